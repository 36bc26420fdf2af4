"""Management commands an operator runs by hand: a bad argument is one line (CommandError), never a
traceback, and changes nothing."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from federation.models import AuditLog, UserToken
from tests.federation_fixtures import make_user

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


@pytest.mark.parametrize("revoke", [False, True])
def test_routing_token_refuses_a_name_that_is_not_utf8_in_one_line(revoke):
    from routing.models import RoutingToken

    # `routing_token $'app\xff'`: Python hands argv's undecodable byte on as a lone surrogate,
    # which was a UnicodeEncodeError traceback from the database driver
    with pytest.raises(CommandError, match="must be UTF-8 text: 'app\\\\udcff' holds an undecodable"):
        run("routing_token", "app\udcff", *(["--revoke"] if revoke else []))
    assert not RoutingToken.objects.exists()


@pytest.mark.parametrize("where", ["missing/schema.json", "."])
def test_export_schema_to_a_path_it_cannot_write_says_so_in_one_line(registry, tmp_path, where):
    # a folder that does not exist, or a folder itself: was a FileNotFoundError / IsADirectoryError
    # traceback
    with pytest.raises(CommandError, match="cannot write the schema to"):
        run("export_schema", "--out", str(tmp_path / where))
    assert not (tmp_path / "missing").exists()


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


def test_round_status_with_more_rounds_than_any_federation_has_lists_them_all():
    from federation import services

    services.open_round(services.Actor.system("tests"))
    # was a traceback of django.db.DataError (bigint out of range, in the query's LIMIT)
    assert run("round_status", "--last", str(10**20)).startswith("round 1: open")


@pytest.mark.parametrize("every", ["nan", "inf"])
def test_close_due_rounds_refuses_an_interval_that_is_not_a_finite_number(every):
    # was a traceback of time.sleep's ValueError (nan) or OverflowError (inf), after one check
    with pytest.raises(CommandError, match="--every must be a finite number of seconds"):
        run("close_due_rounds", "--every", every)


def test_erase_client_reads_only_ascii_digits_as_an_id():
    # "²" passes str.isdigit but not int(): was a ValueError traceback
    with pytest.raises(CommandError, match="no client '²'"):
        run("erase_client", "²")
