"""The chunk driver: a call's programs run chunk by chunk (:func:`run`).

Between chunks it evaluates where due, updates the progress bar, writes an atomic checkpoint (a call with the same
arguments resumes from it, bit for bit), warns or stops when the training loss turns NaN or Inf, stops a run past its
time budget and calls the callback; at the end it joins the chunks' metrics into the :class:`SimulationResult`.
:class:`Call` is one call's arguments and how to drive it; :func:`compile_updates` and :func:`compile_eval` compile a
call's programs ahead (its updates on a thread of their own while its start runs).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from asgd_jax import cache, errors, exchange, interrupts
from asgd_jax import checkpoint as ckpt
from asgd_jax.plan import Plan
from asgd_jax.simulator import programs as programs_lib
from asgd_jax.simulator.programs import Program as _Program
from asgd_jax.simulator.programs import Programs as _Programs
from asgd_jax.simulator.state import SimState, SimulationResult


@dataclasses.dataclass
class _Progress:
    """What a run has done so far: updates, per-chunk metrics and evaluations (host arrays)."""

    done: int = 0
    chunks: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    evals: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    eval_updates: list[int] = dataclasses.field(default_factory=list)
    saved: int = 0  # the update count of the last checkpoint


class Call(NamedTuple):
    """One call's arguments to its program, and how to drive it."""

    plan: Plan
    params: Any
    model_state: Any
    data: Any
    eval_data: Any
    keys: jax.Array
    hparams: dict[str, Any]
    numbers: dict[str, Any]
    batched: bool
    on_nonfinite: str
    checkpoint_dir: str | None
    progress: bool
    callback: Callable | None
    description: str
    runs: int | None = None  # a sharded sweep's own runs (the rest pad the runs axis to the devices)


def _header(call: Call) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by this call."""
    p = call.plan
    return {
        "key": exchange.key_fingerprint(call.keys),
        "num_updates": p.num_updates,
        "plan": repr(p.structure()._replace(delays=type(p.delays).__name__)) + f" workers={p.workers}",
        "numbers": exchange.key_fingerprint_tree((call.numbers, call.hparams)),
    }


def _resume(path: str, template: Any, header: dict[str, Any], axis: int) -> tuple[SimState, _Progress]:
    state, arrays, saved = ckpt.load(path, template)
    mismatched = [k for k in header if saved.get(k) != header[k]]
    if mismatched:
        shown = lambda k: (
            k
            if k in ("key", "numbers")
            else "{} ({} then, {} now)".format(k, *errors.differing(saved.get(k), header[k]))
        )
        raise errors.ConfigError(
            f"Checkpoint {path} was written by a run with different {', '.join(map(shown, mismatched))}: resume with "
            "the same key, plan and numbers, or use another checkpoint_dir."
        )
    metrics = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
    stacked = {k[2:]: v for k, v in arrays.items() if k.startswith("e/")}
    n_evals = next(iter(stacked.values())).shape[axis] if stacked else 0
    evals = [{k: np.take(v, i, axis=axis) for k, v in stacked.items()} for i in range(n_evals)]
    done = int(saved["done"])
    eval_updates = [int(u) for u in arrays.get("eval_updates", [])]
    return state, _Progress(done, [metrics] if metrics else [], evals, eval_updates, done)


def _start_shape(run: _Program, c: Call) -> SimState:
    return jax.eval_shape(run.jitted["start"], c.params, c.model_state, c.keys, c.hparams, c.numbers)


def compile_updates(programs: _Programs, c: Call) -> None:
    """Compiles the update programs a call needs (:func:`~asgd_jax.simulator.programs.scans_whole_chunks`); a failure
    is left for the call itself to meet and report, when it runs the program."""
    try:
        state = _start_shape(programs.run, c)
        args = (c.data, c.keys, c.hparams, c.numbers)
        scanned, whole, part = (
            _scanned(c),
            c.plan.num_updates // c.plan.chunk_length,
            c.plan.num_updates % c.plan.chunk_length,
        )
        if scanned and whole:
            programs.run.compiled("scan", state, *args)
        if part or not scanned:
            programs.run.compiled("chunk", state, *args, np.int32(0))
    except Exception:
        return


def _scanned(c: Call) -> bool:
    """Whether the call's whole chunks run in the scan program, by the platform of its keys (placed on its devices)."""
    return programs_lib.scans_whole_chunks(cache.platform_of(c.keys))


def compile_eval(programs: _Programs, c: Call) -> None:
    if programs.evaluates:
        state = _start_shape(programs.run, c)
        programs.evaluator.compiled("eval", state.server.params, state.server.model_state, c.eval_data)


def run(programs: _Programs, call: Call) -> SimulationResult:
    with interrupts.watch():
        return _chunks(programs, call)


def _chunks(programs: _Programs, call: Call) -> SimulationResult:
    plan, axis, program = call.plan, (1 if call.batched else 0), programs.run
    args = (call.keys, call.hparams, call.numbers)
    path = None if call.checkpoint_dir is None else os.path.join(call.checkpoint_dir, "simulator.npz")
    header = _header(call)
    so_far = _Progress()
    if path is not None and os.path.exists(path):
        template = program.compiled("start", call.params, call.model_state, *args).out_info
        state, so_far = _resume(path, template, header, axis)
    else:
        # The update programs compile on a thread of their own while this one compiles and runs the start and the
        # first evaluation: on a machine with two cores the first call waits for the larger of the two, not the sum.
        threading.Thread(target=compile_updates, args=(programs, call), daemon=True).start()
        state = program.call("start", call.params, call.model_state, *args)
        if programs.evaluates:
            so_far.evals, so_far.eval_updates = [jax.device_get(programs.evaluate(state, call.eval_data))], [0]
    bar = _bar(call.progress, plan.num_updates, so_far.done, call.description)
    chunk, every, scanned = plan.chunk_length, plan.eval_interval(), _scanned(call)
    warned = [False]
    over = _past_budget(plan, state, so_far, programs.evaluates)  # a resumed run may be over already
    try:
        while so_far.done < plan.num_updates and not over:
            interrupts.check()  # a Ctrl-C something swallowed (while compiling) still stops the run
            length = min(chunk, plan.num_updates - so_far.done)
            end = so_far.done + length
            if length == chunk and scanned:
                state, metrics = program.call("scan", state, call.data, *args)
            else:
                state, metrics = program.call("chunk", state, call.data, *args, np.int32(length))
            if programs.evaluates and (end % every == 0 or end == plan.num_updates):
                so_far.evals.append(jax.device_get(programs.evaluate(state, call.eval_data)))
                so_far.eval_updates.append(end)
            metrics = {k: np.take(v, np.arange(length), axis=axis) for k, v in jax.device_get(metrics).items()}
            so_far.chunks.append(metrics)
            so_far.done = end
            _check_finite(metrics, end, call.on_nonfinite, warned, call.runs)
            over = _past_budget(plan, state, so_far, programs.evaluates)
            if path is not None and (
                end - so_far.saved >= plan.checkpoint_interval() or over or end == plan.num_updates
            ):
                _save(path, state, so_far, header, axis)
            if bar is not None:
                bar.update(length)
                bar.set_postfix(_progress_note(np.take(metrics["loss"], -1, axis=axis)))
            if call.callback is not None:
                call.callback(so_far.done, state)
    finally:
        if bar is not None:
            bar.close()
    metrics = _metrics(so_far, axis)
    if call.runs is not None:  # a sharded sweep: the runs that pad its runs axis to the devices are dropped
        keep = lambda x: np.asarray(x)[: call.runs] if np.ndim(x) else x
        state, metrics = jax.tree.map(keep, jax.device_get(state)), {k: keep(v) for k, v in metrics.items()}
    params, model_state = state.server.params, state.server.model_state
    return SimulationResult(params, model_state, state, metrics, plan)


def _past_budget(plan: Plan, state: SimState, so_far: _Progress, evaluates: bool) -> bool:
    """Whether a run with a ``time_budget`` is over: every run's clock has reached it, at an evaluation."""
    if plan.time_budget is None or so_far.done == 0 or (evaluates and so_far.eval_updates[-1] != so_far.done):
        return False
    return bool(np.min(jax.device_get(state.clock)) >= plan.time_budget)


def _save(path: str, state: SimState, so_far: _Progress, header: dict[str, Any], axis: int) -> None:
    so_far.chunks = [_join(so_far.chunks, axis)]
    arrays = {f"m/{k}": v for k, v in so_far.chunks[0].items()}
    arrays.update({f"e/{k}": v for k, v in _join(so_far.evals, axis, stack=True).items()})
    arrays["eval_updates"] = np.asarray(so_far.eval_updates, np.int64)
    ckpt.save(path, state, arrays, {**header, "done": so_far.done})
    so_far.saved = so_far.done


def _bar(progress: bool, total: int, initial: int, description: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=description, unit="upd", leave=False)


def _metrics(so_far: _Progress, axis: int) -> dict[str, np.ndarray]:
    metrics = _join(so_far.chunks, axis)
    if so_far.evals and so_far.evals[0]:
        ev = _join(so_far.evals, axis, stack=True)
        shape = next(iter(ev.values())).shape
        metrics.update(ev)
        metrics["eval_update"] = np.broadcast_to(np.asarray(so_far.eval_updates, np.int32), shape).copy()
    return metrics


def _join(parts: Sequence[Mapping[str, np.ndarray]], axis: int, stack: bool = False) -> dict[str, np.ndarray]:
    """Joins per-chunk metrics along the update axis (``stack`` for one scalar per chunk, e.g. evaluations)."""
    if not parts:
        return {}
    join = np.stack if stack else np.concatenate
    return {k: join([np.asarray(p[k]) for p in parts], axis=axis) for k in parts[0]}


def _progress_note(last_losses: np.ndarray) -> dict[str, str]:
    """The progress bar's note: the last loss (a sweep's median over its runs) and how many runs diverged."""
    losses = np.atleast_1d(last_losses)
    finite = losses[np.isfinite(losses)]
    note = {"loss": f"{float(np.median(finite)):.3f}" if finite.size else "nan"}
    if finite.size < losses.size:
        note["diverged"] = f"{losses.size - finite.size}/{losses.size}"
    return note


def _check_finite(
    metrics: dict[str, np.ndarray], done: int, policy: str, warned: list[bool], runs: int | None = None
) -> None:
    """Warns (once) or stops when a chunk's training loss is NaN or Inf: a diverging run says so (a sweep says how
    many of its ``runs`` own runs, so far: not the copies that pad a sharded sweep)."""
    losses = np.asarray(metrics["loss"])
    losses = losses if runs is None else losses[:runs]
    bad = ~np.isfinite(losses)
    if policy == "ignore" or not bad.any():
        return
    per_update = bad.reshape(-1, bad.shape[-1]).any(axis=0)  # any run of a sweep
    first = done - losses.shape[-1] + int(np.argmax(per_update))
    which = "the run" if losses.ndim == 1 else f"{int(bad.any(axis=-1).sum())} of its {losses.shape[0]} runs"
    message = (
        f"the training loss is NaN or Inf from update {first + 1} on: {which} diverged (lower the learning "
        "rate, check the data and the initial weights)"
    )
    if policy == "stop":
        raise FloatingPointError(message + "; stopped (on_nonfinite='stop').")
    if not warned[0]:
        warnings.warn(message + ".", RuntimeWarning, stacklevel=4)
        warned[0] = True
