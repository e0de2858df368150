"""Rennala SGD's cluster (Tyurin & Richtárik, NeurIPS 2023): rounds of S gradients computed at the current weights,
any worker giving several; a gradient computed at an older iterate is ignored."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asgd_jax.delays.base import Round
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.clusters import Cluster as _Cluster
from asgd_jax.delays.clusters import ClusterState
from asgd_jax.delays.clusters import restart as _restart
from asgd_jax.delays.clusters import stop as _stop


class Rennala(_Cluster):
    """Rennala SGD's cluster (Tyurin & Richtárik, NeurIPS 2023, arXiv 2305.12387): rounds of S gradients.

    Every worker computes at the current weights x^k; the gradients computed at x^k are collected, as they arrive,
    until S have (a fast worker may give several, each on its next minibatch); then one update with their mean. A
    worker always begins at the newest iterate (the one whose gradient closes round k begins at x^{k+1}); a gradient
    computed at an older iterate is ignored (its minibatch used) and its worker restarts at x^k. With ``stops=True``
    every other worker is stopped at the round's end and restarts at x^{k+1} (the 2026 group code's semantics): then,
    with fixed times tau_i, a round takes exactly T_S = min{t : sum_i floor(t / tau_i) >= S}. Every computation,
    a restart included, takes its worker's next time (:func:`computation_time`).

    Every update is computed at w_t, so the server keeps no backup: one copy of the weights for any M.

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M.
      batch: S >= 1 (static: the round's payloads are one batched gradient).
      stops: restart every worker at the new weights after each round (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.Rennala(asgd_jax.delays.Workers(16), batch=4).round_size
      4
    """

    workers: Any
    batch: int = 1
    stops: bool = False

    def __post_init__(self):
        self._check("batch")

    num_slots = 1

    @property
    def round_size(self) -> int:
        return self.batch

    def round(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key  # the workers' times come from the cluster's own key (computation_time), one per computation begun
        law, size = self.workers, self.batch
        shards = jnp.zeros((size,), jnp.int32)

        def collecting(c):
            return c[1] < size

        def arrive(c):
            s, count, shards, skips = c
            w = jnp.argmin(s.finish).astype(jnp.int32)
            now, fresh = s.finish[w], s.start[w] == t
            slot = jnp.minimum(count, size - 1)
            shards = shards.at[slot].set(jnp.where(fresh, w, shards[slot]))
            skips = skips.at[slot].set(jnp.where(fresh, s.skips[w], skips[slot]))
            # The gradient that closes the round makes x^{k+1}: its worker begins the next one there (the newest).
            version = jnp.where(fresh & (count == size - 1), t + 1, t)
            s = _restart(law, s, w, now, version, ~fresh, n_sync)
            return s, count + fresh.astype(jnp.int32), shards, skips

        zero = jnp.zeros((), jnp.int32)
        s, _, shards, skips = jax.lax.while_loop(collecting, arrive, (s, zero, shards, shards))
        now = s.began.max()  # the last arrival: every worker that finished this round began its next one then
        if self.stops:  # every computation still at x^k (all but the closing worker's) restarts at x^{k+1}
            s = _stop(law, s, s.start == t, now, t + 1, n_sync)
        s = s._replace(clock=now)
        return s, Round(shards, skips, now, s.busy, s.wasted)


Rennala = _pytree_dataclass(Rennala, meta=("batch", "stops"))
