"""A resumed training run computes what the run it continues computed: every setting that changes the weights is
checked against the checkpoint (#34 item 12: the schedule, the augmentation, the compute dtype, the warm start)."""

from __future__ import annotations

import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asgd_jax import rules
from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.trainer.persistence import ADDED_LATER, check_header, check_resume

pytestmark = pytest.mark.xdist_group("resume_settings")  # one worker trains the module's run once

BASE = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "2", "--checkpoint-every", "10"]
BASE += ["--lr", "0.1", "--schedule", "constant"]  # (a schedule other than the run's is refused below)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main([*BASE, "--num-updates", "20", "--no-progress", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--schedule", "step"], "recipe"),
        (["--augment"], "loss"),
        (["--dtype", "bfloat16"], "loss"),
        (["--warm-start-steps", "10"], "warm_start_steps"),
        (["--lr", "0.3"], "rule_probe"),
    ],
)
def test_a_resume_that_would_compute_something_else_is_refused_in_one_line(finished, flags, key, capsys):
    trace = (finished / "trace.jsonl").read_text()
    argv = [*BASE, "--num-updates", "30", "--no-progress", "--out", str(finished), "--resume", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "written by a different run" in err and f"{key}: checkpoint" in err, err
    assert (finished / "trace.jsonl").read_text() == trace  # refused before anything ran


def test_the_same_settings_resume(finished):
    """The new keys are stable: the same flags, made again, resume (this runs last in the file: it extends the run)."""
    assert main([*BASE, "--num-updates", "30", "--no-progress", "--out", str(finished), "--resume"]) == 0
    assert len((finished / "trace.jsonl").read_text().splitlines()) >= 30


def test_a_checkpoint_from_before_these_keys_still_resumes_and_is_checked_on_the_rest():
    now = {"num_workers": 2, "rule_probe": "abc", "recipe": "r", "loss": "l", "warm_start_steps": 0}
    older = {k: v for k, v in now.items() if k not in ADDED_LATER}
    check_header("checkpoint.npz", older, now)  # nothing to compare the new keys with: accepted
    with pytest.raises(ConfigError, match="num_workers: checkpoint 3 vs now 2"):
        check_header("checkpoint.npz", {**older, "num_workers": 3}, now)
    with pytest.raises(ConfigError, match="loss: checkpoint 'other' vs now 'l'"):
        check_header("checkpoint.npz", {**older, "loss": "other"}, now)


def _with_header(folder, change) -> None:
    """``folder``'s checkpoint with its header changed by ``change(header)`` (the arrays as they are)."""
    path = folder / "checkpoint.npz"
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    header = json.loads(bytes(arrays["__header__"]).decode())
    change(header)
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def test_a_checkpoint_from_before_the_compiled_probe_is_checked_on_the_probe_it_holds(finished, tmp_path, capsys):
    """Before 2026-12-05 a header held the rule's probe as ``rule``, computed an operation at a time (the compiled
    probe may round apart: ``rule_probe``, a key of its own). A resume of such a checkpoint computes that older probe
    for its rule and compares it; a newer checkpoint never computes it."""

    def never():
        raise AssertionError("a checkpoint that holds rule_probe computes no older probe")

    check_resume(finished, {"num_workers": 2}, {"rule": never})
    folder = tmp_path / "older"
    shutil.copytree(finished, folder)
    _with_header(folder, lambda h: (h.pop("rule_probe"), h.update(rule="0123456789abcdef")))  # as written then
    argv = [*BASE, "--num-updates", "30", "--no-progress", "--out", str(folder), "--resume"]
    assert main(argv) == 2
    refused = re.search(r"rule: checkpoint '0123456789abcdef' vs now '([0-9a-f]{16})'", capsys.readouterr().err)
    assert refused, "the older probe was not computed and compared"
    _with_header(folder, lambda h: h.update(rule=refused.group(1)))  # what that checkpoint would have held
    assert main(argv) == 0
    assert len((folder / "trace.jsonl").read_text().splitlines()) >= 30


def test_the_operation_at_a_time_probe_is_the_one_older_checkpoints_hold():
    """``rules.fingerprint(..., eager=True)`` gives the values the probe gave before 2026-12-05 (computed then, at
    52a82a1), so that their checkpoints resume; the compiled probe may round apart (DC-ASGD-a here)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.arange(3, dtype=jnp.bfloat16)}
    assert rules.fingerprint(rules.get("dc_asgd_a", 0.1), params, eager=True) == "8ad42ee757266cfd"
    assert rules.fingerprint(rules.get("asgd", 0.05), params, eager=True) == "28007fc977c95fcb"
    assert rules.fingerprint(rules.get("asgd", 0.05), params) == "28007fc977c95fcb"
    by_hand = optax.chain(optax.clip(1.0), rules.asgd(0.1))  # (no recipe: probed an operation at a time, as then)
    assert rules.fingerprint(by_hand, params) == "853409115a3b0df9"


def test_a_long_setting_that_differs_is_named_by_the_part_that_changed():
    """A rule's recipe is hundreds of characters; the refusal shows where the two differ (here a schedule's
    boundaries, which follow --steps), not both whole."""
    recipe = (
        "((rules.dc_asgd_a, (('learning_rate', ('made', (schedules.piecewise, {}))))), {{'boundaries': {}, 'f': 0.1}})"
    )
    saved, now = recipe.format("x" * 200, (15, 22)), recipe.format("x" * 200, (20, 30))
    with pytest.raises(ConfigError) as refused:
        check_header("checkpoint.npz", {"recipe": saved}, {"recipe": now})
    message = str(refused.value)
    assert "'boundaries': (15, 22)" in message and "'boundaries': (20, 30)" in message
    assert "x" * 30 not in message and len(message) < len(saved)


def test_a_resume_continues_with_the_runs_own_flags_and_a_flag_given_wins(finished, tmp_path, capsys):
    """``train --out F --resume`` alone continues the run in F with the flags that started it (its ``args.json``,
    written when the run took the folder); a flag on the command line wins, and is checked like any other."""
    folder = tmp_path / "copy"
    shutil.copytree(finished, folder)
    record = json.loads((folder / "args.json").read_text())
    assert record["dataset"] == "digits" and record["workers"] == 2 and record["lr"] == 0.1  # BASE, not the defaults
    assert main(["train", "--out", str(folder), "--resume", "--lr", "0.3", "--no-progress"]) == 2
    assert "rule_probe: checkpoint" in capsys.readouterr().err  # the given --lr won, and was refused
    before = _applied(folder)  # (20, or 30 once the module's last test extended the run)
    assert main(["train", "--out", str(folder), "--resume", "--num-updates", str(before + 10), "--no-progress"]) == 0
    assert f"the run's flags from {folder / 'args.json'}" in capsys.readouterr().out
    assert len((folder / "trace.jsonl").read_text().splitlines()) >= before + 10
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["resumed_from"] == before and summary["pushes_applied"] == before + 10
    assert summary["args"] == json.loads((folder / "args.json").read_text())  # this session's flags
    assert summary["args"]["num_updates"] == before + 10 and summary["args"]["model"] == "mlp"


def _applied(folder) -> int:
    return json.loads((folder / "summary.json").read_text())["pushes_applied"]


def test_a_resume_takes_no_session_flags_from_the_record_and_reads_an_older_runs_summary(finished, tmp_path):
    """``--timeout``, ``--progress`` (and ``--out``, ``--resume``, ``--config``) belong to one session: a record's
    are not taken. A run from before ``args.json`` has its flags in ``summary.json``; a run with neither is resumed
    with the flags given, as before (here the defaults: another run, refused)."""
    folder = tmp_path / "copy"
    shutil.copytree(finished, folder)
    record = json.loads((folder / "args.json").read_text())
    (folder / "args.json").write_text(json.dumps({**record, "timeout": 1e-6, "out": "elsewhere"}))
    n = _applied(folder) + 5
    assert main(["train", "--out", str(folder), "--resume", "--num-updates", str(n), "--no-progress"]) == 0  # not 3
    assert _applied(folder) == n
    (folder / "args.json").unlink()  # an older run: summary.json's "args" (the record of the session before)
    assert main(["train", "--out", str(folder), "--resume", "--num-updates", str(n + 5), "--no-progress"]) == 0
    assert json.loads((folder / "args.json").read_text())["num_updates"] == n + 5 == _applied(folder)
    (folder / "args.json").unlink()
    (folder / "summary.json").unlink()
    assert main(["train", "--out", str(folder), "--resume", "--num-updates", str(n + 10), "--no-progress"]) == 2


@pytest.mark.parametrize("text", ['{"workers": 2', "[1, 2]"])
def test_a_broken_record_of_flags_is_one_line_naming_it(finished, tmp_path, text, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(finished, folder)
    (folder / "args.json").write_text(text)  # cut short by a full disk; not a table
    assert main(["train", "--out", str(folder), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(folder / "args.json") in err, err


@pytest.mark.parametrize("bad", [{"partition": "bogus"}, {"model": "nope"}, {"workers": "four"}])
def test_a_recorded_flag_value_that_is_refused_is_one_line_naming_the_record(finished, tmp_path, bad, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(finished, folder)
    record = json.loads((folder / "args.json").read_text())
    (folder / "args.json").write_text(json.dumps({**record, **bad}))  # (edited by hand, or another asgd_jax's)
    assert main(["train", "--out", str(folder), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(folder / "args.json") in err and next(iter(bad)) in err, err


def test_a_resume_keeps_the_metrics_of_its_checkpoint_and_their_clock_goes_on(finished, tmp_path):
    """metrics.jsonl after a resume reads as the trace does: the records of work the checkpoint lost (and a line cut
    short by a kill) are gone, every line is whole, and the resumed session's times go on from the last kept one."""
    folder = tmp_path / "copy"
    shutil.copytree(finished, folder)
    before = _applied(folder)
    lines = (folder / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = "".join(line for line in lines if json.loads(line)["kind"] != "final")  # killed before its final record
    lost = {"kind": "train", "update": before + 5, "time": 999.0, "loss": 0.1, "applied": before + 5}
    (folder / "metrics.jsonl").write_text(kept + json.dumps(lost) + "\n" + '{"kind": "tr')  # then killed mid-line
    assert main(["train", "--out", str(folder), "--resume", "--num-updates", str(before + 10), "--no-progress"]) == 0
    text = (folder / "metrics.jsonl").read_text()
    assert text.startswith(kept) and "999.0" not in text
    records = [json.loads(line) for line in text.splitlines()]  # every line whole
    old, new = records[: len(kept.splitlines())], records[len(kept.splitlines()) :]
    assert new and min(r["time"] for r in new) >= max(r["time"] for r in old) > 0
    updates = [r["update"] for r in records if r["kind"] != "eval"]
    assert updates == sorted(updates) and updates[-1] == before + 10
    # Every applied push in exactly one record's histogram: those between the last kept record and the checkpoint
    # (whose record the kill took) in the first new one.
    assert sum(n for r in records if r["kind"] != "eval" for n in r["staleness_histogram"].values()) == before + 10


def test_a_full_disk_as_a_resume_rewrites_its_metrics_stops_it_in_one_message_and_keeps_them(tmp_path, monkeypatch):
    import errno

    from asgd_jax import checkpoint
    from asgd_jax.errors import RunStopped
    from asgd_jax.trainer.messages import StoreStatus
    from asgd_jax.trainer.session import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "train", "update": 5, "time": 1.0, "staleness_histogram": {"0": 5}}) + "\n")
    before = path.read_text()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_json_lines", full)
    status = StoreStatus(5, 0, 0, 5, False, None, 5, (3, 2), {0: 5})
    with pytest.raises(RunStopped, match=r"the disk is full .*metrics.jsonl could not be written.*as they were"):
        MetricsLog(2).open(str(tmp_path), status)
    assert path.read_text() == before
