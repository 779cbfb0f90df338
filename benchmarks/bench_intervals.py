"""Cost of interval replays: K draws in lockstep against one plain replay, in one run.

    python benchmarks/bench_intervals.py [--trace ../shared/data/residency-vllm/sweep_rate/agg_8rps/patched/trace.csv]
        [--draws 8 32] [--requests N] [--rounds 2] [--profile]

Replays the 8 requests/s residency-vllm run (without the shared data, the synthetic twin of
``benchmarks/bench_replay.py``; ``--requests`` keeps the first N) on ``qwen3-14b-h100-tp1``,
after warm-up: one plain replay (:func:`jkernel.replay.replay`), then for each K the
lockstep replay of K draws alone (:func:`jkernel.replay.lockstep.lockstep_replay`: one
pricing call per iteration for all K) and the whole :func:`jkernel.replay.intervals.
replay_intervals` (its point replay, the draws, the result tables and the statistics).
Prints every wall time as a ratio to the plain replay measured in the same run (the best of
``--rounds`` rounds of each), and where a lockstep iteration's time goes: the pricing call,
and per variant the scheduler and bookkeeping (``--profile``: cProfile's top functions).
The target: K = 32 at most 4 × one plain replay.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "residency-vllm" / "sweep_rate" / "agg_8rps" / \
    "patched" / "trace.csv"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--scenario", default="qwen3-14b-h100-tp1")
    ap.add_argument("--draws", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--requests", type=int, default=0, help="first N requests only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import jkernel
    from jkernel.replay import load_requests, replay
    from jkernel.replay.intervals import draw_variants, replay_intervals
    from jkernel.replay.lockstep import Lockstep, lockstep_replay
    from jkernel.uncertainty.errormodel import shipped_error_model
    from jkernel.uncertainty.extrapolation import assess
    from jkernel.uncertainty.posterior import Posterior

    from bench_replay import synthetic

    jkernel.enable_x64()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    k = jkernel.open(a.scenario)
    k.warm_up()
    if Path(a.trace).exists():
        reqs, what = load_requests(a.trace), a.trace
    else:
        reqs, what = synthetic(), "synthetic 4,800 requests at 8/s (no shared data)"
    if a.requests:
        reqs = reqs.head(a.requests)
    em = shipped_error_model()
    post = Posterior.from_kernel(k, em)

    def best(fn) -> float:
        walls = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t)
        return min(walls)

    lockstep_replay([k], [reqs.head(50)], draw_variants(post, em, "fitted", 2).variants)
    plain_res = replay(k, reqs)
    plain = best(lambda: replay(k, reqs))
    steps = plain_res.summary["steps"]
    cls = assess(k, em, steps=plain_res.steps).cls
    print(f"workload: {what}, {len(reqs)} requests; class {cls}")
    print(f"plain replay: {plain:.2f} s, {steps} steps ({plain / steps * 1e6:.0f} µs per step)")
    print(f"{'K':>4} {'lockstep s':>11} {'× plain':>8} {'full s':>8} {'× plain':>8} "
          f"{'iterations':>11} {'µs/iter':>8} {'µs/variant-step':>16} {'pricing µs/iter':>16}")
    print(f"{'':>4} {'':>11} {'':>8} {'':>8} {'':>8} {'':>11} {'':>8} {'':>16} {'(rows + call)':>16}")
    for kk in a.draws:
        variants = draw_variants(post, em, cls, kk).variants
        timer = [0.0]
        price = Lockstep._price

        def timed(self, items, _p=price):
            t = time.perf_counter()
            try:
                return _p(self, items)
            finally:
                timer[0] += time.perf_counter() - t
        lockstep_replay([k], [reqs.head(200)], variants)     # compiles the row counts
        Lockstep._price = timed
        last = {}

        def run():
            timer[0] = 0.0
            res, ls = lockstep_replay([k], [reqs], variants)
            last.update(ls=ls, pricing=timer[0])
        ls_wall = best(run)
        Lockstep._price = price
        full = best(lambda: replay_intervals(k, reqs, draws=kk, error_model=em, posterior=post))
        it = last["ls"].iterations
        print(f"{kk:4d} {ls_wall:11.2f} {ls_wall / plain:8.2f} {full:8.2f} {full / plain:8.2f} "
              f"{it:11d} {ls_wall / it * 1e6:8.0f} {ls_wall / (it * kk) * 1e6:16.1f} "
              f"{last['pricing'] / it * 1e6:16.0f}")
    if a.profile:
        import cProfile
        import pstats

        variants = draw_variants(post, em, cls, a.draws[-1]).variants
        prof = cProfile.Profile()
        prof.enable()
        lockstep_replay([k], [reqs], variants)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print("target: K = 32 ≤ 4 × one plain replay "
          f"({'see the lockstep column' if 32 in a.draws else 'K = 32 not run'})")


if __name__ == "__main__":
    main()
