"""How the trainer exchanges for a plan: one value, derived once from the plan's delay model, read everywhere.

The optimal-time methods' ignores, stops and rounds are decisions of timing only (schedule, not rule), so in the
simulator they live in the delay model; in the trainer the store and the workers carry them out for real. What each
method asks of them is decided here and nowhere else: the store reads :attr:`Discipline.threshold` and
:attr:`Discipline.gather`, the workers :attr:`Discipline.stop_stale`, the endpoint :attr:`Discipline.kind`, a
checkpoint pins :meth:`Discipline.header`. A new method is one case in :meth:`Discipline.of`, one delay model and one
flag.

Example:
  >>> from asgd_jax import Plan, delays
  >>> from asgd_jax.trainer.discipline import Discipline
  >>> d = Discipline.of(Plan(delays.Ringmaster(4, 3, stops=True)))
  >>> d.kind, d.threshold, d.stop_stale
  ('ringmaster', 3, 3)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from asgd_jax import delays
from asgd_jax.plan import Plan

__all__ = ["KINDS", "TRAINABLE", "Discipline", "Gather"]

KINDS = ("async", "ssgd", "ringmaster", "rennala", "msync")
"""The exchange disciplines: asynchronous pushes, SSGD rounds, Ringmaster's threshold (and stops), Rennala's and
m-Synchronous SGD's gathered rounds."""

TRAINABLE = (delays.Workers, delays.Ringmaster, delays.Rennala, delays.MSync)
"""The delay models a trainer's plan may hold: M real workers, bare or under an optimal-time method."""


class Gather(NamedTuple):
    """A round method's rounds in the store: ``size`` payloads computed at the current weights make one update.

    ``kind``: ``"rennala"`` (Rennala SGD: a worker may give several, averaged in arrival order; a gradient computed at
    an older iterate is ignored, its minibatch used, unless ``stops``) or ``"msync"`` (m-Synchronous SGD: one per
    worker, averaged in worker order; the other computations are stopped at the round's end)."""

    kind: str
    size: int
    stops: bool


@dataclasses.dataclass(frozen=True)
class Discipline:
    """What a plan asks of the trainer's store and workers.

    Attributes:
      kind: one of :data:`KINDS`.
      threshold: a push computed this many updates ago or more is ignored, its worker pulled (Ringmaster's R).
      stop_stale: a worker's computation in progress that becomes this stale is stopped and restarted at the current
        weights on the same minibatches (Ringmaster's R with stops; 1 for the rounds that stop at a round's end).
      gather: the rounds of a round method (:class:`Gather`), or ``None``.
    """

    kind: str = "async"
    threshold: int | None = None
    stop_stale: int | None = None
    gather: Gather | None = None

    @classmethod
    def of(cls, plan: Plan) -> Discipline:
        """The discipline of ``plan`` (its mode and delay model)."""
        d = plan.delays
        if isinstance(d, delays.Ringmaster):
            return cls("ringmaster", threshold=d.threshold, stop_stale=d.threshold if d.stops else None)
        if isinstance(d, delays.Rennala):
            return cls("rennala", stop_stale=1 if d.stops else None, gather=Gather("rennala", d.batch, d.stops))
        if isinstance(d, delays.MSync):
            return cls("msync", stop_stale=1, gather=Gather("msync", d.m, True))
        return cls("ssgd" if plan.mode == "sync" else "async")

    @property
    def rounds(self) -> bool:
        """Whether updates are rounds of every worker's (SSGD) or a gathered round's payloads: every worker computes
        at the round's weights, worker 0's backup (the rounds are its pushes)."""
        return self.kind == "ssgd" or self.gather is not None

    def header(self) -> dict[str, Any]:
        """What a checkpoint of this discipline pins (a resume under another is refused); plain asynchronous and SSGD
        runs pin nothing here (their mode is pinned with the plan), so older checkpoints still resume."""
        if self.kind == "ringmaster":
            return {"ringmaster": [self.threshold, self.stop_stale is not None]}
        if self.gather is not None:
            return {"rounds": list(self.gather)}
        return {}
