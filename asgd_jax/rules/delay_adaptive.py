"""Delay-adaptive step sizes: Mishchenko, Bach, Even, Woodworth, "Asynchronous SGD Beats Minibatch SGD Under
Arbitrary Delays", NeurIPS 2022.

:func:`scale_by_delay_adaptive` scales a step by :math:`\\min(1, M / \tau)`, M the number of workers;
:func:`delay_adaptive_sgd` chains it with SGD.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


@recipe(elementwise=True)
def scale_by_delay_adaptive(num_workers: int | jax.Array) -> optax.GradientTransformationExtraArgs:
    r"""Scales the step by :math:`\min(1, M / \tau)`: full steps unless the delay exceeds the worker count.

    This is the delay-adaptive step size of Mishchenko, Bach, Even and Woodworth (NeurIPS 2022), whose rates depend on
    the number of workers M rather than the worst delay.

    Args:
      num_workers: M >= 1 (may be traced).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.scale_by_delay_adaptive(4)
      >>> rule.update(jnp.array([8.0]), rule.init(None), staleness=16)[0]
      Array([2.], dtype=float32)
    """
    common.check_num_workers("num_workers", num_workers, static=False)

    def factor(tau):
        # Where tau <= M the step is full; the maximum only guards the division at tau = 0.
        m = jnp.asarray(num_workers, jnp.float32)
        return jnp.minimum(1.0, m / jnp.maximum(tau, 1).astype(jnp.float32))

    return common.scale_by(factor)


@recipe(elementwise=True)
def delay_adaptive_sgd(
    learning_rate: ScalarOrSchedule,
    num_workers: int | jax.Array,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""SGD with the delay-adaptive step :math:`\eta \min(1, M/\tau)` (Mishchenko et al. 2022).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.delay_adaptive_sgd(0.5, num_workers=2)
      >>> rule.update(jnp.array([4.0]), rule.init(jnp.zeros(1)), staleness=8)[0]
      Array([-0.5], dtype=float32)
    """
    return optax.chain(scale_by_delay_adaptive(num_workers), common.sgd(learning_rate, momentum, nesterov))
