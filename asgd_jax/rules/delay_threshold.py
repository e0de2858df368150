"""Koloskova, Stich, Jaggi, "Sharper Convergence Guarantees for Asynchronous SGD for Distributed and Federated
Learning", NeurIPS 2022: the delay-adaptive step of their Theorem 8, :func:`delay_threshold_sgd` (full steps up to a
delay of M, then a step bounded by c / tau, or none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


@recipe(elementwise=True)
def delay_threshold_sgd(
    learning_rate: ScalarOrSchedule, num_workers: int | jax.Array, max_step: float | jax.Array = 0.0
) -> optax.GradientTransformationExtraArgs:
    r"""SGD with the delay-adaptive step of Koloskova, Stich and Jaggi (NeurIPS 2022, Theorem 8).

    .. math::
        \gamma_\tau = \eta \text{ if } \tau \le M, \text{ else } \min(\eta, c / \tau), \quad c = 1 / (4L)

    The theorem allows any step up to that bound for a delay above M; ``max_step`` c = 0 (the default) drops such a
    gradient: a zero update, which still counts as an applied update (the version advances, as with
    :func:`drop_stale`); :class:`asgd_jax.delays.Ringmaster` is the form that ignores it and advances nothing.
    Mishchenko et al.'s form, :math:`\eta \min(1, M/\tau)`, is :func:`delay_adaptive_sgd`.

    Args:
      learning_rate: the step size eta (a number or an optax schedule).
      num_workers: M >= 1 (may be traced).
      max_step: c >= 0, the bound's numerator 1 / (4L) for an L-smooth loss (may be traced).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.delay_threshold_sgd(0.5, num_workers=2, max_step=1.0)
      >>> [float(rule.update(jnp.array([1.0]), rule.init(jnp.zeros(1)), staleness=t)[0][0]) for t in (2, 4)]
      [-0.5, -0.25]
    """
    common.check_num_workers("num_workers", num_workers, static=False)
    common.check_nonnegative("max_step", max_step)
    common.check_learning_rate(learning_rate)

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, staleness, **extra_args):
        del params, extra_args
        eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
        eta = jnp.asarray(eta, jnp.float32)
        tau = jnp.asarray(staleness)
        bounded = jnp.minimum(eta, jnp.asarray(max_step, jnp.float32) / jnp.maximum(tau, 1).astype(jnp.float32))
        step = jnp.where(tau <= jnp.asarray(num_workers), eta, bounded)
        updates = jax.tree.map(lambda g: (-step * g).astype(g.dtype), updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
