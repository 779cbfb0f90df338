"""Importers that turn other measurements into step traces
(:mod:`jkernel.calibration.data.traces`).

(a) Aggregate forward-pass rows — :func:`from_aggregate`
---------------------------------------------------------

One row per measured forward pass, with only totals: ``batch_size`` (requests in the step),
``prefill_tokens`` (new prompt tokens in the step), ``kv_tokens`` (KV tokens the decode
requests read: the sum over decodes of their context including the new token) and the
latency (``latency_s`` or ``latency_ms``). Optional: ``prefill_requests`` (default 1 when
``prefill_tokens > 0``, else 0), ``prefill_context`` (tokens already cached per prefill,
default 0), ``decode_tokens`` (tokens per decode request, default 1), ``pad``.

The step is rebuilt as the most even batch with those totals: ``P = prefill_requests``
prefills share ``prefill_tokens`` (the first ones take the remainder); the
``D = batch_size − P`` decodes run ``decode_tokens`` each and share the context
``kv_tokens`` (decode read per request is ``computed + scheduled``, step.md §6.3). The
laws that read per-request detail are affected by this choice: the prefill attention FLOPs
(``Σ s²``) assume an even split of the prompt tokens, and a sliding window's ``min(ctx, W)``
assumes even contexts; GEMMs, collectives and full-attention decode reads depend only on the
totals. Rows that cannot be rebuilt are skipped and counted: ``decodes_negative``
(``batch_size < prefill_requests``), ``kv_without_decodes``, ``kv_below_decodes``
(``kv_tokens < D·decode_tokens``), ``empty`` and bad latencies (``latency_*``).

(b) Streamed token timestamps — :func:`from_timestamps`
------------------------------------------------------

Input, per request: ``arrival_s``, ``prompt_tokens`` and ``token_times_s`` (when each output
token was received; the first one ends the prefill), one time per token. The steps are
rebuilt by the one reconstruction of calibration,
:func:`jkernel.calibration.data.timestamps.reconstruct_steps` (its docstring gives the
method and the failure modes), reading a step in which a running request sent nothing as a
missed token (``gap="missed"``: that step is dropped and counted). Exclude the steps after
an idle engine from a fit with ``fit_trace(..., exclude_flags=("idle_before",))``.

(c) Splitwise's whole-step table — :func:`from_splitwise`
---------------------------------------------------------

``splitwise/data/perf_model.csv`` (``Mutinifni/splitwise-sim``, MIT): per model, hardware and
tensor-parallel width, ``batch_size`` prompts of ``prompt_size`` tokens, ``prompt_time``
(ms: the prefill of the whole batch) and ``token_time`` (ms: the mean decode iteration over
``token_size`` output tokens). Each row gives two steps: the prefill (``batch_size`` requests
of ``prompt_size`` new tokens) and a decode step of ``batch_size`` requests at the mean
cached context ``prompt_size + (token_size − 2)/2`` (the decode read is linear in the context,
so the mean iteration is the iteration at the mean context; flag ``mean_decode``). The
deployment is a catalog model on the catalog chip (``llama2-70b`` → ``llama-3.1-70b-instruct``,
the same 80-layer GQA-8 architecture with a larger vocabulary; ``h100-80gb`` → ``h100``,
``a100-80gb`` → ``a100-80``), colocated on one node at the row's tp. BLOOM-176B has no
catalog graph: pass ``scenario=`` to use another. The data comes from an older engine:
trust its shapes more than its levels.
"""

from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from jkernel.catalog import COEFFICIENT_SETS

from .timestamps import Reconstruction, reconstruct_steps
from .traces import StepTrace, TraceError, from_steps

__all__ = ["from_aggregate", "read_aggregate_csv", "from_timestamps", "from_splitwise",
           "SPLITWISE_MODELS", "SPLITWISE_CHIPS", "splitwise_bundle"]


# --------------------------------------------------------------------------------------
# (a) aggregate rows
# --------------------------------------------------------------------------------------

def _num(row: Mapping, key: str, default=None):
    v = row.get(key, default)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(int(parts))]


def from_aggregate(rows: Iterable[Mapping[str, Any]], deployment, *, pool=None,
                   decode_threshold: int = 1, source: str = "") -> StepTrace:
    """A trace from aggregate forward-pass rows (see the module docstring, (a))."""
    steps, skipped = [], {}

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    for row in rows:
        lat = _num(row, "latency_s")
        if lat is None:
            ms = _num(row, "latency_ms")
            lat = None if ms is None else ms * 1e-3
        if lat is None:
            skip("latency_missing")
            continue
        if math.isnan(lat):
            skip("latency_nan")
            continue
        if not math.isfinite(lat):
            skip("latency_inf")
            continue
        if lat <= 0:
            skip("latency_nonpositive")
            continue
        vals = {k: _num(row, k, d) for k, d in (("batch_size", None), ("prefill_tokens", 0.0),
                                               ("kv_tokens", 0.0), ("prefill_requests", None),
                                               ("prefill_context", 0.0),
                                               ("decode_tokens", 1.0), ("pad", 0.0))}
        if vals["batch_size"] is None:
            raise TraceError(f"aggregate row without batch_size: {dict(row)}")
        bad = [k for k, v in vals.items() if v is not None and (not math.isfinite(v) or v < 0
                                                               or v != int(v))]
        if bad:
            skip("counts_invalid")
            continue
        B, PT, K = int(vals["batch_size"]), int(vals["prefill_tokens"]), int(vals["kv_tokens"])
        P = int(vals["prefill_requests"]) if vals["prefill_requests"] is not None \
            else (1 if PT > 0 else 0)
        if P > 0 and PT < P:
            skip("prefill_tokens_below_requests")
            continue
        D = B - P
        dt = max(int(vals["decode_tokens"]), 1)
        if D < 0:
            skip("decodes_negative")
            continue
        if D == 0 and K > 0:
            skip("kv_without_decodes")
            continue
        if D > 0 and K < D * dt:
            skip("kv_below_decodes")
            continue
        if B == 0 and int(vals["pad"]) == 0:
            skip("empty")
            continue
        s, c = [], []
        ctx0 = int(vals["prefill_context"])
        for n in _split(PT, P) if P else []:
            s.append(n)
            c.append(ctx0)
        if D:
            for ctx in _split(K, D):
                s.append(dt)
                c.append(ctx - dt)
        steps.append({"scheduled": s, "computed": c, "prompt": [a + b for a, b in zip(s, c)],
                      "duration_s": lat, "decode_threshold": decode_threshold,
                      "pad": int(vals["pad"]), "flags": ("aggregate",)})
    return from_steps(deployment, steps, pool=pool, source=source, skipped=skipped)


def read_aggregate_csv(path: str | Path, deployment, **kw) -> StepTrace:
    """:func:`from_aggregate` over a CSV file with those column names."""
    p = Path(path)
    data = p.read_bytes()
    rows = list(csv.DictReader(data.decode("utf-8").splitlines()))
    tr = from_aggregate(rows, deployment, source=kw.pop("source", str(p)), **kw)
    tr.file, tr.sha256 = str(p), hashlib.sha256(data).hexdigest()
    return tr


# --------------------------------------------------------------------------------------
# (b) streamed token timestamps
# --------------------------------------------------------------------------------------

def from_timestamps(requests, deployment, *, pool=None, tolerance_s: float | None = None,
                    decode_threshold: int = 1, source: str = ""
                    ) -> tuple[StepTrace, Reconstruction]:
    """A trace rebuilt from streamed token timestamps (module docstring, (b)), and the
    reconstruction's record."""
    rec = reconstruct_steps(requests, tolerance_s=tolerance_s, gap="missed",
                            decode_threshold=decode_threshold)
    tr = from_steps(deployment, rec.steps, pool=pool, source=source,
                skipped={f"reconstruction_{k}": v for k, v in rec.dropped.items()})
    return tr, rec


# --------------------------------------------------------------------------------------
# (c) Splitwise perf_model.csv
# --------------------------------------------------------------------------------------

#: Splitwise model → catalog model.
SPLITWISE_MODELS = {"llama2-70b": "llama-3.1-70b-instruct"}
#: Splitwise hardware → catalog chip.
SPLITWISE_CHIPS = {"h100-80gb": "h100", "a100-80gb": "a100-80", "h100-80gb-pcap": "h100"}


def splitwise_bundle(model: str, chip: str, tp: int) -> str:
    """YAML text of a colocated one-node bundle for ``model`` on ``chip`` at ``tp``."""
    name = f"splitwise-{model}-{chip}-tp{tp}"
    return (f"kind: Scenario\nname: {name}\nmodel: {model}\n"
            f"coefficients: [{', '.join(COEFFICIENT_SETS)}]\n"
            f'engine_version: "0.31.0"\ncluster:\n  hardware: {chip}\n  nodes: 1\n'
            f"  gpus_per_node: {tp}\n---\nkind: Deployment\nname: {name}\npools:\n"
            f"  - role: colocated\n    nodes: 1\n    parallel: {{tp: {tp}, pp: 1, dp: 1}}\n")


def from_splitwise(path: str | Path, *, model: str = "llama2-70b",
                   hardware: str = "h100-80gb", tensor_parallel: int = 4,
                   scenario=None, include: Sequence[str] = ("prefill", "decode")) -> StepTrace:
    """Steps of Splitwise's ``perf_model.csv`` for one model, hardware and tp (module
    docstring, (c)). ``scenario``: a deployment to use instead of the default mapping."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read {p}: {exc}", file=str(p)) from exc
    rows = list(csv.DictReader(data.decode("utf-8").splitlines()))
    need = ("model", "hardware", "tensor_parallel", "batch_size", "prompt_size", "token_size",
            "prompt_time", "token_time")
    missing = [c for c in need if rows and c not in rows[0]]
    if not rows or missing:
        raise TraceError(f"not a Splitwise perf_model table (missing columns {missing})",
                         file=str(p))
    if scenario is None:
        if model not in SPLITWISE_MODELS or hardware not in SPLITWISE_CHIPS:
            raise TraceError(f"no catalog deployment for model {model!r} on {hardware!r} "
                             f"(known: {sorted(SPLITWISE_MODELS)} on {sorted(SPLITWISE_CHIPS)}); "
                             "pass scenario=", file=str(p))
        scenario = splitwise_bundle(SPLITWISE_MODELS[model], SPLITWISE_CHIPS[hardware],
                                    int(tensor_parallel))
    steps, skipped = [], {}
    picked = [r for r in rows if r["model"] == model and r["hardware"] == hardware
              and int(float(r["tensor_parallel"])) == int(tensor_parallel)]
    if not picked:
        raise TraceError(f"no rows for {model} on {hardware} at tp {tensor_parallel}",
                         file=str(p))
    for r in picked:
        b, ps, ts = int(float(r["batch_size"])), int(float(r["prompt_size"])), \
            int(float(r["token_size"]))
        for kind, key in (("prefill", "prompt_time"), ("decode", "token_time")):
            if kind not in include:
                continue
            try:
                ms = float(r[key])
            except ValueError:
                ms = float("nan")
            if not math.isfinite(ms) or ms <= 0:
                skipped[f"{key}_invalid"] = skipped.get(f"{key}_invalid", 0) + 1
                continue
            if kind == "prefill":
                s, c, flags = [ps] * b, [0] * b, ("splitwise_prefill",)
            else:
                ctx = ps + max(ts - 2, 0) // 2
                s, c, flags = [1] * b, [ctx] * b, ("mean_decode",)
            steps.append({"scheduled": s, "computed": c, "prompt": [ps] * b,
                          "duration_s": ms * 1e-3, "flags": flags})
    tr = from_steps(scenario, steps, source=f"{p} ({model}, {hardware}, tp {tensor_parallel})",
                skipped=skipped, sha256=hashlib.sha256(data).hexdigest())
    tr.file = str(p)
    return tr
