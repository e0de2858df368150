"""One meaning per default (#35 item 3): every flag of the command line defaults to the field of the value object it
fills, and every choice it offers is the library's own list of them, so that ``asgd-jax train`` with no flags is
``Setup()``, ``Plan`` and ``TrainConfig()``, and a law, rule, backend or model the library gains is a choice at once."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asgd_jax import cli, data, delays, models, rules, setups, studies
from asgd_jax.cli.ablate import add_ablate
from asgd_jax.cli.run import add_run
from asgd_jax.cli.train import add_train
from asgd_jax.plan import INNER, MODES, PUSHES
from asgd_jax.trainer.config import BACKENDS, FAILURE_POLICIES, NONFINITE_POLICIES, TrainConfig


class _Recording(argparse.ArgumentParser):
    """A parser that keeps the actions its flags made, in order."""

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.__dict__.setdefault("recorded", []).append(action)  # (its own --help comes first, from __init__)
        return action


def _flags(command: str) -> dict[str, argparse.Action]:
    """A sub-command's flags by destination, as its parser defines them."""
    sub = argparse.ArgumentParser().add_subparsers(parser_class=_Recording)
    {"ablate": add_ablate, "train": add_train, "run": add_run}[command](sub)
    return {a.dest: a for a in sub.choices[command].recorded}


# `train`'s flags that fill no field of a value object, and why.
TRAIN_WITHOUT_A_FIELD = {
    "config": "a file of flag values, read before the others",
    "rule": "the rule's name: train_rule builds the rule from it (dc_asgd_a, the command's own choice)",
    "lam": "the rule's own number (None: the rule's default, rules.defaults)",
    "warm_start": "a saved model to start from",
    "ringmaster": "with --rennala, --msync and --stops: which delay model the plan's --workers M run",
    "rennala": "(as --ringmaster)",
    "msync": "(as --ringmaster)",
    "stops": "(as --ringmaster)",
    "dylu": "(as --ringmaster: Workers(M, speeds=..., dylu=True))",
    "out": "the command line always writes a run folder (TrainConfig's None writes none)",
}
# Flags named otherwise than their field, and flag values that a field holds in another form.
TRAIN_RENAMED = {"lr": "learning_rate"}
AS_FIELD = {"decay_at": tuple, "slowdown": lambda v: v or {}}  # a list of positions; W:F strings (none: {})


def test_asgd_jax_train_with_no_flags_is_the_value_objects_defaults():
    args = cli.parse(["train"])
    holders = {"Setup": setups.Setup(), "TrainConfig": TrainConfig(), "Plan": TrainConfig().plan}
    pinned = set()
    for action in args.actions:
        if action.dest in TRAIN_WITHOUT_A_FIELD:
            continue
        name = TRAIN_RENAMED.get(action.dest, action.dest)
        value = AS_FIELD.get(action.dest, lambda v: v)(getattr(args, action.dest))
        fields = {
            where: getattr(obj, name)
            for where, obj in holders.items()
            if name in {f.name for f in dataclasses.fields(obj)} or (where == "Plan" and name == "workers")
        }
        assert fields, f"--{action.dest.replace('_', '-')} fills no field (name it in TRAIN_WITHOUT_A_FIELD?)"
        for where, default in fields.items():  # --batch-size is the Setup's and the Plan's
            assert value == default, f"--{action.dest.replace('_', '-')} defaults to {value!r}, {where} to {default!r}"
        pinned.add(action.dest)
    assert {"dataset", "model", "lr", "schedule", "workers", "batch_size", "backend", "seed"} <= pinned
    # What the flags build is the value objects themselves.
    assert cli.setup_of(args) == setups.Setup()
    assert cli.train_config(args) == dataclasses.replace(TrainConfig(), out=args.out)


def test_asgd_jax_ablate_with_no_flags_is_the_ablate_form():
    """``ablate``'s flags override the ``dcasgd_table1`` study's ablate form (what :func:`asgd_jax.studies.ablate`
    runs): their defaults are the form's, and those left ``None`` (seeds, epochs, window) the form's own, which
    ``--quick`` switches."""
    form = studies.load("dcasgd_table1").form("ablate")
    args = cli.parse(["ablate"])
    as_field = {"lr": ("learning_rate", float), "workers": ("workers", lambda v: tuple(map(int, v)))}
    as_field["algorithms"] = ("algorithms", tuple)
    for dest in vars(args):
        skip = ("func", "top_parser", "quick", "out", "no_progress", "seeds", "epochs", "window")
        if dest in (*skip, "resume", "overwrite"):  # (the last two: what to do with --out, not settings)
            continue
        name, convert = as_field.get(dest, (dest, lambda v: v))
        assert convert(getattr(args, dest)) == getattr(form, name), dest


# Every flag that offers choices, and the library's list it must offer.
CHOICES = {
    ("train", "rule"): rules.names(),
    ("train", "model"): models.names(),
    ("train", "dtype"): list(setups.DTYPES),
    ("train", "schedule"): list(setups.SCHEDULES),
    ("train", "unit"): list(setups.UNITS),
    ("train", "mode"): list(MODES),
    ("train", "push"): list(PUSHES),
    ("train", "inner"): list(INNER),
    ("train", "backend"): list(BACKENDS),
    ("train", "on_worker_failure"): list(FAILURE_POLICIES),
    ("train", "on_nonfinite"): list(NONFINITE_POLICIES),
    ("ablate", "compute_time"): list(delays.COMPUTE_TIME_KINDS),
    ("ablate", "model"): models.names(),
    ("ablate", "algorithms"): ["sgd", "asgd", "ssgd", "dc_asgd_c", "dc_asgd_a"],  # DC-ASGD's Table 1
    ("run", "backend"): list(studies.BACKENDS),
}


@pytest.mark.parametrize("command", ["train", "ablate", "run"])
def test_every_choice_is_the_librarys_own_list(command):
    offered = {dest: list(a.choices) for dest, a in _flags(command).items() if a.choices is not None}
    expected = {dest: choices for (c, dest), choices in CHOICES.items() if c == command}
    assert offered == expected
    assert "pareto" in offered.get("compute_time", ["pareto"])  # the law --compute-time once missed


@pytest.mark.parametrize("command", ["train", "ablate"])
def test_the_dataset_flag_names_every_embedded_dataset(command):
    """``--dataset`` is open (``tfds:<name>``), so not a list of choices: its help names the embedded ones."""
    assert _flags(command)["dataset"].help.startswith(f"{', '.join(data.EMBEDDED)} or tfds:<name>")
