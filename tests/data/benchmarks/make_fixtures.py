"""Write the small benchmark result files of this folder, one per client format, from
the clients' documented schemas (tests/data/README.md names the version of each).

    python tests/data/benchmarks/make_fixtures.py

The runs are invented (seeded): a server whose first token comes 30 ms + 20 µs per prompt
token after the send and each later token 12–18 ms after the previous one. Each file also
carries the aggregates its tool would print, computed here with the tool's own formulas
written out independently of jkernel (numpy on the per-request lists), so that a test can
check that jkernel.replay.metrics defines each metric as the tool does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
N = 12


def invented_run(seed: int, clients: int | None, rate: float | None):
    """Per request: send, token times, end, prompt and answer lengths."""
    rng = np.random.default_rng(seed)
    inp = rng.integers(100, 900, N)
    out = rng.integers(5, 40, N)
    free = [0.0] * (clients or N)
    sched = (np.cumsum(rng.exponential(1 / rate, N)) if rate else np.zeros(N))
    runs = []
    for i in range(N):
        k = int(np.argmin(free)) if clients else i
        start = max(sched[i], free[k]) if clients else sched[i]
        first = start + 0.030 + 20e-6 * inp[i] + rng.uniform(0, 0.01)
        gaps = rng.uniform(0.012, 0.018, out[i] - 1)
        times = first + np.concatenate([[0.0], np.cumsum(gaps)])
        end = times[-1] + 0.0015
        if clients:
            free[k] = end
        runs.append(dict(sched=float(sched[i]), start=float(start), times=times.tolist(),
                         end=float(end), inp=int(inp[i]), out=int(out[i])))
    return runs


def vllm() -> None:
    """vllm bench serve --max-concurrency 3 --save-result --save-detailed (request rate
    inf): the keys of vllm/benchmarks/serve.py's result JSON; request 4 failed."""
    t0 = 5000.0                                   # time.perf_counter() at the start
    runs = invented_run(1, 3, None)
    failed = 4
    ok = [i for i in range(N) if i != failed]
    ttfts = [r["times"][0] - r["start"] for r in runs]
    itls = [list(np.diff(r["times"])) for r in runs]
    lat = [r["end"] - r["start"] for r in runs]
    tpots = [(lat[i] - ttfts[i]) / (runs[i]["out"] - 1) for i in ok if runs[i]["out"] > 1]
    all_itl = [g for i in ok for g in itls[i]]
    dur = max(runs[i]["end"] for i in range(N)) + 0.002
    total_in = sum(runs[i]["inp"] for i in ok)
    total_out = sum(runs[i]["out"] for i in ok)
    doc = {"date": "20260301-120000", "endpoint_type": "openai", "backend": "openai",
           "label": None, "model_id": "Qwen/Qwen3-14B", "tokenizer_id": "Qwen/Qwen3-14B",
           "num_prompts": N, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 3,
           "duration": dur, "completed": len(ok), "failed": 1,
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / dur, "request_goodput": None,
           "output_throughput": total_out / dur,
           "total_token_throughput": (total_in + total_out) / dur,
           "input_lens": [r["inp"] for r in runs],
           "output_lens": [0 if i == failed else r["out"] for i, r in enumerate(runs)],
           "ttfts": [0.0 if i == failed else ttfts[i] for i in range(N)],
           "itls": [[] if i == failed else itls[i] for i in range(N)],
           "latencies": [0.0 if i == failed else lat[i] for i in range(N)],
           "start_times": [t0 + r["start"] for r in runs],
           "queue_times": [r["start"] - r["sched"] for r in runs],
           "generated_texts": ["" if i == failed else "text" for i in range(N)],
           "errors": ["" if i != failed else "Bad Request" for i in range(N)],
           "max_output_tokens_per_s": 0.0, "max_concurrent_requests": 3, "rtfx": 0.0}
    for key, vals in (("ttft", [ttfts[i] for i in ok]), ("tpot", tpots), ("itl", all_itl),
                      ("e2el", [lat[i] for i in ok])):
        doc[f"mean_{key}_ms"] = float(np.mean(vals)) * 1000
        doc[f"median_{key}_ms"] = float(np.median(vals)) * 1000
        doc[f"std_{key}_ms"] = float(np.std(vals)) * 1000
        doc[f"p99_{key}_ms"] = float(np.percentile(vals, 99)) * 1000
    (HERE / "vllm_bench_serve.json").write_text(json.dumps(doc, indent=1) + "\n")


def _weighted(values, weights) -> dict:
    """guidellm's DistributionSummary.from_distribution_function (mean, median, p90, p99)."""
    v, w = np.asarray(values, float), np.asarray(weights, float)
    o = np.argsort(v)
    v, p = v[o], (w / w.sum())[o]
    cdf = np.cumsum(p)

    def q(x):
        return float(v[np.argmax(cdf >= x)])
    return {"mean": float(np.sum(v * p)), "median": q(0.5),
            "percentiles": {"p90": q(0.9), "p99": q(0.99)}}


def guidellm_02() -> None:
    """guidellm 0.2 report: one concurrent benchmark of 2 streams."""
    t0 = 1.75e9
    runs = invented_run(2, 2, None)
    succ = []
    for i, r in enumerate(runs):
        succ.append({"type_": "generative_text_response", "request_id": f"req-{i}",
                     "request_type": "text_completions",
                     "scheduler_info": {"requested": True, "completed": True, "errored": False,
                                        "canceled": False,
                                        "targeted_start_time": t0 + r["sched"],
                                        "queued_time": t0 + r["sched"],
                                        "dequeued_time": t0 + r["start"],
                                        "scheduled_time": t0 + r["start"],
                                        "worker_start": t0 + r["start"],
                                        "request_start": t0 + r["start"],
                                        "request_end": t0 + r["end"],
                                        "worker_end": t0 + r["end"], "process_id": i % 2},
                     "prompt": "p" * 10, "output": "o" * 10,
                     "prompt_tokens": r["inp"], "output_tokens": r["out"],
                     "start_time": t0 + r["start"], "end_time": t0 + r["end"],
                     "first_token_time": t0 + r["times"][0],
                     "last_token_time": t0 + r["times"][-1]})
    ttft = [1000 * (s["first_token_time"] - s["start_time"]) for s in succ]
    tpot = [1000 * (s["last_token_time"] - s["first_token_time"]) / s["output_tokens"]
            for s in succ]
    itl = [1000 * (s["last_token_time"] - s["first_token_time"]) / (s["output_tokens"] - 1)
           for s in succ]
    latency = [s["end_time"] - s["start_time"] for s in succ]
    out = [s["output_tokens"] for s in succ]
    metrics = {"time_to_first_token_ms": {"successful": _weighted(ttft, [1] * N)},
               "time_per_output_token_ms": {"successful": _weighted(tpot, out)},
               "inter_token_latency_ms": {"successful": _weighted(itl, [o - 1 for o in out])},
               "request_latency": {"successful": _weighted(latency, [1] * N)}}
    bench = {"type_": "generative_benchmark", "id_": "b0", "run_id": "r0",
             "args": {"profile": {"type_": "concurrent", "streams": [2]}, "strategy_index": 0,
                      "strategy": {"type_": "concurrent", "streams": 2},
                      "max_number": N, "max_duration": None, "warmup_number": None,
                      "warmup_duration": None, "cooldown_number": None,
                      "cooldown_duration": None},
             "start_time": min(s["start_time"] for s in succ),
             "end_time": max(s["end_time"] for s in succ), "extras": {},
             "metrics": metrics,
             "request_totals": {"successful": N, "incomplete": 0, "errored": 0, "total": N},
             "requests": {"successful": succ, "incomplete": [], "errored": []}}
    (HERE / "guidellm_0.2.json").write_text(json.dumps({"benchmarks": [bench]}, indent=1)
                                            + "\n")


def guidellm_07() -> None:
    """guidellm 0.7 report (metadata version 2): one poisson benchmark at 4 req/s."""
    t0 = 1.76e9
    runs = invented_run(3, None, 4.0)
    succ = []
    for i, r in enumerate(runs):
        succ.append({"type_": "generative_request_stats", "request_id": f"req-{i}",
                     "response_id": f"cmpl-{i}", "request_args": None, "output": "o",
                     "info": {"request_id": f"req-{i}", "status": "completed",
                              "timings": {"targeted_start": t0 + r["sched"],
                                          "queued": t0 + r["sched"],
                                          "resolve_start": t0 + r["start"],
                                          "request_start": t0 + r["start"],
                                          "first_token_iteration": t0 + r["times"][0],
                                          "last_token_iteration": t0 + r["times"][-1],
                                          "token_iterations": r["out"],
                                          "request_end": t0 + r["end"],
                                          "resolve_end": t0 + r["end"]}},
                     "input_metrics": {"text_tokens": r["inp"], "total_tokens": r["inp"]},
                     "output_metrics": {"text_tokens": r["out"], "total_tokens": r["out"]},
                     "prompt_tokens": r["inp"], "output_tokens": r["out"]})
    tm = [s["info"]["timings"] for s in succ]
    out = [s["output_tokens"] for s in succ]
    ttft = [1000 * (t["first_token_iteration"] - t["request_start"]) for t in tm]
    tpot = [1000 * (t["last_token_iteration"] - t["request_start"]) / o for t, o in zip(tm, out)]
    itl = [1000 * (t["last_token_iteration"] - t["first_token_iteration"]) / (o - 1)
           for t, o in zip(tm, out)]
    latency = [t["request_end"] - t["request_start"] for t in tm]
    metrics = {"time_to_first_token_ms": {"successful": _weighted(ttft, [1] * N)},
               "time_per_output_token_ms": {"successful": _weighted(tpot, out)},
               "inter_token_latency_ms": {"successful": _weighted(itl, [o - 1 for o in out])},
               "request_latency": {"successful": _weighted(latency, [1] * N)}}
    bench = {"type_": "generative_benchmark",
             "config": {"id_": "b0", "run_id": "r0", "run_index": 0,
                        "strategy": {"type_": "poisson", "rate": 4.0},
                        "constraints": {}, "sample_size": None,
                        "warmup": {}, "cooldown": {}},
             "metrics": metrics,
             "requests": {"successful": succ, "incomplete": [], "errored": []}}
    doc = {"metadata": {"version": 2, "guidellm_version": "0.7.3",
                        "python_version": "3.12", "platform": "linux"},
           "config": {}, "benchmarks": [bench]}
    (HERE / "guidellm_0.7.json").write_text(json.dumps(doc, indent=1) + "\n")


def inference_perf() -> None:
    """inference-perf 0.6 per_request_lifecycle_metrics.json: poisson at 3 req/s; the
    last request failed."""
    t0 = 880.0                                    # time.perf_counter() at the start
    runs = invented_run(4, None, 3.0)
    items = []
    for i, r in enumerate(runs):
        info = {"request_metrics": {"text": {"input_tokens": r["inp"]}, "image": None,
                                    "video": None, "audio": None},
                "response_metrics": {"output_tokens": r["out"], "server_usage": None,
                                     "response_chunks": [], "chunk_times": [],
                                     "output_token_times": [t0 + x for x in r["times"]]},
                "extra_info": {}, "lora_adapter": None, "labels": {},
                "input_tokens": r["inp"]}
        err = None
        if i == N - 1:
            info["response_metrics"]["output_token_times"] = []
            info["response_metrics"]["output_tokens"] = 0
            err = {"error_type": "ClientResponseError", "error_msg": "503"}
        items.append({"start_time": t0 + r["start"], "end_time": t0 + r["end"],
                      "request": json.dumps({"prompt": "p", "max_tokens": r["out"]}),
                      "response": None if err else "text", "info": info, "error": err})
    (HERE / "inference_perf_per_request_lifecycle_metrics.json").write_text(
        json.dumps(items, indent=1) + "\n")


def lmbench() -> None:
    """The llm-d-benchmark lmbench CSV: uniform spacing at 5 req/s, server token counts."""
    runs = invented_run(5, None, None)
    lines = ["request_id,arrival_time_us,input_tokens,output_tokens,ttft_us,e2e_us"]
    for i, r in enumerate(runs):
        start = i * 0.2
        lines.append(f"{i},{round(start * 1e6)},{r['inp']},{r['out']},"
                     f"{round((r['times'][0] - r['start']) * 1e6)},"
                     f"{round((r['end'] - r['start']) * 1e6)}")
    (HERE / "lmbench_sharegpt_output_5.csv").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    vllm()
    guidellm_02()
    guidellm_07()
    inference_perf()
    lmbench()
