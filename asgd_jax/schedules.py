"""Learning-rate schedules whose numbers are arguments of a compiled program.

A schedule is a function of the update count, as in optax. An optax schedule is a closure: a rule built with one is
keyed by the schedule's identity, so every new schedule object compiles the simulator again. The schedules here are
:mod:`asgd_jax.recipes`: their values and boundaries are numbers, so ``dc_asgd(schedules.piecewise(0.5, (80, 120)))``
and the same with other numbers share one program. Each computes exactly what its optax namesake computes.

Example:
  >>> from asgd_jax import schedules
  >>> lr = schedules.piecewise(0.5, (80, 120), 0.1)
  >>> [round(float(lr(t)), 4) for t in (79, 80, 120)]
  [0.5, 0.05, 0.005]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from asgd_jax import errors
from asgd_jax.recipes import recipe

__all__ = ["constant", "cosine", "piecewise", "warmed_up"]

Number = float | jax.Array


@recipe(numbers=("value",), elementwise=True)
def constant(value: Number) -> Callable[[jax.Array], jax.Array]:
    """``value`` at every update (``optax.constant_schedule``)."""
    return lambda count: value


@recipe(numbers=("init_value", "boundaries", "factor"), elementwise=True)
def piecewise(init_value: Number, boundaries: Sequence[Number], factor: Number = 0.1) -> Callable:
    r"""``init_value``, multiplied by ``factor`` at each of ``boundaries`` (update counts, increasing): DC-ASGD's
    step decay. The same arithmetic as ``optax.piecewise_constant_schedule(init_value, {b: factor for b in
    boundaries})``, so the same bits, with the boundaries numbers rather than part of the program.

    Example:
      >>> from asgd_jax import schedules
      >>> [float(schedules.piecewise(1.0, (2,), 0.5)(t)) for t in range(4)]
      [1.0, 1.0, 0.5, 0.5]
    """
    concrete = [b for b in boundaries if not isinstance(b, jax.core.Tracer)]
    errors.require(
        all(errors.is_int(b) or float(b) == int(b) for b in concrete) and concrete == sorted(concrete),
        "boundaries",
        list(boundaries),
        "give increasing update counts",
    )

    def schedule(count):
        v = init_value
        for threshold in boundaries:
            indicator = jnp.maximum(0.0, jnp.sign(threshold - count))
            v = v * indicator + (1 - indicator) * factor * v
        return v

    return schedule


@recipe(numbers=("init_value", "decay_steps", "alpha"), elementwise=True)
def cosine(init_value: Number, decay_steps: Number, alpha: Number = 0.0) -> Callable:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` updates, then flat: the same
    arithmetic as ``optax.cosine_decay_schedule(init_value, decay_steps, alpha)``.

    Example:
      >>> from asgd_jax import schedules
      >>> [round(float(schedules.cosine(1.0, 10, 0.1)(t)), 3) for t in (0, 5, 10, 20)]
      [1.0, 0.55, 0.1, 0.1]
    """
    concrete = not isinstance(decay_steps, jax.core.Tracer)
    errors.require(not concrete or float(decay_steps) > 0, "decay_steps", decay_steps, "give a count > 0")

    def schedule(count):
        progress = jnp.minimum(count, decay_steps) / decay_steps
        decayed = (1 - alpha) * 0.5 * (1 + jnp.cos(jnp.pi * progress)) + alpha
        return init_value * decayed

    return schedule


@recipe(numbers=("steps",), elementwise=True)
def warmed_up(schedule: Callable, steps: Number) -> Callable:
    """``schedule`` times ``min(1, (count + 1) / steps)``: a linear warm-up over the first ``steps`` updates (Goyal et
    al. 2017's gradual warm-up), then ``schedule`` itself.

    Example:
      >>> from asgd_jax import schedules
      >>> [float(schedules.warmed_up(schedules.constant(1.0), 4)(t)) for t in range(5)]
      [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    concrete = not isinstance(steps, jax.core.Tracer)
    errors.require(not concrete or float(steps) > 0, "steps", steps, "give a warm-up of at least one update")
    return lambda count: schedule(count) * jnp.minimum(1.0, (count + 1) / steps)
