"""The study language: :class:`Variant`, :class:`Arm`, :class:`Settings`, :class:`Study` (with its groups
:class:`Table`, :class:`Tuning` and :class:`Paper`), the DC-ASGD paper's CIFAR-10 setup, and finding the studies
(:func:`load`, :func:`available`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
import pkgutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from asgd_jax import delays as delays_lib
from asgd_jax import errors, rules
from asgd_jax.plan import Plan
from asgd_jax.setups import Setup

METRICS = {
    "test_error": "final test error (%)",
    "time_to_target": "virtual time to the target training error",
    "speedup": "speed-up in time to the target training error",
    "perplexity": "final test perplexity per token",
}
"""What a study's table can show (:attr:`Table.metric`, :attr:`Table.also`)."""

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One rule setting inside an arm.

    Attributes:
      label: the series name in tables and plots (``"DC-ASGD-a"``).
      rule: a registered rule (:func:`asgd_jax.rules.get`); default ``"sgd"``.
      lr: this variant's learning rate (default: the settings'), a traced number: an arm tunes it in one program.
      hp: the rule's other numeric hyperparameters, traced per run (the variants of one rule in an arm name the same
        ones):
        ``Variant("DC-ASGD-a", rule="dc_asgd", hp={"lam": 2.0, "adaptive": 1.0})`` and an ASGD with ``lam`` 0 share
        one program.
      coords: extra coordinates for tables/plots (e.g. ``{"lambda": 2.0}``).
    """

    label: str
    rule: str = "sgd"
    lr: float | None = None
    hp: Mapping[str, float] = dataclasses.field(default_factory=dict)
    coords: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        errors.choice("rule", self.rule, rules.names())
        if self.lr is not None:
            errors.finite_number("lr", self.lr, positive=True)
        takes = {*rules.defaults(self.rule), *rules.required(self.rule)}
        unknown = sorted(set(self.hp) - takes)
        errors.require(not unknown, "hp", dict(self.hp), f"rule {self.rule!r} takes {sorted(takes)}, not {unknown}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """Runs that share one compiled program.

    Attributes:
      coords: coordinates of every run in the arm (``{"M": 8}``, ``{"clients": 4, "n_sync": 10, "start": "warm"}``).
      plan: the arm's :class:`asgd_jax.Plan`: its delay model (``Settings.cluster(M)`` for the study's compute times,
        or ``FixedDelay(tau)``) and exchange pattern (``mode``, ``n_sync``, ``push``, ``local_lr``); the runner sets
        its batch, budget and evaluation cadence from the study's settings.
      variants: the rules: any mix of registered rules runs as one program (:func:`asgd_jax.rules.one_of` picks each
        run's); variants of one rule differ only in traced numbers.
      server_lr: the server's learning rate (default: the study's schedule; 1.0 with ``push="delta"`` adds the delta).
      warm: start from the study's warm-started weights.
      series: how the runs are named in plots (default: the variant's label).
      rule_options: static arguments of the rule (``buffer_size`` of Delayed Nesterov, DANA's ``lam``, ...).
      for_every: the arm's runs stand in every cell of these coordinates, run once (a reference such as sequential
        SGD in every ``{"M": (4, 16, 32)}`` column).
      num_updates: the arm's budget in updates (rounded up to whole evaluation intervals); default: the settings'
        ``epochs``. A study with a virtual-time budget gives each arm enough updates to reach it.
    """

    coords: Mapping[str, Any]
    plan: Plan = dataclasses.field(default_factory=lambda: Plan(1))
    variants: tuple[Variant, ...] = (Variant("SGD"),)
    server_lr: float | None = None
    warm: bool = False
    series: str | None = None
    rule_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    for_every: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    num_updates: int | None = None

    def __post_init__(self):
        if self.num_updates is not None:
            errors.positive_int("num_updates", self.num_updates)
        errors.require(isinstance(self.plan, Plan), "plan", self.plan, "give an asgd_jax.Plan(delays, ...)")
        errors.require(bool(self.variants), "variants", self.variants, "give at least one Variant")
        known = {k for v in self.variants for k in (*rules.defaults(v.rule), *rules.required(v.rule))}
        unknown = sorted(set(self.rule_options) - known)
        errors.require(not unknown, "rule_options", unknown, f"the arm's rules take {sorted(known)}")
        named: dict[str, list[str]] = {}
        for v in self.variants:
            hp = named.setdefault(v.rule, list(v.hp))
            errors.require(
                list(v.hp) == hp, "hp", dict(v.hp), f"every {v.rule!r} variant of an arm names the same ones: {hp}"
            )

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
      compute_time: the workers' compute-time distribution.
      evals: test-error evaluations per run.
      window: training-error smoothing window (minibatches; GPU A-SGD: 400).
      warm_epochs: single-worker SGD epochs that make the warm-started weights.
      target_error: training error (smoothed) whose first crossing defines time-to-target.
      time_budget: a virtual-time budget: a crossing after it does not count (no time to target).
      init_seed: seed of the shared initial weights.
      workers: the worker counts the study's arms run.

    The setup's ``schedule`` is DC-ASGD's step decay by default (/10 at 50% and 75% of the run); ``momentum`` is
    every rule's (the DC-ASGD paper reports none). A study's numbers of its own join a subclass (``DCSettings`` of
    ``asgd_jax.experiments._dcasgd`` adds DC-ASGD's lambda_0 and m), not this class: a form stays one flat record,
    the ``settings`` that ``results.json`` and every kept arm hold and a resume compares field by field.
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: float = 15.0
    compute_time: str = "exponential"
    evals: int = 10
    window: int = 100
    warm_epochs: float = 2.0
    target_error: float = 0.5
    init_seed: int = 0
    workers: tuple[int, ...] = (1, 4, 8)
    time_budget: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.time_budget is not None:
            errors.finite_number("time_budget", self.time_budget, positive=True)
        errors.require(bool(self.seeds), "seeds", self.seeds, "give at least one seed")
        errors.require(
            bool(self.workers) and all(isinstance(m, int) and m >= 1 for m in self.workers),
            "workers",
            list(self.workers),
            "give worker counts >= 1",
        )
        errors.finite_number("epochs", self.epochs, positive=True)
        errors.finite_number("warm_epochs", self.warm_epochs, positive=True)
        for name in ("evals", "window"):
            errors.positive_int(name, getattr(self, name))
        errors.choice("compute_time", self.compute_time, delays_lib.COMPUTE_TIME_KINDS)
        rules.get("sgd", 0.1, momentum=self.momentum)  # momentum is checked by the rule itself

    def cluster(self, workers: int, **kwargs: Any) -> delays_lib.Workers:
        """``Workers(workers, **kwargs)`` with the study's compute times (``kwargs`` may override them)."""
        return delays_lib.Workers(workers, **{"compute_time": self.compute_time, **kwargs})


#: The DC-ASGD paper's CIFAR-10 setup (Zheng et al. 2017): ResNet-20, no augmentation, 160 effective epochs,
#: minibatch 128 per worker, lr 0.5 divided by 10 at epochs 80 and 120, M in {1, 4, 8}, 5 seeds, the same initial
#: weights and schedule for every run (its lambda_0 and m are DC-ASGD's own numbers, ``DCSettings`` of
#: ``asgd_jax.experiments._dcasgd``): the full form of ``dcasgd_table1`` and ``dcasgd_lambda_sweep`` (hours on one
#: GPU; `asgd-jax data prepare cifar10` first).
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
class Problem:
    """A study's own problem, in place of its settings' dataset and model (the optimal-time quadratic).

    Attributes:
      loss: the training loss, an :class:`asgd_jax.Loss` with ``has_aux``: its aux ``"error"`` is the training measure
        (smoothed over the settings' ``window``, it decides the time to target and the tuned picks).
      evaluate: ``evaluate(params, model_state) -> {"error": ...}``: the measure at the server's weights, every
        evaluation (the results' ``test_error``: the last one).
      params: the initial weights.
      train: the training data (a pytree of arrays whose leading axis is the examples; the shards are cut from it).
    """

    loss: Any
    evaluate: Callable[[Any, Any], Mapping[str, Any]]
    params: Any
    train: Any

    @property
    def num_examples(self) -> int:
        import jax  # the study modules import this one without JAX

        return int(jax.tree.leaves(self.train)[0].shape[0])


@dataclasses.dataclass(frozen=True)
class Table:
    """How a study shows its results (``Table(rows, columns, ...)``): the table of its final metric, a cell per row
    and column (and facet value), and the plots drawn from the same cells.

    Attributes:
      rows, columns: the coordinates the cells are laid out by (``"label"`` is the series name); the final plot draws
        the metric against the rows, a line per column.
      facet: one table (and one plot panel) per value of this coordinate (``"cluster"``).
      column_order: the columns in this order (default: as the runs come).
      metric: ``"test_error"`` (%), ``"perplexity"`` (a language model's), ``"time_to_target"`` (virtual time) or
        ``"speedup"`` (the baseline's
        time-to-target over the run's).
      also: more metrics, each one more table of the same cells (``("time_to_target",)``).
      baseline: the coordinates of the speed-up baseline.
      equal_time: the time to target is measured under one virtual-time budget per column (and facet value), the
        same for every row (rule) there: the time at which the column's earliest-finishing run ended its budget of
        epochs, so that every run of the column ran at least that long; a crossing later does not count. Without it,
        each run's own budget of epochs bounds its time to target (a slower rule is given more time).
      curves_x: x axes of the training-curve plots (``"epoch"``, ``"update"``, ``"time"``; ``()``: none).
    """

    rows: str = "M"
    columns: str = "label"
    facet: str | None = None
    column_order: tuple[str, ...] | None = None
    metric: str = "test_error"
    also: tuple[str, ...] = ()
    baseline: Mapping[str, Any] | None = None
    equal_time: bool = False
    curves_x: tuple[str, ...] = ("epoch",)

    def __post_init__(self):
        for metric in (self.metric, *self.also):
            errors.choice("metric", metric, METRICS)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A tuned study: each cell shows the runs of its best setting, and the table lists the picks.

    Attributes:
      over: the coordinates tuned per cell (``("lr", "lambda")``; ``()``, the default: none).
      by: what a pick minimises, a run's ``"train_error"`` (its final smoothed training error, the default: the test
        set never picks) or ``"time_to_target"`` (a run that never reaches the target counts as the worst).
      widen: rounds of grid widening: after the arms, every cell whose tuned learning rate is the smallest or largest
        of 3 or more tried there runs that variant again one grid step further out (the step the grid's two outermost
        values make), and the picks are made again; a pick still at the edge stays marked * (default 0: none).
    """

    over: tuple[str, ...] = ()
    by: str = "train_error"
    widen: int = 0

    def __post_init__(self):
        errors.choice("by", self.by, ("train_error", "time_to_target"))
        errors.int_at_least("widen", self.widen, 0, "--widen")


@dataclasses.dataclass(frozen=True)
class Paper:
    """What the paper says, beside what the study measures.

    Attributes:
      numbers: its numbers, ``{row: {column: value}}``, printed beside ours.
      note: where they come from (its setup, table and authors).
      prediction: ``prediction(settings, rows) -> (label, {row: value})``: a curve drawn beside the final metric's
        lines (a theory's prediction, up to a constant: it is scaled to the best measured value at each row, their
        median ratio).
    """

    numbers: Mapping[Any, Mapping[str, float]] | None = None
    note: str = ""
    prediction: Callable[[Settings, list[Any]], tuple[str, Mapping[Any, float]]] | None = None


#: ``Study``'s keywords of before the groups (deprecated, for one release): each one's group and its name there.
FLAT_KEYWORDS = {
    "rows": ("table", "rows"),
    "columns": ("table", "columns"),
    "facet": ("table", "facet"),
    "column_order": ("table", "column_order"),
    "metric": ("table", "metric"),
    "also": ("table", "also"),
    "baseline": ("table", "baseline"),
    "equal_time": ("table", "equal_time"),
    "curves_x": ("table", "curves_x"),
    "tune": ("tuning", "over"),
    "tune_by": ("tuning", "by"),
    "widen": ("tuning", "widen"),
    "paper_note": ("paper", "note"),
    "reference": ("paper", "prediction"),
}
_GROUPS: dict[str, Any] = {"table": Table, "tuning": Tuning, "paper": Paper}


def _deprecated(old: str, group: str, name: str) -> None:
    kind = _GROUPS[group].__name__
    warnings.warn(
        f"Study({old}=...) is deprecated: write Study({group}={kind}({name}=...)); the flat keywords go in the next "
        "release",
        DeprecationWarning,
        stacklevel=4,  # the caller of Study(...)
    )


def _grouped(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``Study``'s keywords with those of before the groups (``rows=``, ``tune=``, ``paper={row: {...}}``, ...) moved
    into their group, each with a ``DeprecationWarning`` naming it."""
    if "paper" in kwargs and not isinstance(kwargs["paper"], Paper):  # the paper's numbers themselves, as before
        _deprecated("paper", "paper", "numbers")
        kwargs["paper"] = Paper(numbers=kwargs["paper"])
    changes: dict[str, dict[str, Any]] = {}
    for old in [k for k in kwargs if k in FLAT_KEYWORDS]:
        group, name = FLAT_KEYWORDS[old]
        _deprecated(old, group, name)
        changes.setdefault(group, {})[name] = kwargs.pop(old)
    for group, values in changes.items():
        kwargs[group] = dataclasses.replace(kwargs.get(group, _GROUPS[group]()), **values)
    return kwargs


def _takes_flat_keywords(cls: type[_T]) -> type[_T]:
    """``cls`` whose ``__init__`` also takes the keywords of before the groups (:data:`FLAT_KEYWORDS`)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **_grouped(kwargs))

    setattr(cls, "__init__", __init__)  # noqa: B010 (an assignment is mypy's method-assign error)
    return cls


@_takes_flat_keywords
@dataclasses.dataclass(frozen=True)
class Study:
    """A reproduction study: what it reproduces, its forms and arms, and its knobs in three groups (a new knob joins
    one of them): :class:`Table` (what the table and plots show, and their layout), :class:`Tuning` (a tuned study's
    picks) and :class:`Paper` (the paper's numbers and prediction).

    Attributes:
      name: the command-line name (``asgd-jax run <name>``).
      title: one line.
      reproduces: what it reproduces and the expected qualitative result (goes into the report).
      quick, full: the two forms' :class:`Settings` (quick: minutes on 2 CPU cores; full: the paper's setup).
      arms: ``arms(settings, quick) -> list[Arm]``.
      forms: more named forms beside ``quick`` and ``full`` (``asgd-jax ablate`` runs ``dcasgd_table1``'s).
      problem: ``problem(settings) -> Problem``: the study's own loss, weights and data instead of the settings'
        dataset and model.
      measure: the name of a :attr:`problem`'s own training measure (its loss's aux ``error``, e.g. ``"‖∇f‖²"``):
        tables and plots call it so, and the curves draw it as it is, on a log axis. None (the default): the
        classification training error, drawn in %.
      table: the table's layout and metric, and the plots (:class:`Table`; default: the test error by ``"M"`` and
        ``"label"``).
      tuning: the coordinates tuned per cell and how (:class:`Tuning`; default: none).
      paper: the paper's numbers and prediction (:class:`Paper`; default: none).

    The keywords of before the groups (``rows=``, ``tune=``, ``paper={row: {...}}``, ...: :data:`FLAT_KEYWORDS`) still
    work for one release, each with a ``DeprecationWarning`` naming its group.
    """

    name: str
    title: str
    reproduces: str
    quick: Settings
    full: Settings
    arms: Callable[[Settings, bool], list[Arm]]
    _: dataclasses.KW_ONLY
    forms: Mapping[str, Settings] = dataclasses.field(default_factory=dict)
    problem: Callable[[Settings], Problem] | None = None
    measure: str | None = None
    table: Table = Table()
    tuning: Tuning = Tuning()
    paper: Paper = Paper()

    def __post_init__(self):
        for field, kind in (("table", Table), ("tuning", Tuning), ("paper", Paper)):
            value = getattr(self, field)
            errors.require(isinstance(value, kind), field, value, f"give a studies.{kind.__name__}(...)")
        if self.measure is not None:
            errors.require(
                isinstance(self.measure, str) and self.measure.strip() != "",
                "measure",
                self.measure,
                'name the training measure, e.g. "‖∇f‖²" (or None for the training error in %)',
            )

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
        module = _study_module(path)
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


STUDY_FILE = "a study file is a Python .py file that defines STUDY = asgd_jax.studies.Study(...)"


def _study_module(path: pathlib.Path) -> Any:
    """The module of a study file, or a ``ConfigError`` naming the file and what a study file is: one Python cannot
    load as a module (not a ``.py`` file), or whose code fails (the error and its line in the file)."""
    spec = importlib.util.spec_from_file_location(f"asgd_jax_study_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise errors.ConfigError(f"{path} is not a study file (Python cannot load it as a module): {STUDY_FILE}.")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the file's own code failed: where and why, in one line
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
        tb = e.__traceback__
        while tb is not None:  # the deepest frame of the study file itself
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
                line = tb.tb_lineno
            tb = tb.tb_next
        at = f" at line {line}" if line else ""
        what = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        raise errors.ConfigError(f"{path} could not be loaded{at} ({what}): {STUDY_FILE}.") from e
    return module
