"""TFDS datasets, tested with tfds.testing.mock_data and never the network."""

from __future__ import annotations

import pathlib
import time

import jax
import numpy as np
import pytest

import asgd_jax
from asgd_jax import data
from asgd_jax.cli import main

tfds = pytest.importorskip("tensorflow_datasets")


# TFDS makes a temporary folder for every builder of a dataset not prepared on disk (DatasetInfo.
# initialize_from_bucket) and never removes it: 40 a run in /tmp before.
pytestmark = pytest.mark.usefixtures("scratch_tempdir")


@pytest.fixture
def mocked(monkeypatch, no_network):
    """TFDS's mock data; it has no files on disk, so the prepared-files check is bypassed (tested separately)."""
    monkeypatch.setattr(data, "_require_prepared", lambda *args: None)
    data.clear_cache()
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        yield
    data.clear_cache()


@pytest.mark.parametrize(
    ("name", "shape", "classes"),
    [("tfds:cifar10", (32, 32, 3), 10), ("tfds:mnist", (28, 28, 1), 10), ("tfds:fashion_mnist", (28, 28, 1), 10)],
)
def test_tfds_datasets_load_into_memory(mocked, tmp_path, name, shape, classes):
    ds = data.load(name, data_dir=tmp_path)
    assert ds.input_shape == shape and ds.num_classes == classes
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    assert len(ds.y_train) == 24 and len(ds.y_test) == 24
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)  # per-channel standardised
    assert ds.y_train.min() >= 0 and ds.y_train.max() < classes


def test_imagenet_source_streams_and_refuses_in_memory_loading(mocked, tmp_path):
    source, info = data.tfds_source("tfds:imagenet2012", "validation", data_dir=tmp_path)
    example = source[0]
    assert example["image"].ndim == 3 and example["image"].shape[-1] == 3
    assert info.features["label"].num_classes == 1000
    with pytest.raises(ValueError, match="varying size"):
        data.load("tfds:imagenet2012", data_dir=tmp_path, test_split="validation")


def test_tfds_dataset_trains_through_the_simulator(mocked, tmp_path):
    ds = data.load("tfds:mnist", data_dir=tmp_path)
    model = asgd_jax.models.get("mlp", num_classes=ds.num_classes, input_shape=ds.input_shape, hidden=(16,))
    params, state = model.init(jax.random.key(0))
    result = asgd_jax.simulate(
        asgd_jax.classification_loss(model),
        asgd_jax.asgd(0.1),
        params,
        ds.train,
        asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=4, num_updates=30),
        model_state=state,
        progress=False,
    )
    assert result.metrics["loss"][-10:].mean() < result.metrics["loss"][:10].mean()


def test_unprepared_dataset_fails_fast_offline_with_the_prepare_command(no_network, tmp_path):
    data.clear_cache()
    start = time.perf_counter()
    with pytest.raises(data.DatasetNotPrepared) as info:
        data.load("tfds:cifar10", data_dir=tmp_path)
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "'tfds:cifar10' is not prepared" in message
    assert str(tmp_path) in message
    assert f"asgd-jax data prepare tfds:cifar10 --data-dir {tmp_path}" in message


def test_bad_tfds_names_raise(no_network, tmp_path):
    with pytest.raises(ValueError, match="tfds:<name>"):
        data.load("tfds:", data_dir=tmp_path)
    with pytest.raises(ValueError, match="no dataset 'not_a_dataset_xyz'"):
        data.load("tfds:not_a_dataset_xyz", data_dir=tmp_path)


def test_cli_reports_an_unprepared_dataset(no_network, tmp_path, capsys):
    data.clear_cache()
    argv = ["ablate", "--dataset", "tfds:cifar10", "--data-dir", str(tmp_path), "--no-progress"]
    argv += ["--out", str(tmp_path / "out")]
    for _ in range(2):  # and again: the first left no unfinished run to resume (no arm had run)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "asgd-jax data prepare tfds:cifar10" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_the_dcasgd_full_form_runs_end_to_end_on_mock_data(mocked, tmp_path):
    import dataclasses

    from asgd_jax import studies

    study = studies.load("dcasgd_table1")
    s = study.full
    # The paper's setup, pinned (DC-ASGD, Zheng et al. 2017: CIFAR-10, ResNet-20, 160 epochs, batch 128, lr 0.5
    # divided by 10 at epochs 80 and 120, lambda 0.04 / 2, m 0.95, no momentum, M in {1, 4, 8}).
    assert (s.dataset, s.model, s.workers, s.epochs, s.batch_size) == (
        "tfds:cifar10",
        "resnet20",
        (1, 4, 8),
        160.0,
        128,
    )
    assert (s.learning_rate, s.lam_c, s.lam_a, s.mean_square_decay, s.momentum) == (0.5, 0.04, 2.0, 0.95, None)
    assert schedule_boundaries(s, 160) == (80, 120)
    # A few updates end to end on mock CIFAR-10: one worker count, shrunk batch and budget.
    small = dataclasses.replace(
        s,
        data_dir=str(tmp_path),
        workers=(2,),
        algorithms=("asgd", "dc_asgd_a"),
        seeds=(0,),
        epochs=2.0,
        batch_size=4,
        evals=2,
        window=2,
        model_options={"blocks_per_stage": 1},  # (ResNet-8: the same code, a third of the layers to compile)
    )
    result = studies.run(study, settings=small, progress=False)
    assert {r["label"] for r in result.runs} == {"ASGD", "DC-ASGD-a"}
    paths = studies.save(result, tmp_path / "out", plots=("panels",))
    assert pathlib.Path(paths["plot"]).exists()


def schedule_boundaries(settings, num_updates):
    """The learning-rate drops of a study's schedule, found by evaluating it."""
    from asgd_jax import studies

    lr = studies.schedule(settings, num_updates)
    values = [float(lr(t)) for t in range(num_updates + 1)]
    return tuple(t for t in range(1, num_updates + 1) if values[t] < values[t - 1] * 0.5)


@pytest.mark.parametrize("name", ["tfds:tiny_shakespeare", "tfds:lm1b"])
def test_a_prepared_text_corpus_is_language_modelling_per_character(mocked, tmp_path, name):
    # TFDS's mock text: short random strings, one per example; the splits are joined by newlines and cut in windows.
    ds = data.load(name, data_dir=tmp_path)
    source, _ = data.tfds_source(name, "train", data_dir=tmp_path)
    text = "\n".join(str(source[i]["text"]) for i in range(len(source)))
    alphabet = sorted(set(text))
    assert ds.input_shape == (data.TEXT_WINDOW,) and ds.num_classes == len(alphabet) + 1
    assert ds.x_train.dtype == ds.y_train.dtype == np.int32
    assert len(ds.x_train) == (len(text) - 1) // data.TEXT_WINDOW
    decoded = "".join(alphabet[i] for i in ds.x_train.reshape(-1))
    assert decoded == text[: len(decoded)]  # the windows cut the training text in order
    np.testing.assert_array_equal(ds.y_train[:, :-1], ds.x_train[:, 1:])  # the label is the next character
    assert ds.x_test.max() <= len(alphabet)  # a character only the test split holds is the last id
    model = asgd_jax.models.get("transformer", num_classes=ds.num_classes, input_shape=ds.input_shape, width=16,
                                depth=1, heads=2)  # fmt: skip
    params, state = model.init(jax.random.key(0))
    metrics = asgd_jax.classification_eval(model, ds.test)(params, state)
    assert set(metrics) == {"loss", "error", "perplexity"}
