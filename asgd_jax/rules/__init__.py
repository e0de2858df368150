"""Update rules for asynchronous SGD as optax transforms, one module per paper or method.

Every rule here is an :class:`optax.GradientTransformationExtraArgs`. The parameter server calls

    ``updates, state = rule.update(grads, state, params, stale_params=..., staleness=..., worker=...)``

where ``params`` are the server's current weights w_t, ``stale_params`` the weights the gradient was computed at
(DC-ASGD's backup w_bak(m)), ``staleness`` an int32 scalar (server updates since that pull) and ``worker`` the int32 id
of the pushing worker. A rule takes what it needs as keyword-only arguments, so forgetting one raises a ``TypeError``
that names it, and swallows the rest in ``**extra_args``. Rules compose with :func:`optax.chain` and stay valid inside
``jit``, ``vmap``, ``lax.scan`` and :func:`optax.inject_hyperparams` (numeric hyperparameters may arrive traced, so no
Python branching on them; ``num_workers`` of :func:`scale_by_delay_compensation` sets a state shape and must be passed
in ``static_args`` there).

Naming follows optax: ``scale_by_<x>`` only rescales the incoming gradient; ``<x>(learning_rate, ...)`` chains it with
:func:`optax.sgd`, so the learning rate (a float or an optax schedule counting server updates), momentum and Nesterov
come from optax itself.

One face: every rule factory lives under ``asgd_jax.rules``; the top-level ``asgd_jax.dc_asgd`` etc. are kept aliases
of the most used. Import from here (``asgd_jax.rules.gap_aware``), not from the modules below, which are the layout:

- ``delay_compensation``: DC-ASGD (Zheng et al., ICML 2017): ``scale_by_delay_compensation``, ``dc_asgd``.
- ``async_sgd``: plain asynchronous SGD, ``asgd``.
- ``staleness_aware``: Zhang et al. (IJCAI 2016): ``scale_by_staleness``, ``staleness_aware_sgd``.
- ``delay_adaptive``: Mishchenko et al. (NeurIPS 2022): ``scale_by_delay_adaptive``, ``delay_adaptive_sgd``.
- ``delay_threshold``: Koloskova et al. (NeurIPS 2022, Theorem 8): ``delay_threshold_sgd``.
- ``drop_stale_gradient``: TensorFlow's DropStaleGradientOptimizer: ``drop_stale``.
- ``gap_aware_mitigation``: Gap-Aware (Barkai et al., ICLR 2020): ``gap_aware``.
- ``async_local_sgd``: Delayed Nesterov (Liu et al. 2024): ``delayed_nesterov``.
- ``diloco``: DiLoCo's outer Nesterov step (Douillard et al. 2023), synchronous or on every arrival: ``diloco``.
- ``taming_momentum``: DANA (Hakimi et al. 2019), a :class:`PullRule`: ``dana``.
- ``incremental_aggregation``: IA²SGD (Wang et al. 2024, for heterogeneous data): ``scale_by_incremental_aggregation``,
  ``ia2sgd``.
- ``malenia``: Malenia SGD (Tyurin & Richtárik, NeurIPS 2023, for heterogeneous data; on ``delays.Malenia``):
  ``scale_by_malenia``, ``malenia_sgd``.
- ``ringleader``: Ringleader ASGD (Maranjyan & Richtárik, ICLR 2026): ``scale_by_ringleader``, ``ringleader_asgd``.
- ``fadas``: FADAS (Wang et al., ICML 2024; asynchronous AMSGrad over a buffer of deltas): ``fadas``.
- ``cgad``: CGAD (Shah & Sun 2026; Adam on age-scaled deltas): ``scale_by_age``, ``cgad``.
- ``combinators``: rules of rules: ``weight_decayed``, ``one_of``, and ``chained_before`` (a transform before a rule,
  its pull kept).
- ``compressors``: compressors of the pushed payload, chained before a rule with ``compressed``: ``rand_k``,
  ``top_k`` (with per-worker error feedback), ``qsgd``.
- ``registry``: the rules by name: ``RULES``, ``names``, ``defaults``, ``required``, ``get``, ``register``,
  ``fingerprint``.
- ``common``: what the rules share: the hyperparameter checks, the SGD step, :class:`PullRule`.

To add a rule: write one file, ``asgd_jax/rules/<method>.py``, whose docstring names the paper (authors, title, year,
venue) and what it defines; its factory is a :func:`asgd_jax.recipes.recipe` checking its numbers with ``common``'s
checks (a number may arrive traced). Re-export it here (import and ``__all__``); register it by name in
``registry.py``'s ``RULES``, where ``tests/test_rules_registry.py`` runs every registered rule through the properties
all rules share; and add one test family against the paper's definition (as ``tests/test_rules.py`` and
``tests/test_mitigation.py`` do).
"""

from asgd_jax.rules.async_local_sgd import DelayedNesterovState, delayed_nesterov
from asgd_jax.rules.async_sgd import asgd
from asgd_jax.rules.cgad import cgad, scale_by_age
from asgd_jax.rules.combinators import chained_before, one_of, weight_decayed
from asgd_jax.rules.common import PullRule
from asgd_jax.rules.common import ScalarOrSchedule as ScalarOrSchedule  # importable here as before the split
from asgd_jax.rules.compressors import CompressorState, compressed, qsgd, rand_k, top_k
from asgd_jax.rules.delay_adaptive import delay_adaptive_sgd, scale_by_delay_adaptive
from asgd_jax.rules.delay_compensation import ScaleByDelayCompensationState, dc_asgd, scale_by_delay_compensation
from asgd_jax.rules.delay_threshold import delay_threshold_sgd
from asgd_jax.rules.diloco import diloco
from asgd_jax.rules.drop_stale_gradient import drop_stale
from asgd_jax.rules.fadas import FadasState, fadas
from asgd_jax.rules.gap_aware_mitigation import GapAwareState, gap_aware
from asgd_jax.rules.incremental_aggregation import (
    IncrementalAggregationState,
    ia2sgd,
    scale_by_incremental_aggregation,
)
from asgd_jax.rules.malenia import MaleniaState, malenia_sgd, scale_by_malenia
from asgd_jax.rules.registry import RULES, defaults, fingerprint, get, names, register, required
from asgd_jax.rules.ringleader import RingleaderState, ringleader_asgd, scale_by_ringleader
from asgd_jax.rules.staleness_aware import scale_by_staleness, staleness_aware_sgd
from asgd_jax.rules.taming_momentum import DanaState, dana

__all__ = [
    "RULES",
    "CompressorState",
    "DanaState",
    "DelayedNesterovState",
    "FadasState",
    "GapAwareState",
    "IncrementalAggregationState",
    "MaleniaState",
    "RingleaderState",
    "PullRule",
    "ScaleByDelayCompensationState",
    "asgd",
    "cgad",
    "chained_before",
    "compressed",
    "dc_asgd",
    "delay_adaptive_sgd",
    "delay_threshold_sgd",
    "dana",
    "delayed_nesterov",
    "diloco",
    "drop_stale",
    "fadas",
    "fingerprint",
    "gap_aware",
    "get",
    "ia2sgd",
    "malenia_sgd",
    "ringleader_asgd",
    "defaults",
    "names",
    "one_of",
    "qsgd",
    "rand_k",
    "scale_by_age",
    "register",
    "required",
    "scale_by_delay_adaptive",
    "scale_by_delay_compensation",
    "scale_by_incremental_aggregation",
    "scale_by_malenia",
    "scale_by_ringleader",
    "scale_by_staleness",
    "staleness_aware_sgd",
    "top_k",
    "weight_decayed",
]

# Everything here, and the registry's named presets, keep the module they had when the rules were one file
# (asgd_jax/rules.py), as numpy's and jax's public functions name their public module: a rule's description
# (asgd_jax.recipes.describe, in the header a resumed run checks) names its factory by module and name, so a run
# checkpointed before the split still resumes (tests/test_rules_registry.py pins it).
for _made in [*(globals()[_name] for _name in __all__), *RULES.values()]:
    if getattr(_made, "__module__", "").startswith(f"{__name__}."):
        _made.__module__ = __name__
        if hasattr(_made, "__wrapped__"):  # a recipe: the factory it wraps is what a description names
            _made.__wrapped__.__module__ = __name__
del _made
