"""Recorded schedules, replayed: :class:`Trace` (an order of pushing workers, e.g. a trainer's ``trace.jsonl``, with
rejected pushes as skips and, for a Ringmaster run, the versions pulled) and :class:`RoundTrace` (a Rennala or
m-Synchronous run's rounds)."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors
from asgd_jax.delays.base import Counted as _Counted
from asgd_jax.delays.base import Event, Round
from asgd_jax.delays.base import Stateless as _Stateless
from asgd_jax.delays.base import check_array as _check_array
from asgd_jax.delays.base import check_int as _check_int
from asgd_jax.delays.base import is_concrete as _is_concrete
from asgd_jax.delays.base import pytree_dataclass as _pytree_dataclass


def _recorded_time(times: Any, t: jax.Array) -> jax.Array:
    """Update ``t``'s recorded time, or ``t + 1`` for a record without times."""
    return (t + 1).astype(jnp.float32) if times is None else jnp.asarray(times, jnp.float32)[t]


class Trace(_Counted, _Stateless):
    """Pushes arrive in exactly the given order of workers; each worker pulls right after it pushes (or, with
    ``pulled``, computes at the version given).

    All workers start from w_0. This replays a recorded run: ``Trace.load("runs/x/trace.jsonl")``.

    Args:
      worker_ids: the pushing worker of every update, ints in ``[0, num)``.
      num: number of workers (static); defaults to ``max(worker_ids) + 1``.
      times: optional virtual (or wall-clock) time of every update; defaults to ``1, 2, 3, ...``.
      skips: optional, per update: the pushing worker's pushes rejected (NaN/Inf) since its previous applied one. Each
        used up that worker's minibatches without changing a weight, so the replay skips as many exchange periods of
        its shard (``Trace.load`` reads them from the trace's rejected and ignored records).
      pulled: optional, per update t: the version its gradient was computed at (``t - pulled[t]`` its staleness), for
        a run whose workers did not always compute at the weights their own previous push brought back (a trainer's
        Ringmaster run: a too-stale push ignored and answered with the current weights, a stopped computation
        restarted there). The server then keeps a ring of ``ring`` versions, the largest staleness + 1, instead of a
        backup per worker.
      ring: the ring's length (static; default from a concrete ``pulled``).
      steps: optional, per worker: the minibatches of its exchange periods, when fewer than ``n_sync`` (a DyLU
        run's, :attr:`Workers.dylu`: a trainer run records them, :func:`asgd_jax.trainer.replay_plan` reads them).

    Example:
      >>> import asgd_jax
      >>> trace = asgd_jax.delays.Trace([0, 1, 1, 0])
      >>> trace.num, len(trace)
      (2, 4)
      >>> asgd_jax.delays.Trace([0, 1, 1, 0], pulled=[0, 0, 2, 2]).num_slots  # staleness at most 1: two versions
      2
    """

    worker_ids: Any
    times: Any = None
    num: int | None = None
    skips: Any = None
    pulled: Any = None
    ring: int | None = None
    steps: Any = None

    def __post_init__(self):
        _check_array("skips", self.skips, lambda s: s >= 0, ">= 0 per update", per_update=True)
        ids = self.worker_ids
        if _is_concrete(ids):
            ids = np.asarray(ids)
            if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise errors.ConfigError(
                    f"worker_ids={self.worker_ids!r} is invalid: give a non-empty 1-D list of ints."
                )
            if ids.min() < 0:
                raise errors.ConfigError(f"worker_ids contains {ids.min()}: worker ids must be >= 0.")
            num = int(ids.max()) + 1 if self.num is None else self.num
            _check_int("num", num, 1)
            if ids.max() >= num:
                raise errors.ConfigError(
                    f"worker_ids contains {ids.max()} but num={num}: ids must be < num (or leave num=None)."
                )
            object.__setattr__(self, "num", int(num))
            object.__setattr__(self, "worker_ids", ids.astype(np.int32))
            for name in ("times", "skips"):
                if getattr(self, name) is not None and np.shape(getattr(self, name)) != ids.shape:
                    raise errors.ConfigError(
                        f"{name} has shape {np.shape(getattr(self, name))}: give one per worker id {ids.shape}."
                    )
            if self.skips is not None:
                object.__setattr__(self, "skips", np.asarray(self.skips).astype(np.int32))
        elif self.num is None:
            raise errors.ConfigError("Trace(worker_ids=<traced>) needs num= given explicitly.")
        self._check_pulled()
        if self.steps is not None and _is_concrete(self.steps):
            steps = np.asarray(self.steps)
            errors.require(
                steps.shape == (self.num,) and np.issubdtype(steps.dtype, np.integer) and bool(np.all(steps >= 1)),
                "steps",
                self.steps,
                f"give each worker's minibatches per exchange period: {self.num} ints >= 1, one per worker",
            )
            object.__setattr__(self, "steps", steps.astype(np.int32))

    def _check_pulled(self) -> None:
        if self.pulled is None:
            errors.require(self.ring is None, "ring", self.ring, "a ring replays pulled versions: give pulled too")
            return
        if not _is_concrete(self.pulled):
            errors.require(self.ring is not None, "ring", self.ring, "Trace(pulled=<traced>) needs ring= given")
            _check_int("ring", self.ring, 1)
            return
        _check_array("pulled", self.pulled, lambda p: p >= 0, ">= 0 per update", per_update=True)
        pulled = np.asarray(self.pulled).astype(np.int32)
        errors.require(
            pulled.shape == np.shape(self.worker_ids),
            "pulled",
            f"an array of shape {pulled.shape}",
            f"give one version per worker id {np.shape(self.worker_ids)}",
        )
        stale = np.arange(len(pulled)) - pulled
        errors.require(
            bool(np.all(stale >= 0)),
            "pulled",
            f"version {pulled[np.argmin(stale)]} at update {int(np.argmin(stale))}",
            "a gradient is computed at a version already made: pulled[t] <= t",
        )
        ring = int(stale.max()) + 1 if self.ring is None else self.ring
        _check_int("ring", ring, int(stale.max()) + 1)
        object.__setattr__(self, "pulled", pulled)
        object.__setattr__(self, "ring", ring)

    def __len__(self) -> int:
        return int(np.shape(self.worker_ids)[0])

    @property
    def num_slots(self) -> int:
        return self.num if self.ring is None else self.ring

    def next(self, state: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key, n_sync
        worker = jnp.asarray(self.worker_ids, jnp.int32)[t]
        times = _recorded_time(self.times, t)
        skip = 0 if self.skips is None else jnp.asarray(self.skips, jnp.int32)[t]
        steps = None if self.steps is None else jnp.asarray(self.steps, jnp.int32)[worker]
        if self.ring is None:
            return state, Event(worker, worker, worker, times, skip, steps=steps)
        # A ring of versions, as Ringmaster's: slot v % ring holds w_v from when v is made until v + ring is.
        source = jnp.asarray(self.pulled, jnp.int32)[t] % self.ring
        return state, Event(source, ((t + 1) % self.ring).astype(jnp.int32), worker, times, skip, worker, steps=steps)

    @classmethod
    def load(cls, path: str | os.PathLike, num: int | None = None, steps: Any = None) -> Trace:
        """Reads a trainer's ``trace.jsonl`` (:func:`asgd_jax.trace.read`: one record per applied or rejected push; a
        rejected one becomes a skip of its worker's next applied push).

        The number of workers is ``num``, or else the one the records say (a worker that never pushed still counts);
        a half-written last line (a killed run) is left out. ``steps``: a DyLU run's minibatches per period, per
        worker (its ``plan.json``'s ``local_steps``).
        """
        from asgd_jax import trace  # the trace format's owner (it imports nothing of the engines)

        read = trace.read(path)
        num = num if num is not None else read.num
        if read.rounds is not None:  # a round method's run (Rennala, m-Synchronous): every update a recorded round
            return RoundTrace(read.rounds, read.round_skips, read.times, num)
        return cls(read.workers, read.times, num, read.skips, read.pulled, steps=steps)


Trace = _pytree_dataclass(Trace, meta=("num", "ring"))


class RoundTrace(_Counted, _Stateless):
    """Recorded rounds, replayed (a trainer's Rennala or m-Synchronous run: :meth:`Trace.load` reads one back so).

    Update t averages ``K`` payloads, all computed at w_t: payload j is worker ``shards[t, j]``'s next minibatch, after
    ``skips[t, j]`` minibatch periods of its shard used by gradients that changed no weight (ignored as computed at an
    older iterate, or in a round rejected as NaN/Inf).

    Args:
      shards: int ``[updates, K]``: each round's workers, in the order their payloads are averaged.
      skips: optional int ``[updates, K]`` (default none).
      times: optional time of every update (default ``1, 2, 3, ...``).
      num: the number of workers M (default: the largest worker id + 1).

    Example:
      >>> import asgd_jax
      >>> rounds = asgd_jax.delays.RoundTrace([[0, 2], [1, 1], [2, 0]], num=3)
      >>> rounds.round_size, len(rounds)
      (2, 3)
    """

    shards: Any
    skips: Any = None
    times: Any = None
    num: int | None = None

    def __post_init__(self):
        shards = np.asarray(self.shards) if _is_concrete(self.shards) else None
        if shards is not None:
            ok = shards.ndim == 2 and shards.size > 0 and np.issubdtype(shards.dtype, np.integer)
            errors.require(ok, "shards", self.shards, "give a non-empty [updates, K] array of worker ids")
            errors.require(bool(shards.min() >= 0), "shards", int(shards.min()), "worker ids are >= 0")
            num = int(shards.max()) + 1 if self.num is None else self.num
            _check_int("num", num, int(shards.max()) + 1)
            object.__setattr__(self, "num", num)
            object.__setattr__(self, "shards", shards.astype(np.int32))
            if self.skips is not None:
                skips = np.asarray(self.skips)
                errors.require(
                    skips.shape == shards.shape and np.issubdtype(skips.dtype, np.integer) and bool(np.all(skips >= 0)),
                    "skips",
                    f"an array of shape {skips.shape}",
                    f"give one int >= 0 per payload, shape {shards.shape}",
                )
                object.__setattr__(self, "skips", skips.astype(np.int32))
            if self.times is not None:
                errors.require(
                    np.shape(self.times) == shards.shape[:1],
                    "times",
                    f"an array of shape {np.shape(self.times)}",
                    f"give one time per update, shape {shards.shape[:1]}",
                )
        elif self.num is None:
            raise errors.ConfigError("RoundTrace(shards=<traced>) needs num= given explicitly.")

    def __len__(self) -> int:
        return int(np.shape(self.shards)[0])

    num_slots = 1

    @property
    def round_size(self) -> int:
        return int(np.shape(self.shards)[1])

    def round(self, state: jax.Array, t: jax.Array, key: jax.Array, n_sync: int = 1):
        del key, n_sync
        shards = jnp.asarray(self.shards, jnp.int32)[t]
        skips = jnp.zeros_like(shards) if self.skips is None else jnp.asarray(self.skips, jnp.int32)[t]
        time = _recorded_time(self.times, t)
        return state, Round(shards, skips, time, None, None)


RoundTrace = _pytree_dataclass(RoundTrace, meta=("num",))
