"""Small least-squares problems: one without noise (the trainer, store, life-cycle and Ray tests), one with noise
and a random start (the simulator's tests), and the simulator run on it."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import asgd_jax
from asgd_jax.simulator import shard_indices
from helpers.reference import lsq_grad

N, DIM, B = 96, 4, 8
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, DIM)).astype(np.float32)
DATA = {"x": X, "y": (X @ _rng.normal(size=DIM)).astype(np.float32)}
W0 = np.zeros(DIM, np.float32)


def lsq_loss(w, batch):
    return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _noisy(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, DIM)).astype(np.float32)
    y = (x @ rng.normal(size=DIM) + 0.1 * rng.normal(size=N)).astype(np.float32)
    return {"x": x, "y": y}


NOISY = _noisy()
W1 = np.random.default_rng(1).normal(size=DIM).astype(np.float32)


PLAN_FIELDS = {f.name for f in dataclasses.fields(asgd_jax.Plan)}


def plan_and_options(delay_model, kwargs):
    """``kwargs`` split into an ``asgd_jax.Plan`` (with ``delay_model``) and the call's other options."""
    plan = asgd_jax.Plan(delay_model, **{k: v for k, v in kwargs.items() if k in PLAN_FIELDS})
    return plan, {k: v for k, v in kwargs.items() if k not in PLAN_FIELDS}


BIG = {"w": W0, "big": np.zeros(1_000_000, np.float32)}  # a million parameters more: 4 MB of weights


def big_loss(params, batch):
    """The noiseless problem's loss on ``BIG`` weights: what a store restarted with weights of real size must hold."""
    return lsq_loss(params["w"], batch) + 0.0 * jnp.sum(params["big"])


def train_config(workers: int, **kwargs) -> asgd_jax.TrainConfig:
    """A ``TrainConfig`` of ``Plan(workers, <the plan fields of kwargs>)`` and the rest of ``kwargs``."""
    plan = {k: v for k, v in kwargs.items() if k in PLAN_FIELDS}
    return asgd_jax.TrainConfig(asgd_jax.Plan(workers, **plan), **{k: v for k, v in kwargs.items() if k not in plan})


def simulate_lsq(rule, delay_model, num_updates=40, key=0, **kwargs):
    """``asgd_jax.simulate`` on the noisy problem from ``W1``, batch ``B`` unless given, no progress bar; ``kwargs``
    are plan fields or options of ``simulate``."""
    kwargs.setdefault("progress", False)
    kwargs.setdefault("batch_size", B)
    plan, options = plan_and_options(delay_model, {"num_updates": num_updates, **kwargs})
    return asgd_jax.simulate(lsq_loss, rule, jnp.asarray(W1), NOISY, plan, key=jax.random.key(key), **options)


def simulate_clean(rule, delay_model, num_updates, *, key=3, params=W0, batch_size=4, loss=lsq_loss, **kwargs):
    """``asgd_jax.simulate`` on the noiseless problem the trainer tests train (from ``W0``, batch 4 unless given),
    no progress bar: what a trainer run's trace must replay to. ``key``: an int seed or a key."""
    plan, options = plan_and_options(delay_model, {"num_updates": num_updates, "batch_size": batch_size, **kwargs})
    key = jax.random.key(key) if isinstance(key, int) else key
    return asgd_jax.simulate(loss, rule, jnp.asarray(params), DATA, plan, key=key, progress=False, **options)


def replay_clean(out, rule, seed: int):
    """A trainer run's trace in ``out`` replayed on the noiseless problem (its recorded plan, the run's seed)."""
    plan = asgd_jax.trainer.replay_plan(out)
    return asgd_jax.simulate(lsq_loss, rule, W0, DATA, plan, key=jax.random.key(seed), progress=False)


class BatchOrder:
    """The documented minibatch order: shard s's j-th batch is a slice of that epoch's shard indices."""

    def __init__(self, key, num_shards, batch_size=B):
        self.key, self.num_shards, self.batch_size = jax.random.key(key), num_shards, batch_size
        self.per_epoch = (N // num_shards) // batch_size
        self.taken = [0] * num_shards

    def next(self, shard):
        epoch, k = divmod(self.taken[shard], self.per_epoch)
        self.taken[shard] += 1
        idx = np.asarray(shard_indices(self.key, epoch, N, self.num_shards))[shard]
        idx = idx[k * self.batch_size : (k + 1) * self.batch_size]
        return NOISY["x"][idx].astype(np.float64), NOISY["y"][idx].astype(np.float64)


class Column:
    """A data column over an array that does something each time it is read whole (``np.asarray`` reads it, as a
    worker's loader does): :meth:`read` is that something."""

    def __init__(self, array):
        self.array = np.asarray(array)

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)

    def __len__(self):
        return len(self.array)

    def __getitem__(self, index):
        return self.array[index]

    def read(self) -> None:
        pass

    def __array__(self, dtype=None, copy=None):
        self.read()
        return self.array if dtype is None else self.array.astype(dtype)


class SlowColumn(Column):
    """A data column every read of which takes ``DELAY`` seconds: a slow data loader, injected into any backend (it
    travels to Ray's workers with the data)."""

    DELAY = 0.05

    def read(self) -> None:
        time.sleep(self.DELAY)


PUSH_ORDER = np.random.default_rng(4).integers(0, 3, size=60)  # a recorded order of pushes by 3 workers


def replay_order(push, pull, order=PUSH_ORDER, num=3):
    """Runs a NumPy reference server over ``order`` on the noisy problem, as ``simulate_lsq`` over
    ``delays.Trace(order, num=num)`` runs: worker m computes at what it was sent, on its next minibatch, pushes, then
    pulls. ``push(worker, gradient, sent)`` and ``pull(worker) -> weights`` are the reference's."""
    batches = BatchOrder(0, num_shards=num)
    sent = {m: pull(m) for m in range(num)}
    for worker in order:
        a, y = batches.next(int(worker))
        push(int(worker), lsq_grad(sent[int(worker)], a, y), sent[int(worker)])
        sent[int(worker)] = pull(int(worker))


def replay_trainer_run(loss, rule, params, data, run, *, num, batch_size, num_updates, model_state, seed):
    """A trainer run (``run``, a :class:`asgd_jax.trainer.TrainResult`) replayed in the simulator from its trace: the
    same loss, rule, initial weights, data and seed; its result."""
    plan = asgd_jax.Plan(
        asgd_jax.delays.Trace.load(run.trace_path, num=num), batch_size=batch_size, num_updates=num_updates
    )
    return asgd_jax.simulate(
        loss, rule, params, data, plan, model_state=model_state, key=jax.random.key(seed), progress=False
    )


def straggler_waits_first(monkeypatch, straggler: int = 0) -> None:
    """In a threaded run, the other workers take their first minibatch only once ``straggler`` waits on the store's
    version (its computation began, and it can be stopped): however the threads are scheduled (a loaded machine),
    the run cannot end before the straggler's stop is in place."""
    from asgd_jax.trainer.endpoint import Endpoint
    from asgd_jax.trainer.loader import ShardLoader

    take, wait_version, waiting = ShardLoader.__next__, Endpoint.wait_version, threading.Event()

    def gated_take(self):
        if self.worker != straggler:
            waiting.wait(60)
        return take(self)

    def noted_wait(self, version, timeout):
        waiting.set()  # (only the straggler can be here first: the others wait for their first minibatch)
        return wait_version(self, version, timeout)

    monkeypatch.setattr(ShardLoader, "__next__", gated_take)
    monkeypatch.setattr(Endpoint, "wait_version", noted_wait)


def crash_at(update: int):
    """A simulator callback that stops a run as a Ctrl-C would, once ``update`` updates are done."""

    def crash(done, state):
        if done == update:
            raise KeyboardInterrupt

    return crash
