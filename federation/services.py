"""Business logic of the federation: roles, organizations, client enrollment and tokens, the
federation's settings, rounds and their state machine. Every change of state is audited.

Views and commands call these functions with an `Actor` (who, from where); the functions check
what that actor may do and raise `federation.errors` exceptions otherwise.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import math
import re
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import F, Q, QuerySet, Sum
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.text import slugify

from compendium.models import CompendiumVersion, NumericField
from compendium.services import seed_default_numeric_fields
from compendium.validation import forbidden_character, invisible_character, name_key
from federation import accounting, ratelimit
from federation.errors import (
    BudgetExceeded,
    Busy,
    Conflict,
    InvalidRequest,
    InvalidTransition,
    NoOpenRound,
    NotAllowed,
    NotFound,
    RateLimited,
)
from federation.models import (
    AuditLog,
    Client,
    ClientToken,
    FederationSettings,
    Membership,
    MergeRecord,
    Organization,
    Round,
    SimulationRun,
    UserToken,
)
from federation.round_config import RoundConfig
from federation.signals import round_closed
from synapse_web.prepared import prepared_cursor

log = logging.getLogger(__name__)

TOKEN_PREFIX_CLIENT = "syn_c_"
TOKEN_PREFIX_USER = "syn_u_"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str  # "" when none was issued: `withheld` says why
    withheld: str = ""


# --- who is acting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Actor:
    """Who performs an operation and from where. `user` is None for the system (the pipeline,
    management commands)."""

    user: Any = None
    ip: str | None = None
    label: str = ""

    @classmethod
    def system(cls, label: str = "system") -> Actor:
        return cls(None, None, label)

    @classmethod
    def for_user(cls, user, ip: str | None = None) -> Actor:
        return cls(user, ip, user.get_username())

    @property
    def name(self) -> str:
        return self.label or (self.user.get_username() if self.user is not None else "system")

    @property
    def is_operator(self) -> bool:
        # The system (commands, the pipeline) acts with the operator's authority.
        return self.user is None or bool(self.user.is_superuser)


FAILURE_FOR_THE_OPERATOR = "the merge failed; the federation operator sees why and may retry it"


def failure_reason_for(user, rnd: Round) -> str:
    """A failed round's reason as `user` may read it. The pipeline's reasons carry an exception's
    text (a database error's detail, a validation error quoting a submitted text) from any
    organization's merge: in full for the operator only (as in the round.fail audit entry);
    everyone else reads that it failed and who can act on it."""
    if not rnd.failure_reason:
        return ""
    if getattr(user, "is_superuser", False):
        return rnd.failure_reason
    return FAILURE_FOR_THE_OPERATOR


def client_ip(request) -> str | None:
    """The address a request came from, as audited and as the sign-in throttle counts it: the
    connection's peer (REMOTE_ADDR); with SYNAPSE_BEHIND_PROXY, the last address of
    X-Forwarded-For, the one the proxy in front appended (earlier ones the client can forge), so
    that every visitor does not share the proxy's address. Not an IP address: the peer's."""
    if request is None:
        return None
    peer = request.META.get("REMOTE_ADDR") or None
    if settings.SYNAPSE_BEHIND_PROXY:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")[-1].strip()
        # Some proxies (Azure Application Gateway) append the client's port too:
        # "203.0.113.5:4711", "[2001:db8::7]:443". Read as no address, every visitor counted as
        # the proxy, and 50 failed sign-ins from anyone locked everyone out.
        with_port = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::\d{1,5})?|(\d{1,3}(?:\.\d{1,3}){3}):\d{1,5}",
                                 forwarded)
        if with_port:
            forwarded = with_port.group(1) or with_port.group(2)
        try:
            address = ipaddress.ip_address(forwarded)
        except ValueError:
            address = None
        # An IPv6 zone ("fe80::1%eth0") names a link of the proxy's host, not a visitor, and
        # neither PostgreSQL's inet nor the throttle's key takes one of any length.
        if address is not None and not getattr(address, "scope_id", None):
            return str(address)
    return peer


def membership_of(user) -> Membership | None:
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        return user.membership
    except Membership.DoesNotExist:
        return None


def visible_organization_ids(user) -> list[int] | None:
    """None: every organization (the operator); otherwise the ids the user may see."""
    if user is not None and user.is_superuser:
        return None
    membership = membership_of(user)
    return [membership.organization_id] if membership else []


def figure_scope(user) -> list[int] | None:
    """The organizations whose submission figures `user` may see (None: all): a client its own
    organization's, a person the organizations they belong to, the operator every one."""
    client = getattr(user, "client", None)
    if client is not None:
        return [client.organization_id]
    return visible_organization_ids(user)


def visible_organizations(user):
    """The organizations whose data `user` may see, as a queryset: the single place every
    dashboard page scopes by. The operator (a superuser) sees all; a member sees their own."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return Organization.objects.none()
    ids = visible_organization_ids(user)
    return Organization.objects.all() if ids is None else Organization.objects.filter(pk__in=ids)


def can_view(actor: Actor, organization_id: int) -> bool:
    visible = visible_organization_ids(actor.user) if actor.user is not None else None
    return visible is None or organization_id in visible


def can_admin(actor: Actor, organization_id: int) -> bool:
    if actor.is_operator:
        return True
    membership = membership_of(actor.user)
    return (
        membership is not None
        and membership.organization_id == organization_id
        and membership.role == Membership.Role.ADMIN
    )


def admin_right_holds(actor: Actor, mine: Membership | None, organization_id: int) -> bool:
    """Whether `actor` may administer `organization_id`, judged on `mine`, the actor's membership
    as locked by the calling transaction (select_for_update): an admin of that organization whose
    login is active now. The login's activity is read after the lock, so a deactivation that
    held the row (people.set_active locks it) is seen once committed. The operator always may."""
    if actor.is_operator:
        return True
    return (
        mine is not None
        and mine.user_id == actor.user.pk
        and mine.organization_id == organization_id
        and mine.role == Membership.Role.ADMIN
        and get_user_model().objects.filter(pk=mine.user_id, is_active=True).exists()
    )


def lock_own_membership(actor: Actor) -> Membership | None:
    """The acting person's membership, locked to the end of the calling transaction (None for the
    operator or a login in no organization): a demotion or deactivation of the actor by another
    admin waits for the action, or the action waits for it and sees it. A client action takes it
    after the client's lock (people._locked takes the target's and the actor's in one statement);
    no action locks an existing client after a membership, so the order cannot deadlock."""
    if actor.is_operator:
        return None
    return Membership.objects.select_for_update().filter(user_id=actor.user.pk).first()


def require_admin_now(actor: Actor, organization_id: int, refusal: str) -> None:
    """Inside an admin action's transaction: refuse (NotAllowed `refusal`) unless the actor is
    the operator or, as the database holds it under a lock of their membership row, an active
    admin of `organization_id`. can_admin answers from the actor as authenticated (what a page
    offers); an admin demoted or deactivated by another while their request was in flight must
    not still act. people._locked locks the actor's row with its target's and judges it the same
    way (admin_right_holds)."""
    if actor.is_operator:
        return
    if not admin_right_holds(actor, lock_own_membership(actor), organization_id):
        raise NotAllowed(refusal)


def require_operator(actor: Actor, what: str) -> None:
    if not actor.is_operator:
        raise NotAllowed(f"only the federation operator may {what}")


def audit(
    actor: Actor,
    action: str,
    *,
    target=None,
    target_type: str = "",
    target_label: str = "",
    organization: Organization | None = None,
    details: dict | None = None,
) -> AuditLog:
    if target is not None:
        target_type = target_type or target._meta.model_name
        target_label = target_label or str(target)
    return AuditLog.objects.create(
        actor=actor.user,
        actor_label=actor.name,
        action=action,
        organization=organization,
        target_type=target_type,
        target_id=str(target.pk) if target is not None else "",
        target_label=target_label[:300],
        ip=actor.ip,
        details=details or {},
    )


# Audit details for an organization's admins and the operator only: a read-only member sees its
# colleagues and their roles, not their e-mail addresses or sign-in times (as in the people list
# and API), nor whom to reach about a client (its contact, an enrollment's detail, as in the
# client list), at whatever depth an entry holds them (a login changed in the Django admin keeps
# its fields under `changes` and `login`).
ADMIN_ONLY_AUDIT_DETAILS = frozenset({"email", "last_login", "contact"})


def _plain(value):
    """A value as the audit log's JSON keeps it (numbers, text, flags; anything else as text)."""
    if value is None or isinstance(value, (str, bool, int, float, list, dict)):
        return value
    return str(value)


def audit_schema_edit(actor: Actor, obj, operation: str, fields: dict | None = None) -> AuditLog:
    """Audit a change to the schema in force made in the Django admin: a tool of the registry or
    a declared numeric field (whose range and sensitivity set the Laplace noise) added, changed
    (each changed field from / to) or deleted."""
    details = {"via": "django admin", "operation": operation, "model": obj._meta.verbose_name}
    if fields:
        details["fields"] = {
            name: {key: _plain(value) for key, value in change.items()}
            for name, change in fields.items()
        }
    return audit(actor, AuditLog.Action.SCHEMA_CHANGE, target=obj, details=details)


class ShownAudit(NamedTuple):
    details: dict
    ip: str | None


def audit_entry_for(user, entry: AuditLog) -> ShownAudit:
    """An audit entry's details and address as `user` may read them. An organization's admins and
    the operator read them whole; a read-only member reads no colleague's e-mail address or sign-in
    times in the details (unless the entry is about the member themself) and the address only of
    their own actions, the entry's and the copy a sign-in lock's details hold (a colleague's
    address is personal data as well)."""
    details = entry.details if isinstance(entry.details, dict) else {}
    if can_admin(Actor.for_user(user), entry.organization_id):
        return ShownAudit(details, entry.ip)
    own_action = entry.actor_id is not None and entry.actor_id == user.pk
    shown = details if _about_themself(user, entry) else _without_admin_only(details)
    if not own_action and ({"ip", "address"} & shown.keys()):
        # The entry's address again (a sign-in lock's details name it), or the address a sign-in
        # unlock cleared with the username (the lock's): hidden as it is.
        shown = {key: value for key, value in shown.items() if key not in ("ip", "address")}
    return ShownAudit(shown, entry.ip if own_action else None)


def _about_themself(user, entry: AuditLog) -> bool:
    """Whether `entry` is about `user`'s own login or membership: by what it targets, not by the
    username its details name, which a login deleted or renamed since may have held before."""
    if entry.target_type == "user":
        return entry.target_id == str(user.pk)
    if entry.target_type == Membership._meta.model_name:
        membership = membership_of(user)
        return membership is not None and entry.target_id == str(membership.pk)
    return False


def _without_admin_only(value):
    if isinstance(value, dict):
        return {
            k: _without_admin_only(v) for k, v in value.items() if k not in ADMIN_ONLY_AUDIT_DETAILS
        }
    if isinstance(value, list):
        return [_without_admin_only(v) for v in value]
    return value


MAX_ROUND_NUMBER = 999_999_999  # 9 digits: what a `?round=N` parameter may name


def round_number(raw: str | None) -> int | None:
    """A `?round=N` parameter as a round number (None when absent), for the API and the
    dashboard alike. InvalidRequest unless it is a whole number of at least 1 in ASCII digits
    (str.isdigit also takes "²", which int() refuses) of a round number's length."""
    raw = (raw or "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= MAX_ROUND_NUMBER:
        raise InvalidRequest("round must be a round number")
    return int(raw)


def _period_bound(name: str, raw: str) -> tuple[dict, dt.datetime | None]:
    """The queryset filter of the audit log's `since` or `until` parameter, and the instant the
    period starts (`since`) or ends before (`until`; None past the calendar's last day): a plain
    date (YYYY-MM-DD, as the dashboard takes it) is a whole day, inclusive at both ends; an ISO
    8601 datetime is an instant (`since` inclusive, `until` exclusive; without an offset, in
    TIME_ZONE). Raises InvalidRequest naming the parameter."""
    value = raw.strip()
    try:
        day = dt.date.fromisoformat(value)
    except ValueError:
        pass
    else:
        if name == "until":  # to the next day's start
            bound = None if day == dt.date.max else day + dt.timedelta(days=1)
        else:
            bound = day
        start = None if bound is None else timezone.make_aware(dt.datetime.combine(bound, dt.time.min))
        return {f"created_at__date__{'gte' if name == 'since' else 'lte'}": day}, start
    problem = (
        f"{name} must be a date YYYY-MM-DD or an ISO 8601 datetime (e.g. 2025-01-31T08:00:00Z), "
        f"not {raw[:40]!r}"
    )
    if re.search(r"\d\d:\d\d(:\d\d(\.\d*)?)? \d\d(:?\d\d)?$", value):
        # "…T10:00:00+01:00" sent unencoded: a query string reads the offset's "+" as a space
        problem += " (in a URL, write '+' as %2B)"
    try:
        instant = parse_datetime(value)
        if instant is not None:
            if timezone.is_naive(instant):
                instant = timezone.make_aware(instant)
            instant.astimezone(dt.UTC)  # out of range once in UTC: OverflowError
    except (ValueError, OverflowError):
        raise InvalidRequest(problem) from None
    if instant is None:
        raise InvalidRequest(problem)
    return {f"created_at__{'gte' if name == 'since' else 'lt'}": instant}, instant


def audit_period(since: str = "", until: str = "") -> dict:
    """The queryset filters of the audit log's period (`_period_bound` of each bound given). A
    `since` after `until` (or at it, for an instant `until`, which is exclusive) holds no entry:
    refused, naming both, rather than answering an empty log as if none were there."""
    filters: dict = {}
    bounds = []
    for name, raw in (("since", since), ("until", until)):
        if (raw or "").strip():
            one, bound = _period_bound(name, raw)
            filters.update(one)
            bounds.append(bound)
    if len(bounds) == 2 and None not in bounds and bounds[0] >= bounds[1]:
        raise InvalidRequest(
            f"since ({since.strip()[:40]}) is not before until ({until.strip()[:40]}): no entry "
            "is in that period"
        )
    return filters


def filtered_audit_log(entries: QuerySet, params) -> QuerySet:
    """The audit entries (already scoped to what the caller may see) narrowed by the API's
    filters: action, organization (slug), actor (label), target_type, target_id, round (the
    round an entry is about, its details' round), since, until. Raises
    InvalidRequest naming a malformed filter."""
    action = params.get("action")
    if action:
        if action not in AuditLog.Action.values:
            raise InvalidRequest(f"action must be one of {', '.join(AuditLog.Action.values)}")
        entries = entries.filter(action=action)
    if params.get("organization"):
        entries = entries.filter(organization__slug=params["organization"])
    if params.get("actor"):
        entries = entries.filter(actor_label=params["actor"])
    if params.get("target_type"):
        entries = entries.filter(target_type=params["target_type"])
    if params.get("target_id"):
        entries = entries.filter(target_id=params["target_id"])
    # read as every ?round= is (str.isdigit took "²", which int() refuses: a 500)
    number = round_number(params.get("round"))
    if number is not None:
        entries = entries.filter(details__round=number)
    return entries.filter(**audit_period(params.get("since") or "", params.get("until") or ""))


# --- operator and people ----------------------------------------------------------------------


@transaction.atomic
def reset_operator(
    actor: Actor, username: str = "operator", email: str = "operator@example.org"
) -> Credentials:
    """Create the federation operator (a superuser) or give it a fresh password; the password is
    returned once and stored only as a hash. Audited, never the password: `user.add` for a new
    login, else `user.password` saying whether the login was deactivated or not an operator
    before (the demo needs its operator login, so it is made one again, visibly). Its sessions
    end with the password; its personal API tokens are the operator's own and stay."""
    user_model = get_user_model()
    user, created = user_model.objects.select_for_update().get_or_create(
        username=username, defaults={"email": email}
    )
    before = {"is_active": user.is_active, "is_staff": user.is_staff,
              "is_superuser": user.is_superuser}
    password = secrets.token_urlsafe(12)
    user.is_staff = True
    user.is_superuser = True
    user.is_active = True
    user.set_password(password)
    user.save()
    details = {"user": username, "via": actor.name}
    if created:
        audit(actor, AuditLog.Action.USER_ADD, target=user, target_type="user",
              target_label=username, details=details)
    else:
        changed = {key: {"from": was, "to": True} for key, was in before.items() if not was}
        audit(actor, AuditLog.Action.USER_PASSWORD, target=user, target_type="user",
              target_label=username, details={**details, **({"changes": changed} if changed else {})})
    return Credentials(username, password)


@transaction.atomic
def set_membership(actor: Actor, user, organization: Organization, role: str) -> Membership:
    require_operator(actor, "assign people to organizations")
    if role not in Membership.Role.values:
        raise InvalidRequest(f"role must be one of {', '.join(Membership.Role.values)}")
    membership, _ = Membership.objects.update_or_create(
        user=user, defaults={"organization": organization, "role": role}
    )
    audit(
        actor,
        AuditLog.Action.MEMBERSHIP_SET,
        target=membership,
        organization=organization,
        details={"user": user.get_username(), "role": role},
    )
    return membership


@transaction.atomic
def reset_member(
    actor: Actor, organization: Organization, username: str, role: str
) -> Credentials:
    """Create a person of an organization, or give a fresh password to the one it has under that
    name, through the people service (audited as there: `person.add`, `person.password_reset`,
    which also ends the login's sessions and stops its personal API tokens); the password is
    returned once. A login of that name that is no longer what this made it, an active `role` of
    `organization` (deactivated, demoted, in another organization or in none), is someone's
    decision: it is left as it is, without a password, and `withheld` says why."""
    from federation import people  # it builds on this module

    require_operator(actor, "create logins")
    user_model = get_user_model()
    user = user_model.objects.filter(
        username__iexact=user_model.normalize_username(username.strip())
    ).first()
    if user is None:
        issued = people.add_person(actor, organization, username, role)
        return Credentials(issued.membership.user.get_username(), issued.password)
    username = user.get_username()
    # Locked as people.set_active and set_role lock it, and the login's activity read after the
    # lock: a deactivation committed meanwhile is seen, not overwritten by a reset.
    membership = (
        Membership.objects.select_for_update(of=("self",))
        .select_related("organization")
        .filter(user=user)
        .first()
    )
    if membership is None or membership.organization_id != organization.pk or membership.role != role:
        where = (
            f"a {membership.role} of {membership.organization.slug}" if membership
            else "in no organization"
        )
        return Credentials(
            username, "", f"not {organization.slug}'s {role} (now {where}): left as it is, no "
            "password issued"
        )
    if not user_model.objects.filter(pk=user.pk, is_active=True).exists():
        return Credentials(
            username, "", "deactivated: left so, no password issued (reactivated on its "
            "organization's page, it gets one at the next start)"
        )
    return Credentials(username, people.reset_password(actor, membership).password)


def _new_secret(prefix: str) -> tuple[str, str]:
    token = prefix + secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


TOKEN_LABEL_MAX = 100


@transaction.atomic
def issue_user_token(actor: Actor, user, label: str = "") -> str:
    """A new API token for a person; returned once, stored as a hash; audited (never the token,
    only its first characters)."""
    if actor.user is not None and actor.user.pk != user.pk:
        require_operator(actor, "issue tokens for other people")
    # Read under a lock of the login's row, not from `user` (a request's, authenticated before a
    # deactivation that committed since): a token of a deactivated login would answer 401 while
    # the login is off, then start working on a reactivation, which is meant to find every token
    # of the login stopped. A deactivation in flight waits for this token and revokes it.
    if not get_user_model().objects.select_for_update().filter(pk=user.pk, is_active=True).exists():
        raise InvalidRequest(
            f"{user.get_username()} is deactivated: reactivate the login first, then issue it a token"
        )
    label = " ".join(str(label or "").split())
    if len(label) > TOKEN_LABEL_MAX:
        raise InvalidRequest(f"a token's label is at most {TOKEN_LABEL_MAX} characters")
    if bad := name_problem(label):  # shown in the audit log: as a name, it must read as stored
        raise InvalidRequest(f"a token's label contains {bad}; remove it")
    token, digest = _new_secret(TOKEN_PREFIX_USER)
    row = UserToken.objects.create(user=user, token_hash=digest, prefix=token[:12], label=label)
    _audit_token(actor, AuditLog.Action.TOKEN_ISSUE, row)
    return token


def user_tokens(user):
    """A person's API tokens, newest first (revoked ones too: when they stopped)."""
    return UserToken.objects.filter(user=user).order_by("-created_at", "-id")


@transaction.atomic
def revoke_user_token(actor: Actor, token_id: int) -> UserToken:
    """A person revokes one of their own API tokens (it stops at once); someone else's, or one
    that does not exist, is not found."""
    row = (
        UserToken.objects.select_for_update()
        .filter(pk=token_id, user_id=getattr(actor.user, "pk", None))
        .first()
    )
    if row is None:
        raise NotFound("no such token of yours")
    if row.revoked_at is None:
        row.revoked_at = timezone.now()
        row.save(update_fields=["revoked_at"])
        _audit_token(actor, AuditLog.Action.TOKEN_REVOKE, row)
    return row


def _audit_token(actor: Actor, action: str, row: UserToken) -> None:
    membership = membership_of(row.user)
    audit(
        actor,
        action,
        target=row.user,
        target_type="user",
        target_label=row.user.get_username(),
        organization=membership.organization if membership else None,
        details={"user": row.user.get_username(), "token_prefix": row.prefix, "label": row.label},
    )


@transaction.atomic
def issue_routing_token(actor: Actor, name: str) -> str:
    """A new routing-API token named `name` (an application's); returned once, stored as a hash;
    audited as token.issue (its name, never the token)."""
    from routing.models import RoutingToken

    require_operator(actor, "issue routing tokens")
    if not name.strip():
        # `routing_token "$NAME"` with NAME unset: a token nobody could tell from another
        raise InvalidRequest("a routing token needs a name (it is how the token is revoked)")
    if name != name.strip():
        # " my-app" reads as my-app in the audit log, and `--revoke my-app` found no such token
        raise InvalidRequest(
            f"a routing token's name cannot start or end with a space: {name!r} (it is how the "
            "token is revoked)"
        )
    limit = RoutingToken._meta.get_field("name").max_length
    if len(name) > limit:
        raise InvalidRequest(f"a routing token's name is at most {limit} characters, not {len(name)}")
    if bad := name_problem(name):  # how it is revoked and audited: it must read as stored
        raise InvalidRequest(f"a routing token's name contains {bad}; remove it")
    row = RoutingToken.objects.select_for_update().filter(name=name).first()
    if row is not None and not row.revoked:
        raise Conflict(f"a routing token named {name!r} exists; revoke it first to replace it, or pick another name")
    if row is None:
        try:
            with transaction.atomic():  # a savepoint: the other's row stays, this one is refused
                row, raw = RoutingToken.issue(name)
        except IntegrityError:
            # Issued under this name by another command between the lookup and the insert (no
            # row to lock yet): an IntegrityError traceback before.
            raise Conflict(
                f"a routing token named {name!r} was issued meanwhile; revoke it first to "
                "replace it, or pick another name"
            ) from None
    else:
        # A revoked name is issued again (an application's leaked token replaced): the same row,
        # so its audit entries stay together, with a new secret; the old one stays refused.
        raw = row.reissue()
    audit(actor, AuditLog.Action.TOKEN_ISSUE, target=row, target_label=name,
          details={"routing_token": name})
    return raw


@transaction.atomic
def revoke_routing_token(actor: Actor, name: str) -> None:
    """The routing token named `name` stops at once; audited as token.revoke (once: revoking a
    revoked token again changes and audits nothing)."""
    from routing.models import RoutingToken

    require_operator(actor, "revoke routing tokens")
    row = RoutingToken.objects.select_for_update().filter(name=name).first()
    if row is None:
        raise NotFound(f"no routing token named {name!r}")
    if not row.revoked:
        row.revoked = True
        row.save(update_fields=["revoked"])
        audit(actor, AuditLog.Action.TOKEN_REVOKE, target=row, target_label=name,
              details={"routing_token": name})


def user_for_token(token: str):
    row = (
        UserToken.objects.select_related("user")
        .filter(token_hash=hash_token(token), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    return row.user if row else None


# --- settings ---------------------------------------------------------------------------------

SETTINGS_FIELDS = (
    "epsilon_budget",
    "delta_prime",
    "allow_admin_approval",
    "max_submission_bytes",
    "submissions_per_minute",
    "enrollments_per_hour",
)


def get_settings() -> FederationSettings:
    """The federation's policy row, created on first use with the privacy defaults of the
    deployment's settings (SYNAPSE_EPSILON_BUDGET, SYNAPSE_DELTA_PRIME), so the cap and δ′ do not
    change when the row appears."""
    settings_row, _ = FederationSettings.objects.get_or_create(
        pk=1,
        defaults={
            "epsilon_budget": float(settings.SYNAPSE_EPSILON_BUDGET),
            "delta_prime": float(settings.SYNAPSE_DELTA_PRIME),
        },
    )
    return settings_row


_settings_cache: tuple[float, FederationSettings] | None = None
SETTINGS_TTL_S = 2.0


def cached_settings() -> FederationSettings:
    """The settings for the request hot path: re-read at most every 2 s per process (a change
    made in this process applies at once, in other processes within 2 s)."""
    global _settings_cache
    now = time.monotonic()
    cached = _settings_cache
    if cached is not None and now - cached[0] < SETTINGS_TTL_S:
        return cached[1]
    row = get_settings()
    _settings_cache = (now, row)
    return row


def clear_settings_cache() -> None:
    global _settings_cache
    _settings_cache = None


@transaction.atomic
def update_settings(actor: Actor, **changes) -> FederationSettings:
    require_operator(actor, "change the federation's settings")
    unknown = set(changes) - set(SETTINGS_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown settings: {', '.join(sorted(unknown))}")
    get_settings()
    with waiting_briefly("change the federation's settings"):
        row = FederationSettings.objects.select_for_update().get(pk=1)
    before = {k: getattr(row, k) for k in changes}
    for key, value in changes.items():
        setattr(row, key, value)
    # Each named on its own, with the value given: a bad δ′ is not a bad budget. A number only:
    # true is an int in Python (it was stored as a budget of 1.0), and a string or None was a 500.
    for key, rule, bounds in (
        ("epsilon_budget", "a finite number greater than 0", (0, math.inf)),
        ("delta_prime", "a number between 0 and 1 (exclusive)", (0, 1)),
    ):
        value = getattr(row, key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not bounds[0] < value < bounds[1]:
            raise InvalidRequest(
                f"{key} must be {rule}, not {value:g}" if number
                else f"{key} must be {rule}, not {value!r:.40}"
            )
    # 0 is a policy for the rate limits (no submissions for now: each is a 429 saying so; only
    # the operator enrolls) but not for the size limit, which no compendium could meet.
    # The columns hold PostgreSQL integers (a larger value was a 500), and a new size limit may
    # only lower the server's own cap: a larger one would be shown here but never applied.
    most_integer = connection.ops.integer_field_range("PositiveIntegerField")[1]
    for key, least in (
        ("max_submission_bytes", 1), ("submissions_per_minute", 0), ("enrollments_per_hour", 0)
    ):
        value = getattr(row, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidRequest(f"{key} must be a whole number of at least {least}, not {value!r}")
        if value > most_integer:
            raise InvalidRequest(f"{key} must be at most {most_integer}, not {value}")
        cap = settings.SYNAPSE_MAX_SUBMISSION_BYTES
        if key == "max_submission_bytes" and value > cap and value != before.get(key, value):
            raise InvalidRequest(
                f"max_submission_bytes must be at most the server's cap of {cap} bytes "
                f"(SYNAPSE_MAX_SUBMISSION_BYTES), not {value}: it may only lower that cap"
            )
    if not isinstance(row.allow_admin_approval, bool):
        raise InvalidRequest("allow_admin_approval must be true or false")
    if any(k in changes and changes[k] != before[k] for k in ("epsilon_budget", "delta_prime")):
        # Under the new δ′ (a smaller one loosens the advanced composition, so the committed ε′
        # can pass the cap without the cap moving). Only when one of them changes: a form that
        # sends both as they were, with a rate limit changed, is not a budget change.
        committed = accounting.committed_composition(delta=row.delta_prime)
        if accounting.over_cap(committed.epsilon, row.epsilon_budget):
            raise BudgetExceeded(
                f"epsilon_budget {row.epsilon_budget:g} is below the ε′ the federation has "
                f"committed ({committed.epsilon:.6g} at δ′ = {row.delta_prime:g}: recorded in the "
                f"ledger plus reserved by rounds not released yet)"
            )
    changed = {k: {"from": before[k], "to": changes[k]} for k in changes if before[k] != changes[k]}
    if not changed:
        # Nothing to write: saving would move updated_at with no settings.change entry to show.
        return row
    row.save(update_fields=[*changed, "updated_at"])
    clear_settings_cache()
    transaction.on_commit(clear_settings_cache)
    audit(actor, AuditLog.Action.SETTINGS_CHANGE, target=row, details=changed)
    return row


# --- organizations and clients ----------------------------------------------------------------

# Free texts people give, held to one limit on the dashboard and the API alike.
DESCRIPTION_LIMIT = 2000  # an organization's or a client's description
REASON_LIMIT = 500  # a revocation's reason (kept in the audit log)


def free_text(name: str, value: str, limit: int) -> str:
    """`value` when it is at most `limit` characters and holds no control character (but tab and
    newlines) nor bidi override (forbidden_character: on the dashboard, in the audit log or a
    terminal it would read otherwise than it is stored, as a name or a compendium text would);
    InvalidRequest naming `name` otherwise (cut, it would store something other than given)."""
    if len(value) > limit:
        raise InvalidRequest(f"{name} is at most {limit} characters, not {len(value)}")
    if bad := forbidden_character(value):
        raise InvalidRequest(f"{name} contains {bad}; remove it")
    return value


def name_problem(name: str) -> str | None:
    """What makes `name` unfit for an organization or a client, in words (None when nothing):
    a control character or bidi override makes it read otherwise than it is stored (another
    organization's, to whoever reads the dashboard or the audit log), and an invisible character
    makes a twin of a name that reads the same."""
    return forbidden_character(name) or invisible_character(name)


def _lock_name(scope: str, name: str) -> None:
    """Hold to the transaction's end the lock of a name's key in `scope`: of two creations or
    renames to names with one key at once, the second waits for the first's commit, then sees
    it (the unique index compares names as stored)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"{scope}:{name_key(name)}"])


def _refuse_name_twin(names, name: str, exists) -> None:
    """Conflict when one of `names` has the key of `name` (name_key): `exists(other)` says what
    holds it, and when `name` is not `other` itself, how the two differ: in nothing a reader
    sees."""
    key = name_key(name)
    for other in names:
        if name_key(other) == key:
            how = "" if other == name else (
                f"; {name!r} differs from it only in case, spacing or invisible characters")
            raise Conflict(f"{exists(other)}{how}; choose another name")


def organization_name(name: str) -> str:
    """An organization's name as stored (stripped), for creating and renaming alike; InvalidRequest
    naming what is wrong when it is empty, longer than the column or holds a character it may
    not (name_problem)."""
    name = (name or "").strip()
    limit = Organization._meta.get_field("name").max_length
    if not name:
        raise InvalidRequest("an organization needs a name")
    if len(name) > limit:
        raise InvalidRequest(f"an organization's name is at most {limit} characters, not {len(name)}")
    if bad := name_problem(name):
        raise InvalidRequest(f"an organization's name contains {bad}; remove it")
    return name


def _refuse_twin(name: str, slug: str | None = None, other_than: Organization | None = None) -> None:
    """Conflict when another organization's name has the key of `name` (name_key: the same but
    for case, spacing or invisible characters), or its slug differs from `slug` only in case:
    two organizations would be one to whoever reads or types them ("ORG-A" next to "org-a",
    "Acme Labs" next to "Acme\u00a0Labs"). A slug taken as it is is left to the unique
    constraint, which says it exists. The caller holds _lock_name("organization", name)."""
    others = Organization.objects.exclude(pk=other_than.pk) if other_than else Organization.objects
    slugs = dict(others.values_list("name", "slug").order_by("pk"))
    _refuse_name_twin(slugs, name, lambda other: f"an organization named {other!r} exists"
                      + ("" if other == name else f" (slug {slugs[other]!r})"))
    if slug is not None:
        twin = others.filter(Q(slug__iexact=slug) & ~Q(slug=slug)).first()
        if twin is not None:
            raise Conflict(
                f"the organization {twin.name!r} (slug {twin.slug!r}) has a slug that differs "
                f"from {slug!r} only in case; choose another slug"
            )


@transaction.atomic
def create_organization(
    actor: Actor, name: str, slug: str = "", description: str = ""
) -> Organization:
    require_operator(actor, "create organizations")
    name = organization_name(name)
    free_text("description", description, DESCRIPTION_LIMIT)
    slug_limit = Organization._meta.get_field("slug").max_length
    # A slug derived from a long name is cut to the column's length (a clash is a 409 below).
    slug = slug or slugify(name)[:slug_limit].strip("-")
    if not slug:
        raise InvalidRequest(
            f"the name {name!r} has no Latin letters or digits to make a slug from (the "
            "organization's short name in URLs): give a slug too, of letters, digits, hyphens and "
            "underscores"
        )
    if not re.fullmatch(r"[-a-zA-Z0-9_]+", slug):
        raise InvalidRequest(
            f"slug {slug!r}: use letters, digits, hyphens and underscores only (it is part of URLs)"
        )
    if len(slug) > slug_limit:
        raise InvalidRequest(f"an organization's slug is at most {slug_limit} characters")
    _lock_name("organization", name)
    _refuse_twin(name, slug)
    try:
        with transaction.atomic():
            org = Organization.objects.create(name=name, slug=slug, description=description)
    except IntegrityError as exc:
        raise Conflict(f"an organization named {name!r} or with slug {slug!r} exists") from exc
    audit(actor, AuditLog.Action.ORGANIZATION_CREATE, target=org, organization=org)
    return org


SLUG_STAYS = (
    "the slug {slug!r} cannot change: the organization's dashboard links, the API's "
    "?organization= filters and scripts (erase_client {slug}/CLIENT) name it, and it seeds its "
    "edge's privacy noise, which a replayed round must draw again; only the name can be changed"
)


@transaction.atomic
def rename_organization(
    actor: Actor, organization: Organization | int, name: str, slug: str | None = None
) -> Organization:
    """Give an organization a new display name (the operator's decision, as creating one is).

    Its slug never changes (SLUG_STAYS says why); `slug`, when a caller sends one, must be the
    current one. The row is locked, so that of two renames at once the second waits and its audit
    entry names the first's name as the previous one: none is lost unrecorded."""
    require_operator(actor, "rename organizations")
    pk = organization.pk if isinstance(organization, Organization) else organization
    try:
        org = Organization.objects.select_for_update().get(pk=pk)
    except Organization.DoesNotExist:
        raise NotFound("no such organization") from None
    if slug is not None and slug != org.slug:
        raise InvalidRequest(SLUG_STAYS.format(slug=org.slug))
    name = organization_name(name)
    previous = org.name
    if name == previous:
        return org
    _lock_name("organization", name)
    _refuse_twin(name, other_than=org)
    org.name = name
    try:
        with transaction.atomic():
            org.save(update_fields=["name"])
    except IntegrityError as exc:
        raise Conflict(f"an organization named {name!r} exists; choose another name") from exc
    audit(
        actor,
        AuditLog.Action.ORGANIZATION_RENAME,
        target=org,
        organization=org,
        details={"name": name, "previous_name": previous, "slug": org.slug},
    )
    return org


@dataclass(frozen=True)
class IssuedToken:
    client: Client
    token: str  # shown once; only its hash is stored


@transaction.atomic
def enroll_client(
    actor: Actor, organization: Organization, name: str, description: str = "", contact: str = ""
) -> Client:
    require_admin_now(
        actor, organization.pk, "only an admin of this organization (or the operator) may enroll clients"
    )
    name = name.strip()
    if not name:
        raise InvalidRequest("a client needs a name")
    if bad := name_problem(name):  # as an organization's name (organization_name)
        raise InvalidRequest(f"a client's name contains {bad}; remove it")
    limit = Client._meta.get_field("name").max_length
    if len(name) > limit:
        raise InvalidRequest(f"a client's name is at most {limit} characters, not {len(name)}")
    free_text("contact", contact, Client._meta.get_field("contact").max_length)
    free_text("description", description, DESCRIPTION_LIMIT)
    if not actor.is_operator:
        limit = get_settings().enrollments_per_hour
        decision = ratelimit.hit(f"enroll:org:{organization.pk}", limit, 3600)
        if not decision.allowed:
            raise RateLimited(
                f"enrollment is limited to {limit} clients per organization and hour",
                decision.retry_after,
            )
    # Another client of the organization by a name that reads as this one (name_key): two
    # clients the dashboard, the audit log and erase_client's ORG/CLIENT cannot tell apart.
    _lock_name(f"client:{organization.pk}", name)
    revoked = set(organization.clients.filter(status=Client.Status.REVOKED)
                  .values_list("name", flat=True))
    _refuse_name_twin(
        organization.clients.values_list("name", flat=True).order_by("pk"), name,
        lambda other: f"organization {organization.slug!r} already has a client {other!r}" + (
            " (revoked: a revoked client keeps its name, so that its rounds, audit entries and "
            "erase_client tell it from a new one)" if other in revoked else ""))
    try:
        with transaction.atomic():
            client = Client.objects.create(
                organization=organization, name=name, description=description, contact=contact
            )
    except IntegrityError as exc:
        raise Conflict(f"organization {organization.slug!r} already has a client {name!r}") from exc
    audit(
        actor,
        AuditLog.Action.CLIENT_ENROLL,
        target=client,
        organization=organization,
        details={"name": name, "contact": contact},
    )
    return client


def _locked_client(client: Client | int) -> Client:
    pk = client.pk if isinstance(client, Client) else client
    try:
        return Client.objects.select_for_update().select_related("organization").get(pk=pk)
    except Client.DoesNotExist as exc:
        raise NotFound("no such client") from exc


def _issue_client_token(client: Client) -> str:
    token, digest = _new_secret(TOKEN_PREFIX_CLIENT)
    ClientToken.objects.update_or_create(
        client=client,
        defaults={
            "token_hash": digest,
            "prefix": token[:12],
            "issued_at": timezone.now(),
            "revoked_at": None,
        },
    )
    return token


@transaction.atomic
def approve_client(actor: Actor, client: Client | int) -> IssuedToken:
    client = _locked_client(client)
    require_admin_now(
        actor, client.organization_id,
        "only the operator or this organization's admin may approve clients",
    )
    if not actor.is_operator:
        if not get_settings().allow_admin_approval:
            raise NotAllowed(
                "the federation's policy lets only the operator approve clients "
                "(allow_admin_approval is off)"
            )
    if client.status != Client.Status.PENDING:
        raise InvalidTransition(f"client is {client.status}; only a pending client can be approved")
    client.status = Client.Status.APPROVED
    client.save(update_fields=["status"])
    token = _issue_client_token(client)
    audit(actor, AuditLog.Action.CLIENT_APPROVE, target=client, organization=client.organization)
    return IssuedToken(client, token)


@transaction.atomic
def rotate_client_token(actor: Actor, client: Client | int) -> IssuedToken:
    client = _locked_client(client)
    require_admin_now(
        actor, client.organization_id, "only the operator or this organization's admin may rotate tokens"
    )
    if client.status != Client.Status.APPROVED:
        raise InvalidTransition(f"client is {client.status}; only an approved client has a token")
    token = _issue_client_token(client)
    audit(actor, AuditLog.Action.CLIENT_ROTATE, target=client, organization=client.organization)
    return IssuedToken(client, token)


@transaction.atomic
def revoke_client(actor: Actor, client: Client | int, reason: str = "") -> Client:
    client = _locked_client(client)
    require_admin_now(
        actor, client.organization_id, "only the operator or this organization's admin may revoke clients"
    )
    free_text("reason", reason, REASON_LIMIT)
    if client.status == Client.Status.REVOKED:
        raise InvalidTransition("client is already revoked")
    previous = client.status
    client.status = Client.Status.REVOKED
    client.save(update_fields=["status"])
    ClientToken.objects.filter(client=client).update(revoked_at=timezone.now())
    audit(
        actor,
        AuditLog.Action.CLIENT_REVOKE,
        target=client,
        organization=client.organization,
        details={"previous_status": previous, "reason": reason},
    )
    return client


class TokenRejected(Exception):
    def __init__(self, detail: str, status_code: int):
        super().__init__(detail)
        self.detail = detail
        self.status_code = status_code


def _loadable_columns(model, alias: str) -> tuple[list[str], str]:
    """A model's concrete fields and their columns, for building instances with `from_db` from a
    plain SQL row (only for fields that need no conversion from the database's value)."""
    fields = model._meta.concrete_fields
    converted = [f.name for f in fields if hasattr(f, "from_db_value")]
    if converted:
        raise NotImplementedError(f"{model.__name__} fields need conversion: {converted}")
    return [f.attname for f in fields], ", ".join(f'{alias}."{f.column}"' for f in fields)


_CLIENT_FIELDS, _CLIENT_COLUMNS = _loadable_columns(Client, "c")
_ORGANIZATION_FIELDS, _ORGANIZATION_COLUMNS = _loadable_columns(Organization, "o")
_CLIENT_FOR_TOKEN_SQL = (
    f"SELECT t.revoked_at, {_CLIENT_COLUMNS}, {_ORGANIZATION_COLUMNS} "
    f"FROM {ClientToken._meta.db_table} t "
    f"JOIN {Client._meta.db_table} c ON c.id = t.client_id "
    f"JOIN {Organization._meta.db_table} o ON o.id = c.organization_id "
    "WHERE t.token_hash = %s"
)


def client_for_token(token: str) -> Client:
    """The approved client holding this token (one index lookup), else TokenRejected (401 for
    an unknown token, 403 for a revoked or unapproved client).

    Every client request runs this: it is plain SQL, prepared on the server (building the ORM's
    query with its joins cost several times the CPU of running it), the client comes with its
    organization."""
    with prepared_cursor() as cursor:
        cursor.execute(_CLIENT_FOR_TOKEN_SQL, [hash_token(token)])
        row = cursor.fetchone()
    if row is None:
        raise TokenRejected(
            "invalid client token: unknown, or replaced by a rotation (the old token stops at "
            "once; the new one comes from your organization's admin or the operator)",
            401,
        )
    revoked_at, values = row[0], row[1:]
    split = len(_CLIENT_FIELDS)
    client = Client.from_db(connection.alias, _CLIENT_FIELDS, values[:split])
    client.organization = Organization.from_db(
        connection.alias, _ORGANIZATION_FIELDS, values[split:]
    )
    if revoked_at is not None or client.status == Client.Status.REVOKED:
        raise TokenRejected("this client has been revoked", 403)
    if client.status != Client.Status.APPROVED:
        raise TokenRejected("this client is not approved", 403)
    return client


# --- rounds -----------------------------------------------------------------------------------

_TRANSITIONS = {
    Round.State.OPEN: {Round.State.CLOSING},
    Round.State.CLOSING: {Round.State.MERGING, Round.State.FAILED},
    Round.State.MERGING: {Round.State.PUBLISHED, Round.State.FAILED},
    Round.State.FAILED: {Round.State.CLOSING},
    Round.State.PUBLISHED: set(),
}


def _refuse_over_budget(budget: float, extra: float, what: str) -> None:
    """BudgetExceeded when the committed ε′ plus a round spending `extra` exceeds `budget`."""
    refusal = accounting.budget_refusal(extra, what, budget)
    if refusal:
        raise BudgetExceeded(refusal)


def current_round() -> Round | None:
    return Round.objects.filter(state=Round.State.OPEN).first()


def _future_deadline(closes_at: dt.datetime | None) -> dt.datetime | None:
    if closes_at is None:
        return None
    if timezone.is_naive(closes_at):
        raise InvalidRequest("closes_at needs a time zone (e.g. 2026-12-01T12:00:00Z)")
    try:
        # Stored and read back in UTC: a time past 9999-12-31 there could be written but never
        # read again (every page listing rounds would fail).
        closes_at = closes_at.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidRequest(
            f"closes_at {closes_at.isoformat()} is past 9999-12-31 in UTC; choose an earlier time"
        ) from None
    if closes_at <= timezone.now():
        raise InvalidRequest(
            f"closes_at {closes_at.isoformat()} has passed; a deadline must lie in the future"
        )
    return closes_at


@transaction.atomic
def open_round(
    actor: Actor, config: RoundConfig | dict | None = None, closes_at: dt.datetime | None = None
) -> Round:
    """Open the next round with its replayable configuration; one open round at a time.
    `closes_at`: the round's deadline (in the future), when `close_due_rounds` closes it."""
    require_operator(actor, "open rounds")
    if not isinstance(config, RoundConfig):
        config = RoundConfig(**(config or {}))
    closes_at = _future_deadline(closes_at)
    settings_pk = get_settings().pk
    with waiting_briefly("open a round"):
        settings_row = FederationSettings.objects.select_for_update().get(pk=settings_pk)
    # One read: a close committing between two would leave nothing to name (a 500).
    still_open = Round.objects.filter(state=Round.State.OPEN).values_list("number", flat=True).first()
    if still_open is not None:
        raise Conflict(f"round {still_open} is still open; close it first")
    # the fields its merges will never release, fixed now: they cost no ε
    not_released = accounting.fields_not_released(config)
    _refuse_over_budget(
        settings_row.epsilon_budget,
        accounting.projected_round_spend(config, not_released=not_released),
        f"opening a round at ε = {config.epsilon:g}",
    )
    last = Round.objects.order_by("-number").values_list("number", flat=True).first() or 0
    try:
        with transaction.atomic():
            rnd = Round.objects.create(
                number=last + 1, config=config.model_dump(mode="json"), closes_at=closes_at,
                fields_not_released=not_released,
            )
    except IntegrityError as exc:
        raise Conflict("another round was opened at the same time") from exc
    details = {"config": rnd.config}
    if rnd.fields_not_released:
        details["fields_not_released"] = rnd.fields_not_released
    if closes_at is not None:
        details["closes_at"] = closes_at.isoformat()
    audit(actor, AuditLog.Action.ROUND_OPEN, target=rnd, details=details)
    return rnd


@transaction.atomic
def set_round_deadline(actor: Actor, rnd: Round | int, closes_at: dt.datetime | None) -> Round:
    """Set, move or (None) remove the open round's deadline."""
    require_operator(actor, "set round deadlines")
    rnd = _locked_round(rnd)
    if rnd.state != Round.State.OPEN:
        raise InvalidTransition(f"round {rnd.number} is {rnd.state}; only an open round has a deadline")
    closes_at = _future_deadline(closes_at)
    previous = rnd.closes_at
    if previous == closes_at:
        return rnd
    rnd.closes_at = closes_at
    rnd.save(update_fields=["closes_at"])
    audit(
        actor,
        AuditLog.Action.ROUND_DEADLINE,
        target=rnd,
        details={
            "closes_at": closes_at.isoformat() if closes_at else None,
            "previous": previous.isoformat() if previous else None,
        },
    )
    return rnd


DEADLINE_ACTOR = Actor.system("round deadline")


def close_due_rounds(now: dt.datetime | None = None) -> list[Round]:
    """Close the open round whose deadline has come (the merge pipeline starts after commit).
    Run every minute or so (Celery beat's `synapse.close_due_rounds`, or
    `manage.py close_due_rounds --every 60`); a round closed meanwhile is left alone."""
    now = now or timezone.now()
    closed = []
    for pk in Round.objects.filter(state=Round.State.OPEN, closes_at__lte=now).values_list(
        "pk", flat=True
    ):
        try:
            rnd = _close_if_due(pk, now)
        except (InvalidTransition, NotFound):
            continue  # the operator (or another closer) was first
        if rnd is not None:
            closed.append(rnd)
    return closed


@transaction.atomic
def _close_if_due(pk: int, now: dt.datetime) -> Round | None:
    rnd = _locked_round(pk)
    # Read again under the lock: the operator may have moved or removed the deadline (or closed
    # the round) since the round was listed as due.
    if rnd.state != Round.State.OPEN or rnd.closes_at is None or rnd.closes_at > now:
        return None
    return close_round(DEADLINE_ACTOR, rnd)


# How many times in a row beat's check starts a round's lost merges again before failing it.
MERGE_REQUEUE_LIMIT = 3


def requeue_lost_merges(after_seconds: float, now: dt.datetime | None = None) -> list[Round]:
    """Start again, as a new run, the merges of each round left `closing` whose current run's start
    was never queued (`Round.queued_attempt`): the process that committed the close or retry
    died before it handed the start to the broker, so no task would ever move the round on (a
    broker that refused the start fails the round instead). Only runs that started more than
    `after_seconds` ago: the start is queued right after the commit. Run by Celery beat
    (`synapse.requeue_lost_merges`). The new run makes a start of the old one that was queued
    after all (the process died between queuing it and recording it) stale: it changes nothing.
    A round whose start is lost MERGE_REQUEUE_LIMIT times in a row after its close or retry is
    failed instead, saying so. Returns the rounds started again."""
    now = now or timezone.now()
    started_before = now - dt.timedelta(seconds=after_seconds)
    lost = (
        Round.objects.filter(state=Round.State.CLOSING, attempt_started_at__lte=started_before)
        .exclude(queued_attempt=F("attempt"))
        .values_list("pk", flat=True)
    )
    return [rnd for rnd in (_requeue_if_lost(pk, started_before) for pk in lost) if rnd]


@transaction.atomic
def _requeue_if_lost(pk: int, started_before: dt.datetime) -> Round | None:
    try:
        rnd = _locked_round(pk)
    except NotFound:
        return None
    # Read again under the lock: its start may have been queued (or the round failed) meanwhile.
    if (rnd.state != Round.State.CLOSING or rnd.queued_attempt == rnd.attempt
            or rnd.attempt_started_at is None or rnd.attempt_started_at > started_before):
        return None
    lost = rnd.attempt
    # Started again this many times since its close or the operator's latest retry: a start that
    # is lost every time (the process dies between queuing and recording it, again and again)
    # fails the round, saying so, rather than loop with its pending time reset at each start.
    since = (AuditLog.objects.filter(target_type="round", target_id=str(rnd.pk),
                                     action__in=[AuditLog.Action.ROUND_CLOSE,
                                                 AuditLog.Action.ROUND_RETRY])
             .order_by("-created_at", "-id").values_list("id", flat=True).first())
    again = AuditLog.objects.filter(target_type="round", target_id=str(rnd.pk),
                                    action=AuditLog.Action.ROUND_REQUEUE, id__gt=since or 0).count()
    if again >= MERGE_REQUEUE_LIMIT:
        log.warning("round %s: the start of its merges was lost %s times; failed", rnd.number,
                    again + 1)
        mark_failed(rnd, (
            f"the start of its merges was never queued, {again + 1} times in a row (run "
            f"{lost} and the {again} started again by the check before it): the process that "
            "queues it dies before recording it; see the web and worker logs, then retry"))
        return None
    rnd.attempt += 1
    rnd.attempt_started_at = timezone.now()
    rnd.save(update_fields=["attempt", "attempt_started_at"])
    log.warning("round %s: the start of its merges (run %s) was never queued; started again as "
                "run %s", rnd.number, lost, rnd.attempt)
    audit(Actor.system("merge pipeline"), AuditLog.Action.ROUND_REQUEUE, target=rnd,
          details={"lost_attempt": lost, "reason": "the start of its merges was never queued"})
    _send_round_closed(rnd)
    return rnd


def mark_queued(rnd: Round, attempt: int) -> None:
    """Record that run `attempt` of `rnd`'s merges was handed to the broker
    (`requeue_lost_merges` leaves it alone then)."""
    Round.objects.filter(pk=rnd.pk, attempt=attempt).update(queued_attempt=attempt)


@contextmanager
def waiting_briefly(what: str):
    """Within the block (inside a transaction), a lock another transaction holds is waited for at
    most SYNAPSE_LOCK_WAIT_SECONDS; longer is a Busy (409) naming `what`. For the operator's
    requests: an erasure holds the locks of the rounds it re-merges and the settings' until all
    its merges commit (minutes with an LLM summarizer), and a request waiting that long would be
    cut off by the web server instead of answered."""
    wait_ms = max(1, round(settings.SYNAPSE_LOCK_WAIT_SECONDS * 1000))
    with connection.cursor() as cur:
        cur.execute("SELECT current_setting('lock_timeout')")
        (before,) = cur.fetchone()
        cur.execute("SELECT set_config('lock_timeout', %s, true)", [f"{wait_ms}ms"])
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == "55P03":  # lock_not_available
            raise Busy(
                f"cannot {what} now: a long operation (an erasure re-merging rounds, or a merge "
                f"releasing statistics) holds what it needs for more than "
                f"{settings.SYNAPSE_LOCK_WAIT_SECONDS:g} s; try again once it has finished"
            ) from None
        raise
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('lock_timeout', %s, true)", [before])


def _locked_round(rnd: Round | int | None) -> Round:
    if rnd is None:
        found = Round.objects.select_for_update().filter(state=Round.State.OPEN).first()
        if found is None:
            raise NoOpenRound()
        return found
    pk = rnd.pk if isinstance(rnd, Round) else rnd
    try:
        return Round.objects.select_for_update().get(pk=pk)
    except Round.DoesNotExist as exc:
        raise NotFound("no such round") from exc


def _move(rnd: Round, target: str, verb: str, source: str | None = None) -> str:
    if target not in _TRANSITIONS[rnd.state] or (source is not None and rnd.state != source):
        allowed = ", ".join(sorted(_TRANSITIONS[rnd.state])) or "none (final)"
        article = "an" if source and source[0] in "aeiou" else "a"
        needs = f"; this needs {article} {source} round" if source else ""
        raise InvalidTransition(
            f"cannot {verb} round {rnd.number}: it is {rnd.state} "
            f"(from {rnd.state} it may go to: {allowed}){needs}"
        )
    previous = rnd.state
    rnd.state = target
    return previous


def _send_round_closed(rnd: Round) -> None:
    round_id = rnd.pk

    def send() -> None:
        round_closed.send(sender=Round, round=Round.objects.get(pk=round_id))

    # robust: a pipeline that fails at once (Celery eager mode runs it here, in the request), or
    # whose start cannot be queued (the broker down), records the failure on the round (the
    # tasks and the receiver call fail_round) and must not turn the committed close or retry
    # into an error; Django logs the exception.
    transaction.on_commit(send, robust=True)


@transaction.atomic
def close_round(actor: Actor, rnd: Round | int | None = None) -> Round:
    """open -> closing; after commit, `round_closed` starts the merge pipeline."""
    require_operator(actor, "close rounds")
    rnd = _locked_round(rnd)
    _move(rnd, Round.State.CLOSING, "close", source=Round.State.OPEN)
    rnd.closed_at = rnd.attempt_started_at = timezone.now()
    # Its run is not queued yet (whatever an earlier migration or state left here): the receiver
    # records it once queued, and beat's check starts it again if that never happens.
    rnd.queued_attempt = None
    rnd.save(update_fields=["state", "closed_at", "attempt_started_at", "queued_attempt"])
    # Every client submission stored, and of them those of revoked clients, which the merge
    # does not read (`submissions_to_merge`), as the Overview shows them.
    submissions = rnd.compendiums.filter(kind="client").count()
    merged = submissions_to_merge(round=rnd).count() if submissions else 0
    audit(actor, AuditLog.Action.ROUND_CLOSE, target=rnd,
          details={"submissions": submissions, "from_revoked_clients": submissions - merged})
    _send_round_closed(rnd)
    return rnd


def submissions_to_merge(**filters) -> QuerySet:
    """The client submissions a round's merge reads (`filters` narrow them: `round=`,
    `round_id__in=`, ...): every client's but a revoked one's, which no merge reads. A round
    without any has nothing to merge: its pipeline fails at its start."""
    return CompendiumVersion.objects.filter(
        kind=CompendiumVersion.Kind.CLIENT, **filters
    ).exclude(client__status=Client.Status.REVOKED)


@transaction.atomic
def retry_round(actor: Actor, rnd: Round | int) -> Round:
    """failed -> closing, and the pipeline is started again. A failed round holds no privacy
    reservation, so the retry takes it again and is refused if that would exceed the budget."""
    require_operator(actor, "retry rounds")
    # The round's lock, then the settings' (serializing with open_round and update_settings,
    # without creating the settings row here): the order the pipeline takes them in. The
    # settings' without waiting: an erasure takes them at its first new release and then goes on
    # to lock the later rounds it merges again, this one among them, so a retry that waited for
    # them holding this round's lock was a deadlock, which PostgreSQL broke by aborting the
    # retry (a 500) or the erasure.
    with waiting_briefly("retry the round"):
        rnd = _locked_round(rnd)
    try:
        FederationSettings.objects.select_for_update(nowait=True).filter(pk=1).first()
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        raise Busy(
            "cannot retry the round now: an erasure re-merging rounds, or a merge releasing "
            "statistics, holds the privacy budget's lock; try again once it has finished"
        ) from None
    reason = rnd.failure_reason
    _move(rnd, Round.State.CLOSING, "retry", source=Round.State.FAILED)
    _refuse_after_a_later_publication(rnd, "retried")
    if not submissions_to_merge(round=rnd).exists():
        # Its merge would fail again at once (`pipeline.start_round`): nothing to retry.
        raise InvalidTransition(
            f"round {rnd.number} cannot be retried: it has no submission to merge (none was "
            f"made, or only by clients revoked since), so its merge would fail again at once; "
            f"open the next round instead"
        )
    refusal = retry_budget_refusal(rnd)
    if refusal:
        raise BudgetExceeded(refusal)
    rnd.failure_reason = ""
    rnd.attempt += 1
    rnd.attempt_started_at = timezone.now()
    rnd.save(update_fields=["state", "failure_reason", "attempt", "attempt_started_at"])
    audit(actor, AuditLog.Action.ROUND_RETRY, target=rnd, details={"previous_failure": reason})
    _send_round_closed(rnd)
    return rnd


def retry_budget_refusal(rnd: Round) -> str:
    """Why the privacy budget refuses a retry of the failed `rnd` now ("" when it fits): a failed
    round holds no reservation, and a retry takes it again (`retry_round`; `round_status` says so
    rather than name a retry that would be refused)."""
    return retry_budget_refusals([rnd])[rnd.pk]


def retry_budget_refusals(rounds) -> dict[int, str]:
    """`retry_budget_refusal` of each of the failed `rounds` ({round pk: refusal}), reading the
    ledger once for all of them."""
    return accounting.retry_refusals(rounds, accounting.epsilon_budget())


def pipeline_outcome(rnd: Round) -> str:
    """What became of a round's merge pipeline once its close or retry is committed: without a
    broker it ran in the caller (a request, a command) and is over; with workers it has started."""
    rnd.refresh_from_db()
    if rnd.state == Round.State.PUBLISHED:
        return "its merge ran and published the global compendium"
    if rnd.state == Round.State.FAILED:
        return f"its merge failed: {rnd.failure_reason}"
    return "the merge pipeline started"


@transaction.atomic
def mark_merging(rnd: Round | int, actor: Actor | None = None) -> Round:
    actor = actor or Actor.system("merge pipeline")
    require_operator(actor, "advance rounds")
    rnd = _locked_round(rnd)
    _move(rnd, Round.State.MERGING, "start merging")
    rnd.save(update_fields=["state"])
    audit(actor, AuditLog.Action.ROUND_MERGING, target=rnd)
    return rnd


def published_after(rnd: Round) -> int | None:
    """The number of the first round after `rnd` that is published, or None. Globals are
    published in round order, so `rnd` can then never be published (nor retried)."""
    return (
        Round.objects.filter(number__gt=rnd.number, state=Round.State.PUBLISHED)
        .order_by("number").values_list("number", flat=True).first()
    )


def _refuse_after_a_later_publication(rnd: Round, what: str) -> None:
    """Globals are published in round order: each carries the one before it forward, and the
    latest round's is the one served. A round published after a later one would be in no global
    ever served (the later global was merged without it), so it cannot be `what`."""
    later = published_after(rnd)
    if later is not None:
        raise InvalidTransition(
            f"round {rnd.number} cannot be {what}: round {later} is published already and its "
            f"global was merged without round {rnd.number}'s (globals are published in round "
            f"order); its clients submit again to the open round"
        )


# The publication lock's key (pg_advisory_xact_lock's two int4 keys): "SYNP", 1.
_PUBLICATION_LOCK = (0x53594E50, 1)


def lock_publication() -> None:
    """Take the publication lock, held to the end of the calling transaction: every write of a
    global compendium (`pipeline.run_server_merge`) and every erasure (`pipeline.erase_client`,
    for its whole transaction) take it, so that a server merge checks under it that the previous
    global it carried forward is still the latest published one, and no erasure re-merges or
    deletes a global between that check and the commit. Taken before any round's row lock (an
    erasure locks several rounds after it), so the two orders cannot deadlock; taking it again
    in the same transaction is free."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(_PUBLICATION_LOCK))


@transaction.atomic
def mark_published(rnd: Round | int, actor: Actor | None = None) -> Round:
    actor = actor or Actor.system("merge pipeline")
    require_operator(actor, "publish rounds")
    rnd = _locked_round(rnd)
    _move(rnd, Round.State.PUBLISHED, "publish")
    _refuse_after_a_later_publication(rnd, "published")
    rnd.published_at = timezone.now()
    rnd.save(update_fields=["state", "published_at"])
    audit(actor, AuditLog.Action.ROUND_PUBLISH, target=rnd)
    return rnd


@transaction.atomic
def mark_failed(rnd: Round | int, reason: str, actor: Actor | None = None) -> Round:
    actor = actor or Actor.system("merge pipeline")
    require_operator(actor, "fail rounds")
    rnd = _locked_round(rnd)
    _move(rnd, Round.State.FAILED, "fail")
    rnd.failure_reason = reason or "unspecified failure"
    rnd.save(update_fields=["state", "failure_reason"])
    audit(actor, AuditLog.Action.ROUND_FAIL, target=rnd, details={"reason": rnd.failure_reason})
    return rnd


def fail_round_by_hand(actor: Actor, rnd: Round | int, reason: str) -> Round:
    """closing/merging -> failed by the operator, with a reason (a merge whose worker died with
    its message, which Redis gives back only after its visibility timeout): the round can then be
    retried. A task of the run still in flight writes nothing once it sees the round failed. The
    round's lock is waited for briefly (an erasure may hold it for minutes): Busy (409) then."""
    require_operator(actor, "fail rounds")
    reason = reason.strip()
    if not reason:
        raise InvalidRequest("say why the round is failed: the reason is shown on the round and "
                             "in the audit log")
    free_text("reason", reason, 2000)
    with transaction.atomic(), waiting_briefly("fail the round"):
        return mark_failed(_locked_round(rnd), reason, actor)


def round_figures(queryset, organization_ids=None):
    """Annotate rounds with their submission figures in one query: of every organization, or
    (`organization_ids`) of those only, as the dashboard shows a member its own; and with the
    global's top-1 on the public probe set as the server merge recorded it."""
    from django.db.models import Count, OuterRef, Q, Subquery

    client = Q(compendiums__kind="client")
    if organization_ids is not None:
        client &= Q(compendiums__client__organization_id__in=list(organization_ids))
    server_merge = MergeRecord.objects.filter(round=OuterRef("pk"), organization__isnull=True)
    return queryset.annotate(
        n_submissions=Count("compendiums", filter=client),
        n_organizations=Count("compendiums__client__organization", filter=client, distinct=True),
        n_submitted_bytes=Sum("compendiums__size_bytes", filter=client),
        n_submitted_gzip_bytes=Sum("compendiums__gzip_bytes", filter=client),
        merge_probe_accuracy=Subquery(server_merge.values("accuracy")[:1]),
        merge_probe_queries=Subquery(server_merge.values("probe_queries")[:1]),
    )


# --- the demo federation ----------------------------------------------------------------------

# Eight approved clients an organization. A statistic is released only when its Laplace noise,
# b = w / (K · ε_j) with w the width of the field's clipping window [min, min(max, min + Δ)] (the
# interval every figure is clamped to), can come out narrower than w: at K clients an edge and E
# edges that takes K · ε_j · √E > 1 (`merge.drowned_fields`). The demo once had two clients an
# organization: at ε = 1 under F* = 1 (ε_j = 1/8) the noise was 2.3 times every window, no edge
# released anything and the privacy pages stayed empty (before the judgement used the window, the
# call counts were released at b = 200 calls on a window of 50: coin flips between 0 and 50).
DEMO_ORGANIZATIONS = (
    ("Northwind Health", "northwind", (
        "triage-desk", "lab-bench", "pharmacy", "radiology", "admissions", "billing",
        "ward-east", "ward-west")),
    ("Contoso Logistics", "contoso", (
        "dispatch", "warehouse", "fleet", "customs", "returns", "procurement", "yard",
        "tracking")),
    ("Fabrikam Research", "fabrikam", (
        "notebooks", "library", "wet-lab", "cluster", "seminar", "grants", "archive",
        "field-station")),
)
# Each user's statistics capped at one tool (F*): ε is split over the 2 · F* · F = 8 statistics
# one replaced user can move rather than all T · F of the registry.
DEMO_FIELD_CAP = 1
# ε per round. With eight clients an edge and F* = 1, ε = 2 gives ε_j = 1/4: each edge's noise is
# half of each field's clipping window (b = w / (8 · 1/4)), the global's average over the three
# edges about 0.29 of it (calls: b = 25 calls at an edge on a window of 50, 14 in the global). A
# weak guarantee, said on the privacy pages; at ε = 1 the edges' noise would be as wide as the
# window. Three demo rounds and the open fourth commit 8 of the default budget of 10.
DEMO_EPSILON = 2.0


def demo_round_config(seed: int = 0) -> RoundConfig:
    """The configuration the demo federation's rounds are opened with."""
    return RoundConfig(seed=seed, field_cap=DEMO_FIELD_CAP, epsilon=DEMO_EPSILON)


@dataclass(frozen=True)
class DemoFederation:
    operator: Credentials
    admins: list[tuple[str, Credentials]]  # (organization slug, login)
    clients: list[tuple[str, str, str]]  # (organization slug, client name, token)
    round: Round | None
    opened_round: bool


@transaction.atomic
def bootstrap_demo_federation() -> DemoFederation:
    """A demo federation, idempotent across restarts: organizations with an admin login each,
    approved clients, an operator login, and round 1 when no round exists. Passwords and client
    tokens are re-issued (printed once) on every run; only their hashes are stored. The admins'
    logins are added and re-issued through the people service, audited; one deactivated, demoted
    or moved since is left so (reset_member), as a revoked client is. All or nothing: a refusal
    (round 1 over the privacy budget) leaves the logins that worked before."""
    actor = Actor.system("bootstrap_demo")
    if not NumericField.objects.exists():
        # A flushed database has lost what the data migration declared: the demo's statistics,
        # ledger and privacy pages need fields. Fields an operator declared are left alone.
        seed_default_numeric_fields()
    operator = reset_operator(actor)
    admins: list[tuple[str, Credentials]] = []
    clients: list[tuple[str, str, str]] = []
    for name, slug, client_names in DEMO_ORGANIZATIONS:
        org = Organization.objects.filter(slug=slug).first() or create_organization(
            actor, name, slug, f"Demo organization {name}"
        )
        admins.append((slug, reset_member(actor, org, f"{slug}-admin", Membership.Role.ADMIN)))
        for client_name in client_names:
            client = Client.objects.filter(organization=org, name=client_name).first()
            if client is None:
                client = enroll_client(actor, org, client_name, f"demo client {client_name}")
            if client.status == Client.Status.PENDING:
                issued = approve_client(actor, client)
            elif client.status == Client.Status.APPROVED:
                issued = rotate_client_token(actor, client)
            else:
                continue
            clients.append((slug, client_name, issued.token))
    opened = False
    rnd = Round.objects.order_by("-number").first()
    if rnd is None:
        rnd = open_round(actor, demo_round_config())
        opened = True
    return DemoFederation(operator, admins, clients, rnd, opened)


def store_simulation_run(document: dict, label: str = "") -> SimulationRun:
    """Keep a simulation's results for the dashboards (accuracy curves, frontier, adversarial)."""
    return SimulationRun.objects.create(
        label=label[:200],
        dataset=str(document.get("dataset", ""))[:200],
        config=document.get("config", {}),
        document=document,
        seconds=float(document.get("seconds", 0.0)),
    )
