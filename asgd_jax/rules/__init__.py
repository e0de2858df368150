"""Update rules for asynchronous SGD as optax transforms.

Every rule here is an :class:`optax.GradientTransformationExtraArgs`. The parameter server calls

    ``updates, state = rule.update(grads, state, params, stale_params=..., staleness=..., worker=...)``

where ``params`` are the server's current weights w_t, ``stale_params`` the weights the gradient was computed at
(DC-ASGD's backup w_bak(m)), ``staleness`` an int32 scalar (server updates since that pull) and ``worker`` the int32 id
of the pushing worker. A rule takes what it needs as keyword-only arguments, so forgetting one raises a ``TypeError``
that names it, and swallows the rest in ``**extra_args``. Rules compose with :func:`optax.chain` and stay valid inside
``jit``, ``vmap``, ``lax.scan`` and :func:`optax.inject_hyperparams` (numeric hyperparameters may arrive traced, so no
Python branching on them; ``num_workers`` of :func:`scale_by_delay_compensation` sets a state shape and must be passed
in ``static_args`` there).

Naming follows optax: ``scale_by_<x>`` only rescales the incoming gradient; ``<x>(learning_rate, ...)`` chains it with
:func:`optax.sgd`, so the learning rate (a float or an optax schedule counting server updates), momentum and Nesterov
come from optax itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import errors
from asgd_jax.recipes import recipe

__all__ = [
    "RULES",
    "DanaState",
    "DelayedNesterovState",
    "GapAwareState",
    "PullRule",
    "ScaleByDelayCompensationState",
    "asgd",
    "dc_asgd",
    "delay_adaptive_sgd",
    "delay_threshold_sgd",
    "dana",
    "delayed_nesterov",
    "drop_stale",
    "fingerprint",
    "gap_aware",
    "get",
    "defaults",
    "names",
    "one_of",
    "register",
    "required",
    "scale_by_delay_adaptive",
    "scale_by_delay_compensation",
    "scale_by_staleness",
    "staleness_aware_sgd",
    "weight_decayed",
]

ScalarOrSchedule = float | jax.Array | optax.Schedule


def _is_concrete(value: Any) -> bool:
    """True when ``value`` can be checked in Python (not a tracer from jit/vmap/inject_hyperparams)."""
    return not isinstance(value, jax.core.Tracer)


def _check(name: str, value: Any, ok, expected: str) -> None:
    """Checks a numeric hyperparameter that may be an array, unless it is traced."""
    if not _is_concrete(value):
        return
    numeric = isinstance(value, int | float | np.number | np.ndarray | jax.Array) and not isinstance(value, bool)
    v = np.asarray(value) if numeric else None
    good = numeric and np.issubdtype(v.dtype, np.number) and bool(np.all(np.isfinite(v) & ok(v)))
    errors.require(good, name, value, f"{name} must be a finite number {expected}")


def _check_nonnegative(name: str, value: Any) -> None:
    _check(name, value, lambda v: v >= 0, ">= 0")


def _check_positive(name: str, value: Any) -> None:
    _check(name, value, lambda v: v > 0, "> 0")


def _check_decay(name: str, value: Any) -> None:
    _check(name, value, lambda v: (v >= 0) & (v < 1), "in [0, 1)")


def _check_num_workers(name: str, value: Any, *, static: bool) -> None:
    if static and not (isinstance(value, int) and not isinstance(value, bool)):
        raise errors.ConfigError(
            f"{name}={value!r} is invalid: it sets the shape of the per-worker state, so it must be a Python int "
            f"(under optax.inject_hyperparams pass static_args=({name!r},))."
        )
    _check(name, value, lambda v: v >= 1, ">= 1")


def _check_learning_rate(learning_rate: Any) -> None:
    if callable(learning_rate):  # an optax schedule
        return
    _check("learning_rate", learning_rate, lambda v: v >= 0, ">= 0 (or an optax schedule)")


def _sgd(learning_rate: ScalarOrSchedule, momentum: float | None, nesterov: bool) -> optax.GradientTransformation:
    if momentum is not None:
        _check_decay("momentum", momentum)
    _check_learning_rate(learning_rate)
    return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


# --------------------------------------------------------------------------------------------------------------------
# DC-ASGD (Zheng et al., ICML 2017)
# --------------------------------------------------------------------------------------------------------------------


class ScaleByDelayCompensationState(NamedTuple):
    """State of :func:`scale_by_delay_compensation`.

    Attributes:
      mean_square: DC-ASGD-a's ``MeanSquare`` accumulator, a tree like the params (global, as in the paper) or with a
        leading axis of size ``num_workers`` (one per worker, as in the authors' server code). ``None`` for DC-ASGD-c,
        which keeps no state.
    """

    mean_square: optax.Updates | None


@recipe
def scale_by_delay_compensation(
    lam: float | jax.Array = 0.04,
    *,
    adaptive: bool | jax.Array = False,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Compensates a stale gradient with DC-ASGD's cheap Taylor term.

    .. math::
        \tilde g = g + \lambda_t \, g \odot g \odot (w_t - w_{bak}(m))

    (Zheng et al. 2017, Eq. 10, without the learning rate). DC-ASGD-c uses :math:`\lambda_t = \lambda_0`;
    DC-ASGD-a (``adaptive=True``) first updates :math:`MS \leftarrow m\,MS + (1 - m)\,g \odot g` with the incoming
    gradient and then uses :math:`\lambda_t = \lambda_0 / \sqrt{MS + \epsilon}` elementwise. With ``lam = 0`` or
    ``stale_params == params`` the gradient passes through unchanged.

    Args:
      lam: :math:`\lambda_0 \ge 0`; the paper uses 0.04 for DC-ASGD-c and 2 for DC-ASGD-a on CIFAR-10.
      adaptive: ``True`` for DC-ASGD-a. May also be a (traced) boolean array, so that DC-ASGD-c and -a runs share
        one compiled program in a :func:`asgd_jax.sweep`; ``MeanSquare`` is then always kept.
      mean_square_decay: the momentum ``m`` of ``MeanSquare``, in [0, 1) (paper: 0.95).
      eps: :math:`\epsilon > 0` inside the square root (paper: 1e-7).
      num_workers: ``None`` keeps one global ``MeanSquare`` (the paper); an int keeps one per worker, indexed by the
        ``worker`` extra argument and updated only with that worker's gradients (the authors' server code).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``stale_params`` (and ``worker`` when
      ``num_workers`` is given).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.scale_by_delay_compensation(lam=0.5)
      >>> w_t, w_bak, g = jnp.array([1.0, 2.0]), jnp.array([0.0, 2.0]), jnp.array([2.0, 3.0])
      >>> updates, _ = rule.update(g, rule.init(w_t), w_t, stale_params=w_bak)
      >>> updates  # [2 + 0.5 * 4 * 1, 3 + 0]
      Array([4., 3.], dtype=float32)

    References:
      Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017, Eq. 10 and
      Algorithm 2.
    """
    _check_nonnegative("lam", lam)
    _check_decay("mean_square_decay", mean_square_decay)
    _check_positive("eps", eps)
    if num_workers is not None:
        _check_num_workers("num_workers", num_workers, static=True)
    # A Python bool decides the structure; an array decides per run, inside the program.
    keeps_mean_square = not isinstance(adaptive, bool) or adaptive
    per_worker = keeps_mean_square and num_workers is not None

    def init_fn(params):
        if not keeps_mean_square:
            return ScaleByDelayCompensationState(mean_square=None)
        if per_worker:
            zeros = lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.result_type(p))
        else:
            zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p))
        return ScaleByDelayCompensationState(mean_square=jax.tree.map(zeros, params))

    def update_fn(updates, state, params=None, *, stale_params, worker=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "scale_by_delay_compensation needs the server's current weights: call "
                "update(grads, state, params, stale_params=...)."
            )
        if per_worker and worker is None:
            raise TypeError(
                "scale_by_delay_compensation(num_workers=...) keeps MeanSquare per worker: pass worker=<int32 id>."
            )

        def correction(g, w, w_bak, lam_t):
            # Cast back so a float32 hyperparameter never promotes a bf16 gradient.
            return (g + lam_t * g * g * (w - w_bak)).astype(g.dtype)

        if not keeps_mean_square:
            new = jax.tree.map(lambda g, w, wb: correction(g, w, wb, lam), updates, params, stale_params)
            return new, state

        def new_mean_square(ms, g):
            # m * ms + (1 - m) * g^2, written with m alone so a traced m (inject_hyperparams) rounds like a float one.
            g2 = g * g
            return g2 + mean_square_decay * (ms - g2)

        if per_worker:
            take = lambda ms: jax.lax.dynamic_index_in_dim(ms, worker, axis=0, keepdims=False)
            put = lambda ms, m: jax.lax.dynamic_update_index_in_dim(ms, m.astype(ms.dtype), worker, axis=0)
            # Write the worker's new MeanSquare, then read it back for lambda: everything after the write reads the new
            # stack, so XLA updates it in place (read from the old stack, lambda's use raced the write and XLA copied
            # the whole M x params stack on every push: 2 x 16 MB for 1.1M parameters and M = 4).
            mean_square = jax.tree.map(lambda ms, g: put(ms, new_mean_square(take(ms), g)), state.mean_square, updates)
            ms_w = jax.tree.map(take, mean_square)
        else:
            ms_w = jax.tree.map(new_mean_square, state.mean_square, updates)
            mean_square = jax.tree.map(lambda ms, m: m.astype(ms.dtype), state.mean_square, ms_w)
        adaptive_lam = lambda ms: jnp.where(adaptive, lam / jnp.sqrt(ms + eps), lam)
        new = jax.tree.map(
            lambda g, w, wb, ms: correction(g, w, wb, adaptive_lam(ms)),
            updates,
            params,
            stale_params,
            ms_w,
        )
        return new, ScaleByDelayCompensationState(mean_square=mean_square)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@recipe
def dc_asgd(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 0.04,
    *,
    adaptive: bool | jax.Array = False,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""DC-ASGD: delay-compensated asynchronous SGD.

    .. math::
        w_{t+1} = w_t - \eta_t \left(g_m + \lambda_t\, g_m \odot g_m \odot (w_t - w_{bak}(m))\right)

    The compensation (:func:`scale_by_delay_compensation`) is applied to the raw gradient, before momentum; with
    ``momentum`` the compensated gradient feeds optax's heavy-ball (or Nesterov) trace. Any weight decay chained
    *before* this rule (``optax.chain(optax.add_decayed_weights(wd), dc_asgd(...))``) is compensated too; chained
    after the compensation it is not.

    Args:
      learning_rate: a float or an optax schedule over server updates (paper CIFAR-10: 0.5, divided by 10 at epochs
        80 and 120).
      lam: :math:`\lambda_0` (paper: 0.04 for DC-ASGD-c, 2 for DC-ASGD-a).
      adaptive: ``True`` for DC-ASGD-a; a (traced) boolean, or a number (above 0.5: -a), so that a study's variants
        of -c and -a share one program.
      mean_square_decay: ``m`` of DC-ASGD-a's ``MeanSquare``.
      eps: :math:`\epsilon` of DC-ASGD-a.
      num_workers: keep ``MeanSquare`` per worker (see :func:`scale_by_delay_compensation`).
      momentum: optional heavy-ball momentum in [0, 1).
      nesterov: Nesterov momentum.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` whose ``update`` requires ``stale_params``.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.dc_asgd(learning_rate=0.1, lam=0.5)
      >>> w_t, w_bak, g = jnp.array([1.0, 2.0]), jnp.array([0.0, 2.0]), jnp.array([2.0, 3.0])
      >>> updates, _ = rule.update(g, rule.init(w_t), w_t, stale_params=w_bak)
      >>> updates
      Array([-0.4, -0.3], dtype=float32)

    References:
      Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017, Eq. 10.
    """
    if not isinstance(adaptive, bool):  # a 0/1 number (a study's traced hp) is a flag, as a boolean array is
        if isinstance(adaptive, int | float):
            adaptive = adaptive > 0.5
        elif jnp.asarray(adaptive).dtype != jnp.bool_:
            adaptive = jnp.asarray(adaptive) > 0.5
    return optax.chain(
        scale_by_delay_compensation(
            lam,
            adaptive=adaptive,
            mean_square_decay=mean_square_decay,
            eps=eps,
            num_workers=num_workers,
        ),
        _sgd(learning_rate, momentum, nesterov),
    )


@recipe
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
    return optax.with_extra_args_support(_sgd(learning_rate, momentum, nesterov))


# --------------------------------------------------------------------------------------------------------------------
# Staleness-dependent step sizes
# --------------------------------------------------------------------------------------------------------------------


def _scale_by(factor_fn) -> optax.GradientTransformationExtraArgs:
    """A stateless rule multiplying every leaf of the update by ``factor_fn(staleness)``."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, staleness, **extra_args):
        del params, extra_args
        factor = factor_fn(jnp.asarray(staleness))
        return jax.tree.map(lambda g: (factor * g).astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@recipe
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
    return _scale_by(lambda tau: 1.0 / jnp.maximum(tau, 1).astype(jnp.float32))


@recipe
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
    return optax.chain(scale_by_staleness(), _sgd(learning_rate, momentum, nesterov))


@recipe
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
    _check_num_workers("num_workers", num_workers, static=False)

    def factor(tau):
        # Where tau <= M the step is full; the maximum only guards the division at tau = 0.
        m = jnp.asarray(num_workers, jnp.float32)
        return jnp.minimum(1.0, m / jnp.maximum(tau, 1).astype(jnp.float32))

    return _scale_by(factor)


@recipe
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
    return optax.chain(scale_by_delay_adaptive(num_workers), _sgd(learning_rate, momentum, nesterov))


@recipe
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
    _check_num_workers("num_workers", num_workers, static=False)
    _check_nonnegative("max_step", max_step)
    _check_learning_rate(learning_rate)

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


@recipe
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
    _check_nonnegative("max_staleness", max_staleness)
    return _scale_by(lambda tau: (tau <= max_staleness).astype(jnp.float32))


# --------------------------------------------------------------------------------------------------------------------
# Staleness mitigation since DC-ASGD: Gap-Aware, Delayed Nesterov, DANA (a pull-side rule)
# --------------------------------------------------------------------------------------------------------------------


def _rate(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
    """The learning rate at update ``count`` (a float or an optax schedule)."""
    return jnp.asarray(learning_rate(count) if callable(learning_rate) else learning_rate, jnp.float32)


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
        _check_decay("momentum", momentum)
    _check_decay("decay", decay)
    _check_positive("eps", eps)
    _check_learning_rate(learning_rate)

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        trace = None if momentum is None else jax.tree.map(jnp.zeros_like, params)
        return GapAwareState(jnp.zeros((), jnp.int32), zeros, trace, jnp.zeros((), jnp.float32))

    def update_fn(updates, state, params=None, *, stale_params, **extra_args):
        del extra_args
        count = optax.safe_increment(state.count)
        rate = _rate(learning_rate, state.count)
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


class DelayedNesterovState(NamedTuple):
    """State of :func:`delayed_nesterov`: pushes so far, the momentum ``m`` and the buffered sum of pushes."""

    count: jax.Array
    momentum: optax.Updates
    buffer: optax.Updates


@recipe
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
    _check_positive("buffer_size", buffer_size)
    _check_decay("momentum", momentum)
    _check_nonnegative("activation", activation)
    _check_learning_rate(learning_rate)

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros(), zeros())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        rate = _rate(learning_rate, state.count)
        n = jnp.asarray(buffer_size, jnp.float32)
        flush = count % jnp.asarray(buffer_size, jnp.int32) == 0
        c = jnp.asarray(activation, jnp.float32)
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        m = jax.tree.map(lambda m, d: jnp.where(flush, momentum * m + d / n, m), state.momentum, buffer)
        weight = jnp.where(flush, 1.0 - c * n + c, c) * momentum

        def step(m, g):
            return (-rate * (weight * m + g / n)).astype(g.dtype)

        new = jax.tree.map(step, m, updates)
        buffer = jax.tree.map(lambda d: jnp.where(flush, jnp.zeros_like(d), d), buffer)
        return new, DelayedNesterovState(count, m, buffer)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class PullRule(NamedTuple):
    """An update rule that also decides what a worker pulls: ``pull(params, state, worker) -> the weights sent``.

    The server applies it in its pull and keeps what it sent as the worker's backup, so the worker's gradient and the
    rule's ``stale_params`` are at exactly those weights; the simulator, the store and the Ray backend share it, and a
    recorded trace replays (the pull is a pure function of the server's state).
    """

    init: Callable
    update: Callable
    pull: Callable


@recipe(numbers=("rate",))
def weight_decayed(rule: Any, rate: float | jax.Array) -> Any:
    r"""``rule`` applied to the regularised gradient :math:`g + \text{rate} \cdot w_t`: L2 weight decay on the server's
    current weights, chained before the rule (``optax.chain(optax.add_decayed_weights(rate), rule)``). DC-ASGD then
    compensates the regularised gradient. A pull rule keeps its pull.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.weight_decayed(asgd_jax.asgd(0.1), 0.5)
      >>> w = jnp.array([2.0])
      >>> rule.update(jnp.array([1.0]), rule.init(w), w)[0]  # -0.1 * (1 + 0.5 * 2)
      Array([-0.2], dtype=float32)
    """
    errors.require(
        isinstance(rate, jax.core.Tracer) or (isinstance(rate, int | float | np.number) and float(rate) >= 0),
        "weight_decay",
        rate,
        "use a finite number >= 0",
    )
    # optax.chain hands the extra arguments (stale_params, staleness, worker) only to what it knows takes them.
    inner = (
        rule
        if isinstance(rule, optax.GradientTransformationExtraArgs)
        else optax.GradientTransformationExtraArgs(rule.init, rule.update)
    )
    chained = optax.chain(optax.add_decayed_weights(rate), inner)
    if not callable(getattr(rule, "pull", None)):
        return chained
    return PullRule(chained.init, chained.update, lambda params, state, worker: rule.pull(params, state[1], worker))


class DanaState(NamedTuple):
    """State of :func:`dana`: the update count, every worker's momentum ``v`` (a leading axis of ``num_workers``)
    and their sum ``S``."""

    count: jax.Array
    velocity: optax.Updates
    velocity_sum: optax.Updates


@recipe
def dana(
    learning_rate: ScalarOrSchedule,
    *,
    num_workers: int,
    momentum: float | jax.Array = 0.9,
    lam: float | jax.Array = 0.0,
) -> PullRule:
    r"""DANA: momentum per worker, and every worker pulls a look-ahead of where the weights will be.

    Push of :math:`g` by worker i (computed at the weights :math:`\hat w_i` it was sent; DANA-DC first compensates it
    against them, :math:`g \leftarrow g + \lambda\, g \odot g \odot (w - \hat w_i)`):

    .. math::
        v_i \leftarrow \gamma v_i + g, \quad w \leftarrow w - \eta\, v_i, \quad S \leftarrow S + v_i^{new} - v_i^{old}

    Pull by worker i: :math:`\hat w_i = w - \eta \gamma S` with :math:`S = \sum_j v_j`, the step every worker's
    momentum will still take before this worker's gradient lands (NAG's look-ahead, for all workers at once).

    Args:
      learning_rate: :math:`\eta` (a float or a schedule; the look-ahead uses the current one).
      num_workers: M (static: it shapes the per-worker momenta).
      momentum: :math:`\gamma` in [0, 1) (the paper: 0.9).
      lam: DANA-DC's :math:`\lambda` >= 0 (0: DANA-Zero; the authors' simulator uses 2 for DANA-DC).

    Returns:
      A :class:`PullRule` whose ``update`` requires ``worker`` (and ``stale_params`` with ``lam``).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.dana(0.1, num_workers=2, momentum=0.5)
      >>> w, state = jnp.ones(1), rule.init(jnp.ones(1))
      >>> u, state = rule.update(jnp.array([2.0]), state, w, worker=0, stale_params=w)
      >>> u, rule.pull(w + u, state, 1)   # v_0 = 2: w - 0.2; the look-ahead: w - 0.1 * 0.5 * (2 + 0)
      (Array([-0.2], dtype=float32), Array([0.7], dtype=float32))

    References:
      Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment", 2019 (DANA-Zero;
      DANA-DC as in the authors' simulator: a constant lambda, against the look-ahead the worker used).
    """
    _check_num_workers("num_workers", num_workers, static=True)
    _check_decay("momentum", momentum)
    _check_nonnegative("lam", lam)
    _check_learning_rate(learning_rate)

    def init_fn(params):
        stack = jax.tree.map(lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.result_type(p)), params)
        return DanaState(jnp.zeros((), jnp.int32), stack, jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None, *, worker, stale_params=None, **extra_args):
        del extra_args
        if stale_params is not None:  # DANA-DC (lam = 0 leaves the gradient as it is)
            updates = jax.tree.map(
                lambda g, w, wb: (g + lam * g * g * (w - wb)).astype(g.dtype), updates, params, stale_params
            )
        take = lambda v: jax.lax.dynamic_index_in_dim(v, worker, axis=0, keepdims=False)
        put = lambda v, x: jax.lax.dynamic_update_index_in_dim(v, x.astype(v.dtype), worker, axis=0)
        old = jax.tree.map(take, state.velocity)
        new = jax.tree.map(lambda v, g: momentum * v + g, old, updates)
        velocity = jax.tree.map(put, state.velocity, new)
        velocity_sum = jax.tree.map(lambda s, n, o: s + n - o, state.velocity_sum, new, old)
        rate = _rate(learning_rate, state.count)
        steps = jax.tree.map(lambda v, g: (-rate * v).astype(g.dtype), new, updates)
        return steps, DanaState(optax.safe_increment(state.count), velocity, velocity_sum)

    def pull_fn(params, state, worker):
        del worker  # every worker gets the same look-ahead (DANA-Zero's S sums all momenta)
        lead = _rate(learning_rate, state.count) * momentum
        return jax.tree.map(lambda w, s: (w - lead * s).astype(w.dtype), params, state.velocity_sum)

    return PullRule(init_fn, update_fn, pull_fn)


@recipe(static=("index",))  # a concrete index picks the rule at compile time; a traced one (a sweep's) at run time
def one_of(index: int | jax.Array, choices: Sequence[Any]) -> optax.GradientTransformationExtraArgs | PullRule:
    """The rule ``choices[index]``, with ``index`` possibly traced: a sweep runs different rules in one program.

    The state holds every choice's state and only the chosen one's changes, so a run is the chosen rule's run. Under
    ``vmap`` with a batched index every choice is computed and one is selected: a rule costs O(parameters), small
    beside a gradient. A :class:`PullRule` when any choice is one (the others send the weights as they are).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.one_of(jnp.int32(1), [asgd_jax.asgd(0.1), asgd_jax.asgd(0.5)])
      >>> w = jnp.ones(2)
      >>> rule.update(jnp.ones(2), rule.init(w), w, staleness=jnp.int32(0))[0]
      Array([-0.5, -0.5], dtype=float32)
    """
    choices = [c if isinstance(c, PullRule) else optax.with_extra_args_support(c) for c in choices]
    if not choices:
        raise errors.ConfigError("one_of needs at least one rule in choices.")
    index = jnp.asarray(index, jnp.int32)

    def init_fn(params):
        return tuple(c.init(params) for c in choices)

    def update_fn(updates, state, params=None, **extra_args):
        def branch(i):
            def chosen(state):
                step, new = choices[i].update(updates, state[i], params, **extra_args)
                return step, (*state[:i], new, *state[i + 1 :])

            return chosen

        return jax.lax.switch(index, [branch(i) for i in range(len(choices))], state)

    if not any(isinstance(c, PullRule) for c in choices):
        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

    def pull_fn(params, state, worker):
        sends = [
            (lambda st, c=c, i=i: c.pull(params, st[i], worker)) if isinstance(c, PullRule) else (lambda st: params)
            for i, c in enumerate(choices)
        ]
        return jax.lax.switch(index, sends, state)

    return PullRule(init_fn, update_fn, pull_fn)


# --------------------------------------------------------------------------------------------------------------------
# The registry: every rule by name, for the command line, the studies and the notebooks.
# --------------------------------------------------------------------------------------------------------------------


@recipe
def _named_sgd(learning_rate: ScalarOrSchedule, *, momentum: float | None = None, nesterov: bool = False):
    """Sequential SGD: the ``asgd`` rule, named for runs with one worker (or a reference)."""
    return asgd(learning_rate, momentum=momentum, nesterov=nesterov)


@recipe
def _named_dc_asgd_c(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 0.04,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
):
    """DC-ASGD-c: :func:`dc_asgd` with a constant lambda (paper: 0.04)."""
    return dc_asgd(learning_rate, lam, momentum=momentum, nesterov=nesterov)


@recipe
def _named_dc_asgd_a(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 2.0,
    *,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
):
    """DC-ASGD-a: :func:`dc_asgd` with the adaptive lambda (paper: lambda_0 = 2, m = 0.95)."""
    return dc_asgd(
        learning_rate,
        lam,
        adaptive=True,
        mean_square_decay=mean_square_decay,
        eps=eps,
        num_workers=num_workers,
        momentum=momentum,
        nesterov=nesterov,
    )


RULES: dict[str, Callable[..., optax.GradientTransformationExtraArgs]] = {
    "sgd": _named_sgd,
    "asgd": asgd,
    "dc_asgd": dc_asgd,
    "dc_asgd_c": _named_dc_asgd_c,
    "dc_asgd_a": _named_dc_asgd_a,
    "staleness_aware": staleness_aware_sgd,
    "delay_adaptive": delay_adaptive_sgd,
    "delay_threshold": delay_threshold_sgd,
    "gap_aware": gap_aware,
    "delayed_nesterov": delayed_nesterov,
    "dana": dana,
}
"""Every rule by name: ``factory(learning_rate, **hyperparameters)``; :func:`get` builds one, :func:`register` adds
one."""


def names() -> list[str]:
    """The names :func:`get` knows, in registration order."""
    return list(RULES)


def defaults(name: str) -> dict[str, Any]:
    """The hyperparameters of rule ``name`` (besides the learning rate) and their defaults (``None``: required or
    off).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.rules.defaults("dc_asgd_c")
      {'lam': 0.04, 'momentum': None, 'nesterov': False}
    """
    factory = _factory(name)
    params = list(inspect.signature(factory).parameters.values())[1:]
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default) for p in params}


def required(name: str) -> list[str]:
    """The hyperparameters rule ``name`` cannot do without (``delay_adaptive``'s ``num_workers``)."""
    params = list(inspect.signature(_factory(name)).parameters.values())[1:]
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]


def _factory(name: str) -> Callable[..., optax.GradientTransformationExtraArgs]:
    if not isinstance(name, str) or name not in RULES:
        raise errors.ConfigError(f"rule={name!r} is invalid: use one of {', '.join(RULES)}.")
    return RULES[name]


def get(name: str, learning_rate: ScalarOrSchedule, **hyperparameters: Any) -> optax.GradientTransformationExtraArgs:
    """The rule registered as ``name``, built with ``learning_rate`` and its own hyperparameters.

    Args:
      name: one of :func:`names` (``"asgd"``, ``"dc_asgd_c"``, ``"dc_asgd_a"``, ...).
      learning_rate: a float or an optax schedule over server updates.
      **hyperparameters: the rule's own (see :func:`defaults`); ``None`` values are dropped, so a caller can
        pass every option it has and let the rule's defaults stand.

    Raises:
      ConfigError: an unknown name, or a hyperparameter the rule does not take (the message lists those it takes).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.get("dc_asgd_a", 0.1, lam=1.0)
      >>> w = jnp.array([1.0])
      >>> rule.update(jnp.array([2.0]), rule.init(w), w, stale_params=w)[0]
      Array([-0.2], dtype=float32)
      >>> asgd_jax.rules.get("asgd", 0.1, lam=1.0)
      Traceback (most recent call last):
      ...
      asgd_jax.errors.ConfigError: rule 'asgd' takes no hyperparameter 'lam': it takes momentum, nesterov.
    """
    factory = _factory(name)
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    missing = [k for k in required(name) if k not in given]
    if missing:
        raise errors.ConfigError(
            f"rule {name!r} needs {', '.join(missing)}: pass e.g. rules.get({name!r}, learning_rate, "
            f"{missing[0]}=M), M the plan's number of workers."
        )
    accepted = defaults(name)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "none"
        raise errors.ConfigError(
            f"rule {name!r} takes no hyperparameter {', '.join(map(repr, unknown))}: it takes {takes}."
        )
    return factory(learning_rate, **given)


def register(name: str, factory: Callable[..., optax.GradientTransformationExtraArgs]) -> None:
    """Adds ``factory(learning_rate, **hyperparameters)`` to the registry under ``name`` (replacing an earlier one), so
    that :func:`get`, the command line and the studies know it. It is made a :func:`asgd_jax.recipes.recipe`: rules
    :func:`get` builds from it with other numbers share one compiled program."""
    if not isinstance(name, str) or not name.isidentifier():
        raise errors.ConfigError(f"name={name!r} is invalid: use an identifier such as 'my_rule'.")
    if not callable(factory):
        raise errors.ConfigError(f"factory={factory!r} is invalid: give a function (learning_rate, **hp) -> rule.")
    # As a recipe, the rules it builds key one compiled program whatever their numbers (see asgd_jax.recipes).
    RULES[name] = factory if getattr(factory, "is_recipe", False) else recipe(factory)


def fingerprint(rule: optax.GradientTransformation, params: Any) -> str:
    """A short hash of what ``rule`` does: its first two updates of a fixed probe shaped like ``params``.

    Two rules that differ in a hyperparameter (learning rate, lambda, momentum, ...) give different fingerprints;
    the same rule built twice gives the same one (computed on the CPU, rounded to 6 significant digits). A resumed
    run checks it, so that a run is never continued with another rule. A change that only shows after two updates
    (a schedule's later steps) is not seen.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> w = jnp.zeros(3)
      >>> asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w) == asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w)
      True
      >>> asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w) == asgd_jax.rules.fingerprint(asgd_jax.asgd(0.2), w)
      False
    """
    import hashlib

    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.transfer_guard("allow"):
        probe = jax.tree.map(
            lambda p: 0.01 * (1.0 + jnp.arange(np.size(p), dtype=jnp.float32).reshape(np.shape(p)) % 7), params
        )
        grads = jax.tree.map(lambda p: 0.5 - p, probe)
        state = rule.init(probe)
        out = []
        for step in range(2):
            updates, state = rule.update(
                grads,
                state,
                probe,
                stale_params=jax.tree.map(lambda p: 0.9 * p, probe),
                staleness=jnp.int32(step + 2),
                worker=jnp.int32(0),
            )
            out += [np.asarray(u, np.float64) for u in jax.tree.leaves(updates)]
    digest = hashlib.sha256()
    for u in out:  # a leaf's first elements and its sum, to 6 significant digits: cheap for a big model, and stable
        digest.update(" ".join(f"{x:.6g}" for x in [*u.ravel()[:64], u.sum()]).encode())
    return digest.hexdigest()[:16]
