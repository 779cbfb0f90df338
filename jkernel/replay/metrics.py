"""Serving metrics as the common benchmark clients define them: the one home of every
definition (the table is ``docs/metrics.md``).

The clients agree on what TTFT and end-to-end latency are and disagree on almost everything
else: vLLM's TPOT ends at the end of the response, inference-perf's at the last token;
guidellm 0.2 divides the time from the first to the last token by *all* output tokens and
guidellm ≥ 0.4 the time from the *send* to the last token; vLLM and inference-perf pool every
gap between two tokens into "ITL" while guidellm's "ITL" is one mean per request; guidellm
weights its means and takes the lower percentile of a weighted distribution, the others
interpolate. So each quantity here has one definition (:class:`Quantity`), each client's
metric names the quantity it computes (:class:`Metric`, :data:`METRICS`), and a comparison
computes the measured and the predicted side with the same :class:`Metric` from the same
kind of record (:class:`Timings`), so it never mixes two definitions.

Sources read (facts, not code): ``vllm/benchmarks/serve.py`` (vLLM main, 2026),
guidellm 0.2 ``benchmark/benchmark.py`` and ``objects/statistics.py``, guidellm 0.7
``schemas/request_stats.py``, inference-perf ``reportgen/base.py`` and ``docs/metrics.md``
(v0.6), the llm-d-benchmark lmbench CSVs (TPOT recomputed from their ``runs.csv``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = ["Tool", "Quantity", "Weight", "Percentile", "Metric", "Timings", "SLO", "Summary",
           "Objective", "METRICS", "metrics_of", "values", "summarize_metric", "stats_of", "throughput",
           "goodput", "GOODPUT_KEYS"]


class Tool(enum.Enum):
    """A benchmark client whose metric names and definitions a comparison follows."""

    VLLM = "vllm bench serve"
    GUIDELLM_02 = "guidellm 0.2"
    GUIDELLM = "guidellm 0.4+"
    INFERENCE_PERF = "inference-perf"
    LMBENCH = "llm-d lmbench"


class Quantity(enum.Enum):
    """One definition per quantity. ``start`` is when the client sent the request, ``first``
    and ``last`` when it received the first and the last token, ``end`` when the response
    was complete, ``out`` the output tokens; per request unless said otherwise."""

    TTFT = "first − start"
    E2E = "end − start"
    TPOT_TO_END = "(end − first) / (out − 1), out > 1"
    TPOT_TO_LAST = "(last − first) / (out − 1), out > 1"
    TPOT_FIRST_TO_LAST_ALL = "(last − first) / out, out > 0"
    TPOT_START_TO_LAST_ALL = "(last − start) / out, out > 0"
    NTPOT = "(end − start) / out, out > 0"
    ITL_GAPS = "every gap between two consecutive tokens (chunks), pooled over requests"
    ITL_REQUEST_MEAN = "a request's mean gap between consecutive tokens (chunks)"
    REQUEST_THROUGHPUT = "completed requests / span"
    OUTPUT_THROUGHPUT = "output tokens of completed requests / span"
    INPUT_THROUGHPUT = "prompt tokens of completed requests / span"
    TOTAL_THROUGHPUT = "(prompt + output) tokens of completed requests / span"


#: The span of a run's throughput: from the first send to the last end, over the requests
#: counted (vLLM divides by its benchmark's wall clock, which also holds the first arrival
#: gap; inference-perf by max(end) − min(start); guidellm 0.2 by end_time − start_time).
SPAN = "last end − first start"


class Weight(enum.Enum):
    """How a tool weights each request's value in its mean and percentiles."""

    NONE = "none"
    OUTPUT = "output tokens"
    OUTPUT_MINUS_ONE = "output tokens − 1"


class Percentile(enum.Enum):
    """How a tool takes a percentile."""

    LINEAR = "numpy.percentile (linear interpolation)"
    WEIGHTED_LOWER = "smallest value whose cumulative weight ≥ q (guidellm)"


@dataclass(frozen=True)
class Metric:
    """One metric of one tool: its own name and unit, the quantity it computes and how it
    aggregates. ``scale`` turns seconds into the tool's unit (1e3 for ms)."""

    tool: Tool
    name: str
    quantity: Quantity
    unit: str = "ms"
    weight: Weight = Weight.NONE
    percentile: Percentile = Percentile.LINEAR

    @property
    def scale(self) -> float:
        return {"ms": 1e3, "s": 1.0}.get(self.unit, 1.0)

    @property
    def is_throughput(self) -> bool:
        return self.quantity in _THROUGHPUTS


_THROUGHPUTS = (Quantity.REQUEST_THROUGHPUT, Quantity.OUTPUT_THROUGHPUT,
                Quantity.INPUT_THROUGHPUT, Quantity.TOTAL_THROUGHPUT)

_G = Percentile.WEIGHTED_LOWER


def _tool_metrics() -> tuple[Metric, ...]:
    V, G2, G, IP, LM = (Tool.VLLM, Tool.GUIDELLM_02, Tool.GUIDELLM, Tool.INFERENCE_PERF,
                        Tool.LMBENCH)
    Q = Quantity
    rows = [
        # vllm bench serve: calculate_metrics() and the result JSON's keys
        Metric(V, "TTFT", Q.TTFT), Metric(V, "TPOT", Q.TPOT_TO_END),
        Metric(V, "ITL", Q.ITL_GAPS), Metric(V, "E2EL", Q.E2E),
        Metric(V, "request_throughput", Q.REQUEST_THROUGHPUT, "req/s"),
        Metric(V, "output_throughput", Q.OUTPUT_THROUGHPUT, "tok/s"),
        Metric(V, "total_token_throughput", Q.TOTAL_THROUGHPUT, "tok/s"),
    ]
    for tool, tpot in ((G2, Q.TPOT_FIRST_TO_LAST_ALL), (G, Q.TPOT_START_TO_LAST_ALL)):
        rows += [
            Metric(tool, "time_to_first_token_ms", Q.TTFT, percentile=_G),
            Metric(tool, "time_per_output_token_ms", tpot, weight=Weight.OUTPUT,
                   percentile=_G),
            Metric(tool, "inter_token_latency_ms", Q.TPOT_TO_LAST,
                   weight=Weight.OUTPUT_MINUS_ONE, percentile=_G),
            Metric(tool, "request_latency", Q.E2E, "s", percentile=_G),
            Metric(tool, "requests_per_second", Q.REQUEST_THROUGHPUT, "req/s"),
            Metric(tool, "output_tokens_per_second", Q.OUTPUT_THROUGHPUT, "tok/s"),
            Metric(tool, "tokens_per_second", Q.TOTAL_THROUGHPUT, "tok/s"),
        ]
    rows += [
        # inference-perf: summarize_requests() (seconds)
        Metric(IP, "time_to_first_token", Q.TTFT, "s"),
        Metric(IP, "time_per_output_token", Q.TPOT_TO_LAST, "s"),
        Metric(IP, "inter_token_latency", Q.ITL_GAPS, "s"),
        Metric(IP, "normalized_time_per_output_token", Q.NTPOT, "s"),
        Metric(IP, "request_latency", Q.E2E, "s"),
        Metric(IP, "requests_per_sec", Q.REQUEST_THROUGHPUT, "req/s"),
        Metric(IP, "input_tokens_per_sec", Q.INPUT_THROUGHPUT, "tok/s"),
        Metric(IP, "output_tokens_per_sec", Q.OUTPUT_THROUGHPUT, "tok/s"),
        Metric(IP, "total_tokens_per_sec", Q.TOTAL_THROUGHPUT, "tok/s"),
        # llm-d-benchmark lmbench CSV: ttft_us, e2e_us; its runs' TPOT is vLLM's
        Metric(LM, "ttft", Q.TTFT), Metric(LM, "tpot", Q.TPOT_TO_END),
        Metric(LM, "e2e", Q.E2E),
        Metric(LM, "request_throughput", Q.REQUEST_THROUGHPUT, "req/s"),
        Metric(LM, "output_throughput", Q.OUTPUT_THROUGHPUT, "tok/s"),
    ]
    return tuple(rows)


#: Every tool's metrics, in the order a comparison prints them.
METRICS: tuple[Metric, ...] = _tool_metrics()


def metrics_of(tool: Tool) -> tuple[Metric, ...]:
    """The metrics ``tool`` reports, in its order."""
    return tuple(m for m in METRICS if m.tool is tool)


@dataclass(frozen=True)
class Timings:
    """Per-request timings of one run, seconds on one clock (NaN where unknown).

    Attributes:
      start_s: when the client sent each request, shape ``(n,)``.
      first_token_s, last_token_s: when it received the first and the last token.
      end_s: when the response was complete (the last token, or after it).
      input_tokens, output_tokens: int arrays ``(n,)``.
      ok: completed successfully (the only requests any metric counts).
      gaps_s: per request, the gaps between consecutive tokens (or streamed chunks), or
        None where the source records only the first and last token.
    """

    start_s: np.ndarray
    first_token_s: np.ndarray
    last_token_s: np.ndarray
    end_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    ok: np.ndarray
    gaps_s: tuple | None = field(default=None)

    def __post_init__(self):
        n = len(self.start_s)
        for name in ("first_token_s", "last_token_s", "end_s", "input_tokens",
                     "output_tokens", "ok"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Timings.{name} has {len(getattr(self, name))} entries, "
                                 f"start_s {n}")
        if self.gaps_s is not None and len(self.gaps_s) != n:
            raise ValueError(f"Timings.gaps_s has {len(self.gaps_s)} entries, start_s {n}")

    def __len__(self) -> int:
        return len(self.start_s)

    def subset(self, mask) -> "Timings":
        """The requests where ``mask`` is true (a boolean array of length n)."""
        m = np.asarray(mask, bool)
        gaps = None if self.gaps_s is None else tuple(g for g, k in zip(self.gaps_s, m) if k)
        return Timings(self.start_s[m], self.first_token_s[m], self.last_token_s[m],
                       self.end_s[m], self.input_tokens[m], self.output_tokens[m],
                       self.ok[m], gaps)


def values(q: Quantity, t: Timings) -> np.ndarray:
    """Per-request values of ``q`` in seconds (NaN where a request does not define it;
    only completed requests are finite). ``ITL_GAPS`` returns the pooled gaps instead."""
    out = t.output_tokens.astype(float)
    ok = t.ok.astype(bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        if q is Quantity.TTFT:
            v = t.first_token_s - t.start_s
        elif q is Quantity.E2E:
            v = t.end_s - t.start_s
        elif q is Quantity.TPOT_TO_END:
            v = np.where(out > 1, (t.end_s - t.first_token_s) / (out - 1), np.nan)
        elif q is Quantity.TPOT_TO_LAST:
            v = np.where(out > 1, (t.last_token_s - t.first_token_s) / (out - 1), np.nan)
        elif q is Quantity.TPOT_FIRST_TO_LAST_ALL:
            v = np.where(out > 0, (t.last_token_s - t.first_token_s) / out, np.nan)
        elif q is Quantity.TPOT_START_TO_LAST_ALL:
            v = np.where(out > 0, (t.last_token_s - t.start_s) / out, np.nan)
        elif q is Quantity.NTPOT:
            v = np.where(out > 0, (t.end_s - t.start_s) / out, np.nan)
        elif q is Quantity.ITL_REQUEST_MEAN:
            if t.gaps_s is None:
                raise ValueError("ITL per request needs the token (chunk) times, which this "
                                 "source does not record")
            v = np.array([float(np.mean(g)) if len(g) else np.nan for g in t.gaps_s])
        elif q is Quantity.ITL_GAPS:
            if t.gaps_s is None:
                raise ValueError("ITL per gap needs the token (chunk) times, which this "
                                 "source does not record")
            kept = [np.asarray(g, float) for g, k in zip(t.gaps_s, ok) if k and len(g)]
            return np.concatenate(kept) if kept else np.zeros(0)
        else:
            raise ValueError(f"{q.name} is a throughput: use throughput()")
    return np.where(ok, np.asarray(v, float), np.nan)


def _weights(w: Weight, t: Timings) -> np.ndarray:
    out = t.output_tokens.astype(float)
    if w is Weight.OUTPUT:
        return out
    if w is Weight.OUTPUT_MINUS_ONE:
        return out - 1.0
    return np.ones_like(out)


_NAN = float("nan")


class Summary(NamedTuple):
    """A metric's statistics in its tool's unit: a latency's ``mean``, ``p50``, ``p90``,
    ``p99``; a throughput's ``value`` (the others NaN)."""

    mean: float = _NAN
    p50: float = _NAN
    p90: float = _NAN
    p99: float = _NAN
    value: float = _NAN


def stats_of(m: Metric) -> tuple[str, ...]:
    """The :class:`Summary` fields that apply to ``m``."""
    return ("value",) if m.is_throughput else ("mean", "p50", "p90", "p99")


def summarize_metric(m: Metric, t: Timings) -> Summary:
    """The statistics of metric ``m`` over ``t`` in the tool's unit (NaN when no request
    defines it), aggregated by the tool's rules (weights, percentile method)."""
    if m.is_throughput:
        return Summary(value=throughput(m.quantity, t))
    v = values(m.quantity, t)
    if m.quantity is Quantity.ITL_GAPS:
        w = np.ones_like(v)
    else:
        w = _weights(m.weight, t)
        keep = np.isfinite(v) & (w > 0)
        v, w = v[keep], w[keep]
    v = v * m.scale
    if v.size == 0:
        return Summary()

    def pct(q: float) -> float:
        return (float(np.percentile(v, q)) if m.percentile is Percentile.LINEAR
                else _weighted_lower(v, w, q / 100.0))

    return Summary(float(np.sum(v * w) / np.sum(w)), pct(50), pct(90), pct(99))


def _weighted_lower(v: np.ndarray, w: np.ndarray, q: float) -> float:
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cdf = np.cumsum(w / np.sum(w))
    return float(v[min(int(np.searchsorted(cdf, q, side="left")), len(v) - 1)])


def span_s(t: Timings) -> float:
    """The throughput span of the completed requests: last end − first start (s)."""
    ok = t.ok.astype(bool)
    if not ok.any():
        return float("nan")
    return float(np.max(t.end_s[ok]) - np.min(t.start_s[ok]))


def throughput(q: Quantity, t: Timings) -> float:
    """A throughput over :func:`span_s`: requests/s or tokens/s of completed requests."""
    ok = t.ok.astype(bool)
    span = span_s(t)
    if not span > 0:
        return float("nan")
    if q is Quantity.REQUEST_THROUGHPUT:
        n = float(ok.sum())
    elif q is Quantity.OUTPUT_THROUGHPUT:
        n = float(t.output_tokens[ok].sum())
    elif q is Quantity.INPUT_THROUGHPUT:
        n = float(t.input_tokens[ok].sum())
    elif q is Quantity.TOTAL_THROUGHPUT:
        n = float(t.input_tokens[ok].sum() + t.output_tokens[ok].sum())
    else:
        raise ValueError(f"{q.name} is not a throughput")
    return n / span


@dataclass(frozen=True)
class SLO:
    """Per-request service-level objectives, seconds (None: not checked). A request is good
    when it completed and every stated value is ≤ its objective (vLLM's ``--goodput``,
    inference-perf's ``report.goodput.constraints``)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None
    ntpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self):
        for k in ("ttft_s", "tpot_s", "itl_s", "ntpot_s", "e2e_s"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)
                                      and v >= 0):
                raise ValueError(f"SLO {k} must be a number of seconds ≥ 0, not {v!r}")

    def stated(self) -> tuple["Objective", ...]:
        """The objectives given, in the order ttft, tpot, itl, ntpot, e2e."""
        return tuple(Objective(k, v) for k, v in (
            ("ttft", self.ttft_s), ("tpot", self.tpot_s), ("itl", self.itl_s),
            ("ntpot", self.ntpot_s), ("e2e", self.e2e_s)) if v is not None)


class Objective(NamedTuple):
    """One stated objective: ``key`` (``ttft``, ``tpot``, ``itl``, ``ntpot``, ``e2e``) and
    its limit in seconds."""

    key: str
    limit_s: float


#: Per tool, the SLO keys it knows and the quantity each checks (vLLM: ``ttft``, ``tpot``,
#: ``e2el``; inference-perf: ``ttft``, ``tpot``, ``itl``, ``ntpot``, ``request_latency``).
GOODPUT_KEYS: dict[Tool, dict[str, Quantity]] = {
    Tool.VLLM: {"ttft": Quantity.TTFT, "tpot": Quantity.TPOT_TO_END, "e2e": Quantity.E2E},
    Tool.INFERENCE_PERF: {"ttft": Quantity.TTFT, "tpot": Quantity.TPOT_TO_LAST,
                          "itl": Quantity.ITL_REQUEST_MEAN, "ntpot": Quantity.NTPOT,
                          "e2e": Quantity.E2E},
}

#: The tools' own names of the SLO keys, for messages and the table.
GOODPUT_NAMES = {Tool.VLLM: {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el"},
                 Tool.INFERENCE_PERF: {"ttft": "ttft", "tpot": "tpot", "itl": "itl",
                                       "ntpot": "ntpot", "e2e": "request_latency"}}


def goodput(tool: Tool, t: Timings, slo: SLO) -> tuple[int, float]:
    """Good requests and the goodput (good requests / :func:`span_s`) under ``slo``, as
    ``tool`` counts it: vLLM counts a request of one output token as TPOT 0 (met);
    inference-perf counts a value its request does not define (one output token's TPOT)
    as missed."""
    keys = GOODPUT_KEYS.get(tool)
    if keys is None:
        raise ValueError(f"{tool.value} reports no goodput; goodput follows "
                         f"{' or '.join(k.value for k in GOODPUT_KEYS)}")
    stated = slo.stated()
    unknown = [o.key for o in stated if o.key not in keys]
    if unknown:
        names = GOODPUT_NAMES[tool]
        raise ValueError(f"{tool.value} has no goodput objective {unknown[0]!r}; allowed: "
                         f"{', '.join(names[k] for k in keys)}")
    good = t.ok.astype(bool).copy()
    for k, limit in stated:
        v = values(keys[k], t)
        if tool is Tool.VLLM and k == "tpot":
            v = np.where(t.output_tokens <= 1, 0.0, v)
        good &= (v <= limit) if tool is Tool.INFERENCE_PERF else ~(v > limit)
    n = int(good.sum())
    span = span_s(t)
    return n, (n / span if span > 0 else float("nan"))
