"""Every kind of document under bench/results/simulate*.json, stored the way an operator would
(`simulate --combine FILE`), renders on the Accuracy page: many were written by older versions
of the code and lack sections or keys newer runs have. One document of each distinct key set
(the top-level keys, each section's row keys and each nested object's keys)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from federation.models import SimulationRun

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def key_set(doc) -> frozenset:
    """What a document has: its keys, the keys of each section's rows and of its objects."""
    if not isinstance(doc, dict):
        return frozenset({type(doc).__name__})
    keys = set()
    for name, value in doc.items():
        keys.add(name)
        rows = value if isinstance(value, list) else (
            list(value.values()) if name == "per_category" and isinstance(value, dict) else [])
        for row in rows:
            if isinstance(row, dict):
                keys.update(f"{name}[].{k}" for k in row)
        if isinstance(value, dict) and name not in ("per_category", "config"):
            keys.update(f"{name}.{k}" for k in value)
    return frozenset(keys)


def representatives() -> list[Path]:
    """The first document (by name) of each distinct key set."""
    seen: dict[frozenset, Path] = {}
    for path in sorted(RESULTS.glob("simulate*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8-sig"))
        except ValueError:
            doc = None  # not JSON: --combine refuses it, one of its own
        seen.setdefault(key_set(doc), path)
    return list(seen.values())


@pytest.mark.parametrize("path", representatives(), ids=lambda p: p.name)
def test_a_stored_bench_document_renders_on_the_accuracy_page(path, client, world):
    try:
        call_command("simulate", "--combine", str(path))
    except CommandError as exc:  # refused: one line naming what is wrong, nothing stored
        assert "\n" not in str(exc) and str(path) in str(exc)
        assert not SimulationRun.objects.exists()
        return
    run = SimulationRun.objects.get()
    client.force_login(world.operator)
    response = client.get(reverse("dashboard:accuracy"), {"run": run.pk})
    assert response.status_code == 200
    body = response.content.decode()  # the stored run, where it ran or that it does not say
    assert f'<option value="{run.pk}" selected>' in body and 'id="run-host"' in body
