"""Dropping stale gradients, as TensorFlow's old ``DropStaleGradientOptimizer`` did (no paper of its own):
:func:`drop_stale` zeroes an update whose staleness exceeds a bound, chained in front of any rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from asgd_jax.recipes import recipe
from asgd_jax.rules import common


@recipe(elementwise=True)
def drop_stale(max_staleness: int | jax.Array) -> optax.GradientTransformationExtraArgs:
    r"""Zeroes an update whose staleness exceeds ``max_staleness`` (TensorFlow's old DropStaleGradientOptimizer).

    .. math::
        \tilde g = g \cdot [\tau \le k]

    Chain it in front of any rule: ``optax.chain(asgd_jax.drop_stale(4), asgd_jax.asgd(0.1))``.

    Args:
      max_staleness: k >= 0 (may be traced).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.drop_stale(2)
      >>> rule.update(jnp.array([1.0]), rule.init(None), staleness=3)[0]
      Array([0.], dtype=float32)
    """
    common.check_nonnegative("max_staleness", max_staleness)
    return common.scale_by(lambda tau: (tau <= max_staleness).astype(jnp.float32))
