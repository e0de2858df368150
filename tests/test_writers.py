"""Metric writers: TensorBoard event files beside metrics.jsonl, a callback per record, a callback per study arm.

The event files are read back (the TFRecord framing and tensorboardX's own protobuf) and compared with
``metrics.jsonl`` record by record; a sink that raises stops the run like a full disk.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct
import threading

import jax
import pytest
from helpers.problems import DATA, W0, Column, lsq_loss

import asgd_jax
from asgd_jax import studies, writers
from asgd_jax.errors import RunStopped
from asgd_jax.plan import Plan

pytest.importorskip("tensorboardX")


def read_events(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``folder``, by tag: ``[(step, value), ...]`` in file order."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def _train(tmp_path, data=DATA, **kw):
    config = asgd_jax.TrainConfig(
        Plan(2, num_updates=200, batch_size=8), out=str(tmp_path), progress=False, log_every=0.05, **kw
    )
    evaluate = lambda w, _: {"loss": lsq_loss(w, DATA)}
    return lambda **more: asgd_jax.train(
        lsq_loss, asgd_jax.asgd(0.05), W0, data, config, eval_fn=evaluate, devices=jax.devices()[:2], **more
    )


class GatedColumn(Column):
    """A data column that no worker thread can read before ``gate`` is set (the caller's thread, which checks and
    fingerprints the data, reads it at once): the run cannot end before the driver has written a record of training,
    however fast the machine (no test of the records may depend on timing)."""

    def __init__(self, array, gate: threading.Event):
        super().__init__(array)
        self.gate = gate

    def read(self) -> None:
        if threading.current_thread() is not threading.main_thread() and not self.gate.wait(timeout=120):
            raise TimeoutError("the driver wrote no training record in 120 s")


def test_the_trainer_writes_every_record_to_tensorboard_and_to_the_callback(tmp_path):
    seen, trained = [], threading.Event()

    def sink(record):
        seen.append(record)
        if record["kind"] == "train":
            trained.set()

    _train(tmp_path, {"x": GatedColumn(DATA["x"], trained), "y": DATA["y"]}, tensorboard=True)(on_metrics=sink)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert seen == records and {r["kind"] for r in records} >= {"train", "eval", "final"}
    events = read_events(tmp_path / "tensorboard")
    for record in records:
        for tag, value in writers.scalars(record).items():
            assert (record["update"], pytest.approx(value, rel=1e-6)) in events[tag], (tag, record)
    assert sum(len(v) for v in events.values()) == sum(len(writers.scalars(r)) for r in records)


def test_a_resumed_run_hides_the_lost_updates_events_from_tensorboard(tmp_path):
    """After a kill, events of updates past the checkpoint were written by work the checkpoint lost: a resume's event
    file starts with tensorboardX's purge marker at the update after the checkpoint's, so TensorBoard hides them."""
    from tensorboardX.proto import event_pb2

    _train(tmp_path, tensorboard=True)()
    config = asgd_jax.TrainConfig(
        Plan(2, num_updates=260, batch_size=8), out=str(tmp_path), progress=False, tensorboard=True, resume=True
    )
    asgd_jax.train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config, devices=jax.devices()[:2])
    marks = []
    for path in sorted((tmp_path / "tensorboard").rglob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                marks.append(event.step)
    assert marks == [201]  # the first session's events end at update 200 (its checkpoint): none hidden there
    assert len(list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))) == 2  # one a session, none empty
    steps = {step for events in read_events(tmp_path / "tensorboard").values() for step, _ in events}
    assert min(steps) <= 200 < max(steps)  # the first session's events kept (a same-second file truncated them)


def test_a_callback_that_raises_stops_the_run_keeping_its_checkpoint(tmp_path):
    def broken(record):
        if record["kind"] == "eval":
            raise ValueError("the dashboard is down")

    with pytest.raises(RunStopped, match="a metrics sink failed: ValueError: the dashboard is down"):
        _train(tmp_path)(on_metrics=broken)
    assert (tmp_path / "checkpoint.npz").exists()


def test_without_the_extra_tensorboard_is_refused_with_the_install_command(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(asgd_jax.errors.MissingDependency, match=r"pip install 'asgd_jax\[tensorboard\]'"):
        _train(tmp_path, tensorboard=True)()
    assert not (tmp_path / "trace.jsonl").exists()  # refused before the run started


def test_a_study_hands_each_arm_to_its_callback_and_saves_its_curves_as_events(tmp_path):
    study = studies.load("dcasgd_table1")
    tiny = dataclasses.replace(
        study.quick, dataset="digits", seeds=(0,), epochs=0.5, evals=2, window=10, workers=(1, 2)
    )
    finished = []
    result = studies.run(
        study,
        settings=dataclasses.replace(tiny, algorithms=("asgd", "dc_asgd_a")),
        progress=False,
        on_arm=lambda arm, runs, curves: finished.append((arm.coords, len(runs), sorted(curves))),
    )
    assert [c for c, _, _ in finished] == [arm.coords for arm in study.arms(result.settings, False)]
    assert sum(n for _, n, _ in finished) == len(result.runs)
    assert sorted(name for _, _, names in finished for name in names) == sorted(result.curves)
    studies.save(result, tmp_path, plots=(), tensorboard=True)
    assert len(list((tmp_path / "tensorboard").iterdir())) == len(result.curves)
    for name, curve in result.curves.items():
        events = read_events(tmp_path / "tensorboard" / writers.folder_name(name))
        assert [s for s, _ in events["train/error"]] == curve["update"]
        assert [v for _, v in events["train/error"]] == pytest.approx(curve["train_error"], rel=1e-6)
        assert [v for _, v in events["eval/error"]] == pytest.approx(curve["test_error"], rel=1e-6)
