"""The threaded trainer backend: a store and M worker threads in this process, one device group each.

What it adds to the shared pieces (:class:`asgd_jax.trainer.worker.Worker`'s loop,
:func:`asgd_jax.trainer.driver.drive`) is only how to start them here: the store
(:func:`asgd_jax.trainer.endpoint.for_run`) with its :class:`~asgd_jax.trainer.endpoint.Endpoint` as every worker's
link, worker w on device group ``w mod #groups``, everything compiled before the clock starts (compilation holds the
GIL), then one thread per worker.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

from asgd_jax import exchange, packing
from asgd_jax import loss as loss_lib
from asgd_jax.trainer import driver, session
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.endpoint import Endpoint, for_run
from asgd_jax.trainer.messages import Finished, Progress, WorkerStats
from asgd_jax.trainer.worker import Worker, WorkerSetup, device_groups

__all__ = ["run"]

log = logging.getLogger("asgd_jax.trainer.threads")


def run(
    loss: loss_lib.Loss,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    config: TrainConfig,
    *,
    ex: exchange.Exchange,
    model_state: Any,
    eval_fn: Callable | None,
    devices: list[jax.Device],
    eval_device: jax.Device | None,
    header: dict[str, Any],
    on_metrics: Callable[[dict], Any] | None = None,
    assignment: Any = None,
) -> session.TrainResult:
    """One session of the threaded backend (the arguments are validated by :func:`asgd_jax.trainer.train`)."""
    m = config.plan.workers
    groups = device_groups(devices, config.devices_per_worker)
    spare = [d for d in devices if d not in {d for g in groups[: min(len(groups), m)] for d in g}]
    metrics, evaluator = driver.logs(config, eval_fn, eval_device or (spare or devices)[-1], on_metrics)
    the_store = for_run(
        rule, params, config, header=header, model_state=model_state, evaluates=bool(eval_fn), in_process=True
    )
    endpoint = Endpoint(the_store, config.discipline, timeout=config.timeout)
    status = the_store.status()
    try:
        metrics.open(config.out, status)
    except BaseException:  # (a full disk: the store is closed, its checkpoint as it was)
        the_store.close()
        raise
    layouts = packing.layouts(params, model_state)
    setups = [
        WorkerSetup.of_run(config, w, ex, model_state is not None, layouts, in_process=True, assignment=assignment)
        for w in range(m)
    ]
    # A worker on the store's own device: the store computes its pushes (its period and the exchange, one program).
    on_store = lambda w: the_store.pipelined and groups[w % len(groups)] == [the_store.device]
    shared: dict = {}  # one exchange-period function for all: one compilation per device group
    workers = [
        Worker(dataclasses.replace(s, computed=on_store(w)), endpoint, loss, data, groups[w % len(groups)], shared)
        for w, s in enumerate(setups)
    ]
    backend = _Threads(endpoint, workers)
    try:
        if status.applied < config.plan.num_updates:
            the_store.warm_up(checked=not config.discipline.rounds)  # (a round's mean: checked by the store)
            for w in range(min(len(groups), m)):  # one compilation per device group
                workers[w].warm_up()
            if evaluator is not None:
                state = the_store.state()
                evaluator.warm_up(state.params, state.model_state)
            backend.start()
    except BaseException:
        backend.close()
        raise
    return driver.drive(backend, config, metrics, evaluator, status)


class _Threads:
    """The driver's :class:`asgd_jax.trainer.driver.Backend` over worker threads of this process."""

    def __init__(self, endpoint: Endpoint, workers: list[Worker]):
        self.endpoint, self.workers = endpoint, workers
        self.stop = threading.Event()
        self.finished: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        for w in range(len(workers)):  # until started, every worker has ended (a resumed run that was done)
            self.finished.put(Finished(w, WorkerStats()))

    def start(self) -> None:
        self.finished = queue.Queue()
        self.threads = [
            threading.Thread(target=self._work, args=(w,), name=f"worker-{w}", daemon=True)
            for w in range(len(self.workers))
        ]
        for t in self.threads:
            t.start()

    def _work(self, w: int) -> None:
        try:
            self.finished.put(Finished(w, self.workers[w].run(self.stop)))
        except Exception as e:
            log.exception("worker %d failed", w)
            self.finished.put(Finished(w, None, f"{type(e).__name__}: {e}"[:500]))

    def wait(self, timeout: float) -> list[Finished]:
        out = []
        try:
            out.append(self.finished.get(timeout=timeout))
            while True:
                out.append(self.finished.get_nowait())
        except queue.Empty:
            return out

    def poll(self) -> Progress:
        return self.endpoint.progress()

    def restart(self, worker: int) -> bool:
        del worker
        return False  # a thread that raised has no process to restart: its worker is dropped

    def end(self, why: str) -> None:
        self.endpoint.end(why)

    def fail(self, why: str) -> None:
        self.endpoint.fail(why)

    def close(self) -> tuple[Progress, Any, Any]:
        self.stop.set()  # a straggler asleep wakes now; a worker computing ends after its exchange period
        progress, params, model_state = self.endpoint.close()
        deadline = time.perf_counter() + driver.GOODBYE
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.perf_counter()))
        return progress.followed_by(self.endpoint.progress()), params, model_state
