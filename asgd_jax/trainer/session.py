"""What both trainer backends share: a worker's devices, the metrics log, the evaluator, the result, the wind-down.

The threaded backend (:mod:`asgd_jax.trainer.threads`) and the Ray backend (:mod:`asgd_jax.trainer.ray_backend`) each
import this module and never each other; :func:`asgd_jax.trainer.train` picks one. A session ends the same way on either
(:func:`finish`): a final evaluation of the store's weights, ``model.npz``, the final record of ``metrics.jsonl`` and
``summary.json``, then the result, or the exception that says why the run stopped.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

import jax
import numpy as np

from asgd_jax import cache, checkpoint, errors, exchange, provenance, trace, writers
from asgd_jax.trainer.messages import Snapshot, StoreStatus, WorkerStats

__all__ = [
    "Evaluator",
    "MetricsLog",
    "Outcome",
    "RunLock",
    "TrainResult",
    "finish",
]

log = logging.getLogger("asgd_jax.trainer.session")

MODEL = "model.npz"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TRACE = trace.FILE
CHECKPOINT = "checkpoint.npz"
LOCK = ".lock"
RESUME_ADVICE = "resume=True continues"  # (the end of an interrupted run's KeyboardInterrupt: the CLI says it its way)


class RunLock:
    """A run folder is owned by one process at a time: an exclusive ``flock`` on ``<out>/.lock`` for the run's length.

    Entering makes the folder (it must be one that can be written) and takes the lock, or raises a
    :class:`~asgd_jax.errors.ConfigError` naming the process that holds it. The operating system drops the lock when
    that process ends, however it ends (``kill -9`` included), so a dead run never blocks its resume.

    Example:
      >>> import tempfile
      >>> from asgd_jax.trainer.session import RunLock
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
        self._file: IO[str] | None = None

    def __enter__(self) -> RunLock:
        import fcntl

        out = errors.output_folder("out", self.out, "--out")
        try:
            f = open(os.path.join(out, LOCK), "a+")  # held until __exit__
        except OSError as e:  # (no inode left, a quota)
            raise errors.RunStopped(
                f"{errors.write_failure(e)}: {os.path.join(out, LOCK)} could not be made, and the run did not start"
            ) from e
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
        try:  # who holds it, for another run's message (unbuffered: a full disk leaves it unsaid, the lock held)
            os.ftruncate(f.fileno(), 0)
            os.pwrite(f.fileno(), str(os.getpid()).encode(), 0)
        except OSError:
            pass
        self._file = f
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # closing the file drops the lock
            self._file = None


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
      evals: the evaluations, ``{"update": t, "time": s, **eval_fn(...)}`` in update order; ``time`` is when the
        store took the weights after update ``t``, in seconds on the clock of the ``train`` records of
        ``metrics.jsonl`` (from the session's start, a resumed one's going on from the records it kept), not when the
        evaluation, which runs beside the training, finished.
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

    @property
    def updates_per_second(self) -> float:
        """This session's updates per second of its run phase (``summary.json``'s ``updates_per_second``)."""
        return (self.pushes_applied - self.resumed_from) / max(self.seconds, 1e-9)


# --------------------------------------------------------------------------------------------------------------------
# metrics.jsonl and the evaluator.
# --------------------------------------------------------------------------------------------------------------------


class MetricsLog:
    """``metrics.jsonl``: a record per log period (rates since the previous record), evaluation records, a final
    record. Without an output folder the records are computed and dropped."""

    def __init__(self, num_workers: int, mode: str = "async", sinks: tuple[Callable[[dict], Any], ...] = ()):
        self.num_workers, self.mode, self.sinks = num_workers, mode, tuple(sinks)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._last: tuple = (time.perf_counter(), 0, [0] * num_workers, {})
        self.error: BaseException | None = None
        self.earlier = 0.0  # a resumed run's seconds before this session: the records' clock goes on from there

    def open(self, out_dir: str | None, status: StoreStatus) -> None:
        """Starts the file and the counts the first record's rates are taken from (the store's
        :class:`~asgd_jax.trainer.messages.StoreStatus` at the start). A resume keeps the whole records of the updates
        its checkpoint holds (those of work the checkpoint lost, and a line a kill or a full disk cut short, go, as
        the trace's), and its records' times go on from the last kept one's."""
        counts = dict(status.staleness_counts)
        if out_dir is not None:
            path = os.path.join(out_dir, METRICS)
            kept = _records_up_to(path, status.applied) if status.resumed_from else []
            try:
                if kept:
                    checkpoint.write_json_lines(path, kept)
                self._file = open(path, "a" if kept else "w")  # noqa: SIM115 (close())
                for sink in self.sinks if status.resumed_from else ():  # TensorBoard hides the lost updates' events
                    if isinstance(sink, writers.TensorBoard):
                        sink.resume(status.applied)
            except OSError as e:
                raise errors.RunStopped(
                    f"{errors.write_failure(e)}: {path} could not be written, and the session did not start; free "
                    "some space and start it again (its checkpoint and metrics are as they were)"
                ) from e
            times = [r["time"] for r in kept if isinstance(r.get("time"), int | float) and math.isfinite(r["time"])]
            self.earlier = max(times, default=0.0)
            # The kept records' histograms are the baseline: the pushes between the last of them and the checkpoint
            # (whose own record went with the work the checkpoint lost) are counted in the first new record.
            if kept:
                counts = collections.Counter()
                for r in kept:
                    if r.get("kind") != "eval" and isinstance(r.get("staleness_histogram"), dict):
                        counts.update({int(k): int(v) for k, v in r["staleness_histogram"].items()})
                counts = dict(counts)
        self._last = (time.perf_counter(), status.applied, self._pushes(status), counts)

    def _pushes(self, status: StoreStatus) -> list[int]:
        """Each worker's pushes so far: its data position (in SSGD, every worker's is the rounds')."""
        return list(status.positions) if self.mode == "async" else [status.positions[0]] * self.num_workers

    def restart_clock(self, start: float) -> None:
        self._last = (start, *self._last[1:])

    def record(
        self, status: StoreStatus, elapsed: float, new_losses: list[float], final: bool = False
    ) -> dict[str, Any]:
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
            "time": self.earlier + elapsed,
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
                close = getattr(sink, "close", None)
                if callable(close):
                    close()
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as e:  # the last flush of a full disk
                    self.error = self.error or e


def _records_up_to(path: str, applied: int) -> list[dict[str, Any]]:
    """The whole records of ``metrics.jsonl`` at ``path`` of updates up to ``applied`` (a resume's checkpoint); none
    when there is no file."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            record = None  # (a line cut short, then written past by an older resume)
        if isinstance(record, dict) and isinstance(record.get("update"), int) and record["update"] <= applied:
            kept.append(record)
    return kept


_EVALUATIONS = cache.Kept(8)  # an evaluation's program, per eval_fn: compiled once a process


class Evaluator:
    """Evaluates snapshots of the server's weights on its own device and thread, in the order they were taken."""

    def __init__(self, eval_fn: Callable, device: jax.Device, write: Callable[[dict], None]):
        # An evaluation that carries its held-out split hands it over as an argument (asgd_jax.exchange.eval_parts):
        # its program, kept per eval_fn, is then the same for another split of the same shapes, never a constant.
        evaluate, data = exchange.eval_parts(eval_fn)
        self.fn = _EVALUATIONS.get(eval_fn, lambda: jax.jit(evaluate))
        self.data = jax.device_put(data, device)
        self.device, self.write = device, write
        self.history: list[dict[str, float]] = []
        self._queue: queue.Queue = queue.Queue()
        self._start, self._floor = time.time(), 0.0  # the run phase's clock (start_clock): evaluations' times
        self._thread: threading.Thread | None = None

    def start_clock(self, start: float, floor: float = 0.0) -> None:
        """The run phase's clock reads 0 at ``start`` (``time.time()``; a resumed session's, ``floor`` there): an
        evaluation's ``time`` is when its snapshot was taken on it, the clock of the ``train`` records (not when
        the evaluation finished), never below ``floor``."""
        self._start, self._floor = start, floor

    def warm_up(self, params, model_state) -> None:
        jax.block_until_ready(self.fn(*jax.device_put((params, model_state), self.device), self.data))

    def submit(self, snapshot: Snapshot) -> None:
        """Queues a :class:`~asgd_jax.trainer.messages.Snapshot` of the weights for evaluation."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True, name="evaluator")
            self._thread.start()
        self._queue.put(snapshot)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            version, params, model_state, taken = item
            try:
                out = jax.device_get(self.fn(*jax.device_put((params, model_state), self.device), self.data))
            except Exception as e:  # an evaluation must never take training down
                log.error("evaluation at update %d failed: %r", version, e)
                continue
            record = {
                "update": version,
                "time": max(self._floor, taken - self._start),  # (a push applied as the driver's clock started)
                **{k: float(v) for k, v in out.items()},
            }
            self.history.append(record)
            self.write({"kind": "eval", **record})

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def final(self, version: int, params, model_state, taken: float | None = None) -> list[dict[str, float]]:
        """Evaluates the final weights (had since ``taken``, a ``time.time()``; default now) unless the last
        evaluation was of them; returns every evaluation."""
        self.close()
        if not self.history or self.history[-1]["update"] != version:
            self.submit(Snapshot(version, params, model_state, taken=time.time() if taken is None else taken))
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
    status: StoreStatus  # the store's final one
    failures: dict[int, str]
    seconds: float
    workers: list[WorkerStats]
    interrupted: bool = False
    timed_out: bool = False
    ended: float | None = None  # time.time() when the run phase ended (before the wind-down): the final weights' time


def finish(
    outcome: Outcome,
    *,
    out_dir: str | None,
    metrics: MetricsLog,
    evaluator: Evaluator | None,
    final_record: Callable[[], dict[str, Any]],
    args: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Ends a session the same way on every backend: the final evaluation, ``model.npz``, the final metrics record
    and ``summary.json`` (when the weights are finite; with ``args``, what asked for the run), then the result or the
    exception that says why the run stopped (Ctrl-C, the store's error)."""
    s = outcome.status
    evals = [] if evaluator is None else evaluator.final(s.applied, outcome.params, outcome.model_state, outcome.ended)
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
        losses={w: [float(x) for x in stats.losses] for w, stats in enumerate(outcome.workers)},
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
        _write_summary(out_dir, result, outcome, args)
    if outcome.interrupted:
        raise KeyboardInterrupt(f"training interrupted at update {s.applied}; {RESUME_ADVICE}")
    if s.error is not None:
        raise errors.RunStopped(f"training stopped at update {s.applied}: {s.error}")
    if metrics.error is not None:  # a sink that failed on the last records (the final evaluations): said, not lost
        raise errors.RunStopped(f"training ended at update {s.applied}, but {metrics.error}")
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


def _store_times(status: StoreStatus, seconds: float) -> dict[str, float]:
    times = status.times._asdict()
    return {**times, "busy": (times["exchange"] + times["bookkeeping"]) / max(seconds, 1e-9)}


def _write_summary(out_dir: str, result: TrainResult, outcome: Outcome, args: Mapping[str, Any] | None) -> None:
    """``summary.json``: the run's outcome in one file (counts, the last evaluation, how it ended)."""
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
        "updates_per_second": result.updates_per_second,
        "worker_overhead": [w.overhead for w in result.workers],
        # Where each worker's time went, in seconds (the same on every backend: see WorkerStats).
        "workers": [
            {k: getattr(w, k) for k in ("pushes", "data", "compute", "exchange", "total", "stopped", "wasted")}
            for w in result.workers
        ],
        "staleness_counts": result.staleness_counts,
        # Where the store's time went, in seconds (see asgd_jax.trainer.messages.StoreTimes); "busy": its share of the
        # run.
        "store": _store_times(outcome.status, result.seconds),
    }
    try:
        summary["environment"] = provenance.environment()  # what produced it
    except Exception as e:  # (never the summary's loss, nor the error it reports)
        log.warning("could not record the environment in %s: %r", SUMMARY, e)
    if args is not None:  # (TrainConfig.args: what asked for the run)
        summary["args"] = dict(args)
    try:  # atomically: a crash or a full disk leaves no half-written summary
        checkpoint.write_json(os.path.join(out_dir, SUMMARY), summary)
    except OSError as e:
        log.error("could not write %s: %r", os.path.join(out_dir, SUMMARY), e)
