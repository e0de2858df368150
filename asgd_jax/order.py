"""The order in which workers see the data: a pure function of (key, epoch, shard, position).

In epoch e, the examples are laid out by a keyed pseudo-random permutation P_e of ``[0, N)``; shard s owns positions
``[s * S, (s + 1) * S)`` with ``S = N // num_shards`` (the remainder sits out that epoch), and the shard's k-th
minibatch is the next ``batch_size`` of its positions. Shards are disjoint within an epoch and re-drawn every epoch,
as in DC-ASGD's random re-partitioning.

P_e is a 4-round Feistel network over the smallest power-of-four domain holding N, keyed from the run's key and e,
restricted to ``[0, N)`` by cycle walking. It needs no stored permutation and costs O(batch) per minibatch, also under
``vmap`` (a stored permutation would have to be re-sorted whenever any run in a sweep crossed an epoch). It is the
same function for the simulator and for any host-side loader that must reproduce the simulator's order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from asgd_jax import errors

__all__ = ["example_index", "key_words", "member_position", "shard_indices"]

_ROUNDS = 4


def _mix(x: jax.Array, k: jax.Array) -> jax.Array:
    # A 32-bit integer hash (lowbias32) of x keyed by k: the round function of the Feistel network.
    x = x ^ k
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _feistel(x: jax.Array, keys: jax.Array, half: int) -> jax.Array:
    # keys: [..., _ROUNDS], one row per leading index of x (x: [..., n]); a single row serves every x.
    mask = jnp.uint32((1 << half) - 1)
    left, right = x >> half, x & mask
    for r in range(_ROUNDS):
        left, right = right, left ^ (_mix(right, keys[..., r, None]) & mask)
    return (left << half) | right


def key_words(key: jax.Array) -> jax.Array:
    """The uint32 words that key the data order, derived once per run from its data key."""
    return jax.random.bits(key, (_ROUNDS,), jnp.uint32)


# Jitted inline: inside a program the same operations as written out; called eagerly (a test's reference, a notebook),
# one program per shape instead of an operation at a time and a loop compiled anew on every call.
@functools.partial(jax.jit, static_argnames=("num_examples",), inline=True)
def example_index(words: jax.Array, epoch: int | jax.Array, positions: jax.Array, num_examples: int) -> jax.Array:
    """P_epoch(positions): which example sits at each position of the epoch's layout (int32, same shape).

    Args:
      words: :func:`key_words` of the run's data key.
      epoch: the epoch (int32, may be traced): a scalar, or one epoch per row of ``positions`` (shape
        ``positions.shape[:-1]``: many minibatches of different epochs in one call, as the simulator computes a
        chunk's whole schedule).
      positions: int positions in ``[0, num_examples)``.
      num_examples: N (static).
    """
    if num_examples < 1:
        raise errors.ConfigError(f"num_examples={num_examples!r} is invalid: need at least one example.")
    half = max(1, ((num_examples - 1).bit_length() + 1) // 2)
    positions = jnp.asarray(positions)
    x = jnp.atleast_1d(positions).astype(jnp.uint32)
    e = jnp.asarray(epoch).astype(jnp.uint32)
    e = e.reshape((1,) * (x.ndim - 1)) if e.ndim == 0 else e  # one epoch per row of x
    if e.shape != x.shape[: e.ndim] or e.ndim != x.ndim - 1:
        raise errors.ConfigError(
            f"epoch has shape {e.shape} and positions {positions.shape}: give one epoch, or one per row of positions "
            "(shape positions.shape[:-1])."
        )
    # Round keys of the epoch by integer hashing, not by a PRNG call: on CPU every threefry call is a rolled loop.
    rounds = (1,) * e.ndim + (_ROUNDS,)
    salt = e[..., None] * jnp.uint32(0x9E3779B9) + jnp.arange(_ROUNDS, dtype=jnp.uint32).reshape(rounds)
    keys = _mix(words.reshape(rounds), salt)  # [..., _ROUNDS]
    n = jnp.uint32(num_examples)
    step = lambda y: jnp.where(y >= n, _feistel(y, keys, half), y)
    # Cycle walking: re-apply the bijection until every value lands inside [0, N); the domain is < 4N, so this ends
    # after a few rounds, and it keeps the map a bijection of [0, N). A value inside stays put, so how many values
    # walk together does not change any of them.
    y = _feistel(x, keys, half)
    y = jax.lax.while_loop(lambda y: jnp.any(y >= n), step, y)
    return y.astype(jnp.int32).reshape(positions.shape)


# Jitted: host-side callers (loaders, test references) ask once per epoch; eagerly it would recompile every time.
@functools.partial(jax.jit, static_argnames=("num_examples", "num_shards"))
def shard_indices(key: jax.Array, epoch: int | jax.Array, num_examples: int, num_shards: int) -> jax.Array:
    """The example indices of every shard in one epoch: ``[num_shards, num_examples // num_shards]`` int32.

    A shard's k-th minibatch of the epoch is ``shard_indices(...)[shard, k * batch_size : (k + 1) * batch_size]``.

    Example:
      >>> import jax, asgd_jax
      >>> idx = asgd_jax.order.shard_indices(jax.random.key(0), epoch=0, num_examples=10, num_shards=3)
      >>> idx.shape, len(set(idx.ravel().tolist())), int(idx.max()) < 10
      ((3, 3), 9, True)
    """
    shard_size = num_examples // num_shards
    positions = jnp.arange(num_shards * shard_size, dtype=jnp.int32)
    return example_index(key_words(key), epoch, positions, num_examples).reshape(num_shards, shard_size)


@functools.partial(jax.jit, inline=True)  # (as example_index)
def member_position(words: jax.Array, epoch: jax.Array, positions: jax.Array, worker: jax.Array, sizes: jax.Array):
    """Where each of ``positions`` of a worker's epoch falls in that worker's own list of examples: a keyed
    permutation of ``[0, sizes[worker])`` per (worker, epoch), for a fixed partition (:mod:`asgd_jax.partition`),
    whose workers hold lists of different lengths.

    The same 4-round Feistel network with cycle walking as :func:`example_index`, its half-width and its bound traced
    per row (a worker's list length is a number of the run, not of its program).

    Args:
      words: :func:`key_words` of the run's data key.
      epoch, worker: int32 arrays of shape ``positions.shape[:-1]`` (a row's epoch and worker).
      positions: int32 ``[..., batch]`` positions in ``[0, sizes[worker])``.
      sizes: int32 ``[M]``, every worker's list length (each >= 1).
    """
    ones = (1,) * jnp.ndim(epoch)
    n = sizes[worker].astype(jnp.uint32)[..., None]  # [..., 1]
    bits = 32 - jax.lax.clz(jnp.maximum(n, jnp.uint32(2)) - jnp.uint32(1))  # bit length of n - 1 (at least 1)
    half = (bits + jnp.uint32(1)) // jnp.uint32(2)
    mask = (jnp.uint32(1) << half) - jnp.uint32(1)
    e, w = jnp.asarray(epoch).astype(jnp.uint32), jnp.asarray(worker).astype(jnp.uint32)
    salt = (e * jnp.uint32(0x9E3779B9) ^ w * jnp.uint32(0x85EBCA6B))[..., None]  # [..., 1]
    keys = _mix(words.reshape((*ones, _ROUNDS)), salt + jnp.arange(_ROUNDS, dtype=jnp.uint32).reshape((*ones, -1)))

    def feistel(x):
        left, right = x >> half, x & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ (_mix(right, keys[..., r, None]) & mask)
        return (left << half) | right

    y = feistel(jnp.asarray(positions).astype(jnp.uint32))
    y = jax.lax.while_loop(lambda y: jnp.any(y >= n), lambda y: jnp.where(y >= n, feistel(y), y), y)
    return y.astype(jnp.int32)
