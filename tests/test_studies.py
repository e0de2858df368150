"""Reproduction studies: configs match the issue's grids, runs are deterministic, tables and reports are right."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, provenance, studies
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.plan import Plan

REPO = pathlib.Path(__file__).resolve().parents[1]

TINY = studies.Settings(dataset="digits", seeds=(0, 1), epochs=1.0, evals=2, window=10, warm_epochs=0.5)


def test_every_study_is_found_and_its_grids_are_the_papers():
    names = studies.available()
    assert names == [
        "async_local_sgd",
        "communication_bound",
        "dcasgd_lambda_sweep",
        "dcasgd_table1",
        "gpu_asgd_nsync",
        "heterogeneous_data",
        "heterogeneous_workers",
        "optimal_time",
        "speedup_model",
        "staleness_curve",
        "staleness_leaderboard",
    ]
    full = {n: studies.load(n) for n in names}
    arms = {n: s.arms(s.full, False) for n, s in full.items()}
    gpu = {(a.coords["clients"], a.plan.n_sync, a.coords["start"]) for a in arms["gpu_asgd_nsync"]}
    assert gpu == {(c, n, s) for c in (1, 2, 4, 8, 16, 32) for n in (1, 10, 100, 300, 900) for s in ("cold", "warm")}
    assert all(a.warm == (a.coords["start"] == "warm") for a in arms["gpu_asgd_nsync"])
    (sweep_arm,) = arms["dcasgd_lambda_sweep"]  # one compiled program
    assert sorted(v.hp["lam"] for v in sweep_arm.variants if v.hp["adaptive"]) == [0.0, 0.5, 1.0, 2.0, 4.0]
    table1 = {(a.coords["M"], v.label, a.plan.mode) for a in arms["dcasgd_table1"] for v in a.variants}
    assert table1 == {(1, "SGD", "async")} | {
        (m, label, "async") for m in (4, 8) for label in ("ASGD", "DC-ASGD-c", "DC-ASGD-a")
    } | {(4, "SSGD", "sync"), (8, "SSGD", "sync")}
    curve = arms["staleness_curve"]
    assert {a.coords["M"] for a in curve if isinstance(a.plan.delays, delays.Workers)} == {1, 2, 4, 8, 16, 32}
    table1 = full["dcasgd_table1"]
    assert table1.full.model == "resnet20" and table1.paper.numbers[8]["DC-ASGD-a"] == 8.57
    for name, study in full.items():  # every study documents its command and expectation
        assert f"asgd-jax run {name} --quick" in study.reproduces and "Expected:" in study.reproduces
    with pytest.raises(ValueError, match="choose from async_local_sgd, communication_bound, dcasgd_lambda_sweep"):
        studies.load("no_such_study")


def test_a_seeded_study_gives_identical_numbers_twice_and_a_report(tmp_path):
    study = studies.load("dcasgd_lambda_sweep")
    first = studies.run(study, settings=TINY, progress=False)
    second = studies.run(study, settings=TINY, progress=False)
    assert first.runs == second.runs and first.curves == second.curves  # bit for bit
    assert len(first.runs) == 2 * 10  # seeds x (5 + 5 lambdas)
    by = {(r["label"], r["lambda"], r["seed"]): r["test_error"] for r in first.runs}
    assert by[("DC-ASGD-a", 0.0, 0)] == by[("DC-ASGD-c", 0.0, 0)]  # lambda 0 is ASGD either way
    paths = studies.save(first, tmp_path / "lam")
    saved = json.loads((tmp_path / "lam" / "results.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(first.runs))
    assert {"final.png", "curves_epoch.png"} <= set(paths)
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| lambda | DC-ASGD-a | DC-ASGD-c |" in text and "![dcasgd_lambda_sweep final](lam/final.png)" in text
    env = saved["environment"]  # what produced the results, and the report says so for each study
    assert env["asgd_jax"] == asgd_jax.__version__ and env["jax"] == jax.__version__
    assert env["commit"] == provenance.commit() and f"Produced by {provenance.describe(env)}." in text
    assert text.count(provenance.describe(env)) == 2  # and the report's header: made by the same
    older = {k: v for k, v in saved.items() if k != "environment"}  # results from before it was recorded
    (tmp_path / "lam" / "results.json").write_text(json.dumps(older))
    assert main(["report", str(tmp_path)]) == 0
    assert "Produced by an asgd_jax that did not record it." in (tmp_path / "report.md").read_text()


def test_the_commit_is_the_checkout_asgd_jax_is_imported_from_not_the_working_folders(tmp_path):
    """Once the report printed ``git rev-parse HEAD`` of the folder it ran in (another project's commit, or none)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert head.returncode == 0  # (the suite runs in a checkout)
    script = "from asgd_jax import provenance; print(provenance.commit())"
    elsewhere = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.strip().split("+")[0] == head.stdout.strip() == provenance.commit().split("+")[0]


def test_warm_arms_start_from_the_warm_up_and_fixed_delay_arms_run():
    study = studies.Study(
        name="t",
        title="t",
        reproduces="",
        quick=TINY,
        full=TINY,
        arms=lambda s, q: [
            studies.Arm({"M": 2, "start": "cold"}, Plan(2, n_sync=2, push="delta", local_lr=0.5), server_lr=1.0),
            studies.Arm(
                {"M": 2, "start": "warm"}, Plan(2, n_sync=2, push="delta", local_lr=0.5), server_lr=1.0, warm=True
            ),
            studies.Arm({"M": 3, "tau": 2}, Plan(delays.FixedDelay(2))),
        ],
    )
    result = studies.run(study, settings=TINY, progress=False)
    curves = {c["coords"].get("start", "tau"): c for c in result.curves.values()}
    assert curves["warm"]["epoch"][0] > TINY.warm_epochs > curves["cold"]["epoch"][0]
    assert curves["warm"]["train_error"][0] < curves["cold"]["train_error"][0]  # it starts trained
    assert len(result.runs) == 3 * len(TINY.seeds)


def test_tables_speedup_and_paper_columns():
    study = studies.Study(
        name="s",
        title="s",
        reproduces="",
        quick=TINY,
        full=TINY,
        arms=lambda s, q: [],
        table=studies.Table(rows="clients", metric="speedup", baseline={"clients": 1}),
        paper=studies.Paper(numbers={8: {"paper": 3.2}}),
    )
    runs = [{"clients": 1, "label": "A", "time_to_target": t, "test_error": 0.1} for t in (9.0, 11.0)]
    runs += [{"clients": 8, "label": "A", "time_to_target": 4.0, "test_error": 0.1}]
    runs += [{"clients": 8, "label": "B", "time_to_target": math.nan, "test_error": 0.1}]  # never reached the target
    table = studies.format_table(study, runs, 2)
    assert "| 1 | 1.00x | — |" in table and "| 8 | 2.50x | — |" in table and "| 8 | 3.20 |" in table
    error = dataclasses.replace(study, table=dataclasses.replace(study.table, metric="test_error"))
    assert "| 1 | 10.00 ± 0.00 |" in studies.format_table(error, runs, 2)
    np.testing.assert_equal(studies.time_to_target(np.arange(4.0), np.array([0.9, 0.6, 0.4, 0.3]), 0.5), 2.0)


def test_the_flat_keywords_of_before_the_groups_still_make_the_same_study_with_a_warning():
    """``Study(rows=..., tune=..., paper={...})`` (the 24 flat fields of before) makes the grouped study, each keyword
    warning where it went; ``dataclasses.replace(study, widen=2)`` changes the group's field and keeps the others."""
    reference = lambda s, rows: ("theory", {r: 1.0 for r in rows})
    grouped = studies.Study(
        "g",
        "g",
        "",
        TINY,
        TINY,
        arms=lambda s, q: [],
        table=studies.Table(rows="clients", columns="M", facet="cluster", metric="speedup", baseline={"clients": 1}),
        tuning=studies.Tuning(over=("lr",), by="time_to_target", widen=1),
        paper=studies.Paper(numbers={8: {"paper": 3.2}}, note="a note", prediction=reference),
    )
    flat = dict(rows="clients", columns="M", facet="cluster", metric="speedup", baseline={"clients": 1})
    flat |= dict(tune=("lr",), tune_by="time_to_target", widen=1)
    flat |= dict(paper={8: {"paper": 3.2}}, paper_note="a note", reference=reference)
    with pytest.warns(DeprecationWarning) as warned:
        old = studies.Study("g", "g", "", TINY, TINY, arms=grouped.arms, **flat)
    assert old == grouped and len(warned) == len(flat)
    said = {str(w.message) for w in warned}
    assert "Study(rows=...) is deprecated: write Study(table=Table(rows=...))" in " ".join(said)
    assert any("Study(tune=...) is deprecated: write Study(tuning=Tuning(over=...))" in m for m in said)
    assert any("Study(paper=...) is deprecated: write Study(paper=Paper(numbers=...))" in m for m in said)
    with pytest.warns(DeprecationWarning, match=r"tuning=Tuning\(widen="):
        wider = dataclasses.replace(grouped, widen=2)
    assert wider.tuning == studies.Tuning(over=("lr",), by="time_to_target", widen=2) and wider.table == grouped.table
    with pytest.raises(ConfigError, match="table="):
        studies.Study("g", "g", "", TINY, TINY, arms=grouped.arms, table="M")


def test_cli_lists_studies_and_errors(tmp_path, capsys):
    assert main(["run", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "gpu_asgd_nsync" in listing and "GPU A-SGD" in listing
    assert main(["run", "nope", "--quick"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err


def test_the_leaderboard_grid_is_the_issues():
    study = studies.load("staleness_leaderboard")
    arms = study.arms(study.full, False)
    cells = {(a.coords["cluster"], a.coords["M"]) for a in arms if not a.for_every}
    clusters = ("uniform", "half at half speed", "fixed delay", "1 + √i")
    assert cells == {(c, m) for c in clusters for m in (4, 16, 32)}
    rules_per_cell = {}
    for a in arms:
        for v in a.variants:
            rules_per_cell.setdefault((a.coords["cluster"], a.coords["M"]), {}).setdefault(v.label, set()).add(v.lr)
    expected = {"ASGD", "DC-ASGD-c", "DC-ASGD-a", "staleness-aware", "delay-adaptive", "Gap-Aware", "DANA-Zero"}
    expected |= {"Delayed Nesterov", "SSGD", "delay-threshold (Koloskova)"}
    expected |= {"async DiLoCo", "FADAS", "CGAD"}  # issue #37's rules: the DiLoCo line and the adaptive server rules
    expected |= {"Ringmaster (stops)", "Rennala (stops)", "m-Synchronous"}  # the optimal-time methods, R = S = m = M/2
    for cell in cells:
        assert set(rules_per_cell[cell]) == expected
        assert all(len(lrs) >= 2 for lrs in rules_per_cell[cell].values())  # every rule's lr is tuned
    (reference,) = [a for a in arms if a.for_every]  # sequential SGD, run once, stands in every cell
    assert reference.plan.workers == 1 and set(reference.for_every) == {"M", "cluster"}
    dn = [a for a in arms if a.variants[0].rule == "delayed_nesterov"]
    assert all(
        a.plan.n_sync > 1 and a.plan.push == "delta" and a.rule_options["buffer_size"] == a.plan.workers for a in dn
    )
    local = [a for a in arms if a.variants[0].rule == "diloco"]
    assert all(a.plan.n_sync > 1 and a.plan.push == "delta" and a.plan.mode == "async" for a in local)
    for rule, options in [("fadas", ("buffer_size", "delay_threshold")), ("cgad", ("cutoff", "decay"))]:
        mine = [a for a in arms if a.variants[0].rule == rule]
        assert all(a.plan.n_sync == 1 and a.rule_options.keys() == set(options) for a in mine)
    slow = [a for a in arms if a.coords["cluster"] == "half at half speed"]
    half = lambda m: [0.5] * (m // 2) + [1.0] * (m // 2)
    law = lambda a: getattr(a.plan.delays, "workers", a.plan.delays)  # the optimal-time clusters' Workers law
    assert all(sorted(law(a).speeds) == half(a.plan.workers) for a in slow)
    sqrt = [a for a in arms if a.coords["cluster"] == "1 + √i" and isinstance(a.plan.delays, delays.Workers)]
    assert all(np.allclose(1 / np.asarray(a.plan.delays.speeds), delays.sqrt_times(a.plan.workers)) for a in sqrt)
    optimal = {type(a.plan.delays).__name__: a.plan.delays for a in arms if a.coords.get("M") == 16}
    assert (optimal["Ringmaster"].threshold, optimal["Rennala"].batch, optimal["MSync"].m) == (8, 8, 8)
    assert optimal["Ringmaster"].stops and optimal["Rennala"].stops
    assert (
        study.full.seeds == (0, 1, 2, 3, 4)
        and study.quick.seeds == (0, 1)
        and study.full.model == "resnet20"
        and study.quick.model == "cnn"
    )
    assert study.tuning == studies.Tuning(over=("lr", "lambda"), widen=1)  # an edge pick runs once more, a step out
    assert (study.table.metric, study.table.also) == ("time_to_target", ("test_error",))


def test_a_mix_of_rules_in_one_arm_gives_each_rule_its_own_runs():
    """One program for several rules (the rule index traced) gives every run what its rule alone gives."""
    variants = (
        studies.Variant("ASGD", lr=0.2),
        studies.Variant("Gap-Aware", rule="gap_aware", lr=0.2),
        studies.Variant("DANA", rule="dana", lr=0.05),
    )
    one = [studies.Arm({"M": 3}, Plan(3), variants=variants)]
    apart = [studies.Arm({"M": 3}, Plan(3), variants=(v,)) for v in variants]
    settings = dataclasses.replace(TINY, seeds=(0,))

    def runs(arms):
        study = studies.Study("m", "m", "", settings, settings, arms=lambda s, q: arms)
        return {r["label"]: r for r in studies.run(study, settings=settings, progress=False).runs}

    mixed, alone = runs(one), runs(apart)
    for label in mixed:
        for key in ("test_error", "train_error", "mean_staleness", "virtual_time"):
            np.testing.assert_allclose(mixed[label][key], alone[label][key], rtol=1e-5, err_msg=f"{label} {key}")


def _leaderboard_runs() -> list[dict]:
    """Made-up runs of two rules in two clusters, with a tuned lr (and a diverged setting)."""
    runs = []
    for cluster in ("uniform", "slow"):
        for seed in (0, 1):
            for lr, err in ((0.1, 0.30), (0.2, 0.20), (0.4, math.nan)):
                runs.append(
                    {
                        "label": "A",
                        "M": 4,
                        "cluster": cluster,
                        "lr": lr,
                        "seed": seed,
                        "train_error": err,
                        "test_error": err + 0.01 * seed,
                        "time_to_target": 10.0 * lr,
                        "virtual_time": 3.0 + seed,  # every lr: the clock does not depend on it
                    }
                )
            runs.append(
                {
                    "label": "SGD",
                    "M": 4,
                    "cluster": cluster,
                    "lr": 0.1,
                    "seed": seed,
                    "train_error": 0.1,
                    "test_error": 0.1,
                    "time_to_target": 5.0,
                    "virtual_time": 12.0,
                }
            )
    return runs


def test_best_tuned_picks_by_training_error_and_a_diverged_setting_never_wins():
    study = studies.load("staleness_leaderboard")
    kept, picks = studies.best_tuned(study, _leaderboard_runs())
    assert {(r["cluster"], r["label"], r["lr"]) for r in kept} == {(c, "A", 0.2) for c in ("uniform", "slow")} | {
        (c, "SGD", 0.1) for c in ("uniform", "slow")
    }
    assert len(kept) == 8 and picks[("uniform", "A", 4)] == {"lr": 0.2}
    untuned = dataclasses.replace(study, tuning=studies.Tuning())
    runs = _leaderboard_runs()
    assert studies.best_tuned(untuned, runs) == (runs, {})  # without tune: every run, no picks


def test_the_table_counts_the_diverged_runs_in_one_line():
    study = studies.load("staleness_leaderboard")
    table = studies.format_table(study, _leaderboard_runs(), num_seeds=2)
    assert (
        "4 of 16 runs diverged (their training error turned NaN or Inf): a tuned cell counts such a setting as its "
        "worst." in table
    )
    assert "diverged" not in studies.format_table(study, [r for r in _leaderboard_runs() if r["lr"] != 0.4], 2)


def _curve(m: int, label: str, lr: float, level: float) -> dict:
    steps = np.arange(1, 9)
    return {
        "coords": {"M": m, "lr": lr, "label": label},
        "epoch": (steps / 4).tolist(),
        "update": steps.tolist(),
        "time": (2.0 * steps).tolist(),
        "train_error": (level / steps).tolist(),
        "eval_epoch": [2.0],
        "test_error": [level],
    }


def test_a_tuned_studys_curves_are_its_picks_in_a_panel_per_row_in_its_own_measure():
    """The optimal-time study (6 rules x 2 M here, each with a learning rate that wins, one that loses and one that
    diverges): its curve plot draws each cell's pick only, a panel per M with a colour per rule, ||grad f||^2 as it is
    on a log axis; the diverged settings are not drawn, and matplotlib lays the figure out without a warning."""
    import warnings

    study = studies.load("optimal_time")
    labels = ["A", "B", "C", "D", "E", "F"]
    runs, curves = [], {}
    for m in (16, 64):
        for label in labels:
            for lr, level in ((0.1, 2.0), (0.2, 1.0), (0.4, math.inf)):
                runs += [{"M": m, "label": label, "lr": lr, "seed": 0, "train_error": level, "time_to_target": level}]
                curves[f"{label} (M={m} | lr={lr})"] = _curve(m, label, lr, level)
    result = studies.StudyResult(study, study.quick, True, runs, curves, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # matplotlib's layout warnings
        fig = studies.curves_figure(result, "time")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["M = 16", "M = 64"]
    for ax in panels:
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == labels  # one per rule: the pick, lr 0.2
        np.testing.assert_array_equal(lines[0].get_ydata(), 1.0 / np.arange(1, 9))  # as it is, not in %
        assert ax.get_yscale() == "log" and len({tuple(line.get_color()) for line in lines}) == len(labels)
    assert "‖∇f‖²" in fig.get_supylabel() and "picks" not in fig.get_supylabel()
    assert "virtual time to the target ‖∇f‖²" in studies.format_table(study, runs, num_seeds=1)
    with pytest.raises(ConfigError, match="x='epochs'"):
        studies.curves_figure(result, "epochs")
    few = dataclasses.replace(study, tuning=studies.Tuning(), measure=None)
    mine = {n: c for n, c in curves.items() if n.startswith("A ")}  # 6 curves, one of them diverged: one axes
    fig = studies.curves_figure(studies.StudyResult(few, few.quick, True, runs, mine, 0.0), "epoch")
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 6 and ax.get_yscale() == "linear" and "training error (%)" in ax.get_ylabel()
    np.testing.assert_array_equal(ax.get_lines()[1].get_ydata(), 100.0 * (1.0 / np.arange(1, 9)))
    assert np.isnan(ax.get_lines()[2].get_ydata()).all()  # Inf left out, not drawn to the sky
    with pytest.raises(ConfigError, match="measure="):
        dataclasses.replace(study, measure="  ")


def test_equal_time_gives_every_rule_of_a_column_one_budget():
    """The leaderboard's headline: a column's budget is its earliest run end (3.0: rule A's seed 0); SGD reaches the
    target at 5.0, after it, so it shows "—" there, though it would within its own (longer) budget of epochs."""
    study = studies.load("staleness_leaderboard")
    assert study.table.equal_time
    runs = _leaderboard_runs()
    assert studies.time_budgets(study, runs) == {("uniform", 4): 3.0, ("slow", 4): 3.0}
    within = studies.within_budgets(study, runs)
    late = [r["time_to_target"] > 3.0 for r in runs]  # SGD's 5.0 and rule A's lr 0.4 (4.0)
    assert [math.isnan(r["time_to_target"]) for r in within] == late and sum(late) == 8
    assert all(a == b for a, b, gone in zip(within, runs, late, strict=True) if not gone)
    table = studies.format_table(study, runs, 2)
    headline = table.split("final test error")[0]
    assert "| SGD | — |" in headline and "| A | 2.00 ± 0.00 |" in headline and "| budget | 3.0 |" in headline
    own_time = dataclasses.replace(study, table=dataclasses.replace(study.table, equal_time=False))
    own = studies.format_table(own_time, runs, 2)
    assert "| SGD | 5.00 ± 0.00 |" in own and "budget" not in own
    assert studies.time_budgets(own_time, runs) == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["A", "B", "C"]),
            st.sampled_from([4, 16]),
            st.floats(0.1, 100.0),
            st.one_of(st.just(math.nan), st.floats(0.0, 100.0)),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_within_budgets_only_ever_drops_a_crossing_after_its_columns_budget(rows):
    study = studies.load("staleness_leaderboard")
    runs = [
        {"label": rule, "M": m, "cluster": "uniform", "virtual_time": end, "time_to_target": min(t, end)}
        for rule, m, end, t in rows
    ]
    budgets = studies.time_budgets(study, runs)
    for before, after in zip(runs, studies.within_budgets(study, runs), strict=True):
        budget = budgets[("uniform", before["M"])]
        assert budget <= before["virtual_time"]
        if before["time_to_target"] <= budget:
            assert after == before
        else:
            assert math.isnan(after["time_to_target"])


def test_facets_give_one_table_each_with_both_metrics_and_the_picks():
    study = studies.load("staleness_leaderboard")
    table = studies.format_table(study, _leaderboard_runs(), 2)
    for cluster in ("uniform", "slow"):
        assert table.count(f"cluster = {cluster}") == 4  # time to target, its budgets, test error, picks
    assert "| A | 20.50 ± 0.71 |" in table  # lr 0.2's runs: test errors 0.20 and 0.21
    assert "| A | 2.00 ± 0.00 |" in table  # its time to target
    assert "| A | lr 0.2 |" in table and "| SGD | lr 0.1 |" in table  # 0.2: inside A's grid; SGD: one value
    assert "each cell the best of its lr, lambda grid by training error" in table and "*: the edge" not in table
    edge = [dict(r, train_error=0.05) if r["label"] == "A" and r["lr"] == 0.1 else r for r in _leaderboard_runs()]
    table = studies.format_table(study, edge, 2)
    assert "| A | lr 0.1* |" in table and "*: the edge of its grid" in table  # the smallest of 0.1, 0.2, 0.4


def test_a_progress_bar_names_its_arm_each_rule_once_and_its_cluster():
    study = studies.load("staleness_leaderboard")
    arms = study.arms(study.quick, True)
    push = next(a for a in arms if a.coords == {"M": 16, "cluster": "half at half speed"} and a.plan.mode == "async")
    assert (
        push.description
        == ("M=16 async, half at half speed: ASGD, DC-ASGD-c, DC-ASGD-a, staleness-aware, delay-adaptive, Gap-Aw")[:72]
    )
    ssgd = next(a for a in arms if a.coords == {"M": 4, "cluster": "fixed delay"} and a.plan.mode == "sync")
    assert ssgd.description == "M=4 sync, fixed delay: SSGD"


def test_faceted_bar_plots_stack_their_panels_and_lay_out_with_missing_values(tmp_path):
    """One panel per cluster, stacked (a README-width figure), and a cell with no value (the target never reached)
    drawn as a mark: matplotlib lays the figure out without a warning (an empty unclipped mark once collapsed it)."""
    import warnings

    import matplotlib.image

    study = studies.load("staleness_leaderboard")
    runs = _leaderboard_runs()
    for r in runs:
        if r["label"] == "SGD" and r["cluster"] == "slow":
            r["time_to_target"] = math.inf  # not reached
    result = studies.StudyResult(study, study.quick, True, runs, {}, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # matplotlib's layout warnings
        paths = studies.plot(result, tmp_path)
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["final.png", "final_test_error.png"]
    for p in paths:
        height, width, _ = matplotlib.image.imread(p).shape
        assert height > width  # two stacked panels


def test_run_takes_fewer_seeds_and_epochs_from_the_command_line(tmp_path, capsys):
    """`asgd-jax run <study> --quick --seeds N --epochs E`: a shorter look at a long study, the rest its quick form."""
    assert main(["run", "dcasgd_lambda_sweep", "--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["run", "dcasgd_lambda_sweep", "--epochs", "nan"]) == 2
    assert "--epochs" in capsys.readouterr().err
    out = tmp_path / "short"
    args = ["run", "dcasgd_lambda_sweep", "--quick", "--seeds", "1", "--epochs", "0.5", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    saved = json.loads((out / "results.json").read_text())
    quick = studies.load("dcasgd_lambda_sweep").quick
    assert saved["settings"]["seeds"] == [0] and saved["settings"]["epochs"] == 0.5
    assert saved["settings"]["dataset"] == quick.dataset and saved["settings"]["model"] == quick.model
    assert len(saved["runs"]) == 10 and {r["seed"] for r in saved["runs"]} == {0}  # 10 variants x 1 seed


def test_widening_runs_an_edge_pick_one_grid_step_further_out():
    """A learning rate picked at the top of its grid (3 values, too small for this budget) is run again at twice it,
    round after round, and the picks are made again with those runs; a pick still at the edge stays marked."""
    lrs = (0.005, 0.01, 0.02)
    arm = studies.Arm({"M": 2}, Plan(2), variants=tuple(studies.Variant("ASGD", lr=lr) for lr in lrs))
    settings = dataclasses.replace(TINY, seeds=(0,), schedule="constant")
    study = studies.Study(
        "w", "w", "", settings, settings, arms=lambda s, q: [arm], tuning=studies.Tuning(over=("lr",))
    )
    plain = studies.run(study, settings=settings, progress=False)
    assert studies.best_tuned(study, plain.runs)[1][(None, 2, "ASGD")] == {"lr": 0.02}
    assert [a.variants[0].lr for a in studies.widened_arms(study, settings, [arm], plain.runs)] == [0.04]
    wide = studies.run(
        dataclasses.replace(study, tuning=studies.Tuning(over=("lr",), widen=2)), settings=settings, progress=False
    )
    tried = sorted(r["lr"] for r in wide.runs)
    assert tried == [0.005, 0.01, 0.02, 0.04, 0.08]  # two rounds, each one step (x2) further
    assert [r for r in wide.runs if r["lr"] in lrs] == plain.runs  # the grid's own runs are as they were
    pick = studies.best_tuned(study, wide.runs)[1][(None, 2, "ASGD")]["lr"]
    assert pick in (0.04, 0.08) and pick > 0.02
    with pytest.raises(ConfigError, match="widen"):
        studies.Tuning(over=("lr",), widen=-1)


def test_a_study_compiles_only_a_few_arms_ahead_of_the_one_computing():
    """A long study neither compiles all its arms at once nor keeps them: when arm i finishes, no more than
    COMPILE_AHEAD arms beyond it have been compiled (a hundred arms held at once ran LLVM out of memory maps)."""
    from helpers.compiles import compilations

    from asgd_jax.studies import runner

    # One arm more than the compiled-ahead window and the computing arm: a study that compiled every arm at once
    # would show all four compiled when the first ends.
    arms = [studies.Arm({"M": m}, Plan(m), variants=(studies.Variant("ASGD", lr=0.1),)) for m in (2, 3, 4, 5)]
    settings = dataclasses.replace(TINY, seeds=(0, 1))
    study = studies.Study("ahead", "ahead", "", settings, settings, arms=lambda s, q: arms)
    seen = []
    with compilations() as compiled:
        studies.run(
            study,
            settings=settings,
            progress=False,
            on_arm=lambda a, r, c: seen.append(sum(n for name, n in compiled.items() if name == "simulator_chunk")),
        )
    assert len(seen) == len(arms) > 1 + runner.COMPILE_AHEAD
    assert all(n <= i + 1 + runner.COMPILE_AHEAD for i, n in enumerate(seen)), seen
