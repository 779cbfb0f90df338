"""Calibration benchmarks: one chip's full profile fit, a 10,000-step trace fit, and the
serving fit of the 15 trainval H100 runs.

::

    python benchmarks/bench_calibration.py [--data ../shared/data/aic-op-profiles] [--chip h100]
                                           [--steps 10000] [--skip-profiles]
                                           [--residency ../shared/data/residency-vllm]
                                           [--serving ../shared/data] [--skip-serving]

Prints wall and process CPU seconds of each. The targets: a chip's full profile fit
≤ 120 s, a 10,000-step trace fit ≤ 60 s, and ``python -m jkernel.calibration serving`` on the
15 trainval H100 runs (10 fitted, 5 held out, both evaluated before and after) ≤ 5 minutes,
on 2 cores. Without the shared data the profile
benchmark runs on the committed fixtures (and says so). Restrict the cores with
``taskset -c 0,1 python benchmarks/bench_calibration.py`` to reproduce the 2-core figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t):
    w, c = _clock()
    return w - t[0], c - t[1]


def bench_profiles(data: Path, chip: str) -> None:
    from jkernel.calibration.fit.chip import FitSettings, fit_chip
    t = _clock()
    cf = fit_chip(data, chip, settings=FitSettings())
    wall, cpu = _since(t)
    rows = sum(f.rows_fit + f.rows_held for f in cf.fits)
    print(f"profile fit, {chip} ({data}): {wall:.1f} s wall, {cpu:.1f} s CPU, {rows} rows, "
          f"{len(cf.written())} coefficients")
    for f in cf.fits:
        r = f.error(next(iter(f.entry_slice.values()), ""))
        held = f"held-out {r.held.median:.3f} / {r.held.p90:.3f}" if r else ""
        print(f"    {f.primitive:18s} {f.seconds:6.1f} s  {f.rows_fit + f.rows_held:7d} rows  "
              f"{held}")


def bench_trace(n_steps: int) -> None:
    import numpy as np
    import jkernel
    from jkernel.calibration.fit import traces as T

    k = jkernel.open("llama-3.1-8b-h100-tp1")
    rng = np.random.default_rng(0)
    batches = []
    for i in range(n_steps):
        kind = i % 3
        d = 0 if kind == 2 else int(rng.integers(1, 200))
        s, c = [1] * d, [int(x) for x in rng.integers(32, 8000, d)]
        if kind != 0:
            s.append(int(rng.integers(64, 4096)))
            c.append(int(rng.integers(0, 2048)))
        batches.append(jkernel.Batch(s, c))
    p = k.params
    truth = p.replace(hbm_derate=0.7, attention_decode_floor=1.5 * float(
        p["attention_decode_floor"]), host_serial=500e-6)
    t = _clock()
    tr = T.generate_trace(k, batches, params=truth, noise=0.03)
    gw, gc = _since(t)
    names = ("hbm_derate", "attention_decode_floor", "host_serial")
    t = _clock()
    fit = T.fit_trace(tr, names, kernel=k)
    wall, cpu = _since(t)
    print(f"trace fit, {n_steps} steps of up to 201 requests ({SCEN}), 3 parameters: "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU (generation {gw:.1f} s)")
    for n in names:
        print(f"    {n:24s} true {float(truth[n]):.4g}  fitted {fit.values[n]:.4g}  "
              f"se {fit.laplace.se_value[n]}")


SCEN = "llama-3.1-8b-h100-tp1"


def bench_residency(root: Path, out: Path) -> None:
    """``python -m jkernel.calibration import residency`` on both runs and ``traces`` on the first
    (the second held out), each as its own process, as a user runs them."""
    import subprocess
    out.mkdir(parents=True, exist_ok=True)
    runs = (("sweep_rate/agg_2rps", "residency-2rps.jsonl"),
            ("sweep_tenants/1T_agg_2rps", "residency-1T-2rps.jsonl"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def timed(label, cmd):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "jkernel.calibration", *cmd], check=True, env=env,
                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{label}: {time.perf_counter() - t:.1f} s wall")

    for rel, name in runs:
        timed(f"import residency {rel}", ["import", "residency", str(root / rel),
                                          "--out", str(out / name)])
    timed("traces (3 constants, 32,209 steps fitted, 13,804 + 46,621 held out)",
          ["traces", "--traces", str(out / runs[0][1]), "--split", "time", "--heldout", "0.3",
           "--fit", "host_serial,host_serial_per_request,compute_derate",
           "--exclude-flags", "idle_before", "--held-trace", str(out / runs[1][1]),
           "--out", str(out / "vllm-h100-steps.yaml"), "--quiet"])


def bench_serving(data: Path, out: Path) -> None:
    """``python -m jkernel.calibration serving`` on the trainval runs of the shared data's
    manifest (validation/serving-runs.yaml), as its own process, as a user runs it."""
    import subprocess
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jkernel.calibration", "serving", "--runs",
                    str(ROOT / "validation" / "serving-runs.yaml"), "--data", str(data),
                    "--sources", "trainval", "--out", str(out / "serving-trainval.yaml"),
                    "--quiet"], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    print(f"serving fit, 15 trainval H100 runs (10 fitted, 5 held out): "
          f"{time.perf_counter() - t:.1f} s wall (target 300 s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/aic-op-profiles"))
    ap.add_argument("--chip", default="h100")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--skip-profiles", action="store_true")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--residency", default=str(ROOT.parent / "shared/data/residency-vllm"),
                    help="the residency-vllm root: time import residency and traces on it")
    ap.add_argument("--skip-residency", action="store_true")
    ap.add_argument("--serving", default=str(ROOT.parent / "shared/data"),
                    help="the shared data folder (serving-runs/): time the serving fit")
    ap.add_argument("--skip-serving", action="store_true")
    a = ap.parse_args(argv)
    print(f"cores available: {len(os.sched_getaffinity(0))}")
    if not a.skip_profiles:
        data = Path(a.data)
        if not data.is_dir():
            data = ROOT / "tests/data/aic"
            print(f"shared data not found; using the fixtures {data}")
        bench_profiles(data, a.chip)
    if not a.skip_trace:
        bench_trace(a.steps)
    if not a.skip_residency:
        if Path(a.residency).is_dir():
            bench_residency(Path(a.residency), ROOT / "build" / "bench-residency")
        else:
            print(f"no residency data at {a.residency}: skipped")
    if not a.skip_serving:
        if (Path(a.serving) / "serving-runs").is_dir():
            bench_serving(Path(a.serving), ROOT / "build" / "bench-serving")
        else:
            print(f"no serving runs under {a.serving}: skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
