"""The classic analysis setting: the gradient applied at update t was computed at ``w_{max(0, t - tau)}``, with a fixed
tau (:class:`FixedDelay`) or one drawn per update (:class:`RandomDelay`); a ring of ``tau + 1`` snapshots as slots, one
data stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asgd_jax.delays.base import Event
from asgd_jax.delays.base import Stateless as _Stateless
from asgd_jax.delays.base import check_int as _check_int
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass


class _RingDelay(_Stateless):
    """Shared mechanics of the fixed-tau models: ``max_tau + 1`` snapshot slots read as a ring, one data stream."""

    @property
    def num_slots(self) -> int:
        return self._max_tau + 1

    @property
    def num_shards(self) -> int:
        return 1

    def _event(self, t: jax.Array, tau: jax.Array) -> Event:
        # Slot s holds w_v for the latest v <= t with v = s (mod H), so w_{max(0, t - tau)} sits in its slot.
        h = self.num_slots
        source = jnp.maximum(t - tau, 0) % h
        zero = jnp.zeros((), jnp.int32)
        return Event(
            source.astype(jnp.int32),
            ((t + 1) % h).astype(jnp.int32),
            zero,
            (t + 1).astype(jnp.float32),
        )


class FixedDelay(_RingDelay):
    """The gradient applied at update t is computed at ``w_{max(0, t - tau)}`` (classic fixed-delay analysis).

    Equivalent to ``tau + 1`` workers pushing round-robin; the minibatches come from one data stream.

    Args:
      tau: the delay, an int >= 0 (static: it sets the number of snapshots kept).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.FixedDelay(3).num_slots
      4
    """

    tau: int

    def __post_init__(self):
        _check_int("tau", self.tau, 0)

    @property
    def _max_tau(self) -> int:
        return self.tau

    def next(self, state, t, key, n_sync: int = 1):
        del key, n_sync
        return state, self._event(t, jnp.asarray(self.tau, jnp.int32))


FixedDelay = _pytree_dataclass(FixedDelay, meta=("tau",))


class RandomDelay(_RingDelay):
    """Like :class:`FixedDelay`, with tau drawn uniformly from ``0..max_tau`` for every update.

    Args:
      max_tau: the largest delay, an int >= 0 (static).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.delays.RandomDelay(4).num_slots
      5
    """

    max_tau: int

    def __post_init__(self):
        _check_int("max_tau", self.max_tau, 0)

    @property
    def _max_tau(self) -> int:
        return self.max_tau

    def next(self, state, t, key, n_sync: int = 1):
        del n_sync
        tau = jax.random.randint(key, (), 0, self.max_tau + 1, jnp.int32)
        return state, self._event(t, tau)


RandomDelay = _pytree_dataclass(RandomDelay, meta=("max_tau",))
