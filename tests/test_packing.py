"""Packed pytrees (asgd_jax.packing): what crosses between a worker and the store, one buffer per dtype.

Packing is a bijection between a pytree and its buffers, the same on the host and inside a program; the store moves a
push as those buffers whatever the model's leaf count, and its compiled exchange takes exactly one argument per
dtype."""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax.packing import ALIGNMENT, Layout, aligned_empty
from asgd_jax.trainer.store import BadPush, ParameterStore

DTYPES = [np.float32, np.float16, np.int32, jnp.bfloat16]
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
leaves = st.tuples(st.sampled_from(range(len(DTYPES))), shapes)


@st.composite
def trees(draw):
    """A dict/list pytree of arrays of mixed dtypes and shapes (empty leaves and scalars included)."""
    specs = draw(st.lists(leaves, min_size=1, max_size=6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    arrays = [(rng.normal(size=shape) * 100).astype(DTYPES[k]) for k, shape in specs]
    return {"a": arrays[: len(arrays) // 2], "b": tuple(arrays[len(arrays) // 2 :])}


@settings(max_examples=40, deadline=None)
@given(trees())
def test_packing_is_a_bijection_on_the_host_and_in_a_program(tree):
    layout = Layout.of(tree)
    host = layout.pack_host(tree)
    assert len(host) == len({np.dtype(x.dtype) for x in jax.tree.leaves(tree)})  # one buffer per dtype
    assert layout.misfit(host) is None
    back = layout.unpack_host(host)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    traced = jax.jit(layout.pack)(tree)
    for a, b in zip(traced, host, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    again = jax.jit(lambda bufs: layout.unpack(bufs))(host)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=3).map(tuple), st.sampled_from(DTYPES))
def test_an_aligned_host_buffer_is_taken_by_a_cpu_device_without_a_copy(shape, dtype):
    x = aligned_empty(shape, dtype)
    assert x.shape == shape and x.dtype == np.dtype(dtype) and (x.size == 0 or x.ctypes.data % ALIGNMENT == 0)
    x[...] = (np.arange(x.size) % 100).reshape(shape).astype(dtype)
    on_device = jax.device_put(x, jax.devices("cpu")[0])
    np.testing.assert_array_equal(np.asarray(on_device), x)
    if x.size:  # (the device's buffer is the array's memory: no copy on a CPU)
        assert np.asarray(on_device).ctypes.data == x.ctypes.data


@settings(max_examples=40, deadline=None)
@given(trees())
def test_a_host_packs_several_leaves_into_aligned_buffers(tree):
    layout = Layout.of(tree)
    for buffer, dtype in zip(layout.pack_host(tree), layout.dtypes, strict=True):
        leaves = [x for x in jax.tree.leaves(tree) if np.dtype(x.dtype) == dtype]
        assert len(leaves) == 1 or not buffer.size or buffer.ctypes.data % ALIGNMENT == 0  # (one leaf: itself)


def test_host_leaves_are_views_of_the_buffer():
    tree = {"w": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}
    layout = Layout.of(tree)
    (buffer,) = layout.pack_host(tree)
    back = layout.unpack_host((buffer,))
    assert all(np.shares_memory(x, buffer) for x in jax.tree.leaves(back))


def test_misfit_names_the_buffer_and_the_expected_form():
    layout = Layout.of({"w": np.zeros(3, np.float32)})
    assert "not 1 packed buffer" in layout.misfit((np.zeros(3, np.float32), np.zeros(1, np.float32)))
    assert "float32[3]" in layout.misfit((np.zeros(4, np.float32),))
    assert "float32[3]" in layout.misfit((np.zeros(3, np.float64),))


def test_a_push_is_one_buffer_whatever_the_leaf_count():
    # The cnn's 8 leaves cross as one float32 buffer; the exchange program takes that one buffer (and the model
    # state's one), and a packed push and a pytree push give the same weights, bit for bit.
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    params, _ = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    answers = []
    for packed in (False, True):
        store = ParameterStore(asgd_jax.dc_asgd(0.1, 2.0, adaptive=True), params, 2)
        try:
            assert len(store.layout.sizes) == 1 and store.layout.num_leaves == len(jax.tree.leaves(params)) == 8
            payload = store.layout.pack_host(grads) if packed else grads
            lowered = store.lower_exchange(1, payload)
            # The program's arguments: the state's buffers, the rule's numbers, the worker id, then one buffer.
            assert len(lowered.args_info[0][3]) == 1 and set(lowered.args_info[0][1]) == {"learning_rate", "lam"}
            store.push(1, payload, 0, packed=packed).result(timeout=30)
            answers.append(store.final_weights()[0])
        finally:
            store.close()
    for a, b in zip(jax.tree.leaves(answers[0]), jax.tree.leaves(answers[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_packed_push_of_the_wrong_size_is_refused_at_once():
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 1)
    try:
        with pytest.raises(BadPush, match=r"packed buffer 0 is float32\[4\], the model's is float32\[3\]"):
            store.push(0, (np.zeros(4, np.float32),), 0, packed=True)
        s = store.status()
        assert (s.received, s.rejected, s.applied) == (1, 1, 0)
    finally:
        store.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_store_says_where_its_time_went(pipelined):
    # Idle is the store's time between one push's end and the next one's start (a pipelined store once booked ~0
    # there): a worker that takes 50 ms between its pushes leaves the store idle at least that long.
    started = time.perf_counter()
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 1, pipelined=pipelined)
    try:
        store.push(0, {"w": np.ones(3, np.float32)}, 0).result(timeout=30)
        time.sleep(0.05)
        with contextlib.suppress(BadPush):  # (pipelined: answered at once, rejected when its flags are read)
            store.push(0, {"w": np.full(3, np.nan, np.float32)}, 1).result(timeout=30)
        store.state()
        times, rejected = store.status().times, store.status().rejected
    finally:
        store.close()
    elapsed = time.perf_counter() - started
    assert times.pushes == 2 and rejected == 1  # both pushes reached the applier: one applied, one rejected there
    assert times.exchange > 0 and times.bookkeeping >= 0 and times.transfer_in > 0
    assert times.idle >= 0.05 and times.idle + times.exchange + times.bookkeeping <= elapsed  # (disjoint spans)


def test_a_pipelined_store_books_its_wait_for_the_device_under_exchange(monkeypatch):
    # Pipelined, a push's outcome is read off the device when the next push is dispatched: that wait is the device's
    # time (for a computed push, the worker's period's too), not the store's bookkeeping, which once held it all (a
    # one-worker `cnn` run booked 1.9 s of its 2.4 s there). Here each outcome takes 0.1 s to come.
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 1, pipelined=True)
    settle = store.server.settle

    def slow(dispatched):
        time.sleep(0.1)
        return settle(dispatched)

    monkeypatch.setattr(store.server, "settle", slow)
    try:
        for version in range(4):  # pushes 2-4 each settle the one before them: three waits inside pushes
            store.push(0, {"w": np.ones(3, np.float32)}, version).result(timeout=30)
        store.state()  # (the fourth, settled outside a push: no push's time)
        times = store.status().times
    finally:
        store.close()
    assert times.pushes == 4 and store.status().applied == 4
    assert times.exchange >= 0.3 and times.bookkeeping < 0.3
