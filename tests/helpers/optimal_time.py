"""Float64 NumPy event loops of the optimal-time methods, written from the papers' algorithms (Ringmaster ASGD,
Maranjyan et al. 2025, Alg. 1 and its stopping variant; Rennala SGD, Tyurin & Richtárik 2023, Alg. 3-4, with the
2026 group code's stop semantics; m-Synchronous SGD, Begunov & Tyurin 2026), on the noisy least-squares problem with
fixed per-worker times. Nothing of the simulator is used but the documented minibatch order (``BatchOrder``): a
gradient a method ignores used its minibatch, a stopped computation did not (it restarts on the same one)."""

import heapq

import numpy as np

from helpers.problems import W1, BatchOrder


def _grad(w, batch):
    x, y = batch
    return x.T @ (x @ w - y) / len(y)


class _Workers:
    """Each worker's computation in progress: when it ends, the version it is computed at, its minibatch."""

    def __init__(self, times):
        self.times = np.asarray(times, np.float64)
        self.queue = [(t, i) for i, t in enumerate(self.times)]  # (finish, worker): ties go to the lower id
        heapq.heapify(self.queue)
        self.start = np.zeros(len(times), np.int64)
        self.began = np.zeros(len(times))
        self.busy = self.wasted = 0.0

    def arrive(self):
        now, i = heapq.heappop(self.queue)
        self.busy += now - self.began[i]
        return now, i

    def begin(self, i, now, version):
        self.start[i], self.began[i] = version, now
        heapq.heappush(self.queue, (now + self.times[i], i))

    def stop(self, which, now, version):
        """Stops the computations of ``which`` at ``now`` and begins them again at ``version``."""
        which = set(int(i) for i in which)
        for i in which:
            spent = now - self.began[i]
            self.busy += spent
            self.wasted += spent
        self.queue = [(f, i) for f, i in self.queue if i not in which]
        heapq.heapify(self.queue)
        for i in sorted(which):
            self.begin(i, now, version)


def ringmaster(times, threshold, lr, num_updates, stops=False, key=0):
    """Ringmaster ASGD: apply a gradient whose delay (applied updates since its worker began it) is below R, else
    ignore it; either way the worker begins again at the current weights. With stops, after every update a worker
    whose computation has become R stale is stopped and restarted at the current weights."""
    m = len(times)
    order, workers = BatchOrder(key, m), _Workers(times)
    history = [W1.astype(np.float64)]  # x^0, x^1, ...: the weights of every version
    out = {"time": [], "staleness": [], "worker": [], "busy": [], "wasted": []}
    while len(history) - 1 < num_updates:
        now, i = workers.arrive()
        k = len(history) - 1
        delay = k - workers.start[i]
        g = _grad(history[workers.start[i]], order.next(i))
        if delay < threshold:
            history.append(history[-1] - lr * g)
            for name, value in zip(out, (now, delay, i, workers.busy, workers.wasted), strict=True):
                out[name].append(value)
        else:
            workers.wasted += now - workers.began[i]
        workers.begin(i, now, len(history) - 1)
        if stops and delay < threshold:
            k = len(history) - 1
            stale = [j for j in range(m) if k - workers.start[j] >= threshold]
            workers.stop(stale, now, k)
            out["busy"][-1], out["wasted"][-1] = workers.busy, workers.wasted
    return history[-1], {k: np.asarray(v) for k, v in out.items()}, order.taken


def rennala(times, batch, lr, num_updates, stops=False, key=0):
    """Rennala SGD: collect gradients computed at the current x^k (a worker may give several) until S have arrived,
    then one step with their mean (in arrival order); a gradient computed at an older iterate is ignored and its
    worker begins again at x^k. A worker always begins at the newest iterate: the one whose gradient closes the round
    begins at x^{k+1}. With stops, every other worker restarts at x^{k+1} after each step."""
    m = len(times)
    order, workers = BatchOrder(key, m), _Workers(times)
    w = W1.astype(np.float64)
    out = {"time": [], "busy": [], "wasted": []}
    for k in range(num_updates):
        used, now = [], 0.0
        while len(used) < batch:
            now, i = workers.arrive()
            g = _grad(w, order.next(i))  # an ignored gradient's value is never used: only its minibatch
            if workers.start[i] == k:
                used.append(g)
            else:
                workers.wasted += now - workers.began[i]
            workers.begin(i, now, k + 1 if len(used) == batch else k)
        w = w - lr * np.mean(used, axis=0)
        if stops:
            workers.stop([j for j in range(m) if workers.start[j] == k], now, k + 1)
        for name, value in zip(out, (now, workers.busy, workers.wasted), strict=True):
            out[name].append(value)
    return w, {k: np.asarray(v) for k, v in out.items()}, order.taken


def m_synchronous(times, m, lr, num_updates, key=0):
    """m-Synchronous SGD: every round all workers begin at x^k; the first m to finish (ties to the lower id) give one
    gradient each, averaged into one step; the others are stopped (their minibatches unused)."""
    order = BatchOrder(key, len(times))
    w, clock = W1.astype(np.float64), 0.0
    first = sorted(sorted(range(len(times)), key=lambda i: (times[i], i))[:m])
    took = max(times[i] for i in first)
    out = {"time": []}
    for _ in range(num_updates):
        w = w - lr * np.mean([_grad(w, order.next(i)) for i in first], axis=0)
        clock += took
        out["time"].append(clock)
    return w, {k: np.asarray(v) for k, v in out.items()}, order.taken


def rennala_round_time(times, batch):
    """T_S = min{t : sum_i floor(t / tau_i) >= S}: the first time S gradients can have arrived when every worker
    starts at 0 (a multiple of some tau_i)."""
    candidates = sorted(k * t for t in times for k in range(1, batch + 1))
    return next(c for c in candidates if sum(int(np.floor(c / t + 1e-12)) for t in times) >= batch)


def ringmaster_bound(times, threshold):
    """Lemma 4.1's bound on R consecutive Ringmaster updates (with stops): 2 min_m H_m (1 + R / m)."""
    times = np.sort(np.asarray(times, np.float64))
    harmonic = np.arange(1, len(times) + 1) / np.cumsum(1.0 / times)
    return float(np.min(2 * harmonic * (1 + threshold / np.arange(1, len(times) + 1))))
