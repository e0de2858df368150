"""The data order: every epoch a keyed permutation, shards disjoint and re-drawn, the same on the host and device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.problems import N

from asgd_jax import order
from asgd_jax.simulator import shard_indices


def test_data_shards_are_disjoint_cover_the_epoch_and_reshuffle():
    a = np.asarray(shard_indices(jax.random.key(0), 0, N, 8))
    b = np.asarray(shard_indices(jax.random.key(0), 1, N, 8))
    assert a.shape == (8, N // 8)
    assert sorted(a.ravel().tolist()) == list(range(N))
    assert not np.array_equal(a, b) and sorted(b.ravel().tolist()) == list(range(N))
    np.testing.assert_array_equal(a, shard_indices(jax.random.key(0), 0, N, 8))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 65, 1000, 1438, 4097])
def test_every_epoch_is_a_permutation_of_the_examples(n):
    # A Feistel network over the next power of four, restricted to [0, n) by cycle walking: a bijection for any n.
    words = order.key_words(jax.random.key(3))
    for epoch in (0, 1, 17):
        idx = np.asarray(order.example_index(words, epoch, np.arange(n), n))
        assert sorted(idx.tolist()) == list(range(n))
    first, second = (np.asarray(order.example_index(words, e, np.arange(n), n)) for e in (0, 1))
    assert n < 3 or not np.array_equal(first, second)  # re-drawn every epoch


def test_the_order_is_a_pure_function_of_key_epoch_and_position():
    words = order.key_words(jax.random.key(5))
    whole = np.asarray(order.example_index(words, 2, np.arange(100), 100))
    part = np.asarray(order.example_index(words, 2, np.arange(40, 60), 100))  # any slice, computed alone
    np.testing.assert_array_equal(whole[40:60], part)
    jitted = jax.jit(order.example_index, static_argnums=3)(words, 2, np.arange(100), 100)
    np.testing.assert_array_equal(whole, np.asarray(jitted))


def test_many_minibatches_of_different_epochs_in_one_call_are_each_epochs_own():
    # The simulator asks for a whole chunk's minibatches at once, one epoch per row: each row is what that epoch
    # alone gives (a value already inside [0, N) stays put while the others walk).
    words = order.key_words(jax.random.key(5))
    epochs = np.array([[0, 3], [3, 11], [2, 0]], dtype=np.int32)
    positions = (np.arange(6 * 9).reshape(3, 2, 9) * 7) % 1438
    rows = np.asarray(order.example_index(words, epochs, positions, 1438))
    for i, j in np.ndindex(epochs.shape):
        alone = np.asarray(order.example_index(words, int(epochs[i, j]), positions[i, j], 1438))
        np.testing.assert_array_equal(rows[i, j], alone)
    one = order.example_index(words, 3, 5, 1438)  # a scalar position gives a scalar
    assert one.shape == () and int(one) == int(np.asarray(order.example_index(words, 3, np.arange(6), 1438))[5])
    with pytest.raises(ValueError, match=r"epoch has shape \(2,\) and positions \(3, 2, 9\)"):
        order.example_index(words, epochs[0], positions, 1438)


def test_the_order_called_eagerly_compiles_once_per_shape_and_inside_a_program_is_the_same():
    """A test's reference or a notebook calls the order eagerly: one program per shape (the Feistel rounds and the
    cycle walk's loop), not an operation at a time with the loop compiled anew on every call."""
    words = order.key_words(jax.random.key(5))
    positions = np.arange(40, dtype=np.int32).reshape(4, 10)
    sizes = np.array([10, 37, 64, 100], np.int32)
    workers = np.arange(4, dtype=np.int32)
    eager = lambda e: (
        np.asarray(order.example_index(words, np.full(4, e, np.int32), positions, 1000)),
        np.asarray(order.member_position(words, np.full(4, e, np.int32), positions, workers, sizes)),
    )
    first = eager(0)
    with compilations() as counts:
        later = [eager(e) for e in (1, 2, 0)]
    assert sum(counts.values()) == 0, counts
    np.testing.assert_array_equal(later[2][0], first[0])
    inside = jax.jit(lambda e: order.example_index(words, e, positions, 1000))(np.zeros(4, np.int32))
    np.testing.assert_array_equal(np.asarray(inside), first[0])
    member = first[1]
    assert all(len(set(member[w].tolist())) == 10 and member[w].max() < sizes[w] for w in range(4))  # a bijection
