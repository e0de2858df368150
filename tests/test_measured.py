"""Worker speeds replayed from a measured table (the Zeus traces, shipped with its source and licence): the table
reads back as shipped, a cluster of GPU models runs at their measured ratios, and bad names are refused."""

from __future__ import annotations

import importlib.resources

import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax import delays
from asgd_jax.delays import measured
from asgd_jax.errors import ConfigError


def test_the_table_ships_with_its_source_and_licence_and_reads_back_whole():
    data = importlib.resources.files("asgd_jax.delays").joinpath("data")
    header = data.joinpath("gpu_epoch_times.csv").read_text().splitlines()[:6]
    assert any("ml-energy/zeus" in line for line in header) and any("Apache License" in line for line in header)
    assert "Apache License" in data.joinpath("ZEUS_LICENSE").read_text()
    table = measured.epoch_times()
    assert len(table) == 38 and set(measured.workloads()) == {
        "cifar100/shufflenetv2",
        "imagenet/resnet50",
        "librispeech/deepspeech2",
        "movielens-1m/ncf",
        "sentiment140/bert_base_uncased",
        "squad/bert_base_uncased",
    }
    assert all(set(row) == set(measured.GPUS) and min(row.values()) > 0 for row in table.values())
    assert table[("imagenet/resnet50", 64)]["v100"] == 3754.323  # a row of summary_power_v100.csv, read as shipped
    # The P100 (2016) is the slowest of the four on every workload and batch size measured.
    assert all(row["p100"] > max(row["v100"], row["a40"]) for row in table.values())


def test_a_cluster_of_gpu_models_pushes_at_their_measured_ratios():
    law = delays.gpu_cluster(["v100", "p100"], workload="imagenet/resnet50", batch_size=64)
    row = measured.epoch_times()[("imagenet/resnet50", 64)]
    np.testing.assert_allclose(law.times, [1.0, row["p100"] / row["v100"]], rtol=1e-6)
    x = np.random.default_rng(0).normal(size=(96, 2)).astype(np.float32)
    data = {"x": x, "y": x.sum(axis=1)}
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
    plan = asgd_jax.Plan(law, num_updates=200, batch_size=8)
    run = asgd_jax.simulate(loss, asgd_jax.asgd(0.05), np.zeros(2, np.float32), data, plan, progress=False)
    counts = np.bincount(np.asarray(run.metrics["worker"]), minlength=2)
    assert abs(counts[0] / counts[1] - row["p100"] / row["v100"]) < 0.05  # 1.727: the V100 pushes that much more


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpus": "v100"}, "gpus"),
        ({"gpus": ["v100", "h100"]}, "gpus"),
        ({"gpus": []}, "gpus"),
        ({"gpus": ["v100"], "workload": "mnist/mlp"}, "workload"),
        ({"gpus": ["v100"], "batch_size": 3}, "batch_size"),
    ],
)
def test_unknown_models_workloads_and_batches_are_refused_naming_the_choices(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        delays.gpu_cluster(**kwargs)
