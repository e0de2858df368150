"""What the rules share, none of it a rule: the checks of their hyperparameters, the SGD step they end in.

The checks take a number that may arrive traced (under ``jit``, ``vmap`` or :func:`optax.inject_hyperparams`) and check
it only when it is concrete. :func:`sgd` is the optax SGD step (learning rate, momentum, Nesterov) that the
``<x>(learning_rate, ...)`` rules chain after their ``scale_by_<x>``; :func:`rate` the learning rate at an update count
for the rules that step themselves; :func:`scale_by` the stateless rule of a staleness-dependent factor. A rule module
uses them as ``common.check_decay(...)``; they are public because several modules do, and not re-exported by
:mod:`asgd_jax.rules`. :class:`PullRule`, the form of a rule that also decides what a worker pulls (DANA), is
re-exported there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import errors, server

ScalarOrSchedule = float | jax.Array | optax.Schedule


def _is_concrete(value: Any) -> bool:
    """True when ``value`` can be checked in Python (not a tracer from jit/vmap/inject_hyperparams)."""
    return not isinstance(value, jax.core.Tracer)


def _check(name: str, value: Any, ok, expected: str) -> None:
    """Checks a numeric hyperparameter that may be an array, unless it is traced."""
    if not _is_concrete(value):
        return
    # (np.generic: ml_dtypes' scalars, a bfloat16 one, are no np.number; a bool's dtype is refused below)
    numeric = isinstance(value, int | float | np.generic | np.ndarray | jax.Array) and not isinstance(value, bool)
    v = np.asarray(value) if numeric else None
    with np.errstate(invalid="ignore"):  # (NaN compared: refused below, not warned about first)
        good = numeric and errors.is_numeric(v.dtype) and bool(np.all(np.isfinite(v) & ok(v)))
    errors.require(good, name, value, f"{name} must be a finite number {expected}")


def check_nonnegative(name: str, value: Any) -> None:
    _check(name, value, lambda v: v >= 0, ">= 0")


def check_positive(name: str, value: Any) -> None:
    _check(name, value, lambda v: v > 0, "> 0")


def check_decay(name: str, value: Any) -> None:
    _check(name, value, lambda v: (v >= 0) & (v < 1), "in [0, 1)")


def check_num_workers(name: str, value: Any, *, static: bool) -> None:
    if static and not (isinstance(value, int) and not isinstance(value, bool)):
        raise errors.ConfigError(
            f"{name}={value!r} is invalid: it sets the shape of the per-worker state, so it must be a Python int "
            f"(under optax.inject_hyperparams pass static_args=({name!r},))."
        )
    _check(name, value, lambda v: v >= 1, ">= 1")


def check_learning_rate(learning_rate: Any) -> None:
    if callable(learning_rate):  # an optax schedule
        return
    _check("learning_rate", learning_rate, lambda v: v >= 0, ">= 0 (or an optax schedule)")


def sgd(learning_rate: ScalarOrSchedule, momentum: float | None, nesterov: bool) -> optax.GradientTransformation:
    if momentum is not None:
        check_decay("momentum", momentum)
    check_learning_rate(learning_rate)
    return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


def scale_by(factor_fn) -> optax.GradientTransformationExtraArgs:
    """A stateless rule multiplying every leaf of the update by ``factor_fn(staleness)``."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, staleness, **extra_args):
        del params, extra_args
        factor = factor_fn(jnp.asarray(staleness))
        return jax.tree.map(lambda g: (factor * g).astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def rate(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
    """The learning rate at update ``count`` (a float or an optax schedule)."""
    return jnp.asarray(learning_rate(count) if callable(learning_rate) else learning_rate, jnp.float32)


class PullRule(NamedTuple):
    """An update rule that also decides what a worker pulls: ``pull(params, state, worker) -> the weights sent``.

    The server applies it in its pull and keeps what it sent as the worker's backup, so the worker's gradient and the
    rule's ``stale_params`` are at exactly those weights; the simulator, the store and the Ray backend share it, and a
    recorded trace replays (the pull is a pure function of the server's state).
    """

    init: Callable
    update: Callable
    pull: Callable


class MeanTable(NamedTuple):
    """Per-slot running means of the gradients of one round (leaves ``[S, *leaf]``), their counts, and the round each
    row holds: a row stamped with another round reads as empty, so a new round clears the table in O(1) (Malenia SGD's
    and Ringleader ASGD's tables)."""

    means: optax.Updates
    counts: jax.Array  # int32 [S]
    stamps: jax.Array  # int32 [S]


def mean_table(params: optax.Params, slots: int) -> MeanTable:
    """An empty :class:`MeanTable` of ``slots`` rows shaped like ``params``."""
    means = jax.tree.map(lambda p: jnp.zeros((slots, *jnp.shape(p)), jnp.result_type(p)), params)
    return MeanTable(means, jnp.zeros((slots,), jnp.int32), jnp.full((slots,), -1, jnp.int32))


def fold_mean(table: MeanTable, slot: jax.Array, stamp: jax.Array, grads: optax.Updates):
    """Folds ``grads`` into row ``slot``'s running mean of round ``stamp`` (mean += (g - mean) / count), in O(row).

    Returns:
      ``(table, change, first)``: the table, the change of that row's mean (a pytree), and whether ``grads`` is the
      row's first gradient of the round.
    """
    valid = table.stamps[slot] == stamp
    read = server.row(table.means, slot)
    old = jax.tree.map(lambda o: jnp.where(valid, o, jnp.zeros_like(o)), read)
    count = jnp.where(valid, table.counts[slot], 0) + 1
    new = jax.tree.map(lambda o, g: o + (g - o) / count.astype(o.dtype), old, grads)
    means = server.replace_row(table.means, slot, new, read)
    change = jax.tree.map(jnp.subtract, new, old)
    return MeanTable(means, table.counts.at[slot].set(count), table.stamps.at[slot].set(stamp)), change, ~valid
