"""What a run holds and what a call gives back.

:class:`SimState` is the simulator's whole state (the server, the delay model's state, the data positions
:class:`DataState`, the clock and the :class:`RunKeys`); :func:`init` makes it before the first update (the start
program makes it with :func:`init_state`). :class:`SimulationResult` is what :func:`asgd_jax.simulate` returns.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import exchange, order, server
from asgd_jax.plan import Plan


class DataState(NamedTuple):
    """How many minibatches each shard has taken; with the key this fixes every future batch (see :mod:`order`)."""

    taken: jax.Array  # int32 [num_shards]


class RunKeys(NamedTuple):
    """What a run's key is split into, derived once at its start (:func:`asgd_jax.exchange.split_key`): the words that
    key its data order (:func:`asgd_jax.order.key_words`), and the raw data of its delay and model keys."""

    data_words: jax.Array  # uint32 [4]
    delay: jax.Array  # uint32 key data
    model: jax.Array  # uint32 key data


class SimState(NamedTuple):
    """The simulator's whole state: a checkpoint holds exactly this."""

    server: server.ServerState
    delay: Any
    data: DataState
    clock: jax.Array  # float32 virtual time of the last update
    keys: RunKeys
    workers: Any = None  # each worker's own state across its exchanges: its inner optimizer's, [M, ...] (or None)


class SimulationResult(NamedTuple):
    """What :func:`simulate` returns (with a leading run axis everywhere for :func:`sweep`).

    Attributes:
      params: final server weights.
      model_state: final server model state (``{}`` without one).
      state: the final :class:`SimState` (server, delay model and data positions).
      metrics: per-update numpy arrays ``loss``, ``staleness``, ``worker``, ``time``, ``epoch`` (effective passes over
        the data) and any auxiliary training metrics the loss returns (e.g. ``error``); with ``eval_fn`` also
        ``eval_update`` (the update count at each evaluation, starting at 0) and ``eval_<name>`` for each metric.
      plan: the run's :class:`asgd_jax.Plan`.
    """

    params: Any
    model_state: Any
    state: SimState
    metrics: dict[str, np.ndarray]
    plan: Plan | None = None


def init(
    rule: optax.GradientTransformation,
    params: Any,
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
) -> SimState:
    """The simulator's state before the first update (what :func:`simulate` starts from and :func:`lower`'s program
    takes): the server at w_0, the delay model's first draw under ``key``, no minibatch taken, the clock at 0.

    Example:
      >>> import jax.numpy as jnp, asgd_jax
      >>> state = asgd_jax.simulator.init(asgd_jax.asgd(0.1), jnp.zeros(3), asgd_jax.Plan(4))
      >>> state.server.backup_params.shape, int(state.server.version)
      ((4, 3), 0)
    """
    plan = Plan() if plan is None else plan
    key = jax.random.key(0) if key is None else key
    return init_state(rule, params, plan.delays, key, plan.n_sync, model_state, plan.inner)


def init_state(rule, params, delays, key, n_sync: int, model_state, inner: str = "sgd") -> SimState:
    # The key's split and the data order's words are made here, once: every chunk would otherwise make them again
    # (each a PRNG call that XLA compiles anew in every program that makes one).
    data_key, delay_key, model_key = exchange.split_key(key)
    return SimState(
        server=server.init(rule, params, delays.num_slots, model_state),
        delay=delays.init(delay_key, n_sync),
        data=DataState(jnp.zeros((delays.num_shards,), jnp.int32)),
        clock=jnp.zeros((), jnp.float32),
        keys=RunKeys(order.key_words(data_key), jax.random.key_data(delay_key), jax.random.key_data(model_key)),
        workers=_inner_states(inner, params, getattr(delays, "num_workers", delays.num_slots)),
    )


def _inner_states(inner: str, params: Any, num_workers: int) -> Any:
    """Every worker's first state of its inner optimizer, stacked ``[M, ...]``; None for plain local SGD."""
    if inner == "sgd":
        return None
    first = exchange.inner_optimizer(inner, 0.0).init(params)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers, *jnp.shape(x))), first)
