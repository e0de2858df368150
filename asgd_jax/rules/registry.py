"""The registry: every rule by name, for the command line, the studies and the notebooks.

:data:`RULES` maps a name to ``factory(learning_rate, **hyperparameters)``; :func:`names`, :func:`defaults` and
:func:`required` read it, :func:`get` builds a rule from it, :func:`register` adds one. The named presets (``"sgd"``,
``"dc_asgd_c"``, ``"dc_asgd_a"``) are the ``_named_*`` factories here. :func:`fingerprint` is what a resumed run checks
of its rule.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import cache, errors, recipes
from asgd_jax.recipes import recipe
from asgd_jax.rules.async_local_sgd import delayed_nesterov
from asgd_jax.rules.async_sgd import asgd
from asgd_jax.rules.cgad import cgad
from asgd_jax.rules.common import ScalarOrSchedule
from asgd_jax.rules.compressors import compressed, rand_k, top_k
from asgd_jax.rules.delay_adaptive import delay_adaptive_sgd
from asgd_jax.rules.delay_compensation import dc_asgd
from asgd_jax.rules.delay_threshold import delay_threshold_sgd
from asgd_jax.rules.diloco import diloco
from asgd_jax.rules.fadas import fadas
from asgd_jax.rules.gap_aware_mitigation import gap_aware
from asgd_jax.rules.incremental_aggregation import ia2sgd
from asgd_jax.rules.malenia import malenia_sgd
from asgd_jax.rules.ringleader import ringleader_asgd
from asgd_jax.rules.staleness_aware import staleness_aware_sgd
from asgd_jax.rules.taming_momentum import dana


@recipe(elementwise=True)
def _named_sgd(learning_rate: ScalarOrSchedule, *, momentum: float | None = None, nesterov: bool = False):
    """Sequential SGD: the ``asgd`` rule, named for runs with one worker (or a reference)."""
    return asgd(learning_rate, momentum=momentum, nesterov=nesterov)


@recipe(elementwise=True)
def _named_dc_asgd_c(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 0.04,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
):
    """DC-ASGD-c: :func:`dc_asgd` with a constant lambda (paper: 0.04)."""
    return dc_asgd(learning_rate, lam, momentum=momentum, nesterov=nesterov)


@recipe(elementwise=True)
def _named_dc_asgd_a(
    learning_rate: ScalarOrSchedule,
    lam: float | jax.Array = 2.0,
    *,
    mean_square_decay: float | jax.Array = 0.95,
    eps: float | jax.Array = 1e-7,
    num_workers: int | None = None,
    momentum: float | None = None,
    nesterov: bool = False,
):
    """DC-ASGD-a: :func:`dc_asgd` with the adaptive lambda (paper: lambda_0 = 2, m = 0.95)."""
    return dc_asgd(
        learning_rate,
        lam,
        adaptive=True,
        mean_square_decay=mean_square_decay,
        eps=eps,
        num_workers=num_workers,
        momentum=momentum,
        nesterov=nesterov,
    )


@recipe(static=("fraction",))
def _named_topk_asgd(learning_rate: ScalarOrSchedule, *, num_workers: int, fraction: float = 1 / 16):
    """ASGD stepping with a TopK push: the ``fraction`` of the payload's coordinates of largest magnitude, each
    worker's error feedback (:func:`compressed` with :func:`top_k`); ``fraction`` shapes the program."""
    return compressed(asgd(learning_rate), top_k(fraction=fraction, num_workers=num_workers))


@recipe(numbers=("learning_rate", "seed"), static=("fraction",))
def _named_randk_asgd(learning_rate: ScalarOrSchedule, *, fraction: float = 1 / 16, seed: int = 0):
    """ASGD stepping with a RandK push: ``fraction`` of the coordinates at random, scaled by its inverse, unbiased
    (:func:`compressed` with :func:`rand_k`); ``fraction`` shapes the program, ``seed`` is a number."""
    return compressed(asgd(learning_rate), rand_k(fraction=fraction, seed=seed))


RULES: dict[str, Callable[..., optax.GradientTransformationExtraArgs]] = {
    "sgd": _named_sgd,
    "asgd": asgd,
    "dc_asgd": dc_asgd,
    "dc_asgd_c": _named_dc_asgd_c,
    "dc_asgd_a": _named_dc_asgd_a,
    "staleness_aware": staleness_aware_sgd,
    "delay_adaptive": delay_adaptive_sgd,
    "delay_threshold": delay_threshold_sgd,
    "gap_aware": gap_aware,
    "delayed_nesterov": delayed_nesterov,
    "diloco": diloco,
    "fadas": fadas,
    "cgad": cgad,
    "dana": dana,
    "ia2sgd": ia2sgd,
    "malenia": malenia_sgd,
    "ringleader": ringleader_asgd,
    "topk_asgd": _named_topk_asgd,
    "randk_asgd": _named_randk_asgd,
}
"""Every rule by name: ``factory(learning_rate, **hyperparameters)``; :func:`get` builds one, :func:`register` adds
one."""


def names() -> list[str]:
    """The names :func:`get` knows, in registration order."""
    return list(RULES)


def defaults(name: str) -> dict[str, Any]:
    """The hyperparameters of rule ``name`` (besides the learning rate) and their defaults (``None``: required or
    off).

    Example:
      >>> import asgd_jax
      >>> asgd_jax.rules.defaults("dc_asgd_c")
      {'lam': 0.04, 'momentum': None, 'nesterov': False}
    """
    factory = _factory(name)
    params = list(inspect.signature(factory).parameters.values())[1:]
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default) for p in params}


def required(name: str) -> list[str]:
    """The hyperparameters rule ``name`` cannot do without (``delay_adaptive``'s ``num_workers``)."""
    params = list(inspect.signature(_factory(name)).parameters.values())[1:]
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]


def _factory(name: str) -> Callable[..., optax.GradientTransformationExtraArgs]:
    if not isinstance(name, str) or name not in RULES:
        raise errors.ConfigError(f"rule={name!r} is invalid: use one of {', '.join(RULES)}.")
    return RULES[name]


def get(name: str, learning_rate: ScalarOrSchedule, **hyperparameters: Any) -> optax.GradientTransformationExtraArgs:
    """The rule registered as ``name``, built with ``learning_rate`` and its own hyperparameters.

    Args:
      name: one of :func:`names` (``"asgd"``, ``"dc_asgd_c"``, ``"dc_asgd_a"``, ...).
      learning_rate: a float or an optax schedule over server updates.
      **hyperparameters: the rule's own (see :func:`defaults`); ``None`` values are dropped, so a caller can
        pass every option it has and let the rule's defaults stand.

    Raises:
      ConfigError: an unknown name, or a hyperparameter the rule does not take (the message lists those it takes).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> rule = asgd_jax.rules.get("dc_asgd_a", 0.1, lam=1.0)
      >>> w = jnp.array([1.0])
      >>> rule.update(jnp.array([2.0]), rule.init(w), w, stale_params=w)[0]
      Array([-0.2], dtype=float32)
      >>> asgd_jax.rules.get("asgd", 0.1, lam=1.0)
      Traceback (most recent call last):
      ...
      asgd_jax.errors.ConfigError: rule 'asgd' takes no hyperparameter 'lam': it takes momentum, nesterov.
    """
    factory = _factory(name)
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    missing = [k for k in required(name) if k not in given]
    if missing:
        raise errors.ConfigError(
            f"rule {name!r} needs {', '.join(missing)}: pass e.g. rules.get({name!r}, learning_rate, "
            f"{missing[0]}=M), M the plan's number of workers."
        )
    accepted = defaults(name)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "none"
        raise errors.ConfigError(
            f"rule {name!r} takes no hyperparameter {', '.join(map(repr, unknown))}: it takes {takes}."
        )
    return factory(learning_rate, **given)


def register(name: str, factory: Callable[..., optax.GradientTransformationExtraArgs]) -> None:
    """Adds ``factory(learning_rate, **hyperparameters)`` to the registry under ``name`` (replacing an earlier one), so
    that :func:`get`, the command line and the studies know it. It is made a :func:`asgd_jax.recipes.recipe`: rules
    :func:`get` builds from it with other numbers share one compiled program."""
    if not isinstance(name, str) or not name.isidentifier():
        raise errors.ConfigError(f"name={name!r} is invalid: use an identifier such as 'my_rule'.")
    if not callable(factory):
        raise errors.ConfigError(f"factory={factory!r} is invalid: give a function (learning_rate, **hp) -> rule.")
    # As a recipe, the rules it builds key one compiled program whatever their numbers (see asgd_jax.recipes).
    RULES[name] = factory if getattr(factory, "is_recipe", False) else recipe(factory)


def fingerprint(rule: optax.GradientTransformation, params: Any, *, eager: bool = False) -> str:
    """A short hash of what ``rule`` does: its first two updates of a fixed probe shaped like ``params``.

    Two rules that differ in a hyperparameter (learning rate, lambda, momentum, ...) give different fingerprints;
    the same rule built twice gives the same one (computed on the CPU, rounded to 6 significant digits). A resumed
    run checks it, so that a run is never continued with another rule. A change that only shows after two updates
    (a schedule's later steps, a rule that waits for a round of its workers) is not seen.

    A rule built from its recipe (every registered rule, :mod:`asgd_jax.recipes`) is probed by one compiled program
    per rule structure and weights' shapes, its numbers the program's arguments: a run's start on a cold cache, 0.5 s
    for the ``cnn``'s DC-ASGD-a where an operation at a time took 3.5 s. A rule composed by hand, or ``eager``, is
    probed an operation at a time (each compiled once per leaf shape: a rule rebuilt in a notebook compiles nothing
    new), which is also how checkpoints before 2026-12-05 computed theirs (its last bits may round apart from the
    compiled probe's).

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> w = jnp.zeros(3)
      >>> asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w) == asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w)
      True
      >>> asgd_jax.rules.fingerprint(asgd_jax.asgd(0.1), w) == asgd_jax.rules.fingerprint(asgd_jax.asgd(0.2), w)
      False
    """
    import hashlib

    built = None if eager else recipes.of(rule)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), jnp.float32), params)
    layout = (jax.tree.structure(shapes), tuple(x.shape for x in jax.tree.leaves(shapes)))
    key = None if built is None else (built.structure, *layout)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.transfer_guard("allow"):
        if key is None or not cache.hashable(key):
            updates = _probe(rule, None, shapes, {})
        else:  # (numbers as arguments: a rule at another learning rate compiles nothing new)
            program = _PROBES.get(key, lambda: jax.jit(functools.partial(_probe, None, built.structure, shapes)))
            updates = program(built.numbers)
        out = [np.asarray(u, np.float64) for u in updates]
    digest = hashlib.sha256()
    for u in out:  # a leaf's first elements and its sum, to 6 significant digits: cheap for a big model, and stable
        digest.update(" ".join(f"{x:.6g}" for x in [*u.ravel()[:64], u.sum()]).encode())
    return digest.hexdigest()[:16]


_PROBES = cache.Kept(16)  # fingerprint's programs, per rule structure and weights' shapes


def _probe(rule: Any, structure: Any, shapes: Any, numbers: Any) -> list[jax.Array]:
    """:func:`fingerprint`'s two updates of its probe, every leaf of both: ``rule``, or (``None``) the rule of the
    recipe ``structure`` at ``numbers``; jitted, one program, else an operation at a time."""
    rule = recipes.Recipe(structure, numbers).build() if rule is None else rule
    probe = jax.tree.map(lambda p: 0.01 * (1.0 + jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) % 7), shapes)
    grads = jax.tree.map(lambda p: 0.5 - p, probe)
    state = rule.init(probe)
    out = []
    for step in range(2):
        updates, state = rule.update(
            grads,
            state,
            probe,
            stale_params=jax.tree.map(lambda p: 0.9 * p, probe),
            staleness=jnp.int32(step + 2),
            worker=jnp.int32(0),
        )
        out += jax.tree.leaves(updates)
    return out
