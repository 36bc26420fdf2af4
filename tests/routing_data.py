"""Where the MetaTool data lives, from the main checkout or a worktree beside it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import METATOOL as _METATOOL

METATOOL = next(
    (p for p in (_METATOOL, Path("/work/shared/data/metatool")) if (p / "tools.jsonl").exists()),
    _METATOOL,
)


def published_global_data(tools: int, seed: int, test_fraction: float, max_per_tool: int) -> dict:
    """A small MetaTool global as the server publishes it: the first `tools` tools' train queries
    as scenarios, embedded by the engine that embeds stored rows, with the head publication
    fits (`federation.pipeline.routing_head`), and the held-out split."""
    from compendium.registry import load_dataset, stratified_split
    from federation.pipeline import routing_head
    from routing.datasets import compendium_from_queries
    from routing.embeddings import get_engine

    dataset = load_dataset(METATOOL)
    chosen = set(sorted(dataset.tool_ids)[:tools])
    queries = [q for q in dataset.queries if q.tool_id in chosen]
    split = stratified_split(queries, seed=seed, test_fraction=test_fraction)
    compendium = compendium_from_queries(dataset.tools, split.train, max_per_tool=max_per_tool)
    documents = get_engine()  # as in production: stored rows are embedded by the merge's engine
    embeddings = documents.embed([s.text for s in compendium.scenarios])
    return {
        "tools": [t for t in dataset.tools if t.tool_id in chosen],
        "compendium": compendium,
        "embeddings": embeddings,
        "head": routing_head(compendium, embeddings, documents.embed),
        "test": split.test,
        "probe_split": split.probe,
        "documents": documents,
    }


def publish_with_probe(data: dict, number: int = 1, compendium=None):
    """Publish `data["compendium"]` (or `compendium`, a subset of its scenarios) as round
    `number`'s global, with its tools and, once, `data["probe"]` as the public probe set, as the
    tuned-router tests need it. Returns (round, version)."""
    from compendium.services import import_registry, store_compendium
    from federation.models import ProbeQuery, Round

    import_registry(data["tools"])
    if not ProbeQuery.objects.exists():
        ProbeQuery.objects.bulk_create(
            ProbeQuery(dataset="metatool", qid=q.qid, text=q.query, tool_id=q.tool_id)
            for q in data["probe"]
        )
    round_ = Round.objects.create(number=number, state="published")
    compendium = compendium or data["compendium"]
    return round_, store_compendium(
        compendium, kind="global", round=round_,
        scenario_embeddings=data["embeddings"][: len(compendium.scenarios)],
        routing_head=data["head"] if compendium is data["compendium"] else None,
    )
