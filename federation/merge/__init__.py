"""The typed merge operator, its privacy mechanism and robust aggregation. Pure: no Django."""

from federation.merge.clustering import greedy_cluster
from federation.merge.operator import (
    conflicts_to_precautions,
    drowned_fields,
    edge_merge,
    server_merge,
    within_schema,
)
from federation.merge.privacy import BudgetExceeded, compose, laplace_scale
from federation.merge.summarize import ProbeSet
from federation.merge.types import ConflictEntry, LedgerEntry, MergeInput, MergeResult, MergeStats

__all__ = [
    "BudgetExceeded",
    "ConflictEntry",
    "LedgerEntry",
    "MergeInput",
    "MergeResult",
    "MergeStats",
    "ProbeSet",
    "compose",
    "conflicts_to_precautions",
    "drowned_fields",
    "edge_merge",
    "greedy_cluster",
    "laplace_scale",
    "server_merge",
    "within_schema",
]
