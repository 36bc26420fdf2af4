"""The right to erasure against what the server derived from a global that held the erased
client's texts: the tuned router's folder (an encoder fine-tuned on them, and their vectors), the
routers a process keeps in memory, the router download API, the pgvector rows and the files under
SYNAPSE_DATA_DIR. On the real embedded PostgreSQL, with a real (one-epoch) tuning."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.urls import reverse

from compendium.models import CompendiumVersion, PrecautionEntry, ScenarioEntry
from federation import pipeline
from federation import services as federation_services
from federation.models import Client, ConflictLogEntry, MergeRecord
from federation.tuning import routers_dir, tune_published_router
from routing import services
from routing.models import TunedRouter
from tests.merge_helpers import build_federation
from tests.merge_helpers import close_round as close

pytestmark = [pytest.mark.slow, pytest.mark.django_db, pytest.mark.usefixtures("fresh_routing")]

ERASED = "17 multiplied"  # a2's scenario "What is 17 multiplied by 23?"


def _files_holding(root: Path, needle: str) -> list[Path]:
    data = needle.encode("utf-8")
    return [p for p in root.rglob("*") if p.is_file() and data in p.read_bytes()]


def test_erasure_removes_the_tuned_router_learnt_from_the_client_and_has_the_global_tuned_again(
    probes, django_capture_on_commit_callbacks, settings, client, monkeypatch
):
    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    before = CompendiumVersion.objects.get(kind="global", round=round_)
    assert any(ERASED in s["text"] for s in before.content["scenarios"])
    record = tune_published_router(before.pk, 1)
    assert record.state == TunedRouter.State.READY, record.detail
    folder = Path(record.directory)
    # What a tuning of it killed mid-way (its worker past its hard time limit, OOM) left: the
    # encoder half fine-tuned on the same texts. Only a later tuning of the same global removes
    # it, and an erasure deletes that global.
    killed = folder.with_name(folder.name[:-8] + "0badc0de.partial")
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half-tuned weights")
    assert services.route_query("What is 12 times 9?")["tuned_router"] is True

    auth = {"HTTP_AUTHORIZATION": f"Bearer {_token()}"}
    manifest = client.get(reverse("api:compendium-router"), **auth)
    assert manifest.status_code == 200
    params = reverse("api:compendium-router-file", args=["synapse-router-params.json"])
    assert client.get(params, **auth).status_code == 200
    listing = client.get(reverse("api:compendium-global"), **auth)
    assert listing.status_code == 200

    # An erasure that fails changes nothing: the folders go only once it commits.
    def broken(*args, **kwargs):
        raise RuntimeError("server merge broke")

    with monkeypatch.context() as patch, django_capture_on_commit_callbacks(execute=True):
        patch.setattr(pipeline, "run_server_merge", broken)
        with pytest.raises(RuntimeError, match="server merge broke"):
            pipeline.erase_client(Client.objects.get(name="a2"))
    assert folder.is_dir() and killed.is_dir()
    assert TunedRouter.objects.get(version=before).state == TunedRouter.State.READY

    queued = []
    monkeypatch.setattr("workers.tasks.send_tuning", queued.append)
    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 1
    with django_capture_on_commit_callbacks(execute=True):
        report = pipeline.erase_client(Client.objects.get(name="a2"))
    assert report.globals_rematerialized == [1]
    after = CompendiumVersion.objects.get(kind="global", round=round_)
    assert after.pk != before.pk

    # The folder fine-tuned on the erased text is gone, and so is what a killed tuning left.
    assert not folder.exists()
    assert not killed.exists()
    assert list(routers_dir().iterdir()) == []
    # The global merged again is queued to be tuned; until then routing is frozen, and this
    # process does not keep the router of the deleted global.
    assert [r.version_id for r in queued] == [after.pk]
    assert TunedRouter.objects.get(version=after).state == TunedRouter.State.QUEUED
    assert not TunedRouter.objects.filter(version_id=before.pk).exists()
    answer = services.route_query("What is 12 times 9?")
    assert answer["tuned_router"] is False
    assert all(key[0] != before.pk for key in services._served)
    # Clients can no longer download it: the manifest says it is being tuned, its files are
    # not served, and the global's ETag changed.
    refused = client.get(reverse("api:compendium-router"), **auth)
    assert refused.status_code == 404 and refused.json()["code"] == "router_tuning"
    assert client.get(params, **auth).status_code == 404
    again = client.get(reverse("api:compendium-global"), HTTP_IF_NONE_MATCH=listing["ETag"], **auth)
    assert again.status_code == 200 and again["ETag"] != listing["ETag"]
    # No row of the database holds the erased text, and no file under SYNAPSE_DATA_DIR.
    assert not ScenarioEntry.objects.filter(text__contains=ERASED).exists()
    assert not PrecautionEntry.objects.filter(text__contains=ERASED).exists()
    assert not any(ERASED in str(c.dissenters) + c.centroid for c in ConflictLogEntry.objects.all())
    assert not any(ERASED in str(m.flagged) + str(m.rejected) for m in MergeRecord.objects.all())
    assert not any(ERASED in str(v.content) for v in CompendiumVersion.objects.all())
    assert _files_holding(settings.DATA_DIR, ERASED) == []


def _token() -> str:
    SYSTEM = federation_services.Actor(None)
    org = federation_services.create_organization(SYSTEM, "Reader", "reader")
    reader = federation_services.enroll_client(SYSTEM, org, "r1")
    return federation_services.approve_client(SYSTEM, reader).token


def test_retiring_routers_removes_what_killed_tunings_of_deleted_globals_left(
    probes, django_capture_on_commit_callbacks
):
    """A tuning killed mid-way leaves a `.partial` folder that only a later tuning of the same
    global removes; when an erasure deleted that global (a tuning still running at the erasure,
    killed after it), none ever would: the next router to become ready removes it. A `.partial`
    of a global that exists is a tuning running now, and stays."""
    from federation.tuning import folder_prefix, retire_older

    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    version = CompendiumVersion.objects.get(kind="global", round=round_)
    mine = folder_prefix(1, version.pk, version.sha256)
    root = routers_dir()
    current = root / f"{mine}aaaaaaaa"
    running = root / f"{mine}bbbbbbbb.partial"
    killed = root / f"{folder_prefix(1, version.pk + 1000, 'c' * 64)}cccccccc.partial"
    foreign = root / "notes.partial"
    for folder in (current, running, killed, foreign):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
    record = TunedRouter.objects.create(version=version, state="ready", epochs=1,
                                        directory=str(current))
    assert retire_older(record) == 1
    assert sorted(p.name for p in root.iterdir()) == sorted(
        p.name for p in (current, running, foreign))
