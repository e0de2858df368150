"""Worker speeds replayed from measurements: seconds per epoch of six workloads on four GPU models (A40, V100, P100,
RTX 6000), from the Zeus traces (You et al., NSDI 2023; Apache-2.0), shipped as package data
(``delays/data/gpu_epoch_times.csv``, its source, commit and licence in its header and ``ZEUS_LICENSE`` beside it).

:func:`gpu_cluster` makes a :class:`~asgd_jax.delays.Workers` law whose workers are GPUs of the given models: each
worker's time per minibatch is its GPU's measured time, relative to the fastest GPU of the cluster (times
``mean_compute_time``, 1 by default), so a mixed cluster of a P100 and a V100 runs at the ratio measured on them.
"""

from __future__ import annotations

import csv
import functools
import importlib.resources
from collections.abc import Sequence
from typing import Any

import numpy as np

from asgd_jax import errors
from asgd_jax.delays.workers import Workers

__all__ = ["GPUS", "epoch_times", "gpu_cluster", "workloads"]

GPUS = ("a40", "v100", "p100", "rtx6000")
"""The GPU models of the table."""


@functools.cache
def epoch_times() -> dict[tuple[str, int], dict[str, float]]:
    """The table: ``{(workload, batch_size): {gpu: seconds per epoch}}``.

    Example:
      >>> from asgd_jax.delays import measured
      >>> measured.epoch_times()[("imagenet/resnet50", 64)]["v100"]
      3754.323
    """
    text = importlib.resources.files("asgd_jax.delays").joinpath("data/gpu_epoch_times.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return {(r["workload"], int(r["batch_size"])): {g: float(r[g]) for g in GPUS} for r in rows}


def workloads() -> dict[str, list[int]]:
    """Every workload of the table and its batch sizes.

    Example:
      >>> from asgd_jax.delays import measured
      >>> measured.workloads()["imagenet/resnet50"]
      [8, 16, 32, 64, 128]
    """
    out: dict[str, list[int]] = {}
    for workload, batch in epoch_times():
        out.setdefault(workload, []).append(batch)
    return {k: sorted(v) for k, v in out.items()}


def gpu_cluster(
    gpus: Sequence[str], workload: str = "imagenet/resnet50", batch_size: int = 64, **kwargs: Any
) -> Workers:
    """A :class:`Workers` law of one worker per entry of ``gpus``, each taking its GPU model's measured time on
    ``workload`` at ``batch_size``, relative to the fastest of them (``kwargs`` go to :meth:`Workers.with_times`:
    ``mean_compute_time=``, ``noise=``, ``links=``, ...).

    Example:
      >>> from asgd_jax.delays import measured
      >>> law = measured.gpu_cluster(["v100", "p100", "a40"], workload="imagenet/resnet50", batch_size=64)
      >>> [round(float(t), 3) for t in law.times]   # P100 and A40 against the V100
      [1.0, 1.727, 1.053]
    """
    table = workloads()
    errors.choice("workload", workload, tuple(table))
    errors.require(batch_size in table[workload], "batch_size", batch_size, f"use one of {table[workload]}")
    errors.require(
        not isinstance(gpus, str) and len(gpus) > 0 and all(g in GPUS for g in gpus),
        "gpus",
        gpus,
        f"give a list of GPU models, each one of {', '.join(GPUS)}",
    )
    row = epoch_times()[(workload, batch_size)]
    seconds = np.array([row[g] for g in gpus], np.float64)
    return Workers.with_times(seconds / seconds.min(), **kwargs)
