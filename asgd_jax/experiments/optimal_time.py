"""Optimal time under heterogeneous workers: the virtual time each method needs to reach a target gradient norm, as
the cluster grows.

The worst-case quadratic of the optimal-time line of work (Tyurin & Richtárik 2023; Maranjyan, Tyurin & Richtárik
2025; Begunov & Tyurin 2026): f(x) = 1/2 x^T A x - b^T x, A = (L/4) tridiag(-1, 2, -1), b = (L/4)(-1, 0, ..., 0),
x0 = sqrt(d) e1, L = 1, with additive gradient noise (one N(0, s^2) scalar added to every coordinate, drawn per
example). M workers take 1 + sqrt(i) per gradient (i = 1..M) plus half-normal noise (a fifth of that time, a new draw
per gradient). Methods: ASGD, delay-adaptive ASGD in both published forms (Mishchenko et al. 2022; Koloskova et al.
2022 with c = 1/(4L)), Ringmaster ASGD with and without stops (R tuned), Rennala SGD with and without stops (S tuned),
m-Synchronous SGD (m tuned) and minibatch SGD (m = M). Every method's step size is tuned on the same grid; a cell shows
the setting with the lowest mean virtual time to ||grad f||^2 <= target within the time budget, at the point each used
gradient was computed (the server's weights for the round methods).

Command:   asgd-jax run optimal_time --quick --out results/optimal_time
Full form: asgd-jax run optimal_time --out results/optimal_time_full   (more seeds, a wider budget)
Expected:  (the papers' prediction) Ringmaster and Rennala flatten as M grows, near the optimal-time curve
           min_m H_m (1 + s^2 / (m eps)) (up to a constant); ASGD and minibatch SGD degrade (ASGD's delays grow with
           the slow workers, minibatch SGD waits for the slowest); see the README for what was measured.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from asgd_jax import delays
from asgd_jax.loss import Loss
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Paper, Problem, Settings, Study, Table, Tuning, Variant

DIM = 32
NOISE = 1.0  # the gradient noise's scale per coordinate: s^2 = DIM * NOISE^2 in the bound
EXAMPLES = 8192  # noise draws: eight per worker's shard at M = 1,024
ASYNC_LRS = (0.001, 0.003, 0.01, 0.03, 0.1)  # one gradient per update
ROUND_LRS = (0.03, 0.1, 0.3, 1.0, 1.5)  # a mean of S or m gradients per update (GD is stable below 2 / L)
THRESHOLDS = (4, 16, 64, 256)  # Ringmaster's R
BATCHES = (4, 16, 64, 256)  # Rennala's S (a fast worker may give several)
FRACTIONS = (16, 4)  # m-Synchronous: m = M / 16, M / 4 (m = M is minibatch SGD)


def quadratic(s: Settings) -> Problem:
    """The quadratic, its noise draws and x0; the training measure (aux ``error``) and the evaluation are
    ||grad f(x)||^2 without noise."""
    a = 0.25 * (2 * np.eye(DIM) - np.eye(DIM, k=1) - np.eye(DIM, k=-1))
    b = np.zeros(DIM)
    b[0] = -0.25
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    x0 = np.zeros(DIM, np.float32)
    x0[0] = math.sqrt(DIM)
    xi = NOISE * np.random.default_rng(s.init_seed).normal(size=EXAMPLES).astype(np.float32)
    return Problem(Loss(_Loss(a, b), has_aux=True), _Measure(a, b), jnp.asarray(x0), {"xi": xi})


@dataclasses.dataclass(frozen=True, eq=False)
class _Measure:
    """||grad f(x)||^2 at the server's weights (the evaluation)."""

    a: object
    b: object

    def __call__(self, x, model_state=None):
        g = self.a @ x - self.b
        return {"error": g @ g}


@dataclasses.dataclass(frozen=True, eq=False)
class _Loss:
    """f(x) + mean(xi) * sum(x): its gradient is grad f(x) + xi * 1; aux: ||grad f(x)||^2."""

    a: object
    b: object

    def __call__(self, x, batch):
        g = self.a @ x - self.b
        f = 0.5 * x @ (self.a @ x) - self.b @ x
        return f + jnp.mean(batch["xi"]) * jnp.sum(x), {"error": g @ g}


def law(m: int) -> delays.Workers:
    """M workers taking 1 + sqrt(i) per gradient, plus half-normal noise of a fifth of that."""
    times = delays.sqrt_times(m)
    return delays.Workers.with_times(times, noise=0.2 * times)


def updates_within(s: Settings, m: int, payloads: int) -> int:
    """Enough updates to reach the time budget: no cluster of these times applies more than sum_i 1/tau_i gradients
    per unit of time, ``payloads`` per update (the plan's ``time_budget`` ends a run at the first evaluation past the
    budget, usually long before: Ringmaster and Rennala ignore many gradients)."""
    return math.ceil(s.time_budget * float(np.sum(1.0 / delays.sqrt_times(m))) / payloads)


def optimal_time(s: Settings, rows: list) -> tuple[str, dict]:
    """min_m H_m (1 + s^2 / (m eps)) per M (fixed times 1 + sqrt(i)), the optimal time up to a constant."""
    sigma2 = DIM * NOISE**2
    out = {}
    for m_total in rows:
        times = delays.sqrt_times(m_total)
        ms = np.arange(1, m_total + 1)
        harmonic = ms / np.cumsum(1.0 / times)
        out[m_total] = float(np.min(harmonic * (1 + sigma2 / (ms * s.target_error))))
    return "min_m H_m (1 + s²/(m ε))", out


def arms(s: Settings, quick: bool) -> list[Arm]:
    del quick

    def lrs(label: str, rule: str = "sgd", grid: tuple[float, ...] = ASYNC_LRS) -> tuple[Variant, ...]:
        return tuple(Variant(label, rule=rule, lr=lr) for lr in grid)

    out = []
    for m in s.workers:
        cluster, c = law(m), {"M": m}
        async_updates = updates_within(s, m, 1)
        mixed = lrs("ASGD") + lrs("Delay-adaptive (Mishchenko)", "delay_adaptive")
        out += [
            Arm(c, Plan(cluster, time_budget=s.time_budget), variants=mixed, num_updates=async_updates),
            Arm(
                c,
                Plan(cluster, time_budget=s.time_budget),
                variants=lrs("Delay-adaptive (Koloskova)", "delay_threshold"),
                rule_options={"max_step": 0.25},  # 1 / (4 L)
                num_updates=async_updates,
            ),
        ]
        for r in THRESHOLDS:
            for stops in (False, True):
                label = "Ringmaster (stops)" if stops else "Ringmaster"
                plan = Plan(delays.Ringmaster(cluster, r, stops=stops), time_budget=s.time_budget)
                out.append(Arm({**c, "R": r}, plan, variants=lrs(label), num_updates=async_updates))
        for size in BATCHES:
            for stops in (False, True):
                label = "Rennala (stops)" if stops else "Rennala"
                plan = Plan(delays.Rennala(cluster, size, stops=stops), time_budget=s.time_budget)
                variants, budget = lrs(label, grid=ROUND_LRS), updates_within(s, m, size)
                out.append(Arm({**c, "S": size}, plan, variants=variants, num_updates=budget))
        for k in sorted({*(max(1, m // f) for f in FRACTIONS), m}):
            label = "Minibatch SGD" if k == m else "m-Synchronous"
            plan = Plan(delays.MSync(cluster, k), time_budget=s.time_budget)
            variants, budget = lrs(label, grid=ROUND_LRS), updates_within(s, m, k)
            out.append(Arm({**c, "m": k}, plan, variants=variants, num_updates=budget))
    return out


QUICK = Settings(
    seeds=(0, 1, 2),
    learning_rate=1.0,
    schedule="constant",
    batch_size=1,
    evals=40,
    window=1,
    workers=(16, 64, 256, 1024),
    target_error=1e-3,
    time_budget=1500.0,
)

STUDY = Study(
    name="optimal_time",
    title="Optimal time: time to ||∇f||² ≤ ε vs workers (1 + √i)",
    reproduces=__doc__,
    quick=QUICK,
    full=dataclasses.replace(QUICK, seeds=tuple(range(8)), workers=(16, 64, 256, 1024, 4096), time_budget=3000.0),
    arms=arms,
    problem=quadratic,
    measure="‖∇f‖²",
    table=Table(rows="M", metric="time_to_target", curves_x=("time",)),
    tuning=Tuning(over=("lr", "R", "S", "m"), by="time_to_target"),
    paper=Paper(prediction=optimal_time),
)
