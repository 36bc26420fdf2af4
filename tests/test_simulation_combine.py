"""`simulate --combine`: runs of one configuration on disjoint seeds become one document."""

from __future__ import annotations

import json
import re

import pytest
from django.core.management import CommandError, call_command

from federation.simulation.report import _shape_problem, combine, summarize, table


def doc(seeds, accuracy, bytes_raw, **extra):
    rows = [
        {"method": "synapse", "round": 1, "seed": s, "accuracy": a, "macro_accuracy": a}
        for s, a in zip(seeds, accuracy, strict=True)
    ] + [
        {"method": "bm25", "round": None, "seed": s, "accuracy": 0.5, "macro_accuracy": 0.5}
        for s in seeds
    ]
    return {
        "dataset": "tiny",
        "config": {"orgs": 2, "rounds": 1},
        "seeds": list(seeds),
        "results": rows,
        "communication": {"bytes_per_client_round": bytes_raw, "gzip_bytes_per_client_round": bytes_raw},
        "privacy": {"membership_auroc": 0.6, "token_overlap": 0.8, "share_clients_overlap_below_0_10": 0.0},
        "diagnostics": {},
        "rounds": [[{"round": 1}] for _ in seeds],
        "transfer": [],
        "seconds": 10.0,
        "command": f"python manage.py simulate --seed {seeds[0]}",
        **extra,
    }


def test_combined_runs_are_summarized_as_one_run_over_all_their_seeds():
    out = combine([doc([0, 1, 2], [0.7, 0.8, 0.9], 300.0), doc([3], [0.6], 100.0)])
    assert out["seeds"] == [0, 1, 2, 3]
    synapse = next(r for r in out["summary"] if r["method"] == "synapse")
    assert synapse["seeds"] == 4 and synapse["accuracy_mean"] == 0.75
    assert synapse["accuracy_sd"] == pytest.approx(0.1291, abs=1e-4)
    # Per-seed means weighted by seeds: (3 * 300 + 1 * 100) / 4.
    assert out["communication"]["bytes_per_client_round"] == 250.0
    assert len(out["rounds"]) == 4 and out["seconds"] == 20.0
    assert out["combined_from"][1] == "python manage.py simulate --seed 3"
    assert out["hosts"] == [None, None]  # written before documents said where they ran


def test_a_round_a_seed_did_not_measure_is_left_out_of_the_combined_mean():
    """Under drift a seed's round with no held-out query of the categories in use is null:
    the combined mean is over the seeds that measured it, not a 0 pulling it down, and a round
    no seed measured stays null (n/a in the table)."""
    measured = doc([0], [0.8], 1.0)
    unmeasured = doc([1], [None], 1.0)
    unmeasured["results"][0]["macro_accuracy"] = None
    out = combine([measured, unmeasured])
    synapse = next(r for r in out["summary"] if r["method"] == "synapse")
    assert (synapse["seeds"], synapse["accuracy_mean"], synapse["accuracy_sd"]) == (1, 0.8, 0.0)
    alone = combine([unmeasured])
    synapse = next(r for r in alone["summary"] if r["method"] == "synapse")
    assert synapse["accuracy_mean"] is None and synapse["macro_accuracy_mean"] is None
    row = next(line for line in table(alone).splitlines() if line.startswith("synapse"))
    assert row.split()[1:] == ["1", "n/a", "n/a"]
    # One figure null and the other not is no result a run writes.
    half = doc([1], [0.5], 1.0)
    half["results"][0]["accuracy"] = None
    with pytest.raises(ValueError, match="result 1 has no 'accuracy' and 'macro_accuracy' figures"):
        combine([measured, half])

def test_the_printed_table_states_a_spread_only_over_several_seeds():
    one = doc([0], [0.7], 1.0)
    one["summary"] = summarize(one["results"])
    row = next(line for line in table(one).splitlines() if line.startswith("synapse"))
    assert row.split()[2:] == ["0.700", "0.700"]  # one seed: no "± 0.000", which reads as measured
    several = combine([doc([0, 1, 2], [0.7, 0.8, 0.9], 300.0)])
    row = next(line for line in table(several).splitlines() if line.startswith("synapse"))
    assert row.split()[2:] == ["0.800", "±", "0.100", "0.800"]


def test_a_combined_document_says_where_each_part_ran():
    epyc = {"cpu": "AMD EPYC", "isa": ["avx2", "avx512_vnni"]}
    xeon = {"cpu": "Intel Xeon", "isa": ["avx2"]}
    out = combine([doc([0], [0.7], 1.0, host=epyc), doc([1], [0.8], 1.0, host=xeon)])
    assert out["hosts"] == [epyc, xeon]
    # A combined document combined again brings the hosts of its runs, not a None for itself.
    again = combine([out, doc([2], [0.9], 1.0, host=xeon)])
    assert again["hosts"] == [epyc, xeon, xeon] and again["seeds"] == [0, 1, 2]


@pytest.mark.parametrize(
    "second, message",
    [
        (doc([1], [0.5], 1.0, dataset="other"), "dataset 'other'"),
        (doc([1], [0.5], 1.0, config={"orgs": 3, "rounds": 1}), "another configuration (orgs)"),
        (doc([0], [0.5], 1.0), "document 2: seed 0 is in document 1 too"),
        (doc([1], [0.5], 1.0, privacy_sweep=[{"epsilon": 1, "mask_strength": 1, "seeds": 1, "accuracy": 0.5}]),
         "has sweeps (privacy_sweep) that document 1 has not (none)"),
        ({"dataset": "tiny"}, "document 2 is not a simulate --out file: no 'config'"),
        (5, "document 2 is not a simulate --out file: a JSON int, not an object"),
        (doc([1], [0.5], 1.0, config=None), "document 2 is not a simulate --out file: 'config' is not a JSON object"),
        (dict(doc([1], [0.5], 1.0), seeds=None), "'seeds' is not a JSON list"),
        (dict(doc([1], [0.5], 1.0), seeds=["1"]), "'seeds' holds something other than whole numbers"),
        (doc([1], [0.5], 1.0, results=[{"round": 1, "accuracy": 0.5}]), "result 1 has no 'method'"),
        (doc([1], [0.5], 1.0, results=[{"method": "synapse", "round": 1}]),
         "result 1 has no 'accuracy' and 'macro_accuracy' figures"),
        (doc([1], [0.5], 1.0, communication=[1]), "'communication' is not a JSON object"),
        (doc([1], [0.5], 1.0, host={"embedding_model": "all-mpnet-base-v2"}),
         "the runs embedded with different models (all-MiniLM-L6-v2, all-mpnet-base-v2)"),
    ],
)
def test_runs_that_do_not_belong_together_are_refused(second, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        combine([doc([0], [0.7], 1.0, host={"embedding_model": "all-MiniLM-L6-v2"}), second])


def test_a_run_records_the_code_it_ran_and_combining_runs_of_other_code_warns(tmp_path, capsys):
    """Runs of different code combined into one table could not be told apart: each run now
    records its git commit ("+" for uncommitted changes), and --combine says when they differ."""
    import subprocess

    from federation.simulation.report import code_revision

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert code_revision().removesuffix("+") == head
    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 1.0, host={"code": "a" * 40})))
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.7], 1.0, host={"code": "b" * 40 + "+"})))
    call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--out", str(tmp_path / "all.json"), "--no-store")
    assert (f"warning: the runs joined ran different code ({'a' * 40}, {'b' * 40}+)"
            in capsys.readouterr().err)
    (tmp_path / "c.json").write_text(json.dumps(doc([2], [0.7], 1.0, host={"code": "a" * 40})))
    call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "c.json"),
                 "--no-store")
    assert "different code" not in capsys.readouterr().err


def test_the_command_names_the_file_that_is_not_a_simulate_document(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 1.0)))
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.7], 1.0, config=None)))
    with pytest.raises(CommandError, match=f"^{tmp_path / 'b.json'} is not a simulate --out file: "
                       "'config' is not a JSON object$"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--no-store")


def test_a_file_from_before_an_option_existed_combines_with_runs_at_its_default():
    from federation.simulation.runner import SimulationConfig

    default = SimulationConfig().drift_every
    newer = doc([1], [0.9], 1.0, config={"orgs": 2, "rounds": 1, "drift_every": default})
    out = combine([doc([0], [0.7], 1.0), newer])
    assert out["seeds"] == [0, 1] and out["config"]["drift_every"] == default
    other = doc([1], [0.9], 1.0, config={"orgs": 2, "rounds": 1, "drift_every": default + 2})
    with pytest.raises(ValueError, match=r"another configuration \(drift_every\)"):
        combine([doc([0], [0.7], 1.0), other])


def adversarial(fraction_accuracy: dict, seeds: list[int], auroc: float):
    """An adversarial sweep section: per (mode, fraction), the final accuracy of each seed."""
    return [
        {"adversarial_mode": "tool_confusion", "adversarial_fraction": fraction,
         "robust_rule": "none", "seeds": len(seeds), "accuracy": sum(accs) / len(accs),
         "accuracy_sd": 0.0, "membership_auroc": auroc, "bytes_per_client_round": 100.0 * len(seeds),
         "accuracy_by_seed": [[seed, acc] for seed, acc in zip(seeds, accs, strict=True)]}
        for fraction, accs in fraction_accuracy.items()
    ]


def test_sweeps_of_the_same_variants_are_joined_per_variant():
    a = doc([0, 1], [0.8, 0.8], 1.0, adversarial=adversarial({0.2: [0.7, 0.8], 0.6: [0.5, 0.6]}, [0, 1], 0.6))
    b = doc([2], [0.8], 1.0, adversarial=adversarial({0.2: [0.9], 0.6: [0.4]}, [2], 0.9))
    [low, high] = combine([a, b])["adversarial"]
    assert (low["adversarial_fraction"], low["seeds"], low["accuracy"]) == (0.2, 3, 0.8)
    assert low["accuracy_sd"] == pytest.approx(0.1)
    assert low["accuracy_by_seed"] == [[0, 0.7], [1, 0.8], [2, 0.9]]
    assert (high["accuracy"], high["membership_auroc"]) == (0.5, 0.7)  # AUROC weighted by seeds
    assert high["bytes_per_client_round"] == pytest.approx(500 / 3, abs=1e-3)


def test_screening_counts_add_up_over_the_combined_seeds():
    counts = {"honest_submissions": 12, "dropped_honest": 1, "adversarial_submissions": 8,
              "dropped_adversarial": 7}
    a = doc([0, 1], [0.8, 0.8], 1.0, screening=counts,
            adversarial=[{**row, **counts} for row in adversarial({0.4: [0.7, 0.8]}, [0, 1], 0.6)])
    b = doc([2], [0.8], 1.0, screening={**counts, "dropped_honest": 0},
            adversarial=[{**row, **counts, "dropped_adversarial": 8}
                         for row in adversarial({0.4: [0.9]}, [2], 0.9)])
    out = combine([a, b])
    assert out["screening"] == {"honest_submissions": 24, "dropped_honest": 1,
                                "adversarial_submissions": 16, "dropped_adversarial": 14}
    [row] = out["adversarial"]
    assert (row["dropped_adversarial"], row["adversarial_submissions"]) == (15, 16)


def test_targeting_counts_add_up_and_a_run_without_them_leaves_them_out():
    """Each run counts its own victim queries: the counts differ from seed to seed and are
    figures, not part of a sweep variant's name. A run written before they were counted has
    none, and a sum over some of the seeds would read as all of them: then there is none."""
    a = doc([0, 1], [0.8, 0.8], 1.0, targeting={"victim_queries": 80, "victims_routed_to_target": 3},
            adversarial=[{**row, "victim_queries": 80, "victims_routed_to_target": 9}
                         for row in adversarial({0.4: [0.7, 0.8]}, [0, 1], 0.6)])
    b = doc([2], [0.8], 1.0, targeting={"victim_queries": 75, "victims_routed_to_target": 1},
            adversarial=[{**row, "victim_queries": 75, "victims_routed_to_target": 4}
                         for row in adversarial({0.4: [0.9]}, [2], 0.9)])
    out = combine([a, b])
    assert out["targeting"] == {"victim_queries": 155, "victims_routed_to_target": 4}
    [row] = out["adversarial"]
    assert (row["victim_queries"], row["victims_routed_to_target"], row["seeds"]) == (155, 13, 3)

    older = doc([2], [0.8], 1.0, adversarial=adversarial({0.4: [0.9]}, [2], 0.9))
    out = combine([a, older])
    assert out["targeting"] == {}
    [row] = out["adversarial"]
    assert row["seeds"] == 3 and "victim_queries" not in row
    assert _shape_problem({**b, "targeting": [1]}) == "'targeting' is not a JSON object"


def test_summarizer_fallback_causes_are_averaged_over_the_combined_seeds():
    def sweep(seeds, kinds, fallbacks):
        return [{"summarizer": "llm-single-shot", "seeds": len(seeds), "accuracy": 0.8,
                 "accuracy_sd": 0.0, "accuracy_by_seed": [[s, 0.8] for s in seeds],
                 "summaries": 10.0, "llm_summaries": 10.0 - fallbacks,
                 "summarizer_fallbacks": fallbacks, "summarizer_fallback_kinds": kinds}]

    a = doc([0, 1], [0.8, 0.8], 1.0, summarizer_sweep=sweep(
        [0, 1], {"llm-single-shot: unusable answer": 3.0}, 3.0))
    b = doc([2], [0.8], 1.0, summarizer_sweep=sweep(
        [2], {"llm-single-shot: unusable answer": 3.0, "llm-single-shot: LLM unavailable": 3.0}, 6.0))
    [row] = combine([a, b])["summarizer_sweep"]
    assert row["summarizer_fallbacks"] == pytest.approx(4.0)  # (2 × 3 + 6) / 3 seeds
    assert row["summarizer_fallback_kinds"] == {"llm-single-shot: LLM unavailable": 1.0,
                                                "llm-single-shot: unusable answer": 3.0}


@pytest.mark.parametrize(
    "second, message",
    [
        (doc([2], [0.8], 1.0, adversarial=adversarial({0.4: [0.9]}, [2], 0.9)), "differ in their variants"),
        (doc([2], [0.8], 1.0), "has sweeps (none) that document 1 has not (adversarial)"),
    ],
)
def test_sweeps_that_differ_are_refused(second, message):
    first = doc([0], [0.8], 1.0, adversarial=adversarial({0.2: [0.7]}, [0], 0.6))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        combine([first, second])
    old = adversarial({0.2: [0.7]}, [0], 0.6)
    del old[0]["accuracy_by_seed"]
    with pytest.raises(ValueError, match="^document 1: its adversarial sweep has no per-seed accuracies"):
        combine([doc([1], [0.8], 1.0, adversarial=old),
                 doc([2], [0.8], 1.0, adversarial=adversarial({0.2: [0.9]}, [2], 0.9))])


def test_one_document_from_before_sweeps_kept_per_seed_accuracies_stores_as_it_was():
    """Five of bench/results' documents (release, privacy and adversarial sweeps written before
    rows kept `accuracy_by_seed`) could not be stored for the dashboard: `--combine FILE` refused
    them ("run it again to combine it") though one document has nothing to pool."""
    old = adversarial({0.2: [0.7]}, [1], 0.6)
    del old[0]["accuracy_by_seed"]
    combined = combine([doc([1], [0.8], 1.0, adversarial=old)])
    assert combined["adversarial"] == old


def test_a_file_with_a_byte_order_mark_combines_and_one_not_utf8_is_named(tmp_path):
    """A file an editor saved with a UTF-8 byte-order mark was 'not JSON (Unexpected UTF-8
    BOM)'; one in another encoding was a UnicodeDecodeError traceback."""
    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(doc([0], [0.7], 200.0)).encode())
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.9], 400.0)))
    call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--out", str(tmp_path / "all.json"), "--no-store")
    assert json.loads((tmp_path / "all.json").read_text())["seeds"] == [0, 1]
    (tmp_path / "c.json").write_bytes(json.dumps(doc([2], [0.5], 1.0)).encode("utf-16"))
    with pytest.raises(CommandError, match=f"^{re.escape(str(tmp_path / 'c.json'))} is not UTF-8 "
                       "text"):
        call_command("simulate", "--combine", str(tmp_path / "b.json"), str(tmp_path / "c.json"),
                     "--no-store")
    # nor were a number too long to read and a nesting too deep (a ValueError, a RecursionError)
    for text, problem in (('{"seconds": 1' + "0" * 5000 + "}", "holds a number of more than 4,300 digits"),
                          ("[" * 100_000 + "]" * 100_000, "is not JSON (nested too deeply)")):
        (tmp_path / "c.json").write_text(text)
        with pytest.raises(CommandError, match=f"^{re.escape(str(tmp_path / 'c.json'))} "
                           f"{re.escape(problem)}$"):
            call_command("simulate", "--combine", str(tmp_path / "b.json"), str(tmp_path / "c.json"),
                         "--no-store")


def test_the_command_writes_the_combined_document(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 200.0)))
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.9], 400.0)))
    call_command(
        "simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
        "--out", str(tmp_path / "all.json"), "--no-store",
    )
    written = json.loads((tmp_path / "all.json").read_text())
    assert written["seeds"] == [0, 1]
    assert "synapse" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CommandError, match="is not JSON"):
        call_command("simulate", "--combine", str(tmp_path / "bad.json"), "--no-store")
    (tmp_path / "a2.json").write_text(json.dumps(doc([2, 0], [0.7, 0.7], 200.0)))
    with pytest.raises(CommandError, match=f"^{re.escape(str(tmp_path / 'a2.json'))}: seed 0 is in "
                       f"{re.escape(str(tmp_path / 'a.json'))} too$"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "a2.json"),
                     "--no-store")
    # --out over one of the parts would replace it by the whole: the part is refused as --out.
    before = (tmp_path / "b.json").read_text()
    with pytest.raises(CommandError, match=f"^--out {re.escape(str(tmp_path))}/[.]/b[.]json is one "
                       "of the files --combine joins; name another file$"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--out", f"{tmp_path}/./b.json", "--no-store")
    assert (tmp_path / "b.json").read_text() == before
    # The same file twice (under another spelling too) is named as such, not as a seed clash.
    with pytest.raises(CommandError, match=f"^--combine names {re.escape(str(tmp_path / 'a.json'))} "
                       "twice$"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     f"{tmp_path}/./a.json", "--no-store")


@pytest.mark.parametrize(("flags", "named"), [
    (["--seeds", "5"], "--seeds"),
    (["--lambda", "0.5", "--dataset", "elsewhere"], "--dataset, --lambda"),
    (["--in-memory"], "--in-memory"),
    (["--llm", "http://127.0.0.1:9/v1"], "--llm"),
])
def test_run_flags_given_with_combine_are_refused_not_ignored(tmp_path, flags, named):
    """--combine runs nothing: a run's flag beside it (--seeds 5, --lambda 0.5) was silently
    ignored, and the combined document kept the configuration its files were played with."""
    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 200.0)))
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.9], 400.0)))
    with pytest.raises(CommandError, match=f"^{re.escape(named)}: --combine runs nothing"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--out", str(tmp_path / "all.json"), "--no-store", *flags)
    assert not (tmp_path / "all.json").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--label", "all seeds"], "^--label names the stored run; with --no-store nothing is stored"),
    (["--unless-stored"], "^--unless-stored looks for this run stored; with --no-store it never is"),
])
@pytest.mark.parametrize("mode", [["--combine", "a.json"], ["--dataset", "/no/such/dataset"]])
def test_store_flags_with_no_store_are_refused_not_ignored(tmp_path, mode, flags, message):
    """--label with --no-store was silently dropped; --unless-stored with --no-store read the
    database it was told not to store in (a traceback where it has no table) and ran again on
    every call, since this run is never stored."""
    with pytest.raises(CommandError, match=message):
        call_command("simulate", *mode, "--no-store", *flags)


@pytest.mark.django_db
def test_a_run_that_cannot_be_stored_is_refused_before_it_starts(tmp_path):
    """Without the dashboard's table (an unmigrated database) the command says what to do before
    running or writing anything; --no-store still works. The rename is rolled back with the
    test's transaction."""
    from django.db import connection

    from federation.models import SimulationRun

    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 200.0)))
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {SimulationRun._meta.db_table} RENAME TO hidden_runs")
    with pytest.raises(CommandError, match="run `python manage.py migrate` first, or pass --no-store"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), "--out", str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(CommandError, match="no table for simulation runs"):
        call_command("simulate", "--dataset", str(tmp_path / "missing"))
    call_command("simulate", "--combine", str(tmp_path / "a.json"), "--out", str(tmp_path / "x.json"),
                 "--no-store")
    assert json.loads((tmp_path / "x.json").read_text())["seeds"] == [0]


def test_cadence_curves_are_joined_per_round_and_keep_their_variant():
    """A cadence sweep's per-round accuracies and merge figures are averaged over the combined
    seeds, weighted by seeds; the cadence stays the variant's name."""

    def cadence(every, seeds, curve, scenarios):
        return {"aggregate_every": every, "seeds": len(seeds), "accuracy": curve[-1],
                "accuracy_sd": 0.0, "accuracy_by_seed": [[s, curve[-1]] for s in seeds],
                **{f"accuracy_round_{r}": a for r, a in enumerate(curve, start=1)},
                "global_scenarios": scenarios, "dedup_rate": 0.5}

    a = doc([0, 1], [0.8, 0.8], 1.0, cadence=[cadence(1, [0, 1], [0.6, 0.9], 100),
                                              cadence(0, [0, 1], [0.6, 0.3], 40)])
    b = doc([2], [0.8], 1.0, cadence=[cadence(1, [2], [0.9, 0.6], 160), cadence(0, [2], [0.9, 0.6], 70)])
    every, frozen = combine([a, b])["cadence"]
    assert (every["aggregate_every"], frozen["aggregate_every"]) == (1, 0)
    assert every["accuracy_round_1"] == pytest.approx(0.7) and every["accuracy_round_2"] == pytest.approx(0.8)
    assert frozen["accuracy_round_2"] == pytest.approx(0.4) and every["global_scenarios"] == pytest.approx(120)
    assert every["seeds"] == 3 and every["accuracy_by_seed"] == [[0, 0.9], [1, 0.9], [2, 0.6]]


@pytest.mark.parametrize(("target", "message"), [
    (lambda tmp: tmp, "is a folder; name a file"),
    # a folder that does not exist yet, named as one (Path drops the separator: a file "newdir")
    (lambda tmp: f"{tmp}/newdir/", "newdir/ is a folder; name a file"),
    (lambda tmp: tmp / "a.json" / "out.json", "a.json is a file, not a folder"),
    (lambda tmp: "/proc/synapse-out.json", "/proc/synapse-out.json cannot be written"),
])
def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, target, message):
    """Before the dataset loads (it does not exist here) and before a combine reads its files."""
    for flags in (["--dataset", "/no/such/dataset"], ["--combine", str(_written(tmp_path))]):
        with pytest.raises(CommandError, match=message) as error:
            call_command("simulate", *flags, "--out", str(target(tmp_path)), "--no-store")
        assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # nothing left behind


def test_out_is_written_whole_into_a_new_folder_without_a_scratch_file(tmp_path):
    out = tmp_path / "new" / "out.json"
    call_command("simulate", "--combine", str(_written(tmp_path)), "--out", str(out), "--no-store")
    assert json.loads(out.read_text())["seeds"] == [0]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.json"]  # no scratch file


def _written(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(doc([0], [0.7], 200.0)))
    return path


@pytest.mark.django_db
def test_a_run_whose_out_fails_at_the_end_is_stored_first_and_says_so(tmp_path, monkeypatch):
    """--out became unwritable after the check (here: the check is skipped and --out is a
    folder): the run is stored, and the error names the stored run and the file."""
    from federation.management.commands import simulate
    from federation.models import SimulationRun

    monkeypatch.setattr(simulate, "_check_out", lambda path: None)
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--combine", str(_written(tmp_path)), "--out", str(tmp_path),
                     "--label", "late")
    stored = SimulationRun.objects.get(label="late")
    assert str(error.value).startswith(f"the run is stored as simulation run {stored.pk}, but --out: ")
    assert f"cannot write {tmp_path}" in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no scratch file left


@pytest.mark.django_db(transaction=True)  # the connection is cut outside any test transaction
def test_a_run_whose_database_connection_dropped_while_it_played_is_still_stored_and_written(
        tmp_path, monkeypatch):
    """The database closed the command's connection while the run played (a restart, an idle
    timeout over a run of hours): storing it raised a traceback at the very end, and --out,
    written after the store, was never written: the whole run lost. The store is tried again
    on a new connection, and --out is written whatever the store does."""
    from django.db import DatabaseError, connection

    from federation.management.commands import simulate
    from federation.models import SimulationRun

    real_combine = simulate.combine

    def combine_then_lose_the_connection(*args):
        with pytest.raises(DatabaseError), connection.cursor() as cursor:  # the server ends it
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return real_combine(*args)

    monkeypatch.setattr(simulate, "combine", combine_then_lose_the_connection)
    out = tmp_path / "out.json"
    call_command("simulate", "--combine", str(_written(tmp_path)), "--out", str(out),
                 "--label", "reconnected")
    assert SimulationRun.objects.get(label="reconnected").document["seeds"] == [0]
    assert json.loads(out.read_text())["seeds"] == [0]

    # A store that fails on the new connection too: --out is written all the same, and the
    # error says so and how to store it from there.
    def store_fails(document, label=""):
        raise DatabaseError("the database is read-only")

    monkeypatch.setattr("federation.services.store_simulation_run", store_fails)
    out.unlink()
    with pytest.raises(CommandError) as error:
        call_command("simulate", "--combine", str(_written(tmp_path)), "--out", str(out),
                     "--label", "lost")
    assert json.loads(out.read_text())["seeds"] == [0]
    assert str(error.value) == (
        f"the run could not be stored (the database is read-only); its results are written to "
        f"{out}: store them with `python manage.py simulate --combine {out}`"
    )


def test_a_run_in_which_no_client_sent_anything_has_no_byte_figure_not_nan():
    from compendium.schema import Compendium
    from federation.simulation.runner import RoundOutcome, communication

    silent = [RoundOutcome(r, Compendium(), {}, {}, [], [], [], {}) for r in (1, 2)]
    figures = communication(silent)
    assert figures["bytes_per_client_round"] is None and figures["dcz_bytes_per_client_round"] is None
    assert figures["bytes_round_1"] == 0.0
    one = doc([0], [0.7], None)
    several = combine([one, doc([1], [0.8], None)])
    assert several["communication"]["bytes_per_client_round"] is None
    assert "bytes per client per round: none, no client sent anything" in table(several)
    json.dumps(several, allow_nan=False)  # no NaN anywhere
    # Beside a run that sent something, the figure is that run's.
    assert combine([one, doc([1], [0.8], 300.0)])["communication"]["bytes_per_client_round"] == 300.0


@pytest.mark.django_db
def test_a_nan_is_neither_written_nor_stored(tmp_path):
    from federation.models import SimulationRun

    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], float("nan"))))  # NaN, as Python writes it
    with pytest.raises(CommandError, match="hold a NaN or an infinity, which JSON cannot represent"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), "--out", str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists() and not SimulationRun.objects.exists()


class _Played:
    """A stand-in for a Simulation: each seed's result is given, not played."""

    def __init__(self, config, results):
        from types import SimpleNamespace

        self.config, self.results = config, results
        self.dataset, self.engine, self.progress = SimpleNamespace(name="tiny"), None, print

    def run_seed(self, seed):
        return self.results[seed]


def _result(seed, synapse, last_row, per_category=None):
    from federation.simulation.runner import SeedResult

    rows = [{"method": "synapse", "round": r, "seed": seed, "accuracy": a, "macro_accuracy": a}
            for r, a in enumerate(synapse, start=1)]
    rows.append({"method": last_row, "round": len(synapse), "seed": seed, "accuracy": 0.1,
                 "macro_accuracy": 0.1})
    # the bytes every played seed reports (`runner.communication`)
    sent = {"bytes_per_client_round": 100.0, "gzip_bytes_per_client_round": 40.0}
    return SeedResult(seed, rows=rows, per_category=per_category or {}, communication=sent)


@pytest.mark.parametrize("last_row", ["synapse_served", "synapse_untuned"])
def test_a_sweep_reads_synapse_at_the_final_round_not_the_last_row(last_row):
    from federation.simulation.report import sweep
    from federation.simulation.runner import SimulationConfig

    results = {0: _result(0, [0.5, 0.8], last_row), 1: _result(1, [0.4, 0.6], last_row)}
    [row] = sweep(lambda config: _Played(config, results), SimulationConfig(), [{"tau": 0.8}], [0, 1])
    assert row["accuracy"] == 0.7 and row["accuracy_by_seed"] == [[0, 0.8], [1, 0.6]]


def test_the_per_category_table_is_over_every_seed_weighted_by_its_queries():
    from federation.simulation.report import run
    from federation.simulation.runner import SimulationConfig

    results = {
        0: _result(0, [0.5], "bm25", {"Travel": {"accuracy": 1.0, "n": 3}, "Math": {"accuracy": 0.5, "n": 2}}),
        1: _result(1, [0.5], "bm25", {"Travel": {"accuracy": 0.0, "n": 1}}),
    }
    document = run(_Played(SimulationConfig(), results), [0, 1])
    assert document["per_category"] == {"Math": {"accuracy": 0.5, "n": 2}, "Travel": {"accuracy": 0.75, "n": 4}}
    first, second = (dict(doc([s], [0.5], 1.0), per_category=results[s].per_category) for s in (0, 1))
    assert combine([first, second])["per_category"] == document["per_category"]


def test_an_error_in_a_run_says_which_seed_and_round_it_came_from():
    from federation.simulation.report import PlayedRuns, sweep
    from federation.simulation.runner import Simulation, SimulationConfig

    class Failing(_Played):
        seed_name = Simulation.seed_name

        def run_seed(self, seed):
            if seed == 8:
                self.at_round = 2
                raise ValueError("no scenario to route with")
            self.at_round = None
            return _result(seed, [0.5], "bm25")

    with pytest.raises(ValueError, match=r"^seed 8 \(2/2\): round 2: no scenario to route with$"):
        PlayedRuns().results(Failing(SimulationConfig(), {}), [7, 8])
    with pytest.raises(ValueError, match=r"^tau_sweep 1/1: seed 8 \(2/2\): round 2: no scenario"):
        sweep(lambda config: Failing(config, {}), SimulationConfig(), [{"tau": 0.8}], [7, 8], name="tau_sweep")


def test_runs_and_sweep_rows_say_how_many_clients_played_adversarial():
    from federation.simulation.report import run, sweep
    from federation.simulation.runner import SimulationConfig

    results = {0: _result(0, [0.5], "bm25")}
    config = SimulationConfig(orgs=2, clients_per_org=5, adversarial_fraction=0.25,
                              adversarial_mode="tool_confusion")
    document = run(_Played(config, results), [0])
    assert document["adversarial_clients"] == 2  # 10 x 0.25 = 2.5, rounded to even
    document["summary"] = summarize(document["results"])
    assert "adversarial clients: 2 of 10 (tool_confusion, --adversarial-fraction 0.25)" in table(document)
    rows = sweep(lambda c: _Played(c, results), config,
                 [{"adversarial_mode": "tool_confusion", "adversarial_fraction": f, "robust_rule": "none"}
                  for f in (0.0, 0.3)], [0])
    assert [row["adversarial_clients"] for row in rows] == [0, 3]
    document["adversarial"] = rows
    assert "  tool_confusion            30% (3 clients) none" in table(document)
    assert combine([document])["adversarial"][1]["adversarial_clients"] == 3


@pytest.mark.parametrize(("changes", "problem"), [
    ({"seeds": [], "results": []}, "'seeds' is empty"),
    ({"seeds": [0, 0]}, "'seeds' names a seed twice"),
    ({"communication": {"bytes_per_client_round": "100"}},
     "'communication' has 'bytes_per_client_round' that is not a number"),
    ({"privacy": {"membership_auroc": True}}, "'privacy' has 'membership_auroc' that is not a number"),
    ({"per_category": {"Travel": {"accuracy": 0.5}}},
     "'per_category' has 'Travel' without an 'accuracy' and a whole 'n'"),
    ({"seeds": [3]}, "result 1 is of seed 0, not one of its 'seeds'"),
    ({"results": [{"method": "synapse", "seed": 0, "accuracy": 0.7, "macro_accuracy": 0.7}]},
     "result 1 has no 'round'"),
    # What every run writes and a combined document must keep: a row's seed, the bytes a client
    # sent per round raw and gzipped (such files were combined into rows of no seed, a table of
    # "0 gzip" bytes, or no communication figure at all).
    ({"results": [{"method": "synapse", "round": 1, "accuracy": 0.7, "macro_accuracy": 0.7}]},
     "result 1 has no 'seed'"),
    ({"communication": {"bytes_per_client_round": 100.0}},
     "'communication' has no 'gzip_bytes_per_client_round'"),
    ({"communication": {}},
     "'communication' has no 'bytes_per_client_round' and 'gzip_bytes_per_client_round'"),
    ({"transfer": [{"reranker": "fusion", "accuracy": 0.7, "macro_accuracy": 0.7}]},
     "transfer row 1 has no 'model' and 'reranker' or no 'accuracy' and 'macro_accuracy' figures"),
    ({"tau_sweep": [1]}, "'tau_sweep' row 1 is not a JSON object"),
    ({"tau_sweep": [{"tau": 0.8, "accuracy": 0.5, "accuracy_by_seed": [[0, 0.5]]}]},
     "'tau_sweep' row 1 has no whole 'seeds' and 'accuracy' figure"),
    ({"screening": {"dropped_honest": "3"}}, "'screening' has 'dropped_honest' that is not a whole number"),
    ({"seconds": "ten"}, "'seconds' is not a number"),
    ({"communication": {"bytes_per_client_round": 5.0, "bytes_round_two": 5.0}},
     "'communication' has 'bytes_round_two', not a round's figure"),
    ({"privacy": {"membership_auroc": 0.6}},
     "'privacy' has no 'token_overlap' and 'share_clients_overlap_below_0_10'"),
    ({"privacy": {"membership_auroc": None, "token_overlap": 0.5, "share_clients_overlap_below_0_10": 0.1}},
     "'privacy' has no 'membership_auroc'"),
    ({"diagnostics": {"reranker_contraction_p99": 0.4}},
     "'diagnostics' has no 'decisions_unchanged_under_noise'"),
    ({"adversarial": [{"adversarial_fraction": 0.2, "robust_rule": "none", "seeds": 1, "accuracy": 0.5}]},
     "'adversarial' row 1 has no 'adversarial_mode'"),
    ({"cadence": [{"seeds": 1, "accuracy": 0.5}]}, "'cadence' row 1 has no 'aggregate_every'"),
    ({"tau_sweep": [{"tau": 0.8, "seeds": 1, "accuracy": 0.5, "accuracy_by_seed": [[0]]}]},
     "'tau_sweep' row 1 has 'accuracy_by_seed' that is not a list of [seed, accuracy] pairs"),
    # What the dashboard then reads of the stored run: a host that is not an object, a setting
    # of another type than the configuration's (its accuracy page failed on both).
    ({"hosts": ["epyc"]}, "'hosts' holds something other than objects"),
    ({"config": {"orgs": 2, "rounds": 1, "min_users": "2"}},
     "'config' has 'min_users' that is not a whole number"),
    ({"config": {"orgs": 2, "rounds": 1, "client_tau": "0.8"}},
     "'config' has 'client_tau' that is not a number or null"),
    ({"config": {"orgs": 2, "rounds": 1, "transfer_models": "bf16"}},
     "'config' has 'transfer_models' that is not a list of strings"),
])
def test_a_hand_edited_file_is_refused_in_one_line_naming_what_is_wrong(tmp_path, changes, problem):
    """Before: a ZeroDivisionError (no seeds), a numpy TypeError (a figure that is text), a
    KeyError (a category row without 'n') traceback; rows of seeds the file does not list, or a
    seed listed twice, were combined into a summary of the wrong seeds."""
    (tmp_path / "a.json").write_text(json.dumps({**doc([0], [0.7], 1.0), **changes}))
    (tmp_path / "b.json").write_text(json.dumps({**doc([1], [0.7], 1.0), **{
        k: v for k, v in changes.items() if k not in ("seeds", "results")}}))
    with pytest.raises(CommandError, match=f"^{tmp_path / 'a.json'} is not a simulate --out file: "
                       f"{re.escape(problem)}$"):
        call_command("simulate", "--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--no-store")


@pytest.mark.django_db
def test_unless_stored_combines_and_stores_a_label_once(tmp_path, capsys):
    """`--combine ... --label L --unless-stored` (a script's last step, run again) stored the
    combined run again on every call: --unless-stored was not looked at with --combine."""
    from federation.models import SimulationRun

    (tmp_path / "a.json").write_text(json.dumps(doc([0], [0.7], 200.0)))
    (tmp_path / "b.json").write_text(json.dumps(doc([1], [0.9], 400.0)))
    flags = ["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--label", "all seeds",
             "--unless-stored"]
    call_command("simulate", *flags)
    call_command("simulate", *flags, "--out", str(tmp_path / "all.json"))
    assert SimulationRun.objects.filter(label="all seeds").count() == 1
    assert "labelled 'all seeds' is stored already; nothing to do" in capsys.readouterr().out
    assert not (tmp_path / "all.json").exists()


def test_the_printed_table_shows_the_privacy_and_release_sweeps():
    """--sweep-epsilon/--sweep-lambda and --sweep-min-users were played and written to the JSON,
    but the printed results said nothing of them (the τ, summarizer, contradiction and cadence
    sweeps and the adversarial rows were printed)."""
    document = doc([0, 1], [0.7, 0.8], 300.0)
    document["summary"] = summarize(document["results"])
    figures = {"membership_auroc": 0.71, "token_overlap": 0.55}
    document["privacy_sweep"] = [
        {"epsilon": 1.0, "mask_strength": 0.0, "accuracy": 0.83, "accuracy_sd": 0.01,
         "bytes_per_client_round": 778.0, **figures},
        {"epsilon": 1.0, "mask_strength": 1.5, "accuracy": 0.8, "accuracy_sd": 0.02,
         "bytes_per_client_round": 700.0, **figures},
    ]
    document["release_sweep"] = [
        {"min_users": 1, "accuracy": 0.83, "accuracy_sd": 0.01, "bytes_per_client_round": 780.0,
         **figures},
        {"min_users": 3, "accuracy": 0.4, "accuracy_sd": 0.0, "bytes_per_client_round": None,
         "membership_auroc": 0.5, "token_overlap": 0.0},
    ]
    document["tau_sweep"] = [{"tau": 0.8, "accuracy": 0.8, "accuracy_sd": 0.0}]
    lines = table(document).splitlines()
    assert lines[lines.index("τ sweep (final round, mean over seeds):") + 2].split()[:2] == ["0.8", "0.800"]
    start = lines.index("privacy sweep (final round, mean over seeds):")
    assert lines[start + 1].split() == ["ε", "λ", "accuracy", "AUROC", "overlap", "bytes"]
    assert lines[start + 2].split() == ["1", "0", "0.830", "±", "0.010", "0.710", "0.550", "778"]
    assert lines[start + 3].split() == ["1", "1.5", "0.800", "±", "0.020", "0.710", "0.550", "700"]
    start = lines.index("k-anonymous release sweep (final round, mean over seeds):")
    assert lines[start + 1].split() == ["k", "accuracy", "AUROC", "overlap", "bytes"]
    assert lines[start + 2].split() == ["1", "0.830", "±", "0.010", "0.710", "0.550", "780"]
    assert lines[start + 3].split() == ["3", "0.400", "±", "0.000", "0.500", "0.000", "nothing",
                                        "sent"]


def test_runs_of_two_versions_of_one_dataset_are_not_combined():
    """--combine compared datasets by their folder's name only: runs on a dataset edited between
    them (or on two folders of one name) were joined into one mean as if of one dataset."""
    first = doc([0], [0.7], 1.0, dataset_fingerprint="1111")
    with pytest.raises(ValueError, match="^b.json is of another version of dataset 'tiny' than "
                       "a.json: its tools or queries differ$"):
        combine([first, doc([1], [0.8], 1.0, dataset_fingerprint="2222")], ["a.json", "b.json"])
    joined = combine([first, doc([1], [0.8], 1.0, dataset_fingerprint="1111")])
    assert joined["dataset_fingerprint"] == "1111"
    # A document written before runs had a fingerprint joins either.
    assert combine([first, doc([1], [0.8], 1.0)])["dataset_fingerprint"] == "1111"
    assert "dataset_fingerprint" not in combine([doc([0], [0.7], 1.0)])
    assert _shape_problem(doc([0], [0.7], 1.0, dataset_fingerprint=3)) == (
        "'dataset_fingerprint' is not a JSON string")


def test_a_run_records_the_code_it_started_with_not_what_is_checked_out_when_it_ends(monkeypatch):
    """A long run recorded the commit checked out when it wrote its document: one started before a
    merge and ending after it named the new code, which it had not run."""
    from types import SimpleNamespace

    from federation.simulation import report
    from federation.simulation.runner import SimulationConfig

    checked_out = ["a" * 40]
    monkeypatch.setattr(report, "code_revision", lambda: checked_out[0])

    class Played:
        def results(self, simulation, seeds):
            checked_out[0] = "b" * 40  # a commit lands while the seeds run
            return []

    simulation = SimpleNamespace(dataset=SimpleNamespace(name="tiny"), config=SimulationConfig(),
                                 engine=None)
    assert report.run(simulation, [0], Played())["host"]["code"] == "a" * 40


def test_the_printed_table_says_when_a_row_is_measured_on_fewer_seeds_than_the_run():
    """A row some seeds did not measure (under drift, a round with no held-out query of the
    categories in use) is a mean over the seeds that did: the dashboard shows its seeds and no
    spread for one seed. The printed table showed "0.800 ± 0.000", a spread over one seed read
    as over the run's two, and did not say that a seed was missing from the mean."""
    measured = doc([0], [0.8], 1.0)
    unmeasured = doc([1], [None], 1.0)
    unmeasured["results"][0]["macro_accuracy"] = None
    printed = table(combine([measured, unmeasured, doc([2], [0.6], 1.0)]))
    row = next(line for line in printed.splitlines() if line.startswith("synapse"))
    assert row.split()[1:] == ["1", "0.700", "±", "0.141", "0.700", "(2", "of", "3", "seeds)"]
    printed = table(combine([measured, unmeasured]))
    row = next(line for line in printed.splitlines() if line.startswith("synapse"))
    assert row.split()[1:] == ["1", "0.800", "0.800", "(1", "of", "2", "seeds)"]  # no "± 0.000"
    bm25 = next(line for line in printed.splitlines() if line.startswith("bm25"))
    assert "seeds)" not in bm25  # measured on every seed: nothing to say
