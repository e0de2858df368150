"""What workers talk to and what a driver polls: a run's store, in the worker's terms, on any substrate.

:func:`for_run` builds a trainer run's :class:`~asgd_jax.trainer.store.ParameterStore` from its config (the one place
a backend's store is made); :class:`Endpoint` wraps it for the workers (in this process, or inside the Ray backend's
store actor) and for the driver.
"""

from __future__ import annotations

import threading
from typing import Any, SupportsFloat, SupportsInt

import jax
import optax

from asgd_jax.trainer.config import TrainConfig
from asgd_jax.trainer.discipline import Discipline
from asgd_jax.trainer.messages import (
    Answer,
    BadPush,
    Computed,
    Ignored,
    Progress,
    StaleRound,
    StoreClosed,
    Sync,
    Weights,
)
from asgd_jax.trainer.store import ParameterStore

__all__ = ["Endpoint", "for_run", "readable_losses"]


def for_run(
    rule: optax.GradientTransformation,
    params: Any,
    config: TrainConfig,
    *,
    header: dict[str, Any],
    model_state: Any,
    evaluates: bool,
    resume: bool | None = None,
    in_process: bool = False,
) -> ParameterStore:
    """The store of a trainer run, made from its :class:`asgd_jax.TrainConfig`: its budget, output folder, checkpoints,
    snapshots for evaluation, non-finite policy and discipline. ``resume`` defaults to the config's (the Ray store
    actor always resumes: Ray restarts it from its checkpoint); ``in_process``: its workers are threads of this
    process, whose payloads and answers stay on the devices (a plain asynchronous run is then pipelined)."""
    discipline = config.discipline
    return ParameterStore(
        rule,
        params,
        config.plan.workers,
        model_state=model_state,
        num_updates=config.plan.num_updates,
        out_dir=config.out,
        on_nonfinite=config.on_nonfinite,
        checkpoint_dir=config.out,
        checkpoint_every=config.checkpoint_interval(),
        resume=bool(config.resume if resume is None else resume),  # ("auto": the run decided already; restore if there)
        header=header,
        snapshot_every=config.eval_interval() if evaluates else None,
        max_nonfinite=config.max_nonfinite,
        device=config.store_device_now(),
        threshold=discipline.threshold,
        gather=discipline.gather,
        pipelined=in_process and discipline.kind == "async",
    )


class Endpoint:
    """A :class:`~asgd_jax.trainer.store.ParameterStore`, in :mod:`asgd_jax.trainer.worker`'s terms.

    The one place where the store's exceptions become a worker's :class:`~asgd_jax.trainer.messages.Answer`: a bad or
    non-finite push is ``"rejected"``, a closed store ``"closed"``, an SSGD payload of a round already past
    ``"resync"``, a round method's computation its round's end stopped ``"restart"``. In a round discipline every
    round is pushed as worker 0, so every worker computes at worker 0's backup.

    Args:
      store: the store.
      discipline: how the run exchanges (its config's :attr:`~asgd_jax.TrainConfig.discipline`).
      timeout: the longest a worker waits in a round for the others' pushes (the run's timeout); an asynchronous push
        is applied on the pushing thread itself, its answer there when ``push`` returns.
    """

    def __init__(self, store: ParameterStore, discipline: Discipline, timeout: float | None = None):
        self.store, self.discipline, self.timeout = store, discipline, timeout
        self._lock = threading.Lock()
        self._losses: list[SupportsFloat] = []  # (an in-process worker's: still on its device)
        kind = discipline.kind
        self._push = {"ssgd": store.push_round, "rennala": store.push_gathered, "msync": store.push_gathered}.get(
            kind, self._push_async
        )

    def _push_async(self, worker: int, payload: Any, version: SupportsInt, model_state: Any, timeout, **how: Any):
        return self.store.push(worker, payload, version, model_state, **how).result(timeout=timeout)

    def sync(self, worker: int) -> Sync:
        """``worker``'s backup (the weights it last pulled, packed host buffers) and its data position."""
        params, model_state, version = self.store.packed_backup(0 if self.discipline.rounds else worker)
        # A round method's workers read their own shards at their own pace; SSGD's all at the rounds'.
        with self.store.lock:  # (the position and the inner state of one and the same push)
            position = self.store.ledger.positions[0 if self.discipline.kind == "ssgd" else worker]
            inner = self.store.ledger.inner.get(worker)
        return Sync(Weights(params, model_state, version), int(position), inner)

    def pull(self, worker: int) -> Weights:
        """The current weights for ``worker`` (recorded as its backup): where a stopped computation restarts. In a
        round discipline every worker computes at the current weights, worker 0's backup."""
        if self.discipline.rounds:
            return Weights(*self.store.rounds.weights(packed=True))
        return Weights(*self.store.pull(worker, packed=True))

    def wait_version(self, version: int, timeout: float) -> int:
        """The store's applied updates once it reaches ``version`` or after ``timeout`` seconds; -1 once it closed."""
        applied = self.store.wait_version(version, timeout)
        return -1 if self.store.closed else applied

    def push(
        self, worker: int, payload: Any, version: SupportsInt, model_state: Any, loss: SupportsFloat, inner: Any = None
    ) -> Answer:
        """Applies a push of packed buffers (or the round it completes) and answers it with packed weights;
        ``inner``: the worker's inner-optimizer state after it (kept for the checkpoints once it is applied)."""
        try:
            how: dict[str, Any] = {"packed": True}
            if inner is not None:  # (a round keeps each of its workers' states: the store's push, by worker)
                how["inner"] = inner if self.discipline.rounds else {worker: inner}
            weights = self._push(worker, payload, version, model_state, self.timeout, **how)
        except StaleRound as e:
            if self.discipline.gather is not None:  # a computation its round's end stopped: again, same minibatches
                return Answer("restart", self.pull(worker), str(e))
            return Answer("resync", None, str(e))
        except StoreClosed as e:
            return Answer("closed", None, str(e))
        except BadPush as e:
            return Answer("rejected", None, str(e))
        with self._lock:
            self._losses.append(loss)
        if self.discipline.rounds and self.store.closed:  # that was the last round: nobody computes another one
            return Answer("closed", None, self.store.status().error or "the store reached its number of updates")
        return Answer("ok", Weights(*weights), applied=not isinstance(weights, Ignored))

    def push_computed(self, worker: int, push: Computed) -> Answer:
        """A :class:`~asgd_jax.trainer.messages.Computed` push (a worker on a pipelined store's device): the store runs
        the worker's period at its backup and applies the payload, one program; the answer carries the loss."""
        try:
            *weights, loss = self.store.push(worker, push, 0, None, packed=True).result(timeout=self.timeout)
        except StoreClosed as e:
            return Answer("closed", None, str(e))
        with self._lock:
            self._losses.append(loss)
        return Answer("ok", Weights(*weights), loss=loss)

    def warm_up_computed(self, worker: int, push: Computed) -> None:
        """Compiles ``push``'s program (on a scratch copy of the state) before the run's clock starts."""
        with self.store.lock:
            self.store.server.warm_up_computed(worker, push)

    def progress(self) -> Progress:
        """The store's status, the losses pushed since the last call and the snapshots taken since (handed over)."""
        with self._lock:
            losses, self._losses = self._losses, []
        return Progress(self.store.status(), readable_losses(losses), self.store.take_snapshots())

    def end(self, why: str) -> None:
        """Ends the run without an error (a worker the run cannot go on without died): rounds off, store closed."""
        self.store.abort_rounds(why)
        self.store.close()

    def fail(self, why: str) -> None:
        """Stops the run with an error (the driver could not write metrics.jsonl)."""
        self.store.fail(OSError(why))

    def close(self) -> tuple[Progress, Any, Any]:
        """Closes the store (final checkpoint); returns the last :meth:`progress` and the final weights."""
        self.store.close()
        return (self.progress(), *self.store.final_weights())


def readable_losses(losses: list) -> list[float]:
    """The pushed losses on the host (one transfer); a loss of a program that failed (the store's applier died on it,
    and says why) is left out, not raised here in the driver's place."""
    try:
        return [float(x) for x in jax.device_get(losses)]
    except jax.errors.JaxRuntimeError:
        out = []
        for x in losses:
            try:
                out.append(float(jax.device_get(x)))
            except jax.errors.JaxRuntimeError:
                continue
        return out
