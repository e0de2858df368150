"""Host-side minibatches for one worker: its shard of every epoch, in the simulator's order, prefetched on a thread.

A :class:`ShardLoader` is what a trainer's worker reads when the data does not live on the device: it walks the same
layout as the simulator (:func:`asgd_jax.order.shard_indices` under the run's data key), so worker w's k-th batch
here is the simulator's worker w's k-th batch, which is what makes a recorded run replayable; under a fixed partition
(:mod:`asgd_jax.partition`) it walks the worker's own examples as the simulator does. Batches have a fixed shape (the
remainder of a shard sits out the epoch); a background thread, started at the first minibatch taken, keeps
``prefetch`` blocks of them ready, a block gathered from in-memory NumPy arrays with one indexing per array (up to
:data:`BLOCK_BYTES`; the batches views of it), so a worker's minibatch costs it no hand-off between threads but one a
block. A transform that fails on a batch of a block hands over the batches before it first, then the error.

Example:
  >>> import numpy as np, jax, asgd_jax
  >>> data = {"x": np.arange(20.0)[:, None], "y": np.arange(20)}
  >>> from asgd_jax.trainer.loader import ShardLoader
  >>> with ShardLoader(data, worker=1, num_workers=2, batch_size=4, key=jax.random.key(0)) as it:
  ...     batch = next(it)
  >>> batch["x"].shape, batch["y"].shape
  ((4, 1), (4,))
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors, exchange, order, partition

__all__ = ["BLOCK_BYTES", "ShardLoader"]

BLOCK_BYTES = 1 << 20
"""The bytes of an in-memory source one block of its batches gathers at most, before any transform (at least one
batch, at most :data:`MAX_BLOCK` of them): gathered with one indexing per array, handed to the worker in one queue
operation."""

MAX_BLOCK = 64
"""The most batches in one block."""


class ShardLoader(Iterator[dict[str, np.ndarray]]):
    """Iterates one worker's minibatches forever (epoch after epoch), from a background thread.

    Args:
      source: a dict of arrays with a leading example axis, or a random-access source (``len(source)`` and
        ``source[i] -> dict``, e.g. :func:`asgd_jax.data.tfds_source`).
      worker: this worker's shard, in ``[0, num_workers)``.
      num_workers: number of shards.
      batch_size: examples per batch (fixed).
      key: the run's key (the same key gives the simulator's order).
      transform: optional ``transform(batch) -> batch`` applied on the host thread (decoding, normalisation).
      start_batch: how many of this worker's batches to skip (resume).
      prefetch: blocks of batches kept ready (:data:`BLOCK_BYTES`).
      assignment: a fixed partition's :class:`asgd_jax.partition.Assignment` (the run's, every worker the same);
        None: IID shards re-dealt every epoch.
    """

    def __init__(
        self,
        source: Mapping[str, np.ndarray] | Any,
        *,
        worker: int,
        num_workers: int,
        batch_size: int,
        key: jax.Array,
        transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
        start_batch: int = 0,
        prefetch: int = 2,
        assignment: partition.Assignment | None = None,
    ):
        self._arrays = isinstance(source, Mapping)
        n = len(next(iter(source.values()))) if self._arrays else len(source)
        checks = (
            ("num_workers", num_workers, 1),
            ("batch_size", batch_size, 1),
            ("prefetch", prefetch, 1),
            ("start_batch", start_batch, 0),
        )
        for name, value, lowest in checks:
            errors.int_at_least(name, value, lowest)
        errors.require(0 <= worker < num_workers, "worker", worker, f"use an int in [0, {num_workers})")
        shard_size = n // num_workers if assignment is None else int(assignment.sizes[worker])
        if batch_size > shard_size:
            raise errors.ConfigError(
                f"batch_size={batch_size} is larger than a shard: {n} examples over {num_workers} workers leaves "
                f"{shard_size} per shard."
            )
        self.source: Any = source  # (a dict of arrays, or a random-access source)
        self.worker, self.num_workers, self.batch_size = worker, num_workers, batch_size
        self.num_examples, self.per_epoch = n, shard_size // batch_size
        self.key, self.transform, self.assignment = key, transform, assignment
        self.taken = start_batch  # batches handed out so far
        self._cache: tuple[int, np.ndarray] = (-1, np.empty(0, np.int32))
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._ready: collections.deque = collections.deque()  # the consumer's side of the block it took last
        self.block_size = _block_size(source, batch_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(start_batch,), daemon=True, name=f"loader-{worker}")

    def indices(self, j: int) -> np.ndarray:
        """Example indices of this worker's j-th batch (a pure function of j; the epoch's shard is cached)."""
        epoch, k = divmod(j, self.per_epoch)
        cached_epoch, shard = self._cache  # one attribute, swapped atomically: safe across the two threads
        if cached_epoch != epoch:
            cpu = jax.devices("cpu")[0]
            key, epoch_arr = jax.device_put((self.key, np.int32(epoch)), cpu)  # explicit host -> CPU-device copy
            data_key = exchange.split_key(key)[0]
            if self.assignment is None:  # IID: the epoch's re-dealt shards, this worker's row
                shards = order.shard_indices(data_key, epoch_arr, self.num_examples, self.num_workers)
                shard = jax.device_get(shards)[self.worker]  # explicit device -> host copy, then index on the host
            else:  # a fixed partition: the epoch's minibatches of this worker's own examples, in the simulator's order
                args = jax.device_put((self.assignment, np.int32(self.worker)), cpu)
                most = int(np.max(self.assignment.sizes)) // self.batch_size  # (every worker's program: one shape)
                rows = _partition_epoch(data_key, *args, epoch_arr, self.batch_size, most)
                shard = jax.device_get(rows)[: self.per_epoch].reshape(-1)
            self._cache = (epoch, shard)
        return shard[k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, j: int) -> dict[str, np.ndarray]:
        """This worker's j-th batch, transformed (pure: does not advance the iterator)."""
        return self._transformed(self._raw(j))

    def block(self, j: int, n: int) -> list[dict[str, np.ndarray]]:
        """Batches ``j .. j + n - 1``, transformed, as :meth:`batch` gives them (:meth:`gather`'s)."""
        return [self._transformed(b) for b in self.gather(j, n)]

    def gather(self, j: int, n: int) -> list[dict[str, np.ndarray]]:
        """Batches ``j .. j + n - 1`` as the source holds them (not transformed); from in-memory arrays gathered with
        one indexing per array (the batches are views of one block)."""
        if not self._arrays or n == 1:
            return [self._raw(i) for i in range(j, j + n)]
        idx = np.concatenate([self.indices(i) for i in range(j, j + n)])
        gathered = {k: np.asarray(v)[idx].reshape(n, self.batch_size, *np.shape(v)[1:]) for k, v in self.source.items()}
        return [{k: v[i] for k, v in gathered.items()} for i in range(n)]

    def _raw(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        if self._arrays:
            return {k: np.asarray(v)[idx] for k, v in self.source.items()}
        records = [self.source[int(i)] for i in idx]
        return {k: np.stack([np.asarray(r[k]) for r in records]) for k in records[0]}

    def _transformed(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.transform(batch) if self.transform is not None else batch

    def _fill(self, j: int) -> None:
        done: list = []
        try:
            while not self._stop.is_set():
                done = []
                for raw in self.gather(j, min(self.block_size, self.per_epoch - j % self.per_epoch)):  # (an epoch's)
                    done.append(self._transformed(raw))
                if not self._put(done):
                    return
                j += len(done)
        except BaseException as e:  # surfaced to the consumer, not lost on the thread: after the block's good batches
            if not done or self._put(done):
                self._put(e)

    def _put(self, item: Any) -> bool:
        """Hands ``item`` over once there is room; False when the loader closed first (close() empties the queue, so a
        thread waiting here wakes at once)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> dict[str, np.ndarray]:
        if self._stop.is_set():
            raise StopIteration
        if self._thread.ident is None:  # (started at the first minibatch: a warm-up's loader reads only batch(0))
            self._thread.start()
        if not self._ready:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise RuntimeError(f"loader of worker {self.worker} failed: {item}") from item
            self._ready.extend(item)
        self.taken += 1
        return self._ready.popleft()

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.taken // self.per_epoch

    def close(self) -> None:
        """Stops the prefetch thread (idempotent; at once: a thread waiting to hand over a block finds room)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _block_size(source: Any, batch_size: int) -> int:
    """Batches in one block: of in-memory NumPy arrays :data:`BLOCK_BYTES` of them, 1 to :data:`MAX_BLOCK`; of any
    other source one (a random-access source's records, an array-like column that reads itself on each access)."""
    if not isinstance(source, Mapping) or not all(isinstance(v, np.ndarray) for v in source.values()):
        return 1
    per_batch = batch_size * sum(math.prod(v.shape[1:]) * v.itemsize for v in source.values())
    return max(1, min(MAX_BLOCK, BLOCK_BYTES // max(per_batch, 1)))


@functools.partial(jax.jit, static_argnames=("batch_size", "rows"))
def _partition_epoch(data_key, assignment, worker, epoch, batch_size: int, rows: int):
    """A worker's minibatches of epoch ``epoch`` under a fixed partition, the simulator's
    (:func:`asgd_jax.partition.batch_indices`): ``[rows, batch]`` for ``rows`` at least the worker's minibatches an
    epoch (the first of them are its epoch; one program for every worker, whatever its share)."""
    per_epoch = assignment.sizes[worker] // batch_size
    taken = epoch * per_epoch + jnp.arange(rows, dtype=jnp.int32)
    workers = jnp.full((rows,), worker, jnp.int32)
    return partition.batch_indices(order.key_words(data_key), assignment, batch_size, workers, taken)
