"""``trace.jsonl``, the record of a trainer run's applied pushes: its one owner (written, cut back, read).

One JSON object a line, one line per applied push, in the order the store applied them (:class:`Record`). The store
writes it through a :class:`Writer` (a resumed run first cuts it back to its checkpoint's update, dropping a
half-written last line); :func:`read` reads it back, which :meth:`asgd_jax.delays.Trace.load` turns into the delay
model that replays the run in the simulator.

Example:
  >>> import os, tempfile
  >>> from asgd_jax import trace
  >>> path = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
  >>> writer = trace.Writer(path, keep=0)
  >>> writer.write(trace.Record(worker=1, workers=2, pulled_version=0, applied_version=1, staleness=0, time=0.5))
  >>> writer.close()
  >>> trace.read(path).workers.tolist(), trace.read(path).num
  ([1], 2)
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from asgd_jax import errors

__all__ = ["FILE", "Read", "Record", "Writer", "read", "whole_records"]

FILE = "trace.jsonl"


class Record(NamedTuple):
    """One applied push, as the server saw it."""

    worker: int
    workers: int  # M, so that a reader knows it even if the last worker never pushed
    pulled_version: int
    applied_version: int
    staleness: int
    time: float  # seconds since the store started

    def line(self) -> str:
        return json.dumps(self._asdict()) + "\n"


class Writer:
    """Appends :class:`Record` s to a trace, after its first ``keep`` whole records (``keep=0``: a fresh file).

    Raises:
      ConfigError: on a resume (``keep > 0``), when the trace is missing or holds fewer whole records than the
        checkpoint's updates: the run could no longer be replayed.
    """

    def __init__(self, path: str | os.PathLike, keep: int):
        self.path = os.fspath(path)
        lines = whole_records(self.path, keep)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())

    def write(self, record: Record) -> None:
        """Appends one record and flushes it (an ``OSError`` of a full disk is the caller's to stop on)."""
        self._file.write(record.line())
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def whole_records(path: str | os.PathLike, keep: int) -> list[str]:
    """The first ``keep`` whole lines of a trace (a half-written last line is not whole); none for ``keep=0``.

    Raises:
      ConfigError: the trace is missing or holds fewer whole records than ``keep`` (the checkpoint's updates): the run
        could no longer be replayed past them.
    """
    if not keep:
        return []
    path = os.fspath(path)
    way_out = (
        f"the run can no longer be replayed past that. Restore {os.path.basename(path)} from a copy, or start a new "
        "run in another folder (--out)"
    )
    if not os.path.exists(path):
        raise errors.ConfigError(f"{path} is missing but the checkpoint is at update {keep}: {way_out}.")
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw[: raw.rfind(b"\n") + 1].decode("utf-8", errors="replace").splitlines(keepends=True)[:keep]
    if len(lines) < keep:
        raise errors.ConfigError(
            f"{path} holds {len(lines)} whole records but the checkpoint is at update {keep}: {way_out}."
        )
    return lines


class Read(NamedTuple):
    """A trace read back: every applied push's worker and time, and the worker count it records."""

    workers: np.ndarray  # int32 [updates]
    times: np.ndarray  # float32 [updates]
    num: int | None  # M as recorded (None for a trace that does not say)


def read(path: str | os.PathLike) -> Read:
    """Reads a trace; a half-written last line (a killed run) is left out.

    Raises:
      ConfigError: the file cannot be read, holds no record, or a line is not a record.
    """
    workers, times, counts = [], [], set()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise errors.ConfigError(f"{path} is not a readable trace ({type(e).__name__}): give a trace.jsonl.") from None
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            workers.append(int(record["worker"]))
            times.append(float(record.get("time", n)))
            counts.add(record.get("workers"))
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines):  # the last line, cut mid-write
                break
            raise errors.ConfigError(f"{path}:{n}: not a trace record with a 'worker' field ({e}).") from None
    if not workers:
        raise errors.ConfigError(f"{path} holds no trace records.")
    recorded = {c for c in counts if c is not None}
    num = int(recorded.pop()) if len(recorded) == 1 else None
    return Read(np.asarray(workers, np.int32), np.asarray(times, np.float32), num)
