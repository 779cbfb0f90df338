"""The replay end to end: timelines priced by the kernel, the resolved settings it obeys,
rejections, bad input, and the ``jkernel replay`` command on a committed excerpt."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import jkernel
from conftest import bundle_with as _bundle_with
from jkernel import cli
from jkernel.replay import load_requests, replay, replay_disaggregated
from jkernel.replay.scheduler import PoolLimits
from jkernel.replay.sim import step_ticks, ticks

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "residency-vllm"
QWEN = ROOT / "catalog" / "scenarios" / "qwen3-14b-h100-tp1.yaml"
DISAGG = ROOT / "catalog" / "scenarios" / "llama-3.1-70b-h200-disagg.yaml"


def bundle_with(tmp: Path, source: Path = QWEN, **engine) -> Path:
    return _bundle_with(tmp, source, **engine)


@lru_cache(maxsize=None)
def qwen(**engine) -> jkernel.Kernel:
    if not engine:
        return jkernel.open(QWEN)
    import tempfile

    return jkernel.open(bundle_with(Path(tempfile.mkdtemp()), **engine))


def table(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["request_id", "arrival_s", "input_tokens",
                                       "output_tokens"])


def us(k, prompt, computed):
    return step_ticks(k.step_time(jkernel.Batch(prompt, computed)).expected_s)


# -- timelines ---------------------------------------------------------------------------------

@pytest.mark.parametrize("async_", [True, False])
def test_one_request_is_priced_step_by_step(async_):
    k = qwen() if async_ else qwen(async_scheduling=False)
    assert k.resolution().async_scheduling is async_
    prompt, out = 300, 4
    res = replay(k, table([(7, 0.0, prompt, out)]))
    r = res.requests.iloc[0]
    adm = ticks(k.admission_overhead(prompt))
    steps = [us(k, [prompt], [0])] + [us(k, [1], [prompt + i]) for i in range(out - 1)]
    tok = ticks(k.output_token_overhead())
    assert r.request_id == 7 and not r.rejected and r.preemptions == 0
    assert round(r.ttft_s * 1e6) == adm + steps[0] + tok
    assert round(r.e2e_s * 1e6) == adm + sum(steps) + tok + ticks(k.completion_overhead())
    assert r.itl_mean_s == pytest.approx(sum(steps[1:]) / (out - 1) / 1e6, abs=1e-6)
    assert res.summary["steps"] == out == len(res.steps)
    assert np.allclose(res.itl_gaps_s * 1e6, steps[1:], atol=0.5)


def test_an_idle_gap_leaves_the_engine_idle_and_costs_nothing():
    k = qwen()
    res = replay(k, table([(0, 0.0, 200, 3), (1, 100.0, 200, 3)]))
    a, b = res.requests.itertuples()
    assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-6)       # no queueing after the gap
    assert a.e2e_s == pytest.approx(b.e2e_s, abs=1e-6)
    assert res.summary["steps"] == 6
    st = res.steps
    assert st.start_s.iloc[3] == pytest.approx(100.0 + ticks(k.admission_overhead(200)) / 1e6)


def test_async_scheduling_admits_a_request_one_step_later():
    """A request that becomes ready while step N runs: synchronous scheduling runs it in step
    N+1; asynchronous scheduling had already scheduled N+1 when N started, so N+2."""
    rows = [(0, 0.0, 4000, 20), (1, 0.001, 500, 2)]
    starts = {}
    for async_ in (False, True):
        k = qwen() if async_ else qwen(async_scheduling=False)
        res = replay(k, table(rows))
        # The step in which request 1's prompt first runs: the first with 500 + tokens.
        st = res.steps
        first = st.index[st.prefill_tokens > 0][1]
        starts[async_] = int(first)
    assert starts == {False: 1, True: 2}


def _api(k, per_request_s: float, per_token_s: float):
    return k.with_params(k.params.replace(host_api_server_per_request=per_request_s,
                                          host_api_server_per_token=per_token_s))


def test_the_api_server_streams_a_steps_tokens_one_after_another():
    """The API server's work per streamed token (jkernel.replay.sim): three requests whose
    prompts run in one step get their first tokens 3 × the token time after it ends, and a
    request alone one token time later than without the work."""
    k = qwen()
    rows = [(i, 0.5, 200, 2) for i in range(3)]
    base, work = replay(k, table(rows)), replay(_api(k, 0.0, 1e-3), table(rows))
    assert np.allclose(work.requests.ttft_s - base.requests.ttft_s, 3e-3, atol=1e-6)
    one = [(0, 0.0, 300, 4)]
    b1, w1 = replay(k, table(one)), replay(_api(k, 0.0, 1e-3), table(one))
    assert w1.requests.ttft_s.iloc[0] - b1.requests.ttft_s.iloc[0] == pytest.approx(1e-3,
                                                                                    abs=1e-6)
    assert w1.requests.itl_mean_s.iloc[0] == pytest.approx(b1.requests.itl_mean_s.iloc[0],
                                                           abs=1e-6)


def test_requests_queue_on_a_busy_api_server_one_admission_at_a_time():
    """Admission work queues: of requests reaching the server together, the i-th reaches
    the engine i admissions later; a request's own admission is part of its
    admission_overhead (it reaches the engine when both are over), so a request alone whose
    admission work is within that delay is not delayed at all."""
    k = qwen()
    adm = ticks(k.admission_overhead(200)) / 1e6
    rows = [(i, 0.0, 200, 2) for i in range(3)]
    res = replay(_api(k, 1.0, 0.0), table(rows))
    pre = res.steps[res.steps.prefill_tokens > 0]
    assert np.allclose(pre.start_s, 1.0 + np.arange(3) * 1.0, atol=1e-6)   # 1 s > adm
    assert (pre.requests == 1).all()
    base = replay(k, table(rows[:1])).requests.ttft_s.iloc[0]
    assert replay(_api(k, adm / 2, 0.0), table(rows[:1])).requests.ttft_s.iloc[0] == \
        pytest.approx(base, abs=1e-6)


def test_without_api_server_work_the_replay_is_unchanged():
    """The catalog's default (no API-server work) replays exactly as the delays alone."""
    k = qwen()
    assert k.api_server_work() == (0.0, 0.0)
    rng = np.random.default_rng(5)
    rows = [(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(
        np.cumsum(rng.exponential(0.05, 60)), rng.integers(50, 900, 60),
        rng.integers(2, 40, 60)))]
    a = replay(k, table(rows)).requests
    b = replay(_api(k, 0.0, 0.0), table(rows)).requests
    pd.testing.assert_frame_equal(a, b)


def test_token_budget_and_max_num_seqs_bound_every_step():
    k = qwen(max_num_seqs=4, max_num_batched_tokens=512)
    assert k.settings.max_num_seqs == 4 and k.settings.max_num_batched_tokens == 512
    res = replay(k, table([(i, 0.0, 300, 8) for i in range(10)]))
    assert res.summary["completed"] == 10
    assert res.steps.requests.max() == 4
    assert res.steps.tokens.max() <= 512
    assert (res.steps.tokens == 512).any()                    # chunked prefill fills it


def test_preemption_when_the_cache_is_small(tmp_path):
    base = qwen()
    util = (base.fixed_bytes().total() + 200.5 * base.page_bytes()) / \
        base.device_memory_bytes()
    # vLLM refuses to start when one max_model_len sequence cannot fit the cache: jkernel.open
    # refuses the pool (jkernel.startup.start_refusal), and so does the replay of a kernel
    # built by jkernel.new from the same documents.
    doc = bundle_with(tmp_path, gpu_memory_utilization=round(util, 6))
    with pytest.raises(ValueError, match="max_model_len 40960 needs 2560 KV pages.*would not"):
        jkernel.open(doc)
    refused = jkernel.new(jkernel.open_inputs(doc))
    with pytest.raises(ValueError, match="max_model_len 40960 needs 2560 KV pages.*would not"):
        replay(refused, table([(0, 0.0, 10, 2)]))
    tight = jkernel.open(bundle_with(tmp_path, gpu_memory_utilization=round(util, 6),
                                     max_model_len=3000))
    assert 150 <= tight.kv_cache_pages() <= 250
    burst = table([(i, 0.0, 512, 128) for i in range(16)])   # 16 · 640 tokens ≫ 200 pages
    roomy, squeezed = replay(base, burst), replay(tight, burst)
    assert roomy.summary["preemptions"] == 0
    assert squeezed.summary["preemptions"] > 0
    assert squeezed.requests.preemptions.sum() == squeezed.summary["preemptions"]
    assert squeezed.summary["completed"] == 16
    assert squeezed.summary["kv_usage_peak"] > 0.9 > roomy.summary["kv_usage_peak"]
    assert squeezed.summary["e2e_mean_s"] > roomy.summary["e2e_mean_s"]


def test_prefix_caching_hits_a_shared_prefix():
    k = qwen()
    reqs = table([(0, 0.0, 1000, 2), (1, 5.0, 1000, 2), (2, 10.0, 1000, 2)])
    reqs["prefix_group"] = ["g", "g", ""]
    reqs["prefix_length"] = [800, 800, 0]
    res = replay(k, reqs).requests
    assert list(res.cached_tokens) == [0, 800, 0]
    assert res.ttft_s[1] < res.ttft_s[0] == pytest.approx(res.ttft_s[2], abs=1e-6)
    off = replay(qwen(enable_prefix_caching=False), reqs).requests
    assert list(off.cached_tokens) == [0, 0, 0]


def test_disaggregated_pair_flow():
    pre, dec = jkernel.open_pool(DISAGG, "prefill"), jkernel.open_pool(DISAGG, "decode")
    prompt = 1000
    res = replay_disaggregated(pre, dec, table([(0, 0.0, prompt, 3)]))
    r = res.requests.iloc[0]
    xfer = ticks(pre.pd_transfer_time(prompt, jkernel.Placement(node=0),
                                      jkernel.Placement(node=1)))
    assert xfer > 0
    expect = (ticks(pre.admission_overhead(prompt)) + us(pre, [prompt], [0]) + xfer
              + ticks(dec.admission_overhead(prompt)) + us(dec, [1], [prompt - 1])
              + ticks(dec.output_token_overhead()))
    assert round(r.ttft_s * 1e6) == expect
    assert set(res.steps.pool) == {"prefill", "decode"}
    assert (res.steps.pool == "prefill").sum() == 1 and (res.steps.pool == "decode").sum() == 3


def test_requests_arriving_together_are_scheduled_together():
    res = replay(qwen(), table([(i, 0.5, 200, 2) for i in range(3)]))
    assert res.steps.requests.iloc[0] == 3 and res.steps.tokens.iloc[0] == 600
    assert res.requests.ttft_s.nunique() == 1


def test_a_run_is_deterministic_and_keeps_up_below_saturation():
    rng = np.random.default_rng(3)
    n = 150
    arr = np.cumsum(rng.exponential(1 / 4.0, n))
    reqs = table([(i, a, int(p), 32) for i, (a, p) in
                  enumerate(zip(arr, rng.integers(500, 1500, n)))])
    a, b = replay(qwen(), reqs), replay(qwen(), reqs)
    assert a.summary == b.summary
    assert a.summary["completed"] == n and a.summary["rejected"] == 0
    assert a.summary["requests_per_s"] == pytest.approx(4.0, rel=0.25)
    s = a.summary
    assert 0 < s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
    assert s["itl_p50_s"] <= s["itl_p90_s"] and s["e2e_mean_s"] > s["ttft_mean_s"]


# -- rejections and bad input ----------------------------------------------------------------

def test_a_request_longer_than_max_model_len_is_rejected_and_counted():
    k = qwen()
    reqs = table([(0, 0.0, 100, 4), (1, 0.1, 40_900, 100), (2, 0.2, 100, 4)])
    res = replay(k, reqs)
    t = res.requests
    assert list(t.request_id) == [0, 1, 2]                     # nothing dropped
    assert list(t.rejected) == [False, True, False]
    assert "max_model_len" in t.reject_reason[1] and "40960" in t.reject_reason[1]
    assert np.isnan(t.ttft_s[1]) and np.isnan(t.e2e_s[1])
    assert res.summary["rejected"] == 1 and res.summary["completed"] == 2


def test_the_replay_honours_the_max_model_len_the_kernel_resolved_when_the_bundle_states_none():
    """With no max_model_len in the bundle, vLLM v0.31.0 serves the length the model's
    config.json gives and answers 400 to a longer request. The replay read max_model_len from
    the bundle alone (the kernel's settings never held it), so with none stated it took a
    request longer than the engine serves and priced it."""
    k = jkernel.open("llama-3.1-8b-a100-tp1")
    assert k.inputs.deployment.pools[k.inputs.pool_index].engine.max_model_len == 0
    limit = k.inputs.model_max_len
    assert limit == 131072                      # Llama 3.1's max_position_embeddings
    res = replay(k, table([(0, 0.0, limit - 1, 2), (1, 0.0, 100, 2), (2, 0.0, limit - 2, 2)]))
    t = res.requests
    assert list(t.rejected) == [True, False, False]
    assert t.reject_reason[0] == f"max_model_len: {limit + 1} tokens (prompt + output) > {limit}"
    assert res.summary["completed"] == 2


@pytest.mark.parametrize("stated", [None, False, True])
def test_the_replay_takes_prefix_caching_from_the_kernels_settings(stated):
    """Prefix caching is on unless the engine states it off (vLLM v0.31.0); the replay's
    limits take it, async scheduling and max_model_len from the kernel's resolved settings."""
    k = qwen() if stated is None else qwen(enable_prefix_caching=stated)
    assert k.settings.enable_prefix_caching is (stated is not False)
    lim = PoolLimits(k)
    assert lim.prefix_caching is k.settings.enable_prefix_caching
    assert lim.async_scheduling is k.settings.async_scheduling
    assert lim.max_model_len == k.settings.max_model_len == 40960
    reqs = table([(0, 0.0, 1000, 2), (1, 5.0, 1000, 2)])
    reqs["prefix_group"], reqs["prefix_length"] = ["g", "g"], [800, 800]
    hits = list(replay(k, reqs).requests.cached_tokens)
    assert hits == ([0, 800] if k.settings.enable_prefix_caching else [0, 0])


def test_missing_column_names_the_column_and_the_file(tmp_path):
    p = tmp_path / "reqs.csv"
    table([(0, 0.0, 10, 2)]).drop(columns="output_tokens").to_csv(p, index=False)
    with pytest.raises(ValueError, match=r"reqs\.csv.*'output_tokens'"):
        load_requests(p)


@pytest.mark.parametrize("value, what", [(-5, "≥ 1"), (2.5, "whole"), (None, "missing")])
def test_bad_token_counts_name_the_row(tmp_path, value, what):
    df = table([(0, 0.0, 10, 2), (1, 1.0, 10, 2), (2, 2.0, 10, 2)])
    df["input_tokens"] = df["input_tokens"].astype(object)
    df.loc[2, "input_tokens"] = value
    p = tmp_path / "bad.csv"
    df.to_csv(p, index=False)
    with pytest.raises(ValueError, match=r"bad\.csv.*'input_tokens'") as e:
        load_requests(p)
    assert what in str(e.value) and "row 2" in str(e.value)


def test_unsorted_arrivals_are_sorted_stably_and_said_so():
    df = table([(0, 2.0, 10, 2), (1, 1.0, 10, 2), (2, 1.0, 11, 2)])
    got = load_requests(df)
    assert list(got.request_id) == [1, 2, 0] and got.attrs["sorted"] is True
    res = replay(qwen(), df).requests
    assert list(res.request_id) == [1, 2, 0] and res.e2e_s.notna().all()


def test_arrival_time_us_and_duplicate_ids():
    df = pd.DataFrame({"request_id": [0, 1], "arrival_time_us": [0, 1_500_000],
                       "input_tokens": [10, 10], "output_tokens": [2, 2]})
    assert list(load_requests(df).arrival_s) == [0.0, 1.5]
    df["request_id"] = [3, 3]
    with pytest.raises(ValueError, match="repeats"):
        load_requests(df)


def test_client_trace_reads_send_time_and_server_tokens():
    reqs = load_requests(DATA / "agg_2rps_head.csv")
    raw = pd.read_csv(DATA / "agg_2rps_head.csv")
    # The client logs requests in issue order; a few were sent out of order (tenants'
    # threads), so the table comes back sorted by send time.
    assert not raw.send_time_us.is_monotonic_increasing and reqs.attrs["sorted"]
    raw = raw.sort_values("send_time_us", kind="stable")
    assert list(reqs.request_id) == list(raw.request_id)
    assert len(reqs) == len(raw) == 60
    assert reqs.arrival_s.iloc[0] == 0.0
    assert list(reqs.input_tokens) == list(raw.server_input_tokens)
    assert np.allclose(reqs.arrival_s, (raw.send_time_us - raw.send_time_us.min()) / 1e6)


# -- the command ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_cli_replays_the_committed_excerpt(tmp_path, capsys, suffix):
    out = tmp_path / f"out{suffix}"
    rc = cli.main(["replay", "qwen3-14b-h100-tp1", "--requests",
                   str(DATA / "agg_2rps_head.csv"), "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("TTFT", "ITL", "E2E", "p99", "steps", "KV usage peak", "throughput"):
        assert word in text
    got = pd.read_csv(out) if suffix == ".csv" else pd.read_parquet(out)
    assert len(got) == 60
    for col in ("request_id", "ttft_s", "e2e_s", "itl_mean_s", "preemptions", "rejected"):
        assert col in got.columns
    assert got.ttft_s.gt(0).all() and (got.e2e_s > got.ttft_s).all()


def test_cli_names_a_missing_column(tmp_path, capsys):
    p = tmp_path / "x.csv"
    pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "input_tokens": [4]}).to_csv(p)
    rc = cli.main(["replay", "qwen3-14b-h100-tp1", "--requests", str(p)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "x.csv" in err and "output_tokens" in err


@pytest.mark.parametrize("clock", ["expected_s", "no_overlap_s"])
def test_the_pool_prices_exactly_as_step_time(clock):
    from jkernel.replay.sim import Pool

    k = qwen()
    pool = Pool(k, clock=clock)
    rng = np.random.default_rng(0)
    for n in (1, 17, 70):
        sched = [int(x) for x in rng.integers(1, 400, n)]
        comp = [int(x) for x in rng.integers(0, 5000, n)]
        items = [(None, s, c, False) for s, c in zip(sched, comp)]
        want = step_ticks(getattr(k.step_time(jkernel.Batch(sched, comp)), clock))
        assert pool.price([items]) == want


def test_progress_bar_changes_nothing(capsys):
    reqs = table([(i, 0.1 * i, 100, 3) for i in range(5)])
    quiet, shown = replay(qwen(), reqs), replay(qwen(), reqs, progress=True)
    assert quiet.summary == shown.summary
    assert "replay" in capsys.readouterr().err


def test_parquet_request_file_and_unknown_suffix(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet request files need the optional extra "
                        "jkernel[replay]")
    df = pd.DataFrame({"request_id": ["a", "b"], "arrival_time_us": [0, 250_000],
                       "input_tokens": [12, 30], "output_tokens": [3, 2]})
    p = tmp_path / "reqs.parquet"
    df.to_parquet(p)
    got = load_requests(p)
    assert list(got.request_id) == ["a", "b"] and list(got.arrival_s) == [0.0, 0.25]
    res = replay(qwen(), got)
    assert list(res.requests.request_id) == ["a", "b"] and res.summary["completed"] == 2
    q = tmp_path / "reqs.json"
    q.write_text("{}")
    with pytest.raises(ValueError, match=r"reqs\.json.*allowed: \.csv, \.parquet"):
        load_requests(q)


def test_data_parallel_replicas_step_in_lockstep():
    k = jkernel.open("qwen3-30b-a3b-h200-ep")
    dp = k.resolution().data_parallel()
    assert dp >= 2, f"the shipped scenario qwen3-30b-a3b-h200-ep resolved dp {dp}"
    from jkernel.replay.sim import Pool

    pool = Pool(k)
    assert len(pool.engines[0].replicas) == dp
    # Two requests ready at once go to two replicas and run in one step, priced with the
    # lighter replica padded to the heavier one's tokens (the arrivals are spaced so that
    # admission, which grows with the prompt, ends at the same tick).
    lag = k.admission_overhead(800) - k.admission_overhead(300)
    res = replay(k, table([(0, 0.0, 800, 2), (1, round(lag, 6), 300, 2)]))
    first = res.steps.iloc[0]
    assert first.requests == 2 and first.tokens == 1100
    heavy = k.step_time(jkernel.Batch([800], [0])).expected_s
    light = k.step_time(jkernel.Batch([300], [0], pad_tokens=500)).expected_s
    assert first.duration_s == pytest.approx(max(heavy, light), abs=1e-6)


def test_client_trace_row_without_a_server_count_keeps_the_clients(tmp_path):
    raw = pd.read_csv(DATA / "agg_2rps_head.csv").head(3)
    raw.loc[1, "server_input_tokens"] = 0
    raw.loc[1, "status"] = "error"
    p = tmp_path / "trace.csv"
    raw.to_csv(p, index=False)
    got = load_requests(p).set_index("request_id")
    rid = raw.request_id[1]
    assert got.loc[rid, "input_tokens"] == raw.input_tokens[1]
    assert got.loc[rid, "input_tokens_source"] == "client"
    assert got.loc[rid, "client_status"] == "error" and len(got) == 3


def test_cli_json_summary(capsys):
    import json

    rc = cli.main(["replay", "qwen3-14b-h100-tp1", "--requests",
                   str(DATA / "agg_2rps_head.csv"), "--json", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 60 and summary["rejected"] == 0
    assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]


def test_an_empty_table_replays_to_an_empty_result():
    res = replay(qwen(), table([]))
    assert len(res.requests) == 0 and res.summary["completed"] == 0
    assert res.summary["steps"] == 0 and np.isnan(res.summary["ttft_mean_s"])


def test_the_step_table_is_what_pandas_builds_from_the_step_log_rows():
    """The replay builds its step table column by column (faster than pandas' row-wise
    conversion of 35,000 tuples); values and dtypes are those of the row-wise table, for
    an empty log too, and a replay's gaps are the per-request diffs of its token times."""
    from jkernel.replay.api import STEP_COLUMNS, _step_table

    log = [("", 0, 10, 5, 3, 100, 90, 0.25), ("decode", 1, 20, 7, 2, 2, 0, 0.0)]
    for rows in (log, log[:1], []):
        pd.testing.assert_frame_equal(_step_table(rows),
                                      pd.DataFrame(rows, columns=list(STEP_COLUMNS)))
    k = qwen()
    rng = np.random.default_rng(3)
    reqs = pd.DataFrame({"request_id": np.arange(12), "arrival_s": np.sort(rng.uniform(0, 2, 12)),
                         "input_tokens": rng.integers(50, 400, 12),
                         "output_tokens": rng.integers(1, 20, 12)})
    res = replay(k, reqs)
    for i, row in res.requests.iterrows():
        gaps = res.token_gaps_s[i]
        assert len(gaps) == max(int(row["output_tokens"]) - 1, 0)
        if len(gaps):
            assert (gaps > 0).all()
            assert gaps.sum() == pytest.approx(row["finish_s"] - row["first_token_s"]
                                               - ticks(k.completion_overhead()) / 1e6,
                                               abs=1e-9)
