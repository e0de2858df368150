"""Reproduction studies: each a small declarative config, one runner, one report.

A :class:`Study` says what it reproduces and lists :class:`Arm` s; an arm is one compiled program (one
:func:`asgd_jax.sweep`): a :class:`asgd_jax.Plan` (delay model and exchange pattern) shared by its :class:`Variant` s x
seeds. Every run gets the same budget of effective epochs, the same learning-rate schedule and the same initial weights
(or the same warm-started ones). :func:`run` writes ``results.json``, ``results.csv``, ``table.md`` and PNG plots into a
folder; :func:`report` turns folders of results into one Markdown report.

The studies themselves are modules of :mod:`asgd_jax.experiments` (``STUDY = Study(...)``), installed with the
package; :func:`load` finds them by name, or loads a study file of your own by its path.

Example:
  >>> import asgd_jax
  >>> from asgd_jax import studies
  >>> v = studies.Variant("DC-ASGD-a", lam=2.0, adaptive=True)
  >>> arm = studies.Arm({"M": 8}, asgd_jax.Plan(8), variants=(v,))
  >>> arm.plan.workers, arm.label(v)
  (8, 'DC-ASGD-a')
"""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import pkgutil
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import cache, errors, rules, setups
from asgd_jax import checkpoint as checkpoint_lib
from asgd_jax import data as data_lib
from asgd_jax import delays as delays_lib
from asgd_jax import metrics as metrics_lib
from asgd_jax.plan import Plan
from asgd_jax.setups import Setup
from asgd_jax.simulator import Prepared, grid, prepare_sweep, simulate

__all__ = [
    "ALGORITHMS",
    "METRICS",
    "DCASGD_CIFAR10",
    "Arm",
    "Settings",
    "Study",
    "StudyResult",
    "Variant",
    "ablate",
    "arm_rule",
    "available",
    "run_arm",
    "best_tuned",
    "format_table",
    "load",
    "plot",
    "plot_panels",
    "report",
    "run",
    "save",
    "schedule",
    "time_to_target",
]

log = logging.getLogger("asgd_jax.studies")

METRICS = {
    "test_error": "final test error (%)",
    "time_to_target": "virtual time to the target training error",
    "speedup": "speed-up in time to the target training error",
}
"""What a study's table can show (:attr:`Study.metric`, :attr:`Study.also`)."""

ALGORITHMS = {
    "sgd": "SGD",
    "asgd": "ASGD",
    "ssgd": "SSGD",
    "dc_asgd_c": "DC-ASGD-c",
    "dc_asgd_a": "DC-ASGD-a",
}
"""The algorithms of DC-ASGD's Table 1 (``asgd-jax ablate --algorithms``) and their labels."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One rule setting inside an arm.

    Attributes:
      label: the series name in tables and plots (``"DC-ASGD-a"``).
      rule: a registered rule (:func:`asgd_jax.rules.get`); ``"dc_asgd"`` (the default) covers SGD, ASGD (lambda 0),
        DC-ASGD-c and -a, so they share one compiled program.
      lam: DC-ASGD's lambda_0.
      adaptive: DC-ASGD-a (True) or -c.
      lr: this variant's learning rate (default: the settings'), a traced number: an arm tunes it in one program.
      hp: the rule's other numeric hyperparameters, traced per run (every variant of an arm names the same ones).
      coords: extra coordinates for tables/plots (e.g. ``{"lambda": 2.0}``).
    """

    label: str
    rule: str = "dc_asgd"
    lam: float = 0.0
    adaptive: bool = False
    lr: float | None = None
    hp: Mapping[str, float] = dataclasses.field(default_factory=dict)
    coords: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        errors.choice("rule", self.rule, rules.names())
        if self.lr is not None:
            errors.finite_number("lr", self.lr, positive=True)


@dataclasses.dataclass(frozen=True)
class Arm:
    """Runs that share one compiled program.

    Attributes:
      coords: coordinates of every run in the arm (``{"M": 8}``, ``{"clients": 4, "n_sync": 10, "start": "warm"}``).
      plan: the arm's :class:`asgd_jax.Plan`: its delay model (``Settings.cluster(M)`` for the study's compute times,
        or ``FixedDelay(tau)``) and exchange pattern (``mode``, ``n_sync``, ``push``, ``local_lr``); the runner sets
        its batch, budget and evaluation cadence from the study's settings.
      variants: the rules: any mix of registered rules runs as one program (:func:`asgd_jax.rules.one_of` picks each
        run's), and ``"dc_asgd"`` variants (SGD, ASGD, DC-ASGD-c and -a) differ only in traced numbers.
      server_lr: the server's learning rate (default: the study's schedule; 1.0 with ``push="delta"`` adds the delta).
      warm: start from the study's warm-started weights.
      series: how the runs are named in plots (default: the variant's label).
      rule_options: static arguments of the rule (``buffer_size`` of Delayed Nesterov, DANA's ``lam``, ...).
      for_every: the arm's runs stand in every cell of these coordinates, run once (a reference such as sequential
        SGD in every ``{"M": (4, 16, 32)}`` column).
    """

    coords: Mapping[str, Any]
    plan: Plan = dataclasses.field(default_factory=lambda: Plan(1))
    variants: tuple[Variant, ...] = (Variant("SGD"),)
    server_lr: float | None = None
    warm: bool = False
    series: str | None = None
    rule_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    for_every: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        errors.require(isinstance(self.plan, Plan), "plan", self.plan, "give an asgd_jax.Plan(delays, ...)")
        errors.require(bool(self.variants), "variants", self.variants, "give at least one Variant")
        known = {k for v in self.variants for k in (*rules.defaults(v.rule), *rules.required(v.rule))}
        unknown = sorted(set(self.rule_options) - known)
        errors.require(not unknown, "rule_options", unknown, f"the arm's rules take {sorted(known)}")
        hp = list(self.variants[0].hp)
        for v in self.variants:
            errors.require(list(v.hp) == hp, "hp", dict(v.hp), f"every variant of an arm names the same ones: {hp}")

    def label(self, variant: Variant) -> str:
        return variant.label if self.series is None else self.series.format(label=variant.label, **self.coords)

    @property
    def description(self) -> str:
        """The progress bar's label: which arm is running (where, how, which rules)."""
        p = self.plan
        where = f"tau={p.delays.tau}" if isinstance(p.delays, delays_lib.FixedDelay) else f"M={p.workers}"
        what = ", ".join(dict.fromkeys(self.label(v) for v in self.variants))  # each label once, in order
        extra = "" if p.n_sync == 1 else f" n_sync={p.n_sync}"
        extra += "".join(f", {c}" for c in self.coords.values() if isinstance(c, str) and c != "—")  # the cluster
        return f"{where} {p.mode}{extra}{' warm' if self.warm else ''}: {what}"[:72]


@dataclasses.dataclass(frozen=True)
class Settings(Setup):
    """What every run of a study shares (a study has a quick and a full form of these): a training
    :class:`asgd_jax.setups.Setup` (data, model, batch, schedule, momentum, weight decay, augmentation, evaluation:
    the same description ``asgd-jax train --config`` reads) and the study's own numbers.

    Attributes:
      seeds: one run per seed and variant.
      epochs: effective passes over the training data per run (warm runs: after the warm-up).
      mean_square_decay: DC-ASGD-a's m.
      compute_time: the workers' compute-time distribution.
      evals: test-error evaluations per run.
      window: training-error smoothing window (minibatches; GPU A-SGD: 400).
      warm_epochs: single-worker SGD epochs that make the warm-started weights.
      target_error: training error (smoothed) whose first crossing defines time-to-target.
      init_seed: seed of the shared initial weights.
      workers, algorithms, lam_c, lam_a: the DC-ASGD Table-1 grid (``dcasgd_table1``, ``asgd-jax ablate``): worker
        counts, which of :data:`ALGORITHMS` run, and DC-ASGD-c's and -a's lambda_0.

    The setup's ``schedule`` is DC-ASGD's step decay by default (/10 at 50% and 75% of the run); ``momentum`` is
    every rule's (the DC-ASGD paper reports none).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: float = 15.0
    mean_square_decay: float = 0.95
    compute_time: str = "exponential"
    evals: int = 10
    window: int = 100
    warm_epochs: float = 2.0
    target_error: float = 0.5
    init_seed: int = 0
    workers: tuple[int, ...] = (1, 4, 8)
    algorithms: tuple[str, ...] = tuple(ALGORITHMS)
    lam_c: float = 0.04
    lam_a: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        errors.require(bool(self.seeds), "seeds", self.seeds, "give at least one seed")
        errors.require(
            bool(self.workers) and all(isinstance(m, int) and m >= 1 for m in self.workers),
            "workers",
            list(self.workers),
            "give worker counts >= 1",
        )
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        errors.require(
            bool(self.algorithms) and not unknown,
            "algorithms",
            list(self.algorithms),
            f"choose from {', '.join(ALGORITHMS)}",
        )
        errors.finite_number("epochs", self.epochs, positive=True)
        errors.finite_number("warm_epochs", self.warm_epochs, positive=True)
        for name in ("evals", "window"):
            errors.positive_int(name, getattr(self, name))
        errors.choice("compute_time", self.compute_time, delays_lib.COMPUTE_TIME_KINDS)
        # lam_c, lam_a, mean_square_decay and momentum are checked by the rule itself.
        rules.get("dc_asgd_c", 0.1, lam=self.lam_c, momentum=self.momentum)
        rules.get("dc_asgd_a", 0.1, lam=self.lam_a, mean_square_decay=self.mean_square_decay)

    def cluster(self, workers: int, **kwargs: Any) -> delays_lib.Workers:
        """``Workers(workers, **kwargs)`` with the study's compute times (``kwargs`` may override them)."""
        return delays_lib.Workers(workers, **{"compute_time": self.compute_time, **kwargs})


#: The DC-ASGD paper's CIFAR-10 setup (Zheng et al. 2017): ResNet-20, no augmentation, 160 effective epochs,
#: minibatch 128 per worker, lr 0.5 divided by 10 at epochs 80 and 120, DC-ASGD-c lambda_0 0.04, DC-ASGD-a lambda_0 2
#: and m 0.95, M in {1, 4, 8}, 5 seeds, the same initial weights and schedule for every run: the full form of
#: ``dcasgd_table1`` and ``dcasgd_lambda_sweep`` (hours on one GPU; `asgd-jax data prepare cifar10` first).
DCASGD_CIFAR10 = Settings(
    dataset="tfds:cifar10",
    model="resnet20",
    seeds=(0, 1, 2, 3, 4),
    epochs=160.0,
    batch_size=128,
    learning_rate=0.5,
    evals=40,
    window=400,
)


@dataclasses.dataclass(frozen=True)
class Study:
    """A reproduction study.

    Attributes:
      name: the command-line name (``asgd-jax run <name>``).
      title: one line.
      reproduces: what it reproduces and the expected qualitative result (goes into the report).
      quick, full: the two forms' :class:`Settings` (quick: minutes on 2 CPU cores; full: the paper's setup).
      arms: ``arms(settings, quick) -> list[Arm]``.
      rows, columns: the table lays out the final metric with these coordinates as rows and columns (``"label"``
        is the series name).
      metric: ``"test_error"`` (%), ``"time_to_target"`` (virtual time) or ``"speedup"`` (the baseline's
        time-to-target over the run's).
      baseline: the coordinates of the speed-up baseline.
      curves_x: x axes of the training-curve plots (``"epoch"``, ``"update"``, ``"time"``).
      paper: the paper's numbers, ``{row: {column: value}}``, printed beside ours.
      column_order: the table's columns in this order (default: as the runs come).
      forms: more named forms beside ``quick`` and ``full`` (``asgd-jax ablate`` runs ``dcasgd_table1``'s).
      tune: coordinates tuned per cell (``("lr", "lambda")``): a cell shows the runs of its best setting, the one with
        the lowest mean final training error (the test set never picks), and the table lists the picks.
      facet: one table (and one plot panel) per value of this coordinate (``"cluster"``).
      also: more metrics, each one more table of the same cells (``("time_to_target",)``).
    """

    name: str
    title: str
    reproduces: str
    quick: Settings
    full: Settings
    arms: Callable[[Settings, bool], list[Arm]]
    rows: str = "M"
    columns: str = "label"
    metric: str = "test_error"
    baseline: Mapping[str, Any] | None = None
    curves_x: tuple[str, ...] = ("epoch",)
    paper: Mapping[Any, Mapping[str, float]] | None = None
    paper_note: str = ""
    column_order: tuple[str, ...] | None = None
    forms: Mapping[str, Settings] = dataclasses.field(default_factory=dict)
    tune: tuple[str, ...] = ()
    facet: str | None = None
    also: tuple[str, ...] = ()

    def __post_init__(self):
        for metric in (self.metric, *self.also):
            errors.choice("metric", metric, METRICS)

    def form(self, name: str) -> Settings:
        """The settings of the form ``name``."""
        forms = {"quick": self.quick, "full": self.full, **self.forms}
        errors.choice("form", name, forms)
        return forms[name]


# --------------------------------------------------------------------------------------------------------------------
# Finding studies.
# --------------------------------------------------------------------------------------------------------------------


CATALOG = "asgd_jax.experiments"
"""The package of the studies that ship with asgd_jax (``asgd_jax/experiments/<name>.py``)."""


def available() -> list[str]:
    """Names of the studies that ship with the package (modules of :mod:`asgd_jax.experiments` that define
    ``STUDY``)."""
    package = importlib.import_module(CATALOG)
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    return sorted(
        n for n in names if isinstance(getattr(importlib.import_module(f"{CATALOG}.{n}"), "STUDY", None), Study)
    )


def load(name_or_path: str | os.PathLike) -> Study:
    """The ``STUDY`` of a shipped study by name (:func:`available`), or of a study file of your own by its path."""
    text = os.fspath(name_or_path)
    if text.endswith(".py") or os.sep in text:
        path = pathlib.Path(text)
        errors.require(
            path.is_file(), "study", text, "no such study file: give a path to a .py file that defines STUDY"
        )
        spec = importlib.util.spec_from_file_location(f"asgd_jax_study_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        where = str(path)
    else:
        errors.require(
            text.isidentifier() and text in available(),
            "study",
            text,
            f"choose from {', '.join(available())} or give a path to a study .py file",
        )
        module = importlib.import_module(f"{CATALOG}.{text}")
        where = module.__name__
    study = getattr(module, "STUDY", None)
    if not isinstance(study, Study):
        raise errors.ConfigError(f"{where} defines no STUDY = asgd_jax.studies.Study(...).")
    return study


# --------------------------------------------------------------------------------------------------------------------
# Running.
# --------------------------------------------------------------------------------------------------------------------


def schedule(
    s: Settings, num_updates: int, learning_rate: float | jax.Array | None = None, updates_per_epoch: float = 1.0
) -> optax.Schedule:
    """The learning rate of a run of ``num_updates`` updates: the setup's (:meth:`Setup.learning_rate_schedule`),
    DC-ASGD's steps by default.

    Example:
      >>> from asgd_jax import studies
      >>> lr = studies.schedule(studies.Settings(learning_rate=0.5), 160)
      >>> [round(float(lr(t)), 4) for t in (79, 80, 120)]
      [0.5, 0.05, 0.005]
    """
    return s.learning_rate_schedule(num_updates, updates_per_epoch, learning_rate)


def _arm_rules(variants: tuple[Variant, ...]) -> list[str]:
    return list(dict.fromkeys(v.rule for v in variants))


@dataclasses.dataclass(frozen=True)
class _ArmRule:
    """``hparams -> rule`` for an arm: the learning rate (when the arm tunes it), the variants' numbers and (for a mix)
    which rule are traced. A value (hashable): arms that build their rules alike share one compiled program."""

    names: tuple[str, ...]
    learning_rate: float
    schedule: setups.Schedule  # the setup's, in updates of this arm's runs
    server_lr: float | None
    momentum: float | None
    weight_decay: float
    mean_square_decay: float
    num_workers: int
    rule_options: tuple[tuple[str, Any], ...]

    def build(self, rule: str, h: Mapping[str, jax.Array], lr: Any):
        takes = {*rules.defaults(rule), *rules.required(rule)}
        kwargs: dict[str, Any] = {}
        if "num_workers" in rules.required(rule):
            kwargs["num_workers"] = self.num_workers
        if rule == "dc_asgd":
            kwargs.update(mean_square_decay=self.mean_square_decay, lam=h["lam"], adaptive=h["adaptive"] > 0.5)
        kwargs.update({k: v for k, v in self.rule_options if k in takes})
        kwargs.update({k: v for k, v in h.items() if k in takes and k not in ("lam", "adaptive")})
        return setups.make_rule(rule, lr, momentum=self.momentum, weight_decay=self.weight_decay, **kwargs)

    def __call__(self, h: Mapping[str, jax.Array]):
        # The learning rate is traced only when the arm tunes it: a Python float keeps the schedule's constants folded,
        # as they always were. A server learning rate (GPU A-SGD's deltas) has no schedule.
        lr = self.server_lr if self.server_lr is not None else self.schedule.build(h.get("lr", self.learning_rate))
        if len(self.names) == 1:
            return self.build(self.names[0], h, lr)
        return rules.one_of(h["rule"].astype("int32"), [self.build(name, h, lr) for name in self.names])


def arm_rule(arm: Arm, s: Settings, num_updates: int, updates_per_epoch: float) -> Callable[[Mapping], Any]:
    """An arm's ``hparams -> rule`` for runs of ``num_updates`` (``updates_per_epoch`` converts the setup's epochs):
    the registered rule of each variant with the setup's schedule, momentum and weight decay, its numbers traced. A
    value: arms that build their rules alike share one compiled program. ``asgd-jax train`` builds its rule from the
    same setup the same way (:meth:`asgd_jax.setups.Setup.rule`)."""
    variants = arm.variants
    return _ArmRule(
        names=tuple(_arm_rules(variants)),
        learning_rate=s.learning_rate,
        schedule=s.schedule_in_updates(num_updates, updates_per_epoch),
        server_lr=arm.server_lr,
        momentum=s.momentum,
        weight_decay=s.weight_decay,
        mean_square_decay=s.mean_square_decay,
        num_workers=arm.plan.workers,
        rule_options=tuple(sorted(arm.rule_options.items())),
    )


def _hparams(variants: tuple[Variant, ...], s: Settings, index: np.ndarray) -> dict[str, np.ndarray]:
    """Each run's traced numbers (its variant's, by ``index``): the learning rate, lambda, the adaptive flag, hp."""
    keys = list(variants[0].hp)  # every variant names the same ones (Arm checks)
    tuned = {"lr": [v.lr or s.learning_rate for v in variants]} if any(v.lr for v in variants) else {}
    names = _arm_rules(variants)
    table = {
        **tuned,
        **({"rule": [names.index(v.rule) for v in variants]} if len(names) > 1 else {}),
        "lam": [v.lam for v in variants],
        "adaptive": [float(v.adaptive) for v in variants],
        **{k: [v.hp[k] for v in variants] for k in keys},
    }
    return {k: np.asarray(values, np.float32)[index] for k, values in table.items()}


def time_to_target(times: np.ndarray, smoothed: np.ndarray, target: float) -> float:
    """The time of the first update whose smoothed training error is at or below ``target`` (NaN if none is).

    Example:
      >>> import numpy as np
      >>> from asgd_jax import studies
      >>> studies.time_to_target(np.arange(4.0), np.array([0.9, 0.6, 0.4, 0.3]), 0.5)
      2.0
    """
    hit = np.flatnonzero(smoothed <= target)
    return float(times[hit[0]]) if hit.size else math.nan


@dataclasses.dataclass
class StudyResult:
    """Per-run outcomes and mean curves of a study run (what :func:`run` saves)."""

    study: Study
    settings: Settings
    quick: bool
    runs: list[dict[str, Any]]
    curves: dict[str, dict[str, list[float]]]
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every arm of a study run shares: the data, the model's loss and evaluation, the initial weights."""

    ds: Any
    loss_fn: Any
    eval_fn: Any
    init: tuple[Any, Any]
    warm: tuple[Any, Any] | None


def _setup(s: Settings, arms: list[Arm], progress: bool) -> _Setup:
    ds = data_lib.load(s.dataset, data_dir=s.data_dir)
    model = s.build_model(ds.num_classes, ds.input_shape)
    params0, model_state0 = model.init(jax.random.key(s.init_seed))
    loss_fn = s.loss(model)
    warm = None
    if any(a.warm for a in arms):  # one warm start for the whole study: single-worker SGD from the shared init
        updates = max(1, round(s.warm_epochs * len(ds.y_train) / s.batch_size))
        w = simulate(
            loss_fn,
            rules.get("sgd", s.learning_rate),
            params0,
            ds.train,
            Plan(1, batch_size=s.batch_size, num_updates=updates),
            model_state=model_state0,
            key=jax.random.key(10_000 + s.init_seed),
            progress=progress,
        )
        warm = (w.params, w.model_state)
    eval_fn = s.evaluation(model, ds.test)
    return _Setup(ds, loss_fn, eval_fn, (params0, model_state0), warm)


@dataclasses.dataclass(frozen=True)
class _ArmRun:
    """One arm bound to its compiled sweep (checked, not run yet) and what its results are read with."""

    arm: Arm
    plan: Plan
    index: np.ndarray  # each run's variant
    sweep: Prepared


def _prepare_arm(s: Settings, arm: Arm, setup: _Setup, progress: bool) -> _ArmRun:
    """One arm's sweep over its variants x seeds, checked and bound to its programs (nothing compiled yet)."""
    n = len(setup.ds.y_train)
    p = arm.plan
    per_update = s.batch_size * p.n_sync * (p.workers if p.mode == "sync" else 1)
    interval = max(1, round(s.epochs * n / per_update / s.evals))
    num_updates = interval * s.evals
    plan = p.replace(batch_size=s.batch_size, num_updates=num_updates, eval_every=interval, chunk=None)
    variants = arm.variants
    keys, hp = grid(seeds=s.seeds, index=list(range(len(variants))))
    index = np.asarray(hp.pop("index")).astype(int)
    hp = _hparams(variants, s, index)
    params, model_state = setup.warm if arm.warm else setup.init
    prepared = prepare_sweep(
        setup.loss_fn,
        arm_rule(arm, s, num_updates, n / per_update),
        params,
        setup.ds.train,
        plan,
        keys=keys,
        hparams=hp,
        model_state=model_state,
        eval_fn=setup.eval_fn,
        progress=progress,
        description=arm.description,
    )
    return _ArmRun(arm, plan, index, prepared)


def _arm_results(s: Settings, run: _ArmRun, result, setup: _Setup) -> tuple[list[dict], dict[str, dict]]:
    """An arm's runs and mean curves, from its sweep's result."""
    arm, plan, index, variants = run.arm, run.plan, run.index, run.arm.variants
    n = len(setup.ds.y_train)
    per_update = s.batch_size * plan.n_sync * (plan.workers if plan.mode == "sync" else 1)
    num_updates = plan.num_updates
    mx = result.metrics
    seeds = np.repeat(np.asarray(s.seeds), len(variants))
    # Training error per minibatch, smoothed over `window` minibatches (an update is n_sync of them per worker).
    smoothed = metrics_lib.smooth(mx["error"], max(1, s.window // plan.n_sync))
    offset = s.warm_epochs if arm.warm else 0.0
    runs, curves = [], {}
    for i, variant in enumerate(variants):
        rows = np.flatnonzero(index == i)
        label = arm.label(variant)
        coords = {**arm.coords, **variant.coords, **({"lr": variant.lr} if variant.lr else {}), "label": label}
        series = " | ".join(
            f"{k}={v}"
            for k, v in coords.items()
            if k != "label" and f"{k}={v}" not in label and str(v) not in label.split(", ")
        )
        curves[f"{label} ({series})" if series else label] = {
            "coords": coords,
            "update": list(range(1, num_updates + 1)),
            "epoch": (offset + mx["epoch"][rows[0]]).tolist(),
            "time": mx["time"][rows].mean(axis=0).tolist(),
            "train_error": smoothed[rows].mean(axis=0).tolist(),
            "eval_epoch": (offset + mx["eval_update"][rows[0]] * per_update / n).tolist(),
            "test_error": mx["eval_error"][rows].mean(axis=0).tolist(),
        }
        runs += [
            {
                **coords,
                "seed": int(seeds[r]),
                "test_error": float(mx["eval_error"][r, -1]),
                "train_error": float(smoothed[r, -1]),
                "time_to_target": time_to_target(mx["time"][r], smoothed[r], s.target_error),
                "virtual_time": float(mx["time"][r, -1]),
                "mean_staleness": float(mx["staleness"][r].mean()),
                "max_staleness": int(mx["staleness"][r].max()),
                "updates": num_updates,
            }
            for r in rows
        ]
    return runs, curves


def _for_every(arm: Arm, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An arm's runs copied into every cell of its ``for_every`` coordinates (a reference run once)."""
    for key, values in arm.for_every.items():
        runs = [{**r, key: v} for v in values for r in runs]
    return runs


def run(
    study: Study,
    *,
    quick: bool = False,
    progress: bool = True,
    settings: Settings | None = None,
    form: str | None = None,
    on_arm: Callable[[Arm, list[dict[str, Any]], dict[str, Any]], Any] | None = None,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    backend: str = "local",
    ray_address: str | None = None,
) -> StudyResult:
    """Runs every arm of ``study`` (one :func:`asgd_jax.sweep` each) in one of its forms.

    Args:
      study: the study (:func:`load` finds one by name).
      quick: the quick form (minutes on 2 CPU cores) instead of the full one.
      progress: progress bars, one per arm, labelled with it.
      settings: override the form's settings (tests use a tiny one).
      form: a named form of the study (``"quick"``, ``"full"`` or one of ``study.forms``), instead of ``quick``.
      on_arm: ``on_arm(arm, runs, curves)`` as each arm finishes: its rows of the results and its mean curves (to
        log them elsewhere, or watch a long study); on a resume, the arms found done are handed over first.
      out: a folder that keeps each finished arm (``<out>/arms/<i>.json``, written atomically as the arm finishes),
        so that a study killed midway loses at most the arm it was running (:func:`save` into the same folder
        clears them once the results are written).
      resume: with ``out``: run only the arms not found there (the same tables as an uninterrupted run); the study,
        its form and settings must be the ones the folder's arms were run with. Without it, a folder holding an
        unfinished study is refused.
      backend: ``"local"`` (the arms one after another in this process, each over every local accelerator) or
        ``"ray"``: each arm a Ray task (:func:`run_arm`; a GPU each where the cluster has them), gathered into the same
        result in arm order (identical numbers), one progress bar for the study, a task whose worker died retried
        (up to :data:`MAX_RETRIES` times), an arm that fails for its own reason named with it.
      ray_address: the Ray cluster to join (``"auto"``: the one ``ray start`` made); default: a local instance.
    """
    errors.require(on_arm is None or callable(on_arm), "on_arm", on_arm, "give a function of (arm, runs, curves)")
    errors.choice("backend", backend, BACKENDS, "--backend")
    if backend == "ray":
        from asgd_jax.ray_backend import require_ray

        require_ray()  # fails at once, with the install command
    start = time.perf_counter()
    cache.enable()  # the studies' programs are kept across processes (asgd_jax.cache)
    s = settings or study.form(form or ("quick" if quick else "full"))
    arms = study.arms(s, quick)
    if not arms:
        raise errors.ConfigError(f"study {study.name!r} has no arms for these settings.")
    kept = None if out is None else _ArmStore(out, _manifest(study, s, quick, arms), resume)
    found = {} if kept is None else kept.found()
    if found:
        log.info("resuming %s: %d of %d arms done in %s", study.name, len(found), len(arms), out)
    runs: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}

    def finished(arm: Arm, arm_runs: list[dict[str, Any]], arm_curves: dict[str, Any], tell: bool = True) -> None:
        runs.extend(_for_every(arm, arm_runs))
        curves.update(arm_curves)
        if on_arm is not None and tell:
            on_arm(arm, arm_runs, arm_curves)

    if backend == "ray":
        done = None if on_arm is None else lambda i, result: on_arm(arms[i], *result)  # as each arm finishes
        results = _run_on_ray(study, s, quick, arms, found, kept, progress, ray_address, done)
        for i, arm in enumerate(arms):  # the results in arm order, whatever order the tasks finished in
            finished(arm, *results[i], tell=False)
        return StudyResult(study, s, quick, runs, curves, time.perf_counter() - start)
    setup = _setup(s, arms, progress)
    # Every arm still to run is checked before any runs.
    prepared = {i: _prepare_arm(s, arm, setup, progress) for i, arm in enumerate(arms) if i not in found}

    # The arms' programs compile (or load) on threads of their own, in order, while the earlier arms compute: a
    # compilation releases Python's lock, so the time a study waits for the compiler shrinks to its first arm's.
    threads = max(1, min(2, (os.cpu_count() or 1) - 1))  # beside the compute: two threads need three cores
    ahead = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="asgd_jax-compile")
    try:
        compiled = {i: ahead.submit(arm_run.sweep.compile) for i, arm_run in prepared.items()}
        for i, arm in enumerate(arms):
            if i in found:
                finished(arm, *found[i])
                continue
            result = prepared[i].sweep.run()  # waits for its compilation if it is still under way
            compiled[i].result()
            arm_runs, arm_curves = _arm_results(s, prepared[i], result, setup)
            if kept is not None:
                kept.keep(i, arm_runs, arm_curves)
            finished(arm, arm_runs, arm_curves)
    finally:
        ahead.shutdown(wait=False, cancel_futures=True)
    return StudyResult(study, s, quick, runs, curves, time.perf_counter() - start)


ARMS = "arms"  # the folder of a study's finished arms, under its output folder
BACKENDS = ("local", "ray")
MAX_RETRIES = 3  # a Ray task whose worker died is run again this many times


def run_arm(study: Study, settings: Settings, quick: bool, index: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One arm of a study, alone: its data, model and warm start made as :func:`run` makes them, its sweep run; its
    rows of the results and its mean curves (what a Ray task of ``run(backend="ray")`` computes)."""
    cache.enable()  # a Ray worker reuses the programs other workers (and runs) compiled
    arms = study.arms(settings, quick)
    errors.require(0 <= index < len(arms), "index", index, f"the study has {len(arms)} arms")
    setup = _setup(settings, arms, progress=False)
    prepared = _prepare_arm(settings, arms[index], setup, progress=False)
    return _arm_results(settings, prepared, prepared.sweep.run(), setup)


def _run_on_ray(study, s, quick, arms, found, kept, progress, address, done) -> dict[int, tuple]:
    """Every arm not ``found`` as a Ray task, gathered by index as they finish (kept as they finish, with ``kept``;
    ``done(index, result)`` told of each, the found ones first)."""
    import ray
    from tqdm.auto import tqdm

    from asgd_jax.ray_backend import join

    join(address)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=MAX_RETRIES, retry_exceptions=False)(run_arm)
    pending = {task.remote(study, s, quick, i): i for i in range(len(arms)) if i not in found}
    results = dict(found)
    for i in sorted(found) if done is not None else ():
        done(i, found[i])
    with tqdm(
        total=len(arms), initial=len(found), disable=not progress, desc=f"{study.name} on Ray", unit="arm"
    ) as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            try:
                results[i] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                for ref in pending:
                    ray.cancel(ref, force=True)
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise RuntimeError(f"arm {i} ({arms[i].description}) failed: {type(cause).__name__}: {cause}") from None
            if kept is not None:
                kept.keep(i, *results[i])
            if done is not None:
                done(i, results[i])
            bar.update(1)
    return results


def _manifest(study: Study, s: Settings, quick: bool, arms: list[Arm]) -> dict[str, Any]:
    """What a folder's finished arms were run with, as JSON reads it back: a resume must match it."""
    manifest = {
        "study": study.name,
        "quick": quick,
        "settings": dataclasses.asdict(s),
        "arms": [{**arm.coords, "description": arm.description} for arm in arms],
    }
    return json.loads(json.dumps(manifest, default=str))


class _ArmStore:
    """A study's finished arms in ``<out>/arms``: a manifest, then one JSON file per arm as it finishes."""

    def __init__(self, out: str | os.PathLike, manifest: dict[str, Any], resume: bool):
        self.folder = os.path.join(errors.output_folder("out", out, "--out"), ARMS)
        path = os.path.join(self.folder, "study.json")
        if os.path.exists(path):
            saved = checkpoint_lib.read_json(path)
            done = len([f for f in os.listdir(self.folder) if f[:-5].isdigit()])
            if not resume:
                raise errors.ConfigError(
                    f"{out} holds an unfinished run of study {saved.get('study')!r} ({done} of "
                    f"{len(saved.get('arms', []))} arms done): pass resume=True (--resume) to finish it, or choose "
                    "another output folder."
                )
            differ = sorted(_differences(saved, manifest))
            errors.require(
                not differ,
                "resume",
                True,
                f"{out}'s arms were run with other settings ({'; '.join(differ[:4])}): use the same study, form and "
                "settings, or another output folder",
                "--resume",
            )
        else:
            os.makedirs(self.folder, exist_ok=True)
            checkpoint_lib.write_json(path, manifest)
        self.manifest = manifest

    def found(self) -> dict[int, tuple[list[dict[str, Any]], dict[str, Any]]]:
        """The arms finished before, by index: their runs and curves."""
        out = {}
        for i in range(len(self.manifest["arms"])):
            path = os.path.join(self.folder, f"{i}.json")
            if os.path.exists(path):
                saved = checkpoint_lib.read_json(path)
                out[i] = (saved["runs"], saved["curves"])
        return out

    def keep(self, i: int, runs: list[dict[str, Any]], curves: dict[str, Any]) -> None:
        checkpoint_lib.write_json(os.path.join(self.folder, f"{i}.json"), {"runs": runs, "curves": curves})


def _differences(saved: Any, now: Any, where: str = "") -> list[str]:
    """Where two JSON values differ, as ``path: saved -> now`` lines."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [
            d for k in sorted(set(saved) | set(now)) for d in _differences(saved.get(k), now.get(k), f"{where}.{k}")
        ]
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now, strict=True)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if saved == now else [f"{where.lstrip('.')}: {saved!r} then, {now!r} now"]


# --------------------------------------------------------------------------------------------------------------------
# Tables, plots, files.
# --------------------------------------------------------------------------------------------------------------------


def _ordered(values) -> list:
    values = list(dict.fromkeys(values))
    return sorted(values) if all(isinstance(v, int | float) for v in values) else values


def _metric_value(metric: str, r: dict[str, Any]) -> float:
    return 100 * r["test_error"] if metric == "test_error" else r["time_to_target"]


def _cell(study: Study, r: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (r.get(study.facet) if study.facet else None, r.get(study.rows), r.get(study.columns))


def best_tuned(study: Study, runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[tuple, dict[str, Any]]]:
    """The runs of each cell's best tuned setting, and the picks: ``{(facet, row, column): {"lr": 0.1, ...}}``.

    A cell's runs are grouped by their :attr:`Study.tune` coordinates; the group with the lowest mean final training
    error wins (a diverged run counts as the worst), so the test set only reports. Without ``tune``: all runs, no picks.

    Example:
      >>> from asgd_jax import studies
      >>> study = studies.load("staleness_leaderboard")
      >>> runs = [{"label": "ASGD", "M": 4, "cluster": "uniform", "lr": lr, "train_error": e, "test_error": e}
      ...         for lr, e in [(0.1, 0.3), (0.1, 0.5), (0.2, 0.35), (0.2, 0.35)]]
      >>> kept, picks = studies.best_tuned(study, runs)
      >>> [r["lr"] for r in kept], picks
      ([0.2, 0.2], {('uniform', 'ASGD', 4): {'lr': 0.2}})
    """
    if not study.tune:
        return runs, {}
    groups: dict[tuple, dict[tuple, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(_cell(study, r), {}).setdefault(tuple(r.get(k) for k in study.tune), []).append(r)

    def score(group: list[dict[str, Any]]) -> float:
        errs = np.asarray([r["train_error"] for r in group], np.float64)
        return float(errs.mean()) if np.isfinite(errs).all() else math.inf

    kept, picks = [], {}
    for cell, by_setting in groups.items():
        setting = min(by_setting, key=lambda k: score(by_setting[k]))
        kept += by_setting[setting]
        picks[cell] = {k: v for k, v in zip(study.tune, setting, strict=True) if v is not None}
    return kept, picks


def _grid_edges(study: Study, runs: list[dict[str, Any]], picks: dict[tuple, dict[str, Any]]) -> dict[tuple, set]:
    """Per cell, the tuned coordinates whose pick is the smallest or largest of 3 or more values tried there."""
    tried: dict[tuple, dict[str, set]] = {}
    for r in runs:
        for k in study.tune:
            if r.get(k) is not None:
                tried.setdefault(_cell(study, r), {}).setdefault(k, set()).add(r[k])
    return {
        cell: {k for k, v in p.items() if len(grid := tried[cell][k]) >= 3 and v in (min(grid), max(grid))}
        for cell, p in picks.items()
    }


def _cell_values(study: Study, runs: list[dict[str, Any]], metric: str | None = None) -> dict[tuple, tuple]:
    """``{(facet, row, column): (mean, std)}`` of ``metric`` (default: the study's) over the seeds."""
    metric = metric or study.metric
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        groups.setdefault(_cell(study, r), []).append(_metric_value(metric, r))
    cells = {k: tuple(float(x) for x in metrics_lib.mean_std(np.asarray(v))) for k, v in groups.items()}
    if metric == "speedup":
        base_runs = [r for r in runs if all(r.get(k) == v for k, v in (study.baseline or {}).items())]
        base = float(np.mean([r["time_to_target"] for r in base_runs])) if base_runs else math.nan
        cells = {k: (base / mean if mean > 0 else math.nan, 0.0) for k, (mean, _) in cells.items()}
    return cells


def _layout(study: Study, cells) -> tuple[list, list, list]:
    """The facet values, rows and columns of a study's tables, in order."""
    facets = _ordered(f for f, _, _ in cells)
    rows = _ordered(r for _, r, _ in cells)
    cols = list(dict.fromkeys(c for _, _, c in cells))
    if study.column_order:
        cols = sorted(cols, key=lambda c: study.column_order.index(c) if c in study.column_order else len(cols))
    return facets, rows, cols


def _grid(study: Study, cells: dict[tuple, Any], text: Callable[[Any], str]) -> list[str]:
    """Markdown table(s), one per facet value, of ``text(cell)``."""
    facets, rows, cols = _layout(study, cells)
    lines: list[str] = []
    for facet in facets:
        if study.facet:
            lines += ["", f"{study.facet} = {facet}", ""]
        lines.append(f"| {study.rows} | " + " | ".join(map(str, cols)) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for row in rows:
            if any((facet, row, col) in cells for col in cols):
                lines.append(f"| {row} | " + " | ".join(text(cells.get((facet, row, col))) for col in cols) + " |")
    return lines


def format_table(study: Study, runs: list[dict[str, Any]], num_seeds: int) -> str:
    """The study's Markdown table(s) (mean ± std over seeds): one per facet value and metric, the tuned picks, and the
    paper's numbers beside ours when given."""
    kept, picks = best_tuned(study, runs)
    lines: list[str] = []
    for metric in (study.metric, *study.also):
        cells = _cell_values(study, kept, metric)
        what = METRICS[metric]
        if metric == "speedup":
            what += f" (baseline {', '.join(f'{k}={v}' for k, v in (study.baseline or {}).items())})"
        over = "ratio of mean times" if metric == "speedup" else "mean ± std"
        tuned = f"; each cell the best of its {', '.join(study.tune)} grid by training error" if study.tune else ""

        def text(cell, metric=metric):
            if cell is None or math.isnan(cell[0]):
                return "—"
            return f"{cell[0]:.2f}x" if metric == "speedup" else f"{cell[0]:.2f} ± {cell[1]:.2f}"

        lines += ([""] if lines else []) + [f"{what}, {over} over {num_seeds} seed(s){tuned}"]
        lines += ([] if study.facet else [""]) + _grid(study, cells, text)
        if metric != "test_error" and any(math.isnan(m) for m, _ in cells.values()):
            lines += ["", "—: the target was not reached within the epoch budget (in at least one seed)."]
    if picks:
        edges = _grid_edges(study, runs, picks)
        lines += ["", f"The tuned settings picked (lowest training error over {', '.join(study.tune)})"]
        marked = {
            cell: ", ".join(f"{k} {v:g}{'*' if k in edges[cell] else ''}" for k, v in p.items())
            for cell, p in picks.items()
        }
        lines += ([] if study.facet else [""]) + _grid(study, marked, str)
        if any(edges.values()):
            lines += ["", "*: the edge of its grid (of 3 or more values): a wider grid may do better."]
    if study.paper:
        pcols = list(dict.fromkeys(c for v in study.paper.values() for c in v))
        lines += [
            "",
            f"Paper{': ' + study.paper_note if study.paper_note else ''}",
            "",
            f"| {study.rows} | " + " | ".join(pcols) + " |",
            "|---" * (len(pcols) + 1) + "|",
        ]
        for row, values in study.paper.items():
            lines.append(f"| {row} | " + " | ".join(f"{values[c]:.2f}" if c in values else "" for c in pcols) + " |")
    return "\n".join(lines)


def _final_axes(ax, study: Study, cells: dict[tuple, tuple], facet, rows: list, cols: list, labels: bool) -> bool:
    """One panel of the final metric: lines against numeric rows, grouped bars over named ones (rules), an x where a
    bar has no value (the target not reached, or diverged). Returns whether it drew an x."""
    numeric = all(isinstance(r, int | float) for r in rows)
    width, missing = 0.8 / max(len(cols), 1), False
    for j, col in enumerate(cols):
        pts = [(r, *cells[(facet, r, col)]) for r in rows if (facet, r, col) in cells]
        if numeric:
            x = [p[0] for p in pts]
            ax.errorbar(x, [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, label=str(col))
        else:
            x = [rows.index(p[0]) + (j - (len(cols) - 1) / 2) * width for p in pts]
            bars = ax.bar(
                x,
                [p[1] for p in pts],
                width,
                yerr=[p[2] for p in pts],
                capsize=2,
                label=str(col) if study.columns == "label" else f"{study.columns} {col}",
            )
            none = [xi for xi, p in zip(x, pts, strict=True) if not math.isfinite(p[1])]
            if none:  # (an empty line drawn unclipped would stretch the panel's layout box to the figure's origin)
                ax.plot(
                    none, [0.0] * len(none), "x", color=bars.patches[0].get_facecolor(), ms=6, mew=1.5, clip_on=False
                )
                missing = True
    if numeric and len(rows) > 2 and min(rows) > 0 and max(rows) / min(rows) >= 8:
        ax.set_xscale("log", base=2)
    if not numeric:
        ax.set_xticks(range(len(rows)), [str(r) for r in rows] if labels else [], rotation=35, ha="right", fontsize=8)
    else:
        ax.set_xlabel(study.rows)
    ax.grid(alpha=0.3, axis="y" if not numeric else "both")
    return missing


def _final_figure(study: Study, cells: dict[tuple, tuple], metric: str):
    """The figure of one metric: line panels side by side over numeric rows; bar panels (a group per rule) stacked,
    so that a README page shows them at a readable size."""
    import matplotlib.pyplot as plt

    facets, rows, cols = _layout(study, cells)
    numeric = all(isinstance(r, int | float) for r in rows)
    width = max(4.5, (1.0 if numeric else 0.5 + 0.12 * len(cols)) * len(rows))
    shape, size = ((1, len(facets)), (width * len(facets) ** 0.8, 4.2))
    if not numeric:
        shape, size = ((len(facets), 1), (width, max(4.2, 1.2 + 2.6 * len(facets))))
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False, sharey=True, layout="constrained")
    axes, missing = list(axes.flat), False
    for ax, facet in zip(axes, facets, strict=True):
        missing |= _final_axes(ax, study, cells, facet, rows, cols, labels=numeric or ax is axes[-1])
        if study.facet:
            ax.set_title(f"{study.facet} = {facet}", fontsize=9)
    axes[0 if numeric else len(axes) // 2].set_ylabel({**METRICS, "speedup": "speed-up"}[metric])
    axes[-1 if numeric else 0].legend(fontsize=7, ncol=len(cols) if len(axes) > 1 and not numeric else 1)
    tuned = f" (best of each {'/'.join(study.tune)} grid)" if study.tune else ""
    note = "\nx: no value (the target not reached in some seed, or diverged)" if missing else ""
    title = study.title if metric == study.metric else f"{study.title.split(':')[0]}: {METRICS[metric]}"
    fig.suptitle(f"{title}{tuned}{note}", fontsize=10)
    return fig


def plot(result: StudyResult, folder: str | os.PathLike) -> list[str]:
    """``final.png`` (the table's metric against its rows, one line or bar group per column, one panel per facet
    value), ``final_<metric>.png`` for :attr:`Study.also`, and ``curves_<x>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study, paths = result.study, []
    runs, _ = best_tuned(study, result.runs)
    for metric in (study.metric, *study.also):
        cells = _cell_values(study, runs, metric)
        fig = _final_figure(study, cells, metric)
        paths.append(os.path.join(folder, "final.png" if metric == study.metric else f"final_{metric}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for x in study.curves_x:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        n = len(result.curves)
        ax.set_prop_cycle(color=plt.cm.tab20(np.linspace(0, 1, max(n, 2))) if n > 10 else plt.cm.tab10(range(n)))
        for name, c in result.curves.items():
            ax.plot(c[x], 100 * np.asarray(c["train_error"]), label=name, lw=1)
        ax.set_xlabel({"epoch": "effective epochs", "update": "server updates", "time": "virtual wall-clock time"}[x])
        ax.set_ylabel(f"training error (%), smoothed over {result.settings.window} minibatches")
        ax.set_title(study.title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
        fig.tight_layout()
        paths.append(os.path.join(folder, f"curves_{x}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def plot_panels(result: StudyResult, path: str | os.PathLike) -> str:
    """One panel per row value (e.g. per worker count M): smoothed training error (thin) and test error (markers) of
    every series against effective epochs, mean over seeds; what ``asgd-jax ablate`` writes as ``curves.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = result.study
    rows = _ordered(c["coords"].get(study.rows) for c in result.curves.values())
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False, sharey=True)
    labels = list(dict.fromkeys(c["coords"]["label"] for c in result.curves.values()))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for ax, row in zip(axes[0], rows, strict=True):
        for c in result.curves.values():
            if c["coords"].get(study.rows) != row:
                continue
            label = c["coords"]["label"]
            ax.plot(c["epoch"], 100 * np.asarray(c["train_error"]), color=colors[label], lw=0.8, alpha=0.6)
            ax.plot(c["eval_epoch"], 100 * np.asarray(c["test_error"]), "o-", color=colors[label], ms=3, label=label)
        ax.set_title(f"{study.rows} = {row}")
        ax.set_xlabel("effective epochs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("error %")
    fig.text(
        0.5,
        0.01,
        f"markers: test error; thin lines: training error smoothed over {result.settings.window} "
        "minibatches; mean over seeds",
        ha="center",
        fontsize=8,
    )
    tops = [100 * np.asarray(c["test_error"])[len(c["test_error"]) // 4 :].max() for c in result.curves.values()]
    axes[0][0].set_ylim(0, min(100, 1.5 * max(tops) + 1))
    fig.suptitle(f"{study.title}: {result.settings.dataset} / {result.settings.model}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)


def save(
    result: StudyResult,
    folder: str | os.PathLike,
    *,
    plots: tuple[str, ...] = ("final", "curves"),
    tensorboard: bool = False,
) -> dict[str, str]:
    """Writes ``results.json``, ``results.csv``, ``table.md`` and the plots into ``folder``: ``"final"`` and
    ``"curves"`` (:func:`plot`: ``final.png``, ``curves_<x>.png``), ``"panels"`` (:func:`plot_panels`:
    ``curves.png``); with ``tensorboard``, every curve as TensorBoard event files in ``folder/tensorboard/<series>``
    (training error by update, test error at its evaluations; :mod:`asgd_jax.writers`)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    study, s = result.study, result.settings
    table = format_table(study, result.runs, len(s.seeds))
    payload = {
        "study": study.name,
        "title": study.title,
        "reproduces": study.reproduces,
        "quick": result.quick,
        "settings": dataclasses.asdict(s),
        "seconds": result.seconds,
        "runs": result.runs,
        "curves": result.curves,
        "table": table,
    }
    paths = {
        "json": os.path.join(folder, "results.json"),
        "csv": os.path.join(folder, "results.csv"),
        "table": os.path.join(folder, "table.md"),
    }
    with open(paths["json"], "w") as f:
        json.dump(payload, f, indent=1, default=str)
    keys = list(dict.fromkeys(k for r in result.runs for k in r))
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(result.runs)
    with open(paths["table"], "w") as f:
        f.write(f"# {study.title}\n\n{table}\n")
    if "final" in plots or "curves" in plots:
        for p in plot(result, folder):
            paths[os.path.basename(p)] = p
    if "panels" in plots:
        paths["plot"] = plot_panels(result, os.path.join(folder, "curves.png"))
    if tensorboard:
        paths["tensorboard"] = _write_tensorboard(result.curves, os.path.join(folder, "tensorboard"))
    shutil.rmtree(os.path.join(folder, ARMS), ignore_errors=True)  # finished: nothing left to resume
    return paths


def _write_tensorboard(curves: dict[str, dict[str, Any]], folder: str) -> str:
    """Each series' mean curves as event files of its own (one line per series in TensorBoard)."""
    from asgd_jax import writers

    for name, curve in curves.items():
        board = writers.TensorBoard(os.path.join(folder, writers.folder_name(name)))
        try:
            for update, error in zip(curve["update"], curve["train_error"], strict=True):
                board({"kind": "train", "update": update, "error": error})
            at = np.searchsorted(np.asarray(curve["epoch"]), np.asarray(curve["eval_epoch"]) - 1e-9) + 1
            for update, error in zip(at.tolist(), curve["test_error"], strict=True):
                board({"kind": "eval", "update": update, "error": error})
        finally:
            board.close()
    return folder


def ablate(*, quick: bool = False, progress: bool = True, **overrides: Any) -> StudyResult:
    """DC-ASGD's Table 1 in miniature: the ``dcasgd_table1`` study in its ``ablate`` form (mnist1d MLP, 40 effective
    epochs, 5 seeds; ``quick``: 15 epochs, 3 seeds), with ``overrides`` of its :class:`Settings` (``workers``,
    ``algorithms``, ``seeds``, ``epochs``, ``learning_rate``, ``lam_c``, ``lam_a``, ``dataset``, ...). What
    ``asgd-jax ablate`` and ``make demo`` run."""
    study = load("dcasgd_table1")
    settings = dataclasses.replace(study.form("ablate-quick" if quick else "ablate"), **overrides)
    return run(study, quick=quick, progress=progress, settings=settings)


def report(folder: str | os.PathLike, out: str | os.PathLike | None = None, *, header: str = "") -> str:
    """Turns a results folder (one study, or subfolders of several) into ``report.md`` with tables and plots."""
    folder = pathlib.Path(folder)
    found = sorted(folder.rglob("results.json"))
    if not found:
        raise errors.ConfigError(
            f"no results.json under {folder}: run `asgd-jax run <study> --out {folder}/<study>` first."
        )
    parts = ["# asgd_jax reproduction report", ""] + ([header, ""] if header else [])
    out = pathlib.Path(out) if out is not None else folder / "report.md"
    errors.output_folder("out", out.parent, "--out")
    for path in found:
        payload = _read_results(path)
        s = payload["settings"]
        form = "quick" if payload["quick"] else "full"
        parts += [
            f"## {payload['title']} (`{payload['study']}`, {form} form)",
            "",
            payload["reproduces"].strip(),
            "",
            f"{s['dataset']} / {s['model']}, {len(s['seeds'])} seed(s), {s['epochs']:g} effective epochs, "
            f"batch {s['batch_size']} per worker, lr {s['learning_rate']} ({s['schedule']}); "
            f"{payload['seconds']:.0f} s.",
            "",
            payload["table"],
            "",
        ]
        for png in sorted(path.parent.glob("*.png")):
            parts.append(f"![{payload['study']} {png.stem}]({os.path.relpath(png, out.parent)})")
        parts.append("")
    out.write_text("\n".join(parts))
    return str(out)


# What report() reads of a results.json, and of its settings.
_RESULT_KEYS = ("settings", "quick", "title", "study", "reproduces", "seconds", "table")
_SETTINGS_KEYS = ("dataset", "model", "seeds", "epochs", "batch_size", "learning_rate", "schedule")


def _read_results(path: pathlib.Path) -> dict[str, Any]:
    """A study's ``results.json``, or a :class:`~asgd_jax.errors.ConfigError` saying what is wrong with it (cut short,
    not JSON, not a study's results)."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise errors.ConfigError(
            f"{path} is not a readable results file ({type(e).__name__}: {e}): run the study again into its folder."
        ) from None
    missing = [k for k in _RESULT_KEYS if not isinstance(payload, dict) or k not in payload]
    if not missing and isinstance(payload["settings"], dict):
        missing = [f"settings.{k}" for k in _SETTINGS_KEYS if k not in payload["settings"]]
    if missing or not isinstance(payload.get("settings"), dict):
        raise errors.ConfigError(
            f"{path} is not a study's results (it lacks {', '.join(missing) or 'settings'}): run the study again "
            "into its folder."
        )
    return payload
