"""One driver for every trainer backend: the monitor loop, the metrics log, evaluations, the deadline, Ctrl-C.

A backend starts a store and M workers on its substrate (threads of this process, actors on a Ray cluster) and offers
them through :class:`Backend`; :func:`drive` does the rest, the same everywhere: it polls the store
(:class:`~asgd_jax.trainer.messages.Progress`), writes ``metrics.jsonl`` and the progress bar every ``log_every``
seconds, hands snapshots of the weights to the evaluator, applies the failure policy when a worker dies (restart it
where the substrate can, go on, or end the run), stops at the deadline, and on Ctrl-C or any way out closes the store
(its final checkpoint) before :func:`asgd_jax.trainer.session.finish` writes the rest.

Example (what a backend looks like to the driver)::

    class Backend(Protocol):
        def poll(self) -> Progress | None: ...
        def wait(self, timeout: float) -> list[Finished]: ...
        def restart(self, worker: int) -> bool: ...
        def end(self, why: str) -> None: ...
        def fail(self, why: str) -> None: ...
        def close(self) -> tuple[Progress, params, model_state]: ...
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax

from asgd_jax import interrupts
from asgd_jax.trainer import session
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.messages import Finished, Progress, StoreStatus, WorkerStats

__all__ = ["GOODBYE", "Backend", "drive", "logs"]

log = logging.getLogger("asgd_jax.trainer.driver")

GOODBYE = 10.0
"""Seconds a backend gives its workers to end once the run is over (their next push is answered "closed"; a straggler
asleep is woken): a worker still computing after that is left behind, its time uncounted."""


class Backend(Protocol):
    """A store and M workers started on some substrate, as the driver sees them."""

    def poll(self) -> Progress | None:
        """The store's :class:`~asgd_jax.trainer.messages.Progress` (``None`` while it cannot answer, e.g.
        restarting)."""

    def wait(self, timeout: float) -> list[Finished]:
        """Waits up to ``timeout`` seconds for workers to end; the ones that did since the last call."""

    def restart(self, worker: int) -> bool:
        """Restarts a failed worker where the substrate can (it re-syncs from the store); whether it did."""

    def end(self, why: str) -> None:
        """Ends the run without an error: the store closes, the workers' next push is answered ``"closed"``."""

    def fail(self, why: str) -> None:
        """Stops the run with an error (kept in the store's status)."""

    def close(self) -> tuple[Progress, Any, Any]:
        """Closes the store (its final checkpoint), ends the workers; the last progress and the final weights."""


def logs(
    config: TrainConfig,
    eval_fn: Callable | None,
    eval_device: jax.Device | None,
    on_metrics: Callable[[dict], Any] | None = None,
) -> tuple[session.MetricsLog, session.Evaluator | None]:
    """A session's ``metrics.jsonl`` with its sinks (TensorBoard event files, ``on_metrics``) and its evaluator (on
    ``eval_device``, writing to the same log; none without an ``eval_fn``)."""
    sinks: list[Callable[[dict], Any]] = []
    if config.tensorboard and config.out is not None:
        from asgd_jax import writers

        sinks.append(writers.TensorBoard(os.path.join(config.out, writers.FOLDER)))
    if on_metrics is not None:
        sinks.append(on_metrics)
    metrics = session.MetricsLog(config.plan.workers, config.plan.mode, tuple(sinks))
    evaluator = None if eval_fn is None else session.Evaluator(eval_fn, eval_device, metrics.write)
    return metrics, evaluator


def drive(
    backend: Backend,
    config: TrainConfig,
    metrics: session.MetricsLog,
    evaluator: session.Evaluator | None,
    status: StoreStatus,
) -> session.TrainResult:
    """Runs a started session to its end (the workers done, the deadline, Ctrl-C) and finishes it.

    Args:
      backend: the store and workers, started (compiled, warmed up): the clock starts now.
      config: the run's settings.
      metrics: its ``metrics.jsonl`` (opened).
      evaluator: evaluates snapshots of the weights, or ``None``.
      status: the store's :class:`~asgd_jax.trainer.messages.StoreStatus` at the start.
    """
    from tqdm.auto import tqdm

    c, workers = config, config.plan.workers
    start = time.perf_counter()
    metrics.restart_clock(start)
    if evaluator is not None:
        evaluator.start_clock(time.time() - metrics.earlier, floor=metrics.earlier)  # (the records' clock)
    run = _Run(backend, c, metrics, evaluator, status, start)
    bar = tqdm(
        total=c.plan.num_updates,
        initial=status.applied,
        disable=not c.progress,
        unit="update",
        desc=f"{c.plan.mode} x{workers}{' (ray)' if c.backend == 'ray' else ''}",
        dynamic_ncols=True,
    )
    interrupted = timed_out = False
    try:
        timed_out = run.loop(bar)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopping the workers and writing a final checkpoint")
    finally:
        # The run phase's end: the final weights' time (the wind-down then waits for the workers' goodbyes; a push
        # in flight at a timeout or Ctrl-C may still be applied in it).
        ended = time.time()
        try:
            progress, params, model_state = backend.close()
            run.take(progress)
            for finished in backend.wait(0.0):  # the workers that said goodbye as the store closed
                run.ended(finished, set(), closing=True)
        finally:
            bar.close()
    seconds = time.perf_counter() - start
    outcome = session.Outcome(
        params=params,
        model_state=model_state,
        status=run.status,
        failures=run.failures,
        seconds=seconds,
        workers=[run.stats.get(w) or WorkerStats() for w in range(workers)],
        interrupted=interrupted,
        timed_out=timed_out,
        ended=ended,
    )
    return session.finish(
        outcome,
        out_dir=c.out,
        metrics=metrics,
        evaluator=evaluator,
        final_record=lambda: run.record(final=True),
        args=c.args,
    )


class _Run:
    """What the driver keeps while a session runs: the latest status, new losses, each worker's stats and failure."""

    def __init__(
        self,
        backend: Backend,
        config: TrainConfig,
        metrics: session.MetricsLog,
        evaluator: session.Evaluator | None,
        status: StoreStatus,
        start: float,
    ):
        self.backend, self.c, self.metrics, self.evaluator = backend, config, metrics, evaluator
        self.status, self.start = status, start
        self.losses: list[float] = []
        self.stats: dict[int, WorkerStats] = {}
        self.failures: dict[int, str] = {}
        self.restarts: dict[int, int] = {}

    def take(self, progress: Progress | None) -> None:
        """A poll of the store: its status, the losses since the last poll, snapshots for the evaluator."""
        if progress is None:  # the store cannot answer now (a Ray store restarting from its checkpoint)
            return
        self.status = progress.status
        self.losses.extend(progress.losses)
        if self.evaluator is not None:
            for snapshot in progress.snapshots:
                self.evaluator.submit(snapshot)

    def record(self, final: bool = False) -> dict[str, Any]:
        record = self.metrics.record(self.status, time.perf_counter() - self.start, self.losses, final=final)
        self.losses = []
        return record

    def ended(self, finished: Finished, running: set[int], closing: bool = False) -> None:
        """A worker ended: its stats kept, or its failure handled by the policy (restart, go on, or end the run;
        nothing more once the run is ``closing``)."""
        w, c = finished.worker, self.c
        if finished.error is None:
            stats = finished.stats if finished.stats is not None else WorkerStats()  # (a worker always sends them)
            self.stats[w] = stats.merged(self.stats.get(w))
            running.discard(w)
            return
        self.failures[w] = finished.error
        log.error("worker %d failed: %s", w, finished.error)
        if closing:
            return
        restarts = self.restarts.get(w, 0)
        if c.on_worker_failure != "stop" and restarts < c.max_restarts and self.backend.restart(w):
            self.restarts[w] = restarts + 1  # it re-syncs from the store; in SSGD it rejoins its round
            log.warning("worker %d restarted (%d of %d)", w, restarts + 1, c.max_restarts)
            return
        running.discard(w)
        if c.on_worker_failure == "stop" or c.plan.mode == "sync":  # rounds cannot go on without every worker
            self.backend.end(f"worker {w} failed: {finished.error}")

    def loop(self, bar) -> bool:
        """Until every worker has ended: poll, log, evaluate; True when the deadline stopped it."""
        c = self.c
        running = set(range(c.plan.workers))
        deadline, next_log = self.start + c.timeout, self.start + c.log_every
        while running:
            interrupts.check()  # a Ctrl-C something swallowed (while compiling) still stops the run
            if time.perf_counter() >= deadline:
                return True
            for finished in self.backend.wait(min(0.25, c.log_every)):
                self.ended(finished, running)
            self.take(self.backend.poll())
            if self.status.closed:  # the budget is reached, or the store stopped: the rest is goodbye
                break
            if time.perf_counter() >= next_log:
                next_log += c.log_every
                record = self.record()
                self.metrics.write(record)
                if self.metrics.error is not None:  # a full disk: stop now, the checkpoint is still good
                    self.backend.fail(f"writing metrics.jsonl failed: {self.metrics.error}")
                bar.update(self.status.applied - bar.n)
                if record["loss"] is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        bar.update(self.status.applied - bar.n)
        return False
