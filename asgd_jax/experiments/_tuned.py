"""What the tuned studies share (``staleness_leaderboard``, ``heterogeneous_data``, ``communication_bound``): the
learning-rate grid, each rule's grid as variants, and sequential SGD, the reference run once and shown in every cell.
Outside the study language, as ``_dcasgd`` is."""

from __future__ import annotations

from typing import Any

from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Variant

LR_GRID = (0.125, 0.25, 0.5, 1.0)
"""The learning-rate grid, as multiples of the settings' learning rate (the largest)."""


def mnist1d(quick: bool, workers: tuple[int, ...], **more: Any) -> Settings:
    """The settings of a tuned study on MNIST-1D's MLP: the quick form (5 seeds, 10 epochs) or the full (10 seeds, 30
    epochs), at the learning rate the grid scales (0.4) and ``workers``; ``more`` adds fields (a target error)."""
    form = (
        dict(seeds=(0, 1, 2, 3, 4), epochs=10.0, evals=8, window=100)
        if quick
        else dict(seeds=tuple(range(10)), epochs=30.0, evals=20)
    )
    return Settings(dataset="mnist1d", learning_rate=0.4, workers=workers, **form, **more)


def lrs(s: Settings, scale: float = 1.0) -> list[float]:
    """The grid's learning rates, ``scale`` times the settings' (a rule averaging several gradients takes more)."""
    return [round(scale * f * s.learning_rate, 6) for f in LR_GRID]


def tuned(label: str, rule: str, s: Settings, scale: float = 1.0) -> tuple[Variant, ...]:
    """Rule ``rule`` at every learning rate of the grid, as one series ``label``."""
    return tuple(Variant(label, rule=rule, lr=lr) for lr in lrs(s, scale))


def sequential_reference(s: Settings, **for_every: Any) -> Arm:
    """Sequential SGD (one worker, the grid at twice the rate), run once and shown at every M of the settings and at
    every value of ``for_every``'s other coordinates."""
    return Arm(
        {"M": "—", **dict.fromkeys(for_every, "—")},
        Plan(s.cluster(1)),
        variants=tuned("SGD (1 worker)", "sgd", s, 2.0),
        for_every={"M": s.workers, **for_every},
    )
