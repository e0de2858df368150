"""The store's server state on its device and the programs that change it: one program per push.

:class:`StoreState` holds the whole server state (weights, rule state, model state, every worker's backup and pulled
version, the version; :mod:`asgd_jax.server`'s) on the store's device; its :class:`Programs`, the jitted programs that
read and write it (kept per process for their structure: stores of one structure share them), are the exchange (a push
applied and its worker's pull recorded, in one program, state donated), a pull, a backup's lookup, the weights for a
snapshot. What crosses in and out is packed (:mod:`asgd_jax.packing`): one buffer per dtype whatever the leaf count. It
is not thread-safe: its one user, :class:`asgd_jax.trainer.store.ParameterStore`, calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import cache, packing, recipes, server
from asgd_jax.trainer.messages import BadPush, Checked, Computed

__all__ = [
    "Dispatched",
    "Exchanged",
    "Programs",
    "StateLayout",
    "Stored",
    "StoreState",
    "host",
    "host_copy",
    "packed_view",
    "programs",
]


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


class Stored(NamedTuple):
    """The server state as the store keeps it on its device: a handful of buffers, whatever the model's leaf count.

    Attributes:
      live: the weights, the rule's state and the model state (every push rewrites them), each packed on its own,
        one buffer per dtype: a push's update of the weights (or of a moment) then writes the buffer it reads, in
        place (packed together, their concatenation went to a new buffer, copied back: a pass over them all).
      backup_params: per dtype of the weights' packed form, an ``[M, size]`` stack: row m is worker m's backup,
        exactly the packed answer it was sent (one row written per pull, in place).
      backup_model_state: the same for the model state.
      kept: the rule's per-worker tables (leaves with a leading axis of M), kept as they are so a push updates one
        row of each in place.
      backup_version: int32 ``[M]``.
      version: int32 scalar.
    """

    live: tuple
    backup_params: tuple
    backup_model_state: tuple
    kept: tuple
    backup_version: jax.Array
    version: jax.Array


class StateLayout:
    """How a :class:`asgd_jax.server.ServerState` maps to its :class:`Stored` form and back (inside programs).

    A program's dispatch costs a few microseconds per argument: ResNet-20's state as a pytree is ~200 arguments per
    push (59 leaves of weights, of backups, of a rule's moments), as :class:`Stored` under ten.

    The programs apply the rule to a *working form* of the state. For most rules it is the state itself, the weights
    a pytree, read as slices of the stored buffers: XLA:CPU then runs a kernel or more per leaf and pass (ResNet-20:
    130 for ASGD, 308 for DC-ASGD-a). An elementwise rule (:func:`asgd_jax.recipes.elementwise`) works on the weights
    packed, one buffer per dtype (``view``, the server state of ``rule.init`` on the packed weights; its rule state
    is :meth:`asgd_jax.packing.Layout.pack_within` of the tree's): the same bits in a few kernels whatever the leaf
    count. :meth:`of` and :meth:`full` take and give the tree's form either way (a checkpoint's).

    Args:
      state: the server state's shapes, the weights a pytree.
      num_workers: M.
      layout, ms_layout: the weights' and the model state's packed forms.
      view: the working form's shapes when the rule works on the packed weights, else None.

    Attributes:
      works_packed: whether it does (``view`` was given).
    """

    def __init__(
        self,
        state: server.ServerState,
        num_workers: int,
        layout: packing.Layout,
        ms_layout: packing.Layout,
        view: server.ServerState | None = None,
    ):
        self.layout, self.ms_layout = layout, ms_layout
        self.works_packed = view is not None
        work = state if view is None else view
        self._tree_opt = state.opt_state
        # The weights as the rule sees them (a payload's, a backup's): the pytree, or the packed buffers themselves.
        self.work = packing.Layout.of(work.params)
        leaves, self._opt_def = jax.tree.flatten(work.opt_state)
        # A leaf shaped [M, *a weight's shape] is a per-worker table (a push writes one row): kept as it is.
        shapes = {np.shape(x) for x in jax.tree.leaves(work.params)}
        self._kept = [
            num_workers > 1 and np.shape(x)[:1] == (num_workers,) and np.shape(x)[1:] in shapes for x in leaves
        ]
        live = [x for x, k in zip(leaves, self._kept, strict=True) if not k]
        self.live = tuple(packing.Layout.of(x) for x in (work.params, live, work.model_state))
        # Whether the rule keeps more than scalar counters (a moment, a table: what a select would copy whole).
        self.moments = any(np.ndim(x) > 0 for x in live) or any(self._kept)

    def load(self, st: Stored) -> server.ServerState:
        """The state's working form as slices of the stored buffers (no backups: read a row with :meth:`row`)."""
        params, live, model_state = (layout.unpack(b) for layout, b in zip(self.live, st.live, strict=True))
        live, kept = iter(live), iter(st.kept)
        opt_state = jax.tree.unflatten(self._opt_def, [next(kept) if k else next(live) for k in self._kept])
        return server.ServerState(params, opt_state, model_state, None, None, st.backup_version, st.version)

    def store(self, s: server.ServerState, st: Stored) -> Stored:
        """``s``'s weights, rule state and counters (the working form) written over ``st`` (its backups kept)."""
        leaves = jax.tree.leaves(s.opt_state)
        live = [x for x, k in zip(leaves, self._kept, strict=True) if not k]
        kept = tuple(x for x, k in zip(leaves, self._kept, strict=True) if k)
        packed = tuple(layout.pack(x) for layout, x in zip(self.live, (s.params, live, s.model_state), strict=True))
        return st._replace(live=packed, kept=kept, backup_version=s.backup_version, version=s.version)

    @staticmethod
    def row(st: Stored, slot: jax.Array) -> tuple[tuple, tuple]:
        """Worker ``slot``'s backup, packed: what it computes at."""
        take = lambda stacks: tuple(jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in stacks)
        return take(st.backup_params), take(st.backup_model_state)

    def pull(self, rule: Any, s: server.ServerState, st: Stored, slot: jax.Array) -> Stored:
        """:func:`asgd_jax.server.pull` on the stored form (``s`` the working form): what a pull by ``slot`` sends
        (the weights, or the rule's look-ahead), the model state and the version recorded as its backup row, in
        place."""
        put = lambda stack, x: jax.lax.dynamic_update_index_in_dim(stack, x, slot, 0)
        sent = self.work.pack(server.sent(rule, s.params, s.opt_state, slot))
        return st._replace(
            backup_params=tuple(map(put, st.backup_params, sent)),
            backup_model_state=tuple(map(put, st.backup_model_state, self.ms_layout.pack(s.model_state))),
            backup_version=put(s.backup_version, s.version),
        )

    def of(self, s: server.ServerState) -> Stored:
        """A whole :class:`asgd_jax.server.ServerState` (the weights a pytree) in its stored form."""
        rows = lambda layout, stacks: tuple(jax.vmap(layout.pack)(stacks)) if layout.dtypes else ()
        bp, bms = rows(self.layout, s.backup_params), rows(self.ms_layout, s.backup_model_state)
        empty = Stored((), bp, bms, (), s.backup_version, s.version)
        if self.works_packed:
            s = s._replace(params=self.layout.pack(s.params), opt_state=self.layout.pack_within(s.opt_state))
        return self.store(s, empty)

    def full(self, st: Stored) -> server.ServerState:
        """The stored form as a whole :class:`asgd_jax.server.ServerState`, the weights a pytree (a checkpoint's, a
        caller's)."""
        s = self.load(st)
        if self.works_packed:
            opt_state = self.layout.unpack_within(s.opt_state, self._tree_opt)
            s = s._replace(params=self.layout.unpack(s.params), opt_state=opt_state)
        stacks = lambda layout, rows: jax.vmap(layout.unpack)(rows) if layout.dtypes else layout.unpack(())
        return s._replace(
            backup_params=stacks(self.layout, st.backup_params),
            backup_model_state=stacks(self.ms_layout, st.backup_model_state),
        )


def packed_view(init: Callable, numbers: Any, state: server.ServerState, layout: packing.Layout):
    """The working form of ``state`` (shapes) for a rule that works on the packed weights: what the store's ``init``
    (``(numbers, params, model_state) -> ServerState``) makes of ``layout``'s buffers, when its rule state is
    :meth:`asgd_jax.packing.Layout.pack_within` of the tree's (the same bytes, stored alike); None where it is not (a
    table the packing does not see: the tree's form)."""
    view = jax.eval_shape(init, numbers, layout.shapes(), state.model_state)
    packed = jax.eval_shape(layout.pack_within, state.opt_state)
    kind = lambda tree: (jax.tree.structure(tree), [(np.shape(x), x.dtype) for x in jax.tree.leaves(tree)])
    return view if kind(packed) == kind(view.opt_state) else None


class Programs:
    """The store's compiled programs for one structure: the rule's recipe (or a rule composed by hand, itself), M, and
    the weights' and model state's shapes (:func:`programs` keeps them per process). The rule's numbers are arguments
    of every program that applies it: a store at another learning rate, or a second run, compiles nothing.

    Attributes:
      layout, model_state_layout: the packed forms of the weights and of the model state (``{}``'s when stateless).
      stored_layout: the server state's stored form.
      stateful: whether the model has a state.
      init: ``(numbers, params, model_state) -> ServerState``.
      exchange, pull, answer, backup, packed_backup, weights, of, full: the programs (:class:`StoreState` calls them).
    """

    def __init__(
        self,
        rule_at: Callable[[Any], Any],
        num_workers: int,
        numbers: Any,
        params: Any,
        model_state: Any,
        elementwise: bool = False,
    ):
        self.init = jax.jit(lambda n, p, ms: server.init(rule_at(n), p, num_workers, ms))
        shapes = jax.eval_shape(self.init, numbers, params, model_state)
        self.stateful = model_state is not None
        self.layout = packing.Layout.of(shapes.params)
        self.model_state_layout = packing.Layout.of(shapes.model_state if self.stateful else {})
        view = packed_view(self.init, numbers, shapes, self.layout) if elementwise else None
        self.stored_layout = StateLayout(shapes, num_workers, self.layout, self.model_state_layout, view)
        self._computed = cache.Kept(8)  # a computed push's program, per worker period function
        self._compile(rule_at)

    def _compile(self, rule_at: Callable[[Any], Any]) -> None:
        """The very same server step the simulator scans, jitted for the store's device, on packed pushes.

        One program per push: the payload's leaves are slices of its packed buffers, the finite check is an output
        (a payload with NaN/Inf leaves the state as it was; a worker's payload comes with its check, made in the
        worker's program, :class:`~asgd_jax.trainer.messages.Checked`, and the store reads no pass of it for that:
        the program takes the flag instead, a second compilation), and so are the staleness and the answer: what the
        worker computes at next, packed, with its own finite check (weights that turned NaN/Inf). The state is kept and
        donated in its :class:`Stored` form: a few buffers to dispatch, updated in place (the weights, the rule's
        state and one backup row; not the M backups, benchmarks/store_push.py).
        """
        layout, ms_layout, stateful, sl = self.layout, self.model_state_layout, self.stateful, self.stored_layout
        work = sl.work  # (the weights as the rule sees them: the pytree, or the packed buffers themselves)

        def exchange_packed(st: Stored, numbers, w, g, ms, ok=None):
            rule = rule_at(numbers)
            # ``ok``: the payload's own check, computed where it was made (a worker's program: Checked); else here.
            ok = packing.finite((*g, *ms)) if ok is None else ok
            grads, model_state = work.unpack(g), ms_layout.unpack(ms) if stateful else None
            staleness = st.version - server.snapshot_version(st, w)
            # The stale row, read before the loop that writes that row: read inside, XLA may fuse the read into the
            # row's write and copy the whole M-row stack to order the two (tests/test_store.py pins the HLO).
            stale = work.unpack(sl.row(st, w)[0])

            def push(c):  # asgd_jax.server.exchange, on the stored form: the push ...
                st, trips = c
                s, _ = server.push(rule, sl.load(st), w, grads, model_state, stale_params=stale)
                return sl.store(s, st), trips + 1

            def pull(c):  # ... then the pull, from the new weights as the first loop wrote them (in one loop, XLA
                # fused the whole update a second time into the backup row's write: every input read twice)
                st, trips = c
                return sl.pull(rule, sl.load(st), st, w), trips + 1

            # Applied at most once: loops of ok (0 or 1) trips keep the per-worker stacks updated in place, where
            # lax.cond made XLA copy them on every push (tests/test_store.py pins it on the compiled HLO).
            once = lambda body, st: jax.lax.while_loop(
                lambda c: c[1] < ok.astype(jnp.int32), body, (st, jnp.zeros((), jnp.int32))
            )[0]
            if sl.moments:  # (a select over a per-worker table copies it whole; over a moment, XLA copied it)
                st = once(push, st)
            else:  # a rule of counters alone (ASGD): the push selected, one pass (in the loop, XLA hoisted lr * g
                # out of it into a pass of its own; ResNet-20's exchange 498 -> 389 us)
                st = jax.tree.map(lambda new, old: jnp.where(ok, new, old), push((st, 0))[0], st)
            st = once(pull, st)
            # The worker's backup: what this push's pull recorded (the very weights a pull sends), or, for a
            # rejected push, the weights it computed at before; either way where it computes next.
            sent = sl.row(st, w)
            version = server.snapshot_version(st, w)
            flags = jnp.stack([staleness, ok.astype(jnp.int32), packing.finite(sent[0]).astype(jnp.int32)])
            return st, flags, sent, version  # (the flags in one buffer: one transfer)

        def answer(st: Stored, numbers, w):  # what a pull by w would send (nothing recorded)
            s = sl.load(st)
            return work.pack(server.sent(rule_at(numbers), s.params, s.opt_state, w)), ms_layout.pack(s.model_state)

        def backup(st: Stored, w):
            return (*sl.row(st, w), server.snapshot_version(st, w))

        def unpacked_backup(st: Stored, w):
            params, model_state, version = backup(st, w)
            return layout.unpack(params), ms_layout.unpack(model_state), version

        def weights(st: Stored):
            s = sl.load(st)
            return work.pack(s.params), ms_layout.pack(s.model_state)

        self.exchange_packed = exchange_packed  # (what a computed push's program ends with)
        self.exchange = jax.jit(exchange_packed, donate_argnums=0)
        self.pull = jax.jit(lambda st, n, w: sl.pull(rule_at(n), sl.load(st), st, w), donate_argnums=0)
        self.answer = jax.jit(answer)
        self.packed_backup = jax.jit(backup)
        self.backup = jax.jit(unpacked_backup)
        self.weights = jax.jit(weights)
        self.of, self.full = jax.jit(sl.of), jax.jit(sl.full)

    def computed(self, work: Callable) -> Callable:
        """A :class:`~asgd_jax.trainer.messages.Computed` push's program for the worker period ``work``: the period at
        the worker's backup row and the exchange of its payload."""
        return self._computed.get(work, lambda: self._compile_computed(work))

    def _compile_computed(self, work: Callable) -> Callable:
        sl, exchange_packed = self.stored_layout, self.exchange_packed

        def computed(st: Stored, numbers, w, batches, model_key, local_lr):
            params, model_state = sl.row(st, w)  # where the worker computes: its backup
            payload, model_state, loss, _, finite = work(
                params, model_state, batches, model_key, local_lr, server.snapshot_version(st, w), w
            )
            return (*exchange_packed(st, numbers, w, payload, model_state, finite), loss)

        return jax.jit(computed, donate_argnums=0)


_PROGRAMS = cache.Kept(16)


def programs(rule: Any, num_workers: int, params: Any, model_state: Any) -> tuple[Programs, dict[str, Any]]:
    """The store's programs for ``rule`` with ``num_workers`` workers and these weights and model state (their shapes),
    built on first use in this process, and the rule's numbers, their arguments. The rule is rebuilt inside each
    program from its recipe (:mod:`asgd_jax.recipes`), as the simulator does; a rule composed by hand (no recipe) is
    taken as it is, and its programs kept for that very rule."""
    built = recipes.of(rule)
    numbers = {} if built is None else built.numbers
    structure = rule if built is None else built.structure
    shapes = packing.Layout.of  # (a tree's structure, shapes and dtypes: hashable)
    key = (structure, num_workers, shapes(params), shapes(model_state), shapes(numbers))

    def build() -> Programs:
        rule_at = (lambda n: rule) if built is None else (lambda n: recipes.Recipe(structure, n).build())
        return Programs(rule_at, num_workers, numbers, params, model_state, recipes.elementwise(rule))

    return _PROGRAMS.get(key, build), numbers


class StoreState:
    """A server state on ``device`` and the programs that change it (see the module's docstring).

    Args:
      rule: the update rule.
      params: initial weights w_0.
      model_state: the initial model state, or ``None``.
      num_workers: M.
      device: where the state lives.
    """

    def __init__(self, rule: optax.GradientTransformation, params: Any, model_state: Any, num_workers: int, device):
        self.device, self.num_workers = device, num_workers
        params, model_state = jax.device_put((params, model_state), device)  # explicit, never implicit
        self.programs, numbers = programs(rule, num_workers, params, model_state)
        # The rule's numbers (learning rate, lambda, ...), placed once: arguments of every program that applies it.
        self.numbers = jax.device_put(numbers, device)
        with jax.default_device(device):
            state = self.programs.init(self.numbers, params, model_state)
        self._ids = [jax.device_put(np.int32(w), device) for w in range(num_workers)]  # placed once, not per push
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self.stateful = self.programs.stateful
        # Pushes and answers cross as packed buffers (one per dtype), whatever the leaf count (asgd_jax.packing).
        self.layout, self.model_state_layout = self.programs.layout, self.programs.model_state_layout
        self._structure: Any = self.layout.treedef
        self._leaves = [(shape, self.layout.dtypes[k]) for k, _, _, shape in self.layout.leaves]
        self.sends = server.has_pull(rule)  # a pull-side rule answers with a look-ahead, not the server's weights
        self.stored: Stored = self.programs.of(jax.device_put(state, device))

    @property
    def state(self) -> server.ServerState:
        """The whole server state as a :class:`asgd_jax.server.ServerState` on the store's device (a fresh copy:
        what a checkpoint holds)."""
        return self.programs.full(self.stored)

    # -- payloads in -------------------------------------------------------------------------------------------------

    def packed_payload(self, worker: int, payload: Any, model_state: Any, packed: bool | None = None) -> tuple:
        """A push's payload and model state as packed host buffers: given packed (a worker's), or packed here from
        the model's pytrees (``packed=None``: whichever it is). A misfit is a :class:`BadPush` naming the leaf or
        buffer."""
        if isinstance(payload, Checked):
            payload = payload.payload
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

    def placed(
        self, worker: int, payload: Any, model_state: Any, packed: bool | None, in_call: bool = False
    ) -> tuple[Any, tuple]:
        """A push's payload and model state checked (:meth:`packed_payload`) and moved to the store's device,
        explicitly; a :class:`~asgd_jax.trainer.messages.Checked` one keeps its worker's flag (trusted), with it.
        ``in_call``: host buffers stay on the host, to cross in the exchange's own call (JAX's C++ path: a
        ``device_put`` costs ~100 us more a push on a 2-core host) by a caller that waits for the exchange (the
        unpipelined store: the buffers are read before the push returns)."""
        finite = _flagged(payload)[-1]
        flagged = (*self.packed_payload(worker, payload, model_state, packed), finite)
        on_host = all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(flagged))
        g, ms, finite = flagged if in_call and on_host else self.put(flagged)
        return (g if finite is None else Checked(g, finite)), ms

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

    def exchange(self, worker: int, payload: tuple | Checked, model_state: tuple) -> Exchanged:
        """Applies a packed payload on the device (a non-finite one leaves the state as it was) and records the
        worker's pull: one program, the state updated in place; waits for its flags and answer on the host. A
        :class:`~asgd_jax.trainer.messages.Checked` payload brings its finite check (its worker's)."""
        dispatched = self.dispatch(worker, payload, model_state)
        flags, sent = host((dispatched.flags, dispatched.answer))  # one transfer call for the flags and the answer
        return self.settle(dispatched._replace(flags=flags, answer=sent))

    def dispatch(self, worker: int, payload: tuple | Checked, model_state: tuple) -> Dispatched:
        """The same exchange, dispatched without waiting: its outputs stay on the device (:meth:`settle` reads the
        flags later; the answer goes to the worker as it is)."""
        with jax.transfer_guard_host_to_device("allow"):  # (a payload kept on the host crosses here: placed())
            self.stored, flags, sent, version = self.programs.exchange(
                self.stored, self.numbers, self._ids[worker], *_flagged(payload, model_state)
            )
        return Dispatched(flags, sent, version)

    def dispatch_computed(self, worker: int, push: Computed, *, state: Stored | None = None) -> tuple[Dispatched, Any]:
        """A :class:`~asgd_jax.trainer.messages.Computed` push: the worker's period at its backup row and the exchange
        of its payload, one program, dispatched like :meth:`dispatch`; and the period's loss (on the device).
        ``state``: run it on that copy instead of the live state (a warm-up)."""
        program = self.programs.computed(push.work)
        with jax.transfer_guard_host_to_device("allow"):  # the minibatches: the one transfer, in the call
            st = self.stored if state is None else state
            out = program(st, self.numbers, self._ids[worker], push.batches, push.model_key, push.local_lr)
        if state is None:
            self.stored = out[0]
        return Dispatched(*out[1:4]), out[4]

    def warm_up_computed(self, worker: int, push: Computed) -> None:
        """Compiles a computed push's program on a scratch copy of the state (the live state untouched)."""
        jax.block_until_ready(self.dispatch_computed(worker, push, state=self._scratch()))

    def _scratch(self) -> Stored:
        return _copy(self.stored)

    @staticmethod
    def settle(dispatched: Dispatched) -> Exchanged:
        """A dispatched exchange's flags on the host (waits for the device), its answer left where it lies."""
        staleness, ok, sound = np.asarray(dispatched.flags).tolist()
        return Exchanged(bool(ok), staleness, bool(sound), dispatched.answer)

    def pull(self, worker: int) -> tuple:
        """Records ``worker``'s pull; the packed weights it computes at."""
        self.stored = self.programs.pull(self.stored, self.numbers, self._ids[worker])
        return host(self.programs.packed_backup(self.stored, self._ids[worker])[:2])

    def answer(self, worker: int) -> tuple:
        """What a pull by ``worker`` would send, packed on the host (nothing recorded)."""
        return host(self.programs.answer(self.stored, self.numbers, self._ids[worker]))

    def backup(self, worker: int) -> tuple[Any, Any, int]:
        """``worker``'s backup as pytrees (device arrays) and its version."""
        params, model_state, version = self.programs.backup(self.stored, self._ids[worker])  # (one program)
        return params, model_state, int(jax.device_get(version))

    def packed_backup(self, worker: int) -> tuple[tuple, tuple, int]:
        """``worker``'s backup as packed host buffers (one program, one transfer per buffer) and its version."""
        params, model_state, version = self.programs.packed_backup(self.stored, self._ids[worker])
        return *host((params, model_state)), int(jax.device_get(version))

    def weights(self) -> tuple:
        """The server's own weights, packed on the host (a pull-side rule's answer is a look-ahead instead)."""
        return host(self.programs.weights(self.stored))

    def unpack(self, packed: tuple) -> tuple[Any, Any]:
        """Packed ``(params, model_state)`` host buffers as the model's pytrees (views, no copy)."""
        params, model_state = packed
        ms = self.model_state_layout.unpack_host(model_state) if self.stateful else None
        return self.layout.unpack_host(params), ms

    def warm_up(self, checked: bool = False) -> None:
        """Compiles the exchange and the lookups now, the exchange on a scratch copy of the state (donated; the live
        state is untouched) and a zero payload made on the device; ``checked``: the exchange of payloads that come
        with their check (a run's workers'), else the one that checks them."""
        g, ms = self.put(self.zeros)
        ok = jax.device_put(np.bool_(True), self.device) if checked else None
        jax.block_until_ready(self.programs.exchange(self._scratch(), self.numbers, self._ids[0], g, ms, ok))
        jax.block_until_ready(self.programs.packed_backup(self.stored, self._ids[0]))
        jax.block_until_ready(self.programs.weights(self.stored))
        jax.block_until_ready(self.programs.full(self.stored))  # (what a checkpoint reads: not compiled mid-run)

    def lower(self, worker: int, payload: tuple | Checked, model_state: tuple) -> jax.stages.Lowered:
        """The exchange for a packed payload (or a :class:`~asgd_jax.trainer.messages.Checked` one: the program that
        takes its flag), lowered (``.compile().as_text()`` is its optimised HLO)."""
        arguments = self.put(_flagged(payload, model_state))
        return self.programs.exchange.lower(self.stored, self.numbers, self._ids[worker], *arguments)

    def lost(self) -> bool:
        """Whether a failing exchange consumed the donated state: its buffers deleted (the exchange failed at its
        dispatch) or holding the exchange's error (it failed on the device after a pipelined dispatch went on)."""
        leaves = [x for x in jax.tree.leaves(self.stored) if isinstance(x, jax.Array)]
        if any(x.is_deleted() for x in leaves):
            return True
        try:
            jax.block_until_ready(leaves)
        except jax.errors.JaxRuntimeError:
            return True
        return False

    def restore(self, state: server.ServerState) -> None:
        """Replaces the state with a checkpoint's (moved to the store's device)."""
        self.stored = self.programs.of(jax.device_put(state, self.device))


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _flagged(payload: tuple | Checked, *model_state: tuple) -> tuple:
    """A payload's buffers, the model state when given, and its worker's finite flag (``None``: a plain payload, which
    the exchange checks itself): the exchange program's arguments after the state and the worker."""
    if isinstance(payload, Checked):
        return (payload.payload, *model_state, payload.finite)
    return (payload, *model_state, None)


def host(packed: Any) -> Any:
    """Packed device buffers as host arrays: zero-copy views on a CPU (an answer is a fresh buffer of its own, never
    donated), one transfer per buffer from an accelerator (all started at once)."""
    on_cpu = all(d.platform == "cpu" for x in jax.tree.leaves(packed) for d in getattr(x, "devices", lambda: [])())
    return jax.tree.map(np.asarray, packed if on_cpu else jax.device_get(packed))


def host_copy(tree: Any) -> Any:
    """A NumPy copy that owns its memory (never a view of a buffer the store will donate)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)
