"""Reproduction studies: configs match the issue's grids, runs are deterministic, tables and reports are right."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from asgd_jax import studies
from asgd_jax.cli import main

TINY = studies.Settings(dataset="digits", seeds=(0, 1), epochs=1.0, evals=2, window=10, warm_epochs=0.5)


def test_every_study_is_found_and_its_grids_are_the_papers():
    names = studies.available()
    assert names == [
        "dcasgd_lambda_sweep",
        "dcasgd_table1",
        "gpu_asgd_nsync",
        "heterogeneous_workers",
        "speedup_model",
        "staleness_curve",
    ]
    full = {n: studies.load(n) for n in names}
    arms = {n: s.arms(s.full, False) for n, s in full.items()}
    gpu = {(a.coords["clients"], a.n_sync, a.coords["start"]) for a in arms["gpu_asgd_nsync"]}
    assert gpu == {(c, n, s) for c in (1, 2, 4, 8, 16, 32) for n in (1, 10, 100, 300, 900) for s in ("cold", "warm")}
    assert all(a.warm == (a.coords["start"] == "warm") for a in arms["gpu_asgd_nsync"])
    (sweep_arm,) = arms["dcasgd_lambda_sweep"]  # one compiled program
    assert sorted(v.lam for v in sweep_arm.variants if v.adaptive) == [0.0, 0.5, 1.0, 2.0, 4.0]
    table1 = {(a.coords["M"], v.label, a.mode) for a in arms["dcasgd_table1"] for v in a.variants}
    assert table1 == {(1, "SGD", "async")} | {
        (m, label, "async") for m in (4, 8) for label in ("ASGD", "DC-ASGD-c", "DC-ASGD-a")
    } | {(4, "SSGD", "sync"), (8, "SSGD", "sync")}
    assert {a.coords["M"] for a in arms["staleness_curve"] if a.tau is None} == {1, 2, 4, 8, 16, 32}
    assert full["dcasgd_table1"].full.model == "resnet20" and full["dcasgd_table1"].paper[8]["DC-ASGD-a"] == 8.57
    for name, study in full.items():  # every study documents its command and expectation
        assert f"asgd-jax run {name} --quick" in study.reproduces and "Expected:" in study.reproduces
    with pytest.raises(ValueError, match="choose from dcasgd_lambda_sweep"):
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
    assert "at commit" in text


def test_warm_arms_start_from_the_warm_up_and_fixed_delay_arms_run():
    study = studies.Study(
        name="t",
        title="t",
        reproduces="",
        quick=TINY,
        full=TINY,
        rows="M",
        arms=lambda s, q: [
            studies.Arm({"M": 2, "start": "cold"}, workers=2, n_sync=2, push="delta", server_lr=1.0),
            studies.Arm({"M": 2, "start": "warm"}, workers=2, n_sync=2, push="delta", server_lr=1.0, warm=True),
            studies.Arm({"M": 3, "tau": 2}, tau=2),
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
        rows="clients",
        metric="speedup",
        baseline={"clients": 1},
        paper={8: {"paper": 3.2}},
    )
    runs = [{"clients": 1, "label": "A", "time_to_target": t, "test_error": 0.1} for t in (9.0, 11.0)]
    runs += [{"clients": 8, "label": "A", "time_to_target": 4.0, "test_error": 0.1}]
    runs += [{"clients": 8, "label": "B", "time_to_target": math.nan, "test_error": 0.1}]  # never reached the target
    table = studies.format_table(study, runs, 2)
    assert "| 1 | 1.00x | — |" in table and "| 8 | 2.50x | — |" in table and "| 8 | 3.20 |" in table
    error = dataclasses.replace(study, metric="test_error")
    assert "| 1 | 10.00 ± 0.00 |" in studies.format_table(error, runs, 2)
    np.testing.assert_equal(studies.time_to_target(np.arange(4.0), np.array([0.9, 0.6, 0.4, 0.3]), 0.5), 2.0)


def test_cli_lists_studies_and_errors(tmp_path, capsys):
    assert main(["run", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "gpu_asgd_nsync" in listing and "GPU A-SGD" in listing
    assert main(["run", "nope", "--quick"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err
