"""Round deadlines: a round opened with `closes_at` stops taking submissions then and is closed by
`close_due_rounds` (Celery beat's task, or the management command); the operator sets, moves or
removes the deadline in the API and on the dashboard."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from federation import services
from federation.errors import InvalidRequest, InvalidTransition, NoOpenRound, NotAllowed
from federation.models import AuditLog, Round
from tests.federation_fixtures import SYSTEM

pytestmark = pytest.mark.django_db

SUBMIT = "/api/v1/submissions/"


def later(minutes: float = 60) -> dt.datetime:
    return timezone.now() + dt.timedelta(minutes=minutes)


def expire(rnd: Round) -> None:
    """Move the deadline into the past, as time passing would."""
    Round.objects.filter(pk=rnd.pk).update(closes_at=timezone.now() - dt.timedelta(seconds=1))


def api_for(user=None, token: str | None = None) -> APIClient:
    api = APIClient()
    token = token or services.issue_user_token(SYSTEM, user)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return api


def submit(token: str, doc: dict, key: str = "k"):
    return api_for(token=token).post(
        SUBMIT, json.dumps(doc), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )


def test_a_deadline_must_lie_in_the_future_and_name_its_time_zone(world):
    with pytest.raises(InvalidRequest, match="has passed"):
        services.open_round(SYSTEM, closes_at=timezone.now() - dt.timedelta(minutes=1))
    with pytest.raises(InvalidRequest, match="time zone"):
        services.open_round(SYSTEM, closes_at=dt.datetime(2099, 1, 1, 12, 0))
    assert not Round.objects.exists()
    rnd = services.open_round(SYSTEM, closes_at=later())
    entry = AuditLog.objects.get(action="round.open")
    assert entry.details["closes_at"] == rnd.closes_at.isoformat()


def test_a_deadline_past_the_last_representable_utc_time_is_refused_not_stored(world):
    # 9999-12-31T23:59-05:00 is 10000-01-01 in UTC: PostgreSQL stores it, Python cannot read it
    # back, and every page listing rounds failed.
    beyond = dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    with pytest.raises(InvalidRequest, match="past 9999-12-31"):
        services.open_round(SYSTEM, closes_at=beyond)
    rnd = services.open_round(SYSTEM)
    with pytest.raises(InvalidRequest, match="past 9999-12-31"):
        services.set_round_deadline(SYSTEM, rnd, beyond)
    assert Round.objects.get().closes_at is None
    assert not AuditLog.objects.filter(action="round.deadline").exists()
    # the last minute that is still 9999 in UTC is a (far) deadline like any other
    last = dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    assert services.set_round_deadline(SYSTEM, rnd, last).closes_at == last
    assert Round.objects.get().closes_at == last


@pytest.mark.parametrize(
    "raw", ["2030-02-30T10:00", "2030-13-01T10:00", "2030-01-01T25:00", "2030-01-01T10:00+99:00",
            "9999-12-31T23:59-05:00"],
)
def test_the_dashboard_refuses_a_deadline_that_is_no_time_with_a_400(client, world, raw):
    client.force_login(world.operator)
    response = client.post(reverse("dashboard:round-open"), {"epsilon": "1", "closes_at": raw})
    assert response.status_code == 400 and "closes_at" in response.content.decode()
    assert not Round.objects.exists()
    assert client.get(reverse("dashboard:overview")).status_code == 200


def test_submissions_stop_at_the_deadline_with_a_reason(world, valid_doc):
    rnd = services.open_round(SYSTEM, closes_at=later())
    assert submit(world.token_a, valid_doc, "before").status_code == 201
    expire(rnd)
    late = submit(world.token_a, valid_doc, "after")
    assert late.status_code == 409
    assert f"round {rnd.number} stopped taking submissions at its deadline" in late.json()["detail"]
    # a retry of a submission that made it is still answered from what was stored
    assert submit(world.token_a, valid_doc, "before").status_code == 201
    # once the round is closed the refusal is the plain one
    services.close_round(SYSTEM, rnd)
    assert submit(world.token_a, valid_doc, "closed").json()["detail"] == NoOpenRound().detail


def test_close_due_rounds_closes_only_the_round_whose_deadline_came(world):
    rnd = services.open_round(SYSTEM, closes_at=later(5))
    assert services.close_due_rounds() == []
    assert services.close_due_rounds(now=later(6))[0].pk == rnd.pk
    rnd.refresh_from_db()
    assert rnd.state == "closing" and rnd.closed_at is not None
    entry = AuditLog.objects.get(action="round.close")
    assert entry.actor is None and entry.actor_label == "round deadline"
    assert services.close_due_rounds(now=later(7)) == []  # nothing open: nothing to do


@pytest.mark.parametrize("moved_to", ["later", "none"])
def test_a_deadline_moved_while_the_closer_waits_for_the_round_keeps_it_open(
    world, monkeypatch, moved_to
):
    rnd = services.open_round(SYSTEM, closes_at=later())
    expire(rnd)
    lock = services._locked_round

    def operator_moves_it_first(pk):
        # The operator's set_round_deadline commits after the closer listed the round as due
        # and before the closer gets its lock.
        monkeypatch.setattr(services, "_locked_round", lock)
        services.set_round_deadline(SYSTEM, pk, later(60) if moved_to == "later" else None)
        return lock(pk)

    monkeypatch.setattr(services, "_locked_round", operator_moves_it_first)
    assert services.close_due_rounds() == []
    assert Round.objects.get(pk=rnd.pk).state == "open"
    assert not AuditLog.objects.filter(action="round.close").exists()


def test_a_round_without_a_deadline_is_never_closed_by_the_clock(world):
    services.open_round(SYSTEM)
    assert services.close_due_rounds(now=later(10**6)) == []
    assert Round.objects.get().state == "open"


def test_the_command_and_the_celery_task_close_a_due_round(world, settings):
    from synapse_web.celery import app
    from workers.tasks import close_due_rounds_task

    # the beat schedule names the task the worker registers
    schedule = settings.CELERY_BEAT_SCHEDULE["close-due-rounds"]
    assert schedule["task"] == close_due_rounds_task.name and schedule["task"] in app.tasks

    first = services.open_round(SYSTEM, closes_at=later())
    out = io.StringIO()
    call_command("close_due_rounds", stdout=out)
    assert out.getvalue() == "" and Round.objects.get(pk=first.pk).state == "open"
    expire(first)
    call_command("close_due_rounds", stdout=out)
    assert f"round {first.number} closed at its deadline" in out.getvalue()
    Round.objects.filter(pk=first.pk).update(state="published")
    second = services.open_round(SYSTEM, closes_at=later())
    expire(second)
    assert close_due_rounds_task.apply().get() == [second.number]
    assert Round.objects.get(pk=second.pk).state == "closing"


def test_the_operator_sets_moves_and_removes_the_deadline(world):
    rnd = services.open_round(SYSTEM)
    target = later(30)
    services.set_round_deadline(SYSTEM, rnd, target)
    assert Round.objects.get(pk=rnd.pk).closes_at == target
    services.set_round_deadline(SYSTEM, rnd, target)  # unchanged: no second entry
    services.set_round_deadline(SYSTEM, rnd, None)
    assert Round.objects.get(pk=rnd.pk).closes_at is None
    entries = list(AuditLog.objects.filter(action="round.deadline").order_by("id"))
    assert [e.details["closes_at"] for e in entries] == [target.isoformat(), None]
    assert entries[1].details["previous"] == target.isoformat()
    with pytest.raises(NotAllowed):
        services.set_round_deadline(world.actor(world.admin_a), rnd, later())
    services.close_round(SYSTEM, rnd)
    with pytest.raises(InvalidTransition, match="only an open round"):
        services.set_round_deadline(SYSTEM, rnd, later())


def test_deadlines_through_the_api(world):
    operator = api_for(world.operator)
    bad = operator.post("/api/v1/admin/rounds/", {"closes_at": "2001-01-01T00:00:00Z"}, format="json")
    assert bad.status_code == 400 and "has passed" in bad.json()["detail"]
    garbled = operator.post("/api/v1/admin/rounds/", {"closes_at": "soon"}, format="json")
    assert garbled.status_code == 400 and "closes_at" in garbled.json()["errors"]
    assert garbled.json()["detail"].startswith("closes_at: Datetime has wrong format")
    target = later(90).replace(microsecond=0)
    opened = operator.post(
        "/api/v1/admin/rounds/", {"epsilon": 0.5, "closes_at": target.isoformat()}, format="json"
    )
    assert opened.status_code == 201, opened.content
    body = opened.json()
    assert dt.datetime.fromisoformat(body["closes_at"]) == target and body["config"]["epsilon"] == 0.5
    assert "closes_at" not in body["config"]  # the deadline is not part of the replayable config
    url = f"/api/v1/admin/rounds/{body['id']}/deadline/"
    moved = operator.post(url, {"closes_at": later(120).isoformat()}, format="json")
    assert moved.status_code == 200 and moved.json()["closes_at"] != body["closes_at"]
    removed = operator.post(url, {"closes_at": None}, format="json")
    assert removed.status_code == 200 and removed.json()["closes_at"] is None
    assert api_for(world.admin_a).post(url, {"closes_at": None}, format="json").status_code == 403
    listed = api_for(token=world.token_a).get("/api/v1/rounds/?state=open").json()["results"]
    assert listed[0]["closes_at"] is None


def test_deadlines_on_the_dashboard(client, world):
    client.force_login(world.operator)
    overview = reverse("dashboard:overview")
    assert 'name="closes_at"' in client.get(overview).content.decode()
    when = later(60 * 24).strftime("%Y-%m-%dT%H:%M")  # as the datetime-local input sends it
    response = client.post(reverse("dashboard:round-open"), {"epsilon": "1", "closes_at": when})
    assert response.status_code == 302
    rnd = Round.objects.get()
    assert rnd.closes_at.strftime("%Y-%m-%dT%H:%M") == when and rnd.closes_at.tzinfo is not None
    page = client.get(overview).content.decode()
    assert "It closes itself at" in page and 'id="round-deadline"' in page and "due " in page
    action = reverse("dashboard:round-action", args=[rnd.number, "deadline"])
    assert client.post(action, {"closes_at": ""}).status_code == 302
    assert Round.objects.get().closes_at is None and "It has no deadline." in client.get(overview).content.decode()
    bad = client.post(action, {"closes_at": "tomorrow"})
    assert bad.status_code == 400 and "is not a date and time" in bad.content.decode()
    past = client.post(action, {"closes_at": "2001-01-01T00:00"})
    assert past.status_code == 400 and "has passed" in past.content.decode()
    client.force_login(world.admin_a)
    assert client.post(action, {"closes_at": ""}).status_code == 403


def test_a_deadline_without_a_time_zone_is_read_as_utc_by_the_api(world):
    naive = later(45).replace(tzinfo=None, microsecond=0)
    response = api_for(world.operator).post(
        "/api/v1/admin/rounds/", {"closes_at": naive.isoformat()}, format="json"
    )
    assert response.status_code == 201, response.content
    assert Round.objects.get().closes_at == naive.replace(tzinfo=dt.UTC)


def test_the_dashboard_keeps_a_deadline_saved_as_shown_and_says_when_it_passed(client, world):
    client.force_login(world.operator)
    rnd = services.open_round(SYSTEM, closes_at=later(90).replace(second=42))
    action = reverse("dashboard:round-action", args=[rnd.number, "deadline"])
    shown = rnd.closes_at.strftime("%Y-%m-%dT%H:%M")  # what the form's input holds
    assert client.post(action, {"closes_at": shown}).status_code == 302
    assert Round.objects.get().closes_at == rnd.closes_at  # not moved to the minute
    assert not AuditLog.objects.filter(action="round.deadline").exists()
    expire(rnd)
    page = client.get(reverse("dashboard:overview")).content.decode()
    assert "has passed: it takes no more submissions" in page and "from now" not in page


def test_status_says_when_the_open_rounds_deadline_has_passed(capsys):
    from compendium.client_cli import _past

    assert _past("2001-01-01T00:00:00+00:00") and not _past(later().isoformat())
    assert not _past("not a time")
