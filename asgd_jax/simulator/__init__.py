"""The deterministic staleness simulator: asynchronous training replayed exactly, many runs at once.

The simulator is an ``init`` / ``step`` state machine over server updates. The delay model decides each update's
:class:`~asgd_jax.delays.Event` and the data order its minibatch, neither from the weights, so a chunk of updates first
computes this schedule for all of them; each step then lets the pushing worker compute its payload at the snapshot it
pulled (its gradient only depends on that snapshot and its next minibatch, so it is computed when it lands), applies
the push with :func:`asgd_jax.server.push` and records the pull with :func:`asgd_jax.server.pull`. :func:`simulate`
scans the step in chunks: between chunks it evaluates, updates the progress bar and writes a checkpoint.
:func:`sweep` vmaps the same program over keys and hyperparameters, so a grid of runs compiles once.

Compiled once per structure: a run is described by a :class:`asgd_jax.Plan`, and its programs are cached across calls,
keyed on what shapes them (the plan's structure, the loss, the rule's structure, the shapes and dtypes of the weights
and the data). Everything numeric is an argument: the initial weights, the key, the rule's numbers (a rule built by one
of :mod:`asgd_jax.rules`' factories, see :mod:`asgd_jax.recipes`), the delay model's numbers, ``local_lr`` and the
budget. A run compiles two programs: its start (the initial state) and its chunk, a loop over up to
``plan.chunk_length`` updates whose trip count is an argument, so a run's last, shorter part runs in it too; on an
accelerator, whole chunks run in a third, scanned at their known length (XLA:GPU reads the predicate of a loop of
unknown trip count on the host on every trip). With an ``eval_fn``, the evaluation is a program of its own, keyed by the
eval_fn and the weights' shapes only: runs of other rules, clusters and plans on the same model share it. A rule that is
a closure of its own is keyed by identity: build it once.


Randomness: the run's key is split into data, delay and model keys; update t draws its delay with
``fold_in(delay_key, t)``. The model's randomness (dropout, augmentation) of the worker w that pushes at t uses
``fold_in(fold_in(model_key, v), w)``, v the version w pulled (asynchronous), or splits ``fold_in(model_key, t)`` over
the workers (SSGD): what the trainer's workers know too, so its traces replay with dropout. The same call gives the
same bits, and a run resumed from a checkpoint continues exactly where it stopped. Row r of a sweep of R >= 2 runs does
not depend on the other runs or on R; a single run (``simulate``, or a sweep of one) is compiled without the run axis,
which XLA may reduce in another order: it agrees with the sweep's row to float rounding, not bit for bit.

Data: worker (shard) s draws minibatches from its own shard. A shard's j-th batch belongs to its epoch ``j // K``; in
epoch e the shards are consecutive slices of one keyed random permutation of the data (:mod:`asgd_jax.order`), so in
every epoch the shards are disjoint and the data is re-partitioned randomly across workers, as in DC-ASGD.

The package, a module per job (import from here: ``asgd_jax.simulator.simulate``; the modules are the layout):

- ``calls``: the public calls: :func:`simulate`, :func:`sweep` (:func:`prepare_sweep` checks one and binds it to its
  programs, a :class:`Prepared` to compile ahead and run), :func:`lower` (the compiled chunk, for inspection) and
  :func:`grid` (a sweep's keys and hyperparameters).
- ``checks``: a call's arguments checked, before anything is made on a device or compiled.
- ``cache``: the programs kept across calls, keyed on what shapes them (:func:`clear_cache`, :class:`RecompileWarning`);
  ``prepare`` finds a call's, building them on a miss.
- ``programs``: what a compiled program is: a run's start and chunk, built from the state machine, and an
  evaluation's; each piece compiled once per shapes on whichever thread asks first (:data:`PROGRAM_NAMES`,
  :data:`COMPILE_EVENT`, :data:`WAIT_EVENT`).
- ``chunks``: the chunk driver: a call's programs run chunk by chunk, with evaluations, the progress bar, checkpoints
  (and resuming from one), the NaN watch and the callback between chunks; the result gathered at the end.
- ``updates``: the pure state machine's step: a chunk's schedule (events, minibatches, rounds' keys), then one server
  update per row of it.
- ``state``: :class:`SimState` (with :class:`DataState` and :class:`RunKeys`), :func:`init` and
  :class:`SimulationResult`.
- ``indices``: the data order: :func:`shard_indices`, and the minibatch indices a schedule reads.

How a run flows through them: a call (``calls``) takes its :class:`asgd_jax.Plan` and arguments and has them checked
(``checks``: :data:`NONFINITE` and the rest); it splits its rule and delay model into what shapes the program and the
numbers passed to it, and asks ``cache`` for the programs of that structure, which ``programs`` builds on a miss from
``updates`` and ``state`` (one compilation per structure, the updates on a thread of their own); the chunk driver
(``chunks``) runs the start and then the chunks, evaluating, checkpointing and reporting between them, and returns the
:class:`SimulationResult`.
"""

from asgd_jax.simulator.cache import RecompileWarning, clear_cache
from asgd_jax.simulator.calls import Prepared, grid, lower, prepare_sweep, simulate, sweep
from asgd_jax.simulator.checks import NONFINITE
from asgd_jax.simulator.indices import shard_indices
from asgd_jax.simulator.programs import COMPILE_EVENT, PROGRAM_NAMES, WAIT_EVENT
from asgd_jax.simulator.state import DataState, RunKeys, SimState, SimulationResult, init

__all__ = [
    "COMPILE_EVENT",
    "NONFINITE",
    "PROGRAM_NAMES",
    "WAIT_EVENT",
    "DataState",
    "Prepared",
    "RecompileWarning",
    "RunKeys",
    "SimState",
    "SimulationResult",
    "clear_cache",
    "grid",
    "init",
    "lower",
    "prepare_sweep",
    "shard_indices",
    "simulate",
    "sweep",
]

# The objects keep the modules they are defined in (asgd_jax.simulator.calls.simulate, ...), unlike the rules'
# (asgd_jax/rules/__init__.py): nothing keys on a simulator object's module or name (the program cache keys on the
# call's arguments, a checkpoint's header on the key, the plan and the numbers, and XLA's persistent cache on the
# programs without their source locations), and a pickle of SimState or SimulationResult made before the split
# still loads, as both are importable here.
