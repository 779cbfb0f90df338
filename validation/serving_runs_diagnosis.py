"""Why the serving-runs baseline misses where it does: the evidence tables of
validation/BASELINE.md ("What misses and why").

    python -m validation.serving_runs_diagnosis --data /work/shared/data/serving-runs \\
        --profiles /work/shared/data/aic-op-profiles [--only NAME ...]

Each table isolates one cause, with the shipped constants unchanged (a "what if" column
prices a named alternative to show its size, it changes nothing shipped):

* ``operating_point``: the kernel's step price at each trainval stage's *measured* operating
  point (Little's law: N = rate × (E2E − TTFT) decoding requests, contexts spread evenly over
  the output) against the measured ITL. With whole-prompt prefix hits the steps are nearly
  pure decode, so this is the step-cost error without the replay's queueing feedback.
* ``decode_attention``: the H100 decode-attention profile's achieved bandwidth by KV heads
  per GPU, against the single shipped rate.
* ``moe``: the H100 MoE profile of Llama-4-Scout's expert shape (fp8 block-scaled, the
  fp8 path whose cost the measured steps allow) against the kernel's routed-expert term per
  layer, by tokens per step.
* ``workstation``: the measured decode step of the LLMServingSim runs in every second with
  no prompt tokens (running / generated tokens per second), the kernel's price of the batch
  running then (reconstructed from the per-request timestamps), and the same with a named
  alternative (rtx-4090: the GEMM ramp's m_half scaled by the chip's compute-to-bandwidth
  ratio; rtx-pro-6000: H100's fitted engine constants).
* ``llmd_cache``: llm-d load points replayed with a cold prefix cache (the baseline), with
  the conversations the client sent (what the replay ships) and with every prompt already
  cached (the same 252 requests replayed once before); the slope of TTFT over the prompt's
  length tells them apart at light load.
* ``llmd_inflight``: every llm-d request's TTFT by the requests in flight when it was sent
  (its client's view: sent and not yet finished), measured and as the shipped replay gives
  it, over all 28 load points: where the API server's queue starts to show.
* ``llmd_token``: the llm-d held-out TTFT error per load point with the API server's time
  per streamed token as shipped and at named alternatives (a what-if: the loads near the
  server's saturation move by tens of per cent for a few µs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from . import serving_runs as S

__all__ = ["operating_point", "decode_attention", "moe", "workstation", "llmd_cache",
           "llmd_inflight", "llmd_token", "main"]


def _batch(k, contexts):
    from jkernel import Batch

    contexts = np.asarray(contexts, np.int64)
    return Batch([1] * len(contexts), contexts, decode_threshold=k.settings.decode_threshold)


def _terms(k, batch) -> pd.Series:
    """The kernel's ``expected_s`` per term of one batch, ms."""
    return k.breakdown(batch).groupby("term")["expected_s"].sum() * 1e3


def operating_point(root: str | Path) -> pd.DataFrame:
    """Per trainval stage: measured ITL, the kernel's decode step at the measured operating
    point, their ratio − 1, and the step's host-serial, decode-attention, routed-expert and
    collective parts (ms)."""
    runs = pd.read_csv(Path(root) / "inference-sim-trainval" / "runs.csv")
    runs = runs[runs["stage_index"] >= 0]
    kernels: dict = {}
    rows = []
    for _, r in runs.iterrows():
        scen = S.TRAINVAL[r["run_id"]]
        if scen not in kernels:
            kernels[scen] = S.open_kernel(scen)
        k = kernels[scen]
        e2e, ttft = r["e2e_mean_ms"] / 1e3, r["ttft_mean_ms"] / 1e3
        n = max(1, int(round(r["stage_rate_rps"] * (e2e - ttft))))
        prompt, out = r["system_prompt_len"] + r["question_len"], r["output_len"]
        ctx = prompt + (np.arange(n) + 0.5) / n * out
        b = _batch(k, ctx.astype(int))
        step = k.step_time(b).expected_s * 1e3
        t = _terms(k, b)
        itl = (e2e - ttft) / (out - 1) * 1e3
        rows.append({"run": r["run_id"], "stage": int(r["stage_index"]), "requests_per_step": n,
                     "context": int(ctx.mean()), "measured_itl_ms": itl, "step_ms": step,
                     "error": step / itl - 1, "host_serial_ms": t.get("host serial", 0.0),
                     "decode_attention_ms": t.filter(like="attention decode").sum(),
                     "experts_ms": t.filter(like="expert").sum(),
                     "collectives_ms": t[[i for i in t.index if "all_reduce" in i
                                          or "alltoall" in i or "all_gather" in i]].sum()})
    return pd.DataFrame(rows)


def decode_attention(profiles: str | Path, chip: str = "h100_sxm") -> pd.DataFrame:
    """Median achieved bandwidth (TB/s) of the decode-attention profile (bf16 KV, head 128,
    no window, ≥ 200 MB read per call) per KV heads per GPU, and the shipped rate."""
    g = pd.read_parquet(Path(profiles) / chip / "attention" / "vllm" / "0.24.0"
                        / "generation_attention_perf.parquet")
    g = g[(g["head_dim"] == 128) & (g["kv_cache_dtype"].astype(str) == "bfloat16")
          & (g["window_size"].fillna(0) == 0)]
    nbytes = g["batch_size"] * (g["step"] + 1) * 2 * g["num_key_value_heads"] * 128 * 2
    g = g.assign(tbs=nbytes / (g["latency"] * 1e-3) / 1e12)[nbytes > 2e8]
    out = g.groupby("num_key_value_heads")["tbs"].agg(["median", "count"]).reset_index()
    k = S.open_kernel("llama-2-7b-h100-tp1-vllm0.15")
    out["shipped_rate_tbs"] = k.params.value("attention_decode_rate") / 1e12
    return out.rename(columns={"median": "profile_tbs", "count": "calls"})


def moe(profiles: str | Path) -> pd.DataFrame:
    """Llama-4-Scout experts per layer (ms) by tokens per step: the H100 profile (fp8 block,
    balanced routing, moe_tp 2 and 4) against the kernel's routed-expert term at tp 2 and 4."""
    m = pd.read_parquet(Path(profiles) / "h100_sxm" / "moe" / "vllm" / "0.24.0"
                        / "moe_perf.parquet")
    m = m[(m["hidden_size"] == 5120) & (m["inter_size"] == 8192) & (m["topk"] == 1)
          & (m["num_experts"] == 16) & (m["moe_ep_size"] == 1)
          & (m["distribution"] == "balanced") & (m["moe_dtype"].astype(str) == "fp8_block")]
    prof = m.pivot_table(index="num_tokens", columns="moe_tp_size", values="latency")
    rows = []
    kernels = {2: S.open_kernel("llama-4-scout-fp8-h100-tp2-vllm0.15"),
               4: S.open_kernel(S.LLMD)}
    layers = 48
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        row = {"tokens": n}
        for tp, k in kernels.items():
            t = _terms(k, _batch(k, [700] * n))
            row[f"kernel_tp{tp}_ms"] = t.get("routed experts", 0.0) / layers
            row[f"profile_tp{tp}_ms"] = float(prof.loc[n, tp]) if n in prof.index else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def workstation(root: str | Path) -> pd.DataFrame:
    """Per LLMServingSim run: over the seconds with no prompt tokens, the median measured
    decode step, the kernel's price of the reconstructed batch, and the price under the
    named alternative (errors are medians over those seconds)."""
    h = S.open_kernel("qwen2.5-7b-h100-tp1-mnbt2048-vllm0.15")
    h100 = {n: h.params.value(n) for n in ("host_serial", "host_serial_per_request",
                                           "compute_derate")}
    rows = []
    for run, scen in S.LLMSERVINGSIM.items():
        folder = Path(root) / "llmservingsim" / run
        k = S.open_kernel(scen)
        if "rtx-4090" in scen:
            chip = k.inputs.chip
            ratio = (chip.bf16_peak_tflops / chip.hbm_tbs) / (362.05 / 0.864)   # l40s's
            alt = k.with_params(k.params.replace(
                gemm_m_half_bf16=k.params.value("gemm_m_half_bf16") * ratio))
            alt_name = f"gemm_m_half_bf16 × {ratio:.3f} (l40s's ramp at this chip's ridge)"
        else:
            alt = k.with_params(k.params.replace(**{n: v for n, v in h100.items()
                                                    if n in k.params}))
            alt_name = "H100's host_serial, host_serial_per_request, compute_derate"
        dp = int(k.resolution().data_parallel())
        ts = pd.read_csv(folder / "timeseries.csv")
        q = pd.read_csv(folder / "requests.csv")
        arrival = q["arrival_time_us"] / 1e6
        first, last = arrival + q["ttft_us"] / 1e6, arrival + q["e2e_us"] / 1e6
        per = []
        for _, r in ts[(ts["prompt_throughput"] == 0) & (ts["gen_throughput"] > 0)].iterrows():
            t = r["t"] - 0.5
            live = (first <= t) & (last >= t)
            ctx = (q["input_tokens"] + (t - first) / (last - first) * q["output_tokens"])[live]
            ctx = ctx.astype(int).to_numpy()[::dp]
            if len(ctx) == 0:
                continue
            meas = r["running"] / r["gen_throughput"] * 1e3
            b = _batch(k, ctx)
            per.append((meas, k.step_time(b).expected_s * 1e3, alt.step_time(b).expected_s * 1e3,
                        r["running"], int(live.sum())))
        d = pd.DataFrame(per, columns=["measured", "kernel", "alt", "running", "reconstructed"])
        rows.append({"run": run, "seconds": len(d), "running": d["running"].median(),
                     "reconstructed": d["reconstructed"].median(),
                     "measured_step_ms": d["measured"].median(),
                     "kernel_step_ms": d["kernel"].median(),
                     "error": (d["kernel"] / d["measured"] - 1).median(),
                     "alternative": alt_name,
                     "alternative_error": (d["alt"] / d["measured"] - 1).median()})
    return pd.DataFrame(rows)


def llmd_cache(root: str | Path, loads=("4", "10", "24", "50", "75", "100")) -> pd.DataFrame:
    """llm-d load points: measured mean TTFT and ITL (ms) and the slope of TTFT over the
    prompt's tokens (µs per token, least squares over the requests) against three replays:
    ``cold`` (no prompt cached), ``conv`` (the conversations LMBench sent, with their
    warm-up: the shipped replay, serving_runs.LLMD_CONVERSATIONS) and ``warm`` (every
    prompt already cached: the same requests replayed once before)."""
    from jkernel.replay import load_requests, replay

    def slope(tokens, ttft_s) -> float:
        x = np.asarray(tokens, float)
        return float(np.polyfit(x, np.asarray(ttft_s, float), 1)[0] * 1e6)

    def stats(t: pd.DataFrame) -> tuple[float, float, float]:
        t = t[~t["warm_up"]] if "warm_up" in t.columns else t
        s = S._stats(t["ttft_s"], t["e2e_s"], t["output_tokens"])
        return s["ttft_mean"] * 1e3, s["itl_mean"] * 1e3, slope(t["input_tokens"], t["ttft_s"])

    k = S.open_kernel(S.LLMD)
    rows = []
    for run in S.discover(root, ("llm-d",)):
        if run.run.split()[0] not in loads:
            continue
        df = load_requests(run.requests).drop(columns=["arrival_time_us"], errors="ignore")
        hashes = [" ".join(str(i * 100_000 + j) for j in range(n // 16))
                  for i, n in enumerate(df["input_tokens"])]
        first = df.assign(request_id=["w" + str(x) for x in df["request_id"]],
                          block_hashes=hashes, warm_up=True)      # replayed, not counted
        again = df.assign(block_hashes=hashes, arrival_s=df["arrival_s"] + 300.0,
                          warm_up=False)
        warm = stats(replay(k, pd.concat([first, again], ignore_index=True)).requests)
        cold = stats(replay(k, df).requests)
        conv = stats(S.replay_run(run, root, k)[1].requests)
        m = S.measured(run, root, df).iloc[0]
        meas = pd.read_csv(run.requests)
        row = {"load": run.run, "ttft_measured_ms": m["ttft_mean"] * 1e3}
        row.update({f"ttft_{n}_ms": v[0] for n, v in (("cold", cold), ("conv", conv),
                                                      ("warm", warm))})
        row["itl_measured_ms"] = m["itl_mean"] * 1e3
        row.update({f"itl_{n}_ms": v[1] for n, v in (("cold", cold), ("conv", conv),
                                                     ("warm", warm))})
        row["slope_measured"] = slope(meas["input_tokens"], meas["ttft_us"] / 1e6)
        row.update({f"slope_{n}": v[2] for n, v in (("cold", cold), ("conv", conv),
                                                    ("warm", warm))})
        rows.append(row)
    return pd.DataFrame(rows)


def _in_flight(sent_s, e2e_s) -> np.ndarray:
    """Per request, the requests sent before it and not finished when it is sent."""
    sent = np.asarray(sent_s, float)
    end = sent + np.asarray(e2e_s, float)
    return np.array([int(np.sum((sent < t) & (end > t))) for t in sent])


def llmd_inflight(root: str | Path, width: int = 20) -> pd.DataFrame:
    """Mean TTFT (ms) of the llm-d requests by requests in flight at their send (bins of
    ``width``), measured and replayed with the shipped constants, over every load point
    (the warm-up turns are not counted, on either side)."""
    k = S.open_kernel(S.LLMD)
    meas, pred = [], []
    for run in S.discover(root, ("llm-d",)):
        m = pd.read_csv(run.requests)
        meas.append(pd.DataFrame({"in_flight": _in_flight(m["arrival_time_us"] / 1e6,
                                                          m["e2e_us"] / 1e6),
                                  "ttft_ms": m["ttft_us"] / 1e3}))
        t = S.replay_run(run, root, k)[1].requests
        t = t[~t["warm_up"].astype(bool)]
        pred.append(pd.DataFrame({"in_flight": _in_flight(t["arrival_s"], t["e2e_s"]),
                                  "ttft_ms": t["ttft_s"] * 1e3}))
    rows = []
    for name, parts in (("measured", meas), ("replayed", pred)):
        d = pd.concat(parts, ignore_index=True)
        d["bin"] = d["in_flight"] // width * width
        g = d.groupby("bin")["ttft_ms"]
        rows.append(pd.DataFrame({f"{name}_requests": g.size(), f"{name}_ttft_ms": g.mean(),
                                  f"{name}_ttft_p90_ms": g.quantile(0.9)}))
    out = pd.concat(rows, axis=1).reset_index().rename(columns={"bin": "in_flight_from"})
    return out.fillna(0)


def llmd_token(root: str | Path, per_token_us=(170.0, 200.0)) -> pd.DataFrame:
    """The llm-d held-out load points' mean TTFT error (%) with the shipped
    ``host_api_server_per_token`` and with each of ``per_token_us`` instead (what-ifs;
    everything else as shipped)."""
    k = S.open_kernel(S.LLMD)
    shipped = float(k.params["host_api_server_per_token"]) * 1e6
    every = S.discover(root, ("llm-d",))
    held = S.held_out("llm-d", [r.run for r in every])
    runs = [r for r in every if r.run in held]
    out = pd.DataFrame({"load": [r.run for r in runs]})
    for us in (shipped, *per_token_us):
        kk = k.with_params(k.params.replace(host_api_server_per_token=us * 1e-6))
        out[f"ttft_error_{us:g}us_pct"] = [
            100 * float(S.replay_run(r, root, kk)[0]["ttft_mean_error"].iloc[0]) for r in runs]
    return out


TABLES = ("operating_point", "decode_attention", "moe", "workstation", "llmd_cache",
          "llmd_inflight", "llmd_token")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.serving_runs_diagnosis",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/serving-runs")
    p.add_argument("--profiles", default="../shared/data/aic-op-profiles")
    p.add_argument("--only", nargs="*", choices=TABLES, default=list(TABLES))
    a = p.parse_args(argv)
    import jkernel

    jkernel.enable_x64()
    pd.set_option("display.width", 220)
    calls = {"operating_point": lambda: operating_point(a.data),
             "decode_attention": lambda: decode_attention(a.profiles),
             "moe": lambda: moe(a.profiles), "workstation": lambda: workstation(a.data),
             "llmd_cache": lambda: llmd_cache(a.data),
             "llmd_inflight": lambda: llmd_inflight(a.data),
             "llmd_token": lambda: llmd_token(a.data)}
    for name in a.only:
        print(f"## {name}")
        print(calls[name]().to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
