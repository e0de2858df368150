"""Shadowheart SGD's decisions (Tyurin, Pozzi, Ilin & Richtárik, NeurIPS 2024, arXiv 2402.04785): the equilibrium
time t* of a cluster whose workers take h_i per gradient and tau_i per compressed message, and each worker's share
of a round: b_i = floor(t* / h_i) gradients, m_i = floor(t* / tau_i) compressed messages, and the server's weights.

Decided from the cluster's numbers alone, before any gradient, as the optimal-time clusters decide theirs (host-side,
float64: the times are fixed numbers of the run). The round model that runs the method on them is not in the package
yet; these are what it will read, and what a study can print beside its clusters.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from asgd_jax import errors

__all__ = ["ShadowheartRound", "equilibrium_time", "shadowheart_round"]

_BISECTIONS = 200


def _times(name: str, values) -> np.ndarray:
    try:
        array = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        array = np.zeros(0)
    ok = array.ndim == 1 and array.size > 0 and np.all(np.isfinite(array)) and np.all(array > 0)
    errors.require(bool(ok), name, values, "give one positive finite time per worker")
    return array


def equilibrium_time(compute_times, send_times, omega: float, sigma2_over_eps: float) -> float:
    r"""The equilibrium time t* of Shadowheart SGD (Definition 4.2 of the paper).

    Sort the workers by :math:`\max(h_i, \tau_i)`; for each prefix j of that order let :math:`s^*(j)` solve

    .. math::
        s = \Big[\sum_{i \le j} \frac{1}{2\tau_i\omega + 4\tau_i\omega h_i (\sigma^2/\varepsilon)/s
            + 2 h_i \sigma^2/\varepsilon}\Big]^{-1},

    and :math:`t^*(j) = \max\{\max(h_{\pi_j}, \tau_{\pi_j}), s^*(j)\}`; then :math:`t^* = \min_j t^*(j)`. The right
    side decreases in s, so each equation has one root, found here by bisection between
    :math:`[\sum_i 1/(2\tau_i\omega + 2h_i\sigma^2/\varepsilon)]^{-1}` (the right side at infinity) and the right side
    there. A prefix with a worker whose terms are all zero (no compression variance and no noise) takes the prefix's
    own bound, as the authors' code does.

    Args:
      compute_times: h_i, seconds per stochastic gradient, one per worker (> 0).
      send_times: tau_i, seconds per compressed message, one per worker (> 0).
      omega: the compressor's variance parameter (>= 0: RandK of d is d / K - 1; 0 without compression).
      sigma2_over_eps: sigma^2 / epsilon (>= 0), a tuning knob in the authors' experiments.

    Example:
      >>> from asgd_jax.delays.shadowheart import equilibrium_time
      >>> round(equilibrium_time([1.0, 1.0], [1.0, 1.0], omega=0.0, sigma2_over_eps=4.0), 3)  # 2 h sigma^2/eps / 2
      4.0
    """
    h, tau = _times("compute_times", compute_times), _times("send_times", send_times)
    errors.require(h.shape == tau.shape, "send_times", send_times, f"give {h.size} times, one per worker")
    omega = errors.finite_number("omega", omega, positive=False)
    r = errors.finite_number("sigma2_over_eps", sigma2_over_eps, positive=False)
    errors.require(omega >= 0 and r >= 0, "omega", (omega, r), "omega and sigma2_over_eps must be >= 0")
    order = np.argsort(np.maximum(h, tau), kind="stable")
    h, tau = h[order], tau[order]
    bound = np.maximum(h, tau)
    best = np.inf
    for j in range(h.size):
        hj, tj = h[: j + 1], tau[: j + 1]
        a, b = 2 * tj * omega + 2 * hj * r, 4 * tj * omega * hj * r
        if np.any(a <= 1e-12):
            best = min(best, bound[j])
            continue
        rhs = lambda s, a=a, b=b: 1.0 / np.sum(1.0 / (a + b / s))
        low = 1.0 / np.sum(1.0 / a)
        high = rhs(low)
        for _ in range(_BISECTIONS):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if mid - rhs(mid) < 0 else (low, mid)
        best = min(best, max(bound[j], 0.5 * (low + high)))
    return float(best)


class ShadowheartRound(NamedTuple):
    """A round of Shadowheart SGD: its time t*, each worker's gradients ``b`` and compressed messages ``m`` (a worker
    with either 0 sits out), and the server's weight of each worker's messages (0 for those that sit out)."""

    time: float
    b: np.ndarray
    m: np.ndarray
    weights: np.ndarray


def shadowheart_round(compute_times, send_times, omega: float, sigma2_over_eps: float) -> ShadowheartRound:
    r"""Each worker's share of a Shadowheart round: :math:`b_i = \lfloor t^*/h_i \rfloor`,
    :math:`m_i = \lfloor t^*/\tau_i \rfloor`, and the weights :math:`w_i = 1/(b_i\omega + \omega\sigma^2/\varepsilon
    + m_i\sigma^2/\varepsilon)` of the step :math:`x \leftarrow x - \gamma \sum_i w_i \sum_{j \le m_i} C_{ij}(g_i) /
    \sum_i w_i m_i b_i` (Algorithm 1), with :math:`g_i` the sum of worker i's b_i gradients.

    Example:
      >>> from asgd_jax.delays.shadowheart import shadowheart_round
      >>> r = shadowheart_round([1.0, 3.0], [1.0, 1.0], omega=1.0, sigma2_over_eps=1.0)
      >>> round(r.time, 4), r.b.tolist(), r.m.tolist()
      (3.5375, [3, 1], [3, 3])
    """
    t = equilibrium_time(compute_times, send_times, omega, sigma2_over_eps)
    h, tau = _times("compute_times", compute_times), _times("send_times", send_times)
    b, m = np.floor(t / h + 1e-9).astype(np.int64), np.floor(t / tau + 1e-9).astype(np.int64)
    active = (b > 0) & (m > 0)
    r = float(sigma2_over_eps)
    with np.errstate(divide="ignore"):
        weights = np.where(active, 1.0 / (b * omega + omega * r + m * r), 0.0)
    return ShadowheartRound(t, b, m, weights)
