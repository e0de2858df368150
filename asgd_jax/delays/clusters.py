"""The optimal-time methods' clusters (:mod:`~asgd_jax.delays.ringmaster`, :mod:`~asgd_jax.delays.rennala`,
:mod:`~asgd_jax.delays.msync`): which gradients are used, ignored or stopped is decided by timing alone, so it is part
of the schedule, computed before any gradient.

What they share: :class:`ClusterState` (every worker's computation in progress and the work done so far),
:func:`computation_time` (the c-th computation of a worker takes its c-th time, whatever the policy), :func:`restart`
and :func:`stop` (a computation ends, used or wasted, and the next begins), and :class:`Cluster`, the base class of a
model of M workers drawn from a :class:`~asgd_jax.delays.workers.Workers` law."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from asgd_jax import errors
from asgd_jax.delays.base import check_int as _check_int
from asgd_jax.delays.workers import Workers


class ClusterState(NamedTuple):
    """Every worker's computation in progress, and the work done so far.

    Attributes:
      finish: float32 ``[M]``: when the computation in progress ends.
      began: float32 ``[M]``: when it began.
      start: int32 ``[M]``: the version (applied updates) of the weights it is computed at.
      skips: int32 ``[M]``: minibatch periods used on gradients that were ignored since the worker's last used one.
      clock: float32: the time of the last update.
      busy: float32: compute time of all workers so far, wasted work included (finished or stopped computations).
      wasted: float32: of ``busy``, the work that changed no weight (ignored gradients, stopped computations).
      begun: int32 ``[M]``: the computations each worker has begun (restarts after a stop included): the next one
        takes its worker's time number ``begun[w]`` (:func:`computation_time`).
      keys: the key data of every worker's sequence of times, ``[M, ...]``: ``fold_in(init key, w)`` (folded once, so
        a time costs one fold_in, not two).
    """

    finish: jax.Array
    began: jax.Array
    start: jax.Array
    skips: jax.Array
    clock: jax.Array
    busy: jax.Array
    wasted: jax.Array
    begun: jax.Array
    keys: jax.Array


def computation_time(workers: Workers, key: jax.Array, worker: jax.Array, count: jax.Array, n_sync: int = 1):
    """The time of computation number ``count`` (from 0) of ``worker`` in an optimal-time cluster (:class:`Ringmaster`,
    :class:`Rennala`) begun with ``key``: ``workers.work_time(fold_in(fold_in(key, worker), count), n_sync, worker)``.

    Every worker draws its own sequence of times, one per computation it begins, a restart after a stop included: the
    papers' model and their authors' simulators draw a computation's time when it starts, so a stopped computation
    does not keep the (long) time it had drawn, and the c-th computation of a worker takes the c-th time whatever the
    policy (runs with and without stops share their workers' times).

    Example:
      >>> import jax, asgd_jax
      >>> law = asgd_jax.delays.Workers.with_times([2.0, 3.0])
      >>> float(asgd_jax.delays.computation_time(law, jax.random.key(0), 1, 5))
      3.0
    """
    return workers.work_time(jax.random.fold_in(jax.random.fold_in(key, worker), count), n_sync, worker)


def worker_keys(key: jax.Array, num: int) -> jax.Array:
    """The key data of every worker's sequence of times, ``fold_in(key, w)``."""
    key = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    return jax.random.key_data(jax.vmap(lambda w: jax.random.fold_in(key, w))(jnp.arange(num, dtype=jnp.int32)))


def _time(workers: Workers, s: ClusterState, w: jax.Array, n_sync: int) -> jax.Array:
    """Worker ``w``'s next time (number ``begun[w]``): :func:`computation_time`, its worker's key folded in once."""
    return workers.work_time(jax.random.fold_in(jax.random.wrap_key_data(s.keys[w]), s.begun[w]), n_sync, w)


def _times(workers: Workers, s: ClusterState, n_sync: int) -> jax.Array:
    """Every worker's next time, ``[M]``."""
    return jax.vmap(lambda w: _time(workers, s, w, n_sync))(jnp.arange(workers.num, dtype=jnp.int32))


def _fresh(workers: Workers, key: jax.Array, n_sync: int) -> ClusterState:
    m = workers.num
    zero_f, zero_i = jnp.zeros((m,), jnp.float32), jnp.zeros((m,), jnp.int32)
    scalar = jnp.zeros((), jnp.float32)
    s = ClusterState(zero_f, zero_f, zero_i, zero_i, scalar, scalar, scalar, zero_i, worker_keys(key, m))
    return s._replace(finish=_times(workers, s, n_sync), begun=zero_i + 1)


def restart(workers: Workers, s: ClusterState, w, now, version, ignored: Any, n_sync: int) -> ClusterState:
    """Worker ``w``'s computation ends at ``now`` (its gradient used, or ``ignored``: a traced or Python bool), and it
    begins the next one, at ``version``'s weights, taking its next time. Only worker ``w``'s entries change (O(1) in a
    loop over arrivals)."""
    spent = now - s.began[w]
    work = _time(workers, s, w, n_sync)
    return s._replace(
        finish=s.finish.at[w].set(now + work),
        began=s.began.at[w].set(now),
        start=s.start.at[w].set(version),
        skips=s.skips.at[w].set(jnp.where(ignored, s.skips[w] + 1, 0)),
        busy=s.busy + spent,
        wasted=s.wasted + jnp.where(ignored, spent, 0.0),
        begun=s.begun.at[w].add(1),
    )


def stop(workers: Workers, s: ClusterState, which: jax.Array, now, version, n_sync: int) -> ClusterState:
    """Stops the computations ``which`` (bool ``[M]``) at ``now``: their work is wasted, and they begin again at
    ``version``'s weights on the same minibatch (none is used up), each taking its worker's next time (a new draw, as
    any computation that begins)."""
    spent = jnp.where(which, now - s.began, 0.0).sum()
    return s._replace(
        finish=jnp.where(which, now + _times(workers, s, n_sync), s.finish),
        began=jnp.where(which, now, s.began),
        start=jnp.where(which, version, s.start),
        busy=s.busy + spent,
        wasted=s.wasted + spent,
        begun=s.begun + which.astype(jnp.int32),
    )


class OfWorkers:
    """A model of M workers drawn from a :class:`Workers` law (its field ``workers``): one data shard each."""

    @property
    def num_workers(self) -> int:
        return self.workers.num

    @property
    def num_shards(self) -> int:
        return self.workers.num


class Cluster(OfWorkers):
    """Shared by the optimal-time models: M workers drawn from a :class:`Workers` law."""

    def init(self, key: jax.Array, n_sync: int = 1) -> ClusterState:
        return _fresh(self.workers, key, n_sync)

    def _check(self, knob: str) -> None:
        """The law (or an int M), the model's static int ``knob`` (>= 1) and, where it has one, ``stops``."""
        object.__setattr__(self, "workers", check_workers(self.workers))
        _check_int(knob, getattr(self, knob), 1)
        stops = getattr(self, "stops", False)
        errors.require(isinstance(stops, bool), "stops", stops, "give True or False")


def check_workers(workers: Any) -> Workers:
    """``workers`` as a :class:`Workers` law (an int M is ``Workers(M)``), refused by name otherwise."""
    if errors.is_int(workers):
        return Workers(workers)
    if not isinstance(workers, Workers):
        raise errors.ConfigError(
            f"workers={workers!r} is invalid: give an asgd_jax.delays.Workers (the compute-time law) or an int M."
        )
    errors.require(
        workers.availability is None,
        "workers.availability",
        workers.availability,
        "the optimal-time clusters and Overlapped do not model workers that come and go yet: use Workers(M) alone",
    )
    return workers
