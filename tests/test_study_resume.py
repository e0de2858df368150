"""A study killed midway resumes: finished arms are kept as they finish, a resume runs only the missing ones and gives
the same tables as an uninterrupted run, and a resume with other settings is refused in one line."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgd_jax import studies
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
STUDY_FILE = """
import dataclasses
from asgd_jax import studies
STUDY = dataclasses.replace(
    studies.load("dcasgd_table1"),
    name="tiny_table1",
    quick=studies.Settings(dataset="digits", seeds=(0,), epochs=0.3, evals=2, window=10, workers=(1, 2, 4)),
)
"""


@pytest.fixture
def study_file(tmp_path):
    path = tmp_path / "tiny_table1.py"
    path.write_text(STUDY_FILE)
    return path


def test_a_study_killed_in_its_third_arm_resumes_to_the_same_tables(tmp_path, study_file, caplog):
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "asgd_jax", "run", str(study_file), "--quick", "--no-progress", "--out", str(out)]
    killed = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        second = out / "arms" / "1.json"
        for _ in range(6000):  # two arms finished: it is in its third (bounded: 600 s)
            if second.exists() or killed.poll() is not None:
                break
            time.sleep(0.1)
        assert killed.poll() is None, killed.stderr.read()
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.wait()
    study = studies.load(str(study_file))
    done = sorted(p.name for p in (out / "arms").iterdir())
    assert {"0.json", "1.json", "study.json"} <= set(done)
    with pytest.raises(ConfigError, match=r"holds an unfinished run of study 'tiny_table1' \(\d of \d arms done\)"):
        studies.run(study, quick=True, progress=False, out=out)
    with caplog.at_level(logging.INFO, logger="asgd_jax.studies"):
        resumed = studies.run(study, quick=True, progress=False, out=out, resume=True)
    assert f"resuming tiny_table1: {len(done) - 1} of {len(study.arms(study.quick, True))} arms done" in caplog.text
    whole = studies.run(study, quick=True, progress=False)
    # The same numbers to the last digit (compared as JSON: a NaN time-to-target equals itself there).
    assert json.dumps(resumed.runs) == json.dumps(whole.runs) and json.dumps(resumed.curves) == json.dumps(whole.curves)
    seeds = len(study.quick.seeds)
    assert studies.format_table(study, resumed.runs, seeds) == studies.format_table(study, whole.runs, seeds)
    # The study's seconds are every session's: the killed one's, up to the last arm it kept, and the resume's.
    spent = [json.loads((out / "arms" / name).read_text())["seconds"] for name in done if name != "study.json"]
    assert resumed.seconds > max(spent) > 0
    studies.save(resumed, out, plots=())
    assert not (out / "arms").exists()  # finished: nothing left to resume


def test_a_resumed_studys_seconds_count_its_earlier_sessions(tmp_path, study_file):
    """(The arm file's own record of the study's time so far, made large: the result adds it to the resume's.)"""
    study, out = studies.load(str(study_file)), tmp_path / "out"

    def stop_after_the_first(arm, runs, curves):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        studies.run(study, quick=True, progress=False, out=out, on_arm=stop_after_the_first)
    first = out / "arms" / "0.json"
    arm = json.loads(first.read_text())
    assert 0 < arm["seconds"] < 600
    first.write_text(json.dumps({**arm, "seconds": 5000.0}))  # as after a long first session
    resumed = studies.run(study, quick=True, progress=False, out=out, resume=True)
    assert 5000.0 < resumed.seconds < 5000.0 + 600


def test_a_resume_with_other_settings_is_refused_in_one_line(tmp_path, study_file, capsys):
    out = tmp_path / "out"
    study = studies.load(str(study_file))
    calls = []

    def stop_after_the_first(arm, runs, curves):
        calls.append(arm)
        raise KeyboardInterrupt  # killed after its first arm

    with pytest.raises(KeyboardInterrupt):
        studies.run(study, quick=True, progress=False, out=out, on_arm=stop_after_the_first)
    assert (out / "arms" / "0.json").exists()
    argv = ["run", str(study_file), "--quick", "--no-progress", "--out", str(out), "--resume", "--epochs", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "arms were run with other settings (settings.epochs: 0.3 then, 0.5 now)" in err
    assert len(err.strip().splitlines()) == 1


@settings(max_examples=50, deadline=None)
@given(
    seeds=st.integers(1, 12),
    variants=st.integers(1, 6),
    runs_per_task=st.one_of(st.none(), st.integers(2, 20)),
)
def test_seed_groups_cut_an_arm_into_whole_seeds_in_order(seeds, variants, runs_per_task):
    """A split arm's tasks: every seed once, in order; two runs or more a task; no more than ``runs_per_task`` a
    task where a seed's runs fit in it (a last lone run joins the task before it)."""
    groups = studies.seed_groups(tuple(range(seeds)), variants, runs_per_task)
    assert [s for g in groups for s in g] == list(range(seeds))
    if runs_per_task is None or seeds * variants <= runs_per_task:
        assert len(groups) == 1
    if len(groups) > 1:
        assert all(len(g) * variants >= 2 for g in groups)
        if variants <= runs_per_task:
            assert all(len(g) * variants <= runs_per_task for g in groups[:-1])
            assert len(groups[-1]) * variants <= runs_per_task + 1  # a lone last run joined
