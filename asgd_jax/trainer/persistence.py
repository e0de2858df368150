"""A store's checkpoints and the checks of a resume: what is written, when, and what a resume refuses.

A checkpoint (``checkpoint.npz``: the whole server state, each worker's data position, the run's header and the
store's books with the trace lines they belong to) is written atomically (temporary file, fsync, rename: a process
killed mid-write leaves the previous one loadable) every ``checkpoint_every`` updates by a
:class:`asgd_jax.checkpoint.Writer` that never stalls the applier, and once more when the store closes. A resume is
refused, before anything starts (:func:`check_resume`), when the checkpoint is another run's (its header differs) or
the trace no longer reaches it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from asgd_jax import checkpoint, errors, trace
from asgd_jax.trainer.session import CHECKPOINT

__all__ = ["ADDED_LATER", "Checkpoints", "check_header", "check_resume", "trace_pin"]

ADDED_LATER = frozenset({"recipe", "loss", "warm_start_steps", "partition", "rule_probe"})
"""Header keys that older checkpoints do not hold (``partition``: before data partitions; ``rule_probe``: before
2026-12-05, whose checkpoints hold the rule's probe as ``rule``, computed an operation at a time, which
:func:`check_resume` computes again for them; the others: before 2026-12-03): a resume of such a checkpoint does not
check them (everything it does hold is checked)."""


def trace_pin(header: dict[str, Any]) -> tuple[int, str | None]:
    """The trace lines a checkpoint belongs to and their SHA-256, from its header. Checkpoints written before the
    trace was pinned hold neither: their trace is cut at the applied count, unchecked."""
    return int(header.get("trace_lines", header.get("applied", 0))), header.get("trace_sha256")


def check_header(path: str, saved: dict[str, Any], header: dict[str, Any]) -> None:
    """Refuses a checkpoint whose header (``saved``) differs from this run's in any key of ``header``."""
    checked = {k: v for k, v in header.items() if k in saved or k not in ADDED_LATER}
    mismatched = {k: (saved.get(k), v) for k, v in checked.items() if saved.get(k) != v}
    if mismatched:
        details = ", ".join(
            "{}: checkpoint {} vs now {}".format(k, *errors.differing(*v)) for k, v in mismatched.items()
        )
        raise errors.ConfigError(
            f"Cannot resume from {path}: it was written by a different run ({details}). "
            "Use the same settings, or another output folder."
        )


def check_resume(
    out_dir: str | os.PathLike, header: dict[str, Any], older: dict[str, Callable[[], Any]] | None = None
) -> None:
    """What a store resuming in ``out_dir`` would refuse, checked where the run starts (before any store or worker is
    made, on any backend): a checkpoint of another run (its header differs from ``header``, which holds the worker
    count), or a trace that no longer reaches the checkpoint. Raises a ``ConfigError`` saying which.

    ``older``: keys that older checkpoints hold in place of today's, each with how to compute it now; one the
    checkpoint holds is computed and added to ``header`` (so the store's own check, and the checkpoints it writes,
    hold it too)."""
    path = os.path.join(os.fspath(out_dir), CHECKPOINT)
    saved = checkpoint.read_header(path)
    for key, now in (older or {}).items():
        if key in saved and key not in header:
            header[key] = now()
    check_header(path, saved, header)
    trace.whole_records(os.path.join(os.fspath(out_dir), trace.FILE), *trace_pin(saved))


class Checkpoints:
    """A store's checkpoints in ``folder`` (``None``: none), every ``every`` updates (``None``: only at the end).

    ``on_error`` is called with a failed background write's error (the store stops; the checkpoint on disk stays the
    last good one)."""

    def __init__(self, folder: str | os.PathLike | None, every: int | None, on_error: Callable[[BaseException], None]):
        self.path = None if folder is None else os.path.join(os.fspath(folder), CHECKPOINT)
        self.every = every
        self._writer = None if self.path is None else checkpoint.Writer(self.path, on_error)

    def exists(self) -> bool:
        """Whether a checkpoint is on disk."""
        return self.path is not None and os.path.exists(self.path)

    def due(self, applied: int) -> bool:
        """Whether update ``applied`` is checkpointed (on the writer's thread)."""
        return self._writer is not None and self.every is not None and applied % self.every == 0

    def submit(self, contents: tuple) -> None:
        """Hands a checkpoint's contents (host copies) to the writer's thread; a newer one supersedes a pending one
        (only where :meth:`due`: there is a writer)."""
        assert self._writer is not None
        self._writer.submit(*contents)

    def save(self, contents: tuple) -> str:
        """Writes a checkpoint now (atomically); returns its path."""
        if self.path is None:
            raise errors.ConfigError("this store has no checkpoint_dir: pass checkpoint_dir= to ParameterStore.")
        checkpoint.save(self.path, *contents)
        return self.path

    def close(self) -> bool:
        """Waits for the pending write; returns whether there is a writer (a final checkpoint is due)."""
        if self._writer is None:
            return False
        self._writer.close()
        self._writer = None
        return True

    def kept(self) -> str:
        """What is on disk, for a message about weights that went wrong (once a write under way is done)."""
        if self._written():
            return "the last checkpoint holds the last finite weights"
        return "no checkpoint had been written yet"

    def way_on(self) -> str:
        """How a stopped run goes on: from its checkpoint, or from the start when none was written yet (once a write
        under way is done: the message says what the folder will hold)."""
        return "resume (--resume)" if self._written() else "start again: no checkpoint had been written yet"

    def _written(self) -> bool:
        if self._writer is not None:
            self._writer.flush()
        return self.exists()
