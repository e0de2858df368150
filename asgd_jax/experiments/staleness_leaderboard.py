"""Staleness leaderboard: the mitigation methods since DC-ASGD under the same delays, each at its best learning rate.

Rules: ASGD; DC-ASGD-c and -a (Zheng et al. 2017); staleness-aware (Zhang et al. 2016: lr / tau); delay-adaptive (lr
min(1, M / tau), Mishchenko et al. 2022: plain ASGD unless a gradient is more than M updates stale); Gap-Aware (Barkai
et al. 2020); DANA-Zero (Hakimi et al. 2019: momentum per worker and a look-ahead pull); Delayed Nesterov (Liu et al.
2024: local-SGD workers, n_sync 4, pushing deltas); SSGD and sequential SGD (one worker) as references. Clusters of M
in {4, 16, 32} workers: uniform (exponential compute times), half the cluster at half speed, and a fixed delay
(constant compute times: every gradient is M - 1 updates stale, round robin). Each rule's learning rate (and DC-ASGD's
lambda_0) is tuned on a small grid in the same sweep; a cell shows the setting with the lowest final training error,
mean ± std over the seeds of its final test error and its virtual time to the target training error.

Command:   asgd-jax run staleness_leaderboard --quick --out results/staleness_leaderboard   (~37 minutes on 2 cores)
Full form: asgd-jax run staleness_leaderboard --out results/staleness_leaderboard_full      (CIFAR-10 ResNet-20, GPU)
Expected:  (quick form, measured) every rule falls behind sequential SGD (18% test error) as M grows, except DANA-Zero
           at M = 4, which ties it; from M = 16 on Gap-Aware and DC-ASGD-a lead (47-56% at M = 16-32 with uniform
           workers, ASGD 58-69%); DC-ASGD-c is ASGD within a std; a fixed delay is the hardest cluster (ASGD 84-89%
           at M = 16-32), where DANA-Zero fails and SSGD and Delayed Nesterov come within 2-3 points of the best.
"""

import dataclasses

from asgd_jax.experiments._dcasgd import variant
from asgd_jax.plan import Plan
from asgd_jax.studies import DCASGD_CIFAR10, Arm, Settings, Study, Variant

WORKERS = (4, 16, 32)


def clusters(m: int) -> dict[str, dict]:
    """The three clusters of ``m`` workers (``Workers`` arguments)."""
    return {
        "uniform": {},
        "half at half speed": {"speeds": (0.5,) * (m // 2) + (1.0,) * (m - m // 2)},
        "fixed delay": {"compute_time": "constant"},
    }


#: The learning-rate grid, as multiples of the settings' learning rate (the largest); DANA's momentum 0.9 takes a
#: fifth of it, SSGD's mean of M gradients twice it, Delayed Nesterov's outer rate on deltas is its own.
LR_GRID = (0.125, 0.25, 0.5, 1.0)
DN_OUTER = (0.5, 1.0, 2.0, 4.0)
LAM_C = (0.04, 0.2)
LAM_A = (1.0, 4.0)


def _lrs(s: Settings, scale: float = 1.0) -> list[float]:
    return [round(scale * f * s.learning_rate, 6) for f in LR_GRID]


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
        ("Gap-Aware", "gap_aware", 1.0),
        ("DANA-Zero", "dana", 0.2),
    ]:
        push += [Variant(label, rule=rule, lr=lr) for lr in _lrs(s, scale)]
    # Delayed Nesterov's grid is of the outer learning rate on the pushed deltas (1.0 adds their mean); the workers'
    # local steps use half the settings' learning rate.
    outer = tuple(Variant("Delayed Nesterov", rule="delayed_nesterov", lr=f) for f in DN_OUTER)
    plan = Plan(s.cluster(m, **kwargs))
    local_sgd = plan.replace(n_sync=4, push="delta", local_lr=0.5 * s.learning_rate)
    return [
        Arm(c, plan, variants=tuple(push)),
        Arm(c, local_sgd, variants=outer, rule_options={"buffer_size": m}),
        Arm(c, plan.replace(mode="sync"), variants=tuple(variant("SSGD", lr=lr) for lr in _lrs(s, 2.0))),
    ]


def arms(s: Settings, quick: bool) -> list[Arm]:
    out = [
        Arm(
            {"M": "—", "cluster": "—"},
            Plan(s.cluster(1)),
            variants=tuple(Variant("SGD (1 worker)", rule="sgd", lr=lr) for lr in _lrs(s, 2.0)),
            for_every={"M": s.workers, "cluster": tuple(clusters(1))},
        )
    ]
    for cluster in clusters(1):
        for m in s.workers:
            out += rule_arms(s, m, cluster, clusters(m)[cluster])
    return out


STUDY = Study(
    name="staleness_leaderboard",
    title="Staleness leaderboard: final test error at each rule's best learning rate",
    reproduces=__doc__,
    quick=Settings(
        dataset="mnist1d",
        model="cnn",
        model_options={"features": (8, 16), "hidden": 32},  # a third of the default's cost per example
        seeds=(0, 1, 2, 3, 4),
        epochs=6.0,
        learning_rate=0.4,
        evals=8,
        window=100,
        workers=WORKERS,
        target_error=0.6,
    ),
    full=dataclasses.replace(DCASGD_CIFAR10, workers=WORKERS, target_error=0.3),
    arms=arms,
    rows="label",
    columns="M",
    facet="cluster",
    tune=("lr", "lambda"),
    also=("time_to_target",),
    curves_x=(),
)
