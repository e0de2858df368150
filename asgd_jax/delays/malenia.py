"""Malenia SGD's cluster (Tyurin & Richtárik, NeurIPS 2023): rounds that close when every worker has reported at the
round's weights, every other computation then stopped; paired with the rule :func:`asgd_jax.rules.malenia_sgd`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asgd_jax.delays.base import Event
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.clusters import Cluster as _Cluster
from asgd_jax.delays.clusters import ClusterState
from asgd_jax.delays.clusters import restart as _restart
from asgd_jax.delays.clusters import stop as _stop


class Malenia(_Cluster):
    """Malenia SGD's cluster (Tyurin & Richtárik, NeurIPS 2023, arXiv 2305.12387, Algorithm 5; the heterogeneous-data
    sibling of :class:`Rennala`).

    Round k: every worker computes at x^k, one gradient after another (each on its next minibatch), and every arrival
    is a push; the round closes at the arrival that makes every worker have reported at least once. Then every other
    computation in progress is stopped (its work wasted, its minibatch not used) and every worker begins round k + 1 at
    x^{k+1}, as the KAUST group's simulator resets all nodes at each step. With fixed times tau_i a round takes
    exactly max_i tau_i and worker i gives floor(max_j tau_j / tau_i) gradients (ties aside).

    The weights move only at a round's last arrival: the rule :func:`asgd_jax.rules.malenia_sgd` keeps each worker's
    running mean of the round and steps with the mean over workers at that arrival, a zero step at every other (the
    version counts arrivals, so ``num_updates`` is a budget of pushes). Every gradient is computed at the current
    weights: the server keeps one copy of the weights for any M. Simulator only (the trainer refuses it).

    Whether the arriving worker closes the round is read from the cluster's state alone: a worker that has reported
    this round began its next computation at a later version than the round's start, so the round's start is the least
    ``start`` and the round closes when its arriving worker is the only one still there.

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M.

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.Malenia(asgd_jax.delays.Workers.with_times([1.0, 2.5])).num_workers
      2
    """

    workers: Any

    def __post_init__(self):
        self._check("num_workers")

    num_slots = 1

    def next(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key  # the workers' times come from the cluster's own key (computation_time), one per computation begun
        law = self.workers
        w = jnp.argmin(s.finish).astype(jnp.int32)
        now, skip = s.finish[w], s.skips[w]
        first = s.start.min()
        closes = (s.start[w] == first) & ((s.start == first).sum() == 1)
        s = _restart(law, s, w, now, t + 1, False, n_sync)
        s = _stop(law, s, closes & (jnp.arange(law.num) != w), now, t + 1, n_sync)
        s = s._replace(clock=now)
        zero = jnp.zeros((), jnp.int32)
        return s, Event(zero, zero, w, now, skip, w, s.busy, s.wasted)


Malenia = _pytree_dataclass(Malenia, meta=())
