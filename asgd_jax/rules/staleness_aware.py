"""Staleness-aware async SGD: Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning",
IJCAI 2016.

:func:`scale_by_staleness` divides a gradient by its staleness; :func:`staleness_aware_sgd` chains it with SGD (the
step :math:`\alpha_0 / \\max(\tau, 1)`).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule


@recipe(elementwise=True)
def scale_by_staleness() -> optax.GradientTransformationExtraArgs:
    r"""Divides the gradient by its staleness (Zhang et al. 2016); staleness 0 counts as 1.

    .. math::
        \tilde g = g / \max(\tau, 1)

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``staleness``.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.scale_by_staleness()
      >>> rule.update(jnp.array([4.0]), rule.init(None), staleness=4)[0]
      Array([1.], dtype=float32)

    References:
      Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016.
    """
    return common.scale_by(lambda tau: 1.0 / jnp.maximum(tau, 1).astype(jnp.float32))


@recipe(elementwise=True)
def staleness_aware_sgd(
    learning_rate: ScalarOrSchedule, *, momentum: float | None = None, nesterov: bool = False
) -> optax.GradientTransformationExtraArgs:
    r"""SGD with the staleness-aware step :math:`\alpha_0 / \max(\tau, 1)` (Zhang et al. 2016).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.staleness_aware_sgd(0.5)
      >>> rule.update(jnp.array([4.0]), rule.init(jnp.zeros(1)), staleness=2)[0]
      Array([-1.], dtype=float32)
    """
    return optax.chain(scale_by_staleness(), common.sgd(learning_rate, momentum, nesterov))
