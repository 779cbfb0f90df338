"""Where a replay's wall time goes, per simulated step.

    python benchmarks/profile_replay.py [--trace ../shared/data/residency-vllm/sweep_rate/agg_8rps/patched/trace.csv]
                                        [--scenario qwen3-14b-h100-tp1] [--cprofile N] [--rounds 3]

Replays the 8 requests/s residency run (or, without the shared data, the synthetic twin of
``bench_replay.py``) after the kernel is warm, ``--rounds`` times, and prints µs per step
of each part, the medians over rounds:

* ``schedule``: ``Replica.schedule`` (the scheduler: running requests, admission, block
  accounting, prefix-cache lookups and registration);
* ``outputs``: ``Simulation._outputs`` (token times, finished requests, ``release``);
* ``price: arrays``: ``Pool.price`` outside ``Kernel.step_time`` (the Python lists of
  tokens and their int32 arrays);
* ``price: step_time host``: ``Kernel.step_time`` outside its compiled programs
  (validation, packing, the ``StepEstimate``);
* ``price: programs``: the compiled step programs (``Programs.step``: dispatch, run,
  the result back as numpy);
* ``step bookkeeping``: ``Simulation._step`` outside the parts above (the step log,
  KV usage, pushing the step's end);
* ``event loop``: the rest of ``Simulation.run`` (the heap, arrivals, routing, wake-ups),
  including the timers' own cost (~0.1–0.2 µs per timed call, 7–8 calls per step);
* ``replay api``: ``replay`` outside ``Simulation.run`` (validating the table, rejections,
  building the result tables), spread over the steps.

With ``--cprofile N`` it also runs one more replay under ``cProfile`` and prints the N
functions with the most own time (cProfile's overhead inflates call-heavy code: read its
shares, not its µs).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_replay import TRACE, synthetic  # noqa: E402

PARTS = ("schedule", "outputs", "price: arrays", "price: step_time host", "price: programs",
         "step bookkeeping", "event loop", "replay api")


class Timers:
    """Inclusive seconds per wrapped function, by name."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        acc = self.s
        acc.setdefault(name, 0.0)
        clock = time.perf_counter

        def timed(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += clock() - t

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, fn))

    def restore(self) -> None:
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)
        self.undo.clear()


def breakdown(k, reqs) -> tuple[dict, int, float]:
    """One replay with timers: (µs per step by part, steps, wall s)."""
    from jkernel.programs import Programs
    from jkernel.replay import replay, scheduler, sim

    t = Timers()
    t.wrap(scheduler.Replica, "schedule", "schedule")
    t.wrap(sim.Simulation, "_outputs", "outputs")
    t.wrap(sim.Simulation, "_step", "_step")
    t.wrap(sim.Simulation, "run", "run")
    t.wrap(sim.Pool, "price", "price")
    t.wrap(type(k), "step_time", "step_time")
    t.wrap(Programs, "step", "programs")
    try:
        t0 = time.perf_counter()
        res = replay(k, reqs)
        wall = time.perf_counter() - t0
    finally:
        t.restore()
    s = t.s
    steps = res.summary["steps"]
    # _step runs outputs, schedule (both once, and again ahead under async scheduling) and
    # price; schedule is also reached only through _step
    parts = {
        "schedule": s["schedule"],
        "outputs": s["outputs"],
        "price: arrays": s["price"] - s["step_time"],
        "price: step_time host": s["step_time"] - s["programs"],
        "price: programs": s["programs"],
        "step bookkeeping": s["_step"] - s["schedule"] - s["outputs"] - s["price"],
    }
    parts["event loop"] = s["run"] - s["_step"]
    parts["replay api"] = wall - s["run"]
    return {p: v / steps * 1e6 for p, v in parts.items()}, steps, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--scenario", default="qwen3-14b-h100-tp1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    a = ap.parse_args()
    import jkernel
    from jkernel.replay import load_requests, replay

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load average "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    k = jkernel.open(a.scenario)
    k.warm_up()
    if Path(a.trace).exists():
        reqs, what = load_requests(a.trace), a.trace
    else:
        reqs, what = synthetic(), "synthetic 4,800 requests at 8/s (no shared data)"
    print(f"workload: {what}; scenario {a.scenario}")
    replay(k, reqs.head(300))                             # warm every program it will run
    runs, walls, plain = [], [], []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        res = replay(k, reqs)
        plain.append(time.perf_counter() - t0)
        parts, steps, wall = breakdown(k, reqs)
        runs.append(parts)
        walls.append(wall)
    steps = res.summary["steps"]
    print(f"{steps} steps; untimed replay {statistics.median(plain):.2f} s "
          f"({statistics.median(plain) / steps * 1e6:.1f} µs/step, "
          f"{steps / statistics.median(plain):,.0f} steps/s); timed "
          f"{statistics.median(walls):.2f} s (medians of {a.rounds})")
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"\n  {'part':<26}{'µs/step':>10}{'share':>8}   (rounds)")
    for p in PARTS:
        vals = [r[p] for r in runs]
        m = statistics.median(vals)
        print(f"  {p:<26}{m:>10.1f}{m / total * 100:>7.0f} %   "
              + " ".join(f"{v:.1f}" for v in vals))
    print(f"  {'total':<26}{total:>10.1f}")
    print(f"load average after: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if a.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        replay(k, reqs)
        prof.disable()
        print(f"\ncProfile, top {a.cprofile} by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
