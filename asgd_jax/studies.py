"""Reproduction studies: each a small declarative config, one runner, one report.

A :class:`Study` says what it reproduces and lists :class:`Arm` s; an arm is one compiled program (one
:func:`asgd_jax.sweep`): a delay model and exchange pattern shared by its :class:`Variant` s x seeds. Every run gets the
same budget of effective epochs, the same learning-rate schedule and the same initial weights (or the same warm-started
ones). :func:`run` writes ``results.json``, ``results.csv``, ``table.md`` and PNG plots into a folder;
:func:`report` turns folders of results into one Markdown report.

The studies themselves live in ``experiments/<name>.py`` (``STUDY = Study(...)``); :func:`load` finds them by name.

Example:
  >>> from asgd_jax import studies
  >>> v = studies.Variant("DC-ASGD-a", lam=2.0, adaptive=True)
  >>> arm = studies.Arm({"M": 8}, workers=8, variants=(v,))
  >>> arm.delays().num, arm.label(v)
  (8, 'DC-ASGD-a')
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import ablation, rules
from asgd_jax import data as data_lib
from asgd_jax import delays as delays_lib
from asgd_jax import metrics as metrics_lib
from asgd_jax import models as models_lib
from asgd_jax.simulator import grid, simulate, sweep

__all__ = ["DCASGD_CIFAR10", "Arm", "Settings", "Study", "Variant", "available", "load", "report", "run"]

FAMILIES = ("dc", "staleness_aware", "delay_adaptive")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One rule setting inside an arm.

    Attributes:
      label: the series name in tables and plots (``"DC-ASGD-a"``).
      family: ``"dc"`` (SGD/ASGD/DC-ASGD: lambda 0 is plain ASGD), ``"staleness_aware"`` or ``"delay_adaptive"``.
      lam: DC-ASGD's lambda_0.
      adaptive: DC-ASGD-a (True) or -c.
      coords: extra coordinates for tables/plots (e.g. ``{"lambda": 2.0}``).
    """

    label: str
    family: str = "dc"
    lam: float = 0.0
    adaptive: bool = False
    coords: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is invalid: use one of {', '.join(FAMILIES)}.")


@dataclasses.dataclass(frozen=True)
class Arm:
    """Runs that share one compiled program.

    Attributes:
      coords: coordinates of every run in the arm (``{"M": 8}``, ``{"clients": 4, "n_sync": 10, "start": "warm"}``).
      workers: M (``Workers``), or ``tau`` for a fixed delay.
      tau: use ``FixedDelay(tau)`` instead of workers.
      variants: the rules, all of one family.
      mode: ``"async"`` or ``"sync"`` (SSGD).
      n_sync, push: the exchange pattern (GPU A-SGD).
      local_lr: local step size for ``n_sync > 1`` (default: the study's learning rate).
      server_lr: the server's learning rate (default: the study's schedule; 1.0 with ``push="delta"`` adds the delta).
      warm: start from the study's warm-started weights.
      worker_kwargs: more ``Workers`` arguments (``speeds``, ``straggler_prob``, ``comm_time``, ...).
      series: how the runs are named in plots (default: the variant's label).
    """

    coords: Mapping[str, Any]
    workers: int = 1
    tau: int | None = None
    variants: tuple[Variant, ...] = (Variant("SGD"),)
    mode: str = "async"
    n_sync: int = 1
    push: str = "gradients"
    local_lr: float | None = None
    server_lr: float | None = None
    warm: bool = False
    worker_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    series: str | None = None

    def __post_init__(self):
        families = {v.family for v in self.variants}
        if len(families) != 1:
            raise ValueError(f"an Arm's variants share one family (one program), got {sorted(families)}: split it.")

    def delays(self, compute_time: str = "exponential"):
        if self.tau is not None:
            return delays_lib.FixedDelay(self.tau)
        return delays_lib.Workers(self.workers, compute_time=compute_time, **self.worker_kwargs)

    def label(self, variant: Variant) -> str:
        return variant.label if self.series is None else self.series.format(label=variant.label, **self.coords)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of a study shares (a study has a quick and a full form of these).

    Attributes:
      dataset, data_dir, model: data and model by name; model_options go to :func:`asgd_jax.models.get`.
      seeds: one run per seed and variant.
      epochs: effective passes over the training data per run (warm runs: after the warm-up).
      batch_size: minibatch per worker.
      learning_rate: initial learning rate.
      schedule: ``"step"`` (/10 at 50% and 75%, DC-ASGD's) or ``"constant"``.
      mean_square_decay: DC-ASGD-a's m.
      compute_time: the workers' compute-time distribution.
      evals: test-error evaluations per run.
      window: training-error smoothing window (minibatches; GPU A-SGD: 400).
      warm_epochs: single-worker SGD epochs that make the warm-started weights.
      target_error: training error (smoothed) whose first crossing defines time-to-target.
      init_seed: seed of the shared initial weights.
    """

    dataset: str = "mnist1d"
    data_dir: str | None = None
    model: str = "mlp"
    model_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: float = 15.0
    batch_size: int = 32
    learning_rate: float = 0.5
    schedule: str = "step"
    mean_square_decay: float = 0.95
    compute_time: str = "exponential"
    evals: int = 10
    window: int = 100
    warm_epochs: float = 2.0
    target_error: float = 0.5
    init_seed: int = 0


#: The DC-ASGD paper's CIFAR-10 setup (ResNet-20, 160 epochs, batch 128, step size 0.5): the full form of its studies.
DCASGD_CIFAR10 = Settings(dataset="tfds:cifar10", model="resnet20", seeds=(0, 1, 2), epochs=160.0, batch_size=128,
                          learning_rate=0.5, evals=20, window=400)  # fmt: skip


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


# --------------------------------------------------------------------------------------------------------------------
# Finding studies.
# --------------------------------------------------------------------------------------------------------------------


def _experiments_dir() -> pathlib.Path:
    env = os.environ.get("ASGD_JAX_EXPERIMENTS")
    if env:
        return pathlib.Path(env)
    for base in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parents[1]):
        if (base / "experiments").is_dir():
            return base / "experiments"
    return pathlib.Path.cwd() / "experiments"


def available() -> list[str]:
    """Names of the studies in ``experiments/`` (files that define ``STUDY``)."""
    folder = _experiments_dir()
    return sorted(p.stem for p in folder.glob("*.py") if "STUDY = " in p.read_text())


def load(name_or_path: str) -> Study:
    """The ``STUDY`` of ``experiments/<name>.py`` (or of a given ``.py`` file)."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".py":
        path = _experiments_dir() / f"{name_or_path}.py"
    if not path.exists():
        raise ValueError(f"study {name_or_path!r} not found in {path.parent}: choose from {', '.join(available())}.")
    spec = importlib.util.spec_from_file_location(f"asgd_jax_study_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    study = getattr(module, "STUDY", None)
    if not isinstance(study, Study):
        raise ValueError(f"{path} defines no STUDY = asgd_jax.studies.Study(...).")
    return study


# --------------------------------------------------------------------------------------------------------------------
# Running.
# --------------------------------------------------------------------------------------------------------------------


def _schedule(s: Settings, num_updates: int) -> optax.Schedule:
    if s.schedule == "constant":
        return optax.constant_schedule(s.learning_rate)
    return ablation._schedule(s.learning_rate, num_updates)  # DC-ASGD's steps, as in the ablation


def _rule_fn(family: str, arm: Arm, s: Settings, num_updates: int, num_workers: int):
    lr = _schedule(s, num_updates) if arm.server_lr is None else arm.server_lr
    if family == "staleness_aware":
        return lambda h: rules.staleness_aware_sgd(lr)
    if family == "delay_adaptive":
        return lambda h: rules.delay_adaptive_sgd(lr, num_workers)
    return lambda h: rules.dc_asgd(lr, h["lam"], adaptive=h["adaptive"] > 0.5, mean_square_decay=s.mean_square_decay)


def _time_to_target(times: np.ndarray, smoothed: np.ndarray, target: float) -> float:
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


def run(study: Study, *, quick: bool = False, progress: bool = True, settings: Settings | None = None) -> StudyResult:
    """Runs every arm of ``study`` (one :func:`asgd_jax.sweep` each) in its quick or full form.

    Args:
      study: the study (:func:`load` finds one by name).
      quick: the quick form (minutes on 2 CPU cores) instead of the full one.
      progress: progress bars.
      settings: override the form's settings (tests use a tiny one).
    """
    start = time.perf_counter()
    s = settings or (study.quick if quick else study.full)
    arms = study.arms(s, quick)
    if not arms:
        raise ValueError(f"study {study.name!r} has no arms for these settings.")
    ds = data_lib.load(s.dataset, data_dir=s.data_dir)
    model = models_lib.get(s.model, num_classes=ds.num_classes, input_shape=ds.input_shape, **s.model_options)
    params0, model_state0 = model.init(jax.random.key(s.init_seed))
    loss_fn = models_lib.classification_loss(model)
    eval_fn = models_lib.classification_eval(model, ds.test)
    n = len(ds.y_train)
    warm = None
    if any(a.warm for a in arms):  # one warm start for the whole study: single-worker SGD from the shared init
        updates = max(1, round(s.warm_epochs * n / s.batch_size))
        w = simulate(loss_fn, rules.asgd(s.learning_rate), params0, ds.train, delays=delays_lib.Workers(1),
                     batch_size=s.batch_size, num_updates=updates, model_state=model_state0,
                     key=jax.random.key(10_000 + s.init_seed), progress=progress)  # fmt: skip
        warm = (w.params, w.model_state)

    runs: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}
    for arm in arms:
        m = arm.tau + 1 if arm.tau is not None else arm.workers
        per_update = s.batch_size * arm.n_sync * (m if arm.mode == "sync" else 1)
        interval = max(1, round(s.epochs * n / per_update / s.evals))
        num_updates = interval * s.evals
        variants = arm.variants
        keys, hp = grid(seeds=s.seeds, index=list(range(len(variants))))
        index = np.asarray(hp.pop("index")).astype(int)
        hp = {
            "lam": np.asarray([v.lam for v in variants], np.float32)[index],
            "adaptive": np.asarray([float(v.adaptive) for v in variants], np.float32)[index],
        }
        params, model_state = warm if arm.warm else (params0, model_state0)
        result = sweep(
            loss_fn, _rule_fn(variants[0].family, arm, s, num_updates, m), params, ds.train, keys=keys, hparams=hp,
            delays=arm.delays(s.compute_time), batch_size=s.batch_size, num_updates=num_updates, mode=arm.mode,
            n_sync=arm.n_sync, push=arm.push,
            local_learning_rate=(arm.local_lr or s.learning_rate) if arm.n_sync > 1 or arm.push == "delta" else None,
            model_state=model_state, eval_fn=eval_fn, eval_every=interval, progress=progress,
        )  # fmt: skip
        mx = result.metrics
        seeds = np.repeat(np.asarray(s.seeds), len(variants))
        # Training error per minibatch, smoothed over `window` minibatches (an update is n_sync of them per worker).
        smoothed = metrics_lib.smooth(mx["error"], max(1, s.window // arm.n_sync))
        offset = s.warm_epochs if arm.warm else 0.0
        for i, variant in enumerate(variants):
            rows = np.flatnonzero(index == i)
            label = arm.label(variant)
            coords = {**arm.coords, **variant.coords, "label": label}
            series = " | ".join(
                f"{k}={v}"
                for k, v in coords.items()
                if k != "label" and f"{k}={v}" not in label and str(v) not in label.split(", ")
            )  # what the label does not say already
            key = f"{label} ({series})" if series else label
            curves[key] = {
                "coords": coords,
                "update": list(range(1, num_updates + 1)),
                "epoch": (offset + mx["epoch"][rows[0]]).tolist(),
                "time": mx["time"][rows].mean(axis=0).tolist(),
                "train_error": smoothed[rows].mean(axis=0).tolist(),
                "eval_epoch": (offset + mx["eval_update"][rows[0]] * per_update / n).tolist(),
                "test_error": mx["eval_error"][rows].mean(axis=0).tolist(),
            }
            for r in rows:
                runs.append({
                    **coords, "seed": int(seeds[r]),
                    "test_error": float(mx["eval_error"][r, -1]),
                    "train_error": float(smoothed[r, -1]),
                    "time_to_target": _time_to_target(mx["time"][r], smoothed[r], s.target_error),
                    "virtual_time": float(mx["time"][r, -1]),
                    "mean_staleness": float(mx["staleness"][r].mean()),
                    "updates": num_updates,
                })  # fmt: skip
    return StudyResult(study, s, quick, runs, curves, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------------------------
# Tables, plots, files.
# --------------------------------------------------------------------------------------------------------------------


def _ordered(values) -> list:
    values = list(dict.fromkeys(values))
    return sorted(values) if all(isinstance(v, int | float) for v in values) else values


def _cell_values(study: Study, runs: list[dict[str, Any]]) -> dict[tuple[Any, Any], tuple[float, float]]:
    groups: dict[tuple[Any, Any], list[float]] = {}
    for r in runs:
        value = 100 * r["test_error"] if study.metric == "test_error" else r["time_to_target"]
        groups.setdefault((r.get(study.rows), r.get(study.columns)), []).append(value)
    cells = {k: tuple(float(x) for x in metrics_lib.mean_std(np.asarray(v))) for k, v in groups.items()}
    if study.metric == "speedup":
        base_runs = [r for r in runs if all(r.get(k) == v for k, v in (study.baseline or {}).items())]
        base = float(np.mean([r["time_to_target"] for r in base_runs])) if base_runs else math.nan
        cells = {k: (base / mean if mean > 0 else math.nan, 0.0) for k, (mean, _) in cells.items()}
    return cells


def format_table(study: Study, runs: list[dict[str, Any]], num_seeds: int) -> str:
    """The study's Markdown table (mean ± std over seeds), with the paper's numbers beside ours when given."""
    cells = _cell_values(study, runs)
    rows = _ordered(r for r, _ in cells)
    cols = list(dict.fromkeys(c for _, c in cells))
    what = {"test_error": "final test error (%)", "time_to_target": "virtual time to the target training error",
            "speedup": "speed-up in time to the target training error"}[study.metric]  # fmt: skip
    if study.metric == "speedup":
        what += f" (baseline {', '.join(f'{k}={v}' for k, v in (study.baseline or {}).items())})"
    head = f"| {study.rows} | " + " | ".join(map(str, cols)) + " |"
    over = "ratio of mean times" if study.metric == "speedup" else "mean ± std"
    lines = [f"{what}, {over} over {num_seeds} seed(s)", "", head]
    lines.append("|---" * (len(cols) + 1) + "|")
    for row in rows:
        out = []
        for col in cols:
            mean, std = cells.get((row, col), (math.nan, 0.0))
            if math.isnan(mean):
                out.append("—")
            elif study.metric == "speedup":
                out.append(f"{mean:.2f}x")
            else:
                out.append(f"{mean:.2f} ± {std:.2f}")
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    if study.metric != "test_error" and any(math.isnan(m) for m, _ in cells.values()):
        lines += ["", "—: the target was not reached within the epoch budget (in at least one seed)."]
    if study.paper:
        pcols = list(dict.fromkeys(c for v in study.paper.values() for c in v))
        lines += ["", f"Paper{': ' + study.paper_note if study.paper_note else ''}", "",
                  f"| {study.rows} | " + " | ".join(pcols) + " |", "|---" * (len(pcols) + 1) + "|"]  # fmt: skip
        for row, values in study.paper.items():
            lines.append(f"| {row} | " + " | ".join(f"{values[c]:.2f}" if c in values else "" for c in pcols) + " |")
    return "\n".join(lines)


def plot(result: StudyResult, folder: str | os.PathLike) -> list[str]:
    """``final.png`` (the table's metric against its rows, one line per column) and ``curves_<x>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study, paths = result.study, []
    cells = _cell_values(study, result.runs)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rows = _ordered(r for r, _ in cells)
    numeric = all(isinstance(r, int | float) for r in rows)
    for col in dict.fromkeys(c for _, c in cells):
        pts = [(r, *cells[(r, col)]) for r in rows if (r, col) in cells]
        x = [p[0] if numeric else rows.index(p[0]) for p in pts]
        ax.errorbar(x, [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, label=str(col))
    if numeric and len(rows) > 2 and min(rows) > 0 and max(rows) / min(rows) >= 8:
        ax.set_xscale("log", base=2)
    if not numeric:
        ax.set_xticks(range(len(rows)), [str(r) for r in rows], rotation=15)
    ax.set_xlabel(study.rows)
    ax.set_ylabel({"test_error": "final test error (%)", "time_to_target": "virtual time to target",
                   "speedup": "speed-up"}[study.metric])  # fmt: skip
    ax.set_title(study.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(folder, "final.png"))
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


def save(result: StudyResult, folder: str | os.PathLike) -> dict[str, str]:
    """Writes ``results.json``, ``results.csv``, ``table.md`` and the plots into ``folder``."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    study, s = result.study, result.settings
    table = format_table(study, result.runs, len(s.seeds))
    payload = {
        "study": study.name, "title": study.title, "reproduces": study.reproduces, "quick": result.quick,
        "settings": dataclasses.asdict(s), "seconds": result.seconds, "runs": result.runs, "curves": result.curves,
        "table": table,
    }  # fmt: skip
    paths = {"json": os.path.join(folder, "results.json"), "csv": os.path.join(folder, "results.csv"),
             "table": os.path.join(folder, "table.md")}  # fmt: skip
    with open(paths["json"], "w") as f:
        json.dump(payload, f, indent=1, default=str)
    keys = list(dict.fromkeys(k for r in result.runs for k in r))
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(result.runs)
    with open(paths["table"], "w") as f:
        f.write(f"# {study.title}\n\n{table}\n")
    for p in plot(result, folder):
        paths[os.path.basename(p)] = p
    return paths


def report(folder: str | os.PathLike, out: str | os.PathLike | None = None, *, header: str = "") -> str:
    """Turns a results folder (one study, or subfolders of several) into ``report.md`` with tables and plots."""
    folder = pathlib.Path(folder)
    found = sorted(folder.rglob("results.json"))
    if not found:
        raise ValueError(f"no results.json under {folder}: run `asgd-jax run <study> --out {folder}/<study>` first.")
    out = pathlib.Path(out) if out is not None else folder / "report.md"
    parts = ["# asgd_jax reproduction report", ""] + ([header, ""] if header else [])
    for path in found:
        payload = json.loads(path.read_text())
        s = payload["settings"]
        form = "quick" if payload["quick"] else "full"
        parts += [f"## {payload['title']} (`{payload['study']}`, {form} form)", "", payload["reproduces"].strip(), "",
                  f"{s['dataset']} / {s['model']}, {len(s['seeds'])} seed(s), {s['epochs']:g} effective epochs, "
                  f"batch {s['batch_size']} per worker, lr {s['learning_rate']} ({s['schedule']}); "
                  f"{payload['seconds']:.0f} s.", "", payload["table"], ""]  # fmt: skip
        for png in sorted(path.parent.glob("*.png")):
            parts.append(f"![{payload['study']} {png.stem}]({os.path.relpath(png, out.parent)})")
        parts.append("")
    out.write_text("\n".join(parts))
    return str(out)
