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
        "documents": documents,
    }
