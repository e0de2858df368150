"""What both trainer backends share: a worker's devices, the metrics log, the evaluator, the result, the wind-down.

The threaded backend (:mod:`asgd_jax.threads`) and the Ray backend (:mod:`asgd_jax.ray_backend`) each import this
module and never each other; :func:`asgd_jax.trainer.train` picks one. A session ends the same way on either
(:func:`finish`): a final evaluation of the store's weights, ``model.npz``, the final record of ``metrics.jsonl`` and
``summary.json``, then the result, or the exception that says why the run stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from asgd_jax import checkpoint, errors, trace
from asgd_jax.delays import MSync, Rennala, Ringmaster, Workers
from asgd_jax.plan import Plan

__all__ = [
    "BACKENDS",
    "Evaluator",
    "MetricsLog",
    "Outcome",
    "RunLock",
    "TrainConfig",
    "TrainResult",
    "WorkerStats",
    "finish",
]

log = logging.getLogger("asgd_jax.session")

MODEL = "model.npz"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TRACE = trace.FILE
CHECKPOINT = "checkpoint.npz"
LOCK = ".lock"


class RunLock:
    """A run folder is owned by one process at a time: an exclusive ``flock`` on ``<out>/.lock`` for the run's length.

    Entering makes the folder (it must be one that can be written) and takes the lock, or raises a
    :class:`~asgd_jax.errors.ConfigError` naming the process that holds it. The operating system drops the lock when
    that process ends, however it ends (``kill -9`` included), so a dead run never blocks its resume.

    Example:
      >>> import tempfile
      >>> from asgd_jax.session import RunLock
      >>> out = tempfile.mkdtemp()
      >>> with RunLock(out):
      ...     try:
      ...         RunLock(out).__enter__()
      ...     except ValueError as e:
      ...         print(str(e).split("(process")[0])
      out=... (--out) is in use by another run
    """

    def __init__(self, out: str | os.PathLike):
        self.out = os.fspath(out)
        self._file = None

    def __enter__(self) -> RunLock:
        import fcntl

        out = errors.output_folder("out", self.out, "--out")
        f = open(os.path.join(out, LOCK), "a+")  # held until __exit__
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise errors.ConfigError(
                f"out={out!r} (--out) is in use by another run (process {holder}): wait for it to end, or choose "
                "another folder."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            self._file.close()  # closing the file drops the lock
            self._file = None


BACKENDS = ("threads", "ray")
FAILURE_POLICIES = ("continue", "stop")
NONFINITE_POLICIES = ("reject", "stop")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run's settings, validated when made: its :class:`asgd_jax.Plan` and how the trainer runs it.

    The plan is the run's static description, the same value the simulator reads: the worker count (``Plan(M)``, its
    delay model ``Workers(M)``: the trainer's delays are real, measured and recorded in ``trace.jsonl``; or an
    optimal-time method over M workers, ``Ringmaster(M, R, stops=)``, ``Rennala(M, S, stops=)``, ``MSync(M, m)``,
    whose ignores, stops and rounds the store and the workers carry out for real), the budget,
    the batch, the exchange pattern (``mode``, ``n_sync``, ``push``, ``local_lr``) and the cadence (``eval_every``,
    ``checkpoint_every``). Every field of the plan and of this class is a flag of ``asgd-jax train`` with the same name
    (``--workers M`` for the plan's delays, with ``--ringmaster R``, ``--rennala S``, ``--msync m`` and ``--stops``;
    ``progress=False`` is ``--no-progress``; ``--steps`` is an alias of
    ``--num-updates``); a TOML or JSON ``--config`` file uses the same names. The model, data and rule are
    :func:`asgd_jax.trainer.train`'s other arguments.

    Attributes:
      plan: the run's :class:`asgd_jax.Plan` (default: 4 workers, 2,000 updates, batch 32); ``num_updates`` counts the
        warm-up too. ``checkpoint_every`` (default a tenth of the run) needs ``out``; ``eval_every`` defaults to a
        tenth of the run, with an ``eval_fn``.
      seed: the run's key is ``jax.random.key(seed)``: it fixes every worker's minibatch order and model randomness
        (the simulator's, for replay).
      devices_per_worker: devices per worker; worker w owns group ``w mod (devices // devices_per_worker)``, its
        minibatch is split over the group and the gradients averaged inside it.
      out: the run's folder: ``plan.json``, ``trace.jsonl``, ``metrics.jsonl``, ``checkpoint.npz``, ``model.npz``,
        ``summary.json``.
      resume: ``True``: continue from ``out``'s checkpoint (one must be there); ``"auto"``: continue if there is one,
        else start; ``False``: start (an existing checkpoint is an error, never overwritten).
      warm_start_steps: first this many updates with a single worker, then all M start from its weights.
      log_every: seconds between records of ``metrics.jsonl`` (and progress-bar refreshes).
      progress: show a progress bar.
      on_worker_failure: ``"continue"`` (the others carry on) or ``"stop"``; SSGD always stops.
      on_nonfinite: a NaN/Inf push is ``"reject"``-ed (counted) or ``"stop"``-s the run.
      max_nonfinite: this many NaN/Inf pushes in a row stop the run (a diverged model; default: 10 per worker).
      slowdown: ``{worker: factor}`` makes those workers ``factor`` times slower (stragglers).
      timeout: seconds after which the run is stopped regardless.
      backend: ``"threads"`` (this machine's devices) or ``"ray"`` (actors on a Ray cluster).
      ray_address: the Ray cluster to join (``"auto"``: the one ``ray start`` made); default: a local instance.
      max_restarts: Ray: how often a dead worker actor is restarted before it is dropped.
      tensorboard: also write every record of ``metrics.jsonl`` to TensorBoard event files in ``<out>/tensorboard``
        (:mod:`asgd_jax.writers`; the optional extra ``asgd_jax[tensorboard]``).

    Example:
      >>> import asgd_jax
      >>> config = asgd_jax.TrainConfig(asgd_jax.Plan(4, num_updates=100), seed=1)
      >>> config.plan.workers, config.plan.n_sync
      (4, 1)
      >>> asgd_jax.TrainConfig(asgd_jax.Plan(4), seed=-1)
      Traceback (most recent call last):
      ...
      asgd_jax.errors.ConfigError: seed=-1 (--seed) is invalid: use an int >= 0.
    """

    plan: Plan = dataclasses.field(default_factory=lambda: Plan(4))
    seed: int = 0
    devices_per_worker: int = 1
    out: str | None = None
    resume: bool | str = False
    warm_start_steps: int = 0
    log_every: float = 1.0
    progress: bool = True
    on_worker_failure: str = "continue"
    on_nonfinite: str = "reject"
    max_nonfinite: int | None = None
    slowdown: Mapping[int, float] = dataclasses.field(default_factory=dict)
    timeout: float = 24 * 3600.0
    backend: str = "threads"
    ray_address: str | None = None
    max_restarts: int = 0
    tensorboard: bool = False

    def __post_init__(self):
        flag = lambda name: "--" + name.replace("_", "-")
        plan = self.plan
        errors.require(isinstance(plan, Plan), "plan", plan, "give an asgd_jax.Plan(workers, num_updates=...)")
        errors.require(
            isinstance(plan.delays, Workers | Ringmaster | Rennala | MSync),
            "plan.delays",
            plan.delays,
            "the trainer runs M real workers: give Plan(M) (its delays are measured, not drawn), or the optimal-time "
            "methods' Ringmaster(M, R, stops=), Rennala(M, S, stops=) or MSync(M, m)",
            "--workers",
        )
        errors.require(
            plan.time_budget is None,
            "plan.time_budget",
            plan.time_budget,
            "a virtual-time budget is the simulator's: the trainer's wall-clock budget is timeout= (--timeout)",
        )
        errors.int_at_least("devices_per_worker", self.devices_per_worker, 1, flag("devices_per_worker"))
        for name in ("seed", "warm_start_steps", "max_restarts"):
            errors.int_at_least(name, getattr(self, name), 0, flag(name))
        errors.require(self.seed < 2**32, "seed", self.seed, "use an int < 2**32 (a key's seed)", "--seed")
        if self.max_nonfinite is not None:
            errors.int_at_least("max_nonfinite", self.max_nonfinite, 1, flag("max_nonfinite"))
        for name, choices in (
            ("backend", BACKENDS),
            ("on_worker_failure", FAILURE_POLICIES),
            ("on_nonfinite", NONFINITE_POLICIES),
        ):
            errors.choice(name, getattr(self, name), choices, flag(name))
        errors.finite_number("log_every", self.log_every, positive=True, flag=flag("log_every"))
        errors.finite_number("timeout", self.timeout, positive=True, flag=flag("timeout"))
        errors.require(
            self.warm_start_steps < plan.num_updates,
            "warm_start_steps",
            self.warm_start_steps,
            f"use fewer than num_updates={plan.num_updates}",
            flag("warm_start_steps"),
        )
        errors.require(
            plan.batch_size % self.devices_per_worker == 0,
            "batch_size",
            plan.batch_size,
            f"use a multiple of devices_per_worker={self.devices_per_worker}",
            flag("batch_size"),
        )
        if self.out is None:
            errors.require(
                plan.checkpoint_every is None,
                "checkpoint_every",
                plan.checkpoint_every,
                "checkpoints need an output folder: pass out (--out) too",
                flag("checkpoint_every"),
            )
            errors.require(not self.resume, "resume", self.resume, "a resume needs out (--out)", flag("resume"))
        errors.require(self.resume in (True, False, "auto"), "resume", self.resume, "use True, False or 'auto'")
        errors.require(isinstance(self.progress, bool), "progress", self.progress, "use True or False", "--progress")
        errors.require(
            isinstance(self.tensorboard, bool) and (self.out is not None or not self.tensorboard),
            "tensorboard",
            self.tensorboard,
            "use True or False; event files need an output folder (--out)",
            "--tensorboard",
        )
        errors.require(
            self.ray_address is None or isinstance(self.ray_address, str),
            "ray_address",
            self.ray_address,
            "give a Ray address such as 'auto' or 'host:6379', or None for a local instance",
            "--ray-address",
        )
        self._check_slowdown_and_out(plan)

    def _check_slowdown_and_out(self, plan: Plan) -> None:
        """The stragglers (``{worker: factor}``) and the output folder, in the forms the rest of the run reads."""
        errors.require(
            self.slowdown is None or isinstance(self.slowdown, Mapping),
            "slowdown",
            self.slowdown,
            f"give {{worker in [0, {plan.workers}): factor >= 1}}",
            "--slowdown W:F",
        )
        slowdown = dict(self.slowdown or {})
        for w, factor in slowdown.items():
            ok = isinstance(w, int) and 0 <= w < plan.workers and isinstance(factor, int | float) and factor >= 1
            errors.require(
                ok, "slowdown", slowdown, f"use {{worker in [0, {plan.workers}): factor >= 1}}", "--slowdown W:F"
            )
        object.__setattr__(self, "slowdown", slowdown)
        if self.out is not None:
            ok = isinstance(self.out, str | os.PathLike) and os.fspath(self.out) != ""
            errors.require(ok, "out", self.out, "give a folder path", "--out")
            object.__setattr__(self, "out", os.fspath(self.out))

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def key(self) -> jax.Array:
        """The run's key, ``jax.random.key(seed)`` (made on the default device, deliberately)."""
        with jax.transfer_guard("allow"):
            return jax.random.key(self.seed)

    def stop_stale(self) -> int | None:
        """The staleness at which a worker's computation in progress is stopped and restarted at the current weights:
        Ringmaster's R with stops; 1 for m-Synchronous and Rennala with stops (a round's end stops every
        computation of it); None (never) otherwise."""
        d = self.plan.delays
        if isinstance(d, Ringmaster):
            return d.threshold if d.stops else None
        return 1 if isinstance(d, MSync) or (isinstance(d, Rennala) and d.stops) else None

    def checkpoint_interval(self) -> int | None:
        """Updates between checkpoints: ``plan.checkpoint_every``, or a tenth of the run with an output folder."""
        if self.out is None:
            return None
        return self.plan.checkpoint_every or max(1, self.plan.num_updates // 10)

    def eval_interval(self) -> int:
        """Updates between evaluations: ``plan.eval_every``, or a tenth of the run."""
        return self.plan.eval_every or max(1, self.plan.num_updates // 10)


@dataclasses.dataclass
class WorkerStats:
    """Where one worker's time went (seconds, this session), the same on every backend.

    Attributes:
      pushes: payloads it sent.
      compute: its exchange period on its devices, the transfers around it included (a straggler's extra time too).
      data: waiting for minibatches.
      exchange: waiting for the store's answer (push applied, fresh weights back) or, in SSGD, for the round.
      total: its whole loop (the three above).
      losses: the training loss of each push.
      stopped: computations stopped as too stale (Ringmaster with stops); their time is in ``compute`` and
        ``wasted``.
      wasted: the seconds of the stopped computations.
    """

    pushes: int = 0
    compute: float = 0.0
    data: float = 0.0
    exchange: float = 0.0
    total: float = 0.0
    losses: list[float] = dataclasses.field(default_factory=list)
    stopped: int = 0
    wasted: float = 0.0

    def add(self, *, data: float, compute: float, exchange: float, loss: float) -> None:
        """One push: its times and its loss."""
        self.pushes += 1
        self.data, self.compute, self.exchange = self.data + data, self.compute + compute, self.exchange + exchange
        self.total += data + compute + exchange
        self.losses.append(loss)

    def merged(self, other: WorkerStats | None) -> WorkerStats:
        """These stats and ``other``'s (a worker restarted within a session), summed."""
        if other is None:
            return self
        return WorkerStats(
            self.pushes + other.pushes,
            self.compute + other.compute,
            self.data + other.data,
            self.exchange + other.exchange,
            self.total + other.total,
            self.losses + other.losses,
            self.stopped + other.stopped,
            self.wasted + other.wasted,
        )

    def stop(self, seconds: float) -> None:
        """One computation stopped after ``seconds``."""
        self.stopped += 1
        self.wasted += seconds
        self.compute += seconds
        self.total += seconds

    @property
    def overhead(self) -> float:
        """Fraction of the worker's time spent outside its exchange period's computation."""
        return 1.0 - self.compute / self.total if self.total > 0 else 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`asgd_jax.trainer.train` returns.

    Attributes:
      params, model_state: the store's final weights and model state.
      pushes_sent: pushes the workers sent (over all sessions of a resumed run); ``pushes_applied + pushes_rejected +
        pushes_ignored`` always equals it.
      pushes_applied, pushes_rejected: the store's counts.
      pushes_ignored: pushes a Ringmaster run ignored as ``R`` or more updates stale (0 otherwise).
      pushes_late: of the rejected, those that merely arrived after the budget was reached (in flight at the end).
      failures: ``{worker: "ExceptionType: message"}`` for workers that died.
      trace_path, checkpoint_path, metrics_path: files in the output folder (``None`` without one).
      seconds: wall time of the run phase (this session).
      losses: per worker, the training losses of its pushes (this session).
      workers: per worker, where its time went (:class:`WorkerStats`).
      evals: the evaluations, ``{"update": t, "time": s, **eval_fn(...)}`` in update order.
      resumed_from: the update the run resumed at (0 for a fresh run).
      staleness_counts: ``{staleness: applied pushes}`` over the whole run.
      ended: ``"finished"`` (the budget was reached), ``"timeout"`` (``timeout`` cut it short: ``resume`` continues),
        or ``"workers failed"`` (every worker died).
    """

    params: Any
    model_state: Any
    pushes_sent: int
    pushes_applied: int
    pushes_rejected: int
    pushes_late: int
    failures: dict[int, str]
    trace_path: str | None
    checkpoint_path: str | None
    metrics_path: str | None
    seconds: float
    losses: dict[int, list[float]]
    workers: list[WorkerStats]
    evals: list[dict[str, float]]
    resumed_from: int
    staleness_counts: dict[int, int]
    ended: str = "finished"
    pushes_ignored: int = 0


# --------------------------------------------------------------------------------------------------------------------
# Devices and data.
# --------------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------------
# metrics.jsonl and the evaluator.
# --------------------------------------------------------------------------------------------------------------------


class MetricsLog:
    """``metrics.jsonl``: a record per log period (rates since the previous record), evaluation records, a final
    record. Without an output folder the records are computed and dropped."""

    def __init__(self, num_workers: int, mode: str = "async", sinks: tuple[Callable[[dict], Any], ...] = ()):
        self.num_workers, self.mode, self.sinks = num_workers, mode, tuple(sinks)
        self._file = None
        self._lock = threading.Lock()
        self._last: tuple = (time.perf_counter(), 0, [0] * num_workers, {})
        self.error: BaseException | None = None

    def open(self, out_dir: str | None, status: Any) -> None:
        """Starts the file (appends on a resume) and the counts the first record's rates are taken from (the store's
        :class:`~asgd_jax.store.StoreStatus` at the start)."""
        if out_dir is not None:
            mode = "a" if status.resumed_from else "w"
            self._file = open(os.path.join(out_dir, METRICS), mode)  # noqa: SIM115 (close())
        self._last = (time.perf_counter(), status.applied, self._pushes(status), dict(status.staleness_counts))

    def _pushes(self, status: Any) -> list[int]:
        """Each worker's pushes so far: its data position (in SSGD, every worker's is the rounds')."""
        return list(status.positions) if self.mode == "async" else [status.positions[0]] * self.num_workers

    def restart_clock(self, start: float) -> None:
        self._last = (start, *self._last[1:])

    def record(self, status: Any, elapsed: float, new_losses: list[float], final: bool = False) -> dict[str, Any]:
        """The record of what happened since the previous one, from the store's status now (its per-worker
        positions count the pushes)."""
        now = time.perf_counter()
        t_prev, applied_prev, pushes_prev, stale_prev = self._last
        applied, rejected, pushes = status.applied, status.rejected, self._pushes(status)
        counts = dict(status.staleness_counts)
        dt = max(now - t_prev, 1e-9)
        record = {
            "kind": "final" if final else "train",
            "update": applied,
            "time": elapsed,
            "loss": float(np.mean(new_losses)) if new_losses else None,
            "applied": applied,
            "rejected": rejected,
            "updates_per_second": (applied - applied_prev) / dt,
            "worker_pushes_per_second": [(a - b) / dt for a, b in zip(pushes, pushes_prev, strict=True)],
            "staleness_histogram": {
                str(k): v - stale_prev.get(k, 0) for k, v in sorted(counts.items()) if v - stale_prev.get(k, 0)
            },
        }
        self._last = (now, applied, list(pushes), counts)
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Appends a record and hands it to every sink (TensorBoard, a callback); a failing write (a full disk) or a
        sink that raises is kept in ``error`` for the run to stop on."""
        with self._lock:
            if self.error is not None or (self._file is not None and self._file.closed):
                return
            try:
                if self._file is not None:
                    self._file.write(json.dumps(record) + "\n")
                    self._file.flush()
                for sink in self.sinks:
                    sink(record)
            except Exception as e:  # a sink's own error, reported as the run's
                self.error = e if isinstance(e, OSError) else OSError(f"a metrics sink failed: {type(e).__name__}: {e}")

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                if callable(getattr(sink, "close", None)):
                    sink.close()
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as e:  # the last flush of a full disk
                    self.error = self.error or e


class Evaluator:
    """Evaluates snapshots of the server's weights on its own device and thread, in the order they were taken."""

    def __init__(self, eval_fn: Callable, device: jax.Device, write: Callable[[dict], None]):
        self.fn, self.device, self.write = jax.jit(eval_fn), device, write
        self.history: list[dict[str, float]] = []
        self._queue: queue.Queue = queue.Queue()
        self._t0 = time.perf_counter()
        self._thread: threading.Thread | None = None

    def warm_up(self, params, model_state) -> None:
        jax.block_until_ready(self.fn(*jax.device_put((params, model_state), self.device)))

    def submit(self, snapshot: Any) -> None:
        """Queues a :class:`~asgd_jax.store.Snapshot` of the weights for evaluation."""
        self._submit(*snapshot)

    def _submit(self, version: int, params, model_state) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True, name="evaluator")
            self._thread.start()
        self._queue.put((version, params, model_state))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            version, params, model_state = item
            try:
                out = jax.device_get(self.fn(*jax.device_put((params, model_state), self.device)))
            except Exception as e:  # an evaluation must never take training down
                log.error("evaluation at update %d failed: %r", version, e)
                continue
            record = {
                "update": version,
                "time": time.perf_counter() - self._t0,
                **{k: float(v) for k, v in out.items()},
            }
            self.history.append(record)
            self.write({"kind": "eval", **record})

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def final(self, version: int, params, model_state) -> list[dict[str, float]]:
        """Evaluates the final weights unless the last evaluation was of them; returns every evaluation."""
        self.close()
        if not self.history or self.history[-1]["update"] != version:
            self._submit(version, params, model_state)
            self.close()
        return self.history


# --------------------------------------------------------------------------------------------------------------------
# The wind-down.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What a backend knows when its workers have stopped: the store's final state and counts, and how it ended."""

    params: Any
    model_state: Any
    status: Any  # the store's final StoreStatus
    failures: dict[int, str]
    seconds: float
    workers: list[WorkerStats]
    interrupted: bool = False
    timed_out: bool = False


def finish(
    outcome: Outcome,
    *,
    out_dir: str | None,
    metrics: MetricsLog,
    evaluator: Evaluator | None,
    final_record: Callable[[], dict[str, Any]],
) -> TrainResult:
    """Ends a session the same way on every backend: the final evaluation, ``model.npz``, the final metrics record
    and ``summary.json`` (when the weights are finite), then the result or the exception that says why the run
    stopped (Ctrl-C, the store's error)."""
    s = outcome.status
    evals = [] if evaluator is None else evaluator.final(s.applied, outcome.params, outcome.model_state)
    paths: dict[str, str] = {}
    if out_dir is not None:
        paths = {
            k: os.path.join(out_dir, f) for k, f in (("trace", TRACE), ("checkpoint", CHECKPOINT), ("metrics", METRICS))
        }
        if all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(outcome.params)):
            checkpoint.save_model(os.path.join(out_dir, MODEL), outcome.params, outcome.model_state)
        metrics.write(final_record())
    metrics.close()
    result = TrainResult(
        params=outcome.params,
        model_state=outcome.model_state,
        pushes_sent=s.received,
        pushes_applied=s.applied,
        pushes_rejected=s.rejected,
        pushes_late=s.late,
        failures=outcome.failures,
        trace_path=paths.get("trace"),
        checkpoint_path=paths.get("checkpoint"),
        metrics_path=paths.get("metrics"),
        seconds=outcome.seconds,
        losses={w: stats.losses for w, stats in enumerate(outcome.workers)},
        workers=outcome.workers,
        evals=evals,
        resumed_from=s.resumed_from,
        staleness_counts=dict(sorted(s.staleness_counts.items())),
        ended=_ended(outcome),
        pushes_ignored=s.ignored,
    )
    if outcome.timed_out:
        log.warning("stopped by the timeout at update %d (resume continues)", s.applied)
    if out_dir is not None:
        _write_summary(out_dir, result, outcome)
    if outcome.interrupted:
        raise KeyboardInterrupt(f"training interrupted at update {s.applied}; resume=True continues")
    if s.error is not None:
        raise errors.RunStopped(f"training stopped at update {s.applied}: {s.error}")
    return result


def _ended(outcome: Outcome) -> str:
    if outcome.interrupted:
        return "interrupted"
    if outcome.status.error is not None:
        return "stopped"
    if outcome.timed_out:
        return "timeout"
    if outcome.failures and len(outcome.failures) == len(outcome.workers):
        return "workers failed"
    return "finished"


def _store_times(status: Any, seconds: float) -> dict[str, float]:
    times = status.times._asdict()
    return {**times, "busy": (times["exchange"] + times["bookkeeping"]) / max(seconds, 1e-9)}


def _write_summary(out_dir: str, result: TrainResult, outcome: Outcome) -> None:
    """``summary.json``: the run's outcome in one file (counts, the last evaluation, how it ended)."""
    session_updates = result.pushes_applied - result.resumed_from
    summary = {
        "ended": _ended(outcome),
        "error": outcome.status.error,
        "evals": result.evals,
        "test_error": result.evals[-1].get("error") if result.evals else None,
        "pushes_sent": result.pushes_sent,
        "pushes_applied": result.pushes_applied,
        "pushes_rejected": result.pushes_rejected,
        "pushes_late": result.pushes_late,
        "pushes_ignored": result.pushes_ignored,
        "failures": result.failures,
        "resumed_from": result.resumed_from,
        "seconds": result.seconds,
        "updates_per_second": session_updates / max(result.seconds, 1e-9),
        "worker_overhead": [w.overhead for w in result.workers],
        # Where each worker's time went, in seconds (the same on every backend: see WorkerStats).
        "workers": [
            {k: getattr(w, k) for k in ("pushes", "data", "compute", "exchange", "total", "stopped", "wasted")}
            for w in result.workers
        ],
        "staleness_counts": result.staleness_counts,
        # Where the store's time went, in seconds (see asgd_jax.store.StoreTimes); "busy": its share of the run.
        "store": _store_times(outcome.status, result.seconds),
    }
    try:
        with open(os.path.join(out_dir, SUMMARY), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    except OSError as e:
        log.error("could not write %s: %r", os.path.join(out_dir, SUMMARY), e)
