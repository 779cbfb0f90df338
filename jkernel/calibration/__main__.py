"""Command line of the calibration package.

::

    python -m jkernel.calibration profiles --chip h100 \\
        --data ../shared/data/aic-op-profiles --out build/calibrated-h100.yaml
    python -m jkernel.calibration traces --scenario llama-3.1-8b-h100-tp1 \\
        --traces steps.jsonl --fit hbm_derate,host_serial --out build/trace-fit.yaml
    python -m jkernel.calibration import residency \\
        ../shared/data/residency-vllm/sweep_rate/agg_2rps --out build/steps.jsonl
    python -m jkernel.calibration traces --traces build/steps.jsonl --split time \\
        --heldout 0.3 --fit host_serial,host_serial_per_request,compute_derate \\
        --exclude-flags idle_before --held-trace build/steps-1T.jsonl --out build/vllm-h100.yaml
    python -m jkernel.calibration import splitwise \\
        --in ../shared/data/splitwise/data/perf_model.csv \\
        --out build/splitwise-h100-tp4.jsonl --hardware h100-80gb --tp 4
    python -m jkernel.calibration serving --runs validation/serving-runs.yaml \\
        --data ../shared/data --sources trainval --out build/serving-h100.yaml

``profiles`` fits every primitive of one chip and writes one coefficient set (all entries
``method: fitted``, scoped to the chip) plus a Markdown report (``--report``, default the
output path with ``.md``) and its PNG plots when matplotlib is installed. ``traces`` fits the
named parameters against a step trace (:mod:`jkernel.calibration.data.traces` documents the
format) and writes the identifiable ones. ``import`` converts Splitwise's table, aggregate
forward-pass rows (CSV), streamed token timestamps (JSON) or a streamed serving run's
``trace.csv`` + ``trace.itl.csv`` (``residency``, :mod:`jkernel.calibration.data.residency`)
into a step trace. ``serving`` fits the engine-level constants (the front end, host work per
step and per request, the compute derate) to serving runs listed in a run manifest
(:mod:`jkernel.calibration.data.serving` documents it), one fit per deployment class (chip
and engine version), and writes the identified constants as a coefficient set (scoped by
chip and engine version, each with the deployments it was fitted on) and a Markdown report
of the errors before and after on the fit and the held-out runs
(:mod:`jkernel.calibration.fit.serving`); with ``--api-server`` also the API server's work
per request and per streamed token (:mod:`jkernel.calibration.fit.api_server`), after which
each class whose runs keep it is fitted again with it. Progress goes to stderr.
Exit status: 0 on success, 2 on bad input (a clear message naming the file).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from jkernel.atomic import write_text, write_with

__all__ = ["main"]


def _progress(quiet: bool):
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)
    return say


def _report_paths(out: Path, report: str | None) -> Path:
    return Path(report) if report else out.with_suffix(".md")


def cmd_profiles(a) -> int:
    from .fit.chip import FitSettings, fit_chip
    from .report.coefficients import profile_entries, write_coefficient_set
    from .report.markdown import profile_report
    from .report.plots import save_plots

    say = _progress(a.quiet)
    settings = FitSettings(heldout=a.heldout, seed=a.seed, steps=a.steps,
                           max_rows=a.max_rows or None, shape_aware=a.shape_aware,
                           allreduce=a.allreduce, kernel_gap=a.kernel_gap,
                           primitives=tuple(a.primitives.split(",")) if a.primitives
                           else FitSettings().primitives)
    cf = fit_chip(a.data, a.chip, settings=settings, progress=say)
    out = Path(a.out)
    command = "python -m jkernel.calibration " + " ".join(shlex.quote(x) for x in a.argv)
    entries = profile_entries(cf, command=command)
    name = a.set_name or out.stem
    write_coefficient_set(out, name, entries, header=(
        f"{name}: coefficients of {cf.chip} fitted from NVIDIA AIConfigurator per-operator "
        f"profiles by jkernel's calibration.\nReproduce with: {command}\n"
        "Every entry: method fitted, its data source and sha256, rows, held-out error "
        "(|log ratio| median and p90), standard error."))
    say(f"wrote {len(entries)} entries to {out}")
    rep = _report_paths(out, a.report)
    plots = {} if a.no_plots else save_plots(cf.fits, rep.parent, rep.stem)
    rep.parent.mkdir(parents=True, exist_ok=True)
    write_text(rep, profile_report(cf, plots=plots, command=command))
    say(f"wrote the report {rep}" + (f" and {sum(len(v) for v in plots.values())} plots"
                                     if plots else ""))
    return 0


def cmd_traces(a) -> int:
    from .data.traces import open_deployment, read_trace
    from .fit.traces import fit_trace
    from .report.coefficients import trace_entries, write_coefficient_set
    from .report.markdown import trace_report

    say = _progress(a.quiet)
    trace = read_trace(a.traces)
    if a.scenario:
        trace.deployment = a.scenario
    if a.pool is not None:
        trace.pool = a.pool
    say(f"read {len(trace)} steps from {a.traces}"
        + (f" (skipped: {trace.skipped})" if trace.skipped else ""))
    kernel = open_deployment(trace.deployment, trace.pool, file=a.traces)
    names = [n.strip() for n in a.fit.split(",") if n.strip()]
    fit = fit_trace(trace, names, kernel=kernel, target=a.target, steps=a.steps,
                    heldout=a.heldout, seed=a.seed,
                    prior_sigma=__import__("math").log(a.prior_factor),
                    exclude_flags=tuple(f for f in (a.exclude_flags or "").split(",") if f),
                    split=a.split, progress=say)
    hardware = [a.hardware] if a.hardware else [kernel.inputs.scenario.cluster.hardware]
    model = [kernel.inputs.scenario.model] if a.scope_model else None
    command = "python -m jkernel.calibration " + " ".join(shlex.quote(x) for x in a.argv)
    entries = trace_entries(fit, hardware=hardware, model=model, command=command)
    out = Path(a.out)
    name = a.set_name or out.stem
    write_coefficient_set(out, name, entries, header=(
        f"{name}: coefficients fitted from the step trace {a.traces} by jkernel's "
        f"calibration.\nReproduce with: {command}"))
    rep = _report_paths(out, a.report)
    write_text(rep, trace_report(fit, command=command))
    for n in fit.names:
        lap = fit.laplace
        if lap.identifiable[n]:
            say(f"{n}: {fit.catalog[n]:.6g} → {fit.values[n]:.6g} (SI), se "
                f"{lap.se_value[n]:.3g}")
        else:
            say(f"{n}: not identifiable ({lap.reason[n]}); kept at {fit.catalog[n]:.6g}")
    for part, curve, st in fit.errors:
        say(f"{part:8s} {curve:8s} |log ratio| median {st.median:.4f} p90 {st.p90:.4f}")
    say(f"wrote {len(entries)} entries to {out} and the report {rep}")
    _held_reports(a, fit, say)
    return 0


def cmd_import(a) -> int:
    from .data import importers
    from .data.traces import write_trace

    say = _progress(a.quiet)
    if a.kind == "residency":
        return _import_residency(a, say)
    if a.input is None:
        raise SystemExit(f"import {a.kind} needs --in")
    if a.kind == "splitwise":
        tr = importers.from_splitwise(a.input, model=a.model, hardware=a.hardware,
                                      tensor_parallel=a.tp, scenario=a.deployment)
    elif a.kind == "aggregate":
        if not a.deployment:
            raise SystemExit("import aggregate needs --deployment")
        tr = importers.read_aggregate_csv(a.input, a.deployment)
    else:
        if not a.deployment:
            raise SystemExit("import timestamps needs --deployment")
        reqs = json.loads(Path(a.input).read_text(encoding="utf-8"))
        tr, rec = importers.from_timestamps(reqs, a.deployment, tolerance_s=a.tolerance)
        say(f"{rec.events} token events → {rec.clusters} clusters → {len(rec.steps)} steps "
            f"(tolerance {rec.tolerance_s:.3g} s, dropped {rec.dropped or 'none'})")
    write_trace(a.out, tr)
    say(f"wrote {len(tr)} steps to {a.out}" + (f" (skipped {tr.skipped})" if tr.skipped else ""))
    return 0


def _import_residency(a, say) -> int:
    from .data.residency import DEFAULT_DEPLOYMENT, import_residency
    from .data.traces import write_trace

    path = a.path or a.input
    if path is None:
        raise SystemExit("import residency needs the run's folder (DIR or --in DIR)")
    rec = import_residency(path, a.deployment or DEFAULT_DEPLOYMENT,
                           max_num_batched_tokens=a.max_num_batched_tokens,
                           tolerance_s=a.tolerance)
    say(rec.summary())
    write_trace(a.out, rec.trace)
    say(f"wrote {len(rec.trace)} steps to {a.out}")
    return 0


def _held_reports(a, fit, say) -> None:
    """``traces --held-trace``: the fit's errors on other runs, entirely held out."""
    from .data.traces import read_trace
    from .fit.steperrors import step_errors, summary

    tables = []
    k = fit.kernel
    for path in a.held_trace or ():
        tr = read_trace(path)
        for label, params in (("catalog", k.params), ("fitted", fit.params())):
            s = summary(k, params, tr, part=f"{Path(path).name} {label}")
            say(f"held-out run {path} ({label}): decode |log ratio| median {s['decode']:.4f}, "
                f"prefill {s['prefill']:.4f}; decode slope {s['slope_predicted_s'] * 1e6:.1f} "
                f"µs/request vs measured {s['slope_measured_s'] * 1e6:.1f}")
            tables.append(step_errors(k, params, tr, part=f"{path} {label}"))
    if tables and a.report_csv:
        import pandas as pd
        table = pd.concat(tables)
        write_with(a.report_csv, lambda tmp: table.to_csv(tmp, index=False))
        say(f"wrote per-kind and per-batch errors to {a.report_csv}")


def cmd_serving(a) -> int:
    from .data.serving import read_manifest
    from .fit.serving import fit_classes
    from .report.coefficients import api_server_set, serving_set, write_coefficient_set
    from .report.markdown import serving_report

    say = _progress(a.quiet)
    runs = read_manifest(a.runs, root=a.data, sources=a.sources or None,
                         runs=a.only or None)
    if not runs:
        raise ValueError(f"{a.runs}: no run left (sources {a.sources}, runs {a.only})")
    names = tuple(a.fit.split(",")) if a.fit else None
    command = "python -m jkernel.calibration " + " ".join(shlex.quote(x) for x in a.argv)
    kernels: dict = {}
    fits = fit_classes(runs, kernels=kernels, names_for=lambda cls, fit_runs: names, log=say,
                       sample=a.sample, max_outer=a.max_outer)
    if not fits:
        raise ValueError(f"{a.runs}: no deployment class has a fit run")
    api = []
    if a.api_server:
        from .fit.api_server import refit_with_api_server

        fits, api = refit_with_api_server(fits, kernels, lambda cls, fit_runs: names,
                                          sample=a.sample, log=say, max_outer=a.max_outer)
    out = Path(a.out)
    name = a.set_name or out.stem
    entries = serving_set(fits, command=command, front_end_hardware=a.front_end_hardware,
                          taken_only=not a.write_all)
    entries += api_server_set(api, command=command, hardware=a.front_end_hardware)
    write_coefficient_set(out, name, entries, header=(
        f"{name}: engine-level constants fitted from serving runs by jkernel's calibration.\n"
        f"Reproduce with: {command}\nEvery entry: method fitted, scoped by chip and engine "
        "version, the deployments it was fitted on (fitted_on), the runs' sha256, held-out "
        "error, standard error."))
    say(f"wrote {len(entries)} entries to {out}")
    rep = _report_paths(out, a.report)
    rep.parent.mkdir(parents=True, exist_ok=True)
    write_text(rep, serving_report(fits, command=command, manifest=str(a.runs)))
    if a.table:
        import pandas as pd

        table = pd.concat([f.table for f in fits], ignore_index=True)
        write_with(a.table, lambda tmp: table.to_csv(tmp, index=False))
    say(f"wrote the report to {rep}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jkernel.calibration",
                                 description="Calibrate jkernel's constants from profiles "
                                             "step traces and serving runs.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profiles", help="fit one chip's primitives from per-operator profiles")
    p.add_argument("--chip", required=True, help="catalog chip name (h100, b200, a100-sxm…)")
    p.add_argument("--data", required=True, help="AIConfigurator data directory")
    p.add_argument("--out", required=True, help="coefficient-set YAML to write")
    p.add_argument("--report", help="Markdown report (default: OUT with .md)")
    p.add_argument("--set-name", help="coefficient set name (default: OUT's stem)")
    p.add_argument("--primitives", help="comma list among gemm, decode_attention, "
                                        "prefill_attention, moe, collectives (default all)")
    p.add_argument("--shape-aware", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--allreduce", choices=("nccl", "vllm"), default="nccl",
                   help="fit all_reduce on NCCL (default) or on vLLM's custom/NCCL composite")
    p.add_argument("--kernel-gap", action="store_true",
                   help="also write the GEMM per-call floor as kernel_gap (default: reported "
                        "only; expected.md leaves kernel_gap to step-trace fits)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--heldout", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rows", type=int, default=200_000,
                   help="deterministic subsample above this many rows (0: all)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_profiles)

    t = sub.add_parser("traces", help="fit parameters against a step trace")
    t.add_argument("--scenario", help="deployment (overrides the trace header's)")
    t.add_argument("--pool", help="pool role or index of a disaggregated deployment")
    t.add_argument("--traces", required=True, help="step trace (JSON Lines)")
    t.add_argument("--fit", required=True, help="comma list of parameter names")
    t.add_argument("--out", required=True, help="coefficient-set YAML to write")
    t.add_argument("--report")
    t.add_argument("--set-name")
    t.add_argument("--target", choices=("expected_s", "no_overlap_s", "overlap_s"),
                   default="expected_s")
    t.add_argument("--steps", type=int, default=400, help="Adam steps")
    t.add_argument("--heldout", type=float, default=0.2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--prior-factor", type=float, default=3.0,
                   help="log-normal prior width around the catalog values (a factor)")
    t.add_argument("--exclude-flags", help="comma list of step flags to leave out")
    t.add_argument("--split", choices=("hash", "time"), default="hash",
                   help="held-out steps: a hash-chosen fraction, or the last fraction in time")
    t.add_argument("--held-trace", action="append",
                   help="another trace of the same deployment, entirely held out (repeatable)")
    t.add_argument("--report-csv", help="per-kind and per-batch-size errors of the held-out "
                                        "traces (CSV)")
    t.add_argument("--hardware", help="scope of the written entries (default the chip)")
    t.add_argument("--scope-model", action="store_true",
                   help="also scope the entries to the deployment's model")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=cmd_traces)

    v = sub.add_parser("serving", help="fit engine-level constants to serving runs")
    v.add_argument("--runs", required=True, help="run manifest (YAML; "
                   "jkernel/calibration/data/serving.py documents the format)")
    v.add_argument("--data", help="folder the manifest's data paths are relative to "
                                  "(default: the manifest's root, else its folder)")
    v.add_argument("--out", required=True, help="coefficient-set YAML to write")
    v.add_argument("--report", help="Markdown report (default: OUT with .md)")
    v.add_argument("--table", help="per-group errors before and after (CSV)")
    v.add_argument("--set-name")
    v.add_argument("--sources", nargs="*", help="only the runs of these sources")
    v.add_argument("--only", nargs="*", help="only these run names")
    v.add_argument("--fit", help="comma list of constants to fit (default: every serving "
                                 "constant the data identify)")
    v.add_argument("--sample", type=int, default=300,
                   help="requests replayed per group after its transient (0: whole runs)")
    v.add_argument("--max-outer", type=int, default=4, help="replays after the first")
    v.add_argument("--front-end-hardware", nargs="*",
                   help="chips the front-end entries apply to (host CPU work; default: the "
                        "fit's chip)")
    v.add_argument("--write-all", action="store_true",
                   help="write every constant the fits identified, also step constants of a "
                        "fit whose ITLs scatter more than the catalog takes (ACCEPT_SIGMA), "
                        "each for its fit's engine version only")
    v.add_argument("--api-server", action="store_true",
                   help="also fit the API server's work per request and per streamed token "
                        "(the queue on its one process, jkernel/calibration/fit/api_server.py) "
                        "by a grid of replays, then refit the serving constants with it")
    v.add_argument("--quiet", action="store_true")
    v.set_defaults(func=cmd_serving)

    i = sub.add_parser("import", help="convert other measurements into a step trace")
    i.add_argument("kind", choices=("splitwise", "aggregate", "timestamps", "residency"))
    i.add_argument("path", nargs="?", help="residency: the run's folder (trace.csv and "
                                           "trace.itl.csv, or a patched/ folder holding them)")
    i.add_argument("--in", dest="input")
    i.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="residency: the engine's token budget per step (chunked prefill)")
    i.add_argument("--out", required=True)
    i.add_argument("--deployment", help="scenario name or bundle path for the trace header")
    i.add_argument("--model", default="llama2-70b")
    i.add_argument("--hardware", default="h100-80gb")
    i.add_argument("--tp", type=int, default=4)
    i.add_argument("--tolerance", type=float, help="timestamp clustering tolerance (s)")
    i.add_argument("--quiet", action="store_true")
    i.set_defaults(func=cmd_import)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    a.argv = argv
    from jkernel.errors import Refusal

    from .data.profiles import ProfileError
    from .data.traces import TraceError
    try:
        return a.func(a)
    except (ProfileError, TraceError, FileNotFoundError, ValueError, Refusal) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
