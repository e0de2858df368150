"""The threaded trainer backend: one worker thread per device group of this machine, a host-side parameter store.

Phases of a session (:func:`run`):

1. *Set-up*: the store (restored from ``<out>/checkpoint.npz`` on a resume), one
   :class:`~asgd_jax.loader.ShardLoader` per worker (the simulator's minibatch order, resumed at the worker's data
   position), the worker's exchange-period function jitted for every device group and warmed up before the clock
   starts (compilation holds the GIL).
2. *Run*: each worker starts from its backup in the store (w_0 on a cold start), computes a payload on its devices,
   copies it to the host explicitly and pushes; the store applies it with the server step and hands back the fresh
   weights (the worker's next pull). In SSGD the workers send each round to :meth:`ParameterStore.push_round`, which
   applies their mean once. An evaluation thread scores snapshots of the weights; the main thread streams
   ``metrics.jsonl`` and the progress bar, and stops the run when the store, a worker or a writer says so.
3. *Wind-down* (:func:`asgd_jax.session.finish`): nothing waits forever; Ctrl-C writes a final checkpoint and raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import exchange, session
from asgd_jax.loader import ShardLoader
from asgd_jax.session import TrainConfig
from asgd_jax.store import BadPush, ParameterStore, StoreClosed

__all__ = ["run"]

log = logging.getLogger("asgd_jax.threads")


def run(
    loss: exchange.Loss,
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
) -> session.TrainResult:
    """One session of the threaded backend (the arguments are validated by :func:`asgd_jax.trainer.train`)."""
    return _Session(loss, rule, params, data, config, ex, model_state, eval_fn, devices, eval_device, header).go()


class _Session:
    def __init__(
        self, loss, rule, params, data, config: TrainConfig, ex, model_state, eval_fn, devices, eval_device, header
    ):
        self.c, self.M, self.ex, self.stateful = config, config.plan.workers, ex, model_state is not None
        key = config.key()
        self.work = exchange.worker_function(loss, ex, config.plan.workers, config.plan.local_lr)
        groups = session.device_groups(devices, config.devices_per_worker)
        self.groups = [session.DeviceGroup(g, exchange.split_key(key)[2]) for g in groups]
        if config.out is not None:
            os.makedirs(config.out, exist_ok=True)
        self.metrics = session.MetricsLog(self.M)
        self.evaluator = None
        if eval_fn is not None:
            used = {d for g in groups[: min(len(groups), self.M)] for d in g}
            spare = [d for d in devices if d not in used]
            self.evaluator = session.Evaluator(eval_fn, eval_device or (spare or devices)[-1], self.metrics.write)
        self.store = ParameterStore(
            rule,
            params,
            self.M,
            model_state=model_state,
            num_updates=config.plan.num_updates,
            out_dir=config.out,
            on_nonfinite=config.on_nonfinite,
            checkpoint_dir=config.out,
            checkpoint_every=config.checkpoint_interval(),
            resume=config.resume,
            header=header,
            snapshot_every=config.eval_interval() if eval_fn else None,
            on_snapshot=None if self.evaluator is None else self.evaluator.submit,
            max_nonfinite=config.max_nonfinite,
        )
        self.metrics.open(
            config.out,
            append=bool(self.store.resumed_from),
            applied=self.store.applied,
            staleness_counts=self.store.staleness_counts,
        )
        # Data positions: every push the store applied or rejected used up n_sync of that worker's minibatches.
        done = self.store.positions if ex.mode == "async" else np.full(self.M, self.store.positions[0])
        self.loaders = [
            ShardLoader(
                data,
                worker=w,
                num_workers=self.M,
                batch_size=config.plan.batch_size,
                key=key,
                start_batch=int(done[w]) * ex.n_sync,
            )
            for w in range(self.M)
        ]
        self.stats = [session.WorkerStats() for _ in range(self.M)]
        self.losses: dict[int, list[float]] = {w: [] for w in range(self.M)}
        self.failures: dict[int, str] = {}
        self.stop = threading.Event()
        self._losses_seen = [0] * self.M

    # -- set-up ------------------------------------------------------------------------------------------------------

    def _place(self, w: int, params, model_state, batches, version: int):
        return self.groups[w % len(self.groups)].place(w, params, model_state, batches, version)

    def _warm_up(self) -> None:
        """Compiles the worker function for every device group, the store's exchange and the evaluation before the
        clock starts."""
        self.store.warm_up()
        state = self.store.state()  # one host copy of the whole server state
        w0, ms0 = state.params, state.model_state
        for g in range(min(len(self.groups), self.M)):
            batches = session.stack_batches([self.loaders[g].batch(0)] * self.ex.n_sync)
            jax.block_until_ready(self.work(*self._place(g, w0, ms0, batches, 0)))
        if self.evaluator is not None:
            self.evaluator.warm_up(w0, ms0)

    # -- workers -----------------------------------------------------------------------------------------------------

    def _compute(self, w: int, params_h, ms_h, version: int):
        stats = self.stats[w]
        t0 = time.perf_counter()
        batches = session.stack_batches([next(self.loaders[w]) for _ in range(self.ex.n_sync)])
        t1 = time.perf_counter()
        payload, new_ms, loss, _ = self.work(*self._place(w, params_h, ms_h, batches, version))
        payload, new_ms, loss = jax.device_get((payload, new_ms, loss))  # explicit device -> host copy
        t2 = time.perf_counter()
        if w in self.c.slowdown:  # a straggler: this worker computes `slowdown` times slower
            time.sleep((self.c.slowdown[w] - 1.0) * (t2 - t1))
            t2 = time.perf_counter()
        stats.data += t1 - t0
        stats.compute += t2 - t1
        stats.pushes += 1
        self.losses[w].append(float(loss))
        return payload, new_ms if self.stateful else None

    def _async_worker(self, w: int) -> None:
        stats = self.stats[w]
        params_h, ms_h, version = jax.device_get(self.store.backup(w))  # w_0 and 0 on a cold start
        while not self.stop.is_set() and not self.store.closed:
            start = time.perf_counter()
            payload, new_ms = self._compute(w, params_h, ms_h, version)
            t = time.perf_counter()
            try:
                future = self.store.push(w, payload, version, new_ms)
                params_h, ms_h, version = jax.device_get(future.result(timeout=self.c.timeout))
            except StoreClosed:
                break
            except BadPush as e:  # rejected (non-finite): pull fresh weights and go on
                log.warning("worker %d: %s", w, e)
                params_h, ms_h, version = jax.device_get(self.store.pull(w))
            finally:
                stats.exchange += time.perf_counter() - t
                stats.total += time.perf_counter() - start

    def _sync_worker(self, w: int) -> None:
        """SSGD: every round, a payload at the round's weights; the store applies the mean once all M have sent."""
        stats = self.stats[w]
        params_h, ms_h, version = jax.device_get(self.store.backup(0))  # every round is pushed as worker 0
        while not self.stop.is_set():
            start = time.perf_counter()
            payload, new_ms = self._compute(w, params_h, ms_h, version)
            t = time.perf_counter()
            try:
                params_h, ms_h, version = self.store.push_round(w, payload, version, new_ms, timeout=self.c.timeout)
            except StoreClosed:
                break
            finally:
                stats.exchange += time.perf_counter() - t
                stats.total += time.perf_counter() - start
            if self.store.closed:
                break

    def _guard(self, body: Callable[[int], None]) -> Callable[[int], None]:
        def guarded(w: int) -> None:
            try:
                body(w)
            except Exception as e:
                self.failures[w] = f"{type(e).__name__}: {e}"
                log.exception("worker %d failed: %s", w, self.failures[w])  # with the traceback
                if self.c.on_worker_failure == "stop" or self.ex.mode == "sync":  # SSGD cannot go on without it
                    self.stop.set()
                    self.store.abort_rounds(f"worker {w} failed: {self.failures[w]}")
                    self.store.close()

        return guarded

    # -- the run -----------------------------------------------------------------------------------------------------

    def go(self) -> session.TrainResult:
        store, interrupted, timed_out = self.store, False, False
        start = time.perf_counter()
        threads: list[threading.Thread] = []
        try:
            if store.applied < self.c.plan.num_updates:
                self._warm_up()
                body = self._async_worker if self.ex.mode == "async" else self._sync_worker
                threads = [
                    threading.Thread(target=self._guard(body), args=(w,), name=f"worker-{w}", daemon=True)
                    for w in range(self.M)
                ]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                timed_out = self._monitor(threads, start)
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: stopping the workers and writing a final checkpoint")
        finally:
            self.stop.set()
            store.close()  # stops taking pushes, drains the queue, writes the final checkpoint
            for t in threads:
                t.join(timeout=self.c.timeout)
            for loader in self.loaders:
                loader.close()
        seconds = time.perf_counter() - start
        params, model_state = store.final_weights()
        outcome = session.Outcome(
            params=params,
            model_state=model_state,
            status=store.status(),
            failures=self.failures,
            seconds=seconds,
            losses=self.losses,
            workers=self.stats,
            interrupted=interrupted,
            timed_out=timed_out,
        )
        return session.finish(
            outcome,
            out_dir=self.c.out,
            metrics=self.metrics,
            evaluator=self.evaluator,
            final_record=lambda: self._record(seconds, final=True),
            summary={},
        )

    def _monitor(self, threads: list[threading.Thread], start: float) -> bool:
        """The main thread: metrics records and the progress bar until the workers are done; True at the deadline."""
        from tqdm.auto import tqdm

        deadline = start + self.c.timeout
        bar = tqdm(
            total=self.c.plan.num_updates,
            initial=self.store.applied,
            disable=not self.c.progress,
            unit="update",
            desc=f"{self.ex.mode} x{self.M}",
            dynamic_ncols=True,
        )
        self.metrics.restart_clock(start)
        next_log = start + self.c.log_every
        try:
            while any(t.is_alive() for t in threads):
                if self.store.closed or len(self.failures) == self.M:
                    break
                if time.perf_counter() >= deadline:
                    return True
                self.store.wait_closed(0.05)  # no busy polling: the workers need the GIL more than we do
                if time.perf_counter() >= next_log:
                    next_log += self.c.log_every
                    record = self._record(time.perf_counter() - start)
                    self.metrics.write(record)
                    if self.metrics.error is not None:  # a full disk: stop now, the checkpoint is still good
                        self.store.fail(OSError(f"writing metrics.jsonl failed: {self.metrics.error}"))
                    bar.update(self.store.applied - bar.n)
                    if record.get("loss") is not None:
                        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            bar.update(self.store.applied - bar.n)
            return False
        finally:
            bar.close()

    def _record(self, elapsed: float, final: bool = False) -> dict[str, Any]:
        seen = [len(self.losses[w]) for w in range(self.M)]
        new_losses = [x for w in range(self.M) for x in self.losses[w][self._losses_seen[w] : seen[w]]]
        self._losses_seen = seen
        return self.metrics.record(
            applied=self.store.applied,
            rejected=self.store.rejected,
            elapsed=elapsed,
            pushes=[s.pushes for s in self.stats],
            new_losses=new_losses,
            staleness_counts=self.store.staleness_counts,
            final=final,
        )
