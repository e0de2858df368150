"""Host-side summaries of simulator metrics: smoothing, mean and spread over seeds, staleness histograms."""

from __future__ import annotations

import numpy as np

from asgd_jax import errors

__all__ = ["mean_std", "smooth", "staleness_histogram"]


def smooth(values: np.ndarray, window: int = 400) -> np.ndarray:
    """Trailing sliding-window mean along the last axis (GPU A-SGD smooths training error over 400 minibatches).

    The first ``window - 1`` points average over what exists so far, so the output has the input's shape.

    Example:
      >>> import numpy as np, asgd_jax
      >>> asgd_jax.metrics.smooth(np.array([1.0, 3.0, 5.0, 7.0]), window=2)
      array([1., 2., 4., 6.])
    """
    if not isinstance(window, int) or window < 1:
        raise errors.ConfigError(f"window={window!r} is invalid: use an int >= 1 (minibatches).")
    values = np.asarray(values, np.float64)
    csum = np.cumsum(values, axis=-1)
    shifted = np.zeros_like(csum)
    shifted[..., window:] = csum[..., :-window]
    count = np.minimum(np.arange(1, values.shape[-1] + 1), window)
    return (csum - shifted) / count


def mean_std(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation (0 for a single run) over ``axis``.

    Example:
      >>> import numpy as np, asgd_jax
      >>> asgd_jax.metrics.mean_std(np.array([1.0, 3.0]))
      (np.float64(2.0), np.float64(1.4142135623730951))
    """
    values = np.asarray(values, np.float64)
    std = values.std(axis=axis, ddof=1) if values.shape[axis] > 1 else np.zeros_like(values.mean(axis=axis))
    return values.mean(axis=axis), std


def staleness_histogram(staleness: np.ndarray) -> np.ndarray:
    """Counts of each staleness value 0..max (over all runs and updates).

    Example:
      >>> import numpy as np, asgd_jax
      >>> asgd_jax.metrics.staleness_histogram(np.array([0, 2, 2, 3])).tolist()
      [1, 0, 2, 1]
    """
    staleness = np.asarray(staleness).ravel()
    return np.bincount(staleness[staleness >= 0])
