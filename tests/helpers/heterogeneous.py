"""Independent float64 NumPy references of the heterogeneous-data rules, written from their papers and the authors'
event loops, sharing no code with asgd_jax: per-worker lists of gradients, plain Python control flow.

Each reference takes arrivals one at a time (``arrive(worker, g)``) and returns the step it makes (None: no update),
and records, for every update, the largest delay (updates made since the weights a used gradient was computed at)
under plain asynchronous pulls: a worker computes at the weights it was sent after its previous arrival.
"""

from __future__ import annotations

import numpy as np


class RingleaderRef:
    """Ringleader ASGD (Maranjyan & Richtárik, ICLR 2026): phase 1 collects until every worker has a gradient in the
    current table; phase 2 makes n updates, the first at once, then one on each other worker's first arrival; arrivals
    of workers that already updated go to the next table, current once the n-th update is made."""

    def __init__(self, n: int):
        self.n = n
        self.current: dict[int, list] = {}  # worker -> [(g, version computed at)]
        self.next: dict[int, list] = {}
        self.phase, self.waiting = 1, set()
        self.updates, self.cycles, self.per_cycle = 0, 0, []
        self.pulled = dict.fromkeys(range(n), 0)  # the version each worker computes at
        self.delays: list[int] = []

    def _step(self) -> np.ndarray:
        means = [np.mean([g for g, _ in self.current[i]], axis=0) for i in range(self.n)]
        oldest = min(v for i in range(self.n) for _, v in self.current[i])
        self.delays.append(self.updates - oldest)
        self.updates += 1
        return np.mean(means, axis=0)

    def arrive(self, worker: int, g: np.ndarray):
        item, step = (np.asarray(g, np.float64), self.pulled[worker]), None
        if self.phase == 1:
            self.current.setdefault(worker, []).append(item)
            if len(self.current) == self.n:
                step, self.phase, self.waiting, self.made = self._step(), 2, set(range(self.n)) - {worker}, 1
        elif worker in self.waiting:
            self.current.setdefault(worker, []).append(item)
            step = self._step()
            self.waiting.discard(worker)
            self.made += 1
        else:
            self.next.setdefault(worker, []).append(item)
        if self.phase == 2 and not self.waiting:  # the cycle's n-th update: the next table becomes current
            self.per_cycle.append(self.made)
            self.current, self.next, self.phase = self.next, {}, 1
            self.cycles += 1
        self.pulled[worker] = self.updates
        return step


class MaleniaRef:
    """Malenia SGD (Tyurin & Richtárik, NeurIPS 2023), the round closing at the arrival that completes every worker:
    the step is the mean over workers of each worker's mean gradient of the round."""

    def __init__(self, n: int):
        self.n, self.round, self.updates = n, {}, 0

    def arrive(self, worker: int, g: np.ndarray):
        self.round.setdefault(worker, []).append(np.asarray(g, np.float64))
        if len(self.round) < self.n:
            return None
        step = np.mean([np.mean(self.round[i], axis=0) for i in range(self.n)], axis=0)
        self.round, self.updates = {}, self.updates + 1
        return step
