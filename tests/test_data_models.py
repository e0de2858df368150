"""Embedded datasets (offline), small models, and a real learning check."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.compiles import compilations
from helpers.problems import replay_trainer_run

import asgd_jax


@pytest.mark.parametrize(
    ("name", "train", "test", "shape"),
    [("digits", 1438, 359, (8, 8, 1)), ("mnist1d", 4000, 1000, (40, 1))],
)
def test_embedded_loaders_work_offline(no_network, name, train, test, shape):
    ds = asgd_jax.data.load(name)
    assert (len(ds.y_train), len(ds.y_test), ds.input_shape, ds.num_classes) == (train, test, shape, 10)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    # Standardised on the training split.
    np.testing.assert_allclose(ds.x_train.mean(), 0.0, atol=1e-4)
    np.testing.assert_allclose(ds.x_train.std(), 1.0, atol=1e-3)
    assert set(np.unique(ds.y_train)) == set(range(10))
    assert ds.train["x"] is ds.x_train and ds.test["y"] is ds.y_test


def test_digits_split_is_fixed_and_disjoint():
    ds = asgd_jax.data.load("digits")
    from sklearn.datasets import load_digits

    raw = load_digits().images.reshape(len(load_digits().target), -1)
    # Every example lands in exactly one split.
    assert len(ds.y_train) + len(ds.y_test) == len(raw)
    flat_train = {row.tobytes() for row in np.round(ds.x_train.reshape(len(ds.x_train), -1), 4)}
    flat_test = {row.tobytes() for row in np.round(ds.x_test.reshape(len(ds.x_test), -1), 4)}
    assert len(flat_train & flat_test) <= 2  # the raw digits hold a few exact duplicates, nothing more
    asgd_jax.data.clear_cache()
    again = asgd_jax.data.load("digits")
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    other = asgd_jax.data.load("digits", seed=1)
    assert not np.array_equal(other.y_train, ds.y_train)


def test_mnist1d_leaves_numpy_global_state_alone():
    np.random.seed(123)  # noqa: NPY002
    before = np.random.get_state()[1].copy()  # noqa: NPY002
    asgd_jax.data.clear_cache()
    asgd_jax.data.load("mnist1d")
    np.testing.assert_array_equal(np.random.get_state()[1], before)  # noqa: NPY002


def _generated(monkeypatch) -> list[int]:
    """Counts MNIST-1D generations (the real generator still runs)."""
    import mnist1d.data

    calls, real = [], mnist1d.data.make_dataset
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda args: calls.append(args.seed) or real(args))
    return calls


def test_mnist1d_is_generated_once_and_read_back_from_disk_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("ASGD_JAX_CACHE_DIR", str(tmp_path))
    generated = _generated(monkeypatch)
    asgd_jax.data.clear_cache()
    first = asgd_jax.data.load("mnist1d")
    assert [p.name.split("-")[:2] for p in (tmp_path / "datasets").iterdir()] == [["mnist1d", "seed0"]]
    asgd_jax.data.clear_cache()
    again = asgd_jax.data.load("mnist1d")
    assert generated == [42]  # the second load read the kept file
    for a, b in zip(dataclasses.astuple(first), dataclasses.astuple(again), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def kept_mnist1d(tmp_path_factory):
    """MNIST-1D (seed 1) generated once for the damage tests: its arrays and its kept file's name and bytes."""
    folder = tmp_path_factory.mktemp("kept")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASGD_JAX_CACHE_DIR", str(folder))
        asgd_jax.data.clear_cache()
        reference = asgd_jax.data.load("mnist1d", seed=1)
        asgd_jax.data.clear_cache()
    (kept,) = (folder / "datasets").iterdir()
    return reference, kept.name, kept.read_bytes()


@pytest.mark.parametrize("fault", ["truncate", "flip", "empty"])
def test_a_damaged_kept_dataset_is_regenerated_not_used(tmp_path, monkeypatch, fault, kept_mnist1d):
    reference, name, raw = kept_mnist1d
    monkeypatch.setenv("ASGD_JAX_CACHE_DIR", str(tmp_path))
    kept = tmp_path / "datasets" / name
    kept.parent.mkdir()
    damaged = {"truncate": raw[: len(raw) // 2], "flip": bytearray(raw), "empty": b""}[fault]
    if fault == "flip":  # one bit in the middle of an array's bytes
        damaged[len(raw) // 2] ^= 0x10
    kept.write_bytes(bytes(damaged))
    generated = _generated(monkeypatch)
    asgd_jax.data.clear_cache()
    again = asgd_jax.data.load("mnist1d", seed=1)
    assert generated == [43]
    np.testing.assert_array_equal(again.x_train, reference.x_train)
    np.testing.assert_array_equal(again.y_test, reference.y_test)
    assert kept.read_bytes() == raw  # rewritten whole


def test_a_full_disk_keeps_nothing_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ASGD_JAX_CACHE_DIR", str(tmp_path))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    asgd_jax.data.clear_cache()
    ds = asgd_jax.data.load("mnist1d", seed=2)
    assert len(ds.y_train) == 4000 and list((tmp_path / "datasets").iterdir()) == []  # no partial file left


def test_no_dataset_is_kept_when_the_cache_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ASGD_JAX_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asgd_jax.data.clear_cache()
    asgd_jax.data.load("mnist1d", seed=3)
    assert asgd_jax.cache.data_folder() is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("name", "seed"), [("cifar10", 0), ("digits", -1)])
def test_bad_dataset_arguments_raise(name, seed):
    with pytest.raises(ValueError, match=name if seed == 0 else "seed"):
        asgd_jax.data.load(name, seed=seed)


@pytest.mark.parametrize(
    ("name", "shape", "expected_params"),
    [
        ("mlp", (8, 8, 1), 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10),
        ("cnn", (8, 8, 1), (9 * 16 + 16) + (9 * 16 * 32 + 32) + (2 * 2 * 32 * 64 + 64) + (64 * 10 + 10)),
        ("cnn", (40, 1), (3 * 16 + 16) + (3 * 16 * 32 + 32) + (10 * 32 * 64 + 64) + (64 * 10 + 10)),
    ],
)
def test_models_shapes_and_parameter_counts(name, shape, expected_params):
    model = asgd_jax.models.get(name, num_classes=10, input_shape=shape)
    params, state = model.init(jax.random.key(0))
    assert model.num_params(params) == expected_params
    assert state == {}
    logits, new_state = model.apply(params, state, jnp.zeros((7, *shape)), train=True, key=jax.random.key(1))
    assert logits.shape == (7, 10) and new_state == {}


def test_model_init_is_deterministic_and_keyed():
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    a, _ = model.init(jax.random.key(0))
    b, _ = model.init(jax.random.key(0))
    c, _ = model.init(jax.random.key(1))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "resnet9000", "num_classes": 10, "input_shape": (8, 8, 1)}, "resnet9000"),
        ({"name": "mlp", "num_classes": 1, "input_shape": (8, 8, 1)}, "num_classes"),
        ({"name": "cnn", "num_classes": 10, "input_shape": (64,)}, "input_shape"),
        ({"name": "mlp", "num_classes": 10, "input_shape": (0, 3)}, "input_shape"),
    ],
)
def test_bad_model_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        asgd_jax.models.get(**kwargs)


def test_loss_and_accuracy_values():
    logits = jnp.array([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    labels = jnp.array([0, 1, 1])
    np.testing.assert_allclose(asgd_jax.models.accuracy(logits, labels), 2 / 3, rtol=1e-6)
    want = np.mean([np.log1p(np.exp(-2.0)), np.log1p(np.exp(-3.0)), np.log1p(np.exp(1.0))])
    np.testing.assert_allclose(asgd_jax.models.cross_entropy(logits, labels), want, rtol=1e-6)


def test_classification_eval_matches_a_direct_computation():
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    got = jax.jit(asgd_jax.classification_eval(model, ds.test, batch_size=100))(params, state)  # 3 full + 59 rest
    logits, _ = model.apply(params, state, ds.x_test)
    np.testing.assert_allclose(got["loss"], asgd_jax.models.cross_entropy(logits, ds.y_test), rtol=1e-5)
    np.testing.assert_allclose(got["error"], 1 - asgd_jax.models.accuracy(logits, ds.y_test), rtol=1e-6)


def test_an_evaluation_called_eagerly_compiles_once_and_equals_its_jitted_self():
    """After a run, a notebook calls the evaluation on the weights again and again: its batches' loop is compiled
    once per evaluation (an equal evaluation of the same shapes shares it), not on every call."""
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    evaluate = asgd_jax.classification_eval(model, ds.test, batch_size=100)
    first = evaluate(params, state)
    moved = jax.tree.map(lambda w: w + 0.01, params)
    with compilations() as counts:
        again = [evaluate(moved, state), asgd_jax.classification_eval(model, ds.test, batch_size=100)(params, state)]
    assert sum(counts.values()) == 0, counts
    assert jax.tree.map(float, again[1]) == jax.tree.map(float, first)
    assert float(again[0]["loss"]) != float(first["loss"])  # the weights are an argument, not a constant
    jitted = jax.jit(evaluate)(params, state)
    assert jax.tree.map(float, jitted) == jax.tree.map(float, first)


@pytest.mark.slow
def test_mlp_trained_with_asgd_on_digits_beats_90_percent():
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    rule = asgd_jax.asgd(0.1, momentum=0.9)
    loss = asgd_jax.classification_loss(model)
    x, y = jnp.asarray(ds.x_train), jnp.asarray(ds.y_train)

    def step(carry, t):
        params, opt_state = carry
        idx = jax.random.choice(jax.random.fold_in(jax.random.key(1), t), len(y), (32,), replace=False)
        grads, _ = jax.grad(loss, has_aux=True)(params, state, {"x": x[idx], "y": y[idx]}, None)
        updates, opt_state = rule.update(grads, opt_state, params, stale_params=params, staleness=0)
        return (jax.tree.map(jnp.add, params, updates), opt_state), None

    (params, _), _ = jax.lax.scan(step, (params, rule.init(params)), jnp.arange(300))
    metrics = asgd_jax.classification_eval(model, ds.test)(params, state)
    assert float(metrics["error"]) < 0.10, metrics


class _NnxNet(nnx.Module):
    """An NNX network with BatchNorm (model state) and dropout (model randomness)."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


def test_an_nnx_model_trains_in_the_simulator_and_its_trainer_run_replays(tmp_path):
    from asgd_jax.plan import Plan
    from asgd_jax.trainer import TrainConfig, train

    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.from_nnx(_NnxNet, input_shape=ds.input_shape, num_classes=ds.num_classes)
    params, state = model.init(jax.random.key(0))
    loss, evaluate = asgd_jax.classification_loss(model), asgd_jax.classification_eval(model, ds.test)
    rule = asgd_jax.rules.get("dc_asgd_a", 0.1)
    sim = asgd_jax.simulate(
        loss,
        rule,
        params,
        ds.train,
        asgd_jax.Plan(asgd_jax.delays.Workers(4), batch_size=16, num_updates=300, eval_every=300),
        model_state=state,
        eval_fn=evaluate,
        progress=False,
    )
    assert sim.metrics["eval_error"][-1] < 0.2  # it learns
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), sim.model_state, state))
    assert max(moved) > 0  # BatchNorm's statistics are the model state the server keeps
    # The trainer with the same NNX model: dropout is keyed like the simulator's, so the trace replays.
    config = TrainConfig(Plan(2, num_updates=20, batch_size=16), seed=4, out=str(tmp_path), progress=False)
    run = train(loss, rule, params, ds.train, config, model_state=state, devices=jax.devices()[:2])
    replay = replay_trainer_run(
        loss, rule, params, ds.train, run, num=2, batch_size=16, num_updates=20, model_state=state, seed=4
    )
    for a, b in zip(jax.tree.leaves(replay.params), jax.tree.leaves(run.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_loss_form_is_declared_and_a_mismatch_is_reported_before_compiling():
    x = np.ones((32, 3), np.float32)
    data = {"x": x, "y": np.ones(32, np.float32)}
    plain = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
    sim = lambda loss, **kw: asgd_jax.simulate(
        loss,
        asgd_jax.asgd(0.1),
        jnp.zeros(3),
        data,
        asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=4, num_updates=3),
        progress=False,
        **kw,
    )
    with pytest.raises(ValueError, match=r"declared form loss_fn\(params, batch\) -> \(loss, aux\)"):
        sim(plain, has_aux=True)  # says it returns aux; returns a scalar
    with pytest.raises(ValueError, match=r"has_model_state=True .* model_state was not given"):
        sim(asgd_jax.Loss(lambda w, ms, b, k: (plain(w, b), ms), has_model_state=True))
    # A model state that is itself a pair is not mistaken for (state, aux): the form is declared, not guessed.
    pair_state = (jnp.zeros(()), jnp.ones(()))
    counted = asgd_jax.Loss(lambda w, ms, b, k: (plain(w, b), (ms[0] + 1.0, ms[1])), has_model_state=True)
    result = sim(counted, model_state=pair_state)
    assert float(result.model_state[0]) >= 1.0 and float(result.model_state[1]) == 1.0  # counted, kept
    with_aux = asgd_jax.Loss(lambda w, b: (plain(w, b), {"half": 0.5 * plain(w, b)}), has_aux=True)
    assert "half" in sim(with_aux).metrics
