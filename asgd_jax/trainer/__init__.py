"""The trainer: real asynchronous training, workers on devices against a parameter store (GPU A-SGD's system).

One wing, one module per part (ARCHITECTURE.md draws how they meet):

* :mod:`~asgd_jax.trainer.training`: :func:`train` (validation, the one resume decision, the warm start, the choice of
  backend) and :func:`replay_plan`.
* :mod:`~asgd_jax.trainer.config`: :class:`TrainConfig`, a run's settings; :mod:`~asgd_jax.trainer.discipline`: how a
  plan exchanges (async, SSGD rounds, Ringmaster's threshold and stops, gathered rounds), one value derived once.
* :mod:`~asgd_jax.trainer.messages`: what the parts tell each other, typed.
* The store: :mod:`~asgd_jax.trainer.store` (:class:`~asgd_jax.trainer.store.ParameterStore`), its server state and
  programs (:mod:`~asgd_jax.trainer.state`), applier (:mod:`~asgd_jax.trainer.applier`), books and trace
  (:mod:`~asgd_jax.trainer.ledger`), rounds (:mod:`~asgd_jax.trainer.rounds`), checkpoints and resume checks
  (:mod:`~asgd_jax.trainer.persistence`); :mod:`~asgd_jax.trainer.endpoint`, what workers and a driver talk to.
* :mod:`~asgd_jax.trainer.worker` (the one worker loop) and its :mod:`~asgd_jax.trainer.loader`;
  :mod:`~asgd_jax.trainer.driver` (the one monitor loop); :mod:`~asgd_jax.trainer.session` (the run folder, metrics,
  evaluation, the result); the backends :mod:`~asgd_jax.trainer.threads` and :mod:`~asgd_jax.trainer.ray_backend`.

Every program of a run is kept in the process for its structure (the rule's recipe, the loss, the shapes, M), the
numbers (learning rates, lambda) its arguments: a second :func:`train` at other numbers compiles nothing;
:func:`clear_cache` forgets them.
"""

from asgd_jax import cache as _cache
from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.messages import WorkerStats
from asgd_jax.trainer.session import TrainResult
from asgd_jax.trainer.training import ARGS, PLAN, replay_plan, train

__all__ = ["ARGS", "PLAN", "TrainConfig", "TrainResult", "WorkerStats", "clear_cache", "replay_plan", "train"]


def clear_cache() -> None:
    """Forgets the trainer's programs kept in this process (its next run of each structure compiles again; a run in
    progress keeps the programs it holds, but may compile its computed pushes' program again)."""
    _cache.clear()
