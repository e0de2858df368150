"""Rules compared in one call: a grid per rule, every rule and setting in one compiled sweep, each rule's tuned pick.

Between a raw :func:`asgd_jax.sweep` (one rule, hand-indexed results) and a full :class:`asgd_jax.studies.Study`
(arms, forms, files): give the loss, the weights, the data, a :class:`asgd_jax.Plan` (its delay model is the cluster)
and ``{rule name: {hyperparameter: values}}``. Every rule's grid, times the seeds, runs as one program (the rule chosen
per run by :func:`asgd_jax.rules.one_of`, its numbers traced); each rule's pick is the setting with the lowest mean
final training loss over the seeds (a diverged run counts as the worst; the held-out split never picks), with a
``*`` where the pick is at the edge of a grid of three or more values (widen it). :meth:`Comparison.table` lays the
picks out; :meth:`Comparison.plot` draws each pick's held-out error against virtual time, seeds as a band.

Example:
  >>> import jax.numpy as jnp, numpy as np, asgd_jax
  >>> x = np.random.default_rng(0).normal(size=(256, 3)).astype(np.float32)
  >>> data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
  >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
  >>> result = asgd_jax.compare(loss, jnp.zeros(3), data, asgd_jax.Plan(8, batch_size=16, num_updates=200),
  ...     {"asgd": {"learning_rate": [0.01, 0.03]}, "dc_asgd_a": {"learning_rate": [0.03], "lam": [0.5, 2.0]}},
  ...     seeds=[0, 1], progress=False)
  >>> sorted(result.picks)
  ['asgd', 'dc_asgd_a']
  >>> result.picks["asgd"]
  {'learning_rate': 0.03}
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asgd_jax import errors, rules
from asgd_jax.plan import Plan
from asgd_jax.simulator import SimulationResult, grid, sweep

__all__ = ["Comparison", "compare"]


@dataclasses.dataclass(frozen=True)
class _OneOf:
    """``hparams -> rule``: run r's rule (``hparams["rule"]``) with its numbers. A value, so a second comparison of the
    same rules and grid names compiles nothing."""

    names: tuple[str, ...]
    hp: tuple[tuple[str, ...], ...]  # each rule's hyperparameters (learning_rate first)
    num_workers: int

    def build(self, i: int, h: Mapping[str, Any]):
        name, extra = self.names[i], {k: h[k] for k in self.hp[i] if k != "learning_rate"}
        if "num_workers" in rules.required(name):
            extra["num_workers"] = self.num_workers
        return rules.get(name, h["learning_rate"], **extra)

    def __call__(self, h: Mapping[str, Any]):
        if len(self.names) == 1:
            return self.build(0, h)
        return rules.one_of(h["rule"].astype("int32"), [self.build(i, h) for i in range(len(self.names))])


@dataclasses.dataclass
class Comparison:
    """What :func:`compare` returns.

    Attributes:
      runs: one row per run: ``rule``, its grid values, ``seed``, ``final_loss`` (the mean training loss over the last
        tenth of the updates), ``virtual_time`` and, with an ``eval_fn``, the final ``eval_<name>`` values.
      picks: each rule's best setting, ``{rule: {hyperparameter: value}}``.
      edges: each rule's hyperparameters whose pick is the smallest or largest of three or more values tried.
      result: the sweep's :class:`asgd_jax.SimulationResult` (run r is ``runs[r]``).
    """

    runs: list[dict[str, Any]]
    picks: dict[str, dict[str, float]]
    edges: dict[str, set[str]]
    result: SimulationResult

    def picked(self, rule: str) -> list[int]:
        """The indices of ``rule``'s picked runs (one per seed)."""
        pick = self.picks[rule]
        return [
            r for r, row in enumerate(self.runs) if row["rule"] == rule and all(row[k] == v for k, v in pick.items())
        ]

    def table(self) -> str:
        """A Markdown table: each rule's pick (``*``: at the edge of its grid) and its final loss (and held-out metrics)
        as mean ± std over the seeds."""
        metrics = ["final_loss", *sorted(k for k in self.runs[0] if k.startswith("eval_"))]
        lines = ["| rule | pick | " + " | ".join(metrics) + " |", "|---" * (2 + len(metrics)) + "|"]
        for rule, pick in self.picks.items():
            rows = [self.runs[r] for r in self.picked(rule)]
            shown = ", ".join(f"{k}={v:g}{'*' if k in self.edges[rule] else ''}" for k, v in pick.items())
            cells = [_mean_std([row[m] for row in rows]) for m in metrics]
            lines.append(f"| {rule} | {shown} | " + " | ".join(cells) + " |")
        if any(self.edges.values()):
            lines.append("\n`*`: the pick is at the edge of the values tried; the best value may lie beyond them.")
        return "\n".join(lines)

    def plot(self, path: str | None = None, metric: str | None = None):
        """Each pick's held-out ``metric`` (default: the first evaluation metric) against virtual time: the mean over
        the seeds and a band from their min to max. An evaluation after ``u`` updates is drawn at the virtual time of
        update ``u`` (0 at the start). Returns the figure (saved to ``path`` when given)."""
        import matplotlib.pyplot as plt

        m = self.result.metrics
        names = sorted(k for k in m if k.startswith("eval_") and k != "eval_update")
        errors.require(bool(names), "eval_fn", None, "plot needs evaluations: pass eval_fn (and plan.eval_every)")
        metric = metric or names[0].removeprefix("eval_")
        errors.choice("metric", f"eval_{metric}", names)
        fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
        for rule in self.picks:
            rows = self.picked(rule)
            at = m["eval_update"][rows[0]]
            times = np.where(at > 0, m["time"][rows][:, np.maximum(at - 1, 0)], 0.0)
            values = m[f"eval_{metric}"][rows]
            t = times.mean(axis=0)
            ax.plot(t, values.mean(axis=0), marker="o", ms=3, label=rule)
            ax.fill_between(t, values.min(axis=0), values.max(axis=0), alpha=0.2)
        ax.set_xlabel("virtual time")
        ax.set_ylabel(metric)
        ax.legend()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _mean_std(values: Sequence[float]) -> str:
    a = np.asarray(values, np.float64)
    return f"{a.mean():.4g} ± {a.std():.2g}" if np.isfinite(a).all() else "diverged"


def compare(
    loss_fn: Any,
    params: Any,
    data: Any,
    plan: Plan,
    grids: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Any = None,
    progress: bool = True,
    devices: Sequence[Any] | None = None,
) -> Comparison:
    """Compares registered rules, each tuned over its own grid, in one compiled sweep.

    Args:
      loss_fn, params, data, plan, model_state, has_aux, eval_fn, progress, devices: as in :func:`asgd_jax.sweep`.
      grids: ``{rule: {hyperparameter: values}}`` for rules of :func:`asgd_jax.rules.names` (your own after
        :func:`asgd_jax.rules.register`); every grid names ``learning_rate``.
      seeds: the seeds every setting runs with.

    Returns:
      A :class:`Comparison`.
    """
    errors.require(isinstance(grids, Mapping) and bool(grids), "grids", grids, "give {rule: {hyperparameter: values}}")
    names = tuple(grids)
    hp_names: list[tuple[str, ...]] = []
    for name in names:
        errors.choice("rule", name, rules.names())
        given = grids[name]
        errors.require(
            isinstance(given, Mapping) and "learning_rate" in given,
            f"grids[{name!r}]",
            given,
            "give {'learning_rate': [...], other hyperparameters: [...]}",
        )
        takes = {*rules.defaults(name), "learning_rate"}
        unknown = sorted(set(given) - takes)
        errors.require(not unknown, f"grids[{name!r}]", unknown, f"{name} takes {', '.join(sorted(takes))}")
        hp_names.append(("learning_rate", *sorted(k for k in given if k != "learning_rate")))
    settings = [
        (i, dict(zip(hp_names[i], values, strict=True)))
        for i, name in enumerate(names)
        for values in itertools.product(*(_values(name, k, grids[name][k]) for k in hp_names[i]))
    ]
    errors.require(
        isinstance(seeds, Sequence | np.ndarray) and not isinstance(seeds, str),
        "seeds",
        seeds,
        "give a list of seeds, e.g. seeds=[0, 1, 2] (or seeds=range(n))",
    )
    keys, index = grid(seeds=list(seeds), setting=list(range(len(settings))))
    chosen = np.asarray(index["setting"]).astype(int)
    all_names = sorted({k for names_i in hp_names for k in names_i})
    hparams = {"rule": np.asarray([settings[c][0] for c in chosen], np.float32)}
    for k in all_names:  # a rule that does not take k ignores its column (filled with a harmless 0)
        hparams[k] = np.asarray([settings[c][1].get(k, 0.0) for c in chosen], np.float32)
    rule_fn = _OneOf(names, tuple(hp_names), plan.workers if plan is not None else 1)
    result = sweep(
        loss_fn,
        rule_fn,
        params,
        data,
        plan,
        keys=keys,
        hparams=hparams,
        model_state=model_state,
        has_aux=has_aux,
        eval_fn=eval_fn,
        progress=progress,
        description=f"compare {len(names)} rules: {len(settings)} settings x {len(seeds)} seeds",
        devices=devices,
    )
    runs = _rows(result, names, settings, chosen, [int(s) for s in seeds for _ in settings])
    picks, edges = _picks(runs, names, hp_names, grids)
    return Comparison(runs, picks, edges, result)


def _values(rule: str, name: str, values: Any) -> list[float]:
    ok = isinstance(values, Sequence | np.ndarray) and not isinstance(values, str) and len(values) > 0
    ok = ok and all(errors.is_number(v) and math.isfinite(v) for v in values)
    errors.require(ok, f"grids[{rule!r}][{name!r}]", values, "give a non-empty list of finite numbers")
    return [float(v) for v in values]


def _rows(result, names, settings, chosen, seeds) -> list[dict[str, Any]]:
    m = result.metrics
    tail = max(1, m["loss"].shape[1] // 10)
    final = m["loss"][:, -tail:].mean(axis=1)
    evals = {k: m[k][:, -1] for k in m if k.startswith("eval_") and k != "eval_update"}
    return [
        {
            "rule": names[settings[c][0]],
            **settings[c][1],
            "seed": seeds[r],
            "final_loss": float(final[r]),
            "virtual_time": float(m["time"][r, -1]),
            **{k: float(v[r]) for k, v in evals.items()},
        }
        for r, c in enumerate(chosen)
    ]


def _picks(runs, names, hp_names, grids) -> tuple[dict[str, dict[str, float]], dict[str, set[str]]]:
    picks, edges = {}, {}
    for i, name in enumerate(names):
        groups: dict[tuple, list[float]] = {}
        for row in runs:
            if row["rule"] == name:
                groups.setdefault(tuple(row[k] for k in hp_names[i]), []).append(row["final_loss"])
        score = lambda losses: float(np.mean(losses)) if np.isfinite(losses).all() else math.inf
        best = min(groups, key=lambda g: score(groups[g]))
        picks[name] = dict(zip(hp_names[i], best, strict=True))
        tried = {k: sorted(set(_values(name, k, grids[name][k]))) for k in hp_names[i]}
        edges[name] = {k for k, v in picks[name].items() if len(tried[k]) >= 3 and v in (tried[k][0], tried[k][-1])}
    return picks, edges
