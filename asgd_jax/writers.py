"""Where metrics go besides ``metrics.jsonl`` and ``results.json``: TensorBoard event files, and your own callback.

:class:`TensorBoard` writes every numeric field of a record as a scalar, tagged ``<kind>/<field>`` (``train/loss``,
``eval/error``, ...) at the record's update. It uses tensorboardX, which writes TensorBoard's event files without
TensorFlow (clu's metric writers need TensorFlow for theirs) and is an optional extra: ``pip install
'asgd_jax[tensorboard]'``. Nothing else in asgd_jax needs it.

The trainer hands every record of ``metrics.jsonl`` to each of its sinks (``TrainConfig(tensorboard=True)`` /
``--tensorboard``, and ``train(on_metrics=fn)``); a study hands each finished arm to ``studies.run(on_arm=fn)`` and
``studies.save(..., tensorboard=True)`` writes every curve. A sink that raises stops a training run as a full disk
does (its last checkpoint kept), with the sink's error.

Example:
  >>> import tempfile
  >>> from asgd_jax import writers
  >>> board = writers.TensorBoard(tempfile.mkdtemp())  # doctest: +SKIP
  >>> board({"kind": "train", "update": 10, "loss": 0.5})  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import uuid
from typing import Any

from asgd_jax import errors

__all__ = ["TensorBoard", "folder_name", "scalars"]

FOLDER = "tensorboard"


def folder_name(series: str) -> str:
    """A series' name as a folder name (TensorBoard draws one line per folder)."""
    return "".join(c if c.isalnum() or c in "-_.=," else "_" for c in series)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record, by TensorBoard tag (``<kind>/<field>``; lists and nested tables left out)."""
    kind = record.get("kind", "train")
    return {
        f"{kind}/{k}": float(v)
        for k, v in record.items()
        if k not in ("kind", "update") and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoard:
    """A callable sink: ``board(record)`` writes the record's scalars at its ``update`` into ``folder``'s event file.

    Raises:
      MissingDependency: tensorboardX is not installed (the message gives the install command).
    """

    def __init__(self, folder: str | os.PathLike):
        self.check()
        self.folder = os.fspath(folder)
        self._purge_step: int | None = None
        self._writer: Any = None  # a SummaryWriter, made at the first record (tensorboardX makes its file then)

    @staticmethod
    def check() -> None:
        """Raises :class:`~asgd_jax.errors.MissingDependency` (with the install command) without tensorboardX."""
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise errors.MissingDependency(
                "TensorBoard event files need tensorboardX: pip install 'asgd_jax[tensorboard]' (or tensorboardX)."
            ) from None

    def resume(self, after: int) -> None:
        """The run goes on after update ``after`` (a resume's checkpoint): TensorBoard hides the events of later
        updates written before (work a kill lost; tensorboardX's ``purge_step``). Call it before any record."""
        self._purge_step = int(after) + 1

    def __call__(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # A file of its own: tensorboardX names it by the second, and a writer of the same second (a resume at
            # once) would otherwise truncate the earlier session's file.
            self._writer = SummaryWriter(
                logdir=self.folder, flush_secs=5, purge_step=self._purge_step, filename_suffix=f".{uuid.uuid4().hex}"
            )
        step = int(record.get("update", 0))
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
