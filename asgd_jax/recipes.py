"""How a rule was built, so that a compiled program can take its numbers as arguments.

An optax rule is a pair of closures: its learning rate and other numbers are baked into them. A program compiled for
``dc_asgd(0.1, lam=2.0)`` would be compiled again for ``dc_asgd(0.2, lam=2.0)``, and its numbers would be constants of
the program. Every rule factory of :mod:`asgd_jax.rules` is therefore a *recipe*: the rule it returns remembers the
factory and the arguments it was called with (:func:`of`). The simulator keys its programs on the recipe's
:attr:`Recipe.structure` (the factory and every argument that shapes the program) and passes :attr:`Recipe.numbers`
as arguments, rebuilding the rule inside the program with :meth:`Recipe.build`: every rule from one factory with the
same structure and other numbers shares one compiled program.

What is structure and what is a number: floats and arrays are numbers; ``None``, bools, strings, ints and callables
(an optax schedule, by identity) are structure, except the arguments a factory declares numbers (the learning rate,
always). A rule among the arguments (:func:`asgd_jax.rules.one_of`'s choices) or a learning-rate schedule of
:mod:`asgd_jax.schedules` contributes its own recipe.

Decorate your own factory with :func:`recipe` to give its rules the same treatment.

Example:
  >>> import asgd_jax
  >>> a, b = asgd_jax.dc_asgd(0.1, lam=2.0), asgd_jax.dc_asgd(0.3, lam=0.5)
  >>> asgd_jax.recipes.of(a).structure == asgd_jax.recipes.of(b).structure
  True
  >>> sorted(asgd_jax.recipes.of(a).numbers)
  ['lam', 'learning_rate']
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np

from asgd_jax.errors import ConfigError, is_number

__all__ = ["Recipe", "describe", "elementwise", "of", "recipe"]

# A rule's update function -> the recipe that built it. Keyed weakly: a rule that is gone takes its entry with it.
_RECIPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The factories declared elementwise (``recipe(elementwise=True)``).
_ELEMENTWISE: set[Callable] = set()


class _NotARecipe(Exception):
    """An argument that can be neither a number nor structure (a traced value, an unhashable object)."""


class Recipe(NamedTuple):
    """How a rule was built.

    Attributes:
      structure: hashable: the factory and every structural argument (what a compiled program depends on).
      numbers: the numeric arguments as given (Python numbers, NumPy or JAX arrays), by name (nested for a rule or
        schedule among the arguments): what a compiled program takes as arguments.
    """

    structure: Hashable
    numbers: dict[str, Any]

    def build(self, numbers: dict[str, Any] | None = None) -> Any:
        """The rule again, with ``numbers`` (by default its own; traced ones inside a program)."""
        return _build(self.structure, self.numbers if numbers is None else numbers)

    def vary(self, names: list[str]) -> Recipe:
        """This recipe with the arguments ``names`` as numbers (a sweep varies them per run), at their values here or
        the factory's defaults. A name that is not an argument of the factory, or one that shapes the program (an
        int such as a worker count), raises a ``ConfigError``."""
        factory, arguments = self.structure
        parameters = inspect.signature(factory).parameters
        given, numbers = dict(arguments), dict(self.numbers)
        for name in names:
            if name in numbers:
                continue
            if name not in parameters or parameters[name].kind in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            ):
                raise ConfigError(
                    f"hparams[{name!r}] is not an argument of {factory.__name__}: it takes "
                    f"{', '.join(p for p in parameters if p not in ('args', 'kwargs'))}."
                )
            value = given[name][1] if name in given else parameters[name].default
            if value is inspect.Parameter.empty or (
                isinstance(value, int | np.integer) and not isinstance(value, bool)
            ):
                raise ConfigError(
                    f"hparams[{name!r}] cannot vary inside one program: {factory.__name__}'s {name} shapes it (give it "
                    "as an argument, and one sweep per value)."
                )
            given[name], numbers[name] = ("number",), value
        return Recipe((factory, tuple(given.items())), numbers)


def _target(made: Any) -> Any:
    """What a recipe is filed under: a rule's update function, or a schedule itself."""
    return made.update if _is_rule(made) else made


def of(made: Any) -> Recipe | None:
    """The recipe that built ``made`` (a rule, or a schedule of :mod:`asgd_jax.schedules`), or ``None`` (a rule
    composed by hand, e.g. with ``optax.chain``; an optax schedule)."""
    try:
        return _RECIPES.get(_target(made))
    except TypeError:  # not weakly referenceable: not one of ours
        return None


def describe(value: Any) -> str | None:
    """A stable text of ``value``, the same in every process: a rule's or schedule's recipe (its factory and every
    argument, numbers included: a schedule's later steps too), or a dataclass value (a loss, a model) field by field;
    ``None`` where some part is known only by its address. What a resumed run compares with the run it continues.

    Example:
      >>> import asgd_jax
      >>> step = asgd_jax.schedules.piecewise(0.1, [100], [0.1])
      >>> describe(asgd_jax.asgd(step)) == describe(asgd_jax.asgd(asgd_jax.schedules.piecewise(0.1, [100], [0.1])))
      True
      >>> describe(asgd_jax.asgd(step)) == describe(asgd_jax.asgd(asgd_jax.schedules.piecewise(0.1, [200], [0.1])))
      False
    """
    made = of(value)
    text = _text(tuple(made) if made is not None else value)
    return None if " at 0x" in text else text


def _text(x: Any) -> str:
    """:func:`describe`'s text of one value."""
    if made := of(x) if callable(x) else None:
        return "recipe" + _text(tuple(made))
    if inspect.isfunction(x) or inspect.isclass(x) or inspect.ismethod(x) or inspect.isbuiltin(x):
        return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', repr(x))}"
    if type(x).__module__.startswith("flax"):  # a flax module: its own repr lists its configuration
        return repr(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = ", ".join(f"{f.name}={_text(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__qualname__}({fields})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(x, list | tuple):
        return "(" + ", ".join(_text(v) for v in x) + ")"
    if isinstance(x, bool | int | str | None):
        return repr(x)
    if isinstance(x, float | np.floating):
        return f"{float(x):.9g}"
    if isinstance(x, np.ndarray | jax.Array):
        a = np.asarray(x)
        return f"array{list(a.shape)}{a.dtype}{[f'{v:.9g}' for v in a.ravel()[:64].astype(np.float64)]}"
    return repr(x)


def recipe(
    factory: Callable | None = None,
    *,
    numbers: tuple[str, ...] = ("learning_rate",),
    static: tuple[str, ...] = (),
    elementwise: bool = False,
) -> Callable:
    """Decorates a rule (or schedule) factory so that what it returns carries its :class:`Recipe`.

    Args:
      factory: ``factory(*args, **kwargs) -> rule`` (an optax transform or a :class:`asgd_jax.rules.PullRule`), or
        ``-> schedule`` (a function of the update count).
      numbers: arguments that are numbers even when given as ints (the learning rate); other ints are structure.
      static: arguments that are structure even when given as arrays (a concrete choice the program should fold,
        such as :func:`asgd_jax.rules.one_of`'s index).
      elementwise: every element of what the rule makes (its update, its new state, its pull) is a function of the
        same element of its inputs and of scalars alone (no reduction over a leaf, no leaf's shape or place in the
        tree): then it may run on the weights packed into one buffer per dtype and give the same bits
        (:func:`elementwise`; the parameter store does, :mod:`asgd_jax.trainer.state`). A schedule touches no
        element: declare it so. ``tests/test_rules_registry.py`` holds every registered rule to its word.

    Example:
      >>> import optax, asgd_jax
      >>> @asgd_jax.recipes.recipe
      ... def my_sgd(learning_rate, decay=0.5):
      ...     return optax.chain(optax.scale(decay), optax.sgd(learning_rate))
      >>> asgd_jax.recipes.of(my_sgd(0.1)).build().update is not None
      True
    """
    if factory is None:
        return functools.partial(recipe, numbers=numbers, static=static, elementwise=elementwise)
    signature = inspect.signature(factory)
    if elementwise:
        _ELEMENTWISE.add(factory)

    @functools.wraps(factory)
    def make(*args, **kwargs):
        made = factory(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            parts = [
                (name, _fixed(value) if name in static else _split(value, name in numbers))
                for name, value in bound.arguments.items()
            ]
            structure = (factory, tuple((name, s) for name, (s, _) in parts))
            _RECIPES[_target(made)] = Recipe(structure, {name: n for name, (_, n) in parts if n is not None})
        except (_NotARecipe, TypeError):  # built inside a trace, or of parts we cannot key: an ordinary rule
            pass
        return made

    make.is_recipe = True
    return make


def elementwise(rule: Any) -> bool:
    """Whether ``rule`` was built by a recipe declared elementwise (``recipe(elementwise=True)``) from arguments that
    are all numbers, plain values, schedules, or rules themselves elementwise: applied to the weights packed into one
    buffer per dtype (a tuple of 1-D buffers) it gives the bits it gives leaf by leaf. ``False`` for a rule composed by
    hand (no recipe: nothing is known of it).

    Example:
      >>> import asgd_jax
      >>> elementwise(asgd_jax.dc_asgd(0.1, adaptive=True)), elementwise(asgd_jax.rules.get("randk_asgd", 0.1))
      (True, False)
    """
    made = of(rule)
    return made is not None and _elementwise(made.structure)


def _elementwise(structure: Hashable) -> bool:
    factory, arguments = structure
    return factory in _ELEMENTWISE and all(_part_elementwise(s) for _, s in arguments)


def _part_elementwise(part: Hashable) -> bool:
    kind = part[0]
    if kind == "made":
        return _elementwise(part[1])
    if kind == "seq":
        return all(_part_elementwise(s) for s in part[2])
    return kind == "number" or not (kind == "value" and _is_rule(part[1]))


def _is_rule(value: Any) -> bool:
    return callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def _is_number(value: Any, int_is_number: bool) -> bool:
    if is_number(value):  # (a float of Python, NumPy or ml_dtypes: a bfloat16 scalar is no np.floating)
        return int_is_number or not isinstance(value, int | np.integer)
    return isinstance(value, np.ndarray | jax.Array)


def _fixed(value: Any) -> tuple[Hashable, None]:
    """A concrete scalar kept as structure (its value keys the program)."""
    if isinstance(value, jax.core.Tracer):
        raise _NotARecipe
    return ("value", np.asarray(value).item() if np.ndim(value) == 0 else value), None


def _split(value: Any, int_is_number: bool = False) -> tuple[Hashable, Any]:
    """``(structure, numbers)`` of one argument (``numbers`` is ``None`` when it has none)."""
    if isinstance(value, jax.core.Tracer):
        raise _NotARecipe
    if _is_number(value, int_is_number):
        return ("number",), value  # as given (on the host): a Python float reaches a program weakly typed, as a literal
    if _is_rule(value) or callable(value):  # a rule among the arguments, or a schedule
        inner = of(value)
        return (("made", inner.structure), inner.numbers) if inner is not None else (("value", value), None)
    if isinstance(value, list | tuple):
        parts = [_split(v, int_is_number) for v in value]
        nums = [n for _, n in parts]
        return ("seq", type(value), tuple(s for s, _ in parts)), (nums if any(n is not None for n in nums) else None)
    hash(value)  # a TypeError for what cannot key a program
    return ("value", value), None


def _join(structure: Hashable, numbers: Any) -> Any:
    kind = structure[0]
    if kind == "value":
        return structure[1]
    if kind == "number":
        return numbers
    if kind == "made":
        return _build(structure[1], numbers)
    nums = numbers if numbers is not None else [None] * len(structure[2])
    return structure[1](_join(s, n) for s, n in zip(structure[2], nums, strict=True))


def _build(structure: Hashable, numbers: dict[str, Any]) -> Any:
    factory, arguments = structure
    return factory(**{name: _join(s, numbers.get(name)) for name, s in arguments})
