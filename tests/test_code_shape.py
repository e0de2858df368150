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


WING = PACKAGE / "trainer"


def _source(module: str) -> str:
    """A module's source by its dotted name under the package (``"trainer.store"``)."""
    return (PACKAGE / f"{module.replace('.', '/')}.py").read_text()


def _imported(node: ast.AST) -> set[str]:
    """The package's modules an import statement names, dotted under the package (``"trainer.session"``)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asgd_jax"):
        base = node.module.removeprefix("asgd_jax").removeprefix(".")
        names = set()
        for a in node.names:
            dotted = f"{base}.{a.name}" if base else a.name
            names.add(dotted if (PACKAGE / f"{dotted.replace('.', '/')}.py").exists() else base)
        return names
    if isinstance(node, ast.Import):
        return {a.name.removeprefix("asgd_jax.") for a in node.names if a.name.startswith("asgd_jax.")}
    return set()


def _imports(module: str, top_level_only: bool = False) -> set[str]:
    """The package's modules ``module`` imports: at any depth of its code, or (``top_level_only``) when it is
    imported (neither inside a function nor under ``TYPE_CHECKING``)."""
    tree = ast.parse(_source(module))
    nodes = tree.body if top_level_only else ast.walk(tree)
    return set().union(*(_imported(n) for n in nodes)) - {""}


def test_the_backends_share_the_session_and_never_import_each_other():
    for backend, other in (("trainer.threads", "trainer.ray_backend"), ("trainer.ray_backend", "trainer.threads")):
        imports = _imports(backend)
        assert "trainer.session" in imports and other not in imports, (backend, imports)
        assert "trainer.training" not in imports and "trainer" not in imports, (backend, imports)
        # the one loop, the one driver, the one endpoint
        assert {"trainer.worker", "trainer.driver", "trainer.endpoint"} <= imports, (backend, imports)
    assert not (
        {"trainer.threads", "trainer.ray_backend", "trainer.training", "simulator"} & _imports("trainer.session")
    )
    assert "simulator" not in _imports("trainer.loader")  # the data order needs the order module, not the simulator
    assert "ray_cluster" in _imports("studies.runner") and not any(
        m.startswith("trainer") for m in _imports("studies.runner")
    )


def test_the_trainer_wing_imports_in_one_direction():
    """The wing's modules, as imported, form no circle (the store's parts name it only for type checkers)."""
    modules = [f"trainer.{p.stem}" for p in WING.glob("*.py") if p.stem != "__init__"]
    graph = {m: {i for i in _imports(m, top_level_only=True) if i in modules} for m in modules}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m not in done:
            for n in graph[m]:
                visit(n, (*path, m))
            done.add(m)

    for m in modules:
        visit(m, ())


def _names(module: str) -> set[str]:
    """The names a module's code reads (not its docstrings or comments)."""
    tree = ast.parse(_source(module))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def test_what_a_method_means_for_the_trainer_is_decided_in_one_place():
    """The optimal-time methods' delay models are read by the trainer in its discipline only (one value derived from
    the plan): a new method is a case there, not an isinstance check in every module of the wing."""
    methods = {"Ringmaster", "Rennala", "MSync"}
    for path in WING.glob("*.py"):
        if path.stem not in ("discipline", "__init__"):
            assert not (methods & _names(f"trainer.{path.stem}")), path.stem
    assert methods <= _names("trainer.discipline")


def _defs(module: str) -> dict[str, ast.AST]:
    tree = ast.parse(_source(module))
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def test_each_loop_is_written_once():
    """The worker loop is :class:`asgd_jax.trainer.worker.Worker`'s and the monitor loop
    :func:`asgd_jax.trainer.driver.drive`'s: a backend only starts a store and workers on its substrate (no loop that
    pushes, nor one that polls and logs)."""
    for backend in ("trainer.threads", "trainer.ray_backend"):
        source = _source(backend)
        tree = ast.parse(source)
        for loop in (n for n in ast.walk(tree) if isinstance(n, ast.While | ast.For)):
            body = ast.unparse(loop)
            assert ".push(" not in body and ".record(" not in body and ".write(" not in body, (backend, body[:200])
        for call in ("stack_batches", "worker_function", "MetricsLog.record", "metrics.write", "tqdm"):
            assert call not in source, (backend, call)
    assert "def run" in _source("trainer.worker") and "def drive" in _source("trainer.driver")


TYPED = {"status", "progress", "snapshot", "stats", "answer", "finished", "weights", "sync"}


def test_what_modules_tell_each_other_is_typed_not_string_keyed():
    """A store's status, an answer, a worker's configuration and its stats are typed values, never ``Any`` in the
    wing: a typo is an AttributeError at once, not a KeyError at the end of a long run."""
    from asgd_jax.trainer import messages, worker

    assert messages.StoreStatus._fields[:3] == ("applied", "rejected", "late")
    assert dataclasses.is_dataclass(worker.WorkerSetup) and dataclasses.is_dataclass(messages.WorkerStats)
    for path in WING.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            named = [(a.arg, a.annotation) for a in node.args.args] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                named.append((node.target.id, node.annotation))
            for name, annotation in named:
                if name in TYPED:
                    assert annotation is not None and "Any" not in ast.unparse(annotation), (path.stem, name)
    for module in ("threads", "ray_backend", "driver", "session", "endpoint"):  # (the books read a checkpoint header)
        source = _source(f"trainer.{module}")
        for key in ("applied", "positions", "staleness_counts", "resumed_from", "num_workers", "local_lr"):
            assert f'["{key}"]' not in source, (module, key)


def test_no_class_is_longer_than_300_lines():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


EXPERIMENTS = PACKAGE.parent / "experiments"


def _function_lengths():
    # Every module of the package, its subpackages included, and the experiments' scripts (a clone has them).
    for path in sorted([*PACKAGE.rglob("*.py"), *EXPERIMENTS.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = node.body
                doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                start = body[1].lineno if doc and len(body) > 1 else body[0].lineno
                yield f"{path.relative_to(PACKAGE.parent)}:{node.name}", node.end_lineno - start + 1


def test_no_function_is_longer_than_80_lines_of_code():
    long = {name: n for name, n in _function_lengths() if n > 80}
    assert not long, long


def _train_flags() -> dict[str, object]:
    return {a.dest: a for a in build_parser().parse_args(["train"]).actions}


def test_every_training_setting_is_a_flag_of_the_same_name():
    flags = _train_flags()
    for field in dataclasses.fields(TrainConfig):
        if field.name in ("plan", "args"):  # its fields are flags of their own; the flags themselves, as given
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


def _module_level_imports(path: pathlib.Path) -> set[str]:
    """The package's modules (dotted, ``"asgd_jax.studies.picks"``) a module imports when it is itself imported: its
    top-level statements, into ``if``/``try``/``with`` blocks and class bodies, but not into functions nor under
    ``if TYPE_CHECKING:``. A ``from X import name`` names the module ``X.name`` where that is one, else ``X``."""
    package = path.relative_to(PACKAGE.parent).parts[:-1]  # what a relative import starts from

    def is_module(dotted: str) -> bool:
        where = PACKAGE.parent.joinpath(*dotted.split("."))
        return where.with_suffix(".py").exists() or (where / "__init__.py").exists()

    def named(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name.split(".")[0] == "asgd_jax"}
        if not isinstance(node, ast.ImportFrom):
            return set()
        base = ".".join((*package[: len(package) - node.level + 1], node.module or "")).strip(".")
        base = base if node.level else (node.module or "")
        if base.split(".")[0] != "asgd_jax":
            return set()
        return {f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names}

    def walk(body: list[ast.stmt]) -> set[str]:
        found: set[str] = set()
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                found |= walk(node.orelse)
                continue
            found |= named(node)
            for field in ("body", "orelse", "finalbody", "handlers"):
                found |= walk(getattr(node, field, []))
        return found

    return walk(ast.parse(path.read_text()).body)


def test_no_module_of_the_package_imports_in_a_circle():
    """Every module of the package and its subpackages, as imported (not inside functions, not for type checkers),
    imports in one direction: a circle is reported as the path that closes it."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: {i for i in _module_level_imports(p) if i in modules and i != m} for m, p in modules.items()}
    assert "asgd_jax.studies.picks" in graph["asgd_jax.studies.runner"]  # (the walk sees the imports it must)
    assert "studies.present" not in _imports("studies.runner")  # the runner reads the picks, not the presentation
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path[path.index(m) :], m))
        if m not in done:
            for n in sorted(graph[m]):
                visit(n, (*path, m))
            done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_the_top_level_face_is_the_public_api_only():
    # dir(asgd_jax) is what __all__ says: the engines' internals are submodules, imported by their full name.
    engine = {"server", "exchange", "packing", "order", "ray_cluster", "interrupts", "writers"}
    assert not engine & set(asgd_jax.__all__)
    assert not engine & set(dir(asgd_jax)) - set(vars(asgd_jax))  # (listed only once imported, as any submodule)
    for name in asgd_jax.__all__:
        assert getattr(asgd_jax, name) is not None


@pytest.mark.parametrize("num_updates", [1, 7, 600, 2_000, 62_500])
@pytest.mark.parametrize("every", [None, 50])
def test_both_engines_take_their_cadences_from_the_plan(num_updates, every):
    # One meaning per default: what None means for evaluations and checkpoints is the plan's, in both engines.
    from asgd_jax.plan import Plan

    every = every and min(every, num_updates)
    plan = Plan(2, num_updates=num_updates, eval_every=every, checkpoint_every=every, chunk=every)
    config = TrainConfig(plan, out="runs/x")
    assert config.eval_interval() == plan.eval_interval()
    assert config.checkpoint_interval() == plan.checkpoint_interval() == (every or max(1, num_updates // 10))
    if every is None:
        assert TrainConfig(plan).checkpoint_interval() is None  # (no output folder: nothing to write)
