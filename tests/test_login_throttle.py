"""Sign-in throttling: failed sign-ins counted per username and per address; at the limit that
username or address is refused, right password too, on every login form, until the window ends."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth import SESSION_KEY, aauthenticate, authenticate, get_user_model
from django.test import Client as DjangoClient
from django.utils.crypto import salted_hmac

from federation import login_throttle, ratelimit
from federation.models import AuditLog, Membership, RateCounter
from federation.services import create_organization
from tests.federation_fixtures import SYSTEM

PASSWORD = "correct horse battery staple"
WINDOW = 900
LOGIN_FORMS = ["/accounts/login/", "/admin/login/", "/api-auth/login/"]


@pytest.fixture(autouse=True)
def small_limits(settings):
    settings.SYNAPSE_LOGIN_FAILURES_PER_USERNAME = 3
    settings.SYNAPSE_LOGIN_FAILURES_PER_IP = 5
    settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS = WINDOW
    # Many sign-ins per test: a fast hasher (the throttle does not depend on the hasher).
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def clock(monkeypatch):
    """The rate limiter's clock, in the middle of a window, movable by the test."""
    now = SimpleNamespace(t=1_800_000_000.0 + 100)
    monkeypatch.setattr(ratelimit, "time", SimpleNamespace(time=lambda: now.t))
    return now


@pytest.fixture
def people(db):
    users = get_user_model().objects
    org = create_organization(SYSTEM, "Org A", "org-a")
    alice = users.create_user("alice", password=PASSWORD)
    Membership.objects.create(user=alice, organization=org, role=Membership.Role.ADMIN)
    bob = users.create_user("bob", password=PASSWORD)
    root = users.create_superuser("root", password=PASSWORD)
    return SimpleNamespace(org=org, alice=alice, bob=bob, root=root)


def sign_in(client, username, password, path="/accounts/login/", ip="127.0.0.1"):
    return client.post(path, {"username": username, "password": password}, REMOTE_ADDR=ip)


def signed_in(client) -> bool:
    return SESSION_KEY in client.session


def counter(key: str) -> int:
    return sum(RateCounter.objects.filter(key=key).values_list("count", flat=True))


# --- per username ---------------------------------------------------------------------------------


def test_account_locks_after_limit_and_refuses_the_right_password(client, people, clock):
    for _ in range(2):
        response = sign_in(client, "alice", "wrong")
        assert response.status_code == 200
        assert "didn't match" in response.content.decode()
    # The third failure reaches the limit: the form says so at once.
    third = sign_in(client, "alice", "wrong").content.decode()
    assert "Too many failed sign-ins for this account; try again in 14 minutes." in third
    assert "didn't match" not in third

    refused = sign_in(client, "alice", PASSWORD)
    assert refused.status_code == 200 and not signed_in(client)
    assert (
        "Too many failed sign-ins for this account; try again in 14 minutes."
        in refused.content.decode()
    )
    # The same account in another case, from another address: still locked.
    other = DjangoClient()
    assert "for this account" in sign_in(other, "ALICE", PASSWORD, ip="10.9.9.9").content.decode()
    assert not signed_in(other)
    # Another account is not affected.
    assert sign_in(DjangoClient(), "bob", PASSWORD).status_code == 302


def test_refused_attempts_do_not_count_and_the_lock_ends_with_the_window(client, people, clock):
    for _ in range(3):
        sign_in(client, "alice", "wrong")
    key = login_throttle.username_key("alice")
    assert counter(key) == 3
    for _ in range(5):
        sign_in(client, "alice", "wrong")
        sign_in(client, "Alice", PASSWORD)
    assert counter(key) == 3  # checking the lock is not a failure
    assert AuditLog.objects.filter(action="login.throttled").count() == 1

    clock.t += WINDOW  # the next window
    response = sign_in(client, "alice", PASSWORD)
    assert response.status_code == 302 and signed_in(client)


def test_success_under_the_limit_is_not_blocked(client, people, clock):
    sign_in(client, "alice", "wrong")
    sign_in(client, "alice", "wrong")
    response = sign_in(client, "alice", PASSWORD)
    assert response.status_code == 302 and signed_in(client)
    assert not AuditLog.objects.filter(action="login.throttled").exists()
    # The right password was counted before it was checked, and uncounted after.
    assert counter(login_throttle.username_key("alice")) == 2


@pytest.mark.django_db(transaction=True)  # each guessing thread has its own connection
def test_guesses_sent_in_parallel_get_at_most_the_limit_of_password_checks(people, monkeypatch):
    """The lock was read before the (slow) password hash and the failure counted after it: 16
    guesses sent together all had their password checked, with the limit at 3."""
    import threading

    from django.contrib.auth.backends import ModelBackend
    from django.core.exceptions import PermissionDenied
    from django.db import connection
    from django.test import RequestFactory

    checked, outcomes, go = [], [], threading.Event()
    arrived = threading.Condition()
    real = ModelBackend.authenticate

    def slow_check(self, request, username=None, password=None, **kwargs):
        with arrived:
            checked.append(password)
            arrived.notify_all()
        go.wait(5)  # every guess that gets this far waits for the others to arrive
        return real(self, request, username=username, password=password, **kwargs)

    monkeypatch.setattr(ModelBackend, "authenticate", slow_check)

    def guess(i):
        try:
            request = RequestFactory().post("/accounts/login/", REMOTE_ADDR=f"10.0.0.{i + 1}")
            try:
                outcome = authenticate(request, username="alice", password=f"guess {i}")
            except PermissionDenied as refused:  # the throttle ends authenticate() so
                outcome = refused
            with arrived:
                outcomes.append(outcome)
                arrived.notify_all()
        finally:
            connection.close()

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    with arrived:  # every guess checked (waiting) or refused (returned at once)
        assert arrived.wait_for(lambda: len(checked) + len(outcomes) >= 8, timeout=30)
    go.set()
    for thread in threads:
        thread.join(10)
    assert len(checked) == 3 and len(outcomes) == 8
    assert counter(login_throttle.username_key("alice")) == 3
    assert AuditLog.objects.filter(action="login.throttled").count() == 1


@pytest.mark.parametrize(
    "first, second, same",
    [
        ("2001:db8:1:2::1", "2001:db8:1:2:ffff::9", True),  # one /64: one host or subscriber
        ("2001:db8:1:2::1", "2001:db8:1:3::1", False),
        ("::ffff:192.0.2.1", "192.0.2.1", True),  # an IPv4 client seen through a v6 socket
        ("192.0.2.1", "192.0.2.2", False),
    ],
)
def test_an_ipv6_address_is_counted_with_its_slash_64(first, second, same):
    """Counted per full address, a host given a /64 could try 2^64 addresses' worth of guesses."""
    assert (login_throttle.address_key(first) == login_throttle.address_key(second)) is same


def test_unknown_usernames_are_counted_too(client, people, clock):
    for _ in range(3):
        sign_in(client, "nobody", "wrong")
    page = sign_in(client, "nobody", "anything").content.decode()
    assert "Too many failed sign-ins for this account" in page
    entry = AuditLog.objects.get(action="login.throttled")
    # what was typed is not an account, and may be a password in the wrong field: not kept
    assert entry.target_type == "user" and entry.target_id == ""
    assert entry.target_label.startswith("unknown username (keyed digest ") and "nobody" not in str(
        entry.details
    )
    assert entry.organization is None
    # keyed with the server's secret: a plain sha256 of what was typed (perhaps a password in
    # the wrong field) could be matched offline against a list of common passwords
    digest = entry.target_label.removeprefix("unknown username (keyed digest ").rstrip(")")
    assert digest != hashlib.sha256(b"nobody").hexdigest()[:12]

    def keyed(secret):
        return salted_hmac(login_throttle._UNKNOWN_USERNAME_SALT,
                           login_throttle.username_key("nobody"), secret=secret,
                           algorithm="sha256").hexdigest()[:12]

    assert digest == keyed(settings.SECRET_KEY) != keyed("another secret")


def test_lock_is_audited_once_with_username_ip_and_organization(client, people, clock):
    for _ in range(6):
        sign_in(client, "Alice", "wrong", ip="192.0.2.7")
    entry = AuditLog.objects.get(action="login.throttled")
    assert entry.actor is None and entry.actor_label == "anonymous sign-in"
    assert entry.ip == "192.0.2.7"
    assert entry.target_type == "user" and entry.target_id == str(people.alice.pk)
    assert entry.target_label == "alice"
    assert entry.organization == people.org  # alice's organization sees it in its audit log
    assert entry.details["scope"] == "username" and entry.details["username"] == "Alice"
    assert entry.details["failures"] == 3 and entry.details["window_s"] == WINDOW
    assert entry.details["ip"] == "192.0.2.7"


def test_the_accounts_organization_sees_its_lock_in_the_audit_log(client, people, clock):
    for _ in range(3):
        sign_in(client, "alice", "wrong", ip="192.0.2.7")
    other_org = create_organization(SYSTEM, "Org B", "org-b")
    bob_admin = DjangoClient()
    Membership.objects.create(user=people.bob, organization=other_org, role=Membership.Role.ADMIN)
    bob_admin.force_login(people.bob)
    assert "login.throttled</code>" not in bob_admin.get("/audit/").content.decode()
    alice = DjangoClient()
    alice.force_login(people.alice)
    page = alice.get("/audit/", {"action": "login.throttled"}).content.decode()
    assert "login.throttled</code>" in page and "anonymous sign-in" in page and "192.0.2.7" in page


@pytest.mark.parametrize("path", LOGIN_FORMS)
def test_every_login_form_is_throttled_and_says_so(client, people, clock, path):
    for _ in range(3):
        sign_in(client, "root", "wrong", path=path)
    response = sign_in(client, "root", PASSWORD, path=path)
    assert response.status_code == 200 and not signed_in(client)
    assert (
        "Too many failed sign-ins for this account; try again in 14 minutes."
        in response.content.decode()
    )


def test_authenticate_without_a_request_is_throttled(people, clock):
    # Client.login, management code: no address, the username still counts.
    for _ in range(3):
        assert authenticate(username="bob", password="wrong") is None
    assert authenticate(username="bob", password=PASSWORD) is None
    assert async_to_sync(aauthenticate)(username="bob", password=PASSWORD) is None
    assert authenticate(username="alice", password=PASSWORD) == people.alice


def test_limit_zero_turns_a_count_off(client, people, clock, settings):
    settings.SYNAPSE_LOGIN_FAILURES_PER_USERNAME = 0
    settings.SYNAPSE_LOGIN_FAILURES_PER_IP = 0
    for _ in range(10):
        sign_in(client, "alice", "wrong")
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    assert not RateCounter.objects.filter(key__startswith="login:").exists()


# --- per address ----------------------------------------------------------------------------------


def test_address_locks_after_limit_across_usernames(client, people, clock):
    for n in range(5):
        sign_in(client, f"guess{n}", "wrong", ip="198.51.100.4")
    refused = sign_in(client, "bob", PASSWORD, ip="198.51.100.4")
    assert not signed_in(client)
    assert (
        "Too many failed sign-ins from this address; try again in 14 minutes."
        in refused.content.decode()
    )
    # From another address the account is fine (bob never failed).
    assert sign_in(DjangoClient(), "bob", PASSWORD, ip="198.51.100.5").status_code == 302
    entry = AuditLog.objects.get(action="login.throttled", target_type="address")
    assert entry.target_label == "198.51.100.4" and entry.ip == "198.51.100.4"
    assert entry.details["scope"] == "address" and entry.organization is None


def test_behind_a_proxy_the_address_count_is_per_forwarded_client(client, people, clock, settings):
    settings.SYNAPSE_BEHIND_PROXY = True
    for n in range(5):
        client.post(
            "/accounts/login/",
            {"username": f"guess{n}", "password": "wrong"},
            REMOTE_ADDR="10.0.0.2",
            HTTP_X_FORWARDED_FOR="203.0.113.9",
        )
    locked = DjangoClient()
    locked.post(
        "/accounts/login/",
        {"username": "bob", "password": PASSWORD},
        REMOTE_ADDR="10.0.0.2",
        HTTP_X_FORWARDED_FOR="203.0.113.9",
    )
    assert not signed_in(locked)
    # The lock (and the audit log) names the forwarded client, not the proxy.
    assert AuditLog.objects.get(action="login.throttled").target_label == "203.0.113.9"
    # Another visitor through the same proxy is not locked out.
    fine = DjangoClient()
    response = fine.post(
        "/accounts/login/",
        {"username": "bob", "password": PASSWORD},
        REMOTE_ADDR="10.0.0.2",
        HTTP_X_FORWARDED_FOR="203.0.113.10",
    )
    assert response.status_code == 302 and signed_in(fine)


def test_neither_spelling_nor_a_forged_forwarded_for_escapes_a_count(client, people, clock, settings):
    """Guesses at one account spelt in other cases and look-alike (NFKC) characters, each with a
    forged X-Forwarded-For, count for that account and for the connection's address; behind a
    proxy, an address the visitor puts before the proxy's own entry does not split the count."""
    for name, forged in (("alice", "192.0.2.1"), ("ALICE", "192.0.2.2"), ("Ａｌｉｃｅ", "192.0.2.3")):
        client.post("/accounts/login/", {"username": name, "password": "wrong"},
                    REMOTE_ADDR="198.51.100.20", HTTP_X_FORWARDED_FOR=forged)
    assert counter(login_throttle.username_key("alice")) == 3
    assert counter(login_throttle.address_key("198.51.100.20")) == 3
    fresh = DjangoClient()
    fresh.post("/accounts/login/", {"username": "alice", "password": PASSWORD},
               REMOTE_ADDR="198.51.100.21", HTTP_X_FORWARDED_FOR="192.0.2.9")
    assert not signed_in(fresh)

    settings.SYNAPSE_BEHIND_PROXY = True
    for n in range(5):
        client.post("/accounts/login/", {"username": f"guess{n}", "password": "wrong"},
                    REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=f"192.0.2.{50 + n}, 203.0.113.30")
    bob = DjangoClient()
    bob.post("/accounts/login/", {"username": "bob", "password": PASSWORD},
             REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="192.0.2.99, 203.0.113.30")
    assert not signed_in(bob)


def test_two_logins_whose_names_fold_alike_do_not_share_a_lock(client, people, clock):
    """"strasse" and "straße" are two logins (a username in another case is refused, these are
    not in another case); casefolding made them one count, so that the one's mistyped passwords
    locked the other out. Only its exact name signs in to a login: a count per name in any case
    leaves a guesser no more tries."""
    users = get_user_model().objects
    users.create_user("strasse", password=PASSWORD)
    users.create_user("straße", password=PASSWORD)
    for _ in range(3):
        sign_in(client, "strasse", "wrong", ip="192.0.2.40")
    other = DjangoClient()
    sign_in(other, "straße", PASSWORD, ip="192.0.2.41")
    assert signed_in(other)
    locked = DjangoClient()  # the login guessed at is locked, whatever the case typed
    assert login_throttle.lock_for("STRASSE", None) is not None
    sign_in(locked, "strasse", PASSWORD, ip="192.0.2.42")
    assert not signed_in(locked)


# --- the service ----------------------------------------------------------------------------------


def _failure(username, ip, now):
    return login_throttle.end_attempt(login_throttle.begin_attempt(username, ip, now=now), False)


def test_lock_for_reads_without_counting(people):
    now = 1_800_000_000.0
    for _ in range(2):
        _failure("Carol", "192.0.2.1", now)
    for _ in range(10):
        assert login_throttle.lock_for("carol", "192.0.2.1", now=now) is None
    locks = _failure("CAROL", None, now)
    assert [lock.scope for lock in locks] == ["username"]
    lock = login_throttle.lock_for("carol", "192.0.2.2", now=now + 60)
    assert lock is not None and lock.retry_after == WINDOW - 60 and lock.minutes == 14
    assert lock.message == "Too many failed sign-ins for this account; try again in 14 minutes."
    assert login_throttle.lock_for("carol", None, now=now + WINDOW) is None


def test_lock_message_rounds_up_to_whole_minutes():
    assert login_throttle.Lock("username", 1).message.endswith("try again in 1 minute.")
    assert login_throttle.Lock("address", 61).message == (
        "Too many failed sign-ins from this address; try again in 2 minutes."
    )


@pytest.mark.django_db
def test_a_locked_account_is_opened_by_a_password_reset_or_the_unlock_command(people, clock):
    import io

    from django.core.management import call_command

    from federation import people as people_service
    from federation.services import Actor

    for _ in range(3):
        sign_in(DjangoClient(), "Root", "wrong", ip="10.9.9.9")  # someone locks the operator out
    client = DjangoClient()
    sign_in(client, "root", PASSWORD)
    assert not signed_in(client)
    out = io.StringIO()
    call_command("unlock_login", "ROOT", stdout=out)
    assert "username 'ROOT': 1 failure count(s) cleared" in out.getvalue()
    entry = AuditLog.objects.get(action="login.unlock")
    assert entry.actor_label == "manage.py unlock_login" and entry.details["counters_cleared"] == 1
    sign_in(client, "root", PASSWORD)
    assert signed_in(client)

    for _ in range(3):
        sign_in(DjangoClient(), "alice", "wrong", ip="10.9.9.8")
    membership = Membership.objects.get(user=people.alice)
    issued = people_service.reset_password(Actor.for_user(people.root), membership)
    fresh = DjangoClient()
    sign_in(fresh, "alice", issued.password)
    assert signed_in(fresh)
    # the address that guessed keeps its own count
    assert counter(login_throttle.address_key("10.9.9.8")) == 3


def test_an_unlock_is_audited_where_the_lock_was(people, clock):
    """A username's lock is in its organization's audit log; so is its unlock, so that its admins
    do not read a lock that was never lifted."""
    from django.core.management import call_command

    for _ in range(3):
        sign_in(DjangoClient(), "alice", "wrong", ip="10.9.9.7")
    call_command("unlock_login", "ALICE", stdout=None)
    entry = AuditLog.objects.get(action="login.unlock")
    assert entry.organization == people.org
    assert entry.target_type == "user" and entry.target_id == str(people.alice.pk)
    assert entry.details["username"] == "ALICE" and entry.details["counters_cleared"] == 1
    # the address cleared with it is the lock's, which a read-only member does not read
    from federation.services import audit_entry_for

    call_command("unlock_login", "alice", "--address", "10.9.9.7", stdout=None)
    both = AuditLog.objects.filter(action="login.unlock").latest("id")
    Membership.objects.create(user=people.bob, organization=people.org, role=Membership.Role.MEMBER)
    assert "address" not in audit_entry_for(people.bob, both).details
    assert audit_entry_for(people.alice, both).details["address"] == "10.9.9.7"
    call_command("unlock_login", "nobody-here", stdout=None)  # no account: federation-wide
    assert AuditLog.objects.filter(action="login.unlock").latest("id").organization is None


@pytest.mark.parametrize("typed", ["198.51.100.400", "198.51.100", "host.example", "198.51.100.4/32"])
def test_unlock_refuses_an_address_that_is_not_one(people, clock, typed):
    """A mistyped --address cleared nothing and said "sign-in is open again" (and audited an
    unlock): the operator left the address locked believing it open."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    for n in range(5):
        sign_in(DjangoClient(), f"guess{n}", "wrong", ip="198.51.100.4")
    with pytest.raises(CommandError, match=f"--address {typed!r} is not an IP address"):
        call_command("unlock_login", "--address", typed)
    assert not AuditLog.objects.filter(action="login.unlock").exists()
    assert counter(login_throttle.address_key("198.51.100.4")) == 5


def test_unlock_takes_an_address_as_pasted_from_the_audit_log(people, clock):
    import io

    from django.core.management import call_command

    for n in range(5):
        sign_in(DjangoClient(), f"guess{n}", "wrong", ip="2001:db8:0:1::7")
    out = io.StringIO()
    call_command("unlock_login", "--address", " 2001:db8:0:1::7 ", stdout=out)
    assert "address 2001:db8:0:1::7: 1 failure count(s) cleared" in out.getvalue()
    assert counter(login_throttle.address_key("2001:db8:0:1::7")) == 0


def test_the_beat_schedule_prunes_old_counters(settings):
    from synapse_web.celery import app
    from workers.tasks import prune_rate_counters_task

    task = settings.CELERY_BEAT_SCHEDULE["prune-rate-counters"]["task"]
    assert task == prune_rate_counters_task.name and task in app.tasks


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/accounts/password_change/", "/admin/password_change/"])
def test_guessing_the_current_password_on_the_change_page_is_throttled(people, clock, path):
    client = DjangoClient()
    client.force_login(people.root)
    new = {"new_password1": "An-Other-Long-Pass-91", "new_password2": "An-Other-Long-Pass-91"}
    for _ in range(3):
        wrong = client.post(path, {"old_password": "guess", **new}, REMOTE_ADDR="10.1.1.1")
        assert wrong.status_code == 200 and "incorrectly" in wrong.content.decode()
    refused = client.post(path, {"old_password": PASSWORD, **new}, REMOTE_ADDR="10.1.1.1")
    assert refused.status_code == 200
    assert "Too many failed sign-ins for this account" in refused.content.decode()
    people.root.refresh_from_db()
    assert people.root.check_password(PASSWORD)  # not changed while locked
    clock.t += WINDOW
    done = client.post(path, {"old_password": PASSWORD, **new}, REMOTE_ADDR="10.1.1.1")
    assert done.status_code == 302
    assert AuditLog.objects.filter(action="person.password_change", actor=people.root).count() == 1


@pytest.mark.django_db
def test_a_lock_reached_on_the_change_page_names_the_signed_in_person(people, clock):
    """Guesses of the current password come from a signed-in session (a borrowed one, say): the
    lock's audit entry names that login, not "anonymous sign-in", which reads as an outsider
    guessing at the sign-in form and hides that a session of the account is in other hands."""
    client = DjangoClient()
    client.force_login(people.alice)
    new = {"new_password1": "An-Other-Long-Pass-91", "new_password2": "An-Other-Long-Pass-91"}
    for _ in range(3):
        client.post("/accounts/password_change/", {"old_password": "guess", **new},
                    REMOTE_ADDR="10.1.1.2")
    entry = AuditLog.objects.get(action="login.throttled", details__scope="username")
    assert entry.actor == people.alice and entry.actor_label == "alice"
    assert entry.ip == "10.1.1.2" and entry.organization == people.org
    assert entry.target_id == str(people.alice.pk)


@pytest.mark.django_db
def test_pruning_keeps_the_counters_of_a_lock_still_running(settings):
    from datetime import UTC, datetime, timedelta

    from workers.tasks import prune_rate_counters_task

    settings.SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS = 2 * 86400  # two-day locks
    now = datetime.now(UTC)
    RateCounter.objects.create(key="login:user:a", window_start=now - timedelta(days=1.5), count=9)
    RateCounter.objects.create(key="login:user:b", window_start=now - timedelta(days=3), count=9)
    assert prune_rate_counters_task.apply().get() == 1
    assert list(RateCounter.objects.values_list("key", flat=True)) == ["login:user:a"]
