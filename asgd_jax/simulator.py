"""The deterministic staleness simulator: asynchronous training replayed exactly, many runs at once.

The simulator is an ``init`` / ``step`` state machine over server updates. Each step asks the delay model for the next
:class:`~asgd_jax.delays.Event`, lets the pushing worker compute its payload at the snapshot it pulled (its gradient
only depends on that snapshot and its next minibatch, so it is computed when it lands), applies the push with
:func:`asgd_jax.server.push` and records the pull with :func:`asgd_jax.server.pull`. :func:`simulate` scans the step
in chunks: between chunks it evaluates, updates the progress bar and writes a checkpoint. :func:`sweep` vmaps the same
program over keys and hyperparameters, so a grid of runs compiles once.

Randomness: the run's key is split into data, delay and model keys; update t draws its delay with
``fold_in(delay_key, t)``. The model's randomness (dropout, augmentation) of the worker w that pushes at t uses
``fold_in(fold_in(model_key, v), w)``, v the version w pulled (asynchronous), or splits ``fold_in(model_key, t)`` over
the workers (SSGD): what the trainer's workers know too, so its traces replay with dropout. The same key gives the same
bits, and a run resumed from a checkpoint continues exactly where it stopped.

Data: worker (shard) s draws minibatches from its own shard. A shard's j-th batch belongs to its epoch ``j // K``; in
epoch e the shards are consecutive slices of one keyed random permutation of the data (:mod:`asgd_jax.order`), so in
every epoch the shards are disjoint and the data is re-partitioned randomly across workers, as in DC-ASGD.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import checkpoint as ckpt
from asgd_jax import delays as delays_lib
from asgd_jax import order, server

__all__ = ["SimState", "SimulationResult", "grid", "init", "lower", "shard_indices", "simulate", "sweep"]

MODES = ("async", "sync")
PUSHES = ("gradients", "delta", "accumulate")


class DataState(NamedTuple):
    """How many minibatches each shard has taken; with the key this fixes every future batch (see :mod:`order`)."""

    taken: jax.Array  # int32 [num_shards]


class SimState(NamedTuple):
    """The simulator's whole state: a checkpoint holds exactly this."""

    server: server.ServerState
    delay: Any
    data: DataState
    clock: jax.Array  # float32 virtual time of the last update


class SimulationResult(NamedTuple):
    """What :func:`simulate` returns (with a leading run axis everywhere for :func:`sweep`).

    Attributes:
      params: final server weights.
      model_state: final server model state (``{}`` without one).
      state: the final :class:`SimState` (server, delay model and data positions).
      metrics: per-update numpy arrays ``loss``, ``staleness``, ``worker``, ``time``, ``epoch`` (effective passes over
        the data) and any auxiliary training metrics the loss returns (e.g. ``error``); with ``eval_fn`` also
        ``eval_update`` (the update count at each evaluation, starting at 0) and ``eval_<name>`` for each metric.
    """

    params: Any
    model_state: Any
    state: SimState
    metrics: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about a run: it decides the compiled program."""

    mode: str
    n_sync: int
    push: str
    batch_size: int
    num_examples: int
    shard_size: int
    stateful: bool
    chunk: int


# --------------------------------------------------------------------------------------------------------------------
# Validation: every mistake a user can make is reported here, before anything is traced or compiled.
# --------------------------------------------------------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: {name} must be an int >= 1.")
    return int(value)


def _validate(
    data,
    delays,
    *,
    mode,
    n_sync,
    push,
    batch_size,
    num_updates,
    local_learning_rate,
    eval_fn,
    eval_every,
) -> tuple[int, int]:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: use 'async' or 'sync'.")
    if push not in PUSHES:
        raise ValueError(f"push={push!r} is invalid: use one of {', '.join(PUSHES)}.")
    n_sync = _positive_int("n_sync", n_sync)
    batch_size = _positive_int("batch_size", batch_size)
    _positive_int("num_updates", num_updates)
    if eval_every is not None:
        _positive_int("eval_every", eval_every)
        if eval_fn is None:
            raise ValueError("eval_every was given without eval_fn: pass eval_fn(params, model_state) -> dict.")
    if not all(hasattr(delays, a) for a in ("num_slots", "num_shards", "init", "next")):
        raise ValueError(
            f"delays={delays!r} is not a delay model: use one of asgd_jax.delays.Workers, Trace, FixedDelay, "
            "RandomDelay."
        )
    if mode == "sync" and not isinstance(delays, delays_lib.Workers):
        raise ValueError(
            f"mode='sync' (SSGD) needs delays=asgd_jax.delays.Workers(M), not {type(delays).__name__}: a barrier "
            "round averages the M workers' gradients."
        )
    if isinstance(delays, delays_lib.Trace) and len(delays) < num_updates:
        raise ValueError(
            f"num_updates={num_updates} but the trace holds only {len(delays)} pushes: lower num_updates or give a "
            "longer trace."
        )
    if n_sync > 1 and push != "accumulate" and local_learning_rate is None:
        raise ValueError(
            f"n_sync={n_sync} with push={push!r} takes local SGD steps between exchanges: pass "
            "local_learning_rate=<float>, or use push='accumulate' (no local steps)."
        )
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("data is empty: pass a pytree of arrays with a leading example axis, e.g. {'x': x, 'y': y}.")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"data leaves have leading sizes {sorted(sizes)}: every leaf needs the same leading example axis."
        )
    num_examples = sizes.pop()
    shard_size = num_examples // delays.num_shards
    if batch_size > shard_size:
        raise ValueError(
            f"batch_size={batch_size} is larger than a shard: {num_examples} examples over {delays.num_shards} "
            f"shards leaves {shard_size} per shard. Lower batch_size or the number of workers."
        )
    return num_examples, shard_size


# --------------------------------------------------------------------------------------------------------------------
# Data: per-shard minibatches, re-partitioned every epoch.
# --------------------------------------------------------------------------------------------------------------------


def shard_indices(key: jax.Array, epoch: int | jax.Array, num_examples: int, num_shards: int) -> jax.Array:
    """The example indices of every shard in one epoch of the run keyed ``key``: ``[num_shards, N // num_shards]``.

    Shard s's k-th minibatch of the epoch is ``shard_indices(...)[s, k * batch_size : (k + 1) * batch_size]``; the
    layout is :func:`asgd_jax.order.shard_indices` under the run's data key.

    Example:
      >>> import jax, asgd_jax
      >>> idx = asgd_jax.simulator.shard_indices(jax.random.key(0), epoch=0, num_examples=10, num_shards=3)
      >>> idx.shape, len(set(idx.ravel().tolist()))
      ((3, 3), 9)
    """
    return order.shard_indices(_split_key(key)[0], epoch, num_examples=num_examples, num_shards=num_shards)


def _batch_indices(data_words: jax.Array, cfg: _Config, shard: jax.Array, taken: jax.Array) -> jax.Array:
    """Example indices of a shard's ``taken``-th minibatch (``shard`` and ``taken`` may be arrays of equal shape)."""
    per_epoch = cfg.shard_size // cfg.batch_size
    epoch, k = taken // per_epoch, taken % per_epoch
    start = shard * cfg.shard_size + k * cfg.batch_size
    positions = start[..., None] + jnp.arange(cfg.batch_size, dtype=jnp.int32).reshape((1,) * start.ndim + (-1,))
    if jnp.ndim(epoch) == 0:
        return order.example_index(data_words, epoch, positions, cfg.num_examples)
    # SSGD: all shards are in the same epoch (they move in lock-step).
    return order.example_index(data_words, epoch[0], positions, cfg.num_examples)


def _take(data, data_words, cfg: _Config, ds: DataState, shard: jax.Array):
    """Shard ``shard``'s next minibatch."""
    idx = _batch_indices(data_words, cfg, shard, ds.taken[shard])
    return DataState(ds.taken.at[shard].add(1)), jax.tree.map(lambda a: a[idx], data)


def _take_all(data, data_words, cfg: _Config, ds: DataState):
    """Every shard's next minibatch, ``[num_shards, batch, ...]`` (SSGD)."""
    shards = jnp.arange(ds.taken.shape[0], dtype=jnp.int32)
    idx = _batch_indices(data_words, cfg, shards, ds.taken)
    return DataState(ds.taken + 1), jax.tree.map(lambda a: a[idx], data)


# --------------------------------------------------------------------------------------------------------------------
# Workers: what one exchange period computes.
# --------------------------------------------------------------------------------------------------------------------


def _as_stateful(loss_fn: Callable, stateful: bool) -> Callable:
    """Normalises the loss to ``(params, model_state, batch, key) -> (loss, (model_state, aux))``."""
    if stateful:

        def full(params, model_state, batch, key):
            loss, rest = loss_fn(params, model_state, batch, key)
            if isinstance(rest, tuple) and len(rest) == 2:
                return loss, rest
            return loss, (rest, {})

        return full
    return lambda params, model_state, batch, key: (loss_fn(params, batch), (model_state, {}))


def _work(grad_fn, cfg: _Config, params0, model_state0, batches, key, local_lr):
    """One worker's exchange period: ``n_sync`` minibatches from the pulled snapshot; returns the payload."""
    if cfg.n_sync == 1:
        (loss, (model_state, aux)), g = grad_fn(params0, model_state0, jax.tree.map(lambda b: b[0], batches), key)
        payload = jax.tree.map(lambda x: local_lr * x, g) if cfg.push == "delta" else g
        return payload, model_state, loss, aux

    local_steps = cfg.push != "accumulate"

    def body(carry, inputs):
        params, model_state, acc = carry
        batch, i = inputs
        at = params if local_steps else params0
        (loss, (model_state, aux)), g = grad_fn(at, model_state, batch, jax.random.fold_in(key, i))
        acc = jax.tree.map(jnp.add, acc, g)
        if local_steps:
            params = jax.tree.map(lambda p, x: p - local_lr * x, params, g)
        return (params, model_state, acc), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params0)
    (params, model_state, acc), (losses, auxes) = jax.lax.scan(
        body, (params0, model_state0, zeros), (batches, jnp.arange(cfg.n_sync))
    )
    # "delta" pushes the descent direction w_pulled - w_local, which the server's rule treats like a gradient.
    payload = jax.tree.map(jnp.subtract, params0, params) if cfg.push == "delta" else acc
    return payload, model_state, losses.mean(), jax.tree.map(jnp.mean, auxes)


def _mean_tree(tree):
    return jax.tree.map(
        lambda x: x.mean(axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0],
        tree,
    )


# --------------------------------------------------------------------------------------------------------------------
# The state machine.
# --------------------------------------------------------------------------------------------------------------------


def _split_key(key: jax.Array):
    data_key, delay_key, model_key = jax.random.split(key, 3)
    return data_key, delay_key, model_key


def init(
    rule: optax.GradientTransformation,
    params: Any,
    *,
    delays: Any = None,
    key: jax.Array | None = None,
    n_sync: int = 1,
    model_state: Any = None,
) -> SimState:
    """The simulator's state before the first update (what :func:`simulate` starts from and :func:`lower`'s program
    takes): the server at w_0, the delay model's first draw under ``key``, no minibatch taken, the clock at 0.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> state = asgd_jax.simulator.init(asgd_jax.asgd(0.1), jnp.zeros(3), delays=asgd_jax.delays.Workers(4))
      >>> state.server.backup_params.shape, int(state.server.version)
      ((4, 3), 0)
    """
    delays = delays_lib.Workers(8) if delays is None else delays
    key = jax.random.key(0) if key is None else key
    _, delay_key, _ = _split_key(key)
    return SimState(
        server=server.init(rule, params, delays.num_slots, model_state),
        delay=delays.init(delay_key, n_sync),
        data=DataState(jnp.zeros((delays.num_shards,), jnp.int32)),
        clock=jnp.zeros((), jnp.float32),
    )


def _live_slot(delays, cfg: _Config) -> bool:
    """Whether every update pulls into slot 0 and computes at w_t: SSGD, or a single slot (FixedDelay(0), one worker).
    Then slot 0 always holds w_t bit for bit, so the step reads the live weights and the chunk writes the slot's
    weights once at its end: per update, a copy of the weights into the slot (and one XLA made to protect the slot
    from that write while the gradient read it) would be the only work beyond sequential SGD's."""
    return cfg.mode == "sync" or delays.num_slots == 1


def _step(grad_fn, rule, delays, cfg: _Config, data, data_words, local_lr, state: SimState, step_keys, model_key):
    """One server update. ``step_keys`` are ``fold_in(delay_key, t)`` and, for SSGD, ``fold_in(model_key, t)`` for this
    t (``None`` asynchronously: the pushing worker's key comes from ``model_key``, its pulled version and its id)."""
    k_delay, k_model = step_keys
    t = state.server.version
    push_state = lambda ms: ms if cfg.stateful else None

    if cfg.mode == "async":
        delay_state, event = delays.next(state.delay, t, k_delay, cfg.n_sync)
        if _live_slot(delays, cfg):
            params0, model_state0 = state.server.params, state.server.model_state
        else:
            params0, model_state0 = server.snapshot(state.server, event.push)
        # The worker's model randomness (dropout, augmentation) is keyed by what it knows when it computes: the version
        # it pulled and its id. The trainer's workers do the same, so a replayed trace draws the same masks.
        pulled = server.snapshot_version(state.server, event.push)
        k_model = jax.random.fold_in(jax.random.fold_in(model_key, pulled), event.push)
        ds = state.data
        batches = []
        for _ in range(cfg.n_sync):
            ds, batch = _take(data, data_words, cfg, ds, event.shard)
            batches.append(batch)
        batches = jax.tree.map(lambda *b: jnp.stack(b), *batches)
        payload, model_state, loss, aux = _work(grad_fn, cfg, params0, model_state0, batches, k_model, local_lr)
        srv, staleness = server.push(
            rule, state.server, event.push, payload, push_state(model_state), stale_params=params0
        )  # the snapshot the gradient was computed at, read once
        srv = server.pull(srv, event.pull, weights=not _live_slot(delays, cfg))
        worker, clock, examples = event.push, event.time, cfg.n_sync * cfg.batch_size
    else:
        num = delays.num_slots
        delay_state = state.delay
        ds = state.data
        batches = []
        for _ in range(cfg.n_sync):
            ds, batch = _take_all(data, data_words, cfg, ds)
            batches.append(batch)
        batches = jax.tree.map(lambda *b: jnp.stack(b, axis=1), *batches)  # [M, n_sync, batch, ...]
        params0, model_state0 = state.server.params, state.server.model_state
        keys = jax.random.split(k_model, num)
        payloads, model_states, losses, auxes = jax.vmap(
            lambda b, k: _work(grad_fn, cfg, params0, model_state0, b, k, local_lr)
        )(batches, keys)
        srv, staleness = server.push(rule, state.server, 0, _mean_tree(payloads), push_state(_mean_tree(model_states)))
        srv = server.pull(srv, 0, weights=not _live_slot(delays, cfg))
        loss, aux = losses.mean(), jax.tree.map(jnp.mean, auxes)
        worker = jnp.asarray(-1, jnp.int32)
        clock = state.clock + delays.sync_time(k_delay, cfg.n_sync)
        examples = num * cfg.n_sync * cfg.batch_size

    new = SimState(server=srv, delay=delay_state, data=ds, clock=clock.astype(jnp.float32))
    metrics = {
        "loss": loss.astype(jnp.float32),
        "staleness": staleness.astype(jnp.int32),
        "worker": jnp.asarray(worker, jnp.int32),
        "time": new.clock,
        "epoch": (srv.version.astype(jnp.float32) * examples) / cfg.num_examples,
        **{k: jnp.asarray(v, jnp.float32) for k, v in aux.items()},
    }
    return new, metrics


def _evaluate(eval_fn, state: SimState) -> dict[str, jax.Array]:
    if eval_fn is None:
        return {}
    out = eval_fn(state.server.params, state.server.model_state)
    return {f"eval_{k}": jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _make_chunk(grad_fn, rule_fn, delays_fn, cfg: _Config, eval_fn, length: int):
    """``(state, data, key, hparams, local_lr) -> (state, per-update metrics, evaluation)`` over ``length`` updates.

    ``length`` is static: a loop with a known trip count runs without asking the host whether to go on (on a GPU a
    traced count cost a device-to-host round trip per update), so a run's last, shorter chunk compiles a program of
    its own.
    """

    def chunk(state, data, key, hparams, local_lr):
        rule, delays = rule_fn(hparams), delays_fn(hparams)
        data_key, delay_key, model_key = _split_key(key)
        data_words = order.key_words(data_key)
        # Every update's keys in one vectorised PRNG call per chunk (on CPU each call inside the loop is a rolled
        # loop of its own); identical to folding t in step by step.
        ts = state.server.version + jnp.arange(length, dtype=jnp.int32)
        fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
        step_keys = (fold(delay_key, ts), fold(model_key, ts) if cfg.mode == "sync" else None)
        step = lambda s, k: _step(grad_fn, rule, delays, cfg, data, data_words, local_lr, s, k, model_key)
        state, metrics = jax.lax.scan(step, state, step_keys)
        if _live_slot(delays, cfg):  # the pulls of the chunk recorded versions only: slot 0's weights are w_t
            state = state._replace(server=server.pull(state.server, 0))
        return state, metrics, _evaluate(eval_fn, state)

    return chunk


# --------------------------------------------------------------------------------------------------------------------
# Driving it: chunks, progress, evaluation, checkpoints.
# --------------------------------------------------------------------------------------------------------------------


def _key_fingerprint(keys: jax.Array) -> str:
    return hashlib.sha256(np.asarray(jax.random.key_data(keys)).tobytes()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class _Program:
    """A validated run's compiled pieces: the initial state, chunks of updates, the evaluation."""

    cfg: _Config
    init: Callable  # (keys, hparams) -> SimState
    chunk: Callable  # length -> jitted (state, data, keys, hparams, local_lr) -> (state, metrics, evaluation)
    evaluate: Callable  # state -> evaluation
    evaluates: bool  # an eval_fn was given
    data: Any  # on the device
    local_lr: jax.Array


def _program(loss_fn, rule_fn, params, data, *, hparams, batched, delays_fn, batch_size, num_updates, mode, n_sync,
             push, model_state, local_learning_rate, eval_fn, eval_every, chunk_len=None) -> _Program:  # fmt: skip
    """Validates the arguments (before anything is traced) and builds the run's programs."""
    # The structure (slots, shards, kind) is static, so the first run's delay model describes every run.
    first = jax.tree.map(lambda v: v[0], hparams) if batched else hparams
    delays = delays_fn(first)
    num_examples, shard_size = _validate(
        data,
        delays,
        mode=mode,
        n_sync=n_sync,
        push=push,
        batch_size=batch_size,
        num_updates=num_updates,
        local_learning_rate=local_learning_rate,
        eval_fn=eval_fn,
        eval_every=eval_every,
    )
    stateful = model_state is not None
    chunk_len = chunk_len or eval_every or max(1, min(num_updates, math.ceil(num_updates / 20)))
    cfg = _Config(mode, n_sync, push, batch_size, num_examples, shard_size, stateful, chunk_len)
    grad_fn = jax.value_and_grad(_as_stateful(loss_fn, stateful), has_aux=True)
    model_state = {} if model_state is None else model_state

    def init_one(key, hp):
        return init(rule_fn(hp), params, delays=delays_fn(hp), key=key, n_sync=cfg.n_sync, model_state=model_state)

    @functools.cache  # one program per chunk length: the full chunks', and the last one's if it is shorter
    def chunk(length: int):
        fn = _make_chunk(grad_fn, rule_fn, delays_fn, cfg, eval_fn, length)
        if batched:
            fn = jax.vmap(fn, in_axes=(0, None, 0, 0, None))
        return jax.jit(fn, donate_argnums=0)

    evaluate = lambda s: _evaluate(eval_fn, s)
    return _Program(
        cfg=cfg,
        init=jax.jit(jax.vmap(init_one) if batched else init_one),
        chunk=chunk,
        evaluate=jax.jit(jax.vmap(evaluate) if batched else evaluate),
        evaluates=eval_fn is not None,
        data=jax.tree.map(jnp.asarray, data),
        local_lr=jnp.asarray(0.0 if local_learning_rate is None else local_learning_rate, jnp.float32),
    )


def _run(program: _Program, *, keys, hparams, batched: bool, num_updates, checkpoint_dir, progress, callback,
         description) -> SimulationResult:  # fmt: skip
    cfg, chunk_len, data, local_lr = program.cfg, program.cfg.chunk, program.data, program.local_lr
    init_fn, compiled, evaluate = program.init, program.chunk, program.evaluate
    state = init_fn(keys, hparams)
    chunks: list[dict[str, np.ndarray]] = []
    evals: list[dict[str, np.ndarray]] = []
    done = 0
    axis = 1 if batched else 0  # the update axis of the per-update metrics
    path = None if checkpoint_dir is None else os.path.join(os.fspath(checkpoint_dir), "simulator.npz")
    header = {
        "key": _key_fingerprint(keys),
        "num_updates": num_updates,
        "chunk": chunk_len,
        "config": repr(cfg),
    }
    if path is not None and os.path.exists(path):
        state, arrays, saved = ckpt.load(path, state)
        mismatched = [k for k in header if saved.get(k) != header[k]]
        if mismatched:
            raise ValueError(
                f"Checkpoint {path} was written by a run with different {', '.join(mismatched)}: resume with the "
                "same key and settings, or use another checkpoint_dir."
            )
        done = int(saved["done"])
        metrics = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
        stacked = {k[2:]: v for k, v in arrays.items() if k.startswith("e/")}
        chunks = [metrics] if metrics else []
        n_evals = next(iter(stacked.values())).shape[axis] if stacked else 0
        evals = [{k: np.take(v, i, axis=axis) for k, v in stacked.items()} for i in range(n_evals)]
    if not evals and program.evaluates:
        first = jax.device_get(evaluate(state))
        evals = [first] if first else []

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_updates, initial=done, desc=description, unit="upd", leave=False)
    try:
        while done < num_updates:
            length = min(chunk_len, num_updates - done)
            state, metrics, ev = compiled(length)(state, data, keys, hparams, local_lr)
            chunks.append(jax.device_get(metrics))
            if ev:
                evals.append(jax.device_get(ev))
            done += length
            if path is not None:
                chunks = [_join(chunks, axis)]
                arrays = {f"m/{k}": v for k, v in chunks[0].items()}
                arrays.update({f"e/{k}": v for k, v in _join(evals, axis, stack=True).items()})
                ckpt.save(path, state, arrays, {**header, "done": done})
            if bar is not None:
                bar.update(length)
                bar.set_postfix(loss=f"{float(np.mean(np.take(chunks[-1]['loss'], -1, axis=axis))):.3f}")
            if callback is not None:
                callback(done, state)
    finally:
        if bar is not None:
            bar.close()

    metrics = _join(chunks, axis)
    if evals and evals[0]:
        ev = _join(evals, axis, stack=True)
        updates = np.minimum(np.arange(len(evals)) * chunk_len, num_updates).astype(np.int32)
        shape = next(iter(ev.values())).shape
        metrics.update(ev)
        metrics["eval_update"] = np.broadcast_to(updates, shape).copy()
    return SimulationResult(state.server.params, state.server.model_state, state, metrics)


def _join(parts: Sequence[Mapping[str, np.ndarray]], axis: int, stack: bool = False) -> dict[str, np.ndarray]:
    """Joins per-chunk metrics along the update axis (``stack`` for one scalar per chunk, e.g. evaluations)."""
    if not parts:
        return {}
    join = np.stack if stack else np.concatenate
    return {k: join([np.asarray(p[k]) for p in parts], axis=axis) for k in parts[0]}


def simulate(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    *,
    delays: Any = None,
    batch_size: int = 32,
    num_updates: int = 2_000,
    key: jax.Array | None = None,
    mode: str = "async",
    n_sync: int = 1,
    push: str = "gradients",
    model_state: Any = None,
    local_learning_rate: float | None = None,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
) -> SimulationResult:
    """Simulates asynchronous SGD with a parameter server, deterministically.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; or, when ``model_state`` is given, ``loss_fn(params,
        model_state, batch, key) -> (loss, new_model_state)`` or ``-> (loss, (new_model_state, aux))`` with ``aux`` a
        dict of scalar training metrics (see :func:`asgd_jax.classification_loss`).
      rule: the server's update rule, e.g. :func:`asgd_jax.dc_asgd`.
      params: initial weights w_0 (every backup starts here).
      data: pytree of arrays with a leading example axis, e.g. ``{"x": x, "y": y}``; it is put on the device whole.
      delays: a delay model from :mod:`asgd_jax.delays` (default ``Workers(8)``).
      batch_size: minibatch size of every worker.
      num_updates: server updates (applied pushes) to run; a learning-rate schedule counts these.
      key: the run's key (default ``jax.random.key(0)``); the same key gives identical bits.
      mode: ``"async"`` (ASGD; default) or ``"sync"`` (SSGD: each update averages the M workers' payloads, computed
        at the same weights; needs ``Workers``).
      n_sync: minibatches each worker computes between exchanges (GPU A-SGD).
      push: with ``n_sync > 1``: ``"gradients"`` (local SGD steps, push the summed gradients), ``"delta"`` (local
        steps, push ``w_pulled - w_local``, which the rule treats like a gradient: use a server learning rate of 1 to
        add the delta) or ``"accumulate"`` (sum the gradients at the pulled weights, no local steps).
      model_state: initial non-trained model collections (BatchNorm); selects the stateful ``loss_fn`` form. Workers
        compute with the state they pulled and push their updated state; the server keeps the latest.
      local_learning_rate: step size of the local steps (needed when ``n_sync > 1`` and ``push != "accumulate"``).
      eval_fn: ``eval_fn(params, model_state) -> dict`` of scalars, run on the server's weights at the start and every
        ``eval_every`` updates.
      eval_every: evaluation (and checkpoint / progress) interval; by default the run is cut into about 20 chunks.
      checkpoint_dir: if given, the state is written there atomically after every chunk, and a run started with the
        same arguments resumes from it (bit-identical to an uninterrupted run).
      progress: show a progress bar.
      callback: ``callback(updates_done, state)`` called after every chunk (e.g. to log or stop early by raising).

    Returns:
      A :class:`SimulationResult`.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> result = asgd_jax.simulate(loss, asgd_jax.dc_asgd(0.1, lam=0.5), jnp.zeros(3), data,
      ...                            delays=asgd_jax.delays.Workers(4), num_updates=200, progress=False)
      >>> result.params.round(2)
      Array([ 1. , -2. ,  0.5], dtype=float32)
      >>> int(result.metrics["staleness"].max()) > 0
      True
    """
    delays = delays_lib.Workers(8) if delays is None else delays
    key = jax.random.key(0) if key is None else key
    program = _program(
        loss_fn, lambda _: rule, params, data, hparams={}, batched=False, delays_fn=lambda _: delays,
        batch_size=batch_size, num_updates=num_updates, mode=mode, n_sync=n_sync, push=push, model_state=model_state,
        local_learning_rate=local_learning_rate, eval_fn=eval_fn, eval_every=eval_every,
    )  # fmt: skip
    return _run(program, keys=key, hparams={}, batched=False, num_updates=num_updates, checkpoint_dir=checkpoint_dir,
                progress=progress, callback=callback, description="simulate")  # fmt: skip


def lower(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    *,
    delays: Any = None,
    batch_size: int = 32,
    num_updates: int = 2_000,
    key: jax.Array | None = None,
    mode: str = "async",
    n_sync: int = 1,
    push: str = "gradients",
    model_state: Any = None,
    local_learning_rate: float | None = None,
    length: int | None = None,
) -> jax.stages.Lowered:
    """The program :func:`simulate` compiles for a chunk of ``length`` updates, lowered, for inspection.

    Takes :func:`simulate`'s arguments; ``length`` defaults to the chunk ``simulate`` would use. The program is
    ``(state, data, key, hparams, local_lr) -> (state, metrics, evaluation)`` with the state donated; ``.compile()``
    gives its optimised HLO (``.as_text()``), cost and memory analyses, so one can check what an update costs (see
    ARCHITECTURE.md, "What a step costs").

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> data = {"x": jnp.ones((256, 3)), "y": jnp.ones(256)}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> lowered = asgd_jax.simulator.lower(loss, asgd_jax.asgd(0.1), jnp.zeros(3), data, length=5)
      >>> lowered.args_info[0][0].server.backup_params.shape  # Workers(8): one backup per worker
      (8, 3)
    """
    delays = delays_lib.Workers(8) if delays is None else delays
    key = jax.random.key(0) if key is None else key
    program = _program(
        loss_fn, lambda _: rule, params, data, hparams={}, batched=False, delays_fn=lambda _: delays,
        batch_size=batch_size, num_updates=num_updates, mode=mode, n_sync=n_sync, push=push, model_state=model_state,
        local_learning_rate=local_learning_rate, eval_fn=None, eval_every=None,
        chunk_len=None if length is None else _positive_int("length", length),
    )  # fmt: skip
    state = jax.eval_shape(program.init, key, {})
    return program.chunk(program.cfg.chunk).lower(state, program.data, key, {}, program.local_lr)


def sweep(
    loss_fn: Callable,
    rule_fn: Callable[[Mapping[str, jax.Array]], optax.GradientTransformation],
    params: Any,
    data: Any,
    *,
    keys: jax.Array,
    hparams: Mapping[str, Any] | None = None,
    delays: Any = None,
    batch_size: int = 32,
    num_updates: int = 2_000,
    mode: str = "async",
    n_sync: int = 1,
    push: str = "gradients",
    model_state: Any = None,
    local_learning_rate: float | None = None,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
) -> SimulationResult:
    """Runs R simulations as one compiled program, vmapped over keys and hyperparameters.

    Everything that shapes the program (workers, batch size, n_sync, mode) is shared; what varies per run is the key
    and the numeric hyperparameters, from which ``rule_fn`` builds each run's rule and, if ``delays`` is a function,
    each run's delay model (traced, so no Python branching on them). Run r equals
    ``simulate(..., rule=rule_fn(hparams[r]), key=keys[r])`` to float tolerance. :func:`grid` builds ``keys`` and
    ``hparams`` for a Cartesian product.

    Args:
      loss_fn: as in :func:`simulate`.
      rule_fn: ``rule_fn(hparams) -> rule`` for one run's hyperparameters (a dict of scalars).
      params: initial weights, shared by all runs.
      data: as in :func:`simulate`, shared.
      keys: ``[R]`` keys, one per run.
      hparams: dict of ``[R]`` arrays (default: none).
      delays: a delay model shared by all runs, or ``delays(hparams) -> model`` to vary its numeric parameters per run
        (e.g. ``lambda h: Workers(8, straggler_prob=h["p"])``); its structure (worker count, kind) must not vary.
      **rest: as in :func:`simulate`.

    Returns:
      A :class:`SimulationResult` whose arrays have a leading run axis ``R``.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.0, 0.5])
      >>> result = asgd_jax.sweep(loss, lambda h: asgd_jax.dc_asgd(0.1, h["lam"]), jnp.zeros(3), data,
      ...                         keys=keys, hparams=hp, num_updates=100, progress=False)
      >>> result.params.shape, result.metrics["loss"].shape
      ((4, 3), (4, 100))
    """
    delays = delays_lib.Workers(8) if delays is None else delays
    delays_fn = delays if callable(delays) and not hasattr(delays, "num_slots") else (lambda _: delays)
    hparams = {} if hparams is None else {k: jnp.asarray(v) for k, v in hparams.items()}
    num_runs = int(np.shape(keys)[0]) if np.ndim(keys) else 0
    if num_runs < 1:
        raise ValueError("keys must be a 1-D array of keys, one per run (see asgd_jax.grid).")
    for name, value in hparams.items():
        if np.shape(value)[:1] != (num_runs,):
            raise ValueError(
                f"hparams[{name!r}] has shape {np.shape(value)}: give one value per run, a leading axis of {num_runs}."
            )
    program = _program(
        loss_fn, rule_fn, params, data, hparams=hparams, batched=True, delays_fn=delays_fn, batch_size=batch_size,
        num_updates=num_updates, mode=mode, n_sync=n_sync, push=push, model_state=model_state,
        local_learning_rate=local_learning_rate, eval_fn=eval_fn, eval_every=eval_every,
    )  # fmt: skip
    return _run(program, keys=keys, hparams=hparams, batched=True, num_updates=num_updates,
                checkpoint_dir=checkpoint_dir, progress=progress, callback=callback,
                description=f"sweep x{num_runs}")  # fmt: skip


def grid(*, seeds: Sequence[int], **values: Sequence[float]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The Cartesian product of seeds and hyperparameter values, as ``(keys, hparams)`` for :func:`sweep`.

    Runs are ordered with the seed varying slowest.

    Example:
      >>> import asgd_jax
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.5, 1.0, 2.0])
      >>> keys.shape, hp["lam"].tolist()
      ((6,), [0.5, 1.0, 2.0, 0.5, 1.0, 2.0])
    """
    if not seeds:
        raise ValueError("seeds is empty: give at least one seed.")
    names = list(values)
    rows = list(itertools.product(list(seeds), *(list(values[n]) for n in names)))
    keys = jax.vmap(jax.random.key)(jnp.asarray([r[0] for r in rows], jnp.uint32))
    hparams = {n: jnp.asarray([r[i + 1] for r in rows], jnp.float32) for i, n in enumerate(names)}
    return keys, hparams
