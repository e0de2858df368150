"""The pure state machine's step: a chunk of server updates.

The delay model decides each update's :class:`~asgd_jax.delays.Event` and the data order its minibatch, neither from
the weights, so a chunk first computes its schedule for all of its updates (:func:`async_schedule`,
:func:`round_schedule`, :func:`sync_schedule`); :func:`step` then applies one row of it: the pushing worker's payload
at the snapshot it pulled, pushed with :func:`asgd_jax.server.push` and the pull recorded with
:func:`asgd_jax.server.pull`. :class:`Ctx` is what a chunk's updates share; :func:`live_slot` says when slot 0 always
holds the live weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax import delays as delays_lib
from asgd_jax import exchange, server
from asgd_jax.exchange import Exchange
from asgd_jax.simulator.indices import batch_indices as _batch_indices
from asgd_jax.simulator.state import DataState, SimState


def live_slot(rule, delays, ex: Exchange) -> bool:
    """Whether every update pulls into slot 0 and computes at w_t: SSGD, or a single slot (FixedDelay(0), one worker),
    with a rule that sends the weights as they are (a pull-side rule's backup is its look-ahead, not w_t).
    Then slot 0 always holds w_t bit for bit, so the step reads the live weights and the chunk writes the slot's
    weights once at its end: per update, a copy of the weights into the slot (and one XLA made to protect the slot
    from that write while the gradient read it) would be the only work beyond sequential SGD's."""
    return (ex.mode == "sync" or delays.num_slots == 1) and not server.has_pull(rule)


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What every update of a chunk shares (closed over by the step)."""

    grad_fn: Callable
    rule: optax.GradientTransformation
    delays: Any
    ex: Exchange
    data: Any
    data_words: jax.Array
    local_lr: jax.Array
    model_key: jax.Array
    partition: Any = None  # a fixed partition's asgd_jax.partition.Assignment; None: IID shards


class _Schedule(NamedTuple):
    """A chunk's updates as the delay model and the data order decide them, one row per update.

    None of it depends on the weights, so the chunk computes all of it before its first gradient
    (:func:`async_schedule`, :func:`sync_schedule`): the update loop then holds no data-order walk and no delay
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
    steps: jax.Array | None = None  # int32: the push's minibatches when fewer than n_sync (DyLU)


def _keep(valid: jax.Array | None, i: jax.Array, new: Any, old: Any) -> Any:
    """``new``, or ``old`` for a row past the ``valid`` ones (a last, shorter chunk); small state only."""
    if valid is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(i < valid, a, b), new, old)


def async_schedule(c: Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
    """The chunk's events and minibatches: ``(schedule, delay state, data state)`` after its last update (after the
    first ``valid`` rows, when given: the rows past them are computed but change no state)."""
    n_sync = c.ex.n_sync

    def one(carry, xs):
        t, k, i = xs
        delay_state, event = c.delays.next(carry[0], t, k, n_sync)
        # A replayed push rejected as NaN/Inf used up its minibatches: the shard moves past them (a drawn model's
        # skip is the literal 0, which leaves the program as it was).
        counters, used = carry[1][event.shard] + jnp.arange(n_sync, dtype=jnp.int32), n_sync
        if event.steps is not None:  # DyLU: the period's own minibatches only (a replayed run's skips are periods too)
            used = event.steps
        if not (isinstance(event.skip, int) and event.skip == 0):
            counters, used = counters + event.skip * used, (1 + event.skip) * used
        taken = carry[1].at[event.shard].add(used)
        return _keep(valid, i, (delay_state, taken), carry), (event._replace(skip=None), counters)

    rows = jnp.arange(ts.shape[0], dtype=jnp.int32)
    (delay_state, taken), (events, counters) = jax.lax.scan(one, (state.delay, state.data.taken), (ts, k_delays, rows))
    schedule = _Schedule(
        push_slot=events.push_slot,
        pull_slot=events.pull_slot,
        worker=events.push_slot if events.worker is None else events.worker,
        time=events.time.astype(jnp.float32),
        indices=_batch_indices(c, jnp.broadcast_to(events.shard[:, None], counters.shape), counters),
        round_key=None,
        busy=events.busy,
        wasted=events.wasted,
        steps=events.steps,
    )
    return schedule, delay_state, DataState(taken)


def round_schedule(c: Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
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
        indices=_batch_indices(c, shards, counters),
        round_key=jax.vmap(jax.random.fold_in, in_axes=(None, 0))(c.model_key, ts),
        busy=rounds.busy,
        wasted=rounds.wasted,
    )
    return schedule, delay_state, DataState(taken)


def sync_schedule(c: Ctx, state: SimState, ts: jax.Array, k_delays: jax.Array, valid: jax.Array | None = None):
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
    indices = _batch_indices(c, shards, counters)
    schedule = _Schedule(
        push_slot=zeros, pull_slot=zeros, worker=zeros - 1, time=times, indices=indices, round_key=keys
    )
    done = length if valid is None else valid
    return schedule, state.delay, DataState(state.data.taken + done * n_sync)


def _async_update(c: Ctx, srv: server.ServerState, workers: Any, x: _Schedule):
    """The scheduled push: that worker's payload at its snapshot (with its inner optimizer's state, when ``workers``
    holds them), applied; then its pull."""
    ex, live = c.ex, live_slot(c.rule, c.delays, c.ex)
    if live:
        params0, model_state0 = srv.params, srv.model_state
    else:
        params0, model_state0 = server.snapshot(srv, x.push_slot)
    # The worker's model randomness (dropout, augmentation) is keyed by what it knows when it computes: the version
    # it pulled and its id. The trainer's workers do the same, so a replayed trace draws the same masks.
    pulled = server.snapshot_version(srv, x.push_slot)
    k_model = jax.random.fold_in(jax.random.fold_in(c.model_key, pulled), x.push_slot)
    batches = jax.tree.map(lambda a: a[x.indices], c.data)  # [n_sync, batch, ...]
    if workers is None:
        payload, model_state, loss, aux = exchange.work(
            c.grad_fn, ex, params0, model_state0, batches, k_model, c.local_lr, steps=x.steps
        )
    else:  # the pushing worker's own optimizer state, read and written back
        mine = jax.tree.map(lambda a: a[x.worker], workers)
        payload, model_state, loss, aux, mine = exchange.work(
            c.grad_fn, ex, params0, model_state0, batches, k_model, c.local_lr, mine, steps=x.steps
        )
        workers = server.write_row(workers, x.worker, mine)
    srv, staleness = server.exchange(
        c.rule,
        srv,
        x.push_slot,
        payload,
        model_state if ex.stateful else None,
        pull_slot=x.pull_slot,
        stale_params=params0,  # the snapshot the gradient was computed at, read once
        pull_weights=not live,
        worker=x.worker,  # (a ring of versions' slot is not its worker)
    )
    return srv, workers, (loss, aux, staleness, ex.n_sync * ex.batch_size)


def _sync_update(c: Ctx, srv: server.ServerState, workers: Any, x: _Schedule):
    """An SSGD round: every worker's payload at w_t (each with its inner optimizer's state, when ``workers`` holds
    them), their mean applied once (as worker 0); or a round model's K payloads at w_t."""
    ex, num = c.ex, _round_size(c.delays)
    batches = jax.tree.map(lambda a: a[x.indices], c.data)  # [M, n_sync, batch, ...]
    live = live_slot(c.rule, c.delays, ex)
    if live:
        params0, model_state0 = srv.params, srv.model_state
    else:  # a pull-side rule: every worker computes at what slot 0's pull sent
        params0, model_state0 = server.snapshot(srv, 0)
    keys = jax.random.split(x.round_key, num)
    if workers is None:
        payloads, model_states, losses, auxes = jax.vmap(
            lambda b, k: exchange.work(c.grad_fn, ex, params0, model_state0, b, k, c.local_lr)
        )(batches, keys)
    else:  # (SSGD's workers are the round's, in order: worker m's state is row m)
        payloads, model_states, losses, auxes, workers = jax.vmap(
            lambda b, k, s: exchange.work(c.grad_fn, ex, params0, model_state0, b, k, c.local_lr, s)
        )(batches, keys, workers)
    mean_state = exchange.mean_tree(model_states) if ex.stateful else None
    # Every payload was computed at params0: slot 0's snapshot (the live weights w_t, see live_slot).
    # The round's step direction: their mean, or the round model's own combination (Shadowheart's weighted sum of
    # compressed per-worker sums).
    combine = getattr(c.delays, "combine", None)
    payload = (
        exchange.mean_tree(payloads) if combine is None else combine(payloads, jax.random.fold_in(x.round_key, num))
    )
    srv, staleness = server.exchange(c.rule, srv, 0, payload, mean_state, stale_params=params0, pull_weights=not live)
    aux = jax.tree.map(jnp.mean, auxes)
    return srv, workers, (losses.mean(), aux, staleness, num * ex.n_sync * ex.batch_size)


def _round_size(delays: Any) -> int:
    """Payloads per synchronous update: a round model's K, else every worker (SSGD)."""
    return delays.round_size if delays_lib.is_round_model(delays) else delays.num_slots


def step(c: Ctx, carry: Any, x: _Schedule):
    """One server update, as the chunk's schedule row ``x`` says. ``carry``: the server's state, or with an inner
    optimizer ``(server, workers)``, every worker's state of it too."""
    update = _async_update if c.ex.mode == "async" else _sync_update
    srv, workers = (carry, None) if not c.ex.keeps_inner_state else carry
    srv, workers, (loss, aux, staleness, examples) = update(c, srv, workers, x)
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
    return (srv if workers is None else (srv, workers)), metrics
