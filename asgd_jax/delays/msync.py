"""m-Synchronous SGD's cluster (Begunov & Tyurin 2026): every round all M workers start at the current weights and the
first m gradients are averaged, the other computations stopped."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asgd_jax import errors
from asgd_jax.delays.base import Round
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.clusters import Cluster as _Cluster
from asgd_jax.delays.clusters import ClusterState
from asgd_jax.delays.clusters import worker_keys as _worker_keys


class MSync(_Cluster):
    """m-Synchronous SGD's cluster (Begunov & Tyurin 2026, arXiv 2602.03802): every round, all M workers start at the
    current weights; the first m gradients (one per worker) are averaged into one update, the other M - m
    computations are stopped at that moment and discarded. ``MSync(Workers(M), m=M)`` is synchronous minibatch SGD
    (``Plan(mode="sync")``), bit for bit: same draws, same minibatches, same mean.

    The rule is reconstructed from the paper's summary (the paper's own code was not read): UNCONFIRMED in detail.

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M.
      m: 1 <= m <= M, the gradients per update (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.MSync(asgd_jax.delays.Workers(8), m=3).round_size
      3
    """

    workers: Any
    m: int = 1

    def __post_init__(self):
        self._check("m")
        if self.m > self.workers.num:
            raise errors.ConfigError(f"m={self.m} is invalid: at most the {self.workers.num} workers (m <= M).")

    num_slots = 1

    @property
    def round_size(self) -> int:
        return self.m

    def init(self, key: jax.Array, n_sync: int = 1) -> ClusterState:
        """Every round draws its own times (from the update's key, as SSGD): no computation is in progress between
        rounds."""
        del n_sync
        zero_f, zero_i = jnp.zeros((self.workers.num,), jnp.float32), jnp.zeros((self.workers.num,), jnp.int32)
        scalar = jnp.zeros((), jnp.float32)
        return ClusterState(
            zero_f, zero_f, zero_i, zero_i, scalar, scalar, scalar, zero_i, _worker_keys(key, self.workers.num)
        )

    def round(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del t
        times = self.workers.work_time(key, n_sync)  # SSGD's draw (Workers.sync_time), every worker from the round
        if self.m == self.workers.num:
            shards, took = jnp.arange(self.m, dtype=jnp.int32), times.max()
            busy, wasted = times.sum(), jnp.zeros((), jnp.float32)
        else:
            first = jnp.argsort(times, stable=True)[: self.m]  # ties go to the lower id
            shards, took = jnp.sort(first).astype(jnp.int32), times[first[-1]]
            busy, wasted = times[first].sum() + (self.workers.num - self.m) * took, (self.workers.num - self.m) * took
        now = (s.clock + took).astype(jnp.float32)
        s = s._replace(clock=now, busy=s.busy + busy, wasted=s.wasted + wasted)
        return s, Round(shards, jnp.zeros((self.m,), jnp.int32), now, s.busy, s.wasted)


MSync = _pytree_dataclass(MSync, meta=("m",))
