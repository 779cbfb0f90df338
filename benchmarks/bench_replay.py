"""Speed of the serving replay: the 8 requests/s residency-vllm run, end to end.

    python benchmarks/bench_replay.py [--trace ../shared/data/residency-vllm/sweep_rate/agg_8rps/patched/trace.csv]
                                      [--rounds 3]

Prints the machine, the kernel's open + warm-up time, the replay's wall time (the median of
``--rounds`` replays), steps, steps per second, and the share of the time spent pricing
steps (the kernel's jitted step program; measured in one more round by wrapping
``Pool.price``). Without the shared data it
replays a synthetic Poisson workload of the same shape (4,800 requests at 8/s, 1,010-token prompts, 128 outputs).
Target: ≤ 1.5 s (≥ 25,000 steps/s) for the 8 requests/s run on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "residency-vllm" / "sweep_rate" / "agg_8rps" / \
    "patched" / "trace.csv"


def synthetic(n: int = 4800, rate: float = 8.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, n)
    return pd.DataFrame({"request_id": np.arange(n), "arrival_s": np.cumsum(gaps) - gaps[0],
                         "input_tokens": rng.integers(960, 1060, n), "output_tokens": 128})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--scenario", default="qwen3-14b-h100-tp1")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import jkernel
    from jkernel.replay import load_requests, replay

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    k = jkernel.open(a.scenario)
    k.warm_up()
    t_open = time.perf_counter() - t0
    if Path(a.trace).exists():
        reqs, what = load_requests(a.trace), a.trace
    else:
        reqs, what = synthetic(), "synthetic 4,800 requests at 8/s (no shared data)"
    from jkernel.replay import sim

    # the wall time: the median of --rounds untimed replays (the machine is shared, and a
    # replay's first round after warm-up also compiles the buckets it meets first)
    walls = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        res = replay(k, reqs)
        walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    s = res.summary

    # one more round with Pool.price wrapped in a timer: the share spent pricing steps
    inside = [0.0]
    price = sim.Pool.price

    def timed(self, per_replica):
        t = time.perf_counter()
        try:
            return price(self, per_replica)
        finally:
            inside[0] += time.perf_counter() - t

    sim.Pool.price = timed               # this process only: time spent pricing steps
    t0 = time.perf_counter()
    replay(k, reqs)
    timed_wall = time.perf_counter() - t0
    sim.Pool.price = price
    print(f"workload: {what}")
    print(f"open + warm_up: {t_open:.1f} s")
    print(f"replay: {len(reqs)} requests, {s['steps']} steps, {s['duration_s']:.0f} s served, "
          f"in {wall:.2f} s wall (median of {a.rounds}: "
          f"{' '.join(f'{w:.2f}' for w in walls)}) = {s['steps'] / wall:.0f} steps/s "
          f"({wall / max(s['duration_s'], 1e-9) * 100:.2f} % of real time)")
    print(f"pricing steps (the kernel's jitted step, timed round of {timed_wall:.2f} s): "
          f"{inside[0]:.2f} s ({inside[0] / timed_wall * 100:.0f} %), "
          f"{inside[0] / s['steps'] * 1e6:.0f} µs per step; scheduler and bookkeeping "
          f"{(timed_wall - inside[0]) / s['steps'] * 1e6:.0f} µs per step")
    met = wall <= 1.5 and s['steps'] / wall >= 25_000
    print(f"target ≤ 1.5 s and ≥ 25,000 steps/s: {'met' if met else 'missed'}; load average "
          f"after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
