"""Benchmark clients' per-request results as requests *and* measurements.

:func:`read_benchmark` reads one result file of a common benchmark client into a
:class:`BenchmarkRun`: the request table to replay (validated by
:func:`~jkernel.replay.validate_requests`), the measured per-request timings (a
:class:`~jkernel.replay.metrics.Timings` aligned with the table's rows), how the client sent
the requests (:class:`~jkernel.replay.Clients` and the schedule) and the aggregates the file
itself reports. The formats, and the version of each followed (tests/data/README.md):

======================  ===============================================================
vLLM ``bench serve``    ``--save-result --save-detailed`` JSON (``vllm/benchmarks/serve.py``):
                        ``input_lens``, ``output_lens``, ``ttfts``, ``itls``,
                        ``latencies``, ``errors``, ``start_times``, ``queue_times``;
                        ``request_rate``, ``burstiness``, ``max_concurrency``
guidellm 0.2            report JSON, ``benchmarks[].requests.successful[]`` of
                        ``generative_text_response`` (``start_time``, ``end_time``,
                        ``first_token_time``, ``last_token_time``, ``prompt_tokens``,
                        ``output_tokens``); ``args.strategy``
guidellm ≥ 0.4          report JSON with ``metadata.version`` 2 (followed at 0.7.3):
                        ``benchmarks[].requests.successful[]`` of
                        ``generative_request_stats`` (``info.timings.request_start``,
                        ``first_token_iteration``, ``last_token_iteration``,
                        ``request_end``, ``prompt_tokens``, ``output_tokens``);
                        ``config.strategy``
inference-perf          ``per_request_lifecycle_metrics.json``: ``start_time``,
                        ``end_time``, ``info`` (0.2: ``input_tokens``,
                        ``output_tokens``, ``output_token_times``; 0.6: also
                        ``request_metrics.text.input_tokens`` and
                        ``response_metrics.{output_tokens, output_token_times}``),
                        ``error``
llm-d lmbench CSV       ``request_id, arrival_time_us, input_tokens, output_tokens,
                        ttft_us, e2e_us`` (``../shared/data/serving-runs/llm-d-lmbench``)
======================  ===============================================================

How the requests are sent again: a client that held a concurrency (vLLM
``max_concurrency``, guidellm ``concurrent``/``synchronous``/``throughput`` with a
``max_concurrency``) is replayed by as many closed-loop clients, each request sent no earlier
than its schedule (vLLM: ``start_times − queue_times``; ``request_rate`` inf: all at 0);
otherwise each request is sent when the client sent it (``start_times``, ``start_time``,
``request_start``, ``arrival_time_us``). A request that failed is not replayed (its answer
length is unknown) and is counted in :attr:`BenchmarkRun.failed`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .clients import Clients
from .metrics import METRICS, Metric, Timings, Tool
from .workload import validate_requests

__all__ = ["BenchmarkRun", "BenchmarkFormatError", "Reported", "read_benchmark", "FORMATS"]

#: The formats read, as a refusal lists them.
FORMATS = ("vLLM bench serve --save-result --save-detailed JSON",
           "guidellm report JSON (0.2, or metadata.version 2 of 0.4+)",
           "inference-perf per_request_lifecycle_metrics.json",
           "llm-d lmbench CSV (request_id, arrival_time_us, input_tokens, output_tokens, "
           "ttft_us, e2e_us)")


class BenchmarkFormatError(ValueError):
    """A result file that is not one of :data:`FORMATS`, or is missing what the replay
    needs: names the file, the field and what is allowed."""

    def __init__(self, file: str, field: str | None, reason: str, allowed: str):
        self.file, self.field, self.allowed = file, field, allowed
        where = f"{file}: " + (f"{field}: " if field else "")
        super().__init__(f"{where}{reason}; allowed: {allowed}")


class Reported(NamedTuple):
    """An aggregate the result file itself reports: ``metric``'s ``stat`` (``mean``,
    ``p50``, ``p90``, ``p99`` or ``value``) in the metric's unit."""

    metric: Metric
    stat: str
    value: float


@dataclass(frozen=True)
class BenchmarkRun:
    """One benchmark client's run, read back.

    Attributes:
      tool: whose format (and metric definitions) it is.
      version: the format version recognised, in words.
      requests: the request table to replay (validated; arrival order).
      measured: the measured timings, one entry per row of ``requests``.
      clients: how the client sent the requests (closed loop where it held a concurrency).
      failed: requests the client recorded as failed (not replayed).
      reported: the aggregates the file reports (for a cross-check of the definitions).
      source: the file.
    """

    tool: Tool
    version: str
    requests: pd.DataFrame
    measured: Timings
    clients: Clients = field(default_factory=Clients)
    failed: int = 0
    reported: tuple = ()
    source: str = ""


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def _build(tool: Tool, version: str, path: str, rows: dict[str, np.ndarray], gaps,
           clients: Clients, failed: int, reported=()) -> BenchmarkRun:
    """Validate the request table and align the measured timings with its rows."""
    n = len(rows["request_id"])
    if n == 0:
        raise BenchmarkFormatError(path, None, "no successful request to replay",
                                   "a run with at least one completed request")
    df = pd.DataFrame({"request_id": rows["request_id"], "arrival_s": rows["arrival_s"],
                       "input_tokens": rows["input_tokens"],
                       "output_tokens": rows["output_tokens"], "_row": np.arange(n)})
    df = validate_requests(df, source=path)
    order = df["_row"].to_numpy()
    df = df.drop(columns="_row")
    df.attrs["source"] = path
    t = Timings(start_s=rows["start_s"][order], first_token_s=rows["first_s"][order],
                last_token_s=rows["last_s"][order], end_s=rows["end_s"][order],
                input_tokens=df["input_tokens"].to_numpy(),
                output_tokens=df["output_tokens"].to_numpy(), ok=np.ones(n, bool),
                gaps_s=None if gaps is None else tuple(gaps[i] for i in order))
    return BenchmarkRun(tool, version, df, t, clients, failed, tuple(reported), path)


def _need(doc: dict, keys, path: str, what: str) -> None:
    for k in keys:
        if k not in doc:
            raise BenchmarkFormatError(path, k, f"missing from a {what}",
                                       f"a file with {', '.join(keys)}")


def _lists(doc: dict, keys, path: str) -> int:
    n = None
    for k in keys:
        v = doc.get(k)
        if not isinstance(v, list):
            raise BenchmarkFormatError(path, k, f"expected a list, got {type(v).__name__}",
                                       "one entry per request")
        if n is None:
            n = len(v)
        elif len(v) != n:
            raise BenchmarkFormatError(path, k, f"{len(v)} entries where "
                                       f"{keys[0]} has {n}", "one entry per request")
    return n or 0


# -- vLLM bench serve ---------------------------------------------------------------------

_VLLM_STATS = {"mean": "mean", "median": "p50", "p90": "p90", "p99": "p99"}


def _vllm(doc: dict, path: str) -> BenchmarkRun:
    detailed = ("input_lens", "output_lens", "ttfts", "itls", "latencies")
    if "input_lens" not in doc or "ttfts" not in doc:
        raise BenchmarkFormatError(
            path, "input_lens" if "input_lens" not in doc else "ttfts",
            "missing: the result was saved without --save-detailed",
            "a result of vllm bench serve --save-result --save-detailed")
    n = _lists(doc, detailed, path)
    errors = doc.get("errors") or [""] * n
    starts = doc.get("start_times")
    queues = doc.get("queue_times")
    for k, v in (("errors", errors), ("start_times", starts), ("queue_times", queues)):
        if v is not None and len(v) != n:
            raise BenchmarkFormatError(path, k, f"{len(v)} entries where input_lens has "
                                       f"{n}", "one entry per request")
    inp = np.array([_num(x) for x in doc["input_lens"]])
    out = np.array([_num(x) for x in doc["output_lens"]])
    ttft = np.array([_num(x) for x in doc["ttfts"]])
    lat = np.array([_num(x) for x in doc["latencies"]])
    ok = np.array([not e for e in errors]) & (out > 0)
    start = (np.array([_num(x) for x in starts]) if starts is not None else np.zeros(n))
    gaps = [np.asarray([_num(g) for g in (doc["itls"][i] or [])], float) for i in range(n)]
    rate = doc.get("request_rate", "inf")
    rate = math.inf if rate in (None, "inf") else _num(rate)
    conc = doc.get("max_concurrency")
    if conc is not None and (not isinstance(conc, int) or conc < 1):
        raise BenchmarkFormatError(path, "max_concurrency", f"{conc!r}",
                                   "null or a whole number ≥ 1")
    t0 = float(np.min(start[ok])) if ok.any() else 0.0
    if conc:
        # the schedule: when each request was due (its send less its wait for a slot)
        if math.isinf(rate):
            sched = np.zeros(n)
        elif queues is not None:
            sched = start - np.array([_num(q) for q in queues]) - t0
        else:
            sched = start - t0
        clients = Clients(concurrency=int(conc))
    else:
        if starts is None:
            raise BenchmarkFormatError(path, "start_times", "missing: without a "
                                       "max_concurrency the sends are the schedule",
                                       "a result of a vLLM version that saves start_times")
        sched = start - t0
        clients = Clients()
    sched = np.maximum(sched, 0.0)
    keep = np.flatnonzero(ok)
    rows = {"request_id": keep, "arrival_s": sched[keep],
            "input_tokens": inp[keep], "output_tokens": out[keep],
            "start_s": start[keep], "first_s": (start + ttft)[keep],
            "last_s": np.array([start[i] + ttft[i] + gaps[i].sum() for i in keep]),
            "end_s": (start + lat)[keep]}
    reported = []
    for m in METRICS:
        if m.tool is not Tool.VLLM:
            continue
        if m.is_throughput:
            if isinstance(doc.get(m.name), (int, float)):
                reported.append(Reported(m, "value", float(doc[m.name])))
            continue
        key = m.name.lower()
        for stat, ours in _VLLM_STATS.items():
            v = doc.get(f"{stat}_{key}_ms")
            if isinstance(v, (int, float)):
                reported.append(Reported(m, ours, float(v)))
    version = "vllm bench serve --save-detailed" + ("" if starts is not None
                                                    else " (no start_times)")
    return _build(Tool.VLLM, version, path, rows, [gaps[i] for i in keep], clients,
                  int(n - ok.sum()), reported)


# -- guidellm -----------------------------------------------------------------------------

def _pick(benchmarks: list, index: int | None, path: str) -> tuple[dict, int]:
    if not benchmarks:
        raise BenchmarkFormatError(path, "benchmarks", "empty", "at least one benchmark")
    if index is None:
        if len(benchmarks) > 1:
            raise BenchmarkFormatError(path, "benchmarks", f"{len(benchmarks)} benchmarks "
                                       "(one per strategy of the profile)",
                                       f"choose one with benchmark=0…{len(benchmarks) - 1}")
        index = 0
    if not 0 <= index < len(benchmarks):
        raise BenchmarkFormatError(path, "benchmarks", f"no benchmark {index}",
                                   f"0…{len(benchmarks) - 1}")
    b = benchmarks[index]
    if not isinstance(b, dict):
        raise BenchmarkFormatError(path, f"benchmarks[{index}]", "not a mapping",
                                   "a guidellm generative_benchmark")
    return b, index


def _strategy_clients(strategy: dict, where: str, path: str) -> Clients:
    kind = strategy.get("type_") if isinstance(strategy, dict) else None
    allowed = "synchronous, concurrent, throughput, constant, poisson"
    if kind == "synchronous":
        return Clients(1)
    if kind == "concurrent":
        streams = strategy.get("streams")
        if not isinstance(streams, int) or streams < 1:
            raise BenchmarkFormatError(path, f"{where}.streams", f"{streams!r}",
                                       "a whole number ≥ 1")
        return Clients(streams)
    if kind == "throughput":
        mc = strategy.get("max_concurrency")
        return Clients(mc) if isinstance(mc, int) and mc > 0 else Clients()
    if kind in ("constant", "poisson"):
        return Clients()
    raise BenchmarkFormatError(path, f"{where}.type_", f"{kind!r}", allowed)


def _guidellm(doc: dict, path: str, index: int | None) -> BenchmarkRun:
    meta = doc.get("metadata")
    new = isinstance(meta, dict) and meta.get("version") == 2
    b, index = _pick(doc.get("benchmarks") or [], index, path)
    where = f"benchmarks[{index}]"
    reqs = b.get("requests")
    if not isinstance(reqs, dict) or not isinstance(reqs.get("successful"), list):
        raise BenchmarkFormatError(path, f"{where}.requests.successful", "missing",
                                   "a guidellm report with its requests (not sampled away)")
    succ = reqs["successful"]
    failed = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
    if new:
        strategy = (b.get("config") or {}).get("strategy")
        clients = _strategy_clients(strategy, f"{where}.config.strategy", path)
        tool, version = Tool.GUIDELLM, f"guidellm {meta.get('guidellm_version', '0.4+')} " \
                                       "(report version 2)"
    else:
        strategy = (b.get("args") or {}).get("strategy")
        clients = _strategy_clients(strategy, f"{where}.args.strategy", path)
        tool, version = Tool.GUIDELLM_02, "guidellm 0.2 report"
    cols = {k: [] for k in ("start", "first", "last", "end", "inp", "out", "sched")}
    for i, r in enumerate(succ):
        w = f"{where}.requests.successful[{i}]"
        if not isinstance(r, dict):
            raise BenchmarkFormatError(path, w, "not a mapping", "a request's statistics")
        if new:
            tm = (r.get("info") or {}).get("timings") or {}
            vals = (tm.get("request_start"), tm.get("first_token_iteration"),
                    tm.get("last_token_iteration"), tm.get("request_end"),
                    r.get("prompt_tokens", (r.get("input_metrics") or {}).get("total_tokens")),
                    r.get("output_tokens", (r.get("output_metrics") or {}).get("total_tokens")),
                    tm.get("targeted_start"))
            names = ("info.timings.request_start", "info.timings.first_token_iteration",
                     "info.timings.last_token_iteration", "info.timings.request_end",
                     "prompt_tokens", "output_tokens")
        else:
            si = r.get("scheduler_info") or {}
            vals = (r.get("start_time"), r.get("first_token_time"), r.get("last_token_time"),
                    r.get("end_time"), r.get("prompt_tokens"), r.get("output_tokens"),
                    si.get("targeted_start_time"))
            names = ("start_time", "first_token_time", "last_token_time", "end_time",
                     "prompt_tokens", "output_tokens")
        for name, v in zip(names, vals):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BenchmarkFormatError(path, f"{w}.{name}", f"{v!r}", "a number")
        for key, v in zip(("start", "first", "last", "end", "inp", "out", "sched"), vals):
            cols[key].append(_num(v))
    start = np.array(cols["start"])
    t0 = float(start.min()) if len(start) else 0.0
    sched = np.zeros(len(start)) if clients.closed else start - t0
    rows = {"request_id": np.arange(len(start)), "arrival_s": sched,
            "input_tokens": np.array(cols["inp"]), "output_tokens": np.array(cols["out"]),
            "start_s": start, "first_s": np.array(cols["first"]),
            "last_s": np.array(cols["last"]), "end_s": np.array(cols["end"])}
    if clients.closed:                      # the clients took the requests in send order
        order = np.argsort(start, kind="stable")
        rows = {k: (v[order] if k != "request_id" else v) for k, v in rows.items()}
        rows["arrival_s"] = np.zeros(len(start))
    reported = []
    metrics = b.get("metrics") or {}
    for m in METRICS:
        if m.tool is not tool or m.is_throughput:
            continue
        succ_stats = ((metrics.get(m.name) or {}).get("successful") or {})
        pct = succ_stats.get("percentiles") or {}
        for stat, v in (("mean", succ_stats.get("mean")), ("p50", succ_stats.get("median")),
                        ("p90", pct.get("p90")), ("p99", pct.get("p99"))):
            if isinstance(v, (int, float)):
                reported.append(Reported(m, stat, float(v)))
    return _build(tool, version, path, rows, None, clients, failed, reported)


# -- inference-perf -----------------------------------------------------------------------

def _inference_perf(doc: list, path: str) -> BenchmarkRun:
    cols = {k: [] for k in ("start", "end", "inp", "out")}
    gaps, firsts, lasts, failed = [], [], [], 0
    for i, r in enumerate(doc):
        w = f"[{i}]"
        if not isinstance(r, dict):
            raise BenchmarkFormatError(path, w, "not a mapping", "a request's lifecycle "
                                       "metrics (start_time, end_time, info, error)")
        if r.get("error"):
            failed += 1
            continue
        info = r.get("info")
        if not isinstance(info, dict):
            raise BenchmarkFormatError(path, f"{w}.info", "missing", "a mapping with the "
                                       "request's token counts and token times")
        resp = info.get("response_metrics") if isinstance(info.get("response_metrics"),
                                                           dict) else {}
        req = info.get("request_metrics") if isinstance(info.get("request_metrics"),
                                                        dict) else {}
        inp = info.get("input_tokens", (req.get("text") or {}).get("input_tokens"))
        out = resp.get("output_tokens", info.get("output_tokens"))
        times = resp.get("output_token_times", info.get("output_token_times"))
        for name, v in (("start_time", r.get("start_time")), ("end_time", r.get("end_time")),
                        ("info.input_tokens", inp), ("info.output_tokens", out)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BenchmarkFormatError(path, f"{w}.{name}", f"{v!r}", "a number")
        if not isinstance(times, list) or len(times) < 2:
            raise BenchmarkFormatError(
                path, f"{w}.info.output_token_times",
                f"{'missing' if not isinstance(times, list) else f'{len(times)} time(s)'}",
                "the token times of a streamed request (two or more)")
        tt = np.array([_num(x) for x in times])
        cols["start"].append(_num(r["start_time"]))
        cols["end"].append(_num(r["end_time"]))
        cols["inp"].append(_num(inp))
        cols["out"].append(_num(out))
        firsts.append(tt[0])
        lasts.append(tt[-1])
        gaps.append(np.diff(tt))
    start = np.array(cols["start"])
    t0 = float(start.min()) if len(start) else 0.0
    rows = {"request_id": np.arange(len(start)), "arrival_s": start - t0,
            "input_tokens": np.array(cols["inp"]), "output_tokens": np.array(cols["out"]),
            "start_s": start, "first_s": np.array(firsts), "last_s": np.array(lasts),
            "end_s": np.array(cols["end"])}
    new = any("response_metrics" in (r.get("info") or {}) for r in doc if isinstance(r, dict))
    version = "inference-perf per_request_lifecycle_metrics " + ("(0.6)" if new else "(0.2)")
    return _build(Tool.INFERENCE_PERF, version, path, rows, gaps, Clients(), failed)


# -- llm-d lmbench CSV --------------------------------------------------------------------

_LMBENCH = ("request_id", "arrival_time_us", "input_tokens", "output_tokens", "ttft_us",
            "e2e_us")


def _lmbench(df: pd.DataFrame, path: str) -> BenchmarkRun:
    missing = [c for c in _LMBENCH if c not in df.columns]
    if missing:
        raise BenchmarkFormatError(path, missing[0], "missing column",
                                   "the lmbench CSV's " + ", ".join(_LMBENCH)
                                   + " (or a plain request file without --compare)")
    for c in ("ttft_us", "e2e_us"):
        v = pd.to_numeric(df[c], errors="coerce").to_numpy(float)
        bad = ~np.isfinite(v) | (v < 0)
        if bad.any():
            raise BenchmarkFormatError(path, c, f"row {int(np.flatnonzero(bad)[0])} has "
                                       f"{df[c].iloc[int(np.flatnonzero(bad)[0])]!r}",
                                       "microseconds ≥ 0")
    arr = pd.to_numeric(df["arrival_time_us"], errors="coerce").to_numpy(float) / 1e6
    ttft = df["ttft_us"].to_numpy(float) / 1e6
    e2e = df["e2e_us"].to_numpy(float) / 1e6
    t0 = np.nanmin(arr) if len(arr) else 0.0
    rows = {"request_id": df["request_id"].to_numpy(), "arrival_s": arr - t0,
            "input_tokens": df["input_tokens"].to_numpy(),
            "output_tokens": df["output_tokens"].to_numpy(),
            "start_s": arr, "first_s": arr + ttft, "last_s": arr + e2e, "end_s": arr + e2e}
    return _build(Tool.LMBENCH, "llm-d-benchmark lmbench CSV", path, rows, None, Clients(),
                  0)


# -- entry point --------------------------------------------------------------------------

def read_benchmark(path: str | os.PathLike, *, benchmark: int | None = None) -> BenchmarkRun:
    """Read a benchmark client's result file (see :data:`FORMATS`); ``benchmark``: which
    benchmark of a guidellm report holding several (a sweep). Raises
    :class:`BenchmarkFormatError` naming the file, the field and what is allowed."""
    p = Path(path)
    src = str(p)
    allowed = "; ".join(FORMATS)
    if not p.is_file():
        raise BenchmarkFormatError(src, None, "no such file", allowed)
    suffix = p.suffix.lower()
    if suffix == ".csv":
        return _lmbench(pd.read_csv(p), src)
    if suffix != ".json":
        raise BenchmarkFormatError(src, None, f"unknown result file type {suffix!r}",
                                   ".json (vLLM, guidellm, inference-perf) or .csv (lmbench)")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BenchmarkFormatError(src, None, f"not valid JSON ({exc})", allowed) from None
    if isinstance(doc, list):
        if doc and all(isinstance(r, dict) and "start_time" in r and "info" in r
                       for r in doc[:5]):
            return _inference_perf(doc, src)
        raise BenchmarkFormatError(src, "[0]", "a list, but not of inference-perf request "
                                   "lifecycle metrics (start_time, end_time, info, error)",
                                   allowed)
    if isinstance(doc, dict):
        if "benchmarks" in doc:
            return _guidellm(doc, src, benchmark)
        if any(k in doc for k in ("input_lens", "ttfts", "latencies", "endpoint_type",
                                  "mean_ttft_ms")):
            return _vllm(doc, src)
    raise BenchmarkFormatError(src, None, "not a benchmark result this reads (no "
                               "'benchmarks', 'input_lens' or per-request list)", allowed)
