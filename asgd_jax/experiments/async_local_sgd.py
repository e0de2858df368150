"""Asynchronous local SGD for language modelling (Liu et al. 2024, Tables 1 and 2, scaled down): synchronous DiLoCo,
asynchronous DiLoCo and Delayed Nesterov on the offline grammar task, final test perplexity per character.

Every worker takes H = 8 local steps of its own AdamW (optax's, learning rate 0.01, its state kept across the
worker's exchanges: ``Plan(inner="adamw")``) from the weights it pulled (batch 16), then pushes the delta. DiLoCo
(synchronous): a round of every worker's delta, their mean, an outer Nesterov step (learning rate 0.7, momentum 0.9:
the paper's). Asynchronous DiLoCo: the same outer step on every delta as it arrives, at 0.7 and
at a tenth of it (0.07, the rate of Liu et al.'s asynchronous toy). Delayed Nesterov (outer 0.7, momentum 0.9): plain
steps of lr/N on every delta, the momentum step every N deltas, N = M (the paper's) and N = 2M (the 2026
reproduction's best was N = 8 at M = 4). Speeds: uniform (every worker an exponential time of mean 1 per minibatch)
and heterogeneous (fixed times 1 + sqrt(i)). Every run sees the same number of examples (the settings' epochs); a
diverged run's perplexity is NaN, its cell "—".

Delayed Nesterov with N = 2M again with DyLU (``Workers(dylu=True)``): worker w runs ``floor(v_w / max v * H)`` of
the H steps, v its speed, so that slow workers push as often as fast ones (on uniform speeds it changes nothing).

Not the papers' setting, and what that leaves out: H is 8 (the papers': 50), and the model is a 32-wide one-block
transformer on 64-character windows of a probabilistic grammar, not a 20M model on C4; AdamW's constants are optax's
defaults. With DyLU a slow worker's push holds fewer examples: at an equal number of updates its runs see fewer.

Command:   asgd-jax run async_local_sgd --quick --out results/async_local_sgd   (its time: the README)
Full form: asgd-jax run async_local_sgd --out results/async_local_sgd_full      (M 4/8/16, 5 seeds, a 64-wide
           two-block transformer, 6 epochs)
Expected:  (Liu et al.) asynchronous DiLoCo worst (44.27 against DiLoCo's 41.35 at M = 4), Delayed Nesterov with
           DyLU at or below synchronous DiLoCo (41.13); the 2026 reproduction: asynchronous DiLoCo diverging from
           scratch, Delayed Nesterov's best buffer N = 8 at M = 4.
"""

from asgd_jax import delays
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Study, Table, Variant

H, LOCAL_LR, OUTER_LR = 8, 0.01, 0.7


def clusters(m: int) -> dict[str, dict]:
    """The speeds: uniform (exponential times of mean 1) and heterogeneous (fixed times 1 + sqrt(i))."""
    return {
        "uniform": {},
        "heterogeneous": {"compute_time": "constant", "speeds": tuple(float(v) for v in 1.0 / delays.sqrt_times(m))},
    }


def cell_arms(s: Settings, m: int, speeds: str) -> list[Arm]:
    c = {"M": m, "speeds": speeds}
    local = Plan(s.cluster(m, **clusters(m)[speeds]), n_sync=H, push="delta", local_lr=LOCAL_LR, inner="adamw")
    diloco = lambda label, lr: Variant(label, rule="diloco", lr=lr)
    dylu = local.replace(delays=s.cluster(m, **clusters(m)[speeds], dylu=True))
    nesterov = lambda n, plan=local, more="": Arm(
        c,
        plan,
        variants=(
            Variant(f"Delayed Nesterov (N = {'M' if n == m else '2M'}){more}", rule="delayed_nesterov", lr=OUTER_LR),
        ),
        rule_options={"buffer_size": n},
    )
    return [
        Arm(c, local.replace(mode="sync"), variants=(diloco("DiLoCo (synchronous)", OUTER_LR),)),
        Arm(c, local, variants=(diloco("async DiLoCo", OUTER_LR), diloco("async DiLoCo (lr / 10)", OUTER_LR / 10))),
        nesterov(m),
        nesterov(2 * m),
        nesterov(2 * m, dylu, " + DyLU"),
    ]


def arms(s: Settings, quick: bool) -> list[Arm]:
    # By M first: a run stopped early (a GPU's time ran out) holds both speeds of its smaller clusters.
    return [arm for m in s.workers for speeds in clusters(1) for arm in cell_arms(s, m, speeds)]


def settings(quick: bool) -> Settings:
    """The quick form (a 32-wide one-block transformer, M 4 and 8, 3 epochs) or the full (64-wide, two blocks, M 4,
    8 and 16, 6 epochs); 5 seeds, batch 16 per worker, the outer learning rate 0.7 constant."""
    size = (32, 1, 2) if quick else (64, 2, 4)
    return Settings(
        dataset="grammar",
        model="transformer",
        model_options=dict(zip(("width", "depth", "heads"), size, strict=True)),
        batch_size=16,
        learning_rate=OUTER_LR,
        schedule="constant",
        seeds=(0, 1, 2, 3, 4),
        epochs=3.0 if quick else 6.0,
        evals=4 if quick else 10,
        window=50 if quick else 100,
        workers=(4, 8) if quick else (4, 8, 16),
    )


STUDY = Study(
    name="async_local_sgd",
    title="Asynchronous local SGD for language modelling: final test perplexity per character",
    reproduces=__doc__,
    quick=settings(True),
    full=settings(False),
    arms=arms,
    table=Table("label", "M", facet="speeds", metric="perplexity", also=("test_error",), curves_x=("epoch",)),
)
