"""The compiled programs: a run's start, chunk and scanned chunk (:func:`make_program`, the state machine of ``updates``
and ``state`` scanned and jitted), and an evaluation's (:func:`make_evaluator`).

A :class:`Program` compiles each of its pieces once per shapes of its arguments, on whichever thread asks first: the
run's own compile thread (its updates compile while its start runs), a study's (:meth:`Prepared.compile`, the next arm
while the current one runs) or the run itself; a thread that needs a piece being compiled elsewhere waits for it.
:class:`Key` is what a program depends on, :class:`Source` where it gets each run's rule and delay model from;
:data:`PROGRAM_NAMES`, :data:`COMPILE_EVENT` and :data:`WAIT_EVENT` are what the programs are called in compile logs and
:mod:`jax.monitoring` events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from asgd_jax import cache, errors, exchange, server
from asgd_jax import delays as delays_lib
from asgd_jax import loss as loss_lib
from asgd_jax.exchange import Exchange
from asgd_jax.simulator.state import SimState
from asgd_jax.simulator.state import init_state as _init
from asgd_jax.simulator.updates import Ctx as _Ctx
from asgd_jax.simulator.updates import async_schedule as _async_schedule
from asgd_jax.simulator.updates import live_slot as _live_slot
from asgd_jax.simulator.updates import round_schedule as _round_schedule
from asgd_jax.simulator.updates import step as _step
from asgd_jax.simulator.updates import sync_schedule as _sync_schedule

PROGRAM_NAMES = ("simulator_start", "simulator_chunk", "simulator_eval", "simulator_scan")
"""The names the simulator's compiled programs carry (in ``jax_log_compiles`` and :mod:`jax.monitoring` events)."""
CPU_START_OPTIONS: Mapping[str, Any] = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""XLA's options for a run's start on a CPU (the program that makes the first state, once per run): LLVM without
optimisation and XLA's older fusion emitters compile it ~3x faster (the ``mlp`` 0.19 s instead of 0.51-0.62, the
``cnn`` 0.20 s instead of 0.63-0.66), and it runs as fast (11M weights, eight backups: 153 ms against 174). The
state's weights, backups, rule state and keys are the same bits as with XLA's defaults; a first compute time (drawn
through a logarithm, or as a sum of ``n_sync`` draws) may round apart in its last bit, and with it a run's clock, not
its updates (``tests/test_compile.py``). The update and evaluation programs keep XLA's defaults: they run for the
whole run."""
COMPILE_EVENT = "/asgd_jax/simulator/compile_duration"
"""A :mod:`jax.monitoring` duration event: one program compiled (or loaded from the persistent cache), on any thread."""
WAIT_EVENT = "/asgd_jax/simulator/compile_wait_duration"
"""A :mod:`jax.monitoring` duration event: how long a run waited for a program it needed to be compiled (zero when a
compilation ahead of time, :meth:`Prepared.compile`, had finished it)."""


class Source(NamedTuple):
    """Where a program gets each run's rule and delay model from: ``rule(hparams, numbers)`` and
    ``delays(hparams, numbers)`` inside the program, keyed (``rule_key``, ``delays_key``) by what they depend on
    besides the numbers."""

    rule: Callable
    rule_key: Hashable
    delays: Callable
    delays_key: Hashable


class Key(NamedTuple):
    """What a compiled program depends on; its numbers are arguments."""

    loss: Hashable
    eval_fn: Hashable
    rule: Hashable
    delays: Hashable
    plan: Hashable
    exchange: Exchange
    avals: Hashable  # the structure, shapes and dtypes of the weights, model state and data
    runs: int | None  # None: one run (simulate); R: a sweep of R runs


class Program:
    """A run's compiled pieces, each compiled once per shapes of its arguments (and kept with the program).

    ``start(params, model_state, keys, hparams, numbers) -> state``; ``chunk(state, data, keys, hparams, numbers, n)
    -> (state, per-update metrics)``: the first ``n`` updates of a chunk of ``plan.chunk_length`` (a loop whose trip
    count is an argument: every chunk on a CPU, a run's last, shorter part elsewhere); ``scan(state, data, keys,
    hparams, numbers)``: a whole chunk, a loop of known trip count (on accelerators, :func:`scans_whole_chunks`); or
    an evaluation's program, ``eval(params, model_state, eval_data) -> {"eval_<name>": ...}``.

    :meth:`call` runs one, compiling it first if needed (ahead-of-time: ``lower(...).compile()``), so that
    :meth:`Prepared.compile` can compile a run's programs on another thread while an earlier run computes; a call that
    finds its program being compiled elsewhere waits for it instead of compiling it again.
    """

    def __init__(self, jitted: dict[str, Callable], cpu_options: Mapping[str, Mapping[str, Any]] | None = None):
        self.jitted = jitted
        self.cpu_options = dict(cpu_options or {})  # program name -> XLA's options for it on a CPU
        self._lock = threading.Lock()
        self._compiled: dict[Hashable, Any] = {}
        self._pending: dict[Hashable, threading.Event] = {}

    def compiled(self, name: str, *args: Any) -> Any:
        """The compiled ``name`` program for arguments shaped like ``args`` (arrays or ``jax.ShapeDtypeStruct``)."""
        key = (name, _aval_key(args))
        while True:
            with self._lock:
                if key in self._compiled:
                    return self._compiled[key]
                event = self._pending.get(key)
                if event is None:
                    self._pending[key] = event = threading.Event()
                    break
            event.wait()  # another thread is compiling it
        started = time.perf_counter()
        try:
            options = self.cpu_options.get(name)
            options = options if options is not None and cache.platform_of(args) == "cpu" else None
            compiled = cache.compile_with(self.jitted[name].lower(*args), options)
            with self._lock:
                self._compiled[key] = compiled
        finally:
            with self._lock:
                self._pending.pop(key, None)
            event.set()
            jax.monitoring.record_event_duration_secs(COMPILE_EVENT, time.perf_counter() - started)
        return compiled

    def call(self, name: str, *args: Any) -> Any:
        """Runs the ``name`` program on ``args``; the time it waits for a compilation is reported as
        :data:`WAIT_EVENT`."""
        started = time.perf_counter()
        compiled = self.compiled(name, *args)
        jax.monitoring.record_event_duration_secs(WAIT_EVENT, time.perf_counter() - started)
        return compiled(*args)


class Programs(NamedTuple):
    """A call's programs: its run's (start, chunk, scan), and its evaluation's, or None (no eval_fn)."""

    run: Program
    evaluator: Program | None

    @property
    def evaluates(self) -> bool:
        return self.evaluator is not None

    def evaluate(self, state: SimState, eval_data: Any) -> dict[str, jax.Array]:
        return self.evaluator.call("eval", state.server.params, state.server.model_state, eval_data)


def _aval_key(args: Any) -> Hashable:
    """What a compiled program is specialised to: the structure, shapes, dtypes and weak types of its arguments."""
    leaves, treedef = jax.tree.flatten(args)

    def one(x):
        if isinstance(x, bool | int | float):  # a Python number reaches a program weakly typed
            return ((), jnp.result_type(type(x)).name, True)
        sharding = getattr(x, "sharding", None)  # a sharded sweep's arrays: the program is partitioned for them
        spread = (sharding.mesh.devices.shape, sharding.spec) if isinstance(sharding, NamedSharding) else None
        return (tuple(np.shape(x)), str(x.dtype), bool(getattr(x, "weak_type", False)), spread)

    return treedef, tuple(one(x) for x in leaves)


def make_program(key: Key, loss: loss_lib.Loss, source: Source, ex: Exchange, length: int) -> Program:
    grad_fn = jax.value_and_grad(loss.normalized(), has_aux=True)
    batched = key.runs is not None

    def one_start(params, model_state, k, h, numbers):
        return _init(source.rule(h, numbers), params, source.delays(h, numbers), k, ex.n_sync, model_state, ex.inner)

    def one_chunk(state, data, k, h, numbers, n=None):
        del k  # the run's keys were split once, at its start: they are in the state
        rule, delays = source.rule(h, numbers), source.delays(h, numbers)
        delay_key, model_key = (jax.random.wrap_key_data(w) for w in (state.keys.delay, state.keys.model))
        c = _Ctx(
            grad_fn,
            rule,
            delays,
            ex,
            data,
            state.keys.data_words,
            numbers["local_lr"],
            model_key,
            numbers.get("partition"),
        )
        # Every update's delay key in one vectorised PRNG call per chunk (on CPU each call inside the loop is a
        # rolled loop of its own); identical to folding t in step by step.
        ts = state.server.version + jnp.arange(length, dtype=jnp.int32)
        k_delays = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(delay_key, ts)
        schedule_fn = (
            _async_schedule
            if ex.mode == "async"
            else _round_schedule
            if delays_lib.is_round_model(delays)
            else _sync_schedule
        )
        schedule, delay_state, data_state = schedule_fn(c, state, ts, k_delays, n)
        step = lambda s, x: _step(c, s, x)
        # The carry: the server, and with an inner optimizer every worker's state of it too.
        first = state.server if state.workers is None else (state.server, state.workers)
        if n is None:
            carry, metrics = jax.lax.scan(step, first, schedule)
            clock = schedule.time[-1]
        else:
            carry, metrics = _dynamic_scan(step, first, schedule, n)
            clock = jax.lax.dynamic_index_in_dim(schedule.time, n - 1, keepdims=False)
        srv, workers = (carry, None) if state.workers is None else carry
        if _live_slot(rule, delays, ex):  # the pulls of the chunk recorded versions only: slot 0's weights are w_t
            srv = server.pull(srv, 0)
        return SimState(srv, delay_state, data_state, clock, state.keys, workers), metrics

    if batched:  # the runs axis: keys and hparams per run; data, numbers and the trip count shared
        start = jax.vmap(one_start, in_axes=(None, None, 0, 0, None))
        chunk = jax.vmap(one_chunk, in_axes=(0, None, 0, 0, None, None))
        scan = jax.vmap(one_chunk, in_axes=(0, None, 0, 0, None))
    else:
        start, chunk, scan = one_start, one_chunk, one_chunk
    jitted = {
        "start": jax.jit(_named(start, PROGRAM_NAMES[0])),
        "chunk": jax.jit(_named(chunk, PROGRAM_NAMES[1]), donate_argnums=0),
        "scan": jax.jit(_named(scan, PROGRAM_NAMES[3]), donate_argnums=0),
    }
    return Program(jitted, {"start": CPU_START_OPTIONS})


def scans_whole_chunks(platform: str) -> bool:
    """Whether whole chunks run in the ``scan`` program, a loop of known trip count, beside the ``chunk`` program of a
    run's last, shorter part: on accelerators (XLA:GPU reads the predicate of a loop of unknown trip count on the host
    on every trip: a round trip per update). Not on a CPU, where the chunk program runs every chunk as fast
    (benchmarks/README.md, session 24) and a run whose budget is not a whole number of chunks compiles one program
    instead of two."""
    return platform != "cpu"


def make_evaluator(eval_fn, batched: bool, params: Any, model_state: Any) -> Program:
    """The evaluation's own program, ``(params, model_state, eval_data) -> {"eval_<name>": ...}``: one per eval_fn,
    weights' shapes and run count, shared by every program that evaluates them (a study's arms of one model and
    grid size compile it once, not once per rule and cluster). An eval_fn that returns no dict of scalars is told
    here, traced on the weights' shapes, before anything compiles."""
    evaluate, eval_data = exchange.eval_parts(eval_fn)
    one = lambda params, model_state, eval_data: _evaluate(evaluate, params, model_state, eval_data)
    jax.eval_shape(one, params, model_state, eval_data)
    fn = jax.vmap(one, in_axes=(0, 0, None)) if batched else one
    return Program({"eval": jax.jit(_named(fn, PROGRAM_NAMES[2]))})


def _named(fn: Callable, name: str) -> Callable:
    """``fn`` under ``name`` (what compile logs and :mod:`jax.monitoring` events call the program)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def _evaluate(evaluate, params: Any, model_state: Any, eval_data: Any) -> dict[str, jax.Array]:
    out = evaluate(params, model_state, eval_data)
    if not isinstance(out, Mapping):
        raise errors.ConfigError(
            f"eval_fn returned {type(out).__name__}, not a dict of scalars: return e.g. {{'error': error}}."
        )
    shapes = {k: jnp.shape(v) for k, v in out.items()}
    if any(shape != () for shape in shapes.values()):
        raise errors.ConfigError(
            f"eval_fn returned arrays of shapes {shapes}, not a dict of scalars: return e.g. {{'error': error}}."
        )
    return {f"eval_{k}": jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _dynamic_scan(step: Callable, carry: Any, xs: Any, n: jax.Array) -> tuple[Any, Any]:
    """``lax.scan(step, carry, xs)`` over the first ``n`` (traced) rows of ``xs`` only; the outputs keep every row's
    place (the rows past ``n`` are zeros). The same step as the scan's, so the same bits."""
    first = jax.tree.map(lambda a: a[0], xs)
    # Traced once: the outputs' shapes and the loop's body read the same trace (jit's own cache, the step inlined).
    step = jax.jit(step, inline=True)
    shapes = jax.eval_shape(step, carry, first)[1]
    length = jax.tree.leaves(xs)[0].shape[0]
    ys = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), shapes)

    def body(i, c):
        carry, ys = c
        carry, y = step(carry, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))
        return carry, jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0), ys, y)

    return jax.lax.fori_loop(0, n, body, (carry, ys))
