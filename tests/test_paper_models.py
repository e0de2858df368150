"""The papers' models (ResNet-20, ResNet-50, cuda-convnet style) and image preprocessing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax import preprocess


def _normal(shape):
    """Standard-normal inputs drawn by NumPy (JAX's sampler compiles a program per shape: ~0.8 s each, cold)."""
    return jnp.asarray(np.random.default_rng(1).standard_normal(shape, np.float32))


def _count(name, shape, num_classes=10, **options):
    model = asgd_jax.models.get(name, num_classes=num_classes, input_shape=shape, **options)
    params, state = jax.eval_shape(model.init, jax.random.key(0))  # shapes only: no compute
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)), state


def test_resnet20_has_the_published_parameter_count():
    # He et al. 2016, CIFAR ResNet-20 with identity (option A) shortcuts: 0.27M. The exact count of this
    # architecture is 269,722 (272,474 is the variant with 1x1 projection shortcuts).
    count, state = _count("resnet20", (32, 32, 3))
    assert count == 269_722
    assert "batch_stats" in state


def test_resnet50_has_the_published_parameter_count():
    count, _ = _count("resnet50", (224, 224, 3), num_classes=1000)
    assert count == 25_557_032  # torchvision's resnet50: 25.6M


def test_convnet_shapes_and_dropout():
    model = asgd_jax.models.get("convnet", num_classes=10, input_shape=(32, 32, 3), width=0.125, stem_stride=1)
    params, state = model.init(jax.random.key(0))
    apply = jax.jit(model.apply, static_argnames="train")
    x = _normal((4, 32, 32, 3))
    logits, _ = apply(params, state, x)
    assert logits.shape == (4, 10)
    eval_again, _ = apply(params, state, x)
    np.testing.assert_array_equal(logits, eval_again)  # inference is deterministic
    a, _ = apply(params, state, x, train=True, key=jax.random.key(2))
    b, _ = apply(params, state, x, train=True, key=jax.random.key(3))
    c, _ = apply(params, state, x, train=True, key=jax.random.key(2))
    assert not np.allclose(a, b)  # dropout is on in training, keyed
    np.testing.assert_array_equal(a, c)


def test_batchnorm_trains_on_batch_statistics_and_evaluates_on_running_ones():
    model = asgd_jax.models.get("resnet20", num_classes=10, input_shape=(8, 8, 3), blocks_per_stage=1)
    params, state = model.init(jax.random.key(0))
    apply = jax.jit(model.apply, static_argnames="train")
    x = 3.0 + _normal((16, 8, 8, 3))
    _, new_state = apply(params, state, x, train=True)
    first = jax.tree.leaves(state["batch_stats"])[0]
    assert not np.allclose(jax.tree.leaves(new_state["batch_stats"])[0], first)  # statistics moved
    # Inference uses running statistics: an example's logits do not depend on the rest of the batch.
    alone, _ = apply(params, new_state, x[:1])
    together, _ = apply(params, new_state, x)
    np.testing.assert_allclose(alone[0], together[0], rtol=1e-5, atol=1e-5)
    train_alone, _ = apply(params, new_state, x[:2], train=True)
    train_together, _ = apply(params, new_state, x, train=True)
    assert not np.allclose(train_alone[0], train_together[0], atol=1e-4)


@pytest.mark.slow
def test_resnet20_trains_through_the_simulator_and_evaluates_with_the_servers_state():
    # (16 x 16 images: ResNet-20's layers and weights, a quarter of CIFAR-10's arithmetic)
    model = asgd_jax.models.get("resnet20", num_classes=10, input_shape=(16, 16, 3))
    params, state = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=32).astype(np.int32)
    x += y[:, None, None, None] * 0.3  # learnable: the label shifts the mean
    evaluate = asgd_jax.classification_eval(model, {"x": x, "y": y})
    seen = []

    def eval_fn(p, s):
        seen.append(None)
        return {**evaluate(p, s), "stat": jax.tree.leaves(s["batch_stats"])[0].sum()}

    result = asgd_jax.simulate(
        asgd_jax.classification_loss(model),
        asgd_jax.dc_asgd(0.05, 2.0, adaptive=True),
        params,
        {"x": x, "y": y},
        asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=8, num_updates=24, eval_every=12),
        model_state=state,
        eval_fn=eval_fn,
        progress=False,
    )
    losses = result.metrics["loss"]
    assert losses[-6:].mean() < losses[:6].mean()
    # The evaluation saw the server's latest BatchNorm statistics.
    np.testing.assert_allclose(
        result.metrics["eval_stat"][-1], jax.tree.leaves(result.model_state["batch_stats"])[0].sum(), rtol=1e-6
    )
    assert result.metrics["eval_stat"][-1] != result.metrics["eval_stat"][0]


def test_ten_crops_and_multi_crop_average_by_hand():
    x = jnp.arange(1 * 3 * 3 * 1, dtype=jnp.float32).reshape(1, 3, 3, 1)  # [[0,1,2],[3,4,5],[6,7,8]]
    crops = preprocess.ten_crops(x, 2)
    assert crops.shape == (10, 1, 2, 2, 1)
    np.testing.assert_array_equal(crops[0, 0, :, :, 0], [[0, 1], [3, 4]])  # top-left
    np.testing.assert_array_equal(crops[3, 0, :, :, 0], [[4, 5], [7, 8]])  # bottom-right
    np.testing.assert_array_equal(crops[5, 0, :, :, 0], [[1, 0], [4, 3]])  # flipped top-left
    # A "model" that reads the top-left pixel of its crop: corners 0, 1, 3, 4, centre 0 (3x3 -> 2x2 centre is
    # top-left aligned), flips 1, 2, 4, 5, 1.
    logits = preprocess.multi_crop_logits(lambda c: c[:, 0, 0, :], x, 2)
    np.testing.assert_allclose(logits, [[(0 + 1 + 3 + 4 + 0 + 1 + 2 + 4 + 5 + 1) / 10]])


def test_random_crop_flip_is_keyed_and_keeps_content():
    x = jnp.arange(4 * 6 * 6 * 2, dtype=jnp.float32).reshape(4, 6, 6, 2)
    a = preprocess.random_crop_flip(jax.random.key(0), x, padding=2)
    b = preprocess.random_crop_flip(jax.random.key(0), x, padding=2)
    c = preprocess.random_crop_flip(jax.random.key(1), x, padding=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and a.shape == x.shape
    unpadded = preprocess.random_crop_flip(jax.random.key(0), x, padding=0, flip=False)
    np.testing.assert_array_equal(unpadded, x)
    with pytest.raises(ValueError, match="crop size=7"):
        preprocess.center_crop(x, 7)


def test_multi_crop_evaluation_averages_the_ten_crops():
    model = asgd_jax.models.get("resnet20", num_classes=10, input_shape=(8, 8, 3), blocks_per_stage=1, widths=(4, 8, 8))
    params, state = model.init(jax.random.key(0))
    x = _normal((5, 8, 8, 3))
    y = jnp.arange(5) % 10
    got = jax.jit(asgd_jax.classification_eval(model, {"x": x, "y": y}, crop=6, multi_crop=True))(params, state)
    apply = jax.jit(lambda c: model.apply(params, state, c)[0])
    logits = jnp.mean(jnp.stack([apply(c) for c in preprocess.ten_crops(x, 6)]), axis=0)
    np.testing.assert_allclose(got["loss"], asgd_jax.models.cross_entropy(logits, y), rtol=1e-5)
    centre = jax.jit(asgd_jax.classification_eval(model, {"x": x, "y": y}, crop=6))(params, state)
    want = asgd_jax.models.cross_entropy(apply(preprocess.center_crop(x, 6)), y)
    np.testing.assert_allclose(centre["loss"], want, rtol=1e-5)


def test_training_augmentation_is_optional_keyed_and_changes_the_batch():
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    params, state = model.init(jax.random.key(0))
    batch = {"x": _normal((6, 8, 8, 1)), "y": jnp.arange(6)}
    plain = jax.jit(asgd_jax.classification_loss(model))
    augmented = jax.jit(asgd_jax.classification_loss(model, augment=True))
    base = plain(params, state, batch, jax.random.key(2))[0]
    a = augmented(params, state, batch, jax.random.key(2))[0]
    assert float(a) != float(base)
    np.testing.assert_array_equal(a, augmented(params, state, batch, jax.random.key(2))[0])
    assert float(augmented(params, state, batch, jax.random.key(3))[0]) != float(a)
