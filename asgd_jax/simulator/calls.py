"""The public calls: :func:`simulate` (one run), :func:`sweep` (R runs as one vmapped program; :func:`prepare_sweep`
checks one and binds it to its programs without running it, a :class:`Prepared`), :func:`lower` (the compiled chunk,
for inspection) and :func:`grid` (a sweep's keys and hyperparameters).

Each checks its arguments (``checks``), splits the rule and the delay model into what keys the program (a
:class:`~asgd_jax.simulator.programs.Source`) and the numbers passed to it, finds its programs (``cache``) and hands
one ``Call`` to the chunk driver (``chunks``); a sweep over several devices is spread over them here.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asgd_jax import delays as delays_lib
from asgd_jax import errors, exchange, partition, recipes
from asgd_jax.delays import links as links_lib
from asgd_jax.plan import Plan
from asgd_jax.simulator import programs as programs_lib
from asgd_jax.simulator.cache import prepare as _prepare
from asgd_jax.simulator.checks import check_devices as _check_devices
from asgd_jax.simulator.checks import check_hparams as _check_hparams
from asgd_jax.simulator.checks import check_key as _check_key
from asgd_jax.simulator.checks import check_options as _check_options
from asgd_jax.simulator.checks import check_plan as _check_plan
from asgd_jax.simulator.checks import check_rule as _check_rule
from asgd_jax.simulator.chunks import Call as _Call
from asgd_jax.simulator.chunks import compile_eval as _compile_eval
from asgd_jax.simulator.chunks import compile_updates as _compile_updates
from asgd_jax.simulator.chunks import run as _run
from asgd_jax.simulator.programs import Programs as _Programs
from asgd_jax.simulator.programs import Source as _Source
from asgd_jax.simulator.state import SimState, SimulationResult


def simulate(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
) -> SimulationResult:
    """Simulates asynchronous SGD with a parameter server, deterministically.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; with ``model_state`` given, ``loss_fn(params, model_state,
        batch, key) -> (loss, new_model_state)``; with ``has_aux=True`` the loss comes with a dict of scalar training
        metrics (``(loss, aux)``, or ``(loss, (new_model_state, aux))``). An :class:`asgd_jax.loss_lib.Loss` declares
        its own form (:func:`asgd_jax.classification_loss` returns one). A loss that does not return what its form
        says is reported before anything compiles.
      rule: the server's update rule, e.g. :func:`asgd_jax.dc_asgd` (its numbers are arguments of the compiled
        program: a rule with other numbers compiles nothing new).
      params: initial weights w_0 (every backup starts here).
      data: pytree of arrays with a leading example axis, e.g. ``{"x": x, "y": y}``; it is put on the device (pass
        device arrays to skip the copy on every call).
      plan: the run's :class:`asgd_jax.Plan` (delay model, exchange pattern, budget, cadence); default ``Plan()``:
        ``Workers(8)``, 2,000 updates, batch 32.
      key: the run's key (default ``jax.random.key(0)``); the same key gives identical bits.
      model_state: initial non-trained model collections (BatchNorm); declares the stateful ``loss_fn`` form. Workers
        compute with the state they pulled and push their updated state; the server keeps the latest.
      has_aux: the loss returns auxiliary training metrics (see ``loss_fn``).
      eval_fn: ``eval_fn(params, model_state) -> dict`` of scalars, run on the server's weights at the start and every
        ``plan.eval_interval()`` updates (``plan.eval_every``, or about twenty times a run).
      on_nonfinite: when the training loss turns NaN or Inf: ``"warn"`` (once; default), ``"stop"`` (raise
        ``FloatingPointError`` after that chunk) or ``"ignore"``.
      checkpoint_dir: if given, the state is written there atomically at chunk ends (the first past every
        ``plan.checkpoint_interval()`` updates: ``checkpoint_every``, default a tenth of the run), and a run started
        with the same arguments resumes from it (bit-identical to an uninterrupted run).
      progress: show a progress bar.
      callback: ``callback(updates_done, state)`` called after every chunk (e.g. to log or stop early by raising).

    Returns:
      A :class:`SimulationResult`.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> plan = asgd_jax.Plan(asgd_jax.delays.Workers(4), num_updates=200)
      >>> result = asgd_jax.simulate(loss, asgd_jax.dc_asgd(0.1, lam=0.5), jnp.zeros(3), data, plan, progress=False)
      >>> result.params.round(2)
      Array([ 1. , -2. ,  0.5], dtype=float32)
      >>> int(result.metrics["staleness"].max()) > 0
      True
    """
    plan = _check_plan(plan)
    options = _check_options(on_nonfinite, checkpoint_dir, progress)  # before anything is made on a device
    key = _check_key("key", jax.random.key(0) if key is None else key, batched=False)
    _check_rule(rule)
    plan = _sized(plan, params)
    delays_source, delay_numbers = _plan_delays(plan)
    source, rule_numbers = _recipe_source(rule, delays_source, ())
    program, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, eval_fn, source, None, plan.delays)
    call = _Call(
        plan=plan,
        params=params,
        model_state={} if model_state is None else model_state,
        data=jax.tree.map(jnp.asarray, data),
        eval_data=_eval_data(eval_fn),
        keys=key,
        hparams={},
        numbers=_numbers(plan, rule_numbers, delay_numbers, data),
        batched=False,
        **options,
        callback=callback,
        description="simulate",
    )
    return _run(program, call)


def lower(
    loss_fn: Callable,
    rule: optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    key: jax.Array | None = None,
    model_state: Any = None,
    has_aux: bool = False,
) -> jax.stages.Lowered:
    """The program :func:`simulate` runs a whole chunk of ``plan.chunk_length`` updates with, lowered, for inspection.

    The program is ``(state, data, key, hparams, numbers[, n]) -> (state, metrics)`` with the state donated (``n``,
    the updates to run, on a CPU, where one program runs every chunk: :func:`~asgd_jax.simulator.programs.
    scans_whole_chunks`);
    ``.compile()`` gives its optimised HLO (``.as_text()``), cost and memory analyses, so one can check what an update
    costs (see ARCHITECTURE.md, "What a step costs").

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> data = {"x": jnp.ones((256, 3)), "y": jnp.ones(256)}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> lowered = asgd_jax.simulator.lower(loss, asgd_jax.asgd(0.1), jnp.zeros(3), data, asgd_jax.Plan(chunk=5))
      >>> lowered.args_info[0][0].server.backup_params.shape  # Workers(8): one backup per worker
      (8, 3)
    """
    plan = _check_plan(plan)
    key = _check_key("key", jax.random.key(0) if key is None else key, batched=False)
    _check_rule(rule)
    plan = _sized(plan, params)
    delays_source, delay_numbers = _plan_delays(plan)
    source, rule_numbers = _recipe_source(rule, delays_source, ())
    programs, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, None, source, None, plan.delays)
    model_state = {} if model_state is None else model_state
    numbers = _numbers(plan, rule_numbers, delay_numbers, data)
    state = jax.eval_shape(programs.run.jitted["start"], params, model_state, key, {}, numbers)
    args = (state, jax.tree.map(jnp.asarray, data), key, {}, numbers)
    if programs_lib.scans_whole_chunks(jax.default_backend()):  # the program that runs a whole chunk here
        return programs.run.jitted["scan"].lower(*args)
    return programs.run.jitted["chunk"].lower(*args, np.int32(0))


def sweep(*args: Any, **kwargs: Any) -> SimulationResult:
    """Runs R simulations as one compiled program, vmapped over keys and hyperparameters.

    Everything that shapes the program (the plan) is shared; what varies per run is the key and the numeric
    hyperparameters. ``rule`` is either a rule whose numbers ``hparams`` override by name (``{"learning_rate": ...,
    "lam": ...}`` for :func:`asgd_jax.dc_asgd`), or ``rule(hparams) -> rule`` building each run's rule from its numbers
    (traced, so no Python branching on them); ``delays_fn(hparams) -> delay model`` likewise varies the delay model's
    numbers per run (its structure must be ``plan.delays``'). :func:`grid` builds ``keys`` and ``hparams`` for a
    Cartesian product. Run r equals ``simulate(...)`` with its rule and key to float rounding (see the module's notes
    on bits), and does not depend on the other runs of the sweep.

    Args:
      loss_fn, params, data, plan, model_state, has_aux, eval_fn, on_nonfinite, checkpoint_dir, progress, callback:
        as in :func:`simulate`, shared by every run.
      rule: a rule (its numbers overridden by ``hparams`` of the same names), or ``rule(hparams) -> rule``.
      keys: ``[R]`` keys, one per run.
      hparams: dict of ``[R]`` arrays (default: none).
      delays_fn: ``delays_fn(hparams) -> model``: each run's delay model (e.g. ``lambda h: Workers(8,
        straggler_prob=h["p"])``).
      description: the progress bar's label (default ``"sweep xR"``).
      devices: the devices the runs are split over (``jax.sharding`` on the runs axis, padded with copies of the
        last run to a multiple of their number, the padding dropped from the result): 16 runs on 8 GPUs use all 8.
        Default: every local accelerator; on a CPU one device (fake CPU devices share the same cores). A run's numbers
        do not depend on the split, to float rounding (XLA partitions the program; on XLA:CPU the least-squares
        sweeps of the tests are the same bits, a network's within one ulp).

    Returns:
      A :class:`SimulationResult` whose arrays have a leading run axis ``R``.

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> x = jax.random.normal(jax.random.key(1), (256, 3))
      >>> data = {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5])}
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.0, 0.5])
      >>> result = asgd_jax.sweep(loss, asgd_jax.dc_asgd(0.1), jnp.zeros(3), data, asgd_jax.Plan(num_updates=100),
      ...                         keys=keys, hparams=hp, progress=False)
      >>> result.params.shape, result.metrics["loss"].shape
      ((4, 3), (4, 100))
    """
    return prepare_sweep(*args, **kwargs).run()


class Prepared(NamedTuple):
    """A call checked and bound to its programs, not run yet (what :func:`prepare_sweep` returns).

    :meth:`compile` compiles its programs (or loads them from the persistent cache), and may run on another thread
    while an earlier call computes: a study compiles its next arm while the current one runs. :meth:`run` runs it
    (compiling what is not compiled yet, or waiting for a compilation in progress).
    """

    program: _Programs
    call: _Call

    def compile(self) -> None:
        """Compiles the programs this call will run: its start, its evaluation (shared with other calls that evaluate
        the same eval_fn on the same weights' shapes) and its chunk (on accelerators, the scanned whole chunk and,
        when the budget is not a whole number of chunks, the chunk program of its last, shorter part)."""
        c = self.call
        self.program.run.compiled("start", c.params, c.model_state, c.keys, c.hparams, c.numbers)
        _compile_eval(self.program, c)
        _compile_updates(self.program, c)

    def run(self) -> SimulationResult:
        """Runs the call: :func:`sweep`'s result."""
        return _run(self.program, self.call)


def prepare_sweep(
    loss_fn: Callable,
    rule: Callable[[Mapping[str, jax.Array]], optax.GradientTransformation] | optax.GradientTransformation,
    params: Any,
    data: Any,
    plan: Plan | None = None,
    *,
    keys: jax.Array,
    hparams: Mapping[str, Any] | None = None,
    delays_fn: Callable[[Mapping[str, jax.Array]], Any] | None = None,
    model_state: Any = None,
    has_aux: bool = False,
    eval_fn: Callable | None = None,
    on_nonfinite: str = "warn",
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    callback: Callable[[int, SimState], None] | None = None,
    description: str | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Prepared:
    """:func:`sweep`'s arguments checked (everything a user can get wrong, before anything compiles) and bound to the
    sweep's programs, without running it: ``prepare_sweep(...).run()`` is ``sweep(...)``; ``.compile()`` compiles
    ahead, e.g. on a background thread while another sweep runs.
    """
    plan = _check_plan(plan)
    options = _check_options(on_nonfinite, checkpoint_dir, progress)  # before anything is made on a device
    devices = _check_devices(devices)
    keys = _check_key("keys", keys, batched=True)
    num_runs = own_runs = int(keys.shape[0])
    hparams = _check_hparams(hparams, num_runs, per_run_arrays=delays_fn is not None)
    if len(devices) > 1:  # the runs axis split over the devices, padded with copies of the last run to fit
        num_runs = -(-own_runs // len(devices)) * len(devices)
        keys, hparams = _pad_runs((keys, hparams), num_runs)
    first = {k: np.asarray(v)[0] for k, v in hparams.items()}  # on the host: no device work to check a rule
    plan = _sized(plan, params)
    if delays_fn is not None and callable(delays_fn):
        given = delays_fn
        delays_fn = lambda h: links_lib.sized(given(h), lambda: delays_lib.message_bytes(params))  # (the weights')
    if delays_fn is None:
        delays_source, delay_numbers = _plan_delays(plan)
        first_delays = plan.delays
    else:
        errors.require(callable(delays_fn), "delays_fn", delays_fn, "give delays_fn(hparams) -> a delay model")
        first_delays = delays_fn(first)
        same = type(first_delays) is type(plan.delays) and first_delays.num_slots == plan.delays.num_slots
        errors.require(same, "delays_fn", first_delays, f"return a model of plan.delays' structure ({plan.delays!r})")
        delays_source, delay_numbers = (lambda h, n: delays_fn(h), ("fn", delays_fn)), []
    if callable(rule) and not callable(getattr(rule, "update", None)):
        source = _Source(lambda h, n: rule(h), ("fn", rule), *delays_source)
        rule_numbers = {}
        _check_rule(rule(first))
    else:
        _check_rule(rule)
        source, rule_numbers = _recipe_source(rule, delays_source, list(hparams))
    program, _ = _prepare(loss_fn, params, data, plan, model_state, has_aux, eval_fn, source, num_runs, first_delays)
    call = _Call(
        plan=plan,
        params=params,
        model_state={} if model_state is None else model_state,
        data=jax.tree.map(jnp.asarray, data),
        eval_data=_eval_data(eval_fn),
        keys=keys,
        hparams=hparams,
        numbers=_numbers(plan, rule_numbers, delay_numbers, data),
        batched=True,
        **options,
        callback=callback,
        description=description or f"sweep x{own_runs}" + (f" on {len(devices)} devices" if len(devices) > 1 else ""),
        runs=own_runs if len(devices) > 1 else None,
    )
    return Prepared(program, _spread(call, devices) if len(devices) > 1 else call)


def _pad_runs(tree: Any, runs: int) -> Any:
    """Every leaf's runs axis (its first) padded to ``runs`` with copies of its last run."""

    def pad(x):
        extra = runs - x.shape[0]
        return jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)]) if extra else x

    return jax.tree.map(pad, tree)


def _spread(call: _Call, devices: list[jax.Device]) -> _Call:
    """A sweep's arguments placed over ``devices``: the runs axis split, everything shared replicated."""
    mesh = Mesh(np.asarray(devices), ("runs",))
    split, whole = NamedSharding(mesh, PartitionSpec("runs")), NamedSharding(mesh, PartitionSpec())
    keys, hparams = jax.device_put((call.keys, call.hparams), split)
    params, model_state, data, eval_data = jax.device_put(
        (call.params, call.model_state, call.data, call.eval_data), whole
    )
    return call._replace(
        keys=keys, hparams=hparams, params=params, model_state=model_state, data=data, eval_data=eval_data
    )


sweep.__signature__ = inspect.signature(prepare_sweep).replace(return_annotation=SimulationResult)


def _eval_data(eval_fn) -> Any:
    return None if eval_fn is None else jax.tree.map(jnp.asarray, exchange.eval_parts(eval_fn)[1])


def _numbers(plan: Plan, rule_numbers: Any, delay_numbers: Any, data: Any) -> dict[str, Any]:
    local_lr = 0.0 if plan.local_lr is None else plan.local_lr
    numbers = {"rule": rule_numbers, "delays": delay_numbers, "local_lr": np.float32(local_lr)}
    drawn = partition.assignment(plan.partition, data, plan.delays.num_shards, plan.batch_size)
    return numbers if drawn is None else {**numbers, "partition": drawn}


def _recipe_source(rule: Any, delays_source: tuple[Callable, Hashable], hp_names: Sequence[str]) -> tuple:
    """A rule's source: its recipe (numbers as arguments; hparams by name override them), else the rule itself."""
    built = recipes.of(rule)
    if built is None:
        if hp_names:
            raise errors.ConfigError(
                f"hparams {sorted(hp_names)} cannot vary a rule composed by hand: pass rule_fn(hparams) -> rule, or a "
                "rule built by asgd_jax.rules.get / a rule function, whose numbers hparams may name."
            )
        return _Source(lambda h, n: rule, rule, *delays_source), {}
    built = built.vary(list(hp_names))
    structure = built.structure
    rule_fn = lambda h, n: recipes.Recipe(structure, n["rule"]).build({**n["rule"], **h})
    return _Source(rule_fn, ("recipe", structure), *delays_source), built.numbers


def _sized(plan: Plan, params: Any) -> Plan:
    """``plan`` with its links' missing message sizes set to the weights' (:func:`asgd_jax.delays.links.sized`)."""
    model = links_lib.sized(plan.delays, lambda: delays_lib.message_bytes(params))  # (only a model with links)
    return plan if model is plan.delays else plan.replace(delays=model)


def _plan_delays(plan: Plan) -> tuple[tuple[Callable, Hashable], list[jax.Array]]:
    structure, numbers = delays_lib.split(plan.delays)
    return (lambda h, n: structure.build(n["delays"]), structure), numbers


def grid(*, seeds: Sequence[int], **values: Sequence[float]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The Cartesian product of seeds and hyperparameter values, as ``(keys, hparams)`` for :func:`sweep`.

    Runs are ordered with the seed varying slowest.

    Example:
      >>> import asgd_jax
      >>> keys, hp = asgd_jax.grid(seeds=[0, 1], lam=[0.5, 1.0, 2.0])
      >>> keys.shape, hp["lam"].tolist()
      ((6,), [0.5, 1.0, 2.0, 0.5, 1.0, 2.0])
    """
    given = seeds
    seeds = list(seeds) if isinstance(seeds, Sequence | np.ndarray) and not isinstance(seeds, str) else None
    errors.require(bool(seeds), "seeds", given, "give a non-empty list of seeds, e.g. seeds=[0, 1, 2]")
    for seed in seeds:
        errors.require(
            errors.is_int(seed) and 0 <= seed < 2**32, "seeds", seeds, "use ints in [0, 2**32) (a key's seed)"
        )
    names = list(values)
    for name in names:
        vals = values[name]
        ok = isinstance(vals, Sequence | np.ndarray) and not isinstance(vals, str) and len(vals) > 0
        ok = ok and all(errors.is_number(v) and np.isfinite(v) for v in vals)
        errors.require(ok, name, vals, "give a non-empty list of finite numbers")
    rows = list(itertools.product(seeds, *(list(values[n]) for n in names)))
    keys = jax.vmap(jax.random.key)(jnp.asarray([r[0] for r in rows], jnp.uint32))
    hparams = {n: jnp.asarray([r[i + 1] for r in rows], jnp.float32) for i, n in enumerate(names)}
    return keys, hparams
