"""Turning a labelled routing dataset into a simulated federation: seeded stratified splits,
partitions of the train split over organizations and clients, and the clients' usage logs.

Pure (no Django): the `simulate` command and the tests use the same functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from compendium.registry import LabelledQuery, RoutingDataset, Split, stratified_split
from compendium.schema import ToolSpec

Partition = Literal["iid", "category", "random"]


def split_dataset(
    dataset: RoutingDataset, *, seed: int, probe_fraction: float = 0.1, test_fraction: float = 0.4
) -> Split:
    """The simulation's split of a dataset: `compendium.registry.stratified_split` of its
    queries (40% held out by default, 10% public probe set)."""
    return stratified_split(
        dataset.queries, seed=seed, probe_fraction=probe_fraction, test_fraction=test_fraction
    )


@dataclass
class ClientShare:
    organization: str
    client: str
    queries: list[LabelledQuery] = field(default_factory=list)


def partition_train(
    train: Sequence[LabelledQuery],
    tools: Sequence[ToolSpec],
    *,
    orgs: int,
    clients_per_org: int,
    mode: Partition,
    seed: int,
    dirichlet_alpha: float = 0.5,
) -> list[ClientShare]:
    """Deal the train queries to orgs x clients.

    - iid: uniformly at random;
    - category: each organization specializes in a subset of tool categories (categories are dealt
      round-robin to organizations, the paper's cross-organizational setting); inside an
      organization the queries are dealt uniformly to its clients;
    - random: each client draws tool preferences from a Dirichlet(alpha) and queries are assigned
      to clients in proportion to them (label skew without category structure).
    """
    if orgs < 1 or clients_per_org < 1:
        raise ValueError("need at least one organization and one client per organization")
    rng = random.Random(seed)
    shares = [
        ClientShare(f"org-{o + 1}", f"org-{o + 1}-client-{c + 1}")
        for o in range(orgs)
        for c in range(clients_per_org)
    ]
    queries = list(train)
    rng.shuffle(queries)
    if mode == "iid":
        for index, query in enumerate(queries):
            shares[index % len(shares)].queries.append(query)
    elif mode == "category":
        category_of = _categories(tools)
        categories = sorted({category_of.get(q.tool_id, "uncategorized") for q in queries})
        rng.shuffle(categories)
        owner = {cat: i % orgs for i, cat in enumerate(categories)}
        dealt = [0] * orgs
        for query in queries:
            org = owner[category_of.get(query.tool_id, "uncategorized")]
            shares[org * clients_per_org + dealt[org] % clients_per_org].queries.append(query)
            dealt[org] += 1
    elif mode == "random":
        import numpy as np

        np_rng = np.random.default_rng(seed)
        tool_ids = sorted({q.tool_id for q in queries})
        prefs = np_rng.dirichlet([dirichlet_alpha] * len(shares), size=len(tool_ids))
        column = {tool: prefs[i] for i, tool in enumerate(tool_ids)}
        for query in queries:
            shares[int(np_rng.choice(len(shares), p=column[query.tool_id]))].queries.append(query)
    else:
        raise ValueError(f"unknown partition {mode!r}: use iid, category or random")
    return shares


def _categories(tools: Sequence[ToolSpec]) -> dict[str, str]:
    """Each tool's category as the category partition deals it.

    The simulation has one definition of a query's category: its tool's, from tools.jsonl (what
    an organization specializes in). The partition, the drift plan and the per-category table
    all read it; a category a line of queries.jsonl gives is not read (`query_category_mismatches`
    counts those that differ)."""
    return {t.tool_id: t.category or "uncategorized" for t in tools}


def listing(names: Sequence[str], most: int = 5) -> str:
    """'x', 'x and y', 'x, y and z'; past `most` names, the first ones and how many more."""
    names = list(names)
    if len(names) > most:
        return ", ".join(names[:most]) + f" and {len(names) - most} more"
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1] if names else ""]))


def uncategorized_tools(dataset: RoutingDataset) -> str | None:
    """None when a tool of `dataset` has a category; otherwise, in words, that tools.jsonl gives
    its tools none and which categories queries.jsonl has instead (not read, `_categories`)."""
    if any(t.category for t in dataset.tools):
        return None
    named = sorted({q.category for q in dataset.queries if q.category})
    instead = ""
    if named:
        one = len(named) == 1
        instead = (f" (the {len(named)} categor{'y' if one else 'ies'} in queries.jsonl, "
                   f"{listing(named)}, {'is' if one else 'are'} not read for it)")
    return (f"tools.jsonl gives none of the dataset {dataset.name}'s {len(dataset.tools)} tools a "
            f"category{instead}")


def some_uncategorized(dataset: RoutingDataset) -> list[str]:
    """The tools tools.jsonl gives no category where others have one, in order (none where every
    tool has one, or none has: `uncategorized_tools`): `_categories` puts them together in one
    category of their own, "uncategorized"."""
    missing = [t.tool_id for t in dataset.tools if not t.category]
    return missing if len(missing) < len(dataset.tools) else []


def query_category_mismatches(dataset: RoutingDataset) -> tuple[int, LabelledQuery | None]:
    """How many queries carry a category of their own (in queries.jsonl) other than their
    tool's (in tools.jsonl), and the first of them: the simulation reads the tool's
    (`_categories`)."""
    category_of = {t.tool_id: t.category for t in dataset.tools}
    differ = [q for q in dataset.queries if q.category and q.category != category_of.get(q.tool_id)]
    return len(differ), (differ[0] if differ else None)


# stratified_split: a tool with fewer distinct queries stays in train and is never tested.
TESTED_FROM = 3


def untested_tools(dataset: RoutingDataset) -> tuple[int, int]:
    """How many of the dataset's tools have some queries but fewer than TESTED_FROM distinct
    ones (they stay in train, never tested), and how many queries they have (the tools of no
    query at all: `unasked_tools`)."""
    texts: dict[str, set[str]] = defaultdict(set)
    counts: dict[str, int] = defaultdict(int)
    for query in dataset.queries:
        texts[query.tool_id].add(query.query)
        counts[query.tool_id] += 1
    few = [counts[t.tool_id] for t in dataset.tools if 0 < len(texts[t.tool_id]) < TESTED_FROM]
    return len(few), sum(few)


def unasked_tools(dataset: RoutingDataset) -> list[str]:
    """The tools of tools.jsonl that no query of queries.jsonl is labelled with, in order: no
    client's log holds them and no split tests them."""
    asked = {query.tool_id for query in dataset.queries}
    return [tool.tool_id for tool in dataset.tools if tool.tool_id not in asked]


def federation_problem(
    dataset: RoutingDataset, seeds: Sequence[int], *, orgs: int, clients_per_org: int,
    partition: Partition, probe_fraction: float, test_fraction: float, drift_every: int = 0,
) -> str | None:
    """Why the dataset cannot make this simulated federation (None: it can), from each seed's
    split and partition (cheap, before any model loads): fewer than two tools, no query to test
    or probe with, fewer categories than organizations to deal them to, a client dealt nothing,
    workload drift over tools of one category (`drift_plan` would bring nothing in later)."""
    if len(dataset.tools) < 2:
        return f"the dataset {dataset.name} has {len(dataset.tools)} tool; routing needs at least 2"
    if drift_every > 0 and len(set(_categories(dataset.tools).values())) < 2:
        missing = uncategorized_tools(dataset)
        if missing:
            return (
                f"--drift-every {drift_every}: {missing}, so none could come into use in a later "
                "round and the run would have no drift; put each tool's category in tools.jsonl "
                "or use --drift-every 0"
            )
        return (
            f"--drift-every {drift_every}: the dataset {dataset.name}'s tools are all in one "
            "category, so none could come into use in a later round and the run would have no "
            "drift; use --drift-every 0 or a dataset whose tools have two or more categories"
        )
    unasked = set(unasked_tools(dataset))  # their categories bring nothing into use
    asked = sorted({c for t, c in _categories(dataset.tools).items() if t not in unasked})
    if drift_every > 0 and len(asked) < 2:
        others = sorted(set(_categories(dataset.tools).values()) - set(asked))
        return (
            f"--drift-every {drift_every}: the queries of the dataset {dataset.name} are all of "
            f"tools of one category, {listing(asked)} (no query is of a tool of "
            f"{listing(others)}), so none could come into use in a later round and the run "
            "would have no drift; use --drift-every 0 or a dataset whose queries are of tools "
            "of two or more categories"
        )
    for seed in seeds:
        split = split_dataset(dataset, seed=seed, probe_fraction=probe_fraction,
                              test_fraction=test_fraction)
        if not split.test or not split.probe:
            return (
                f"the dataset {dataset.name} has no tool with {TESTED_FROM} or more distinct queries: "
                "nothing to test on or to put in the public probe set"
            )
        if partition == "category":
            category_of = _categories(dataset.tools)
            categories = {category_of[q.tool_id] for q in split.train}
            if len(categories) < orgs:
                missing = uncategorized_tools(dataset)
                if missing:
                    return (
                        "--partition category deals the organizations the tools' categories, "
                        f"and {missing}: put each tool's category in tools.jsonl, or use "
                        "--partition iid or random"
                    )
                return (
                    f"--partition category: the train queries' tools have {len(categories)} "
                    f"categor{'y' if len(categories) == 1 else 'ies'} for --orgs {orgs}, so "
                    f"{orgs - len(categories)} organization(s) would get no queries; use fewer "
                    "--orgs or --partition iid or random"
                )
        shares = partition_train(split.train, dataset.tools, orgs=orgs,
                                 clients_per_org=clients_per_org, mode=partition, seed=seed)
        empty = sum(not share.queries for share in shares)
        if empty:
            return (
                f"seed {seed}: {empty} of {len(shares)} clients get no train queries "
                f"({len(split.train)} dealt by --partition {partition}); use fewer --orgs or "
                "--clients-per-org"
            )
    return None


def dataset_fingerprint(dataset: RoutingDataset) -> str:
    """What a run played on, beyond its folder's name: a hash of every tool and labelled query
    (in order), so that `simulate --combine` can tell two versions of one dataset apart."""
    content = {
        "tools": [tool.model_dump(mode="json") for tool in dataset.tools],
        "queries": [dataclasses.asdict(query) for query in dataset.queries],
    }
    text = json.dumps(content, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def stable_unit(*parts: object) -> float:
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def confusable_tools(tools: Sequence[ToolSpec], seed: int) -> dict[str, list[str]]:
    """For each tool, the tools a frozen LLM plausibly mistakes it for: the same category first."""
    by_category: dict[str, list[str]] = defaultdict(list)
    for tool in tools:
        by_category[tool.category].append(tool.tool_id)
    all_ids = [t.tool_id for t in tools]
    out = {}
    for tool in tools:
        peers = [t for t in by_category[tool.category] if t != tool.tool_id]
        if not peers:
            peers = [t for t in all_ids if t != tool.tool_id]
        peers.sort(key=lambda t: stable_unit(seed, tool.tool_id, t))
        out[tool.tool_id] = peers[:5]
    return out


def usage_log(
    share: ClientShare,
    confusions: dict[str, list[str]],
    *,
    seed: int,
    users: int = 3,
    error_rate: float = 0.15,
    correction_rate: float = 0.6,
) -> list[dict]:
    """The routing log the client's own frozen LLM would have produced for its queries.

    Each query was routed once: mostly to its gold tool (success), sometimes to a confusable tool;
    such a mistake was corrected by the user to the gold tool (`corrected`) or left as a
    `failure`. Latency is drawn per tool from a stable lognormal profile. Users are the client's
    end users, each with a stable share of the queries.
    """
    rng = random.Random(f"{seed}|{share.client}")
    lines = []
    for query in share.queries:
        user = f"{share.client}-user-{rng.randrange(max(1, users)) + 1}"
        chosen, outcome, corrected_to = query.tool_id, "success", None
        if rng.random() < error_rate and confusions.get(query.tool_id):
            chosen = rng.choice(confusions[query.tool_id])
            if rng.random() < correction_rate:
                outcome, corrected_to = "corrected", query.tool_id
            else:
                outcome = "failure"
        base = 150 + 1500 * stable_unit("latency", chosen)
        latency = round(base * rng.lognormvariate(0, 0.35), 1)
        line = {
            "query": query.query,
            "tool": chosen,
            "outcome": outcome,
            "latency_ms": latency,
            "user": user,
        }
        if corrected_to:
            line["corrected_to"] = corrected_to
        lines.append(line)
    return lines
