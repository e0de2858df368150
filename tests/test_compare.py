"""asgd_jax.compare: every rule's grid in one compiled sweep, each rule's pick, the table and the plot against virtual
time (an evaluation after u updates at the time of update u)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.problems import NOISY, W1, lsq_loss

import asgd_jax
from asgd_jax.errors import ConfigError

PLAN = asgd_jax.Plan(asgd_jax.delays.Workers(4), batch_size=8, num_updates=120, eval_every=40)
EVAL = lambda w, _: {"loss": lsq_loss(w, NOISY)}
GRIDS = {"asgd": {"learning_rate": [0.01, 0.03, 0.1]}, "dc_asgd_a": {"learning_rate": [0.03], "lam": [0.5, 2.0]}}


@pytest.fixture(scope="module")
def result():
    return asgd_jax.compare(lsq_loss, W1, NOISY, PLAN, GRIDS, seeds=[0, 1], eval_fn=EVAL, progress=False)


def test_each_rules_runs_are_its_own_sweeps_runs(result):
    """One program for every rule and setting; each run is that rule's run (to float rounding: rules.one_of)."""
    keys = asgd_jax.grid(seeds=[0, 1], lr=[0.01, 0.03, 0.1])[0]
    alone = asgd_jax.sweep(
        lsq_loss,
        lambda h: asgd_jax.asgd(h["lr"]),
        W1,
        NOISY,
        PLAN,
        keys=keys,
        hparams={"lr": np.tile(np.float32([0.01, 0.03, 0.1]), 2)},
        eval_fn=EVAL,
        progress=False,
    )
    rows = [r for r, row in enumerate(result.runs) if row["rule"] == "asgd"]
    assert [(result.runs[r]["seed"], result.runs[r]["learning_rate"]) for r in rows] == [
        (s, lr) for s in (0, 1) for lr in (0.01, 0.03, 0.1)
    ]
    np.testing.assert_allclose(result.result.metrics["loss"][rows], alone.metrics["loss"], rtol=1e-5, atol=1e-7)


def test_the_pick_is_the_lowest_mean_final_loss_and_an_edge_is_marked(result):
    for rule, pick in result.picks.items():
        groups = {}
        for row in result.runs:
            if row["rule"] == rule:
                key = tuple(row[k] for k in pick)
                groups.setdefault(key, []).append(row["final_loss"])
        best = min(groups, key=lambda k: np.mean(groups[k]))
        assert tuple(pick.values()) == best
    assert result.picks["asgd"] == {"learning_rate": 0.1}  # the largest of three: an edge
    assert result.edges == {"asgd": {"learning_rate"}, "dc_asgd_a": set()}
    table = result.table()
    assert "| asgd | learning_rate=0.1* |" in table and "edge of the values tried" in table
    assert len(result.picked("dc_asgd_a")) == 2  # one per seed


def test_the_plot_draws_an_evaluation_after_u_updates_at_the_time_of_update_u(result):
    fig = result.plot()
    m = result.result.metrics
    rows = result.picked("asgd")
    at = m["eval_update"][rows[0]]
    assert at.tolist() == [0, 40, 80, 120]
    expected = np.stack([np.r_[0.0, m["time"][r][at[1:] - 1]] for r in rows]).mean(axis=0)
    line = fig.axes[0].lines[list(result.picks).index("asgd")]
    np.testing.assert_allclose(line.get_xdata(), expected)
    np.testing.assert_allclose(line.get_ydata(), m["eval_loss"][rows].mean(axis=0))


def test_a_second_comparison_with_other_numbers_compiles_nothing(result):
    other = {"asgd": {"learning_rate": [0.02, 0.04, 0.05]}, "dc_asgd_a": {"learning_rate": [0.05], "lam": [1.0, 3.0]}}
    with compilations() as counts:
        asgd_jax.compare(lsq_loss, W1, NOISY, PLAN, other, seeds=[3, 4], eval_fn=EVAL, progress=False)
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}, dict(counts)


@pytest.mark.parametrize(
    ("grids", "message"),
    [
        ({}, "grids="),
        ({"nope": {"learning_rate": [0.1]}}, "rule='nope'"),
        ({"asgd": {"lam": [0.1]}}, r"grids\['asgd'\]"),
        ({"asgd": {"learning_rate": [0.1], "lam": [1.0]}}, "asgd takes"),
        ({"asgd": {"learning_rate": []}}, "non-empty list of finite numbers"),
        ({"asgd": {"learning_rate": [float("nan")]}}, "non-empty list of finite numbers"),
    ],
)
def test_bad_grids_are_named_before_anything_compiles(grids, message):
    with compilations() as counts, pytest.raises(ConfigError, match=message):
        asgd_jax.compare(lsq_loss, W1, NOISY, PLAN, grids, progress=False)
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}
