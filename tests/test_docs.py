"""Every runnable example in the docstrings and the README runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil

import pytest

import asgd_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(asgd_jax.__path__, "asgd_jax.") if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("module", ["asgd_jax", *MODULES])
def test_docstring_examples(module, scratch_tempdir):  # (the examples' mkdtemp folders)
    m = importlib.import_module(module)
    result = doctest.testmod(m, optionflags=FLAGS, verbose=False)
    assert result.failed == 0
    # doctest skips a decorated function (its wrapper's globals are the decorator's module): every recipe factory
    # of the rules. Their examples run here, in their own module's namespace.
    runner, finder = doctest.DocTestRunner(optionflags=FLAGS, verbose=False), doctest.DocTestFinder()
    for name, obj in sorted(vars(m).items()):
        wrapped = getattr(obj, "__wrapped__", None)
        if callable(obj) and getattr(wrapped, "__globals__", None) is vars(m) and wrapped.__doc__:
            for test in finder.find(wrapped, f"{module}.{name}", module=m, globs=dict(vars(m))):
                runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of decorated functions failed"
    if module == "asgd_jax.rules.compressors":  # (the check finds them: this module's four factories have examples)
        assert runner.tries >= 10, runner.tries


def test_readme_examples(scratch_tempdir):
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=FLAGS)
    assert result.failed == 0
    assert result.attempted > 5  # the README's tour really is executed


def test_public_names_are_documented():
    for name in asgd_jax.__all__:
        obj = getattr(asgd_jax, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"asgd_jax.{name} has no docstring"


def test_notebooks_carry_no_outputs_and_only_import_the_library():
    import json
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
    names = sorted(p.name for p in folder.glob("*.ipynb"))
    assert names == [
        "01_update_rules.ipynb",
        "02_staleness_simulator.ipynb",
        "03_trainer_and_replay.ipynb",
        "04_leaderboard.ipynb",
    ]
    # What a user writes in a notebook: a loss, and in 04 a rule of their own and the arms that run it.
    own = ["def loss(", "def trajectory(", "def scale_by_sqrt_staleness(", "def update(", "def sqrt_staleness("]
    own += ["def with_my_rule("]
    for name in names:
        cells = json.loads((folder / name).read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), f"{name} has stored outputs"
        source = "".join("".join(c["source"]) for c in code)
        for allowed in own:
            source = source.replace(allowed, "")
        assert "def " not in source, name  # no logic of their own beyond that


def test_every_image_and_file_the_docs_point_at_is_in_the_repository():
    """README.md and ARCHITECTURE.md link only files that git tracks (not generated results, nothing outside)."""
    import re
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    tracked = set(
        subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    )
    for doc in ("README.md", "ARCHITECTURE.md", "experiments/benchmarks/README.md"):
        text = (root / doc).read_text()
        links = re.findall(r"\]\(([^)#\s]+)\)", text)
        local = [link for link in links if "://" not in link]
        base = pathlib.Path(doc).parent
        for link in local:
            path = pathlib.PurePosixPath(base / link).as_posix()
            assert path in tracked or any(t.startswith(path.rstrip("/") + "/") for t in tracked), f"{doc} -> {link}"
        assert "../shared" not in text, doc
    assert "docs/results/staleness_leaderboard.png" in tracked


def test_every_test_the_readmes_fault_table_names_exists():
    """The README's table of injected faults stays true: each test it names is in the suite."""
    import re

    text = (ROOT / "README.md").read_text()
    table = text[text.index("### When something goes wrong") : text.index("### On a Ray cluster")]
    named = re.findall(r"`(test_[a-z0-9_]+|tests/[a-z_]+\.py)`", table)
    assert len(named) >= 15
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in named:
        assert (ROOT / name).exists() if name.startswith("tests/") else f"def {name}(" in sources, name
