"""Every script under bench/ imports: the benchmarks are not run by the suite, so a refactor that
renames or moves what they import from the product (a function, a constant, a module) would
otherwise go unnoticed until someone reruns a figure. Imported in-process as `python
bench/SCRIPT.py` would load them (bench/ first on sys.path, for `_routing_common` and
`submit_load`), without running `main`; and every name they import from the product further
down (inside main(), after django.setup()) still exists. None is excluded: no script does more than set
DJANGO_SETTINGS_MODULE and sys.path at import time."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def test_the_scripts_are_found():
    assert {"merge_scale.py", "route_accuracy.py", "submit_load.py", "tune_device.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports(script, monkeypatch):
    module = _load(script, monkeypatch)
    if not script.startswith("_"):
        assert callable(getattr(module, "main", None)), f"bench/{script} has no main()"


def _product_imports(script: str) -> list[tuple[str, str]]:
    """(module, name) of every `from PRODUCT_MODULE import name` in the script, at any depth: most
    scripts import the product inside main(), after django.setup(), where importing the script
    does not reach."""
    tree = ast.parse((BENCH / script).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if (ROOT / top / "__init__.py").is_file() and top not in {"tests", "bench"}:
                found += [(node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_product_names_exist(script):
    """Django is set up by pytest-django, so models import as they would after django.setup()."""
    missing = [
        f"{module}.{name}" for module, name in _product_imports(script)
        if not hasattr(importlib.import_module(module), name)
        and importlib.util.find_spec(f"{module}.{name}") is None
    ]
    assert not missing, f"bench/{script} imports names the product no longer has: {missing}"


@pytest.mark.slow
@pytest.mark.django_db
def test_the_confusion_margin_wrapper_reaches_the_federations_merges(tiny_dataset, tmp_path,
                                                                     monkeypatch):
    """Its settings patch the merges the simulation calls in memory, so it plays the rounds
    `--in-memory`: through the services the pipeline's own merges would ignore them, and the
    source check it turns off would still drop the adversaries."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_confusion", BENCH / "simulate_confusion_margin.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_confusion", module)
    spec.loader.exec_module(module)
    import federation.simulation.runner as runner

    # The wrapper patches the runner's merges for the process; undone after the test.
    monkeypatch.setattr(runner, "edge_merge", runner.edge_merge)
    monkeypatch.setattr(runner, "server_merge", runner.server_merge)
    out = tmp_path / "off.json"
    common = ["--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2", "--rounds",
              "2", "--seed", "1", "--no-baselines", "--no-diagnostics", "--adversarial-fraction",
              "0.5", "--adversarial-mode", "tool_confusion", "--no-store", "--verbosity", "0"]
    assert module.main(["--source-limit", "9", *common, "--out", str(out)]) == 0
    import json

    document = json.loads(out.read_text())
    assert document["config"]["through_services"] is False
    assert document["screening"]["adversarial_submissions"] > 0
    assert document["screening"]["dropped_adversarial"] == 0  # the source check was off


def _load(script: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    name = f"bench_script_{script.removesuffix('.py')}"
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as a module run by path would be (dataclasses look it up).
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _dataset(folder, tools: dict[str, str], queries: int):
    """tools: tool_id -> category; `queries` distinct queries each."""
    import json

    folder.mkdir()
    (folder / "tools.jsonl").write_text("".join(
        json.dumps({"tool_id": t, "description": f"{t} service", "category": c}) + "\n"
        for t, c in tools.items()))
    (folder / "queries.jsonl").write_text("".join(
        json.dumps({"query": f"request {n} for {t}", "tool_id": t}) + "\n"
        for t in tools for n in range(queries)))
    return folder


@pytest.mark.parametrize("script", ["stats_grid.py", "dcz_dictionaries.py", "finetune_router.py",
                                    "transfer_centralized.py"])
@pytest.mark.parametrize(("tools", "flags", "message"), [
    ({"a": "x"}, [], "the dataset d has 1 tool; routing needs at least 2"),
    ({"a": "x", "b": "x"}, ["--orgs", "2"],
     "--partition category: the train queries' tools have 1 category for --orgs 2, so 1 "
     "organization(s) would get no queries; use fewer --orgs or --partition iid or random"),
])
def test_a_script_on_the_simulation_refuses_a_dataset_simulate_refuses_in_one_line(
        script, tools, flags, message, tmp_path, monkeypatch):
    """The scripts built on `_routing_common.federation_simulation` played the federation
    without the dataset check `simulate` runs (`federation_problem`): a dataset of one tool, or
    of fewer categories than organizations, ended in a traceback deep in the merge or the
    partition (or a run that measured nothing). They now stop first, before the model loads
    (a model that cannot load is named here), with simulate's line."""
    module = _load(script, monkeypatch)
    folder = _dataset(tmp_path / "d", tools, 20)
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--embedding-model", "no-such-model-xyz", *flags])
    assert stop.value.code == f"{script.removesuffix('.py')}: {message}"


def test_a_script_on_the_simulation_names_a_dataset_it_cannot_read_in_one_line(
        tmp_path, monkeypatch):
    module = _load("stats_grid.py", monkeypatch)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "tools.jsonl").write_text('{"tool_id": "a", "description": "a service"}\n')
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder)])
    assert stop.value.code == f"stats_grid: {folder}: no queries.jsonl in this folder"


def test_the_tune_device_export_refuses_a_dataset_simulate_refuses(tmp_path, monkeypatch):
    module = _load("tune_device.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x"}, 20)
    with pytest.raises(SystemExit) as stop:
        module.main(["export", "--dataset", str(folder), "--dir", str(tmp_path / "out"),
                     "--embedding-model", "no-such-model-xyz"])
    assert stop.value.code == "tune_device: the dataset d has 1 tool; routing needs at least 2"


def _bad_dataset(tmp_path, kind: str):
    """A dataset `load_dataset` refuses: no folder, a line that is not JSON, a query labelled
    with a tool the registry does not have."""
    import json

    folder = tmp_path / "bad"
    if kind == "missing":
        return folder
    folder.mkdir()
    (folder / "tools.jsonl").write_text("".join(
        json.dumps({"tool_id": t, "description": f"{t} service", "category": t}) + "\n"
        for t in ("a", "b")))
    lines = [json.dumps({"query": f"request {n}", "tool_id": "a"}) for n in range(3)]
    lines.append('{"query": "broken' if kind == "malformed" else
                 json.dumps({"query": "who is this", "tool_id": "zz"}))
    (folder / "queries.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _refusal(folder) -> str:
    from compendium.registry import RegistryFormatError, load_dataset

    with pytest.raises(RegistryFormatError) as refused:
        load_dataset(folder)
    return str(refused.value)


# Every script that reads --dataset itself (not through `federation_simulation`).
DATASET_SCRIPTS = ["route_accuracy.py", "raw_ceiling.py", "merge_scale.py", "mask_leakage.py",
                   "masking_residue.py", "submit_load.py", "submit_cpu.py", "word_cuts_offline.py",
                   "route_latency.py"]


@pytest.mark.parametrize("script", DATASET_SCRIPTS)
@pytest.mark.parametrize("kind", ["missing", "malformed", "unknown-label"])
def test_a_script_names_a_dataset_it_cannot_read_in_one_line(script, kind, tmp_path, monkeypatch):
    """They called `load_dataset` (or read the JSONL) bare: a missing folder, a line that is not
    JSON or a query of an unknown tool ended in a traceback (submit_load's after it had set up a
    federation in the database). Now one line, `SCRIPT: why`, as simulate's, before anything
    else; and no --out file."""
    module = _load(script, monkeypatch)
    folder = _bad_dataset(tmp_path, kind)
    out = tmp_path / "out.json"
    argv = ["--dataset", str(folder), "--out", str(out)]
    if script in ("raw_ceiling.py", "word_cuts_offline.py"):
        argv += ["--embedding-model", "no-such-model-xyz"]
    if script == "submit_cpu.py":
        argv.remove("--out")
        argv.remove(str(out))
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == f"{script.removesuffix('.py')}: {_refusal(folder)}"
    assert not out.exists()


@pytest.mark.parametrize(("script", "argv"), [
    ("raw_ceiling.py", []),
    ("word_cuts_offline.py", ["--sent", "1700", "--test", "10", "--dictionary", "10"]),
    ("stats_grid.py", ["--partition", "iid", "--orgs", "1", "--clients-per-org", "2"]),
    ("dcz_dictionaries.py", ["--partition", "iid", "--orgs", "1", "--clients-per-org", "2"]),
    ("finetune_router.py", ["--partition", "iid", "--orgs", "1", "--clients-per-org", "2"]),
    ("transfer_centralized.py", ["--partition", "iid", "--orgs", "1", "--clients-per-org", "2"]),
    ("tune_device.py", ["--partition", "iid", "--orgs", "1", "--clients-per-org", "2"]),
])
def test_a_script_names_an_embedding_model_it_cannot_load_in_one_line(script, argv, tmp_path,
                                                                      monkeypatch):
    """An --embedding-model that cannot be loaded ended in a traceback (EmbeddingModelUnavailable
    from get_engine); now one line naming the script, the model and what the flag takes, as
    simulate's, and no --out file."""
    from federation.simulation.runner import MODEL_NAMES

    module = _load(script, monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 900)
    out = tmp_path / "out.json"
    argv = [*(["export", "--dir", str(tmp_path / "exported")] if script == "tune_device.py" else
              ["--out", str(out)]),
            "--dataset", str(folder), "--embedding-model", "no-such-model-xyz", *argv]
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    line = stop.value.code
    assert isinstance(line, str) and "\n" not in line, line
    assert line.startswith(f"{script.removesuffix('.py')}: ") and "'no-such-model-xyz'" in line, line
    assert line.endswith(f"; --embedding-model takes {MODEL_NAMES}"), line
    assert not out.exists()


@pytest.mark.parametrize(("flags", "ends"), [
    (["--transfer-models", "no-such-model-xyz"], "TRANSFER_MODEL_HINT"),
    (["--transfer-models", "bundled:all-MiniLM-L6-v2", "--transfer-rerankers", "nope"],
     "choose from"),
])
def test_transfer_centralized_names_a_transfer_variant_it_cannot_build_in_one_line(
        flags, ends, tmp_path, monkeypatch):
    """`Simulation.transfer_variants` refuses an unknown reranker or a model that cannot load in
    one line, which simulate reports as such; the script let it out as a traceback. (Loads the
    bundled model: the variants are checked once the federation's engine is up.)"""
    import federation.simulation.runner as runner

    module = _load("transfer_centralized.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 20)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--partition", "iid", "--orgs", "1",
                     "--clients-per-org", "2", "--out", str(out), *flags])
    line = stop.value.code
    assert isinstance(line, str) and "\n" not in line, line
    assert line.startswith("transfer_centralized: "), line
    assert (line.endswith(runner.TRANSFER_MODEL_HINT) if ends == "TRANSFER_MODEL_HINT"
            else ends in line), line
    assert not out.exists()


# Every script with --dataset and --out (tune_device's export writes --dir, not --out).
OUT_SCRIPTS = ["route_accuracy.py", "raw_ceiling.py", "merge_scale.py", "mask_leakage.py",
               "masking_residue.py", "submit_load.py", "word_cuts_offline.py", "stats_grid.py",
               "dcz_dictionaries.py", "finetune_router.py", "transfer_centralized.py",
               "route_latency.py"]


@pytest.mark.parametrize("script", OUT_SCRIPTS)
def test_a_script_refuses_an_out_it_could_not_write_before_it_runs(script, tmp_path, monkeypatch):
    """An --out that names a folder failed at the very end, after the whole run, with a
    traceback (IsADirectoryError). Now refused first, as simulate refuses it (the same line,
    `out_file_problem`), before the dataset is read."""
    module = _load(script, monkeypatch)
    folder = tmp_path / "results"
    folder.mkdir()
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(tmp_path / "no-such-dataset"), "--out", str(folder)])
    assert stop.value.code == (f"{script.removesuffix('.py')}: --out {folder} is a folder; "
                               "name a file")


@pytest.mark.parametrize(("held", "why"), [
    ('{"clients": 200}', "holds no list of rows"),
    ("not json", "is not JSON"),
    ('[{"clients": 200}, 3]', "holds no list of rows"),
])
def test_submit_load_refuses_an_out_it_could_not_add_its_row_to_before_it_runs(
        held, why, tmp_path, monkeypatch):
    """submit_load adds its row to the rows its --out holds. One holding anything else (another
    script's figures, a file that is not JSON) ended the run in a traceback (AttributeError,
    JSONDecodeError) after the federation was set up in the database and the load sent, its row
    written nowhere. Refused first, in one line naming the file, before the dataset is read; the
    file is left as it was."""
    module = _load("submit_load.py", monkeypatch)
    out = tmp_path / "figures.json"
    out.write_text(held, encoding="utf-8")
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(tmp_path / "no-such-dataset"), "--out", str(out)])
    assert stop.value.code == (f"submit_load: --out {out} {why}: it adds its row to a JSON list "
                               "of rows; name a new file or such a list")
    assert out.read_text(encoding="utf-8") == held


@pytest.mark.parametrize(("flag", "value", "takes"), [
    ("--clients", "0", "at least 1"), ("--submissions", "0", "at least 1"),
    ("--duplicates", "0", "at least 1"), ("--tools-per-client", "-1", "at least 1"),
    ("--scenarios-per-tool", "-1", "at least 0"), ("--rate", "-5", "a finite number >= 0"),
    ("--rate", "nan", "a finite number >= 0"), ("--timeout", "0", "a finite number > 0"),
])
def test_submit_load_refuses_a_count_or_rate_it_cannot_run_with_before_it_runs(
        flag, value, takes, tmp_path, monkeypatch, capsys):
    """A --tools-per-client or --scenarios-per-tool below 0 was a traceback (random.sample's
    ValueError) once the federation was set up in the database; no client, no key, no send or a
    negative rate ran a load of nothing, or a burst, and reported it. Refused as argparse refuses
    a bad value (usage, one line naming the flag, status 2), before the dataset is read."""
    module = _load("submit_load.py", monkeypatch)
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(tmp_path / "no-such-dataset"), flag, value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f": error: {flag} must be {takes}, not {value}")


@pytest.mark.parametrize(("script", "flag", "value", "least"), [
    ("submit_cpu.py", "--clients", "1", 2), ("submit_cpu.py", "--rounds", "0", 1),
    ("submit_cpu.py", "--tools-per-client", "-1", 1), ("mask_leakage.py", "--limit", "-3", 1),
])
def test_submit_cpu_and_mask_leakage_refuse_a_count_they_cannot_run_with(
        script, flag, value, least, tmp_path, monkeypatch, capsys):
    """submit_cpu with one client was an IndexError once the federation was set up (it warms up on
    two), mask_leakage's negative --limit random.sample's ValueError: refused as argparse refuses
    a bad value, before the dataset is read."""
    module = _load(script, monkeypatch)
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(tmp_path / "no-such-dataset"), flag, value])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f": error: {flag} must be at least {least}, not {value}")


@pytest.mark.parametrize("script", ["mask_leakage.py", "masking_residue.py"])
def test_a_script_writes_its_out_into_a_folder_it_creates(script, tmp_path, monkeypatch):
    """As simulate's --out: a missing parent folder is created (they failed at the end with
    FileNotFoundError, after the run)."""
    import json

    module = _load(script, monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 5)
    out = tmp_path / "new" / "deeper" / "out.json"
    assert module.main(["--dataset", str(folder), "--out", str(out)]) == 0
    assert json.loads(out.read_text())


@pytest.mark.parametrize(("script", "argv"), [
    ("router_delta.py", []), ("tune_device.py", ["tune", "--dir", "x"]),
    ("client_scaling.py", []),
    ("ledger_accounting.py", ["--orgs", "1", "--rounds", "1", "--tools", "2", "--fields", "1",
                              "--repeat", "1"]),
    ("dashboard_scale.py", ["--clients", "2", "--rounds", "1", "--repeat", "1"]),
])
def test_a_script_without_a_dataset_refuses_an_out_folder_first(script, argv, tmp_path,
                                                               monkeypatch):
    """The same check before a run that reads no --dataset (tune_device tunes on a GPU,
    client_scaling masks and collapses for half a minute, ledger_accounting fills a scratch
    database: the folder failed only at their end)."""
    module = _load(script, monkeypatch)
    folder = tmp_path / "results"
    folder.mkdir()
    monkeypatch.setattr(sys, "argv", [script, *argv, "--out", str(folder)])
    with pytest.raises(SystemExit) as stop:
        module.main(*([] if script == "router_delta.py" else [[*argv, "--out", str(folder)]]))
    assert stop.value.code == (f"{script.removesuffix('.py')}: --out {folder} is a folder; "
                               "name a file")


def _must_not_run(*args, **kwargs):
    raise AssertionError("the script went on to its long work")


@pytest.mark.parametrize(("tools", "queries", "message"), [
    ({"a": "x"}, 20, "the dataset d has 1 tool; routing needs at least 2"),
    ({"a": "x", "b": "y"}, 2,
     "the dataset d has no tool with 3 or more distinct queries: nothing to test on or to put in "
     "the public probe set"),
])
def test_route_latency_refuses_a_dataset_it_cannot_route_before_it_starts_a_database(
        tools, queries, message, tmp_path, monkeypatch):
    """route_latency read MetaTool whatever it was given (it had no --dataset), after it had
    started its database and gunicorn. It now takes --dataset, read first (`read_dataset`), and
    refuses what `simulate` refuses (`federation_problem`: fewer than two tools, no query to hold
    out) in one line, before the database."""
    module = _load("route_latency.py", monkeypatch)
    monkeypatch.setattr(module, "_setup_django", _must_not_run)
    folder = _dataset(tmp_path / "d", tools, queries)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--out", str(out)])
    assert stop.value.code == f"route_latency: {message}"
    assert not out.exists()


def test_route_latency_times_the_dataset_it_is_given(tmp_path, monkeypatch):
    """Its catalogues are the --dataset's tools and held-out queries (named after the dataset),
    and the synthetic one three variants of each of them."""
    from compendium.registry import load_dataset

    module = _load("route_latency.py", monkeypatch)
    dataset = load_dataset(_dataset(tmp_path / "d", {"a": "x", "b": "y"}, 10))
    catalogues = list(module.catalogues(dataset, 0))
    assert [(name, sorted(t.tool_id for t in tools)) for name, tools, _, _ in catalogues] == [
        ("d", ["a", "b"]), ("synthetic", ["a.v0", "a.v1", "a.v2", "b.v0", "b.v1", "b.v2"])]
    held_out = catalogues[0][3]
    assert held_out and all(q.startswith("request ") for q in held_out)
    assert {s.tool_id for s in catalogues[0][2].scenarios} == {"a", "b"}


def _exported(folder):
    """A folder as `tune_device.py export` writes it, tiny: two globals, probe, test."""
    import json

    from compendium.schema import Compendium, Scenario

    folder.mkdir()
    compendium = Compendium(scenarios=[Scenario(tool_id=t, text=f"{t} request") for t in "ab"])
    for which in ("synapse", "centralized"):
        (folder / f"{which}.json").write_text(compendium.model_dump_json())
    for name in ("probe", "test"):
        (folder / f"{name}.jsonl").write_text("".join(
            json.dumps({"query": f"{name} {n} for {t}", "tool_id": t, "category": t}) + "\n"
            for t in "ab" for n in range(2)))
    (folder / "export.json").write_text(json.dumps({"dataset": "d", "seed": 0}))
    return folder


TUNE_DIR_HINT = "give the folder `tune_device.py export --dir` wrote"


@pytest.mark.parametrize(("kind", "flags", "why"), [
    ("missing", [], ": no such folder; " + TUNE_DIR_HINT),
    ("a file", [], f" is not a folder; {TUNE_DIR_HINT}"),
    ("empty", [], " has no probe.jsonl, test.jsonl, synapse.json, centralized.json, export.json; "
                  + TUNE_DIR_HINT),
    ("exported", ["--globals", "synapse,central"], f" has no central.json; {TUNE_DIR_HINT}"),
    ("not JSON", [], ": probe.jsonl line 2 is not JSON (Expecting ',' delimiter at column 15)"),
    ("no tool", [], ": test.jsonl line 1 is not a request with a query and a tool_id"),
    ("no test", [], ": test.jsonl holds no request"),
    ("not a compendium", [], ": synapse.json is not a compendium (scenarios.0.tool_id: Field "
                             "required)"),
])
def test_tune_device_refuses_a_dir_export_did_not_write_before_it_tunes(
        kind, flags, why, tmp_path, monkeypatch):
    """`tune` read --dir only as it went: a missing folder, or one without the export's files,
    ended in a traceback (FileNotFoundError), a --globals the export did not save after the first
    global had been tuned. Now every file is read first, and what is wrong is one line."""
    module = _load("tune_device.py", monkeypatch)
    folder = tmp_path / "exported"
    if kind == "a file":
        folder.write_text("")
    elif kind == "empty":
        folder.mkdir()
    elif kind != "missing":
        _exported(folder)
    if kind == "not JSON":
        (folder / "probe.jsonl").write_text('{"query": "x", "tool_id": "a"}\n{"query": "y" "a"}\n')
    if kind == "no tool":
        (folder / "test.jsonl").write_text('{"query": "x"}\n')
    if kind == "no test":
        (folder / "test.jsonl").write_text("\n")
    if kind == "not a compendium":
        (folder / "synapse.json").write_text('{"scenarios": [{"text": "x"}]}')
    monkeypatch.setattr("routing.finetune.tune_router", _must_not_run)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["tune", "--dir", str(folder), "--device", "cpu", "--out", str(out), *flags])
    assert stop.value.code == f"tune_device: --dir {folder}{why}"
    assert not out.exists()


@pytest.mark.parametrize("model", ["missing", "onnx-int8:all-MiniLM-L6-v2", "bf16:all-MiniLM-L6-v2"])
def test_tune_device_refuses_a_base_model_it_cannot_tune_before_it_tunes(model, tmp_path,
                                                                         monkeypatch):
    """A --base-model that does not exist failed as a traceback (EmbeddingModelUnavailable) when
    the frozen router was built; an inference build of MiniLM (ONNX, bfloat16) loaded for the
    frozen router and failed in the fine-tuning. Now one line first, as `load_engine` reports a
    model that cannot load, naming the model and what --base-model takes."""
    module = _load("tune_device.py", monkeypatch)
    folder = _exported(tmp_path / "exported")
    name = str(tmp_path / "no-such-model") if model == "missing" else model
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["tune", "--dir", str(folder), "--device", "cpu", "--base-model", name,
                     "--out", str(out)])
    line = stop.value.code
    assert isinstance(line, str) and "\n" not in line, line
    assert line.startswith("tune_device: ") and repr(name) in line, line
    assert line.endswith(f"; --base-model takes {module.BASE_MODELS}"), line
    assert not out.exists()


def test_tune_device_export_refuses_a_dir_it_could_not_write_before_the_federation(
        tmp_path, monkeypatch):
    """`export` made --dir after the whole federation had played: a --dir under a file failed
    there with a traceback. Now refused first (`check_out` on the file it writes there)."""
    module = _load("tune_device.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 20)
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file"
    with pytest.raises(SystemExit) as stop:
        module.main(["export", "--dataset", str(folder), "--dir", str(target),
                     "--embedding-model", "no-such-model-xyz"])
    assert stop.value.code == (f"tune_device: --dir {target / 'export.json'}: {target} is a "
                               "file, not a folder")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_route_latency_warms_up_on_the_round_it_just_published(tmp_path, monkeypatch, settings,
                                                               live_server):
    """Its API warm-up asserted that the first answers after a publication came from the new
    round; a server goes on with the global it serves until its cached version expires
    (SYNAPSE_ROUTING_VERSION_TTL, 2 s), so a run that reached the API quickly (a small --dataset,
    few --queries) stopped there on a bare AssertionError. The warm-up now routes until the
    server answers from the round just published."""
    import httpx

    from compendium.registry import load_dataset
    from routing import services
    from routing.embeddings import get_engine
    from routing.models import RoutingToken

    settings.DATA_DIR = tmp_path / "server"
    settings.SYNAPSE_ROUTER_TUNE_EPOCHS = 0
    settings.SYNAPSE_ROUTE_RATE_LIMIT = 0
    services.forget_published_version()
    services.forget_served()
    module = _load("route_latency.py", monkeypatch)
    dataset = load_dataset(_dataset(tmp_path / "d", {"a": "x", "b": "y"}, 10))
    _, token = RoutingToken.issue("route-latency-test")
    url = f"{live_server.url}/api/v1"
    try:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {token}"}) as http:
            for _, tools, compendium, _ in module.catalogues(dataset, 0):
                vectors = get_engine().embed([s.text for s in compendium.scenarios])
                number = module.publish(tools, compendium, vectors, None)
                module.warm_up(http, url, "none", number, workers=1)
                answer = http.post(f"{url}/route/", json={"query": "request 1 for a"}).json()
                assert answer["compendium_round"] == number
        assert number == 2
    finally:
        services.forget_published_version()
        services.forget_served()


def test_route_accuracy_scores_a_max_test_sample_of_every_tool(tmp_path, monkeypatch):
    """--max-test N scored the first N held-out queries, and the split holds them tool by tool
    in the order of their ids: on MetaTool, 500 were the queries of 29 tools out of 199, all
    named A to D. Now a seeded sample of the whole held-out split, as simulate's --test-limit."""
    import json

    from routing.router import Router

    module = _load("route_accuracy.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {t: "x" for t in "abcdef"}, 20)  # 4 held out each
    routed: list[str] = []
    route_batch = Router.route_batch

    def recording(self, queries, *args, **kwargs):
        routed.extend(queries)
        return route_batch(self, queries, *args, **kwargs)

    monkeypatch.setattr(Router, "route_batch", recording)
    out = tmp_path / "out.json"
    assert module.main(["--dataset", str(folder), "--max-test", "6", "--out", str(out)]) == 0
    tools = {text.rsplit(" ", 1)[-1] for text in routed}
    assert len(tools) > 2, tools  # the first 6 of the split: 4 of tool a's, 2 of b's
    assert [row["test_queries"] for row in json.loads(out.read_text())] == [6, 6]


@pytest.mark.parametrize("value", ["0", "-2"])
def test_route_accuracy_refuses_a_max_test_below_1(value, tmp_path, monkeypatch):
    """--max-test 0 scored nothing and printed nan (and wrote NaN, which is not JSON); -2
    silently left out the split's last two queries."""
    module = _load("route_accuracy.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 10)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--max-test", value, "--out", str(out)])
    assert stop.value.code == f"route_accuracy: --max-test must be at least 1, not {value}"
    assert not out.exists()


@pytest.mark.parametrize("script", ["route_accuracy.py", "raw_ceiling.py"])
def test_a_script_refuses_a_dataset_with_nothing_to_test_in_one_line(script, tmp_path,
                                                                      monkeypatch):
    """A dataset whose every tool has fewer than 3 distinct queries has no held-out query:
    these scripts printed an accuracy of nan and wrote NaN into --out (not JSON). simulate
    refuses such a dataset; so do they now, in its words."""
    module = _load(script, monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 2)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--out", str(out)])
    assert stop.value.code == (
        f"{script.removesuffix('.py')}: the dataset d has no tool with 3 or more distinct "
        "queries: nothing to test on")
    assert not out.exists()


def test_route_accuracy_refuses_fractions_that_leave_no_train_split_in_one_line(tmp_path,
                                                                               monkeypatch):
    """--test 0 ended in stratified_split's traceback."""
    module = _load("route_accuracy.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 10)
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--test", "0"])
    assert stop.value.code == ("route_accuracy: fractions must leave a non-empty train split "
                               "(probe 0.1, test 0)")


@pytest.mark.slow
@pytest.mark.django_db
def test_the_byte_scripts_measure_the_bodies_simulate_measures(tiny_dataset, tmp_path,
                                                               monkeypatch):
    """stats_grid and dcz_dictionaries averaged over every client of a round, a client with
    nothing to submit included (the bytes of an empty compendium it never sends): on this
    federation some of the 6 clients send nothing in round 2, and the scripts' "shipped" figure was
    below simulate's dcz bytes per client per round for the very same run. They now measure the
    bodies put on the wire, each counted once, as simulate does."""
    import json

    from django.core.management import call_command

    flags = ["--dataset", str(tiny_dataset), "--partition", "iid", "--orgs", "2",
             "--clients-per-org", "3", "--seed", "0"]
    simulated = tmp_path / "simulate.json"
    call_command("simulate", *flags, "--rounds", "2", "--in-memory", "--no-store",
                 "--no-baselines", "--no-diagnostics", "--out", str(simulated), verbosity=0)
    expected = json.loads(simulated.read_text())["communication"]["dcz_bytes_per_client_round"]
    stats, dictionaries = tmp_path / "stats.json", tmp_path / "dcz.json"
    assert _load("stats_grid.py", monkeypatch).main(
        [*flags, "--rounds", "2", "--out", str(stats)]) == 0
    assert _load("dcz_dictionaries.py", monkeypatch).main(
        [*flags, "--rounds", "2", "--out", str(dictionaries)]) == 0
    grid = json.loads(stats.read_text())
    assert min(row["clients"] for row in grid["rows"]) < 6  # some client sent nothing
    assert grid["mean"]["4 digits (shipped)"] == round(expected, 1)
    assert json.loads(dictionaries.read_text())["mean"][
        "shipped: probe + schema, then pulled global"] == round(expected, 1)


@pytest.mark.slow
@pytest.mark.django_db
def test_a_wrapper_run_stored_for_the_dashboard_names_the_wrapper(tiny_dataset, tmp_path,
                                                                  monkeypatch):
    """simulate wrote its command line as `python manage.py simulate` + sys.argv[2:]; called by a
    bench wrapper, sys.argv is the wrapper's, so the stored run read `python manage.py simulate
    <the dataset's path> --orgs 2 ...`: not the command that ran (the adversaries of
    simulate_absent_clients send nothing), and not one that runs (its --dataset gone). Only the
    --out file was corrected, by the wrapper."""
    from federation.models import SimulationRun

    module = _load("simulate_absent_clients.py", monkeypatch)
    import federation.simulation.runner as runner

    monkeypatch.setattr(runner, "corrupt", runner.corrupt)  # the wrapper patches it
    argv = ["--dataset", str(tiny_dataset), "--orgs", "2", "--clients-per-org", "2", "--rounds",
            "1", "--adversarial-fraction", "0.5", "--no-baselines", "--no-diagnostics",
            "--in-memory", "--label", "absent", "--verbosity", "0"]
    monkeypatch.setattr(sys, "argv", ["bench/simulate_absent_clients.py", *argv])
    assert module.main() == 0
    stored = SimulationRun.objects.get(label="absent").document
    assert stored["command"] == "python bench/simulate_absent_clients.py " + " ".join(argv)


@pytest.mark.parametrize("count", ["3", "0"])
def test_merge_scale_refuses_more_tools_per_client_than_the_dataset_has_in_one_line(
        count, tmp_path, monkeypatch):
    """On a dataset of fewer tools than --tools-per-client (default 8), or with 0, each client's
    draw of its tools ended in numpy's traceback ("Cannot take a larger sample than population
    when replace is False")."""
    module = _load("merge_scale.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 5)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--clients", "2", "--tools-per-client", count,
                     "--out", str(out)])
    assert stop.value.code == (
        f"merge_scale: --tools-per-client {count}: a client uses 1 to 2 tools of the dataset d "
        "(those with queries outside the probe set)")
    assert not out.exists()


def test_route_latency_times_a_sample_of_every_tools_held_out_queries(tmp_path, monkeypatch):
    """It timed the first --queries (300) of the held-out split, which holds them tool by tool
    in the order of the tool ids: on MetaTool the requests of the first few tools alone. Its
    held-out queries are now in a seeded order, so that the first N are a sample of them all."""
    from compendium.registry import load_dataset, stratified_split

    module = _load("route_latency.py", monkeypatch)
    dataset = load_dataset(_dataset(tmp_path / "d", {t: "x" for t in "abcdef"}, 20))
    (_, _, _, held_out), _ = list(module.catalogues(dataset, 0))
    first = {text.rsplit(" ", 1)[-1] for text in held_out[:6]}
    assert len(first) > 2, first  # the split's first 6: tool a's held-out queries and b's
    split = stratified_split(dataset.queries, seed=0, probe_fraction=module.PROBE_FRACTION,
                             test_fraction=module.TEST_FRACTION)
    assert sorted(held_out) == sorted(q.query for q in split.test)  # the same queries, all
    assert list(module.catalogues(dataset, 0))[0][3] == held_out  # seeded


@pytest.mark.parametrize(("flag", "value"), [("--seeds", "0"), ("--test-limit", "0"),
                                             ("--test-limit", "-1")])
def test_raw_ceiling_refuses_a_count_below_1_in_one_line(flag, value, tmp_path, monkeypatch):
    """--seeds 0 ended in print_table's TypeError over no row, --test-limit -1 in
    random.sample's ValueError; --test-limit 0 scored the whole split under a flag that said
    0 (simulate refuses all three)."""
    module = _load("raw_ceiling.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 10)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), flag, value, "--out", str(out)])
    assert stop.value.code == f"raw_ceiling: {flag} must be at least 1, not {value}"
    assert not out.exists()


def test_word_cuts_offline_refuses_no_test_query_before_the_model_loads(tmp_path, monkeypatch,
                                                                         capsys):
    """--test 0 scored every cut on no query: an accuracy of nan, written into --out as NaN
    (not JSON)."""
    module = _load("word_cuts_offline.py", monkeypatch)
    folder = _dataset(tmp_path / "d", {"a": "x", "b": "y"}, 900)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as stop:
        module.main(["--dataset", str(folder), "--sent", "1700", "--test", "0", "--dictionary",
                     "10", "--embedding-model", "no-such-model-xyz", "--out", str(out)])
    assert stop.value.code == 2
    assert "error: --test must be at least 1, not 0" in capsys.readouterr().err
    assert not out.exists()
