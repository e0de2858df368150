"""The data order a run reads: per-shard minibatches, re-partitioned every epoch (or a fixed partition's).

Worker (shard) s draws minibatches from its own shard. A shard's j-th batch belongs to its epoch ``j // K``; in epoch e
the shards are consecutive slices of one keyed random permutation of the data (:mod:`asgd_jax.order`).
:func:`shard_indices` is one epoch's layout (for users and tests); :func:`batch_indices` gives the example indices a
chunk's schedule reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asgd_jax import exchange, order, partition


def shard_indices(key: jax.Array, epoch: int | jax.Array, num_examples: int, num_shards: int) -> jax.Array:
    """The example indices of every shard in one epoch of the run keyed ``key``: ``[num_shards, N // num_shards]``.

    Shard s's k-th minibatch of the epoch is ``shard_indices(...)[s, k * batch_size : (k + 1) * batch_size]``; the
    layout is :func:`asgd_jax.order.shard_indices` under the run's data key.

    Example:
      >>> import jax, asgd_jax
      >>> idx = asgd_jax.simulator.shard_indices(jax.random.key(0), epoch=0, num_examples=10, num_shards=3)
      >>> idx.shape, len(set(idx.ravel().tolist()))
      ((3, 3), 9)
    """
    return order.shard_indices(exchange.split_key(key)[0], epoch, num_examples=num_examples, num_shards=num_shards)


def batch_indices(c: Any, shard: jax.Array, taken: jax.Array) -> jax.Array:
    """Example indices of shard ``shard``'s ``taken``-th minibatch in the run of chunk context ``c``
    (:class:`asgd_jax.simulator.updates.Ctx`), ``[..., batch]`` for int arrays ``shard`` and ``taken`` of one shape
    (each minibatch in its own epoch): IID, the epoch's shard; under a fixed partition, the worker's own examples
    (:func:`asgd_jax.partition.batch_indices`)."""
    ex = c.ex
    if c.partition is not None:
        return partition.batch_indices(c.data_words, c.partition, ex.batch_size, shard, taken)
    per_epoch = ex.shard_size // ex.batch_size
    epoch, k = taken // per_epoch, taken % per_epoch
    start = shard * ex.shard_size + k * ex.batch_size
    positions = start[..., None] + jnp.arange(ex.batch_size, dtype=jnp.int32).reshape((1,) * start.ndim + (-1,))
    return order.example_index(c.data_words, epoch, positions, ex.num_examples)
