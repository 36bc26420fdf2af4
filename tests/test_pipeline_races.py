"""The pipeline's steps interleaved with each other: a step that commits between another step's
reads and its write (a replayed edge task, an erasure, an earlier round's publication, a withheld
re-release followed by a retry). The interleavings are forced deterministically, by running the
competing step from inside the first one's merge computation, after it has read its inputs."""

from __future__ import annotations

import pytest
from django.db import connection

from compendium.models import CompendiumVersion
from compendium.schema import Compendium
from compendium.services import store_compendium
from federation import pipeline
from federation.models import Client, ConflictLogEntry, MergeRecord, PrivacyLedgerEntry, Round
from tests.merge_helpers import build_federation
from tests.merge_helpers import close_round as close

pytestmark = pytest.mark.django_db




def interleave(monkeypatch, name: str, step):
    """Run `step` once, the first time pipeline.<name> (a merge operator) is called: after the
    calling step has read its inputs and before it writes. Returns the list of calls made."""
    real = getattr(pipeline, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            step()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, name, wrapped)
    return calls


def deferred_constraints_hold():
    """Check the deferred foreign keys now, as the commit would (a test runs in one transaction
    that never commits): a global written with a deleted edge or global among its sources fails
    here, as the round's commit would fail with an IntegrityError."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def merge_edges(round_):
    for org in pipeline.organizations_with_submissions(round_):
        pipeline.run_edge_merge(round_.pk, org)


def texts(version):
    return [s["text"] for s in version.content["scenarios"]]


def later_round(number, text, tool="flights", client="g1"):
    round_ = Round.objects.create(number=number, state="merging",
                                  config={"summarizer": "centroid", "seed": 10 + number})
    store_compendium(Compendium.model_validate({"scenarios": [{"tool_id": tool, "text": text}]}),
                     kind="client", round=round_, client=Client.objects.get(name=client))
    return round_


# --- A: a release's noise is replayed over exactly that release's inputs -------------------------


@pytest.mark.usefixtures("every_field_released")
def test_a_retry_after_a_withheld_re_release_does_not_replay_the_first_releases_noise(
    probes, settings
):
    """Release 0 of acme's edge is over a1 and a2. a2 is erased while the round merges and the
    budget is spent: the re-release over a1 alone (release 1) is withheld, writing no ledger
    rows. The ledger still ends at release 0, but its noise must never be drawn again over a1
    alone (the two releases would give a2's figures away): a retry of the edge task replays
    release 1, withheld again, instead of publishing release 0's noise over a1 with no ε
    charged."""
    round_, clients = build_federation(state="merging")
    acme = clients[("acme", "a1")].organization
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    ledger = PrivacyLedgerEntry.objects.filter(round=round_, organization=acme)
    assert set(ledger.values_list("release", flat=True)) == {0}
    settings.SYNAPSE_EPSILON_BUDGET = 0.3  # 0.25 spent: no room for another release
    pipeline.erase_client(clients[("acme", "a2")])
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.stats["release"] == 1 and "epsilon budget" in record.stats["numeric_withheld"]
    assert set(ledger.values_list("release", flat=True)) == {0}
    rows = ledger.count()

    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)  # the retry's edge task
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.stats["release"] == 1, "release 0's noise drawn again over other inputs"
    assert "epsilon budget" in record.stats["numeric_withheld"]
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme)
    assert not any(m.get("stats") for m in edge.content.get("metadata", []))
    assert ledger.count() == rows
    # The withheld release took its number: the next re-materialization is release 2, and the
    # record names what release 1 was made from.
    assert pipeline._release_number(round_, acme, True, record.stats["inputs"],
                                    record.stats["schema"]) == (2, True)
    # With budget again (the operator raised it), the replay of release 1 over a1 draws release
    # 1's noise and charges its ε.
    settings.SYNAPSE_EPSILON_BUDGET = 10.0
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.stats["release"] == 1 and "numeric_withheld" not in record.stats
    assert set(ledger.values_list("release", flat=True)) == {0, 1}


@pytest.mark.usefixtures("every_field_released")
def test_a_replay_after_a_tool_description_changed_is_the_same_release(probes):
    """acme's edge released (release 0), then the operator edited a tool's description (the
    admin, or `import_tools` with an updated catalogue) before the edge task ran again (a
    redelivery, a retry of the failed round). No statistic depends on a description: the same
    tools and fields are drawn at the same scales from the same inputs. The replay made a new
    release all the same, with fresh noise and the round's ε charged a second time (or, past the
    budget, the edge published without its statistics). It replays release 0; a tool taken out
    of the registry still makes a new release."""
    from compendium.models import Tool
    from compendium.schema import ToolSpec
    from compendium.services import import_registry
    from tests.merge_helpers import TOOLS

    round_, clients = build_federation(state="merging")
    acme = clients[("acme", "a1")].organization
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    ledger = PrivacyLedgerEntry.objects.filter(round=round_, organization=acme)
    assert set(ledger.values_list("release", flat=True)) == {0}
    rows = ledger.count()
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme)
    # A record kept before the release's digest was (it named the whole schema's) is read as
    # made from the schema in force when that digest matches it.
    from compendium.services import current_schema

    record = MergeRecord.objects.get(round=round_, organization=acme)
    record.stats["schema"] = pipeline._schema_digest(current_schema())
    record.save(update_fields=["stats"])
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    assert MergeRecord.objects.get(round=round_, organization=acme).stats["release"] == 0

    import_registry([ToolSpec(tool_id=t.tool_id, name=t.name, description=t.description + " (updated)")
                     for t in TOOLS])
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    record = MergeRecord.objects.get(round=round_, organization=acme)
    assert record.stats["release"] == 0, "a description edit made a new release"
    assert set(ledger.values_list("release", flat=True)) == {0} and ledger.count() == rows
    again = CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme)

    def figures(version):
        return {m["tool_id"]: m.get("stats") for m in version.content.get("metadata", [])}

    assert figures(again) == figures(edge)  # the same noise: the same figures
    assert "(updated)" in str(again.content)  # the descriptions in force

    Tool.objects.filter(tool_id="calculator").update(active=False)
    pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)
    assert MergeRecord.objects.get(round=round_, organization=acme).stats["release"] == 1


# --- B: replays keep the edge row; the server merge re-reads its edges under its lock ------------


def test_a_replay_that_comes_out_the_same_keeps_the_edge_row(probes):
    round_, clients = build_federation(state="merging")
    acme = clients[("acme", "a1")].organization
    first = pipeline.run_edge_merge(round_.pk, acme.pk)
    again = pipeline.run_edge_merge(round_.pk, acme.pk)
    assert again.version_id == first.version_id and again.sha256 == first.sha256
    assert CompendiumVersion.objects.filter(kind="edge", round=round_, organization=acme).count() == 1


def test_an_identical_edge_replay_during_the_server_merge_does_not_fail_the_round(
    probes, monkeypatch
):
    """A redelivered edge task (or a second chord) runs while the server merge computes: the
    edge comes out the same and keeps its row, so the server merge writes over the edges it
    read, once."""
    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    acme = clients[("acme", "a1")].organization
    calls = interleave(monkeypatch, "server_merge_operator",
                       lambda: pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt))
    pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    deferred_constraints_hold()
    round_.refresh_from_db()
    assert round_.state == "published"
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.all()) == set(CompendiumVersion.objects.filter(kind="edge", round=round_))
    assert len(calls) == 1  # nothing changed: merged once


def test_a_tool_deactivated_during_the_server_merge_is_not_published(probes, monkeypatch):
    """The operator deactivates a tool in the admin after the server merge read the schema: the
    edge merge checks the schema under its locks, the server merge did not, and published the
    tool's scenarios and precautions in the global (a tool out of the registry, which no merge
    publishes for; a tool deleted instead was a KeyError at the write, the round failed). It
    merges again under the schema in force."""
    from compendium.models import Tool

    round_, _clients = build_federation(state="merging")
    merge_edges(round_)
    assert any(s["tool_id"] == "calculator" for e in CompendiumVersion.objects.filter(
        kind="edge", round=round_) for s in e.content["scenarios"])
    calls = interleave(monkeypatch, "server_merge_operator",
                       lambda: Tool.objects.filter(tool_id="calculator").update(active=False))
    pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    round_.refresh_from_db()
    assert round_.state == "published"
    content = CompendiumVersion.objects.get(kind="global", round=round_).content
    assert all(entry["tool_id"] != "calculator" for part in ("scenarios", "precautions", "templates")
               for entry in content.get(part) or ())
    assert len(calls) == 2  # merged again under the schema in force


def test_an_edge_merged_again_during_the_server_merge_is_merged_again_by_it(probes, monkeypatch):
    """A client is revoked and acme's edge merged again (other inputs, another row) after the
    server merge read the edges: the server merge sees it under its locks and merges again over
    the new edge, instead of writing a global over a deleted edge (an IntegrityError at commit,
    the round failed) that holds what the revoked client sent."""
    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    acme = clients[("acme", "a1")].organization

    def revoke_and_merge_again():
        Client.objects.filter(pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED)
        pipeline.run_edge_merge(round_.pk, acme.pk, attempt=round_.attempt)

    calls = interleave(monkeypatch, "server_merge_operator", revoke_and_merge_again)
    pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    deferred_constraints_hold()
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.all()) == set(CompendiumVersion.objects.filter(kind="edge", round=round_))
    assert "What is 17 multiplied by 23?" not in texts(glob)
    assert len(calls) == 2


def test_a_server_merge_whose_inputs_keep_changing_fails_saying_so(probes, monkeypatch):
    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    acme = clients[("acme", "a1")].organization
    monkeypatch.setattr(pipeline, "MERGE_TRIES", 1)

    def revoke_and_merge_again():
        Client.objects.filter(pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED)
        pipeline.run_edge_merge(round_.pk, acme.pk)

    interleave(monkeypatch, "server_merge_operator", revoke_and_merge_again)
    with pytest.raises(pipeline.PipelineError, match="changed .* each of the 1 times"):
        pipeline.run_server_merge(round_.pk)
    assert not CompendiumVersion.objects.filter(kind="global", round=round_).exists()


def test_a_client_revoked_while_its_edge_merges_is_left_out(probes, monkeypatch):
    """The edge merge reads its inputs again under the round's lock: a client revoked (or erased)
    after they were read is not written into the edge."""
    round_, clients = build_federation(state="merging")
    acme = clients[("acme", "a1")].organization
    interleave(monkeypatch, "edge_merge", lambda: Client.objects.filter(
        pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED))
    pipeline.run_edge_merge(round_.pk, acme.pk)
    edge = CompendiumVersion.objects.get(kind="edge", round=round_, organization=acme)
    assert [v.client_id for v in edge.sources.all()] == [clients[("acme", "a1")].pk]


def test_a_client_revoked_after_its_edge_merged_is_left_out_of_the_global(probes):
    """The edge merge leaves revoked clients out, but a client revoked after its organization's
    edge was merged and before the server merge read the edges was published in the round's
    global all the same. The server merge of a merging round merges such an edge again first
    (a new release without the revoked client; without clients left, the edge is removed)."""
    from federation import services
    from tests.federation_fixtures import SYSTEM

    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    acme = clients[("acme", "a1")].organization
    services.revoke_client(SYSTEM, clients[("acme", "a2")])
    services.revoke_client(SYSTEM, clients[("globex", "g1")])
    pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    deferred_constraints_hold()
    round_.refresh_from_db()
    assert round_.state == "published"
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    edge = CompendiumVersion.objects.get(kind="edge", round=round_)
    assert edge.organization == acme and list(glob.sources.all()) == [edge]
    assert [v.client_id for v in edge.sources.all()] == [clients[("acme", "a1")].pk]
    assert MergeRecord.objects.get(round=round_, organization=acme).stats["release"] == 1
    assert "What is 17 multiplied by 23?" not in texts(glob)
    assert "What is the temperature in Berlin today?" not in texts(glob)


def test_a_client_revoked_while_the_server_merge_runs_is_left_out_of_the_global(
    probes, monkeypatch
):
    """Revoked after the server merge read the edges: it sees that under its locks and merges
    again, the edge first."""
    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    calls = interleave(monkeypatch, "server_merge_operator", lambda: Client.objects.filter(
        pk=clients[("acme", "a2")].pk).update(status=Client.Status.REVOKED))
    pipeline.run_server_merge(round_.pk, attempt=round_.attempt)
    deferred_constraints_hold()
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert set(glob.sources.all()) == set(CompendiumVersion.objects.filter(kind="edge", round=round_))
    assert not CompendiumVersion.objects.filter(
        kind="edge", round=round_, sources__client__status=Client.Status.REVOKED).exists()
    assert "What is 17 multiplied by 23?" not in texts(glob)
    assert len(calls) == 2


# --- C: an erasure and a later round's server merge ---------------------------------------------


def test_an_erasure_during_a_later_rounds_server_merge_reaches_that_round(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Round 2 carries round 1's global forward and is merging when a round-1 client is erased:
    the erasure merges round 1's global again (round 2 is not published, so not its to redo).
    Round 2's server merge, which read the old global 1, finds it replaced under the
    publication lock and merges again over the new one, instead of publishing the erased
    client's scenarios (or failing on the deleted global)."""
    round1, clients = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    assert round1.state == "published", round1.failure_reason
    round2 = later_round(2, "Which airline flies nonstop to Lisbon?")
    merge_edges(round2)
    calls = interleave(monkeypatch, "server_merge_operator",
                       lambda: pipeline.erase_client(clients[("acme", "a2")]))
    pipeline.run_server_merge(round2.pk, attempt=round2.attempt)
    deferred_constraints_hold()
    round2.refresh_from_db()
    assert round2.state == "published"
    first = CompendiumVersion.objects.get(kind="global", round=round1)
    glob = CompendiumVersion.objects.get(kind="global", round=round2)
    assert "What is 17 multiplied by 23?" not in texts(first)
    assert "What is 17 multiplied by 23?" not in texts(glob)
    assert "Which airline flies nonstop to Lisbon?" in texts(glob)
    assert first in set(glob.sources.all())
    assert len(calls) == 3  # round 2, round 1 again by the erasure, round 2 again


def _publication_lock_comes_first(queries):
    sql = [q["sql"] for q in queries.captured_queries]
    first_row_lock = next(i for i, q in enumerate(sql) if "FOR UPDATE" in q)
    lock = next(i for i, q in enumerate(sql) if "pg_advisory_xact_lock" in q)
    return lock < first_row_lock


def test_erasures_and_server_merges_take_the_publication_lock_before_any_round(
    probes, django_capture_on_commit_callbacks
):
    """Both take it before any round's row lock (an erasure locks several rounds after it), so
    the two cannot deadlock, and an erasure holds it for its whole transaction."""
    from django.test.utils import CaptureQueriesContext

    round_, clients = build_federation(state="merging")
    merge_edges(round_)
    with CaptureQueriesContext(connection) as queries:
        pipeline.run_server_merge(round_.pk)
    assert _publication_lock_comes_first(queries)
    with CaptureQueriesContext(connection) as queries:
        pipeline.erase_client(clients[("acme", "a2")])
    assert _publication_lock_comes_first(queries)


# --- D: two rounds merging at once --------------------------------------------------------------


def test_an_earlier_round_published_during_a_later_ones_server_merge_is_carried_forward(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Rounds 2 and 3 merge at once (round 2 was retried after round 3 opened). Round 3 reads the
    latest published global (round 1's); round 2 publishes before round 3 writes. Round 3 must
    carry round 2's global forward, not round 1's, which would drop round 2 from every global
    served from then on: under the publication lock it finds the previous global changed and
    merges again."""
    round1, _ = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2 = later_round(2, "Which airline flies nonstop to Lisbon?")
    round3 = later_round(3, "What is 5 plus 7?", tool="calculator")
    merge_edges(round2)
    merge_edges(round3)
    calls = interleave(monkeypatch, "server_merge_operator",
                       lambda: pipeline.run_server_merge(round2.pk, attempt=round2.attempt))
    pipeline.run_server_merge(round3.pk, attempt=round3.attempt)
    deferred_constraints_hold()
    round2.refresh_from_db()
    round3.refresh_from_db()
    assert (round2.state, round3.state) == ("published", "published")
    second = CompendiumVersion.objects.get(kind="global", round=round2)
    third = CompendiumVersion.objects.get(kind="global", round=round3)
    assert second in set(third.sources.all())
    assert "Which airline flies nonstop to Lisbon?" in texts(third)
    assert "What is 5 plus 7?" in texts(third)
    assert len(calls) == 3


def test_an_earlier_round_published_during_a_later_ones_edge_merge_reaches_its_precautions(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Rounds 2 and 3 merge at once; round 2's acme edge logged a conflict. Round 3's acme edge
    reads the latest published round's log (round 1's, without it) and round 2 publishes before
    it writes: round 4 will read round 3's log, so round 2's conflict would never become a
    precaution. Under the publication lock the edge finds the log it read superseded and merges
    again over round 2's."""
    from tests.merge_helpers import plant_weather_conflict

    round1, _ = build_federation()
    close(round1, django_capture_on_commit_callbacks)
    round2, clients = build_federation(round_number=2, state="merging",
                                       config={"summarizer": "none"})
    acme = plant_weather_conflict(round2, clients)
    merge_edges(round2)
    assert ConflictLogEntry.objects.filter(round=round2, organization=acme).exists()
    round3 = later_round(3, "Which airline flies nonstop to Lisbon?", client="a1")
    calls = interleave(monkeypatch, "edge_merge",
                       lambda: Round.objects.filter(pk=round2.pk).update(state="published"))
    pipeline.run_edge_merge(round3.pk, acme.pk)
    edge = CompendiumVersion.objects.get(kind="edge", round=round3, organization=acme)
    assert any(p["text"].startswith("Use WeatherNow for will it rain tomorrow in Paris")
               for p in edge.content.get("precautions", [])), edge.content.get("precautions")
    assert len(calls) == 2


def test_an_erasure_during_a_later_edge_merge_that_read_its_conflict_log_reaches_that_edge(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Round 1's acme log holds a3's dissent; a3 sat round 2 out. Round 2's acme edge reads
    that log, and a3 is erased before the edge writes: the erasure re-merged round 1 without
    a3, but round 2's edge had no merge record yet, so it was no reader the erasure could
    reach. Under its locks the edge checked only *which* round's log it read, not what it
    read: it wrote a3's words as a precaution, and round 2's global would publish them."""
    from tests.test_merge_pipeline import SECRET, _leaks, _weather_conflict

    org, clients, _ = _weather_conflict(django_capture_on_commit_callbacks, {"a3": SECRET})
    round2 = later_round(2, "Book a flight to Rome", client="a1")
    calls = interleave(monkeypatch, "edge_merge",
                       lambda: pipeline.erase_client(clients[("acme", "a3")]))
    pipeline.run_edge_merge(round2.pk, org.pk)
    assert _leaks("Zorblat") == []
    assert calls.count("edge_merge") >= 3  # the first, the erasure's, the edge's again


def test_an_erasure_during_a_later_server_merge_that_read_the_servers_log_reaches_it(
    probes, django_capture_on_commit_callbacks, monkeypatch
):
    """Round 1's server log holds globex's claim (a conflict between edges); round 2, which
    does not carry round 1's global forward, composes it into a precaution. globex's client is
    erased while round 2's server merge runs: without a carried-forward global the merge's
    check under the publication lock saw nothing change (the same edges, the same latest
    round), and it published the precaution the erasure had just removed from round 1."""
    from tests.merge_helpers import plant_cross_edge_conflict

    r1 = Round.objects.create(number=1, state="closing", config={"summarizer": "none"})
    clients = plant_cross_edge_conflict(r1)
    close(r1, django_capture_on_commit_callbacks)
    assert ConflictLogEntry.objects.filter(round=r1, organization=None).count() == 1
    r2 = Round.objects.create(number=2, state="merging",
                              config={"summarizer": "none", "carry_forward": False})
    store_compendium(Compendium.model_validate({"scenarios": [
        {"tool_id": "flights", "text": "Book a flight to Rome"}]}), kind="client", round=r2,
        client=clients["a1"])
    merge_edges(r2)
    calls = interleave(monkeypatch, "server_merge_operator",
                       lambda: pipeline.erase_client(clients["g1"]))
    pipeline.run_server_merge(r2.pk, attempt=r2.attempt)
    glob = CompendiumVersion.objects.get(kind="global", round=r2).content
    assert [p["text"] for p in glob.get("precautions", []) if p["tool_id"] == "fares"] == []
    assert len(calls) == 3  # round 2, round 1 again by the erasure, round 2 again
