"""Models by name, behind one pure protocol the engines use.

Every model is a :class:`Model` with ``init(key) -> (params, model_state)`` and
``apply(params, model_state, x, train=False, key=None) -> (logits, model_state)``; ``model_state`` holds the non-trained
collections (BatchNorm statistics) and is an empty dict for models without any. The flax modules underneath are an
implementation detail.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from asgd_jax import cache, errors, preprocess
from asgd_jax import loss as loss_lib

__all__ = [
    "CPU_INIT_OPTIONS",
    "MODELS",
    "Evaluation",
    "Model",
    "NNX_MODELS",
    "NnxModel",
    "Transformer",
    "accuracy",
    "classification_eval",
    "classification_loss",
    "cross_entropy",
    "from_nnx",
    "get",
    "names",
]

Params = Any
ModelState = dict[str, Any]


class MLP(nn.Module):
    """Flatten, then ReLU dense layers."""

    num_classes: int
    hidden: Sequence[int] = (128, 128)

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two conv + max-pool stages and a dense head; works on 1-D (length, channels) and 2-D (h, w, channels) inputs."""

    num_classes: int
    features: Sequence[int] = (16, 32)
    hidden: int = 64

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        spatial = x.ndim - 2
        for width in self.features:
            x = nn.relu(nn.Conv(width, kernel_size=(3,) * spatial, padding="SAME")(x))
            x = nn.max_pool(x, window_shape=(2,) * spatial, strides=(2,) * spatial, padding="SAME")
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


class _BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs); the CIFAR shortcut is parameter-free (He et al. 2016, option A)."""

    features: int
    strides: int

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)
        y = nn.Conv(self.features, (3, 3), self.strides, padding="SAME", use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), 1, padding="SAME", use_bias=False)(y)
        y = norm()(y)
        if self.strides != 1 or x.shape[-1] != self.features:
            # Option A: subsample spatially and zero-pad the new channels.
            x = x[:, :: self.strides, :: self.strides, :]
            pad = self.features - x.shape[-1]
            x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (pad // 2, pad - pad // 2)))
        return nn.relu(x + y)


class CifarResNet(nn.Module):
    """ResNet-{6n+2} for 32x32 inputs: a 3x3 conv, 3 stages of n basic blocks (16/32/64 channels), global pooling."""

    num_classes: int
    blocks_per_stage: int = 3
    widths: Sequence[int] = (16, 32, 64)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.widths[0], (3, 3), padding="SAME", use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x))
        for stage, width in enumerate(self.widths):
            for block in range(self.blocks_per_stage):
                x = _BasicBlock(width, 2 if stage > 0 and block == 0 else 1)(x, train)
        return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class _Bottleneck(nn.Module):
    features: int
    strides: int

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)
        y = nn.relu(norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
        y = nn.relu(norm()(nn.Conv(self.features, (3, 3), self.strides, padding="SAME", use_bias=False)(y)))
        y = norm()(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
        if self.strides != 1 or x.shape[-1] != 4 * self.features:
            x = norm()(nn.Conv(4 * self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet50(nn.Module):
    """ResNet-50 for ImageNet (He et al. 2016): 7x7/2 stem, max-pool, bottleneck stages [3, 4, 6, 3]."""

    num_classes: int
    stages: Sequence[int] = (3, 4, 6, 3)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(64, (7, 7), 2, padding=[(3, 3), (3, 3)], use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate(self.stages):
            for block in range(blocks):
                x = _Bottleneck(64 * 2**stage, 2 if stage > 0 and block == 0 else 1)(x, train)
        return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class ConvNet(nn.Module):
    """A cuda-convnet style network (GPU A-SGD): conv 11x11/4 -> pool -> conv 5x5 -> pool -> 3 x conv 3x3 -> pool ->
    two dropout fully connected layers -> logits, ReLU throughout.

    ``width`` scales every layer (1.0: 96/256/384/384/256 channels and 4096 hidden units); ``stem_stride`` is 4 for
    ImageNet-sized inputs and 1 (with a 5x5 first kernel) for CIFAR-sized ones.
    """

    num_classes: int
    width: float = 1.0
    stem_stride: int = 4
    dropout: float = 0.5

    @nn.compact
    def __call__(self, x, train: bool = False):
        c = lambda n: max(1, round(n * self.width))
        pool = lambda y: nn.max_pool(y, (3, 3), (2, 2), padding="SAME")
        kernel = (11, 11) if self.stem_stride > 1 else (5, 5)
        x = pool(nn.relu(nn.Conv(c(96), kernel, self.stem_stride, padding="SAME")(x)))
        x = pool(nn.relu(nn.Conv(c(256), (5, 5), padding="SAME")(x)))
        for n in (384, 384, 256):
            x = nn.relu(nn.Conv(c(n), (3, 3), padding="SAME")(x))
        x = pool(x)
        x = x.reshape((x.shape[0], -1))
        for _ in range(2):
            x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(nn.Dense(c(4096))(x)))
        return nn.Dense(self.num_classes)(x)


CPU_INIT_OPTIONS: Mapping[str, Any] = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}
"""XLA's options for a model's initialisation on a CPU (random draws, once per model): LLVM's lighter pipeline and
XLA's older fusion emitters compile it 2-3x faster (the cnn 0.5 s instead of 1.2-1.4 s, ResNet-20 1.7 s instead of
3.6 s, ResNet-50 5.2 s instead of 6.9 s) to the same weights, bit for bit (``tests/test_compile.py`` pins every
built-in model against XLA's defaults; level 0 would change them). Every other program keeps XLA's defaults:
``experiments/benchmarks/README.md`` says what these options would change there."""


class Transformer(nnx.Module):
    """A small decoder-only transformer for character- or token-level language modelling: token and learned position
    embeddings, ``depth`` pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP (4x wide), a final
    LayerNorm and a linear head to ``num_classes`` logits per position (the vocabulary)."""

    def __init__(
        self, num_classes: int, seq_len: int, *, width: int = 64, depth: int = 2, heads: int = 4, rngs: nnx.Rngs
    ):
        self.check(seq_len, width=width, depth=depth, heads=heads)
        self.embed = nnx.Embed(num_classes, width, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, width)))
        self.blocks = nnx.List([_Block(width, heads, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    @staticmethod
    def check(seq_len: int, *, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        """Refuses (a ``ConfigError`` naming the value) a size that cannot build the model."""
        for name, value in (("seq_len", seq_len), ("width", width), ("depth", depth), ("heads", heads)):
            errors.int_at_least(name, value, 1)
        errors.require(width % heads == 0, "width", width, f"use a multiple of heads={heads}", "--model-options")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[-1]
        h = self.embed(tokens) + self.position[None, :length]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h))


class _Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
        h = h + self.attention(self.norm1(h), mask=mask)
        return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))


# The compiled initialisations, by (model, key signature): a model is a value (equal models are the same module with
# the same numbers), so a model built again finds its program here. The last 32 are kept.
_INITS = cache.Kept(32)


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as pure functions.

    Attributes:
      name: the name it was built by.
      module: the flax module underneath.
      input_shape: shape of one example (no batch axis).
      num_classes: number of output logits.
      dtype: ``"float32"``, or ``"bfloat16"``: the forward and backward passes compute in bf16 (weights, inputs and
        the model state are cast on the way in) while the weights, their gradients, the logits and the model state
        stay float32: mixed precision as the papers' GPU ports run it, with the server's state untouched.
    """

    name: str
    module: nn.Module
    input_shape: tuple[int, ...]
    num_classes: int
    dtype: str = "float32"

    @functools.cached_property
    def _init(self) -> Callable:
        # Jitted once per model: one compile instead of hundreds of eagerly dispatched ops for the deep models. The
        # dummy input is NumPy's: made first inside a caller's trace (jit(model.init) before any plain call, as when
        # the compiled program came from an equal model), a jnp array would be that trace's tracer, kept and leaked.
        dummy = np.zeros((1, *self.input_shape), np.float32)
        return jax.jit(lambda k: self.module.init({"params": k, "dropout": k}, dummy, train=False))

    @functools.cached_property
    def _programs(self) -> dict[Hashable, Any]:  # (a model that is not a value's own compiled initialisations)
        return {}

    def __getstate__(self) -> dict[str, Any]:
        # Compiled programs stay in their process: a copy (a Ray worker's, a pickle's) compiles its own.
        return {k: v for k, v in self.__dict__.items() if k not in ("_init", "_programs")}

    def init(self, key: jax.Array) -> tuple[Params, ModelState]:
        """Returns ``(params, model_state)`` for a batch-of-one dummy input."""
        errors.require(isinstance(key, jax.Array | np.ndarray), "key", key, "give a PRNG key, e.g. jax.random.key(0)")
        # Inside the caller's jit, vmap or eval_shape the initialisation is part of the caller's program.
        traced = isinstance(key, jax.core.Tracer)
        variables = dict(self._init(key) if traced else self._init_program(key)(key))
        params = variables.pop("params")
        return params, variables

    def _init_program(self, key: Any) -> Callable:
        """The initialisation compiled for ``key``'s shape, dtype and device (on a CPU: :data:`CPU_INIT_OPTIONS`),
        kept for every model equal to this one (a model built again by the same call, as a notebook cell or a study
        arm does, initialises without tracing, lowering or loading its program again). A model is a value: what its
        module computes follows from its fields (as the simulator's programs, keyed on its loss, assume too); a
        module that reads a global it does not hold finds the program of before until :func:`asgd_jax.cache.clear`.
        """
        # A key on another device gets a program (and weights) there; a NumPy key, the default device's.
        where = getattr(key, "sharding", None) or jax.config.jax_default_device
        options = dict(CPU_INIT_OPTIONS) if cache.platform_of(key) == "cpu" else None
        randomness = (jax.config.jax_threefry_partitionable, str(jax.config.jax_default_prng_impl))
        signature = (np.shape(key), str(key.dtype), where, tuple(sorted((options or {}).items())), randomness)
        build = lambda: cache.compile_with(self._init.lower(key), options)
        if not cache.hashable(self):  # (a module of one's own that is not a value: its programs kept on it alone)
            if signature not in self._programs:
                self._programs[signature] = build()
            return self._programs[signature]
        return _INITS.get((self, *signature), build)

    def apply(
        self,
        params: Params,
        model_state: ModelState,
        x: jax.Array,
        train: bool = False,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, ModelState]:
        """Returns ``(logits, new_model_state)``; in training mode the non-param collections are updated."""
        compute = jnp.dtype(self.dtype)
        if compute != jnp.float32:  # mixed precision: compute in bf16, hand back float32 (the casts carry gradients)
            params, model_state, x = _cast((params, model_state, x), compute)
        variables = {"params": params, **model_state}
        rngs = {"dropout": key} if key is not None else None
        if train and model_state:
            logits, updated = self.module.apply(variables, x, train=True, rngs=rngs, mutable=list(model_state))
            logits, updated = (logits, dict(updated))
        else:
            logits, updated = self.module.apply(variables, x, train=train, rngs=rngs), model_state
        if compute != jnp.float32:
            logits, updated = _cast((logits, updated), jnp.float32)
        return logits, updated

    def num_params(self, params: Params) -> int:
        """Number of trainable scalars."""
        return sum(int(jnp.size(p)) for p in jax.tree.leaves(params))


def _cast(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of ``tree`` as ``dtype`` (integers, such as labels or counters, as they are)."""
    return jax.tree.map(lambda v: v.astype(dtype) if jnp.issubdtype(jnp.result_type(v), jnp.floating) else v, tree)


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """A flax NNX module behind the same pure protocol as :class:`Model` (made by :func:`from_nnx`).

    The module is split into its parameters (``nnx.Param``), its model state (``nnx.BatchStat``: what BatchNorm
    updates in training) and the rest (random-number streams), and merged back for every call, so ``apply`` is a pure
    function the engines can ``jit``, ``vmap`` and ship to workers.
    """

    name: str
    factory: Callable[[nnx.Rngs], nnx.Module]
    input_shape: tuple[int, ...]
    num_classes: int

    @functools.cached_property
    def _skeleton(self) -> tuple[Any, Any, tuple[str, ...]]:
        graphdef, _, _, rest = nnx.split(self.factory(nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)
        flat = jax.tree_util.tree_leaves(rest, is_leaf=lambda v: isinstance(v, nnx.RngKey))
        tags = tuple(sorted({v.tag for v in flat if isinstance(v, nnx.RngKey)}))
        return graphdef, rest, tags

    def init(self, key: jax.Array) -> tuple[Params, ModelState]:
        """Builds the module with ``nnx.Rngs(key)``; returns ``(params, model_state)``."""
        _, params, stats, _ = nnx.split(self.factory(nnx.Rngs(key)), nnx.Param, nnx.BatchStat, ...)
        return params, stats

    def apply(
        self, params: Params, model_state: ModelState, x: jax.Array, train: bool = False, key: jax.Array | None = None
    ) -> tuple[jax.Array, ModelState]:
        """Returns ``(logits, new_model_state)``: the module merged, its streams reseeded with ``key``, in training or
        evaluation mode, called, and its BatchNorm statistics split out again."""
        graphdef, rest, tags = self._skeleton
        # Fresh variables at this trace level (the engines call apply inside grad, scan and vmap): a module may only
        # mutate variables made where it runs.
        fresh = lambda tree: jax.tree.map(lambda v: v, tree)
        module = nnx.merge(graphdef, fresh(params), fresh(model_state), fresh(rest))
        if key is not None and tags:
            nnx.reseed(module, **dict.fromkeys(tags, key))
        if train:
            module.train()
        else:
            module.eval()
        logits = module(x)
        if not train:
            return logits, model_state
        _, _, new_state, _ = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
        return logits, new_state

    def num_params(self, params: Params) -> int:
        """Number of trainable scalars."""
        return sum(int(jnp.size(p)) for p in jax.tree.leaves(params))


def from_nnx(
    factory: Callable[[nnx.Rngs], nnx.Module], *, input_shape: Sequence[int], num_classes: int, name: str = "nnx"
) -> NnxModel:
    """A flax NNX model for the simulator and the trainer: ``factory(rngs)`` builds the module (its ``__call__(x)``
    returns logits; ``.train()`` / ``.eval()`` switch dropout and BatchNorm).

    Example:
      >>> import jax, jax.numpy as jnp, asgd_jax
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.hidden, self.out = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.out(jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1))))
      >>> model = asgd_jax.models.from_nnx(Net, input_shape=(8, 8, 1), num_classes=10)
      >>> params, state = model.init(jax.random.key(0))
      >>> model.apply(params, state, jnp.zeros((5, 8, 8, 1)))[0].shape, model.num_params(params)
      ((5, 10), 2410)
    """
    errors.require(callable(factory), "factory", factory, "give a function rngs -> nnx.Module")
    errors.int_at_least("num_classes", num_classes, 2)
    return NnxModel(name, factory, tuple(int(d) for d in input_shape), int(num_classes))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet20": CifarResNet,
    "resnet50": ResNet50,
    "convnet": ConvNet,
}
"""Model constructors by name; each takes ``num_classes`` and its own keyword options."""

NNX_MODELS: dict[str, type[Transformer]] = {"transformer": Transformer}
"""Flax NNX models by name (:class:`NnxModel`): each takes ``num_classes``, the sequence length (the input shape's
first axis) and its own keyword options."""


def names() -> list[str]:
    """Every model :func:`get` builds by name (the linen ones, then the NNX ones)."""
    return [*MODELS, *NNX_MODELS]


def options_of(name: str) -> tuple[str, ...]:
    """The options a model by name takes (its module's fields, and ``dtype``; an NNX model's keyword arguments), for
    :func:`get` and its checks."""
    if name in NNX_MODELS:
        signature = inspect.signature(NNX_MODELS[name].__init__)
        return tuple(p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY and p.name != "rngs")
    module = MODELS[name]
    fields = [f.name for f in dataclasses.fields(module) if f.init and f.name not in ("parent", "name", "num_classes")]
    return (*fields, "dtype")


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuses (a ``ConfigError``) an option that model ``name`` does not take, naming the ones it does."""
    unknown = sorted(set(options) - set(options_of(name)))
    errors.require(
        not unknown,
        "model_options",
        dict(options),
        f"{name!r} takes {', '.join(options_of(name))}; not {', '.join(unknown)}",
        "--model-options",
    )


def get(name: str, *, num_classes: int, input_shape: Sequence[int], **options: Any) -> Model:
    """Builds a model by name.

    Args:
      name: ``"mlp"``, ``"cnn"``, ``"resnet20"`` (CIFAR, 0.27M parameters), ``"resnet50"`` (ImageNet, 25.6M),
        ``"convnet"`` (cuda-convnet style, for GPU A-SGD) or ``"transformer"`` (a decoder-only language model, flax
        NNX: ``num_classes`` is the vocabulary, ``input_shape`` ``(sequence length,)`` of token ids).
      num_classes: number of classes (> 1).
      input_shape: shape of one example, channels last: ``(8, 8, 1)`` for digits, ``(40, 1)`` for mnist1d.
      **options: forwarded to the module (``hidden=`` for ``mlp``; ``features=``, ``hidden=`` for ``cnn``;
        ``blocks_per_stage=`` for ``resnet20``; ``width=``, ``stem_stride=``, ``dropout=`` for ``convnet``;
        ``width=``, ``depth=``, ``heads=`` for ``transformer``), except
        ``dtype="bfloat16"``: the model computes in bf16 with float32 weights (:class:`Model`).

    Returns:
      A :class:`Model`.

    Example:
      >>> import jax, asgd_jax
      >>> model = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
      >>> params, state = model.init(jax.random.key(0))
      >>> logits, _ = model.apply(params, state, jax.numpy.zeros((5, 8, 8, 1)))
      >>> logits.shape
      (5, 10)
    """
    if name not in MODELS and name not in NNX_MODELS:
        known = ", ".join(sorted(names()))
        raise errors.ConfigError(f"Unknown model {name!r}. Known models: {known}.")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise errors.ConfigError(f"num_classes={num_classes!r} is invalid: use an int >= 2.")
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d < 1 for d in input_shape):
        raise errors.ConfigError(
            f"input_shape={input_shape!r} is invalid: give the shape of one example, e.g. (8, 8, 1)."
        )
    if name == "cnn" and len(input_shape) not in (2, 3):
        raise errors.ConfigError(
            f"input_shape={input_shape!r} does not fit 'cnn': it takes (length, channels) or (height, width, channels)."
        )
    if name in ("resnet20", "resnet50", "convnet") and len(input_shape) != 3:
        raise errors.ConfigError(
            f"input_shape={input_shape!r} does not fit {name!r}: it takes (height, width, channels)."
        )
    check_options(name, options)
    if name in NNX_MODELS and len(input_shape) != 1:
        raise errors.ConfigError(
            f"input_shape={input_shape!r} does not fit {name!r}: it takes (sequence length,) of token ids."
        )
    if name in NNX_MODELS:
        NNX_MODELS[name].check(input_shape[0], **options)
        factory = _NnxFactory(NNX_MODELS[name], num_classes, input_shape[0], tuple(sorted(options.items())))
        return NnxModel(name, factory, input_shape, num_classes)
    dtype = options.pop("dtype", "float32")
    errors.choice("dtype", dtype, ("float32", "bfloat16"), "--dtype")
    return Model(name, MODELS[name](num_classes=num_classes, **options), input_shape, num_classes, dtype)


@dataclasses.dataclass(frozen=True)
class _NnxFactory:
    """``factory(rngs)`` of an NNX model by name: a value, so that the same model made twice keys one program."""

    module: type[nnx.Module]
    num_classes: int
    seq_len: int
    options: tuple[tuple[str, Any], ...]

    def __call__(self, rngs: nnx.Rngs) -> nnx.Module:
        return self.module(self.num_classes, self.seq_len, rngs=rngs, **dict(self.options))


def check_labels(data: Any, num_classes: int) -> None:
    """Raises a ``ConfigError`` unless ``data["y"]`` holds int labels in ``[0, num_classes)``: an out-of-range label
    makes a one-hot of zeros, a loss and an error that are silently wrong."""
    if not isinstance(data, dict) or "y" not in data:
        return  # (the shapes check names a missing label)
    y = np.asarray(jax.device_get(data["y"]))
    errors.require(
        np.issubdtype(y.dtype, np.integer),
        "labels",
        f"{y.dtype} array",
        "give int class labels, e.g. y.astype(np.int32)",
    )
    if y.size:
        low, high = int(y.min()), int(y.max())
        errors.require(
            low >= 0 and high < num_classes,
            "labels",
            f"in [{low}, {high}]",
            f"the model has {num_classes} classes: labels must be in [0, {num_classes - 1}] (or build the model with "
            f"num_classes={high + 1})",
        )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of examples whose arg-max logit is the label."""
    return (jnp.argmax(logits, axis=-1) == labels).mean()


def classification_loss(
    model: Model | NnxModel, *, augment: bool = False, padding: int = 4, flip: bool = True
) -> loss_lib.Loss:
    """The training loss of ``model``, declared in the stateful form with auxiliary metrics.

    Args:
      model: the model.
      augment: apply :func:`asgd_jax.preprocess.random_crop_flip` (pad by ``padding``, random crop back to size,
        random horizontal flip) to every training minibatch, keyed by the update's key. Off by default: DC-ASGD's
        CIFAR-10 runs used no augmentation.
      padding: the padding of the random crop.
      flip: flip half the images horizontally (not for digits: :func:`asgd_jax.preprocess.augmentation` says what
        fits a dataset).

    Returns:
      An :class:`asgd_jax.loss_lib.Loss` (``has_model_state=True, has_aux=True``) of
      ``loss_fn(params, model_state, batch, key) -> (loss, (model_state, {"error": error}))`` for a batch
      ``{"x": inputs, "y": int labels}``; ``key`` drives dropout (and augmentation), ``error`` is the minibatch's
      training error.

    Example:
      >>> import jax, asgd_jax
      >>> ds = asgd_jax.data.load("digits")
      >>> model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
      >>> params, state = model.init(jax.random.key(0))
      >>> loss, (state, aux) = asgd_jax.classification_loss(model)(params, state, ds.test, jax.random.key(1))
      >>> float(loss) > 2.0, sorted(aux)
      (True, ['error'])
    """

    return loss_lib.Loss(_ClassificationLoss(model, augment, padding, flip), has_model_state=True, has_aux=True)


@dataclasses.dataclass(frozen=True)
class _ClassificationLoss:
    """:func:`classification_loss`'s function: a value, so that the same model's loss made twice keys one compiled
    program."""

    model: Any
    augment: bool
    padding: int
    flip: bool = True

    def check_data(self, data: Any) -> None:
        """The labels are int classes of the model (``0 <= y < num_classes``)."""
        check_labels(data, self.model.num_classes)

    def __call__(self, params, model_state, batch, key):
        x = batch["x"]
        if self.augment:
            x = preprocess.random_crop_flip(jax.random.fold_in(key, 1), x, self.padding, self.flip)
        logits, model_state = self.model.apply(params, model_state, x, train=True, key=key)
        return cross_entropy(logits, batch["y"]), (model_state, {"error": 1.0 - accuracy(logits, batch["y"])})


def classification_eval(
    model: Model | NnxModel,
    data: dict[str, Any],
    batch_size: int = 1024,
    *,
    crop: int | None = None,
    multi_crop: bool = False,
) -> Callable:
    """An ``eval_fn(params, model_state) -> {"loss", "error"}`` over a whole held-out split, in inference mode.

    The split is evaluated in fixed-size batches (``lax.map``), the remainder in one smaller batch, so memory stays
    bounded and nothing recompiles.

    Args:
      model: the model.
      data: ``{"x", "y"}`` of the held-out split.
      batch_size: evaluation batch size.
      crop: evaluate on the central ``crop x crop`` window of each image.
      multi_crop: average the logits of the ten crops of size ``crop`` (four corners, centre, and their horizontal
        flips): GPU A-SGD's multi-crop testing.
    """

    errors.require(
        isinstance(data, dict) and {"x", "y"} <= set(data), "data", type(data).__name__, "give {'x': ..., 'y': ...}"
    )
    if not np.shape(data["y"]) or int(np.shape(data["y"])[0]) == 0:
        raise errors.ConfigError("classification_eval got an empty split: give at least one example.")
    errors.positive_int("batch_size", batch_size)
    check_labels(data, model.num_classes)
    return Evaluation(model, {"x": data["x"], "y": data["y"]}, int(batch_size), crop, bool(multi_crop))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """:func:`classification_eval`'s ``eval_fn``: ``evaluation(params, model_state) -> {"loss", "error"}`` (and
    ``"perplexity"`` for a language model: labels ``[n, length]``, the loss and error per token).

    Its data is apart from its function (:meth:`evaluate` takes it as an argument), so an engine passes the held-out
    split to its compiled program as an argument rather than baking it in as a constant; two evaluations of equal
    models and settings compare equal (the data is not compared), so they key one program.
    """

    model: Any
    data: dict[str, Any] = dataclasses.field(compare=False, repr=False)
    batch_size: int = 1024
    crop: int | None = None
    multi_crop: bool = False

    def __call__(self, params, model_state) -> dict[str, jax.Array]:
        data = jax.tree.map(jnp.asarray, self.data)
        # Called eagerly (a notebook, after a run): one program per evaluation, kept without its data (an equal one
        # shares it, and the cache holds no held-out split), not its batches' loop compiled anew on every call.
        key = dataclasses.replace(self, data=None)
        if not cache.hashable(key):  # a model that is not a value: evaluated as it is
            return self.evaluate(params, model_state, data)
        return _EVALUATIONS.get(key, lambda: jax.jit(key.evaluate, inline=True))(params, model_state, data)

    def _logits(self, params, model_state, xb):
        apply = lambda v: self.model.apply(params, model_state, v, train=False)[0]
        if self.multi_crop:
            return preprocess.multi_crop_logits(apply, xb, self.crop or xb.shape[1])
        return apply(xb if self.crop is None else preprocess.center_crop(xb, self.crop))

    def _sums(self, params, model_state, xb, yb):
        logits = self._logits(params, model_state, xb)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return losses.sum(), (jnp.argmax(logits, -1) != yb).sum()

    def evaluate(self, params, model_state, data) -> dict[str, jax.Array]:
        """The loss and error on ``data`` (``{"x", "y"}``, this evaluation's split or one of its shape)."""
        x, y = data["x"], data["y"]
        n = int(y.shape[0])
        size = min(self.batch_size, n)
        full = n // size
        xs = x[: full * size].reshape(full, size, *x.shape[1:])
        ys = y[: full * size].reshape(full, size, *y.shape[1:])
        loss, wrong = jax.lax.map(lambda b: self._sums(params, model_state, *b), (xs, ys))
        loss, wrong = loss.sum(), wrong.sum()
        if full * size < n:
            rest_loss, rest_wrong = self._sums(params, model_state, x[full * size :], y[full * size :])
            loss, wrong = loss + rest_loss, wrong + rest_wrong
        # Per label: per example for classification, per token for a language model (labels [n, length]), whose
        # perplexity is exp(loss per token).
        count = y.size
        metrics = {"loss": loss / count, "error": wrong.astype(jnp.float32) / count}
        return metrics if y.ndim == 1 else {**metrics, "perplexity": jnp.exp(metrics["loss"])}


_EVALUATIONS = cache.Kept(8)  # an evaluation's program when called eagerly (jitted inline: in a program, as written)
