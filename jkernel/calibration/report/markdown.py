"""Markdown reports of a calibration: a chip's profile fit and a step-trace fit.

:func:`profile_report` and :func:`trace_report` render the data, the law of each primitive,
the fitted values with their uncertainty, the error tables (fit and held-out, median and p90
of ``|log(predicted / measured)|``) beside the comparison curves, the notes of each fit and
the plots written by :func:`jkernel.calibration.report.plots.save_plots`.
"""

from __future__ import annotations

import math
from typing import Mapping

from jkernel.params import si_scale

from ..fit.base import PrimitiveFit
from ..fit.chip import ChipFit
from .coefficients import LAWS, units_for

__all__ = ["profile_report", "trace_report", "serving_report", "serving_summary",
           "serving_summary_markdown", "SERVING_METRICS"]


def _fmt(x: float | None, name: str = "") -> str:
    if x is None:
        return "—"
    if name:
        x = x / si_scale(name)
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e5 or a < 1e-3:
        return f"{x:.4g}"
    return f"{x:.5g}"


def _error_table(f: PrimitiveFit) -> list[str]:
    lines = ["| slice | curve | fit median | fit p90 | held-out median | held-out p90 | rows "
             "(fit / held) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in f.errors:
        lines.append(f"| {r.slice} | {r.variant} | {_e(r.fit.median)} | {_e(r.fit.p90)} | "
                     f"{_e(r.held.median)} | {_e(r.held.p90)} | {r.fit.rows} / {r.held.rows} |")
    return lines


def _e(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.4f}"


def _values_table(f: PrimitiveFit) -> list[str]:
    lines = ["| name | value | units | standard error | 95 % interval | identifiable | "
             "written |", "|---|---:|---|---:|---|---|---|"]
    lap = f.laplace
    for p in f.params:
        v = f.written.get(p.name, f.values[p.name])
        ok = lap.identifiable.get(p.name, True) if lap is not None else True
        se = lap.se_value.get(p.name) if lap is not None else None
        ci = lap.ci95.get(p.name) if lap is not None else None
        scale_name = p.name if p.written or p.name == "kernel_gap" else (
            "kernel_gap" if "floor" in p.name else "")
        ci_s = (f"[{_fmt(ci[0], scale_name)}, {_fmt(ci[1], scale_name)}]" if ci else "—")
        units = units_for(p.name) if p.written or p.name == "kernel_gap" else (
            "µs" if "floor" in p.name else "")
        lines.append(f"| `{p.name}` | {_fmt(v, scale_name)} | {units} | "
                     f"{_fmt(se, scale_name)} | {ci_s} | "
                     f"{'yes' if ok else 'no (' + lap.reason[p.name] + ')'} | "
                     f"{'yes' if p.written else 'no (nuisance)'} |")
    return lines


def profile_report(chip_fit: ChipFit, *, plots: Mapping[str, list[str]] | None = None,
                   plots_prefix: str = "", command: str = "") -> str:
    """Markdown report of a chip's profile fit."""
    cf = chip_fit
    L = [f"# Calibration of `{cf.chip}` from per-operator profiles", ""]
    if command:
        L += [f"Command: `{command}`", ""]
    L += [f"Data: `{cf.data_dir}/{cf.profile_dir}` (NVIDIA AIConfigurator, Apache-2.0). "
          f"Total fit time {cf.seconds:.1f} s.", "",
          "Errors are the median and the 90th percentile of |log(predicted / measured)| "
          "(0.10 ≈ a 10 % miss) on the fit rows and on held-out rows (20 % of the shapes, "
          "split by a hash of each row's shape, never seen by the fit). Standard errors are "
          "Gauss–Newton (Laplace) estimates given the law; with residuals dominated by the "
          "law's structural misfit they measure how well the data pins a value, not its "
          "predictive accuracy, which the held-out error states.", ""]
    for note in cf.notes:
        L.append(f"* {note}")
    if cf.notes:
        L.append("")
    if cf.unloaded:
        L += [f"Tables present but not read by any fit: {', '.join(f'`{u}`' for u in cf.unloaded)}.",
              ""]
    for f in cf.fits:
        L += [f"## {f.primitive.replace('_', ' ')}", "",
              f"Law: {LAWS.get(f.primitive, f.primitive)}.", "",
              f"Source: `{f.source}` (sha256 `{f.sha256[:16]}…`), {f.rows_fit} fit rows, "
              f"{f.rows_held} held-out rows" + (f", rows skipped on load: {f.skipped}"
                                               if f.skipped else "")
              + f"; {f.seconds:.1f} s.", ""]
        L += _values_table(f) + [""]
        L += _error_table(f) + [""]
        for note in f.notes:
            L.append(f"* {note}")
        if f.notes:
            L.append("")
        for name in (plots or {}).get(f.primitive, []):
            L += [f"![{f.primitive}]({plots_prefix}{name})", ""]
    return "\n".join(L) + "\n"


def trace_report(fit, *, command: str = "") -> str:
    """Markdown report of a step-trace fit (:class:`jkernel.calibration.fit.traces.TraceFit`)."""
    L = ["# Step-trace calibration", ""]
    if command:
        L += [f"Command: `{command}`", ""]
    dep = fit.deployment if isinstance(fit.deployment, str) and "\n" not in fit.deployment \
        else "(inline bundle)"
    L += [f"Deployment: `{dep}`. Trace: `{fit.trace_file or '(in memory)'}`"
          + (f" (sha256 `{fit.trace_sha256[:16]}…`)" if fit.trace_sha256 else "") + ". "
          f"Target: `{fit.target}`. {fit.steps_fit} fit steps, {fit.steps_held} held-out "
          f"steps; residual scale σ = {fit.sigma:.4f} (log); {fit.seconds:.1f} s.", ""]
    if fit.skipped:
        L += [f"Steps skipped while reading: {fit.skipped}.", ""]
    L += ["| name | catalog | fitted | standard error | 95 % interval | identifiable |",
          "|---|---:|---:|---:|---|---|"]
    lap = fit.laplace
    for n in fit.names:
        ci = lap.ci95[n]
        ok = lap.identifiable[n]
        L.append(f"| `{n}` | {_fmt(fit.catalog[n], n)} | "
                 f"{_fmt(fit.values[n], n) if ok else _fmt(fit.raw[n], n) + ' (not kept)'} | "
                 f"{_fmt(lap.se_value[n], n)} | "
                 f"{'[' + _fmt(ci[0], n) + ', ' + _fmt(ci[1], n) + ']' if ci else '—'} | "
                 f"{'yes' if ok else 'no (' + lap.reason[n] + ')'} |")
    L += ["", "Values in registry units (µs, bytes/µs, dimensionless).", "",
          "| steps | curve | median | p90 | rows |", "|---|---|---:|---:|---:|"]
    for part, curve, st in fit.errors:
        L.append(f"| {part} | {curve} | {_e(st.median)} | {_e(st.p90)} | {st.rows} |")
    L.append("")
    for note in fit.notes:
        L.append(f"* {note}")
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------------------
# Serving fits

#: The group metrics of a serving report, as the tables name them.
SERVING_METRICS = (("ttft_mean", "TTFT"), ("itl_mean", "ITL"), ("e2e_mean", "E2E"))


def _pct(x: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}".replace("-", "−")


def serving_summary(table, by: str = "source"):
    """Median signed and median absolute error (predicted / measured − 1) before and after,
    per value of ``by`` and split: a DataFrame (rows: ``by``, ``split``, ``groups``,
    ``runs``, then ``<metric>_<when>_median`` / ``_median_abs``)."""
    import pandas as pd

    rows = []
    if not len(table):
        return pd.DataFrame(rows)
    for key, g in table.groupby(by, sort=True):
        for split in ("fit", "held-out"):
            h = g[g["split"] == split]
            if h.empty:
                continue
            row = {by: key, "split": split, "groups": len(h), "runs": h["run"].nunique()}
            for m, _ in SERVING_METRICS:
                for when in ("before", "after"):
                    e = h[f"{m}_error_{when}"].dropna()
                    row[f"{m}_{when}_median"] = float(e.median()) if len(e) else math.nan
                    row[f"{m}_{when}_median_abs"] = float(e.abs().median()) if len(e) else \
                        math.nan
                    row[f"{m}_{when}_max_abs"] = float(e.abs().max()) if len(e) else math.nan
            rows.append(row)
    return pd.DataFrame(rows)


def serving_summary_markdown(table, by: str = "source") -> str:
    """:func:`serving_summary` as a Markdown table: per metric, before → after as the
    signed median (median |error|, max |error|), in %."""
    s = serving_summary(table, by)
    head = [by, "split", "groups (runs)"] + [f"{label} before → after" for _, label in
                                             SERVING_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in s.iterrows():
        cells = [str(r[by]), r["split"], f"{int(r['groups'])} ({int(r['runs'])})"]
        for m, _ in SERVING_METRICS:
            cells.append(" → ".join(
                f"{_pct(r[f'{m}_{w}_median'])} ({abs(r[f'{m}_{w}_median_abs']) * 100:.1f}, "
                f"{abs(r[f'{m}_{w}_max_abs']) * 100:.1f})" for w in ("before", "after")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serving_report(fits, *, command: str, manifest: str) -> str:
    """The Markdown report of a serving calibration: per deployment class the fitted
    constants (value, 95 % interval, before), the constants not fitted and why, the fit's
    path, then the per-group errors before and after for the fit and the held-out runs, and
    their medians per source, chip and model family."""
    import pandas as pd

    from ..fit.serving import SERVING_CONSTANTS

    out = ["# Serving calibration", "",
           f"Command: `{command}`  ", f"Runs: `{manifest}`", "",
           "Errors are predicted / measured − 1 of each group's mean TTFT, ITL ((mean E2E − "
           "mean TTFT) / (mean output − 1)) and E2E; *before* is the catalog as shipped, "
           "*after* the fitted constants. Held-out runs are never fitted (split by run, per "
           "source). Medians: signed median (median |error|, max |error|), %.", ""]
    tables = []
    for fit in fits:
        out += [f"## {fit.cls}", "",
                f"{len(fit.runs)} fit runs, {len(fit.held)} held-out runs; {fit.replays} "
                f"replays of the fit runs; {fit.wall_s:.0f} s. Verdict: {fit.verdict()}.", "",
                "| constant | start | fitted | 95 % interval | |", "|---|---:|---:|---|---|"]
        lap = fit.laplace
        for name in fit.start:
            ci = lap.ci95.get(name) if (lap is not None and name in lap.names) else None
            status = ("not pinned, kept: " + fit.loose[name] if name in fit.loose
                      else "fitted" if name in fit.names
                      else "not fitted: " + fit.frozen.get(name, ""))
            out.append(f"| `{name}` | {_fmt(fit.start[name], name)} | "
                       f"{_fmt(fit.values[name], name) if name in fit.names else '—'} | "
                       + (f"[{_fmt(ci[0], name)}, {_fmt(ci[1], name)}]" if ci else "—")
                       + f" | {status} |")
        out.append("")
        out.append("Units as the catalog states them (µs for host times); *start* is the "
                   "catalog's value (or the value a newer engine version's fit on this chip "
                   "gives, which this class borrows once written), or the prior's centre "
                   "where the catalog charges 0. "
                   + "; ".join(f"`{n}`: {SERVING_CONSTANTS[n]}" for n in fit.names))
        if fit.offsets:
            out += ["", "Models' step offsets (log; a nuisance of the fit, never priced): "
                    + ", ".join(f"{m} {v:+.3f}" for m, v in sorted(fit.offsets.items()))]
        out += ["", "Path (replayed loss per accepted step): "
                + " → ".join(f"{h['loss']:.2f}" for h in fit.history), ""]
        t = fit.table
        if len(t):
            tables.append(t)
            out += ["| run | group | split | TTFT before → after | ITL before → after | "
                    "E2E before → after |", "|---|---|---|---|---|---|"]
            for _, r in t.iterrows():
                out.append(f"| {r['run']} | {r['group']} | {r['split']} | "
                           + " | ".join(f"{_pct(r[f'{m}_error_before'])} → "
                                        f"{_pct(r[f'{m}_error_after'])}"
                                        for m, _ in SERVING_METRICS) + " |")
            out.append("")
    if tables:
        every = pd.concat(tables, ignore_index=True)
        for by in ("source", "chip", "family"):
            if by in every.columns:
                out += [f"## Medians per {by}", "", serving_summary_markdown(every, by), ""]
    return "\n".join(out) + "\n"
