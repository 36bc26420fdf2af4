"""`make demo`'s bootstrap: a demo federation, idempotent across restarts."""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import authenticate
from django.core.management import CommandError, call_command

from federation import services
from federation.models import Client, Membership, Organization, Round

pytestmark = pytest.mark.django_db


@pytest.fixture
def registry_file(tmp_path):
    path = tmp_path / "tools.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"tool_id": t, "name": t, "description": f"the {t} tool", "category": "Demo"})
            for t in ("weather", "flights", "calculator")
        )
    )
    return path


def run(registry_file) -> str:
    out, err = io.StringIO(), io.StringIO()
    call_command("bootstrap_demo", "--dataset", str(registry_file), stdout=out, stderr=err)
    return out.getvalue() + err.getvalue()


def test_bootstrap_creates_demo_federation_and_is_idempotent(registry_file):
    first = run(registry_file)
    assert "username: operator" in first
    password = re.search(r"username: operator\n  password: (\S+)", first).group(1)
    assert authenticate(username="operator", password=password).is_superuser
    assert Organization.objects.count() == 3
    assert Membership.objects.filter(role="admin").count() == 3
    assert Client.objects.filter(status="approved").count() == 24
    tokens = re.findall(r"token: (syn_c_\S+)", first)
    assert len(tokens) == 24
    assert {services.client_for_token(t).status for t in tokens} == {"approved"}
    assert Round.objects.get().state == "open" and "round 1 is open (opened now)" in first
    admin_line = re.search(r"username: (northwind-admin)\s+password: (\S+)", first)
    admin = authenticate(username=admin_line.group(1), password=admin_line.group(2))
    assert admin.membership.organization.slug == "northwind"

    second = run(registry_file)
    assert Organization.objects.count() == 3 and Client.objects.count() == 24
    assert Round.objects.count() == 1 and "round 1 is open" in second
    new_tokens = re.findall(r"token: (syn_c_\S+)", second)
    assert len(new_tokens) == 24 and not set(new_tokens) & set(tokens)
    with pytest.raises(services.TokenRejected):
        services.client_for_token(tokens[0])
    assert services.client_for_token(new_tokens[0]).status == "approved"


def test_round_status_tells_where_the_rounds_stand(registry_file):
    def status() -> str:
        out = io.StringIO()
        call_command("round_status", stdout=out)
        return out.getvalue()

    assert "no round yet" in status()
    out = io.StringIO()
    call_command("bootstrap_demo", "--dataset", str(registry_file), stdout=out, stderr=io.StringIO())
    # the banner is shown again once the demo's rounds have moved on: it names no round state
    assert "round 1 is open" not in out.getvalue()
    assert re.fullmatch(r"round 1: open \(opened [\d-]+ [\d:]+ UTC\), submissions from 0 clients\n", status())
    services.close_round(services.Actor.system("tests"), Round.objects.get())
    services.open_round(services.Actor.system("tests"))
    lines = status().splitlines()
    assert lines[0].startswith("round 2: open") and lines[1].startswith("round 1: closing (since ")


def test_round_status_names_why_a_round_failed_and_its_retry(registry):
    """A failed round was listed as 'failed (since <close>)', with neither its reason nor what to
    run; a retried one showed the time of its first close."""
    from federation.pipeline import fail_round

    system = services.Actor.system("tests")
    rnd = services.open_round(system)
    services.close_round(system, rnd)
    fail_round(rnd.pk, "no accepted submission")
    out = io.StringIO()
    call_command("round_status", stdout=out)
    assert re.fullmatch(
        r"round 1: failed \(since [\d-]+ [\d:]+ UTC\), submissions from 0 clients; failed: no accepted "
        r"submission \(it has no submission to merge, so it cannot be retried: open the next round "
        r"instead\)\n", out.getvalue()
    ), out.getvalue()  # retry_round refuses it (it named retry_round before: found by audit)
    Round.objects.filter(pk=rnd.pk).update(closed_at=Round.objects.get(pk=rnd.pk).closed_at - timedelta(days=3))
    # a client submitted meanwhile (a round with no submission to merge is not retried)
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation.models import Client, Organization, Submission

    organization = Organization.objects.create(name="Org", slug="org")
    client = Client.objects.create(organization=organization, name="c1",
                                   status=Client.Status.APPROVED)
    version = store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client", round=rnd, client=client)
    Submission.objects.create(client=client, round=rnd, idempotency_key="k", version=version,
                              request_sha256="0" * 64, response={})
    out = io.StringIO()
    call_command("round_status", stdout=out)
    assert out.getvalue().endswith("(manage.py retry_round 1 runs it again)\n"), out.getvalue()
    # a later round published: retry_round refuses it, and round_status does not name it
    later = Round.objects.create(number=2, state=Round.State.PUBLISHED)
    out = io.StringIO()
    call_command("round_status", stdout=out)
    assert out.getvalue().splitlines()[-1].endswith(
        "(round 2 is published after it, so it cannot be retried: globals are published in round "
        "order)"), out.getvalue()
    later.delete()
    services.retry_round(system, rnd.pk)
    retried = Round.objects.get(pk=rnd.pk)
    out = io.StringIO()
    call_command("round_status", stdout=out)
    since = f"{retried.attempt_started_at:%Y-%m-%d %H:%M}"
    assert out.getvalue().startswith(
        f"round 1: {retried.state} (since {since} UTC), submissions from 1 client, merge run 2"
    ), out.getvalue()


def _failed_round_the_budget_refuses_to_retry():
    """Round 1 failed with a submission to merge, and round 2, opened since, reserved the whole ε
    budget: a failed round holds no reservation, so retrying round 1 would take it again."""
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation.models import Submission
    from federation.pipeline import fail_round

    system = services.Actor.system("tests")
    services.update_settings(system, epsilon_budget=10.0)
    # ε = 10 under a field cap F* = 1: one client an edge releases its numeric fields (at a
    # smaller ε nothing would be released, and a round would reserve nothing)
    config = {"epsilon": 10.0, "field_cap": 1}
    organization = Organization.objects.create(name="Org", slug="org")
    client = Client.objects.create(organization=organization, name="c1",
                                   status=Client.Status.APPROVED)
    rnd = services.open_round(system, config)
    assert rnd.fields_not_released == []
    version = store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client", round=rnd, client=client)
    Submission.objects.create(client=client, round=rnd, idempotency_key="k", version=version,
                              request_sha256="0" * 64, response={})
    services.close_round(system, rnd)
    fail_round(rnd.pk, "the worker died")  # a failed round holds no reservation
    services.open_round(system, config)  # and the next round takes the whole budget
    with pytest.raises(CommandError, match="privacy budget"):
        call_command("retry_round", "1", stdout=io.StringIO())


BUDGET_REFUSES_RETRY = (
    "the privacy budget refuses its retry now: retrying round 1 (projected round spend "
    "ε = 10) would bring the federation's committed ε′ from 10 to 20 (basic composition), "
    "above its privacy budget of 10 (committed: 0 round(s) recorded in the ledger, 1 reserved by "
    "rounds not released yet)"
)


def test_round_status_does_not_name_retry_round_for_a_round_the_budget_refuses(registry):
    """Found by audit: a failed round whose retry the privacy budget refuses (its reservation no
    longer fits: a later round reserved the rest) was listed with "manage.py retry_round N runs it
    again", and retry_round then refused it."""
    _failed_round_the_budget_refuses_to_retry()
    out = io.StringIO()
    call_command("round_status", stdout=out)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("round 1: failed") and "retry_round 1 runs it again" not in line, line
    assert line.endswith(f"({BUDGET_REFUSES_RETRY})"), line


def test_the_overview_offers_no_retry_the_budget_refuses(registry, client):
    """The Overview's Retry on such a round answered a 409 with the budget's reason once pressed;
    it now says that reason in its place, as round_status does."""
    import html

    from django.contrib.auth import get_user_model
    from django.urls import reverse

    _failed_round_the_budget_refuses_to_retry()
    client.force_login(get_user_model().objects.create_superuser("op", "op@example.org", "pw"))
    body = html.unescape(client.get(reverse("dashboard:overview")).content.decode())
    assert reverse("dashboard:round-action", args=[1, "retry"]) not in body
    assert BUDGET_REFUSES_RETRY in body


@pytest.mark.parametrize("last", ["0", "-1"])
def test_round_status_wants_at_least_one_round(last):
    # -1 was a ValueError traceback, 0 said "no round yet" whatever the rounds were
    services.open_round(services.Actor.system("tests"))
    with pytest.raises(CommandError, match="--last must be 1 or more"):
        call_command("round_status", "--last", last, stdout=io.StringIO())


def test_bootstrap_declares_the_default_numeric_fields_in_a_flushed_database(registry_file):
    from compendium.models import NumericField
    from compendium.schema import DEFAULT_NUMERIC_FIELDS

    NumericField.objects.all().delete()  # what `manage.py flush` leaves
    run(registry_file)
    assert set(NumericField.objects.values_list("name", flat=True)) == {
        spec.name for spec in DEFAULT_NUMERIC_FIELDS}
    # the demo's first round is opened with its field cap and ε, and will release statistics
    # (eight approved clients an organization: noise narrower than every clipping window)
    rnd = Round.objects.get(number=1)
    assert rnd.config["field_cap"] == services.DEMO_FIELD_CAP
    assert rnd.config["epsilon"] == services.DEMO_EPSILON
    assert rnd.fields_not_released == []
    # fields an operator declared are theirs: the demo adds none beside them
    NumericField.objects.exclude(name="calls").delete()
    run(registry_file)
    assert list(NumericField.objects.values_list("name", flat=True)) == ["calls"]


def test_bootstrap_refused_its_first_round_by_the_budget_says_so_and_changes_nothing(
    registry_file, settings
):
    """A privacy budget below one demo round's ε (an operator's choice) was a BudgetExceeded
    traceback after the operator's and the admins' passwords had been reset and the clients'
    tokens rotated, none of them shown: the logins that worked before were lost."""
    settings.SYNAPSE_EPSILON_BUDGET = 0.0001
    with pytest.raises(CommandError, match="above its privacy budget of 0.0001"):
        run(registry_file)
    assert not Organization.objects.exists() and not Round.objects.exists()
    assert not Client.objects.exists()


@pytest.mark.slow
def test_make_demo_keeps_the_printed_logins_to_the_owner(tmp_path):
    """`make demo` writes the operator's and the admins' passwords and the clients' tokens to
    SYNAPSE_DATA_DIR/demo-logins.txt: under the usual umask (022) any user of the machine could
    read them, where the secret key beside it is made 0600. The recipe is run with a stand-in
    for the virtualenv's python that prints what it is asked to run."""
    import os
    import stat
    import subprocess

    from tests.conftest import ROOT

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"ran $*\"\n")
    python.chmod(0o755)
    installed = tmp_path / "venv" / ".installed"
    installed.parent.mkdir()
    installed.touch()
    data = tmp_path / "data"
    env = dict(os.environ, SYNAPSE_DATA_DIR=str(data), SECRET_KEY="test-only")
    done = subprocess.run(
        ["sh", "-c", 'umask 022 && exec make -s -o "$1" demo VENV="$2" PY="$3"', "make",
         str(installed), str(installed.parent), str(python)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    logins = data / "demo-logins.txt"
    assert logins.read_text().startswith("ran manage.py bootstrap_demo --dataset")
    assert stat.S_IMODE(logins.stat().st_mode) == 0o600


def test_bootstrap_prints_working_addresses_for_a_url_given_without_its_final_slash(registry_file):
    # `--url http://127.0.0.1:8000` printed "http://127.0.0.1:8000api/v1/rounds/" and the like
    out, err = io.StringIO(), io.StringIO()
    call_command("bootstrap_demo", "--dataset", str(registry_file), "--url", "http://127.0.0.1:8000",
                 stdout=out, stderr=err)
    banner = out.getvalue()
    assert "SYNAPSE is starting on http://127.0.0.1:8000/\n" in banner
    assert "API: http://127.0.0.1:8000/api/v1/rounds/   schema: http://127.0.0.1:8000/api/schema/" in banner


def _admin_line(output: str, username: str) -> str:
    return next(line for line in output.splitlines() if f"username: {username} " in line)


def test_a_reseed_reissues_the_admins_passwords_through_the_people_service_audited(registry_file):
    """The demo's admin logins were created and their passwords re-issued with no audit entry;
    a re-issue left the login's sessions and personal API tokens working."""
    from django.test import Client as BrowserClient
    from django.urls import reverse

    from federation.models import AuditLog, UserToken

    first = run(registry_file)
    added = AuditLog.objects.filter(action="person.add")
    assert sorted(added.values_list("details__user", flat=True)) == [
        "contoso-admin", "fabrikam-admin", "northwind-admin"]
    assert {e.actor_label for e in added} == {"bootstrap_demo"}
    assert {e.details["role"] for e in added} == {"admin"}
    old = re.search(r"username: northwind-admin\s+password: (\S+)", first).group(1)
    browser = BrowserClient()
    browser.post(reverse("login"), {"username": "northwind-admin", "password": old})
    assert browser.get(reverse("dashboard:overview")).status_code == 200
    user = authenticate(username="northwind-admin", password=old)
    services.issue_user_token(services.Actor.system("tests"), user, "script")

    second = run(registry_file)
    new = re.search(r"username: northwind-admin\s+password: (\S+)", second).group(1)
    assert new != old and authenticate(username="northwind-admin", password=old) is None
    assert authenticate(username="northwind-admin", password=new).is_active
    resets = AuditLog.objects.filter(action="person.password_reset")
    assert sorted(resets.values_list("details__user", flat=True)) == [
        "contoso-admin", "fabrikam-admin", "northwind-admin"]
    assert resets.get(details__user="northwind-admin").details["tokens_revoked"] == 1
    assert AuditLog.objects.filter(action="person.add").count() == 3  # none added again
    assert not UserToken.objects.filter(user=user, revoked_at__isnull=True).exists()
    # the session opened with the old password is over
    assert browser.get(reverse("dashboard:overview")).status_code == 302


def test_a_reseed_leaves_a_deactivated_admin_deactivated_and_says_so(registry_file):
    """Rerunning the demo's bootstrap silently reactivated a login an admin or the operator had
    deactivated, with a fresh password and no audit entry."""
    from federation import people
    from federation.models import AuditLog

    first = run(registry_file)
    membership = Membership.objects.get(user__username="northwind-admin")
    people.set_active(services.Actor.system("tests"), membership, False)
    hashed = membership.user.password
    old = re.search(r"username: northwind-admin\s+password: (\S+)", first).group(1)

    second = run(registry_file)
    membership.user.refresh_from_db()
    assert not membership.user.is_active and membership.user.password == hashed
    line = _admin_line(second, "northwind-admin")
    assert "password:" not in line and "deactivated" in line, line
    assert authenticate(username="northwind-admin", password=old) is None
    assert not AuditLog.objects.filter(
        action__in=["person.reactivate", "person.password_reset"], details__user="northwind-admin"
    ).exists()
    # the other organizations' admins are re-issued as before
    other = re.search(r"username: contoso-admin\s+password: (\S+)", second).group(1)
    assert authenticate(username="contoso-admin", password=other).is_active


@pytest.mark.parametrize("where", ["another organization", "no organization", "a member"])
def test_a_reseed_leaves_a_login_that_is_no_longer_the_organizations_admin_as_it_is(
    registry_file, where
):
    """The bootstrap moved any login of the admin's name into the organization as its admin
    (set_membership) and gave it a fresh password: a login in another organization, one in none
    (an operator's or staff login made in the Django admin) or one demoted to member."""
    from django.contrib.auth import get_user_model

    from federation import people
    from federation.models import AuditLog

    system = services.Actor.system("tests")
    if where == "a member":
        run(registry_file)
        membership = Membership.objects.get(user__username="northwind-admin")
        people.set_role(system, membership, Membership.Role.MEMBER)
        user = membership.user
    elif where == "another organization":
        other = services.create_organization(system, "Other", "other", "")
        user = people.add_person(system, other, "northwind-admin", "member").membership.user
    else:
        user = get_user_model().objects.create_user("northwind-admin", password="kept-as-it-is")
    hashed = user.password
    before = list(Membership.objects.filter(user=user).values_list("organization__slug", "role"))

    output = run(registry_file)
    user.refresh_from_db()
    assert user.password == hashed and user.is_active
    assert list(Membership.objects.filter(user=user).values_list("organization__slug", "role")) == before
    line = _admin_line(output, "northwind-admin")
    assert "password:" not in line and "not northwind's admin" in line, line
    assert not AuditLog.objects.filter(
        action__in=["person.password_reset", "membership.set"], details__user="northwind-admin"
    ).exists()


def test_the_operator_login_is_added_and_reissued_audited(registry_file):
    """The demo's operator login was created, re-issued a password and made an active superuser
    again on every start with no audit entry."""
    from django.contrib.auth import get_user_model

    from federation.models import AuditLog

    run(registry_file)
    added = AuditLog.objects.get(action="user.add", target_label="operator")
    assert added.actor_label == "bootstrap_demo" and added.details["user"] == "operator"
    assert "password" not in json.dumps(added.details)
    operator = get_user_model().objects.get(username="operator")
    operator.is_active = False
    operator.save()
    second = run(registry_file)
    new = re.search(r"username: operator\s+password: (\S+)", second).group(1)
    assert authenticate(username="operator", password=new).is_superuser
    reissued = AuditLog.objects.get(action="user.password", target_label="operator")
    assert reissued.details["changes"] == {"is_active": {"from": False, "to": True}}
    assert new not in json.dumps(reissued.details)
    run(registry_file)
    again = AuditLog.objects.filter(action="user.password", target_label="operator").latest("id")
    assert again.pk != reissued.pk and "changes" not in again.details
    assert AuditLog.objects.filter(action="user.add", target_label="operator").count() == 1


def test_a_demo_of_another_dataset_in_a_folder_that_played_one_is_refused(registry_file, tmp_path):
    """make demo DATASET=other in the data folder of a played demo: the rounds were found and not
    played again, and the other dataset's tools only added to the registry beside the first's,
    the pages showing the first dataset's federation. Refused, changing nothing; the same
    dataset again, or another before anything was played, goes on."""
    from compendium.models import CompendiumVersion, Tool

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"tool_id": "translate", "name": "translate",
                                 "description": "the translate tool", "category": "Demo"}))
    run(registry_file)
    run(other)  # nothing played yet: added, as import_tools does
    assert Tool.objects.filter(tool_id="translate").exists()
    Tool.objects.filter(tool_id="translate").delete()
    CompendiumVersion.objects.create(kind="global", round=Round.objects.get(), content={},
                                     size_bytes=2, gzip_bytes=2)
    third = tmp_path / "third.jsonl"
    third.write_text(other.read_text().replace("translate", "currency"))
    with pytest.raises(CommandError) as refused:
        run(third)
    assert str(refused.value).startswith(
        "this data folder played the demo on another registry (3 active tools are not in "
        f"{third}, e.g. 'calculator')")
    assert "SYNAPSE_DATA_DIR=.data/NAME" in str(refused.value)
    assert not Tool.objects.filter(tool_id="currency").exists()
    assert "round 1 is open" in run(registry_file)
