"""People of an organization: adding a login, its role, a fresh password, deactivating it.

The operator acts on every organization, an organization admin on its own. Nobody changes their
own role, activity or password here (a person changes their own password after signing in, with
the current one: `synapse_web.urls`' password change page), so an admin cannot lock themselves
out and an organization keeps the admin who acted. A new or reset password is returned once and
stored only as a hash; every change is audited.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from importlib import import_module

from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from federation import login_throttle
from federation.errors import Conflict, InvalidRequest, NotAllowed, NotFound
from federation.models import AuditLog, Membership, Organization, UserToken
from federation.services import (
    Actor,
    admin_right_holds,
    audit,
    membership_of,
    require_admin_now,
    require_operator,
    visible_organization_ids,
)


@dataclass(frozen=True)
class IssuedPassword:
    membership: Membership
    password: str  # shown once; only its hash is stored
    tokens_revoked: int = 0  # the person's personal API tokens a reset stopped


def people(user, organization: Organization | None = None):
    """The memberships `user` may see (the operator: every organization's), with their users."""
    queryset = Membership.objects.select_related("user", "organization").order_by(
        "organization__name", "user__username"
    )
    visible = visible_organization_ids(user)
    if visible is not None:
        queryset = queryset.filter(organization_id__in=visible)
    if organization is not None:
        queryset = queryset.filter(organization=organization)
    return queryset


def _new_password() -> str:
    return secrets.token_urlsafe(12)


def _require_admin(actor: Actor, organization: Organization, what: str) -> None:
    """Checked under a lock of the actor's membership row, as _locked does (services.
    require_admin_now): an admin demoted or deactivated a moment ago may no longer act."""
    require_admin_now(
        actor, organization.pk, f"only an admin of this organization (or the operator) may {what}"
    )


def _role(role: str) -> str:
    if role not in Membership.Role.values:
        raise InvalidRequest(f"role must be one of {', '.join(Membership.Role.values)}")
    return role


def _locked(actor: Actor, membership: Membership | int, what: str) -> Membership:
    """The target's membership, locked together with the acting admin's own (in one statement,
    in id order, so that two admins acting on each other wait for one another instead of
    deadlocking); then the actor's right is checked on what the database holds now
    (services.admin_right_holds, as for every admin action): an admin deactivated or demoted a
    moment ago by another admin may no longer act."""
    pk = membership.pk if isinstance(membership, Membership) else membership
    own = None
    if not actor.is_operator:
        own = Membership.objects.filter(user_id=actor.user.pk).values_list("pk", flat=True).first()
    rows = {
        m.pk: m
        for m in Membership.objects.select_for_update(of=("self",))
        .select_related("user", "organization")
        .filter(pk__in=[pk] + ([own] if own else []))
        .order_by("pk")
    }
    if pk not in rows:
        raise NotFound("no such person")
    target = rows[pk]
    if not admin_right_holds(actor, rows.get(own), target.organization_id):
        raise NotAllowed(f"only an admin of this organization (or the operator) may {what}")
    return target


def _not_self(actor: Actor, membership: Membership, what: str) -> None:
    if actor.user is not None and actor.user.pk == membership.user_id:
        raise NotAllowed(
            f"you cannot {what} yourself; another admin of the organization or the operator can"
        )


def _not_operator_login(actor: Actor, membership: Membership, what: str) -> None:
    """A superuser's or staff login (one may also belong to an organization) is the operator's
    to manage: an organization admin who could reset its password would become the operator."""
    user = membership.user
    if (user.is_superuser or user.is_staff) and not actor.is_operator:
        raise NotAllowed(
            f"{user.get_username()} is the federation operator's or a staff login: only the "
            f"operator may {what} it"
        )


def _details(membership: Membership, **extra) -> dict:
    return {"user": membership.user.get_username(), "role": membership.role, **extra}


@transaction.atomic
def add_person(
    actor: Actor, organization: Organization, username: str, role: str, email: str = ""
) -> IssuedPassword:
    """A new login in `organization` with a generated password (returned once)."""
    _require_admin(actor, organization, "add people")
    user_model = get_user_model()
    # As create_user will store it (NFKC: "ｂob" is "bob"), so that the checks below see that name.
    username = user_model.normalize_username(username.strip())
    email = email.strip()
    limit = user_model._meta.get_field(user_model.USERNAME_FIELD).max_length
    if not username:
        raise InvalidRequest("a person needs a username")
    if len(username) > limit:
        raise InvalidRequest(f"a username is at most {limit} characters")
    try:
        user_model.username_validator(username)
    except ValidationError as exc:
        raise InvalidRequest(f"username {username!r}: {' '.join(exc.messages)}") from None
    email_limit = user_model._meta.get_field("email").max_length
    if len(email) > email_limit:
        raise InvalidRequest(f"an e-mail address is at most {email_limit} characters, not {len(email)}")
    if email:
        try:
            validate_email(email)
        except ValidationError:
            raise InvalidRequest(f"{email!r} is not an e-mail address") from None
    _role(role)
    # Two adds of `Bob` and `bob` at once: the second waits for the first's commit, then sees it
    # (the table's unique index is case-sensitive; this lock is held to the transaction's end).
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(lower(%s)))", [username])
    if user_model.objects.filter(username__iexact=username).exists():
        raise Conflict(f"a login named {username!r} exists; choose another username")
    password = _new_password()
    try:
        with transaction.atomic():
            user = user_model.objects.create_user(username=username, email=email, password=password)
    except IntegrityError as exc:  # a concurrent add of the same name
        raise Conflict(f"a login named {username!r} exists; choose another username") from exc
    membership = Membership.objects.create(user=user, organization=organization, role=role)
    audit(
        actor,
        AuditLog.Action.PERSON_ADD,
        target=membership,
        organization=organization,
        details=_details(membership, email=email),
    )
    return IssuedPassword(membership, password)


@transaction.atomic
def set_role(actor: Actor, membership: Membership | int, role: str) -> Membership:
    membership = _locked(actor, membership, "change roles")
    _not_self(actor, membership, "change the role of")
    _not_operator_login(actor, membership, "change the role of")
    previous = membership.role
    if _role(role) == previous:
        return membership
    membership.role = role
    membership.save(update_fields=["role"])
    audit(
        actor,
        AuditLog.Action.PERSON_ROLE,
        target=membership,
        organization=membership.organization,
        details=_details(membership, previous_role=previous),
    )
    return membership


@transaction.atomic
def reset_password(actor: Actor, membership: Membership | int) -> IssuedPassword:
    """A fresh password (returned once); the old one, the person's open sessions and their
    personal API tokens stop: a reset is how a login thought compromised is taken back, and a
    token issued with the old password would outlive it (the person issues new ones after
    signing in)."""
    membership = _locked(actor, membership, "reset passwords")
    _not_self(actor, membership, "reset the password of")
    _not_operator_login(actor, membership, "reset the password of")
    password = _new_password()
    user = membership.user
    # Changing the hash also ends the person's sessions: each session carries a hash of it.
    user.set_password(password)
    user.save(update_fields=["password"])
    # ... and the new password works at once, even if someone locked the account by guessing.
    login_throttle.unlock(user.get_username())
    revoked = _revoke_tokens(user)
    audit(
        actor,
        AuditLog.Action.PERSON_PASSWORD_RESET,
        target=membership,
        organization=membership.organization,
        details=_details(membership, tokens_revoked=revoked),
    )
    return IssuedPassword(membership, password, revoked)


@transaction.atomic
def set_active(actor: Actor, membership: Membership | int, active: bool) -> Membership:
    """Deactivate (sign-in, sessions and personal API tokens stop at once, for good: a
    reactivation brings back neither) or reactivate."""
    verb = "reactivate" if active else "deactivate"
    membership = _locked(actor, membership, f"{verb} people")
    _not_self(actor, membership, verb)
    _not_operator_login(actor, membership, verb)
    user = membership.user
    if user.is_active == active:
        return membership
    if active and not actor.is_operator and _deactivated_by_operator(membership):
        # The operator's decision (a compromised login, a person who left) stands until the
        # operator reverses it.
        raise NotAllowed(
            f"the federation operator deactivated {user.get_username()}: only the operator may "
            "reactivate this login"
        )
    user.is_active = active
    user.save(update_fields=["is_active"])
    stopped = {}
    if not active:
        stopped = {"tokens_revoked": _revoke_tokens(user), "sessions_ended": _end_sessions(user)}
    audit(
        actor,
        AuditLog.Action.PERSON_REACTIVATE if active else AuditLog.Action.PERSON_DEACTIVATE,
        target=membership,
        organization=membership.organization,
        details=_details(membership, **stopped),
    )
    return membership


def _revoke_tokens(user) -> int:
    """Stop every live personal API token of `user` at once; how many there were."""
    return UserToken.objects.filter(user=user, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def _end_sessions(user) -> int:
    """End every open session of `user` (how many there were), on a deactivation: an inactive
    login's sessions are refused, but they would be accepted again on its reactivation (a session
    holds the login's id and a hash of its password, which a deactivation leaves as it was), as a
    revoked token would if deactivating only suspended it. Sessions name their login only inside
    their encoded data, so each live one is read: a deactivation is rare, sessions few."""
    store = import_module(settings.SESSION_ENGINE).SessionStore
    if not hasattr(store, "get_model_class"):  # not kept in the database: nothing to look through
        return 0
    ended = 0
    live = store.get_model_class().objects.filter(expire_date__gt=timezone.now())
    for session in live.iterator():
        if session.get_decoded().get(SESSION_KEY) == str(user.pk):
            store(session.session_key).delete()  # the cache's copy too (cached_db)
            ended += 1
    return ended


def _deactivated_by_operator(membership: Membership) -> bool:
    """Whether the latest deactivation of this person was the operator's (a superuser or the
    system), from the audit log."""
    last = (
        AuditLog.objects.filter(
            action=AuditLog.Action.PERSON_DEACTIVATE,
            target_type=Membership._meta.model_name,
            target_id=str(membership.pk),
        )
        .select_related("actor")
        .order_by("-created_at", "-id")
        .first()
    )
    return last is not None and (last.actor is None or last.actor.is_superuser)


def password_changed(actor: Actor) -> int:
    """A person changed their own password (the page has checked the old one): audited, and
    their personal API tokens revoked, as after a reset: a password is changed because it may be
    known to someone else, and a token issued under it (by a stolen session, without the
    password) would outlive it. Returns how many tokens were revoked."""
    membership = membership_of(actor.user)
    revoked = _revoke_tokens(actor.user)
    audit(
        actor,
        AuditLog.Action.PASSWORD_CHANGE,
        target=actor.user,
        target_type="user",
        target_label=actor.name,
        organization=membership.organization if membership else None,
        details={"tokens_revoked": revoked},
    )
    return revoked


# --- logins changed in the Django admin ---------------------------------------------------------
# The operator's tool for what the People pages do not cover (a second operator or staff login, a
# login in no organization, names and e-mail addresses). Its changes are audited here, with what
# changed; a deactivation there is recorded as one here is, so that it stands as the operator's.

VIA_DJANGO_ADMIN = "django admin"
USER_FIELDS = (
    "username", "first_name", "last_name", "email", "is_active", "is_staff", "is_superuser",
    "last_login", "date_joined",
)


def login_snapshot(user) -> dict:
    """What the Django admin can change about a login, as the audit log shows it (never the
    password: only whether one is usable)."""
    snapshot = {}
    for field in USER_FIELDS:
        value = getattr(user, field, None)
        if isinstance(value, dt.datetime):
            # As the admin's form gives it back (to the second, in TIME_ZONE): the same instant.
            value = value.astimezone(dt.UTC).replace(microsecond=0).isoformat()
        snapshot[field] = value
    snapshot["usable_password"] = user.has_usable_password()
    if user.pk is not None:
        snapshot["groups"] = sorted(user.groups.values_list("name", flat=True))
        snapshot["user_permissions"] = sorted(
            f"{app}.{codename}"
            for app, codename in user.user_permissions.values_list(
                "content_type__app_label", "codename"
            )
        )
    return snapshot


def _membership_of_login(user) -> Membership | None:
    return Membership.objects.select_related("organization").filter(user_id=user.pk).first()


def _audit_login(actor: Actor, action: str, user, membership: Membership | None, **details) -> None:
    """One audit entry about a login changed in the Django admin, under its organization if it
    has one; `details` after the login's name and where it was changed."""
    audit(
        actor,
        action,
        target=user,
        target_type="user",
        target_label=user.get_username(),
        organization=membership.organization if membership else None,
        details={"user": user.get_username(), "via": VIA_DJANGO_ADMIN, **details},
    )


def admin_login_saved(actor: Actor, user, before: dict | None) -> None:
    """Audit a login added (`before` None) or changed in the Django admin: `user.add` or
    `user.change` with each changed field's from / to; a change of is_active is recorded (and
    acts) as on the People pages: person.deactivate (personal API tokens revoked) or
    person.reactivate."""
    after = login_snapshot(user)
    membership = _membership_of_login(user)
    organization = membership.organization if membership else None
    username = user.get_username()
    if before is None:
        _audit_login(actor, AuditLog.Action.USER_ADD, user, membership, login=after)
        return
    changes = {
        key: {"from": before.get(key), "to": value}
        for key, value in after.items()
        if before.get(key) != value
    }
    active = changes.pop("is_active", None)
    if active is not None:
        details = {"user": username, "via": VIA_DJANGO_ADMIN}
        if membership is not None:
            details["role"] = membership.role
        if not user.is_active:
            details["tokens_revoked"] = _revoke_tokens(user)
            details["sessions_ended"] = _end_sessions(user)
        audit(
            actor,
            AuditLog.Action.PERSON_REACTIVATE if user.is_active else AuditLog.Action.PERSON_DEACTIVATE,
            target=membership if membership is not None else user,
            target_type="" if membership is not None else "user",
            target_label="" if membership is not None else username,
            organization=organization,
            details=details,
        )
    if changes:
        _audit_login(actor, AuditLog.Action.USER_CHANGE, user, membership, changes=changes)


def admin_password_set(actor: Actor, user) -> None:
    """Audit a password set (or password sign-in disabled) in the Django admin; never the
    password. As after a reset (the way a login thought compromised is taken back), the login's
    personal API tokens are revoked and its failed sign-ins forgotten."""
    membership = _membership_of_login(user)
    revoked = _revoke_tokens(user)
    login_throttle.unlock(user.get_username())
    _audit_login(actor, AuditLog.Action.USER_PASSWORD, user, membership,
                 usable_password=user.has_usable_password(), tokens_revoked=revoked)


def admin_login_deleted(actor: Actor, user) -> None:
    """Audit a login about to be deleted in the Django admin (with its membership)."""
    membership = _membership_of_login(user)
    role = {"role": membership.role} if membership is not None else {}
    _audit_login(actor, AuditLog.Action.USER_DELETE, user, membership, **role)


@transaction.atomic
def unlock_sign_in(actor: Actor, username: str | None, address: str | None) -> int:
    """Clear the failed sign-in counts of a username and/or a client address (the operator's way
    back for a locked-out account, theirs too); audited as login.unlock with how many counters it
    cleared. Returns that number."""
    require_operator(actor, "unlock sign-in")
    removed = login_throttle.unlock(username, address)
    # Under the account's organization, as its lock (login.throttled) is: its admins see it lifted.
    user = login_throttle.account(username) if username else None
    membership = membership_of(user) if user is not None else None
    audit(
        actor,
        AuditLog.Action.LOGIN_UNLOCK,
        target=user,
        target_type="user" if username else "address",
        target_label=username or address,
        organization=membership.organization if membership else None,
        details={"username": username, "address": address, "counters_cleared": removed},
    )
    return removed
