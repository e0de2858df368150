"""Delay models: who pushes next, and at which weights their gradient was computed.

A delay model describes the asynchrony of a run as a pure, keyed schedule of events. The server keeps one backup
(snapshot of the weights plus the version it was taken at) per *slot*; every update is an :class:`Event` saying which
slot's backup the pushed gradient was computed at (``push``), which slot takes a fresh snapshot right after the update
(``pull``), which data shard the minibatch comes from and the virtual time of the update. A *round* model's update is
a :class:`Round` instead: the mean of ``K`` payloads, all computed at the current weights.

The models, a file per family (or per paper):

* :class:`Workers` (``workers.py``) is event-driven: M workers with random compute times (or fixed ones,
  :meth:`Workers.with_times`; :func:`sqrt_times` is the optimal-time papers' cluster); the one that finishes first
  pushes, then pulls (slot = worker = shard). The default, and the law every cluster below draws from.
  Its ``links`` (:class:`Links`, ``links.py``) make communication cost time that grows with the message: each
  worker's upload and download, latency + bytes / bandwidth (:func:`message_bytes`: the weights' size); its
  ``availability`` (:class:`Availability`, ``availability.py``) online windows and dropouts with a time of return;
  :func:`gpu_cluster` (``measured.py``) its times from measured per-GPU epoch times (the Zeus traces, shipped).
  :class:`Overlapped` (``overlapped.py``) runs such a law's workers with compute and communication as separate
  resources: a worker computes its next gradient while the last one uploads.
* :class:`Trace` (``traces.py``) replays a given order of pushing workers (e.g. a real trainer's ``trace.jsonl``);
  :class:`RoundTrace` replays a round method's recorded rounds. ``Trace.load`` reads either back.
* :class:`FixedDelay` and :class:`RandomDelay` (``rings.py``) are the classic analysis setting: the gradient applied at
  update t was computed at ``w_{max(0, t - tau)}``. They keep a ring of ``tau + 1`` snapshots as slots and read one
  data stream.
* The optimal-time methods' clusters, where timing alone decides which gradients are used, ignored or stopped
  (``clusters.py``: their shared :class:`ClusterState` and :func:`computation_time`):
  :class:`Ringmaster` (``ringmaster.py``: a gradient R or more updates stale is ignored; a ring of R versions),
  :class:`Rennala` (``rennala.py``: rounds of S gradients at the current weights) and :class:`MSync` (``msync.py``:
  the first m of M gradients per round), the last two round models; and :class:`Malenia` (``malenia.py``: rounds
  that close when every worker has reported, for the rule ``rules.malenia_sgd``); and Shadowheart SGD's decisions
  (``shadowheart.py``: :func:`equilibrium_time` t* and each worker's share of a round, :func:`shadowheart_round`)
  and its round model, :class:`Shadowheart`.

Static fields (the number of slots, the distribution's kind) shape the compiled program; numeric fields (mean compute
time, speeds, straggler probability, ...) are pytree leaves, so they may be traced or vmapped over: :func:`split` gives
a model's :class:`Structure` and numbers (``structure.py``). What every model shares, that value semantics and the
checks of its numbers, is in ``base.py``.

Adding a delay model: one file here defining its class (``init`` and ``next`` returning an :class:`Event`, or
``round_size`` and ``round`` returning a :class:`Round`; ``num_slots`` and ``num_shards``; its numbers checked in
``__post_init__`` with :func:`~asgd_jax.delays.base.check_int` and :func:`~asgd_jax.delays.base.check_array`), made a
value with ``pytree_dataclass(cls, meta=<its static fields>)`` from ``base.py``, with one ``Example:`` in its
docstring; its name imported here and put in ``__all__``; and one instance (with a twin of other numbers and a
constructor of bad ones) in ``MODELS`` of ``tests/test_delays_family.py``, the test every delay model passes.
"""

from __future__ import annotations

from asgd_jax.delays.availability import Availability
from asgd_jax.delays.base import Event, Round, is_delay_model, is_round_model
from asgd_jax.delays.clusters import ClusterState, computation_time
from asgd_jax.delays.links import Links, message_bytes
from asgd_jax.delays.malenia import Malenia
from asgd_jax.delays.measured import gpu_cluster
from asgd_jax.delays.msync import MSync
from asgd_jax.delays.overlapped import Overlapped, OverlappedState
from asgd_jax.delays.rennala import Rennala
from asgd_jax.delays.ringmaster import Ringmaster
from asgd_jax.delays.rings import FixedDelay, RandomDelay
from asgd_jax.delays.shadowheart import Shadowheart, ShadowheartRound, equilibrium_time, shadowheart_round
from asgd_jax.delays.structure import Structure, split
from asgd_jax.delays.traces import RoundTrace, Trace
from asgd_jax.delays.workers import COMPUTE_TIME_KINDS, Workers, sqrt_times

__all__ = [
    "Availability",
    "COMPUTE_TIME_KINDS",
    "ClusterState",
    "Event",
    "FixedDelay",
    "Links",
    "MSync",
    "Overlapped",
    "OverlappedState",
    "Malenia",
    "RandomDelay",
    "Rennala",
    "Ringmaster",
    "Round",
    "Shadowheart",
    "ShadowheartRound",
    "RoundTrace",
    "Structure",
    "Trace",
    "Workers",
    "computation_time",
    "equilibrium_time",
    "gpu_cluster",
    "is_delay_model",
    "is_round_model",
    "message_bytes",
    "shadowheart_round",
    "split",
    "sqrt_times",
]
