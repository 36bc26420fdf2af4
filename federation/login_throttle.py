"""Sign-in throttling: failed password sign-ins are counted per username (case-insensitive) and
per client address in fixed windows (`federation.ratelimit`). Once either count reaches its limit,
every sign-in for that username or from that address is refused until the window ends, the right
password too. `federation.auth.ThrottledModelBackend` enforces it for every login form; the moment
a username or an address gets locked is audited (`login.throttled`).

Limits: SYNAPSE_LOGIN_FAILURES_PER_USERNAME, SYNAPSE_LOGIN_FAILURES_PER_IP (0: not counted) and
SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS.
"""

from __future__ import annotations

import ipaddress
import math
import unicodedata
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils.crypto import salted_hmac

from federation import ratelimit
from federation.models import AuditLog
from federation.services import Actor, audit, membership_of

USERNAME = "username"
ADDRESS = "address"
_UNKNOWN_USERNAME_SALT = "synapse.login_throttle.unknown_username"
# RateCounter.key holds 200 characters; a username longer than a form accepts (150) is cut.
_MAX_KEY_USERNAME = 180


@dataclass(frozen=True)
class Lock:
    """A refusal: which count is at its limit, and for how many more seconds."""

    scope: str  # USERNAME or ADDRESS
    retry_after: int

    @property
    def minutes(self) -> int:
        return max(1, math.ceil(self.retry_after / 60))

    @property
    def message(self) -> str:
        whom = "for this account" if self.scope == USERNAME else "from this address"
        unit = "minute" if self.minutes == 1 else "minutes"
        return f"Too many failed sign-ins {whom}; try again in {self.minutes} {unit}."


def username_key(username: str) -> str:
    # Lower case, not casefold: casefolding makes one name of two logins ("strasse", "straße"),
    # and one's failures would lock the other out. A login signs in by its exact name only, so
    # counting spellings it cannot sign in with apart gives a guesser nothing.
    folded = unicodedata.normalize("NFKC", str(username)).lower()
    return f"login:user:{folded[:_MAX_KEY_USERNAME]}"


def parsed_address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `ip` names (an IPv6 zone left out), or None when it names none."""
    try:
        return ipaddress.ip_address(str(ip).split("%", 1)[0])
    except ValueError:
        return None


def address_key(ip: str) -> str:
    """An IPv4 address is counted alone; an IPv6 one with its /64 (what one host or subscriber
    is given: counting each address would let it rotate through 2^64 of them)."""
    address = parsed_address(ip)
    if address is None:
        return f"login:ip:{ip}"
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.version == 6:
        return f"login:ip:{ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"login:ip:{address}"


def _counts(username: str | None, ip: str | None) -> list[tuple[str, str, int]]:
    """(scope, rate counter key, limit) of each count that applies."""
    counts = []
    if username and settings.SYNAPSE_LOGIN_FAILURES_PER_USERNAME > 0:
        counts.append(
            (USERNAME, username_key(username), settings.SYNAPSE_LOGIN_FAILURES_PER_USERNAME)
        )
    if ip and settings.SYNAPSE_LOGIN_FAILURES_PER_IP > 0:
        counts.append((ADDRESS, address_key(ip), settings.SYNAPSE_LOGIN_FAILURES_PER_IP))
    return counts


def lock_for(username: str | None, ip: str | None, now: float | None = None) -> Lock | None:
    """The lock on this username or address, if either has reached its limit of failures in the
    current window (the username's first). Reads the counts; counts nothing."""
    window_s = settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS
    for scope, key, limit in _counts(username, ip):
        if ratelimit.count(key, window_s, now) >= limit:
            return Lock(scope, ratelimit.window(window_s, now).retry_after)
    return None


@dataclass
class Attempt:
    """A password check counted as a failure before it runs (`begin_attempt`), settled after it
    (`end_attempt`). `lock`: the count that was already at its limit (the attempt is refused)."""

    username: str | None
    ip: str | None
    hits: list[tuple[str, str, int, ratelimit.Decision]]  # scope, key, limit, decision
    window_start: object
    now: float | None
    # Who made the attempt, when known: a signed-in person re-entering their password (the
    # password change page). None: someone at a sign-in form.
    actor: Actor | None = None

    @property
    def lock(self) -> Lock | None:
        for scope, _, _, decision in self.hits:
            if not decision.allowed:
                return Lock(scope, decision.retry_after)
        return None


def begin_attempt(
    username: str | None, ip: str | None, now: float | None = None, actor: Actor | None = None
) -> Attempt:
    """Count a sign-in attempt as a failure of the username and the address before its password
    is checked, each count in one atomic upsert: of guesses sent in parallel, only as many as the
    limit get their password checked (checking the counts first and counting after the hash let
    every one of them through). `end_attempt` takes the counts back when the password was right,
    or when the attempt was refused (a refused attempt counts nothing). `actor`: the signed-in
    person making it, if any, whom a lock it brings is audited as."""
    window_s = settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS
    hits = [(scope, key, limit, ratelimit.hit(key, limit, window_s, now))
            for scope, key, limit in _counts(username, ip)]
    return Attempt(username, ip, hits, ratelimit.window(window_s, now).start, now, actor)


def end_attempt(attempt: Attempt, succeeded: bool) -> list[Lock]:
    """Settle `attempt`: a success or a refusal uncounts it; a failure stays counted, and the
    count it brought to its limit is a lock, audited as `login.throttled` (returned)."""
    if succeeded or attempt.lock is not None:
        for _, key, _, _ in attempt.hits:
            ratelimit.take_back(key, attempt.window_start)
        return []
    window_s = settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS
    locks = []
    for scope, _, limit, decision in attempt.hits:
        if decision.count == limit:
            lock = Lock(scope, decision.retry_after)
            _audit_lock(lock, attempt.username, attempt.ip, limit, window_s, attempt.now,
                        attempt.actor)
            locks.append(lock)
    return locks


def account(username: str):
    """The login a typed username names: its exact spelling, else one in another case."""
    users = get_user_model()._default_manager
    field = get_user_model().USERNAME_FIELD
    exact = users.filter(**{field: username}).first()
    return exact or users.filter(**{f"{field}__iexact": username}).order_by("pk").first()


def _audit_lock(lock: Lock, username, ip, limit: int, window_s: int, now, actor=None) -> None:
    username = str(username or "")[:150]
    user = account(username) if username else None
    if user is None and username:
        # Not an account: what was typed may be a password in the wrong field; the log keeps a
        # digest that tells repeated attempts apart, not the text. Keyed with the server's secret:
        # a plain sha256 let whoever reads the log (an export, a backup) try a list of common
        # passwords against it offline.
        digest = salted_hmac(_UNKNOWN_USERNAME_SALT, username_key(username),
                             algorithm="sha256").hexdigest()[:12]
        username = f"unknown username (keyed digest {digest})"
    until = ratelimit.window(window_s, now).start + timedelta(seconds=window_s)
    details = {
        "scope": lock.scope,
        "username": username,
        "ip": ip,
        "failures": limit,
        "window_s": window_s,
        "locked_until": until.isoformat(),
    }
    actor = actor or Actor(None, ip, "anonymous sign-in")
    if lock.scope == USERNAME:
        # The account's organization (if the username is one) sees its own lock in its audit log.
        membership = membership_of(user) if user is not None else None
        audit(
            actor,
            AuditLog.Action.LOGIN_THROTTLED,
            target=user,
            target_type="user",
            target_label="" if user is not None else username,
            organization=membership.organization if membership else None,
            details=details,
        )
    else:
        audit(
            actor,
            AuditLog.Action.LOGIN_THROTTLED,
            target_type="address",
            target_label=ip or "",
            details=details,
        )


def unlock(username: str | None = None, ip: str | None = None) -> int:
    """Clear the failure counts of a username and/or an address (every window): the way back for
    a locked-out account (a password reset does it, and `manage.py unlock_login`). Returns how
    many counters were removed."""
    from federation.models import RateCounter

    keys = ([username_key(username)] if username else []) + ([address_key(ip)] if ip else [])
    if not keys:
        return 0
    deleted, _ = RateCounter.objects.filter(key__in=keys).delete()
    return deleted
