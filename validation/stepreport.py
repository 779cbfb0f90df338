"""The step-trace fit's figures as docs/calibrate.md shows them, without writing the catalog.

    python -m validation.stepreport ../shared/data/residency-vllm [--markdown]

imports the two residency-vllm runs the shipped H100 step constants come from
(``jkernel.calibration.regenerate.STEP_RUNS``: the 2 req/s run, fitted on its first 70 % in
time, and the one-tenant 2 req/s run, held out entirely), runs
``jkernel.calibration.fit.stepfit.calibrate_steps`` on them exactly as
``python -m jkernel.calibration.regenerate --steps`` does, and prints the residuals of the
profile-only constants, the R² that names the candidates not fitted, and the held-out errors
before (profile-only step constants) and after the fit. ``--markdown`` prints them as the
Markdown region of docs/calibrate.md that ``docs/generate.py`` fills. Nothing is written.
About 30 s. A dataset study, not part of the installed library: run it from the repository
root (``python -m validation.stepreport`` or ``python validation/stepreport.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jkernel.calibration.regenerate import STEP_RUNS, calibrate_step_runs

__all__ = ["markdown", "main"]


def _label(part: str, index: int) -> str:
    """``last 30 %`` for the fitted run's held-out part, ``second run`` (``run N``) after."""
    if index == 0:
        return part.split(" of ")[0].replace("%", " %")
    return "second run" if index == 1 else f"run {index + 1}"


def markdown(cal) -> str:
    """Stage 1's residuals, stage 2's R² and the held-out table of docs/calibrate.md."""
    res, r2 = cal.residuals, cal.r2
    dec, pre = res["decode"], res["prefill"]
    before = [s for s in cal.summaries if s["when"] == "before"]
    short = sorted(-s["prefill_bias"] * 100 for s in before)
    lines = [
        f"*Residuals* (stage 1) of the profile-only constants on the fitted run: "
        f"{dec['per_step_s'] * 1e6:+.0f} µs per decode step and "
        f"{dec['per_request_s'] * 1e6:+.1f} µs per request; prefill steps "
        f"{pre['per_step_s'] * 1e6:+.0f} µs per step, {pre['per_request_s'] * 1e6:+.1f} µs "
        f"per request and {pre['per_prefill_token_s'] * 1e6:+.2f} µs per prefill token, "
        f"{short[0]:.0f}–{short[-1]:.0f} % short on the held-out parts (median).",
        "",
        "*R²* (stage 3) of each candidate's column by the fitted constants' columns: "
        + ", ".join(f"`{n}` {v:.4f}" for n, v in r2.items() if n not in cal.fit.names) + ".",
        "",
        "| held out | decode median \\|log ratio\\| | prefill | decode cost per request "
        "(measured) |",
        "|---|---:|---:|---:|",
    ]
    parts = list(dict.fromkeys(s["part"] for s in cal.summaries))
    for i, part in enumerate(parts):
        for s in (s for s in cal.summaries if s["part"] == part):
            after = s["when"] == "after"
            b = "**" if after else ""
            label = f"{_label(part, i)}, {'fitted' if after else 'profiles only'}"
            lines.append(f"| {label} | {b}{s['decode']:.3f}{b} | {b}{s['prefill']:.3f}{b} | "
                         f"{b}{s['slope_predicted_s'] * 1e6:.1f} µs{b} "
                         f"({s['slope_measured_s'] * 1e6:.1f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.stepreport",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", default="../shared/data/residency-vllm",
                   help="the residency-vllm folder (default ../shared/data/residency-vllm)")
    p.add_argument("--runs", nargs="*", default=None,
                   help="run folders under ROOT, the fitted one first (default: "
                        "jkernel.calibration.regenerate.STEP_RUNS)")
    p.add_argument("--markdown", action="store_true", help="print docs/calibrate.md's region")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if not Path(a.root).exists():
        print(f"{a.root}: no such folder (the residency-vllm data)", file=sys.stderr)
        return 2
    say = None if a.quiet or a.markdown else (lambda m: print(m, file=sys.stderr, flush=True))
    cal = calibrate_step_runs(a.root, tuple(a.runs or STEP_RUNS), progress=say)
    if a.markdown:
        print(markdown(cal))
    else:
        for s in cal.summaries:
            print(f"{s['part']:32s} {s['when']:6s} decode {s['decode']:.4f} prefill "
                  f"{s['prefill']:.4f} slope {s['slope_predicted_s'] * 1e6:.1f} µs/request "
                  f"(measured {s['slope_measured_s'] * 1e6:.1f})")
        for n, why in cal.not_identified.items():
            print(f"not fitted: {n}: {why}")
        print("fitted: " + ", ".join(f"{n} {v:.6g}" for n, v in cal.values().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
