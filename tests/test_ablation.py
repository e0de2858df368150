"""The ablation job and the ``asgd-jax`` command line."""

from __future__ import annotations

import csv
import json
import pathlib

import jax
import numpy as np
import pytest

import asgd_jax
from asgd_jax import ablation
from asgd_jax.cli import main

TINY = dict(dataset="digits", workers=(1, 2), seeds=(0, 1), epochs=1.0, evals=2, window=5)


@pytest.fixture(scope="module")
def tiny_result():
    return ablation.run(ablation.AblationConfig(**TINY), progress=False)


def test_groups_put_each_algorithm_where_the_table_has_it():
    cfg = ablation.AblationConfig(workers=(1, 4))
    assert cfg.groups() == [
        (1, "async", ["sgd"]),
        (4, "async", ["asgd", "dc_asgd_c", "dc_asgd_a"]),
        (4, "sync", ["ssgd"]),
    ]


def test_result_covers_every_cell_and_seed(tiny_result):
    table = tiny_result.table()
    assert set(table) == {1, 2}
    assert set(table[1]) == {"sgd"} and set(table[2]) == {"asgd", "ssgd", "dc_asgd_c", "dc_asgd_a"}
    assert len(tiny_result.runs) == 2 * 5
    for run in tiny_result.runs:
        assert 0.0 <= run["test_error"] <= 1.0
        # Same epoch budget: async runs make M times more updates than SSGD's rounds.
        n = len(asgd_jax.data.load("digits").y_train)
        per_update = 32 * (run["workers"] if run["algorithm"] == "ssgd" else 1)
        assert abs(run["updates"] * per_update / n - 1.0) < 0.1
    asgd_runs = [r for r in tiny_result.runs if r["algorithm"] == "asgd"]
    assert all(r["mean_staleness"] > 0.5 for r in asgd_runs)
    assert all(r["max_staleness"] == 0 for r in tiny_result.runs if r["algorithm"] in ("sgd", "ssgd"))


def test_swept_asgd_equals_a_separate_simulation(tiny_result):
    # The sweep builds ASGD as DC-ASGD with lambda = 0 and a traced flag; pin that it is plain ASGD.
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    run = next(r for r in tiny_result.runs if r["algorithm"] == "asgd" and r["seed"] == 1)
    updates = run["updates"]
    alone = asgd_jax.simulate(
        asgd_jax.classification_loss(model),
        asgd_jax.asgd(ablation._schedule(0.5, updates)),
        params,
        ds.train,
        delays=asgd_jax.delays.Workers(2),
        num_updates=updates,
        key=jax.random.key(1),
        model_state=state,
        eval_fn=asgd_jax.classification_eval(model, ds.test),
        eval_every=updates // 2,
        progress=False,
    )
    np.testing.assert_allclose(alone.metrics["eval_error"][-1], run["test_error"], atol=1 / len(ds.y_test) + 1e-6)


def test_seeded_ablation_gives_identical_numbers_twice(tiny_result):
    again = ablation.run(ablation.AblationConfig(**TINY), progress=False)
    assert again.runs == tiny_result.runs


def test_save_writes_json_csv_table_and_plot(tiny_result, tmp_path):
    paths = ablation.save(tiny_result, tmp_path)
    summary = json.loads(pathlib.Path(paths["json"]).read_text())
    assert summary["runs"] == tiny_result.runs
    assert summary["table_test_error_percent"]["2"]["asgd"]["mean"] == pytest.approx(tiny_result.table()[2]["asgd"][0])
    rows = list(csv.DictReader(pathlib.Path(paths["csv"]).read_text().splitlines()))
    assert len(rows) == len(tiny_result.runs) and rows[0]["algorithm"] == "sgd"
    table = pathlib.Path(paths["table"]).read_text()
    assert table.splitlines()[0] == "| M | SGD | ASGD | SSGD | DC-ASGD-c | DC-ASGD-a |"
    assert pathlib.Path(paths["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_table_lays_out_mean_and_std():
    result = ablation.AblationResult(
        ablation.AblationConfig(workers=(1, 4), algorithms=("sgd", "asgd")),
        runs=[
            {"algorithm": "sgd", "workers": 1, "seed": 0, "test_error": 0.10},
            {"algorithm": "sgd", "workers": 1, "seed": 1, "test_error": 0.12},
            {"algorithm": "asgd", "workers": 4, "seed": 0, "test_error": 0.2},
        ],
        curves={("sgd", 1): {}, ("asgd", 4): {}},
        seconds=0.0,
    )
    assert ablation.format_table(result).splitlines() == [
        "| M | SGD | ASGD |",
        "|---|---|---|",
        "| 1 | 11.00 ± 1.41 |  |",
        "| 4 |  | 20.00 ± 0.00 |",
    ]


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
    with pytest.raises(ValueError, match=match):
        ablation.AblationConfig(**overrides)


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
