"""The host-side shard loader: the simulator's order, disjoint shards, fixed shapes, a thread that stops."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax.trainer import loader as loader_lib
from asgd_jax.trainer.loader import ShardLoader

N = 50
DATA = {"x": np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32), "y": np.arange(N)}


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_shards_are_disjoint_cover_the_epoch_and_reshuffle():
    key = jax.random.key(3)
    per_worker = []
    for w in range(4):  # 50 // 4 = 12 per shard, 3 batches of 4
        with ShardLoader(DATA, worker=w, num_workers=4, batch_size=4, key=key) as it:
            batches = _take(it, 6)  # two epochs
        assert all(b["x"].shape == (4, 3) and b["y"].shape == (4,) for b in batches)
        per_worker.append([b["y"] for b in batches])
    epoch0 = np.concatenate([np.concatenate(b[:3]) for b in per_worker])
    epoch1 = np.concatenate([np.concatenate(b[3:]) for b in per_worker])
    assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48  # disjoint, 2 sit out
    assert not np.array_equal(epoch0, epoch1)  # re-partitioned every epoch


def test_matches_the_simulators_minibatch_order():
    # A simulated run with one worker per shard sees exactly these batches: replay depends on it.
    key = jax.random.key(7)
    x = jnp.asarray(DATA["x"][:, :1])

    def loss(w, batch):  # the gradient is the batch's sum, so the final weight sums every batch seen
        return jnp.sum(w * batch["x"])

    result = asgd_jax.simulate(
        loss,
        asgd_jax.asgd(1.0),
        jnp.zeros(()),
        {"x": x},
        asgd_jax.Plan(asgd_jax.delays.Trace([1, 0, 1, 1, 0], num=2), batch_size=5, num_updates=5),
        key=key,
        progress=False,
    )
    # With loss = sum(w * x) and lr 1, the final weight is minus the sum of every batch's x.
    with (
        ShardLoader(DATA, worker=0, num_workers=2, batch_size=5, key=key) as w0,
        ShardLoader(DATA, worker=1, num_workers=2, batch_size=5, key=key) as w1,
    ):
        total = sum(b["x"][:, 0].sum() for b in _take(w0, 2) + _take(w1, 3))
    np.testing.assert_allclose(result.params, -total, rtol=1e-6)


def test_resume_skips_batches_and_indices_are_pure():
    key = jax.random.key(0)
    with ShardLoader(DATA, worker=0, num_workers=2, batch_size=5, key=key) as it:
        first = _take(it, 4)
    with ShardLoader(DATA, worker=0, num_workers=2, batch_size=5, key=key, start_batch=2) as it:
        resumed = _take(it, 2)
        assert it.epoch == 0 and it.taken == 4
    np.testing.assert_array_equal(resumed[0]["y"], first[2]["y"])
    np.testing.assert_array_equal(resumed[1]["y"], first[3]["y"])


def test_random_access_sources_and_transforms():
    records = [{"image": np.full((2, 2), i, np.uint8), "label": i} for i in range(N)]
    transform = lambda b: {"x": b["image"].astype(np.float32) / 255.0, "y": b["label"].astype(np.int32)}
    with ShardLoader(records, worker=0, num_workers=1, batch_size=8, key=jax.random.key(0), transform=transform) as it:
        batch = next(it)
    assert batch["x"].shape == (8, 2, 2) and batch["x"].dtype == np.float32
    np.testing.assert_allclose(batch["x"][:, 0, 0] * 255.0, batch["y"])


def test_errors_on_the_thread_reach_the_consumer_and_threads_stop():
    def broken(batch):
        raise KeyError("no such feature")

    it = ShardLoader(DATA, worker=0, num_workers=1, batch_size=4, key=jax.random.key(0), transform=broken)
    with pytest.raises(RuntimeError, match="loader of worker 0 failed"):
        next(it)
    before = threading.active_count()
    with ShardLoader(DATA, worker=0, num_workers=1, batch_size=4, key=jax.random.key(0)) as it:
        next(it)
    assert threading.active_count() <= before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"worker": 2}, "worker=2"), ({"batch_size": 30}, "batch_size=30"), ({"num_workers": 0}, "num_workers=0")],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"worker": 0, "num_workers": 2, "batch_size": 4, "key": jax.random.key(0), **kwargs}
    with pytest.raises(ValueError, match=match):
        ShardLoader(DATA, **args)


@pytest.mark.parametrize(("start", "rows"), [(0, 3), (5, 3), (1, 200_000)])
def test_blocks_hand_out_exactly_the_batches_in_order(start, rows):
    # Batches come in blocks (one indexing per array), across epochs, from a resumed position: the same batches, in
    # the same order, as batch(j) one at a time; a source whose batch is over BLOCK_BYTES comes a batch a block.
    data = {"x": np.arange(N * rows, dtype=np.float32).reshape(N, rows), "y": np.arange(N)}
    key = jax.random.key(5)
    with ShardLoader(data, worker=1, num_workers=2, batch_size=4, key=key, start_batch=start) as it:
        taken = _take(it, 20)  # 6 batches an epoch: several epochs, several blocks
        big = 4 * rows * np.float32().itemsize > loader_lib.BLOCK_BYTES  # (a batch of x alone)
        assert it.block_size == (1 if big else loader_lib.MAX_BLOCK)
        for i, batch in enumerate(taken):
            expected = it.batch(start + i)
            assert batch.keys() == expected.keys()
            for k in batch:
                np.testing.assert_array_equal(batch[k], expected[k])


def test_a_transform_that_fails_mid_block_hands_over_the_batches_before_it_and_the_thread_starts_when_read():
    calls = []

    def fails_third(batch):
        calls.append(None)
        if len(calls) == 3:
            raise ValueError("bad record")
        return batch

    it = ShardLoader(DATA, worker=7, num_workers=8, batch_size=2, key=jax.random.key(0), transform=fails_third)
    assert it.block_size > 3
    assert "loader-7" not in {t.name for t in threading.enumerate()}  # (a warm-up reads batch(0) alone: no thread)
    good = _take(it, 2)
    np.testing.assert_array_equal(good[1]["y"], it.batch(1)["y"])
    with pytest.raises(RuntimeError, match="bad record"):
        next(it)
    assert "loader-7" not in {t.name for t in threading.enumerate()}
