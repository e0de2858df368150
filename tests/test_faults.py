"""Faults, injected: nothing hangs, nothing is lost silently, and every bad input gets one clear line.

Divergence (a huge learning rate, NaN data), a full disk (a process whose file-size limit makes writes fail, as a full
disk does), an applier that dies (a rule that raises on the host), truncated, missing and corrupted files, timeouts,
and a catalogue of bad flags and arguments.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import optax
import pytest
from helpers.problems import DATA, PLAN_FIELDS, W0, lsq_loss, simulate_clean

import asgd_jax
from asgd_jax import checkpoint
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError, RunStopped
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train

REPO = pathlib.Path(__file__).resolve().parents[1]
GUARD = 300.0  # a run that hangs would end here (as a timeout) and fail the test's assertions, never block the suite


def _train(rule, config, data=DATA, **kw):
    return train(lsq_loss, rule, W0, data, config, devices=jax.devices()[:2], **kw)


# --------------------------------------------------------------------------------------------------------------------
# Divergence
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        Plan(2, mode="sync", num_updates=50, batch_size=8),
        Plan(asgd_jax.delays.MSync(2, 1), num_updates=50, batch_size=8),
    ],
    ids=["ssgd", "m-synchronous"],
)
def test_a_round_whose_update_diverges_stops_the_run_at_once(tmp_path, plan):
    """The applier stops the store while a worker holds the round's lock waiting for that very update: the store
    must not wait for the lock (it did, until the run's timeout, and the waiting worker failed with a TimeoutError)."""
    config = TrainConfig(plan, out=str(tmp_path), timeout=GUARD, progress=False)
    with pytest.raises(RunStopped, match="the weights turned NaN or Inf at update 1"):
        train(lsq_loss, asgd_jax.asgd(1e38), W0 + 1.0, DATA, config, devices=jax.devices()[:2])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == {} and summary["pushes_applied"] == 1


def test_a_diverging_run_stops_and_keeps_the_last_finite_checkpoint(tmp_path):
    config = TrainConfig(
        Plan(2, num_updates=10_000, batch_size=8, checkpoint_every=1), out=str(tmp_path), timeout=GUARD, progress=False
    )
    with pytest.raises(RunStopped, match="weights turned NaN or Inf at update"):
        _train(asgd_jax.asgd(1e12), config)
    saved = np.load(tmp_path / "checkpoint.npz")
    leaves = [saved[k] for k in saved.files if k.startswith("leaf_")]
    assert all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.floating))  # the last good state
    assert not (tmp_path / "model.npz").exists()  # NaN weights are never saved as a model
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ended"] == "stopped" and "diverged" in summary["error"]


def test_a_run_whose_every_push_is_nan_stops_after_max_nonfinite(tmp_path):
    poisoned = {"x": np.full_like(DATA["x"], np.nan), "y": DATA["y"]}
    config = TrainConfig(Plan(2, num_updates=100, batch_size=8), max_nonfinite=6, timeout=GUARD, progress=False)
    with pytest.raises(RunStopped, match=r"6 pushes in a row held NaN or Inf.*\(--max-nonfinite\)"):
        _train(asgd_jax.asgd(0.1), config, data=poisoned)


def test_the_cli_reports_divergence_in_one_line_and_exits_non_zero(tmp_path, capsys):
    argv = [
        "train",
        "--dataset",
        "digits",
        "--workers",
        "2",
        "--num-updates",
        "2000",
        "--lr",
        "1e9",
        "--schedule",
        "constant",
        "--batch-size",
        "16",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "training stopped at update" in err and "diverged" in err and "Traceback" not in err
    saved = (tmp_path / "run" / "checkpoint.npz").exists()  # a checkpoint is promised only where there is one
    assert ("The last good checkpoint" in err) == saved and ("No checkpoint had been written yet" in err) != saved


def test_the_simulator_says_when_its_loss_turns_nan():
    poisoned = {"x": DATA["x"].copy(), "y": DATA["y"]}
    poisoned["x"][5] = np.nan
    run = lambda **kw: asgd_jax.simulate(
        lsq_loss,
        asgd_jax.asgd(0.05),
        W0,
        poisoned,
        asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=8, num_updates=40),
        progress=False,
        **kw,
    )
    with pytest.warns(RuntimeWarning, match="NaN or Inf from update"):
        run()
    with pytest.raises(FloatingPointError, match="on_nonfinite='stop'"):
        run(on_nonfinite="stop")
    with pytest.raises(ConfigError, match="params hold NaN"):
        asgd_jax.simulate(
            lsq_loss,
            asgd_jax.asgd(0.05),
            np.full(4, np.nan, np.float32),
            DATA,
            asgd_jax.Plan(batch_size=8),
            progress=False,
        )


def test_a_sweep_says_how_many_of_its_runs_diverged():
    """A grid whose large learning rates blow up: the sweep warns once, naming how many of its runs diverged (not
    the copies that pad a sharded sweep)."""
    keys, hp = asgd_jax.grid(seeds=[0], learning_rate=[0.05, 1e3, 1e4])
    plan = asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=8, num_updates=40)
    sweep = lambda **kw: asgd_jax.sweep(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, plan, keys=keys, hparams=hp, **kw)
    with pytest.warns(RuntimeWarning, match=r"2 of its 3 runs diverged"):
        losses = sweep(progress=False).metrics["loss"]
    assert np.isfinite(losses[0]).all() and not np.isfinite(losses[1:, -1]).any()
    with pytest.warns(RuntimeWarning, match=r"2 of its 3 runs diverged"):
        sweep(progress=False, devices=jax.devices()[:4])  # padded to 4 runs with a copy of a diverged one


# --------------------------------------------------------------------------------------------------------------------
# A full disk, a dead applier, a timeout
# --------------------------------------------------------------------------------------------------------------------


def _python(script: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR="",
    )
    prologue = ""
    if fsize is not None:  # every file this process writes is capped: a write past it fails, as on a full disk
        prologue = (
            f"import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n"
        )
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _train_on_a_full_disk(config: str, fsize: int) -> subprocess.CompletedProcess:
    """``train`` of the least-squares problem with ``TrainConfig(<config>, progress=False)`` in a process whose every
    file is capped at ``fsize`` bytes; it prints ``STOPPED <message>`` for a RunStopped."""
    script = f"""
        import sys; sys.path.insert(0, "tests")
        import asgd_jax
        from asgd_jax import Plan
        from helpers.problems import DATA, W0, lsq_loss
        from asgd_jax.errors import RunStopped
        from asgd_jax.trainer import TrainConfig, train
        try:
            train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, TrainConfig({config}, progress=False))
        except RunStopped as e:
            print("STOPPED", e)
    """
    return _python(script, fsize=fsize)


@pytest.mark.parametrize("fsize", [2_500, 6_000], ids=["full before the first checkpoint", "full mid-run"])
def test_a_full_disk_stops_the_run_with_its_error_and_leaves_the_last_good_checkpoint(tmp_path, fsize):
    config = f"Plan(2, num_updates=2000, batch_size=8, checkpoint_every=10), out={str(tmp_path)!r}, log_every=0.05"
    run = _train_on_a_full_disk(f"{config}, timeout={GUARD}", fsize)
    assert "STOPPED" in run.stdout, run.stdout + run.stderr
    assert "failed" in run.stdout and ("File too large" in run.stdout or "free space" in run.stdout)
    if "free space and" in run.stdout:  # a checkpoint is promised only where there is one
        assert ("free space and resume" in run.stdout) == (tmp_path / "checkpoint.npz").exists(), run.stdout
    if (tmp_path / "checkpoint.npz").exists():  # whatever is there is whole: the atomic write kept the previous one
        saved = np.load(tmp_path / "checkpoint.npz")
        assert json.loads(bytes(saved["__header__"]).decode())["applied"] >= 10


@pytest.mark.parametrize("fsize", [2_500, 3], ids=["args.json fails", "the lock's pid fails first"])
def test_a_disk_full_before_the_run_starts_stops_it_in_one_message_before_any_worker(tmp_path, fsize):
    """The records written as a run takes its folder (args.json, plan.json) fail on a full disk: a RunStopped saying
    so, not a traceback from deep inside, and nothing ran. The folder's lock holds even when its note of the
    holder's process cannot be written."""
    run = _train_on_a_full_disk(
        f'Plan(2, num_updates=50, batch_size=8), out={str(tmp_path)!r}, args={{"n": "x" * 4000}}', fsize
    )
    assert "STOPPED a write failed (File too large)" in run.stdout, run.stdout + run.stderr
    assert "args.json could not be written, and the run did not start" in run.stdout
    assert not (tmp_path / "checkpoint.npz").exists() and not (tmp_path / "trace.jsonl").exists()


def test_a_stopped_runs_message_says_what_its_folder_holds_once_a_write_under_way_ends(tmp_path, monkeypatch):
    # A run that stops while its checkpoint writer is mid-write (the trace's disk fills at update 23, the checkpoint
    # of update 20 still being written) must not say "no checkpoint" and then leave one: the message waits for the
    # write under way. (The write is held open until a timer lets it go; whenever the message is asked, after or
    # during the write, it names what the folder holds once the write is done.)
    from asgd_jax.trainer.persistence import Checkpoints

    started, release, real_save = threading.Event(), threading.Event(), checkpoint.save

    def slow_save(path, *contents):
        started.set()
        release.wait(60)
        real_save(path, *contents)

    monkeypatch.setattr(checkpoint, "save", slow_save)
    errors = []
    keeper = Checkpoints(tmp_path, 10, errors.append)
    state = asgd_jax.server.init(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2)
    keeper.submit((state, {"positions": np.zeros(2, np.int64)}, {"applied": 20}))
    assert started.wait(60)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    assert keeper.way_on() == "resume (--resume)" and keeper.exists()
    assert keeper.kept() == "the last checkpoint holds the last finite weights"
    keeper.close()
    timer.join()
    assert not errors


def test_a_dead_applier_stops_the_run_at_once_with_its_error():
    calls = {"n": 0}

    def explode(x):
        calls["n"] += 1
        if calls["n"] == 6:  # the warm-up compiles and runs once; a few pushes go through
            raise RuntimeError("injected fault in the applier")
        return x

    base = asgd_jax.asgd(0.05)

    def update(g, state, params=None, **extra):
        g = jax.tree.map(lambda x: jax.pure_callback(explode, x, x), g)
        return base.update(g, state, params, **extra)

    rule = optax.GradientTransformationExtraArgs(base.init, update)
    config = TrainConfig(Plan(2, num_updates=10_000, batch_size=8), timeout=GUARD, progress=False)
    with pytest.raises(RunStopped, match=r"(?s)applier failed: .*injected fault in the applier"):
        _train(rule, config)


def test_a_checkpoint_never_pins_trace_lines_that_could_not_be_written_out(tmp_path):
    # The trace is flushed before a checkpoint pins its lines; when that flush fails (a full disk), the store stops with
    # the trace's error and writes no checkpoint of those lines: the one on disk stays the last good one.
    from asgd_jax.trainer.store import ParameterStore, StoreClosed

    store = ParameterStore(
        asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2, out_dir=tmp_path, checkpoint_dir=tmp_path,
        checkpoint_every=2,
    )  # fmt: skip
    try:
        _, _, version = store.pull(0)
        for _ in range(2):
            _, _, version = store.push(0, {"w": np.ones(3, np.float32)}, version).result(timeout=30)
        assert store.checkpoints.kept() == "the last checkpoint holds the last finite weights"  # (written: update 2)
        assert json.loads(bytes(np.load(tmp_path / "checkpoint.npz")["__header__"]).decode())["trace_lines"] == 2

        def full(*_):
            raise OSError(28, "No space left on device")

        store.ledger.trace.flush = full
        for _ in range(2):
            try:
                _, _, version = store.push(0, {"w": np.ones(3, np.float32)}, version).result(timeout=30)
            except StoreClosed:
                break
    finally:
        store.close()
    assert "No space left on device" in str(store.error)
    assert json.loads(bytes(np.load(tmp_path / "checkpoint.npz")["__header__"]).decode())["trace_lines"] == 2


def test_the_loss_of_a_program_that_failed_is_left_out_of_the_progress_not_raised_in_the_driver():
    # When the applier's program dies (above), a loss it was to compute may reach the driver's progress poll before the
    # store says why: reading it raised there, in the driver's place, instead of the store's error (a race: seen once
    # in a full suite run). The losses that can be read are kept, in order.
    from asgd_jax.trainer.endpoint import readable_losses

    class Failed:
        def __float__(self):
            raise jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: injected")

    assert readable_losses([np.float32(2.0), Failed(), jax.numpy.float32(3.0)]) == [2.0, 3.0]
    assert readable_losses([jax.numpy.float32(1.5)]) == [1.5]


def test_a_run_cut_short_by_its_timeout_says_so(tmp_path, capsys):
    config = TrainConfig(
        Plan(2, num_updates=10**7, batch_size=8), out=str(tmp_path / "api"), timeout=1.0, progress=False
    )
    result = _train(asgd_jax.asgd(0.05), config)
    assert result.ended == "timeout" and 0 < result.pushes_applied < 10**7
    assert json.loads((tmp_path / "api" / "summary.json").read_text())["ended"] == "timeout"
    argv = [
        "train",
        "--dataset",
        "digits",
        "--workers",
        "2",
        "--num-updates",
        "10000000",
        "--timeout",
        "1",
        "--lr",
        "0.1",
        "--schedule",
        "constant",
        "--no-progress",
        "--out",
        str(tmp_path / "cli"),
    ]
    assert main(argv) == 3
    assert "stopped by --timeout 1 s after" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# Resume: what makes the trace replay is checked
# --------------------------------------------------------------------------------------------------------------------


def _base(tmp_path, **kw):
    plan = dict(num_updates=20, batch_size=8, checkpoint_every=5)
    values = dict(seed=3, out=str(tmp_path), progress=False, timeout=GUARD)
    for k, v in kw.items():
        (plan if k in PLAN_FIELDS else values)[k] = v
    return TrainConfig(Plan(2, **plan), **values)


def test_a_half_written_trace_line_is_cut_on_resume_and_the_trace_still_replays(tmp_path):
    rule = lambda: asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)
    _train(rule(), _base(tmp_path))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(trace.read_text() + '{"worker": 1, "pulled_ver')  # killed mid-write of update 21
    result = _train(rule(), _base(tmp_path, num_updates=30, resume=True))
    assert result.resumed_from == 20 and result.pushes_applied == 30
    loaded = asgd_jax.delays.Trace.load(trace)
    assert len(loaded) == 30 and loaded.num == 2
    replay = simulate_clean(rule(), loaded, 30, batch_size=8)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


def test_a_resume_without_a_whole_trace_or_with_other_settings_is_refused(tmp_path):
    _train(asgd_jax.asgd(0.05), _base(tmp_path))
    lines = (tmp_path / "trace.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "trace.jsonl").write_text("".join(lines[:15]))
    with pytest.raises(ConfigError, match="holds 15 whole records but the checkpoint is at record 20"):
        _train(asgd_jax.asgd(0.05), _base(tmp_path, num_updates=30, resume=True))
    (tmp_path / "trace.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"trace\.jsonl is missing"):
        _train(asgd_jax.asgd(0.05), _base(tmp_path, num_updates=30, resume=True))
    (tmp_path / "trace.jsonl").write_text("".join(lines))
    with pytest.raises(ConfigError, match="rule_probe: checkpoint"):  # another learning rate: another rule
        _train(asgd_jax.asgd(0.5), _base(tmp_path, num_updates=30, resume=True))
    with pytest.raises(ConfigError, match="local_lr"):
        _train(asgd_jax.asgd(0.05), _base(tmp_path, num_updates=30, resume=True, n_sync=1, local_lr=0.1))
    with pytest.raises(ConfigError, match="no checkpoint"):
        _train(asgd_jax.asgd(0.05), _base(tmp_path / "elsewhere", resume=True))
    fresh = _train(asgd_jax.asgd(0.05), _base(tmp_path / "elsewhere", resume="auto"))  # nothing there: it starts
    assert fresh.resumed_from == 0 and fresh.pushes_applied == 20


def test_the_trace_records_the_worker_count_for_a_worker_that_never_pushed(tmp_path):
    rule = lambda: asgd_jax.asgd(0.05)
    config = TrainConfig(
        Plan(3, num_updates=24, batch_size=8),
        seed=3,
        out=str(tmp_path),
        slowdown={2: 500.0},
        progress=False,
        timeout=GUARD,
    )
    result = train(lsq_loss, rule(), W0, DATA, config, devices=jax.devices()[:3])
    trace = asgd_jax.delays.Trace.load(result.trace_path)  # the README's recipe, without num=
    assert trace.num == 3
    replay = simulate_clean(rule(), trace, 24, batch_size=8)
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("damage", ["truncated", "empty", "bit-flipped", "random bytes"])
def test_a_damaged_checkpoint_is_reported_in_one_line(tmp_path, damage, capsys):
    _train(asgd_jax.asgd(0.05), _base(tmp_path))
    path = tmp_path / "checkpoint.npz"
    raw = path.read_bytes()
    damaged = {
        "truncated": raw[: len(raw) // 2],
        "empty": b"",
        "bit-flipped": raw[:200] + bytes([raw[200] ^ 0xFF]) + raw[201:],
        "random bytes": np.random.default_rng(0).bytes(len(raw)),
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ConfigError, match=r"checkpoint\.npz is not a readable checkpoint"):
        _train(asgd_jax.asgd(0.05), _base(tmp_path, num_updates=30, resume=True))
    argv = ["train", "--dataset", "digits", "--warm-start", str(path), "--no-progress", "--out", str(tmp_path / "w")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not a readable checkpoint" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------------------------
# Bad input: one line, the flag or argument named, exit status 2
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], r"workers=0 \(--workers\) is invalid"),
        (["--mode", "sync", "--n-sync", "2"], r"\(--n-sync\).*\(--local-lr\)"),
        (["--timeout", "0"], r"timeout=0.0 \(--timeout\) is invalid"),
        (["--checkpoint-every", "0"], r"checkpoint_every=0 \(--checkpoint-every\) is invalid"),
        (["--local-lr", "-1"], r"local_lr=-1.0 \(--local-lr\) is invalid"),
        (["--lr", "inf"], r"learning_rate=inf \(--lr\) is invalid"),
        (["--max-nonfinite", "0"], r"max_nonfinite=0 \(--max-nonfinite\) is invalid"),
        (["--slowdown", "fast"], r"--slowdown 'fast' is invalid"),
        (["--rule", "asgd", "--lam", "0.5"], r"--rule"),
    ],
)
def test_bad_flags_get_one_line_naming_the_flag(tmp_path, capsys, flags, message):
    assert main(["train", *flags, "--no-progress", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asgd-jax: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_output_folders_that_cannot_hold_a_run_are_refused(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for out, message in ((a_file, "is a file"), (a_file / "below", "cannot be written")):
        assert main(["train", "--no-progress", "--num-updates", "5", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--no-progress", "--resume", "--out", str(tmp_path / "nothing_here")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_bad_python_arguments_raise_naming_them():
    with pytest.raises(ConfigError, match="learning_rate=inf"):
        asgd_jax.asgd(float("inf"))
    with pytest.raises(ConfigError, match=r"learning_rate=.0\.1."):
        asgd_jax.asgd("0.1")


def test_files_that_are_not_traces_or_models_are_named(tmp_path):
    binary = tmp_path / "trace.jsonl"
    binary.write_bytes(np.random.default_rng(0).bytes(256))
    with pytest.raises(ConfigError, match=r"trace\.jsonl is not a readable trace"):
        asgd_jax.delays.Trace.load(binary)
    garbage = tmp_path / "model.npz"
    garbage.write_bytes(b"PK\x03\x04" + np.random.default_rng(1).bytes(100))
    with pytest.raises(ConfigError, match=r"model\.npz is not a readable checkpoint"):
        checkpoint.load_model(garbage, W0)


def test_a_saved_model_of_ml_dtypes_weights_loads_back_and_a_misfit_is_still_named(tmp_path):
    # .npz keeps a dtype NumPy does not name as raw bytes (|V2 for bfloat16, |V1 for a dozen 1-byte ones) or with a
    # descriptor np.load cannot read (float8_e5m2's <f1): each leaf's dtype is kept beside it, by name.
    import ml_dtypes

    params = {
        "w": np.asarray([1.5, -2.0, 3.25], ml_dtypes.bfloat16),
        "s": np.asarray([1.0, -0.5], ml_dtypes.float8_e4m3fn),
        "e": np.asarray([2.0, 0.25], ml_dtypes.float8_e5m2),
        "q": np.asarray([-3, 5], ml_dtypes.int4),
    }
    checkpoint.save_model(tmp_path / "model.npz", params, None)
    loaded, _ = checkpoint.load_model(tmp_path / "model.npz", jax.tree.map(np.zeros_like, params))
    for name, x in params.items():
        assert loaded[name].dtype == x.dtype and loaded[name].tobytes() == x.tobytes(), name
    for leaf, other in (("w", np.float16), ("s", ml_dtypes.int4), ("s", ml_dtypes.float8_e4m3b11fnuz)):
        template = {**params, leaf: np.zeros(params[leaf].shape, other)}  # the same bytes' size, another dtype
        with pytest.raises(
            ConfigError, match=rf"leaf \d is {params[leaf].dtype}\[\d\] but this run needs {np.dtype(other)}"
        ):
            checkpoint.load_model(tmp_path / "model.npz", template)


def test_a_bfloat16_checkpoint_from_before_dtypes_were_kept_still_loads_and_a_1_byte_one_is_refused(tmp_path):
    import ml_dtypes

    header = np.frombuffer(json.dumps({"kind": "model"}).encode(), np.uint8)
    w, s8 = np.asarray([1.5, -2.0], ml_dtypes.bfloat16), np.asarray([1.0], ml_dtypes.float8_e4m3fn)
    np.savez(tmp_path / "old.npz", leaf_00000=w, __header__=header)  # (np.savez: the bytes, as |V2)
    loaded, _ = checkpoint.load_model(tmp_path / "old.npz", np.zeros(2, ml_dtypes.bfloat16))
    assert loaded.dtype == w.dtype and loaded.tobytes() == w.tobytes()
    np.savez(tmp_path / "old8.npz", leaf_00000=s8, __header__=header)  # |V1: any of a dozen 1-byte dtypes
    with pytest.raises(ConfigError, match=r"leaf 0 is \|V1\[1\] but this run needs float8_e4m3fn\[1\]"):
        checkpoint.load_model(tmp_path / "old8.npz", np.zeros(1, ml_dtypes.float8_e4m3fn))


@pytest.mark.parametrize("names", [b'["no_such_dtype"]', b'["float32", "float32"]', b"not json"])
def test_a_checkpoint_whose_dtype_names_are_damaged_is_named_damaged(tmp_path, names):
    checkpoint.save_model(tmp_path / "model.npz", np.zeros(3, np.float32), None)
    with np.load(tmp_path / "model.npz") as f:
        contents = {k: f[k] for k in f.files}
    contents["__dtypes__"] = np.frombuffer(names, np.uint8)
    np.savez(tmp_path / "model.npz", **contents)
    with pytest.raises(ConfigError, match=r"model\.npz is not a readable checkpoint"):
        checkpoint.load_model(tmp_path / "model.npz", np.zeros(3, np.float32))


# --------------------------------------------------------------------------------------------------------------------
# The compiled programs' cache: a truncated entry, a write that fills the disk
# --------------------------------------------------------------------------------------------------------------------

_CACHED_PROGRAM = """
    import collections, jax, jax.numpy as jnp, asgd_jax
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
    asgd_jax.cache.enable()
    print(jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(3.0)).tolist())
    print("hits", events["/jax/compilation_cache/cache_hits"])
"""


def _cached(where, fsize: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASGD_JAX_CACHE_DIR=str(where), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    prologue = ""
    if fsize is not None:  # every file this process writes is capped: a write past it fails, as on a full disk
        prologue = (
            f"import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n"
        )
    script = prologue + textwrap.dedent(_CACHED_PROGRAM)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_truncated_cache_entry_is_compiled_again_once_and_written_whole(tmp_path):
    """A process killed mid-write left half an entry: JAX fails to read it (a warning) and compiles the program
    again; that run writes it anew (JAX alone never replaces an entry), and the next one loads it."""
    first = _cached(tmp_path)
    assert first.returncode == 0 and "hits 0" in first.stdout, first.stderr
    entries = [p for p in tmp_path.iterdir() if p.name.endswith("-cache")]
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # cut short
    mended = _cached(tmp_path)
    assert mended.returncode == 0 and "Error reading persistent compilation cache entry" in mended.stderr
    assert mended.stdout.splitlines()[0] == first.stdout.splitlines()[0]
    loaded = _cached(tmp_path)
    hits = f"hits {len(entries)}"
    assert loaded.returncode == 0 and "Error reading" not in loaded.stderr and hits in loaded.stdout, loaded
    assert loaded.stdout.splitlines()[0] == first.stdout.splitlines()[0]


def test_a_cache_write_that_fills_the_disk_leaves_no_entry_and_no_temporary_file(tmp_path):
    full = _cached(tmp_path, fsize=2_000)  # each entry is larger than that: its write fails part-way
    assert full.returncode == 0 and "Error writing persistent compilation cache entry" in full.stderr, full.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(("-cache", asgd_jax.cache.TMP_SUFFIX))]
    written, loaded = _cached(tmp_path), _cached(tmp_path)  # no half entry read: compiled, written, then loaded
    assert written.stdout.splitlines()[0] == loaded.stdout.splitlines()[0] == full.stdout.splitlines()[0]
    assert "hits 0" in written.stdout and "hits 0" not in loaded.stdout
    assert "Error reading" not in written.stderr + loaded.stderr, written.stderr + loaded.stderr
