"""Reproduction studies: each a small declarative config, one runner, one report.

A :class:`Study` says what it reproduces and lists :class:`Arm` s; an arm is one compiled program (one
:func:`asgd_jax.sweep`): a :class:`asgd_jax.Plan` (delay model and exchange pattern) shared by its :class:`Variant` s x
seeds. Every run gets the same budget of effective epochs, the same learning-rate schedule and the same initial weights
(or the same warm-started ones). :func:`run` writes ``results.json``, ``results.csv``, ``table.md`` and PNG plots into a
folder; :func:`report` turns folders of results into one Markdown report.

The package's modules, each importing only those before it: :mod:`~asgd_jax.studies.language` (what a study is, and
finding studies), :mod:`~asgd_jax.studies.picks` (a tuned study's picks: each cell's best setting and the time budgets,
from its results only), :mod:`~asgd_jax.studies.runner` (running one, locally or on Ray, resumable) and
:mod:`~asgd_jax.studies.present` (tables, plots, files and the report, from a study's results only).

The studies themselves are modules of :mod:`asgd_jax.experiments` (``STUDY = Study(...)``), installed with the
package; :func:`load` finds them by name, or loads a study file of your own by its path.

Example:
  >>> import asgd_jax
  >>> from asgd_jax import studies
  >>> v = studies.Variant("DC-ASGD-a", rule="dc_asgd", hp={"lam": 2.0, "adaptive": 1.0})
  >>> arm = studies.Arm({"M": 8}, asgd_jax.Plan(8), variants=(v,))
  >>> arm.plan.workers, arm.label(v)
  (8, 'DC-ASGD-a')
"""

from __future__ import annotations

from asgd_jax.studies.language import (
    DCASGD_CIFAR10,
    METRICS,
    Arm,
    Paper,
    Problem,
    Settings,
    Study,
    Table,
    Tuning,
    Variant,
    available,
    load,
)
from asgd_jax.studies.picks import best_tuned, time_budgets, within_budgets
from asgd_jax.studies.present import (
    curves_figure,
    format_table,
    plot,
    plot_panels,
    report,
    save,
)
from asgd_jax.studies.runner import (
    BACKENDS,
    MAX_RETRIES,
    StudyResult,
    ablate,
    arm_rule,
    run,
    run_arm,
    run_arm_part,
    schedule,
    seed_groups,
    time_to_target,
    widened_arms,
)

__all__ = [
    "BACKENDS",
    "MAX_RETRIES",
    "METRICS",
    "DCASGD_CIFAR10",
    "Arm",
    "Paper",
    "Problem",
    "Settings",
    "Study",
    "StudyResult",
    "Table",
    "Tuning",
    "Variant",
    "ablate",
    "arm_rule",
    "available",
    "run_arm",
    "run_arm_part",
    "best_tuned",
    "curves_figure",
    "format_table",
    "load",
    "plot",
    "plot_panels",
    "report",
    "run",
    "save",
    "schedule",
    "seed_groups",
    "time_budgets",
    "time_to_target",
    "widened_arms",
    "within_budgets",
]
