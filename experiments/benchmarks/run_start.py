"""What a trainer run's start compiles, on a cold cache: the rule's probe both ways, and the programs by call site.

A run's start fingerprints its rule for the checkpoint header (:func:`asgd_jax.rules.fingerprint`): two updates of a
probe shaped like the model. Each measurement runs in a fresh process with the persistent cache off (what a first run
on a new machine meets), side by side in one invocation:

- the probe an operation at a time (``eager=True``, what every run's start did before 2026-12-05 and what a checkpoint
  of then holds) against the compiled probe (one program per rule structure and shapes), at the ``cnn``'s and
  ResNet-20's sizes: seconds, programs compiled, and their ratio;
- a whole ``asgd-jax train --dataset digits --model cnn --workers 2 --steps 200``: its wall time and XLA's
  compilations grouped by the asgd_jax call site that asked for them.

    .venv/bin/python experiments/benchmarks/run_start.py              # ~1 minute on 2 cores
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

COMPILE = "/jax/core/compile/backend_compile_duration"
MODELS = {"cnn": (8, 8, 1), "resnet20": (32, 32, 3)}


def listen() -> collections.Counter:
    """XLA's compilations from now on, by the innermost asgd_jax frame that asked: ``site -> [seconds, count]``."""
    import jax

    sites: dict = collections.defaultdict(lambda: [0.0, 0])

    def one(event, duration, **kwargs):
        if event == COMPILE:
            frames = [f for f in traceback.extract_stack() if f"{os.sep}asgd_jax{os.sep}" in f.filename]
            site = f"{frames[-1].filename.split(os.sep + 'asgd_jax' + os.sep)[-1]}:{frames[-1].name}" if frames else "-"
            sites[site][0] += duration
            sites[site][1] += 1

    jax.monitoring.register_event_duration_secs_listener(one)
    return sites


def probe(model_name: str, eager: bool) -> dict:
    import jax

    import asgd_jax

    model = asgd_jax.models.get(model_name, num_classes=10, input_shape=MODELS[model_name])
    params = model.init(jax.random.key(0))[0]
    rule = asgd_jax.rules.get("dc_asgd_a", 0.1)
    sites = listen()
    t0 = time.perf_counter()
    asgd_jax.rules.fingerprint(rule, params, eager=eager)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "programs": sum(n for _, n in sites.values())}


def train() -> dict:
    from asgd_jax.cli import main

    sites = listen()
    with tempfile.TemporaryDirectory() as out:
        argv = ["train", "--dataset", "digits", "--model", "cnn", "--workers", "2", "--steps", "200"]
        t0 = time.perf_counter()
        assert main([*argv, "--out", out, "--no-progress"]) == 0
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "sites": {k: v for k, v in sites.items()}}


def fresh(*args: str) -> dict:
    """One measurement in a fresh process, the persistent cache off."""
    env = dict(os.environ, ASGD_JAX_CACHE_DIR="off")
    done = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        what = sys.argv[2]
        print(json.dumps(train() if what == "train" else probe(what, sys.argv[3] == "eager")))
        return
    print("the rule's probe (DC-ASGD-a), a fresh process each, cache off\n")
    print("| model | an operation at a time | compiled | ÷ |\n|---|---|---|---|")
    for name in MODELS:
        eager, compiled = fresh(name, "eager"), fresh(name, "compiled")
        programs = lambda r: f"{r['programs']} program{'s' if r['programs'] != 1 else ''}"
        print(
            f"| {name} | {eager['seconds']:.2f} s, {programs(eager)} | {compiled['seconds']:.2f} s, "
            f"{programs(compiled)} | {compiled['seconds'] / eager['seconds']:.2f} |"
        )
    run = fresh("train")
    sites = sorted(run["sites"].items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in run["sites"].values())
    count = sum(n for _, n in run["sites"].values())
    print(
        f"\nasgd-jax train --model cnn --workers 2 --steps 200, cold: {run['seconds']:.1f} s wall, XLA {total:.2f} s in"
    )
    print(f"{count} compilations\n\n| call site | XLA s | programs |\n|---|---|---|")
    for site, (seconds, n) in sites[:12]:
        print(f"| {site} | {seconds:.2f} | {n} |")


if __name__ == "__main__":
    main()
