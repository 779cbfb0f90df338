"""Before and after the serving calibration: every serving run replayed twice, per source,
chip and model family, against the acceptance targets.

    python -m validation.serving_study --data ../shared/data/serving-runs \\
        [--before REF | --before-csv FILE] [--after-csv FILE] [--save-before FILE]
        [--save-after FILE] [--markdown FILE] [--sources ...] [--quiet]

replays every run of ``serving-runs/`` and ``residency-vllm/`` beside it
(:func:`validation.serving_runs.baseline`, whole runs, every request) with the catalog of git
revision ``REF`` (*before*; default :data:`BEFORE`, the catalog the baseline of
``validation/BASELINE.md`` shipped with, exported with ``git archive`` and read through
``JKERNEL_CATALOG``) and with the working tree's catalog (*after*), and prints per run and
group the errors of mean TTFT, ITL and E2E before → after, the medians per source, chip and
model family for the fit and the held-out runs (the split of
:func:`jkernel.calibration.data.heldout.held_out_runs`, never fitted), and the acceptance
lines on the held-out runs of each source: mean E2E and ITL within 5 % (median ≤ 3 %), mean
TTFT within 15 % (median ≤ 7 %), and no run that replays before failing after. A saved
table (``--save-before``) stands in for a replay (``--before-csv``), as both replays take
about a quarter of an hour on two cores each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["BEFORE", "TARGETS", "catalog_at", "both", "joined", "medians", "acceptance",
           "markdown", "main"]

#: The git revision whose catalog is "before": main when the serving-runs baseline was taken
#: (validation/BASELINE.md; the models and chips it added are in it).
BEFORE = "e651e00"
#: The acceptance targets on each source's held-out runs: metric → (bound on every run,
#: bound on the median over runs), as |predicted / measured − 1|.
TARGETS = {"e2e_mean": (0.05, 0.03), "itl_mean": (0.05, 0.03), "ttft_mean": (0.15, 0.07)}
_METRICS = ("ttft_mean", "itl_mean", "e2e_mean")


@contextlib.contextmanager
def catalog_at(ref: str, repo: str | Path | None = None):
    """The catalog folder of git revision ``ref`` (exported to a temporary folder), as
    ``JKERNEL_CATALOG`` and ``JKERNEL_REGISTRY`` (the coefficient sets are read from the
    registry root) for the duration of the block."""
    repo = Path(repo or Path(__file__).resolve().parents[1])
    blob = subprocess.run(["git", "-C", str(repo), "archive", ref, "catalog"], check=True,
                          capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(blob)) as tar:
            tar.extractall(tmp, filter="data")
        names = ("JKERNEL_CATALOG", "JKERNEL_REGISTRY")
        old = {n: os.environ.get(n) for n in names}
        for n in names:
            os.environ[n] = str(Path(tmp) / "catalog")
        try:
            yield Path(tmp) / "catalog"
        finally:
            for n, v in old.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v


def both(data: str | Path, *, before: str = BEFORE, before_csv=None, after_csv=None,
         sources=None, log=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The before and after tables of :func:`validation.serving_runs.baseline` (replayed,
    or read from the given CSVs)."""
    from validation.serving_runs import SOURCES, baseline

    sources = tuple(sources or SOURCES)
    if before_csv:
        b = pd.read_csv(before_csv)
    else:
        with catalog_at(before):
            b = baseline(data, sources=sources, log=log)
    a = pd.read_csv(after_csv) if after_csv else baseline(data, sources=sources, log=log)
    return b, a


def joined(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """One row per run and group: the measured values, the errors before and after, and the
    requests each replay completed (a run 'replays' when it completed every request)."""
    keys = ["source", "run", "group"]
    keep = keys + ["split", "chip", "family", "model", "requests", "replayed"] + \
        [f"{m}_measured" for m in _METRICS] + [f"{m}_error" for m in _METRICS]
    b = before[[c for c in keep if c in before.columns]]
    a = after[[c for c in keep if c in after.columns]]
    t = b.merge(a[keys + ["replayed"] + [f"{m}_error" for m in _METRICS]], on=keys,
                suffixes=("_before", "_after"))
    return t


def medians(t: pd.DataFrame, by: str) -> pd.DataFrame:
    """Per value of ``by`` and split: the median signed and absolute error of each metric
    before and after, and the largest absolute error after."""
    rows = []
    for key, g in t.groupby(by, sort=True):
        for split in ("fit", "held-out"):
            h = g[g["split"] == split]
            if h.empty:
                continue
            row = {by: key, "split": split, "groups": len(h), "runs": h["run"].nunique()}
            for m in _METRICS:
                for when in ("before", "after"):
                    e = h[f"{m}_error_{when}"].dropna()
                    row[f"{m}_{when}"] = float(e.median()) if len(e) else np.nan
                    row[f"{m}_{when}_abs"] = float(e.abs().median()) if len(e) else np.nan
                row[f"{m}_after_max"] = float(h[f"{m}_error_after"].abs().max())
            rows.append(row)
    return pd.DataFrame(rows)


def acceptance(t: pd.DataFrame) -> list[dict]:
    """The acceptance lines on each source's held-out groups (:data:`TARGETS`) before and
    after: for each metric the median |error| and the groups beyond the per-run bound; and
    the runs that replayed every request before but not after."""
    out = []
    for source, g in t[t["split"] == "held-out"].groupby("source", sort=True):
        for m, (each, med) in TARGETS.items():
            for when in ("before", "after"):
                e = g[f"{m}_error_{when}"].abs()
                miss = [f"{r} {grp}" for r, grp, x in zip(g["run"], g["group"], e) if x > each]
                out.append({"source": source, "metric": m, "when": when,
                            "median_abs": float(e.median()), "median_bound": med,
                            "each_bound": each, "holds": bool(e.median() <= med and
                                                              not miss),
                            "misses": miss})
    lost = t[(t["replayed_before"] >= t["requests"]) & (t["replayed_after"] < t["requests"])]
    out.append({"source": "all", "metric": "replays", "when": "after", "median_abs": np.nan,
                "median_bound": np.nan, "each_bound": np.nan, "holds": lost.empty,
                "misses": [f"{r} {grp}" for r, grp in zip(lost["run"], lost["group"])]})
    return out


def _pct(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{x * 100:+.1f}".replace("-", "−")


def markdown(t: pd.DataFrame) -> str:
    """The study as Markdown: medians per source, chip and family; the acceptance lines;
    the per-group table."""
    parts = []
    for by in ("source", "chip", "family"):
        med = medians(t, by)
        head = [by, "split", "groups (runs)"] + [f"{m.split('_')[0].upper()} before → after"
                                                 for m in _METRICS]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, r in med.iterrows():
            cells = [str(r[by]), r["split"], f"{int(r['groups'])} ({int(r['runs'])})"]
            for m in _METRICS:
                cells.append(f"{_pct(r[f'{m}_before'])} ({r[f'{m}_before_abs'] * 100:.1f}) → "
                             f"{_pct(r[f'{m}_after'])} ({r[f'{m}_after_abs'] * 100:.1f}; max "
                             f"{r[f'{m}_after_max'] * 100:.1f})")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append(f"### Medians per {by}\n\nSigned median (median |error|), %; after: "
                     "also the largest |error|.\n\n" + "\n".join(lines))
    lines = ["| source | metric | before: median \\|error\\| | after: median \\|error\\| | "
             "target (each, median) | holds after | held-out groups beyond the bound after |",
             "|---|---|---:|---:|---|---|---|"]
    acc = acceptance(t)
    for m in TARGETS:
        for source in sorted({a["source"] for a in acc if a["metric"] == m}):
            b = next(a for a in acc if a["source"] == source and a["metric"] == m
                     and a["when"] == "before")
            a = next(a for a in acc if a["source"] == source and a["metric"] == m
                     and a["when"] == "after")
            lines.append(f"| {source} | {m.replace('_', ' ')} | {b['median_abs'] * 100:.1f} | "
                         f"{a['median_abs'] * 100:.1f} | {a['each_bound'] * 100:.0f} %, "
                         f"{a['median_bound'] * 100:.0f} % | {'yes' if a['holds'] else 'no'} | "
                         + (", ".join(a["misses"]) or "none") + " |")
    lost = acc[-1]
    parts.append("### Acceptance on the held-out runs\n\n" + "\n".join(lines) + "\n\nRuns "
                 "that replayed every request before and not after: "
                 + (", ".join(lost["misses"]) or "none") + ".")
    head = ["source", "run", "group", "split"] + [f"{m.split('_')[0].upper()} before → after"
                                                  for m in _METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in t.iterrows():
        lines.append("| " + " | ".join([r["source"], str(r["run"]), str(r["group"]),
                                        r["split"]] +
                                       [f"{_pct(r[f'{m}_error_before'])} → "
                                        f"{_pct(r[f'{m}_error_after'])}" for m in _METRICS])
                     + " |")
    parts.append("### Per group\n\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    from validation.serving_runs import SOURCES

    p = argparse.ArgumentParser(prog="python -m validation.serving_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/serving-runs",
                   help="the serving-runs folder (residency-vllm/ beside it)")
    p.add_argument("--before", default=BEFORE, help="git revision of the 'before' catalog")
    p.add_argument("--before-csv", help="the before table saved by --save-before")
    p.add_argument("--after-csv", help="the after table saved by --save-after")
    p.add_argument("--save-before")
    p.add_argument("--save-after")
    p.add_argument("--sources", nargs="*", default=list(SOURCES), choices=SOURCES)
    p.add_argument("--markdown", help="write the study as Markdown here")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if not Path(a.data).is_dir():
        print(f"{a.data}: no such folder (the serving-runs data)", file=sys.stderr)
        return 2
    import jkernel

    jkernel.enable_x64()
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    b, af = both(a.data, before=a.before, before_csv=a.before_csv, after_csv=a.after_csv,
                 sources=a.sources, log=log)
    if a.save_before:
        b.to_csv(a.save_before, index=False)
    if a.save_after:
        af.to_csv(a.save_after, index=False)
    text = markdown(joined(b, af))
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
