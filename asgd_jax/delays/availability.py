"""Clusters that come and go: :class:`Availability`, each worker's online windows and its dropouts with a time of
return. An offline worker's next chance is a later time, never a yes/no: a computation that would begin while its
worker is away begins when the worker is back (the fix APPFL's simulator had to make)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax.delays.base import for_workers as _for_workers
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.base import worker_numbers as _numbers

__all__ = ["Availability"]

_CHECKS = {
    "period": (lambda v: v > 0, "> 0"),
    "online": (lambda v: (v > 0) & (v <= 1), "in (0, 1]"),
    "phase": (lambda v: v >= 0, ">= 0"),
    "dropout_prob": (lambda v: (v >= 0) & (v <= 1), "in [0, 1]"),
    "return_time": (lambda v: v > 0, "> 0"),
}


class Availability:
    """When each worker can work: online windows, and dropouts with a time of return.

    Worker w is online during ``[phase + k * period, phase + k * period + online * period)`` for every integer k (and
    always, with ``online=1``, the default). After each of its pushes it drops out with probability
    ``dropout_prob`` and returns after an exponential time of mean ``return_time`` (a new draw per dropout). A
    computation that would begin while its worker is offline or away begins at the worker's next online instant;
    one in progress runs to its end (a window that closes does not stop it). Every number is one for all workers or
    one per worker (``[M]``), a number of the run; a ``dropout_prob`` of a literal 0 draws nothing.

    Give it to :class:`~asgd_jax.delays.Workers` (``Workers(M, availability=Availability(...))``).

    Args:
      period: the length of a worker's cycle of online and offline time (> 0).
      online: the fraction of each period the worker is online, from its start (in (0, 1]).
      phase: when the worker's first period begins (>= 0: ``phase=[0, 5]`` staggers two workers).
      dropout_prob: the probability that a worker drops out after a push (in [0, 1]).
      return_time: the mean time a dropped-out worker stays away (> 0).

    Example:
      >>> import asgd_jax
      >>> a = asgd_jax.delays.Availability(period=10.0, online=0.5)
      >>> [float(a.next_online(t, 0)) for t in (3.0, 5.0, 12.5)]   # online in [0, 5), [10, 15), ...
      [3.0, 10.0, 12.5]
    """

    period: Any = 1.0
    online: Any = 1.0
    phase: Any = 0.0
    dropout_prob: Any = 0.0
    return_time: Any = 1.0

    def __post_init__(self):
        for name, (ok, expected) in _CHECKS.items():
            value = getattr(self, name)
            if name == "dropout_prob" and isinstance(value, int | float) and value == 0:
                continue  # the literal 0 that switches the draw off
            object.__setattr__(self, name, _numbers(name, value, lambda v, ok=ok: np.isfinite(v) & ok(v), expected))

    def for_workers(self, num: int) -> Availability:
        """This availability for ``num`` workers (every array ``[num]``; a list of another length refused)."""
        return dataclasses.replace(self, **{name: _for_workers(name, getattr(self, name), num) for name in _CHECKS})

    def _of(self, name: str, worker: Any) -> jax.Array:
        v = jnp.asarray(getattr(self, name), jnp.float32)
        return v if v.ndim == 0 else v[worker]

    def next_online(self, t: Any, worker: Any) -> jax.Array:
        """The first instant at or after ``t`` when ``worker`` is online (``t`` and ``worker`` arrays of one shape,
        or scalars)."""
        t = jnp.asarray(t, jnp.float32)
        period, online, phase = (self._of(k, worker) for k in ("period", "online", "phase"))
        into = jnp.mod(t - phase, period)  # where t falls in its period (>= 0)
        return jnp.where(into < online * period, t, t + (period - into))

    def begin(self, key: jax.Array, worker: Any, t: Any) -> jax.Array:
        """When ``worker``, free at ``t`` after a push, begins its next computation: after a dropout's absence, if it
        drops out, at its next online instant."""
        t = jnp.asarray(t, jnp.float32)
        if not (isinstance(self.dropout_prob, int | float) and self.dropout_prob == 0):
            drops = jax.random.bernoulli(jax.random.fold_in(key, 3), self._of("dropout_prob", worker))
            away = self._of("return_time", worker) * jax.random.exponential(jax.random.fold_in(key, 4), (), jnp.float32)
            t = t + jnp.where(drops, away, 0.0)
        return self.next_online(t, worker)


Availability = _pytree_dataclass(Availability, meta=())
