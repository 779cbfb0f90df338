"""Speed of the deployment search: prints the machine, the load and the figures of one run.

    python benchmarks/bench_plan.py [--workers 2] [--requests 0] [--replay-top 3]

Runs the issue's question (Llama-3.1-70B-Instruct on 16 H200, isl 4096, osl 512, TTFT 2 s,
ITL 50 ms, 20 requests/s) through :func:`jkernel.search.plan` and prints: the whole run's
wall time (target ≤ 30 s on 2 cores), its two stages (pool screens by bulk pricing, then
replays), the candidates screened per second, the replayed requests per second, and the
load average before and after (the machine is shared, so the wall time is an upper bound of
what a quiet machine does).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time

from jkernel import search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--replay-top", type=int, default=3)
    args = ap.parse_args()
    print(f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; load average before "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    marks: dict[str, float] = {}
    t0 = time.perf_counter()

    def log(line: str) -> None:
        m = re.match(r"\[(screen|replay) (\d+)/(\d+)", line)
        if m:
            marks[m.group(1)] = time.perf_counter() - t0

    res = search.plan("llama-3.1-70b-instruct", chip="h200", gpus=16, isl=4096, osl=512,
                      ttft_s=2.0, itl_s=0.05, rate=20.0, requests=args.requests,
                      replay_top=args.replay_top, workers=args.workers, log=log)
    wall = time.perf_counter() - t0
    t = res.table
    n_rep = int(t["replayed"].sum())
    screen_s = marks.get("screen", wall)
    replay_s = wall - screen_s
    print(f"load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"| figure | measured |\n|---|---|")
    print(f"| whole search, {len(t)} candidates, {args.workers} workers | {wall:.1f} s "
          f"(target ≤ 30 s) |")
    print(f"| pool screens (bulk pricing), incl. worker start | {screen_s:.1f} s, "
          f"{len(t) / screen_s:.2f} candidates/s |")
    print(f"| replays: {n_rep} candidates × {res.workload.requests} requests | "
          f"{replay_s:.1f} s, {n_rep * res.workload.requests / max(replay_s, 1e-9):.0f} "
          f"requests/s |")
    best = res.best("colocated")
    print(f"best colocated: {best['configuration'] if best else 'none meets the SLA'}")


if __name__ == "__main__":
    main()
