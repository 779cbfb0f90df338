"""``plan --concurrency`` replays closed-loop clients (jkernel.search.clients), and agrees
with ``plan --rate`` where the two describe the same load."""

from __future__ import annotations

import numpy as np
import pytest

import jkernel
from jkernel import search

KW = dict(chip="h100", gpus=1, isl=1024, osl=64, modes=("colocated",), quantizations=("",),
          kv_dtypes=("auto",), tps=(1,), requests=400, replay_top=1)
N = 16


@pytest.fixture(scope="module")
def by_concurrency():
    return search.plan("llama-3.1-8b-instruct", concurrency=N, **KW)


def replayed(result):
    return result.table[result.table["replayed"]].iloc[0]


def test_plan_concurrency_replays_exactly_n_clients(by_concurrency, tmp_path):
    """The table's figures are a closed-loop replay: N requests in flight from the first
    send to the last, throughput by Little's law, and the candidate replayed on its own
    with search.workload and search.clients gives the table's figures."""
    best = replayed(by_concurrency)
    wl = by_concurrency.workload
    assert search.clients(wl).concurrency == N and (search.workload(wl).arrival_s == 0).all()
    cand = by_concurrency.candidate(best["configuration"])
    path = tmp_path / "best.yaml"
    path.write_text(cand.bundle_yaml(wl.isl + wl.osl))
    from jkernel.replay import replay

    res = replay(jkernel.open(str(path)), search.workload(wl), clients=search.clients(wl))
    fig = search.replay_figures(res, cand.fleet.gpus)
    for col in ("ttft_p50_s", "itl_p50_s", "itl_p90_s", "load_tok_s_gpu"):
        assert fig[col] == pytest.approx(best[col], rel=1e-12), col
    r = res.requests
    t = np.unique(np.concatenate([r.arrival_s, r.finish_s]))
    sent, fin = np.sort(r.arrival_s), np.sort(r.finish_s)
    count = np.searchsorted(sent, t, "right") - np.searchsorted(fin, t, "right")
    assert set(count[(t >= sent[0]) & (t < sent[-1])]) == {N}
    inside = (r.finish_s > sent[0]) & (r.finish_s <= sent[-1])
    x = inside.sum() / (sent[-1] - sent[0])
    assert x * r.e2e_s[inside].mean() == pytest.approx(N, rel=0.03)
    assert best["load_tok_s_gpu"] == pytest.approx(x * wl.osl, rel=0.03)


def test_plan_rate_at_the_throughput_of_plan_concurrency_agrees(by_concurrency):
    """The same load two ways: the rate plan whose Poisson arrivals come at the request
    rate the N clients achieved gives the same output rate per GPU and the same ITL (the
    decode batch holds about N requests either way); its TTFT differs, as it should: a
    closed loop of identical requests sends them in waves, a Poisson stream one by one."""
    best = replayed(by_concurrency)
    x = best["load_tok_s_gpu"] * KW["gpus"] / KW["osl"]            # requests/s achieved
    # search.workload's seeded Poisson arrivals realise a rate a fixed factor off the
    # nominal one (the draw is exponential(1/rate) × n): aim the nominal rate so that the
    # realised one is x
    unit = search.workload(search.Workload(KW["isl"], KW["osl"], 1.0, requests=KW["requests"]))
    realised = (len(unit) - 1) / unit.arrival_s.iloc[-1]
    by_rate = search.plan("llama-3.1-8b-instruct", rate=x / realised, **KW)
    other = replayed(by_rate)
    assert other["configuration"] == best["configuration"]
    assert other["load_tok_s_gpu"] == pytest.approx(best["load_tok_s_gpu"], rel=0.05)
    assert other["itl_p50_s"] == pytest.approx(best["itl_p50_s"], rel=0.05)
