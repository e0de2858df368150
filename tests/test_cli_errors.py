"""The command line's second round of mistakes, injected: one line each, exit status 2, before any work.

A dataset prepared without network, outputs that are files, damaged results, config files with values of the wrong
type, a run without a study, and Ctrl-C at any moment (even one JAX's garbage-collection callback swallows).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import jax
import pytest
from helpers.problems import DATA, W0, lsq_loss

import asgd_jax
from asgd_jax import data, interrupts, studies
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.trainer import TrainConfig, train

REPO = pathlib.Path(__file__).resolve().parents[1]


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("asgd-jax: error: ") and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _never(*args, **kwargs):
    raise AssertionError("the work started before the bad input was refused")


# --------------------------------------------------------------------------------------------------------------------
# No network
# --------------------------------------------------------------------------------------------------------------------


def test_preparing_a_dataset_without_network_fails_at_once_saying_what_to_do_offline(tmp_path, monkeypatch, capsys):
    def unreachable(address, timeout=None):
        assert timeout is not None and timeout <= 10  # never TFDS's minutes of retries
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(data, "_tfds", _never)  # TFDS is never reached
    assert main(["data", "prepare", "mnist", "--data-dir", str(tmp_path / "tfds")]) == 2
    _one_line(capsys, "cannot reach the network", "Network is unreachable", "--data-dir DIR", "digits, mnist1d")


def test_a_data_dir_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "check_network", _never)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["data", "prepare", "mnist", "--data-dir", str(a_file)]) == 2
    _one_line(capsys, "data_dir=", "(--data-dir) is a file")


# --------------------------------------------------------------------------------------------------------------------
# Outputs checked before the work
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["ablate", "--quick"], ["run", "dcasgd_table1", "--quick"]])
def test_an_output_that_is_a_file_is_refused_before_the_study_runs(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setattr(studies, "ablate", _never)
    monkeypatch.setattr(studies, "run", _never)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main([*command, "--out", str(a_file)]) == 2
    _one_line(capsys, "(--out) is a file")
    assert main([*command, "--out", str(a_file / "below")]) == 2
    _one_line(capsys, "(--out) cannot be written")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"study": "x", "settings": ', "is not a readable results file"),
        ("", "is not a readable results file"),
        ('{"study": "x"}', "is not a study's results (it lacks settings"),
        ("[1, 2]", "is not a study's results"),
    ],
    ids=["truncated", "empty", "partial", "not a dict"],
)
def test_report_names_a_damaged_results_file(tmp_path, capsys, content, message):
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "results.json").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    _one_line(capsys, "results.json", message)


def test_report_into_a_folder_that_cannot_be_made_is_refused(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "results.json").write_text("{}")
    assert main(["report", str(tmp_path), "--out", str(a_file / "sub" / "report.md")]) == 2
    _one_line(capsys, "(--out) cannot be written")


def test_run_without_a_study_lists_them_and_says_what_is_missing(capsys):
    assert main(["run"]) == 2
    captured = capsys.readouterr()
    assert "dcasgd_table1" in captured.out
    assert captured.err.startswith("asgd-jax: error: asgd-jax run needs a study")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.txt", "not python", "is not a study file (Python cannot load it as a module)"),
        ("README", "# a readme", "is not a study file (Python cannot load it as a module)"),
        ("syntax.py", "STUDY = = 1\n", "could not be loaded at line 1 (SyntaxError: invalid syntax"),
        ("imports.py", "import os\nimport no_such_module_zz\n", "at line 2 (ModuleNotFoundError: No module named"),
        ("raises.py", "x = 1\n\nraise RuntimeError('boom')\n", "at line 3 (RuntimeError: boom)"),
    ],
)
def test_a_path_that_is_not_a_study_file_is_named_with_what_a_study_file_is(
    tmp_path, monkeypatch, capsys, name, content, message
):
    """`asgd-jax run PATH`: a file Python cannot load as a module, or whose code fails, is one line naming it (and
    the line that failed) and saying what a study file is; nothing runs."""
    monkeypatch.setattr(studies, "run", _never)
    path = tmp_path / name
    path.write_text(content)
    assert main(["run", str(path), "--quick", "--out", str(tmp_path / "out")]) == 2
    _one_line(capsys, str(path), message, "a study file is a Python .py file that defines STUDY = ")


# --------------------------------------------------------------------------------------------------------------------
# Config files: values of the wrong type
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("out = 5", "out = 5 is invalid: give a string"),
        ("dataset = 5", "dataset = 5 is invalid: give a string"),
        ('progress = "no"', "progress = 'no' is invalid: give true or false"),
        ('workers = "4"', "workers = '4' is invalid: give an int"),
        ("workers = 2.5", "workers = 2.5 is invalid: give an int"),
        ("lr = true", "lr = True is invalid: give a number"),
        ('rule = "nope"', "rule = 'nope' is invalid: give one of"),
        ("partition = 0.1", "partition = 0.1 is invalid: give a string"),
        ('resume = "yes"', "resume = 'yes' is invalid: give true, false or 'auto'"),
        ("slowdown = [1, 2]", None),  # a list is what --slowdown takes: parsed, then refused as W:F
    ],
)
def test_config_values_of_the_wrong_type_are_one_line(tmp_path, monkeypatch, capsys, toml, message):
    monkeypatch.setattr(data, "load", _never)
    config = tmp_path / "c.toml"
    config.write_text(toml + "\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    _one_line(capsys, *([f"--config {config}: {message}"] if message else ["--slowdown '1' is invalid"]))


def test_a_config_that_is_a_folder_or_not_a_table_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path)]) == 2
    _one_line(capsys, "cannot be read")
    listed = tmp_path / "c.json"
    listed.write_text("[1, 2]")
    assert main(["train", "--config", str(listed)]) == 2
    _one_line(capsys, "holds list: give a table")


def test_a_dataset_name_that_is_not_a_string_is_named():
    with pytest.raises(ConfigError, match=r"dataset=5 is invalid"):
        data.load(5)


# --------------------------------------------------------------------------------------------------------------------
# Ctrl-C at any moment
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test (a suite started in the background inherits SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _swallowed_ctrl_c() -> None:
    """A Ctrl-C whose KeyboardInterrupt something swallows, as JAX's garbage-collection callback does."""
    try:
        signal.raise_signal(signal.SIGINT)
        for _ in range(10_000):  # the handler runs at the next bytecode boundary: inside this block
            pass
    except KeyboardInterrupt:
        pass


def test_a_ctrl_c_swallowed_while_compiling_still_stops_the_run(tmp_path, monkeypatch, sigint_raises):
    original = asgd_jax.trainer.worker.Worker.warm_up

    def warm_up(self):
        original(self)
        if self.setup.worker == 0:
            _swallowed_ctrl_c()

    monkeypatch.setattr(asgd_jax.trainer.worker.Worker, "warm_up", warm_up)
    config = TrainConfig(asgd_jax.Plan(2, num_updates=10**6, batch_size=8), out=str(tmp_path), timeout=300.0)
    with pytest.raises(KeyboardInterrupt):
        train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config.replace(progress=False), devices=jax.devices()[:2])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ended"] == "interrupted" and summary["pushes_applied"] < 10**6


def test_a_ctrl_c_swallowed_in_the_simulator_stops_it_at_the_next_chunk(monkeypatch, sigint_raises):
    chunks = []

    def callback(done, state):
        chunks.append(done)
        if len(chunks) == 1:
            _swallowed_ctrl_c()

    plan = asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=8, num_updates=400, chunk=100)
    with pytest.raises(KeyboardInterrupt):
        asgd_jax.simulate(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, plan, progress=False, callback=callback)
    assert chunks == [100]


def test_outside_a_watch_nothing_is_remembered(sigint_raises):
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        for _ in range(10_000):
            pass
    interrupts.check()  # no watch: nothing remembered, nothing raised


def test_ctrl_c_while_the_command_starts_jax_exits_130(tmp_path):
    """A real process, interrupted as soon as it says it is loading (JAX starting, then compiling): whenever the
    signal lands, the command ends with 130 instead of training to its end."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ASGD_JAX_CACHE_DIR="off")
    command = [sys.executable, "-m", "asgd_jax", "train", "--dataset", "digits", "--workers", "2"]
    command += ["--num-updates", "1000000"]
    run = subprocess.Popen(
        [*command, "--no-progress", "--out", str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert "loading" in run.stdout.readline()
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_data_that_does_not_fit_the_weights_is_called_a_shape_problem_naming_the_shapes():
    wrong = {"x": DATA["x"][:, :3], "y": DATA["y"]}
    plan = asgd_jax.Plan(asgd_jax.delays.Workers(2), batch_size=8, num_updates=8)
    with pytest.raises(ConfigError, match=r"fails on the shapes .*float32\[4\].*\['x'\]: float32\[8, 3\]"):
        asgd_jax.simulate(lsq_loss, asgd_jax.asgd(0.05), W0, wrong, plan, progress=False)
    with pytest.raises(ConfigError, match="does not take the declared form"):  # a signature problem stays one
        asgd_jax.simulate(lambda w: w.sum(), asgd_jax.asgd(0.05), W0, DATA, plan, progress=False)


def test_the_command_line_starts_without_jax_so_its_ctrl_c_handler_comes_first():
    """The package imports its modules when first used: `import asgd_jax.cli` loads no JAX (whose gc callback would
    swallow an early Ctrl-C), while every public name and module still resolves as an attribute."""
    check = "import sys, asgd_jax.cli; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
    for name in [*asgd_jax.__all__, "studies", "exchange", "ray_cluster"]:
        assert getattr(asgd_jax, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = asgd_jax.nope


def test_ctrl_c_mid_run_says_the_command_that_continues_it_once(tmp_path, capsys, monkeypatch):
    """The library's KeyboardInterrupt ends with its own advice (resume=True); the command line gives its own alone,
    with the folder quoted and the flags a resume does not take from the run's record."""
    import asgd_jax.trainer
    from asgd_jax.trainer.session import CHECKPOINT, RESUME_ADVICE

    out = tmp_path / "a run"

    def interrupted(*args, **kwargs):
        (out / CHECKPOINT).write_bytes(b"")  # (as the run's last checkpoint)
        raise KeyboardInterrupt(f"training interrupted at update 7; {RESUME_ADVICE}")

    monkeypatch.setattr(asgd_jax.trainer, "train", interrupted)
    out.mkdir()
    argv = ["train", "--dataset", "digits", "--out", str(out), "--data-dir", "/data/tf ds", "--no-progress"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"asgd-jax: training interrupted at update 7 (checkpoint in {out}; `asgd-jax train --out '{out}' --resume "
        "--data-dir '/data/tf ds'` continues it, with the run's flags)"
    ]
