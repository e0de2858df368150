"""Staleness leaderboard: the mitigation methods since DC-ASGD and the optimal-time methods under the same delays,
each at its best learning rate, measured by the virtual time to a target training error.

Rules: ASGD; DC-ASGD-c and -a (Zheng et al. 2017); staleness-aware (Zhang et al. 2016: lr / tau); delay-adaptive (lr
min(1, M / tau), Mishchenko et al. 2022: plain ASGD unless a gradient is more than M updates stale) and Koloskova et
al.'s form (2022, Theorem 8, with c = 0: a gradient more than M stale is dropped); Gap-Aware (Barkai et al. 2020);
DANA-Zero (Hakimi et al. 2019: momentum per worker and a look-ahead pull); Delayed Nesterov (Liu et al. 2024:
local-SGD workers, n_sync 4, pushing deltas) and asynchronous DiLoCo (the same workers, each delta applied on arrival
with DiLoCo's outer Nesterov step: the baseline Delayed Nesterov repairs); the asynchronous adaptive server rules FADAS
(Wang et al. 2024: an AMSGrad step on every M pushes, delay-adaptive past tau_c = 1 server step) and CGAD (2026: Adam on
each push scaled by its age, its cutoff at 2M pushes and decay 1/M, the scale of M - 1, a push's typical staleness);
the optimal-time methods: Ringmaster ASGD with stops (Maranjyan et al.
2025, R = M/2), Rennala SGD with stops (Tyurin & Richtárik 2023, S = M/2), m-Synchronous SGD (Begunov & Tyurin 2026,
m = M/2); SSGD (minibatch SGD, m = M) and sequential SGD (one worker) as references. Clusters of M in {4, 16, 32}
workers: uniform (exponential compute times), half the cluster at half speed, a fixed delay (constant compute times:
every gradient is M - 1 updates stale, round robin) and fixed heterogeneous times 1 + sqrt(i) (the optimal-time
papers' cluster). Each rule's learning rate (and DC-ASGD's lambda_0) is tuned on a small grid in the same sweep; a
cell shows the setting with the lowest final training error. The headline table is the virtual time to the target
training error under one fixed virtual-time budget per column (M and cluster), the same for every rule: the time at
which the column's earliest-finishing run ended its budget of effective epochs ("—": not reached by then; every run
ran at least that long, and a rule that is slower per epoch gets no more time); the second, the final test error at
that equal number of epochs. A pick at the edge of its grid is marked with * in the picks table.

Command:   asgd-jax run staleness_leaderboard --quick --out results/staleness_leaderboard   (its time: the README)
Full form: asgd-jax run staleness_leaderboard --out results/staleness_leaderboard_full      (CIFAR-10 ResNet-20, GPU)
Expected:  see the README's results (measured); by the 2023-26 papers, the optimal-time methods should reach the
           target sooner than ASGD on the heterogeneous clusters as M grows.
"""

import dataclasses

from asgd_jax import delays
from asgd_jax.experiments._dcasgd import variant
from asgd_jax.experiments._tuned import LR_GRID, sequential_reference
from asgd_jax.experiments._tuned import lrs as _lrs
from asgd_jax.plan import Plan
from asgd_jax.studies import DCASGD_CIFAR10, Arm, Settings, Study, Table, Tuning, Variant

WORKERS = (4, 16, 32)


def clusters(m: int) -> dict[str, dict]:
    """The three clusters of ``m`` workers (``Workers`` arguments)."""
    return {
        "uniform": {},
        "half at half speed": {"speeds": (0.5,) * (m // 2) + (1.0,) * (m - m // 2)},
        "fixed delay": {"compute_time": "constant"},
        "1 + √i": {"compute_time": "constant", "speeds": tuple(float(v) for v in 1.0 / delays.sqrt_times(m))},
    }


#: The learning-rate grid is ``_tuned.LR_GRID``; DANA's momentum 0.9 takes a fifth of it, SSGD's mean of M gradients
#: twice it, Delayed Nesterov's outer rate on deltas is its own, asynchronous DiLoCo's the grid's factors times the
#: papers' 0.7 (Liu et al.'s asynchronous toy used a tenth of it), the Adam-type server rules' (FADAS, CGAD) a twentieth
#: of the grid (2.5e-3 to 2e-2 at the quick form's 0.4).
DN_OUTER = (0.5, 1.0, 2.0, 4.0)
DILOCO_OUTER = tuple(round(0.7 * f, 6) for f in LR_GRID)
ADAM_SCALE = 1 / 20
LAM_C = (0.04, 0.2)
LAM_A = (1.0, 4.0)


def rule_arms(s: Settings, m: int, cluster: str, kwargs: dict) -> list[Arm]:
    """Every rule's runs for one cell (M, cluster): the learning-rate (and lambda_0) grid in the variants. The
    asynchronous push rules share one program (the rule itself is traced); local SGD and SSGD exchange differently."""
    c = {"M": m, "cluster": cluster}
    push = [variant("ASGD", lr=lr) for lr in _lrs(s)]
    push += [variant("DC-ASGD-c", lam=lam, lr=lr, coords={"lambda": lam}) for lr in _lrs(s) for lam in LAM_C]
    push += [
        variant("DC-ASGD-a", lam=lam, adaptive=True, lr=lr, coords={"lambda": lam}) for lr in _lrs(s) for lam in LAM_A
    ]
    for label, rule, scale in [
        ("staleness-aware", "staleness_aware", 1.0),
        ("delay-adaptive", "delay_adaptive", 1.0),
        ("delay-threshold (Koloskova)", "delay_threshold", 1.0),
        ("Gap-Aware", "gap_aware", 1.0),
        ("DANA-Zero", "dana", 0.2),
    ]:
        push += [Variant(label, rule=rule, lr=lr) for lr in _lrs(s, scale)]
    # Delayed Nesterov's grid is of the outer learning rate on the pushed deltas (1.0 adds their mean); the workers'
    # local steps use half the settings' learning rate.
    outer = tuple(Variant("Delayed Nesterov", rule="delayed_nesterov", lr=f) for f in DN_OUTER)
    diloco = tuple(Variant("async DiLoCo", rule="diloco", lr=f) for f in DILOCO_OUTER)
    fadas = tuple(Variant("FADAS", rule="fadas", lr=lr) for lr in _lrs(s, ADAM_SCALE))
    cgad = tuple(Variant("CGAD", rule="cgad", lr=lr) for lr in _lrs(s, ADAM_SCALE))
    plan = Plan(s.cluster(m, **kwargs))
    local_sgd = plan.replace(n_sync=4, push="delta", local_lr=0.5 * s.learning_rate)
    # The optimal-time methods: what to use, ignore or stop is the cluster's (plain SGD at the server), with R, S and m
    # at half the cluster; the round methods average several gradients per update, so they take SSGD's grid.
    law, half = plan.delays, max(1, m // 2)
    sgd = lambda label, grid: tuple(Variant(label, rule="sgd", lr=lr) for lr in grid)
    return [
        Arm(c, plan, variants=tuple(push)),
        Arm(c, local_sgd, variants=outer, rule_options={"buffer_size": m}),
        Arm(c, local_sgd, variants=diloco),
        Arm(c, plan, variants=fadas, rule_options={"buffer_size": m, "delay_threshold": 1}),
        Arm(c, plan, variants=cgad, rule_options={"cutoff": 2 * m, "decay": 1 / m}),
        Arm(c, plan.replace(mode="sync"), variants=tuple(variant("SSGD", lr=lr) for lr in _lrs(s, 2.0))),
        Arm(c, Plan(delays.Ringmaster(law, half, stops=True)), variants=sgd("Ringmaster (stops)", _lrs(s))),
        Arm(c, Plan(delays.Rennala(law, half, stops=True)), variants=sgd("Rennala (stops)", _lrs(s, 2.0))),
        Arm(c, Plan(delays.MSync(law, half)), variants=sgd("m-Synchronous", _lrs(s, 2.0))),
    ]


def arms(s: Settings, quick: bool) -> list[Arm]:
    out = [sequential_reference(s, cluster=tuple(clusters(1)))]
    for cluster in clusters(1):
        for m in s.workers:
            out += rule_arms(s, m, cluster, clusters(m)[cluster])
    return out


STUDY = Study(
    name="staleness_leaderboard",
    title="Staleness leaderboard: time to the target training error at each rule's best learning rate",
    reproduces=__doc__,
    quick=Settings(
        dataset="mnist1d",
        model="cnn",
        model_options={"features": (8, 16), "hidden": 32},  # a third of the default's cost per example
        seeds=(0, 1),
        epochs=6.0,
        learning_rate=0.4,
        evals=8,
        window=100,
        workers=WORKERS,
        target_error=0.6,
    ),
    full=dataclasses.replace(DCASGD_CIFAR10, workers=WORKERS, target_error=0.3),
    arms=arms,
    table=Table(
        "label", "M", facet="cluster", metric="time_to_target", also=("test_error",), equal_time=True, curves_x=()
    ),
    tuning=Tuning(over=("lr", "lambda"), widen=1),  # widen: an edge pick runs once more, one grid step further out
)
