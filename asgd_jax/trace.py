"""``trace.jsonl``, the record of a trainer run's applied pushes: its one owner (written, cut back, read).

One JSON object a line, one line per push the store applied, rejected as NaN/Inf or ignored as too stale (Ringmaster),
in its order (:class:`Record`; a rejected push has ``"rejected": true`` and an ignored one ``"ignored": true``: it
changed no weight but used up that worker's minibatches). The store
writes it through a :class:`Writer`, which keeps a running SHA-256 of the lines (:meth:`Writer.digest`); each
checkpoint stores the line count and digest it was taken at, so a resume cuts the trace back to exactly those lines
and refuses a trace that is not the one the checkpoint belongs to (:func:`whole_records`). :func:`read` reads it
back, type-checking every record, which :meth:`asgd_jax.delays.Trace.load` turns into the delay model that replays
the run in the simulator.

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

import hashlib
import json
import math
import os
import time
from typing import Any, NamedTuple

import numpy as np

from asgd_jax import errors

__all__ = ["FILE", "Read", "Record", "Writer", "parse", "read", "whole_records"]

FILE = "trace.jsonl"

FLUSH_EVERY = 0.05
"""Seconds between a :class:`Writer`'s flushes of what it wrote (and at every checkpoint, :meth:`Writer.flush`, and
at close): a flush a line cost a system call per push; what a crash loses between two is past the last checkpoint,
which a resume cuts the trace back to anyway."""


class Record(NamedTuple):
    """One applied push, as the server saw it."""

    worker: int
    workers: int | None  # M, so that a reader knows it even if the last worker never pushed (None: a hand-written
    # trace that never says; the readers take the count from the workers seen)
    pulled_version: int
    applied_version: int
    staleness: int
    time: float  # seconds on the run's clock: since its store started, a resumed session's after the last kept record's
    rejected: bool = False  # a NaN/Inf push: nothing applied, the worker's minibatches used up
    ignored: bool = False  # too stale (Ringmaster, Rennala): nothing applied, the worker goes on at the current weights
    round: tuple[int, ...] | None = None  # a round method's update: its workers, in the order they were averaged
    round_skips: tuple[int, ...] | None = None  # per payload: its worker's minibatch periods ignored just before it

    def line(self) -> str:
        """The record as its JSON line (an applied push's written out by hand: ``json.dumps``'s very text, at a fifth of
        its cost, paid once per push on the store's clock)."""
        if not (self.rejected or self.ignored or self.round or self.round_skips) and math.isfinite(self.time):
            workers = "null" if self.workers is None else int(self.workers)
            return (
                f'{{"worker": {int(self.worker)}, "workers": {workers}, "pulled_version": {int(self.pulled_version)}, '
                f'"applied_version": {int(self.applied_version)}, "staleness": {int(self.staleness)}, '
                f'"time": {float(self.time)!r}}}\n'
            )
        fields = self._asdict()
        for flag in ("rejected", "ignored", "round", "round_skips"):  # an applied push's line reads as it always has
            if not fields[flag]:
                del fields[flag]
        return json.dumps(fields) + "\n"


class Writer:
    """Appends :class:`Record` s to a trace, after its first ``keep`` whole records (``keep=0``: a fresh file).

    Args:
      path: the trace file.
      keep: the records to keep (a resume: the checkpoint's line count).
      sha256: the digest those ``keep`` records must have (the checkpoint's), or ``None`` not to check.

    Raises:
      ConfigError: on a resume (``keep > 0``), when the trace is missing, holds fewer whole records than the
        checkpoint's, or is not the trace the checkpoint belongs to: the run could no longer be replayed.
    """

    def __init__(self, path: str | os.PathLike, keep: int, sha256: str | None = None):
        self.path = os.fspath(path)
        lines = whole_records(self.path, keep, sha256)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)
        self.lines = len(lines)
        # The last kept record's time: a resumed session's clock goes on from it (a trace's times never go back).
        where = f"{self.path}:{len(lines)}"  # (a line without a time reads as its number, as Trace.load gives it)
        self.last_time = parse(lines[-1], where, time=float(len(lines))).time if lines else 0.0
        self._digest = hashlib.sha256("".join(lines).encode())
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())
        self._flushed = time.monotonic()

    def write(self, record: Record) -> None:
        """Appends one record, flushed within :data:`FLUSH_EVERY` seconds (an ``OSError`` of a full disk, here or at a
        flush, is the caller's to stop on)."""
        line = record.line()
        self._file.write(line)
        self._digest.update(line.encode())
        self.lines += 1
        if time.monotonic() - self._flushed >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Writes out every line so far (before a checkpoint pins them)."""
        self._file.flush()
        self._flushed = time.monotonic()

    def digest(self) -> str:
        """The SHA-256 of every line written so far (what a checkpoint pins)."""
        return self._digest.hexdigest()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def whole_records(path: str | os.PathLike, keep: int, sha256: str | None = None) -> list[str]:
    """The first ``keep`` whole lines of a trace (a half-written last line is not whole); none for ``keep=0``.

    Each of them must be a record (:func:`parse`), and, with ``sha256``, their digest the checkpoint's.

    Raises:
      ConfigError: the trace is missing, is not a file, holds fewer whole records than ``keep``, holds a line that is
        not a record, or differs from the trace the checkpoint was taken with: the run could no longer be replayed.
    """
    if not keep:
        return []
    path = os.fspath(path)
    way_out = (
        f"the run can no longer be replayed past that. Restore {os.path.basename(path)} from a copy, or start a new "
        "run in another folder (--out)"
    )
    if not os.path.isfile(path):
        what = "is not a file" if os.path.exists(path) else "is missing"
        raise errors.ConfigError(f"{path} {what} but the checkpoint is at record {keep}: {way_out}.")
    with open(path, "rb") as f:
        raw = f.read()
    text = raw[: raw.rfind(b"\n") + 1].decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)[:keep]
    if len(lines) < keep:
        raise errors.ConfigError(
            f"{path} holds {len(lines)} whole records but the checkpoint is at record {keep}: {way_out}."
        )
    num = None
    for n, line in enumerate(lines, 1):
        num = parse(line, f"{path}:{n}", num).workers
    if sha256 is not None and hashlib.sha256("".join(lines).encode()).hexdigest() != sha256:
        raise errors.ConfigError(
            f"{path}'s first {keep} records are not the ones the checkpoint was taken with (a record was changed, or "
            f"the trace is another run's): {way_out}."
        )
    return lines


def parse(line: str, where: str, workers: int | None = None, time: float = 0.0) -> Record:
    """One line as a :class:`Record`, every field type-checked (``workers``: the count the earlier lines said;
    ``time``: the time of a record that has none).

    Raises:
      ConfigError: naming ``where`` (``path:line``), when the line is not JSON, lacks a field, holds a value of the
        wrong type (a worker id of 1.7, a bool where an int belongs) or a worker id outside ``[0, workers)``, or says
        another worker count than the earlier lines.
    """
    try:
        fields = json.loads(line)
    except ValueError as e:
        raise errors.ConfigError(f"{where}: not a trace record ({e}).") from None
    if not isinstance(fields, dict) or "worker" not in fields:
        raise errors.ConfigError(f"{where}: not a trace record with a 'worker' field.")
    bad = lambda name, allowed: errors.ConfigError(f"{where}: {name}={fields.get(name)!r} is not {allowed}.")
    ints: dict[str, Any] = {}  # (each an int, or None where the record leaves it out)
    for name, lowest in (("worker", 0), ("workers", 1), ("pulled_version", 0), ("applied_version", 0)):
        value: Any = fields.get(name, None if name != "worker" else fields["worker"])
        if value is None and name != "worker":
            ints[name] = None
            continue
        if not errors.is_int(value) or value < lowest:
            raise bad(name, f"an int >= {lowest}")
        ints[name] = int(value)
    staleness = fields.get("staleness", 0)
    if not errors.is_int(staleness):
        raise bad("staleness", "an int")
    time = fields.get("time", time)
    if not _is_number(time):
        raise bad("time", "a finite number")
    flags = {name: fields.get(name, False) for name in ("rejected", "ignored")}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise bad(name, "true or false")
    members = fields.get("round")
    skips: Any = fields.get("round_skips", [0] * len(members) if isinstance(members, list) else None)
    if members is not None:
        top = ints["workers"] or workers
        if not isinstance(members, list) or not members or not all(errors.is_int(w) and w >= 0 for w in members):
            raise bad("round", "a non-empty list of worker ids")
        if top is not None and max(members) >= top:
            raise bad("round", f"a list of worker ids below the run's {top} workers")
        ok = isinstance(skips, list) and len(skips) == len(members) and all(errors.is_int(k) and k >= 0 for k in skips)
        if not ok:
            raise bad("round_skips", "a list of ints >= 0, one per worker of the round")
        members, skips = tuple(int(w) for w in members), tuple(int(k) for k in skips)
    count = ints["workers"]
    if count is not None and workers is not None and count != workers:
        raise errors.ConfigError(f"{where}: workers={count}, but the records before it say {workers}.")
    count = count if count is not None else workers
    if count is not None and ints["worker"] >= count:
        raise errors.ConfigError(f"{where}: worker={ints['worker']} is not below the run's {count} workers.")
    return Record(
        ints["worker"],
        count,
        ints["pulled_version"] or 0,
        ints["applied_version"] or 0,
        int(staleness),
        float(time),
        flags["rejected"],
        flags["ignored"],
        members,
        skips if members is not None else None,
    )


def _is_number(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


class Read(NamedTuple):
    """A trace read back: every applied push's worker and time, the minibatches its worker skipped before it (pushes
    rejected as NaN/Inf or ignored since that worker's previous applied push), the worker count it records, and the
    version every applied push was computed at where a worker did not always compute at the weights its own previous
    push brought back (a Ringmaster run: an ignored push, a stopped computation, restart at the current weights)."""

    workers: np.ndarray  # int32 [updates]
    times: np.ndarray  # float32 [updates]
    num: int | None  # M as recorded (None for a trace that does not say)
    skips: np.ndarray | None = None  # int32 [updates], None when nothing was rejected or ignored
    pulled: np.ndarray | None = None  # int32 [updates], None when each worker computed at its own last answer
    rounds: np.ndarray | None = None  # int32 [updates, K]: a round method's run, each update's workers in order
    round_skips: np.ndarray | None = None  # int32 [updates, K]: the minibatch periods skipped before each payload


def read(path: str | os.PathLike) -> Read:
    """Reads a trace; a half-written last line (a killed run) is left out.

    Raises:
      ConfigError: the file cannot be read, holds no applied record, or a line is not a record (:func:`parse`).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise errors.ConfigError(f"{path} is not a readable trace ({type(e).__name__}): give a trace.jsonl.") from None
    records, num = [], None
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = parse(line, f"{path}:{n}", num, time=float(n))
        except errors.ConfigError:
            if n == len(lines):  # no newline after it: the last line, cut mid-write
                break
            raise
        num = record.workers
        records.append((record, '"pulled_version"' in line))
    if any(r.round is not None for r, _ in records):
        return _read_rounds(path, [r for r, _ in records], num)
    workers, times, skips, pulled = [], [], [], []
    pending: dict[int, int] = {}  # worker -> its rejected (or ignored) pushes since its last applied one
    answered: dict[int, int] = {}  # worker -> the version its last applied push was answered with
    own = True  # every push computed at the weights its own previous applied push brought (a per-worker replay)
    for record, says_pulled in records:
        if record.rejected or record.ignored:  # (an ignored push's worker computes next at the current weights)
            pending[record.worker] = pending.get(record.worker, 0) + 1
            continue
        own = own and says_pulled and record.pulled_version == answered.get(record.worker, 0)
        answered[record.worker] = record.applied_version
        workers.append(record.worker)
        times.append(record.time)
        skips.append(pending.pop(record.worker, 0))
        pulled.append(record.pulled_version)
    if not workers:
        raise errors.ConfigError(f"{path} holds no trace records of applied pushes.")
    skipped = np.asarray(skips, np.int32) if any(skips) else None
    versions = None if own else np.asarray(pulled, np.int32)
    return Read(np.asarray(workers, np.int32), np.asarray(times, np.float32), num, skipped, versions)


def _read_rounds(path, records: list[Record], num: int | None) -> Read:
    """A round method's trace: each applied round's workers and skips (its payloads' minibatch periods used before
    them: the round's own count of ignored gradients, and the payloads of rounds rejected as NaN/Inf since)."""
    rounds: list = []
    skips: list = []
    times: list = []
    used: dict[int, int] = {}
    for record in records:
        if record.round is None:
            if record.ignored:  # counted in the next round's skips by the store
                continue
            raise errors.ConfigError(f"{path} mixes rounds and single pushes: not one run's trace.")
        if record.rejected:  # a NaN/Inf round: its payloads' minibatches used up, skipped before their next ones
            for w, k in zip(record.round, record.round_skips or (), strict=True):
                used[w] = used.get(w, 0) + 1 + k
            continue
        skip = list(record.round_skips or ())
        for j, w in enumerate(record.round):
            if record.round.index(w) == j:  # a worker's first payload of the round takes what it used before
                skip[j] += used.pop(w, 0)
        rounds.append(record.round)
        skips.append(skip)
        times.append(record.time)
    if not rounds or len({len(r) for r in rounds}) != 1:
        raise errors.ConfigError(f"{path} holds no applied rounds, or rounds of different sizes.")
    workers = np.asarray([r[0] for r in rounds], np.int32)
    return Read(
        workers,
        np.asarray(times, np.float32),
        num,
        None,
        None,
        np.asarray(rounds, np.int32),
        np.asarray(skips, np.int32),
    )
