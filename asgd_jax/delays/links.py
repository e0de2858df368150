"""Communication that costs time: :class:`Links`, each worker's upload and download, whose time grows with the message
(latency + bytes / bandwidth, the model of every 2024-2026 paper with communication and of the FL simulators FedScale,
AFL-Lib and APPFL); :func:`message_bytes`, the size of a message of the weights (or of K of its coordinates)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors
from asgd_jax.delays.base import for_workers as _for_workers
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass
from asgd_jax.delays.base import worker_numbers as _numbers

__all__ = ["Links", "message_bytes", "sized"]

_FIELDS = ("latency", "bandwidth", "down_latency", "down_bandwidth", "up_bytes", "down_bytes", "up_scale")


class Links:
    """Every worker's link to the server: a push uploads ``up_bytes`` in ``latency + up_bytes / bandwidth``, the pull
    after it downloads ``down_bytes`` in ``down_latency + down_bytes / down_bandwidth``, worker by worker.

    Give it to :class:`~asgd_jax.delays.Workers` (``Workers(M, links=Links(...))``), or to the law a cluster draws
    from: a worker's exchange then takes its compute time, plus ``comm_time``, plus its upload and its download, one
    after the other (the worker waits for the fresh weights before it computes again). Every number may be one for
    all workers or one per worker (``[M]``); all are numbers of the run (arguments of its programs, not structure).

    The message sizes default to the size of the weights (:func:`message_bytes`), filled in by the simulator from the
    run's initial weights; give ``up_bytes`` for a compressed push (``message_bytes(params, coordinates=K)`` for TopK
    or RandK: K values and their indices), or ``up_scale`` (the push as a share of the weights' size: 1/8 for a
    sixteenth of float32 coordinates with 4-byte indices), ``down_bytes`` for a compressed broadcast.

    Args:
      latency: seconds of every upload besides its bytes (>= 0).
      bandwidth: bytes per second of the upload (> 0; ``inf``: free bytes).
      down_latency, down_bandwidth: the download's (default: the upload's).
      up_bytes, down_bytes: the message sizes in bytes (>= 0; default: the weights').
      up_scale: with ``up_bytes`` not given, the push's size as a multiple of the weights' (>= 0; default 1).
      jitter: every message's time drawn anew, times a log-normal factor of mean 1 and log-std ``jitter`` (>= 0; one
        number or one per worker; a literal 0, the default, draws nothing).

    Example:
      >>> import asgd_jax
      >>> links = asgd_jax.delays.Links(latency=0.5, bandwidth=100.0, up_bytes=16, down_bytes=16)
      >>> [round(float(t), 2) for t in links.times()]   # 0.5 + 16 / 100 each way
      [0.66, 0.66]
    """

    latency: Any = 0.0
    bandwidth: Any = math.inf
    down_latency: Any = None
    down_bandwidth: Any = None
    up_bytes: Any = None
    down_bytes: Any = None
    up_scale: Any = 1.0
    jitter: Any = 0.0

    def __post_init__(self):
        if not (isinstance(self.jitter, int | float) and not isinstance(self.jitter, bool) and self.jitter == 0):
            object.__setattr__(
                self, "jitter", _numbers("jitter", self.jitter, lambda v: np.isfinite(v) & (v >= 0), ">= 0")
            )
        for name in _FIELDS:
            if getattr(self, name) is None:
                continue
            ok, expected = (lambda v: v > 0, "> 0 (inf: free)") if "bandwidth" in name else (_finite, "finite and >= 0")
            object.__setattr__(self, name, _numbers(name, getattr(self, name), ok, expected))

    def for_workers(self, num: int) -> Links:
        """These links for ``num`` workers: every number a float32 ``[num]`` array (the downloads' defaults filled),
        a per-worker list of another length refused."""
        out = {}
        for name in (*_FIELDS, "jitter"):
            value = getattr(self, name)
            if value is None and name in ("down_latency", "down_bandwidth"):
                value = getattr(self, name.removeprefix("down_"))
            out[name] = (
                value if name == "jitter" and not isinstance(value, np.ndarray) else _for_workers(name, value, num)
            )
        return dataclasses.replace(self, **out)

    def times(self, worker: jax.Array | None = None, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(upload, download)`` seconds: ``[M]`` (or a scalar of one ``worker``); a missing size counts as 0; with
        ``jitter``, each drawn with ``key``."""

        def pick(v):  # one per worker, or one for all (a sweep's traced number)
            v = jnp.asarray(v, jnp.float32)
            return v if worker is None or v.ndim == 0 else v[worker]

        size = lambda v: jnp.float32(0.0) if v is None else pick(v)
        up_latency, up_bandwidth = pick(self.latency), pick(self.bandwidth)
        down_latency = up_latency if self.down_latency is None else pick(self.down_latency)
        down_bandwidth = up_bandwidth if self.down_bandwidth is None else pick(self.down_bandwidth)
        up = up_latency + size(self.up_bytes) / up_bandwidth
        down = down_latency + size(self.down_bytes) / down_bandwidth
        if key is None or (isinstance(self.jitter, int | float) and self.jitter == 0):
            return up, down
        sigma = jnp.broadcast_to(pick(self.jitter), jnp.shape(up))[None]  # (one or one per worker, per message)
        z = jax.random.normal(jax.random.fold_in(key, 5), (2, *jnp.shape(up)), jnp.float32)
        factor = jnp.exp(sigma * z - 0.5 * sigma * sigma)  # log-normal of mean 1
        return up * factor[0], down * factor[1]


Links = _pytree_dataclass(Links, meta=())


def _finite(v: np.ndarray) -> np.ndarray:
    return (v >= 0) & np.isfinite(v)


def message_bytes(params: Any, coordinates: int | None = None, index_bytes: int = 4) -> int:
    """The bytes of a message of ``params``' shapes and dtypes: all of it, or (``coordinates=K``) K values of the
    weights' widest dtype and an ``index_bytes`` index each (a TopK or RandK payload).

    Example:
      >>> import numpy as np, asgd_jax
      >>> w = {"a": np.zeros((10, 10), np.float32), "b": np.zeros(28, np.float32)}
      >>> asgd_jax.delays.message_bytes(w), asgd_jax.delays.message_bytes(w, coordinates=8)
      (512, 64)
    """
    leaves = jax.tree.leaves(params)
    try:
        widths = [np.dtype(jnp.result_type(x)).itemsize for x in leaves]
    except TypeError:
        widths = []
    errors.require(bool(widths), "params", type(params).__name__, "give a pytree of arrays (the weights)")
    if coordinates is None:
        return int(sum(np.size(x) * w for x, w in zip(leaves, widths, strict=True)))
    errors.int_at_least("coordinates", coordinates, 1)
    return int(coordinates) * (max(widths) + int(index_bytes))


def sized(model: Any, nbytes: int | Callable[[], int]) -> Any:
    """``model`` with its links' missing message sizes set to ``nbytes`` (the push's times its ``up_scale``; a
    :class:`Workers` law's, or the one a cluster draws from); any other model as it is. ``nbytes`` may be a function,
    called only when a size is missing."""
    from asgd_jax.delays.workers import Workers

    if isinstance(model, Workers):
        links = model.links
        if links is None or (links.up_bytes is not None and links.down_bytes is not None):
            return model
        size = nbytes() if callable(nbytes) else nbytes
        fill = {
            k: np.full(model.num, size, np.float32) for k in ("up_bytes", "down_bytes") if getattr(links, k) is None
        }
        if "up_bytes" in fill:  # (a compressed push: a share of the weights)
            fill["up_bytes"] = fill["up_bytes"] * links.up_scale
        return dataclasses.replace(model, links=dataclasses.replace(links, **fill))
    if isinstance(getattr(model, "workers", None), Workers) and dataclasses.is_dataclass(model):
        return dataclasses.replace(model, workers=sized(model.workers, nbytes))
    return model
