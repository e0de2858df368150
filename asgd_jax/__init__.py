"""asgd_jax: asynchronous SGD in JAX.

Update rules (DC-ASGD and neighbours) as optax transforms, one pure parameter-server step, a deterministic staleness
simulator that runs many asynchronous runs as one compiled program, datasets and the papers' models by name, and a
multi-device trainer whose parameter store runs the same server step and records a trace the simulator replays.

Example:
  >>> import asgd_jax
  >>> rule = asgd_jax.dc_asgd(learning_rate=0.1, lam=2.0, adaptive=True)
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and readers; at run time they are imported when first used
    from asgd_jax import (
        cache,
        checkpoint,
        data,
        delays,
        errors,
        loss,
        metrics,
        models,
        plan,
        preprocess,
        recipes,
        rules,
        schedules,
        simulator,
        trainer,
    )
    from asgd_jax.comparison import Comparison, compare
    from asgd_jax.errors import ConfigError
    from asgd_jax.loss import Loss
    from asgd_jax.models import classification_eval, classification_loss
    from asgd_jax.plan import Plan
    from asgd_jax.rules import (
        ScaleByDelayCompensationState,
        asgd,
        dc_asgd,
        delay_adaptive_sgd,
        drop_stale,
        scale_by_delay_adaptive,
        scale_by_delay_compensation,
        scale_by_staleness,
        staleness_aware_sgd,
    )
    from asgd_jax.simulator import SimState, SimulationResult, grid, simulate, sweep
    from asgd_jax.trainer import TrainConfig, train

# Names are imported when first used (PEP 562), so that `import asgd_jax.cli` does not import JAX: the command line
# sets up its Ctrl-C handling before JAX starts, whose garbage-collection callback would otherwise swallow an early
# Ctrl-C (asgd_jax.interrupts). `asgd_jax.simulate` and `from asgd_jax import simulate` work as before.
_NAMES = {
    "ConfigError": "errors",
    "Loss": "loss",
    "classification_eval": "models",
    "classification_loss": "models",
    "Plan": "plan",
    # The most used rules, kept as aliases: every rule factory lives under asgd_jax.rules (the one face).
    "ScaleByDelayCompensationState": "rules",
    "asgd": "rules",
    "dc_asgd": "rules",
    "delay_adaptive_sgd": "rules",
    "drop_stale": "rules",
    "scale_by_delay_adaptive": "rules",
    "scale_by_delay_compensation": "rules",
    "scale_by_staleness": "rules",
    "staleness_aware_sgd": "rules",
    "SimState": "simulator",
    "SimulationResult": "simulator",
    "grid": "simulator",
    "simulate": "simulator",
    "sweep": "simulator",
    "compare": "comparison",
    "Comparison": "comparison",
    "TrainConfig": "trainer",
    "train": "trainer",
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f"asgd_jax.{_NAMES[name]}"), name)
    elif name in _modules() or (not name.startswith("_") and importlib.util.find_spec(f"asgd_jax.{name}")):
        value = importlib.import_module(f"asgd_jax.{name}")  # any of the package's modules, as an attribute
    else:
        raise AttributeError(f"module 'asgd_jax' has no attribute {name!r}")
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES) | _modules())


def _modules() -> set[str]:
    """The public modules of ``__all__``. The engines' own (``server``, ``exchange``, ``packing``, ``order``, the
    trainer's parts, ...) are not part of the package's face: import them by their full name
    (``from asgd_jax import server``), as any package's submodules."""
    return {n for n in __all__ if n not in _NAMES}


__version__ = "0.1.0"

# What users call: the rules, the simulator, the trainer, data and models, the studies' building blocks. The engines'
# own modules (server, exchange, the trainer's wing asgd_jax.trainer.*, ...) stay importable by name.
__all__ = [
    "Comparison",
    "ConfigError",
    "Loss",
    "Plan",
    "ScaleByDelayCompensationState",
    "SimState",
    "SimulationResult",
    "TrainConfig",
    "asgd",
    "cache",
    "checkpoint",
    "classification_eval",
    "classification_loss",
    "compare",
    "data",
    "dc_asgd",
    "delay_adaptive_sgd",
    "delays",
    "drop_stale",
    "errors",
    "grid",
    "loss",
    "metrics",
    "models",
    "plan",
    "preprocess",
    "recipes",
    "rules",
    "scale_by_delay_adaptive",
    "scale_by_delay_compensation",
    "scale_by_staleness",
    "schedules",
    "simulate",
    "simulator",
    "staleness_aware_sgd",
    "sweep",
    "train",
    "trainer",
]
