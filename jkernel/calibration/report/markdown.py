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

__all__ = ["profile_report", "trace_report"]


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
