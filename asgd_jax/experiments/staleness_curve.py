"""How error grows with staleness, per rule: final error vs number of workers M in {1, 2, 4, 8, 16, 32} for ASGD,
DC-ASGD-a, staleness-aware SGD (lr / tau) and delay-adaptive SGD (lr * min(1, M / tau)); and vs a fixed delay tau.

Command:   asgd-jax run staleness_curve --quick --out results/staleness_curve     (~1.5 minutes on 2 CPU cores)
Full form: asgd-jax run staleness_curve --out results/staleness_curve_full        (all M and tau, 5 seeds, 40 epochs)
Expected:  ASGD degrades as M (and the mean staleness, about M - 1) grows; DC-ASGD-a degrades least at large M; the
           staleness-aware rule is robust but slow (its step shrinks with tau); delay-adaptive sits in between.
"""

from asgd_jax.delays import FixedDelay
from asgd_jax.experiments._dcasgd import variant
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Study, Table, Variant

DC = (variant("ASGD"), variant("DC-ASGD-a", lam=2.0, adaptive=True))


def arms(s: Settings, quick: bool) -> list[Arm]:
    workers = (1, 4, 16, 32) if quick else (1, 2, 4, 8, 16, 32)
    taus = (0, 4, 16) if quick else (0, 1, 2, 4, 8, 16, 32)
    out = []
    for m in workers:
        plan = Plan(s.cluster(m))
        out.append(Arm({"M": m}, plan, variants=DC))
        out.append(Arm({"M": m}, plan, variants=(Variant("staleness-aware", rule="staleness_aware"),)))
        out.append(Arm({"M": m}, plan, variants=(Variant("delay-adaptive", rule="delay_adaptive"),)))
    for tau in taus:  # the same rules under a deterministic delay (M = tau + 1 round-robin workers)
        out.append(Arm({"M": tau + 1, "tau": tau}, Plan(FixedDelay(tau)), variants=DC, series="{label}, fixed delay"))
    return out


STUDY = Study(
    name="staleness_curve",
    title="Final test error vs workers M (and fixed delay tau = M - 1)",
    reproduces=__doc__,
    quick=Settings(seeds=(0, 1), epochs=10.0),
    full=Settings(seeds=(0, 1, 2, 3, 4), epochs=40.0, evals=20),
    arms=arms,
    table=Table(rows="M"),
)
