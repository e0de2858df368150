"""FADAS: Wang, Wang, Lu, Chen, "FADAS: Towards Federated Adaptive Asynchronous Optimization", ICML 2024.

:func:`fadas`: the server buffers ``buffer_size`` pushes (client deltas, ``push="delta"``), then takes one AMSGrad step
on their mean, its learning rate cut once the largest delay of the buffer passes a threshold; :class:`FadasState` is
its state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from asgd_jax import errors
from asgd_jax.recipes import recipe
from asgd_jax.rules import common
from asgd_jax.rules.common import ScalarOrSchedule

DELAY_SCALINGS = ("min", "divide")


class FadasState(NamedTuple):
    """State of :func:`fadas`: pushes and steps so far, the buffered sum and its largest delay, the moments."""

    count: jax.Array
    steps: jax.Array
    buffer: optax.Updates
    delay_max: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates


@recipe(numbers=("learning_rate", "buffer_size", "delay_threshold"))
def fadas(
    learning_rate: ScalarOrSchedule,
    *,
    buffer_size: int | jax.Array = 4,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.99,
    eps: float | jax.Array = 1e-8,
    delay_threshold: int | jax.Array | None = None,
    delay_scaling: str = "min",
    bias_correction: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""FADAS: every ``buffer_size`` pushes one AMSGrad step on their mean, with a delay-adaptive learning rate.

    With :math:`M` the buffer size and :math:`g` a push (the descent direction: a gradient, or a delta
    :math:`w_{pulled} - w_{local}`, the negative of the paper's :math:`\Delta^i`), the :math:`M`-th push of a buffer
    does (the paper's server update, Algorithm 1; the bias correction of the authors' code, ``fedams``)

    .. math::
        \bar g = \tfrac1M \textstyle\sum_{i \in \text{buffer}} g_i,\;
        m \leftarrow \beta_1 m + (1 - \beta_1) \bar g,\; v \leftarrow \beta_2 v + (1 - \beta_2) \bar g^2,\;
        \hat v \leftarrow \max(\hat v, v),\;
        w \leftarrow w - \frac{\eta_t}{1 - \beta_1^t} \frac{m}{\sqrt{\hat v / (1 - \beta_2^t)} + \epsilon}

    and the others leave the weights as they are. Delay-adaptive (FADAS's second algorithm, ``delay_threshold``
    :math:`\tau_c`): with :math:`\tau_{max}` the largest delay among the buffered pushes, counted in server steps (the
    steps between a push's pull and its arrival, as the authors' code counts rounds), :math:`\eta_t = \eta` while
    :math:`\tau_{max} \le \tau_c`, else :math:`\min(\eta, 1/\tau_{max})` (the paper, ``delay_scaling="min"``) or
    :math:`\eta / \tau_{max}` (the authors' code, ``"divide"``).

    Args:
      learning_rate: :math:`\eta`, the server's learning rate (a float, or a schedule of server steps).
      buffer_size: M >= 1 pushes per step (may be traced; the code's ``update_freq``, default 5 there).
      b1, b2: the moments' decays (the code's defaults 0.9 and 0.99).
      eps: :math:`\epsilon` (1e-8).
      delay_threshold: :math:`\tau_c` >= 0, or ``None`` (the default): FADAS without the delay adaptation.
      delay_scaling: ``"min"`` or ``"divide"`` (see above).
      bias_correction: divide the moments by :math:`1 - \beta^t` as the authors' code does (the paper's update has
        none).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``staleness`` (the push's, in
      server updates: the delay in steps is derived from it and the buffer's position).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.fadas(0.1, buffer_size=2, bias_correction=False, eps=0.0)
      >>> state = rule.init(jnp.zeros(1))
      >>> u1, state = rule.update(jnp.array([2.0]), state, staleness=0)   # buffered: nothing moves
      >>> u2, state = rule.update(jnp.array([4.0]), state, staleness=1)   # mean 3: m 0.3, v_hat 0.09
      >>> float(u1[0]), round(float(u2[0]), 6)
      (0.0, -0.1)

    References:
      Wang, Wang, Lu, Chen, "FADAS: Towards Federated Adaptive Asynchronous Optimization", ICML 2024
      (arXiv 2407.18365); the authors' code, yujiaw98/FADAS (``fedams``, the delay as rounds since dispatch).
    """
    common.check_positive("buffer_size", buffer_size)
    common.check_decay("b1", b1)
    common.check_decay("b2", b2)
    common.check_nonnegative("eps", eps)
    common.check_learning_rate(learning_rate)
    if delay_threshold is not None:
        common.check_nonnegative("delay_threshold", delay_threshold)
    errors.require(
        delay_scaling in DELAY_SCALINGS,
        "delay_scaling",
        delay_scaling,
        f"use one of {', '.join(map(repr, DELAY_SCALINGS))} (the paper's min(lr, 1/tau_max) or the code's lr/tau_max)",
    )

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        scalar = lambda: jnp.zeros((), jnp.int32)
        return FadasState(scalar(), scalar(), zeros(), scalar(), zeros(), zeros(), zeros())

    def update_fn(updates, state, params=None, *, staleness, **extra_args):
        del params, extra_args
        size = jnp.asarray(buffer_size, jnp.int32)
        # The push's delay in steps: the steps taken since its pull (the pull came `staleness` pushes ago).
        pulled = jnp.maximum(state.count - jnp.asarray(staleness, jnp.int32), 0)
        delay = state.count // size - pulled // size
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        delay_max = jnp.maximum(state.delay_max, delay)
        count = optax.safe_increment(state.count)
        step = count % size == 0
        steps = state.steps + step.astype(jnp.int32)
        mean = jax.tree.map(lambda b: b / size.astype(b.dtype), buffer)
        mu = optax.tree.update_moment(mean, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(mean, state.nu, b2, 2)
        nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu)
        rate = common.rate(learning_rate, state.steps)
        if delay_threshold is not None:
            late = delay_max > jnp.asarray(delay_threshold)
            inverse = 1.0 / jnp.maximum(delay_max, 1).astype(jnp.float32)
            cut = jnp.minimum(rate, inverse) if delay_scaling == "min" else rate * inverse
            rate = jnp.where(late, cut, rate)
        t = jnp.maximum(steps, 1).astype(jnp.float32)  # (no step: t is unused, kept away from 1 - b**0)
        c1, c2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)

        def descent(m, v):
            return (-rate / c1 * m / (jnp.sqrt(v / c2) + eps)).astype(m.dtype)

        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(step, n, o), new, old)
        new = jax.tree.map(lambda m, v: jnp.where(step, descent(m, v), jnp.zeros_like(m)), mu, nu_max)
        return new, FadasState(
            count,
            steps,
            jax.tree.map(lambda b: jnp.where(step, jnp.zeros_like(b), b), buffer),
            jnp.where(step, 0, delay_max),
            keep(mu, state.mu),
            keep(nu, state.nu),
            keep(nu_max, state.nu_max),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
