"""Communication that costs time: the same rules on a cluster whose messages take longer than its gradients, against
free messages, with the push compressed, or computed while the last one uploads.

Every worker computes a minibatch in an exponential time of mean 1 and sends its push over a link of BANDWIDTH bytes
per time unit (the quick form's MLP, 23,050 float32 weights: 2 time units an upload, 2 a download of the fresh
weights; a bigger model's messages take longer). Rules: ASGD with free messages (the reference), ASGD on the links
(compute, upload and download one after the other), ASGD overlapped (``delays.Overlapped``: the next gradient is
computed while the push uploads), TopK ASGD (a sixteenth of the coordinates with their indices, an eighth of the
bytes, each worker's error feedback) and RandK ASGD (a sixteenth at random, scaled by 16), both on the links, and
SSGD on the links (a round: the slowest exchange). M in {4, 16}; each rule's learning rate tuned on a 4-point grid.
The headline table is the virtual time to the target training error within one virtual-time budget per column, the
same for every rule on the links (as in ``staleness_leaderboard``; free messages, a facet of their own, have theirs);
the second, the final test error at the equal number of epochs.

Command:   asgd-jax run communication_bound --quick --out results/communication_bound   (its time: the README)
Full form: asgd-jax run communication_bound --out results/communication_bound_full       (10 seeds, 30 epochs)
Expected:  on the links every rule needs several times the free-message time; overlapping compute and upload and
           compressing the push (1/8 of the bytes) both win most of it back, TopK better than RandK, whose 16x
           scaled coordinates are noisy; SSGD waits for its slowest exchange every round.
"""

from asgd_jax import delays
from asgd_jax.experiments._dcasgd import variant
from asgd_jax.experiments._tuned import lrs as _lrs
from asgd_jax.experiments._tuned import mnist1d, tuned
from asgd_jax.plan import Plan
from asgd_jax.studies import Arm, Settings, Study, Table, Tuning

WORKERS = (4, 16)
BANDWIDTH = 46_100.0
"""Bytes per time unit of every link: the quick form's MLP (92,200 bytes of weights) in 2 time units each way."""


def links(up_scale: float = 1.0) -> delays.Links:
    """Every worker's link: no latency, BANDWIDTH bytes a time unit, the push ``up_scale`` of the weights' size."""
    return delays.Links(latency=0.0, bandwidth=BANDWIDTH, up_scale=up_scale)


def cell_arms(s: Settings, m: int) -> list[Arm]:
    c, free = {"M": m, "messages": "on the links"}, {"M": m, "messages": "free"}
    on_links = Plan(s.cluster(m, links=links()))
    squeezed = Plan(s.cluster(m, links=links(up_scale=1 / 8)))  # a sixteenth of float32 values, 4-byte indices
    asgd = lambda label: tuple(variant(label, lr=lr) for lr in _lrs(s))
    return [
        Arm(free, Plan(s.cluster(m)), variants=asgd("ASGD")),
        Arm(c, on_links, variants=asgd("ASGD")),
        Arm(c, on_links.replace(delays=delays.Overlapped(on_links.delays)), variants=asgd("ASGD, overlapped")),
        Arm(c, squeezed, variants=tuned("TopK ASGD", "topk_asgd", s)),
        Arm(c, squeezed, variants=tuned("RandK ASGD", "randk_asgd", s, 0.25)),
        Arm(c, on_links.replace(mode="sync"), variants=tuple(variant("SSGD", lr=lr) for lr in _lrs(s, 4.0))),
    ]


def arms(s: Settings, quick: bool) -> list[Arm]:
    return [arm for m in s.workers for arm in cell_arms(s, m)]


STUDY = Study(
    name="communication_bound",
    title="Communication that costs time",
    reproduces=__doc__,
    quick=mnist1d(True, WORKERS, target_error=0.5),
    full=mnist1d(False, WORKERS),
    arms=arms,
    table=Table(
        "label", "M", facet="messages", metric="time_to_target", also=("test_error",), equal_time=True, curves_x=()
    ),
    tuning=Tuning(over=("lr",), widen=1),
)
