"""More work never costs less: ``expected_s`` is non-decreasing when a request is added,
when a request's scheduled or cached tokens grow, and across the decode/prefill switch
(jkernel's refinements 6–8, 8 on the context-parallel pools). The reference edges keep the
spec's non-monotone rules (parity), pinned here too. ``benchmarks/monotone_check.py`` runs
the long version.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jkernel
from jkernel import Batch, StepOptions, catalog

from conftest import catalog_kernel

SLACK = 1 - 1e-12
SCENARIOS = catalog.list_scenarios()
AIMED = settings(max_examples=30, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# a dense, a sliding-window MoE, MLA+MoE, EP MoE, MTP speculation, an L40S pool
DEPLOYMENTS = ["llama-3.1-70b-h100-tp4", "gpt-oss-120b-b200-tp8", "deepseek-v3-h200-fp8-tp8",
               "qwen3-30b-a3b-h200-ep", "nemotron-3-super-120b-a12b-b200-tp2-mtp",
               "qwen3-32b-l40s-tp4"]
#: every pool of every shipped scenario, as (scenario, pool index)
POOLS = [(n, i) for n in SCENARIOS for i in range(len(jkernel.open_inputs(n).deployment.pools))]


def expected(k, spec: str, **kw) -> float:
    return k.step_time(Batch.from_spec(spec, **kw)).expected_s


# -- cases where more work cost less, each a regression test ------------------------------

@pytest.mark.parametrize("name", ["qwen3-32b-l40s-tp4", "llama-3.1-70b-h100-tp4",
                                  "deepseek-v3-h200-fp8-tp8"])
def test_a_tiny_request_beside_a_long_prefill_does_not_lower_expected(name):
    """Guards: prefill attention took its efficiency from the ramp at the whole step's
    token count, so adding `1x1@0` to `1x2@30000` cut qwen3-32b-l40s-tp4's expected_s from
    48.08 ms to 40.83 ms."""
    k = catalog_kernel(name)
    assert expected(k, "1x2@30000,1x1@0") >= expected(k, "1x2@30000") * SLACK
    assert expected(k, "1x4096@0,1x1@0") >= expected(k, "1x4096@0") * SLACK


DECODES = "1x1@334,1x1@1573,1x60@3455,1x1@3465,1x1@0,1x1@1388,1x1@55480"


@pytest.mark.parametrize("name", ["llama-3.1-70b-h100-tp4", "qwen3-32b-l40s-tp4"])
def test_a_decode_turning_prefill_does_not_lower_expected(name):
    """Guards: a request crossing the decode threshold stopped reading its cached context
    (a prefill's attention read none of it from HBM) and its tiny prefill ran at the ramp of
    the whole step: on qwen3-32b-l40s-tp4, 1x1@52464 → 1x2@52464 beside seven other
    requests cut expected_s by 6.6 %; on llama-3.1-70b-h100-tp4 at threshold 4,
    1x4@28940 → 1x5@28940 by 0.5 % (found by benchmarks/monotone_check.py)."""
    k = catalog_kernel(name)
    assert expected(k, "1x2@20765") >= expected(k, "1x1@20765") * SLACK
    assert (expected(k, f"1x2@52464,{DECODES}") >= expected(k, f"1x1@52464,{DECODES}") * SLACK)
    base = "1x3@134,1x4@3262,1x1@1063"
    assert (expected(k, f"1x5@28940,{base}", decode_threshold=4)
            >= expected(k, f"1x4@28940,{base}", decode_threshold=4) * SLACK)


CONTEXT_PARALLEL_DROPS = [
    # (pool, threshold, base, more): each cut expected_s before refinement 8
    # PCP split the new prefill's rows: the 4-token decode was 4 rows on each rank, the
    # 5-token prefill its busiest rank's 3 (−1.82 %; −0.04 % on the disaggregated prefill)
    ("deepseek-v3-h200-2node-pcp2", 4, "1x4@0,1x13@4000,1x4@32173,1x2@0,1x4@963",
     "1x5@0,1x13@4000,1x4@32173,1x2@0,1x4@963"),
    ("deepseek-v3.2-gb200-2rack-disagg", 4, "1x1867@0,1x1@25123,1x4@0",
     "1x1867@0,1x1@25123,1x5@0"),
    # PCP with DCP replicated a prefill of up to 6 tokens (6 rows) and split one of 7 (4)
    ("glm-5-h200-2node-pcp2-dcp2", 1, "1x6@0,1x1461@1762", "1x7@0,1x1461@1762"),
    # DCP's decode-only query gather and LSE/output combine vanished with the last decode
    # (−2.82 % and −1.60 %)
    ("deepseek-v3.2-h200-fp8-tp8-dcp2", 1, "1x1@0,1x378@0", "1x2@0,1x378@0"),
    ("glm-5-h200-2node-pcp2-dcp2", 1, "1x1@0,1x1461@1762", "1x2@0,1x1461@1762"),
    # the MLA context gather's runs (ordered by new tokens, split at a prefill without
    # context) regrouped when a prefill grew: two gathers became one
    ("deepseek-v3.2-h200-fp8-tp8-dcp2", 1, "1x200@5000,1x201@0,1x300@5000",
     "1x202@5000,1x201@0,1x300@5000"),
]


@pytest.mark.parametrize("name,thr,base,more", CONTEXT_PARALLEL_DROPS)
def test_context_parallel_steps_do_not_get_cheaper_with_more_work(name, thr, base, more):
    """Guards the context-parallel drops benchmarks/monotone_check.py found (408 of 60,000
    pairs, all in the PCP and DCP pools); the edges keep the spec's split and collectives."""
    k = catalog_kernel(name, 0)
    rows = [Batch.from_spec(x, decode_threshold=thr) for x in (base, more)]
    a, b = expected_many(k, [(list(r.scheduled), list(r.computed)) for r in rows], [thr] * 2)
    assert b >= a


def test_the_edges_keep_the_reference_non_monotone_switch():
    """Parity: the reference's overlap edge drops (by about a millisecond at the shipped
    H100 constants) when the request turns prefill (step.md prices no context read for a
    prefill); jkernel keeps it behind the edges and nothing of its own depends on it."""
    k = catalog_kernel("llama-3.1-70b-h100-tp4")
    a = k.step_time(Batch.from_spec("1x1@20765"))
    b = k.step_time(Batch.from_spec("1x2@20765"))
    assert b.overlap_s < a.overlap_s - 0.5e-3
    assert b.expected_s >= a.expected_s


def test_expected_past_the_token_budget_is_what_the_docs_say():
    """Guards: past the token budget qwen3-30b-a3b-h200-ep's expected_s exceeded
    no_overlap_s while the docs called the edges its bounds. What holds, and what the docs
    now say: with refinements off and the host terms zero it lies between the edges; with
    them on it is the sum of its named terms (the all-to-all's second direction, refinement
    5, is work the edges leave out, so it may exceed no_overlap_s)."""
    k = catalog_kernel("qwen3-30b-a3b-h200-ep")
    batch = Batch.from_spec("1x20000@0,4x100@1000")
    host = ("host_replay_graph_per_step", "host_launch_eager_per_layer",
            "host_launch_per_kernel", "kernel_gap", "host_serial")
    off = k.with_options(StepOptions(expected_refinements=False, expected_routed_max=False)
                         ).with_params(k.params.replace(**{h: 0.0 for h in host}))
    e = off.step_time(batch)
    assert e.overlap_s <= e.expected_s * (1 + 1e-12) <= e.no_overlap_s * (1 + 1e-12) ** 2
    table = k.breakdown(batch)
    assert table["expected_s"].sum() == pytest.approx(k.step_time(batch).expected_s, rel=1e-12)


# -- aimed property tests ------------------------------------------------------------------

@st.composite
def aimed_requests(draw):
    """(base scheduled, base cached, more scheduled, more cached, threshold, move): one
    pair of batches where the second holds at least the first's work, aimed at the cases
    that broke: tiny requests beside long prefills, the decode-threshold boundary, batches
    past the token budget."""
    thr = draw(st.sampled_from([1, 1, 4, 3]))
    n = draw(st.integers(1, 8))
    sched, comp = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "edge", "prefill", "long", "past_budget"]))
        sched.append({"decode": draw(st.integers(1, thr)), "edge": thr,
                      "prefill": draw(st.integers(thr + 1, 3000)),
                      "long": draw(st.integers(3000, 12000)),
                      "past_budget": draw(st.integers(16384, 40000))}[kind])
        comp.append(draw(st.sampled_from([0, draw(st.integers(0, 4096)),
                                          draw(st.integers(0, 60000))])))
    move = draw(st.sampled_from(["add", "grow_scheduled", "grow_cached", "threshold"]))
    ms, mc = list(sched), list(comp)
    j = draw(st.integers(0, n - 1))
    if move == "add":
        ms.append(draw(st.sampled_from([1, 2, draw(st.integers(1, 64))])))
        mc.append(draw(st.sampled_from([0, draw(st.integers(0, 30000))])))
    elif move == "grow_scheduled":
        ms[j] += draw(st.integers(1, 2000))
    elif move == "grow_cached":
        mc[j] += draw(st.integers(1, 20000))
    else:
        assume(sched[j] == thr)                       # a decode at the threshold…
        ms[j] = thr + 1                               # …turns prefill
    return sched, comp, ms, mc, thr, move


@st.composite
def aimed_pair(draw):
    """(scenario, base batch, batch with more work, move) on one of :data:`DEPLOYMENTS`."""
    name = draw(st.sampled_from(DEPLOYMENTS))
    sched, comp, ms, mc, thr, move = draw(aimed_requests())
    return (name, Batch(sched, comp, decode_threshold=thr),
            Batch(ms, mc, decode_threshold=thr), move)


@AIMED
@given(aimed_pair())
def test_more_work_never_lowers_expected(case):
    name, base, more, move = case
    k = catalog_kernel(name)
    a, b = k.step_time(base), k.step_time(more)
    assert b.expected_s >= a.expected_s * SLACK, (move, base, more)


WIDTH, PAIRS, FIXED = 16, 6, 64
ROWS = 2 * (PAIRS + FIXED)


def expected_many(k, rows, thr):
    """expected_s of many ``(scheduled, computed)`` batches in one price_many, padded to
    the one shape (ROWS, WIDTH) every test here uses: one compilation per pool."""
    import numpy as np

    assert len(rows) <= ROWS
    s = np.zeros((ROWS, WIDTH), np.int64)
    c = np.zeros((ROWS, WIDTH), np.int64)
    t = np.ones(ROWS, np.int64)
    for i, ((si, ci), ti) in enumerate(zip(rows, thr)):
        s[i, :len(si)], c[i, :len(ci)], t[i] = si, ci, ti
    return k.price_many(scheduled=s, computed=c, decode_threshold=t).expected_s[:len(rows)]


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(aimed_requests(), min_size=PAIRS, max_size=PAIRS))
@pytest.mark.parametrize("name,pool", POOLS)
def test_every_shipped_pool_is_monotone_on_aimed_batches(name, pool, pairs):
    """Every pool of every shipped scenario, the context-parallel ones included (they
    failed before refinement 8: 408 of benchmarks/monotone_check.py's 60,000 pairs, all in
    the PCP and DCP pools): hypothesis's aimed pairs, with a fixed set of 64 pairs drawn as
    benchmarks/monotone_check.py draws them (past the pool's token budget included), priced
    in one price_many. The long run of ≥ 2,000 pairs per pool is the benchmark."""
    import numpy as np

    from benchmarks.monotone_check import draw_pairs

    k = catalog_kernel(name, pool)
    budget = k.settings.max_num_batched_tokens
    bs, bc, ms, mc, thr, _ = draw_pairs(np.random.default_rng(7), FIXED, WIDTH, budget)
    base = [(p[0], p[1]) for p in pairs] + list(zip(bs.tolist(), bc.tolist()))
    more = [(p[2], p[3]) for p in pairs] + list(zip(ms.tolist(), mc.tolist()))
    thrs = [p[4] for p in pairs] + thr.tolist()
    got = expected_many(k, base + more, thrs + thrs)
    a, b = got[:len(base)], got[len(base):]
    bad = np.nonzero(b < a * SLACK)[0]
    assert bad.size == 0, [(base[i], more[i], thrs[i]) for i in bad]
