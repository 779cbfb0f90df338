"""Coverage of the prediction intervals on held-out real runs: how often the stated 50 % and
80 % intervals of mean TTFT, mean ITL and mean E2E contain the measured value.

    python -m validation.coverage --residuals RESIDUALS.csv \\
        [--residency ../shared/data/residency-vllm] [--serving ../shared/data/serving-runs] \\
        [--draws 32] [--seeds 2] [--out CELLS.csv] [--markdown]

``RESIDUALS.csv`` is ``python -m validation.error_model --residuals``'s table (the group
residuals at the shipped constants). The held-out runs are the residency-vllm runs the
step fit did not fit on (every run but the 2 req/s one) and the held-out split of the
serving runs (``validation.serving_runs.held_out``). For each of them:

1. the error model is estimated again **without the run's own deployment** (for the
   fitted deployment, without the run itself), so no run is scored by intervals that
   learned from it (:func:`validation.error_model.estimate_from`);
2. the run is replayed with :func:`jkernel.replay.intervals.replay_intervals`: ``draws``
   draws in lockstep; a trainval run's requests are drawn from its workload spec
   (``docs/workloads/inference-sim-trainval/<run>.yaml``) with ``seeds`` seeds, since its
   real arrivals were never published; the other runs replay their own requests; the
   llmservingsim runs were timed on the engine's clock, so they get no front end;
3. each compared group (a trainval load stage; the whole run otherwise) gets its mean
   TTFT, ITL and E2E per draw, measured and computed exactly as
   ``validation/serving_runs.py`` and ``validation/replay.py`` compare them, and the 50 %
   and 80 % intervals of those draws (:func:`jkernel.uncertainty.intervals.interval`)
   are checked against the measured value.

One row per group and metric goes to ``--out`` (with the draws, so other levels can be
scored: ``notebooks/intervals.ipynb``'s calibration plot); ``--markdown`` prints the table
of ``docs/intervals.md``. A dataset study, not part of the installed library; about an hour
on two shared cores with 32 draws.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["LEVELS", "METRICS", "held_out_runs", "evaluate_run", "coverage", "summary",
           "markdown", "main"]

ROOT = Path(__file__).resolve().parent.parent
LEVELS = (0.5, 0.8)
METRICS = ("ttft_mean", "itl_mean", "e2e_mean")
SPECS = ROOT / "docs" / "workloads" / "inference-sim-trainval"


def held_out_runs(residuals: pd.DataFrame) -> pd.DataFrame:
    """The residual rows of the runs to score (held out from every fit)."""
    return residuals[residuals["split"] == "held-out"]


def _leave_out(residuals: pd.DataFrame, row) -> np.ndarray:
    """The residual rows an evaluated group's error model must not see: its deployment's
    (the fitted deployment's: its own run's)."""
    if row.cls in ("fitted", "fitted_deployment"):
        return ((residuals["source"] == row.source) & (residuals["run"] == row.run)).to_numpy()
    return (residuals["deployment"] == row.deployment).to_numpy()


def _residency_stats(result) -> dict:
    """One replay's compared means of a residency-vllm run, as ``validation/replay.py``
    compares them (its ITL counts the role and final chunks' gaps)."""
    from .replay import predicted_summary

    pred = predicted_summary(result)
    return {"all": {m: pred[m] for m in METRICS}}


def _group_stats(run, table: pd.DataFrame) -> dict:
    from . import serving_runs as S

    pred = S.predicted(run, table)
    return {int(r.stage): {m: float(getattr(r, m)) for m in METRICS} for r in pred.itertuples()}


def evaluate_run(kind: str, run, *, root: Path, error_model, draws: int, seeds: int,
                 seed: int = 0, levels=LEVELS) -> list[dict]:
    """Cells of one held-out run: ``kind`` is ``residency`` (``run``: (name, folder)) or
    ``serving`` (``run``: a :class:`validation.serving_runs.Run`)."""
    import jkernel
    from jkernel.replay import load_requests, read_spec
    from jkernel.replay.intervals import replay_intervals
    from jkernel.uncertainty.intervals import interval

    from . import serving_runs as S
    from .replay import SCENARIO, measured_summary

    t0 = time.perf_counter()
    if kind == "residency":
        name, folder = run
        k = jkernel.open(SCENARIO)
        trace = pd.read_csv(root / folder / "trace.csv")
        res = replay_intervals(k, load_requests(root / folder / "trace.csv"), draws=draws,
                               error_model=error_model, seed=seed)
        measured = measured_summary(trace)
        meas = {"all": {m: measured[m] for m in METRICS}}
        per_draw = [_residency_stats(r) for r in res.results]
        point = _residency_stats(res.point)
        label, source, group_names = name, "residency-vllm", {"all": "all"}
    else:
        k = S.open_kernel(run.scenario)
        block = int(k.settings.block_size)
        if run.source == "trainval":
            spec = read_spec(SPECS / f"{run.run}.yaml")
            res = replay_intervals(k, workload=spec, draws=draws, seeds=seeds,
                                   error_model=error_model, seed=seed)
            m = S.measured(run, root)
            meas = {int(r.stage): {x: float(getattr(r, x)) for x in METRICS}
                    for r in m.itertuples()}
            group_names = {int(r.stage): r.group for r in m.itertuples()}
        else:
            reqs = S.requests_for(run, block=block)
            res = replay_intervals(k, reqs, draws=draws, error_model=error_model, seed=seed,
                                   front_end=run.source != "llmservingsim")
            m = S.measured(run, root, reqs)
            meas = {-1: {x: float(m.iloc[0][x]) for x in METRICS}}
            group_names = {-1: "all"}
        per_draw = [_group_stats(run, r.requests) for r in res.results]
        point = _group_stats(run, res.point.requests)
        label, source = run.run, run.source
    wall = time.perf_counter() - t0
    rows = []
    for g, mv in meas.items():
        for metric in METRICS:
            values = np.array([d.get(g, {}).get(metric, math.nan) for d in per_draw])
            row = {"source": source, "run": label, "group": group_names[g], "metric": metric,
                   "measured": mv[metric], "point": point.get(g, {}).get(metric, math.nan),
                   "cls": res.extrapolation.cls, "draws": len(values),
                   "wall_s": wall, "values": " ".join(f"{v:.6g}" for v in values)}
            for lv in levels:
                c, lo, hi = interval(values, lv)
                row["central"] = c
                row[f"low_{int(lv * 100)}"] = lo
                row[f"high_{int(lv * 100)}"] = hi
                row[f"in_{int(lv * 100)}"] = bool(lo <= mv[metric] <= hi)
            rows.append(row)
    return rows


def coverage(residuals: pd.DataFrame, *, residency: Path, serving: Path, draws: int = 32,
             seeds: int = 2, out: Path | None = None, log=None, only=None) -> pd.DataFrame:
    """Every held-out run's cells (module docstring); appended to ``out`` as they come."""
    from . import serving_runs as S
    from .error_model import estimate_from, residency_steps
    from .replay import RUNS

    say = log or (lambda m: None)
    steps, rng, cor, _ = residency_steps(residency, log=say)
    held = held_out_runs(residuals)
    serving_runs = {(r.source, r.run): r for r in S.discover(serving)}
    residency_runs = dict(RUNS)
    done = set()
    cells = []
    if out is not None and Path(out).exists():
        prev = pd.read_csv(out)
        cells.append(prev)
        done = set(zip(prev["source"], prev["run"].astype(str)))
    for row in held.itertuples():
        key = (row.source, str(row.run))
        if key in done or (only and str(row.run) not in only):
            continue
        done.add(key)
        em = estimate_from(steps, residuals, rng, [cor], leave_out=_leave_out(residuals, row),
                           name=f"left out: {row.deployment}")
        if row.source == "residency-vllm":
            rows = evaluate_run("residency", (row.run, residency_runs[row.run]),
                                root=residency, error_model=em, draws=draws, seeds=seeds)
        else:
            rows = evaluate_run("serving", serving_runs[key], root=serving, error_model=em,
                                draws=draws, seeds=seeds)
        df = pd.DataFrame(rows)
        cells.append(df)
        if out is not None:
            df.to_csv(out, mode="a", header=not Path(out).exists(), index=False)
        say(f"{row.source} {row.run}: {df['in_80'].mean():.0%} in 80 %, "
            f"{df['in_50'].mean():.0%} in 50 % ({df['wall_s'].iloc[0]:.0f} s)")
    return pd.concat(cells, ignore_index=True) if cells else pd.DataFrame()


def summary(cells: pd.DataFrame) -> pd.DataFrame:
    """Share of cells inside each interval, per source and metric, and overall."""
    rows = []
    for (source, metric), g in cells.groupby(["source", "metric"]):
        rows.append({"source": source, "metric": metric, "cells": len(g),
                     **{f"in_{int(lv * 100)}": g[f"in_{int(lv * 100)}"].mean()
                        for lv in LEVELS}})
    for metric, g in cells.groupby("metric"):
        rows.append({"source": "all", "metric": metric, "cells": len(g),
                     **{f"in_{int(lv * 100)}": g[f"in_{int(lv * 100)}"].mean()
                        for lv in LEVELS}})
    rows.append({"source": "all", "metric": "all", "cells": len(cells),
                 **{f"in_{int(lv * 100)}": cells[f"in_{int(lv * 100)}"].mean()
                    for lv in LEVELS}})
    return pd.DataFrame(rows)


def markdown(cells: pd.DataFrame) -> str:
    """The coverage table of docs/intervals.md, then one line per cell."""
    s = summary(cells)
    lines = ["| source | metric | cells | in the 50 % interval | in the 80 % interval |",
             "|---|---|---:|---:|---:|"]
    for r in s.itertuples():
        lines.append(f"| {r.source} | {r.metric.replace('_', ' ')} | {r.cells} | "
                     f"{r.in_50:.0%} | {r.in_80:.0%} |")
    lines += ["", "| source | run | group | metric | measured | point | 80 % interval | in |",
              "|---|---|---|---|---:|---:|---|---|"]
    for r in cells.itertuples():
        scale, unit = (1.0, "s") if r.metric.startswith("e2e") else (1e3, "ms")
        lines.append(f"| {r.source} | {r.run} | {r.group} | {r.metric.replace('_', ' ')} | "
                     f"{r.measured * scale:.4g} {unit} | {r.point * scale:.4g} | "
                     f"[{r.low_80 * scale:.4g}, {r.high_80 * scale:.4g}] | "
                     f"{'yes' if r.in_80 else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.coverage",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--residuals", default=None,
                   help="python -m validation.error_model --residuals's table")
    p.add_argument("--cells", default=None, metavar="CELLS.csv",
                   help="print the tables of cells already scored (an --out file) instead "
                        "of replaying anything")
    p.add_argument("--residency", default="../shared/data/residency-vllm")
    p.add_argument("--serving", default="../shared/data/serving-runs")
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--seeds", type=int, default=2, help="workload seeds of a spec-drawn run")
    p.add_argument("--out", default=None, help="cells CSV (appended; a rerun skips the runs "
                                               "already in it)")
    p.add_argument("--runs", nargs="*", default=None, help="only these runs")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.cells:
        cells = pd.read_csv(a.cells)
        print(markdown(cells) if a.markdown else summary(cells).to_string(index=False))
        return 0
    if not a.residuals:
        p.error("--residuals is needed to score runs (or --cells to print scored ones)")
    import jkernel

    jkernel.enable_x64()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    cells = coverage(pd.read_csv(a.residuals), residency=Path(a.residency),
                     serving=Path(a.serving), draws=a.draws, seeds=a.seeds,
                     out=Path(a.out) if a.out else None, log=log, only=a.runs)
    if a.markdown:
        print(markdown(cells))
    else:
        print(summary(cells).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
