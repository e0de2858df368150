"""What every delay model shares: the updates it yields, the interface the engines read, value semantics, checks.

* :class:`Event` (one update of an event model) and :class:`Round` (one update of a round model: the mean of ``K``
  payloads computed at w_t); :func:`is_delay_model` and :func:`is_round_model` say which interface a value offers.
* :func:`pytree_dataclass` makes a model class a frozen dataclass registered as a pytree whose static fields are its
  structure: equal models are of one class with equal static fields and equal numbers (arrays element by element), and
  hash by class and static fields only, so a model keys a compiled program while its numbers are the program's
  arguments (:func:`asgd_jax.delays.split`).
* :func:`check_int` and :func:`check_array`, the checks of a model's numbers (a traced number is checked by whoever
  traced it: :func:`is_concrete`), raising :class:`asgd_jax.errors.ConfigError`.
* :class:`Counted` (M workers, each with its own data shard) and :class:`Stateless` (a schedule without state), mixins.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors


class Event(NamedTuple):
    """One server update as the delay model sees it.

    Attributes:
      push_slot: slot whose backup the pushed gradient was computed at (int32).
      pull_slot: slot that records a snapshot of the new weights after the update (int32).
      shard: data shard the pushing worker reads (int32).
      time: virtual time of the update (float32).
      skip: minibatch periods the shard skips before this push (int32): a replayed trainer run's pushes rejected as
        NaN/Inf, or gradients a policy ignored (:class:`Ringmaster`), which used up their minibatches and changed no
        weight; the literal 0 for the models that never skip.
      worker: the pushing worker, when it is not the push slot (a ring of versions, :class:`Ringmaster`).
      busy: the workers' compute time so far, wasted work included (the models of the optimal-time methods).
      wasted: of ``busy``, the work that changed no weight: ignored gradients and stopped computations.
      steps: the minibatches of the push's exchange period when they are fewer than ``n_sync`` (DyLU,
        :attr:`Workers.dylu`); None: ``n_sync``.
    """

    push_slot: jax.Array
    pull_slot: jax.Array
    shard: jax.Array
    time: jax.Array
    skip: Any = 0
    worker: Any = None
    busy: Any = None
    wasted: Any = None
    steps: Any = None


class Round(NamedTuple):
    """One update of a round model (:class:`Rennala`, :class:`MSync`): the mean of ``K`` payloads, every one computed
    at the current weights w_t.

    Attributes:
      shards: int32 ``[K]``: the worker (and data shard) of every payload, in the order they are averaged; a worker
        may appear more than once (a fast worker gives several gradients in one Rennala round).
      skips: int32 ``[K]``: minibatch periods that worker used on ignored gradients just before this payload's.
      time: the virtual time the round ends (its last used gradient arrives).
      busy, wasted: as in :class:`Event`.
    """

    shards: jax.Array
    skips: jax.Array
    time: jax.Array
    busy: jax.Array
    wasted: jax.Array


def is_delay_model(value: Any) -> bool:
    """Whether ``value`` offers the delay-model interface the engines use: static ints ``num_slots`` (backups the
    server keeps) and ``num_shards`` (data shards), and pure, traceable ``init(key, n_sync) -> state`` and
    ``next(state, t, key, n_sync) -> (state, Event)`` (``key`` already folded with the update index ``t``), or, for a
    round model, ``round_size`` and ``round(state, t, key, n_sync) -> (state, Round)``."""
    return all(hasattr(value, a) for a in ("num_slots", "num_shards", "init")) and (
        hasattr(value, "next") or is_round_model(value)
    )


def is_round_model(model: Any) -> bool:
    """Whether every update of ``model`` is a round: the mean of ``round_size`` payloads computed at w_t."""
    return hasattr(model, "round_size") and hasattr(model, "round")


def pytree_dataclass(cls, meta: tuple[str, ...]):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    cls.__eq__, cls.__hash__ = _equal, _hash
    data = tuple(f.name for f in dataclasses.fields(cls) if f.name not in meta)
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


def _equal(a: Any, b: Any) -> bool:
    """Delay models are equal when they are of one class with equal static fields and equal numbers, arrays compared
    element by element (a dataclass's own ``==`` asks an array for one truth value and raises), a traced number equal
    only to itself."""
    if type(a) is not type(b):
        return NotImplemented
    (xs, xdef), (ys, ydef) = jax.tree.flatten(a), jax.tree.flatten(b)
    same = lambda x, y: x is y or (is_concrete(x) and is_concrete(y) and np.array_equal(x, y))
    return xdef == ydef and all(same(x, y) for x, y in zip(xs, ys, strict=True))


def _hash(model: Any) -> int:
    """The class and static fields (equal models have equal hashes; numbers, arrays among them, are not hashed)."""
    return hash(jax.tree.structure(model))


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_int(name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lowest:
        raise errors.ConfigError(f"{name}={value!r} is invalid: {name} must be an int >= {lowest}.")


def check_array(name: str, value: Any, ok, expected: str, per_update: bool = False) -> None:
    """A number of a delay model (or, ``per_update``, an optional 1-D array of them): finite, ``ok``, not a bool.
    Traced values (a sweep's) are checked by the caller that made them."""
    if (value is None and per_update) or not is_concrete(value):
        return
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        array = np.asarray(None)
    numeric = errors.is_numeric(array.dtype)
    fits = array.ndim == 1 and array.size > 0 if per_update else array.ndim == 0
    with np.errstate(invalid="ignore"):  # (NaN compared: refused below, not warned about first)
        good = numeric and fits and bool(np.all(np.isfinite(array) & ok(array)))
    if not good:
        what = "a 1-D list of ints" if per_update else "a finite number"
        raise errors.ConfigError(f"{name}={value!r} is invalid: {name} must be {what} {expected}.")


def worker_numbers(name: str, value: Any, ok, expected: str) -> Any:
    """A number of a delay model given once or once per worker: a float32 number or 1-D array, each value not NaN and
    ``ok``; refused by name otherwise (traced values, a sweep's, as given)."""
    if not is_concrete(value):
        return value
    try:
        bad = isinstance(value, bool | str | bytes) or not errors.is_numeric(np.asarray(value).dtype)
        array = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        bad, array = True, np.zeros(0)
    if bad or array.ndim > 1 or array.size == 0 or np.isnan(array).any() or not np.all(ok(array)):
        raise errors.ConfigError(f"{name}={value!r} is invalid: give one number {expected}, or one per worker.")
    return array.astype(np.float32)


def for_workers(name: str, value: Any, num: int) -> Any:
    """A :func:`worker_numbers` value as ``[num]`` (one number for all broadcast), a list of another length refused;
    None and traced values as given."""
    if not isinstance(value, np.ndarray):
        return value
    if value.ndim == 1 and value.shape != (num,):
        raise errors.ConfigError(f"{name} has {value.size} values: give one, or {num} (one per worker).")
    return np.broadcast_to(value, (num,)).copy()


class Counted:
    """A model of ``num`` workers, each reading its own data shard."""

    @property
    def num_workers(self) -> int:
        return self.num

    @property
    def num_shards(self) -> int:
        return self.num


class Stateless:
    """A model whose schedule needs no state between updates (a recorded one, a fixed ring)."""

    def init(self, key: jax.Array, n_sync: int = 1) -> jax.Array:
        del key, n_sync
        return jnp.zeros((), jnp.int32)
