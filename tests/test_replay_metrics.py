"""The benchmark clients' metric definitions (jkernel.replay.metrics) and their one table
(docs/metrics.md)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from jkernel.replay.metrics import (METRICS, SLO, Metric, Percentile, Quantity, Timings, Tool,
                                    Weight, goodput, metrics_of, summarize_metric, throughput,
                                    values)

ROOT = Path(__file__).resolve().parents[1]


def one_request(times=(0.10, 0.12, 0.15), end=0.16, start=0.0, inp=100) -> Timings:
    t = np.asarray(times, float)
    return Timings(np.array([start]), t[:1], t[-1:], np.array([end]), np.array([inp]),
                   np.array([len(t)]), np.array([True]), (np.diff(t),))


def test_each_quantity_is_its_formula_on_one_request():
    t = one_request()
    got = {q: values(q, t)[0] for q in Quantity
           if q not in (Quantity.ITL_GAPS,) and "THROUGHPUT" not in q.name}
    assert got[Quantity.TTFT] == pytest.approx(0.10)
    assert got[Quantity.E2E] == pytest.approx(0.16)
    assert got[Quantity.TPOT_TO_END] == pytest.approx((0.16 - 0.10) / 2)        # vLLM
    assert got[Quantity.TPOT_TO_LAST] == pytest.approx((0.15 - 0.10) / 2)       # inference-perf
    assert got[Quantity.TPOT_FIRST_TO_LAST_ALL] == pytest.approx(0.05 / 3)      # guidellm 0.2
    assert got[Quantity.TPOT_START_TO_LAST_ALL] == pytest.approx(0.15 / 3)      # guidellm 0.4+
    assert got[Quantity.NTPOT] == pytest.approx(0.16 / 3)
    assert got[Quantity.ITL_REQUEST_MEAN] == pytest.approx(0.025)
    assert np.allclose(values(Quantity.ITL_GAPS, t), [0.02, 0.03])
    # a one-token answer has no TPOT; a failed request has nothing
    single = one_request(times=(0.1,), end=0.1)
    assert np.isnan(values(Quantity.TPOT_TO_END, single)[0])
    failed = Timings(*[getattr(t, f) for f in ("start_s", "first_token_s", "last_token_s",
                                               "end_s", "input_tokens", "output_tokens")],
                     np.array([False]), t.gaps_s)
    assert np.isnan(values(Quantity.TTFT, failed)[0])
    assert values(Quantity.ITL_GAPS, failed).size == 0


def test_the_tools_disagree_where_they_define_differently():
    """TPOT is four quantities across the tools, and ITL two: each tool's metric names the
    one it computes, so the same name never means two things within a tool."""
    tpot = {m.tool: m.quantity for m in METRICS
            if m.name in ("TPOT", "time_per_output_token_ms", "time_per_output_token", "tpot")}
    assert tpot == {Tool.VLLM: Quantity.TPOT_TO_END, Tool.LMBENCH: Quantity.TPOT_TO_END,
                    Tool.GUIDELLM_02: Quantity.TPOT_FIRST_TO_LAST_ALL,
                    Tool.GUIDELLM: Quantity.TPOT_START_TO_LAST_ALL,
                    Tool.INFERENCE_PERF: Quantity.TPOT_TO_LAST}
    itl = {m.tool: m.quantity for m in METRICS if "inter_token" in m.name or m.name == "ITL"}
    assert itl[Tool.VLLM] is itl[Tool.INFERENCE_PERF] is Quantity.ITL_GAPS
    assert itl[Tool.GUIDELLM] is itl[Tool.GUIDELLM_02] is Quantity.TPOT_TO_LAST
    for tool in Tool:
        names = [m.name for m in metrics_of(tool)]
        assert len(names) == len(set(names)) and names


def many(n=200, seed=0) -> Timings:
    rng = np.random.default_rng(seed)
    start = np.sort(rng.uniform(0, 10, n))
    out = rng.integers(1, 30, n)
    gaps = tuple(rng.uniform(0.01, 0.03, k - 1) for k in out)
    first = start + rng.uniform(0.05, 0.5, n)
    last = first + np.array([g.sum() for g in gaps])
    return Timings(start, first, last, last + 0.001, rng.integers(10, 900, n), out,
                   np.ones(n, bool), gaps)


def test_statistics_follow_the_tools_rules():
    t = many()
    vllm_itl = next(m for m in metrics_of(Tool.VLLM) if m.name == "ITL")
    pooled = np.concatenate(t.gaps_s) * 1e3
    s = summarize_metric(vllm_itl, t)
    assert s.mean == pytest.approx(pooled.mean())
    assert s.p99 == pytest.approx(np.percentile(pooled, 99))               # interpolated
    g_itl = next(m for m in metrics_of(Tool.GUIDELLM_02) if m.name == "inter_token_latency_ms")
    assert g_itl.weight is Weight.OUTPUT_MINUS_ONE and g_itl.percentile is Percentile.WEIGHTED_LOWER
    s = summarize_metric(g_itl, t)
    # the (out − 1)-weighted mean of per-request ITL is the mean of the pooled gaps
    assert s.mean == pytest.approx(pooled.mean())
    per = values(Quantity.TPOT_TO_LAST, t) * 1e3
    w = t.output_tokens - 1.0
    keep = np.isfinite(per) & (w > 0)
    v, w = per[keep], w[keep]
    o = np.argsort(v)
    cdf = np.cumsum(w[o]) / w.sum()
    assert s.p90 == v[o][np.argmax(cdf >= 0.9)]                             # a value, lower
    assert s.p90 in set(v)


def test_throughput_spans_the_first_send_to_the_last_end():
    t = many()
    span = (t.end_s.max() - t.start_s.min())
    assert throughput(Quantity.REQUEST_THROUGHPUT, t) == pytest.approx(len(t) / span)
    assert throughput(Quantity.OUTPUT_THROUGHPUT, t) == pytest.approx(t.output_tokens.sum()
                                                                     / span)
    m = next(m for m in metrics_of(Tool.INFERENCE_PERF) if m.name == "total_tokens_per_sec")
    assert summarize_metric(m, t).value == pytest.approx(
        (t.input_tokens.sum() + t.output_tokens.sum()) / span)


def test_goodput_counts_as_each_tool_does():
    t = Timings(np.zeros(3), np.array([0.1, 0.3, 0.1]), np.array([0.5, 0.7, 0.1]),
                np.array([0.5, 0.7, 0.1]), np.array([10, 10, 10]), np.array([5, 5, 1]),
                np.ones(3, bool), (np.full(4, 0.1), np.full(4, 0.1), np.zeros(0)))
    slo = SLO(ttft_s=0.2, tpot_s=0.15)
    # vLLM: request 1 misses TTFT; request 2 (one token) counts as TPOT 0
    assert goodput(Tool.VLLM, t, slo)[0] == 2
    # inference-perf: a one-token request has no TPOT, which misses the objective
    assert goodput(Tool.INFERENCE_PERF, t, slo)[0] == 1
    assert goodput(Tool.VLLM, t, slo)[1] == pytest.approx(2 / 0.7)
    with pytest.raises(ValueError, match="no goodput objective 'itl'; allowed: ttft, tpot, e2el"):
        goodput(Tool.VLLM, t, SLO(itl_s=0.1))
    with pytest.raises(ValueError, match="reports no goodput"):
        goodput(Tool.GUIDELLM, t, slo)
    with pytest.raises(ValueError, match="seconds ≥ 0"):
        SLO(ttft_s=-1.0)


def test_docs_metrics_table_is_the_modules():
    """docs/metrics.md has one table, one row per quantity, naming each tool's metric for
    it exactly as METRICS does."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| `")]
    header = next(r for r in text.splitlines() if r.startswith("| quantity"))
    tools = [c.strip() for c in header.strip("|").split("|")[2:]]
    assert tools == [t.value for t in Tool]
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        q = Quantity[re.findall(r"`(\w+)`", cells[0])[0]]
        for tool, cell in zip(Tool, cells[2:]):
            names = set(re.findall(r"`([^`]+)`", cell))
            want = {m.name for m in metrics_of(tool) if m.quantity is q}
            assert names == want, (q, tool)
            seen |= {(tool, n) for n in names}
    assert seen == {(m.tool, m.name) for m in METRICS}


def test_metric_records_are_typed():
    m = METRICS[0]
    assert isinstance(m, Metric) and m.scale == 1e3 and not m.is_throughput
    with pytest.raises(ValueError, match="ok has 2 entries"):
        Timings(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1), np.ones(1), np.ones(1),
                np.ones(2, bool))
