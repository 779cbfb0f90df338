"""Coefficient-set writing: the entries a calibration writes, in the catalog's format.

Every written value becomes an entry of the catalog's format (documents.md §8, read by
:mod:`jkernel.documents.coefficients`), in registry units (:func:`jkernel.params.si_scale`),
``method: fitted``, ``fitted: true``, scoped by hardware, with:

* ``sources``: the data file(s) (path relative to the data directory; kind ``vendor_doc``
  for NVIDIA's profile tables, ``model`` for a trace fit or a derivation);
* ``data_sha256``: the SHA-256 of those files (``;``-joined when several);
* ``rows``: the rows (or steps) of the fit and held-out parts together;
* ``heldout_error``: ``{metric: abs_log_ratio, median, p90, rows}`` of the slice the entry
  describes (its dtype, kind, or collective key);
* ``standard_error`` and ``ci95`` (Gauss–Newton, :mod:`jkernel.calibration.fit.uncertainty`)
  when the data identifies the value, else ``identifiable: false`` and no standard error;
* a ``rationale`` naming the law, the fit and the command that reproduces it.

Values are rounded to 6 significant digits. :data:`SET_OF` says which of the standard sets
(:data:`jkernel.catalog.COEFFICIENT_SETS`) a name is written to; :func:`catalog_yaml` is the
one YAML writer of the package.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import yaml

from jkernel.atomic import write_text
from jkernel.documents.coefficients import (CoefficientSet, Entry, FittedOn, Scope,
                                            VersionRange, coefficient_set_to_dict)
from jkernel.params import si_scale

from ..fit.chip import ChipFit
from ..fit.stepfit import STEP_CONSTANTS

__all__ = ["SET_OF", "LAWS", "set_for", "units_for", "round_sig", "make_entry",
           "profile_entries", "trace_entries", "step_entries", "serving_entries", "serving_set",
           "api_server_entries", "api_server_set",
           "SERVING_METRIC", "catalog_yaml", "CatalogDumper", "coefficient_set",
           "write_coefficient_set"]

#: Which of the standard sets (:data:`jkernel.catalog.COEFFICIENT_SETS`) a coefficient is
#: written to, by name prefix.
SET_OF = (("collective_", "cost-model-collectives"), ("attention_", "cost-model-attention"),
          ("recurrent_", "cost-model-recurrent"), ("host_", "cost-model-host-overheads"),
          ("kernel_gap", "cost-model-host-overheads"),
          ("host_serial", "cost-model-host-overheads"),
          ("gemm_", "cost-model-primitives"), ("hbm_derate", "cost-model-primitives"),
          ("moe_", "cost-model-primitives"), ("nccl_", "cost-model-memory"),
          ("activation_", "cost-model-memory"), ("cudagraph_", "cost-model-memory"),
          ("engine_workspace", "cost-model-memory"))

_UNITS = (("collective_floor", "us_per_transfer"), ("collective_", "bytes_per_us"),
          ("attention_", "us_per_layer"), ("recurrent_decode_floor", "us_per_layer"),
          ("recurrent_decode_rate", "tokens"), ("gemm_m_half", "tokens"),
          ("host_admission_per_request", "us_per_request"),
          ("host_admission_per_token", "us_per_token"), ("host_output_token", "us_per_token"),
          ("host_completion", "us_per_request"),
          ("host_api_server_per_request", "us_per_request"),
          ("host_api_server_per_token", "us_per_token"),
          ("host_launch_eager_per_layer", "us_per_layer"),
          ("host_replay_graph_per_step", "us_per_step"),
          ("host_launch_per_kernel", "us_per_transfer"), ("kernel_gap", "us_per_transfer"),
          ("host_serial_per_request", "us_per_request"),
          ("host_serial", "us_per_step"), ("host_link_bandwidth", "bytes_per_us"),
          ("moe_kernel_floor", "us_per_layer"), ("moe_assignment_time", "us_per_token"),
          ("moe_m_half", "tokens"))



class CatalogDumper(yaml.SafeDumper):
    """The catalog's YAML style: block maps, inline lists of scalars and small maps (scopes,
    sources, error summaries); used by every writer of catalog coefficient sets."""

    def ignore_aliases(self, data):
        return True


def _repr_list(dumper, data):
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _repr_dict(dumper, data):
    flow = set(data) <= {"hardware", "model", "tp", "ep", "nodes_spanned", "kind", "cite",
                         "role", "metric", "median", "p90", "rows", "engine_version", "from",
                         "before"} and all(not isinstance(v, dict) for v in data.values())
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


CatalogDumper.add_representer(list, _repr_list)
CatalogDumper.add_representer(dict, _repr_dict)


def set_for(name: str) -> str:
    """The standard coefficient set a name belongs to."""
    for prefix, s in SET_OF:
        if name.startswith(prefix):
            return s
    return "cost-model-primitives"


def units_for(name: str) -> str:
    """The registry ``units`` of a coefficient name (as the shipped catalog writes them)."""
    if name.startswith("attention_") and "_rate" in name:
        return "bytes_per_us"
    if name in ("attention_prefill_work_scale", "attention_decode_overlap"):
        return "dimensionless"
    if name == "attention_decode_row_floor":
        return "us_per_request"
    for prefix, u in _UNITS:
        if name.startswith(prefix):
            return u
    return "dimensionless"


def round_sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (ints stay floats)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


def make_entry(name: str, si_value: float, *, hardware: Sequence[str], cite: str, sha256: str,
               rows: int, heldout: Mapping | None, se_si: float | None,
               ci_si: tuple[float, float] | None, identifiable: bool, rationale: str,
               method: str = "fitted", units: str | None = None,
               source_kind: str = "model", engine_version: VersionRange | None = None,
               fitted_on: FittedOn | None = None) -> Entry:
    """One coefficient entry in registry units (see the module docstring). ``source_kind``
    is one of the blis-schemas source kinds (``vendor_doc`` for NVIDIA's published profile
    tables, ``model`` for a fit or a derivation); ``engine_version`` scopes it to a range of
    engine versions, ``fitted_on`` records the deployments of its data."""
    scale = si_scale(name)
    value = round_sig(si_value / scale)
    extra: list[tuple[str, object]] = [("data_sha256", sha256), ("rows", int(rows))]
    if heldout is not None:
        extra.append(("heldout_error", tuple(heldout.items())))
    ci = None
    if identifiable and se_si is not None:
        extra.append(("standard_error", round_sig(se_si / scale, 4)))
        if ci_si is not None:
            lo, hi = round_sig(ci_si[0] / scale), round_sig(ci_si[1] / scale)
            if lo <= value <= hi:
                ci = (lo, hi)
    extra.append(("identifiable", bool(identifiable)))
    return Entry(name, value, units or units_for(name), method, method in ("fitted",),
                 Scope(hardware=tuple(hardware), engine_version=engine_version), ci,
                 ((("kind", source_kind), ("cite", cite), ("role", "primary")),),
                 rationale, None, tuple(extra), fitted_on)


def profile_entries(chip_fit: ChipFit, *, hardware: Sequence[str] | None = None,
                    command: str | None = None) -> list[Entry]:
    """The entries of a chip's profile fit, in primitive order."""
    hw = tuple(hardware or (chip_fit.chip,))
    cmd = command or (f"python -m jkernel.calibration profiles --chip {chip_fit.chip} "
                      "--data <aic-op-profiles>")
    out = []
    for f in chip_fit.fits:
        for name, value in f.written.items():
            lap = f.laplace
            ok = bool(lap.identifiable.get(name, True)) if lap is not None else True
            row = f.error(f.entry_slice.get(name, ""))
            heldout = row.held.to_dict() if row is not None and row.held.rows else None
            cite = f"NVIDIA AIConfigurator per-operator profiles: {f.source}"
            rationale = (f"Fitted by jkernel calibration ({f.primitive}, {cmd}): the law of "
                         f"{LAWS.get(f.primitive, f.primitive)}, robust soft-L1 loss on "
                         f"log(predicted/measured), Adam in log/logit space, "
                         f"{f.rows_fit} fit rows and {f.rows_held} held-out rows split by "
                         "shape.")
            if not ok:
                rationale += (" The data does not identify this value"
                              f" ({lap.reason.get(name, '')}); "
                              + _UNIDENTIFIED.get(f.primitive, "it is the optimiser's value."))
            out.append(make_entry(
                name, value, hardware=hw, cite=cite, sha256=f.sha256,
                rows=f.rows_fit + f.rows_held, heldout=heldout,
                se_si=lap.se_value.get(name) if lap is not None else None,
                ci_si=lap.ci95.get(name) if lap is not None else None, identifiable=ok,
                rationale=rationale, source_kind="vendor_doc"))
    return out


#: The law of each primitive, as the entries' rationales and the reports name it.
LAWS = {
    "gemm": "a GEMM kernel in expected_s's per-kernel form, max(2mnk/(P·ε(m,n,k)), "
            "(weights + m(n+k)·2)/(B·hbm_derate)) + kernel_gap (a per-call floor, written only "
            "on request)",
    "decode_attention": "decode attention, floor + p-norm of (KV bytes/rate, rows·row floor), "
                        "floor and rate per kind, row floor and overlap order shared",
    "prefill_attention": "prefill attention, floor + causal FLOPs/(P·ramp(tokens)·work scale)",
    "moe_imbalance": "routed experts as the edges price them (step.md §6.2), "
                     "max(FLOPs·imbalance/(P·ramp(tokens)), expert bytes/(B·derate)) plus a "
                     "per-call floor that is not written",
    "moe": "a fused-MoE layer's routed experts as expected_s prices them, floor(dtype) + max(FLOPs·imbalance/(P·ε(tokens "
           "per expert)), touched expert bytes/(B·derate)) + assignments·time per assignment",
    "collectives": "the collective law max(t0 + b/r_t, b/r_peak)",
}
_UNIDENTIFIED = {
    "collectives": "no measured message is bound by the peak rate, so the value written is "
                   "max(transition, best measured throughput), which changes no prediction "
                   "on the data.",
}


def trace_entries(fit, *, hardware: Sequence[str], model: Sequence[str] | None = None,
                  command: str | None = None) -> list[Entry]:
    """Entries of a step-trace fit (:class:`jkernel.calibration.fit.traces.TraceFit`): the
    identifiable
    fitted names only (the others stay at their catalog values)."""
    out = []
    held = [e for e in fit.errors if e[0] == "held-out" and e[1] == "fitted"]
    heldout = held[0][2].to_dict() if held else None
    cite = f"step trace {fit.trace_file or '(in memory)'}"
    for name in fit.names:
        lap = fit.laplace
        if not lap.identifiable[name]:
            continue
        cmd = command or "python -m jkernel.calibration traces"
        rationale = (f"Fitted by jkernel calibration from a step trace ({cmd}): jax.grad of "
                     f"{fit.target} over "
                     f"{fit.steps_fit} steps with log-normal priors at the catalog values "
                     f"(fitted together: {', '.join(fit.names)}).")
        e = make_entry(name, fit.values[name], hardware=hardware, cite=cite,
                       sha256=fit.trace_sha256, rows=fit.steps_fit + fit.steps_held,
                       heldout=heldout, se_si=lap.se_value[name], ci_si=lap.ci95[name],
                       identifiable=True, rationale=rationale)
        if model:
            e = Entry(e.name, e.value, e.units, e.method, e.fitted,
                      Scope(hardware=tuple(hardware), model=tuple(model)), e.ci95, e.sources,
                      e.rationale, e.copied_from, e.extra)
        out.append(e)
    return out


def step_entries(cal, *, hardware: Sequence[str], cite: str, command: str,
                 engine_version: VersionRange | None = None,
                 fitted_on: FittedOn | None = None) -> list[Entry]:
    """Catalog entries of a :class:`jkernel.calibration.fit.stepfit.StepCalibration`: the fitted
    engine-level constants with their data, fit, standard error and the held-out errors
    before and after (``cite``: the measured runs; ``command``: how to reproduce;
    ``engine_version``, ``fitted_on``: see :func:`make_entry`)."""
    fit = cal.fit
    held = [e for e in fit.errors if e[0] == "held-out" and e[1] == "fitted"]
    heldout = held[0][2].to_dict() if held else None
    after = [s for s in cal.summaries if s["when"] == "after"]
    figures = "; ".join(f"{s['part']}: decode {s['decode']:.3f}, prefill {s['prefill']:.3f}, "
                        f"decode slope {s['slope_ratio']:.3f}× measured" for s in after)
    unid = ", ".join(sorted(cal.not_identified))
    out = []
    for name in fit.names:
        lap = fit.laplace
        if not lap.identifiable[name]:
            continue
        rationale = (f"Engine-level constant of vLLM on this chip fitted from measured whole "
                     f"steps ({cite}); {STEP_CONSTANTS.get(name, name)}. Fit: {command} "
                     f"(jax.grad of {fit.target} over {fit.steps_fit} steps, the first 70 % in "
                     f"time, log-normal priors, fitted together with "
                     f"{', '.join(n for n in fit.names if n != name)}; held out: the last 30 % "
                     f"and a second run). Held-out median |log ratio| after: {figures}. Not "
                     f"identified by these steps, so left at their profile values: {unid}. "
                     "Transfers across models on the same chip and engine: it measures the "
                     "engine and the chip, not the model (docs/calibrate.md).")
        out.append(make_entry(name, fit.values[name], hardware=hardware, cite=cite,
                              sha256=fit.trace_sha256, rows=fit.steps_fit + fit.steps_held,
                              heldout=heldout, se_si=lap.se_value[name], ci_si=lap.ci95[name],
                              identifiable=True, rationale=rationale,
                              engine_version=engine_version, fitted_on=fitted_on))
    return out


def _abs_log_errors(table, metric: str, split: str) -> dict | None:
    """``{metric: abs_log_ratio, median, p90, rows}`` of ``metric`` after the fit over the
    groups of ``split`` (None when there are none)."""
    import numpy as np

    t = table[table["split"] == split] if len(table) else table
    if not len(t):
        return None
    r = np.abs(np.log(t[f"{metric}_after"].to_numpy(float) / t[f"{metric}_measured"]
                      .to_numpy(float)))
    r = r[np.isfinite(r)]
    if not r.size:
        return None
    return {"metric": "abs_log_ratio", "median": round_sig(float(np.median(r)), 4),
            "p90": round_sig(float(np.percentile(r, 90)), 4), "rows": int(r.size)}


#: The group metric each serving constant acts on most (its entry's held-out error).
SERVING_METRIC = {"host_admission_per_request": "ttft_mean",
                  "host_admission_per_token": "ttft_mean", "host_serial": "itl_mean",
                  "host_serial_per_request": "itl_mean", "compute_derate": "itl_mean"}


def serving_set(fits, *, command: str, front_end_hardware: Sequence[str] | None = None,
                taken_only: bool = True, step_traced: Sequence = ()) -> list[Entry]:
    """The entries of several serving fits (:func:`serving_entries`): what the catalog takes
    of each (:meth:`~jkernel.calibration.fit.serving.ServingFit.taken`; every identified
    constant with ``taken_only`` False), each scoped to the engine versions its fit stands
    for: per constant and chip, the fitted versions split the versions at the boundaries of
    :mod:`jkernel.calibration.fit.serving`
    (:func:`~jkernel.calibration.fit.serving.version_ranges`). ``step_traced``: deployment
    classes whose step constants step traces measured; their versions bound the serving
    fits' step constants on the same chip as a fitted version would."""
    chosen = {id(f): (f.taken() if taken_only else f.names) for f in fits}
    import hashlib

    from ..fit.serving import FRONT_END, FRONT_END_BOUNDARIES, STEP_BOUNDARIES, version_ranges

    versions: dict = {}
    for fit in fits:
        for name in chosen[id(fit)]:
            versions.setdefault((name, fit.cls.hardware), []).append(fit.cls.engine_version)
    for key in list(versions):
        if key[0] not in FRONT_END:
            versions[key] += [c.engine_version for c in step_traced if c.hardware == key[1]]
    out = []
    for fit in fits:
        if not chosen[id(fit)]:
            continue
        sha = hashlib.sha256(";".join(sorted(r.sha256 for r in fit.runs)).encode()).hexdigest()
        ranges = {name: version_ranges(versions[(name, fit.cls.hardware)],
                                       FRONT_END_BOUNDARIES if name in FRONT_END
                                       else STEP_BOUNDARIES)[fit.cls.engine_version]
                  for name in chosen[id(fit)]}
        out += serving_entries(fit, command=command, sha256=sha, hardware=front_end_hardware,
                               engine_versions=ranges, names=chosen[id(fit)])
    return out


def serving_entries(fit, *, command: str, sha256: str, hardware: Sequence[str] | None = None,
                    engine_versions: Mapping | None = None,
                    names: Sequence[str] | None = None) -> list[Entry]:
    """Catalog entries of a :class:`jkernel.calibration.fit.serving.ServingFit`: each
    constant the fit identified, with its value, standard error and 95 % interval (Laplace),
    the held-out error of the group metric it acts on, the runs it was fitted on and the
    command. Step constants are scoped to the fit's chip; front-end constants (host CPU
    work) to ``hardware`` when given, else the chip; each to ``engine_versions[name]`` when
    given. ``fitted_on`` records the fit runs' chip, engine version, models and tp."""
    from ..fit.serving import FRONT_END, SERVING_CONSTANTS

    runs = fit.runs
    cite = (f"{len(runs)} serving runs ({', '.join(sorted({r.source for r in runs}))}): "
            + "; ".join(f"{d['run']} ({d['model']}, tp {d['tp']})" for d in fit.deployments)
            + f"; {fit.cls}")
    rows = int(sum(g.requests for r in runs for g in r.groups if r.fit_on))
    lap = fit.laplace
    offsets = ", ".join(f"{m} {v:+.3f}" for m, v in sorted(fit.offsets.items()))
    frozen = "; ".join(f"{n}: {why}" for n, why in fit.frozen.items()) or "none"
    fitted_on = FittedOn(hardware=(fit.cls.hardware,), engine_version=(fit.cls.engine_version,),
                         model=tuple(sorted({d["model"] for d in fit.deployments})),
                         tp=tuple(sorted({int(d["tp"]) for d in fit.deployments})))
    out = []
    for name in (fit.names if names is None else names):
        metric = SERVING_METRIC.get(name, "itl_mean")
        held = _abs_log_errors(fit.table, metric, "held-out")
        rationale = (f"Engine-level constant fitted from serving runs ({cite}): "
                     f"{SERVING_CONSTANTS[name]}. Fit: {command} (the fixed point of the "
                     f"replay, jax.jacfwd of the groups' mean TTFT and ITL through expected_s "
                     f"and the front end's overheads, Cauchy loss, log-normal priors, a "
                     f"backtracking line search on the replay; {fit.replays} replays; fitted "
                     f"together with {', '.join(n for n in fit.names if n != name) or 'nothing'};"
                     f" models' step offsets (nuisance, log): {offsets or 'none'}). Not fitted: "
                     f"{frozen}." + (f" Not pinned, kept: {fit.loose[name]}."
                                     if name in fit.loose else "")
                     + f" Held-out groups: the {metric.replace('_', ' ')} error "
                     "after the fit (heldout_error).")
        e = make_entry(name, fit.values[name], hardware=(
            tuple(hardware) if (hardware and name in FRONT_END) else (fit.cls.hardware,)),
            cite=cite, sha256=sha256, rows=rows, heldout=held,
            se_si=lap.se_value.get(name) if lap is not None else None,
            ci_si=lap.ci95.get(name) if lap is not None else None,
            identifiable=bool(lap is not None and lap.identifiable.get(name, False)),
            rationale=rationale, fitted_on=fitted_on,
            engine_version=(engine_versions or {}).get(name))
        out.append(e)
    return out


def coefficient_set(name: str, entries: Iterable[Entry]) -> CoefficientSet:
    return CoefficientSet(name, tuple(entries))


def catalog_yaml(doc) -> str:
    """The one YAML writer of the package: ``doc`` (a mapping, or a
    :class:`~jkernel.documents.coefficients.CoefficientSet`) in the catalog's style
    (:class:`CatalogDumper`)."""
    if isinstance(doc, CoefficientSet):
        doc = coefficient_set_to_dict(doc)
    return yaml.dump(doc, Dumper=CatalogDumper, sort_keys=False, width=100, allow_unicode=True)


def write_coefficient_set(path: str | Path, name: str, entries: Iterable[Entry], *,
                          header: str = "") -> Path:
    """Write a coefficient set (YAML, the catalog's format) with an optional comment header."""
    p = Path(path)
    text = catalog_yaml(coefficient_set(name, entries))
    if header:
        text = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + text
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text(p, text)
    return p


def api_server_entries(fit, serving_fit, *, command: str, hardware: Sequence[str],
                       engine_version: VersionRange | None) -> list[Entry]:
    """The two entries of an :class:`~jkernel.calibration.fit.api_server.ApiServerFit` of
    one deployment class (``serving_fit``, the class's
    :class:`~jkernel.calibration.fit.serving.ServingFit`, names its runs): the work kept,
    ``method: fitted``, or 0, ``method: not_charged``, where none is kept (the rationale
    says why); host CPU work, so scoped to every chip in ``hardware`` and to the class's
    ``engine_version`` range."""
    import hashlib

    runs = fit.runs
    sha = hashlib.sha256(";".join(sorted(r.sha256 for r in runs)).encode()).hexdigest()
    cite = (f"{len(runs)} serving runs ({', '.join(sorted({r.source for r in runs}))}): "
            + "; ".join(r.name for r in runs) + f"; {serving_fit.cls}")
    rows = int(sum(g.requests for r in runs for g in r.groups))
    fitted_on = FittedOn(hardware=(serving_fit.cls.hardware,),
                         engine_version=(serving_fit.cls.engine_version,),
                         model=tuple(sorted({d["model"] for d in serving_fit.deployments})),
                         tp=tuple(sorted({int(d["tp"]) for d in serving_fit.deployments})))
    stat, crit = fit.test
    what = {"host_api_server_per_request": "the API server process's time on one request's "
                                           "admission (HTTP and JSON, chat template, "
                                           "tokenisation), part of the front end's delay",
            "host_api_server_per_token": "the API server process's time on one streamed "
                                         "token (detokenisation, the response chunk)"}
    out = []
    for name, value in (("host_api_server_per_request", fit.per_request_s),
                        ("host_api_server_per_token", fit.per_token_s)):
        ci = fit.ci95.get(name)
        verdict = (f"kept: the groups reject no work (likelihood ratio {stat:.1f} against "
                   f"χ²(2) {crit:.1f})" if fit.kept else
                   f"0: not fitted ({fit.reason}), so the server never queues here"
                   if fit.reason else
                   f"0: the groups do not reject no work (likelihood ratio {stat:.1f} "
                   f"against χ²(2) {crit:.1f}), so the server never queues here")
        rationale = (f"{what[name]}, which the replay queues on one process per pool "
                     f"(jkernel.replay.sim). Fitted derivative-free from serving runs ({cite}) "
                     f"by {command}: a grid replayed on the fit runs at the serving fit's "
                     f"constants, every group's mean TTFT and the fitted ITLs, a Cauchy "
                     f"likelihood with each metric's scale profiled out "
                     f"(jkernel.calibration.fit.api_server); {fit.replays} replays. "
                     f"{verdict}." + (" Interval: the grid profile (as coarse as the grid); "
                                      "the serving constants were then refitted with this "
                                      "work in the replay." if fit.kept else ""))
        se = (ci[1] - ci[0]) / 3.92 if (fit.kept and ci is not None) else None
        # a time the fit leaves at 0 is written as not charged (the catalog's only 0)
        out.append(make_entry(name, value, hardware=tuple(hardware), cite=cite, sha256=sha,
                              rows=rows, heldout=None, se_si=se, ci_si=ci,
                              identifiable=bool(fit.kept and ci is not None),
                              rationale=rationale, engine_version=engine_version,
                              fitted_on=fitted_on,
                              method="fitted" if value > 0 else "not_charged"))
    return out


def api_server_set(pairs, *, command: str, hardware: Sequence[str] | None) -> list[Entry]:
    """The entries of every ``(serving fit, ApiServerFit)`` pair
    (:func:`jkernel.calibration.fit.api_server.refit_with_api_server`): per class, its two
    entries scoped to the engine versions its fit stands for (split at the front end's
    boundaries, as the front end's entries are) and to every chip in ``hardware`` (the
    class's chip when None)."""
    from ..fit.serving import FRONT_END_BOUNDARIES, version_ranges

    ranges = version_ranges([f.cls.engine_version for f, _ in pairs], FRONT_END_BOUNDARIES)
    out: list[Entry] = []
    for f, a in pairs:
        out += api_server_entries(a, f, command=command,
                                  hardware=tuple(hardware) if hardware else (f.cls.hardware,),
                                  engine_version=ranges[f.cls.engine_version])
    return out
