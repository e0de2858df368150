"""What every delay model of :mod:`asgd_jax.delays` does, whatever its schedule: it is a value keyed by its structure
(equal by numbers, hashed by class and static fields, pickled and back equal), the same key gives the same events and
a twin with other numbers the same program, its events stay within its slots and shards, and bad numbers are refused.

Every public delay model has a case in ``MODELS`` (the first test fails for one that has none): a new model adds one
line here, an instance with a twin of other numbers and a constructor of bad ones.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asgd_jax import delays, errors

UPDATES = 5
LAW = delays.Workers.with_times([1.0, 2.0, 3.0])


class Case(NamedTuple):
    model: Any
    twin: Any  # the same structure with other numbers; None for a model without numbers
    bad: Callable[[], Any]  # a construction the model's checks refuse


MODELS = {
    "workers": Case(
        delays.Workers(3, mean_compute_time=2.0, speeds=[1.0, 2.0, 0.5], straggler_prob=0.1),
        delays.Workers(3, mean_compute_time=3.0, speeds=[1.0, 1.0, 1.0], straggler_prob=0.2),
        lambda: delays.Workers(3, mean_compute_time=-1.0),
    ),
    "trace": Case(
        delays.Trace([0, 1, 1, 0, 2], times=[0.5, 1.0, 1.5, 2.0, 2.5]),
        delays.Trace([2, 0, 1, 1, 0], times=[1.0, 2.0, 3.0, 4.0, 5.0]),
        lambda: delays.Trace([0, -1, 1]),
    ),
    "trace_of_a_ring": Case(
        delays.Trace([0, 1, 1, 0, 1], pulled=[0, 0, 2, 2, 4]),
        delays.Trace([1, 0, 0, 1, 0], pulled=[0, 1, 1, 3, 3]),
        lambda: delays.Trace([0, 1, 1, 0], pulled=[0, 0, 3, 2]),  # a version not made yet
    ),
    "round_trace": Case(
        delays.RoundTrace([[0, 2], [1, 1], [2, 0], [0, 1], [1, 2]], num=3),
        delays.RoundTrace([[1, 2], [0, 0], [2, 2], [1, 0], [0, 0]], num=3),
        lambda: delays.RoundTrace([[0, 1]], num=1),
    ),
    "fixed_delay": Case(delays.FixedDelay(2), None, lambda: delays.FixedDelay(-1)),
    "random_delay": Case(delays.RandomDelay(3), None, lambda: delays.RandomDelay(-1)),
    "ringmaster": Case(
        delays.Ringmaster(LAW, threshold=2),
        delays.Ringmaster(delays.Workers.with_times([2.0, 3.0, 5.0]), threshold=2),
        lambda: delays.Ringmaster(LAW, threshold=0),
    ),
    "rennala": Case(
        delays.Rennala(delays.Workers(3), batch=2),
        delays.Rennala(delays.Workers(3, mean_compute_time=2.0), batch=2),
        lambda: delays.Rennala(delays.Workers(3), batch=0),
    ),
    "malenia": Case(
        delays.Malenia(delays.Workers(3)),
        delays.Malenia(delays.Workers(3, mean_compute_time=2.0)),
        lambda: delays.Malenia("three"),
    ),
    "overlapped": Case(
        delays.Overlapped(delays.Workers(3, links=delays.Links(latency=0.1))),
        delays.Overlapped(delays.Workers(3, links=delays.Links(latency=[0.2, 0.3, 0.1]))),
        lambda: delays.Overlapped(delays.Workers(3, links=delays.Links(latency=-1.0))),
    ),
    "shadowheart": Case(
        delays.Shadowheart(delays.Workers.with_times([1.0, 2.0]), send_times=[0.5, 0.5], fraction=0.5),
        delays.Shadowheart(delays.Workers.with_times([1.0, 2.0]), send_times=[0.48, 0.48], fraction=0.5),  # same b, m
        lambda: delays.Shadowheart(delays.Workers.with_times([1.0, 2.0]), send_times=[0.5, 0.0]),
    ),
    "msync": Case(
        delays.MSync(delays.Workers(3), m=2),
        delays.MSync(delays.Workers(3, mean_compute_time=0.5), m=2),
        lambda: delays.MSync(delays.Workers(3), m=4),
    ),
}


def test_every_public_delay_model_has_a_case():
    public = (getattr(delays, name) for name in delays.__all__)
    models = {c for c in public if isinstance(c, type) and delays.is_delay_model(c)}
    assert models == {type(case.model) for case in MODELS.values()}
    assert len(models) == 11


@pytest.mark.parametrize("name", MODELS)
def test_a_model_is_a_value_keyed_by_its_structure(name):
    model, twin, _ = MODELS[name]
    structure, numbers = delays.split(model)
    copy = pickle.loads(pickle.dumps(model))
    assert copy == model and hash(copy) == hash(model) and delays.split(copy)[0] == structure
    assert getattr(delays, type(model).__name__) is type(model)  # the name the package answers, wherever it lives
    assert repr(model).startswith(f"{type(model).__name__}(")
    assert delays.split(structure.build(numbers))[0] == structure
    if twin is None:
        assert numbers == []
    else:
        assert twin != model and hash(twin) == hash(model) and delays.split(twin)[0] == structure


def _events(structure: delays.Structure, numbers: list[Any], key: jax.Array, traced: list) -> Any:
    """``UPDATES`` updates of the model ``structure`` builds with ``numbers`` (traced: one program per structure)."""
    traced.append(structure)
    model = structure.build(numbers)
    step = model.round if delays.is_round_model(model) else model.next
    body = lambda state, t: step(state, t, jax.random.fold_in(key, t))
    return jax.lax.scan(body, model.init(key), jnp.arange(UPDATES, dtype=jnp.int32))[1]


@pytest.mark.parametrize("name", MODELS)
def test_the_same_key_gives_the_same_events_and_other_numbers_the_same_program(name):
    model, twin, _ = MODELS[name]
    traced: list = []
    run = jax.jit(lambda s, n, k: _events(s, n, k, traced), static_argnums=0)
    structure, numbers = delays.split(model)
    events = run(structure, numbers, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, events, run(structure, numbers, jax.random.key(0)))
    if twin is not None:
        run(*delays.split(twin), jax.random.key(0))
    assert len(traced) == 1
    assert min(model.num_slots, model.num_shards) >= 1
    within = lambda x, n: bool(np.all((np.asarray(x) >= 0) & (np.asarray(x) < n)))
    if delays.is_round_model(model):
        assert events.shards.shape == (UPDATES, model.round_size) and within(events.shards, model.num_shards)
    else:
        assert within(events.shard, model.num_shards)
        assert within(events.push_slot, model.num_slots) and within(events.pull_slot, model.num_slots)
    assert np.all(np.diff(np.asarray(events.time)) >= 0)


@pytest.mark.parametrize("name", MODELS)
def test_bad_numbers_are_refused(name):
    with pytest.raises(errors.ConfigError):
        MODELS[name].bad()
