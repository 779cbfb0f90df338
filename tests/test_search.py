"""The deployment search (jkernel.search): enumeration under vLLM's rules, refusals with
their reasons, the pre-screen's arithmetic, ranking and the Pareto front on hand-checked
rows, the parallel and Ray paths against the single-process run, the CLI's bad inputs, and
a best candidate replayed on its own reproducing the table's figures."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jkernel
from jkernel import search, startup
from jkernel.errors import Refusal

ROOT = Path(__file__).resolve().parent.parent


def _wl(**kw):
    base = dict(isl=1024, osl=128, rate=4.0, ttft_s=2.0, itl_s=0.05, requests=120)
    base.update(kw)
    return search.Workload(**base)


# -- enumeration against vLLM's rules ------------------------------------------------------

def test_dense_model_enumerates_no_expert_parallelism():
    fl = search.fleet("h200", 16)
    cands = search.enumerate_candidates("llama-3.1-70b-instruct", fl)
    assert all(not p.ep and p.dp == 1 for c in cands for p in c.pools)
    colo = [c for c in cands if c.mode == "colocated"]
    assert sorted({c.pools[0].tp for c in colo}) == [1, 2, 4, 8, 16]
    # bf16 checkpoint on H200: checkpoint and online fp8; KV auto and fp8
    assert {(c.quantization, c.kv_dtype) for c in colo} == {
        ("", "auto"), ("", "fp8"), ("fp8", "auto"), ("fp8", "fp8")}
    # 2 nodes: disaggregation splits them 1 + 1 (pools hold whole nodes)
    dis = [c for c in cands if c.mode == "disaggregated"]
    assert dis and all(c.pools[0].nodes == 1 and c.pools[1].nodes == 1 for c in dis)
    assert {c.pools[0].role for c in dis} == {"prefill"}


def test_moe_model_enumerates_expert_parallelism_only_with_a_group():
    fl = search.fleet("h200", 8)
    cands = search.enumerate_candidates("qwen3-30b-a3b", fl, modes=("colocated",))
    eps = {(c.pools[0].tp, c.pools[0].dp, c.pools[0].ep) for c in cands}
    assert (2, 4, True) in eps and (2, 4, False) in eps
    assert (1, 1, True) not in eps            # no EP without a group to spread over
    assert all(c.pools[0].tp * c.pools[0].dp <= 8 for c in cands)


def test_tp_that_does_not_divide_the_heads_is_refused_with_vllms_reason():
    # Llama-4-Scout has 40 attention heads: tp 16 does not divide them, tp 8 does.
    fl = search.fleet("h200", 16)
    wl = _wl()
    cands = {c.label(): c for c in search.enumerate_candidates(
        "llama-4-scout-17b-16e", fl, modes=("colocated",), quantizations=("",),
        kv_dtypes=("auto",))}
    with pytest.raises(Refusal) as exc:
        search.build_pool(cands["tp16 w:ckpt kv:auto"], 0, wl)
    assert exc.value.code == "R5" and "40 attention heads" in exc.value.reason
    k = search.build_pool(cands["tp8 w:ckpt kv:auto"], 0, wl)
    assert k.plan.tp == 8


def test_a_pool_that_does_not_fit_is_refused_with_its_reason():
    fl = search.fleet("h200", 8)
    wl = _wl()
    c = search.Candidate("llama-3.1-70b-instruct", fl, (search.PoolSpec("colocated", 1, 1),))
    row = search.prescreen(c, wl)
    assert row["refused"].startswith("[FIT]")
    assert "exceed the memory budget" in row["refused"]
    # the same pool at fp8 weights fits
    k = search.build_pool(search.Candidate(c.model, fl, c.pools, "fp8"), 0, wl)
    assert k.kv_cache_pages() > 0


def test_a_cache_too_small_for_one_request_is_refused():
    # Qwen3-32B in bf16 on one H100 keeps ~8 GB for KV (~30k tokens) while its positions
    # allow 40,960: the max_model_len rule passes and the cache cannot hold one request.
    fl = search.fleet("h100", 8)
    c = search.Candidate("qwen3-32b", fl, (search.PoolSpec("colocated", 1, 1),))
    with pytest.raises(Refusal) as exc:
        search.build_pool(c, 0, _wl(isl=40_000, osl=900))
    assert exc.value.code == "FIT" and "needs" in exc.value.reason


def test_fit_check_counts_a_hybrid_models_recurrent_pages():
    """Defect guarded: the planner counted a request's KV pages only, while the replay (and
    memory.md §5) also charge each running sequence's recurrent state against the same
    pages. Both now read jkernel.startup.request_pages (PoolLimits.request_pages is its cached
    form), so a hybrid model's largest screened batch
    is the pages over KV + recurrent pages (Nemotron-3-Nano on one H100 at fp8: 1,998
    recurrent pages per request beside 6,313 KV pages for 101,000 tokens)."""
    from jkernel.replay.scheduler import PoolLimits

    fl = search.fleet("h100", 8)
    c = search.Candidate("nemotron-3-nano-30b-a3b", fl,
                         (search.PoolSpec("colocated", 1, 1),), "fp8")
    wl = _wl(isl=100_000, osl=1000)
    k = search.build_pool(c, 0, wl)
    lim = PoolLimits(k)
    assert lim.fixed_pages > 0
    need = lim.request_pages(101_000)
    assert need == lim.pages_for(101_000) + lim.fixed_pages
    for tokens in (1, 16, 17, 4097, 101_000):
        assert startup.request_pages(k, tokens) == lim.request_pages(tokens)
    b_max = search.screen_pool(c, 0, wl)["b_max"]
    assert b_max == lim.pages // need < lim.pages // lim.pages_for(101_000)


def test_documents_are_the_engines_own_bundle():
    fl = search.fleet("h200", 16)
    c = search.Candidate("llama-3.1-70b-instruct", fl,
                         (search.PoolSpec("prefill", 1, 4), search.PoolSpec("decode", 1, 8)),
                         "fp8", "fp8")
    sc, dep = c.bundle(4608)
    assert sc["cluster"] == {"hardware": "h200", "nodes": 2, "gpus_per_node": 8,
                             "fabric": "ib-400g"}
    assert [p["role"] for p in dep["pools"]] == ["prefill", "decode"]
    assert dep["pools"][1]["engine"] == {"max_model_len": 4608, "quantization": "fp8",
                                         "cache_dtype": "fp8"}
    assert dep["pd_transfer"] == {"connector": "NixlConnector"}
    k = jkernel.open_pool(c.bundle_yaml(4608), "decode")
    assert k.plan.tp == 8 and k.settings.served_dtype == "fp8"


# -- the pre-screen's arithmetic (hand-checked) ------------------------------------------

def test_prescreen_picks_the_largest_batch_within_the_targets():
    fl = search.fleet("h200", 8)
    c = search.Candidate("llama-3.1-8b-instruct", fl, (search.PoolSpec("colocated", 1, 2),))
    screen = {"refused": "", "grid": np.array([1, 2, 4, 8]),
              "itl": np.array([0.01, 0.02, 0.04, 0.08]),
              "ttft": np.array([0.1, 0.1, 0.2, 0.3]),
              "out_tok_s": np.array([100.0, 180.0, 300.0, 400.0]),
              "bottleneck": np.array([1, 1, 0, 0]), "kv_tokens": 1000}
    row = search.prescreen(c, _wl(rate=8.0, osl=100), screens=[screen])
    # ITL ≤ 50 ms holds up to batch 4: 300 tok/s per tp-2 replica → 150 per GPU
    assert row["tok_s_gpu"] == pytest.approx(150.0) and row["batch"] == 4
    assert row["bottleneck"] == "sm" and row["replicas"] == 4
    assert row["capacity_tok_s_gpu"] == pytest.approx(200.0)
    # load: 8 req/s over 4 replicas × 100 tokens = 200 tok/s per replica → batch 4 carries it
    assert row["est_itl_s"] == pytest.approx(0.04) and not row["overloaded"]
    row = search.prescreen(c, _wl(rate=20.0, osl=100), screens=[screen])
    assert row["overloaded"]                 # 500 tok/s per replica > 400
    row = search.prescreen(c, _wl(itl_s=0.005), screens=[screen])
    assert row["tok_s_gpu"] == 0 and "exceeds 5 ms" in row["sla_reason"]


# -- ranking and the front on a tiny hand-checked case ------------------------------------

def _rows():
    def r(name, tok, itl, meets=True, refused=""):
        return {"configuration": name, "mode": "colocated", "refused": refused,
                "tok_s_gpu": tok, "itl_p50_s": itl, "itl_p90_s": itl, "ttft_p90_s": 0.5,
                "ttft_p50_s": 0.4, "replayed": meets, "rejected": 0}
    return [r("A", 100.0, 0.020), r("B", 150.0, 0.030), r("C", 120.0, 0.040),
            r("D", 200.0, 0.090), r("E", 0.0, math.nan, False, "[FIT] no room"),
            r("F", 180.0, 0.010, False)]


def test_rank_orders_sla_meeters_then_built_then_refused():
    wl = _wl(itl_s=0.05)
    t = search.rank(_rows(), wl)
    # D misses the ITL target (90 ms), F was not replayed: both rank after the SLA
    # meeters by tokens/s/GPU (D 200 before F 180); E was refused and comes last
    assert list(t["configuration"]) == ["B", "C", "A", "D", "F", "E"]
    assert list(t["meets_sla"]) == [True, True, True, False, False, False]
    assert list(t["rank"]) == [1, 2, 3, 4, 5, 6]


def test_pareto_front_keeps_the_undominated_points():
    wl = _wl(itl_s=0.05)
    t = search.rank(_rows(), wl)
    front = search.pareto_front(t[t["meets_sla"]])
    # C (120 tok/s at 40 ms) is dominated by B (150 at 30 ms)
    assert list(front["configuration"]) == ["A", "B"]
    front_all = search.pareto_front(t[t["refused"] == ""])
    # F (180 at 10 ms) dominates A, B, C; D (200 at 90 ms) has the most throughput
    assert list(front_all["configuration"]) == ["F", "D"]


# -- the fleet's bad inputs ------------------------------------------------------------

def test_fleet_refusals():
    with pytest.raises(Refusal, match="unknown chip 'h900'"):
        search.fleet("h900", 8)
    with pytest.raises(Refusal, match="whole nodes of 8"):
        search.fleet("h200", 12)
    with pytest.raises(Refusal, match="holds 4 GPUs"):
        search.fleet("gb200-nvl72", 16, gpus_per_node=8)
    assert search.fleet("h200", 4).nodes == 1
    with pytest.raises(Refusal, match="unknown model"):
        search.plan("no-such-model", chip="h200", gpus=8, isl=10, osl=10, rate=1.0)
    with pytest.raises(Refusal, match="exactly one"):
        search.plan("llama-3.1-8b-instruct", chip="h200", gpus=8, isl=10, osl=10)


def _cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jkernel", "plan", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["nope", "--chip", "h200", "--gpus", "8"], "unknown model 'nope'"),
    (["llama-3.1-8b-instruct", "--chip", "h900", "--gpus", "8"], "unknown chip 'h900'"),
    (["llama-3.1-8b-instruct", "--chip", "h200", "--gpus", "12"], "whole nodes of 8"),
    (["llama-3.1-8b-instruct", "--chip", "gb200-nvl72", "--gpus", "16", "--gpus-per-node",
      "8"], "holds 4 GPUs"),
])
def test_cli_bad_inputs(args, message):
    p = _cli(*args, "--isl", "128", "--osl", "16", "--rate", "1")
    assert p.returncode == 2, p.stderr
    assert "refused" in p.stderr and message in p.stderr


def test_cli_impossible_sla_gives_an_empty_front_with_the_reason(tmp_path):
    out = tmp_path / "t.csv"
    p = _cli("llama-3.1-8b-instruct", "--chip", "h100", "--gpus", "1", "--isl", "256",
             "--osl", "16", "--rate", "1", "--itl", "0.0001", "--mode", "colocated",
             "--workers", "1", "--csv", str(out), "--json", str(tmp_path / "t.json"))
    assert p.returncode == 1, p.stderr
    assert "Pareto front: empty: no candidate meets ITL p90 ≤ 0.1 ms" in p.stdout
    assert "exceeds 0.1 ms" in p.stdout
    assert "[screen" in p.stderr                      # progress while it works
    import pandas as pd

    t = pd.read_csv(out)
    assert len(t) == 4 and not t["meets_sla"].any()
    import json

    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["front"] == [] and doc["reason"].startswith("no candidate meets")
    assert len(doc["table"]) == 4


# -- the whole search: replay, reproduction, parallel paths ----------------------------

SMALL = dict(chip="h100", gpus=2, isl=1024, osl=64, ttft_s=1.0, itl_s=0.05, rate=6.0,
             modes=("colocated",), quantizations=("",), kv_dtypes=("auto",), requests=120,
             replay_top=2)


@pytest.fixture(scope="module")
def small():
    return search.plan("llama-3.1-8b-instruct", **SMALL)


@pytest.fixture(scope="module")
def small_point():
    """The same search with point estimates only (no interval draws): what the tests of
    how a search runs compare, at a third of the cost."""
    return search.plan("llama-3.1-8b-instruct", **SMALL, sla_draws=0)


def test_best_colocated_candidate_replayed_on_its_own_reproduces_the_table(small, tmp_path):
    best = small.table[small.table["replayed"]].iloc[0]
    cand = small.candidate(best["configuration"])
    wl = small.workload
    path = tmp_path / "best.yaml"
    path.write_text(cand.bundle_yaml(wl.isl + wl.osl))
    from jkernel.replay import replay

    k = jkernel.open(str(path))
    res = replay(k, search.workload(wl))
    fig = search.replay_figures(res, cand.fleet.gpus)
    for col in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "load_tok_s_gpu"):
        assert fig[col] == pytest.approx(best[col], rel=1e-12), col
    # the steady-state rate carries the offered load (6 req/s × 64 tokens over 2 GPUs)
    assert best["load_tok_s_gpu"] == pytest.approx(6.0 * 64 / 2, rel=0.25)


def test_table_columns_and_json(small):
    t = small.table
    for col in ("configuration", "tok_s_gpu", "ttft_p50_s", "ttft_p90_s", "itl_p50_s",
                "itl_p90_s", "bottleneck", "kv_tokens", "meets_sla", "refused"):
        assert col in t
    doc = small.to_json()
    assert len(doc["table"]) == len(t) and doc["workload"]["isl"] == 1024
    text = search.format_table(small)
    assert "tp1 w:ckpt kv:auto" in text


def test_worker_processes_give_the_single_process_table(small_point):
    par = search.plan("llama-3.1-8b-instruct", workers=2, **SMALL, sla_draws=0)
    cols = [c for c in small_point.table.columns]
    assert par.table[cols].equals(small_point.table[cols])


def test_ray_local_cluster_gives_the_single_process_table(small_point):
    ray = pytest.importorskip("ray", reason="ray is the optional extra jkernel[ray]")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)                       # two workers
    try:
        res = search.plan("llama-3.1-8b-instruct", ray_address=cluster.address, **SMALL,
                          sla_draws=0)
    finally:
        ray.shutdown()
        cluster.shutdown()
    cols = [c for c in small_point.table.columns]
    assert res.table[cols].equals(small_point.table[cols])


# -- plans by probability ------------------------------------------------------------------

def test_replayed_candidates_carry_the_probability_and_margin(small):
    t = small.table
    rep = t[t["replayed"]]
    assert len(rep) and rep["p_sla"].between(0.0, 1.0).all()
    assert rep["sla_margin"].notna().all() and (rep["sla_draws"] == 16).all()
    assert (rep["itl_p50_low_s"] <= rep["itl_p50_s"] * 1.5).all()
    assert t[~t["replayed"]]["p_sla"].isna().all()
    text = search.format_table(small)
    assert "P = probability every target is met" in text


def _prob_rows():
    def r(name, tok, p, replayed=True):
        return {"configuration": name, "mode": "colocated", "refused": "", "tok_s_gpu": tok,
                "itl_p50_s": 0.02, "itl_p90_s": 0.03, "ttft_p90_s": 0.5, "ttft_p50_s": 0.4,
                "replayed": replayed, "rejected": 0, "p_sla": p, "sla_margin": 0.1}
    return [r("A", 300.0, 0.55), r("B", 200.0, 0.95), r("C", 150.0, 0.99),
            r("D", 400.0, math.nan, False)]


def test_sla_confidence_ranks_by_cost_among_the_likely_meeters():
    wl = _wl(itl_s=0.05)
    # point estimates: A, B and C all meet; by probability at 0.9 only B and C
    t = search.rank(_prob_rows(), wl)
    assert list(t["configuration"][:3]) == ["A", "B", "C"] and t["meets_sla"][:3].all()
    t = search.rank(_prob_rows(), wl, confidence=0.9)
    assert list(t["configuration"]) == ["B", "C", "D", "A"]
    assert list(t["meets_sla"]) == [True, True, False, False]
    with pytest.raises(Refusal, match="probability"):
        search.plan("llama-3.1-8b-instruct", chip="h100", gpus=1, isl=10, osl=10, rate=1.0,
                    sla_confidence=1.5)


def test_a_candidate_whose_point_estimate_just_meets_the_sla_has_probability_near_one_half():
    """The ITL target is set to the candidate's own point estimate of p90 ITL; with an
    error model that is unbiased (no bias, no per-step jitter, no front end) the draws
    fall on either side of it about equally."""
    from jkernel.regimes import REGIMES
    from jkernel.uncertainty.errormodel import (CLASSES, ErrorModel, FittedRange, FrontEnd,
                                                Spread)

    em = ErrorModel("symmetric", tuple(Spread(0.0, 0.0) for _ in REGIMES),
                    {c: tuple(Spread(0.0, 0.05) for _ in REGIMES) for c in CLASSES},
                    FrontEnd(0.0, 0.0), FittedRange())
    fl = search.fleet("h100", 1)
    cand = search.Candidate("llama-3.1-8b-instruct", fl, (search.PoolSpec("colocated", 1, 1),))
    wl = _wl(isl=512, osl=32, rate=4.0, requests=60, ttft_s=0.0, itl_s=0.05)
    point = search.replay_candidate(cand, wl)
    wl = _wl(isl=512, osl=32, rate=4.0, requests=60, ttft_s=0.0, itl_s=point["itl_p90_s"])
    fig = search.replay_candidate(cand, wl, draws=32, error_model=em)
    assert fig["itl_p90_s"] == point["itl_p90_s"]
    assert fig["p_sla"] == pytest.approx(0.5, abs=0.2)
    assert abs(fig["sla_margin"]) < 0.05 and fig["sla_binding"] == "itl_p90_s"
