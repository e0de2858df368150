"""``asgd-jax ablate``: DC-ASGD's Table 1 in miniature, the ``dcasgd_table1`` study in its ablate form."""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib

import jax
import numpy as np
import optax
import pytest

import asgd_jax
from asgd_jax import studies
from asgd_jax.cli import main

TINY = dict(dataset="digits", workers=(1, 2), seeds=(0, 1), epochs=1.0, evals=2, window=5)


@pytest.fixture(scope="module")
def tiny_result():
    return studies.ablate(progress=False, **TINY)


def test_arms_put_each_algorithm_where_the_table_has_it():
    study = studies.load("dcasgd_table1")
    settings = dataclasses.replace(study.form("ablate"), workers=(1, 4))
    arms = [(a.plan.workers, a.plan.mode, [v.label for v in a.variants]) for a in study.arms(settings, False)]
    assert arms == [(1, "async", ["SGD"]), (4, "async", ["ASGD", "DC-ASGD-c", "DC-ASGD-a"]), (4, "sync", ["SSGD"])]


@pytest.mark.xdist_group("ablate")  # one worker computes the module's tiny ablation once
def test_result_covers_every_cell_and_seed(tiny_result):
    cells = {(r["M"], r["label"]) for r in tiny_result.runs}
    assert cells == {(1, "SGD")} | {(2, label) for label in ("ASGD", "SSGD", "DC-ASGD-c", "DC-ASGD-a")}
    assert len(tiny_result.runs) == 2 * 5
    n = len(asgd_jax.data.load("digits").y_train)
    for run in tiny_result.runs:
        assert 0.0 <= run["test_error"] <= 1.0
        # Same epoch budget: async runs make M times more updates than SSGD's rounds.
        per_update = 32 * (run["M"] if run["label"] == "SSGD" else 1)
        assert abs(run["updates"] * per_update / n - 1.0) < 0.1
    assert all(r["mean_staleness"] > 0.5 for r in tiny_result.runs if r["label"] == "ASGD")
    assert all(r["max_staleness"] == 0 for r in tiny_result.runs if r["label"] in ("SGD", "SSGD"))


@pytest.mark.xdist_group("ablate")  # one worker computes the module's tiny ablation once
def test_swept_asgd_equals_a_separate_simulation(tiny_result):
    # The sweep builds ASGD as DC-ASGD with lambda = 0 and a traced flag; pin that it is plain ASGD.
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    run = next(r for r in tiny_result.runs if r["label"] == "ASGD" and r["seed"] == 1)
    updates = run["updates"]
    # The ablation's step schedule: divided by 10 at 50% and 75% of the updates.
    lr = optax.piecewise_constant_schedule(0.5, {int(0.5 * updates): 0.1, int(0.75 * updates): 0.1})
    alone = asgd_jax.simulate(
        asgd_jax.classification_loss(model),
        asgd_jax.rules.get("asgd", lr),
        params,
        ds.train,
        asgd_jax.Plan(asgd_jax.delays.Workers(2), num_updates=updates, eval_every=updates // 2),
        key=jax.random.key(1),
        model_state=state,
        eval_fn=asgd_jax.classification_eval(model, ds.test),
        progress=False,
    )
    np.testing.assert_allclose(alone.metrics["eval_error"][-1], run["test_error"], atol=1 / len(ds.y_test) + 1e-6)


@pytest.mark.xdist_group("ablate")  # one worker computes the module's tiny ablation once
def test_seeded_ablation_gives_identical_numbers_twice(tiny_result):
    again = studies.ablate(progress=False, **TINY)
    assert again.runs == tiny_result.runs


@pytest.mark.xdist_group("ablate")
def test_save_writes_json_csv_table_and_plot(tiny_result, tmp_path):
    paths = studies.save(tiny_result, tmp_path, plots=("panels",))
    summary = json.loads(pathlib.Path(paths["json"]).read_text())
    assert summary["runs"] == json.loads(json.dumps(tiny_result.runs))
    rows = list(csv.DictReader(pathlib.Path(paths["csv"]).read_text().splitlines()))
    assert len(rows) == len(tiny_result.runs) and rows[0]["label"] == "SGD"
    table = pathlib.Path(paths["table"]).read_text().splitlines()
    assert "| M | SGD | ASGD | SSGD | DC-ASGD-c | DC-ASGD-a |" in table
    assert pathlib.Path(paths["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_table_lays_out_mean_and_std():
    study = studies.load("dcasgd_table1")
    runs = [
        {"M": 1, "label": "SGD", "seed": 0, "test_error": 0.10},
        {"M": 1, "label": "SGD", "seed": 1, "test_error": 0.12},
        {"M": 4, "label": "ASGD", "seed": 0, "test_error": 0.2},
    ]
    lines = studies.format_table(dataclasses.replace(study, paper=studies.Paper()), runs, 2).splitlines()
    assert lines[2:] == ["| M | SGD | ASGD |", "|---|---|---|", "| 1 | 11.00 ± 1.41 | — |", "| 4 | — | 20.00 ± 0.00 |"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"algorithms": ("adam",)}, "algorithms"),
        ({"workers": (0, 4)}, "workers"),
        ({"seeds": ()}, "seeds"),
        ({"epochs": 0}, "epochs"),
        ({"lam_a": -1.0}, "lam"),
        ({"window": 0}, "window"),
        ({"compute_time": "gamma"}, "compute_time"),
    ],
)
def test_bad_config_raises(overrides, match):
    """DC-ASGD's settings (the ablation's): the study's own numbers and every generic one."""
    dc_settings = type(studies.load("dcasgd_table1").form("ablate"))
    with pytest.raises(ValueError, match=match):
        dc_settings(**overrides)


def test_cli_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "ablate" in capsys.readouterr().out


def test_cli_ablate_prints_the_table_and_writes_results(tmp_path, capsys):
    argv = ["ablate", "--dataset", "digits", "--workers", "1,2", "--seeds", "1", "--epochs", "0.5"]
    argv += ["--algorithms", "sgd", "asgd", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| M | SGD | ASGD |" in out
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.csv", "table.md", "curves.png"}


def test_cli_reports_user_errors_without_a_traceback(capsys):
    assert main(["ablate", "--workers", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asgd-jax: error: workers=[0]") and "Traceback" not in err


def test_cli_ablate_keeps_its_arms_finishes_a_killed_run_and_never_replaces_others_results(tmp_path, capsys):
    """As ``asgd-jax run``: arms kept in --out as they finish, --resume runs only the missing ones, and a folder
    holding an unfinished run or another study's results is refused in one line (it was silently replaced)."""
    flags = [
        "--dataset",
        "digits",
        "--workers",
        "1,2",
        "--seeds",
        "1",
        "--epochs",
        "0.5",
        "--algorithms",
        "sgd",
        "asgd",
    ]
    argv = ["ablate", *flags, "--no-progress", "--out", str(tmp_path / "a")]
    study = studies.load("dcasgd_table1")
    settings = dataclasses.replace(
        study.form("ablate"), dataset="digits", workers=(1, 2), seeds=(0,), epochs=0.5, algorithms=("sgd", "asgd")
    )

    def killed(arm, runs, curves):
        raise KeyboardInterrupt  # after the first arm

    with pytest.raises(KeyboardInterrupt):
        studies.run(study, settings=settings, progress=False, out=tmp_path / "a", on_arm=killed)
    assert main(argv) == 2 and "holds an unfinished run of study 'dcasgd_table1'" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert "| M | SGD | ASGD |" in capsys.readouterr().out and not (tmp_path / "a" / "arms").exists()
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    assert {(r["label"], r["M"]) for r in saved["runs"]} == {("SGD", 1), ("ASGD", 2)}
    # Another ablation's settings there: refused in one line, replaced with --overwrite.
    other = ["ablate", *flags[:-3], "--algorithms", "sgd", "--no-progress", "--out", str(tmp_path / "a")]
    assert main(other) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other settings" in err and "--overwrite" in err, err
    assert main([*other, "--overwrite"]) == 0
