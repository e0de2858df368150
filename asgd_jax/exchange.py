"""What a worker computes between two exchanges with the server, shared by the simulator and both trainer backends.

* :class:`Exchange`: everything static about a worker's exchange period (SSGD or not, ``n_sync`` minibatches, the push
  mode, batch and shard sizes); :meth:`Exchange.create` validates it against the data before anything compiles.
* :func:`work`: the exchange period itself, ``n_sync`` minibatches from the pulled weights to the pushed payload; the
  simulator scans it and :func:`worker_function` jits it for a trainer's worker.
* The run's keys (:func:`split_key`) and the SSGD mean of the workers' payloads (:func:`mean_tree`, :func:`host_mean`).

The loss a worker differentiates is an :class:`asgd_jax.loss.Loss` (its form declared, never guessed).

Example:
  >>> import asgd_jax
  >>> asgd_jax.exchange.split_key(asgd_jax.exchange.jax.random.key(0))[0].shape
  ()
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asgd_jax import cache, errors, packing
from asgd_jax.loss import Loss

# Both engines (the simulator, the trainer's store, workers and Ray actors) come through here: JAX's persistent cache
# writes whole entries in their processes, and mends one cut short (asgd_jax.cache.atomic_entries).
cache.atomic_entries()

__all__ = [
    "Exchange",
    "batch_shapes",
    "check_params",
    "eval_parts",
    "host_mean",
    "inner_optimizer",
    "key_fingerprint",
    "key_fingerprint_tree",
    "mean_tree",
    "split_key",
    "validate",
    "work",
    "worker_function",
]


# --------------------------------------------------------------------------------------------------------------------
# The exchange period.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Everything static about a worker's exchange period, fitted to the data: it decides the compiled program.

    Attributes:
      mode, n_sync, push, batch_size: the plan's (:class:`asgd_jax.Plan`).
      num_examples: training examples N.
      shard_size: examples per worker's shard in an epoch (``N // num_shards``).
      stateful: the loss carries a model state (BatchNorm statistics).
      inner: the workers' optimizer of their local steps (:func:`inner_optimizer`; the plan's).
    """

    mode: str
    n_sync: int
    push: str
    batch_size: int
    num_examples: int
    shard_size: int
    stateful: bool
    inner: str = "sgd"

    @property
    def local_steps(self) -> bool:
        """Whether a worker takes local SGD steps between its exchanges (see :attr:`asgd_jax.Plan.local_steps`)."""
        return self.push == "delta" or (self.n_sync > 1 and self.push != "accumulate")

    @classmethod
    def create(cls, plan: Any, data: Any, *, stateful: bool = False) -> Exchange:
        """The plan's exchange fitted to the data (a batch must fit in a worker's shard, or under a fixed partition in
        every worker's own examples: :meth:`asgd_jax.partition.Partition.assign` checks those), before anything is
        traced."""
        num_examples = _num_examples(data)
        num_shards = plan.delays.num_shards
        shard_size = num_examples // num_shards
        if plan.batch_size > shard_size and plan.partition.iid:
            raise errors.ConfigError(
                f"batch_size={plan.batch_size} is larger than a shard: {num_examples} examples over {num_shards} "
                f"shards leaves {shard_size} per shard. Lower batch_size or the number of workers."
            )
        return cls(
            plan.mode, plan.n_sync, plan.push, plan.batch_size, num_examples, shard_size, bool(stateful), plan.inner
        )

    @property
    def keeps_inner_state(self) -> bool:
        """Whether each worker keeps an optimizer state across its exchanges (an ``inner`` optimizer but plain SGD)."""
        return self.inner != "sgd"


def validate(loss: Loss, data: Any, params: Any, model_state: Any, plan: Any) -> Exchange:
    """Everything an engine checks before it starts: the plan's exchange against the data, finite initial weights,
    and the loss's declared form on a minibatch's shapes. Returns the run's :class:`Exchange`."""
    ex = Exchange.create(plan, data, stateful=loss.has_model_state)
    check_params(params)
    loss.check_data(data)
    loss.check(params, {} if model_state is None else model_state, batch_shapes(data, plan.batch_size))
    return ex


def batch_shapes(data: Any, batch_size: int) -> Any:
    """The shapes and dtypes of one minibatch of ``data`` (abstract: nothing is sliced or copied)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((batch_size, *np.shape(a)[1:]), jnp.result_type(a)), data)


def check_params(params: Any) -> None:
    """Raises a ``ConfigError`` unless ``params`` is a pytree of finite float arrays (the initial weights)."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise errors.ConfigError(f"params={params!r} holds no arrays: pass the model's initial weights (a pytree).")
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise errors.ConfigError(
                f"params hold a leaf of type {getattr(leaf, 'dtype', type(leaf).__name__)}: the weights must be float "
                "arrays (e.g. jnp.zeros(3), not [0, 0, 0] or jnp.zeros(3, jnp.int32))."
            )
    if not all(bool(np.all(np.isfinite(x))) for x in jax.device_get(leaves)):
        raise errors.ConfigError("params hold NaN or Inf: start from finite weights (check the initialisation).")


def _num_examples(data: Any) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise errors.ConfigError(
            "data is empty: pass a pytree of arrays with a leading example axis, e.g. {'x': x, 'y': y}."
        )
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise errors.ConfigError(
            f"data leaves have leading sizes {sorted(sizes)}: every leaf needs the same leading example axis."
        )
    return sizes.pop()


def inner_optimizer(name: str, learning_rate: Any) -> optax.GradientTransformation:
    """A worker's optimizer of its local steps by name (:data:`asgd_jax.plan.INNER`), at ``learning_rate`` (the plan's
    ``local_lr``, a traced number): ``"sgd"``, ``"momentum"`` (Nesterov, 0.9) or ``"adamw"`` (optax's defaults)."""
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=0.9, nesterov=True)
    if name == "adamw":
        return optax.adamw(learning_rate)
    errors.choice("inner", name, ("sgd", "momentum", "adamw"), "--inner")
    return optax.sgd(learning_rate)


def work(
    grad_fn: Callable,
    ex: Exchange,
    params0,
    model_state0,
    batches,
    key,
    local_lr,
    inner_state=None,
    steps=None,
    unroll: int = 1,
):
    """One worker's exchange period: ``n_sync`` minibatches (``batches``, stacked) from the pulled weights.

    ``grad_fn`` is ``jax.value_and_grad(loss.normalized(), has_aux=True)``. Returns ``(payload, model_state, loss,
    aux)``, the loss and aux averaged over the minibatches. With ``inner_state`` (the worker's state of its inner
    optimizer, :attr:`Exchange.inner`) the local steps are that optimizer's, and the new state ends the tuple. With
    ``steps`` (DyLU: an int32 below ``n_sync``) only the first ``steps`` minibatches count: the later ones change
    nothing. ``unroll``: the local steps' scan unrolled by this many (XLA:CPU runs a rolled scan's convolutions
    several times slower than straight-line code); the same arithmetic (XLA may round an inner optimizer's masked
    DyLU steps differently).
    """
    if inner_state is not None or steps is not None:
        state = () if inner_state is None else inner_state
        out = _work_inner(grad_fn, ex, params0, model_state0, batches, key, local_lr, state, steps, unroll)
        return out if inner_state is not None else out[:4]
    if ex.n_sync == 1:
        (loss, (model_state, aux)), g = grad_fn(params0, model_state0, jax.tree.map(lambda b: b[0], batches), key)
        payload = jax.tree.map(lambda x: local_lr * x, g) if ex.push == "delta" else g
        return payload, model_state, loss, aux
    body = functools.partial(_local_step, grad_fn, ex, params0, key, local_lr)
    first, xs = _first_carry(params0, model_state0), (batches, jnp.arange(ex.n_sync))
    carry, (losses, auxes) = jax.lax.scan(body, first, xs, unroll=unroll)
    return _period_end(ex, params0, carry, losses, auxes)


def _work_inner(
    grad_fn: Callable, ex: Exchange, params0, model_state0, batches, key, local_lr, inner_state, steps, unroll: int
):
    """:func:`work` with the worker's inner optimizer (plain SGD when ``inner_state`` is ``()``) and its own number of
    steps (``steps``; None: all): every counted minibatch's gradient summed and stepped with it."""
    plain = isinstance(inner_state, tuple) and not inner_state
    opt = None if plain else inner_optimizer(ex.inner, local_lr)

    def step(carry, inputs):
        new, out = _local_step(grad_fn, ex, params0, key, local_lr, carry, inputs, opt)
        if steps is not None:  # DyLU: a step past the worker's own changes nothing
            new = jax.tree.map(lambda n, o: jnp.where(inputs[1] < steps, n, o), new, carry)
        return new, out

    first = (*_first_carry(params0, model_state0), inner_state)
    carry, (losses, auxes) = jax.lax.scan(step, first, (batches, jnp.arange(ex.n_sync)), unroll=unroll)
    if steps is not None:  # the loss and metrics of the counted minibatches
        weight = (jnp.arange(ex.n_sync) < steps).astype(jnp.float32) * ex.n_sync / steps
        losses, auxes = losses * weight, jax.tree.map(lambda a: a * weight, auxes)
    return (*_period_end(ex, params0, carry[:3], losses, auxes), carry[3])


def _first_carry(params0, model_state0):
    return params0, model_state0, jax.tree.map(jnp.zeros_like, params0)


def _local_step(grad_fn: Callable, ex: Exchange, params0, key, local_lr, carry, inputs, opt=None):
    """The i-th minibatch of an exchange period: its gradient, summed, and a local step (unless ``accumulate``,
    whose gradients are all taken at the pulled weights): plain SGD, or with ``opt`` the worker's inner optimizer,
    whose state then ends ``carry``."""
    params, model_state, acc, *inner = carry
    batch, i = inputs
    local_steps = ex.push != "accumulate"
    at = params if local_steps else params0
    (loss, (model_state, aux)), g = grad_fn(at, model_state, batch, jax.random.fold_in(key, i))
    acc = jax.tree.map(jnp.add, acc, g)
    if local_steps and opt is None:
        params = jax.tree.map(lambda p, x: p - local_lr * x, params, g)
    elif local_steps:
        updates, opt_state = opt.update(g, inner[0], params)
        params, inner = optax.apply_updates(params, updates), [opt_state]
    return (params, model_state, acc, *inner), (loss, aux)


def _period_end(ex: Exchange, params0, carry, losses, auxes):
    params, model_state, acc = carry
    # "delta" pushes the descent direction w_pulled - w_local, which the server's rule treats like a gradient.
    payload = jax.tree.map(jnp.subtract, params0, params) if ex.push == "delta" else acc
    return payload, model_state, losses.mean(), jax.tree.map(jnp.mean, auxes)


CPU_UNROLL = 16
"""The longest exchange period a CPU worker runs as one program, its local steps unrolled (:func:`period_loop`)."""


def period_loop(platform: str, n_sync: int) -> tuple[str, int]:
    """How a worker on ``platform`` compiles an exchange period of ``n_sync`` local steps: ``(loop, unroll)`` for
    :func:`worker_function`.

    An accelerator runs the period as one rolled ``lax.scan``. XLA:CPU runs a rolled scan's convolutions several times
    slower than straight-line code (and a partly unrolled one too: measured at 0.33 of a plain loop's rate on the
    ``cnn``, where the fully unrolled period makes 1.0-1.15 and a program per step 0.8-0.9), so a CPU worker's period
    is unrolled into one program up to :data:`CPU_UNROLL` steps, whose compilation grows with it (ResNet-20: 15 s at
    16 steps against 5.5 s for a program per step); a longer one is a program per step, called from Python.

    Example:
      >>> period_loop("cpu", 4), period_loop("cpu", 64), period_loop("gpu", 64)
      (('scan', 4), ('steps', 1), ('scan', 1))
    """
    if platform != "cpu" or n_sync == 1:
        return "scan", 1
    return ("scan", n_sync) if n_sync <= CPU_UNROLL else ("steps", 1)


def worker_function(
    loss: Loss,
    ex: Exchange,
    num_workers: int,
    layouts: tuple[Any, Any],
    *,
    loop: str = "scan",
    dylu: bool = False,
    unroll: int = 1,
) -> Callable:
    """A trainer worker's exchange period, jitted: ``(params, model_state, batches, model_key, local_lr, version,
    worker) -> (payload, model_state, loss, aux, finite)``: :func:`work` with the simulator's keys, so a recorded run
    replays. ``local_lr`` is a number like the others, an argument (float32; 0 without local steps): runs at other
    local learning rates share the program.

    The weights come in and the payload and model state go out packed (``layouts``: the weights' and the model
    state's :class:`asgd_jax.packing.Layout`): one buffer per dtype to move, unpacked and packed inside the program.
    ``finite`` is the payload's check (:func:`asgd_jax.packing.finite` of it and the model state), made here, on the
    worker's device, so that the store, which applies every worker's pushes in turn, need not read it again.

    ``loop``: how ``n_sync > 1`` local steps are compiled (:func:`period_loop` chooses per platform). ``"scan"``: one
    program (a GPU or TPU runs the period without asking the host), its scan unrolled by ``unroll``; ``"steps"``: one
    program per minibatch, called ``n_sync`` times from Python. The same arithmetic every way, the same bits but for an
    inner optimizer's DyLU period (to float rounding); the replay tests hold for each. With an inner optimizer
    (:attr:`Exchange.keeps_inner_state`) the function is one program taking the worker's state of it last and giving
    the new state last. ``dylu``: it takes the worker's own number of steps (an int32 on its devices) last of all,
    one program whatever the device (:func:`work`'s ``steps``).

    Kept per process for its arguments (a second run of the same loss and shapes compiles nothing)."""
    key = (loss, ex, num_workers, layouts, loop, dylu, unroll)
    return _WORKER_FUNCTIONS.get(key, lambda: _worker_function(*key))


_WORKER_FUNCTIONS = cache.Kept(16)


def _worker_function(
    loss: Loss, ex: Exchange, num_workers: int, layouts: tuple[Any, Any], loop: str, dylu: bool, unroll: int
) -> Callable:
    layout, state_layout = layouts

    def packed(payload, ms, value, aux):
        g, m = layout.pack(payload), state_layout.pack(ms)
        return g, m, value, aux, packing.finite((*g, *m))

    grad_fn = jax.value_and_grad(loss.normalized(), has_aux=True)

    def model_key(k, v, w):  # the update's model key is made on the device from explicit inputs
        # SSGD splits the update's key over the workers; an asynchronous worker folds in the version it pulled, then
        # its id (see asgd_jax.simulator).
        k = jax.random.fold_in(k, v)
        return jax.random.split(k, num_workers)[w] if ex.mode == "sync" else jax.random.fold_in(k, w)

    def run(p, ms, b, k, lr, v, w, *own):  # own: the worker's inner-optimizer state (first), its DyLU steps (last)
        inner = own[:1] if ex.keeps_inner_state else ()
        steps = own[-1] if dylu else None
        params, model_state, key = layout.unpack(p), state_layout.unpack(ms), model_key(k, v, w)
        out = work(grad_fn, ex, params, model_state, b, key, lr, *inner, steps=steps, unroll=unroll)
        return (*packed(*out[:4]), *out[4:])

    # One program whatever the backend with a worker's own state or steps (the local steps scan), or when asked to.
    if dylu or ex.keeps_inner_state or loop == "scan" or ex.n_sync == 1:
        return jax.jit(run)

    @jax.jit
    def start(p, ms, k, v, w):
        params0 = layout.unpack(p)
        return params0, _first_carry(params0, state_layout.unpack(ms)), model_key(k, v, w)

    def one_step(params0, key, lr, carry, batches, i):
        batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)
        return _local_step(grad_fn, ex, params0, key, lr, carry, (batch, i))

    step = jax.jit(one_step)

    @jax.jit
    def end(params0, carry, losses, auxes):
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
        return packed(*_period_end(ex, params0, carry, jnp.stack(losses), stacked))

    indices: dict[Any, list[jax.Array]] = {}  # the minibatch numbers, placed once per device group

    def run_steps(p, ms, b, k, lr, v, w):
        params0, carry, key = start(p, ms, k, v, w)
        sharding = v.sharding
        if sharding not in indices:
            indices[sharding] = [jax.device_put(np.int32(i), sharding) for i in range(ex.n_sync)]
        losses, auxes = [], []
        for i in indices[sharding]:
            carry, (value, aux) = step(params0, key, lr, carry, b, i)
            losses.append(value)
            auxes.append(aux)
        return end(params0, carry, losses, auxes)

    return run_steps


# --------------------------------------------------------------------------------------------------------------------
# Keys and means.
# --------------------------------------------------------------------------------------------------------------------


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A run's key split into its ``(data, delay, model)`` keys: the data order, the delay model's draws and the
    model's randomness."""
    data_key, delay_key, model_key = jax.random.split(key, 3)
    return data_key, delay_key, model_key


def key_fingerprint(keys: jax.Array) -> str:
    """A short hash of a key (or of an array of keys), to tell runs apart in checkpoint headers."""
    return hashlib.sha256(np.asarray(jax.random.key_data(keys)).tobytes()).hexdigest()[:16]


def eval_parts(eval_fn: Callable) -> tuple[Callable, Any]:
    """``eval_fn`` as ``(evaluate(params, model_state, data) -> dict, data)``: an evaluation that carries its data
    (:class:`asgd_jax.models.Evaluation`) hands it over, so a compiled program takes the held-out split as an argument
    instead of a constant; any other ``eval_fn(params, model_state)`` is taken as it is (with no data)."""
    if hasattr(eval_fn, "evaluate") and callable(eval_fn.evaluate) and hasattr(eval_fn, "data"):
        return eval_fn.evaluate, eval_fn.data
    return (lambda params, model_state, data: eval_fn(params, model_state)), None


def key_fingerprint_tree(tree: Any) -> str:
    """A short hash of a pytree of numbers (a run's hyperparameters), to tell runs apart in checkpoint headers."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    return digest.hexdigest()[:16]


def mean_tree(tree: Any) -> Any:
    """The SSGD mean over a leading worker axis, on the device: floats averaged, integers taken from worker 0."""
    return jax.tree.map(
        lambda x: x.mean(axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0],
        tree,
    )


def host_mean(trees: list[Any]) -> Any:
    """The SSGD mean of the workers' payloads on the host, in worker order (what the trainers apply): floats averaged
    (a 16-bit one in float32, as ``jnp.mean`` and :func:`mean_tree` do), integers taken from worker 0, each float mean
    in a buffer a CPU device takes without a copy (:func:`asgd_jax.packing.aligned_empty`). NumPy's sum over the rows,
    divided by M: within a last bit of :func:`mean_tree`'s, which XLA adds in an order of its own and multiplies by
    1 / M."""

    def mean(*xs):
        x = np.asarray(xs[0])
        if not jnp.issubdtype(x.dtype, jnp.inexact):  # (NumPy's own test says no for bfloat16)
            return x
        wide = np.float32 if x.dtype.itemsize == 2 else None
        out = packing.aligned_empty(x.shape, x.dtype)
        out[...] = np.mean(np.stack(xs), axis=0, dtype=wide)  # (the conversion of .astype(x.dtype))
        return out

    return jax.tree.map(mean, *trees)
