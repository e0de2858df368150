"""The package works installed from its wheel, outside the checkout: the shipped studies travel with it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtual environment outside the checkout with the built wheel installed; its dependencies are this
    environment's (no network), its asgd_jax only the wheel's."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # Built from a copy of the tracked files: an in-tree build reuses the checkout's build/ folder (a module that
    # was since removed would travel in the wheel) and would read files other tests are writing.
    source = tmp / "source"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    built = subprocess.run([*build, str(source)], capture_output=True, text=True, cwd=tmp)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("asgd_jax-*.whl")
    env = tmp / "env"
    venv.create(env, with_pip=False)
    site = pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    # This environment's packages as a plain path entry: its .pth files (the checkout's editable install) stay off.
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --target, never --prefix: pip would first uninstall this environment's (editable) asgd_jax.
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, cwd=tmp)
    return env, site, tmp


def _run(installed, *args, timeout=600):
    env, site, tmp = installed
    command = [str(env / "bin" / "python"), str(site / "bin" / "asgd-jax"), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp, timeout=timeout)


def test_the_wheel_lists_and_loads_the_shipped_studies_outside_the_checkout(installed, tmp_path):
    env, _, tmp = installed
    python = [str(env / "bin" / "python"), "-c"]
    where = subprocess.run(
        [*python, "import asgd_jax; print(asgd_jax.__file__)"], capture_output=True, text=True, cwd=tmp, check=True
    ).stdout
    assert where.startswith(str(env)), where  # the wheel's package, not the checkout's
    listing = _run(installed, "run", "--list")
    assert listing.returncode == 0, listing.stderr
    for name in ("dcasgd_table1", "gpu_asgd_nsync", "staleness_leaderboard"):
        assert name in listing.stdout
    assert _run(installed, "ablate", "--help").returncode == 0
    # Every shipped study and its arms build there (what `asgd-jax run <study>` and `ablate` do first), and a study
    # file of one's own still loads by its path.
    mine = tmp_path / "my_study.py"
    mine.write_text(
        "import dataclasses\n"
        "from asgd_jax.experiments.dcasgd_lambda_sweep import STUDY as BASE\n"
        "STUDY = dataclasses.replace(BASE, name='my_study', title='mine')\n"
    )
    check = (
        "from asgd_jax import studies\n"
        "for name in studies.available():\n"
        "    study = studies.load(name)\n"
        "    assert study.arms(study.quick, True), name\n"
        "from asgd_jax.delays import measured\n"
        "assert len(measured.epoch_times()) == 38  # the measured GPU table is package data\n"
        f"print(studies.load({str(mine)!r}).title)\n"
    )
    loaded = subprocess.run([*python, check], capture_output=True, text=True, cwd=tmp)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "mine", loaded.stderr


def test_the_wheel_carries_the_papers_training_setups(installed):
    env, _, tmp = installed
    check = (
        "from asgd_jax import cli, setups\n"
        "args = cli.parse(['train', '--config', 'dcasgd_cifar10'])\n"
        "print(cli.shipped_configs(), args.model, args.num_updates, cli.setup_of(args).schedule)\n"
    )
    loaded = subprocess.run([str(env / "bin" / "python"), "-c", check], capture_output=True, text=True, cwd=tmp)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "['dcasgd_cifar10', 'gpu_asgd_cifar10'] resnet20 62500 step"


def test_the_wheel_claims_no_commit_even_when_run_inside_a_git_checkout(installed):
    """Provenance is the package's, not the folder's: the wheel's asgd_jax run inside this checkout (a git repository)
    records no commit, where the report once printed the folder's."""
    env, _, _ = installed
    check = "from asgd_jax import provenance; print(provenance.commit(), provenance.environment()['asgd_jax'])"
    check += "; import asgd_jax; print(asgd_jax.__file__)"
    # -P: the folder is not put on the module path (there, the checkout's asgd_jax would be imported instead)
    python = [str(env / "bin" / "python"), "-P", "-c", check]
    loaded = subprocess.run(python, capture_output=True, text=True, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    commit, version, where = loaded.stdout.split()
    assert (commit, version) == ("None", "0.1.0") and where.startswith(str(env)), loaded.stdout
