"""How the package is put together: what the architecture promises, pinned (ruff's SLF001/PLC2701 pin the rest)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import asgd_jax
from asgd_jax.cli import build_parser
from asgd_jax.trainer import TrainConfig

PACKAGE = pathlib.Path(asgd_jax.__file__).parent


def _imports(module: str) -> set[str]:
    """The asgd_jax modules ``module`` imports, at any depth of its code."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asgd_jax"):
            found |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("asgd_jax.")}
    return found


def test_the_backends_share_the_session_and_never_import_each_other():
    for backend, other in (("threads", "ray_backend"), ("ray_backend", "threads")):
        imports = _imports(backend)
        assert "session" in imports and other not in imports and "trainer" not in imports, (backend, imports)
        assert {"worker", "driver", "store"} <= imports, (backend, imports)  # the one loop, the one driver
    assert not ({"threads", "ray_backend", "trainer", "simulator"} & _imports("session"))
    assert "simulator" not in _imports("loader")  # the data order needs the order module, not the simulator


def _defs(module: str) -> dict[str, ast.AST]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def test_each_loop_is_written_once():
    """The worker loop is :class:`asgd_jax.worker.Worker`'s and the monitor loop :func:`asgd_jax.driver.drive`'s: a
    backend only starts a store and workers on its substrate (no loop that pushes, nor one that polls and logs)."""
    for backend in ("threads", "ray_backend"):
        source = (PACKAGE / f"{backend}.py").read_text()
        tree = ast.parse(source)
        for loop in (n for n in ast.walk(tree) if isinstance(n, ast.While | ast.For)):
            body = ast.unparse(loop)
            assert ".push(" not in body and ".record(" not in body and ".write(" not in body, (backend, body[:200])
        for call in ("stack_batches", "worker_function", "MetricsLog.record", "metrics.write", "tqdm"):
            assert call not in source, (backend, call)
    assert "def run" in (PACKAGE / "worker.py").read_text() and "def drive" in (PACKAGE / "driver.py").read_text()


def test_what_modules_tell_each_other_is_typed_not_string_keyed():
    """A store's status, a worker's configuration and its stats are typed values: a typo is an AttributeError at once,
    not a KeyError at the end of a long run."""
    from asgd_jax import store, worker

    assert store.StoreStatus._fields[:3] == ("applied", "rejected", "late")
    assert dataclasses.is_dataclass(worker.WorkerSetup) and dataclasses.is_dataclass(asgd_jax.session.WorkerStats)
    for module in ("threads", "ray_backend", "driver", "session"):  # (the store reads its checkpoint header: a file)
        source = (PACKAGE / f"{module}.py").read_text()
        for key in ("applied", "positions", "staleness_counts", "resumed_from", "num_workers", "local_lr"):
            assert f'["{key}"]' not in source, (module, key)


def _function_lengths():
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = node.body
                doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                start = body[1].lineno if doc and len(body) > 1 else body[0].lineno
                yield f"{path.name}:{node.name}", node.end_lineno - start + 1


def test_no_function_is_longer_than_80_lines_of_code():
    long = {name: n for name, n in _function_lengths() if n > 80}
    assert not long, long


def _train_flags() -> dict[str, object]:
    return {a.dest: a for a in build_parser().parse_args(["train"]).actions}


def test_every_training_setting_is_a_flag_of_the_same_name():
    flags = _train_flags()
    for field in dataclasses.fields(TrainConfig):
        if field.name == "plan":  # its fields are flags of their own
            continue
        assert field.name in flags, f"TrainConfig.{field.name} has no --{field.name.replace('_', '-')} flag"
        if field.name not in ("slowdown", "out"):  # W:F strings; the command line always writes a run folder
            assert flags[field.name].default == getattr(TrainConfig(), field.name), field.name
    plan = TrainConfig().plan
    for field in dataclasses.fields(asgd_jax.Plan):
        if field.name in ("delays", "chunk", "time_budget"):  # --workers M; the simulator's chunk and virtual time
            continue
        assert field.name in flags, f"Plan.{field.name} has no --{field.name.replace('_', '-')} flag"
        assert flags[field.name].default == getattr(plan, field.name), field.name
    assert flags["workers"].default == plan.workers


def test_the_rule_flag_offers_every_registered_rule():
    assert list(_train_flags()["rule"].choices) == asgd_jax.rules.names()


@pytest.mark.parametrize("name", asgd_jax.rules.names())
def test_every_registered_rule_builds_from_its_name_and_defaults(name):
    hp = {k: 4 for k in asgd_jax.rules.required(name)}  # num_workers of delay_adaptive
    rule = asgd_jax.rules.get(name, 0.1, **hp)
    assert callable(rule.init) and callable(rule.update)
