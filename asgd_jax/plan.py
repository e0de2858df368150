"""A run's static description as one value: :class:`Plan`.

A plan says how a run is laid out, never what it computes with: the delay model (who pushes when), the exchange
pattern (SSGD or not, ``n_sync`` minibatches per exchange, the push mode, the batch), the budget and the cadence of
evaluations, checkpoints and compiled chunks. The simulator (:func:`asgd_jax.simulate`, :func:`asgd_jax.sweep`,
:func:`asgd_jax.simulator.lower`), the trainer (:class:`asgd_jax.TrainConfig` holds one) and the studies (an
:class:`asgd_jax.studies.Arm` holds one) read the same value, and each setting is checked here, once, when the plan
is made.

A plan's *structure* (:meth:`Plan.structure`: the delay model's kind and worker count, the exchange pattern, the chunk
length) keys the compiled programs; its numbers (the delay model's speeds and times, ``local_lr``) and its budget are
arguments, so a plan that changes only those compiles nothing new.

Example:
  >>> import asgd_jax
  >>> plan = asgd_jax.Plan(asgd_jax.delays.Workers(8), num_updates=2_000, batch_size=64)
  >>> plan.workers, plan.chunk_length
  (8, 100)
  >>> plan.replace(num_updates=5_000).structure() == plan.structure()
  True
  >>> asgd_jax.Plan(n_sync=4)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  asgd_jax.errors.ConfigError: n_sync=4 (--n-sync) with push='gradients' takes local SGD steps ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from asgd_jax import delays as delays_lib
from asgd_jax import errors
from asgd_jax.partition import Partition

__all__ = ["DEFAULT_CHUNK", "INNER", "MODES", "PUSHES", "Plan", "PlanStructure"]

MODES = ("async", "sync")
PUSHES = ("gradients", "delta", "accumulate")
INNER = ("sgd", "momentum", "adamw")
"""A worker's optimizer for its local steps, by name (:func:`asgd_jax.exchange.inner_optimizer` builds it)."""

DEFAULT_CHUNK = 100
"""Updates per compiled chunk when neither ``chunk`` nor ``eval_every`` says: independent of the budget, so runs of
any length share the chunk's program (it takes any length up to the chunk's: a run shorter than a chunk, or its
last part, runs in it too; on an accelerator whole chunks run in a scan of their own)."""


class PlanStructure(NamedTuple):
    """What of a plan shapes the compiled programs (hashable): the delay model's :class:`~asgd_jax.delays.Structure`,
    the exchange pattern and the chunk length."""

    delays: delays_lib.Structure
    mode: str
    n_sync: int
    push: str
    batch_size: int
    chunk: int
    fixed_partition: bool = False  # a non-IID partition: its assignment is an argument of the programs
    inner: str = "sgd"  # the workers' optimizer of their local steps


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static description of a run, validated when made.

    Attributes:
      delays: the delay model (:mod:`asgd_jax.delays`), or an int M for ``Workers(M)``; default ``Workers(8)``. The
        trainer takes its worker count from it (its real delays are measured, not drawn).
      num_updates: server updates (applied pushes) of the run; a learning-rate schedule counts these.
      batch_size: minibatch of every worker.
      mode: ``"async"`` (A-SGD; default) or ``"sync"`` (SSGD: every update averages the M workers' payloads,
        computed at the same weights; needs ``Workers``). A round model (``delays.Rennala``, ``delays.MSync``: every
        update averages the payloads its round uses) makes the mode ``"sync"``.
      n_sync: minibatches a worker computes between two exchanges (GPU A-SGD).
      push: what a worker pushes after its ``n_sync`` minibatches: ``"gradients"`` (local SGD steps at ``local_lr``,
        push the summed gradients), ``"delta"`` (local steps, push ``w_pulled - w_local``, which the rule treats like a
        gradient: a server learning rate of 1 adds the delta) or ``"accumulate"`` (sum the gradients at the pulled
        weights, no local steps).
      local_lr: the step size of the local steps (needed for ``push="delta"``, and with ``n_sync > 1`` unless
        ``push="accumulate"``).
      eval_every: updates between evaluations (with an ``eval_fn``); default: about twenty evaluations per run, at
        chunk ends.
      checkpoint_every: updates between checkpoints; default a tenth of the run (:meth:`checkpoint_interval`, the
        same for both engines; the simulator writes at the first chunk end past each multiple).
      chunk: updates per compiled chunk of the simulator (its progress, evaluation and checkpoint unit); default
        ``eval_every``, else :data:`DEFAULT_CHUNK`. ``eval_every`` must be a multiple of it.
      time_budget: a virtual-time budget (simulator): the run ends at the first evaluation (the first chunk end,
        without an ``eval_fn``) where every run's clock has reached it, before ``num_updates`` if it comes first; its
        metrics hold the updates done. A number, not structure.
      inner: the workers' optimizer of their local steps, at ``local_lr``: ``"sgd"`` (the default, plain steps),
        ``"momentum"`` (SGD with Nesterov momentum 0.9) or ``"adamw"`` (optax's AdamW: DiLoCo's inner optimizer);
        each worker's state of it is its own and lasts across its applied pushes (the simulator's state and
        checkpoints; the trainer keeps it in each worker, a thread or a Ray actor, and in the store's checkpoints as
        of the worker's last applied push).
      partition: how the data is split among the workers (:class:`asgd_jax.partition.Partition`, or its text form:
        ``"iid"``, the default; ``"dirichlet:0.1"``, ``"labels:2"``, ``"unequal:0.5"``); a non-IID partition is drawn
        once from the labels ``data["y"]`` and its own seed, the same for the simulator and the trainer.

    Example:
      >>> import asgd_jax
      >>> plan = asgd_jax.Plan(4, mode="sync")
      >>> plan.delays.num, plan.delays.compute_time
      (4, 'exponential')
    """

    delays: Any = None
    num_updates: int = 2_000
    batch_size: int = 32
    mode: str = "async"
    n_sync: int = 1
    push: str = "gradients"
    local_lr: float | None = None
    eval_every: int | None = None
    checkpoint_every: int | None = None
    chunk: int | None = None
    time_budget: float | None = None
    partition: Any = None
    inner: str = "sgd"

    def __post_init__(self):
        model = delays_lib.Workers(8) if self.delays is None else self.delays
        if errors.is_int(model):
            model = delays_lib.Workers(errors.positive_int("workers", model, "--workers"))
        errors.require(
            delays_lib.is_delay_model(model),
            "delays",
            model,
            "use a delay model (asgd_jax.delays: Workers, Trace, FixedDelay, RandomDelay, Ringmaster, Rennala, MSync) "
            "or an int M for Workers(M)",
        )
        object.__setattr__(self, "delays", model)
        if delays_lib.is_round_model(model):  # every update of a round model is a round (Rennala, MSync)
            object.__setattr__(self, "mode", "sync")
        errors.positive_int("num_updates", self.num_updates, "--num-updates")
        errors.positive_int("batch_size", self.batch_size, "--batch-size")
        errors.choice("mode", self.mode, MODES, "--mode")
        errors.positive_int("n_sync", self.n_sync, "--n-sync")
        errors.choice("push", self.push, PUSHES, "--push")
        errors.choice("inner", self.inner, INNER, "--inner")
        for name in ("eval_every", "checkpoint_every", "chunk"):
            if getattr(self, name) is not None:
                errors.positive_int(name, getattr(self, name), "--" + name.replace("_", "-"))
        if self.time_budget is not None:
            object.__setattr__(
                self, "time_budget", errors.finite_number("time_budget", self.time_budget, positive=True)
            )
        if self.local_lr is not None:
            object.__setattr__(
                self, "local_lr", errors.finite_number("local_lr", self.local_lr, positive=True, flag="--local-lr")
            )
        object.__setattr__(self, "partition", Partition.parse(self.partition))
        if not self.partition.iid and model.num_shards == 1 and getattr(model, "num_workers", None) != 1:
            raise errors.ConfigError(
                f"partition={str(self.partition)!r} (--partition) splits the data among workers, but "
                f"{model!r} reads one data stream: use delays=asgd_jax.delays.Workers(M) (or a cluster "
                "of M workers), or the 'iid' partition."
            )
        self._check_exchange()
        if self.chunk is not None and self.eval_every is not None and self.eval_every % self.chunk:
            raise errors.ConfigError(
                f"eval_every={self.eval_every} is not a multiple of chunk={self.chunk}: evaluations happen at chunk "
                "ends; use a multiple, or leave chunk unset (it then follows eval_every)."
            )

    def _check_exchange(self) -> None:
        local_steps = self.push == "delta" or (self.n_sync > 1 and self.push != "accumulate")
        if local_steps and self.local_lr is None:
            what = (
                "pushes w_pulled - w_local after local SGD steps"
                if self.push == "delta"
                else "takes local SGD steps between exchanges"
            )
            raise errors.ConfigError(
                f"n_sync={self.n_sync} (--n-sync) with push={self.push!r} {what}: pass local_lr=<float> (--local-lr), "
                "or use push='accumulate' (no local steps)."
            )
        if self.inner != "sgd" and not local_steps:
            raise errors.ConfigError(
                f"inner={self.inner!r} (--inner) is the optimizer of a worker's local steps, but this plan takes none "
                f"(push={self.push!r}, n_sync={self.n_sync}): use push='delta' or n_sync > 1, or inner='sgd'."
            )
        inner_law = getattr(self.delays, "workers", None)  # a cluster's law (Ringmaster, Overlapped, ...)
        if getattr(inner_law, "dylu", False):
            raise errors.ConfigError(
                f"{type(self.delays).__name__} over Workers(dylu=True): DyLU is a plain Workers model's (its events "
                "carry each push's steps); use Workers(M, dylu=True) itself."
            )
        steps = getattr(self.delays, "steps", None)  # (a DyLU run's Trace: each worker's steps)
        if isinstance(steps, np.ndarray) and steps.max() > self.n_sync:
            raise errors.ConfigError(
                f"the trace's steps={steps.tolist()} exceed n_sync={self.n_sync}: a worker takes at most the period's "
                "n_sync minibatches; give the n_sync of the run that recorded them."
            )
        dylu = getattr(self.delays, "dylu", False) or isinstance(steps, np.ndarray)
        if dylu and (self.mode != "async" or not local_steps or self.n_sync == 1):
            raise errors.ConfigError(
                f"Workers(dylu=True) (or a DyLU run's Trace) gives each worker its share of n_sync={self.n_sync} local "
                f"steps in asynchronous local SGD, but this plan has mode={self.mode!r}, push={self.push!r}: use "
                "mode='async', n_sync > 1 and local steps (push='delta', or push='gradients' with local_lr)."
            )
        rounds = delays_lib.is_round_model(self.delays)
        if self.mode == "sync" and not (rounds or isinstance(self.delays, delays_lib.Workers)):
            raise errors.ConfigError(
                f"mode='sync' (SSGD) needs delays=asgd_jax.delays.Workers(M), not {type(self.delays).__name__}: a "
                "barrier round averages the M workers' gradients."
            )
        if rounds and (self.push != "gradients" or self.n_sync != 1):
            raise errors.ConfigError(
                f"{type(self.delays).__name__} rounds average gradients computed at w_t: use push='gradients' and "
                f"n_sync=1 (not push={self.push!r}, n_sync={self.n_sync})."
            )
        if isinstance(self.delays, delays_lib.Trace | delays_lib.RoundTrace) and len(self.delays) < self.num_updates:
            what = "pushes" if isinstance(self.delays, delays_lib.Trace) else "rounds"
            raise errors.ConfigError(
                f"num_updates={self.num_updates} but the trace holds only {len(self.delays)} {what}: lower "
                "num_updates or give a longer trace."
            )

    def replace(self, **changes: Any) -> Plan:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    @property
    def workers(self) -> int:
        """The number of workers: M, or ``tau + 1`` round-robin slots for a fixed delay."""
        return getattr(self.delays, "num_workers", self.delays.num_slots)

    @property
    def payloads(self) -> int:
        """Payloads one update averages: a round model's K, every worker for SSGD, one asynchronously."""
        if delays_lib.is_round_model(self.delays):
            return self.delays.round_size
        return self.workers if self.mode == "sync" else 1

    @property
    def chunk_length(self) -> int:
        """Updates per compiled chunk: ``chunk``, else ``eval_every``, else :data:`DEFAULT_CHUNK`."""
        return self.chunk or self.eval_every or DEFAULT_CHUNK

    @property
    def local_steps(self) -> bool:
        """Whether a worker takes local SGD steps between its exchanges."""
        return self.push == "delta" or (self.n_sync > 1 and self.push != "accumulate")

    def eval_interval(self) -> int:
        """Updates between evaluations: ``eval_every``, else about a twentieth of the run, rounded to whole chunks
        (both engines: the trainer's evaluations fall where the simulator's do)."""
        if self.eval_every is not None:
            return self.eval_every
        chunk = self.chunk_length
        return chunk * max(1, round(self.num_updates / 20 / chunk))

    def checkpoint_interval(self) -> int:
        """Updates between checkpoints: ``checkpoint_every``, else a tenth of the run (both engines)."""
        return self.checkpoint_every or max(1, self.num_updates // 10)

    def structure(self) -> PlanStructure:
        """What of this plan shapes a compiled program (see :class:`PlanStructure`)."""
        structure, _ = delays_lib.split(self.delays)
        return PlanStructure(
            structure,
            self.mode,
            self.n_sync,
            self.push,
            self.batch_size,
            self.chunk_length,
            not self.partition.iid,
            self.inner,
        )

    def describe(self) -> dict[str, Any]:
        """The plan as plain values (for a checkpoint header, ``summary.json``, a study's results)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "delays"}
        if self.inner == "sgd":  # (the default, left out: the records of runs from before it existed stay the same)
            del out["inner"]
        if getattr(self.delays, "dylu", False):  # DyLU: each worker's minibatches per period (what a replay takes)
            out["local_steps"] = [int(k) for k in np.asarray(self.delays.local_steps(self.n_sync))]
        return {"delays": repr(self.delays), "workers": self.workers, **out, "partition": str(self.partition)}
