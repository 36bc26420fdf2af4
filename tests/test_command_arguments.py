"""Management commands an operator runs by hand: a bad argument is one line (CommandError), never a
traceback, and changes nothing."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from federation.models import AuditLog, UserToken
from tests.federation_fixtures import SYSTEM, make_user

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_issue_user_token_refuses_a_label_too_long_in_one_line():
    # was a traceback of federation.errors.InvalidRequest
    user = make_user("carol")
    with pytest.raises(CommandError, match="label is at most 100 characters"):
        run("issue_user_token", "carol", "--label", "x" * 101)
    assert not UserToken.objects.filter(user=user).exists()
    assert not AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).exists()
    assert run("issue_user_token", "carol", "--label", "x" * 100).startswith("syn_u_")


def test_issue_user_token_names_the_login_a_username_differs_from_only_in_case(world):
    """Found by audit: `issue_user_token Member_A` said "no user 'Member_A'" although the login
    member_a exists (usernames are unique in any case; a token is issued as written)."""
    with pytest.raises(CommandError) as refused:
        run("issue_user_token", "Member_A")
    assert str(refused.value) == "no user 'Member_A' (usernames are case-sensitive: 'member_a'?)"
    assert not UserToken.objects.exists()
    with pytest.raises(CommandError, match=r"^no user 'nobody'$"):
        run("issue_user_token", "nobody")


def test_issue_user_token_refuses_a_deactivated_login(world):
    """It printed a token for a deactivated login: one that answered 401 "invalid token" while
    the login stayed off, then started working on any reactivation (by an admin of the
    organization too), although a deactivation is meant to stop every token of that login."""
    from federation import people

    people.set_active(SYSTEM, world.member_a.membership, False)
    with pytest.raises(CommandError, match="member_a is deactivated"):
        run("issue_user_token", "member_a")
    assert not UserToken.objects.filter(user=world.member_a).exists()
    assert not AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).exists()
    people.set_active(SYSTEM, world.member_a.membership, True)
    assert run("issue_user_token", "member_a").startswith("syn_u_")


def test_a_person_deactivated_while_their_request_runs_gets_no_token(world):
    """The dashboard issues a token to request.user, authenticated before a deactivation that
    may have committed since: the service reads the login as the database holds it."""
    from django.contrib.auth import get_user_model

    from federation import services
    from federation.errors import InvalidRequest

    stale = get_user_model().objects.get(pk=world.member_a.pk)
    get_user_model().objects.filter(pk=stale.pk).update(is_active=False)
    with pytest.raises(InvalidRequest, match="deactivated"):
        services.issue_user_token(services.Actor.for_user(stale), stale)
    assert not UserToken.objects.filter(user=stale).exists()


def test_routing_token_refuses_a_name_longer_than_its_column_in_one_line():
    from routing.models import RoutingToken

    # was a traceback of django.db.DataError (value too long for character varying(200))
    with pytest.raises(CommandError, match="at most 200 characters"):
        run("routing_token", "x" * 201)
    assert not RoutingToken.objects.exists()
    assert run("routing_token", "x" * 200).startswith("rt_")


@pytest.mark.parametrize("name", ["", "   "])
def test_routing_token_refuses_an_empty_name(name):
    from routing.models import RoutingToken

    # was a token named "" (what `routing_token "$NAME"` issues with NAME unset)
    with pytest.raises(CommandError, match="needs a name"):
        run("routing_token", name)
    assert not RoutingToken.objects.exists()


@pytest.mark.parametrize("name", [" my-app", "my-app ", "my-app\t"])
def test_routing_token_refuses_a_name_that_starts_or_ends_with_a_space(name):
    """Found by audit: `routing_token "my-app "` issued a token whose name read as my-app in the
    audit log, and `routing_token my-app --revoke` answered "no routing token named 'my-app'"."""
    from routing.models import RoutingToken

    with pytest.raises(CommandError, match="cannot start or end with a space"):
        run("routing_token", name)
    assert not RoutingToken.objects.exists()
    assert not AuditLog.objects.filter(action=AuditLog.Action.TOKEN_ISSUE).exists()


def test_routing_token_issue_and_revoke_are_audited_without_the_token():
    """The README says the routing-token command is audited; neither issuing nor revoking wrote
    an entry, so nobody could tell who let an application route or when it was stopped."""
    from routing.models import RoutingToken

    raw = run("routing_token", "my-app").strip()
    issued = AuditLog.objects.get(action=AuditLog.Action.TOKEN_ISSUE)
    row = RoutingToken.objects.get(name="my-app")
    assert (issued.actor_label, issued.target_type, issued.target_id, issued.details) == (
        "manage.py routing_token", "routingtoken", str(row.pk), {"routing_token": "my-app"}
    )
    assert raw not in str(issued.details) and raw not in issued.target_label
    with pytest.raises(CommandError, match="a routing token named 'my-app' exists"):
        run("routing_token", "my-app")
    assert run("routing_token", "my-app", "--revoke") == "revoked routing token my-app\n"
    run("routing_token", "my-app", "--revoke")  # again: nothing changes, nothing more audited
    revoked = AuditLog.objects.get(action=AuditLog.Action.TOKEN_REVOKE)
    assert revoked.target_id == str(row.pk) and revoked.details == {"routing_token": "my-app"}
    with pytest.raises(CommandError, match="no routing token named 'other'"):
        run("routing_token", "other", "--revoke")
    assert AuditLog.objects.count() == 2


def test_a_revoked_routing_token_name_is_issued_again_with_a_new_secret():
    """An operator replacing an application's leaked token revoked it, then was told the name
    'exists; pick another name'. The name is issued again: the new token routes, the old one
    stays refused, and both issues are audited on the one row."""
    from routing.authentication import RoutingTokenAuthentication
    from routing.models import RoutingToken

    old = run("routing_token", "my-app").strip()
    with pytest.raises(CommandError, match="revoke it first"):
        run("routing_token", "my-app")
    run("routing_token", "my-app", "--revoke")
    new = run("routing_token", "my-app").strip()
    assert new.startswith("rt_") and new != old
    row = RoutingToken.objects.get(name="my-app")
    assert not row.revoked
    assert list(AuditLog.objects.order_by("pk").values_list("action", "target_id")) == [
        ("token.issue", str(row.pk)), ("token.revoke", str(row.pk)), ("token.issue", str(row.pk))]
    from rest_framework.test import APIRequestFactory

    def caller(token):
        request = APIRequestFactory().get("/", HTTP_AUTHORIZATION=f"Bearer {token}")
        return RoutingTokenAuthentication().authenticate(request)

    assert caller(new)[1].pk == row.pk
    assert caller(old) is None  # refused: left to the next authenticator, which answers 401


@pytest.mark.parametrize("revoke", [False, True])
def test_routing_token_refuses_a_name_that_is_not_utf8_in_one_line(revoke):
    from routing.models import RoutingToken

    # `routing_token $'app\xff'`: Python hands argv's undecodable byte on as a lone surrogate,
    # which was a UnicodeEncodeError traceback from the database driver
    with pytest.raises(CommandError, match="must be UTF-8 text: 'app\\\\udcff' holds an undecodable"):
        run("routing_token", "app\udcff", *(["--revoke"] if revoke else []))
    assert not RoutingToken.objects.exists()


UNDECODABLE, NUL = "must be UTF-8 text: .* holds an undecodable byte", "cannot hold a NUL character"


@pytest.mark.parametrize(
    "args, what, problem",
    [
        (["erase_client", "acme/app\udcff"], "a client", UNDECODABLE),
        (["issue_user_token", "root\udcff"], "a username", UNDECODABLE),
        (["issue_user_token", "root", "--label", "ci\udcff"], "a token's label", UNDECODABLE),
        (["unlock_login", "root\udcff"], "a username", UNDECODABLE),
        (["routing_token", "app\x00"], "a routing token's name", NUL),
        (["erase_client", "acme/app\x00"], "a client", NUL),
        (["issue_user_token", "root\x00"], "a username", NUL),
        (["issue_user_token", "root", "--label", "ci\x00"], "a token's label", NUL),
        (["unlock_login", "root\x00"], "a username", NUL),
    ],
)
def test_commands_refuse_text_postgresql_cannot_hold_in_one_line(args, what, problem):
    # a shell argument's undecodable byte reaches the command as a lone surrogate, and
    # call_command can pass a NUL (a shell cannot): these were tracebacks from the database
    # driver (UnicodeEncodeError, DataError), as routing_token's name had been
    make_user("root", superuser=True)
    with pytest.raises(CommandError, match=f"{what} {problem}"):
        run(*args)
    assert not UserToken.objects.exists() and not AuditLog.objects.exists()


@pytest.mark.parametrize("where", ["missing/schema.json", "."])
def test_export_schema_to_a_path_it_cannot_write_says_so_in_one_line(registry, tmp_path, where):
    # a folder that does not exist, or a folder itself: was a FileNotFoundError / IsADirectoryError
    # traceback
    with pytest.raises(CommandError, match="cannot write the schema to"):
        run("export_schema", "--out", str(tmp_path / where))
    assert not (tmp_path / "missing").exists()


def test_export_schema_that_cannot_be_written_whole_leaves_the_file_it_replaces(registry, tmp_path):
    """Found by audit: the schema was written in place, so a write that failed midway (the disk
    full, here a file size limit) left half a JSON document where clients read the schema."""
    import resource
    import signal

    schema = tmp_path / "schema.json"
    schema.write_text('{"previous": true}')
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the process killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, limits[1]))
    try:
        with pytest.raises(CommandError, match="cannot write the schema to .*schema.json: File too large"):
            run("export_schema", "--out", str(schema))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert schema.read_text() == '{"previous": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["schema.json"]  # no temporary file left
    assert run("export_schema", "--out", str(schema)) == f"schema written to {schema}\n"
    assert '"tools"' in schema.read_text()


def test_import_probe_set_refuses_a_negative_seed_in_one_line(registry, tmp_path):
    from federation.models import ProbeQuery
    from tests.merge_helpers import write_probe_dataset

    folder = write_probe_dataset(tmp_path / "probe")
    # was a traceback of numpy's ValueError "expected non-negative integer"
    with pytest.raises(CommandError, match="--seed must be 0 or more"):
        run("import_probe_set", str(folder), "--seed", "-1")
    assert not ProbeQuery.objects.exists()


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_demo_rounds_refuses_a_seed_no_round_can_take_before_doing_anything(registry, tmp_path, seed):
    from federation.models import ProbeQuery, Round
    from tests.merge_helpers import write_probe_dataset

    folder = write_probe_dataset(tmp_path / "probe")
    # -1 was numpy's ValueError traceback; 2**63 replaced the probe set, then was a traceback of
    # RoundConfig's ValidationError when the first round was opened
    with pytest.raises(CommandError, match="--seed"):
        run("demo_rounds", "--dataset", str(folder), "--seed", seed)
    assert not ProbeQuery.objects.exists() and not Round.objects.exists()


def _demo_clients():
    """The demo federation's organizations and approved clients, without its round."""
    from federation import services

    for name, slug, client_names in services.DEMO_ORGANIZATIONS:
        org = services.create_organization(SYSTEM, name, slug)
        for client_name in client_names:
            services.approve_client(SYSTEM, services.enroll_client(SYSTEM, org, client_name, ""))


def test_demo_rounds_refused_a_round_by_the_budget_says_so_in_one_line(registry, tmp_path,
                                                                     settings):
    from federation.models import Round
    from tests.merge_helpers import write_probe_dataset

    folder = write_probe_dataset(tmp_path / "probe")
    _demo_clients()
    settings.SYNAPSE_EPSILON_BUDGET = 0.0001
    # `demo_rounds --rounds 12` under the default budget of 10: the round past it was a traceback
    # of BudgetExceeded from opening it
    with pytest.raises(CommandError, match="above its privacy budget of 0.0001"):
        run("demo_rounds", "--dataset", str(folder), "--rounds", "1")
    assert not Round.objects.exists()


def test_demo_rounds_with_an_embedding_model_that_cannot_be_loaded_says_so_in_one_line(
    registry, tmp_path, monkeypatch
):
    from tests.merge_helpers import write_probe_dataset

    folder = write_probe_dataset(tmp_path / "probe")
    _demo_clients()
    monkeypatch.setenv("SYNAPSE_EMBEDDING_MODEL", str(tmp_path / "no-such-model"))
    # was a traceback of EmbeddingModelUnavailable (simulate says it in one line)
    with pytest.raises(CommandError, match="cannot load embedding model .*no-such-model"):
        run("demo_rounds", "--dataset", str(folder), "--rounds", "1")


def test_demo_rounds_without_the_demo_federation_says_to_bootstrap_it_first(registry, tmp_path):
    from federation.models import ProbeQuery, Round
    from tests.merge_helpers import write_probe_dataset

    folder = write_probe_dataset(tmp_path / "probe")
    # was "demo round 1 ended failed: round 1 has no submissions to merge", after opening (and
    # failing) a round at every run
    with pytest.raises(CommandError, match="no approved demo clients.*manage.py bootstrap_demo"):
        run("demo_rounds", "--dataset", str(folder), "--rounds", "1")
    assert not Round.objects.exists() and not ProbeQuery.objects.exists()


def test_round_status_with_more_rounds_than_any_federation_has_lists_them_all():
    from federation import services

    services.open_round(services.Actor.system("tests"))
    # was a traceback of django.db.DataError (bigint out of range, in the query's LIMIT)
    assert run("round_status", "--last", str(10**20)).startswith("round 1: open")


@pytest.mark.parametrize("every", ["nan", "inf", "-60", "1e10", "0.001"])
def test_close_due_rounds_refuses_an_interval_that_is_not_a_finite_number(every):
    # was a traceback of time.sleep's ValueError (nan) or OverflowError (inf), after one check;
    # a negative interval checked once and ended without a word
    # (0.001: a loop that queried the database a thousand times a second)
    with pytest.raises(CommandError,
                       match=r"--every must be 0 \(check once\) or a number of seconds from 1 to 86400"):
        run("close_due_rounds", "--every", every)


def test_close_due_rounds_in_a_loop_ends_quietly_when_interrupted(monkeypatch):
    from federation.management.commands import close_due_rounds

    def interrupted(seconds):
        assert seconds == 60
        raise KeyboardInterrupt

    monkeypatch.setattr(close_due_rounds.time, "sleep", interrupted)
    # "check every N seconds until interrupted": Ctrl-C, the documented way to end it, was a
    # KeyboardInterrupt traceback
    try:
        out = run("close_due_rounds", "--every", "60")
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the command: a traceback")
    assert out == ""


@pytest.mark.django_db(transaction=True)
def test_close_due_rounds_in_a_loop_survives_a_database_that_fails_one_check(monkeypatch):
    """Found by audit: `close_due_rounds --every 60`, run unattended, ended with a traceback the
    first time the database failed a check (restarted, out of reach for a moment), and no round
    closed at its deadline after that. Checked once (cron), the failure still ends the command."""
    from django.db import OperationalError

    from federation.management.commands import close_due_rounds

    checks, sleeps = [], []

    def check():
        checks.append(1)
        if len(checks) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(close_due_rounds, "close_due_rounds", check)
    monkeypatch.setattr(close_due_rounds.time, "sleep", sleep)
    out, err = io.StringIO(), io.StringIO()
    call_command("close_due_rounds", "--every", "60", stdout=out, stderr=err)
    assert len(checks) == 2 and sleeps == [60, 60]
    assert err.getvalue().strip() == (
        "close_due_rounds: the check failed (server closed the connection unexpectedly); "
        "checking again in 60 s")
    checks.clear()
    with pytest.raises(OperationalError):
        run("close_due_rounds")


@pytest.mark.parametrize("command", ["import_tools", "import_probe_set"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(command, tmp_path, monkeypatch):
    """Found by audit: `import_tools "$DATASET"` with DATASET unset read "" as the current folder
    and imported the tools.jsonl (and queries.jsonl) that happened to be there."""
    from compendium.models import Tool
    from federation.models import ProbeQuery

    (tmp_path / "tools.jsonl").write_text('{"tool_id": "stray", "name": "Stray", "description": "d"}\n')
    (tmp_path / "queries.jsonl").write_text('{"query": "q", "tool_id": "stray"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CommandError, match="^the path is empty: name a file or folder$"):
        run(command, "")
    assert not Tool.objects.filter(tool_id="stray").exists() and not ProbeQuery.objects.exists()


def test_erase_client_of_a_pending_client_does_not_say_its_token_submits(world):
    """Found by audit: erasing a client still pending approval said "its token still submits";
    a pending client has no token (approval issues it)."""
    out = run("erase_client", "org-a/a-pending").splitlines()
    assert out[-1] == (
        "org-a/a-pending is still enrolled (pending approval): it has no token yet, and approving "
        "it would let it submit; revoke it on its organization's page if it is to send nothing")


def test_erase_client_reads_only_ascii_digits_as_an_id():
    # "²" passes str.isdigit but not int(): was a ValueError traceback
    with pytest.raises(CommandError, match="no client '²'"):
        run("erase_client", "²")


def published_global(settings, tmp_path):
    """Round 1 published with a one-scenario global over the pipeline tests' registry; the data
    folder (where tuned routers go) in `tmp_path`."""
    from compendium.schema import Compendium, Scenario
    from compendium.services import import_registry, store_compendium
    from federation.models import Round
    from tests.merge_helpers import TOOLS

    settings.DATA_DIR = tmp_path
    import_registry(TOOLS)
    rnd = Round.objects.create(number=1, state="published")
    store_compendium(Compendium(scenarios=[Scenario(tool_id="weather", text="rain in Paris?")]),
                     kind="global", round=rnd)
    return rnd


@pytest.mark.parametrize("epochs", ["32768", str(10**12)])
def test_tune_router_refuses_more_epochs_than_its_row_can_record_in_one_line(epochs, settings,
                                                                             tmp_path):
    from routing.models import TunedRouter

    published_global(settings, tmp_path)
    # was a traceback of django.db.DataError (smallint out of range) writing the tuning's row
    with pytest.raises(CommandError, match="epochs must be at most 32767, not "):
        run("tune_router", "--epochs", epochs)
    assert not TunedRouter.objects.exists()


def test_tune_router_says_so_when_the_global_was_replaced_before_its_tuning(monkeypatch, settings,
                                                                          tmp_path):
    from federation.management.commands import tune_router

    published_global(settings, tmp_path)
    # an erasure re-materialized the round meanwhile: the version is gone (None)
    monkeypatch.setattr(tune_router, "tune_published_router", lambda *args, **kwargs: None)
    # was "round 1: tuning None: the version disappeared"
    with pytest.raises(CommandError) as refused:
        run("tune_router", "--epochs", "1")
    assert str(refused.value) == (
        "round 1: its global compendium was replaced (re-materialized) before it could be tuned; "
        "run tune_router again to tune the one published now"
    )


@pytest.mark.django_db(transaction=True)  # as the command runs: the retry commits, then returns
def test_retry_round_says_how_the_retry_ended_without_a_broker(registry, monkeypatch):
    from compendium.schema import Compendium
    from compendium.services import store_compendium
    from federation import pipeline, services
    from federation.models import Client, Organization, Round

    system = services.Actor.system("tests")
    rnd = services.open_round(system)
    services.close_round(system, rnd)  # nothing was submitted: the pipeline fails it
    assert Round.objects.get(number=1).state == "failed"
    # a retry would fail again at once: refused, saying so
    with pytest.raises(CommandError, match="has no submission to merge.*open the next round"):
        run("retry_round", "1")
    organization = Organization.objects.create(name="Org", slug="org")
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "weather", "text": "Will it rain"}]}), kind="client", round=rnd,
        client=Client.objects.create(organization=organization, name="c1",
                                     status=Client.Status.APPROVED))

    def broken(round_id, attempt=None):
        raise RuntimeError("merge machinery broke")

    monkeypatch.setattr(pipeline, "start_round", broken)
    out = run("retry_round", "1")
    # was "round 1 is closing again; the merge pipeline was started": the eager pipeline had
    # already failed it again, and the reason was not said
    assert Round.objects.get(number=1).state == "failed"
    assert out.strip() == (
        "round 1 retried; its merge failed: starting the merge failed: merge machinery broke")


@pytest.mark.parametrize("linked", [False, True])
def test_simulate_refuses_an_out_that_is_a_pipe_before_running(tmp_path, linked):
    """`simulate --out` is written by renaming a temporary file over it: over a pipe or a device
    that put a regular file in its place (`--out /dev/null`, run as root, replaced /dev/null).
    Refused before anything runs, the pipe left as it is."""
    import os
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = fifo
    if linked:
        out = tmp_path / "report.json"
        out.symlink_to(fifo)
    with pytest.raises(CommandError, match=re.escape(
        f"--out {out} is a pipe (FIFO), not a regular file; name a file"
    )):
        run("simulate", "--dataset", str(tmp_path / "none"), "--in-memory", "--out", str(out))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)



def _router_tuned_an_hour_ago(settings, tmp_path):
    """A published global whose tuned router is ready, finished an hour ago (returned)."""
    import datetime as dt

    from django.utils import timezone

    from compendium.models import CompendiumVersion
    from routing.models import TunedRouter

    published_global(settings, tmp_path)
    version = CompendiumVersion.objects.get(kind=CompendiumVersion.Kind.GLOBAL)
    folder = tmp_path / "routers" / "round-1"
    folder.mkdir(parents=True)
    finished = timezone.now() - dt.timedelta(hours=1)
    TunedRouter.objects.create(
        version=version, state=TunedRouter.State.READY, epochs=1, directory=str(folder), rows=40,
        seconds=1649.0, device="cpu", probe_accuracy=0.9, frozen_probe_accuracy=0.8,
        finished_at=finished,
    )
    return finished


def test_tune_router_says_a_router_tuned_before_was_not_tuned_again(settings, tmp_path):
    """A second `make demo` runs `tune_router` on a global tuned by the first: it printed
    "routing encoder tuned on N texts, … 1649 s" as if it had just tuned for half an hour. It now
    says the router was already tuned, when, and how to tune it again."""
    from routing.models import TunedRouter

    finished = _router_tuned_an_hour_ago(settings, tmp_path)
    out = run("tune_router", "--epochs", "1")
    assert out.startswith("round 1: routing encoder already tuned at ")
    assert finished.strftime("%Y-%m-%d %H:%M") in out
    assert "(40 texts, 1 epoch(s) on cpu, 1649 s; probe top-1 (held half) 0.900 tuned, " in out
    assert "--force tunes it again" in out
    assert TunedRouter.objects.get().finished_at == finished  # nothing was tuned


def test_tune_router_force_whose_retune_fails_says_so_and_fails(settings, tmp_path, monkeypatch):
    """`tune_router --force` on a ready router whose retune failed printed "routing encoder
    already tuned at …; --force tunes it again" and exited 0: the operator who had just forced
    it learnt neither that tuning again failed nor why (the row said it, the old router stays
    served)."""
    import routing.finetune
    from routing.models import TunedRouter

    finished = _router_tuned_an_hour_ago(settings, tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(routing.finetune, "tune_router", broken)
    with pytest.raises(CommandError) as refused:
        run("tune_router", "--epochs", "1", "--force")
    assert str(refused.value) == (
        "round 1: tuning again failed (RuntimeError: out of memory); the router tuned before is "
        "still served"
    )
    record = TunedRouter.objects.get()
    assert (record.state, record.finished_at) == (TunedRouter.State.READY, finished)


@pytest.mark.django_db(transaction=True)  # as cron runs it: the close commits, then the pipeline
def test_close_due_rounds_says_how_the_merge_ended_without_a_broker(registry):
    """Without a broker (cron's `close_due_rounds`, as the README has it) the merge runs in the
    command once the close commits: it printed "the merge pipeline was started" for a round
    whose merge had already failed, without the reason (as retry_round did)."""
    import datetime as dt

    from django.utils import timezone

    from federation import services
    from federation.models import Round

    rnd = services.open_round(services.Actor.system("tests"),
                              closes_at=timezone.now() + dt.timedelta(hours=1))
    Round.objects.filter(pk=rnd.pk).update(closes_at=timezone.now() - dt.timedelta(seconds=1))
    out = run("close_due_rounds")
    rnd.refresh_from_db()
    assert rnd.state == "failed"  # nothing was submitted
    assert out.strip().endswith(f"UTC); its merge failed: {rnd.failure_reason}")
