"""Compute and communication as separate resources: :class:`Overlapped`, workers that compute their next gradient
while the last one uploads."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from asgd_jax.delays.base import Event
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.clusters import OfWorkers as _OfWorkers
from asgd_jax.delays.clusters import check_workers as _check_workers


class OverlappedState(NamedTuple):
    """Every worker's next push arrival, the end of the computation after it, and its pushes so far (their parity
    picks the slot)."""

    arrive: jax.Array
    computed: jax.Array
    pushes: jax.Array


class Overlapped(_OfWorkers):
    """M workers whose computing and communicating overlap: a worker begins its next gradient as soon as it has
    finished one, while that one uploads (one push in flight at a time, uploads one after the other on its link), at
    the freshest weights it holds.

    Per worker: computation k ends at F_k; its push uploads from max(F_k, the previous push's arrival) for the
    upload time (``comm_time`` plus the links' upload, :class:`Links`) and reaches the server at A_k, where it is
    applied; the reply (the fresh weights) takes the download time. Computation k + 1 begins at max(F_k, the arrival
    of reply k - 1): it computes at reply k - 1's weights, while push k is on its way. So a compute-bound worker
    pushes every compute time (not compute + upload + download), a communication-bound one every upload time, and
    every gradient is at least one of its own pushes stale (one worker: always exactly 1 after its first two pushes,
    as ``FixedDelay(1)``).

    The server keeps two backups per worker (slot ``2w + k mod 2``: the weights of reply k, which computation k + 2
    reads): 2M copies of the weights. Simulator only (the trainer's workers communicate for real).

    Args:
      workers: the law of compute times and links (:class:`Workers`, its ``links`` and ``comm_time`` the upload and
        download), or an int M.

    Example:
      >>> import asgd_jax
      >>> law = asgd_jax.delays.Workers.with_times([1.0], links=asgd_jax.delays.Links(latency=0.5))
      >>> asgd_jax.delays.Overlapped(law).num_slots
      2
    """

    workers: Any

    def __post_init__(self):
        object.__setattr__(self, "workers", _check_workers(self.workers))

    @property
    def num_slots(self) -> int:
        return 2 * self.workers.num

    def _link(self, worker: Any = None, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(upload, download)`` seconds (``comm_time`` counts as upload)."""
        law = self.workers
        comm = jnp.asarray(law.comm_time, jnp.float32)
        if law.links is None:
            return comm, jnp.float32(0.0)
        up, down = law.links.times(worker, key)
        return comm + up, down

    def _compute(self, key: jax.Array, n_sync: int, worker: Any = None) -> jax.Array:
        return self.workers.draw(key, (n_sync,), worker).sum(axis=0)

    def init(self, key: jax.Array, n_sync: int = 1) -> OverlappedState:
        first = self._compute(jax.random.fold_in(key, 0), n_sync)
        second = self._compute(jax.random.fold_in(key, 1), n_sync)
        up, _ = self._link(None, jax.random.fold_in(key, 2))
        zero = jnp.zeros((self.workers.num,), jnp.int32)
        return OverlappedState(first + up, first + second, zero)

    def next(self, s: OverlappedState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del t
        w = jnp.argmin(s.arrive).astype(jnp.int32)  # first minimum: ties go to the lower id
        now, up, down = s.arrive[w], *self._link(w, key)
        slot = 2 * w + s.pushes[w] % 2
        # Push k + 1 uploads once computed and the link is free; computation k + 2 begins once computation k + 1 is
        # done and reply k (this push's) has arrived.
        arrive = jnp.maximum(s.computed[w], now) + up
        computed = jnp.maximum(s.computed[w], now + down) + self._compute(key, n_sync, w)
        s = OverlappedState(s.arrive.at[w].set(arrive), s.computed.at[w].set(computed), s.pushes.at[w].add(1))
        return s, Event(slot, slot, w, now, 0, w)


Overlapped = _pytree_dataclass(Overlapped, meta=())
