"""Clients download the server's tuned router (GET /api/v1/compendium/global/router/ and its files,
`synapse-client pull --router`) and `synapse-client route` then ranks exactly as the routing API
does; every case where there is none says why, and a damaged download never replaces a good copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compendium.client_api import ClientError, SynapseClient, router_dir
from compendium.client_cli import main
from compendium.schema import Compendium
from federation import services as federation_services
from federation.tuning import tune_published_router
from routing import services
from routing.finetune import ROUTER_MANIFEST, file_sha256, read_manifest, rows_digest
from routing.models import TunedRouter
from tests.routing_data import publish_with_probe, published_global_data

pytestmark = [
    pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_routing")
]

SYSTEM = federation_services.Actor(None)


@pytest.fixture(scope="module")
def data():
    data = published_global_data(10, seed=7, test_fraction=0.3, max_per_tool=8)
    return {**data, "probe": data["test"][:60], "queries": [q.query for q in data["test"][60:72]]}


def _publish(data, number: int, compendium: Compendium | None = None):
    _, version = publish_with_probe(data, number, compendium)
    services.forget_published_version()
    return version


def _token() -> str:
    org = federation_services.create_organization(SYSTEM, "Org", "org")
    client = federation_services.enroll_client(SYSTEM, org, "c1")
    return federation_services.approve_client(SYSTEM, client).token


def _route_json(compendium_path: Path, query: str, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["route", query, "--compendium", str(compendium_path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_pull_router_and_route_as_the_server_does(
    live_server, data, settings, tmp_path, capsys, monkeypatch
):
    version = _publish(data, 1)
    token = _token()
    out = tmp_path / "client" / "global.json"
    server = ["--server", live_server.url, "--token", token, "--backoff", "0"]

    # Tuning off: the pull succeeds, says why there is no router, and routing stays frozen.
    assert main(["pull", "--out", str(out), "--router", *server]) == 0
    err = capsys.readouterr().err
    assert "no tuned router to download" in err and "tuning is off" in err
    assert not router_dir(out).exists()
    assert _route_json(out, data["queries"][0], capsys)["tuned_router"] is False

    # Being tuned: a clear code the client can act on.
    running = TunedRouter.objects.create(version=version, state=TunedRouter.State.RUNNING, epochs=1)
    with SynapseClient(live_server.url, token, backoff=0) as client:
        pending = client.pull_router(out)
    assert not pending.available and pending.code == "router_tuning" and "being tuned" in pending.detail
    running.delete()

    record = tune_published_router(version.pk, 1)
    assert record.state == TunedRouter.State.READY, record.detail
    served_folder = Path(record.directory)
    manifest = read_manifest(served_folder)
    assert manifest["global_sha256"] == version.sha256 and manifest["round"] == 1
    assert {f["path"] for f in manifest["files"]} >= {"synapse-router.npz", "config.json"}
    weights = next(f for f in manifest["files"] if f["path"] == "model.safetensors")
    assert weights["delta"]["size"] < 0.6 * weights["size"]  # 44% on the demo's round-3 router
    assert not any(f["path"].startswith("deltas/") for f in manifest["files"])

    assert main(["pull", "--out", str(out), "--router", *server]) == 0
    said = capsys.readouterr().out
    assert "the encoder the server tuned on round 1's global (1 epoch(s)" in said
    assert "1 file(s) rebuilt from a delta against the bundled model" in said
    folder = router_dir(out)
    for entry in manifest["files"]:
        assert file_sha256(folder / entry["path"]) == entry["sha256"]
    assert read_manifest(folder)["files"] == manifest["files"]
    pulled = Compendium.model_validate_json(out.read_bytes())
    assert rows_digest(pulled) == manifest["rows_sha256"]  # the saved vectors fit the pulled copy

    # The client ranks exactly as the routing API does with the tuned router.
    services.forget_served()
    for query in data["queries"]:
        mine = _route_json(out, query, capsys)
        theirs = services.route_query(query)
        assert mine["tuned_router"] is True and theirs["tuned_router"] is True
        assert mine["tool"] == theirs["tool"]
        assert mine["confidence"] == pytest.approx(theirs["confidence"], abs=1e-4)
        assert [c["tool"] for c in mine["candidates"]] == [c["tool"] for c in theirs["candidates"]]
    assert _route_json(out, data["queries"][0], capsys, "--frozen")["tuned_router"] is False
    # A tool deactivated since: pulled again (a 304, the schema in force refreshed), the tuned
    # router leaves it out as the routing API's does.
    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600  # the save below is seen at once in this process
    gone = _route_json(out, data["queries"][0], capsys)["tool"]
    _set_active([gone], False)
    assert main(["pull", "--out", str(out), *server]) == 0
    assert "up to date" in capsys.readouterr().out
    for query in data["queries"]:
        mine, theirs = _route_json(out, query, capsys), services.route_query(query)
        assert mine["tuned_router"] is True and theirs["tuned_router"] is True
        assert gone not in _named(mine) and mine["excluded_tools"] == [gone]
        _same_decision(mine, theirs)
    _set_active([gone], True)
    assert main(["pull", "--out", str(out), *server]) == 0
    assert _route_json(out, data["queries"][0], capsys)["tool"] == gone
    capsys.readouterr()
    assert main(["route", data["queries"][0], "--compendium", str(out)]) == 0
    assert "encoder: tuned by the server on the global of round 1, 1 epoch(s)" in capsys.readouterr().out

    # Pulled again: nothing comes over the network; a damaged local file is fetched alone.
    model = folder / "model.safetensors"
    stamp = model.stat().st_mtime_ns
    assert main(["pull", "--out", str(out), "--router", *server]) == 0
    assert "the tuned router of round 1 is up to date" in capsys.readouterr().out
    assert model.stat().st_mtime_ns == stamp
    params = folder / "synapse-router-params.json"
    params.write_text(params.read_text().replace("{", "{ ", 1))
    with SynapseClient(live_server.url, token, backoff=0) as client:
        again = client.pull_router(out)
    assert again.updated and again.reused_files == len(manifest["files"]) - 1
    assert again.downloaded_bytes == next(
        f["size"] for f in manifest["files"] if f["path"] == "synapse-router-params.json"
    )
    assert file_sha256(params) == next(
        f["sha256"] for f in manifest["files"] if f["path"] == "synapse-router-params.json"
    )

    # A file that does not match the manifest is refused, and the good local copy stays.
    head = served_folder / "synapse-router-params.json"
    good = head.read_bytes()
    head.write_bytes(good + b" ")
    params.write_text("{}")  # so that the client must download it
    with SynapseClient(live_server.url, token, backoff=0) as client:
        with pytest.raises(ClientError, match="does not match its manifest"):
            client.pull_router(out)
    assert params.read_text() == "{}" and (folder / ROUTER_MANIFEST).is_file()
    assert not list(folder.parent.glob(folder.name + "*.partial"))
    head.write_bytes(good)

    # The weights come as a delta against the bundled model when the client holds that base,
    # whole otherwise, and whole again (with a warning) when the delta does not rebuild them.
    import shutil

    import compendium.client_api as client_api

    total = sum(f["size"] for f in manifest["files"])
    shutil.rmtree(folder)
    with SynapseClient(live_server.url, token, backoff=0) as client:
        by_delta = client.pull_router(out)
    assert by_delta.delta_files == 1 and by_delta.downloaded_bytes < 0.6 * total
    assert file_sha256(folder / "model.safetensors") == weights["sha256"]
    shutil.rmtree(folder)
    monkeypatch.setattr(client_api, "_local_base_file", lambda name: None)
    with SynapseClient(live_server.url, token, backoff=0) as client:
        whole = client.pull_router(out)
    assert whole.delta_files == 0 and whole.downloaded_bytes == total
    monkeypatch.undo()
    served_delta = served_folder / weights["delta"]["path"]
    packed = served_delta.read_bytes()
    served_delta.write_bytes(packed[:-100])
    shutil.rmtree(folder)
    with SynapseClient(live_server.url, token, backoff=0) as client:
        fallback = client.pull_router(out)
    assert fallback.delta_files == 0 and any("downloading it whole" in w for w in fallback.warnings)
    assert file_sha256(folder / "model.safetensors") == weights["sha256"]
    served_delta.write_bytes(packed)

    # A damaged local folder: route warns and goes on with the frozen model.
    (folder / "synapse-router.npz").write_bytes(b"not an archive")
    capsys.readouterr()
    assert main(["route", data["queries"][0], "--compendium", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tuned_router"] is False
    assert "ignoring the tuned router" in captured.err

    # A newer global without a router yet: the pull says so and drops the old global's router.
    _publish(data, 2, Compendium(scenarios=data["compendium"].scenarios[:-3],
                                 metadata=data["compendium"].metadata))
    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 1
    assert main(["pull", "--out", str(out), "--router", *server]) == 0
    assert "no tuned router yet" in capsys.readouterr().err
    assert not folder.exists()


def _set_active(tool_ids, active: bool) -> None:
    """As the operator does in the admin (ToolAdmin saves each row)."""
    from compendium.models import Tool

    for tool in Tool.objects.filter(tool_id__in=list(tool_ids)):
        tool.active = active
        tool.save()


def _named(answer: dict) -> set:
    """Every tool an answer names: the decision, its nearest scenarios and its ranking."""
    return ({answer["tool"]} | {c["tool"] for c in answer["candidates"]}
            | {r["tool"] for r in answer["ranking"]})


def _same_order(mine: list[dict], theirs: list[dict]) -> None:
    """The same tools with the same scores in the same order, but for two of (nearly) equal
    score, which may trade places: the client embeds the global's rows itself, and a query
    embedded in another process or thread count can differ in the last bits."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-4)
        if a["tool"] != b["tool"]:
            assert any(c["tool"] == b["tool"] and abs(c["score"] - b["score"]) <= 1e-4
                       for c in mine), (mine, theirs)


def _same_decision(mine: dict, theirs: dict, shown: bool = True) -> None:
    """The same decision, its confidence within 1e-4; with `shown`, the same candidates and
    ranking too."""
    assert mine["tool"] == theirs["tool"] and mine["reranker"] == theirs["reranker"]
    assert mine["fallback_reason"] == theirs["fallback_reason"]
    assert mine["confidence"] == pytest.approx(theirs["confidence"], abs=1e-4)
    if shown:
        _same_order(mine["candidates"], theirs["candidates"])
        _same_order(mine["ranking"], theirs["ranking"])


def test_route_leaves_out_a_tool_deactivated_after_the_pull_as_the_routing_api_does(
    live_server, data, settings, tmp_path, capsys
):
    """The operator deactivates a tool after the global was published: the routing API stops
    naming it at once, and a client that routes by itself did not (it read only the global).
    `pull` saves the schema in force beside the global, on a 304 too, and `route` leaves out
    the global's tools it does not list: the same answers as the routing API's, frozen router."""
    from collections import Counter

    settings.SYNAPSE_ROUTING_VERSION_TTL = 3600  # the save below is seen at once in this process
    _publish(data, 1)
    out = tmp_path / "client" / "global.json"
    pull = ["pull", "--out", str(out), "--server", live_server.url, "--token", _token(),
            "--backoff", "0"]
    assert main(pull) == 0
    assert f"{out}.schema.json: the schema in force" in capsys.readouterr().out
    queries = data["queries"]
    before = [_route_json(out, q, capsys) for q in queries]
    assert all(a["excluded_tools"] == [] for a in before)
    gone = Counter(a["tool"] for a in before).most_common(1)[0][0]

    _set_active([gone], False)
    assert main(pull) == 0
    said = capsys.readouterr().out
    assert "up to date" in said and "the schema in force" in said  # a 304, the schema refreshed
    for query in queries:
        mine = _route_json(out, query, capsys, "--top-k", "10")
        theirs = services.route_query(query, 10)
        assert mine["tool"] and gone not in _named(mine)
        assert mine["excluded_tools"] == [gone] and mine["tuned_router"] is theirs["tuned_router"]
        # The frozen router: the client embeds the global's rows itself, in batches of its own;
        # batched by token length, a text's vector is the one it has alone (bit for bit in
        # bf16, to the last bits in fp32), so the same candidates, ranking and confidence.
        _same_decision(mine, theirs)

    # Every tool of the global deactivated: no decision, both ways.
    every = {t.tool_id for t in data["tools"]}
    _set_active(every, False)
    assert main(pull) == 0
    capsys.readouterr()
    mine, theirs = _route_json(out, queries[0], capsys), services.route_query(queries[0])
    assert mine["tool"] is None and mine["fallback_reason"] == "no active tools"
    assert mine["excluded_tools"] == sorted(every)
    _same_decision(mine, theirs)

    # Reactivated: the answers are what they were.
    _set_active(every, True)
    assert main(pull) == 0
    capsys.readouterr()
    assert [_route_json(out, q, capsys) for q in queries] == before


def test_router_endpoints_check_who_asks_and_serve_only_listed_files(data, settings, client, monkeypatch):
    from django.urls import reverse

    version = _publish(data, 1)
    manifest_url = reverse("api:compendium-router")
    assert client.get(manifest_url).status_code in (401, 403)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {_token()}"}

    off = client.get(manifest_url, **auth)
    assert off.status_code == 404 and off.json()["code"] == "router_off"
    failed = TunedRouter.objects.create(
        version=version, state=TunedRouter.State.FAILED, detail="ValueError: no", epochs=1
    )
    # the reason is an exception's text (a server path, a database error): the operator's
    answer = client.get(manifest_url, **auth).json()
    assert answer["code"] == "router_failed" and "ValueError: no" not in answer["detail"]
    assert "the federation operator sees why" in answer["detail"]
    from django.contrib.auth import get_user_model

    operator = get_user_model().objects.create_superuser("op", "op@example.org", "pw-op-1234")
    client.force_login(operator)
    answer = client.get(manifest_url).json()
    assert answer["code"] == "router_failed" and "ValueError: no" in answer["detail"]
    page = client.get(reverse("dashboard:routing")).content.decode()
    assert "tuned router is <strong>failed</strong>: ValueError: no." in page
    # and on the routing playground, an organization's member reads only that it failed
    from federation.models import Membership, Organization

    member = get_user_model().objects.create_user("member", "m@example.org", "pw-member-1234")
    Membership.objects.create(user=member, organization=Organization.objects.get(slug="org"),
                              role=Membership.Role.MEMBER)
    client.force_login(member)
    page = client.get(reverse("dashboard:routing")).content.decode()
    assert "tuned router is <strong>failed</strong>: the federation operator sees why" in page
    assert "ValueError" not in page
    client.logout()
    failed.delete()
    assert client.get(manifest_url, {"round": "x"}, **auth).status_code == 400
    assert client.get(manifest_url, {"round": "9"}, **auth).status_code == 404

    record = tune_published_router(version.pk, 1)
    folder = Path(record.directory)
    (folder / ROUTER_MANIFEST).unlink()  # a router tuned before manifests: written on request
    first = client.get(manifest_url, **auth)
    assert first.status_code == 200 and (folder / ROUTER_MANIFEST).is_file()
    body = first.json()
    assert body["global_sha256"] == version.sha256 and body["rows"] == record.rows
    assert body["device"] == record.device and body["device"]  # where the server fine-tuned it
    assert body["total_bytes"] == sum(f["size"] for f in body["files"]) > 1_000_000
    assert client.get(manifest_url, HTTP_IF_NONE_MATCH=first["ETag"], **auth).status_code == 304

    entry = next(f for f in body["files"] if f["path"] == "synapse-router-params.json")
    url = reverse("api:compendium-router-file", args=[entry["path"]])
    got = client.get(url, **auth)
    assert got.status_code == 200 and got["ETag"] == f'"{entry["sha256"]}"'
    assert b"".join(got.streaming_content) == (folder / entry["path"]).read_bytes()
    assert client.get(url, HTTP_IF_NONE_MATCH=got["ETag"], **auth).status_code == 304
    assert client.get(url).status_code in (401, 403)

    (folder / "secret.txt").write_text("not listed")
    for name in ("secret.txt", "../routers", "1_Pooling/../secret.txt", "nothing"):
        refused = client.get(reverse("api:compendium-router-file", args=[name]), **auth)
        assert refused.status_code == 404, name
    assert refused.json()["code"] == "router_file"

    # Retired (its folder removed by a newer router) while a request reads it: 404, not a 500.
    from federation import tuning

    found = tuning.downloadable_router

    def then_retired(version, reveal=True):
        answer = found(version, reveal)
        import shutil

        shutil.rmtree(folder)
        return answer

    monkeypatch.setattr(tuning, "downloadable_router", then_retired)
    gone = client.get(url, **auth)
    assert gone.status_code == 404 and gone.json()["code"] == "router_retired", gone.content
    monkeypatch.undo()
    folder.mkdir(parents=True)  # the row still says ready; its manifest must be written again
    import routing.finetune

    monkeypatch.setattr(routing.finetune, "write_manifest", lambda *a, **k: (_ for _ in ()).throw(
        FileNotFoundError("retired meanwhile")))
    gone = client.get(manifest_url, **auth)
    assert gone.status_code == 404 and gone.json()["code"] == "router_retired", gone.content
