"""Importers that turn other measurements into step traces (:mod:`calibration.traces`).

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

(b) Streamed token timestamps — :func:`reconstruct_steps` / :func:`from_timestamps`
-----------------------------------------------------------------------------------

Input, per request: ``arrival_s``, ``prompt_tokens`` and ``token_times_s`` (when each output
token was received; the first one ends the prefill). Method:

1. **Cluster** all token events by time. Events are sorted; a new step starts when an event
   is more than ``tolerance_s`` after the first event of the current step, or when its
   request already has a token in the current step (a request emits at most one token per
   step without speculation). ``tolerance_s`` defaults to 0.3 × the median gap between
   consecutive tokens of one request (the typical step time): the tokens of one step arrive
   within streaming jitter, far less than a step apart.
2. **End** of a step: its earliest event (delivery delays only add).
3. **Composition**: the request of token 0 ran its prefill (``scheduled = prompt``,
   ``computed = 0``); the request of token ``j ≥ 1`` ran a decode (``scheduled = 1``,
   ``computed = prompt + j − 1``).
4. **Start**: the previous step's end, unless every request of the step is new and the last
   of them arrived after that end; then the engine was idle and the start is that arrival
   (the step is flagged ``idle_before``; the very first step too). Duration = end − start.
5. **Checks**: a request that emitted tokens before and after a step but none in it
   (``missed_token``) means the clustering or the stream is inconsistent there; such steps
   and steps with a non-positive duration are dropped and counted.

Failure modes (each leaves a count in :class:`Reconstruction` or a flag):

* two steps closer than ``tolerance_s`` with disjoint requests merge into one (rule 1's
  same-request split catches it only when they share a request): durations too long, a step
  missing — keep the tolerance well below the shortest step;
* jitter larger than ``tolerance_s`` splits a step: its requests then look missed in one half
  (``missed_token``, dropped);
* chunked prefill: the chunks before the last emit no token, so their steps are invisible
  and their time is charged to the step that emits token 0 (whose composition lists the
  whole prompt at ``computed = 0``), and other requests' tokens keep coming meanwhile;
* speculative decoding or a server that coalesces several tokens into one chunk: more than
  one token per request per step breaks rule 1 (steps split at every extra token);
* preemption / recomputation: a request stops emitting, then resumes (``missed_token``);
* async scheduling and output processing shift emission after the GPU work by a roughly
  constant lag, which cancels in end − end durations but not in the idle-start rule;
* the first step after an idle gap includes admission and tokenisation between the
  arrival and the GPU work (``idle_before``; exclude it with
  ``fit_trace(..., exclude_flags=("idle_before",))``);
* data-parallel replicas must be reconstructed one stream per replica.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .traces import StepTrace, TraceError


def default_tolerance_s(times: Sequence[np.ndarray]) -> float:
    """How close two token timestamps must be to belong to one engine step, seconds: 0.3 of
    the median gap between a request's consecutive tokens (1 ms when no request has two)."""
    gaps = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.zeros(0)])
    gaps = gaps[gaps > 0]
    return 0.3 * float(np.median(gaps)) if gaps.size else 1e-3


__all__ = ["default_tolerance_s", "from_aggregate", "read_aggregate_csv", "Reconstruction", "reconstruct_steps",
           "from_timestamps", "from_splitwise", "SPLITWISE_MODELS", "SPLITWISE_CHIPS",
           "splitwise_bundle"]


def _trace(deployment, steps: list[dict], *, pool=None, source="", skipped=None,
           sha256="") -> StepTrace:
    if not steps:
        raise TraceError(f"no usable step (skipped: {skipped or {}})")
    arr = lambda k: [np.asarray(s[k], np.int64) for s in steps]  # noqa: E731
    return StepTrace(deployment, arr("scheduled"), arr("computed"), arr("prompt"),
                     np.array([s.get("decode_threshold", 1) for s in steps], np.int64),
                     np.array([s.get("pad", 0) for s in steps], np.int64),
                     np.zeros(len(steps), np.int64),
                     np.array([s["duration_s"] for s in steps], np.float64),
                     [tuple(s.get("flags", ())) for s in steps], pool, source,
                     dict(skipped or {}), None, sha256)


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
    return _trace(deployment, steps, pool=pool, source=source, skipped=skipped)


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

@dataclass
class Reconstruction:
    """Steps rebuilt from token timestamps. ``steps``: dicts with ``scheduled``,
    ``computed``, ``prompt``, ``start_s``, ``end_s``, ``duration_s``, ``flags``,
    ``requests`` (ids); ``dropped``: reason → count; ``tolerance_s`` used."""

    steps: list[dict]
    dropped: dict[str, int]
    tolerance_s: float
    events: int
    clusters: int
    notes: list[str] = field(default_factory=list)


def _get(req, key, default=None):
    return req.get(key, default) if isinstance(req, Mapping) else getattr(req, key, default)


def reconstruct_steps(requests: Sequence[Mapping[str, Any]], *,
                      tolerance_s: float | None = None,
                      decode_threshold: int = 1) -> Reconstruction:
    """Rebuild engine steps from per-request token timestamps (module docstring, (b)).

    Each request: ``arrival_s``, ``prompt_tokens``, ``token_times_s`` (and optionally
    ``id``). Requests with no token are ignored (counted as ``no_tokens``).
    """
    dropped: dict[str, int] = {}
    ids, arrivals, prompts, times = [], [], [], []
    for i, r in enumerate(requests):
        tt = np.asarray(_get(r, "token_times_s", []), dtype=np.float64)
        if tt.size == 0:
            dropped["no_tokens"] = dropped.get("no_tokens", 0) + 1
            continue
        if not np.all(np.isfinite(tt)):
            raise TraceError(f"request {_get(r, 'id', i)!r}: non-finite token time")
        if np.any(np.diff(tt) < 0):
            raise TraceError(f"request {_get(r, 'id', i)!r}: token times go backwards")
        a = float(_get(r, "arrival_s"))
        if not math.isfinite(a) or a > tt[0]:
            raise TraceError(f"request {_get(r, 'id', i)!r}: arrival {a} is not before its "
                             f"first token {tt[0]}")
        p = int(_get(r, "prompt_tokens"))
        if p <= 0:
            raise TraceError(f"request {_get(r, 'id', i)!r}: prompt_tokens must be > 0")
        ids.append(_get(r, "id", i))
        arrivals.append(a)
        prompts.append(p)
        times.append(tt)
    if not times:
        raise TraceError("no request has a token")
    tol = float(default_tolerance_s(times) if tolerance_s is None else tolerance_s)
    ev_t = np.concatenate(times)
    ev_r = np.concatenate([np.full(len(t), k) for k, t in enumerate(times)])
    ev_j = np.concatenate([np.arange(len(t)) for t in times])
    order = np.lexsort((ev_j, ev_r, ev_t))
    ev_t, ev_r, ev_j = ev_t[order], ev_r[order], ev_j[order]
    clusters: list[list[int]] = []
    first_t = None
    members: set[int] = set()
    for e in range(len(ev_t)):
        if clusters and ev_t[e] - first_t <= tol and ev_r[e] not in members:
            clusters[-1].append(e)
            members.add(int(ev_r[e]))
        else:
            clusters.append([e])
            first_t = ev_t[e]
            members = {int(ev_r[e])}
    # per request: the cluster of its first and last token
    n_req = len(times)
    first_c = np.full(n_req, -1)
    last_c = np.full(n_req, -1)
    cluster_of = np.empty(len(ev_t), dtype=int)
    for c, evs in enumerate(clusters):
        for e in evs:
            cluster_of[e] = c
            r = ev_r[e]
            if first_c[r] < 0:
                first_c[r] = c
            last_c[r] = c
    seen = np.zeros((len(clusters),), dtype=object)
    steps = []
    prev_end = None
    for c, evs in enumerate(clusters):
        end = float(ev_t[evs[0]])
        reqs = ev_r[evs]
        js = ev_j[evs]
        running = np.nonzero((first_c < c) & (last_c > c))[0]
        missed = np.setdiff1d(running, reqs)
        new = js == 0
        flags = []
        if prev_end is None:
            start = float(max(arrivals[r] for r in reqs[new])) if new.any() else end
            flags.append("idle_before")
        elif new.all() and max(arrivals[r] for r in reqs) > prev_end:
            start = float(max(arrivals[r] for r in reqs))
            flags.append("idle_before")
        else:
            start = prev_end
        prev_end = end
        if missed.size:
            dropped["missed_token"] = dropped.get("missed_token", 0) + 1
            continue
        dur = end - start
        if not dur > 0:
            dropped["nonpositive_duration"] = dropped.get("nonpositive_duration", 0) + 1
            continue
        s = [prompts[r] if j == 0 else 1 for r, j in zip(reqs, js)]
        cmp = [0 if j == 0 else prompts[r] + j - 1 for r, j in zip(reqs, js)]
        steps.append({"scheduled": s, "computed": cmp, "prompt": [prompts[r] for r in reqs],
                      "start_s": start, "end_s": end, "duration_s": dur, "flags": tuple(flags),
                      "decode_threshold": decode_threshold,
                      "requests": [ids[r] for r in reqs]})
    del seen
    return Reconstruction(steps, dropped, tol, int(len(ev_t)), len(clusters))


def from_timestamps(requests, deployment, *, pool=None, tolerance_s: float | None = None,
                    decode_threshold: int = 1, source: str = ""
                    ) -> tuple[StepTrace, Reconstruction]:
    """A trace rebuilt from streamed token timestamps, and the reconstruction's record."""
    rec = reconstruct_steps(requests, tolerance_s=tolerance_s,
                            decode_threshold=decode_threshold)
    tr = _trace(deployment, rec.steps, pool=pool, source=source,
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
            "coefficients: [cost-model-primitives, cost-model-collectives, "
            "cost-model-host-overheads, cost-model-attention, cost-model-recurrent, "
            "cost-model-memory]\n"
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
    tr = _trace(scenario, steps, source=f"{p} ({model}, {hardware}, tp {tensor_parallel})",
                skipped=skipped, sha256=hashlib.sha256(data).hexdigest())
    tr.file = str(p)
    return tr
