"""Running a study: one sweep per arm, locally or as Ray tasks, finished arms kept for a resume."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from asgd_jax import cache, errors, rules, setups
from asgd_jax import checkpoint as checkpoint_lib
from asgd_jax import data as data_lib
from asgd_jax import metrics as metrics_lib
from asgd_jax.plan import Plan
from asgd_jax.simulator import Prepared, grid, prepare_sweep, simulate
from asgd_jax.studies.language import Arm, Settings, Study, Variant, load
from asgd_jax.studies.picks import best_tuned, cell_of, grid_edges, within_budgets

log = logging.getLogger("asgd_jax.studies")

# --------------------------------------------------------------------------------------------------------------------
# Running.
# --------------------------------------------------------------------------------------------------------------------


def schedule(
    s: Settings, num_updates: int, learning_rate: float | jax.Array | None = None, updates_per_epoch: float = 1.0
) -> optax.Schedule:
    """The learning rate of a run of ``num_updates`` updates: the setup's (:meth:`Setup.learning_rate_schedule`),
    DC-ASGD's steps by default.

    Example:
      >>> from asgd_jax import studies
      >>> lr = studies.schedule(studies.Settings(learning_rate=0.5), 160)
      >>> [round(float(lr(t)), 4) for t in (79, 80, 120)]
      [0.5, 0.05, 0.005]
    """
    return s.learning_rate_schedule(num_updates, updates_per_epoch, learning_rate)


def _arm_rules(variants: tuple[Variant, ...]) -> list[str]:
    return list(dict.fromkeys(v.rule for v in variants))


@dataclasses.dataclass(frozen=True)
class _ArmRule:
    """``hparams -> rule`` for an arm: the learning rate (when the arm tunes it), the variants' numbers and (for a mix)
    which rule are traced. A value (hashable): arms that build their rules alike share one compiled program."""

    names: tuple[str, ...]
    learning_rate: float
    schedule: setups.Schedule  # the setup's, in updates of this arm's runs
    server_lr: float | None
    momentum: float | None
    weight_decay: float
    num_workers: int
    rule_options: tuple[tuple[str, Any], ...]

    def build(self, rule: str, h: Mapping[str, jax.Array], lr: Any):
        takes = {*rules.defaults(rule), *rules.required(rule)}
        kwargs: dict[str, Any] = {}
        if "num_workers" in rules.required(rule):
            kwargs["num_workers"] = self.num_workers
        kwargs.update({k: v for k, v in self.rule_options if k in takes})
        kwargs.update({k: v for k, v in h.items() if k in takes})
        return setups.make_rule(rule, lr, momentum=self.momentum, weight_decay=self.weight_decay, **kwargs)

    def __call__(self, h: Mapping[str, jax.Array]):
        # The learning rate is traced only when the arm tunes it: a Python float keeps the schedule's constants folded,
        # as they always were. A server learning rate (GPU A-SGD's deltas) has no schedule.
        lr = self.server_lr if self.server_lr is not None else self.schedule.build(h.get("lr", self.learning_rate))
        if len(self.names) == 1:
            return self.build(self.names[0], h, lr)
        return rules.one_of(h["rule"].astype("int32"), [self.build(name, h, lr) for name in self.names])


def arm_rule(arm: Arm, s: Settings, num_updates: int, updates_per_epoch: float) -> Callable[[Mapping], Any]:
    """An arm's ``hparams -> rule`` for runs of ``num_updates`` (``updates_per_epoch`` converts the setup's epochs):
    the registered rule of each variant with the setup's schedule, momentum and weight decay, its numbers traced. A
    value: arms that build their rules alike share one compiled program. ``asgd-jax train`` builds its rule from the
    same setup the same way (:meth:`asgd_jax.setups.Setup.rule`)."""
    variants = arm.variants
    return _ArmRule(
        names=tuple(_arm_rules(variants)),
        learning_rate=s.learning_rate,
        schedule=s.schedule_in_updates(num_updates, updates_per_epoch),
        server_lr=arm.server_lr,
        momentum=s.momentum,
        weight_decay=s.weight_decay,
        num_workers=arm.plan.workers,
        rule_options=tuple(sorted(arm.rule_options.items())),
    )


def _hparams(variants: tuple[Variant, ...], s: Settings, index: np.ndarray) -> dict[str, np.ndarray]:
    """Each run's traced numbers (its variant's, by ``index``): the learning rate, which rule (a mix), hp."""
    keys = list(dict.fromkeys(k for v in variants for k in v.hp))  # a rule's variants name the same (Arm checks)
    tuned = {"lr": [v.lr or s.learning_rate for v in variants]} if any(v.lr for v in variants) else {}
    names = _arm_rules(variants)
    table = {
        **tuned,
        **({"rule": [names.index(v.rule) for v in variants]} if len(names) > 1 else {}),
        **{k: [v.hp.get(k, 0.0) for v in variants] for k in keys},  # 0: a rule that does not take it
    }
    return {k: np.asarray(values, np.float32)[index] for k, values in table.items()}


def time_to_target(times: np.ndarray, smoothed: np.ndarray, target: float, budget: float | None = None) -> float:
    """The time of the first update whose smoothed training error is at or below ``target`` (NaN if none is, or, with
    a ``budget``, if none is by then).

    Example:
      >>> import numpy as np
      >>> from asgd_jax import studies
      >>> studies.time_to_target(np.arange(4.0), np.array([0.9, 0.6, 0.4, 0.3]), 0.5)
      2.0
    """
    hit = np.flatnonzero(smoothed <= target)
    if not hit.size or (budget is not None and times[hit[0]] > budget):
        return math.nan
    return float(times[hit[0]])


@dataclasses.dataclass
class StudyResult:
    """Per-run outcomes and mean curves of a study run (what :func:`run` saves)."""

    study: Study
    settings: Settings
    quick: bool
    runs: list[dict[str, Any]]
    curves: dict[str, dict[str, list[float]]]
    seconds: float  # the study's: a resumed one's earlier sessions' too (up to the last arm each kept)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every arm of a study run shares: the training data, the loss and evaluation, the initial weights."""

    train: Any
    num_examples: int
    loss_fn: Any
    eval_fn: Any
    init: tuple[Any, Any]
    warm: tuple[Any, Any] | None


def _setup(study: Study, s: Settings, arms: list[Arm], progress: bool) -> _Setup:
    if study.problem is not None:  # the study's own loss, weights and data
        errors.require(not any(a.warm for a in arms), "warm", True, "a study's own problem has no warm start")
        p = study.problem(s)
        return _Setup(p.train, p.num_examples, p.loss, p.evaluate, (p.params, None), None)
    ds = data_lib.load(s.dataset, data_dir=s.data_dir)
    model = s.build_model(ds.num_classes, ds.input_shape)
    params0, model_state0 = model.init(jax.random.key(s.init_seed))
    loss_fn = s.loss(model)
    warm = None
    if any(a.warm for a in arms):  # one warm start for the whole study: single-worker SGD from the shared init
        updates = max(1, round(s.warm_epochs * len(ds.y_train) / s.batch_size))
        w = simulate(
            loss_fn,
            rules.get("sgd", s.learning_rate),
            params0,
            ds.train,
            Plan(1, batch_size=s.batch_size, num_updates=updates),
            model_state=model_state0,
            key=jax.random.key(10_000 + s.init_seed),
            progress=progress,
        )
        warm = (w.params, w.model_state)
    eval_fn = s.evaluation(model, ds.test)
    return _Setup(ds.train, len(ds.y_train), loss_fn, eval_fn, (params0, model_state0), warm)


@dataclasses.dataclass(frozen=True)
class _ArmRun:
    """One arm bound to its compiled sweep (checked, not run yet) and what its results are read with."""

    arm: Arm
    plan: Plan
    index: np.ndarray  # each run's variant
    sweep: Prepared


def _prepare_arm(s: Settings, arm: Arm, setup: _Setup, progress: bool) -> _ArmRun:
    """One arm's sweep over its variants x seeds, checked and bound to its programs (nothing compiled yet)."""
    n = setup.num_examples
    p = arm.plan
    per_update = s.batch_size * p.n_sync * p.payloads
    if arm.num_updates is not None:
        interval = -(-arm.num_updates // s.evals)
    else:
        interval = max(1, round(s.epochs * n / per_update / s.evals))
    num_updates = interval * s.evals
    plan = p.replace(batch_size=s.batch_size, num_updates=num_updates, eval_every=interval, chunk=None)
    variants = arm.variants
    keys, hp = grid(seeds=s.seeds, index=list(range(len(variants))))
    index = np.asarray(hp.pop("index")).astype(int)
    hp = _hparams(variants, s, index)
    params, model_state = setup.warm if arm.warm else setup.init
    prepared = prepare_sweep(
        setup.loss_fn,
        arm_rule(arm, s, num_updates, n / per_update),
        params,
        setup.train,
        plan,
        keys=keys,
        hparams=hp,
        model_state=model_state,
        eval_fn=setup.eval_fn,
        on_nonfinite="ignore",  # a grid's diverged runs are expected: the table counts them, once
        progress=progress,
        description=arm.description,
    )
    return _ArmRun(arm, plan, index, prepared)


def _arm_results(s: Settings, run: _ArmRun, result, setup: _Setup) -> tuple[list[dict], dict[str, dict]]:
    """An arm's runs and mean curves, from its sweep's result (a diverged run's NaN and Inf pass through quietly:
    the table counts those runs)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _arm_numbers(s, run, result, setup)


def _arm_numbers(s: Settings, run: _ArmRun, result, setup: _Setup) -> tuple[list[dict], dict[str, dict]]:
    arm, plan, index, variants = run.arm, run.plan, run.index, run.arm.variants
    n = setup.num_examples
    per_update = s.batch_size * plan.n_sync * plan.payloads
    mx = result.metrics
    num_updates = mx["loss"].shape[1]  # fewer than the plan's where a time budget ended the runs
    seeds = np.repeat(np.asarray(s.seeds), len(variants))
    # Training error per minibatch, smoothed over `window` minibatches (an update is n_sync of them per worker).
    smoothed = metrics_lib.smooth(mx["error"], max(1, s.window // plan.n_sync))
    offset = s.warm_epochs if arm.warm else 0.0
    runs, curves = [], {}
    for i, variant in enumerate(variants):
        rows = np.flatnonzero(index == i)
        label = arm.label(variant)
        coords = {**arm.coords, **variant.coords, **({"lr": variant.lr} if variant.lr else {}), "label": label}
        series = " | ".join(
            f"{k}={v}"
            for k, v in coords.items()
            if k != "label" and f"{k}={v}" not in label and str(v) not in label.split(", ")
        )
        curves[f"{label} ({series})" if series else label] = {
            "coords": coords,
            "update": list(range(1, num_updates + 1)),
            "epoch": (offset + mx["epoch"][rows[0]]).tolist(),
            "time": mx["time"][rows].mean(axis=0).tolist(),
            "train_error": smoothed[rows].mean(axis=0).tolist(),
            "eval_epoch": (offset + mx["eval_update"][rows[0]] * per_update / n).tolist(),
            "test_error": mx["eval_error"][rows].mean(axis=0).tolist(),
        }
        runs += [
            {
                **coords,
                "seed": int(seeds[r]),
                "test_error": float(mx["eval_error"][r, -1]),
                "train_error": float(smoothed[r, -1]),
                "time_to_target": time_to_target(mx["time"][r], smoothed[r], s.target_error, s.time_budget),
                "virtual_time": float(mx["time"][r, -1]),
                "mean_staleness": float(mx["staleness"][r].mean()),
                "max_staleness": int(mx["staleness"][r].max()),
                "updates": num_updates,
                # A language model's final perplexity per token (NaN or inf: the run diverged).
                **({"test_perplexity": float(mx["eval_perplexity"][r, -1])} if "eval_perplexity" in mx else {}),
            }
            for r in rows
        ]
    return runs, curves


def _for_every(arm: Arm, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An arm's runs copied into every cell of its ``for_every`` coordinates (a reference run once)."""
    for key, values in arm.for_every.items():
        runs = [{**r, key: v} for v in values for r in runs]
    return runs


def run(
    study: Study,
    *,
    quick: bool = False,
    progress: bool = True,
    settings: Settings | None = None,
    form: str | None = None,
    on_arm: Callable[[Arm, list[dict[str, Any]], dict[str, Any]], Any] | None = None,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    backend: str = "local",
    ray_address: str | None = None,
    runs_per_task: int | None = None,
    overwrite: bool = False,
) -> StudyResult:
    """Runs every arm of ``study`` (one :func:`asgd_jax.sweep` each) in one of its forms.

    Args:
      study: the study (:func:`load` finds one by name).
      quick: the quick form (minutes on 2 CPU cores) instead of the full one.
      progress: progress bars, one per arm, labelled with it.
      settings: override the form's settings (tests use a tiny one).
      form: a named form of the study (``"quick"``, ``"full"`` or one of ``study.forms``), instead of ``quick``.
      on_arm: ``on_arm(arm, runs, curves)`` as each arm finishes: its rows of the results and its mean curves (to
        log them elsewhere, or watch a long study); on a resume, the arms found done are handed over first.
      out: a folder that keeps each finished arm (``<out>/arms/<i>.json``, written atomically as the arm finishes),
        so that a study killed midway loses at most the arm it was running (:func:`save` into the same folder
        clears them once the results are written).
      resume: with ``out``: run only the arms not found there (the same tables as an uninterrupted run); the study,
        its form and settings must be the ones the folder's arms were run with. Without it, a folder holding an
        unfinished study is refused.
      backend: ``"local"`` (the arms one after another in this process, each over every local accelerator) or
        ``"ray"``: each arm a Ray task (:func:`run_arm`; a GPU each where the cluster has them), gathered into the same
        result in arm order (identical numbers), one progress bar for the study, a task whose worker died retried
        (up to :data:`MAX_RETRIES` times), an arm that fails for its own reason named with it.
      ray_address: the Ray cluster to join (``"auto"``: the one ``ray start`` made); default: a local instance.
      runs_per_task: with ``backend="ray"``: an arm of more runs than this is split into tasks of whole seeds (at
        most this many runs each where its variants allow, two or more each), gathered into the arm's results as one
        sweep gives them (a run's numbers do not depend on the other runs of its sweep).
      overwrite: with ``out``: replace what it holds that this run did not make: the results (``results.json``) of
        another study, form or settings, or an unfinished run's arms (without ``resume``). Without it, those are
        refused before any work.
    """
    errors.require(on_arm is None or callable(on_arm), "on_arm", on_arm, "give a function of (arm, runs, curves)")
    errors.choice("backend", backend, BACKENDS, "--backend")
    if runs_per_task is not None:
        errors.int_at_least("runs_per_task", runs_per_task, 2, "--runs-per-task")
    if backend == "ray":
        from asgd_jax.ray_cluster import require_ray

        require_ray()  # fails at once, with the install command
    start = time.perf_counter()
    cache.enable()  # the studies' programs are kept across processes (asgd_jax.cache)
    s = settings or study.form(form or ("quick" if quick else "full"))
    arms = study.arms(s, quick)
    if not arms:
        raise errors.ConfigError(f"study {study.name!r} has no arms for these settings.")
    kept = None if out is None else _ArmStore(out, _manifest(study, s, quick, arms), resume, overwrite, start)
    found = {} if kept is None else kept.found(arms, s.seeds)
    if found:
        log.info("resuming %s: %d of %d arms done in %s", study.name, len(found), len(arms), out)
    runs: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}

    def finished(arm: Arm, arm_runs: list[dict[str, Any]], arm_curves: dict[str, Any], tell: bool = True) -> None:
        runs.extend(_for_every(arm, arm_runs))
        curves.update(arm_curves)
        if on_arm is not None and tell:
            on_arm(arm, arm_runs, arm_curves)

    if backend == "ray":
        done = None if on_arm is None else lambda i, result: on_arm(arms[i], *result)  # as each arm finishes
        results = _run_on_ray(study, s, quick, arms, found, kept, progress, ray_address, done, runs_per_task)
        for i, arm in enumerate(arms):  # the results in arm order, whatever order the tasks finished in
            finished(arm, *results[i], tell=False)
        if study.tuning.widen:  # the few widened arms run here, after the cluster's
            _widen(study, s, arms, _setup(study, s, arms, progress), progress, finished, runs)
        return StudyResult(study, s, quick, runs, curves, _seconds(start, kept))
    setup = _setup(study, s, arms, progress)
    # Every arm still to run is checked before any runs.
    prepared = {i: _prepare_arm(s, arm, setup, progress) for i, arm in enumerate(arms) if i not in found}

    # The arms' programs compile (or load) on threads of their own, in order, while the earlier arms compute: a
    # compilation releases Python's lock, so the time a study waits for the compiler shrinks to its first arm's.
    threads = max(1, min(2, (os.cpu_count() or 1) - 1))  # beside the compute: two threads need three cores
    ahead = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="asgd_jax-compile")
    # Only COMPILE_AHEAD arms are compiled ahead of the one computing, and an arm's programs are let go once it ran (the
    # simulator's own cache keeps its 32 newest): a study of a hundred arms holding every compiled program ran out of
    # memory maps in LLVM (a segfault).
    todo, compiled = [i for i in range(len(arms)) if i in prepared], {}
    try:
        for i, arm in enumerate(arms):
            if i in found:
                finished(arm, *found[i])
                continue
            for j in todo[todo.index(i) : todo.index(i) + 1 + COMPILE_AHEAD]:
                if j not in compiled:
                    compiled[j] = ahead.submit(prepared[j].sweep.compile)
            result = prepared[i].sweep.run()  # waits for its compilation if it is still under way
            compiled.pop(i).result()
            arm_runs, arm_curves = _arm_results(s, prepared.pop(i), result, setup)
            if kept is not None:
                kept.keep(i, arm_runs, arm_curves)
            finished(arm, arm_runs, arm_curves)
    finally:
        ahead.shutdown(wait=False, cancel_futures=True)
    _widen(study, s, arms, setup, progress, finished, runs)
    return StudyResult(study, s, quick, runs, curves, _seconds(start, kept))


def _seconds(start: float, kept: _ArmStore | None) -> float:
    """A study's seconds: this session's since ``start``, and a resumed study's earlier sessions' (their time up to
    the last arm they kept: what is in the result)."""
    return time.perf_counter() - start + (0.0 if kept is None else kept.earlier)


def widened_arms(study: Study, s: Settings, arms: list[Arm], runs: list[dict[str, Any]]) -> list[Arm]:
    """The arms one round of :attr:`Tuning.widen` adds: for every cell whose tuned ``lr`` sits at the edge of 3 or
    more values tried there, its picked variant one grid step further out (the ratio of the grid's two outermost
    values on that side), in a copy of the arm it came from."""
    _, picks = best_tuned(study, within_budgets(study, runs))
    out: dict[tuple, Arm] = {}
    for cell, keys in grid_edges(study, runs, picks).items():
        if "lr" not in keys:
            continue
        pick, here = picks[cell], [r for r in runs if cell_of(study, r) == cell]
        lrs = sorted({r["lr"] for r in here if r.get("lr") is not None})
        lr = pick["lr"]
        new = round(lr * (lrs[-1] / lrs[-2] if lr == lrs[-1] else lrs[0] / lrs[1]), 10)
        sample = next(r for r in here if all(r.get(k) == v for k, v in pick.items()))
        for i, arm in enumerate(arms):
            if any(sample.get(k) != v for k, v in arm.coords.items() if k not in arm.for_every):
                continue
            same = [
                v
                for v in arm.variants
                if arm.label(v) == sample["label"]
                and v.lr == lr
                and all(sample.get(k) == c for k, c in v.coords.items())
            ]
            if same:
                out.setdefault(
                    (i, same[0].label, tuple(same[0].coords.items()), new),
                    dataclasses.replace(arm, variants=(dataclasses.replace(same[0], lr=new),)),
                )
                break
    return list(out.values())


def _widen(study: Study, s: Settings, arms: list[Arm], setup: _Setup, progress: bool, finished, runs) -> None:
    """:attr:`Tuning.widen` rounds: the widened arms run here (after the study's own), their runs join the cells."""
    for _ in range(study.tuning.widen):
        extra = widened_arms(study, s, arms, runs)
        if not extra:
            return
        log.info("widening %s: %d edge picks run one grid step further out", study.name, len(extra))
        for arm in extra:
            prepared = _prepare_arm(s, arm, setup, progress)
            finished(arm, *_arm_results(s, prepared, prepared.sweep.run(), setup))
        arms = [*arms, *extra]


ARMS = "arms"  # the folder of a study's finished arms, under its output folder
COMPILE_AHEAD = 2  # arms compiled ahead of the one computing
BACKENDS = ("local", "ray")
MAX_RETRIES = 3  # a Ray task whose worker died is run again this many times


def run_arm(study: Study, settings: Settings, quick: bool, index: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One arm of a study, alone: its data, model and warm start made as :func:`run` makes them, its sweep run; its
    rows of the results and its mean curves (what a Ray task of ``run(backend="ray")`` computes)."""
    prepared, setup = _arm_alone(study, settings, quick, index)
    return _arm_results(settings, prepared, prepared.sweep.run(), setup)


def _arm_alone(study: Study, settings: Settings, quick: bool, index: int) -> tuple[_ArmRun, _Setup]:
    """Arm ``index`` of ``study`` bound to its sweep, with its setup made as :func:`run` makes it (a Ray task's)."""
    cache.enable()  # a Ray worker reuses the programs other workers (and runs) compiled
    arms = study.arms(settings, quick)
    errors.require(0 <= index < len(arms), "index", index, f"the study has {len(arms)} arms")
    setup = _setup(study, settings, arms, progress=False)
    return _prepare_arm(settings, arms[index], setup, progress=False), setup


def seed_groups(seeds: tuple[int, ...], variants: int, runs_per_task: int | None) -> list[tuple[int, ...]]:
    """An arm's seeds cut into the groups of its tasks: whole seeds (every variant of a seed in one task, so the runs
    stay in the sweep's order), at most ``runs_per_task`` runs a group where that holds a seed, and at least two
    runs a group (a sweep of one run is compiled without the runs axis, which may round differently).

    Example:
      >>> from asgd_jax import studies
      >>> studies.seed_groups((0, 1, 2, 3, 4), variants=3, runs_per_task=6)
      [(0, 1), (2, 3), (4,)]
    """
    if runs_per_task is None or len(seeds) * variants <= runs_per_task:
        return [tuple(seeds)]
    per = max(1, runs_per_task // variants, -(-2 // variants))
    groups = [tuple(seeds[i : i + per]) for i in range(0, len(seeds), per)]
    if len(groups) > 1 and len(groups[-1]) * variants < 2:  # a last group of one run joins the one before
        groups[-2:] = [groups[-2] + groups[-1]]
    return groups


def run_arm_part(study: Study, settings: Settings, quick: bool, index: int, seeds: tuple[int, ...]) -> dict[str, Any]:
    """One arm's runs of ``seeds`` (a Ray task of a split arm): its plan, and its sweep's per-run metrics, which
    :func:`run` joins along the runs axis into the arm's results."""
    prepared, setup = _arm_alone(study, dataclasses.replace(settings, seeds=tuple(seeds)), quick, index)
    return {"plan": prepared.plan, "metrics": prepared.sweep.run().metrics, "num_examples": setup.num_examples}


def _joined(s: Settings, arm: Arm, parts: list[dict[str, Any]]) -> tuple[list[dict], dict[str, dict]]:
    """A split arm's results from its parts, as its whole sweep would give them: the per-run metrics joined in seed
    order, then read exactly as :func:`run` reads a sweep's."""
    metrics = {k: np.concatenate([np.asarray(p["metrics"][k]) for p in parts]) for k in parts[0]["metrics"]}
    _, hp = grid(seeds=s.seeds, index=list(range(len(arm.variants))))
    run = _ArmRun(arm, parts[0]["plan"], np.asarray(hp["index"]).astype(int), None)
    setup = _Setup(None, parts[0]["num_examples"], None, None, (None, None), None)
    return _arm_results(s, run, types.SimpleNamespace(metrics=metrics), setup)


def _run_on_ray(study, s, quick, arms, found, kept, progress, address, done, runs_per_task=None) -> dict[int, tuple]:
    """Every arm not ``found`` as Ray tasks (one, or one per group of seeds: :func:`seed_groups`), gathered by index
    as they finish (kept as they finish, with ``kept``; ``done(index, result)`` told of each, the found ones
    first)."""
    import ray
    from tqdm.auto import tqdm

    from asgd_jax.ray_cluster import join

    join(address)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    options = {"num_cpus": 1, "num_gpus": gpus, "max_retries": MAX_RETRIES, "retry_exceptions": False}
    task, part_task = ray.remote(**options)(run_arm), ray.remote(**options)(run_arm_part)
    pending, parts = {}, {}  # task -> (arm, part); arm -> its parts' results so far
    for i in (i for i in range(len(arms)) if i not in found):
        groups = seed_groups(tuple(s.seeds), len(arms[i].variants), runs_per_task)
        if len(groups) == 1:
            pending[task.remote(study, s, quick, i)] = (i, None)
        else:
            parts[i] = [None] * len(groups)
            pending.update({part_task.remote(study, s, quick, i, g): (i, j) for j, g in enumerate(groups)})
    results = dict(found)
    for i in sorted(found) if done is not None else ():
        done(i, found[i])
    with tqdm(
        total=len(arms), initial=len(found), disable=not progress, desc=f"{study.name} on Ray", unit="arm"
    ) as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i, j = pending.pop(ready[0])
            try:
                if j is None:
                    results[i] = ray.get(ready[0])
                else:
                    parts[i][j] = ray.get(ready[0])
                    if any(p is None for p in parts[i]):
                        continue  # the arm's other parts are still running
                    results[i] = _joined(s, arms[i], parts.pop(i))
            except ray.exceptions.RayTaskError as e:
                for ref in pending:
                    ray.cancel(ref, force=True)
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise RuntimeError(f"arm {i} ({arms[i].description}) failed: {type(cause).__name__}: {cause}") from None
            if kept is not None:
                kept.keep(i, *results[i])
            if done is not None:
                done(i, results[i])
            bar.update(1)
    return results


def as_json(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists, other objects as their text without a memory address, which
    changes from one process to the next): how a study's settings and arms are saved and compared."""
    return json.loads(json.dumps(value, default=lambda o: re.sub(r" at 0x[0-9a-fA-F]+", "", str(o))))


def arm_identity(arm: Arm) -> dict[str, Any]:
    """Everything that decides an arm's runs (its coordinates, plan, variants and options) and its label, as JSON: what
    an arm file and a manifest say of the arm they hold."""
    return as_json({"description": arm.description, **dataclasses.asdict(arm)})


def _manifest(study: Study, s: Settings, quick: bool, arms: list[Arm]) -> dict[str, Any]:
    """What a folder's finished arms were run with, as JSON reads it back: a resume must match it."""
    return as_json(
        {
            "study": study.name,
            "quick": quick,
            "settings": dataclasses.asdict(s),
            "arms": [arm_identity(arm) for arm in arms],
        }
    )


RESULTS = "results.json"  # a finished study's results, in its output folder (what :func:`save` writes)


def check_replace(out: str | os.PathLike, study: str, quick: bool, settings: Any, overwrite: bool) -> None:
    """Refuses (a ``ConfigError``) to write into ``out`` where it holds a ``results.json`` that a run of ``study`` in
    this form with these ``settings`` (as JSON) did not make, unless ``overwrite``: another study's results, or
    other settings', or a file that is no study's results. A rerun of the same study and settings replaces its own."""
    path = os.path.join(os.fspath(out), RESULTS)
    if overwrite or not os.path.exists(path):
        return
    fix = "give another output folder (--out), or overwrite=True (--overwrite) to replace them"
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        saved = None
    if not isinstance(saved, dict) or not {"study", "quick", "settings"} <= set(saved):
        raise errors.ConfigError(f"{path} exists and is not a study's results: {fix}.")
    form = "quick" if saved["quick"] else "full"
    if saved["study"] != study or saved["quick"] != quick:
        raise errors.ConfigError(f"{out} holds the results of study {saved['study']!r} ({form} form): {fix}.")
    differ = _differences(saved["settings"], settings, "settings", "there", "now")
    if differ:
        raise errors.ConfigError(
            f"{out} holds the results of study {study!r} ({form} form) run with other settings "
            f"({_some(differ)}): {fix}."
        )


def _some(differences: list[str], most: int = 3) -> str:
    """The first ``most`` differences, each cut to a readable length, for a one-line message."""
    cut = [d if len(d) <= 120 else d[:117] + "..." for d in differences[:most]]
    return "; ".join(cut) + (f"; and {len(differences) - most} more" if len(differences) > most else "")


class _ArmStore:
    """A study's finished arms in ``<out>/arms``: a manifest, then one JSON file per arm as it finishes, each saying
    which study, form, settings and arm it holds (checked on a resume, with the shape of its runs and curves)."""

    def __init__(
        self,
        out: str | os.PathLike,
        manifest: dict[str, Any],
        resume: bool,
        overwrite: bool = False,
        started: float | None = None,
    ):
        out = errors.output_folder("out", out, "--out")
        self.folder, self.manifest = os.path.join(out, ARMS), manifest
        # This session's clock (from the run's start: its setup counts too), and the earlier sessions' seconds.
        self.started, self.earlier = time.perf_counter() if started is None else started, 0.0
        path = os.path.join(self.folder, "study.json")
        if os.path.exists(path) and not resume and (overwrite or not self._numbered()):
            # The user said so, or the unfinished run finished no arm (it stopped before: a dataset not prepared yet,
            # Ctrl-C while compiling): nothing to keep, it starts afresh.
            shutil.rmtree(self.folder)
        if not os.path.exists(path):
            check_replace(out, manifest["study"], manifest["quick"], manifest["settings"], overwrite)
            self._write(path, manifest, "no arm has run yet: free some space and run the study again")
            return
        saved = checkpoint_lib.read_json(path)
        if not isinstance(saved, dict) or not isinstance(saved.get("arms"), list):
            raise errors.ConfigError(
                f"{path} is not a study's manifest: choose another output folder, or overwrite=True (--overwrite) to "
                "start the study afresh there."
            )
        if not resume:
            raise errors.ConfigError(
                f"{out} holds an unfinished run of study {saved.get('study')!r} ({len(self._numbered())} of "
                f"{len(saved['arms'])} arms done): pass resume=True (--resume) to finish it, choose another output "
                "folder, or overwrite=True (--overwrite) to start afresh."
            )
        differ = _differences(saved, manifest)
        errors.require(
            not differ,
            "resume",
            True,
            f"{out}'s arms were run with other settings ({_some(differ, 4)}): use the same study, form and "
            "settings, or another output folder",
            "--resume",
        )

    def _numbered(self) -> list[str]:
        return [f for f in os.listdir(self.folder) if f.endswith(".json") and f[:-5].isdigit()]

    def header(self, i: int) -> dict[str, Any]:
        """What arm file ``i`` says it holds: the study, its form and settings, the arm's index and identity."""
        m = self.manifest
        return {"study": m["study"], "quick": m["quick"], "index": i, "arm": m["arms"][i], "settings": m["settings"]}

    def found(self, arms: list[Arm], seeds: tuple[int, ...]) -> dict[int, tuple[list[dict[str, Any]], dict[str, Any]]]:
        """The arms finished before, by index: their runs and curves, each file checked against the arm it must
        hold (a ``ConfigError`` naming the file and the fix where it does not)."""
        out = {}
        for i, arm in enumerate(arms):
            path = os.path.join(self.folder, f"{i}.json")
            if os.path.exists(path):
                out[i] = self._read(path, i, arm, seeds)
        return out

    def seconds(self) -> float:
        """The study's seconds so far: the earlier sessions' (up to their last kept arm) and this one's."""
        return self.earlier + time.perf_counter() - self.started

    def _read(self, path: str, i: int, arm: Arm, seeds: tuple[int, ...]) -> tuple[list[dict], dict[str, Any]]:
        fix = f"delete it to run arm {i} ({arm.description}) again"
        try:
            saved = checkpoint_lib.read_json(path)
        except errors.ConfigError as e:  # missing, unreadable or cut short
            raise errors.ConfigError(f"{str(e).rstrip('.')}: {fix}.") from None
        expected = self.header(i)
        missing = [k for k in (*expected, "runs", "curves") if not isinstance(saved, dict) or k not in saved]
        if missing:
            raise errors.ConfigError(f"{path} is not a study's arm file (it lacks {', '.join(missing)}): {fix}.")
        differ = [d for k, v in expected.items() for d in _differences(saved[k], v, k, "in the file", "here")]
        if differ:
            raise errors.ConfigError(f"{path} holds other runs than arm {i} of this study ({_some(differ)}): {fix}.")
        problem = arm_file_problem(saved["runs"], saved["curves"], arm, seeds)
        if problem:
            raise errors.ConfigError(f"{path} is not a whole arm file ({problem}): {fix}.")
        spent = saved.get("seconds", 0.0)  # (an arm file from before it was kept: none)
        if isinstance(spent, int | float) and math.isfinite(spent) and spent > self.earlier:
            self.earlier = float(spent)
        return saved["runs"], saved["curves"]

    def keep(self, i: int, runs: list[dict[str, Any]], curves: dict[str, Any]) -> None:
        """Writes arm ``i``'s file; a full disk stops the study (:class:`~asgd_jax.errors.RunStopped`), the arms
        finished before kept."""
        arm = {**self.header(i), "runs": runs, "curves": curves, "seconds": self.seconds()}  # (the study's, so far)
        self._write(os.path.join(self.folder, f"{i}.json"), arm)

    def _write(self, path: str, value: Any, then: str | None = None) -> None:
        try:
            checkpoint_lib.write_json(path, value)
        except OSError as e:
            then = then or (
                f"the {len(self._numbered())} finished arm(s) of {len(self.manifest['arms'])} are kept in "
                f"{self.folder}: free some space, then run the same study again with resume=True (--resume) to "
                "finish it"
            )
            raise errors.RunStopped(f"{errors.write_failure(e)}: {path} could not be written; {then}") from e


RUN_NUMBERS = ("test_error", "train_error", "time_to_target", "virtual_time", "mean_staleness")
RUN_COUNTS = ("seed", "max_staleness", "updates")
CURVE_SERIES = ("update", "epoch", "time", "train_error", "eval_epoch", "test_error")


def arm_file_problem(runs: Any, curves: Any, arm: Arm, seeds: tuple[int, ...]) -> str | None:
    """What is wrong with an arm file's runs and curves for ``arm`` run with ``seeds`` (None: nothing): one run per
    variant and seed, each with the arm's labels, coordinates and numbers; one curve per series, each a set of lists."""
    count = len(arm.variants) * len(seeds)
    if not isinstance(runs, list) or len(runs) != count:
        return f"runs: {count} expected, {len(runs) if isinstance(runs, list) else type(runs).__name__} found"
    labels = {arm.label(v) for v in arm.variants}
    own = {k for v in arm.variants for k in v.coords} | {"lr", "label"}  # a variant's own coordinates win
    coords = as_json({k: v for k, v in arm.coords.items() if k not in own})
    number = (int, float)
    for j, r in enumerate(runs):
        if not isinstance(r, dict):
            return f"run {j} is a {type(r).__name__}"
        if r.get("label") not in labels or r.get("seed") not in seeds:
            return f"run {j} is {r.get('label')!r} seed {r.get('seed')!r}, not one of this arm's"
        if any(r.get(k) != v for k, v in coords.items()):
            return f"run {j} has other coordinates than the arm's {coords}"
        bad = [k for k in RUN_NUMBERS if type(r.get(k)) not in number] + [
            k for k in RUN_COUNTS if type(r.get(k)) is not int
        ]
        if bad:
            return f"run {j} has no number for {', '.join(bad)}"
    if not isinstance(curves, dict) or not curves:
        return f"curves: a table of series expected, {type(curves).__name__} found"
    for name, c in curves.items():
        if not isinstance(c, dict) or not isinstance(c.get("coords"), dict):
            return f"curve {name!r} is not a series"
        bad = [k for k in CURVE_SERIES if not isinstance(c.get(k), list)]
        if bad:
            return f"curve {name!r} has no list for {', '.join(bad)}"
    return None


def _differences(saved: Any, now: Any, where: str = "", then: str = "then", here: str = "now") -> list[str]:
    """Where two JSON values differ, as ``path: saved <then>, now <here>`` lines."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [
            d
            for k in sorted(set(saved) | set(now))
            for d in _differences(saved.get(k), now.get(k), f"{where}.{k}", then, here)
        ]
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [
            d
            for i, (a, b) in enumerate(zip(saved, now, strict=True))
            for d in _differences(a, b, f"{where}[{i}]", then, here)
        ]
    return [] if saved == now else [f"{where.lstrip('.')}: {saved!r} {then}, {now!r} {here}"]


def ablate(
    *,
    quick: bool = False,
    progress: bool = True,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    **overrides: Any,
) -> StudyResult:
    """DC-ASGD's Table 1 in miniature: the ``dcasgd_table1`` study in its ``ablate`` form (mnist1d MLP, 40 effective
    epochs, 5 seeds; ``quick``: 15 epochs, 3 seeds), with ``overrides`` of its settings (``workers``,
    ``algorithms``, ``seeds``, ``epochs``, ``learning_rate``, ``lam_c``, ``lam_a``, ``dataset``, ...: the study's
    ``DCSettings``). What ``asgd-jax ablate`` and ``make demo`` run. ``out``, ``resume`` and ``overwrite`` are
    :func:`run`'s: each arm kept as it finishes, a killed ablation finished, another's results never replaced
    unasked."""
    study = load("dcasgd_table1")
    settings = dataclasses.replace(study.form("ablate-quick" if quick else "ablate"), **overrides)
    return run(study, quick=quick, progress=progress, settings=settings, out=out, resume=resume, overwrite=overwrite)
