"""The Ray backend against the threaded one, same model, same machine: updates per second and store overhead.

The model and data are those of ``trainer_overhead.py`` (an MLP 40-1024-1024-10 on mnist1d, batch 256 per worker,
DC-ASGD-a). Both backends run 2 workers (this machine has 2 cores) for the same number of updates after their own
warm-up; the configurations alternate over the repeats and medians are reported. Ray runs a local instance
(``ray.init(num_cpus=2)``): worker actors are processes, pushes and weights travel through Ray's object store.

    .venv/bin/python experiments/benchmarks/ray_vs_threads.py            # ~2.5 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/ray_vs_threads.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(__file__))

import jax
import ray
from trainer_overhead import make_problem

import asgd_jax
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train


def run(backend, loss, params, data, steps, workers=2):
    config = TrainConfig(Plan(workers, num_updates=steps, batch_size=256), seed=0, backend=backend, progress=False)
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, num_workers=workers)
    result = train(loss, rule, params, data, config, devices=jax.devices()[:workers])
    assert result.pushes_applied == steps and not result.failures
    overhead = statistics.mean(w.overhead for w in result.workers if w.pushes)
    return steps / result.seconds, overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps, repeats = (60, 2) if args.quick else (200, 3)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    loss, params, data = make_problem()
    samples = {"threads": [], "ray": []}
    for _ in range(repeats):
        for backend in samples:
            samples[backend].append(run(backend, loss, params, data, steps))
    med = {k: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v)) for k, v in samples.items()}
    print(
        f"2 workers, {steps} updates per run, {repeats} repeats (medians); Ray {ray.__version__}, jax {jax.__version__}"
    )
    print("\n| backend | updates/s | worker time outside compute |\n|---|---|---|")
    for k, (ups, overhead) in med.items():
        print(f"| {k} | {ups:.1f} | {100 * overhead:.1f}% |")
    print(f"\nray / threads updates per second: {med['ray'][0] / med['threads'][0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
