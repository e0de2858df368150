"""Delayed Nesterov: Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous Local-SGD
Training for Language Modeling", 2024 (a preprint).

:func:`delayed_nesterov`, for local-SGD workers that push a parameter delta: plain steps on every push, the momentum
step only every ``buffer_size`` pushes; :class:`DelayedNesterovState` is its state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


class DelayedNesterovState(NamedTuple):
    """State of :func:`delayed_nesterov`: pushes so far, the momentum ``m`` and the buffered sum of pushes."""

    count: jax.Array
    momentum: optax.Updates
    buffer: optax.Updates


@recipe(elementwise=True)
def delayed_nesterov(
    learning_rate: ScalarOrSchedule,
    *,
    buffer_size: int | jax.Array = 4,
    momentum: float | jax.Array = 0.9,
    activation: float | jax.Array = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Delayed Nesterov: plain steps on every push, the momentum step only every ``buffer_size`` pushes.

    For local-SGD workers that push a parameter delta (``push="delta"``, ``n_sync > 1``), with :math:`N` the buffer
    size, :math:`\beta` the momentum, :math:`c \in [0, 1/N]` the momentum activation and :math:`\epsilon` the
    learning rate, a push :math:`g_t` does :math:`\Delta \leftarrow \Delta + g_t` and

    .. math::
        t \bmod N = 0:\; m \leftarrow \beta m + \Delta / N,\;
            w \leftarrow w - \epsilon\left[(1 - cN + c)\,\beta m + g_t / N\right],\; \Delta \leftarrow 0 \\
        \text{else:}\; w \leftarrow w - \epsilon\left[c\,\beta m + g_t / N\right]

    Over N pushes (c = 0) that is one Nesterov step on the mean of N pushes, as synchronous DiLoCo with N workers would
    take, while every push still moves the weights at once. N = 1, c = 0 is Nesterov SGD.

    Args:
      learning_rate: :math:`\epsilon`, the outer learning rate (a float or a schedule).
      buffer_size: N >= 1 pushes per momentum step (may be traced); the authors buffer as many as there are workers.
      momentum: :math:`\beta` in [0, 1).
      activation: :math:`c` in [0, 1/N] (0, the default of the public reimplementations).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.delayed_nesterov(1.0, buffer_size=2, momentum=0.5)
      >>> w, state = jnp.zeros(1), rule.init(jnp.zeros(1))
      >>> u1, state = rule.update(jnp.array([2.0]), state, w)   # not a flush: w - g/N
      >>> u2, state = rule.update(jnp.array([4.0]), state, w)   # flush: m = 0.5*0 + (2+4)/2 = 3; w - (0.5*3 + 4/2)
      >>> u1, u2
      (Array([-1.], dtype=float32), Array([-3.5], dtype=float32))

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous Local-SGD Training for Language
      Modeling", 2024 (Delayed Nesterov, as reimplemented in utnslab/halos ``opt.py``).
    """
    common.check_positive("buffer_size", buffer_size)
    common.check_decay("momentum", momentum)
    common.check_nonnegative("activation", activation)
    common.check_learning_rate(learning_rate)

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros(), zeros())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        rate = common.rate(learning_rate, state.count)
        n = jnp.asarray(buffer_size, jnp.float32)
        flush = count % jnp.asarray(buffer_size, jnp.int32) == 0
        c = jnp.asarray(activation, jnp.float32)
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        # (in the momentum's own dtype: a bfloat16 weight's would turn float32, and a scan's carry may not change type)
        m = jax.tree.map(lambda m, d: jnp.where(flush, momentum * m + d / n, m).astype(m.dtype), state.momentum, buffer)
        weight = jnp.where(flush, 1.0 - c * n + c, c) * momentum

        def step(m, g):
            return (-rate * (weight * m + g / n)).astype(g.dtype)

        new = jax.tree.map(step, m, updates)
        buffer = jax.tree.map(lambda d: jnp.where(flush, jnp.zeros_like(d), d), buffer)
        return new, DelayedNesterovState(count, m, buffer)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
