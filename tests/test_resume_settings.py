"""A resumed training run computes what the run it continues computed: every setting that changes the weights is
checked against the checkpoint (#34 item 12: the schedule, the augmentation, the compute dtype, the warm start)."""

from __future__ import annotations

import pytest

from asgd_jax.cli import main
from asgd_jax.errors import ConfigError
from asgd_jax.trainer.persistence import ADDED_LATER, check_header

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
    now = {"num_workers": 2, "rule": "abc", "recipe": "r", "loss": "l", "warm_start_steps": 0}
    older = {k: v for k, v in now.items() if k not in ADDED_LATER}
    check_header("checkpoint.npz", older, now)  # nothing to compare the new keys with: accepted
    with pytest.raises(ConfigError, match="rule: checkpoint 'xyz' vs now 'abc'"):
        check_header("checkpoint.npz", {**older, "rule": "xyz"}, now)
    with pytest.raises(ConfigError, match="loss: checkpoint 'other' vs now 'l'"):
        check_header("checkpoint.npz", {**older, "loss": "other"}, now)


def test_a_checkpoint_with_the_operation_at_a_time_rule_probe_still_resumes():
    """Before 2026-12-05 a header held the rule's probe as ``rule``, computed an operation at a time; the compiled
    probe may round apart, so it is a key of its own (``rule_probe``), not compared with the old one."""
    now = {"num_workers": 2, "rule_probe": "compiled", "recipe": "r", "loss": "l", "warm_start_steps": 0}
    older = {"num_workers": 2, "rule": "eager", "recipe": "r", "loss": "l", "warm_start_steps": 0}
    check_header("checkpoint.npz", older, now)
    with pytest.raises(ConfigError, match="recipe: checkpoint 'other' vs now 'r'"):
        check_header("checkpoint.npz", {**older, "recipe": "other"}, now)
    with pytest.raises(ConfigError, match="rule_probe: checkpoint 'x' vs now 'compiled'"):
        check_header("checkpoint.npz", {**now, "rule_probe": "x"}, now)


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
