"""Benchmark clients' results in (jkernel.replay.formats), replayed and compared
(jkernel.replay.compare, ``jkernel replay --requests RESULT --compare``), on small files
written in each client's format (tests/data/benchmarks/, see tests/data/README.md)."""

from __future__ import annotations

import contextlib
import io
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel import cli
from jkernel.replay import Clients, Window, replay
from jkernel.replay.compare import compare, format_comparison
from jkernel.replay.formats import BenchmarkFormatError, read_benchmark
from jkernel.replay.metrics import SLO, Tool, metrics_of, summarize_metric

DATA = Path(__file__).resolve().parent / "data" / "benchmarks"
LMBENCH = Path("/work/shared/data/serving-runs/llm-d-lmbench")
FILES = {Tool.VLLM: "vllm_bench_serve.json", Tool.GUIDELLM_02: "guidellm_0.2.json",
         Tool.GUIDELLM: "guidellm_0.7.json",
         Tool.INFERENCE_PERF: "inference_perf_per_request_lifecycle_metrics.json",
         Tool.LMBENCH: "lmbench_sharegpt_output_5.csv"}


@lru_cache(maxsize=None)
def qwen() -> jkernel.Kernel:
    return jkernel.open("qwen3-14b-h100-tp1")


def run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("tool", list(FILES), ids=[t.name for t in FILES])
def test_each_format_reads_as_requests_and_measurements(tool):
    run = read_benchmark(DATA / FILES[tool])
    assert run.tool is tool
    n = {Tool.VLLM: 11, Tool.INFERENCE_PERF: 11}.get(tool, 12)
    assert len(run.requests) == len(run.measured) == n
    assert run.failed == 12 - n
    assert (run.measured.output_tokens == run.requests.output_tokens.to_numpy()).all()
    assert (run.measured.first_token_s >= run.measured.start_s).all()
    assert (run.measured.end_s >= run.measured.last_token_s).all()


@pytest.mark.parametrize("tool", [Tool.VLLM, Tool.GUIDELLM_02, Tool.GUIDELLM])
def test_measured_metrics_are_the_files_own_figures(tool):
    """Recomputed from the per-request fields with jkernel's definitions, every aggregate
    the file reports comes out as the tool printed it: the definitions are the tool's."""
    run = read_benchmark(DATA / FILES[tool])
    assert len(run.reported) >= 12
    for rep in run.reported:
        mine = getattr(summarize_metric(rep.metric, run.measured), rep.stat)
        if rep.metric.is_throughput:       # vLLM's wall clock holds a little more (docs)
            assert mine == pytest.approx(rep.value, rel=0.01) and mine >= rep.value
        else:
            assert mine == pytest.approx(rep.value, rel=1e-9), (rep.metric.name, rep.stat)


def test_how_each_client_sent_its_requests():
    vllm = read_benchmark(DATA / FILES[Tool.VLLM])
    assert vllm.clients == Clients(3) and (vllm.requests.arrival_s == 0).all()
    g2 = read_benchmark(DATA / FILES[Tool.GUIDELLM_02])
    assert g2.clients == Clients(2)
    g7 = read_benchmark(DATA / FILES[Tool.GUIDELLM])
    assert not g7.clients.closed
    assert np.allclose(g7.requests.arrival_s, g7.measured.start_s - g7.measured.start_s.min())
    ip = read_benchmark(DATA / FILES[Tool.INFERENCE_PERF])
    assert np.allclose(ip.requests.arrival_s, ip.measured.start_s - ip.measured.start_s.min())


@pytest.mark.parametrize("tool", list(FILES), ids=[t.name for t in FILES])
def test_each_format_round_trips_through_a_replay_and_a_comparison(tool):
    run = read_benchmark(DATA / FILES[tool])
    res = replay(qwen(), run.requests, clients=run.clients)
    c = compare(run, res)
    names = {m.name for m in metrics_of(tool)}
    assert set(c.aggregate.metric) <= names and len(set(c.aggregate.metric)) >= 4
    pred = c.aggregate.set_index(["metric", "stat"]).predicted
    ttft = next(m for m in metrics_of(tool) if m.quantity.name == "TTFT")
    assert pred[(ttft.name, "mean")] == pytest.approx(res.requests.ttft_s.mean() * ttft.scale,
                                                      rel=1e-9)
    e2e = next(m for m in metrics_of(tool) if m.quantity.name == "E2E")
    assert pred[(e2e.name, "mean")] == pytest.approx(res.requests.e2e_s.mean() * e2e.scale,
                                                    rel=1e-9)
    assert np.isfinite(c.aggregate.measured).all() and np.isfinite(c.aggregate.predicted).all()
    assert len(c.per_request) == len(run.requests)
    text = format_comparison(c)
    assert f"metrics as {tool.value} defines them" in text
    for name in names & set(c.aggregate.metric):
        assert name in text


def test_a_closed_loop_run_is_replayed_by_as_many_clients():
    run = read_benchmark(DATA / FILES[Tool.VLLM])
    r = replay(qwen(), run.requests, clients=run.clients).requests
    t = np.unique(np.concatenate([r.arrival_s, r.finish_s]))
    sent, fin = np.sort(r.arrival_s), np.sort(r.finish_s)
    count = np.searchsorted(sent, t, "right") - np.searchsorted(fin, t, "right")
    assert count.max() == 3 and (r.arrival_s.iloc[:3] == 0).all()


def test_goodput_and_window_in_a_comparison():
    run = read_benchmark(DATA / FILES[Tool.INFERENCE_PERF])
    res = replay(qwen(), run.requests)
    c = compare(run, res, slo=SLO(ttft_s=0.05, tpot_s=0.02),
                window=Window(warmup_requests=2))
    assert c.counted.sum() == len(run.requests) - 2
    agg = c.aggregate.set_index("metric")
    assert 0 <= agg.loc["good requests", "measured"] <= c.counted.sum()
    assert "goodput" in agg.index
    with pytest.raises(ValueError, match="reports no goodput"):
        compare(read_benchmark(DATA / FILES[Tool.LMBENCH]), replay(
            qwen(), read_benchmark(DATA / FILES[Tool.LMBENCH]).requests), slo=SLO(ttft_s=1.0))


def test_cli_compare_prints_the_tools_metrics(tmp_path):
    out = tmp_path / "cmp.csv"
    rc, text, _ = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests",
                           str(DATA / FILES[Tool.VLLM]), "--compare", "--goodput", "ttft:60",
                           "tpot:20", "--per-request", "2", "--out", str(out)])
    assert rc == 0
    for word in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2EL (ms)", "request_throughput",
                 "goodput: ttft ≤ 60 ms, tpot ≤ 20 ms", "3 closed-loop",
                 "per request, predicted / measured"):
        assert word in text
    table = pd.read_csv(out)
    assert {"measured_TTFT", "predicted_TTFT", "measured_E2EL", "counted"} <= set(table)
    assert np.allclose(table.predicted_TTFT, table.ttft_s * 1e3)
    rc, text, _ = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests",
                           str(DATA / FILES[Tool.GUIDELLM_02]), "--compare", "--json"])
    doc = json.loads(text)
    assert rc == 0 and {r["metric"] for r in doc["comparison"]} >= {
        "time_to_first_token_ms", "time_per_output_token_ms", "inter_token_latency_ms"}


def test_inference_perf_02_layout_reads_the_same(tmp_path):
    """inference-perf 0.2 kept the counts and token times flat in ``info``."""
    items = json.loads((DATA / FILES[Tool.INFERENCE_PERF]).read_text())
    for it in items:
        rm = it["info"].pop("response_metrics")
        it["info"] = {"input_tokens": it["info"]["input_tokens"],
                      "output_tokens": rm["output_tokens"],
                      "output_token_times": rm["output_token_times"]}
    p = tmp_path / "per_request_lifecycle_metrics.json"
    p.write_text(json.dumps(items))
    a, b = read_benchmark(p), read_benchmark(DATA / FILES[Tool.INFERENCE_PERF])
    assert a.version.endswith("(0.2)") and b.version.endswith("(0.6)")
    assert np.array_equal(a.measured.last_token_s, b.measured.last_token_s)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_like=True)


@pytest.mark.skipif(not LMBENCH.exists(), reason="needs ../shared")
def test_lmbench_runs_tpot_is_vllms_definition():
    runs = pd.read_csv(LMBENCH / "runs.csv")
    for row in runs.head(5).itertuples():
        run = read_benchmark(LMBENCH / row.stack / row.file)
        tpot = next(m for m in metrics_of(Tool.LMBENCH) if m.name == "tpot")
        ttft = next(m for m in metrics_of(Tool.LMBENCH) if m.name == "ttft")
        assert summarize_metric(tpot, run.measured).mean == pytest.approx(
            row.tpot_mean_ms, abs=0.001)
        assert summarize_metric(ttft, run.measured).mean == pytest.approx(
            row.ttft_mean_ms, abs=0.01)


# -- wrong formats -------------------------------------------------------------------------

def write(tmp_path, name, doc) -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def vllm_doc() -> dict:
    return json.loads((DATA / FILES[Tool.VLLM]).read_text())


def guidellm_doc() -> dict:
    return json.loads((DATA / FILES[Tool.GUIDELLM_02]).read_text())


@pytest.mark.parametrize("name, make, field, allowed", [
    ("x.json", lambda: {"rows": []}, None, "vLLM bench serve --save-result --save-detailed"),
    ("x.json", lambda: {k: v for k, v in vllm_doc().items() if k != "input_lens"},
     "input_lens", "--save-detailed"),
    ("x.json", lambda: {**vllm_doc(), "ttfts": vllm_doc()["ttfts"][:3]}, "ttfts",
     "one entry per request"),
    ("x.json", lambda: {**vllm_doc(), "max_concurrency": 0}, "max_concurrency",
     "a whole number ≥ 1"),
    ("x.json", lambda: {"benchmarks": guidellm_doc()["benchmarks"] * 2}, "benchmarks",
     "benchmark=0…1"),
    ("x.json", lambda: {"benchmarks": [{**guidellm_doc()["benchmarks"][0],
                                        "args": {"strategy": {"type_": "sweep"}}}]},
     "benchmarks[0].args.strategy.type_", "synchronous, concurrent, throughput"),
    ("x.json", lambda: [{"start_time": 1.0, "end_time": 2.0, "info": {"input_tokens": 3,
                                                                      "output_tokens": 2},
                         "error": None}],
     "[0].info.output_token_times", "two or more"),
    ("x.json", lambda: [1, 2, 3], "[0]", "inference-perf"),
    ("x.json", lambda: "{not json", None, "guidellm report JSON"),
    ("x.csv", lambda: "request_id,arrival_time_us,input_tokens,output_tokens\n0,0,10,2\n",
     "ttft_us", "the lmbench CSV's"),
    ("x.csv", lambda: "request_id,arrival_time_us,input_tokens,output_tokens,ttft_us,e2e_us\n"
                      "0,0,10,2,-5,100\n", "ttft_us", "microseconds ≥ 0"),
    ("x.yaml", lambda: "a: 1", None, ".json (vLLM, guidellm, inference-perf) or .csv"),
])
def test_a_wrong_result_file_is_refused_with_the_file_the_field_and_what_is_allowed(
        tmp_path, name, make, field, allowed):
    p = write(tmp_path, name, make())
    with pytest.raises(BenchmarkFormatError) as err:
        read_benchmark(p)
    assert err.value.file == str(p) and err.value.field == field
    assert allowed in str(err.value) and str(p) in str(err.value)


def test_cli_refuses_a_wrong_result_file_and_bad_options(tmp_path):
    p = write(tmp_path, "r.json", {"rows": []})
    rc, _, err = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests", str(p), "--compare"])
    assert rc == 2 and str(p) in err and "allowed:" in err
    good = str(DATA / FILES[Tool.VLLM])
    rc, _, err = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests", good, "--compare",
                          "--goodput", "speed:3"])
    assert rc == 2 and "allowed: KEY:MILLISECONDS" in err
    rc, _, err = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests", good, "--compare",
                          "--goodput", "itl:30"])
    assert rc == 2 and "no goodput objective 'itl'; allowed: ttft, tpot, e2el" in err
    rc, _, err = run_cli(["replay", "qwen3-14b-h100-tp1", "--requests", good, "--warmup",
                          "lots"])
    assert rc == 2 and "allowed: N (requests)" in err
    spec = write(tmp_path, "s.yaml", "arrival: {process: immediate, count: 2}\n"
                                     "input_tokens: 10\noutput_tokens: 2\n")
    rc, _, err = run_cli(["replay", "qwen3-14b-h100-tp1", "--workload", str(spec),
                          "--compare"])
    assert rc == 2 and "--compare needs --requests" in err
