"""Full model and parallelism coverage, on the shipped catalog.

Every check prices through a kernel built from the shipped catalog and its six standard
coefficient sets: the coverage scenarios (``NEW``), and one-setting variants of them. The
checks are written so that they hold for any coefficient values: an expected figure is built
from the kernel's own params with the spec's formula restated here (step.md §2, §6), never from
a number produced by the implementation.

* the new scenarios open, price, and satisfy the property checks of test_properties.py;
* vectors.md §1.2 (spans), §1.4 (PCP split), §1.5 (windowed pairs), §1.6 (DCP share), §1.7
  (sparse selection) and §2 (state pages) through the kernel;
* every refusal of resolution.md for PCP, DCP, DSA, latent caches, EP width and
  ``dcp_q_replicate``, each beside the feature deployment that opens;
* metamorphic relations (vectors.md §4.4.1, §4.4.3; D9), speculative width and state, and the
  §7 shapes.

Speed: documents are parsed once (``_doc``), kernels are cached by their bundle, and every
kernel prices in one request bucket (64; 256 for the §7 shapes), so each deployment compiles
its step once.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jkernel
from jkernel import Batch, Refusal, catalog
from jkernel.documents import (load_chip, load_coefficient_set, load_fabric, load_graph,
                               load_storage, parse_bundle)
from jkernel.resolve import Inputs
from test_properties import batches, check_one

CAT = catalog.catalog_root()
REG = catalog.registry_root()
BUCKETS = (64, 256)
THR = 8                                       # vectors.md: decode_threshold 8 unless stated

#: The coverage scenarios: the model families and parallel layouts beyond the basic set (DSA,
#: DCP, PCP, recurrent hybrids, MTP, rack-wide and cross-rack EP, EPLB, disaggregated pools).
NEW = [
    "deepseek-v3.2-h200-fp8-tp8", "deepseek-v3.2-h200-fp8-tp8-dcp2",
    "glm-5-h200-2node-pcp2-dcp2", "deepseek-v3-h200-2node-pcp2",
    "qwen3-235b-a22b-h200-tp8-dcp2", "qwen3-235b-a22b-h200-tp8-dcp2-a2a",
    "qwen3.5-397b-a17b-h200-tp8", "nemotron-3-nano-30b-a3b-h100-fp8-tp1-cache-all",
    "nemotron-3-super-120b-a12b-b200-tp2-mtp", "kimi-k3-gb200-nvl72-ep72",
    "minimax-m2.5-h200-2node-ep16", "deepseek-v3-h200-ep8-eplb",
    "minimax-m3-h200-fp8-tp8-ep8", "deepseek-v3-gb200-2rack-ep144",
    "deepseek-v3.2-gb200-2rack-disagg",
]
DISAGG = "deepseek-v3.2-gb200-2rack-disagg"
#: (scenario, pool index) of every new pool
NEW_POOLS = [(n, 0) for n in NEW] + [(DISAGG, 1)]


# -- building kernels cheaply --------------------------------------------------------------

@lru_cache(maxsize=None)
def _doc(kind: str, name: str = ""):
    """One parsed catalog document (immutable; `new` deep-copies what it keeps)."""
    if kind == "model":
        return load_graph(CAT / "models" / name / "graph.yaml", expected_name=name)
    if kind == "chip":
        return load_chip(CAT / "hardware" / f"{name}.yaml")
    if kind == "fabric":
        return load_fabric(CAT / "networks" / f"{name}.yaml")
    if kind == "devices":
        return load_storage(CAT / "devices" / "storage.yaml")
    return load_coefficient_set(REG / "coefficients" / f"{name}.yaml")


@lru_cache(maxsize=None)
def _scenario_text(name: str) -> str:
    return (CAT / "scenarios" / f"{name}.yaml").read_text()


def bundle(name: str, *, model: str | None = None, cluster: dict | None = None,
           parallel: dict | None = None, engine: dict | None = None, unset=(),
           pd: str | None = None) -> str:
    """A shipped scenario with one or more settings changed, as a JSON key of the
    (Scenario, Deployment) pair. ``cluster`` changes apply to the scenario (and ``nodes`` to
    the one pool too); ``unset`` drops engine keys; ``pd`` names a pd_transfer connector."""
    sc, dep = yaml.safe_load_all(_scenario_text(name))
    pool = dep["pools"][0]
    if model:
        sc["model"] = model
    for key, value in (cluster or {}).items():
        sc["cluster"][key] = value
        if key == "nodes":
            pool["nodes"] = value
    pool["parallel"].update(parallel or {})
    eng = pool.setdefault("engine", {})
    eng.update(engine or {})
    for key in unset:
        eng.pop(key, None)
    if pd:
        dep["pd_transfer"] = {"connector": pd}
    return json.dumps([sc, dep], sort_keys=True)


def inputs(key: str, pool: int = 0) -> Inputs:
    sc, dep = json.loads(key)
    scenario, deployment = parse_bundle((sc, dep))
    cl = sc["cluster"]
    return Inputs(scenario, deployment, pool, _doc("model", sc["model"]),
                  _doc("chip", cl["hardware"]),
                  _doc("fabric", cl["fabric"]) if cl.get("fabric") else None,
                  dict(_doc("devices")), tuple(_doc("set", s) for s in sc["coefficients"]))


@lru_cache(maxsize=None)
def _kernel(key: str, pool: int = 0) -> jkernel.Kernel:
    return jkernel.new(inputs(key, pool), buckets=BUCKETS)


def kernel(name: str, pool: int = 0, **change) -> jkernel.Kernel:
    return _kernel(bundle(name, **change), pool)


def refused(code: str, field: str, name: str, **change) -> Refusal:
    with pytest.raises(Refusal) as info:
        jkernel.new(inputs(bundle(name, **change)))
    exc = info.value
    assert exc.code == code and str(exc).startswith(f"[{code}]"), str(exc)
    assert exc.field == field, str(exc)
    return exc


def res(est: jkernel.StepEstimate, name: str) -> float:
    return float(est.per_resource_s[name])


# -- the spec's formulas, restated (step.md §2, §6.8) ----------------------------------------

def law(k: jkernel.Kernel, key, nbytes: float) -> float:
    """coll_t(b) for a resolved key, in seconds."""
    p = k.params
    t0, r_peak, r_t = (float(p[key.floor]), float(p[key.peak]), float(p[key.transition]))
    if nbytes <= 0:
        return t0
    return max(t0 + nbytes / r_t, nbytes / r_peak) if r_t > 0 else max(t0, nbytes / r_peak)


def span(cross: float, total: float, r: float) -> float:
    return 1.0 if cross <= 0 or total <= 0 or not r > 1 else 1 + (r - 1) * cross / total


def ring_span(G: int, p: int, r: float) -> float:
    if G <= 1:
        return 1.0
    if G % p:
        return 1.0 if G <= p else span(G - 1, G - 1, r)
    return span(G // p - 1, G - 1, r)


def a2a_span(G: int, p: int, r: float) -> float:
    return 1.0 if G <= 1 else span(G - p, G - 1, r)


def ratio(k: jkernel.Kernel) -> float:
    return float(k.params["nvlink_bytes_per_s"] / k.params["nic_bytes_per_s"])


def charge(k: jkernel.Kernel, op: str, group: str, nbytes: float, a2a: bool | None = None):
    """One launch of (op, group) on ``nbytes`` → (nvlink_s, nic_s) (step.md §6.8–§6.10)."""
    key, g = k.plan.key(op, group), k.plan.group(group)
    if not g.crosses:
        return law(k, key, nbytes), 0.0
    a2a = (op == "alltoall") if a2a is None else a2a
    s = (a2a_span if a2a else ring_span)(g.width, g.per_node, ratio(k))
    return 0.0, law(k, key, nbytes * s)


def graph_collectives(k: jkernel.Kernel, t_gemm: float):
    """Σ of the graph collectives of one step (step.md §6.8) → (nvlink_s, nic_s)."""
    nvl = nic = 0.0
    for kind in k.plan.kinds:
        for c in kind.collectives:
            if k.plan.key(c.op, c.group) is None:
                continue
            nbytes = t_gemm * k.plan.hidden_size * 2.0
            routed = c.op == "alltoall" and c.routed
            if routed and kind.top_k > 0:
                nbytes *= kind.top_k
            v, n = charge(k, c.op, c.group, nbytes, a2a=routed)
            nvl, nic = nvl + kind.count * v, nic + kind.count * n
    return nvl, nic


def pair(k: jkernel.Kernel, kind: str) -> tuple[float, float]:
    """(floor_s, rate) of decode attention for an attention kind (step.md §3)."""
    p = k.params
    for name, f, r in k.plan.decode_pairs[1:]:
        if name == kind and float(p[r]) > 0:
            return float(p[f]), float(p[r])
    return float(p["attention_decode_floor"]), float(p["attention_decode_rate"])


def ramp(k: jkernel.Kernel, m: float) -> float:
    eps, half = (float(k.params[n]) for n in k.plan.gemm_names[:2])
    return eps * m / (m + half) if half > 0 else eps


def prefill_attention_work(k: jkernel.Kernel, batch: Batch, t_real: float) -> float:
    """Σ over layers of attn_work = causal·n_q·d_h/tp of one batch, read off the kernel: the
    prefill attention SM time is f_p + work/(P·ramp(t_real)·w_p) (step.md §6.3), so doubling
    w_p removes exactly half of the work term and nothing else."""
    w_p = float(k.params["attention_prefill_work_scale"])
    assert w_p > 0
    half = k.with_params(k.params.scaled(attention_prefill_work_scale=2.0))
    d_sm = res(k.step_time(batch), "sm") - res(half.step_time(batch), "sm")
    return 2 * d_sm * float(k.params["peak_flops_per_s"]) * ramp(k, t_real) * w_p


def spec_pairs(s: float, c: float, W: float) -> float:
    """pairs(s, c) under a window W (step.md §2)."""
    ns = max(0.0, min(s, W - c))
    return ns * (c + 1) + ns * (ns - 1) / 2 - ns / 2 + (s - ns) * W


def spec_pcp(s: int, c: int, pcp: int, dcp: int) -> tuple[float, float]:
    """(pcp_local_tokens, pcp_causal_pairs) of step.md §2, restated."""
    n = 2 * pcp
    ch = math.ceil(s / n)
    if dcp > 1 and (n - 1) * ch >= s:
        return s, 4 * (s * c + s * s / 2)
    ranks = []
    for r in range(pcp):
        toks = pairs = 0.0
        for j in (r, n - 1 - r):
            lo = min(j * ch, s)
            hi = min(lo + ch, s)
            nj = hi - lo
            toks += nj
            pairs += nj * (c + 1) + (lo + hi - 1) * nj / 2 - nj / 2
        ranks.append((toks, pairs))
    return max(t for t, _ in ranks), 4 * max(p for _, p in ranks)


def count(k: jkernel.Kernel, pred) -> int:
    return sum(kind.count for kind in k.plan.kinds if pred(kind))


# -- the scenarios ---------------------------------------------------------------------------

def test_new_scenarios_are_listed_and_use_the_standard_sets():
    """Each new bundle is a shipped scenario naming the six standard sets in the order the
    existing scenarios do."""
    standard = next(yaml.safe_load_all(_scenario_text("deepseek-v3-h200-fp8-tp8")))
    listed = set(catalog.list_scenarios())
    for name in NEW:
        sc, dep = yaml.safe_load_all(_scenario_text(name))
        assert name in listed and sc["name"] == name
        assert sc["coefficients"] == standard["coefficients"], name
        assert sum(p["nodes"] for p in dep["pools"]) == sc["cluster"]["nodes"]


@pytest.mark.parametrize("name,pool", NEW_POOLS)
def test_new_scenario_opens_and_prices(name, pool):
    k = kernel(name, pool)
    est = k.step_time(Batch([1] * 8 + [512], [2048] * 8 + [0], decode_threshold=THR))
    check_one(est)
    assert est.no_overlap_s >= est.overlap_s > 0
    assert k.kv_cache_pages() > 0 and k.page_bytes() > 0


def _overrides(k):
    return {(o.field, o.requested, o.resolved) for o in k.resolution().overrides}


def test_scenario_features_resolve_as_intended():
    """What each new scenario is for, read off its resolution."""
    k = kernel("deepseek-v3.2-h200-fp8-tp8")
    assert ("cache_dtype", "fp8", "fp8_ds_mla") in _overrides(k)
    assert k.plan.block_size == 64 and k.kv_bytes_per_token() == 656 * 61
    assert k.plan.segments == 61 + 61 + 1                 # one split per indexed sparse layer
    k = kernel("deepseek-v3.2-h200-fp8-tp8-dcp2")
    assert k.decode_context_parallel_width() == 2 and k.plan.dcp_comm_backend == "ag_rs"
    assert {(c.op, c.group) for c in k.plan.collective_keys} >= {
        ("all_gather", "DCP"), ("reduce_scatter", "DCP")}
    k = kernel("glm-5-h200-2node-pcp2-dcp2")
    assert (k.prefill_context_parallel_width(), k.decode_context_parallel_width()) == (2, 2)
    for g in ("DCP", "PCP"):                              # stride tp: one member per node
        assert (k.plan.group(g).stride, k.plan.group(g).crosses) == (8, True)
    assert {(c.op, c.group) for c in k.plan.collective_keys} >= {
        ("all_gather", "DCP"), ("all_reduce", "DCP"), ("all_gather", "PCP")}
    assert k.settings.cache_layout == "fp8_ds_mla"
    k = kernel("deepseek-v3-h200-2node-pcp2")
    assert k.plan.group("PCP").crosses and not k.plan.group("TP").crosses
    assert kernel("qwen3-235b-a22b-h200-tp8-dcp2-a2a").plan.key("alltoall", "DCP") is not None
    k = kernel("nemotron-3-nano-30b-a3b-h100-fp8-tp1-cache-all")
    assert k.settings.mamba_cache_mode == "all" and k.sequence_fixed_bytes() == 0
    assert k.plan.collective_keys == ()                   # D33: one GPU, no collective
    k = kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    assert (k.plan.num_spec, k.plan.uniform_decode_width, k.plan.capture_ceiling) == (1, 2, 512)
    k = kernel("kimi-k3-gb200-nvl72-ep72")
    g = k.plan.group("Expert")
    routed = any(c.routed for kind in k.plan.kinds for c in kind.collectives)
    assert (k.plan.ep, g.width, g.crosses, routed) == (72, 72, False, True)
    assert k.plan.experts_per_rank == 13                  # 896 = 12·72 + 32
    g = kernel("minimax-m2.5-h200-2node-ep16").plan.group("Expert")
    assert (g.width, g.per_node, g.crosses) == (16, 8, True)
    k = kernel("deepseek-v3-h200-ep8-eplb")
    assert (k.plan.physical_experts, k.plan.experts_per_rank) == (288, 36)
    k = kernel("minimax-m3-h200-fp8-tp8-ep8")
    assert (k.plan.ep, k.plan.experts_per_rank, k.settings.served_dtype) == (8, 16, "fp8")
    g = kernel("deepseek-v3-gb200-2rack-ep144").plan.group("Expert")
    assert (g.width, g.per_node, g.crosses) == (144, 4, True)


# -- the property checks of test_properties.py on every new scenario -------------------------

@pytest.mark.parametrize("name,pool", NEW_POOLS)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(batches(), min_size=1, max_size=3), grow=st.integers(1, 20000))
def test_step_properties_on_new_scenarios(name, pool, drawn, grow):
    """Finite, Overlap ≤ NoOverlap, NoOverlap = Σ resources, bottleneck = argmax; growing a
    request's cached context never lowers any estimate."""
    k = kernel(name, pool)
    for batch in drawn:
        est = k.step_time(batch)
        check_one(est)
        if len(batch):
            comp = batch.computed.copy()
            comp[len(batch) // 2] += grow
            more = k.step_time(Batch(batch.scheduled, comp, decode_threshold=batch.decode_threshold,
                                     pad_tokens=batch.pad_tokens))
            for f in ("overlap_s", "no_overlap_s", "expected_s"):
                assert getattr(more, f) >= getattr(est, f) * (1 - 1e-12)


# -- vectors.md §1.4: the PCP split, through the kernel ---------------------------------------

def _pcp_gathers(k, rows):
    """Σ over layers of the PCP KV gathers of step.md §6.10 → (nvlink_s, nic_s)."""
    nvl = nic = 0.0
    for kind in k.plan.kinds:
        a = kind.attention
        if a is None:
            continue
        sizes = ([a.kv_lora_rank, a.d_h - a.kv_lora_rank] if 0 < a.kv_lora_rank < a.d_h
                 else [a.d_h])
        sizes += [s.n_kv * s.d_h for s in kind.secondaries if s.n_kv > 0 and s.d_h > 0]
        for width in sizes:
            v, n = charge(k, "all_gather", "PCP", rows * width * 2.0)
            nvl, nic = nvl + kind.count * v, nic + kind.count * n
    return nvl, nic


PCP8 = dict(cluster={"nodes": 8}, parallel={"pcp": 8})
PCP4 = dict(cluster={"nodes": 4}, parallel={"pcp": 4})


@pytest.mark.parametrize("change,s,c,local,pair_ratio", [
    ({}, 4096, 0, 2048, 1.0),
    (PCP8, 4096, 0, 512, 1.0),
    (PCP8, 1001, 0, 126, 1.014035),
    (PCP4, 1001, 8192, 252, 1.007398),
    (PCP8, 100, 0, 14, 1.2544),
])
def test_pcp_prefill_charges_the_busiest_rank(change, s, c, local, pair_ratio):
    """§1.4 [C]: a prefill of s tokens on pcp 2, 4 or 8 runs the busiest rank's tokens through
    the GEMMs and graph collectives (t_gemm = pcp_local_tokens), gathers pcp·local rows of
    latent and rope key over the PCP group (which crosses nodes: NIC, ring span), and runs
    the busiest rank's causal pairs."""
    k = kernel("deepseek-v3-h200-2node-pcp2", **change)
    pcp = k.prefill_context_parallel_width()
    batch = Batch([s], [c], decode_threshold=THR)
    est = k.step_time(batch)
    nvl, _ = graph_collectives(k, local)
    g_nvl, g_nic = _pcp_gathers(k, pcp * local)
    assert k.plan.group("PCP").crosses and g_nvl == 0
    assert res(est, "nvlink") == pytest.approx(nvl, rel=1e-12)
    assert res(est, "nic") == pytest.approx(g_nic, rel=1e-12)
    assert spec_pcp(s, c, pcp, 1)[0] == local
    layers = k.plan.total_layers
    pairs = prefill_attention_work(k, batch, local) * k.plan.tp / (128 * 576) / layers
    assert pairs / (4 * (s * c + s * s / 2) / pcp) == pytest.approx(pair_ratio, abs=1e-6)


def test_pcp_prefix_adds_the_busiest_ranks_pairs():
    """With a prefix c, every owned chunk pairs with c: the busiest rank adds 4·local·c."""
    k = kernel("deepseek-v3-h200-2node-pcp2", **PCP8)
    w0 = prefill_attention_work(k, Batch([100], [0], decode_threshold=THR), 14)
    w1 = prefill_attention_work(k, Batch([100], [5000], decode_threshold=THR), 14)
    per_pair = 61 * 128 * 576 / k.plan.tp
    assert (w1 - w0) / per_pair == pytest.approx(4 * 14 * 5000, rel=1e-9)


@pytest.mark.parametrize("s,local", [(9, 9), (10, 6), (4096, 2048)])
def test_pcp_with_dcp_replicates_short_prefills(s, local):
    """§1.4 with dcp > 1: a prefill whose zig-zag split would leave the last chunk empty
    ((2·pcp − 1)·ceil(s/(2·pcp)) ≥ s) is replicated, so every rank runs all s tokens. The
    gathers include the block indexer's key (one more per layer, step.md §6.10)."""
    k = kernel("glm-5-h200-2node-pcp2-dcp2")
    batch = Batch([s], [0], decode_threshold=1)
    est = k.step_time(batch)
    nvl, _ = graph_collectives(k, local)
    _, g_nic = _pcp_gathers(k, 2 * local)
    assert res(est, "nvlink") == pytest.approx(nvl, rel=1e-12)   # no DCP rows in a prefill
    assert res(est, "nic") == pytest.approx(g_nic, rel=1e-12)
    assert spec_pcp(s, 0, 2, 2)[0] == local
    pairs = prefill_attention_work(k, batch, local) * 8 / (64 * 576) / 78
    assert pairs == pytest.approx(spec_pcp(s, 0, 2, 2)[1], rel=1e-9)
    if s <= 9:                                            # replicated: the whole causal count
        assert pairs == pytest.approx(4 * s * s / 2, rel=1e-9)


# -- vectors.md §1.6 and §4.4.1: the DCP share, through the kernel ----------------------------

def _dcp(model: str, dcp: int, **engine):
    if model == "glm-5":   # glm-5 fp8_ds_mla on one node: tp 8, dcp d
        return kernel("glm-5-h200-2node-pcp2-dcp2", cluster={"nodes": 1},
                      parallel={"pcp": 1, "dcp": dcp}, engine=engine or None)
    return kernel("deepseek-v3-h200-fp8-tp8", parallel={"dcp": dcp}, engine=engine or None)


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3"])
def test_doubling_dcp_halves_the_decode_read(model):
    """§4.4.1 [P]: (HBM(1) − HBM(2)) / (HBM(2) − HBM(4)) = 2 at 32 × {1, 32767}; and the drop
    from dcp 1 to 2 is exactly half of every decode read (primary and indexer)."""
    batch = Batch([1] * 32, [32767] * 32, decode_threshold=THR)
    ks = [_dcp(model, d) for d in (1, 2, 4)]
    hbm = [res(k.step_time(batch), "hbm") for k in ks]
    assert (hbm[0] - hbm[1]) / (hbm[1] - hbm[2]) == pytest.approx(2.0, abs=1e-6)
    k = ks[0]
    att = k.plan.kinds[0].attention
    read = 2048 if att.kind == "sparse_mla" else 32768      # the sparse bound (index_topk)
    f, r = pair(k, att.kind)
    half = k.plan.kv_layers * 32 * (read / 2) * k.plan.bpt_layer / r
    for a in k.plan.kinds[0].secondaries:                   # the indexer's batch-total read
        fa, ra = pair(k, a.kind)
        per_token = k.plan.bpt_layer * a.n_kv * a.d_h / (att.n_kv * att.d_h)
        half += k.plan.kv_layers * (32 * 32768 / 2) * per_token / ra
    assert hbm[0] - hbm[1] == pytest.approx(half, rel=1e-9)


def test_dcp_read_is_per_request_within_page_rounding():
    """§1.6 [C]: 8 requests of context 1001 at dcp 4 read Σ ceil(1001/4) = 2008 tokens a
    layer (not 2002 on the batch total); 1000 at dcp 8 striped in runs of 32 reads 128."""
    k = _dcp("deepseek-v3", 4)
    f, r = pair(k, "mla")
    per_token = 61 * k.plan.bpt_layer / r
    a = k.step_time(Batch([1] * 8, [1000] * 8, decode_threshold=THR))
    b = k.step_time(Batch([1] * 8, [0] * 8, decode_threshold=THR))     # 8 × dcp_local(1) = 8
    assert res(a, "hbm") - res(b, "hbm") == pytest.approx((2008 - 8) * per_token, rel=1e-9)
    k = _dcp("deepseek-v3", 8, block_size=64, cp_kv_cache_interleave_size=32)
    assert k.plan.interleave == 32
    a = k.step_time(Batch([1], [999], decode_threshold=THR))
    b = k.step_time(Batch([1], [0], decode_threshold=THR))
    assert res(a, "hbm") - res(b, "hbm") == pytest.approx((128 - 1) * per_token, rel=1e-9)


def test_dcp_shards_gqa_capacity_by_tokens_first():
    """memory.md §2: qwen3-235b (4 KV heads) at tp 8 dcp 2 pages ceil(n/2) tokens."""
    k = kernel("qwen3-235b-a22b-h200-tp8-dcp2")
    page = k.page_bytes()
    assert page == 16 * 2 * 1 * 128 * 1 * 94                # max(1, 4 // 8) head, fp8
    assert k.sequence_variable_bytes(33) == 2 * page         # 17 tokens of the shard
    assert k.sequence_variable_bytes(32) == page


def test_dcp_combine_backends_on_gqa():
    """step.md §6.9 on a GQA model: rows are every token of the step when any request has
    context, else none; ag_rs gathers fp32 LSEs and reduce-scatters the output, a2a sends
    both in one all-to-all of rows·aH·(d_h + 2)·2 bytes."""
    ag = kernel("qwen3-235b-a22b-h200-tp8-dcp2")
    a2a = kernel("qwen3-235b-a22b-h200-tp8-dcp2-a2a")
    rows, aH, oW, L = 8, 64 / 8 * 2, 128, 94
    batch = Batch([1] * 8, [1000] * 8, decode_threshold=THR)
    d = res(ag.step_time(batch), "nvlink") - res(a2a.step_time(batch), "nvlink")
    want = L * (charge(ag, "all_gather", "DCP", 2 * rows * aH * 4)[0]
                + charge(ag, "reduce_scatter", "DCP", rows * aH * oW * 2)[0]
                - charge(a2a, "alltoall", "DCP", rows * aH * (oW + 2) * 2)[0])
    assert d == pytest.approx(want, rel=1e-9)
    fresh = Batch([300, 200], [0, 0], decode_threshold=THR)   # no context: no DCP rows
    for k in (ag, a2a):
        assert res(k.step_time(fresh), "nvlink") == pytest.approx(
            graph_collectives(k, 500)[0], rel=1e-12)


def test_pcp_and_dcp_collectives_of_one_mixed_step():
    """GLM-5, tp 8 × pcp 2 with dcp 2 over two nodes (step.md §6.9–§6.10): with pcp > 1 and
    dcp ≤ pcp the query is not gathered (aH = h/tp); the fp32 LSE all-gather and the output
    all-reduce run over the DCP pair on decode rows; the prefill's context is gathered in
    ceil(S/chunk) launches; the prefill's busiest-rank rows are gathered over the PCP pair.
    Every one of these groups has one member per node: NIC, ring span."""
    k = kernel("glm-5-h200-2node-pcp2-dcp2")
    assert k.plan.mla_chunk == 65536 and ratio(k) == 9.0
    n_dec, s, c = 8, 512, 70000
    batch = Batch([1] * n_dec + [s], [4000] * n_dec + [c], decode_threshold=THR)
    est = k.step_time(batch)
    local = spec_pcp(s, c, 2, 2)[0]
    assert local == 256
    aH, oW, d_h = 64 / 8, 512, 576
    per_layer = (charge(k, "all_gather", "DCP", 2 * n_dec * aH * 4)[1]
                 + charge(k, "all_reduce", "DCP", n_dec * aH * oW * 2)[1]
                 + 2 * charge(k, "all_gather", "DCP", c * d_h * 2 / 2)[1])
    nic = 78 * per_layer + _pcp_gathers(k, 2 * local)[1]
    assert res(est, "nic") == pytest.approx(nic, rel=1e-12)
    assert res(est, "nvlink") == pytest.approx(graph_collectives(k, n_dec + local)[0],
                                               rel=1e-12)


def test_dcp_wider_than_pcp_gathers_the_query_over_tp():
    """dcp = tp·pcp = 16 (step.md §6.9): every rank holds all h heads, so the query is
    all-gathered over TP (on NVLink) and the combine runs over a 16-rank DCP group that spans
    both nodes (NIC, ring_span(16, 8))."""
    k = kernel("glm-5-h200-2node-pcp2-dcp2", parallel={"dcp": 16})
    g = k.plan.group("DCP")
    assert (g.width, g.stride, g.crosses) == (16, 1, True)
    rows, aH, oW, qW = 8, 64, 512, 576
    est = k.step_time(Batch([1] * rows, [4000] * rows, decode_threshold=THR))
    nic = 78 * (charge(k, "all_gather", "DCP", 16 * rows * aH * 4)[1]
                + charge(k, "all_reduce", "DCP", rows * aH * oW * 2)[1])
    nvl = graph_collectives(k, rows)[0] + 78 * charge(k, "all_gather", "TP", rows * aH * qW * 2)[0]
    assert res(est, "nic") == pytest.approx(nic, rel=1e-12)
    assert res(est, "nvlink") == pytest.approx(nvl, rel=1e-12)


def test_mla_context_gather_launches():
    """step.md §6.9: prefills sorted by s; a prefill without context closes the run; each run
    of S context tokens is gathered in ceil(S / chunk) launches (chunk 65536 here)."""
    k = kernel("deepseek-v3.2-h200-fp8-tp8-dcp2")
    assert k.plan.mla_chunk == 65536
    batch = Batch([512, 600, 700], [100000, 0, 30000], decode_threshold=THR)
    key = k.plan.key("all_gather", "DCP")
    assert key.floor != k.plan.key("all_gather", "TP").floor
    up = k.with_params(k.params.scaled(**{key.floor: 10.0}))
    a, b = k.step_time(batch), up.step_time(batch)
    assert res(b, "nvlink") - res(a, "nvlink") == pytest.approx(
        9 * float(k.params[key.floor]) * 61 * (2 + 1), rel=1e-9)


# -- vectors.md §1.7: sparse selection, through the kernel -----------------------------------

@pytest.mark.parametrize("name,dcp", [("deepseek-v3.2-h200-fp8-tp8", 1),
                                      ("deepseek-v3.2-h200-fp8-tp8-dcp2", 2)])
def test_sparse_decode_reads_index_topk(name, dcp):
    """A DeepSeek-V3.2 decode reads min(ctx, 2048) latent tokens (656-byte cells) plus the
    indexer's keys over the whole context: growing the context beyond index_topk adds only
    the indexer's read. Under dcp both reads are striped (the indexer on the batch total)."""
    k = kernel(name)
    att = k.plan.kinds[0].attention
    sec = k.plan.kinds[0].secondaries[0]
    assert (att.kind, att.index_topk, sec.role) == ("sparse_mla", 2048, "block_index_scores")
    _, r = pair(k, "sparse_mla")
    _, r_i = pair(k, sec.kind)
    bpt = k.plan.bpt_layer
    idx = bpt * sec.n_kv * sec.d_h / (att.n_kv * att.d_h)
    hbm = {ctx: res(k.step_time(Batch([1], [ctx - 1], decode_threshold=THR)), "hbm")
           for ctx in (1024, 2048, 4096, 100000)}
    sh = lambda n: math.ceil(n / dcp)                      # noqa: E731 (dcp_local at I = 1)
    assert hbm[4096] - hbm[2048] == pytest.approx(61 * (sh(4096) - sh(2048)) * idx / r_i,
                                                  rel=1e-9)
    assert hbm[100000] - hbm[4096] == pytest.approx(
        61 * (sh(100000) - sh(4096)) * idx / r_i, rel=1e-9)
    assert hbm[2048] - hbm[1024] == pytest.approx(
        61 * (sh(2048) - sh(1024)) * (bpt / r + idx / r_i), rel=1e-9)


# -- vectors.md §1.5: windowed causal pairs, through the kernel ------------------------------

@pytest.mark.parametrize("c,pin", [(131072, 8_912_896), (0, 2_097_152), (1000, 6_193_152)])
def test_windowed_prefill_pins_on_minimax_m3(c, pin):
    """§1.5 [C] with W = 2176 (MiniMax-M3's window): a 1024-token chunk at prefix c runs
    `pin` windowed causal FLOPs on each of the 57 sliding-window layers; the 3 full layers run
    4·(s·c + s²/2)."""
    k = kernel("minimax-m3-h200-fp8-tp8-ep8")
    work = prefill_attention_work(k, Batch([1024], [c], decode_threshold=THR), 1024)
    causal = work * k.plan.tp / (64 * 128)
    full = 4 * (1024 * c + 1024 ** 2 / 2)
    assert (causal - 3 * full) / 57 == pytest.approx(pin, rel=1e-9)
    assert 4 * spec_pairs(1024, c, 2176) == pin


def test_windowed_prefill_on_gpt_oss():
    """§1.5 on gpt-oss-120b (W = 128, 18 windowed + 18 full layers): the 4096-token prefill
    pin 26,181,632 is for W = 2176; here a window of 128 saturates at s·W."""
    k = kernel("gpt-oss-120b-b200-tp8")
    for c in (0, 100, 4096):
        work = prefill_attention_work(k, Batch([1024], [c], decode_threshold=THR), 1024)
        causal = work * k.plan.tp / (64 * 64)
        want = 18 * 4 * spec_pairs(1024, c, 128) + 18 * 4 * (1024 * c + 1024 ** 2 / 2)
        assert causal == pytest.approx(want, rel=1e-9)
    assert 4 * spec_pairs(1024, 4096, 128) == 4 * 1024 * 128
    assert 4 * spec_pairs(4096, 0, 2176) == 26_181_632


# -- vectors.md §2: recurrent state pages -------------------------------------------------------

NANO = "nemotron-3-nano-30b-a3b-h100-fp8-tp1-cache-all"
MAMBA_PAGE = 4_268_032          # (4096 + 2·8·128)·3 + 64·128², × 4 B (D23)


def _page(k, kind):
    return {kd.recurrent.kind: kd.recurrent.page_bytes for kd in k.plan.kinds
            if kd.recurrent is not None}[kind]


@pytest.mark.parametrize("engine,fixed,copies", [
    ({"mamba_cache_mode": "align"}, 196_329_472, 2),
    ({"mamba_cache_mode": "align", "speculative": {"method": "mtp", "num_spec_tokens": 1}},
     294_494_208, 3),
    ({"mamba_cache_mode": "none", "enable_prefix_caching": False}, 98_164_736, 1),
    ({"mamba_cache_mode": "none"}, 196_329_472, 2),          # overridden to align
    ({"mamba_cache_mode": "none", "enable_prefix_caching": False,
      "speculative": {"method": "mtp", "num_spec_tokens": 2}}, 23 * MAMBA_PAGE * 3, 3),
])
def test_mamba_state_by_mode(engine, fixed, copies):
    """§2 [C]: the Mamba2 page of Nemotron-3 Nano and sequence_fixed_bytes by mode and num_spec
    (memory.md §3.2): none 1 + num_spec copies, align 2 + num_spec."""
    k = kernel(NANO, engine=engine)
    assert _page(k, "mamba2") == MAMBA_PAGE
    assert k.sequence_fixed_bytes() == fixed == 23 * MAMBA_PAGE * copies
    assert k.sequence_variable_bytes(256) == 256 * 6144       # KV only, one page


@pytest.mark.parametrize("num_spec", [0, 1])
def test_mamba_all_mode_pages_the_state(num_spec):
    """memory.md §2: under `all` the state rides in the pages: ceil(n/block) + num_spec pages
    of state per recurrent layer, on top of the KV."""
    engine = {"speculative": {"method": "mtp", "num_spec_tokens": 1}} if num_spec else None
    k = kernel(NANO, engine=engine)
    assert k.sequence_fixed_bytes() == 0
    kv = 256 * 6144
    for n, blocks in ((1, 1), (256, 1), (257, 2), (4096, 16)):
        assert k.sequence_variable_bytes(n) == blocks * kv + 23 * MAMBA_PAGE * (blocks + num_spec)
    assert k.page_bytes() == kv + 23 * MAMBA_PAGE * (1 + num_spec)


def test_gated_delta_net_and_kda_pages():
    """memory.md §3.1: kda and gdn pages are n_heads·S²·state_bytes (fp32 unless stated)."""
    k = kernel("qwen3.5-397b-a17b-h200-tp8")
    assert _page(k, "gdn") == 64 * 128 ** 2 * 4 == 4_194_304
    assert k.sequence_fixed_bytes() == 45 * 4_194_304 * 2 == 377_487_360
    half = kernel("qwen3.5-397b-a17b-h200-tp8", engine={"mamba_cache_dtype": "bfloat16"})
    assert half.sequence_fixed_bytes() == 377_487_360 // 2
    k = kernel("kimi-k3-gb200-nvl72-ep72")
    assert _page(k, "kda") == 96 * 128 ** 2 * 4
    assert k.sequence_fixed_bytes() == 69 * 96 * 128 ** 2 * 4 * 2


def test_recurrent_mixers_price_every_real_token():
    """step.md §6.5: each KDA layer adds f + t_real/ρ to SM; GDN, with no measured pair,
    adds nothing (the mixer's rate, doubled, halves the per-token part)."""
    k = kernel("kimi-k3-gb200-nvl72-ep72")
    (_, fn, rn), = k.plan.recurrent_names
    batch = Batch([1] * 16 + [700], [3000] * 16 + [0], decode_threshold=THR)
    fast = k.with_params(k.params.scaled(**{rn: 2.0}))
    d = res(k.step_time(batch), "sm") - res(fast.step_time(batch), "sm")
    assert d == pytest.approx(69 * 716 / float(k.params[rn]) / 2, rel=1e-9)
    q = kernel("qwen3.5-397b-a17b-h200-tp8")
    assert all(float(q.params.value(n)) == 0 for _, f, n in q.plan.recurrent_names)


# -- vectors.md §1.2: spans, on deployments whose groups leave the node -------------------------

@pytest.mark.parametrize("name,group,pin", [
    ("minimax-m2.5-h200-2node-ep16", "Expert", 5.266667),     # a2a_span(16, 8), r = 9
    ("deepseek-v3-h200-2node-tp16", "TP", 1.533333),          # ring_span(16, 8), r = 9
    ("deepseek-v3-gb200-2rack-ep144", "Expert", None),        # a2a_span(144, 4), r = 18
])
def test_nic_time_is_the_law_on_the_spanned_bytes(name, group, pin):
    k = kernel(name)
    g = k.plan.group(group)
    assert g.crosses
    a2a = group == "Expert"
    s = (a2a_span if a2a else ring_span)(g.width, g.per_node, ratio(k))
    if pin is not None:
        assert ratio(k) == 9.0 and s == pytest.approx(pin, abs=1e-6)
    for batch, t in ((Batch([1] * 8, [4000] * 8, decode_threshold=THR), 8),
                     (Batch([1] * 3 + [1500], [900] * 3 + [0], decode_threshold=THR), 1503)):
        est = k.step_time(batch)
        nvl, nic = graph_collectives(k, t)
        assert nic > 0 and res(est, "nic") == pytest.approx(nic, rel=1e-12)
        assert res(est, "nvlink") == pytest.approx(nvl, rel=1e-12)


# -- metamorphic: one collective floor × 10 (vectors.md §4.4.3), on multi-node deployments ----

INFLATE = [
    # scenario, (op, group), batch, resource, launches per step
    ("glm-5-h200-2node-pcp2-dcp2", ("all_gather", "PCP"), ([4096], [0]), "nic", 78 * 3),
    ("glm-5-h200-2node-pcp2-dcp2", ("all_reduce", "DCP"), ([1] * 8, [5000] * 8), "nic", 78),
    ("glm-5-h200-2node-pcp2-dcp2", ("all_reduce", "TP"), ([1] * 8, [5000] * 8), "nvlink",
     2 * 78),
    ("deepseek-v3-h200-2node-pcp2", ("all_gather", "PCP"), ([2000, 3000], [0, 100]), "nic",
     61 * 2),
    ("minimax-m2.5-h200-2node-ep16", ("alltoall", "Expert"), ([1] * 8, [5000] * 8), "nic", 62),
    ("deepseek-v3-gb200-2rack-ep144", ("alltoall", "Expert"), ([1] * 8, [5000] * 8), "nic",
     58),
]


@pytest.mark.parametrize("name,key,batch,resource,launches", INFLATE)
def test_inflating_one_floor_adds_nine_floors_per_launch(name, key, batch, resource, launches):
    """Multiplying one collective key's floor by 10 adds exactly 9 floors per launch to the
    resource the group runs on, and to NoOverlap; nothing else moves. (The PCP gather runs
    3 launches a layer on glm-5: latent, rope key, and the indexer key.)"""
    k = kernel(name)
    kk = k.plan.key(*key)
    b = Batch(*batch, decode_threshold=THR)
    base = k.step_time(b)
    up = k.with_params(k.params.scaled(**{kk.floor: 10.0})).step_time(b)
    nine = 9 * float(k.params[kk.floor]) * launches
    assert res(up, resource) - res(base, resource) == pytest.approx(nine, rel=1e-9)
    assert up.no_overlap_s - base.no_overlap_s == pytest.approx(nine, rel=1e-9)
    for r in jkernel.RESOURCES:
        if r != resource:
            assert res(up, r) == res(base, r)


# -- metamorphic: an EP group inside the rack runs on NVLink (D9) -----------------------------

def test_ep_group_inside_the_rack_moves_from_nic_to_nvlink():
    """Kimi-K3 tp 4 × dp 18, EP 72 on GB200: inside one 72-GPU NVLink rack the routed
    all-to-all is on NVLink; with the same EP width over two 36-GPU racks it leaves the rack
    and is priced on the NIC with a2a_span(72, 4). Nothing else changes."""
    inside = kernel("kimi-k3-gb200-nvl72-ep72")
    outside = kernel("kimi-k3-gb200-nvl72-ep72", cluster={"gpus_per_rack": 36})
    assert not inside.plan.group("Expert").crosses and outside.plan.group("Expert").crosses
    moe = count(inside, lambda kd: kd.moe)
    assert moe == 92
    key = inside.plan.key("alltoall", "Expert")
    for sched, comp in (([1] * 16, [3000] * 16), ([1] * 4 + [900], [100] * 4 + [0])):
        b = Batch(sched, comp, decode_threshold=THR)
        a, o = inside.step_time(b), outside.step_time(b)
        nbytes = sum(sched) * 7168 * 2 * 16
        assert res(a, "nic") == 0
        assert res(a, "nvlink") - res(o, "nvlink") == pytest.approx(
            moe * law(inside, key, nbytes), rel=1e-9)
        assert res(o, "nic") == pytest.approx(
            moe * law(outside, key, nbytes * a2a_span(72, 4, 18.0)), rel=1e-12)
        for r in ("sm", "hbm", "host"):
            assert res(o, r) == res(a, r)


# -- speculative decoding ---------------------------------------------------------------------

def test_speculative_width_picks_the_graph_mode_and_ceiling():
    """resolution.md §11 / step.md §8: with num_spec 1 a decode of 2 tokens per request is the
    uniform decode (FULL); a 1-token decode batch is not (PIECEWISE under
    FULL_AND_PIECEWISE); the ceiling min(2·128·2, 1024) = 512 is met at tokens + pad."""
    k = kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    assert k.assumption("max_cudagraph_capture_size").startswith("512:")
    p = k.params
    R, kk, E = (float(p[n]) for n in ("host_replay_graph_per_step", "host_launch_per_kernel",
                                      "host_launch_eager_per_layer"))
    K, segs, L = k.plan.total_kernels, k.plan.segments, k.plan.total_layers

    def host(sched, pad=0):
        return res(k.step_time(Batch(sched, [1000] * len(sched), decode_threshold=2,
                                     pad_tokens=pad)), "host")

    assert host([2] * 4) == pytest.approx(R + kk * K, rel=1e-12)
    assert host([1] * 4) == pytest.approx(R * segs + kk * K, rel=1e-12)
    assert host([2] * 4, pad=504) == pytest.approx(R + kk * K, rel=1e-12)
    assert host([2] * 4, pad=505) == pytest.approx(E * L + kk * K, rel=1e-12)
    plain = kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp", unset=("speculative",))
    assert (plain.plan.uniform_decode_width, plain.plan.capture_ceiling) == (1, 256)


def test_speculative_tokens_grow_the_recurrent_state():
    """memory.md §3.2: align holds 2 + num_spec state pages per Mamba2 layer."""
    k = kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    plain = kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp", unset=("speculative",))
    page = _page(k, "mamba2")
    assert k.sequence_fixed_bytes() == int(40 * page * 3)
    assert plain.sequence_fixed_bytes() == int(40 * page * 2)
    assert k.sequence_variable_bytes(1000) == plain.sequence_variable_bytes(1000)


# -- disaggregated pools on two racks (methods.md §4, §5) ---------------------------------------

def test_disaggregated_pools_on_two_racks():
    """The prefill pool (tp 4 × pcp 2, EP 8) and the decode pool (tp 4 × dp 18, EP 72) of one
    bundle, each inside its own NVL72 rack. pd_transfer_time, on the sending pool, moves the
    whole request's KV (656-byte cells, not paged, not divided by dcp): at NVLink rate within a
    rack-wide NVLink domain, at the fabric's rate across racks, never under the (alltoall,
    Expert) floor. tier_time reads host DRAM at the slower of the device and the host link."""
    pre, dec = kernel(DISAGG, 0), kernel(DISAGG, 1)
    assert (pre.pool().role, dec.pool().role) == ("prefill", "decode")
    assert (pre.prefill_context_parallel_width(), pre.plan.ep) == (2, 8)
    assert (dec.plan.ep, dec.plan.group("Expert").crosses) == (72, False)
    kvB = pre.kv_bytes_per_token()
    assert kvB == 656 * 61
    p = pre.params
    floor = float(p[pre.settings.pd_floor_name])
    here, rack0, rack1 = (jkernel.Placement(node=0, rack=0), jkernel.Placement(node=3, rack=0),
                          jkernel.Placement(node=18, rack=1))
    for tokens in (1, 4096, 100000):
        nbytes = tokens * kvB
        assert pre.pd_transfer_time(tokens, here, rack1) == pytest.approx(
            max(floor, nbytes / float(p["nic_bytes_per_s"])), rel=1e-12)
        assert pre.pd_transfer_time(tokens, here, rack0) == pytest.approx(
            max(floor, nbytes / float(p["nvlink_bytes_per_s"])), rel=1e-12)
    assert pre.pd_transfer_time(0, here, rack1) == 0
    link = float(dec.params.value("host_link_bandwidth"))
    rate = min(20000e6, link) if link > 0 else 20000e6
    assert dec.tier_time("cpu_dram", "from_tier", 2 ** 30, 1) == pytest.approx(
        max(1e-6, 2 ** 30 / rate), rel=1e-12)


# -- EPLB ---------------------------------------------------------------------------------------

def test_eplb_redundant_experts_in_memory():
    """memory.md §4.2 (D24): 32 redundant experts over EP 8 add 4 experts to each rank; their
    bytes are reported apart and moved out of weights, so total() grows by exactly them."""
    k = kernel("deepseek-v3-h200-ep8-eplb")
    off = kernel("deepseek-v3-h200-ep8-eplb", engine={"eplb": {"enable_eplb": False,
                                                               "num_redundant_experts": 32}})
    assert (off.plan.physical_experts, off.plan.experts_per_rank) == (256, 32)
    e_bytes = next(kd.expert_weight_bytes_per_expert for kd in k.plan.kinds if kd.moe)
    assert e_bytes == 3 * 2048 * 7168
    fb, fo = k.fixed_bytes(), off.fixed_bytes()
    assert fb.eplb_redundant == int(58 * e_bytes * 32 / 8) and fo.eplb_redundant == 0
    assert fb.weights == fo.weights
    assert fb.total() - fo.total() == fb.eplb_redundant
    assert k.plan.local_expert_share == 36 / 288


# -- refusals, each beside the feature deployment that opens ----------------------------------

DS32 = "deepseek-v3.2-h200-fp8-tp8"
DS32_DCP = "deepseek-v3.2-h200-fp8-tp8-dcp2"
GLM = "glm-5-h200-2node-pcp2-dcp2"
DS_PCP = "deepseek-v3-h200-2node-pcp2"
QW = "qwen3-235b-a22b-h200-tp8-dcp2"
P = "pools[0].parallel"
E = "pools[0].engine"

REFUSALS = [
    # id, code, field, base scenario, refused change, building twin change
    ("R5 pcp on gqa", "R5", f"{P}.pcp", DS_PCP, dict(model="qwen3-235b-a22b"), {}),
    ("R5 pcp with kda layers", "R5", f"{P}.pcp", DS_PCP, dict(model="kimi-k3"), {}),
    ("R5 pcp with gdn layers", "R5", f"{P}.pcp", DS_PCP, dict(model="qwen3.5-397b-a17b"), {}),
    ("R5 dcp not in {1, pcp, tp·pcp}", "R5", f"{P}.dcp", GLM, dict(parallel={"dcp": 4}),
     dict(parallel={"dcp": 16})),
    ("R5 dcp does not divide tp", "R5", f"{P}.dcp", QW, dict(parallel={"dcp": 3}), {}),
    ("R6 pcp+dcp on mla", "R6", f"{P}.dcp", GLM, dict(model="deepseek-v3"), {}),
    ("R7 a2a with pcp", "R7", f"{E}.dcp_comm_backend", GLM,
     dict(engine={"dcp_comm_backend": "a2a"}), {}),
    ("R8 unknown combine", "R8", f"{E}.dcp_comm_backend", QW,
     dict(engine={"dcp_comm_backend": "ring"}), dict(engine={"dcp_comm_backend": "a2a"})),
    ("R9 interleave does not fit", "R9", f"{E}.cp_kv_cache_interleave_size", QW,
     dict(engine={"cp_kv_cache_interleave_size": 32}),
     dict(engine={"cp_kv_cache_interleave_size": 16})),
    ("R9 interleave with an assumed block", "R9", f"{E}.cp_kv_cache_interleave_size", QW,
     dict(engine={"cp_kv_cache_interleave_size": 8}, unset=("block_size",)),
     dict(engine={"cp_kv_cache_interleave_size": 8})),
    ("R9 MultiConnector needs a stated interleave", "R9", f"{E}.cp_kv_cache_interleave_size",
     QW, dict(pd="MultiConnector"),
     dict(pd="MultiConnector", engine={"cp_kv_cache_interleave_size": 16})),
    ("R9 MultiConnector interleave must fit", "R9", f"{E}.cp_kv_cache_interleave_size", QW,
     dict(pd="MultiConnector", engine={"cp_kv_cache_interleave_size": 32}),
     dict(pd="MultiConnector", engine={"cp_kv_cache_interleave_size": 8})),
    ("R10 DSA dcp bf16 cache", "R10", f"{E}.cache_dtype", DS32_DCP,
     dict(engine={"cache_dtype": "bfloat16"}), {}),
    ("R10 DSA dcp a2a", "R10", f"{E}.dcp_comm_backend", DS32_DCP,
     dict(engine={"dcp_comm_backend": "a2a"}), {}),
    ("R10 DSA dcp 32 local heads", "R10", f"{P}.dcp", DS32_DCP, dict(parallel={"tp": 4}), {}),
    ("R10 DSA dcp head padding", "R10", f"{P}.dcp", DS32_DCP, dict(parallel={"dcp": 8}),
     dict(parallel={"dcp": 4})),
    ("R10 DSA block", "R10", f"{E}.block_size", DS32, dict(engine={"block_size": 32}),
     dict(engine={"block_size": 128})),
    ("R10 DSA pre-Hopper", "R10", "cluster.hardware", DS32,
     dict(cluster={"hardware": "l40s"}), {}),
    ("R10 DSA nvfp4_ds_mla without fp4", "R10", f"{E}.cache_dtype", DS32_DCP,
     dict(engine={"cache_dtype": "nvfp4_ds_mla"}),
     dict(engine={"cache_dtype": "nvfp4_ds_mla"}, cluster={"hardware": "b200"})),
    ("R10 DSA pcp+dcp needs fp8_ds_mla", "R10", f"{E}.cache_dtype", GLM,
     dict(engine={"cache_dtype": "nvfp4_ds_mla"}, cluster={"hardware": "b200"}),
     dict(cluster={"hardware": "b200"})),
    ("R11 nvfp4 on sparse mla", "R11", f"{E}.cache_dtype", DS32,
     dict(engine={"cache_dtype": "nvfp4"}), {}),
    ("R11 nvfp4 on kimi-k3 mla", "R11", f"{E}.cache_dtype", "kimi-k3-gb200-nvl72-ep72",
     dict(engine={"cache_dtype": "nvfp4"}), {}),
    ("R11 fp8_ds_mla on gqa", "R11", f"{E}.cache_dtype", QW,
     dict(engine={"cache_dtype": "fp8_ds_mla"}), {}),
    ("R11 nvfp4_ds_mla on dense mla", "R11", f"{E}.cache_dtype", DS_PCP,
     dict(engine={"cache_dtype": "nvfp4_ds_mla"}), {}),
    ("R12 EP wider than experts", "R12", P, "deepseek-v3-gb200-2rack-ep144",
     dict(model="minimax-m3"),
     dict(model="minimax-m3", engine={"eplb": {"enable_eplb": True,
                                               "num_redundant_experts": 32}})),
    ("R12 redundant experts only with EPLB on", "R12", P, "deepseek-v3-gb200-2rack-ep144",
     dict(model="minimax-m3", engine={"eplb": {"enable_eplb": False,
                                               "num_redundant_experts": 32}}),
     dict(model="minimax-m3", engine={"eplb": {"enable_eplb": True,
                                               "num_redundant_experts": 16}})),
    ("R14 q replicate on DSA", "R14", f"{E}.dcp_q_replicate", DS32_DCP,
     dict(engine={"dcp_q_replicate": True}), dict(engine={"dcp_q_replicate": False})),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_feature_refusal_beside_a_deployment_that_opens(case):
    _, code, field, base, bad, good = case
    refused(code, field, base, **bad)
    k = jkernel.new(inputs(bundle(base, **good)))
    assert isinstance(k, jkernel.Kernel)


def test_refusal_twins_price_what_they_promise():
    """The twins above that are not shipped scenarios resolve to their feature."""
    k = jkernel.new(inputs(bundle(DS32_DCP, engine={"cache_dtype": "nvfp4_ds_mla"},
                                  cluster={"hardware": "b200"})))
    assert k.kv_bytes_per_token() == 352 * 61
    k = jkernel.new(inputs(bundle(GLM, parallel={"dcp": 16})))
    assert k.plan.group("DCP").stride == 1 and k.plan.key("all_gather", "TP") is not None
    k = jkernel.new(inputs(bundle("deepseek-v3-gb200-2rack-ep144", model="minimax-m3",
                                  engine={"eplb": {"enable_eplb": True,
                                                   "num_redundant_experts": 32}})))
    assert (k.plan.physical_experts, k.plan.experts_per_rank) == (160, 2)


@pytest.mark.parametrize("name", [QW, GLM])
def test_dcp_q_replicate_accepted_where_it_has_no_effect(name):
    """resolution.md §8.5: only DCP without PCP on a latent model refuses it."""
    jkernel.new(inputs(bundle(name, engine={"dcp_q_replicate": True})))


# -- vectors.md §7: shapes to exercise ----------------------------------------------------------

SHAPES = [
    ("minimax-m2.5-h200-2node-ep16", [([2] * 256, [8192] * 256), ([2] * 32, [8192] * 32),
                                      ([2048], [0]), ([2048] * 4, [0] * 4)]),
    ("minimax-m3-h200-fp8-tp8-ep8", [([1024], [0]), ([1] * 32, [1024] * 32),
                                     ([1] * 256, [1024] * 256)]),
]


@pytest.mark.parametrize("name,shapes", SHAPES, ids=[s[0] for s in SHAPES])
def test_section_7_shapes(name, shapes):
    """Finite, Overlap ≤ NoOverlap, every resource ≥ 0, and NoOverlap non-decreasing in each
    decode's context."""
    k = kernel(name)
    for sched, comp in shapes:
        batch = Batch(sched, comp, decode_threshold=THR)
        est = k.step_time(batch)
        check_one(est)
        for j in range(len(sched)):
            if sched[j] > THR:
                continue
            more = np.array(comp)
            more[j] += 4096
            grown = k.step_time(Batch(sched, more, decode_threshold=THR))
            assert grown.no_overlap_s >= est.no_overlap_s * (1 - 1e-12)
