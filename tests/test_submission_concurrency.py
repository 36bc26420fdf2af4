"""Concurrent submissions with duplicated idempotency keys, on the real database with real
transactions: exactly one row per key, one current compendium per client, nothing lost."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from compendium.models import CompendiumVersion
from compendium.schema import Compendium
from compendium.services import store_compendium
from federation import pipeline, services, submissions
from federation.models import Round, Submission
from tests.federation_fixtures import SYSTEM, another_waits_on_a_lock, record_outcome

pytestmark = pytest.mark.django_db(transaction=True)

KEYS_PER_CLIENT = 3
DUPLICATES_PER_KEY = 4


def _document(valid_doc: dict, client_index: int, key_index: int) -> str:
    doc = json.loads(json.dumps(valid_doc))
    doc["scenarios"].append(
        {"tool_id": "weather", "text": f"client {client_index} variant {key_index} forecast"}
    )
    return json.dumps(doc)


def test_duplicated_keys_from_many_threads_store_exactly_one_row_per_key(world, valid_doc):
    rnd = services.open_round(SYSTEM)
    tokens = [world.token_a, world.token_b]
    extra = services.enroll_client(SYSTEM, world.org_a, "a2")
    tokens.append(services.approve_client(SYSTEM, extra).token)

    jobs = []
    for c, token in enumerate(tokens):
        for k in range(KEYS_PER_CLIENT):
            body = _document(valid_doc, c, k)
            jobs.extend([(c, token, f"key-{k}", body)] * DUPLICATES_PER_KEY)
    barrier = threading.Barrier(len(jobs))

    def send(job):
        c, token, key, body = job
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        try:
            barrier.wait()
            response = api.post(
                "/api/v1/submissions/", body, content_type="application/json",
                HTTP_IDEMPOTENCY_KEY=key,
            )
            return c, key, response.status_code, response.json(), response.get("Idempotent-Replayed")
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(send, jobs))

    # Each key is stored once; its duplicates get the same answer replayed, or, once another key
    # of the client replaced its submission, 409 `replaced` (a replay would say it is in effect).
    assert all(status in (201, 409) for _, _, status, _, _ in results), results
    bodies = defaultdict(list)
    replays = defaultdict(int)
    refused = defaultdict(int)
    for c, key, status, body, replayed in results:
        if status == 409:
            assert body["code"] == "replaced", body
            refused[(c, key)] += 1
            continue
        bodies[(c, key)].append(body)
        replays[(c, key)] += replayed == "true"
    for (c, key), answers in bodies.items():
        assert all(a == answers[0] for a in answers), f"client {c} {key}: different answers"
        assert replays[(c, key)] + refused[(c, key)] == DUPLICATES_PER_KEY - 1
    assert len(bodies) == len(tokens) * KEYS_PER_CLIENT  # each key stored: one 201 not replayed
    for (c, key), times in refused.items():
        if not times:
            continue
        row = Submission.objects.get(client_id=bodies[(c, key)][0]["client"], idempotency_key=key)
        assert row.version_id is None, f"client {c} {key}: refused as replaced, but in effect"

    # Exactly one row per key, nothing lost.
    rows = Submission.objects.filter(round=rnd)
    assert rows.count() == len(tokens) * KEYS_PER_CLIENT
    assert len({(s.client_id, s.idempotency_key) for s in rows}) == rows.count()
    # One current compendium per client: the submission that came last replaced the others.
    versions = CompendiumVersion.objects.filter(kind="client", round=rnd)
    assert versions.count() == len(tokens)
    for version in versions:
        current = Submission.objects.get(version=version)
        latest = Submission.objects.filter(client=version.client_id).latest("created_at", "id")
        assert current == latest
        assert version.sha256 == current.response["sha256"]
    assert Submission.objects.filter(version__isnull=True).count() == len(tokens) * (
        KEYS_PER_CLIENT - 1
    )


def test_close_during_submissions_never_stores_into_a_closing_round(
    world, valid_doc, without_merge_pipeline
):
    rnd = services.open_round(SYSTEM)
    barrier = threading.Barrier(9)

    def send(i):
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
        try:
            barrier.wait()
            return api.post(
                "/api/v1/submissions/", _document(valid_doc, 0, i),
                content_type="application/json", HTTP_IDEMPOTENCY_KEY=f"k{i}",
            )
        finally:
            connection.close()

    def close():
        try:
            barrier.wait()
            services.close_round(SYSTEM, rnd)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=9) as pool:
        futures = [pool.submit(send, i) for i in range(8)]
        pool.submit(close).result()
        responses = [f.result() for f in futures]
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {201, 409}, [r.json() for r in responses]

    accepted = statuses.count(201)
    assert Submission.objects.filter(round=rnd).count() == accepted
    assert CompendiumVersion.objects.filter(kind="client", round=rnd).count() == min(accepted, 1)
    rnd.refresh_from_db()
    assert rnd.state == "closing"
    # Submissions after the close are refused.
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.token_a}")
    late = api.post(
        "/api/v1/submissions/", json.dumps(valid_doc), content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="late",
    )
    assert late.status_code == 409


def test_a_submission_during_an_erasure_waits_for_it_and_is_stored_whole(world, valid_doc):
    """Found by review: `erase_client` listed the client's compendiums, deleted them, then deleted
    its Submission rows, without the client's row lock the submission path takes. A first
    submission to the open round that committed between the erasure's listing and its deletion
    of the records lost its record (request hash, idempotency key, stored answer) to the erasure
    while its compendium, never listed, stayed in effect: a version without its record, outside
    every count of the erasure. The erasure now locks the client's row (after the publication
    lock, before reading anything): the submission waits for it, then is stored whole, as any
    submission after an erasure.

    Forced with real connections: this test holds a lock on the client's compendium of an earlier
    round, so the erasure stops at its deletion, after its listing; the submission runs then."""
    client = world.client_a
    earlier = Round.objects.create(number=1, state=Round.State.PUBLISHED)
    erased = store_compendium(
        Compendium.model_validate({"scenarios": [{"tool_id": "weather", "text": "Rain today?"}]}),
        kind="client", round=earlier, client=client,
    )
    services.open_round(SYSTEM)
    outcomes = {"erasure": [], "submission": []}
    stored = threading.Event()

    erasure = threading.Thread(target=record_outcome, args=(
        outcomes["erasure"], lambda: pipeline.erase_client(client)))
    submission = threading.Thread(target=record_outcome, args=(
        outcomes["submission"],
        lambda: submissions.submit(client, json.dumps(valid_doc).encode(), "k1"), stored))
    try:
        with transaction.atomic():
            CompendiumVersion.objects.select_for_update().get(pk=erased.pk)
            erasure.start()
            assert another_waits_on_a_lock(30), "the erasure never reached its delete"
            submission.start()
            # the erasure, and the submission behind it
            waited = another_waits_on_a_lock(30, count=2, done=stored)
    finally:
        erasure.join(60)
        submission.join(60)
    outcomes = {name: got[0] for name, got in outcomes.items()}
    assert not isinstance(outcomes["erasure"], Exception), outcomes
    assert outcomes["submission"].status_code == 201, outcomes
    version = outcomes["submission"].body["version"]
    # Nothing half-erased: the submission's compendium and its record, both or neither.
    assert set(CompendiumVersion.objects.filter(kind="client", client=client)
               .values_list("pk", flat=True)) == {version}
    assert list(Submission.objects.filter(client=client).values_list("idempotency_key", "version")
                ) == [("k1", version)], "a compendium in effect without its submission record"
    assert waited, "the submission did not wait for the erasure"
    report = outcomes["erasure"]
    assert (report.submissions_removed, report.submission_records_removed) == (1, 0)


def test_a_submission_waiting_on_a_rotation_of_its_token_stores_nothing(world, valid_doc):
    """The rotation holds the client's row while the submission of the old token (authenticated
    before it) waits for that lock: once the rotation commits, the token that sent it has
    stopped, and nothing is stored. Read after the lock is granted, in a statement of its own:
    the statement that waited for the lock reads from a snapshot taken before the rotation
    committed (the rotation changes the token, not the client's row)."""
    services.open_round(SYSTEM)
    client = world.client_a
    old = services.hash_token(world.token_a)
    outcome = {"result": []}
    finished = threading.Event()

    submission = threading.Thread(target=record_outcome, args=(
        outcome["result"],
        lambda: submissions.submit(client, json.dumps(valid_doc).encode(), "k1", token_hash=old),
        finished))
    try:
        with transaction.atomic():
            services.rotate_client_token(SYSTEM, client)
            submission.start()
            waited = another_waits_on_a_lock(30, done=finished)
    finally:
        submission.join(60)
    assert waited, "the submission did not wait for the rotation"
    outcome = {name: got[0] for name, got in outcome.items()}
    assert isinstance(outcome["result"], services.NotAllowed), outcome
    assert "rotated" in str(outcome["result"])
    assert not Submission.objects.exists()
    assert not CompendiumVersion.objects.filter(kind="client").exists()
