"""Real asynchronous training: one thread per worker, each on its own device group, exchanging through a ParameterStore.

Phases of :func:`train`:

1. *Set-up*: the store (host; restored from ``<out>/checkpoint.npz`` with ``resume=True``), one
   :class:`~asgd_jax.loader.ShardLoader` per worker (the simulator's minibatch order, resumed at the worker's data
   position), the worker's exchange-period function (the simulator's own ``_work``: ``n_sync`` minibatches in one of
   the three push modes) jitted for every device group and warmed up before the clock starts (compilation holds the
   GIL). A worker owns ``devices_per_worker`` devices: its minibatch is sharded over a mesh of the group and ``jit``
   averages the gradients inside the group synchronously.
2. *Run*: each worker starts from its backup in the store (w_0 on a cold start), computes a payload on its devices,
   copies it to the host explicitly and pushes; the store applies it with the server step and hands back the fresh
   weights (the worker's next pull). With ``mode="sync"`` (SSGD) the workers meet at a barrier every step and their
   mean payload is applied once. An evaluation thread scores the server's weights every ``eval_every`` updates on
   its own device; the main thread streams metrics to ``metrics.jsonl`` and the progress bar.
3. *Wind-down*: a worker that raises is logged with its id; by default the others carry on (as asynchronous SGD
   allows), with ``on_worker_failure="stop"`` (and always in sync mode) everyone stops. Ctrl-C stops the workers,
   writes a final checkpoint and re-raises. Nothing waits forever.

The store's ``trace.jsonl`` replays in the simulator: ``simulate(..., delays=Trace.load(path), key=<same key>)``
reproduces the final weights to float tolerance (exactly the same minibatches and dropout masks: a worker keys its
model's randomness with the version it pulled and its id, as the simulator does), also across a kill and
``resume=True``.
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
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from asgd_jax import checkpoint, simulator
from asgd_jax.loader import ShardLoader
from asgd_jax.store import BadPush, ParameterStore, StoreClosed

__all__ = ["TrainResult", "WorkerStats", "train"]

log = logging.getLogger("asgd_jax.trainer")

MODEL = "model.npz"
METRICS = "metrics.jsonl"


@dataclasses.dataclass
class WorkerStats:
    """Where one worker's time went (seconds, this session).

    Attributes:
      pushes: payloads it sent.
      compute: in its jitted exchange-period function (including the device transfers around it).
      data: waiting for minibatches.
      exchange: waiting for the store (push applied, fresh weights back) or, in sync mode, at the barrier.
      total: its whole loop.
    """

    pushes: int = 0
    compute: float = 0.0
    data: float = 0.0
    exchange: float = 0.0
    total: float = 0.0

    @property
    def overhead(self) -> float:
        """Fraction of the worker's time spent outside gradient computation."""
        return 1.0 - self.compute / self.total if self.total > 0 else 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      params, model_state: the store's final weights and model state.
      pushes_sent: pushes the workers sent (over all sessions of a resumed run); ``pushes_applied + pushes_rejected``
        always equals it.
      pushes_applied, pushes_rejected: the store's counts.
      pushes_late: of the rejected, those that merely arrived after the budget was reached (in flight at the end).
      failures: ``{worker: "ExceptionType: message"}`` for workers that died.
      trace_path, checkpoint_path, metrics_path: files in ``out_dir`` (``None`` without it).
      seconds: wall time of the run phase (this session).
      losses: per worker, the training losses of its pushes (this session).
      workers: per worker, where its time went (:class:`WorkerStats`).
      evals: the evaluations, ``{"update": t, "time": s, **eval_fn(...)}`` in update order.
      resumed_from: the update the run resumed at (0 for a fresh run).
      staleness_counts: ``{staleness: applied pushes}`` over the whole run.
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


def train(
    loss_fn,
    rule: optax.GradientTransformation,
    params: Any,
    data: dict[str, np.ndarray],
    *,
    num_workers: int,
    steps: int,
    batch_size: int = 32,
    key: jax.Array | None = None,
    model_state: Any = None,
    mode: str = "async",
    n_sync: int = 1,
    push: str = "gradients",
    local_learning_rate: float | None = None,
    devices: list[jax.Device] | None = None,
    devices_per_worker: int = 1,
    out_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    warm_start_steps: int = 0,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    eval_device: jax.Device | None = None,
    log_every: float = 1.0,
    progress: bool = False,
    on_worker_failure: str = "continue",
    on_nonfinite: str = "reject",
    slowdown: Mapping[int, float] | None = None,
    timeout: float = 600.0,
    backend: str = "threads",
    ray_address: str | None = None,
    max_restarts: int = 0,
) -> TrainResult:
    """Trains with ``num_workers`` asynchronous worker threads against a host-side parameter store.

    Args:
      loss_fn, rule, params, data, batch_size, model_state, n_sync, push, local_learning_rate: as in
        :func:`asgd_jax.simulate` (``data`` stays on the host; workers stream their shards).
      num_workers: M worker threads.
      steps: server updates (applied pushes) of the whole run, warm-up included.
      key: the run's key: it fixes every worker's minibatch order (the simulator's, for replay).
      mode: ``"async"`` (A-SGD, default) or ``"sync"`` (SSGD on the same devices: a barrier every step, the mean of
        the M payloads applied once; equals ``simulate(mode="sync")``).
      devices: devices to spread the workers over (default: all of ``jax.devices()``).
      devices_per_worker: devices per worker; worker w owns group ``w % (len(devices) // devices_per_worker)``, its
        ``batch_size`` examples are split evenly over the group and the gradients averaged inside it.
      out_dir: where ``trace.jsonl``, ``metrics.jsonl``, ``checkpoint.npz`` (every ``checkpoint_every`` updates and
        at exit) and ``model.npz`` (the final weights, for a warm start) go.
      resume: continue from ``out_dir``'s checkpoint (a fresh start if there is none). Without it an existing
        checkpoint is an error rather than silently overwritten.
      warm_start_steps: first train this many updates with a single worker (in ``out_dir/warmup``), then start all
        M workers from those weights (GPU A-SGD's warm start); 0 (default) is a cold start.
      eval_fn, eval_every: ``eval_fn(params, model_state) -> dict`` on the server's weights after every
        ``eval_every``-th update, on ``eval_device`` in a thread of its own (workers never wait for it), and once at
        the end.
      log_every: seconds between records in ``metrics.jsonl`` (and progress-bar refreshes).
      progress: show a progress bar.
      on_worker_failure: ``"continue"`` (default) or ``"stop"``.
      on_nonfinite: what the store does with a NaN/Inf push: ``"reject"`` or ``"stop"``.
      slowdown: ``{worker: factor}`` makes those workers ``factor`` times slower (they sleep after computing), to
        study stragglers.
      timeout: seconds after which the run is stopped regardless (no deadlock, ever).
      backend: ``"threads"`` (default: this machine's devices) or ``"ray"`` (a store actor and worker actors on a Ray
        cluster, :mod:`asgd_jax.ray_backend`; evaluations run in the driver, by default on its CPU so that the
        workers keep the GPUs).
      ray_address: the Ray cluster to join (``"auto"``: the one ``ray start`` made here); default: a local instance.
      max_restarts: Ray backend: how often Ray restarts a dead worker actor (it resumes from the store) before it is
        dropped.

    Raises:
      ValueError: for a bad argument, before anything compiles or starts.
      KeyboardInterrupt: after Ctrl-C, once the final checkpoint is written (``resume=True`` continues).
      RuntimeError: when the store stopped the run (``on_nonfinite="stop"``).
    """
    if on_worker_failure not in ("continue", "stop"):
        raise ValueError(f"on_worker_failure={on_worker_failure!r} is invalid: use 'continue' or 'stop'.")
    if mode not in simulator.MODES:
        raise ValueError(f"mode={mode!r} is invalid: use 'async' or 'sync'.")
    for name, value, lowest in (("steps", steps, 1), ("warm_start_steps", warm_start_steps, 0)):
        if not isinstance(value, int) or value < lowest:
            raise ValueError(f"{name}={value!r} is invalid: use an int >= {lowest}.")
    if warm_start_steps >= steps:
        raise ValueError(f"warm_start_steps={warm_start_steps} must be smaller than steps={steps}.")
    if eval_every is not None and eval_fn is None:
        raise ValueError("eval_every was given without eval_fn: pass eval_fn(params, model_state) -> dict.")
    if checkpoint_every is not None and out_dir is None:
        raise ValueError(f"checkpoint_every={checkpoint_every} needs out_dir= (where the checkpoints go).")
    if not log_every > 0:
        raise ValueError(f"log_every={log_every!r} is invalid: use seconds > 0.")
    if backend not in ("threads", "ray"):
        raise ValueError(f"backend={backend!r} is invalid: use 'threads' or 'ray'.")
    if backend == "ray":
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts!r} is invalid: use an int >= 0.")
        from asgd_jax.ray_backend import require_ray

        require_ray()  # fails at once, with the install command
    slowdown = dict(slowdown or {})
    for w, factor in slowdown.items():
        if not (isinstance(w, int) and 0 <= w < num_workers) or not factor >= 1:
            raise ValueError(f"slowdown={slowdown!r} is invalid: use {{worker in [0, {num_workers}): factor >= 1}}.")
    devices = list(devices or jax.devices())
    groups = _device_groups(devices, devices_per_worker) if backend == "threads" else []  # Ray: the actors' devices
    if batch_size % devices_per_worker:
        raise ValueError(
            f"batch_size={batch_size} does not split over devices_per_worker={devices_per_worker}: use a multiple."
        )
    if key is None:
        with jax.transfer_guard("allow"):  # the default key is the one deliberate host -> device copy
            key = jax.random.key(0)
    delays = simulator.delays_lib.Workers(num_workers)
    num_examples, shard_size = simulator._validate(
        data, delays, mode=mode, n_sync=n_sync, push=push, batch_size=batch_size, num_updates=steps,
        local_learning_rate=local_learning_rate, eval_fn=eval_fn, eval_every=eval_every,
    )  # fmt: skip
    common = dict(
        batch_size=batch_size, key=key, n_sync=n_sync, push=push, local_learning_rate=local_learning_rate,
        devices=devices, devices_per_worker=devices_per_worker, checkpoint_every=checkpoint_every, resume=resume,
        log_every=log_every, progress=progress, on_nonfinite=on_nonfinite, timeout=timeout,
    )  # fmt: skip

    # -- warm start: K updates with one worker, then everyone starts from there ----------------------------------
    main_checkpoint = None if out_dir is None else os.path.join(os.fspath(out_dir), "checkpoint.npz")
    if warm_start_steps and not (resume and os.path.exists(main_checkpoint or "")):
        warm = train(
            loss_fn, rule, params, data, num_workers=1, steps=warm_start_steps, model_state=model_state,
            out_dir=None if out_dir is None else os.path.join(os.fspath(out_dir), "warmup"), **common,
        )  # fmt: skip
        params, model_state = warm.params, (warm.model_state if model_state is not None else None)
    if backend == "ray":
        from asgd_jax.ray_backend import train_ray

        return train_ray(
            loss_fn, rule, params, data, num_workers=num_workers, steps=steps - warm_start_steps, mode=mode,
            batch_size=batch_size,
            key=key, model_state=model_state, n_sync=n_sync, push=push, local_learning_rate=local_learning_rate,
            devices_per_worker=devices_per_worker, out_dir=out_dir, checkpoint_every=checkpoint_every, resume=resume,
            eval_fn=eval_fn, eval_every=eval_every, eval_device=eval_device, on_worker_failure=on_worker_failure,
            on_nonfinite=on_nonfinite, max_restarts=max_restarts, ray_address=ray_address, timeout=timeout,
            num_examples=num_examples, shard_size=shard_size, slowdown=slowdown, log_every=log_every,
            progress=progress,
        )  # fmt: skip
    run = _Run(
        loss_fn, rule, params, data, num_workers=num_workers, steps=steps - warm_start_steps, mode=mode,
        model_state=model_state, cfg=simulator._Config(
            mode, n_sync, push, batch_size, num_examples, shard_size, model_state is not None, 1
        ), groups=groups, out_dir=out_dir, eval_fn=eval_fn, eval_every=eval_every, eval_device=eval_device,
        on_worker_failure=on_worker_failure, slowdown=slowdown, **common,
    )  # fmt: skip
    return run.go()


def make_work(loss_fn, cfg, mode: str, num_workers: int, local_learning_rate: float | None) -> Callable:
    """A worker's exchange period, jitted: ``(params, model_state, batches, model_key, version, worker) -> (payload,
    model_state, loss, aux)``; the simulator's own ``_work``, with the simulator's per-update model key."""
    grad_fn = jax.value_and_grad(simulator._as_stateful(loss_fn, cfg.stateful), has_aux=True)
    local_lr = np.float32(0.0 if local_learning_rate is None else local_learning_rate)  # a compile-time constant

    def work(p, ms, b, k, v, w):  # the update's model key is made on the device from explicit inputs
        # The simulator's keys: SSGD splits the update's key over the workers; an asynchronous worker folds in the
        # version it pulled, then its id.
        k = jax.random.fold_in(k, v)
        k = jax.random.split(k, num_workers)[w] if mode == "sync" else jax.random.fold_in(k, w)
        return simulator._work(grad_fn, cfg, p, ms, b, k, local_lr)

    return jax.jit(work)


class _Group:
    """A worker's devices: the shardings of its mesh, and the run's model key placed on it once."""

    def __init__(self, devices: list[jax.Device], model_key: jax.Array):
        mesh = Mesh(np.array(devices), ("batch",))
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharded = NamedSharding(mesh, P(None, "batch"))
        self.model_key = jax.device_put(model_key, self.replicated)

    def place(self, worker: int, params, model_state, batches, version: int) -> tuple:
        """The inputs of :func:`make_work`'s function on this group; every host -> device copy explicit."""
        p, ms, v, i = jax.device_put((params, model_state, np.int32(version), np.int32(worker)), self.replicated)
        return p, ms, jax.device_put(batches, self.batch_sharded), self.model_key, v, i


def _device_groups(devices: list[jax.Device], per_worker: int) -> list[list[jax.Device]]:
    if not isinstance(per_worker, int) or per_worker < 1:
        raise ValueError(f"devices_per_worker={per_worker!r} is invalid: use an int >= 1.")
    if per_worker > len(devices):
        raise ValueError(
            f"devices_per_worker={per_worker} but only {len(devices)} device(s) are available: use at most "
            f"{len(devices)} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices)."
        )
    return [devices[i * per_worker : (i + 1) * per_worker] for i in range(len(devices) // per_worker)]


class _Run:
    """One session of :func:`train` (arguments already validated)."""

    def __init__(self, loss_fn, rule, params, data, *, num_workers, steps, mode, model_state, cfg, groups, out_dir,
                 eval_fn, eval_every, eval_device, on_worker_failure, slowdown, batch_size, key, n_sync, push,
                 local_learning_rate, devices, devices_per_worker, checkpoint_every, resume, log_every, progress,
                 on_nonfinite, timeout):  # fmt: skip
        self.M, self.steps, self.mode, self.cfg, self.n_sync = num_workers, steps, mode, cfg, n_sync
        self.stateful = model_state is not None
        self.out_dir = None if out_dir is None else os.fspath(out_dir)
        self.on_worker_failure, self.slowdown, self.timeout = on_worker_failure, slowdown, timeout
        self.log_every, self.progress = log_every, progress
        self.work = make_work(loss_fn, cfg, mode, num_workers, local_learning_rate)
        self.groups = [_Group(g, simulator._split_key(key)[2]) for g in groups]
        if self.out_dir is not None:
            os.makedirs(self.out_dir, exist_ok=True)
        self.metrics = _Metrics(num_workers)
        self.evaluator = None
        if eval_fn is not None:
            used = {d for g in groups[: min(len(groups), num_workers)] for d in g}
            spare = [d for d in devices if d not in used]
            self.evaluator = _Evaluator(eval_fn, eval_device or (spare or devices)[-1], self.metrics.write)
        header = {"mode": mode, "n_sync": n_sync, "batch_size": batch_size, "push": push,
                  "key": simulator._key_fingerprint(key)}  # fmt: skip
        self.store = ParameterStore(
            rule, params, num_workers, model_state=model_state, max_updates=steps, out_dir=self.out_dir,
            on_nonfinite=on_nonfinite, checkpoint_dir=self.out_dir, checkpoint_every=checkpoint_every,
            resume=resume, header=header, snapshot_every=eval_every,
            on_snapshot=None if self.evaluator is None else self.evaluator.submit,
        )  # fmt: skip
        self.metrics.open(self.out_dir, append=bool(self.store.resumed_from), applied=self.store.applied,
                          staleness_counts=self.store.staleness_counts)  # fmt: skip
        # Data positions: every push the store applied or rejected used up n_sync of that worker's minibatches.
        done = self.store.done if mode == "async" else np.full(num_workers, self.store.done[0])
        self.loaders = [
            ShardLoader(data, worker=w, num_workers=num_workers, batch_size=batch_size, key=key,
                        start_batch=int(done[w]) * n_sync)
            for w in range(num_workers)
        ]  # fmt: skip
        self.stats = [WorkerStats() for _ in range(num_workers)]
        self.losses: dict[int, list[float]] = {w: [] for w in range(num_workers)}
        self.failures: dict[int, str] = {}
        self.stop = threading.Event()
        self._losses_seen = [0] * num_workers

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
            batches = _stack([self.loaders[g].batch(0)] * self.n_sync)
            jax.block_until_ready(self.work(*self._place(g, w0, ms0, batches, 0)))
        if self.evaluator is not None:
            self.evaluator.warm_up(w0, ms0)

    # -- workers -----------------------------------------------------------------------------------------------------

    def _compute(self, w: int, params_h, ms_h, version: int):
        stats = self.stats[w]
        t0 = time.perf_counter()
        batches = _stack([next(self.loaders[w]) for _ in range(self.n_sync)])
        t1 = time.perf_counter()
        payload, new_ms, loss, _ = self.work(*self._place(w, params_h, ms_h, batches, version))
        payload, new_ms, loss = jax.device_get((payload, new_ms, loss))  # explicit device -> host copy
        t2 = time.perf_counter()
        if w in self.slowdown:  # a straggler: this worker computes `slowdown` times slower
            time.sleep((self.slowdown[w] - 1.0) * (t2 - t1))
            t2 = time.perf_counter()
        stats.data += t1 - t0
        stats.compute += t2 - t1
        stats.pushes += 1
        self.losses[w].append(float(loss))
        return payload, new_ms

    def _async_worker(self, w: int) -> None:
        stats = self.stats[w]
        params_h, ms_h, version = jax.device_get(self.store.backup(w))  # w_0 and 0 on a cold start
        while not self.stop.is_set() and not self.store.closed:
            start = time.perf_counter()
            payload, new_ms = self._compute(w, params_h, ms_h, version)
            t = time.perf_counter()
            try:
                future = self.store.push(w, payload, version, new_ms if self.stateful else None)
                params_h, ms_h, version = jax.device_get(future.result(timeout=self.timeout))
            except StoreClosed:
                break
            except BadPush as e:  # rejected (non-finite): pull fresh weights and go on
                log.warning("worker %d: %s", w, e)
                params_h, ms_h, version = jax.device_get(self.store.pull(w))
            finally:
                stats.exchange += time.perf_counter() - t
                stats.total += time.perf_counter() - start

    def _sync_workers(self) -> Callable[[int], None]:
        barrier = threading.Barrier(self.M)
        state = self.store.state()
        shared = {"at": jax.device_get((state.params, state.model_state, self.store.version))}
        payloads: list[Any] = [None] * self.M

        def aggregate() -> None:  # runs in the last thread to reach the barrier
            _params_h, _, version = shared["at"]
            mean = _mean_tree([p for p, _ in payloads])
            ms = _mean_tree([m for _, m in payloads]) if self.stateful else None
            try:
                shared["at"] = jax.device_get(self.store.push(0, mean, version, ms).result(timeout=self.timeout))
            except BadPush as e:
                log.warning("sync step: %s", e)
            except StoreClosed:
                self.stop.set()
            if self.store.closed:
                self.stop.set()

        def run(w: int) -> None:
            stats = self.stats[w]
            try:
                while not self.stop.is_set():
                    start = time.perf_counter()
                    params_h, ms_h, version = shared["at"]
                    payloads[w] = self._compute(w, params_h, ms_h, version)
                    t = time.perf_counter()
                    if barrier.wait(timeout=self.timeout) == 0:
                        aggregate()
                    barrier.wait(timeout=self.timeout)  # everyone sees the new weights before computing again
                    stats.exchange += time.perf_counter() - t
                    stats.total += time.perf_counter() - start
            except threading.BrokenBarrierError:
                if w not in self.failures:
                    self.stop.set()
            except BaseException:
                barrier.abort()  # SSGD cannot go on without a worker: release the others
                raise

        return run

    def _guard(self, body: Callable[[int], None]) -> Callable[[int], None]:
        def run(w: int) -> None:
            try:
                body(w)
            except Exception as e:
                self.failures[w] = f"{type(e).__name__}: {e}"
                log.exception("worker %d failed: %s", w, self.failures[w])  # with the traceback
                if self.on_worker_failure == "stop" or self.mode == "sync":
                    self.stop.set()
                    self.store.close()

        return run

    # -- the run -----------------------------------------------------------------------------------------------------

    def go(self) -> TrainResult:
        store = self.store
        interrupted = False
        start = time.perf_counter()
        threads: list[threading.Thread] = []
        try:
            if store.applied < self.steps:
                self._warm_up()
                body = self._async_worker if self.mode == "async" else self._sync_workers()
                threads = [
                    threading.Thread(target=self._guard(body), args=(w,), name=f"worker-{w}", daemon=True)
                    for w in range(self.M)
                ]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                self._monitor(threads, start)
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: stopping the workers and writing a final checkpoint")
        finally:
            self.stop.set()
            store.close()  # stops taking pushes, drains the queue, writes the final checkpoint
            for t in threads:
                t.join(timeout=self.timeout)
            for loader in self.loaders:
                loader.close()
        seconds = time.perf_counter() - start
        final = store.state()
        params, model_state = jax.device_get((final.params, final.model_state))
        evals: list[dict[str, float]] = []
        if self.evaluator is not None:
            self.evaluator.close()
            if not self.evaluator.history or self.evaluator.history[-1]["update"] != store.applied:
                self.evaluator.submit(store.applied, final.params, final.model_state)
                self.evaluator.close()
            evals = self.evaluator.history
        paths = {}
        if self.out_dir is not None:
            checkpoint.save_model(os.path.join(self.out_dir, MODEL), params, model_state)
            self.metrics.write(self._record(seconds, final=True))
            paths = {k: os.path.join(self.out_dir, f) for k, f in
                     (("trace", "trace.jsonl"), ("checkpoint", "checkpoint.npz"), ("metrics", METRICS))}  # fmt: skip
        self.metrics.close()
        if interrupted:
            raise KeyboardInterrupt(f"training interrupted at update {store.applied}; resume=True continues")
        if store.error is not None:
            raise RuntimeError(f"training stopped: {store.error}")
        return TrainResult(
            params=params,
            model_state=model_state,
            pushes_sent=store.received,
            pushes_applied=store.applied,
            pushes_rejected=store.rejected,
            pushes_late=store.late,
            failures=self.failures,
            trace_path=paths.get("trace"),
            checkpoint_path=paths.get("checkpoint"),
            metrics_path=paths.get("metrics"),
            seconds=seconds,
            losses=self.losses,
            workers=self.stats,
            evals=evals,
            resumed_from=store.resumed_from,
            staleness_counts=dict(sorted(store.staleness_counts.items())),
        )

    def _monitor(self, threads: list[threading.Thread], start: float) -> None:
        """The main thread: metrics records and the progress bar until the workers are done (or the deadline)."""
        from tqdm.auto import tqdm

        deadline = start + self.timeout
        bar = tqdm(total=self.steps, initial=self.store.applied, disable=not self.progress, unit="update",
                   desc=f"{self.mode} x{self.M}", dynamic_ncols=True)  # fmt: skip
        self.metrics.restart_clock(start)
        next_log = start + self.log_every
        try:
            while any(t.is_alive() for t in threads) and time.perf_counter() < deadline:
                if self.store.closed or len(self.failures) == self.M:
                    break
                self.store.wait_closed(0.05)  # no busy polling: the workers need the GIL more than we do
                if time.perf_counter() >= next_log:
                    next_log += self.log_every
                    record = self._record(time.perf_counter() - start)
                    self.metrics.write(record)
                    bar.update(self.store.applied - bar.n)
                    if record.get("loss") is not None:
                        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            bar.update(self.store.applied - bar.n)
        finally:
            bar.close()

    def _record(self, elapsed: float, final: bool = False) -> dict[str, Any]:
        seen = [len(self.losses[w]) for w in range(self.M)]
        new_losses = [x for w in range(self.M) for x in self.losses[w][self._losses_seen[w] : seen[w]]]
        self._losses_seen = seen
        return self.metrics.record(
            applied=self.store.applied, rejected=self.store.rejected, elapsed=elapsed,
            pushes=[s.pushes for s in self.stats], new_losses=new_losses,
            staleness_counts=self.store.staleness_counts, final=final,
        )  # fmt: skip


class _Metrics:
    """``metrics.jsonl``: a record per log period (rates since the previous record), evaluation records, a final
    record. Used by both backends; without an output folder the records are computed and dropped."""

    def __init__(self, num_workers: int):
        self.M = num_workers
        self._file = None
        self._lock = threading.Lock()
        self._last: tuple = (time.perf_counter(), 0, [0] * num_workers, {})

    def open(self, out_dir: str | None, *, append: bool, applied: int, staleness_counts: dict[int, int],
             pushes: list[int] | None = None) -> None:  # fmt: skip
        """Starts the file (appends on a resume) and the counts the first record's rates are taken from."""
        if out_dir is not None:
            self._file = open(os.path.join(out_dir, METRICS), "a" if append else "w")  # noqa: SIM115 (close())
        self._last = (time.perf_counter(), applied, list(pushes or [0] * self.M), dict(staleness_counts))

    def restart_clock(self, start: float) -> None:
        self._last = (start, *self._last[1:])

    def record(self, *, applied: int, rejected: int, elapsed: float, pushes: list[int], new_losses: list[float],
               staleness_counts: dict[int, int], final: bool = False) -> dict[str, Any]:  # fmt: skip
        """The record of what happened since the previous one (``pushes``: per-worker totals so far)."""
        now = time.perf_counter()
        t_prev, applied_prev, pushes_prev, stale_prev = self._last
        counts = dict(staleness_counts)
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
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


class _Evaluator:
    """Evaluates snapshots of the server's weights on its own device and thread, in the order they were taken."""

    def __init__(self, eval_fn: Callable, device: jax.Device, write: Callable[[dict], None]):
        self.fn, self.device, self.write = jax.jit(eval_fn), device, write
        self.history: list[dict[str, float]] = []
        self._queue: queue.Queue = queue.Queue()
        self._t0 = time.perf_counter()
        self._thread: threading.Thread | None = None

    def warm_up(self, params, model_state) -> None:
        jax.block_until_ready(self.fn(*jax.device_put((params, model_state), self.device)))

    def submit(self, version: int, params, model_state) -> None:
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


def _stack(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def _mean_tree(trees: list[Any]) -> Any:
    """The simulator's SSGD mean over workers, on the host: floats averaged, integers taken from the first."""

    def mean(*xs):
        x = np.asarray(xs[0])
        if np.issubdtype(x.dtype, np.inexact):
            return np.mean(np.stack(xs), axis=0).astype(x.dtype)
        return x

    return jax.tree.map(mean, *trees)
