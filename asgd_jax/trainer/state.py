"""The store's server state on its device and the programs that change it: one program per push.

:class:`StoreState` holds the whole server state (weights, rule state, model state, every worker's backup and pulled
version, the version; :mod:`asgd_jax.server`'s) on the store's device, and the jitted programs that read and write
it: the exchange (a push applied and its worker's pull recorded, in one program, state donated), a pull, a backup's
lookup, the weights for a snapshot. What crosses in and out is packed (:mod:`asgd_jax.packing`): one buffer per
dtype whatever the leaf count. It is not thread-safe: its one user, :class:`asgd_jax.trainer.store.ParameterStore`,
calls it under its lock.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import packing, server
from asgd_jax.trainer.messages import BadPush

__all__ = ["Dispatched", "Exchanged", "StoreState", "finite_packed", "host", "host_copy"]


class Exchanged(NamedTuple):
    """One push's outcome: ``ok`` (the payload was finite and applied), its staleness (updates since its worker's
    pull, whether applied or not), ``sound`` (the weights after it are finite) and the packed answer on the host: what
    the worker computes at next, its backup (the fresh weights, or the old ones of a rejected push)."""

    ok: bool
    staleness: int
    sound: bool
    answer: tuple


class Dispatched(NamedTuple):
    """A push's exchange dispatched, its outputs still on the device (nothing waited for): the flags to read
    (:meth:`StoreState.settle`), the answer and the version it was pulled at, which the worker computes at next
    straight from the device, before the host knows whether the push was applied."""

    flags: tuple
    answer: tuple
    version: jax.Array


class StoreState:
    """A server state on ``device`` and its compiled programs (see the module's docstring).

    Args:
      rule: the update rule.
      params: initial weights w_0.
      model_state: the initial model state, or ``None``.
      num_workers: M.
      device: where the state lives.
    """

    def __init__(self, rule: optax.GradientTransformation, params: Any, model_state: Any, num_workers: int, device):
        self.device, self.num_workers = device, num_workers
        with jax.default_device(device):
            params, model_state = jax.device_put((params, model_state), device)  # explicit, never implicit
            state = jax.jit(lambda p, ms: server.init(rule, p, num_workers, ms))(params, model_state)
        self.state = jax.device_put(state, device)
        self._ids = [jax.device_put(np.int32(w), device) for w in range(num_workers)]  # placed once, not per push
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self.stateful = model_state is not None
        # Pushes and answers cross as packed buffers (one per dtype), whatever the leaf count (asgd_jax.packing).
        self.layout = packing.Layout.of(state.params)
        self.model_state_layout = packing.Layout.of(state.model_state if self.stateful else {})
        self._structure = jax.tree.structure(state.params)
        self._leaves = [(x.shape, x.dtype) for x in jax.tree.leaves(state.params)]
        self.sends = server.has_pull(rule)  # a pull-side rule answers with a look-ahead, not the server's weights
        self._compile(rule)

    def _compile(self, rule: optax.GradientTransformation) -> None:
        """The very same server step the simulator scans, jitted for the store's device, on packed pushes.

        One program per push: the payload's leaves are slices of its packed buffers, the finite check is an output
        (a payload with NaN/Inf leaves the state as it was), and so are the staleness and the answer: what the worker
        computes at next, packed, with its own finite check (weights that turned NaN/Inf). The state is donated: the
        server updates weights, rule state and the M backups in place instead of copying (M + 2) x params per push
        (benchmarks/trainer_overhead.py, store_push.py).
        """
        layout, ms_layout, stateful = self.layout, self.model_state_layout, self.stateful
        pack = lambda params, model_state: (layout.pack(params), ms_layout.pack(model_state if stateful else {}))

        def answer(s, w):  # what a pull by w sends (a pull-side rule's look-ahead is its backup), packed
            return pack(*(server.snapshot(s, w) if server.has_pull(rule) else (s.params, s.model_state)))

        def exchange_packed(s, w, g, ms):
            ok = finite_packed((*g, *ms))
            grads, model_state = layout.unpack(g), ms_layout.unpack(ms) if stateful else None
            staleness = s.version - server.snapshot_version(s, w)
            # Applied at most once: a loop of ok (0 or 1) trips keeps the per-worker stacks updated in place, where
            # lax.cond made XLA copy them on every push (tests/test_store.py pins it on the compiled HLO).
            s, _ = jax.lax.while_loop(
                lambda c: c[1] < ok.astype(jnp.int32),
                lambda c: (server.exchange(rule, c[0], w, grads, model_state)[0], c[1] + 1),
                (s, jnp.zeros((), jnp.int32)),
            )
            # The worker's backup: what this push's pull recorded (the very weights a pull sends), or, for a
            # rejected push, the weights it computed at before; either way where it computes next.
            sent = pack(*server.snapshot(s, w))
            return s, (staleness, ok, finite_packed(sent[0])), sent, server.snapshot_version(s, w)

        self._exchange = jax.jit(exchange_packed, donate_argnums=0)
        self._pull = jax.jit(lambda s, w: server.pull(s, w, rule=rule))
        self._answer = jax.jit(answer)
        self._backup = jax.jit(lambda s, i: (*server.snapshot(s, i), server.snapshot_version(s, i)))
        self._packed_backup = jax.jit(lambda s, i: (*pack(*server.snapshot(s, i)), server.snapshot_version(s, i)))
        self._weights = jax.jit(lambda s: pack(s.params, s.model_state))

    # -- payloads in -------------------------------------------------------------------------------------------------

    def packed_payload(self, worker: int, payload: Any, model_state: Any, packed: bool | None = None) -> tuple:
        """A push's payload and model state as packed host buffers: given packed (a worker's), or packed here from
        the model's pytrees (``packed=None``: whichever it is). A misfit is a :class:`BadPush` naming the leaf or
        buffer."""
        if packed is None:
            packed = self.layout.misfit(payload) is None
        problem = self.layout.misfit(payload) if packed else self._misfit(payload)
        if problem:
            raise BadPush(f"push from worker {worker} rejected: {problem}")
        if not packed:
            payload = self.layout.pack_host(payload)
        if not self.stateful:
            return payload, ()
        if self.model_state_layout.misfit(model_state) is not None:
            model_state = self.model_state_layout.pack_host(model_state)
        return payload, model_state

    def _misfit(self, payload: Any) -> str | None:
        if jax.tree.structure(payload) != self._structure:
            return f"tree structure {jax.tree.structure(payload)} differs from the model's {self._structure}"
        for i, (x, (shape, dtype)) in enumerate(zip(jax.tree.leaves(payload), self._leaves, strict=True)):
            x_dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)  # a jax.Array: its own dtype, no copy
            if np.shape(x) != shape or x_dtype != dtype:
                return f"leaf {i} is {x_dtype}{list(np.shape(x))}, the model's is {dtype}{list(shape)}"
        return None

    def put(self, packed: tuple) -> tuple:
        """Packed buffers moved to the store's device (explicitly; those already there, a payload of a worker on
        the store's device, stay as they are: not copied, not waited for)."""
        if all(isinstance(x, jax.Array) and x.sharding == self._sharding for x in jax.tree.leaves(packed)):
            return packed
        return jax.device_put(packed, self.device)

    @property
    def zeros(self) -> tuple[tuple, tuple]:
        """A zero payload, packed (what compiles the exchange)."""
        zeros = lambda layout: tuple(np.zeros(n, d) for n, d in zip(layout.sizes, layout.dtypes, strict=True))
        return zeros(self.layout), zeros(self.model_state_layout) if self.stateful else ()

    # -- the programs ------------------------------------------------------------------------------------------------

    def exchange(self, worker: int, payload: tuple, model_state: tuple) -> Exchanged:
        """Applies a packed payload on the device (a non-finite one leaves the state as it was) and records the
        worker's pull: one program, the state updated in place; waits for its flags and answer on the host."""
        self.state, flags, sent, _ = self._exchange(self.state, self._ids[worker], payload, model_state)
        (staleness, ok, sound), sent = host((flags, sent))  # one transfer call for the flags and the answer
        return Exchanged(ok.item(), staleness.item(), sound.item(), sent)

    def dispatch(self, worker: int, payload: tuple, model_state: tuple) -> Dispatched:
        """The same exchange, dispatched without waiting: its outputs stay on the device (:meth:`settle` reads the
        flags later; the answer goes to the worker as it is)."""
        self.state, flags, sent, version = self._exchange(self.state, self._ids[worker], payload, model_state)
        return Dispatched(flags, sent, version)

    @staticmethod
    def settle(dispatched: Dispatched) -> Exchanged:
        """A dispatched exchange's flags on the host (waits for the device), its answer left where it lies."""
        staleness, ok, sound = (x.item() for x in jax.device_get(dispatched.flags))
        return Exchanged(ok, staleness, sound, dispatched.answer)

    def pull(self, worker: int) -> tuple:
        """Records ``worker``'s pull; the packed weights it computes at."""
        self.state = self._pull(self.state, self._ids[worker])
        return host(self._answer(self.state, self._ids[worker]))

    def answer(self, worker: int) -> tuple:
        """What a pull by ``worker`` would send, packed on the host (nothing recorded)."""
        return host(self._answer(self.state, self._ids[worker]))

    def backup(self, worker: int) -> tuple[Any, Any, int]:
        """``worker``'s backup as pytrees (device arrays) and its version."""
        params, model_state, version = self._backup(self.state, self._ids[worker])
        return params, model_state, int(jax.device_get(version))

    def packed_backup(self, worker: int) -> tuple[tuple, tuple, int]:
        """``worker``'s backup as packed host buffers (one program, one transfer per buffer) and its version."""
        params, model_state, version = self._packed_backup(self.state, self._ids[worker])
        return *host((params, model_state)), int(jax.device_get(version))

    def weights(self) -> tuple:
        """The server's own weights, packed on the host (a pull-side rule's answer is a look-ahead instead)."""
        return host(self._weights(self.state))

    def unpack(self, packed: tuple) -> tuple[Any, Any]:
        """Packed ``(params, model_state)`` host buffers as the model's pytrees (views, no copy)."""
        params, model_state = packed
        ms = self.model_state_layout.unpack_host(model_state) if self.stateful else None
        return self.layout.unpack_host(params), ms

    def warm_up(self) -> None:
        """Compiles the exchange and the lookups now, the exchange on a scratch copy of the state (donated; the live
        state is untouched) and a zero payload made on the device."""
        scratch = jax.jit(lambda st: jax.tree.map(jnp.copy, st))(self.state)
        g, ms = self.put(self.zeros)
        jax.block_until_ready(self._exchange(scratch, self._ids[0], g, ms))
        jax.block_until_ready(self._backup(self.state, self._ids[0]))
        jax.block_until_ready(self._weights(self.state))

    def lower(self, worker: int, payload: tuple, model_state: tuple) -> jax.stages.Lowered:
        """The exchange for a packed payload, lowered (``.compile().as_text()`` is its optimised HLO)."""
        return self._exchange.lower(self.state, self._ids[worker], *self.put((payload, model_state)))

    def lost(self) -> bool:
        """Whether a failing exchange consumed the donated state."""
        return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(self.state))

    def restore(self, state: server.ServerState) -> None:
        """Replaces the state with a checkpoint's (moved to the store's device)."""
        self.state = jax.device_put(state, self.device)


def host(packed: Any) -> Any:
    """Packed device buffers as host arrays: zero-copy views on a CPU (an answer is a fresh buffer of its own, never
    donated), one transfer per buffer from an accelerator."""
    return jax.tree.map(np.asarray, jax.device_get(packed))


def host_copy(tree: Any) -> Any:
    """A NumPy copy that owns its memory (never a view of a buffer the store will donate)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def finite_packed(buffers: tuple) -> jax.Array:
    """Whether every float of packed buffers is finite (inside a program: one read, fused with its neighbours)."""
    # x * 0 is 0 for a finite x and NaN for NaN or Inf: the sum is finite exactly when every x is. One reduction,
    # which XLA:CPU runs 2-4x faster than isfinite(x).all() (a materialised mask, then a chain of reductions).
    sums = [jnp.sum(b * 0) for b in buffers if jnp.issubdtype(b.dtype, jnp.inexact)]
    return jnp.isfinite(jnp.stack(sums).sum()) if sums else jnp.bool_(True)
