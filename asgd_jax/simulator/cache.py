"""The programs kept across calls: up to 32 in a process, keyed on what shapes them (a
:class:`~asgd_jax.simulator.programs.Key`: the plan's structure, the loss, the rule's recipe or identity, the
evaluation, the shapes), while everything numeric is an argument. Across processes :mod:`asgd_jax.cache` keeps XLA's
compilations.

:func:`prepare` checks what a call's programs need and finds them, building them on a miss; :func:`clear_cache`
forgets them all. A program compiled again for an argument that is a new object of the same code as before (a closure
made anew on every call) raises a :class:`RecompileWarning` that names it.
"""

from __future__ import annotations

import collections
import functools
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import cache, errors, exchange
from asgd_jax import loss as loss_lib
from asgd_jax.exchange import Exchange
from asgd_jax.plan import Plan
from asgd_jax.simulator.programs import Key as _Key
from asgd_jax.simulator.programs import Program as _Program
from asgd_jax.simulator.programs import Programs as _Programs
from asgd_jax.simulator.programs import Source as _Source
from asgd_jax.simulator.programs import make_evaluator as _make_evaluator
from asgd_jax.simulator.programs import make_program as _make_program


class RecompileWarning(UserWarning):
    """A program was compiled again for an argument that is a new object with the same code as before (a rule, loss
    or evaluation closure built anew on every call): build it once, or build the rule with :mod:`asgd_jax.rules`."""


_CACHE: collections.OrderedDict[_Key, _Program] = collections.OrderedDict()
_CACHE_SIZE = 32
_LOCK = threading.Lock()
_SEEN: dict[Hashable, _Key] = {}  # a key with its objects replaced by their code -> the last key built for it
_WARNED: set[Hashable] = set()


def clear_cache() -> None:
    """Forgets every compiled program (the next call of each structure compiles again)."""
    with _LOCK:
        _CACHE.clear()
        _SEEN.clear()
        _WARNED.clear()


def _code(obj: Any) -> Hashable:
    """What an object keyed by identity does, to tell a new object of the same code from another function."""
    if isinstance(obj, tuple):
        return tuple(_code(x) for x in obj)
    if isinstance(obj, loss_lib.Loss):
        return ("loss", _code(obj.fn), obj.has_model_state, obj.has_aux)
    if isinstance(obj, functools.partial):
        return ("partial", _code(obj.func))
    update = getattr(obj, "update", None)
    if callable(update) and callable(getattr(obj, "init", None)):
        return ("rule", _code(update))
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code
    return obj if cache.hashable(obj) else id(type(obj))


_WHAT = {"loss": "the loss function", "eval_fn": "eval_fn", "rule": "the rule", "delays": "the delay function"}


def _program(key: _Key, build: Callable[[], _Program]) -> _Program:
    """The cached program for ``key``, built (and counted against identity-keyed surprises) on a miss."""
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    program = build()
    with _LOCK:
        _CACHE[key] = program
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        code = key._replace(**{f: _code(getattr(key, f)) for f in _WHAT})
        before = _SEEN.get(code)
        _SEEN[code] = key
        if before is not None and before != key and code not in _WARNED:
            _WARNED.add(code)
            what = " and ".join(_WHAT[f] for f in _WHAT if getattr(before, f) != getattr(key, f))
            warnings.warn(
                f"asgd_jax compiled the simulator again because {what} is a new object with the same code as one it "
                "compiled for before (a closure made anew on each call). Make it once, outside the loop; a rule "
                "built by asgd_jax.rules.get or the rule functions (asgd_jax.dc_asgd, ...) needs no care: its "
                "numbers are arguments of one program.",
                RecompileWarning,
                stacklevel=4,
            )
    return program


def _avals(*trees: Any) -> Hashable:
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def prepare(
    loss_fn, params, data, plan: Plan, model_state, has_aux: bool, eval_fn, source: _Source, runs, first_delays
) -> tuple[_Programs, Exchange]:
    """Checks what a call's program needs (on a cache miss: tracing the loss) and returns the program."""
    if eval_fn is not None and not callable(eval_fn):
        raise errors.ConfigError(f"eval_fn={eval_fn!r} is invalid: give eval_fn(params, model_state) -> dict.")
    if plan.eval_every is not None and eval_fn is None:
        raise errors.ConfigError(
            f"plan.eval_every={plan.eval_every} was given without eval_fn: pass eval_fn(params, model_state) -> dict "
            "(or set chunk instead of eval_every for the chunk length alone)."
        )
    loss = loss_lib.as_loss(loss_fn, has_model_state=model_state is not None, has_aux=has_aux)
    ex = exchange.Exchange.create(plan.replace(delays=first_delays), data, stateful=loss.has_model_state)
    exchange.check_params(params)
    model_state = {} if model_state is None else model_state
    plan_key = plan.structure()._replace(delays=None)  # the delay model's structure is in the source's key
    evaluator = None
    if eval_fn is not None:  # keyed by what the evaluation depends on only: the rule and the cluster are not in it
        eval_avals = _avals(params, model_state, exchange.eval_parts(eval_fn)[1])
        eval_key = _Key(None, eval_fn, None, None, None, None, eval_avals, runs)
        evaluator = _program(eval_key, lambda: _make_evaluator(eval_fn, runs is not None, params, model_state))
    loss.check_data(data)  # (values, every call; the shapes are checked once per program, below)
    key = _Key(loss, None, source.rule_key, source.delays_key, plan_key, ex, _avals(params, model_state, data), runs)

    def build() -> _Program:
        loss.check(params, model_state, exchange.batch_shapes(data, plan.batch_size))
        return _make_program(key, loss, source, ex, plan.chunk_length)

    return _Programs(_program(key, build), evaluator), ex
