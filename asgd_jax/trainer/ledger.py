"""The store's books: what happened to every push (counts, data positions, staleness) and its line in the trace.

``received == applied + rejected + ignored`` always: the store counts a push as received when it arrives and writes it
down once, in the order it handled it, as applied, rejected (``late`` among them: after the store closed) or ignored. A
checkpoint holds the books (:meth:`Ledger.header`, :meth:`Ledger.arrays`), with each worker's inner-optimizer state
as of its last applied push (``Plan(inner=...)``: kept by reference at the apply, copied to the host for a
checkpoint), and a resume reads them back (:meth:`Ledger.restore`). Not thread-safe: the store calls it under its
lock.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from asgd_jax import trace
from asgd_jax.trainer.messages import StoreStatus, StoreTimes

__all__ = ["Ledger"]


class Ledger:
    """The books of a store of ``num_workers`` workers.

    Args:
      num_workers: M.
      out_dir: where ``trace.jsonl`` goes (``None``: no trace).
      on_write_error: what a failed trace write calls, with the trace's path and the error (the store stops).
    """

    def __init__(
        self, num_workers: int, out_dir: str | os.PathLike | None, on_write_error: Callable[[str, OSError], None]
    ):
        self.num_workers, self._out_dir, self._on_write_error = num_workers, out_dir, on_write_error
        self.received = self.applied = self.rejected = self.ignored = 0
        self.late = 0  # of the rejected: pushes that arrived after the store closed (the budget was reached)
        self.positions = np.zeros(num_workers, np.int64)  # per worker: minibatch periods its pushes used up
        self.staleness_counts: collections.Counter[int] = collections.Counter()
        self.resumed_from = 0
        self.streak = 0  # consecutive non-finite pushes
        self.trace: trace.Writer | None = None
        # Per worker: the leaves of its inner optimizer's state after its last applied push (on its devices).
        self.inner: dict[int, list] = {}
        self._t0 = time.perf_counter()

    def open_trace(self, keep: int, sha256: str | None) -> None:
        """Starts ``trace.jsonl`` after its first ``keep`` records (a resume's; their digest checked)."""
        if self._out_dir is not None:
            os.makedirs(self._out_dir, exist_ok=True)
            self.trace = trace.Writer(os.path.join(self._out_dir, trace.FILE), keep, sha256)
            self._t0 -= self.trace.last_time  # a resume's records go on from the run's clock, never back

    def applied_push(self, worker: int, pulled_version: int, staleness: int, round_info: tuple | None) -> None:
        """An applied push (or a round's mean, ``round_info``: its workers and skips)."""
        self.streak = 0
        self.applied += 1
        self._use_minibatches(worker, round_info)
        self.staleness_counts[staleness] += 1
        self._write(worker, pulled_version, staleness, round_info=round_info)  # what the server step saw

    def keep_inner(self, states: Mapping[int, Any] | None) -> None:
        """The inner-optimizer states of an applied push's workers (a round's: each of its workers'), by reference,
        for the checkpoints (``None``: a run without them)."""
        if states:
            self.inner.update({int(w): jax.tree.leaves(s) for w, s in states.items()})

    def rejected_push(self, worker: int, pulled_version: int, round_info: tuple | None = None) -> int:
        """A NaN/Inf push (its minibatches are used up, which the trace records so that a replay skips them too);
        the streak of them so far."""
        self.rejected += 1
        self._use_minibatches(worker, round_info)
        self.streak += 1
        self._write(worker, pulled_version, self.applied - pulled_version, rejected=True, round_info=round_info)
        return self.streak

    def ignored_push(self, worker: int, pulled_version: int, uses_minibatch: bool) -> None:
        """A push ignored as too stale: nothing applied (Ringmaster's moves its worker's position at once; Rennala's
        becomes a skip of that worker's next payload of a round, ``uses_minibatch=False`` here)."""
        self.ignored += 1
        if uses_minibatch:
            self.positions[worker] += 1
        self._write(worker, pulled_version, self.applied - pulled_version, ignored=True)

    def late_push(self) -> None:
        """A push that came after the store closed: rejected, counted as late."""
        self.rejected += 1
        self.late += 1

    def _use_minibatches(self, worker: int, round_info: tuple | None) -> None:
        """The data positions a push moves: its worker's, or every payload's of a gathered round (skips included)."""
        if round_info is None:
            self.positions[worker] += 1
            return
        for w, k in zip(*round_info, strict=True):
            self.positions[w] += 1 + k

    def _write(
        self,
        worker: int,
        pulled_version: int,
        staleness: int,
        rejected: bool = False,
        ignored: bool = False,
        round_info: tuple | None = None,
    ) -> None:
        """Appends one record to the trace (in the order pushes are handled)."""
        if self.trace is None:
            return
        record = trace.Record(
            worker=int(worker),
            workers=self.num_workers,
            pulled_version=int(pulled_version),
            applied_version=self.applied,
            staleness=int(staleness),
            time=time.perf_counter() - self._t0,
            rejected=rejected,
            ignored=ignored,
            round=None if round_info is None else tuple(int(w) for w in round_info[0]),
            round_skips=None if round_info is None else tuple(int(k) for k in round_info[1]),
        )
        try:
            self.trace.write(record)
        except OSError as e:
            self._on_write_error(self.trace.path, e)

    def status(self, closed: bool, error: str | None, times: StoreTimes) -> StoreStatus:
        """The counts, as a typed status."""
        return StoreStatus(
            applied=self.applied,
            rejected=self.rejected,
            late=self.late,
            received=self.received,
            closed=closed,
            error=error,
            resumed_from=self.resumed_from,
            positions=tuple(int(d) for d in self.positions),
            staleness_counts=dict(self.staleness_counts),
            ignored=self.ignored,
            times=times,
        )

    def header(self) -> dict[str, Any]:
        """The counts as a checkpoint's header keys, and the trace they belong to (a resume keeps exactly its lines
        and refuses any other trace); an ``OSError`` when those lines cannot be written out (the store stops)."""
        counts = {"applied": self.applied, "rejected": self.rejected, "received": self.received, "late": self.late}
        if self.trace is not None:  # the lines it pins are on disk first, or there is no checkpoint of them
            try:
                self.trace.flush()
            except OSError as e:
                self._on_write_error(self.trace.path, e)
                raise
        pinned = {} if self.trace is None else {"trace_lines": self.trace.lines, "trace_sha256": self.trace.digest()}
        staleness = {str(k): v for k, v in self.staleness_counts.items()}
        return {**counts, "ignored": self.ignored, **pinned, "staleness_counts": staleness}

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a checkpoint holds: each worker's data position and inner-optimizer state (host copies)."""
        inner = jax.device_get(self.inner)  # (explicit: the states lie on the workers' devices)
        leaves = {f"inner_{w}_{i}": np.array(x, copy=True) for w, xs in inner.items() for i, x in enumerate(xs)}
        return {"positions": self.positions.copy(), **leaves}

    def restore(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """The books of a checkpoint (its header and arrays)."""
        self.applied, self.rejected, self.late = header["applied"], header["rejected"], header.get("late", 0)
        self.ignored = header.get("ignored", 0)
        # Pushes in flight at the checkpoint are lost and sent again.
        self.received = self.applied + self.rejected + self.ignored
        # Checkpoints written before 2026-12 call the positions "done"; they still load.
        self.positions = np.asarray(arrays["positions" if "positions" in arrays else "done"], np.int64).copy()
        self.staleness_counts.update({int(k): v for k, v in header["staleness_counts"].items()})
        self.resumed_from = self.applied
        found = sorted((tuple(map(int, k.split("_")[1:])), v) for k, v in arrays.items() if k.startswith("inner_"))
        self.inner = {}
        for (w, _), x in found:
            self.inner.setdefault(w, []).append(np.asarray(x))
