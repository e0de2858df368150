"""Plain asynchronous SGD, the baseline every other rule here modifies: :func:`asgd` applies whatever gradient
arrives, however stale (the delayed-gradient update of Agarwal and Duchi, "Distributed Delayed Stochastic
Optimization", NIPS 2011; run at scale as Downpour SGD by Dean et al., NIPS 2012). The registry's ``"sgd"`` is the same
rule, named for runs with one worker.
"""

from __future__ import annotations

import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


@recipe(elementwise=True)
def asgd(
    learning_rate: ScalarOrSchedule, *, momentum: float | None = None, nesterov: bool = False
) -> optax.GradientTransformationExtraArgs:
    r"""Plain asynchronous SGD: applies whatever gradient arrives, however stale.

    .. math::
        w_{t+1} = w_t - \eta_t\, g(w_{t-\tau})

    Args:
      learning_rate: a float or an optax schedule over server updates.
      momentum: optional heavy-ball momentum in [0, 1).
      nesterov: Nesterov momentum.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` that ignores every extra argument.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.asgd(0.1)
      >>> w = jnp.array([1.0, 2.0])
      >>> updates, _ = rule.update(jnp.array([2.0, 3.0]), rule.init(w), w, stale_params=w, staleness=3)
      >>> updates
      Array([-0.2, -0.3], dtype=float32)
    """
    return optax.with_extra_args_support(common.sgd(learning_rate, momentum, nesterov))
