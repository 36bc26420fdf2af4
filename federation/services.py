"""Business logic of the federation: operators, organizations, clients and rounds."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@transaction.atomic
def reset_operator(username: str = "operator", email: str = "operator@example.org") -> Credentials:
    """Create the federation operator (a superuser) or give it a fresh password; the password is
    returned once and stored only as a hash."""
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(username=username, defaults={"email": email})
    password = secrets.token_urlsafe(12)
    user.is_staff = True
    user.is_superuser = True
    user.is_active = True
    user.set_password(password)
    user.save()
    return Credentials(username, password)


def visible_organizations(user):
    """The organizations whose data `user` may see: the single place every page scopes by.

    The federation operator (a superuser) sees every organization; anyone else sees none for now,
    because organization membership does not exist yet. Issue 3 (enrollment) extends exactly this
    function with its membership model, e.g. ``Organization.objects.filter(memberships__user=user)``;
    every dashboard page, mixin and decorator goes through here, so nothing else changes then.
    Returns a queryset of `Organization`.
    """
    from federation.models import Organization

    if user is None or not user.is_authenticated or not user.is_active:
        return Organization.objects.none()
    if user.is_superuser:
        return Organization.objects.all()
    return Organization.objects.none()
