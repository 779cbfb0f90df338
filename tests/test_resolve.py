"""Construction and resolution (spec resolution.md; vectors.md §1.10, §1.12, §1.13, §4.1, §6).

Bundles are built as (Scenario, Deployment) dicts so that a refused case and its building twin
differ in one setting. The fixture catalog (tests/data/spec_catalog) supplies chips, the
reference graphs and coefficient sets with the spec's own values; graphs that only the shipped
catalog has (glm-5, mixtral-8x7b-v0.1) are read from it with the fixture registry.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import yaml

import jkernel
from conftest import spec_kernel
from jkernel import Refusal
from jkernel.documents import (CoefficientSet, Entry, Scope, load_chip, load_coefficient_set,
                               load_fabric, load_graph, load_storage, parse_bundle)
from jkernel.documents.hardware import StorageClass
from jkernel.resolve import Inputs, _snap_collective, _snap_memory

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).resolve().parent / "data" / "spec_catalog"
SHIPPED = ROOT / "catalog"
SPEC_REPOS = jkernel.Repos(catalog=SPEC, registry=SPEC)
# Shipped graphs and chips, fixture coefficients (spec values): for glm-5 and mixtral.
MIX_REPOS = jkernel.Repos(catalog=SHIPPED, registry=SPEC)


# -- bundle builders ---------------------------------------------------------------------

def bundle(model: str = "deepseek-v3", hw: str = "h200", *, tp: int = 8, pp: int = 1,
           dp: int = 1, nodes: int = 1, gpn: int = 8, fabric: str | None = None,
           ep: bool = False, pcp: int = 0, dcp: int = 0, engine: dict | None = None,
           sets=("spec-vectors",), version: str = "0.31.0", rack: int | None = None,
           pd: str | None = None, offload: dict | None = None, storage=None):
    """A one-pool (colocated) bundle as a (Scenario, Deployment) pair of dicts."""
    cluster = {"hardware": hw, "nodes": nodes, "gpus_per_node": gpn}
    if fabric:
        cluster["fabric"] = fabric
    if rack:
        cluster["gpus_per_rack"] = rack
    if storage is not None:
        cluster["storage"] = list(storage)
    par = {"tp": tp, "pp": pp, "dp": dp}
    if ep:
        par["enable_expert_parallel"] = True
    if pcp:
        par["pcp"] = pcp
    if dcp:
        par["dcp"] = dcp
    sc = {"kind": "Scenario", "name": "t", "model": model, "coefficients": list(sets),
          "engine_version": version, "cluster": cluster}
    pool = {"role": "colocated", "nodes": nodes, "parallel": par}
    if engine:
        pool["engine"] = dict(engine)
    dep = {"kind": "Deployment", "name": "t", "pools": [pool]}
    if pd:
        dep["pd_transfer"] = {"connector": pd}
    if offload:
        dep["offload"] = offload
    return sc, dep


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        if key == "engine":
            out["engine"] = {**(base.get("engine") or {}), **value}
        else:
            out[key] = value
    return out


def _key(kw: dict) -> str:
    return json.dumps(kw, sort_keys=True, default=str)


_PIECES: dict[tuple, object] = {}
_KERNELS: dict[str, jkernel.Kernel] = {}


def _piece(key: tuple, path: Path, load):
    """One immutable document, loaded once per (repos, name) with jkernel's own loader."""
    if key not in _PIECES:
        _PIECES[key] = load(path)
    return _PIECES[key]


def inputs_of(sc: dict, dep: dict, repos=SPEC_REPOS, pool: int = 0) -> Inputs:
    """`open_inputs((sc, dep), repos, pool)`, reusing documents already loaded.

    Parsing the YAML of the graph, chip and coefficient sets is most of a construction's cost;
    the parsed documents are immutable, so test bundles naming the same ones share them. The
    scenario and deployment are always parsed afresh; a bundle naming a document that does
    not exist goes through open_inputs itself (and its R2).
    """
    cat, reg, cl = Path(repos.catalog), Path(repos.registry), sc["cluster"]
    paths = [cat / "models" / sc["model"] / "graph.yaml",
             cat / "hardware" / f"{cl['hardware']}.yaml", cat / "devices" / "storage.yaml"]
    paths += [cat / "networks" / f"{cl['fabric']}.yaml"] if cl.get("fabric") else []
    paths += [reg / "coefficients" / f"{s}.yaml" for s in sc["coefficients"]]
    if not all(p.is_file() for p in paths):
        return jkernel.open_inputs((sc, dep), repos, pool)
    scenario, deployment = parse_bundle((sc, dep))
    if not 0 <= pool < len(deployment.pools):
        raise Refusal("R3", f"no pool at index {pool}")
    model = _piece(("model", paths[0]), paths[0],
                   lambda p: load_graph(p, expected_name=sc["model"]))
    chip = _piece(("chip", paths[1]), paths[1], load_chip)
    devices = _piece(("devices", paths[2]), paths[2], load_storage)
    fabric = (_piece(("fabric", paths[3]), paths[3], load_fabric) if cl.get("fabric")
              else None)
    sets = tuple(_piece(("set", p), p, load_coefficient_set)
                 for p in paths[len(paths) - len(sc["coefficients"]):])
    return Inputs(scenario, deployment, pool, model, chip, fabric, dict(devices), sets)


def inputs_for(repos=SPEC_REPOS, **kw) -> Inputs:
    return inputs_of(*bundle(**kw), repos)


def build(repos=SPEC_REPOS, **kw) -> jkernel.Kernel:
    """A kernel for ``bundle(**kw)`` (one pool: `open` = `new(open_inputs(…))`), cached."""
    key = _key(kw) + repr(repos)
    if key not in _KERNELS:
        _KERNELS[key] = jkernel.new(inputs_for(repos, **kw))
    return _KERNELS[key]


def refused(code: str, repos=SPEC_REPOS, field: str | None = None, **kw) -> Refusal:
    with pytest.raises(Refusal) as info:
        jkernel.new(inputs_for(repos, **kw))
    exc = info.value
    assert exc.code == code, str(exc)
    if field is not None:
        assert exc.field == field, str(exc)
    return exc


def shipped_model(name: str) -> None:
    """Fail, naming the file, unless the shipped catalog's graph for ``name`` and the chips
    these cases use load: the catalog ships with the repository, so a missing or broken file
    is a defect, never a reason to skip."""
    path = SHIPPED / "models" / name / "graph.yaml"
    assert path.is_file(), f"shipped graph {path} is missing"
    load_graph(path, expected_name=name)                  # a Refusal names the file and key
    for chip in ("h200", "a100-sxm"):
        load_chip(SHIPPED / "hardware" / f"{chip}.yaml")


def entry(name: str, value: float, *, method: str = "measured", units: str = "dimensionless",
          **scope) -> Entry:
    scope = {k: tuple(v) for k, v in (scope or {"hardware": ["h200"]}).items()}
    return Entry(name, float(value), units, method, method == "measured", Scope(**scope),
                 rationale=None if method == "measured" else "test")


def edited(inputs, *, drop=lambda name: False, values: dict | None = None, add=()):
    """``inputs`` with coefficient entries dropped, revalued, or a set appended."""
    values = values or {}
    sets = []
    for cs in inputs.coefficient_sets:
        entries = tuple(dataclasses.replace(e, value=float(values[e.name]))
                        if e.name in values else e
                        for e in cs.entries if not drop(e.name))
        sets.append(dataclasses.replace(cs, entries=entries))
    if add:
        sets.append(CoefficientSet("test-extra", tuple(add)))
    return dataclasses.replace(inputs, coefficient_sets=tuple(sets))


def scope_value(k: jkernel.Kernel, name: str) -> str:
    """The value at the start of a kernel assumption's scope string (resolution.md §7)."""
    scope = k.assumption(name)
    assert scope is not None, f"no assumption {name}"
    return scope.split(":", 1)[0]


# -- vectors.md §6: every refusal beside its building twin ------------------------------------

DS = dict(model="deepseek-v3")
GLM = dict(model="glm-5")
TINY = dict(model="tiny-llm")

TWINS = [
    # id, repos, base kwargs, refused change, twin change, code, field
    ("R13 pp 2", SPEC_REPOS, DS | dict(tp=4), dict(pp=2), dict(pp=1), "R13",
     "pools[0].parallel.pp"),
    ("R5 pcp on gqa", SPEC_REPOS, dict(tp=4, pcp=2), TINY, DS, "R5",
     "pools[0].parallel.pcp"),
    ("R6 dcp+pcp not sparse_mla", MIX_REPOS,
     dict(tp=4, pcp=2, dcp=2, engine={"cache_dtype": "fp8_ds_mla"}),
     dict(model="deepseek-v3", engine={"cache_dtype": "fp8"}), GLM, "R6",
     "pools[0].parallel.dcp"),
    ("R7 a2a with pcp", MIX_REPOS,
     GLM | dict(tp=4, pcp=2, dcp=2, engine={"cache_dtype": "fp8_ds_mla"}),
     dict(engine={"dcp_comm_backend": "a2a"}), dict(engine={"dcp_comm_backend": "ag_rs"}),
     "R7", "pools[0].engine.dcp_comm_backend"),
    ("R8 ring combine", SPEC_REPOS, DS | dict(dcp=2),
     dict(engine={"dcp_comm_backend": "ring"}), dict(engine={"dcp_comm_backend": "ag_rs"}),
     "R8", "pools[0].engine.dcp_comm_backend"),
    ("R9 interleave without connector", SPEC_REPOS,
     TINY | dict(tp=2, dcp=2, engine={"block_size": 16, "cp_kv_cache_interleave_size": 32}),
     dict(), dict(pd="NixlConnector"), "R9", "pools[0].engine.cp_kv_cache_interleave_size"),
    ("R10 DSA block 32", MIX_REPOS, GLM | dict(engine={"cache_dtype": "fp8"}),
     dict(engine={"block_size": 32}), dict(engine={"block_size": 64}), "R10",
     "pools[0].engine.block_size"),
    ("R10 DSA on a100", MIX_REPOS,
     GLM | dict(engine={"cache_dtype": "fp8"}, sets=("spec-vectors", "spec-chips")),
     dict(hw="a100-sxm"), dict(hw="h200"), "R10", "cluster.hardware"),
    ("R10 DSA bf16 cache with dcp", MIX_REPOS, GLM | dict(dcp=2),
     dict(engine={"cache_dtype": "bfloat16"}), dict(engine={"cache_dtype": "fp8"}), "R10",
     "pools[0].engine.cache_dtype"),
    ("R11 nvfp4 on mla", SPEC_REPOS, DS, dict(engine={"cache_dtype": "nvfp4"}),
     dict(engine={"cache_dtype": "fp8"}), "R11", "pools[0].engine.cache_dtype"),
    ("R11 fp8_ds_mla on gqa", SPEC_REPOS, TINY | dict(tp=1),
     dict(engine={"cache_dtype": "fp8_ds_mla"}), dict(engine={"cache_dtype": "fp8"}), "R11",
     "pools[0].engine.cache_dtype"),
    ("R11 fp8_inc", SPEC_REPOS, TINY | dict(tp=1), dict(engine={"cache_dtype": "fp8_inc"}),
     dict(engine={"cache_dtype": "fp8"}), "R11", "pools[0].engine.cache_dtype"),
    ("R11 unknown cache dtype", SPEC_REPOS, TINY | dict(tp=1),
     dict(engine={"cache_dtype": "int3"}), dict(engine={"cache_dtype": "auto"}), "R11",
     "pools[0].engine.cache_dtype"),
    ("R11 mamba state dtype", SPEC_REPOS, TINY | dict(tp=1),
     dict(engine={"mamba_cache_dtype": "fp8"}), dict(engine={"mamba_cache_dtype": "bfloat16"}),
     "R11", "pools[0].engine.mamba_cache_dtype"),
    ("R12 EP wider than experts", MIX_REPOS,
     dict(model="mixtral-8x7b-v0.1", ep=True, nodes=2, fabric="ib-400g",
          sets=("spec-vectors", "spec-h200-16rank")),
     dict(tp=16), dict(tp=8), "R12", "pools[0].parallel"),
    ("R14 dcp_q_replicate on mla", SPEC_REPOS, DS | dict(dcp=2),
     dict(engine={"dcp_q_replicate": True}), dict(engine={"dcp_q_replicate": False}), "R14",
     "pools[0].engine.dcp_q_replicate"),
    ("R16 quantization", SPEC_REPOS, DS, dict(engine={"quantization": "foo"}),
     dict(engine={"quantization": "fp8"}), "R16", "pools[0].engine.quantization"),
    ("R16 cudagraph mode", SPEC_REPOS, DS, dict(engine={"cudagraph_mode": "SOMETIMES"}),
     dict(engine={"cudagraph_mode": "PIECEWISE"}), "R16", "pools[0].engine.cudagraph_mode"),
    ("R16 mamba cache mode", SPEC_REPOS,
     dict(model="nemotron-3.5-lightning-30b-a3b-nvfp4", tp=1),
     dict(engine={"mamba_cache_mode": "sometimes"}), dict(engine={"mamba_cache_mode": "all"}),
     "R16", "pools[0].engine.mamba_cache_mode"),
    ("R18 gb200 8-rank all-reduce", SPEC_REPOS,
     DS | dict(hw="gb200-nvl72", nodes=2, gpn=4, fabric="ib-400g", sets=("spec-chips",)),
     dict(tp=8), dict(tp=4), "R18", "collective_all_reduce"),
] + [
    (f"R15 {layout}", SPEC_REPOS, TINY | dict(tp=1), dict(engine={"cache_dtype": layout}),
     dict(engine={"cache_dtype": "fp8"}), "R15", "pools[0].engine.cache_dtype")
    for layout in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_3bit_nc", "int4_per_token_head", "int8_per_token_head",
                   "fp8_per_token_head")
]


@pytest.mark.parametrize("case", TWINS, ids=[t[0] for t in TWINS])
def test_refusal_beside_its_building_twin(case):
    """vectors.md §6 [C]: each refused case differs from a building twin in one setting. The
    refusal carries its code and names the offending setting; the twin builds."""
    name, repos, base, bad, good, code, field = case
    if repos is MIX_REPOS:
        shipped_model(merged(base, good).get("model", "deepseek-v3"))
    exc = refused(code, repos, field=field, **merged(base, bad))
    assert isinstance(exc, ValueError) and str(exc).startswith(f"[{code}]")
    k = build(repos, **merged(base, good))
    assert isinstance(k, jkernel.Kernel)


def test_r9_twin_honours_the_stated_interleave():
    """resolution.md §8.3: with NixlConnector a stated interleave is honoured as stated."""
    k = build(**TINY, tp=2, dcp=2, pd="NixlConnector",
              engine={"block_size": 16, "cp_kv_cache_interleave_size": 32})
    assert k.plan.interleave == 32
    assert k.resolution().overrides == ()


def test_r9_rules_of_d16():
    """D16: a stated interleave > 1 with an assumed block size and no NixlConnector is R9;
    a stated interleave of 1 is always accepted; a fitting interleave with a stated block
    builds; MultiConnector needs a stated interleave."""
    refused("R9", **TINY, tp=2, dcp=2, engine={"cp_kv_cache_interleave_size": 8},
            field="pools[0].engine.cp_kv_cache_interleave_size")
    assert build(**TINY, tp=2, dcp=2, engine={"cp_kv_cache_interleave_size": 1}
                 ).plan.interleave == 1
    assert build(**TINY, tp=2, dcp=2, engine={"block_size": 16,
                                              "cp_kv_cache_interleave_size": 8}
                 ).plan.interleave == 8
    refused("R9", **TINY, tp=2, dcp=2, pd="MultiConnector")
    refused("R9", **TINY, tp=2, dcp=2, pd="MultiConnector",
            engine={"block_size": 16, "cp_kv_cache_interleave_size": 32})


def test_r17_gemm_half_pair_and_twins():
    """vectors.md §6: `gemm_n_half_fp8` without `gemm_k_half_fp8` is R17; both, or neither,
    build (both switch on the shape-aware ramp)."""
    inputs = inputs_for(**DS)
    n_half = entry("gemm_n_half_fp8", 4096)
    k_half = entry("gemm_k_half_fp8", 2048)
    with pytest.raises(Refusal) as info:
        jkernel.new(edited(inputs, add=[n_half]))
    assert info.value.code == "R17" and info.value.field == "gemm_n_half_fp8"
    with pytest.raises(Refusal) as info:
        jkernel.new(edited(inputs, add=[k_half]))
    assert info.value.code == "R17" and info.value.field == "gemm_k_half_fp8"
    assert jkernel.new(edited(inputs, add=[n_half, k_half])).plan.shape_aware
    assert not jkernel.new(inputs).plan.shape_aware


@pytest.mark.parametrize("name", ["hbm_derate", "gemm_eps_max_fp8", "gemm_m_half_fp8",
                                  "engine_workspace_bytes", "cudagraph_capture_bytes_piecewise",
                                  "activation_scratch_floor_bytes",
                                  "collective_peak_rate_all_reduce_fp16_8rank_h200"])
def test_missing_required_coefficient(name):
    """resolution.md §5.2: a required name without an applicable entry is R17 naming it (a
    collective triple missing its peak makes the width unmeasured: R18)."""
    inputs = inputs_for(**DS, engine={"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(Refusal) as info:
        jkernel.new(edited(inputs, drop=lambda n: n == name))
    want = "R18" if name.startswith("collective") else "R17"
    assert info.value.code == want, str(info.value)
    if want == "R17":
        assert info.value.field == name and name in str(info.value)


def test_activation_count_and_communicator_are_required_at_their_widths():
    """memory.md §4.3/§4.5: the activation multiple is required at the snapped width and the
    communicator when a group is wider than 1: no declared width at all is R17."""
    inputs = inputs_for(**DS)
    for prefix in ("activation_buffer_count_moe_", "nccl_communicator_bytes_"):
        with pytest.raises(Refusal) as info:
            jkernel.new(edited(inputs, drop=lambda n: n.startswith(prefix)))
        assert info.value.code == "R17" and info.value.field.startswith(prefix)


def test_no_applicable_entry_is_r17():
    """resolution.md §5.1: if not a single entry applies across the listed sets, R17."""
    exc = refused("R17", **TINY, hw="b300", tp=1, field="coefficients")
    assert "b300" in str(exc)
    assert build(**TINY, hw="b300", tp=1, sets=("spec-vectors", "spec-chips")).plan.tp == 1


def test_non_positive_hbm_rate_is_r20():
    """R20: hbm_tbs·1e12·hbm_derate ≤ 0 (a not_charged derate of 0)."""
    inputs = inputs_for(**DS)
    with pytest.raises(Refusal) as info:
        jkernel.new(edited(inputs, values={"hbm_derate": 0.0}))
    assert info.value.code == "R20"


def test_single_gpu_needs_no_collective_coefficient():
    """D33: a group of one rank runs no collective, so a tp-1 deployment opens without any
    collective coefficient and resolves no collective key."""
    inputs = inputs_for(**TINY, tp=1)
    k = jkernel.new(edited(inputs, drop=lambda n: n.startswith("collective_")))
    assert k.plan.collective_keys == ()
    assert k.fixed_bytes().comm_buffers == 3_758_096_384   # workspace only, no communicator


# -- cluster and deployment consistency (resolution.md §3, R4) ---------------------------------

def _disagg(tp_prefill=2, tp_decode=4, pd=True):
    sc, dep = bundle(**TINY, nodes=2, fabric="ib-400g")
    dep["pools"] = [
        {"role": "prefill", "nodes": 1, "parallel": {"tp": tp_prefill, "pp": 1, "dp": 1},
         "engine": {"max_num_seqs": 64}},
        {"role": "decode", "nodes": 1, "parallel": {"tp": tp_decode, "pp": 1, "dp": 1}}]
    if pd:
        dep["pd_transfer"] = {"connector": "NixlConnector"}
    return sc, dep


@pytest.mark.parametrize("mutate, field", [
    (lambda sc, dep: dep["pools"][0].__setitem__("nodes", 2), "pools"),
    (lambda sc, dep: dep["pools"].__setitem__(1, dict(dep["pools"][1], role="colocated")),
     "pools"),
    (lambda sc, dep: dep["pools"].__setitem__(1, dict(dep["pools"][1], role="prefill")),
     "pools"),
    (lambda sc, dep: dep.pop("pd_transfer"), "pd_transfer"),
    (lambda sc, dep: sc["cluster"].pop("fabric"), "cluster.fabric"),
    (lambda sc, dep: sc["cluster"].__setitem__("gpus_per_rack", 12), "cluster.gpus_per_rack"),
    (lambda sc, dep: dep["pools"][0]["parallel"].update(dp=2, dp_local=3),
     "pools[0].parallel.dp_local"),
    (lambda sc, dep: dep["pools"][0]["parallel"].update(dp=3), "pools[0].parallel"),
    (lambda sc, dep: dep.__setitem__("offload", {"tiers": [{"tier": "tape", "bytes": 1}]}),
     "offload.tiers[0].tier"),
    (lambda sc, dep: (sc["cluster"].__setitem__("storage", ["nvme_gen4"]),
                      dep.__setitem__("offload", {"tiers": [{"tier": "cpu_dram",
                                                             "bytes": 1}]})),
     "offload.tiers[0].tier"),
])
def test_consistency_refusals_r4(mutate, field):
    """resolution.md §3 (R4): node sum, role pairing, pd_transfer, fabric for several nodes,
    gpus_per_rack, dp_local, engine size dividing the pool (D17), offload tiers. Each case is
    one change to a disaggregated bundle that builds (checked first)."""
    sc, dep = _disagg()
    assert jkernel.new(inputs_of(sc, dep)).plan.tp == 2
    mutate(sc, dep)
    with pytest.raises(Refusal) as info:
        jkernel.new(inputs_of(sc, dep))
    assert info.value.code == "R4", str(info.value)
    assert info.value.field == field


def test_offload_tier_drawn_from_cluster_storage_builds():
    """The twin of the last R4 case: a tier listed in cluster.storage builds, and needs the
    host link coefficient (recorded as needed, resolution.md §5.2)."""
    k = build(**TINY, tp=1, storage=["cpu_dram"],
              offload={"tiers": [{"tier": "cpu_dram", "bytes": 2 ** 34}]})
    assert k.assumption("host_link_bandwidth") is None   # present in spec-vectors


def test_missing_fabric_document_is_r2():
    exc = refused("R2", **TINY, tp=1, fabric="token-ring")
    assert exc.file.endswith("networks/token-ring.yaml")


def test_dcp_divisibility_r5():
    """resolution.md §3: with pcp ≤ 1, tp mod dcp = 0; with pcp > 1, dcp ∈ {1, pcp, tp·pcp}."""
    refused("R5", **DS, dcp=3, field="pools[0].parallel.dcp")
    refused("R5", **DS, tp=2, pcp=2, dcp=3, gpn=4, field="pools[0].parallel.dcp")
    assert build(**DS, tp=4, pcp=2, engine={"cache_dtype": "fp8"}).plan.pcp == 2


# -- engine defaults by chip (vectors.md §1.13) -----------------------------------------------

@pytest.mark.parametrize("chip, tokens, seqs", [
    ("b200", 16384, 1024), ("b300", 16384, 1024), ("gb200-nvl72", 16384, 1024),
    ("gb300", 16384, 1024), ("h100", 8192, 1024), ("h200", 8192, 1024),
    ("a100-80", 2048, 256), ("a100-sxm", 2048, 256), ("l40s", 2048, 256)])
def test_engine_defaults_by_chip(chip, tokens, seqs):
    """vectors.md §1.13 [C] / resolution.md §7: unstated scheduler limits take vLLM v0.31.0's
    default for the chip, recorded as assumptions whose scope starts with the value;
    pool() still reports them unstated (0)."""
    gpn = 4 if chip.startswith("gb") else 8
    k = build(**TINY, hw=chip, tp=1, gpn=gpn, sets=("spec-vectors", "spec-chips"))
    assert k.settings.max_num_batched_tokens == tokens
    assert k.settings.max_num_seqs == seqs
    assert scope_value(k, "max_num_batched_tokens") == str(tokens)
    assert scope_value(k, "max_num_seqs") == str(seqs)
    assert k.pool().engine.max_num_batched_tokens == 0
    assert k.pool().engine.max_num_seqs == 0


def test_stated_limits_record_no_assumption():
    k = build(**TINY, tp=1, engine={"max_num_batched_tokens": 4096, "max_num_seqs": 128})
    assert k.settings.max_num_batched_tokens == 4096 and k.settings.max_num_seqs == 128
    assert k.assumption("max_num_batched_tokens") is None
    assert k.assumption("max_num_seqs") is None


def test_engine_settings_are_a_frozen_record_of_what_the_engine_runs_with():
    """`Kernel.settings` holds every setting a scheduler sizes itself from, resolved: prefix
    caching, async scheduling and the whole-sequence admission check on unless stated off
    (vLLM v0.31.0), max_model_len the stated one, else the length vLLM derives from the
    model's config.json."""
    unstated = jkernel.open("llama-3.1-8b-a100-tp1")        # states no max_model_len
    s = unstated.settings
    assert isinstance(s, jkernel.EngineSettings)
    assert s.max_model_len == unstated.inputs.model_max_len == 131072
    assert (s.enable_prefix_caching, s.async_scheduling) == (True, True)
    assert s.scheduler_reserve_full_isl is True
    assert s.async_scheduling is unstated.resolution().async_scheduling
    assert (s.block_size, s.max_num_batched_tokens, s.max_num_seqs) == (16, 2048, 256)
    assert (s.engines, s.engine_gpus, s.decode_threshold) == (1, 1, 1)
    assert jkernel.open("llama-3.1-8b-h100-tp1").settings.max_model_len == 8192   # stated
    off = build(**TINY, tp=1, engine={"enable_prefix_caching": False,
                                      "async_scheduling": False,
                                      "scheduler_reserve_full_isl": False})
    assert (off.settings.enable_prefix_caching, off.settings.async_scheduling,
            off.settings.scheduler_reserve_full_isl) == (False, False, False)
    assert off.settings.max_model_len == 0            # no config.json, none stated: unknown
    d = s.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["max_model_len"] == 131072 and set(d) == {
        f.name for f in dataclasses.fields(jkernel.EngineSettings)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32


# -- capture ceilings (vectors.md §1.10) -------------------------------------------------------

@pytest.mark.parametrize("chip, engine, ceiling", [
    ("b200", {"max_num_seqs": 1024}, 1024),
    ("h200", {"max_num_seqs": 64}, 128),
    ("h200", {"max_num_seqs": 1024}, 512),
    ("h200", {"max_num_seqs": 256}, 512),
    ("h200", {"max_num_seqs": 64, "speculative": {"method": "ngram", "num_spec_tokens": 3}},
     512),
    ("h200", {"max_num_seqs": 16, "speculative": {"method": "ngram", "num_spec_tokens": 3}},
     128),
    ("h200", {"cudagraph_mode": "NONE"}, 0),
])
def test_capture_ceiling(chip, engine, ceiling):
    """vectors.md §1.10 [C]: min(max_num_seqs·(1+num_spec)·2, 1024 on Blackwell else 512);
    0 when both modes are eager. The ceiling is recorded as `max_cudagraph_capture_size`
    whenever the mode is not NONE (resolution.md §7)."""
    k = build(**TINY, hw=chip, tp=1, engine=engine)
    assert k.plan.capture_ceiling == ceiling
    if ceiling:
        assert scope_value(k, "max_cudagraph_capture_size") == str(ceiling)
    else:
        assert k.assumption("max_cudagraph_capture_size") is None


@pytest.mark.parametrize("mode, decode, other", [
    ("PIECEWISE", "PIECEWISE", "PIECEWISE"), ("FULL", "FULL", "FULL"),
    ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE"), ("FULL_DECODE_ONLY", "FULL", "EAGER"),
    ("NONE", "EAGER", "EAGER"), (None, "FULL", "PIECEWISE")])
def test_graph_mode_pairs(mode, decode, other):
    """resolution.md §11: each cudagraph_mode maps to a (decode-step, other-step) pair; an
    unstated mode is FULL_AND_PIECEWISE, recorded as an assumption."""
    k = build(**TINY, tp=1, engine={"cudagraph_mode": mode} if mode else None)
    assert (k.plan.decode_mode.name, k.plan.other_mode.name) == (decode, other)
    if mode is None:
        assert scope_value(k, "cudagraph_mode") == "FULL_AND_PIECEWISE"
    else:
        assert k.assumption("cudagraph_mode") is None


# -- width snapping (vectors.md §1.12) ---------------------------------------------------------

def _measured(widths, op="all_reduce", chip="h200") -> dict:
    return {f"collective_{p}_{op}_fp16_{n}rank_{chip}": None
            for n in widths for p in ("floor", "peak_rate", "transition_rate")}


@pytest.mark.parametrize("g, width", [(1, 2), (2, 2), (8, 8), (32, 8)])
def test_collective_snap_pins(g, width):
    """vectors.md §1.12 [C]: measured {2, 4, 8}: G ≤ min → min, G measured → G, G > 16 → max."""
    assert _snap_collective("all_reduce", g, "h200", _measured((2, 4, 8))) == width


@pytest.mark.parametrize("g", [3, 6, 16])
def test_collective_snap_refuses_unmeasured_inner_width(g):
    """vectors.md §1.12 [C]: 3, 6 or 16 with measured {2, 4, 8} is R18 (16 is inside the
    searched widths but not measured); {2, 4} at G = 8 is R18 (GB200)."""
    with pytest.raises(Refusal) as info:
        _snap_collective("all_reduce", g, "h200", _measured((2, 4, 8)))
    assert info.value.code == "R18"
    with pytest.raises(Refusal) as info:
        _snap_collective("all_reduce", 8, "gb200_nvl72", _measured((2, 4), chip="gb200_nvl72"))
    assert info.value.code == "R18"


def test_collective_snap_needs_all_three_of_a_triple():
    """resolution.md §5.3: a width is measured only if floor, peak and transition resolve;
    none at all is R18."""
    partial = _measured((2, 4, 8))
    del partial["collective_transition_rate_all_reduce_fp16_8rank_h200"]
    assert _snap_collective("all_reduce", 32, "h200", partial) == 4
    with pytest.raises(Refusal) as info:
        _snap_collective("all_gather", 2, "h200", _measured((2, 4, 8)))
    assert info.value.code == "R18"


@pytest.mark.parametrize("w, snapped", [(1, 2), (3, 2), (6, 4), (8, 8), (16, 8)])
def test_memory_snap_pins(w, snapped):
    """vectors.md §1.12 [C]: memory families with declared widths {2, 4, 8}."""
    assert _snap_memory([2, 4, 8], w) == snapped
    assert _snap_memory([], w) == w            # none declared: w itself (then R17)


def _all_reduce_key(k):
    return next(c for c in k.plan.collective_keys if c.op == "all_reduce" and c.group == "TP")


def test_collective_snap_through_construction():
    """vectors.md §1.12 through open(): on h200 (measured {2, 4, 8}) tp 8 prices the 8-rank
    sweep; tp 32 (> 16) the widest, 8; tp 16 is R18 until a 16-rank sweep is listed; tp 3 and
    tp 6 (they divide tiny-llm-48h's 48 heads) are R18."""
    assert _all_reduce_key(build(**DS)).width == 8
    k32 = build(**DS, tp=32, nodes=4, fabric="ib-400g")
    assert _all_reduce_key(k32).width == 8
    assert _all_reduce_key(k32).floor == "collective_floor_all_reduce_fp16_8rank_h200"
    refused("R18", **DS, tp=16, nodes=2, fabric="ib-400g", field="collective_all_reduce")
    k16 = build(**DS, tp=16, nodes=2, fabric="ib-400g",
                sets=("spec-vectors", "spec-h200-16rank"))
    assert _all_reduce_key(k16).width == 16
    for tp in (3, 6):
        refused("R18", model="tiny-llm-48h", tp=tp, gpn=tp, field="collective_all_reduce")


def test_collective_snap_up_to_narrowest_measured():
    """A 3-rank group on a chip measured only at {4, 8} (l40s fixture) prices the 4-rank
    sweep (G ≤ min(measured))."""
    k = build(model="tiny-llm-48h", hw="l40s", tp=3, gpn=3, sets=("spec-chips",))
    assert _all_reduce_key(k).width == 4


def test_memory_snap_through_construction():
    """memory.md §4.5 and resolution.md §5.4: the communicator width is snapped from tp (even
    when the wider group is the expert group); with tp = 1 and no 1-rank entry the narrowest
    declared width is used; tp 16 snaps to 8. Distinct values make the choice visible."""
    values = {"nccl_communicator_bytes_2rank": 2e8, "nccl_communicator_bytes_4rank": 4e8,
              "nccl_communicator_bytes_8rank": 8e8, "engine_workspace_bytes": 1e9}
    cases = [(dict(tp=1, dp=2, ep=True), 2e8),       # moe_group 2, tp 1 → narrowest (2)
             (dict(tp=4), 4e8), (dict(tp=8), 8e8),
             (dict(tp=16, nodes=2, fabric="ib-400g",
                   sets=("spec-vectors", "spec-h200-16rank")), 8e8)]
    for kw, comm in cases:
        inputs = inputs_for(**DS | kw)
        k = jkernel.new(edited(inputs, values=values))
        assert k.fixed_bytes().comm_buffers == int(1e9 + comm), kw
    # no group wider than one rank: no communicator (memory.md §4.5)
    inputs = inputs_for(**DS, tp=1)
    assert jkernel.new(edited(inputs, values=values)).fixed_bytes().comm_buffers == int(1e9)


def test_activation_family_snap_through_construction():
    """memory.md §4.3: N = snap(min(tp, 8)) over the family's declared widths. With the
    1-rank MoE multiple removed, tp 1 uses the 2-rank multiple."""
    inputs = inputs_for(**DS, tp=1, engine={"max_num_batched_tokens": 8192})
    values = {f"activation_buffer_count_moe_{n}rank": n * 10 for n in (1, 2, 4, 8)}
    k = jkernel.new(edited(inputs, values=values))
    assert k.fixed_bytes().activation_peak == 10 * 8192 * 7168 * 2
    k = jkernel.new(edited(inputs, values=values,
                           drop=lambda n: n == "activation_buffer_count_moe_1rank"))
    assert k.fixed_bytes().activation_peak == 20 * 8192 * 7168 * 2


# -- the vectors.md §4.1 scenario: assumptions, provenance, evidence ------------------------------

def test_section_4_1_kernel_assumptions_and_values():
    """vectors.md §4.1 [R]: the kernel's own assumptions are engine_version (0.29.0 declared →
    0.31.0) and max_cudagraph_capture_size (512), with those values at the start of the
    scope. Beyond them jkernel records only its decisions: gpu_memory_utilization 0.92 (D15),
    expected.md's kernel_gap / host_serial / host_serial_per_request / compute_derate
    defaults, the API server's work at 0 (the replay's queue on it off), and the shape
    constants of expected_s's decode-attention and fused-MoE laws at their neutral values
    (step.md's laws: the fixture registry has none); every other
    jkernel entry is a needed optional coefficient the fixture registry lacks, recorded as
    `absent`."""
    k = spec_kernel()
    assert scope_value(k, "engine_version") == "0.31.0"
    assert "0.29.0" in k.assumption("engine_version")
    assert scope_value(k, "max_cudagraph_capture_size") == "512"
    assert scope_value(k, "gpu_memory_utilization") == "0.92"
    own = {p.name: p.scope for p in k.provenance() if p.set == jkernel.KERNEL_ASSUMPTION_SET}
    decided = {n for n, s in own.items() if not s.startswith("absent")}
    assert decided == {"engine_version", "max_cudagraph_capture_size",
                       "gpu_memory_utilization", "kernel_gap", "host_serial",
                       "host_serial_per_request", "compute_derate",
                       "host_api_server_per_request", "host_api_server_per_token",
                       "attention_decode_row_floor", "attention_decode_overlap",
                       "moe_kernel_floor_fp8", "moe_m_half", "moe_assignment_time"}
    for name in ("attention_decode_row_floor", "moe_kernel_floor_fp8", "moe_m_half",
                 "moe_assignment_time", "host_api_server_per_request",
                 "host_api_server_per_token"):
        assert scope_value(k, name) == "0.0"
    absent = {n for n, s in own.items() if s.startswith("absent")}
    assert absent == {"host_admission_per_request", "attention_decode_floor_mla",
                      "attention_decode_rate_mla"}
    # stated settings record nothing
    for name in ("block_size", "cudagraph_mode", "max_num_batched_tokens", "max_num_seqs"):
        assert k.assumption(name) is None


def test_provenance_order_and_rendering():
    """resolution.md §12.1 and D28: registry entries sorted by name, then the kernel
    assumptions (set `jkernel`, method `assumed`) sorted by name. Every applicable name is
    listed whether or not the deployment uses it; scopes render as `hardware: …`."""
    prov = spec_kernel().provenance()
    names = [p.name for p in prov]
    n_reg = sum(1 for p in prov if p.set != "jkernel")
    registry, own = prov[:n_reg], prov[n_reg:]
    assert all(p.set == "spec-vectors" for p in registry)
    assert all(p.set == "jkernel" and p.method == "assumed" for p in own)
    assert [p.name for p in registry] == sorted(p.name for p in registry)
    assert [p.name for p in own] == sorted(p.name for p in own)
    assert len(set(names)) == len(names)
    by = {p.name: p for p in registry}
    assert by["gemm_eps_max_fp8"].scope == "hardware: h200, b200"
    assert by["gemm_eps_max_fp8"].method == "measured"
    assert by["hbm_derate"].method == "vendor_spec"
    assert by["collective_floor_all_reduce_fp16_2rank_h200"].scope == "hardware: h200"
    assert "gemm_eps_max_nvfp4" in by                  # applicable, unused by fp8
    assert "collective_floor_all_reduce_fp16_2rank_b200" not in by   # not applicable


def test_evidence_counts():
    """resolution.md §12.2: evidenced = entries with method measured/literature/vendor_spec;
    total = len(provenance()); assumed names in provenance order. not_charged counts only in
    total. Checked against an independent reading of the fixture set."""
    k = spec_kernel()
    doc = yaml.safe_load((SPEC / "coefficients" / "spec-vectors.yaml").read_text())
    methods = {}
    for item in doc["coefficients"]:
        (name, body), = item.items()
        if "h200" in body["scope"].get("hardware", []):
            methods[name] = body["method"]
    own = [p.name for p in k.provenance() if p.set == "jkernel"]
    evidenced, total, assumed = k.evidence()
    assert evidenced == sum(m in ("measured", "literature", "vendor_spec")
                            for m in methods.values())
    assert total == len(methods) + len(own) == len(k.provenance())
    assert assumed == [p.name for p in k.provenance() if p.method == "assumed"]
    assert set(assumed) == {n for n, m in methods.items() if m == "assumed"} | set(own)
    assert "cudagraph_capture_bytes_none" not in assumed          # not_charged
    assert methods["cudagraph_capture_bytes_none"] == "not_charged"


def test_selection_later_set_wins_and_scope_rendering():
    """documents.md §8.3–§8.4: the last applicable entry wins (a later set over an earlier
    one); hardware matches case-insensitively; a model scope renders `model: …` and a scope
    without hardware or model renders `unscoped`."""
    inputs = inputs_for(**DS)
    k = jkernel.new(edited(inputs, add=[
        entry("hbm_derate", 0.5, method="assumed", hardware=["H200"]),
        entry("moe_routing_imbalance_median", 1.2, model=["DeepSeek-V3"]),
        entry("host_output_token", 50.0, method="assumed", tp=[8]),
        entry("host_completion", 1.0, method="assumed", tp=[4]),        # does not apply
    ]))
    by = {p.name: p for p in k.provenance()}
    assert (by["hbm_derate"].set, by["hbm_derate"].method) == ("test-extra", "assumed")
    assert k.params.value("hbm_derate") == 0.5
    assert by["moe_routing_imbalance_median"].scope == "model: DeepSeek-V3"
    assert by["host_output_token"].scope == "unscoped"
    assert by["host_completion"].set == "spec-vectors"
    assert k.output_token_overhead() == pytest.approx(50e-6, rel=1e-12)


@pytest.mark.parametrize("kw, name, value", [
    (dict(**TINY, tp=1), "block_size", "16"),
    (dict(**TINY, tp=1), "cudagraph_mode", "FULL_AND_PIECEWISE"),
    (dict(**TINY, tp=1), "gpu_memory_utilization", "0.92"),
    (dict(**TINY, tp=1, version="0.29.0"), "engine_version", "0.31.0"),
    (dict(**TINY, tp=1, version="0.8.0"), "engine_version", "0.31.0"),
    (dict(**DS, dcp=2), "dcp_comm_backend", "ag_rs"),
    (dict(**DS, dcp=2), "mla_context_chunk", "65536"),
    (dict(model="nemotron-3.5-lightning-30b-a3b-nvfp4", tp=1), "mamba_cache_mode", "align"),
    (dict(model="nemotron-3.5-lightning-30b-a3b-nvfp4", tp=1,
          engine={"enable_prefix_caching": False}), "mamba_cache_mode", "none"),
    (dict(**TINY, tp=1), "host_admission_per_request", "absent"),
])
def test_assumption_records_value_first(kw, name, value):
    """resolution.md §7: an unstated setting prices vLLM v0.31.0's default and records an
    assumption (set jkernel, method assumed) whose scope starts with the value used; a
    declared engine version within the covered range (0.8.0 through 0.31.x) is priced as
    v0.31.0 behaviour and recorded (versions outside it are refused: see below)."""
    k = build(**kw)
    assert scope_value(k, name) == value
    origin = next(p for p in k.provenance() if p.name == name)
    assert (origin.set, origin.method) == ("jkernel", "assumed")


def test_dsa_block_default_and_stated_settings_record_nothing():
    """resolution.md §9/§11: a DSA model's unstated block is 64, recorded; a stated one and a
    0.31.0 engine version record nothing."""
    shipped_model("glm-5")
    k = build(MIX_REPOS, **GLM, engine={"cache_dtype": "fp8"})
    assert k.plan.block_size == 64 and scope_value(k, "block_size") == "64"
    k = build(MIX_REPOS, **GLM, engine={"cache_dtype": "fp8", "block_size": 128,
                                        "gpu_memory_utilization": 0.9})
    for name in ("block_size", "engine_version", "gpu_memory_utilization"):
        assert k.assumption(name) is None


def test_mla_context_chunk_from_stated_max_model_len():
    """resolution.md §8.4: with max_model_len stated no assumption is recorded and the chunk is
    min(max(8·len, 4·seqs·block), 65536) aligned to lcm(block, dcp·I)."""
    k = build(**DS, dcp=2, engine={"max_model_len": 4096, "max_num_seqs": 256,
                                   "block_size": 16})
    assert k.plan.mla_chunk == 32768 and k.assumption("mla_context_chunk") is None


# -- overrides (resolution.md §4.4, §9, §10, §8.3) -------------------------------------------

def test_custom_all_reduce_declined_at_tp_3():
    """§4.4: custom all-reduce is requested by default and declined at a width outside
    {2, 4, 6, 8, 16}: override (allreduce_backend, custom → nccl). tp 3 divides
    tiny-llm-48h's heads and snaps to l40s' 4-rank sweeps; tp 4 keeps custom."""
    k = build(model="tiny-llm-48h", hw="l40s", tp=3, gpn=3, sets=("spec-chips",))
    (o,) = k.resolution().overrides
    assert (o.field, o.requested, o.resolved) == ("allreduce_backend", "custom", "nccl")
    assert "3" in o.reason
    assert k.resolution().all_reduce_backend == "nccl"
    twin = build(model="tiny-llm-48h", hw="l40s", tp=4, gpn=4, sets=("spec-chips",))
    assert twin.resolution().all_reduce_backend == "custom"
    assert twin.resolution().overrides == ()


def test_custom_all_reduce_declined_across_nodes_not_inside_a_rack():
    """§4.4: tp wider than a node without a rack NVLink domain declines custom; on GB200 NVL72
    (rack domain) a tp-8 group across two 4-GPU trays keeps it, spans one node-equivalent for
    scope and does not cross (D9)."""
    k = build(**DS, tp=16, nodes=2, fabric="ib-400g",
              sets=("spec-vectors", "spec-h200-16rank"))
    (o,) = k.resolution().overrides
    assert (o.field, o.requested, o.resolved) == ("allreduce_backend", "custom", "nccl")
    assert "node" in o.reason
    assert k.settings.nodes_spanned == 2
    assert next(g for g in k.plan.groups if g.name == "TP").crosses
    rack = build(**DS, hw="gb200-nvl72", tp=8, nodes=2, gpn=4, fabric="ib-400g",
                 sets=("spec-chips", "spec-gb200-ar8"))
    assert rack.resolution().all_reduce_backend == "custom" and rack.resolution().overrides == ()
    assert rack.settings.nodes_spanned == 1
    assert not next(g for g in rack.plan.groups if g.name == "TP").crosses


@pytest.mark.parametrize("engine, backend", [
    ({}, "custom"), ({"allreduce_backend": "nccl"}, "nccl"),
    ({"disable_custom_all_reduce": True}, "nccl"), ({"allreduce_backend": "custom"}, "custom")])
def test_all_reduce_backend_request(engine, backend):
    """§4.4: requested unless disabled or nccl; at tp = 1 the width check is skipped and the
    requested backend is reported without an override (D10)."""
    for tp in (1, 8):
        k = build(**DS, tp=tp, engine=engine)
        assert k.resolution().all_reduce_backend == backend
        assert k.resolution().overrides == ()


def test_dsa_fp8_cache_repacks_with_override():
    """§9: a DSA model's stated fp8 cache resolves to the packed fp8_ds_mla layout (656 B per
    token per layer) with an override on cache_dtype; a stated fp8_ds_mla records none."""
    shipped_model("glm-5")
    k = build(MIX_REPOS, **GLM, engine={"cache_dtype": "fp8"})
    (o,) = k.resolution().overrides
    assert (o.field, o.requested, o.resolved) == ("cache_dtype", "fp8", "fp8_ds_mla")
    assert k.kv_bytes_per_token() == 656 * k.plan.kv_layers
    k2 = build(MIX_REPOS, **GLM, engine={"cache_dtype": "fp8_ds_mla"})
    assert k2.resolution().overrides == ()
    assert k2.kv_bytes_per_token() == k.kv_bytes_per_token()


@pytest.mark.parametrize("engine, mode, override, assumed", [
    ({"mamba_cache_mode": "none"}, "align", True, False),
    ({"mamba_cache_mode": "none", "enable_prefix_caching": False}, "none", False, False),
    ({"mamba_cache_mode": "all"}, "all", False, False),
    ({"mamba_cache_mode": "align", "enable_prefix_caching": False}, "align", False, False),
    ({}, "align", False, True),
    ({"enable_prefix_caching": False}, "none", False, True),
])
def test_mamba_cache_mode_resolution(engine, mode, override, assumed):
    """§10: `none` with prefix caching on resolves to `align` with an override; unstated
    takes the default for the prefix-caching setting, recorded as an assumption."""
    k = build(model="nemotron-3.5-lightning-30b-a3b-nvfp4", tp=1, engine=engine)
    assert k.settings.mamba_cache_mode == mode
    overrides = k.resolution().overrides
    if override:
        (o,) = overrides
        assert (o.field, o.requested, o.resolved) == ("mamba_cache_mode", "none", "align")
    else:
        assert overrides == ()
    assert (k.assumption("mamba_cache_mode") is not None) == assumed


def test_mamba_mode_ignored_without_recurrent_layers():
    """§10: on a model without RecurrentUpdate the stated mode is ignored, nothing recorded."""
    k = build(**TINY, tp=1, engine={"mamba_cache_mode": "none"})
    assert k.resolution().overrides == () and k.assumption("mamba_cache_mode") is None


def test_nixl_unstated_interleave_is_the_block_with_override():
    """§8.3: unstated interleave with NixlConnector and block > 1 becomes the block, with an
    override (requested 0, resolved B)."""
    k = build(**TINY, tp=2, dcp=2, pd="NixlConnector", engine={"block_size": 16})
    (o,) = k.resolution().overrides
    assert (o.field, o.requested, o.resolved) == ("cp_kv_cache_interleave_size", 0, 16)
    assert k.plan.interleave == 16


def test_resolution_record():
    """§12.3: widths (each ≥ 1), EP width tp·pcp·dp with EP on (D8) else 1, async default
    true, cascade attention only when disable_cascade_attn is stated false."""
    r = build(**DS, tp=4, dp=2, ep=True).resolution()
    assert (r.tensor_parallel(), r.data_parallel(), r.expert_parallel()) == (4, 2, 8)
    assert r.async_scheduling is True and r.cascade_attention is False
    r = build(**DS, engine={"async_scheduling": False, "disable_cascade_attn": False}).resolution()
    assert r.async_scheduling is False and r.cascade_attention is True
    assert build(**DS, tp=4, dp=2).resolution().expert_parallel() == 1
    k = build(**DS, dcp=2)
    assert (k.decode_context_parallel_width(), k.prefill_context_parallel_width()) == (2, 1)


# -- entry points and pools (resolution.md §1) ---------------------------------------------

def test_open_refuses_a_disaggregated_bundle_naming_open_pool():
    """§1 Decision: `open` on more than one pool is refused, naming the roles and open_pool."""
    with pytest.raises(Refusal) as info:
        jkernel.open(_disagg(), SPEC_REPOS)
    msg = str(info.value)
    assert "open_pool" in msg and "prefill" in msg and "decode" in msg


def test_open_pool_by_role_and_index():
    sc_dep = _disagg(tp_prefill=2, tp_decode=4)
    pre = jkernel.open_pool(sc_dep, "prefill", SPEC_REPOS)
    dec = jkernel.open_pool(sc_dep, "decode", SPEC_REPOS)
    assert (pre.plan.tp, dec.plan.tp) == (2, 4)
    assert pre.pool().role == "prefill" and dec.pool().role == "decode"
    assert pre.settings.max_num_seqs == 64
    assert jkernel.open_pool(sc_dep, 1, SPEC_REPOS).plan.tp == 4
    assert jkernel.open_pool(sc_dep, "0", SPEC_REPOS).plan.tp == 2
    assert jkernel.open_inputs(sc_dep, SPEC_REPOS, "decode").pool_index == 1


@pytest.mark.parametrize("pool", [2, -1, "colocated", "router"])
def test_missing_pool_is_r3(pool):
    with pytest.raises(Refusal) as info:
        jkernel.open_pool(_disagg(), pool, SPEC_REPOS)
    assert info.value.code == "R3"


def test_new_without_a_required_document_is_r3():
    inputs = inputs_for(**TINY, tp=1)
    for name in ("model", "chip", "scenario", "deployment"):
        with pytest.raises(Refusal) as info:
            jkernel.new(dataclasses.replace(inputs, **{name: None}))
        assert info.value.code == "R3" and name in str(info.value)
    with pytest.raises(Refusal) as info:
        jkernel.new(dataclasses.replace(inputs, pool_index=1))
    assert info.value.code == "R3"


def test_bundle_forms_agree(tmp_path):
    """D18: a bundle may be a path (relative paths join repos.scenarios), YAML text, or a pair
    of mappings; all three build the same kernel."""
    sc, dep = bundle(**TINY, tp=1)
    text = yaml.safe_dump_all([sc, dep])
    (tmp_path / "b.yaml").write_text(text)
    repos = jkernel.Repos(catalog=SPEC, registry=SPEC, scenarios=tmp_path)
    ks = [jkernel.open("b.yaml", repos), jkernel.open(tmp_path / "b.yaml", SPEC_REPOS),
          jkernel.open(text, SPEC_REPOS), jkernel.open((sc, dep), SPEC_REPOS)]
    assert len({k.fixed_bytes() for k in ks}) == 1
    assert len({tuple(k.provenance()) for k in ks}) == 1


def test_kernel_does_not_change_when_inputs_are_mutated():
    """§1: `new` deep-copies everything it keeps. Mutating the Inputs afterwards (the storage
    dict, the chip, the coefficient sets) changes nothing the kernel reports."""
    inputs = jkernel.open_inputs(bundle(**DS), SPEC_REPOS)     # its own copy: mutated below
    k = jkernel.new(inputs)
    before = (k.fixed_bytes(), k.kv_cache_pages(), k.tier_time("cpu_dram", "from_tier", 2 ** 30),
              tuple(k.provenance()), k.inputs.chip, k.pool())
    assert k.inputs is not inputs
    inputs.devices["cpu_dram"] = StorageClass("cpu_dram", 1.0, 1.0, 1e6)
    del inputs.devices["nvme_gen4"]
    object.__setattr__(inputs, "chip", dataclasses.replace(inputs.chip, memory_gib=1.0))
    object.__setattr__(inputs, "coefficient_sets", ())
    object.__setattr__(inputs, "pool_index", 7)
    after = (k.fixed_bytes(), k.kv_cache_pages(), k.tier_time("cpu_dram", "from_tier", 2 ** 30),
             tuple(k.provenance()), k.inputs.chip, k.pool())
    assert after == before
    assert k.tier_time("nvme_gen4", "to_tier", 1e9) == pytest.approx(0.2, rel=1e-12)


def test_refused_construction_leaves_no_state():
    """Nothing half-built: a refused `new` does not touch its Inputs, and a kernel built after
    it is identical to one built before it."""
    good = inputs_for(**DS)
    before = jkernel.new(good)
    bad = inputs_for(**DS, engine={"cache_dtype": "nvfp4"})
    snapshot = copy.deepcopy(bad)
    with pytest.raises(Refusal):
        jkernel.new(bad)
    assert bad == snapshot
    with pytest.raises(Refusal):
        jkernel.new(edited(good, add=[entry("gemm_n_half_fp8", 1.0)]))
    after = jkernel.new(good)
    assert after.fixed_bytes() == before.fixed_bytes()
    assert after.provenance() == before.provenance()
    assert after.resolution() == before.resolution()
    assert after.plan == before.plan


def test_deployment_returns_the_pool_as_stated():
    """§12.4: `pool()` is the request, not the resolution: unstated settings stay 0, ""
    or None."""
    e = build(**TINY, tp=1).pool().engine
    assert (e.block_size, e.cudagraph_mode, e.async_scheduling, e.gpu_memory_utilization) == \
        (0, "", None, 0.0)


# -- settings vLLM refuses (each was priced before; each refusal says why vLLM stops) --------

def _with_kv_heads(inputs: Inputs, n_kv: int) -> Inputs:
    """The inputs with every primary attention's KV heads set to ``n_kv`` (a derived model)."""
    kinds = tuple(dataclasses.replace(lk, nodes=tuple(
        dataclasses.replace(n, n_kv=n_kv) if n.op == "Attention" and not n.role else n
        for n in lk.nodes)) for lk in inputs.model.layer_kinds)
    return dataclasses.replace(inputs, model=dataclasses.replace(inputs.model,
                                                                 layer_kinds=kinds))


def test_token_budget_below_max_num_seqs_is_refused():
    """vLLM's SchedulerConfig stops when max_num_batched_tokens < max_num_seqs (it priced)."""
    exc = refused("R1", field="pools[0].engine.max_num_batched_tokens", **TINY,
                  tp=1, engine={"max_num_batched_tokens": 128, "max_num_seqs": 256})
    assert "max_num_seqs (256)" in exc.reason and "vLLM does not start" in exc.reason
    build(**TINY, tp=1, engine={"max_num_batched_tokens": 256, "max_num_seqs": 256})


def test_unstated_max_num_seqs_is_capped_at_a_small_token_budget():
    """vLLM caps its default max_num_seqs at max_num_batched_tokens, so it starts."""
    k = build(**TINY, tp=1, engine={"max_num_batched_tokens": 64})
    assert k.settings.max_num_seqs == 64
    assert "capped at max_num_batched_tokens 64" in k.assumption("max_num_seqs")


def test_stated_max_num_seqs_above_the_default_token_budget_is_refused():
    """The rule holds for the values vLLM runs with: 2048 default tokens (A100) < 4096."""
    exc = refused("R1", field="pools[0].engine.max_num_seqs", **TINY, tp=1, hw="a100-sxm",
                  sets=("spec-vectors", "spec-chips"), engine={"max_num_seqs": 4096})
    assert "max_num_batched_tokens (2048)" in exc.reason


def test_block_larger_than_token_budget_in_mamba_align_mode_is_refused():
    """vLLM stops in Mamba cache align mode when one block exceeds a step's token budget."""
    hybrid = dict(model="nemotron-3.5-lightning-30b-a3b-nvfp4", tp=1)
    engine = {"mamba_cache_mode": "align", "block_size": 256, "max_num_seqs": 64}
    exc = refused("R1", field="pools[0].engine.max_num_batched_tokens", **hybrid,
                  engine=engine | {"max_num_batched_tokens": 128})
    assert "align mode" in exc.reason
    build(**hybrid, engine=engine | {"max_num_batched_tokens": 256})


def test_token_budget_below_one_block_outside_align_mode_still_builds():
    """Outside align mode vLLM chunks prompts, so a budget below one block runs."""
    k = build(**TINY, tp=1, engine={"block_size": 256, "max_num_batched_tokens": 128,
                                    "max_num_seqs": 128})
    assert k.settings.block_size == 256


@pytest.mark.parametrize("block", [7, 12, 512])
def test_block_size_vllm_does_not_accept_is_refused(block):
    exc = refused("R1", field="deployment.pools[0].engine.block_size", **TINY, tp=1,
                  engine={"block_size": block})
    assert "1, 8, 16, 32, 64, 128, 256" in exc.reason


@pytest.mark.parametrize("util", [0, 0.0, -0.1, 1.5])
def test_gpu_memory_utilization_outside_zero_one_is_refused(util):
    """A stated 0 was read as "unstated" and defaulted to 0.92; vLLM refuses it."""
    exc = refused("R1", field="deployment.pools[0].engine.gpu_memory_utilization", **TINY,
                  tp=1, engine={"gpu_memory_utilization": util})
    assert "(0, 1]" in exc.reason


def test_kv_heads_that_do_not_group_the_query_heads_are_refused():
    """A derived model with 5 KV heads for 16 query heads priced; vLLM's attention stops."""
    inputs = _with_kv_heads(inputs_for(**TINY, tp=1), 5)
    with pytest.raises(Refusal) as info:
        jkernel.new(inputs)
    assert info.value.code == "R5" and "5 KV heads" in info.value.reason
    jkernel.new(_with_kv_heads(inputs_for(**TINY, tp=1), 4))


def test_tp_that_neither_shards_nor_replicates_kv_heads_is_refused():
    """tp 6 over 8 KV heads (48 query heads) priced; vLLM can neither shard (8 % 6) nor
    replicate (6 % 8) them."""
    wide = dict(model="tiny-llm-48h", tp=6, gpn=6)
    with pytest.raises(Refusal) as info:
        jkernel.new(_with_kv_heads(inputs_for(**wide), 8))
    assert info.value.code == "R5" and info.value.field == "pools[0].parallel.tp"
    assert "8 KV heads" in info.value.reason
    for n_kv in (12, 3):                        # 12 shard over 6; 3 replicate over 6
        try:
            jkernel.new(_with_kv_heads(inputs_for(**wide), n_kv))
        except Refusal as exc:                  # the fixture measures no 6-rank collective
            assert exc.code != "R5", str(exc)


@pytest.mark.parametrize("version", ["0.7.3", "1.0.0", "0.32.0", "latest", "0"])
def test_engine_version_outside_the_rules_is_refused(version):
    exc = refused("R1", field="scenario.engine_version", **TINY, tp=1, version=version)
    assert "0.8.0 through 0.31.x" in exc.reason


@pytest.mark.parametrize("version", ["0.8.0", "0.10.1.1", "0.23.0", "0.29.0", "0.31.2"])
def test_engine_versions_the_rules_cover_build(version):
    k = build(**TINY, tp=1, version=version)
    if version != "0.31.0":
        assert version in k.assumption("engine_version")


def _write_bundle(tmp_path, sc, dep) -> Path:
    path = tmp_path / "bundle.yaml"
    path.write_text(yaml.safe_dump_all([sc, dep], sort_keys=False))
    return path


@pytest.mark.parametrize("change, code", [
    (dict(nodes=2, gpn=8), "R4"),                    # no fabric for two nodes
    (dict(tp=3, gpn=3), "R5"),                       # 3 does not divide the heads
    (dict(engine={"cudagraph_mode": "SOMETIMES"}), "R16"),
])
def test_bundle_refusals_name_the_file(tmp_path, change, code):
    """R4, R5 and R16 named the field but not the file the setting was read from."""
    path = _write_bundle(tmp_path, *bundle(**(TINY | dict(tp=1) | change)))
    with pytest.raises(Refusal) as info:
        jkernel.new(jkernel.open_inputs(path, SPEC_REPOS))
    assert info.value.code == code
    assert info.value.file == str(path) and str(path) in str(info.value)


def test_refusal_messages_cite_no_spec_decision(tmp_path):
    """R4's engine-size refusal cited "(D17)", which a user cannot look up."""
    exc = refused("R4", **TINY, tp=3, nodes=1, gpn=8)
    assert "D17" not in str(exc) and ".md" not in str(exc)
    assert "whole engines" in exc.reason


def test_max_model_len_beyond_the_model_positions_is_refused(tmp_path, monkeypatch):
    """qwen3-32b derives 40,960 positions from its config.json; 1,000,000 priced before."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    name = "qwen3-32b-l40s-tp4"
    sc, dep = yaml.safe_load_all((SHIPPED / "scenarios" / f"{name}.yaml").read_text())
    dep["pools"][0]["engine"]["max_model_len"] = 1_000_000
    path = _write_bundle(tmp_path, sc, dep)
    with pytest.raises(Refusal) as info:
        jkernel.new(jkernel.open_inputs(path))
    exc = info.value
    assert exc.code == "R1" and exc.field == "pools[0].engine.max_model_len"
    assert "40960" in exc.reason and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in exc.reason
    assert exc.file == str(path)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    jkernel.new(jkernel.open_inputs(path))         # vLLM then warns and starts


def test_derived_max_model_len_follows_rope_scaling():
    """yarn scales original_max_position_embeddings; llama3 RoPE is not scaled."""
    from jkernel.resolve import open_inputs
    assert open_inputs("deepseek-v3-h200-fp8-tp8").model_max_len == 4096 * 40
    assert open_inputs("llama-3.1-70b-h100-tp4").model_max_len == 131072
    assert open_inputs("gpt-oss-120b-b200-tp8").model_max_len == 4096 * 32


def test_unknown_scenario_name_points_at_the_catalog():
    with pytest.raises(Refusal) as info:
        jkernel.open_inputs("no-such-scenario")
    assert info.value.code == "R2" and "jkernel catalog" in info.value.reason


# -- the staged resolution -------------------------------------------------------------------

def test_stage_records_are_frozen_and_hashable():
    """Every stage returns a frozen record (static structure), so a stage cannot be edited
    after the fact and its output can key a cache."""
    from jkernel import resolve as R
    from jkernel.plan import plan_layers

    inputs = inputs_for(**DS, tp=8)
    pool = inputs.deployment.pools[0]
    layout = R.resolve_layout(inputs.scenario, pool, inputs.chip, inputs.fabric)
    kinds, _ = plan_layers(inputs.model, tp=8, moe_group=layout.moe_group, sp_moe=False,
                           served_bytes=1.0, state_bytes=4.0, routed_a2a=False)
    facts = R.graph_facts(kinds)
    defaults = R.resolve_engine_defaults(pool.engine, inputs.chip, facts, "pools[0]")
    for record in (layout, facts, defaults):
        hash(record)
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.__setattr__(dataclasses.fields(record)[0].name, None)
    assert facts.latent and facts.has_moe and not facts.has_recurrent
    assert layout.tp == 8 and layout.group("TP").width == 8


def test_graph_facts_come_from_the_kind_plans_not_the_raw_graph():
    """A layer kind the stack never runs (here: an added gqa kind) does not change what the
    resolution knows of the model; before, primaries were read from every declared kind."""
    inputs = inputs_for(**TINY, tp=1)
    model = inputs.model
    extra = dataclasses.replace(model.layer_kinds[0], id="unused_swa", nodes=tuple(
        dataclasses.replace(n, kind="swa", window=128) if n.op == "Attention" else n
        for n in model.layer_kinds[0].nodes))
    unused = dataclasses.replace(model, layer_kinds=model.layer_kinds + (extra,))
    a = jkernel.new(inputs)
    b = jkernel.new(dataclasses.replace(inputs, model=unused))
    assert a.plan == b.plan and a.provenance() == b.provenance()


def _mutable_parts(value, path: str, out: list, depth: int = 0) -> None:
    """Paths under ``value`` that hold something a caller could change in place."""
    if isinstance(value, (dict, list, set, bytearray)) or hasattr(value, "__array__"):
        out.append(path)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not type(value).__dataclass_params__.frozen:
            out.append(path)
        for f in dataclasses.fields(value):
            _mutable_parts(getattr(value, f.name), f"{path}.{f.name}", out, depth + 1)
    elif isinstance(value, (tuple, frozenset)):
        for i, v in enumerate(value):
            _mutable_parts(v, f"{path}[{i}]", out, depth + 1)


@pytest.mark.parametrize("source", ["spec", "catalog"])
def test_documents_a_kernel_shares_are_immutable_and_its_devices_are_its_own(source):
    """`new` shares the documents of its Inputs instead of deep-copying them (a deep copy of
    every coefficient set cost a 16-GPU plan ~8 s): that is safe only while every document
    is frozen all the way down, which this holds, and the one mapping, the storage
    devices, is copied so that a caller editing it afterwards changes no built kernel."""
    inputs = inputs_for(**DS) if source == "spec" else \
        jkernel.open("qwen3-14b-h100-tp1").inputs
    found: list = []
    for f in dataclasses.fields(inputs):
        if f.name != "devices":
            _mutable_parts(getattr(inputs, f.name), f.name, found)
    for name, dev in inputs.devices.items():
        _mutable_parts(dev, f"devices[{name!r}]", found)
    assert found == []
    devices = dict(inputs.devices)
    mine = dataclasses.replace(inputs, devices=devices)
    k = jkernel.new(mine)
    devices.clear()
    assert k.inputs.devices == inputs.devices
