"""An independent float64 NumPy reference of the DC-ASGD parameter server (Zheng et al. 2017, Algorithm 2).

Written from the paper, sharing no code with asgd_jax: plain loops over a list of events, dicts of NumPy arrays.
The problem is least squares, ``f_b(w) = 0.5 * mean((A_b w - y_b)^2)`` over fixed minibatches ``b``, whose gradient
``A_b^T (A_b w - y_b) / n`` needs no autodiff.
"""

from __future__ import annotations

import numpy as np


def lsq_grad(w: np.ndarray, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    return a.T @ (a @ w - y) / len(y)


class ReferenceServer:
    """The server of Algorithm 2 with backups per worker.

    Args:
      w0: initial weights.
      num_workers: M.
      lr: eta.
      lam: lambda_0; ``None`` runs plain ASGD.
      adaptive: DC-ASGD-a.
      m: MeanSquare momentum.
      eps: DC-ASGD-a epsilon.
      per_worker_ms: keep MeanSquare per worker (the authors' code) instead of globally (the paper).
    """

    def __init__(self, w0, num_workers, lr, lam=None, adaptive=False, m=0.95, eps=1e-7, per_worker_ms=False):
        self.w = np.array(w0, np.float64)
        self.backup = [self.w.copy() for _ in range(num_workers)]  # w_bak(m) = w_0, copies
        self.backup_version = [0] * num_workers
        self.t = 0
        self.lr, self.lam, self.adaptive, self.m, self.eps = lr, lam, adaptive, m, eps
        self.per_worker_ms = per_worker_ms
        self.ms = [np.zeros_like(self.w) for _ in range(num_workers)] if per_worker_ms else np.zeros_like(self.w)
        self.staleness: list[int] = []

    def pull(self, worker: int) -> np.ndarray:
        self.backup[worker] = self.w.copy()
        self.backup_version[worker] = self.t
        return self.backup[worker]

    def push(self, worker: int, g: np.ndarray) -> None:
        self.staleness.append(self.t - self.backup_version[worker])
        g = np.asarray(g, np.float64)
        if self.lam is None:
            step = g
        else:
            lam_t = self.lam
            if self.adaptive:
                if self.per_worker_ms:
                    self.ms[worker] = self.m * self.ms[worker] + (1 - self.m) * g * g
                    ms = self.ms[worker]
                else:
                    self.ms = self.m * self.ms + (1 - self.m) * g * g
                    ms = self.ms
                lam_t = self.lam / np.sqrt(ms + self.eps)
            step = g + lam_t * g * g * (self.w - self.backup[worker])
        self.w = self.w - self.lr * step
        self.t += 1


def run_trace(server: ReferenceServer, order, batch_for) -> np.ndarray:
    """Replays pushes in ``order``: worker m computes at its backup on ``batch_for(m, t)``, pushes, then pulls."""
    for t, worker in enumerate(order):
        a, y = batch_for(worker, t)
        server.push(worker, lsq_grad(server.backup[worker], a, y))
        server.pull(worker)
    return server.w
