"""The deterministic staleness simulator: asynchronous training replayed exactly, many runs at once.

The simulator is an ``init`` / ``step`` state machine over server updates. The delay model decides each update's
:class:`~asgd_jax.delays.Event` and the data order its minibatch, neither from the weights, so a chunk of updates first
computes this schedule for all of them; each step then lets the pushing worker compute its payload at the snapshot it
pulled (its gradient only depends on that snapshot and its next minibatch, so it is computed when it lands), applies
the push with :func:`asgd_jax.server.push` and records the pull with :func:`asgd_jax.server.pull`. :func:`simulate`
scans the step in chunks: between chunks it evaluates, updates the progress bar and writes a checkpoint.
:func:`sweep` vmaps the same program over keys and hyperparameters, so a grid of runs compiles once.

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
import itertools
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import checkpoint as ckpt
from asgd_jax import delays as delays_lib
from asgd_jax import errors, exchange, order, server
from asgd_jax.exchange import Exchange

__all__ = ["SimState", "SimulationResult", "grid", "init", "lower", "shard_indices", "simulate", "sweep"]

NONFINITE = ("warn", "stop", "ignore")


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
class _Spec:
    """A run's settings as :func:`simulate` takes them (one record instead of a wall of arguments)."""

    batch_size: int = 32
    num_updates: int = 2_000
    mode: str = "async"
    n_sync: int = 1
    push: str = "gradients"
    local_learning_rate: float | None = None
    eval_every: int | None = None
    on_nonfinite: str = "warn"
    chunk: int | None = None  # updates per compiled chunk (default: eval_every, or about a twentieth of the run)

    def chunk_length(self) -> int:
        return self.chunk or self.eval_every or max(1, min(self.num_updates, math.ceil(self.num_updates / 20)))


# --------------------------------------------------------------------------------------------------------------------
# Validation: every mistake a user can make is reported here, before anything is traced or compiled.
# --------------------------------------------------------------------------------------------------------------------


def _validate(spec: _Spec, delays, data, loss: exchange.Loss, params, model_state, eval_fn) -> Exchange:
    """The run's exchange period, once every argument has been checked."""
    errors.positive_int("num_updates", spec.num_updates)
    errors.choice("on_nonfinite", spec.on_nonfinite, NONFINITE)
    if spec.eval_every is not None:
        errors.positive_int("eval_every", spec.eval_every)
        if eval_fn is None:
            raise errors.ConfigError("eval_every was given without eval_fn: pass eval_fn(params, model_state) -> dict.")
    if not all(hasattr(delays, a) for a in ("num_slots", "num_shards", "init", "next")):
        raise errors.ConfigError(
            f"delays={delays!r} is not a delay model: use one of asgd_jax.delays.Workers, Trace, FixedDelay, "
            "RandomDelay."
        )
    if spec.mode == "sync" and not isinstance(delays, delays_lib.Workers):
        raise errors.ConfigError(
            f"mode='sync' (SSGD) needs delays=asgd_jax.delays.Workers(M), not {type(delays).__name__}: a barrier "
            "round averages the M workers' gradients."
        )
    if isinstance(delays, delays_lib.Trace) and len(delays) < spec.num_updates:
        raise errors.ConfigError(
            f"num_updates={spec.num_updates} but the trace holds only {len(delays)} pushes: lower num_updates or give "
            "a longer trace."
        )
    ex = exchange.validate(
        loss,
        data,
        params,
        model_state,
        delays.num_shards,
        mode=spec.mode,
        n_sync=spec.n_sync,
        push=spec.push,
        batch_size=spec.batch_size,
        local_learning_rate=spec.local_learning_rate,
    )
    return ex


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
    return order.shard_indices(exchange.split_key(key)[0], epoch, num_examples=num_examples, num_shards=num_shards)


def _batch_indices(data_words: jax.Array, ex: Exchange, shard: jax.Array, taken: jax.Array) -> jax.Array:
    """Example indices of shard ``shard``'s ``taken``-th minibatch, ``[..., batch]`` for int arrays ``shard`` and
    ``taken`` of one shape (each minibatch in its own epoch)."""
    per_epoch = ex.shard_size // ex.batch_size
    epoch, k = taken // per_epoch, taken % per_epoch
    start = shard * ex.shard_size + k * ex.batch_size
    positions = start[..., None] + jnp.arange(ex.batch_size, dtype=jnp.int32).reshape((1,) * start.ndim + (-1,))
    return order.example_index(data_words, epoch, positions, ex.num_examples)


# --------------------------------------------------------------------------------------------------------------------
# The state machine.
# --------------------------------------------------------------------------------------------------------------------


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
    _, delay_key, _ = exchange.split_key(key)
    return SimState(
        server=server.init(rule, params, delays.num_slots, model_state),
        delay=delays.init(delay_key, n_sync),
        data=DataState(jnp.zeros((delays.num_shards,), jnp.int32)),
        clock=jnp.zeros((), jnp.float32),
    )


def _live_slot(rule, delays, ex: Exchange) -> bool:
    """Whether every update pulls into slot 0 and computes at w_t: SSGD, or a single slot (FixedDelay(0), one worker),
    with a rule that sends the weights as they are (a pull-side rule's backup is its look-ahead, not w_t).
    Then slot 0 always holds w_t bit for bit, so the step reads the live weights and the chunk writes the slot's
    weights once at its end: per update, a copy of the weights into the slot (and one XLA made to protect the slot
    from that write while the gradient read it) would be the only work beyond sequential SGD's."""
    return (ex.mode == "sync" or delays.num_slots == 1) and not server.has_pull(rule)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """What every update of a chunk shares (closed over by the step)."""

    grad_fn: Callable
    rule: optax.GradientTransformation
    delays: Any
    ex: Exchange
    data: Any
    data_words: jax.Array
    local_lr: jax.Array
    model_key: jax.Array


class _Schedule(NamedTuple):
    """A chunk's updates as the delay model and the data order decide them, one row per update.

    None of it depends on the weights, so the chunk computes all of it before its first gradient
    (:func:`_async_schedule`, :func:`_sync_schedule`): the update loop then holds no data-order walk and no delay
    draw, only the gradient and the server step (on a GPU a loop inside the update loop without a known trip count
    asks the host whether to go on, once per update).
    """

    push_slot: jax.Array  # int32: the pushing slot (0 for an SSGD round)
    pull_slot: jax.Array  # int32
    worker: jax.Array  # int32: the pushing worker, -1 for an SSGD round
    time: jax.Array  # float32: the virtual clock after the update
    indices: jax.Array  # int32 example indices: [n_sync, batch], or [M, n_sync, batch] for an SSGD round
    # An SSGD round's key, fold_in(model_key, t); None asynchronously: a pusher's key comes from the version it pulled,
    # which the server's own record says (server.snapshot_version), in the update.
    round_key: jax.Array | None


def _async_schedule(c: _Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array):
    """The chunk's events and minibatches: ``(schedule, delay state, data state)`` after its last update."""
    n_sync = c.ex.n_sync

    def one(carry, xs):
        delay_state, taken = carry
        t, k = xs
        delay_state, event = c.delays.next(delay_state, t, k, n_sync)
        counters = taken[event.shard] + jnp.arange(n_sync, dtype=jnp.int32)
        return (delay_state, taken.at[event.shard].add(n_sync)), (event, counters)

    (delay_state, taken), (events, counters) = jax.lax.scan(one, (state.delay, state.data.taken), (ts, k_delays))
    schedule = _Schedule(
        push_slot=events.push_slot,
        pull_slot=events.pull_slot,
        worker=events.push_slot,
        time=events.time.astype(jnp.float32),
        indices=_batch_indices(c.data_words, c.ex, jnp.broadcast_to(events.shard[:, None], counters.shape), counters),
        round_key=None,
    )
    return schedule, delay_state, DataState(taken)


def _sync_schedule(c: _Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array):
    """SSGD rounds: every shard's next ``n_sync`` minibatches per round (the shards move in lock-step) and the
    clock advanced by the slowest worker, round by round."""
    length, n_sync, num = ts.shape[0], c.ex.n_sync, c.delays.num_slots

    def tick(clock, k):
        clock = (clock + c.delays.sync_time(k, n_sync)).astype(jnp.float32)
        return clock, clock

    _, times = jax.lax.scan(tick, state.clock, k_delays)
    rounds = (
        jnp.arange(length, dtype=jnp.int32)[:, None, None] * n_sync + jnp.arange(n_sync, dtype=jnp.int32)[None, None]
    )
    counters = state.data.taken[None, :, None] + rounds  # [length, M, n_sync]
    shards = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32)[None, :, None], counters.shape)
    zeros = jnp.zeros((length,), jnp.int32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(c.model_key, ts)
    indices = _batch_indices(c.data_words, c.ex, shards, counters)
    schedule = _Schedule(
        push_slot=zeros, pull_slot=zeros, worker=zeros - 1, time=times, indices=indices, round_key=keys
    )
    return schedule, state.delay, DataState(state.data.taken + length * n_sync)


def _async_update(c: _Ctx, srv: server.ServerState, x: _Schedule):
    """The scheduled push: that worker's payload at its snapshot, applied; then its pull."""
    ex, live = c.ex, _live_slot(c.rule, c.delays, c.ex)
    if live:
        params0, model_state0 = srv.params, srv.model_state
    else:
        params0, model_state0 = server.snapshot(srv, x.push_slot)
    # The worker's model randomness (dropout, augmentation) is keyed by what it knows when it computes: the version
    # it pulled and its id. The trainer's workers do the same, so a replayed trace draws the same masks.
    pulled = server.snapshot_version(srv, x.push_slot)
    k_model = jax.random.fold_in(jax.random.fold_in(c.model_key, pulled), x.push_slot)
    batches = jax.tree.map(lambda a: a[x.indices], c.data)  # [n_sync, batch, ...]
    payload, model_state, loss, aux = exchange.work(c.grad_fn, ex, params0, model_state0, batches, k_model, c.local_lr)
    srv, staleness = server.exchange(
        c.rule,
        srv,
        x.push_slot,
        payload,
        model_state if ex.stateful else None,
        pull_slot=x.pull_slot,
        stale_params=params0,  # the snapshot the gradient was computed at, read once
        pull_weights=not live,
    )
    return srv, (loss, aux, staleness, ex.n_sync * ex.batch_size)


def _sync_update(c: _Ctx, srv: server.ServerState, x: _Schedule):
    """An SSGD round: every worker's payload at w_t, their mean applied once (as worker 0)."""
    ex, num = c.ex, c.delays.num_slots
    batches = jax.tree.map(lambda a: a[x.indices], c.data)  # [M, n_sync, batch, ...]
    live = _live_slot(c.rule, c.delays, ex)
    if live:
        params0, model_state0 = srv.params, srv.model_state
    else:  # a pull-side rule: every worker computes at what slot 0's pull sent
        params0, model_state0 = server.snapshot(srv, 0)
    payloads, model_states, losses, auxes = jax.vmap(
        lambda b, k: exchange.work(c.grad_fn, ex, params0, model_state0, b, k, c.local_lr)
    )(batches, jax.random.split(x.round_key, num))
    mean_state = exchange.mean_tree(model_states) if ex.stateful else None
    # Every payload was computed at params0: slot 0's snapshot (the live weights w_t, see _live_slot).
    srv, staleness = server.exchange(
        c.rule, srv, 0, exchange.mean_tree(payloads), mean_state, stale_params=params0, pull_weights=not live
    )
    aux = jax.tree.map(jnp.mean, auxes)
    return srv, (losses.mean(), aux, staleness, num * ex.n_sync * ex.batch_size)


def _step(c: _Ctx, srv: server.ServerState, x: _Schedule):
    """One server update, as the chunk's schedule row ``x`` says."""
    update = _async_update if c.ex.mode == "async" else _sync_update
    srv, (loss, aux, staleness, examples) = update(c, srv, x)
    metrics = {
        "loss": loss.astype(jnp.float32),
        "staleness": staleness.astype(jnp.int32),
        "worker": x.worker,
        "time": x.time,
        "epoch": (srv.version.astype(jnp.float32) * examples) / c.ex.num_examples,
        **{k: jnp.asarray(v, jnp.float32) for k, v in aux.items()},
    }
    return srv, metrics


def _evaluate(eval_fn, state: SimState) -> dict[str, jax.Array]:
    if eval_fn is None:
        return {}
    out = eval_fn(state.server.params, state.server.model_state)
    return {f"eval_{k}": jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _make_chunk(grad_fn, rule_fn, delays_fn, ex: Exchange, eval_fn, length: int):
    """``(state, data, key, hparams, local_lr) -> (state, per-update metrics, evaluation)`` over ``length`` updates.

    ``length`` is static: a loop with a known trip count runs without asking the host whether to go on (on a GPU a
    traced count cost a device-to-host round trip per update), so a run's last, shorter chunk compiles a program of
    its own.
    """

    def chunk(state, data, key, hparams, local_lr):
        rule, delays = rule_fn(hparams), delays_fn(hparams)
        data_key, delay_key, model_key = exchange.split_key(key)
        c = _Ctx(grad_fn, rule, delays, ex, data, order.key_words(data_key), local_lr, model_key)
        # Every update's delay key in one vectorised PRNG call per chunk (on CPU each call inside the loop is a
        # rolled loop of its own); identical to folding t in step by step.
        ts = state.server.version + jnp.arange(length, dtype=jnp.int32)
        k_delays = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(delay_key, ts)
        schedule_fn = _async_schedule if ex.mode == "async" else _sync_schedule
        schedule, delay_state, data_state = schedule_fn(c, state, ts, k_delays)
        srv, metrics = jax.lax.scan(lambda s, x: _step(c, s, x), state.server, schedule)
        if _live_slot(rule, delays, ex):  # the pulls of the chunk recorded versions only: slot 0's weights are w_t
            srv = server.pull(srv, 0)
        state = SimState(server=srv, delay=delay_state, data=data_state, clock=schedule.time[-1])
        return state, metrics, _evaluate(eval_fn, state)

    return chunk


# --------------------------------------------------------------------------------------------------------------------
# Driving it: chunks, progress, evaluation, checkpoints.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Program:
    """A validated run's compiled pieces: the initial state, chunks of updates, the evaluation."""

    spec: _Spec
    ex: Exchange
    init: Callable  # (keys, hparams) -> SimState
    chunk: Callable  # length -> jitted (state, data, keys, hparams, local_lr) -> (state, metrics, evaluation)
    evaluate: Callable  # state -> evaluation
    evaluates: bool  # an eval_fn was given
    data: Any  # on the device
    local_lr: jax.Array

    def config_repr(self) -> str:
        """The run's static configuration as the checkpoint header has always written it (so earlier checkpoints
        still resume)."""
        ex = self.ex
        return (
            f"_Config(mode={ex.mode!r}, n_sync={ex.n_sync}, push={ex.push!r}, batch_size={ex.batch_size}, "
            f"num_examples={ex.num_examples}, shard_size={ex.shard_size}, stateful={ex.stateful}, "
            f"chunk={self.spec.chunk_length()})"
        )


def _program(
    loss: exchange.Loss, rule_fn, params, data, spec: _Spec, *, delays_fn, hparams, batched: bool, model_state, eval_fn
) -> _Program:
    """Validates the arguments (before anything is traced) and builds the run's programs."""
    # The structure (slots, shards, kind) is static, so the first run's delay model describes every run.
    first = jax.tree.map(lambda v: v[0], hparams) if batched else hparams
    ex = _validate(spec, delays_fn(first), data, loss, params, model_state, eval_fn)
    grad_fn = jax.value_and_grad(loss.normalized(), has_aux=True)
    model_state = {} if model_state is None else model_state

    def init_one(key, hp):
        return init(rule_fn(hp), params, delays=delays_fn(hp), key=key, n_sync=ex.n_sync, model_state=model_state)

    @functools.cache  # one program per chunk length: the full chunks', and the last one's if it is shorter
    def chunk(length: int):
        fn = _make_chunk(grad_fn, rule_fn, delays_fn, ex, eval_fn, length)
        if batched:
            fn = jax.vmap(fn, in_axes=(0, None, 0, 0, None))
        return jax.jit(fn, donate_argnums=0)

    evaluate = lambda s: _evaluate(eval_fn, s)
    local_lr = 0.0 if spec.local_learning_rate is None else spec.local_learning_rate
    return _Program(
        spec=spec,
        ex=ex,
        init=jax.jit(jax.vmap(init_one) if batched else init_one),
        chunk=chunk,
        evaluate=jax.jit(jax.vmap(evaluate) if batched else evaluate),
        evaluates=eval_fn is not None,
        data=jax.tree.map(jnp.asarray, data),
        local_lr=jnp.asarray(local_lr, jnp.float32),
    )


@dataclasses.dataclass
class _Progress:
    """What a run has done so far: updates, per-chunk metrics and evaluations (host arrays)."""

    done: int = 0
    chunks: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    evals: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)


def _resume(path: str, state: SimState, header: dict[str, Any], axis: int) -> tuple[SimState, _Progress]:
    state, arrays, saved = ckpt.load(path, state)
    mismatched = [k for k in header if saved.get(k) != header[k]]
    if mismatched:
        raise errors.ConfigError(
            f"Checkpoint {path} was written by a run with different {', '.join(mismatched)}: resume with the "
            "same key and settings, or use another checkpoint_dir."
        )
    metrics = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    stacked = {k[2:]: v for k, v in arrays.items() if k.startswith("e/")}
    n_evals = next(iter(stacked.values())).shape[axis] if stacked else 0
    evals = [{k: np.take(v, i, axis=axis) for k, v in stacked.items()} for i in range(n_evals)]
    return state, _Progress(int(saved["done"]), [metrics] if metrics else [], evals)


def _progress_note(last_losses: np.ndarray) -> dict[str, str]:
    """The progress bar's note: the last loss (a sweep's median over its runs) and how many runs diverged."""
    losses = np.atleast_1d(last_losses)
    finite = losses[np.isfinite(losses)]
    note = {"loss": f"{float(np.median(finite)):.3f}" if finite.size else "nan"}
    if finite.size < losses.size:
        note["diverged"] = f"{losses.size - finite.size}/{losses.size}"
    return note


def _check_finite(metrics: dict[str, np.ndarray], done: int, policy: str, warned: list[bool]) -> None:
    """Warns (once) or stops when a chunk's training loss is NaN or Inf: a diverging run says so."""
    losses = np.asarray(metrics["loss"])
    bad = ~np.isfinite(losses)
    if policy == "ignore" or not bad.any():
        return
    per_update = bad.reshape(-1, bad.shape[-1]).any(axis=0)  # any run of a sweep
    first = done - losses.shape[-1] + int(np.argmax(per_update))
    message = (
        f"the training loss is NaN or Inf from update {first + 1} on: the run diverged (lower the learning "
        "rate, check the data and the initial weights)"
    )
    if policy == "stop":
        raise FloatingPointError(message + "; stopped (on_nonfinite='stop').")
    if not warned[0]:
        warnings.warn(message + ".", RuntimeWarning, stacklevel=4)
        warned[0] = True


def _run(
    program: _Program, *, keys, hparams, batched: bool, checkpoint_dir, progress, callback, description
) -> SimulationResult:
    spec, chunk_len, axis = program.spec, program.spec.chunk_length(), (1 if batched else 0)
    state = program.init(keys, hparams)
    path = None if checkpoint_dir is None else os.path.join(os.fspath(checkpoint_dir), "simulator.npz")
    header = {
        "key": exchange.key_fingerprint(keys),
        "num_updates": spec.num_updates,
        "chunk": chunk_len,
        "config": program.config_repr(),
    }
    so_far = _Progress()
    if path is not None and os.path.exists(path):
        state, so_far = _resume(path, state, header, axis)
    if not so_far.evals and program.evaluates:
        first = jax.device_get(program.evaluate(state))
        so_far.evals = [first] if first else []
    bar = _bar(progress, spec.num_updates, so_far.done, description)
    warned = [False]
    try:
        while so_far.done < spec.num_updates:
            length = min(chunk_len, spec.num_updates - so_far.done)
            state, metrics, ev = program.chunk(length)(state, program.data, keys, hparams, program.local_lr)
            so_far.chunks.append(jax.device_get(metrics))
            so_far.evals += [jax.device_get(ev)] if ev else []
            so_far.done += length
            _check_finite(so_far.chunks[-1], so_far.done, spec.on_nonfinite, warned)
            if path is not None:
                so_far.chunks = [_join(so_far.chunks, axis)]
                arrays = {f"m/{k}": v for k, v in so_far.chunks[0].items()}
                arrays.update({f"e/{k}": v for k, v in _join(so_far.evals, axis, stack=True).items()})
                ckpt.save(path, state, arrays, {**header, "done": so_far.done})
            if bar is not None:
                bar.update(length)
                bar.set_postfix(_progress_note(np.take(so_far.chunks[-1]["loss"], -1, axis=axis)))
            if callback is not None:
                callback(so_far.done, state)
    finally:
        if bar is not None:
            bar.close()
    return SimulationResult(state.server.params, state.server.model_state, state, _metrics(so_far, spec, axis))


def _bar(progress: bool, total: int, initial: int, description: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=description, unit="upd", leave=False)


def _metrics(so_far: _Progress, spec: _Spec, axis: int) -> dict[str, np.ndarray]:
    metrics = _join(so_far.chunks, axis)
    if so_far.evals and so_far.evals[0]:
        ev = _join(so_far.evals, axis, stack=True)
        updates = np.minimum(np.arange(len(so_far.evals)) * spec.chunk_length(), spec.num_updates).astype(np.int32)
        shape = next(iter(ev.values())).shape
        metrics.update(ev)
        metrics["eval_update"] = np.broadcast_to(updates, shape).copy()
    return metrics


def _join(parts: Sequence[Mapping[str, np.ndarray]], axis: int, stack: bool = False) -> dict[str, np.ndarray]:
    """Joins per-chunk metrics along the update axis (``stack`` for one scalar per chunk, e.g. evaluations)."""
    if not parts:
        return {}
    join = np.stack if stack else np.concatenate
    return {k: join([np.asarray(p[k]) for p in parts], axis=axis) for k in parts[0]}


def _one_run(loss_fn, rule, params, data, spec: _Spec, delays, model_state, has_aux: bool, eval_fn) -> _Program:
    """The program of one run (what :func:`simulate` runs and :func:`lower` shows): no hyperparameters traced."""
    delays = delays_lib.Workers(8) if delays is None else delays
    loss = exchange.as_loss(loss_fn, has_model_state=model_state is not None, has_aux=has_aux)
    return _program(
        loss,
        lambda _: rule,
        params,
        data,
        spec,
        delays_fn=lambda _: delays,
        hparams={},
        batched=False,
        model_state=model_state,
        eval_fn=eval_fn,
    )


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
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
) -> SimulationResult:
    """Simulates asynchronous SGD with a parameter server, deterministically.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; with ``model_state`` given, ``loss_fn(params, model_state,
        batch, key) -> (loss, new_model_state)``; with ``has_aux=True`` the loss comes with a dict of scalar training
        metrics (``(loss, aux)``, or ``(loss, (new_model_state, aux))``). An :class:`asgd_jax.exchange.Loss` declares
        its own form (:func:`asgd_jax.classification_loss` returns one). A loss that does not return what its form
        says is reported before anything compiles.
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
      model_state: initial non-trained model collections (BatchNorm); declares the stateful ``loss_fn`` form. Workers
        compute with the state they pulled and push their updated state; the server keeps the latest.
      local_learning_rate: step size of the local steps (needed when ``n_sync > 1`` and ``push != "accumulate"``).
      has_aux: the loss returns auxiliary training metrics (see ``loss_fn``).
      eval_fn: ``eval_fn(params, model_state) -> dict`` of scalars, run on the server's weights at the start and every
        ``eval_every`` updates.
      eval_every: evaluation (and checkpoint / progress) interval; by default the run is cut into about 20 chunks.
      on_nonfinite: when the training loss turns NaN or Inf: ``"warn"`` (once; default), ``"stop"`` (raise
        ``FloatingPointError`` after that chunk) or ``"ignore"``.
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
    key = jax.random.key(0) if key is None else key
    spec = _Spec(batch_size, num_updates, mode, n_sync, push, local_learning_rate, eval_every, on_nonfinite)
    program = _one_run(loss_fn, rule, params, data, spec, delays, model_state, has_aux, eval_fn)
    return _run(
        program,
        keys=key,
        hparams={},
        batched=False,
        checkpoint_dir=checkpoint_dir,
        progress=progress,
        callback=callback,
        description="simulate",
    )


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
    has_aux: bool = False,
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
    key = jax.random.key(0) if key is None else key
    length = None if length is None else errors.positive_int("length", length)
    spec = _Spec(batch_size, num_updates, mode, n_sync, push, local_learning_rate, chunk=length)
    program = _one_run(loss_fn, rule, params, data, spec, delays, model_state, has_aux, None)
    state = jax.eval_shape(program.init, key, {})
    return program.chunk(spec.chunk_length()).lower(state, program.data, key, {}, program.local_lr)


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
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
    description: str | None = None,
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
      description: the progress bar's label (default ``"sweep xR"``).
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
        raise errors.ConfigError("keys must be a 1-D array of keys, one per run (see asgd_jax.grid).")
    for name, value in hparams.items():
        if np.shape(value)[:1] != (num_runs,):
            raise errors.ConfigError(
                f"hparams[{name!r}] has shape {np.shape(value)}: give one value per run, a leading axis of {num_runs}."
            )
    spec = _Spec(batch_size, num_updates, mode, n_sync, push, local_learning_rate, eval_every, on_nonfinite)
    loss = exchange.as_loss(loss_fn, has_model_state=model_state is not None, has_aux=has_aux)
    program = _program(
        loss,
        rule_fn,
        params,
        data,
        spec,
        delays_fn=delays_fn,
        hparams=hparams,
        batched=True,
        model_state=model_state,
        eval_fn=eval_fn,
    )
    return _run(
        program,
        keys=keys,
        hparams=hparams,
        batched=True,
        checkpoint_dir=checkpoint_dir,
        progress=progress,
        callback=callback,
        description=description or f"sweep x{num_runs}",
    )


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
        raise errors.ConfigError("seeds is empty: give at least one seed.")
    names = list(values)
    rows = list(itertools.product(list(seeds), *(list(values[n]) for n in names)))
    keys = jax.vmap(jax.random.key)(jnp.asarray([r[0] for r in rows], jnp.uint32))
    hparams = {n: jnp.asarray([r[i + 1] for r in rows], jnp.float32) for i, n in enumerate(names)}
    return keys, hparams
