"""Gap-Aware: Barkai, Hakimi, Schuster, "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020.

:func:`gap_aware` divides a stale gradient elementwise by how far the weights moved while it was computed (in typical
steps), as in the authors' FTPipe code; :class:`GapAwareState` is its state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


class GapAwareState(NamedTuple):
    """State of :func:`gap_aware`: the update count, the running mean square of the update direction ``r``, the
    momentum trace (``None`` without momentum) and the largest learning rate seen so far."""

    count: jax.Array
    mean_square: optax.Updates
    trace: optax.Updates | None
    max_rate: jax.Array


@recipe
def gap_aware(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: float | jax.Array | None = None,
    decay: float | jax.Array = 0.999,
    eps: float | jax.Array = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    r"""Gap-Aware: penalises a stale gradient elementwise by how far the weights moved while it was computed.

    .. math::
        r_t = \beta r_{t-1} + (1 - \beta)\, u^2, \quad
        C = \eta_{\max}\left(\sqrt{r_t / (1 - \beta^t)} + \epsilon\right), \quad
        G = 1 + \frac{|w_t - w_{bak}(m)|}{C}, \quad \tilde g = g / G

    then the plain (momentum) SGD step with :math:`\tilde g`: :math:`v \leftarrow \gamma v + \tilde g`,
    :math:`w \leftarrow w - \eta v`. ``u`` is the momentum trace before this step (the gradient without momentum);
    ``C`` is the size of one typical full step (the largest learning rate so far times the bias-corrected RMS of the
    update direction), so :math:`G - 1` counts the typical steps the weights moved while the gradient was in flight.
    :math:`G \ge 1` never amplifies. The first update is not penalised (with momentum its ``r`` would be 0 and ``C``
    vanish; the authors' code skips it too).

    Args:
      learning_rate: a float or an optax schedule over server updates.
      momentum: optional heavy-ball momentum in [0, 1); the penalty comes first, as in the authors' code.
      decay: :math:`\beta` of the running mean square (0.999, no new tunable).
      eps: :math:`\epsilon` (1e-8).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``stale_params``.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.gap_aware(0.1)
      >>> w, g = jnp.array([1.0, 1.0]), jnp.array([2.0, 2.0])
      >>> state = rule.init(w)
      >>> _, state = rule.update(g, state, w, stale_params=w)               # update 1: never penalised
      >>> # A typical step is 0.1 * 2 = 0.2; the second weight moved by one while g was in flight: G = 2.
      >>> [round(x, 4) for x in rule.update(g, state, w, stale_params=jnp.array([1.0, 0.8]))[0].tolist()]
      [-0.2, -0.1]

    References:
      Barkai, Hakimi, Schuster, "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020; the rule as in the authors'
      FTPipe code (``sgd_gap_aware.py``: C = max lr x bias-corrected RMS of the update direction, not a mean of past
      steps; weight decay is not offered here).
    """
    if momentum is not None:
        common.check_decay("momentum", momentum)
    common.check_decay("decay", decay)
    common.check_positive("eps", eps)
    common.check_learning_rate(learning_rate)

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        trace = None if momentum is None else jax.tree.map(jnp.zeros_like, params)
        return GapAwareState(jnp.zeros((), jnp.int32), zeros, trace, jnp.zeros((), jnp.float32))

    def update_fn(updates, state, params=None, *, stale_params, **extra_args):
        del extra_args
        count = optax.safe_increment(state.count)
        rate = common.rate(learning_rate, state.count)
        max_rate = jnp.maximum(state.max_rate, rate)
        direction = updates if state.trace is None else state.trace
        mean_square = jax.tree.map(lambda r, u: decay * r + (1.0 - decay) * u * u, state.mean_square, direction)

        def penalise(g, r, w, wb):
            # In the weights' precision (float64 weights get a float64 bias correction), and only once a step was
            # taken: with a learning rate of 0 so far there is no typical step to measure the gap in (FTPipe guards
            # on the largest learning rate so far being positive; C = 0 made NaN weights here).
            correction = 1.0 - jnp.asarray(decay, r.dtype) ** count.astype(r.dtype)
            scale = max_rate.astype(r.dtype) * (jnp.sqrt(r / correction) + eps)
            penalised = (count > 1) & (max_rate > 0)
            gap = jnp.where(penalised, 1.0 + jnp.abs(w - wb) / jnp.where(penalised, scale, 1.0), 1.0)
            return (g / gap).astype(g.dtype)

        penalised = jax.tree.map(penalise, updates, mean_square, params, stale_params)
        if state.trace is None:
            trace, step = None, penalised
        else:
            trace = jax.tree.map(lambda v, g: momentum * v + g, state.trace, penalised)
            step = trace
        new = jax.tree.map(lambda s: (-rate * s).astype(s.dtype), step)
        return new, GapAwareState(count, mean_square, trace, max_rate)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
