"""The staleness ablation: DC-ASGD's Table 1 in miniature, as few compiled programs as possible.

Algorithms {SGD (M = 1), ASGD, SSGD, DC-ASGD-c, DC-ASGD-a} x workers x seeds, all from the same initial weights (as in
the paper), the same learning-rate schedule (divided by 10 at 50% and 75% of training, the paper's 80/120 of 160
epochs) and the same budget of effective epochs. For every worker count, the asynchronous algorithms and seeds form one
:func:`asgd_jax.sweep` (ASGD is DC-ASGD with lambda = 0; -c and -a differ by a traced flag), and SSGD's seeds another.
A seed fixes the data order and the delays, so algorithms are compared on the same draws.

Example:
  >>> import asgd_jax.ablation as ab
  >>> cfg = ab.AblationConfig.quick()
  >>> cfg.workers, cfg.seeds
  ((1, 4, 8), (0, 1, 2))
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import data as data_lib
from asgd_jax import delays as delays_lib
from asgd_jax import metrics as metrics_lib
from asgd_jax import models as models_lib
from asgd_jax import rules
from asgd_jax.simulator import grid, sweep

__all__ = ["ALGORITHMS", "AblationConfig", "AblationResult", "format_table", "plot", "run"]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    label: str
    mode: str  # "async" or "sync"
    lam: str | None  # which config field gives lambda_0; None = no compensation
    adaptive: bool = False


ALGORITHMS: dict[str, Algorithm] = {
    "sgd": Algorithm("SGD", "async", None),
    "asgd": Algorithm("ASGD", "async", None),
    "ssgd": Algorithm("SSGD", "sync", None),
    "dc_asgd_c": Algorithm("DC-ASGD-c", "async", "lam_c"),
    "dc_asgd_a": Algorithm("DC-ASGD-a", "async", "lam_a", adaptive=True),
}
"""The algorithms of DC-ASGD's Table 1. ``sgd`` runs only at M = 1; the others only at M > 1."""


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """One ablation.

    Attributes:
      dataset: a dataset name (``mnist1d``, ``digits``, ``tfds:cifar10``, ...). mnist1d is the default because
        staleness visibly hurts there; on digits every algorithm lands within noise of sequential SGD.
      data_dir: TFDS data directory for ``tfds:`` datasets.
      model: a model name (``mlp``, ``cnn``).
      workers: worker counts M; 1 runs sequential SGD.
      algorithms: a subset of :data:`ALGORITHMS`.
      seeds: one run per seed and (algorithm, M); the seed fixes data order and delays.
      epochs: effective passes over the training data, the same for every algorithm.
      batch_size: minibatch per worker (SSGD's effective batch is M times larger).
      learning_rate: initial learning rate, divided by 10 at 50% and 75% of the updates (paper: 0.5).
      lam_c: DC-ASGD-c's lambda_0 (paper: 0.04).
      lam_a: DC-ASGD-a's lambda_0 (paper: 2).
      mean_square_decay: DC-ASGD-a's m (paper: 0.95).
      momentum: optional momentum for every algorithm (the paper reports none).
      compute_time: the workers' compute-time distribution (``exponential``, ``constant``, ``lognormal``).
      window: sliding window (minibatches) that smooths the training-error curves (GPU A-SGD: 400).
      evals: test-error evaluations per run (curve resolution).
      init_seed: seed of the shared initial weights.
    """

    dataset: str = "mnist1d"
    data_dir: str | None = None
    model: str = "mlp"
    workers: tuple[int, ...] = (1, 4, 8)
    algorithms: tuple[str, ...] = tuple(ALGORITHMS)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    epochs: float = 40.0
    batch_size: int = 32
    learning_rate: float = 0.5
    lam_c: float = 0.04
    lam_a: float = 2.0
    mean_square_decay: float = 0.95
    momentum: float | None = None
    compute_time: str = "exponential"
    window: int = 400
    evals: int = 20
    init_seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> AblationConfig:
        """About a minute on 2 CPU cores: 3 seeds, 15 epochs, a 100-minibatch smoothing window."""
        return cls(**{"seeds": (0, 1, 2), "epochs": 15.0, "window": 100, **overrides})

    def __post_init__(self):
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown or not self.algorithms:
            raise ValueError(f"algorithms={list(self.algorithms)!r} is invalid: choose from {', '.join(ALGORITHMS)}.")
        if not self.workers or any(not isinstance(m, int) or m < 1 for m in self.workers):
            raise ValueError(f"workers={list(self.workers)!r} is invalid: give worker counts >= 1.")
        if not self.seeds:
            raise ValueError("seeds is empty: give at least one seed.")
        if self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs!r} is invalid: use a positive number of passes.")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate!r} is invalid: use a positive number.")
        for name in ("batch_size", "window", "evals"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: use an int >= 1.")
        if self.compute_time not in delays_lib.COMPUTE_TIME_KINDS:
            raise ValueError(
                f"compute_time={self.compute_time!r} is invalid: use one of {', '.join(delays_lib.COMPUTE_TIME_KINDS)}."
            )
        # lam_c, lam_a, mean_square_decay and momentum are checked by the rules themselves.
        rules.dc_asgd(0.1, self.lam_c)
        rules.dc_asgd(0.1, self.lam_a, adaptive=True, mean_square_decay=self.mean_square_decay, momentum=self.momentum)

    def groups(self) -> list[tuple[int, str, list[str]]]:
        """The compiled programs: ``(M, mode, algorithms)`` for each worker count and mode."""
        out = []
        for m in self.workers:
            for mode in ("async", "sync"):
                algos = [
                    a
                    for a in self.algorithms
                    if ALGORITHMS[a].mode == mode and ((a == "sgd") == (m == 1)) and not (mode == "sync" and m == 1)
                ]
                if algos:
                    out.append((m, mode, algos))
        return out


@dataclasses.dataclass
class AblationResult:
    """Per-run outcomes and curves of an ablation.

    Attributes:
      config: the configuration that ran.
      runs: one dict per run: ``algorithm``, ``workers``, ``seed``, ``test_error``, ``train_error`` (smoothed, at the
        end), ``mean_staleness``, ``max_staleness``, ``virtual_time``, ``updates``.
      curves: per ``(algorithm, M)``: ``epoch`` and ``train_error`` (smoothed, ``[seeds, updates]``), ``eval_epoch``
        and ``test_error`` (``[seeds, evals]``).
      seconds: wall time of the whole ablation.
    """

    config: AblationConfig
    runs: list[dict[str, Any]]
    curves: dict[tuple[str, int], dict[str, np.ndarray]]
    seconds: float

    def table(self) -> dict[int, dict[str, tuple[float, float]]]:
        """Final test error in %: ``{M: {algorithm: (mean, std over seeds)}}``."""
        out: dict[int, dict[str, tuple[float, float]]] = {}
        for (algo, m), _ in self.curves.items():
            errors = [100 * r["test_error"] for r in self.runs if r["algorithm"] == algo and r["workers"] == m]
            mean, std = metrics_lib.mean_std(np.asarray(errors))
            out.setdefault(m, {})[algo] = (float(mean), float(std))
        return out


def _schedule(learning_rate: float, num_updates: int) -> optax.Schedule:
    # The paper divides by 10 at epochs 80 and 120 of 160.
    return optax.piecewise_constant_schedule(learning_rate, {int(0.5 * num_updates): 0.1, int(0.75 * num_updates): 0.1})


def run(config: AblationConfig, *, progress: bool = True) -> AblationResult:
    """Runs the ablation (one :func:`asgd_jax.sweep` per worker count and mode).

    Args:
      config: what to run.
      progress: show a progress bar per compiled program.

    Returns:
      An :class:`AblationResult`; :func:`save` writes it, :func:`format_table` prints it.
    """
    start = time.perf_counter()
    ds = data_lib.load(config.dataset, data_dir=config.data_dir)
    model = models_lib.get(config.model, num_classes=ds.num_classes, input_shape=ds.input_shape)
    params, model_state = model.init(jax.random.key(config.init_seed))
    loss_fn = models_lib.classification_loss(model)
    eval_fn = models_lib.classification_eval(model, ds.test)
    n = len(ds.y_train)

    runs: list[dict[str, Any]] = []
    curves: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for m, mode, algos in config.groups():
        per_update = config.batch_size * (m if mode == "sync" else 1)
        # A whole number of evaluation intervals, so every chunk of the scan has one length (one compile).
        interval = max(1, round(config.epochs * n / per_update / config.evals))
        num_updates = interval * config.evals
        schedule = _schedule(config.learning_rate, num_updates)
        lam = [0.0 if ALGORITHMS[a].lam is None else getattr(config, ALGORITHMS[a].lam) for a in algos]
        adaptive = [float(ALGORITHMS[a].adaptive) for a in algos]
        # Seeds vary slowest in grid(); pair each algorithm with its lam/adaptive by index.
        keys, hp = grid(seeds=config.seeds, index=list(range(len(algos))))
        index = np.asarray(hp.pop("index")).astype(int)
        hp = {"lam": np.asarray(lam, np.float32)[index], "adaptive": np.asarray(adaptive, np.float32)[index]}

        def rule_fn(h, schedule=schedule):
            return rules.dc_asgd(
                schedule,
                h["lam"],
                adaptive=h["adaptive"] > 0.5,
                mean_square_decay=config.mean_square_decay,
                momentum=config.momentum,
            )

        result = sweep(
            loss_fn,
            rule_fn,
            params,
            ds.train,
            keys=keys,
            hparams=hp,
            delays=delays_lib.Workers(m, compute_time=config.compute_time),
            batch_size=config.batch_size,
            num_updates=num_updates,
            mode=mode,
            model_state=model_state,
            eval_fn=eval_fn,
            eval_every=interval,
            progress=progress,
        )
        mx = result.metrics
        seeds = np.repeat(np.asarray(config.seeds), len(algos))
        smoothed = metrics_lib.smooth(mx["error"], config.window)
        epoch_per_update = per_update / n
        for i, algo in enumerate(algos):
            rows = np.flatnonzero(index == i)
            curves[(algo, m)] = {
                "epoch": mx["epoch"][rows[0]],
                "train_error": smoothed[rows],
                "eval_epoch": mx["eval_update"][rows[0]] * epoch_per_update,
                "test_error": mx["eval_error"][rows],
            }
            for r in rows:
                runs.append(
                    {
                        "algorithm": algo,
                        "workers": m,
                        "seed": int(seeds[r]),
                        "test_error": float(mx["eval_error"][r, -1]),
                        "train_error": float(smoothed[r, -1]),
                        "mean_staleness": float(mx["staleness"][r].mean()),
                        "max_staleness": int(mx["staleness"][r].max()),
                        "virtual_time": float(mx["time"][r, -1]),
                        "updates": num_updates,
                    }
                )
    return AblationResult(config, runs, curves, time.perf_counter() - start)


def format_table(result: AblationResult, paper: bool = False) -> str:
    """A Markdown table of final test error (%) laid out like DC-ASGD's Table 1: rows M, columns algorithms."""
    table = result.table()
    algos = [a for a in ALGORITHMS if a in result.config.algorithms]
    header = "| M | " + " | ".join(ALGORITHMS[a].label for a in algos) + " |"
    lines = [header, "|---|" + "---|" * len(algos)]
    for m in sorted(table):
        cells = []
        for a in algos:
            if a in table[m]:
                mean, std = table[m][a]
                cells.append(f"{mean:.2f} ± {std:.2f}")
            else:
                cells.append("")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: AblationResult, path: str | os.PathLike) -> None:
    """Error curves per worker count: smoothed training error (thin) and test error (markers), mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({m for _, m in result.curves})
    fig, axes = plt.subplots(1, len(ms), figsize=(5 * len(ms), 4), squeeze=False, sharey=True)
    colors = {a: f"C{i}" for i, a in enumerate(ALGORITHMS)}
    for ax, m in zip(axes[0], ms, strict=True):
        for (algo, mm), c in result.curves.items():
            if mm != m:
                continue
            label = ALGORITHMS[algo].label
            ax.plot(c["epoch"], 100 * c["train_error"].mean(0), color=colors[algo], lw=0.8, alpha=0.6)
            ax.plot(c["eval_epoch"], 100 * c["test_error"].mean(0), "o-", color=colors[algo], ms=3, label=label)
        ax.set_title(f"M = {m} worker{'s' if m > 1 else ''}")
        ax.set_xlabel("effective epochs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("error %")
    fig.text(0.5, 0.01, f"markers: test error; thin lines: training error smoothed over {result.config.window} "
             "minibatches; mean over seeds", ha="center", fontsize=8)  # fmt: skip
    top = max(100 * c["test_error"].mean(0)[len(c["test_error"][0]) // 4 :].max() for c in result.curves.values())
    axes[0][0].set_ylim(0, min(100, 1.5 * top + 1))
    fig.suptitle(f"Staleness ablation: {result.config.dataset} / {result.config.model}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: AblationResult, out_dir: str | os.PathLike) -> dict[str, str]:
    """Writes ``results.json``, ``results.csv``, ``table.md`` and ``curves.png`` into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    names = {"json": "results.json", "csv": "results.csv", "table": "table.md", "plot": "curves.png"}
    paths = {k: os.path.join(out_dir, f) for k, f in names.items()}
    summary = {
        "config": dataclasses.asdict(result.config),
        "seconds": result.seconds,
        "table_test_error_percent": {
            str(m): {a: {"mean": v[0], "std": v[1]} for a, v in row.items()} for m, row in result.table().items()
        },
        "runs": result.runs,
        "jax": {"version": jax.__version__, "backend": jax.default_backend()},
    }
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=2)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result.runs[0]))
        writer.writeheader()
        writer.writerows(result.runs)
    with open(paths["table"], "w") as f:
        f.write(format_table(result) + "\n")
    plot(result, paths["plot"])
    return paths


def parse_ints(values: Sequence[str] | None) -> tuple[int, ...] | None:
    """CLI helper: ``["1", "4", "8"]`` or ``["1,4,8"]`` to ``(1, 4, 8)``."""
    if values is None:
        return None
    out = []
    for v in values:
        for part in str(v).split(","):
            if part.strip():
                try:
                    out.append(int(part))
                except ValueError:
                    raise ValueError(f"{part!r} is not an int.") from None
    return tuple(out)
