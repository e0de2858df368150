"""How the training data is split among the workers: :class:`Partition`, part of a run's :class:`asgd_jax.Plan`.

* ``iid`` (the default): every epoch the data is re-dealt at random into M equal shards (DC-ASGD's random
  re-partitioning; :mod:`asgd_jax.order`).
* ``dirichlet:ALPHA``: each class's examples are split among the workers in proportions drawn from
  Dirichlet(alpha * 1_M) (Hsu et al. 2019; the label-distribution skew of NIID-Bench, Li et al. 2022, with its
  balancing: a worker already holding N/M examples gets no more). alpha = 0.1 is the Ringleader and IA²SGD papers'
  heterogeneous setup; a large alpha tends to IID.
* ``labels:K``: every worker holds K distinct classes (NIID-Bench's #C=K: worker w's first class is w mod C, the other
  K-1 drawn at random), each class's examples split equally among the workers that hold it; a class nobody holds is
  left out.
* ``unequal:BETA``: IID labels, unequal shard sizes: the workers' shares of the shuffled data drawn from
  Dirichlet(beta * 1_M) (NIID-Bench's quantity skew).

A non-IID partition is drawn once, on the host, from its own ``seed`` and the labels, and stays fixed for the whole
run (as a federated fleet's clients keep their data): every seed of a sweep and every rule of a comparison trains on
the same workers. Each worker walks through its own examples in a fresh keyed order every epoch
(:func:`asgd_jax.order.member_position`), ``size // batch_size`` minibatches an epoch. The simulator and the trainer's
workers read the same :class:`Assignment`, so a trace of a trainer run replays on the same partition.

Example:
  >>> import numpy as np
  >>> from asgd_jax.partition import Partition
  >>> p = Partition.parse("dirichlet:0.1")
  >>> p, p.alpha
  (Partition('dirichlet:0.1'), 0.1)
  >>> labels = np.repeat(np.arange(10), 100)
  >>> a = p.assign(labels, num_workers=4, batch_size=8)
  >>> int(a.sizes.sum()), bool((a.sizes >= 8).all())
  (1000, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from asgd_jax import errors, order

__all__ = ["KINDS", "Assignment", "Partition", "assignment", "batch_indices", "labels_of"]

KINDS = ("iid", "dirichlet", "labels", "unequal")
"""The partitions a run can use (``--partition KIND[:VALUE[:SEED]]``)."""

_TRIES = 1_000  # draws of a Dirichlet partition before giving up on one where every worker fills a minibatch


class Assignment(NamedTuple):
    """A drawn partition: worker w holds ``members[offsets[w] : offsets[w] + sizes[w]]`` (example indices, int32).

    ``members`` has one entry per example of the data whatever the partition (a partition that leaves examples out,
    ``labels:K``, pads its end), so every partition of the same data runs in the same compiled programs.

    It is an argument of the simulator's programs (its numbers, not their structure) and what a trainer's worker
    reads its minibatches from.
    """

    members: Any  # int32 [total]
    offsets: Any  # int32 [M]
    sizes: Any  # int32 [M]

    def of(self, worker: int) -> np.ndarray:
        """Worker ``worker``'s example indices (host)."""
        start = int(self.offsets[worker])
        return np.asarray(self.members)[start : start + int(self.sizes[worker])]


@dataclasses.dataclass(frozen=True)
class Partition:
    """A data partition: its kind, its one number (``alpha``, ``labels`` or ``beta``) and its seed.

    Make one with :meth:`parse` (``"iid"``, ``"dirichlet:0.1"``, ``"labels:2"``, ``"unequal:0.5"``, a third field the
    seed: ``"dirichlet:0.1:3"``) or the class methods; ``str(p)`` is the text form back.
    """

    kind: str = "iid"
    value: float | None = None
    seed: int = 0

    def __post_init__(self):
        errors.choice("partition", self.kind, KINDS, "--partition")
        errors.int_at_least("partition seed", self.seed, 0, "--partition")
        if self.kind == "iid":
            errors.require(self.value is None, "partition", str(self), "'iid' takes no number", "--partition")
        elif self.kind == "labels":
            errors.positive_int("labels per worker", self.value, "--partition labels:K")
            object.__setattr__(self, "value", int(self.value))
        else:
            name = "alpha" if self.kind == "dirichlet" else "beta"
            value = errors.finite_number(
                name, self.value, positive=True, flag=f"--partition {self.kind}:{name.upper()}"
            )
            object.__setattr__(self, "value", value)

    @classmethod
    def parse(cls, text: str | Partition | None) -> Partition:
        """``"KIND[:VALUE[:SEED]]"`` (or a Partition, or None for IID) as a :class:`Partition`."""
        if text is None:
            return cls()
        if isinstance(text, Partition):
            return text
        allowed = "use iid, dirichlet:ALPHA, labels:K or unequal:BETA, optionally :SEED after the number"
        errors.require(isinstance(text, str) and text.strip() != "", "partition", text, allowed, "--partition")
        kind, *rest = text.strip().split(":")
        errors.require(kind in KINDS and len(rest) <= 2 and (kind != "iid" or not rest), "partition", text, allowed)
        errors.require(kind == "iid" or len(rest) >= 1, "partition", text, f"{kind} needs its number: {allowed}")
        try:
            value = None if not rest else int(rest[0]) if kind == "labels" else float(rest[0])
            seed = int(rest[1]) if len(rest) == 2 else 0
        except ValueError:
            raise errors.ConfigError(f"partition={text!r} (--partition) is invalid: {allowed}.") from None
        return cls(kind, value, seed)

    @classmethod
    def dirichlet(cls, alpha: float, seed: int = 0) -> Partition:
        """Label skew: each class split among the workers in Dirichlet(alpha) proportions."""
        return cls("dirichlet", alpha, seed)

    @classmethod
    def labels_per_worker(cls, k: int, seed: int = 0) -> Partition:
        """Every worker holds ``k`` classes."""
        return cls("labels", k, seed)

    @classmethod
    def unequal(cls, beta: float, seed: int = 0) -> Partition:
        """IID labels, shard sizes in Dirichlet(beta) proportions."""
        return cls("unequal", beta, seed)

    @property
    def iid(self) -> bool:
        """Whether the data is re-dealt into equal shards every epoch (no :class:`Assignment`)."""
        return self.kind == "iid"

    @property
    def alpha(self) -> float | None:
        """A Dirichlet partition's concentration."""
        return self.value if self.kind == "dirichlet" else None

    def __str__(self) -> str:
        if self.iid:
            return "iid"
        value = repr(self.value).removesuffix(".0")  # the shortest text that reads back as the same float
        return f"{self.kind}:{value}" + (f":{self.seed}" if self.seed else "")

    def __repr__(self) -> str:
        return f"Partition({str(self)!r})"

    def assign(self, labels: Any, num_workers: int, batch_size: int) -> Assignment:
        """Draws the partition of ``labels`` (int, one per training example) among ``num_workers`` workers, each
        holding at least ``batch_size`` examples; the same arguments give the same assignment. Raises a
        :class:`~asgd_jax.errors.ConfigError` naming the partition when no draw fills every worker's minibatch."""
        errors.require(not self.iid, "partition", str(self), "an IID run deals its shards every epoch: no assignment")
        labels = np.asarray(labels)
        errors.require(
            labels.ndim == 1 and (np.issubdtype(labels.dtype, np.integer) or self.kind == "unequal"),
            "labels",
            f"array of shape {labels.shape} and dtype {labels.dtype}",
            f"a {self.kind} partition needs one integer class label per example (data['y'])",
        )
        rng = np.random.default_rng([self.seed, 0x9A27])
        draw = {"dirichlet": _dirichlet, "labels": _k_labels, "unequal": _unequal}[self.kind]
        lists = draw(rng, labels, num_workers, batch_size, self.value)
        smallest = min(len(x) for x in lists)
        if smallest < batch_size:
            raise errors.ConfigError(
                f"partition={str(self)!r} (--partition) leaves a worker {smallest} examples of {len(labels)} over "
                f"{num_workers} workers, fewer than batch_size={batch_size}: raise the partition's number, or lower "
                "the workers or the batch size."
            )
        sizes = np.array([len(x) for x in lists], np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
        members = np.zeros(len(labels), np.int32)  # one length for every partition of the data: one program
        members[: sizes.sum()] = np.concatenate(lists)
        return Assignment(members, offsets, sizes)


def assignment(partition: Partition, data: Any, num_workers: int, batch_size: int) -> Assignment | None:
    """The run's :class:`Assignment` of ``data`` (None for IID): what both engines read, drawn the same way."""
    if partition.iid:
        return None
    if partition.kind == "unequal":  # only the count matters
        leaves = jax.tree.leaves(data)
        errors.require(bool(leaves), "data", type(data).__name__, "a pytree of arrays with a leading example axis")
        labels = np.zeros(len(leaves[0]), np.int32)
    else:
        labels = labels_of(data)
    return partition.assign(labels, num_workers, batch_size)


def labels_of(data: Any, key: str = "y") -> np.ndarray:
    """The class labels a partition splits by: ``data[key]`` on the host (a :class:`ConfigError` without it)."""
    ok = isinstance(data, dict) and key in data
    errors.require(ok, "data", type(data).__name__, f"a non-IID partition needs the labels as data[{key!r}]")
    return np.asarray(jax.device_get(data[key]))


def batch_indices(words: jax.Array, assignment: Assignment, batch_size: int, worker: jax.Array, taken: jax.Array):
    """Example indices of worker ``worker``'s ``taken``-th minibatch under a fixed partition, ``[..., batch]`` for int
    arrays ``worker`` and ``taken`` of one shape: epoch ``taken // (size // batch_size)`` of the worker's own list,
    in that epoch's keyed order (:func:`asgd_jax.order.member_position`)."""
    members, offsets, sizes = (jnp.asarray(a) for a in assignment)
    per_epoch = sizes[worker] // batch_size
    epoch, k = taken // per_epoch, taken % per_epoch
    row = jnp.arange(batch_size, dtype=jnp.int32).reshape((1,) * jnp.ndim(taken) + (-1,))
    positions = (k * batch_size)[..., None] + row
    local = order.member_position(words, epoch, positions, worker, sizes)
    return members[offsets[worker][..., None] + local]


def _split(rng: np.random.Generator, indices: np.ndarray, shares: np.ndarray) -> list[np.ndarray]:
    """``indices`` shuffled and cut in ``shares`` proportions (their sum 1)."""
    indices = rng.permutation(indices)
    cuts = (np.cumsum(shares) * len(indices)).astype(int)[:-1]
    return np.split(indices, cuts)


def _dirichlet(rng, labels, m, batch_size, alpha) -> list[np.ndarray]:
    # NIID-Bench's draw, repeated until every worker fills a minibatch (or _TRIES draws).
    n, classes = len(labels), np.unique(labels)
    for _ in range(_TRIES):
        lists: list[list[np.ndarray]] = [[] for _ in range(m)]
        held = np.zeros(m)
        for c in classes:
            shares = rng.dirichlet(np.full(m, alpha)) * (held < n / m)
            shares = shares / shares.sum() if shares.sum() > 0 else np.full(m, 1.0 / m)
            for w, part in enumerate(_split(rng, np.flatnonzero(labels == c), shares)):
                lists[w].append(part)
                held[w] += len(part)
        if held.min() >= batch_size:
            break
    return [np.sort(np.concatenate(x)) for x in lists]


def _k_labels(rng, labels, m, batch_size, k) -> list[np.ndarray]:
    del batch_size
    classes = np.unique(labels)
    errors.require(
        k <= len(classes), "labels per worker", k, f"the data has {len(classes)} classes", "--partition labels:K"
    )
    holds = []
    for w in range(m):
        first = classes[w % len(classes)]
        others = rng.choice(np.setdiff1d(classes, [first]), size=k - 1, replace=False)
        holds.append([first, *others.tolist()])
    lists: list[list[np.ndarray]] = [[] for _ in range(m)]
    for c in classes:
        holders = [w for w in range(m) if c in holds[w]]
        if holders:
            parts = np.array_split(rng.permutation(np.flatnonzero(labels == c)), len(holders))
            for w, part in zip(holders, parts, strict=True):
                lists[w].append(part)
    return [np.sort(np.concatenate(x)) if x else np.zeros(0, np.int64) for x in lists]


def _unequal(rng, labels, m, batch_size, beta) -> list[np.ndarray]:
    n = len(labels)
    for _ in range(_TRIES):
        shares = rng.dirichlet(np.full(m, beta))
        if (shares * n).min() >= batch_size:
            break
    return [np.sort(x) for x in _split(rng, np.arange(n), shares)]
