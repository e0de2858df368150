"""The parameter server as pure functions: the one place its semantics live.

DC-ASGD's Algorithm 2, generalised to any rule:

* ``pull(state, slot)``: record a snapshot of the current weights (and model state) and the version in ``slot``
  (worker m's backup w_bak(m)); the worker then computes at exactly those weights.
* ``push(rule, state, slot, grads)``: apply the pushed payload with the rule, passing ``params`` = w_t,
  ``stale_params`` = the slot's backup, ``staleness`` = versions since that snapshot and ``worker`` = the slot; then
  advance the version.

The simulator scans these functions; the trainer's parameter store jits the very same ones on the host. Backups start
at w_0 (not zeros) and are snapshots: JAX arrays are immutable, so a later update can never alias into them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "ServerState",
    "Versioned",
    "exchange",
    "has_pull",
    "init",
    "pull",
    "push",
    "replace_row",
    "row",
    "sent",
    "snapshot",
    "snapshot_version",
    "write_row",
]


class ServerState(NamedTuple):
    """Everything the parameter server owns.

    Attributes:
      params: current weights w_t.
      opt_state: the rule's state.
      model_state: the latest non-trained model collections pushed (BatchNorm statistics), ``{}`` when none.
      backup_params: per-slot snapshots of the weights, each leaf with a leading axis of ``num_slots``.
      backup_model_state: per-slot snapshots of ``model_state``.
      backup_version: int32 ``[num_slots]``: the version each snapshot was taken at.
      version: int32 scalar t: the number of updates applied.
    """

    params: Any
    opt_state: Any
    model_state: Any
    backup_params: Any
    backup_model_state: Any
    backup_version: jax.Array
    version: jax.Array


def _stack(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))).astype(jnp.result_type(x)), tree)


def has_pull(rule: Any) -> bool:
    """Whether ``rule`` also transforms pulls (an :class:`asgd_jax.rules.PullRule`, e.g. DANA)."""
    return callable(getattr(rule, "pull", None))


def sent(rule: Any, params: Any, opt_state: Any, slot: jax.Array) -> Any:
    """What a pull by ``slot`` hands out: the weights, or the rule's pull transform of them."""
    return rule.pull(params, opt_state, slot) if has_pull(rule) else params


def init(rule: optax.GradientTransformation, params: Any, num_slots: int, model_state: Any = None) -> ServerState:
    """The server at version 0: every backup holds what a pull of w_0 sends (w_0 itself, unless the rule transforms
    pulls).

    Args:
      rule: the update rule (any optax transform, or a :class:`asgd_jax.rules.PullRule`).
      params: the initial weights w_0.
      num_slots: how many backups to keep (the number of workers, or ``tau + 1`` for the fixed-delay models).
      model_state: initial non-trained collections, or ``None`` / ``{}`` when the model has none.
    """
    model_state = {} if model_state is None else model_state
    # Copies: the engines donate the state to their programs, which must never delete the caller's arrays.
    params, model_state = jax.tree.map(lambda x: jnp.array(x, copy=True), (params, model_state))
    opt_state = rule.init(params)
    if has_pull(rule):
        slots = jnp.arange(num_slots, dtype=jnp.int32)
        backups = jax.vmap(lambda s: sent(rule, params, opt_state, s))(slots)
        backups = jax.tree.map(lambda b, p: b.astype(jnp.result_type(p)), backups, params)
    else:
        backups = _stack(params, num_slots)
    return ServerState(
        params=params,
        opt_state=opt_state,
        model_state=model_state,
        backup_params=backups,
        backup_model_state=_stack(model_state, num_slots),
        backup_version=jnp.zeros((num_slots,), jnp.int32),
        version=jnp.zeros((), jnp.int32),
    )


def _get(stack: jax.Array, slot: jax.Array) -> jax.Array:
    # dynamic_index/dynamic_update (not gather/scatter): an O(leaf) slice, updated in place inside a scan.
    return jax.lax.dynamic_index_in_dim(stack, slot, axis=0, keepdims=False)


def _put(stack: jax.Array, slot: jax.Array, x: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, x.astype(stack.dtype), slot, axis=0)


def snapshot(state: ServerState, slot: jax.Array) -> tuple[Any, Any]:
    """The weights and model state stored in ``slot``: what that worker computes at (read with :func:`row`)."""
    return row((state.backup_params, state.backup_model_state), slot)


def row(tables: Any, slot: jax.Array) -> Any:
    """Row ``slot`` of per-slot tables (leaves ``[M, *leaf]``: the backups, a rule's per-worker state), read into
    buffers of their own.

    Read as a plain slice, XLA:CPU fuses the read into every consumer (an elementwise loss's gradient, a rule's
    running sum) and, where a consumer is not an ancestor of the table's in-place write (the pull's, or
    :func:`replace_row`), copies the whole table on every update to order the two: O(M·d) where the update is O(d)
    (Workers(1000), d = 1,729: 392 against 72 us an update; ``tests/test_simulator_hlo.py`` pins it). A conditional's
    result is a buffer of its own, read once before anything consumes it. On a CPU only: an accelerator's
    conditional would ask the host for its predicate on every update. Outside a program (a rule's update called
    eagerly, in a notebook) the plain slice: an eager conditional would compile anew on every call.
    """
    take = lambda: jax.tree.map(lambda t: _get(t, slot), tables)
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((tables, slot)))
    if not traced or jax.default_backend() != "cpu":
        return take()
    empty = lambda: jax.tree.map(lambda t: jnp.zeros(t.shape[1:], t.dtype), tables)
    return jax.lax.cond(jnp.asarray(slot) >= 0, take, empty)  # (always true; XLA cannot tell)


def replace_row(tables: Any, slot: jax.Array, new: Any, old: Any) -> Any:
    """``tables`` with row ``slot`` replaced by ``new`` in place, written after ``old`` (:func:`row`) was read: the
    write depends on it (a select that always takes ``new``), so XLA orders every read before the write and copies
    nothing."""
    return write_row(tables, slot, jax.tree.map(lambda n, o: jnp.where(jnp.asarray(slot) >= 0, n, o), new, old))


def write_row(tables: Any, slot: jax.Array, new: Any) -> Any:
    """``tables`` with row ``slot`` set to ``new`` (cast to each table's dtype), a dynamic update in place. Not
    ``.at[slot].set``: a scatter's bounds check became a select over the row, which XLA:CPU runs in float32 for a
    bfloat16 table, converting the whole table there and back, a copy per update."""
    return jax.tree.map(lambda t, n: _put(t, slot, n), tables, new)


class Versioned(Protocol):
    """Anything that holds per-slot pulled versions: a :class:`ServerState`, or the trainer's packed form of one."""

    @property
    def backup_version(self) -> jax.Array: ...


def snapshot_version(state: Versioned, slot: jax.Array) -> jax.Array:
    """The version ``slot``'s snapshot was pulled at."""
    return _get(state.backup_version, slot)


def pull(state: ServerState, slot: jax.Array, *, weights: bool = True, rule: Any = None) -> ServerState:
    """Records what a pull by ``slot`` sends (the current weights, or ``rule``'s pull transform of them), the model
    state and the version as ``slot``'s backup (a worker's pull): the worker computes at exactly that backup.

    ``weights=False`` records only the version: for a caller that writes the weights later (the simulator, whose
    single slot always holds w_t, writes it once per chunk instead of copying the weights on every update).
    """
    if not weights:
        return state._replace(backup_version=_put(state.backup_version, slot, state.version))
    put = lambda stack, x: _put(stack, slot, x)
    return state._replace(
        backup_params=jax.tree.map(put, state.backup_params, sent(rule, state.params, state.opt_state, slot)),
        backup_model_state=jax.tree.map(put, state.backup_model_state, state.model_state),
        backup_version=_put(state.backup_version, slot, state.version),
    )


def push(
    rule: optax.GradientTransformation,
    state: ServerState,
    slot: jax.Array,
    grads: Any,
    model_state: Any = None,
    *,
    stale_params: Any = None,
    worker: jax.Array | None = None,
) -> tuple[ServerState, jax.Array]:
    """Applies one pushed payload with the rule and advances the version.

    Args:
      rule: the update rule.
      state: the server.
      slot: the pushing worker's slot (int32); its backup is the gradient's ``stale_params``.
      grads: the payload (a gradient, a sum of gradients, or a descent-direction parameter delta).
      model_state: the worker's updated model collections, which replace the server's; ``None`` keeps them.
      stale_params: the slot's snapshot, when the caller already holds it (the simulator read it to compute the
        gradient: passing it saves a second read of the backup, from memory the gradient has long left); read from
        the backup otherwise.
      worker: the pushing worker's id, the rule's ``worker`` (default: ``slot``; a cluster that keeps a ring of
        versions, :class:`asgd_jax.delays.Ringmaster`, or one copy, :class:`asgd_jax.delays.Malenia`, has slots that
        are not its workers).

    Returns:
      ``(new_state, staleness)`` where staleness is the int32 number of updates since the slot's snapshot.
    """
    slot = jnp.asarray(slot, jnp.int32)
    if stale_params is None:
        stale_params = jax.tree.map(lambda x: _get(x, slot), state.backup_params)
    staleness = state.version - _get(state.backup_version, slot)
    updates, opt_state = rule.update(
        grads,
        state.opt_state,
        state.params,
        stale_params=stale_params,
        staleness=staleness,
        worker=slot if worker is None else jnp.asarray(worker, jnp.int32),
    )
    params = optax.apply_updates(state.params, updates)
    new = state._replace(
        params=params,
        opt_state=opt_state,
        model_state=state.model_state if model_state is None else model_state,
        version=optax.safe_increment(state.version),
    )
    return new, staleness


def exchange(
    rule: optax.GradientTransformation,
    state: ServerState,
    slot: jax.Array,
    grads: Any,
    model_state: Any = None,
    *,
    pull_slot: jax.Array | None = None,
    stale_params: Any = None,
    pull_weights: bool = True,
    worker: jax.Array | None = None,
) -> tuple[ServerState, jax.Array]:
    """One exchange, atomically: :func:`push` from ``slot`` (by ``worker``, default the slot's), then :func:`pull`
    into ``pull_slot`` (default: the same slot, a worker that pulls right after it pushes). What the simulator's step
    and the trainer's store both do.

    Returns:
      ``(new_state, staleness)``.
    """
    state, staleness = push(rule, state, slot, grads, model_state, stale_params=stale_params, worker=worker)
    return pull(state, slot if pull_slot is None else pull_slot, weights=pull_weights, rule=rule), staleness
