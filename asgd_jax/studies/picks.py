"""A tuned study's picks, from its results only: each run's table cell, the columns' virtual-time budgets, the best
tuned setting per cell and the picks at the edge of their grid. What the runner reads to widen a grid
(:func:`asgd_jax.studies.widened_arms`) and what the tables and plots show (:mod:`asgd_jax.studies.present`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from asgd_jax.studies.language import Study

__all__ = ["best_tuned", "cell_of", "grid_edges", "time_budgets", "within_budgets"]


def cell_of(study: Study, r: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A run's table cell: ``(facet, row, column)`` of its coordinates."""
    t = study.table
    return (r.get(t.facet) if t.facet else None, r.get(t.rows), r.get(t.columns))


def time_budgets(study: Study, runs: list[dict[str, Any]]) -> dict[tuple[Any, Any], float]:
    """With :attr:`Table.equal_time`, each column's virtual-time budget: ``{(facet, column): T}``, T the earliest end
    of a run there (every run of the column covers ``[0, T]``); without it, none.

    Example:
      >>> from asgd_jax import studies
      >>> study = studies.load("staleness_leaderboard")
      >>> study.table.equal_time
      True
      >>> runs = [{"label": rule, "M": 4, "cluster": "uniform", "virtual_time": t} for rule, t in [("ASGD", 90.0),
      ...         ("SSGD", 240.0), ("ASGD", 93.5)]]
      >>> studies.time_budgets(study, runs)
      {('uniform', 4): 90.0}
    """
    if not study.table.equal_time:
        return {}
    budgets: dict[tuple[Any, Any], float] = {}
    for r in runs:
        facet, _, column = cell_of(study, r)
        budgets[(facet, column)] = min(budgets.get((facet, column), math.inf), float(r["virtual_time"]))
    return budgets


def within_budgets(study: Study, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs with a time to target past their column's budget (:func:`time_budgets`) made "not reached" (NaN);
    the runs themselves unchanged without :attr:`Table.equal_time`."""
    budgets = time_budgets(study, runs)
    if not budgets:
        return runs
    out = []
    for r in runs:
        facet, _, column = cell_of(study, r)
        late = r.get("time_to_target", math.nan) > budgets[(facet, column)]
        out.append({**r, "time_to_target": math.nan} if late else r)
    return out


def best_tuned(study: Study, runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[tuple, dict[str, Any]]]:
    """The runs of each cell's best tuned setting, and the picks: ``{(facet, row, column): {"lr": 0.1, ...}}``.

    A cell's runs are grouped by their :attr:`Tuning.over` coordinates; the group with the lowest mean of
    :attr:`Tuning.by` wins (the final training error by default; a diverged run, or one that never reaches the
    target, counts as the worst), so the test set only reports. Without ``tune``: all runs, no picks.

    Example:
      >>> from asgd_jax import studies
      >>> study = studies.load("staleness_leaderboard")
      >>> runs = [{"label": "ASGD", "M": 4, "cluster": "uniform", "lr": lr, "train_error": e, "test_error": e}
      ...         for lr, e in [(0.1, 0.3), (0.1, 0.5), (0.2, 0.35), (0.2, 0.35)]]
      >>> kept, picks = studies.best_tuned(study, runs)
      >>> [r["lr"] for r in kept], picks
      ([0.2, 0.2], {('uniform', 'ASGD', 4): {'lr': 0.2}})
    """
    if not study.tuning.over:
        return runs, {}
    groups: dict[tuple, dict[tuple, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(cell_of(study, r), {}).setdefault(tuple(r.get(k) for k in study.tuning.over), []).append(r)

    def score(group: list[dict[str, Any]]) -> float:
        errs = np.asarray([r[study.tuning.by] for r in group], np.float64)
        return float(errs.mean()) if np.isfinite(errs).all() else math.inf

    kept, picks = [], {}
    for cell, by_setting in groups.items():
        setting = min(by_setting, key=lambda k: score(by_setting[k]))
        kept += by_setting[setting]
        picks[cell] = {k: v for k, v in zip(study.tuning.over, setting, strict=True) if v is not None}
    return kept, picks


def grid_edges(study: Study, runs: list[dict[str, Any]], picks: dict[tuple, dict[str, Any]]) -> dict[tuple, set]:
    """Per cell, the tuned coordinates whose pick is the smallest or largest of 3 or more values tried there."""
    tried: dict[tuple, dict[str, set]] = {}
    for r in runs:
        for k in study.tuning.over:
            if r.get(k) is not None:
                tried.setdefault(cell_of(study, r), {}).setdefault(k, set()).add(r[k])
    return {
        cell: {k for k, v in p.items() if len(grid := tried[cell][k]) >= 3 and v in (min(grid), max(grid))}
        for cell, p in picks.items()
    }
