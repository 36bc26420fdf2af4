"""Where the MetaTool data lives, from the main checkout or a worktree beside it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import METATOOL as _METATOOL

METATOOL = next(
    (p for p in (_METATOOL, Path("/work/shared/data/metatool")) if (p / "tools.jsonl").exists()),
    _METATOOL,
)
