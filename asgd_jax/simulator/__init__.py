"""The deterministic staleness simulator: asynchronous training replayed exactly, many runs at once.

The simulator is an ``init`` / ``step`` state machine over server updates. The delay model decides each update's
:class:`~asgd_jax.delays.Event` and the data order its minibatch, neither from the weights, so a chunk of updates first
computes this schedule for all of them; each step then lets the pushing worker compute its payload at the snapshot it
pulled (its gradient only depends on that snapshot and its next minibatch, so it is computed when it lands), applies
the push with :func:`asgd_jax.server.push` and records the pull with :func:`asgd_jax.server.pull`. :func:`simulate`
scans the step in chunks: between chunks it evaluates, updates the progress bar and writes a checkpoint.
:func:`sweep` vmaps the same program over keys and hyperparameters, so a grid of runs compiles once.

Compiled once per structure: a run is described by a :class:`asgd_jax.Plan`, and its programs are cached across calls,
keyed on what shapes them (the plan's structure, the loss, the rule's structure, the shapes and dtypes of the weights
and the data). Everything numeric is an argument: the initial weights, the key, the rule's numbers (a rule built by
one of :mod:`asgd_jax.rules`' factories, see :mod:`asgd_jax.recipes`), the delay model's numbers, ``local_lr`` and the
budget. A run compiles two programs: its start (the initial state) and its chunk of ``plan.chunk_length`` updates; a
run whose budget is not a whole number of chunks also compiles (once, for any length) the program that runs its last,
shorter part. With an ``eval_fn``, the evaluation is a program of its own, keyed by the eval_fn and the weights' shapes
only: runs of other rules, clusters and plans on the same model share it. A rule that is a closure of its own is keyed
by identity: build it once.

Randomness: the run's key is split into data, delay and model keys; update t draws its delay with
``fold_in(delay_key, t)``. The model's randomness (dropout, augmentation) of the worker w that pushes at t uses
``fold_in(fold_in(model_key, v), w)``, v the version w pulled (asynchronous), or splits ``fold_in(model_key, t)`` over
the workers (SSGD): what the trainer's workers know too, so its traces replay with dropout. The same call gives the
same bits, and a run resumed from a checkpoint continues exactly where it stopped. Row r of a sweep of R >= 2 runs does
not depend on the other runs or on R; a single run (``simulate``, or a sweep of one) is compiled without the run axis,
which XLA may reduce in another order: it agrees with the sweep's row to float rounding, not bit for bit.

Data: worker (shard) s draws minibatches from its own shard. A shard's j-th batch belongs to its epoch ``j // K``; in
epoch e the shards are consecutive slices of one keyed random permutation of the data (:mod:`asgd_jax.order`), so in
every epoch the shards are disjoint and the data is re-partitioned randomly across workers, as in DC-ASGD.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asgd_jax import checkpoint as ckpt
from asgd_jax import delays as delays_lib
from asgd_jax import errors, exchange, interrupts, order, recipes, server
from asgd_jax import loss as loss_lib
from asgd_jax.exchange import Exchange
from asgd_jax.plan import Plan

__all__ = [
    "Prepared",
    "RecompileWarning",
    "RunKeys",
    "SimState",
    "SimulationResult",
    "clear_cache",
    "grid",
    "init",
    "lower",
    "prepare_sweep",
    "shard_indices",
    "simulate",
    "sweep",
]

NONFINITE = ("warn", "stop", "ignore")
PROGRAM_NAMES = ("simulator_start", "simulator_chunk", "simulator_tail", "simulator_eval")
"""The names the simulator's compiled programs carry (in ``jax_log_compiles`` and :mod:`jax.monitoring` events)."""
COMPILE_EVENT = "/asgd_jax/simulator/compile_duration"
"""A :mod:`jax.monitoring` duration event: one program compiled (or loaded from the persistent cache), on any thread."""
WAIT_EVENT = "/asgd_jax/simulator/compile_wait_duration"
"""A :mod:`jax.monitoring` duration event: how long a run waited for a program it needed to be compiled (zero when a
compilation ahead of time, :meth:`Prepared.compile`, had finished it)."""


class RecompileWarning(UserWarning):
    """A program was compiled again for an argument that is a new object with the same code as before (a rule, loss
    or evaluation closure built anew on every call): build it once, or build the rule with :mod:`asgd_jax.rules`."""


class DataState(NamedTuple):
    """How many minibatches each shard has taken; with the key this fixes every future batch (see :mod:`order`)."""

    taken: jax.Array  # int32 [num_shards]


class RunKeys(NamedTuple):
    """What a run's key is split into, derived once at its start (:func:`asgd_jax.exchange.split_key`): the words that
    key its data order (:func:`asgd_jax.order.key_words`), and the raw data of its delay and model keys."""

    data_words: jax.Array  # uint32 [4]
    delay: jax.Array  # uint32 key data
    model: jax.Array  # uint32 key data


class SimState(NamedTuple):
    """The simulator's whole state: a checkpoint holds exactly this."""

    server: server.ServerState
    delay: Any
    data: DataState
    clock: jax.Array  # float32 virtual time of the last update
    keys: RunKeys


class SimulationResult(NamedTuple):
    """What :func:`simulate` returns (with a leading run axis everywhere for :func:`sweep`).

    Attributes:
      params: final server weights.
      model_state: final server model state (``{}`` without one).
      state: the final :class:`SimState` (server, delay model and data positions).
      metrics: per-update numpy arrays ``loss``, ``staleness``, ``worker``, ``time``, ``epoch`` (effective passes over
        the data) and any auxiliary training metrics the loss returns (e.g. ``error``); with ``eval_fn`` also
        ``eval_update`` (the update count at each evaluation, starting at 0) and ``eval_<name>`` for each metric.
      plan: the run's :class:`asgd_jax.Plan`.
    """

    params: Any
    model_state: Any
    state: SimState
    metrics: dict[str, np.ndarray]
    plan: Plan | None = None


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
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
) -> SimState:
    """The simulator's state before the first update (what :func:`simulate` starts from and :func:`lower`'s program
    takes): the server at w_0, the delay model's first draw under ``key``, no minibatch taken, the clock at 0.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> state = asgd_jax.simulator.init(asgd_jax.asgd(0.1), jnp.zeros(3), asgd_jax.Plan(4))
      >>> state.server.backup_params.shape, int(state.server.version)
      ((4, 3), 0)
    """
    plan = Plan() if plan is None else plan
    return _init(rule, params, plan.delays, jax.random.key(0) if key is None else key, plan.n_sync, model_state)


def _init(rule, params, delays, key, n_sync: int, model_state) -> SimState:
    # The key's split and the data order's words are made here, once: every chunk would otherwise make them again
    # (each a PRNG call that XLA compiles anew in every program that makes one).
    data_key, delay_key, model_key = exchange.split_key(key)
    return SimState(
        server=server.init(rule, params, delays.num_slots, model_state),
        delay=delays.init(delay_key, n_sync),
        data=DataState(jnp.zeros((delays.num_shards,), jnp.int32)),
        clock=jnp.zeros((), jnp.float32),
        keys=RunKeys(order.key_words(data_key), jax.random.key_data(delay_key), jax.random.key_data(model_key)),
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
    busy: jax.Array | None = None  # float32: the workers' compute time so far (the optimal-time models only)
    wasted: jax.Array | None = None  # float32: of busy, the work that changed no weight


def _keep(valid: jax.Array | None, i: jax.Array, new: Any, old: Any) -> Any:
    """``new``, or ``old`` for a row past the ``valid`` ones (a last, shorter chunk); small state only."""
    if valid is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(i < valid, a, b), new, old)


def _async_schedule(c: _Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
    """The chunk's events and minibatches: ``(schedule, delay state, data state)`` after its last update (after the
    first ``valid`` rows, when given: the rows past them are computed but change no state)."""
    n_sync = c.ex.n_sync

    def one(carry, xs):
        t, k, i = xs
        delay_state, event = c.delays.next(carry[0], t, k, n_sync)
        # A replayed push rejected as NaN/Inf used up its minibatches: the shard moves past them (a drawn model's
        # skip is the literal 0, which leaves the program as it was).
        counters, used = carry[1][event.shard] + jnp.arange(n_sync, dtype=jnp.int32), n_sync
        if not (isinstance(event.skip, int) and event.skip == 0):
            counters, used = counters + event.skip * n_sync, (1 + event.skip) * n_sync
        taken = carry[1].at[event.shard].add(used)
        return _keep(valid, i, (delay_state, taken), carry), (event._replace(skip=None), counters)

    rows = jnp.arange(ts.shape[0], dtype=jnp.int32)
    (delay_state, taken), (events, counters) = jax.lax.scan(one, (state.delay, state.data.taken), (ts, k_delays, rows))
    schedule = _Schedule(
        push_slot=events.push_slot,
        pull_slot=events.pull_slot,
        worker=events.push_slot if events.worker is None else events.worker,
        time=events.time.astype(jnp.float32),
        indices=_batch_indices(c.data_words, c.ex, jnp.broadcast_to(events.shard[:, None], counters.shape), counters),
        round_key=None,
        busy=events.busy,
        wasted=events.wasted,
    )
    return schedule, delay_state, DataState(taken)


def _round_schedule(c: _Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
    """A round model's updates (:func:`asgd_jax.delays.is_round_model`): every round's K payloads, each on its
    worker's next minibatch (a worker used twice in a round takes two in a row; the minibatches of gradients the
    round ignored are skipped), the clock and the work done, as the model draws them."""
    n_sync, size = c.ex.n_sync, c.delays.round_size
    earlier = jnp.tril(jnp.ones((size, size), jnp.int32), -1)  # [j, i]: payload i is before payload j

    def one(carry, xs):
        t, k, i = xs
        delay_state, r = c.delays.round(carry[0], t, k, n_sync)
        periods = 1 + r.skips  # each payload's minibatch periods: the ignored ones before it, then its own
        same = (r.shards[:, None] == r.shards[None, :]).astype(jnp.int32)
        before = (same * earlier * periods[None, :]).sum(axis=1) + r.skips  # the periods its worker used before it
        counters = (carry[1][r.shards] + before * n_sync)[:, None] + jnp.arange(n_sync, dtype=jnp.int32)[None, :]
        taken = carry[1].at[r.shards].add(periods * n_sync)
        return _keep(valid, i, (delay_state, taken), carry), (r, counters)

    rows = jnp.arange(ts.shape[0], dtype=jnp.int32)
    (delay_state, taken), (rounds, counters) = jax.lax.scan(one, (state.delay, state.data.taken), (ts, k_delays, rows))
    shards = jnp.broadcast_to(rounds.shards[:, :, None], counters.shape)  # [length, K, n_sync]
    zeros = jnp.zeros((ts.shape[0],), jnp.int32)
    schedule = _Schedule(
        push_slot=zeros,
        pull_slot=zeros,
        worker=zeros - 1,
        time=rounds.time.astype(jnp.float32),
        indices=_batch_indices(c.data_words, c.ex, shards, counters),
        round_key=jax.vmap(jax.random.fold_in, in_axes=(None, 0))(c.model_key, ts),
        busy=rounds.busy,
        wasted=rounds.wasted,
    )
    return schedule, delay_state, DataState(taken)


def _sync_schedule(c: _Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
    """SSGD rounds: every shard's next ``n_sync`` minibatches per round (the shards move in lock-step) and the
    clock advanced by the slowest worker, round by round (the first ``valid`` rounds, when given)."""
    length, n_sync, num = ts.shape[0], c.ex.n_sync, c.delays.num_slots

    def tick(clock, xs):
        k, i = xs
        new = (clock + c.delays.sync_time(k, n_sync)).astype(jnp.float32)
        return _keep(valid, i, new, clock), new

    _, times = jax.lax.scan(tick, state.clock, (k_delays, jnp.arange(length, dtype=jnp.int32)))
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
    done = length if valid is None else valid
    return schedule, state.delay, DataState(state.data.taken + done * n_sync)


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
    """An SSGD round: every worker's payload at w_t, their mean applied once (as worker 0); or a round model's K
    payloads at w_t."""
    ex, num = c.ex, _round_size(c.delays)
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


def _round_size(delays: Any) -> int:
    """Payloads per synchronous update: a round model's K, else every worker (SSGD)."""
    return delays.round_size if delays_lib.is_round_model(delays) else delays.num_slots


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
    if x.busy is not None:
        metrics.update(busy=x.busy.astype(jnp.float32), wasted=x.wasted.astype(jnp.float32))
    return srv, metrics


def _evaluate(evaluate, params: Any, model_state: Any, eval_data: Any) -> dict[str, jax.Array]:
    out = evaluate(params, model_state, eval_data)
    if not isinstance(out, Mapping):
        raise errors.ConfigError(
            f"eval_fn returned {type(out).__name__}, not a dict of scalars: return e.g. {{'error': error}}."
        )
    shapes = {k: jnp.shape(v) for k, v in out.items()}
    if any(shape != () for shape in shapes.values()):
        raise errors.ConfigError(
            f"eval_fn returned arrays of shapes {shapes}, not a dict of scalars: return e.g. {{'error': error}}."
        )
    return {f"eval_{k}": jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _dynamic_scan(step: Callable, carry: Any, xs: Any, n: jax.Array) -> tuple[Any, Any]:
    """``lax.scan(step, carry, xs)`` over the first ``n`` (traced) rows of ``xs`` only; the outputs keep every row's
    place (the rows past ``n`` are zeros). The same step as the scan's, so the same bits."""
    first = jax.tree.map(lambda a: a[0], xs)
    shapes = jax.eval_shape(lambda c, x: step(c, x)[1], carry, first)
    length = jax.tree.leaves(xs)[0].shape[0]
    ys = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), shapes)

    def body(i, c):
        carry, ys = c
        carry, y = step(carry, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))
        return carry, jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), ys, y)

    return jax.lax.fori_loop(0, n, body, (carry, ys))


# --------------------------------------------------------------------------------------------------------------------
# The programs: built once per structure, cached across calls.
# --------------------------------------------------------------------------------------------------------------------


class _Source(NamedTuple):
    """Where a program gets each run's rule and delay model from: ``rule(hparams, numbers)`` and
    ``delays(hparams, numbers)`` inside the program, keyed (``rule_key``, ``delays_key``) by what they depend on
    besides the numbers."""

    rule: Callable
    rule_key: Hashable
    delays: Callable
    delays_key: Hashable


class _Key(NamedTuple):
    """What a compiled program depends on; its numbers are arguments."""

    loss: Hashable
    eval_fn: Hashable
    rule: Hashable
    delays: Hashable
    plan: Hashable
    exchange: Exchange
    avals: Hashable  # the structure, shapes and dtypes of the weights, model state and data
    runs: int | None  # None: one run (simulate); R: a sweep of R runs


class _Program:
    """A run's compiled pieces, each compiled once per shapes of its arguments (and kept with the program).

    ``start(params, model_state, keys, hparams, numbers) -> state``; ``chunk(state, data, keys, hparams, numbers) ->
    (state, per-update metrics)`` over ``plan.chunk_length`` updates; ``tail(..., n)``: the same over the first ``n``
    updates of a chunk (a run's last, shorter part: a loop whose trip count is an argument); or an evaluation's program,
    ``eval(params, model_state, eval_data) -> {"eval_<name>": ...}``.

    :meth:`call` runs one, compiling it first if needed (ahead-of-time: ``lower(...).compile()``), so that
    :meth:`Prepared.compile` can compile a run's programs on another thread while an earlier run computes; a call that
    finds its program being compiled elsewhere waits for it instead of compiling it again.
    """

    def __init__(self, jitted: dict[str, Callable]):
        self.jitted = jitted
        self._lock = threading.Lock()
        self._compiled: dict[Hashable, Any] = {}
        self._pending: dict[Hashable, threading.Event] = {}

    def compiled(self, name: str, *args: Any) -> Any:
        """The compiled ``name`` program for arguments shaped like ``args`` (arrays or ``jax.ShapeDtypeStruct``)."""
        key = (name, _aval_key(args))
        while True:
            with self._lock:
                if key in self._compiled:
                    return self._compiled[key]
                event = self._pending.get(key)
                if event is None:
                    self._pending[key] = event = threading.Event()
                    break
            event.wait()  # another thread is compiling it
        started = time.perf_counter()
        try:
            compiled = self.jitted[name].lower(*args).compile()
            with self._lock:
                self._compiled[key] = compiled
        finally:
            with self._lock:
                self._pending.pop(key, None)
            event.set()
            jax.monitoring.record_event_duration_secs(COMPILE_EVENT, time.perf_counter() - started)
        return compiled

    def call(self, name: str, *args: Any) -> Any:
        """Runs the ``name`` program on ``args``; the time it waits for a compilation is reported as
        :data:`WAIT_EVENT`."""
        started = time.perf_counter()
        compiled = self.compiled(name, *args)
        jax.monitoring.record_event_duration_secs(WAIT_EVENT, time.perf_counter() - started)
        return compiled(*args)


class _Programs(NamedTuple):
    """A call's programs: its run's (start, chunk, tail), and its evaluation's, or None (no eval_fn)."""

    run: _Program
    evaluator: _Program | None

    @property
    def evaluates(self) -> bool:
        return self.evaluator is not None

    def evaluate(self, state: SimState, eval_data: Any) -> dict[str, jax.Array]:
        return self.evaluator.call("eval", state.server.params, state.server.model_state, eval_data)


def _aval_key(args: Any) -> Hashable:
    """What a compiled program is specialised to: the structure, shapes, dtypes and weak types of its arguments."""
    leaves, treedef = jax.tree.flatten(args)

    def one(x):
        if isinstance(x, bool | int | float):  # a Python number reaches a program weakly typed
            return ((), jnp.result_type(type(x)).name, True)
        sharding = getattr(x, "sharding", None)  # a sharded sweep's arrays: the program is partitioned for them
        spread = (sharding.mesh.devices.shape, sharding.spec) if isinstance(sharding, NamedSharding) else None
        return (tuple(np.shape(x)), str(x.dtype), bool(getattr(x, "weak_type", False)), spread)

    return treedef, tuple(one(x) for x in leaves)


def _make_program(key: _Key, loss: loss_lib.Loss, source: _Source, ex: Exchange, length: int) -> _Program:
    grad_fn = jax.value_and_grad(loss.normalized(), has_aux=True)
    batched = key.runs is not None

    def one_start(params, model_state, k, h, numbers):
        return _init(source.rule(h, numbers), params, source.delays(h, numbers), k, ex.n_sync, model_state)

    def one_chunk(state, data, k, h, numbers, n=None):
        del k  # the run's keys were split once, at its start: they are in the state
        rule, delays = source.rule(h, numbers), source.delays(h, numbers)
        delay_key, model_key = (jax.random.wrap_key_data(w) for w in (state.keys.delay, state.keys.model))
        c = _Ctx(grad_fn, rule, delays, ex, data, state.keys.data_words, numbers["local_lr"], model_key)
        # Every update's delay key in one vectorised PRNG call per chunk (on CPU each call inside the loop is a
        # rolled loop of its own); identical to folding t in step by step.
        ts = state.server.version + jnp.arange(length, dtype=jnp.int32)
        k_delays = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(delay_key, ts)
        schedule_fn = (
            _async_schedule
            if ex.mode == "async"
            else _round_schedule
            if delays_lib.is_round_model(delays)
            else _sync_schedule
        )
        schedule, delay_state, data_state = schedule_fn(c, state, ts, k_delays, n)
        step = lambda s, x: _step(c, s, x)
        if n is None:
            srv, metrics = jax.lax.scan(step, state.server, schedule)
            clock = schedule.time[-1]
        else:
            srv, metrics = _dynamic_scan(step, state.server, schedule, n)
            clock = jax.lax.dynamic_index_in_dim(schedule.time, n - 1, keepdims=False)
        if _live_slot(rule, delays, ex):  # the pulls of the chunk recorded versions only: slot 0's weights are w_t
            srv = server.pull(srv, 0)
        return SimState(server=srv, delay=delay_state, data=data_state, clock=clock, keys=state.keys), metrics

    if batched:  # the runs axis: keys and hparams per run; data, numbers and the trip count shared
        start = jax.vmap(one_start, in_axes=(None, None, 0, 0, None))
        chunk = jax.vmap(one_chunk, in_axes=(0, None, 0, 0, None))
        tail = jax.vmap(one_chunk, in_axes=(0, None, 0, 0, None, None))
    else:
        start, chunk, tail = one_start, one_chunk, one_chunk
    jitted = {
        "start": jax.jit(_named(start, PROGRAM_NAMES[0])),
        "chunk": jax.jit(_named(chunk, PROGRAM_NAMES[1]), donate_argnums=0),
        "tail": jax.jit(_named(tail, PROGRAM_NAMES[2]), donate_argnums=0),
    }
    return _Program(jitted)


def _make_evaluator(eval_fn, batched: bool, params: Any, model_state: Any) -> _Program:
    """The evaluation's own program, ``(params, model_state, eval_data) -> {"eval_<name>": ...}``: one per eval_fn,
    weights' shapes and run count, shared by every program that evaluates them (a study's arms of one model and
    grid size compile it once, not once per rule and cluster). An eval_fn that returns no dict of scalars is told
    here, traced on the weights' shapes, before anything compiles."""
    evaluate, eval_data = exchange.eval_parts(eval_fn)
    one = lambda params, model_state, eval_data: _evaluate(evaluate, params, model_state, eval_data)
    jax.eval_shape(one, params, model_state, eval_data)
    fn = jax.vmap(one, in_axes=(0, 0, None)) if batched else one
    return _Program({"eval": jax.jit(_named(fn, PROGRAM_NAMES[3]))})


def _named(fn: Callable, name: str) -> Callable:
    """``fn`` under ``name`` (what compile logs and :mod:`jax.monitoring` events call the program)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


_CACHE: collections.OrderedDict[_Key, _Program] = collections.OrderedDict()
_CACHE_SIZE = 32
_LOCK = threading.Lock()
_SEEN: dict[Hashable, _Key] = {}  # a key with its objects replaced by their code -> the last key built for it
_WARNED: set[Hashable] = set()


def clear_cache() -> None:
    """Forgets every compiled program (the next call of each structure compiles again)."""
    with _LOCK:
        _CACHE.clear()
        _SEEN.clear()
        _WARNED.clear()


def _code(obj: Any) -> Hashable:
    """What an object keyed by identity does, to tell a new object of the same code from another function."""
    if isinstance(obj, tuple):
        return tuple(_code(x) for x in obj)
    if isinstance(obj, loss_lib.Loss):
        return ("loss", _code(obj.fn), obj.has_model_state, obj.has_aux)
    if isinstance(obj, functools.partial):
        return ("partial", _code(obj.func))
    update = getattr(obj, "update", None)
    if callable(update) and callable(getattr(obj, "init", None)):
        return ("rule", _code(update))
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code
    return obj if _hashable(obj) else id(type(obj))


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


_WHAT = {"loss": "the loss function", "eval_fn": "eval_fn", "rule": "the rule", "delays": "the delay function"}


def _program(key: _Key, build: Callable[[], _Program]) -> _Program:
    """The cached program for ``key``, built (and counted against identity-keyed surprises) on a miss."""
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    program = build()
    with _LOCK:
        _CACHE[key] = program
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        code = key._replace(**{f: _code(getattr(key, f)) for f in _WHAT})
        before = _SEEN.get(code)
        _SEEN[code] = key
        if before is not None and before != key and code not in _WARNED:
            _WARNED.add(code)
            what = " and ".join(_WHAT[f] for f in _WHAT if getattr(before, f) != getattr(key, f))
            warnings.warn(
                f"asgd_jax compiled the simulator again because {what} is a new object with the same code as one it "
                "compiled for before (a closure made anew on each call). Make it once, outside the loop; a rule "
                "built by asgd_jax.rules.get or the rule functions (asgd_jax.dc_asgd, ...) needs no care: its "
                "numbers are arguments of one program.",
                RecompileWarning,
                stacklevel=4,
            )
    return program


# --------------------------------------------------------------------------------------------------------------------
# Checking a call and finding its program.
# --------------------------------------------------------------------------------------------------------------------


def _check_plan(plan: Any) -> Plan:
    if plan is None:
        return Plan()
    errors.require(isinstance(plan, Plan), "plan", plan, "give an asgd_jax.Plan(...) (delays, num_updates, ...)")
    return plan


def _check_rule(rule: Any) -> None:
    ok = callable(getattr(rule, "init", None)) and callable(getattr(rule, "update", None))
    hint = "build one with asgd_jax.rules.get(name, learning_rate) or a rule function such as asgd_jax.dc_asgd(0.1)"
    errors.require(ok, "rule", rule, f"give an update rule (an optax transform): {hint}")


def _check_key(name: str, key: Any, batched: bool) -> jax.Array:
    if isinstance(key, jax.Array | np.ndarray) and key.dtype == np.uint32 and key.shape[-1:] == (2,):
        key = jax.random.wrap_key_data(key)  # a legacy jax.random.PRNGKey: the same key, typed
    good = isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    shape = "a 1-D array of keys, one per run (see asgd_jax.grid)" if batched else "one key, e.g. jax.random.key(0)"
    # An array is named by its kind and shape: its repr is every key's data, lines of it.
    named = f"<keys of shape {tuple(key.shape)}>" if good else key
    if isinstance(key, jax.Array | np.ndarray) and not good:
        named = f"<{key.dtype} array of shape {tuple(key.shape)}>"
    errors.require(good and key.ndim == (1 if batched else 0), name, named, f"give {shape}")
    if batched:
        errors.require(key.shape[0] >= 1, name, named, "give at least one key")
    return key


def _check_on_nonfinite(policy: Any) -> str:
    return errors.choice("on_nonfinite", policy, NONFINITE)


def _check_options(on_nonfinite: Any, checkpoint_dir: Any, progress: Any) -> dict[str, Any]:
    """A call's run options, checked (before anything is made on a device) and in the forms its ``_Call`` holds."""
    return {
        "on_nonfinite": _check_on_nonfinite(on_nonfinite),
        "checkpoint_dir": _check_checkpoint_dir(checkpoint_dir),
        "progress": _check_progress(progress),
    }


def _check_progress(progress: Any) -> bool:
    errors.require(isinstance(progress, bool | np.bool_), "progress", progress, "use True or False")
    return bool(progress)


def _check_checkpoint_dir(checkpoint_dir: Any) -> str | None:
    if checkpoint_dir is None:
        return None
    errors.require(
        isinstance(checkpoint_dir, str | os.PathLike), "checkpoint_dir", checkpoint_dir, "give a folder path (or None)"
    )
    path = os.fspath(checkpoint_dir)
    errors.require(
        not os.path.exists(path) or os.path.isdir(path),
        "checkpoint_dir",
        path,
        "it is a file, not a folder: give a folder (it is made if missing)",
    )
    return path


def _eval_data(eval_fn) -> Any:
    return None if eval_fn is None else jax.tree.map(jnp.asarray, exchange.eval_parts(eval_fn)[1])


def _avals(*trees: Any) -> Hashable:
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def _numbers(plan: Plan, rule_numbers: Any, delay_numbers: Any) -> dict[str, Any]:
    local_lr = 0.0 if plan.local_lr is None else plan.local_lr
    return {"rule": rule_numbers, "delays": delay_numbers, "local_lr": np.float32(local_lr)}


def _prepare(
    loss_fn, params, data, plan: Plan, model_state, has_aux: bool, eval_fn, source: _Source, runs, first_delays
) -> tuple[_Programs, Exchange]:
    """Checks what a call's program needs (on a cache miss: tracing the loss) and returns the program."""
    if eval_fn is not None and not callable(eval_fn):
        raise errors.ConfigError(f"eval_fn={eval_fn!r} is invalid: give eval_fn(params, model_state) -> dict.")
    if plan.eval_every is not None and eval_fn is None:
        raise errors.ConfigError(
            f"plan.eval_every={plan.eval_every} was given without eval_fn: pass eval_fn(params, model_state) -> dict "
            "(or set chunk instead of eval_every for the chunk length alone)."
        )
    loss = loss_lib.as_loss(loss_fn, has_model_state=model_state is not None, has_aux=has_aux)
    ex = exchange.Exchange.create(plan.replace(delays=first_delays), data, stateful=loss.has_model_state)
    exchange.check_params(params)
    model_state = {} if model_state is None else model_state
    plan_key = plan.structure()._replace(delays=None)  # the delay model's structure is in the source's key
    evaluator = None
    if eval_fn is not None:  # keyed by what the evaluation depends on only: the rule and the cluster are not in it
        eval_avals = _avals(params, model_state, exchange.eval_parts(eval_fn)[1])
        eval_key = _Key(None, eval_fn, None, None, None, None, eval_avals, runs)
        evaluator = _program(eval_key, lambda: _make_evaluator(eval_fn, runs is not None, params, model_state))
    loss.check_data(data)  # (values, every call; the shapes are checked once per program, below)
    key = _Key(loss, None, source.rule_key, source.delays_key, plan_key, ex, _avals(params, model_state, data), runs)

    def build() -> _Program:
        loss.check(params, model_state, exchange.batch_shapes(data, plan.batch_size))
        return _make_program(key, loss, source, ex, plan.chunk_length)

    return _Programs(_program(key, build), evaluator), ex


def _recipe_source(rule: Any, delays_source: tuple[Callable, Hashable], hp_names: Sequence[str]) -> tuple:
    """A rule's source: its recipe (numbers as arguments; hparams by name override them), else the rule itself."""
    built = recipes.of(rule)
    if built is None:
        if hp_names:
            raise errors.ConfigError(
                f"hparams {sorted(hp_names)} cannot vary a rule composed by hand: pass rule_fn(hparams) -> rule, or a "
                "rule built by asgd_jax.rules.get / a rule function, whose numbers hparams may name."
            )
        return _Source(lambda h, n: rule, rule, *delays_source), {}
    built = built.vary(list(hp_names))
    structure = built.structure
    rule_fn = lambda h, n: recipes.Recipe(structure, n["rule"]).build({**n["rule"], **h})
    return _Source(rule_fn, ("recipe", structure), *delays_source), built.numbers


def _plan_delays(plan: Plan) -> tuple[tuple[Callable, Hashable], list[jax.Array]]:
    structure, numbers = delays_lib.split(plan.delays)
    return (lambda h, n: structure.build(n["delays"]), structure), numbers


# --------------------------------------------------------------------------------------------------------------------
# Driving a program: chunks, progress, evaluation, checkpoints.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Progress:
    """What a run has done so far: updates, per-chunk metrics and evaluations (host arrays)."""

    done: int = 0
    chunks: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    evals: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    eval_updates: list[int] = dataclasses.field(default_factory=list)
    saved: int = 0  # the update count of the last checkpoint


class _Call(NamedTuple):
    """One call's arguments to its program, and how to drive it."""

    plan: Plan
    params: Any
    model_state: Any
    data: Any
    eval_data: Any
    keys: jax.Array
    hparams: dict[str, Any]
    numbers: dict[str, Any]
    batched: bool
    on_nonfinite: str
    checkpoint_dir: str | None
    progress: bool
    callback: Callable | None
    description: str
    runs: int | None = None  # a sharded sweep's own runs (the rest pad the runs axis to the devices)


def _header(call: _Call) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by this call."""
    p = call.plan
    return {
        "key": exchange.key_fingerprint(call.keys),
        "num_updates": p.num_updates,
        "plan": repr(p.structure()._replace(delays=type(p.delays).__name__)) + f" workers={p.workers}",
        "numbers": exchange.key_fingerprint_tree((call.numbers, call.hparams)),
    }


def _resume(path: str, template: Any, header: dict[str, Any], axis: int) -> tuple[SimState, _Progress]:
    state, arrays, saved = ckpt.load(path, template)
    mismatched = [k for k in header if saved.get(k) != header[k]]
    if mismatched:
        raise errors.ConfigError(
            f"Checkpoint {path} was written by a run with different {', '.join(mismatched)}: resume with the "
            "same key, plan and numbers, or use another checkpoint_dir."
        )
    metrics = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    stacked = {k[2:]: v for k, v in arrays.items() if k.startswith("e/")}
    n_evals = next(iter(stacked.values())).shape[axis] if stacked else 0
    evals = [{k: np.take(v, i, axis=axis) for k, v in stacked.items()} for i in range(n_evals)]
    done = int(saved["done"])
    eval_updates = [int(u) for u in arrays.get("eval_updates", [])]
    return state, _Progress(done, [metrics] if metrics else [], evals, eval_updates, done)


def _start_shape(run: _Program, c: _Call) -> SimState:
    return jax.eval_shape(run.jitted["start"], c.params, c.model_state, c.keys, c.hparams, c.numbers)


def _compile_updates(programs: _Programs, c: _Call) -> None:
    """Compiles the chunk (and the shorter last part's program, if the budget needs it) of a call; a failure is left
    for the call itself to meet and report, when it runs the program."""
    try:
        state = _start_shape(programs.run, c)
        args = (c.data, c.keys, c.hparams, c.numbers)
        if c.plan.num_updates >= c.plan.chunk_length:
            programs.run.compiled("chunk", state, *args)
        if c.plan.num_updates % c.plan.chunk_length:
            programs.run.compiled("tail", state, *args, np.int32(0))
    except Exception:
        return


def _compile_eval(programs: _Programs, c: _Call) -> None:
    if programs.evaluates:
        state = _start_shape(programs.run, c)
        programs.evaluator.compiled("eval", state.server.params, state.server.model_state, c.eval_data)


def _run(programs: _Programs, call: _Call) -> SimulationResult:
    with interrupts.watch():
        return _chunks(programs, call)


def _chunks(programs: _Programs, call: _Call) -> SimulationResult:
    plan, axis, program = call.plan, (1 if call.batched else 0), programs.run
    args = (call.keys, call.hparams, call.numbers)
    path = None if call.checkpoint_dir is None else os.path.join(call.checkpoint_dir, "simulator.npz")
    header = _header(call)
    so_far = _Progress()
    if path is not None and os.path.exists(path):
        template = program.compiled("start", call.params, call.model_state, *args).out_info
        state, so_far = _resume(path, template, header, axis)
    else:
        # The update programs compile on a thread of their own while this one compiles and runs the start and the
        # first evaluation: on a machine with two cores the first call waits for the larger of the two, not the sum.
        threading.Thread(target=_compile_updates, args=(programs, call), daemon=True).start()
        state = program.call("start", call.params, call.model_state, *args)
        if programs.evaluates:
            so_far.evals, so_far.eval_updates = [jax.device_get(programs.evaluate(state, call.eval_data))], [0]
    bar = _bar(call.progress, plan.num_updates, so_far.done, call.description)
    chunk, every = plan.chunk_length, plan.eval_interval()
    warned = [False]
    over = _past_budget(plan, state, so_far, programs.evaluates)  # a resumed run may be over already
    try:
        while so_far.done < plan.num_updates and not over:
            interrupts.check()  # a Ctrl-C something swallowed (while compiling) still stops the run
            length = min(chunk, plan.num_updates - so_far.done)
            end = so_far.done + length
            if length == chunk:
                state, metrics = program.call("chunk", state, call.data, *args)
            else:
                state, metrics = program.call("tail", state, call.data, *args, np.int32(length))
            if programs.evaluates and (end % every == 0 or end == plan.num_updates):
                so_far.evals.append(jax.device_get(programs.evaluate(state, call.eval_data)))
                so_far.eval_updates.append(end)
            metrics = {k: np.take(v, np.arange(length), axis=axis) for k, v in jax.device_get(metrics).items()}
            so_far.chunks.append(metrics)
            so_far.done = end
            _check_finite(metrics, end, call.on_nonfinite, warned, call.runs)
            over = _past_budget(plan, state, so_far, programs.evaluates)
            if path is not None and (
                end - so_far.saved >= (plan.checkpoint_every or 1) or over or end == plan.num_updates
            ):
                _save(path, state, so_far, header, axis)
            if bar is not None:
                bar.update(length)
                bar.set_postfix(_progress_note(np.take(metrics["loss"], -1, axis=axis)))
            if call.callback is not None:
                call.callback(so_far.done, state)
    finally:
        if bar is not None:
            bar.close()
    metrics = _metrics(so_far, axis)
    if call.runs is not None:  # a sharded sweep: the runs that pad its runs axis to the devices are dropped
        keep = lambda x: np.asarray(x)[: call.runs] if np.ndim(x) else x
        state, metrics = jax.tree.map(keep, jax.device_get(state)), {k: keep(v) for k, v in metrics.items()}
    params, model_state = state.server.params, state.server.model_state
    return SimulationResult(params, model_state, state, metrics, plan)


def _past_budget(plan: Plan, state: SimState, so_far: _Progress, evaluates: bool) -> bool:
    """Whether a run with a ``time_budget`` is over: every run's clock has reached it, at an evaluation."""
    if plan.time_budget is None or so_far.done == 0 or (evaluates and so_far.eval_updates[-1] != so_far.done):
        return False
    return bool(np.min(jax.device_get(state.clock)) >= plan.time_budget)


def _save(path: str, state: SimState, so_far: _Progress, header: dict[str, Any], axis: int) -> None:
    so_far.chunks = [_join(so_far.chunks, axis)]
    arrays = {f"m/{k}": v for k, v in so_far.chunks[0].items()}
    arrays.update({f"e/{k}": v for k, v in _join(so_far.evals, axis, stack=True).items()})
    arrays["eval_updates"] = np.asarray(so_far.eval_updates, np.int64)
    ckpt.save(path, state, arrays, {**header, "done": so_far.done})
    so_far.saved = so_far.done


def _bar(progress: bool, total: int, initial: int, description: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=description, unit="upd", leave=False)


def _metrics(so_far: _Progress, axis: int) -> dict[str, np.ndarray]:
    metrics = _join(so_far.chunks, axis)
    if so_far.evals and so_far.evals[0]:
        ev = _join(so_far.evals, axis, stack=True)
        shape = next(iter(ev.values())).shape
        metrics.update(ev)
        metrics["eval_update"] = np.broadcast_to(np.asarray(so_far.eval_updates, np.int32), shape).copy()
    return metrics


def _join(parts: Sequence[Mapping[str, np.ndarray]], axis: int, stack: bool = False) -> dict[str, np.ndarray]:
    """Joins per-chunk metrics along the update axis (``stack`` for one scalar per chunk, e.g. evaluations)."""
    if not parts:
        return {}
    join = np.stack if stack else np.concatenate
    return {k: join([np.asarray(p[k]) for p in parts], axis=axis) for k in parts[0]}


def _progress_note(last_losses: np.ndarray) -> dict[str, str]:
    """The progress bar's note: the last loss (a sweep's median over its runs) and how many runs diverged."""
    losses = np.atleast_1d(last_losses)
    finite = losses[np.isfinite(losses)]
    note = {"loss": f"{float(np.median(finite)):.3f}" if finite.size else "nan"}
    if finite.size < losses.size:
        note["diverged"] = f"{losses.size - finite.size}/{losses.size}"
    return note


def _check_finite(
    metrics: dict[str, np.ndarray], done: int, policy: str, warned: list[bool], runs: int | None = None
) -> None:
    """Warns (once) or stops when a chunk's training loss is NaN or Inf: a diverging run says so (a sweep says how
    many of its ``runs`` own runs, so far: not the copies that pad a sharded sweep)."""
    losses = np.asarray(metrics["loss"])
    losses = losses if runs is None else losses[:runs]
    bad = ~np.isfinite(losses)
    if policy == "ignore" or not bad.any():
        return
    per_update = bad.reshape(-1, bad.shape[-1]).any(axis=0)  # any run of a sweep
    first = done - losses.shape[-1] + int(np.argmax(per_update))
    which = "the run" if losses.ndim == 1 else f"{int(bad.any(axis=-1).sum())} of its {losses.shape[0]} runs"
    message = (
        f"the training loss is NaN or Inf from update {first + 1} on: {which} diverged (lower the learning "
        "rate, check the data and the initial weights)"
    )
    if policy == "stop":
        raise FloatingPointError(message + "; stopped (on_nonfinite='stop').")
    if not warned[0]:
        warnings.warn(message + ".", RuntimeWarning, stacklevel=4)
        warned[0] = True


# --------------------------------------------------------------------------------------------------------------------
# The public calls.
# --------------------------------------------------------------------------------------------------------------------


def simulate(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
) -> SimulationResult:
    """Simulates asynchronous SGD with a parameter server, deterministically.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; with ``model_state`` given, ``loss_fn(params, model_state,
        batch, key) -> (loss, new_model_state)``; with ``has_aux=True`` the loss comes with a dict of scalar training
        metrics (``(loss, aux)``, or ``(loss, (new_model_state, aux))``). An :class:`asgd_jax.loss_lib.Loss` declares
        its own form (:func:`asgd_jax.classification_loss` returns one). A loss that does not return what its form
        says is reported before anything compiles.
      rule: the server's update rule, e.g. :func:`asgd_jax.dc_asgd` (its numbers are arguments of the compiled
        program: a rule with other numbers compiles nothing new).
      params: initial weights w_0 (every backup starts here).
      data: pytree of arrays with a leading example axis, e.g. ``{"x": x, "y": y}``; it is put on the device (pass
        device arrays to skip the copy on every call).
      plan: the run's :class:`asgd_jax.Plan` (delay model, exchange pattern, budget, cadence); default ``Plan()``:
        ``Workers(8)``, 2,000 updates, batch 32.
      key: the run's key (default ``jax.random.key(0)``); the same key gives identical bits.
      model_state: initial non-trained model collections (BatchNorm); declares the stateful ``loss_fn`` form. Workers
        compute with the state they pulled and push their updated state; the server keeps the latest.
      has_aux: the loss returns auxiliary training metrics (see ``loss_fn``).
      eval_fn: ``eval_fn(params, model_state) -> dict`` of scalars, run on the server's weights at the start and every
        ``plan.eval_interval()`` updates (``plan.eval_every``, or about twenty times a run).
      on_nonfinite: when the training loss turns NaN or Inf: ``"warn"`` (once; default), ``"stop"`` (raise
        ``FloatingPointError`` after that chunk) or ``"ignore"``.
      checkpoint_dir: if given, the state is written there atomically at chunk ends (every ``plan.checkpoint_every``
        updates, default every chunk), and a run started with the same arguments resumes from it (bit-identical to an
        uninterrupted run).
      progress: show a progress bar.
      callback: ``callback(updates_done, state)`` called after every chunk (e.g. to log or stop early by raising).

    Returns:
      A :class:`SimulationResult`.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> plan = asgd_jax.Plan(asgd_jax.delays.Workers(4), num_updates=200)
      >>> result = asgd_jax.simulate(loss, asgd_jax.dc_asgd(0.1, lam=0.5), jnp.zeros(3), data, plan, progress=False)
      >>> result.params.round(2)
      Array([ 1. , -2. ,  0.5], dtype=float32)
      >>> int(result.metrics["staleness"].max()) > 0
      True
    """
    plan = _check_plan(plan)
    options = _check_options(on_nonfinite, checkpoint_dir, progress)  # before anything is made on a device
    key = _check_key("key", jax.random.key(0) if key is None else key, batched=False)
    _check_rule(rule)
    delays_source, delay_numbers = _plan_delays(plan)
    source, rule_numbers = _recipe_source(rule, delays_source, ())
    program, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, eval_fn, source, None, plan.delays)
    call = _Call(
        plan=plan,
        params=params,
        model_state={} if model_state is None else model_state,
        data=jax.tree.map(jnp.asarray, data),
        eval_data=_eval_data(eval_fn),
        keys=key,
        hparams={},
        numbers=_numbers(plan, rule_numbers, delay_numbers),
        batched=False,
        **options,
        callback=callback,
        description="simulate",
    )
    return _run(program, call)


def lower(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
    has_aux: bool = False,
) -> jax.stages.Lowered:
    """The program :func:`simulate` compiles for a chunk of ``plan.chunk_length`` updates, lowered, for inspection.

    The program is ``(state, data, key, hparams, numbers) -> (state, metrics)`` with the state donated;
    ``.compile()`` gives its optimised HLO (``.as_text()``), cost and memory analyses, so one can check what an update
    costs (see ARCHITECTURE.md, "What a step costs").

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> data = {"x": jnp.ones((256, 3)), "y": jnp.ones(256)}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> lowered = asgd_jax.simulator.lower(loss, asgd_jax.asgd(0.1), jnp.zeros(3), data, asgd_jax.Plan(chunk=5))
      >>> lowered.args_info[0][0].server.backup_params.shape  # Workers(8): one backup per worker
      (8, 3)
    """
    plan = _check_plan(plan)
    key = _check_key("key", jax.random.key(0) if key is None else key, batched=False)
    _check_rule(rule)
    delays_source, delay_numbers = _plan_delays(plan)
    source, rule_numbers = _recipe_source(rule, delays_source, ())
    programs, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, None, source, None, plan.delays)
    model_state = {} if model_state is None else model_state
    numbers = _numbers(plan, rule_numbers, delay_numbers)
    state = jax.eval_shape(programs.run.jitted["start"], params, model_state, key, {}, numbers)
    return programs.run.jitted["chunk"].lower(state, jax.tree.map(jnp.asarray, data), key, {}, numbers)


def sweep(*args: Any, **kwargs: Any) -> SimulationResult:
    """Runs R simulations as one compiled program, vmapped over keys and hyperparameters.

    Everything that shapes the program (the plan) is shared; what varies per run is the key and the numeric
    hyperparameters. ``rule`` is either a rule whose numbers ``hparams`` override by name (``{"learning_rate": ...,
    "lam": ...}`` for :func:`asgd_jax.dc_asgd`), or ``rule(hparams) -> rule`` building each run's rule from its numbers
    (traced, so no Python branching on them); ``delays_fn(hparams) -> delay model`` likewise varies the delay model's
    numbers per run (its structure must be ``plan.delays``'). :func:`grid` builds ``keys`` and ``hparams`` for a
    Cartesian product. Run r equals ``simulate(...)`` with its rule and key to float rounding (see the module's notes
    on bits), and does not depend on the other runs of the sweep.

    Args:
      loss_fn, params, data, plan, model_state, has_aux, eval_fn, on_nonfinite, checkpoint_dir, progress, callback:
        as in :func:`simulate`, shared by every run.
      rule: a rule (its numbers overridden by ``hparams`` of the same names), or ``rule(hparams) -> rule``.
      keys: ``[R]`` keys, one per run.
      hparams: dict of ``[R]`` arrays (default: none).
      delays_fn: ``delays_fn(hparams) -> model``: each run's delay model (e.g. ``lambda h: Workers(8,
        straggler_prob=h["p"])``).
      description: the progress bar's label (default ``"sweep xR"``).
      devices: the devices the runs are split over (``jax.sharding`` on the runs axis, padded with copies of the
        last run to a multiple of their number, the padding dropped from the result): 16 runs on 8 GPUs use all 8.
        Default: every local accelerator; on a CPU one device (fake CPU devices share the same cores). A run's numbers
        do not depend on the split, to float rounding (XLA partitions the program; on XLA:CPU the least-squares
        sweeps of the tests are the same bits, a network's within one ulp).

    Returns:
      A :class:`SimulationResult` whose arrays have a leading run axis ``R``.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.0, 0.5])
      >>> result = asgd_jax.sweep(loss, asgd_jax.dc_asgd(0.1), jnp.zeros(3), data, asgd_jax.Plan(num_updates=100),
      ...                         keys=keys, hparams=hp, progress=False)
      >>> result.params.shape, result.metrics["loss"].shape
      ((4, 3), (4, 100))
    """
    return prepare_sweep(*args, **kwargs).run()


class Prepared(NamedTuple):
    """A call checked and bound to its programs, not run yet (what :func:`prepare_sweep` returns).

    :meth:`compile` compiles its programs (or loads them from the persistent cache), and may run on another thread
    while an earlier call computes: a study compiles its next arm while the current one runs. :meth:`run` runs it
    (compiling what is not compiled yet, or waiting for a compilation in progress).
    """

    program: _Programs
    call: _Call

    def compile(self) -> None:
        """Compiles the programs this call will run: its start, its evaluation (shared with other calls that evaluate
        the same eval_fn on the same weights' shapes), its chunk, and the program of its last, shorter part when the
        budget is not a whole number of chunks."""
        c = self.call
        self.program.run.compiled("start", c.params, c.model_state, c.keys, c.hparams, c.numbers)
        _compile_eval(self.program, c)
        _compile_updates(self.program, c)

    def run(self) -> SimulationResult:
        """Runs the call: :func:`sweep`'s result."""
        return _run(self.program, self.call)


def prepare_sweep(
    loss_fn: Callable,
    rule: Callable[[Mapping[str, jax.Array]], optax.GradientTransformation] | optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    keys: jax.Array,
    hparams: Mapping[str, Any] | None = None,
    delays_fn: Callable[[Mapping[str, jax.Array]], Any] | None = None,
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
    description: str | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Prepared:
    """:func:`sweep`'s arguments checked (everything a user can get wrong, before anything compiles) and bound to the
    sweep's programs, without running it: ``prepare_sweep(...).run()`` is ``sweep(...)``; ``.compile()`` compiles
    ahead, e.g. on a background thread while another sweep runs.
    """
    plan = _check_plan(plan)
    options = _check_options(on_nonfinite, checkpoint_dir, progress)  # before anything is made on a device
    devices = _check_devices(devices)
    keys = _check_key("keys", keys, batched=True)
    num_runs = own_runs = int(keys.shape[0])
    hparams = _check_hparams(hparams, num_runs, per_run_arrays=delays_fn is not None)
    if len(devices) > 1:  # the runs axis split over the devices, padded with copies of the last run to fit
        num_runs = -(-own_runs // len(devices)) * len(devices)
        keys, hparams = _pad_runs((keys, hparams), num_runs)
    first = {k: np.asarray(v)[0] for k, v in hparams.items()}  # on the host: no device work to check a rule
    if delays_fn is None:
        delays_source, delay_numbers = _plan_delays(plan)
        first_delays = plan.delays
    else:
        errors.require(callable(delays_fn), "delays_fn", delays_fn, "give delays_fn(hparams) -> a delay model")
        first_delays = delays_fn(first)
        same = type(first_delays) is type(plan.delays) and first_delays.num_slots == plan.delays.num_slots
        errors.require(same, "delays_fn", first_delays, f"return a model of plan.delays' structure ({plan.delays!r})")
        delays_source, delay_numbers = (lambda h, n: delays_fn(h), ("fn", delays_fn)), []
    if callable(rule) and not callable(getattr(rule, "update", None)):
        source = _Source(lambda h, n: rule(h), ("fn", rule), *delays_source)
        rule_numbers = {}
        _check_rule(rule(first))
    else:
        _check_rule(rule)
        source, rule_numbers = _recipe_source(rule, delays_source, list(hparams))
    program, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, eval_fn, source, num_runs, first_delays)
    call = _Call(
        plan=plan,
        params=params,
        model_state={} if model_state is None else model_state,
        data=jax.tree.map(jnp.asarray, data),
        eval_data=_eval_data(eval_fn),
        keys=keys,
        hparams=hparams,
        numbers=_numbers(plan, rule_numbers, delay_numbers),
        batched=True,
        **options,
        callback=callback,
        description=description or f"sweep x{own_runs}" + (f" on {len(devices)} devices" if len(devices) > 1 else ""),
        runs=own_runs if len(devices) > 1 else None,
    )
    return Prepared(program, _spread(call, devices) if len(devices) > 1 else call)


def _check_devices(devices: Any) -> list[jax.Device]:
    """The devices a sweep's runs are split over: given, or every local accelerator (one device on a CPU, whose fake
    devices share the same cores)."""
    if devices is None:
        local = jax.local_devices()
        return local if local[0].platform != "cpu" else local[:1]
    listed = list(devices) if isinstance(devices, Sequence) and not isinstance(devices, str) else []
    errors.require(
        bool(listed) and all(isinstance(d, jax.Device) for d in listed) and len(set(listed)) == len(listed),
        "devices",
        devices,
        "give a list of distinct jax devices, e.g. jax.devices()",
    )
    return listed


def _pad_runs(tree: Any, runs: int) -> Any:
    """Every leaf's runs axis (its first) padded to ``runs`` with copies of its last run."""

    def pad(x):
        extra = runs - x.shape[0]
        return jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)]) if extra else x

    return jax.tree.map(pad, tree)


def _spread(call: _Call, devices: list[jax.Device]) -> _Call:
    """A sweep's arguments placed over ``devices``: the runs axis split, everything shared replicated."""
    mesh = Mesh(np.asarray(devices), ("runs",))
    split, whole = NamedSharding(mesh, PartitionSpec("runs")), NamedSharding(mesh, PartitionSpec())
    keys, hparams = jax.device_put((call.keys, call.hparams), split)
    params, model_state, data, eval_data = jax.device_put(
        (call.params, call.model_state, call.data, call.eval_data), whole
    )
    return call._replace(
        keys=keys, hparams=hparams, params=params, model_state=model_state, data=data, eval_data=eval_data
    )


sweep.__signature__ = inspect.signature(prepare_sweep).replace(return_annotation=SimulationResult)


def _check_hparams(hparams: Any, num_runs: int, per_run_arrays: bool = False) -> dict[str, jax.Array]:
    """One finite number per run for every hyperparameter ([R]); with a ``delays_fn`` a run's value may be an array
    ([R, ...], e.g. per-worker speeds)."""
    if hparams is None:
        return {}
    errors.require(isinstance(hparams, Mapping), "hparams", hparams, "give a dict of [R] arrays (see asgd_jax.grid)")
    out = {}
    for name, value in hparams.items():
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            array = np.asarray(None)
        shaped = array.shape[:1] == (num_runs,) and (per_run_arrays or array.ndim == 1)
        ok = shaped and array.dtype != bool and np.issubdtype(array.dtype, np.number)
        errors.require(
            ok and bool(np.all(np.isfinite(array))),
            f"hparams[{name!r}]",
            value,
            f"give one finite number per run: an array with a leading axis of {num_runs}",
        )
        out[name] = value if isinstance(value, jax.Array) else array  # host arrays stay on the host until a call
    return out


def grid(*, seeds: Sequence[int], **values: Sequence[float]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The Cartesian product of seeds and hyperparameter values, as ``(keys, hparams)`` for :func:`sweep`.

    Runs are ordered with the seed varying slowest.

    Example:
      >>> import asgd_jax
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.5, 1.0, 2.0])
      >>> keys.shape, hp["lam"].tolist()
      ((6,), [0.5, 1.0, 2.0, 0.5, 1.0, 2.0])
    """
    given = seeds
    seeds = list(seeds) if isinstance(seeds, Sequence | np.ndarray) and not isinstance(seeds, str) else None
    errors.require(bool(seeds), "seeds", given, "give a non-empty list of seeds, e.g. seeds=[0, 1, 2]")
    for seed in seeds:
        errors.require(
            errors.is_int(seed) and 0 <= seed < 2**32, "seeds", seeds, "use ints in [0, 2**32) (a key's seed)"
        )
    names = list(values)
    for name in names:
        vals = values[name]
        ok = isinstance(vals, Sequence | np.ndarray) and not isinstance(vals, str) and len(vals) > 0
        ok = ok and all(isinstance(v, int | float | np.number) and np.isfinite(v) for v in vals)
        errors.require(ok, name, vals, "give a non-empty list of finite numbers")
    rows = list(itertools.product(seeds, *(list(values[n]) for n in names)))
    keys = jax.vmap(jax.random.key)(jnp.asarray([r[0] for r in rows], jnp.uint32))
    hparams = {n: jnp.asarray([r[i + 1] for r in rows], jnp.float32) for i, n in enumerate(names)}
    return keys, hparams
