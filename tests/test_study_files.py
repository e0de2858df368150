"""No file a study writes is trusted without checking what it holds, and none it did not make is overwritten.

A resume checks every arm file against the arm it must hold (study, form, settings, arm, and the shape of its runs
and curves) and refuses a wrong one in one line naming the file and the fix; a full disk, injected, stops the study in
one line with its finished arms kept, and a resume then gives the same tables; ``run`` and ``report`` refuse to
replace results they did not make unless told ``--overwrite``.

The refusal of a wrong arm file (rather than running the arm again in its place) is deliberate: a file that holds
another arm's runs is a folder mixed up by hand, and the user decides; deleting the file (the fix each message gives)
runs that arm again.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import pathlib
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgd_jax import checkpoint, studies
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError, RunStopped
from asgd_jax.studies import runner

STUDY_FILE = """
import dataclasses
from asgd_jax import studies
STUDY = dataclasses.replace(
    studies.load("dcasgd_table1"),
    name="tiny_files",
    quick=studies.Settings(dataset="digits", seeds=(0,), epochs=0.3, evals=2, window=10, workers=(1, 2)),
)
"""


class Stop(Exception):
    """The work started (where a test says it must not have, or stops it there on purpose)."""


def _never(*args, **kwargs):
    raise Stop("the work started")


@pytest.fixture(scope="module")
def study_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("study") / "tiny_files.py"
    path.write_text(STUDY_FILE)
    return path


@pytest.fixture(scope="module")
def whole(study_file) -> studies.StudyResult:
    """The study run once, uninterrupted: what every resume must give."""
    return studies.run(studies.load(str(study_file)), quick=True, progress=False)


@pytest.fixture(scope="module")
def two_arms_done(study_file, tmp_path_factory) -> pathlib.Path:
    """A folder of the study stopped after its second arm (of three), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("done") / "out"
    done = []

    def stop_after_two(arm, runs, curves):
        done.append(arm)
        if len(done) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        studies.run(studies.load(str(study_file)), quick=True, progress=False, out=out, on_arm=stop_after_two)
    return out


def _argv(study_file, out, *flags) -> list[str]:
    return ["run", str(study_file), "--quick", "--no-progress", "--out", str(out), *flags]


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("asgd-jax: ") and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _same_tables(out: pathlib.Path, whole: studies.StudyResult) -> None:
    saved = json.loads((out / "results.json").read_text())
    assert json.dumps(saved["runs"]) == json.dumps(json.loads(json.dumps(whole.runs)))  # a NaN equals itself here
    assert saved["table"] == studies.format_table(whole.study, whole.runs, len(whole.settings.seeds))
    assert not (out / "arms").exists()  # finished


# --------------------------------------------------------------------------------------------------------------------
# Arm files say what they hold, and a resume checks it
# --------------------------------------------------------------------------------------------------------------------


def test_an_arm_file_says_which_study_settings_and_arm_it_holds(two_arms_done, study_file):
    study = studies.load(str(study_file))
    arms = study.arms(study.quick, True)
    for i in (0, 1):
        saved = json.loads((two_arms_done / "arms" / f"{i}.json").read_text())
        assert saved["study"] == "tiny_files" and saved["quick"] is True and saved["index"] == i
        assert saved["arm"] == runner.arm_identity(arms[i])
        assert saved["settings"] == runner.as_json(dataclasses.asdict(study.quick))
        assert len(saved["runs"]) == len(arms[i].variants) * len(study.quick.seeds)
    assert runner.arm_identity(arms[0]) != runner.arm_identity(arms[1])


def _swap(arms: pathlib.Path) -> None:
    shutil.copy(arms / "0.json", arms / "1.json")  # another arm's file in its place


def _edit(**changes):
    def edit(arms: pathlib.Path) -> None:
        saved = json.loads((arms / "1.json").read_text())
        for key, value in changes.items():
            if value is _DROP:
                del saved[key]
            else:
                saved[key] = value(saved[key]) if callable(value) else value
        (arms / "1.json").write_text(json.dumps(saved))

    return edit


def _text(text: str):
    return lambda arms: (arms / "1.json").write_text(text)


def _cut(arms: pathlib.Path) -> None:
    data = (arms / "1.json").read_bytes()
    (arms / "1.json").write_bytes(data[: len(data) // 2])


_DROP = object()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_swap, "holds other runs than arm 1 of this study (index: 0 in the file, 1 here; arm."),
        (_edit(study="another_study"), "study: 'another_study' in the file, 'tiny_files' here"),
        (_edit(quick=False), "quick: False in the file, True here"),
        (_edit(settings=lambda s: {**s, "epochs": 2.0}), "settings.epochs: 2.0 in the file, 0.3 here"),
        (_edit(runs=_DROP), "is not a study's arm file (it lacks runs)"),
        (_edit(curves=_DROP, index=_DROP), "is not a study's arm file (it lacks index, curves)"),
        (_edit(study=_DROP, quick=_DROP, index=_DROP, arm=_DROP, settings=_DROP), "lacks study, quick, index, arm"),
        (_edit(runs={}), "is not a whole arm file (runs: 3 expected, dict found)"),
        (_edit(runs=lambda r: r[:-1]), "(runs: 3 expected, 2 found)"),
        (_edit(runs=lambda r: [*r[:-1], "a run"]), "(run 2 is a str)"),
        (_edit(runs=lambda r: [{**r[0], "test_error": "0.1"}, *r[1:]]), "(run 0 has no number for test_error)"),
        (_edit(runs=lambda r: [{**r[0], "seed": 7}, *r[1:]]), "(run 0 is 'ASGD' seed 7, not one of this arm's)"),
        (_edit(runs=lambda r: [{**r[0], "M": 4}, *r[1:]]), "(run 0 has other coordinates than the arm's {'M': 2}"),
        (_edit(curves=[]), "(curves: a table of series expected, list found)"),
        (_edit(curves=lambda c: {k: {**v, "time": 3} for k, v in c.items()}), "has no list for time)"),
        (_text("[1, 2]"), "is not a study's arm file (it lacks study, quick, index, arm, settings, runs, curves)"),
        (_text("not json"), "is not readable JSON (JSONDecodeError"),
        (_cut, "is not readable JSON (JSONDecodeError"),
    ],
)
def test_a_wrong_arm_file_is_refused_in_one_line_naming_it_before_any_work(
    two_arms_done, study_file, tmp_path, monkeypatch, capsys, damage, message
):
    """Another arm's file, another study's or settings', a file without its runs, of the wrong types, cut short or
    not JSON: the resume stops before any compile with one line that names the file and says to delete it."""
    out = tmp_path / "out"
    shutil.copytree(two_arms_done, out)
    damage(out / "arms")
    monkeypatch.setattr(runner, "prepare_sweep", _never)
    assert main(_argv(study_file, out, "--resume")) == 2
    _one_line(capsys, f"{out / 'arms' / '1.json'}", message, "delete it to run arm 1 (M=2 async: ASGD, ")
    assert (out / "arms" / "0.json").exists()  # nothing of the folder was touched


def test_the_fix_deleting_the_wrong_arm_file_runs_that_arm_again_to_the_same_tables(
    two_arms_done, study_file, whole, tmp_path, capsys
):
    out = tmp_path / "out"
    shutil.copytree(two_arms_done, out)
    _swap(out / "arms")
    assert main(_argv(study_file, out, "--resume")) == 2
    capsys.readouterr()
    (out / "arms" / "1.json").unlink()
    assert main(_argv(study_file, out, "--resume")) == 0
    _same_tables(out, whole)


def test_a_study_manifest_of_the_wrong_shape_is_refused_naming_it(two_arms_done, study_file, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(two_arms_done, out)
    (out / "arms" / "study.json").write_text('["not", "a", "manifest"]')
    assert main(_argv(study_file, out, "--resume")) == 2
    _one_line(capsys, f"{out / 'arms' / 'study.json'} is not a study's manifest", "--overwrite")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(runs=_JSON, curves=_JSON, drop=st.sampled_from(["", *runner.RUN_NUMBERS, *runner.RUN_COUNTS, "label"]))
def test_any_json_in_an_arm_file_is_named_wrong_or_is_a_whole_arm(runs, curves, drop, study_file):
    """The shape check of an arm file's runs and curves never fails itself: any JSON is called wrong in words, and
    a real arm's runs with one field gone are called wrong too."""
    study = studies.load(str(study_file))
    arm = study.arms(study.quick, True)[1]
    problem = runner.arm_file_problem(runs, curves, arm, study.quick.seeds)
    assert isinstance(problem, str) and problem
    real = [{"label": "ASGD", "seed": 0, "M": 2, **dict.fromkeys(runner.RUN_NUMBERS, 0.5)}]
    real[0].update(dict.fromkeys(runner.RUN_COUNTS, 0))
    real = [{**real[0], "label": label} for label in ("ASGD", "DC-ASGD-c", "DC-ASGD-a")]
    series = {"x": {"coords": {}, **{k: [] for k in runner.CURVE_SERIES}}}
    assert runner.arm_file_problem(real, series, arm, study.quick.seeds) is None
    if drop:
        damaged = [{k: v for k, v in r.items() if k != drop} for r in real]
        assert runner.arm_file_problem(damaged, series, arm, study.quick.seeds)


# --------------------------------------------------------------------------------------------------------------------
# A full disk, injected
# --------------------------------------------------------------------------------------------------------------------


def _full_disk_at(monkeypatch, name: str):
    """Every write of a file called ``name`` fails as on a full disk (the arm files and results.json are written by
    checkpoint.write_json, table.md by open)."""
    write_json, real_open = checkpoint.write_json, open

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def write(path, value):
        if pathlib.Path(path).name == name:
            full(path)
        write_json(path, value)

    def opened(path, mode="r", *args, **kwargs):
        if "w" in mode and pathlib.Path(path).name == name:
            full(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_json", write)
    monkeypatch.setattr("builtins.open", opened)


def test_a_full_disk_at_an_arm_stops_in_one_line_keeping_the_finished_arms(
    study_file, whole, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _full_disk_at(m, "1.json")
        assert main(_argv(study_file, out)) == 1
    _one_line(
        capsys,
        "asgd-jax: the disk is full (No space left on device)",
        f"{out / 'arms' / '1.json'} could not be written",
        f"the 1 finished arm(s) of 3 are kept in {out / 'arms'}",
        "--resume",
    )
    assert sorted(p.name for p in (out / "arms").iterdir()) == ["0.json", "study.json"]  # no temporary file left
    assert main(_argv(study_file, out, "--resume")) == 0  # space freed
    _same_tables(out, whole)


@pytest.mark.parametrize("name", ["results.json", "table.md"])
def test_a_full_disk_at_the_final_save_keeps_every_arm_for_a_resume(
    study_file, whole, tmp_path, monkeypatch, capsys, name
):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _full_disk_at(m, name)
        assert main(_argv(study_file, out)) == 1
    _one_line(
        capsys,
        f"asgd-jax: the disk is full (No space left on device): the results could not be written into {out}",
        f"the study's finished arms are kept in {out / 'arms'}",
        "--resume",
    )
    assert sorted(p.name for p in (out / "arms").iterdir()) == ["0.json", "1.json", "2.json", "study.json"]
    assert main(_argv(study_file, out, "--resume")) == 0
    _same_tables(out, whole)


def test_a_full_disk_while_saving_from_python_says_the_results_are_still_in_memory(whole, tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, "results.json")
    with pytest.raises(RunStopped, match=r"^the disk is full .*free some space and save the results again$"):
        studies.save(whole, tmp_path / "out", plots=())


def test_a_write_that_fails_for_another_reason_says_so(whole, tmp_path, monkeypatch):
    def read_only(path, value):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(checkpoint, "write_json", read_only)
    with pytest.raises(RunStopped, match=r"^a write failed \(Read-only file system\)"):
        studies.save(whole, tmp_path / "out", plots=())


# --------------------------------------------------------------------------------------------------------------------
# Results a command did not make are not replaced unless the user says so
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def finished(whole, tmp_path) -> pathlib.Path:
    """A folder holding the finished study's results."""
    out = tmp_path / "finished"
    studies.save(whole, out, plots=())
    return out


def test_report_never_writes_over_the_results_it_reads(finished, tmp_path, capsys):
    before = (finished / "results.json").read_bytes()
    for flags in ([], ["--overwrite"]):
        assert main(["report", str(finished), "--out", str(finished / "results.json"), *flags]) == 2
        _one_line(capsys, "is a study's results that the report reads: give another --out")
    assert (finished / "results.json").read_bytes() == before


def test_report_replaces_its_own_report_but_another_file_only_when_told(finished, tmp_path, capsys):
    assert main(["report", str(finished)]) == 0
    assert main(["report", str(finished)]) == 0  # its own report: replaced
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    assert main(["report", str(finished), "--out", str(notes)]) == 2
    _one_line(capsys, f"out={str(notes)!r} (--out) exists and is not a report of asgd-jax", "--overwrite")
    assert notes.read_text() == "my notes"
    assert main(["report", str(finished), "--out", str(notes), "--overwrite"]) == 0
    assert notes.read_text().startswith("# asgd_jax reproduction report")
    assert main(["report", str(finished), "--out", str(tmp_path)]) == 2
    _one_line(capsys, "(--out) is a folder: give the report's file")


def test_run_into_a_folder_holding_another_studys_results_is_refused_before_any_work(finished, monkeypatch, capsys):
    before = (finished / "results.json").read_bytes()
    monkeypatch.setattr(runner, "prepare_sweep", _never)
    assert main(["run", "dcasgd_lambda_sweep", "--quick", "--no-progress", "--out", str(finished)]) == 2
    _one_line(capsys, f"{finished} holds the results of study 'tiny_files' (quick form)", "--overwrite")
    assert (finished / "results.json").read_bytes() == before
    with pytest.raises(Stop):  # told: it starts the work
        main(["run", "dcasgd_lambda_sweep", "--quick", "--no-progress", "--out", str(finished), "--overwrite"])


def test_run_with_other_settings_is_refused_and_the_same_settings_replace_their_own(
    finished, study_file, monkeypatch, capsys
):
    monkeypatch.setattr(runner, "prepare_sweep", _never)
    assert main([*_argv(study_file, finished), "--epochs", "0.5"]) == 2
    _one_line(capsys, "run with other settings (settings.epochs: 0.3 there, 0.5 now)", "--overwrite")
    with pytest.raises(Stop):  # the same study and settings: a rerun replaces its own results
        main(_argv(study_file, finished))


@pytest.mark.parametrize("content", ["not json", "[]", '{"study": "x"}'])
def test_a_results_json_that_is_no_studys_is_not_replaced_either(tmp_path, study_file, content):
    (tmp_path / "results.json").write_text(content)
    study = studies.load(str(study_file))
    with pytest.raises(ConfigError, match=r"results.json exists and is not a study's results: give another"):
        studies.run(study, quick=True, progress=False, out=tmp_path)
    assert (tmp_path / "results.json").read_text() == content


def test_overwrite_starts_an_unfinished_run_afresh(two_arms_done, study_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    shutil.copytree(two_arms_done, out)
    monkeypatch.setattr(runner, "prepare_sweep", _never)
    assert main(_argv(study_file, out)) == 2
    _one_line(capsys, "holds an unfinished run of study 'tiny_files' (2 of 3 arms done)", "--overwrite")
    with pytest.raises(Stop):
        main(_argv(study_file, out, "--overwrite"))
    assert sorted(p.name for p in (out / "arms").iterdir()) == ["study.json"]  # the old arms are gone
