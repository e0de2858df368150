"""Real asynchronous training: one thread per worker, each on its own device, exchanging through a ParameterStore.

Phases of :func:`train`:

1. *Set-up*: the store (host), one :class:`~asgd_jax.loader.ShardLoader` per worker (the simulator's minibatch order),
   the worker's exchange-period function (the simulator's own ``_work``: ``n_sync`` minibatches in one of the three
   push modes) jitted and warmed up on every worker's device before the clock starts (compilation holds the GIL).
2. *Run*: every worker starts from w_0, computes a payload on its device, copies it to the host explicitly and pushes;
   the store applies it with the server step and hands back the fresh weights (the worker's next pull). Workers stop
   when the store has applied ``steps`` pushes.
3. *Wind-down*: a worker that raises is logged with its id; by default the others carry on (as asynchronous SGD
   allows), with ``on_worker_failure="stop"`` the store closes and everyone stops. Nothing waits forever.

The store's ``trace.jsonl`` replays in the simulator: ``simulate(..., delays=Trace.load(path), key=<same key>)``
reproduces the final weights to float tolerance (exactly the same minibatches; models without dropout).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import simulator
from asgd_jax.loader import ShardLoader
from asgd_jax.store import BadPush, ParameterStore, StoreClosed

__all__ = ["TrainResult", "train"]

log = logging.getLogger("asgd_jax.trainer")


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      params, model_state: the store's final weights and model state.
      pushes_sent: pushes every worker sent; ``pushes_applied + pushes_rejected`` always equals it.
      pushes_applied, pushes_rejected: the store's counts.
      failures: ``{worker: repr(exception)}`` for workers that died.
      trace_path: the recorded ``trace.jsonl`` (``None`` without ``out_dir``).
      seconds: wall time of the run phase.
      losses: per worker, the training losses of its pushes.
    """

    params: Any
    model_state: Any
    pushes_sent: int
    pushes_applied: int
    pushes_rejected: int
    failures: dict[int, str]
    trace_path: str | None
    seconds: float
    losses: dict[int, list[float]]


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
    n_sync: int = 1,
    push: str = "gradients",
    local_learning_rate: float | None = None,
    devices: list[jax.Device] | None = None,
    out_dir: str | os.PathLike | None = None,
    on_worker_failure: str = "continue",
    on_nonfinite: str = "reject",
    timeout: float = 600.0,
) -> TrainResult:
    """Trains with ``num_workers`` asynchronous worker threads against a host-side parameter store.

    Args:
      loss_fn, rule, params, data, batch_size, model_state, n_sync, push, local_learning_rate: as in
        :func:`asgd_jax.simulate` (``data`` stays on the host; workers stream their shards).
      num_workers: M worker threads; worker w runs on ``devices[w % len(devices)]``.
      steps: server updates (applied pushes) to run.
      key: the run's key: it fixes every worker's minibatch order (the simulator's, for replay).
      devices: devices to spread the workers over (default: all of ``jax.devices()``).
      out_dir: where ``trace.jsonl`` goes.
      on_worker_failure: ``"continue"`` (default) or ``"stop"``.
      on_nonfinite: what the store does with a NaN/Inf push: ``"reject"`` or ``"stop"``.
      timeout: seconds after which the run is stopped regardless (no deadlock, ever).
    """
    if on_worker_failure not in ("continue", "stop"):
        raise ValueError(f"on_worker_failure={on_worker_failure!r} is invalid: use 'continue' or 'stop'.")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid: use an int >= 1.")
    if key is None:
        with jax.transfer_guard("allow"):  # the default key is the one deliberate host -> device copy
            key = jax.random.key(0)
    delays = simulator.delays_lib.Workers(num_workers)
    num_examples, shard_size = simulator._validate(
        data, delays, mode="async", n_sync=n_sync, push=push, batch_size=batch_size, num_updates=steps,
        local_learning_rate=local_learning_rate, eval_fn=None, eval_every=None,
    )  # fmt: skip
    devices = list(devices or jax.devices())
    stateful = model_state is not None
    cfg = simulator._Config("async", n_sync, push, batch_size, num_examples, shard_size, stateful, 1)
    grad_fn = jax.value_and_grad(simulator._as_stateful(loss_fn, stateful), has_aux=True)
    local_lr = np.float32(0.0 if local_learning_rate is None else local_learning_rate)  # a compile-time constant
    # The update's model key is folded in on the device, from the explicitly transferred pulled version.
    work = jax.jit(lambda p, ms, b, k, v: simulator._work(grad_fn, cfg, p, ms, b, jax.random.fold_in(k, v), local_lr))
    model_key = simulator._split_key(key)[2]
    model_state = {} if model_state is None else model_state

    # -- set-up ------------------------------------------------------------------------------------------------------
    store = ParameterStore(
        rule, params, num_workers, model_state=model_state if stateful else None, max_updates=steps,
        out_dir=out_dir, on_nonfinite=on_nonfinite,
    )  # fmt: skip
    loaders = [
        ShardLoader(data, worker=w, num_workers=num_workers, batch_size=batch_size, key=key) for w in range(num_workers)
    ]
    initial = store.state()
    w0, ms0 = jax.device_get((initial.params, initial.model_state))
    placed = {}
    for w in range(num_workers):  # compile and warm up every device before the clock starts
        device = devices[w % len(devices)]
        if device not in placed:
            p, ms = jax.device_put((w0, ms0), device)
            dummy = jax.device_put(_stack([loaders[w].batch(0)] * n_sync), device)
            k, v = jax.device_put((model_key, np.int32(0)), device)
            jax.block_until_ready(work(p, ms, dummy, k, v))
            placed[device] = True

    sent = [0] * num_workers
    losses: dict[int, list[float]] = {w: [] for w in range(num_workers)}
    failures: dict[int, str] = {}
    stop = threading.Event()

    def run_worker(w: int) -> None:
        device = devices[w % len(devices)]
        params_h, ms_h, version = w0, ms0, 0  # every worker starts from w_0 (its backup since init)
        try:
            while not stop.is_set() and not store.closed:
                batches = _stack([next(loaders[w]) for _ in range(n_sync)])
                p, ms, b = jax.device_put((params_h, ms_h, batches), device)
                k, v = jax.device_put((model_key, np.int32(version)), device)
                payload, new_ms, loss, _ = work(p, ms, b, k, v)
                payload, new_ms, loss = jax.device_get((payload, new_ms, loss))  # explicit device -> host copy
                sent[w] += 1
                try:
                    future = store.push(w, payload, version, new_ms if stateful else None)
                except StoreClosed:
                    break
                losses[w].append(float(loss))
                try:
                    params_h, ms_h, version = future.result(timeout=timeout)
                except StoreClosed:
                    break
                except BadPush as e:  # rejected (non-finite): pull fresh weights and go on
                    log.warning("worker %d: %s", w, e)
                    pulled, pulled_ms, version = store.pull(w)
                    params_h, ms_h = jax.device_get((pulled, pulled_ms))
        except Exception as e:
            failures[w] = repr(e)
            log.error("worker %d failed: %r", w, e)
            if on_worker_failure == "stop":
                stop.set()
                store.close()

    # -- run ---------------------------------------------------------------------------------------------------------
    start = time.perf_counter()
    threads = [
        threading.Thread(target=run_worker, args=(w,), name=f"worker-{w}", daemon=True) for w in range(num_workers)
    ]
    for t in threads:
        t.start()
    deadline = start + timeout
    while any(t.is_alive() for t in threads) and time.perf_counter() < deadline:
        if store.closed or len(failures) == num_workers:
            break
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()) + 5)
    seconds = time.perf_counter() - start

    # -- wind-down ---------------------------------------------------------------------------------------------------
    store.close()
    for loader in loaders:
        loader.close()
    if store.error is not None:
        raise RuntimeError(f"training stopped: {store.error}")
    final = store.state()
    return TrainResult(
        params=jax.device_get(final.params),
        model_state=jax.device_get(final.model_state),
        pushes_sent=sum(sent),
        pushes_applied=store.applied,
        pushes_rejected=store.rejected,
        failures=failures,
        trace_path=None if out_dir is None else os.path.join(os.fspath(out_dir), "trace.jsonl"),
        seconds=seconds,
        losses=losses,
    )


def _stack(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}
