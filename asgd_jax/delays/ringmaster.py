"""Ringmaster ASGD's cluster (Maranjyan, Tyurin & Richtárik, ICML 2025): a gradient fewer than R updates stale is
applied, a staler one ignored (or, with stops, its computation stopped); a ring of R weight versions."""

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


class Ringmaster(_Cluster):
    """Ringmaster ASGD's cluster (Maranjyan, Tyurin & Richtárik, ICML 2025, arXiv 2501.16168).

    Asynchronous workers drawn from ``workers``; a gradient whose delay (updates *applied* since its worker began it)
    is below ``threshold`` R is applied (x <- x - lr g with the arm's rule, plain SGD in the paper); otherwise it is
    ignored (its minibatch used, no weight changed, the version not advanced) and the worker restarts at the current
    weights. With ``stops=True`` every arriving gradient is applied and, after each update, a worker whose
    computation in progress has become R updates stale is stopped and restarted at the current weights. Every
    computation, a restart included, takes its worker's next time (:func:`computation_time`).

    The server keeps a ring of R weight versions (no backup per worker: M = 1,000 workers cost R copies of the
    weights), so R is static; the paper's hyperparameters are the step size and R (its quadratic script: R = 6).
    Lemma 4.1 (fixed times, with stops): any R consecutive updates finish within 2 min_m H_m (1 + R/m).

    Args:
      workers: the compute-time law (:class:`Workers`), or an int M for ``Workers(M)``.
      threshold: R >= 1 (static).
      stops: stop and restart a computation that has become R updates stale (static).

    Example:
      >>> import asgd_jax
      >>> cluster = asgd_jax.delays.Ringmaster(asgd_jax.delays.Workers(1000), threshold=6)
      >>> cluster.num_workers, cluster.num_slots
      (1000, 6)
    """

    workers: Any
    threshold: int = 1
    stops: bool = False

    def __post_init__(self):
        self._check("threshold")

    @property
    def num_slots(self) -> int:
        return self.threshold

    def next(self, s: ClusterState, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key  # the workers' times come from the cluster's own key (computation_time), one per computation begun
        law, r = self.workers, self.threshold

        def arrival(s):
            w = jnp.argmin(s.finish).astype(jnp.int32)
            return w, s.finish[w]

        if not self.stops:  # ignore (and restart) every arrival as stale as R or more, until one is applied

            def ignored(s):
                return t - s.start[arrival(s)[0]] >= r

            def ignore(s):
                w, now = arrival(s)
                return _restart(law, s, w, now, t, True, n_sync)

            s = jax.lax.while_loop(ignored, ignore, s)
        w, now = arrival(s)
        push_slot, skip = s.start[w] % r, s.skips[w]
        s = _restart(law, s, w, now, t + 1, False, n_sync)
        if self.stops:
            s = _stop(law, s, (t + 1 - s.start) >= r, now, t + 1, n_sync)
        s = s._replace(clock=now)
        event = Event(push_slot, (t + 1) % r, w, now, skip, w, s.busy, s.wasted)
        return s, event


Ringmaster = _pytree_dataclass(Ringmaster, meta=("threshold", "stops"))
