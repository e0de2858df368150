"""XLA options for the simulator's update program (the chunk) on a CPU: its compile time, its speed, its bits.

The chunk is compiled once per structure and run for the whole run, with XLA's defaults. This script compiles it
with XLA's defaults and with an option set (default: XLA's older fusion emitters, what a run's start already uses,
``asgd_jax.simulator.programs.CPU_START_OPTIONS``), each in a fresh process with the persistent cache off, for a few
models and rules on the embedded ``digits``, and prints, per configuration: the chunk's compile seconds, the second
(warm) call's wall seconds, their ratios (options ÷ defaults) and whether the weights and per-update metrics are the
same bits. Run it again when jaxlib changes: whether an option is worth it is a property of XLA's emitters.

    .venv/bin/python experiments/benchmarks/chunk_options.py                       # ~2 minutes on 2 cores
    .venv/bin/python experiments/benchmarks/chunk_options.py --options '{"xla_backend_optimization_level": 1}'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = [("mlp", "asgd", 20_000), ("mlp", "dc_asgd_a", 20_000), ("cnn", "dc_asgd_a", 4_000), ("cnn", "asgd", 4_000)]
OLDER_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


def child(model_name: str, rule_name: str, updates: int, options: dict) -> None:
    """One configuration in this process: prints a JSON line (chunk compile s, warm wall s, a digest of the result)."""
    import hashlib
    import time

    import jax
    import numpy as np

    import asgd_jax
    from asgd_jax.simulator import programs

    compile_seconds = [0.0]
    compiled = programs.Program.compiled

    def timed(self, name, *args):
        if name == "chunk" and options:
            self.cpu_options["chunk"] = options
        t0 = time.perf_counter()
        out = compiled(self, name, *args)
        if name == "chunk":
            compile_seconds[0] += time.perf_counter() - t0
        return out

    programs.Program.compiled = timed
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get(model_name, num_classes=ds.num_classes, input_shape=ds.input_shape)
    params, model_state = model.init(jax.random.key(0))
    plan = asgd_jax.Plan(num_updates=updates, delays=asgd_jax.delays.Workers(4))
    loss, rule = asgd_jax.classification_loss(model), asgd_jax.rules.get(rule_name, 0.1)
    run = lambda: asgd_jax.simulate(loss, rule, params, ds.train, plan, model_state=model_state, progress=False)
    jax.block_until_ready(run().params)  # (compiles)
    t0 = time.perf_counter()
    result = run()
    jax.block_until_ready(result.params)
    warm = time.perf_counter() - t0
    digest = hashlib.sha1(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves((result.params, result.metrics))))
    print(json.dumps({"compile": compile_seconds[0], "warm": warm, "digest": digest.hexdigest()}))


def measure(model_name: str, rule_name: str, updates: int, options: dict) -> dict:
    env = dict(os.environ, ASGD_JAX_CACHE_DIR="off")
    argv = [sys.executable, __file__, "--child", model_name, rule_name, str(updates), json.dumps(options)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default=json.dumps(OLDER_EMITTERS), help="XLA options for the chunk, as JSON")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, rule_name, updates, options = args.child
        child(model_name, rule_name, int(updates), json.loads(options))
        return
    options = json.loads(args.options)
    print(f"the chunk with {options} against XLA's defaults (Workers(4), digits; fresh processes, cache off)")
    print("| model | rule | updates | compile s | ÷ | warm call s | ÷ | same bits |\n|---|---|---|---|---|---|---|---|")
    for model_name, rule_name, updates in CONFIGS:
        plain = measure(model_name, rule_name, updates, {})
        other = measure(model_name, rule_name, updates, options)
        print(
            f"| {model_name} | {rule_name} | {updates:,} | {plain['compile']:.2f} → {other['compile']:.2f} | "
            f"{other['compile'] / plain['compile']:.2f} | {plain['warm']:.2f} → {other['warm']:.2f} | "
            f"{other['warm'] / plain['warm']:.2f} | {'yes' if plain['digest'] == other['digest'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
