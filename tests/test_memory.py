"""Memory and structural pins (spec memory.md; vectors.md §2, §3).

Coefficient-free pins [C] are exact. The fixed-bytes and page figures [R] are exact here too,
because the fixture registry (tests/data/spec_catalog, set spec-vectors) holds the reference
memory magnitudes. Graphs that only the shipped catalog has are read from it (a test fails,
naming the file, when it is missing or does not load: a broken shipped graph is a defect).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import jkernel
import jkernel.memory
from conftest import spec_kernel
from jkernel import Batch, Refusal
from jkernel.documents import DTYPE_BYTES, load_graph, parse_bundle
from jkernel.plan import LAUNCHES

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).resolve().parent / "data" / "spec_catalog"
SHIPPED = ROOT / "catalog"
SPEC_REPOS = jkernel.Repos(catalog=SPEC, registry=SPEC)
MIX_REPOS = jkernel.Repos(catalog=SHIPPED, registry=SPEC)   # shipped graphs, spec values

H200_BYTES = 151_397_597_184           # 141 GiB (documents.md §3.1)
WORKSPACE = 3_758_096_384
FLOOR = 268_435_456                    # activation_scratch_floor_bytes of the fixture set
NEMOTRON = "nemotron-3.5-lightning-30b-a3b-nvfp4"


def bundle(model="deepseek-v3", hw="h200", *, tp=8, dp=1, nodes=1, gpn=8, fabric=None,
           ep=False, dcp=0, engine=None, sets=("spec-vectors",)):
    cluster = {"hardware": hw, "nodes": nodes, "gpus_per_node": gpn}
    if fabric:
        cluster["fabric"] = fabric
    par = {"tp": tp, "pp": 1, "dp": dp}
    if ep:
        par["enable_expert_parallel"] = True
    if dcp:
        par["dcp"] = dcp
    sc = {"kind": "Scenario", "name": "m", "model": model, "coefficients": list(sets),
          "engine_version": "0.31.0", "cluster": cluster}
    pool = {"role": "colocated", "nodes": nodes, "parallel": par}
    if engine:
        pool["engine"] = engine
    return sc, {"kind": "Deployment", "name": "m", "pools": [pool]}


_KERNELS: dict = {}
_DOCUMENTS: dict = {}


def kernel(repos=SPEC_REPOS, **kw) -> jkernel.Kernel:
    """`open(bundle(**kw), repos)`, cached. Bundles naming the same graph, chip, fabric and
    sets share the parsed documents (immutable; YAML parsing is most of a construction)."""
    key = (repr(repos), repr(sorted(kw.items())))
    if key not in _KERNELS:
        sc, dep = bundle(**kw)
        docs = (repr(repos), sc["model"], repr(sc["cluster"]), tuple(sc["coefficients"]))
        if docs not in _DOCUMENTS:
            _DOCUMENTS[docs] = jkernel.open_inputs((sc, dep), repos)
        scenario, deployment = parse_bundle((sc, dep))
        inputs = dataclasses.replace(_DOCUMENTS[docs], scenario=scenario,
                                     deployment=deployment, pool_index=0)
        _KERNELS[key] = jkernel.new(inputs)
    return _KERNELS[key]


def shipped(name: str) -> None:
    """Check that the shipped catalog's graph ``name`` exists and loads; fails otherwise (the
    catalog ships with the repository, so neither is a reason to skip)."""
    path = SHIPPED / "models" / name / "graph.yaml"
    assert path.is_file(), f"shipped graph {path} is missing"
    load_graph(path, expected_name=name)


def kind(k: jkernel.Kernel, kind_id: str):
    return next(x for x in k.plan.kinds if x.id == kind_id)


# -- vectors.md §2: structural pins from the reference graphs [C] -----------------------------

def test_deepseek_v3_structure():
    """vectors.md §2, deepseek-v3 at tp 8, dp 1, EP off: 61 layers all holding KV, moe_group 1
    so no All2All, 62 segments, 972 kernels = 58·16 + 3·14 + 2, and the per-layer bytes and
    FLOPs of the table."""
    k = spec_kernel()
    p = k.plan
    assert (p.total_layers, p.kv_layers, p.moe_group) == (61, 61, 1)
    assert p.segments == 62
    assert p.total_kernels == 972 == 58 * 16 + 3 * 14 + 2
    dense, moe = kind(k, "attn_dense"), kind(k, "attn_moe")
    assert (dense.count, dense.launches, moe.count, moe.launches) == (3, 14, 58, 16)
    assert moe.dense_weight_bytes == 187_105_280                 # attention GEMMs, fp8
    assert dense.dense_weight_bytes - moe.dense_weight_bytes == 396_361_728   # dense MLP
    assert moe.expert_weight_bytes_per_expert == 44_040_192 == 3 * 2048 * 7168
    assert moe.expert_flops_per_token_per_expert == 88_080_384
    assert p.head_flops_per_token == 1_853_358_080 == 2 * 129280 * 7168
    for kp in (dense, moe):
        assert [c.op for c in kp.collectives] == ["all_reduce", "all_reduce"]
    assert sum(kp.count * len(kp.collectives) for kp in p.kinds) == 122
    assert not any(c.op == "alltoall" for kp in p.kinds for c in kp.collectives)


def _launches(nodes) -> int:
    return sum(LAUNCHES.get(n.op, 1) for n in nodes)


def test_deepseek_v3_derived_graph_differs_by_the_d36_nodes():
    """vectors.md §2: a graph derived under D36 has more nodes (router GEMMs, q/k norms); its
    kernel counts and weights differ from the reference graph's by exactly those nodes."""
    shipped("deepseek-v3")
    ref = spec_kernel()
    der = kernel(MIX_REPOS, engine={"quantization": "fp8", "cache_dtype": "fp8",
                                    "block_size": 16, "max_num_batched_tokens": 8192,
                                    "max_num_seqs": 256, "max_model_len": 32768,
                                    "cudagraph_mode": "PIECEWISE"})
    ref_graph = load_graph(SPEC / "models" / "deepseek-v3" / "graph.yaml")
    der_graph = load_graph(SHIPPED / "models" / "deepseek-v3" / "graph.yaml")
    counts = {kid: der_graph.stack.expanded().count(kid) for kid in
              {lk.id for lk in der_graph.layer_kinds}}
    extra_kernels, extra_bytes = 0, 0.0
    for lk in der_graph.layer_kinds:
        ref_roles = {(n.op, n.role) for n in ref_graph.kind(lk.id).nodes}
        extra = [n for n in lk.nodes if (n.op, n.role) not in ref_roles]
        assert {n.role for n in extra} <= {"router", "q_norm", "k_norm"}, lk.id
        extra_kernels += counts[lk.id] * _launches(extra)
        extra_bytes += counts[lk.id] * sum(n.n * n.k * DTYPE_BYTES[n.weight_dtype or "fp8"]
                                           for n in extra if n.op == "GEMM") / 8
    assert extra_kernels == 58                          # one router GEMM per MoE layer
    assert der.plan.total_kernels - ref.plan.total_kernels == extra_kernels
    assert der.fixed_bytes().weights - ref.fixed_bytes().weights == int(extra_bytes)
    assert int(extra_bytes) == 58 * 256 * 7168 * 2 // 8       # bf16 router, tp 8


@pytest.mark.parametrize("tp, kernels", [(1, 258), (2, 322), (8, 322)])
def test_llama_3_1_8b_kernel_counts(tp, kernels):
    """vectors.md §2: 32·8 + 2 = 258 at tp 1 (no all-reduce emitted), 32·10 + 2 = 322 at
    tp > 1; 33 segments. A dense Llama has no router and no q/k norms, so D36 adds nothing."""
    shipped("llama-3.1-8b-instruct")
    k = kernel(MIX_REPOS, model="llama-3.1-8b-instruct", tp=tp)
    assert k.plan.total_kernels == kernels and k.plan.segments == 33
    g = load_graph(SHIPPED / "models" / "llama-3.1-8b-instruct" / "graph.yaml")
    assert not [n for lk in g.layer_kinds for n in lk.nodes
                if n.role in ("router", "q_norm", "k_norm")]


@pytest.mark.parametrize("tp, ep, kernels", [(1, False, 362), (8, False, 434), (8, True, 506)])
def test_gpt_oss_kernel_counts(tp, ep, kernels):
    """vectors.md §2 [C]: 36·10 + 2, 36·12 + 2, and 36·14 + 2 with EP on (the All2All's two
    launches); 37 segments. The shipped (D36-derived) graph adds one router GEMM per layer."""
    k = kernel(model="gpt-oss-120b", tp=tp, ep=ep)
    assert k.plan.total_kernels == kernels and k.plan.segments == 37
    if (SHIPPED / "models" / "gpt-oss-120b" / "graph.yaml").is_file():
        shipped("gpt-oss-120b")
        der = kernel(MIX_REPOS, model="gpt-oss-120b", tp=tp, ep=ep)
        g = load_graph(SHIPPED / "models" / "gpt-oss-120b" / "graph.yaml")
        routers = sum(g.stack.expanded().count(lk.id) for lk in g.layer_kinds
                      for n in lk.nodes if n.role == "router")
        assert der.plan.total_kernels - k.plan.total_kernels == routers == 36


@pytest.mark.parametrize("tp, kvb", [(1, 73_728), (2, 36_864), (4, 18_432), (8, 9_216),
                                     (16, 9_216)])
def test_gpt_oss_kv_bytes_per_token(tp, kvb):
    """vectors.md §2 [C]: 2·max(1, 8 // tp)·64·2·36 (auto cache on mxfp4 weights is 2 B); at tp
    16 the KV heads floor at one per rank, so tp 16 holds what tp 8 holds."""
    extra = dict(nodes=2, fabric="ib-400g", sets=("spec-vectors", "spec-h200-16rank")) \
        if tp == 16 else {}
    assert kernel(model="gpt-oss-120b", tp=tp, **extra).kv_bytes_per_token() == kvb


def test_nemotron_structure_and_state():
    """vectors.md §2 [C]: kinds mamba 23, attention 6, moe 23 (L_kv 6); the mamba2 page is
    ((4096 + 2·8·128)·3 + 64·128²)·4 B = 4,268,032 B (no d_h on the node, D23); align mode
    holds two pages per recurrent layer, three with num_spec 1."""
    k = kernel(model=NEMOTRON, tp=1)
    assert {kp.id: kp.count for kp in k.plan.kinds} == {"mamba": 23, "attention": 6, "moe": 23}
    assert k.plan.kv_layers == 6
    page = ((4096 + 2 * 8 * 128) * 3 + 64 * 128 ** 2) * 4
    assert page == 4_268_032
    assert kind(k, "mamba").recurrent.page_bytes == page
    assert k.settings.mamba_cache_mode == "align"
    assert k.sequence_fixed_bytes() == 196_329_472 == 23 * page * 2
    spec = kernel(model=NEMOTRON, tp=1,
                  engine={"speculative": {"method": "nemotron_h_mtp", "num_spec_tokens": 1}})
    assert spec.sequence_fixed_bytes() == 294_494_208 == 23 * page * 3


@pytest.mark.parametrize("tp, kvb", [(1, 6_144), (2, 3_072), (4, 3_072)])
def test_nemotron_kv_bytes_per_token(tp, kvb):
    """vectors.md §2 [C]: 2·max(1, 2 // tp)·128·2·6; the state is not divided by tp (D23)."""
    k = kernel(model=NEMOTRON, tp=tp)
    assert k.kv_bytes_per_token() == kvb
    assert k.sequence_fixed_bytes() == 196_329_472


@pytest.mark.parametrize("engine, fixed, per_page", [
    ({"mamba_cache_mode": "none", "enable_prefix_caching": False}, 23 * 4_268_032, 0),
    ({"mamba_cache_mode": "all"}, 0, 23 * 4_268_032),
    ({"mamba_cache_dtype": "bfloat16"}, 23 * 2 * (4_268_032 // 2), 0),
])
def test_recurrent_state_by_mode(engine, fixed, per_page):
    """memory.md §3.2: `none` holds one page per recurrent layer; `all` holds none outside the
    KV and adds count·page·(ceil(tokens/block) + num_spec) to sequence_variable_bytes (on the
    unsharded tokens); a 2-byte state dtype halves the page."""
    k = kernel(model=NEMOTRON, tp=1, engine=engine)
    assert k.sequence_fixed_bytes() == fixed
    kv17 = math.ceil(17 / 16) * 16 * 6_144
    assert k.sequence_variable_bytes(17) == kv17 + per_page * 2
    assert k.sequence_variable_bytes(0) == 0


def test_llama_3_1_70b_fp8_tp8_weights():
    """vectors.md §2 [C]: (80·855,638,016 + 128256·8192·1 + 128256·8192·2) / 8 = 8,950,382,592:
    layers and head at the served fp8 width, the embedding at the bf16 checkpoint width. kvB
    with an fp8 cache: 20,480 at tp 8, 163,840 at tp 1."""
    shipped("llama-3.1-70b-instruct")
    engine = {"quantization": "fp8", "cache_dtype": "fp8"}
    k8 = kernel(MIX_REPOS, model="llama-3.1-70b-instruct", engine=engine)
    assert k8.fixed_bytes().weights == 8_950_382_592 == \
        (80 * 855_638_016 + 128256 * 8192 * 1 + 128256 * 8192 * 2) // 8
    assert k8.kv_bytes_per_token() == 20_480
    k1 = kernel(MIX_REPOS, model="llama-3.1-70b-instruct", tp=1, engine=engine)
    assert k1.kv_bytes_per_token() == 163_840


# -- vectors.md §3.1: deepseek-v3 memory pins ---------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_deepseek_kv_bytes_per_token_any_tp(tp):
    """vectors.md §3.1 [C]: kvB = 1·1·576·1·61 = 35,136 at any tp (a latent cache is never
    split); 70,272 with a bf16 cache."""
    assert kernel(tp=tp, engine={"cache_dtype": "fp8"}).kv_bytes_per_token() == 35_136
    assert kernel(tp=tp, engine={"cache_dtype": "bfloat16"}).kv_bytes_per_token() == 70_272


@pytest.mark.parametrize("tokens, nbytes", [(0, 0), (-5, 0), (1, 562_176), (16, 562_176),
                                            (17, 1_124_352), (4096, 143_917_056)])
def test_deepseek_sequence_variable_bytes(tokens, nbytes):
    """vectors.md §3.1 [C]: whole pages of 16·35,136 = 562,176 B; 4096 tokens are 137.25 MiB."""
    assert spec_kernel().sequence_variable_bytes(tokens) == nbytes


def test_deepseek_sequence_variable_bytes_tp1_and_dcp8():
    """vectors.md §3.1 [C]: 16 tokens are one page at tp 1 as at tp 8. At dcp 8 the token count
    is sharded first, then paged: 4096 → 512 tokens = 17,989,632 B; 16 → 2 tokens, still one
    page of 562,176 B (memory.md §2)."""
    assert kernel(tp=1, engine={"cache_dtype": "fp8", "block_size": 16}
                  ).sequence_variable_bytes(16) == 562_176
    k = kernel(dcp=8, engine={"cache_dtype": "fp8", "block_size": 16})
    assert k.sequence_variable_bytes(4096) == 17_989_632
    assert k.sequence_variable_bytes(16) == 562_176
    assert k.page_bytes() == 562_176
    n = 4096
    assert math.ceil(k.sequence_variable_bytes(n) / k.page_bytes()) == \
        math.ceil(math.ceil(n / 8) / 16)


def test_block_size_one_is_unpaged():
    """memory.md §2: with block ≤ 1, kv = trunc(t·kvB)."""
    k = kernel(engine={"cache_dtype": "fp8", "block_size": 1})
    assert k.sequence_variable_bytes(17) == 17 * 35_136


def test_deepseek_fixed_bytes_breakdown():
    """vectors.md §3.1 / memory.md §4.6: weights 83,864,870,912 [C]; activation 10·8192·7168·2
    = 1,174,405,120, PIECEWISE capture 858,783,744, communicator + workspace 4,169,138,176,
    EPLB 0 [R]; total 90,067,197,952, the non-weight part 6,202,327,040."""
    fb = spec_kernel().fixed_bytes()
    assert fb.weights == 83_864_870_912
    assert fb.activation_peak == 1_174_405_120 == 10 * 8192 * 7168 * 2
    assert fb.cuda_graph == 858_783_744
    assert fb.comm_buffers == 411_041_792 + WORKSPACE == 4_169_138_176
    assert fb.eplb_redundant == 0
    assert fb.total() == 90_067_197_952
    assert fb.total() - fb.weights == 6_202_327_040
    assert all(isinstance(v, int) for v in dataclasses.astuple(fb))


def test_deepseek_weights_by_part():
    """memory.md §4.6 [C]: 3 dense layers 218,800,128; 58 MoE layers 83,414,401,024; head at
    fp8 plus the embedding at the fp8 checkpoint width 231,669,760."""
    assert 3 * 583_467_008 // 8 == 218_800_128
    moe = 58 * (187_105_280 + 44_040_192 * 256 + 44_040_192) // 8
    assert moe == 83_414_401_024
    assert 218_800_128 + moe + (926_679_040 + 926_679_040) // 8 == 83_864_870_912
    assert spec_kernel().plan.head_weight_bytes == 926_679_040


def test_communicator_at_tp2():
    """vectors.md §3.1 [R]: the communicator at tp 2 is 358,612,992."""
    k = kernel(tp=2, engine={"cache_dtype": "fp8"})
    assert k.fixed_bytes().comm_buffers - WORKSPACE == 358_612_992


def test_kv_pages_at_0_9_and_default():
    """vectors.md §3.2 / memory.md §5: floor((151,397,597,184·u − 90,067,197,952) / 562,176)
    pages: 82,164 (1,314,624 tokens) at u = 0.9 and 87,550 at the unstated default 0.92 (D15)."""
    k = spec_kernel()
    assert k.inputs.chip.memory_bytes == H200_BYTES
    assert k.kv_cache_pages() == 87_550
    assert k.assumption("gpu_memory_utilization").startswith("0.92")
    engine = {"quantization": "fp8", "cache_dtype": "fp8", "block_size": 16,
              "max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 32768,
              "cudagraph_mode": "PIECEWISE", "gpu_memory_utilization": 0.9}
    k9 = kernel(engine=engine)
    assert k9.kv_cache_pages() == 82_164
    assert k9.kv_cache_pages() * 16 == 1_314_624
    assert k9.assumption("gpu_memory_utilization") is None
    assert math.floor((H200_BYTES * 0.9 - 90_067_197_952) / 562_176) == 82_164


def test_kv_pages_never_negative():
    """memory.md §5: pages = max(0, …) when the fixed bytes exceed the budget."""
    k = kernel(engine={"quantization": "fp8", "cache_dtype": "fp8",
                       "gpu_memory_utilization": 0.5})
    assert k.kv_cache_pages() == 0


def test_h_act():
    """vectors.md §3.1 [C] / memory.md §4.3: h_act is 7168 for deepseek-v3 (latent: H) and
    32·128 = 4096 for qwen3-30b-a3b (n_q·d_h, against a hidden size of 2048)."""
    assert spec_kernel().fixed_bytes().activation_peak == 10 * 8192 * 7168 * 2
    shipped("qwen3-30b-a3b")
    k = kernel(MIX_REPOS, model="qwen3-30b-a3b", tp=1, engine={"max_num_batched_tokens": 8192})
    assert k.fixed_bytes().activation_peak == 10 * 8192 * 4096 * 2


# -- [P] relations (vectors.md §3.1) -----------------------------------------------------------

def test_one_token_budget_gives_the_scratch_floor():
    """[P] max_num_batched_tokens 1 gives exactly activation_scratch_floor_bytes."""
    k = kernel(engine={"cache_dtype": "fp8", "max_num_batched_tokens": 1})
    assert k.fixed_bytes().activation_peak == FLOOR


def test_activation_is_linear_above_the_floor():
    """[P] Budgets of 4096 and 8192, both above the floor, give activations in ratio 2."""
    a = kernel(engine={"cache_dtype": "fp8", "max_num_batched_tokens": 4096})
    b = kernel(engine={"cache_dtype": "fp8", "max_num_batched_tokens": 8192})
    assert a.fixed_bytes().activation_peak > FLOOR
    assert b.fixed_bytes().activation_peak == 2 * a.fixed_bytes().activation_peak


def test_no_graph_mode_captures_nothing():
    """[P] cudagraph_mode NONE gives cuda_graph = 0; an unstated mode is charged exactly as
    FULL_AND_PIECEWISE (memory.md §4.4)."""
    assert kernel(engine={"cudagraph_mode": "NONE"}).fixed_bytes().cuda_graph == 0
    assert kernel().fixed_bytes() == \
        kernel(engine={"cudagraph_mode": "FULL_AND_PIECEWISE"}).fixed_bytes()


_MEMORY = ("activation_buffer_count_", "activation_scratch_floor_bytes", "cudagraph_capture_bytes_",
           "engine_workspace_bytes", "nccl_communicator_bytes_")


def test_tripling_memory_coefficients_changes_memory_not_time():
    """[P] vectors.md §3.1: tripling every memory coefficient of the registry triples the
    non-weight part of fixed_bytes() and leaves step time unchanged."""
    inputs = jkernel.open_inputs(
        (SPEC / "scenarios" / "deepseek-v3-h200-fp8-tp8.yaml"), SPEC_REPOS)
    sets = tuple(dataclasses.replace(cs, entries=tuple(
        dataclasses.replace(e, value=3 * e.value) if e.name.startswith(_MEMORY) else e
        for e in cs.entries)) for cs in inputs.coefficient_sets)
    tripled = jkernel.new(dataclasses.replace(inputs, coefficient_sets=sets))
    base = spec_kernel()
    a, b = base.fixed_bytes(), tripled.fixed_bytes()
    assert b.weights == a.weights and b.eplb_redundant == a.eplb_redundant
    assert (b.activation_peak, b.cuda_graph, b.comm_buffers) == \
        (3 * a.activation_peak, 3 * a.cuda_graph, 3 * a.comm_buffers)
    assert b.total() != a.total()
    batch = Batch([1] * 8, [100] * 8)
    assert tripled.step_time(batch) == base.step_time(batch)


def test_eplb_redundant_experts_counted_once_and_only_when_enabled():
    """memory.md §4.1–§4.2, D24: redundant experts count only with eplb.enable_eplb; their
    bytes are moved out of `weights`, so weights are unchanged and total() grows by exactly
    eplb_redundant = 58·44,040,192·32 / ep / 1 (EP on, tp 8)."""
    eplb = {"enable_eplb": True, "num_redundant_experts": 32}
    on = kernel(ep=True, engine={"cache_dtype": "fp8", "eplb": eplb}).fixed_bytes()
    off = kernel(ep=True, engine={"cache_dtype": "fp8", "eplb": eplb | {"enable_eplb": False}}
                 ).fixed_bytes()
    assert off.eplb_redundant == 0
    assert on.eplb_redundant == 58 * 44_040_192 * 32 // 8
    assert on.weights == off.weights
    assert on.total() - off.total() == on.eplb_redundant


def test_tied_embeddings_are_counted_once():
    """D22: with tie_word_embeddings true the embedding term (vocab·H·checkpoint bytes / tp) is
    dropped; the head still holds the table."""
    inputs = jkernel.open_inputs(
        (SPEC / "scenarios" / "deepseek-v3-h200-fp8-tp8.yaml"), SPEC_REPOS)
    tied = jkernel.new(dataclasses.replace(
        inputs, model=dataclasses.replace(inputs.model, tie_word_embeddings=True)))
    drop = spec_kernel().fixed_bytes().weights - tied.fixed_bytes().weights
    assert drop == 129280 * 7168 * 1 // 8


# -- vectors.md §1.9: cache element bytes [C] ----------------------------------------------------

def _tiny(engine=None, weight_dtype=None) -> jkernel.Kernel:
    """tiny-llm at tp 1: gqa with 2 KV heads of 128 over 4 layers, kvB = 2·2·128·4·bytes."""
    inputs = jkernel.open_inputs(bundle("tiny-llm", tp=1, engine=engine), SPEC_REPOS)
    if weight_dtype:
        inputs = dataclasses.replace(
            inputs, model=dataclasses.replace(inputs.model, weight_dtype=weight_dtype))
    return jkernel.new(inputs)


@pytest.mark.parametrize("engine, weight_dtype, elem", [
    ({}, None, 2),                                        # auto, served bf16
    ({"cache_dtype": "auto", "quantization": "fp8"}, None, 2),       # served fp8
    ({"quantization": "nvfp4"}, None, 2),                 # served nvfp4
    ({"quantization": "modelopt_fp4"}, None, 2),
    ({"quantization": "mxfp4"}, None, 2),                 # served mxfp4
    ({}, "int4", 2),                                      # served int4 (checkpoint)
    ({"quantization": "awq"}, "int4", 2),                 # the graph governs
    ({}, "fp32", 4),                                      # auto, served fp32
    ({"cache_dtype": "fp8"}, None, 1),
    ({"cache_dtype": "fp8_e4m3"}, None, 1),
    ({"cache_dtype": "fp8_e5m2"}, "fp32", 1),
    ({"cache_dtype": "nvfp4"}, None, 0.5625),
    ({"cache_dtype": "nvfp4_4over6"}, None, 0.5625),
    ({"cache_dtype": "bfloat16"}, "fp32", 2),
    ({"cache_dtype": "float16"}, None, 2),
    ({"cache_dtype": "float32"}, None, 4),
])
def test_cache_element_bytes(engine, weight_dtype, elem):
    """vectors.md §1.9 [C] / memory.md §1.2: `auto` is the model's compute width (2 whenever
    the served weights are narrower than 2 bytes, else the served width); explicit cache
    dtypes are independent of the weights. kvB keeps a fractional byte count (nvfp4)."""
    k = _tiny(engine, weight_dtype)
    assert k.kv_bytes_per_token() == 2 * 2 * 128 * 4 * elem


@pytest.mark.parametrize("hw, cache, cell", [("h200", "fp8_ds_mla", 656),
                                              ("h200", "fp8", 656),
                                              ("b200", "nvfp4_ds_mla", 352)])
def test_packed_sparse_mla_cells(hw, cache, cell):
    """vectors.md §1.9 [C] / memory.md §1.1: on a latent (sparse_mla) layer the packed layouts
    are 656 and 352 B per token per layer, not divided by tp; nvfp4_ds_mla on a DSA model
    needs a native FP4 peak (b200), else R10."""
    shipped("glm-5")
    k = kernel(MIX_REPOS, model="glm-5", hw=hw, engine={"cache_dtype": cache})
    assert k.kv_bytes_per_token() == cell * k.plan.kv_layers == cell * 78
    assert k.page_bytes() == 64 * cell * 78                      # DSA block 64
    if cache == "nvfp4_ds_mla":
        with pytest.raises(Refusal) as info:
            jkernel.open(bundle("glm-5", "h200", engine={"cache_dtype": cache}), MIX_REPOS)
        assert info.value.code == "R10"


def test_sliding_window_stack_is_not_dcp_sharded():
    """memory.md §2: a stack mixing sliding-window and full attention is not DCP-sharded in
    capacity (swa does not shard, resolution.md §8.6); a pure gqa/mla stack is."""
    a = kernel(model="gpt-oss-120b", dcp=2)
    b = kernel(model="gpt-oss-120b")
    assert a.sequence_variable_bytes(4096) == b.sequence_variable_bytes(4096)
    c = kernel(dcp=2, engine={"cache_dtype": "fp8", "block_size": 16})
    assert c.sequence_variable_bytes(4096) == 2048 * 35_136


# -- version-selected memory rules (jkernel/memory.py) -----------------------------------------

@pytest.mark.parametrize("text, version", [("0.10.1.1", (0, 10, 1)), ("v0.23.0rc1", (0, 23, 0)),
                                           ("0.9", (0, 9, 0)), ("0.31.0", (0, 31, 0))])
def test_parse_version(text, version):
    assert jkernel.memory.parse_version(text) == version


@pytest.mark.parametrize("version, spec, graphs, reported", [
    ("0.8.5", False, False, True), ("0.19.1", False, False, True), ("0.20.0", False, True, True),
    ("0.21.0", False, True, True),
    ("0.28.1", False, True, True), ("0.29.0", True, True, False), ("0.31.0", True, True, False)])
def test_memory_rules_by_version(version, spec, graphs, reported):
    """The spec's recipe from 0.29.0 (its magnitudes are the 0.29 rules pack's, its pins are
    declared at 0.29.0 and 0.31.0); vLLM's measured start-up before; the CUDA-graph estimate
    charged from vLLM v0.20.0 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1 there)."""
    r = jkernel.memory.memory_rules(version)
    assert (r.spec_recipe, r.graphs_subtracted, r.reported_total) == (spec, graphs, reported)


def test_spec_pins_hold_at_the_declared_0_29_fixture():
    """The DeepSeek fixture declares engine_version 0.29.0: the spec recipe governs it, so the
    pinned breakdown is unchanged by the vLLM-measured rules of earlier versions."""
    assert spec_kernel().inputs.scenario.engine_version == "0.29.0"
    assert spec_kernel().fixed_bytes().total() == 90_067_197_952
