"""The HF-config deriver (spec documents.md §6.7, §7; vectors.md §2).

Self-contained: every config is read from the copy shipped beside its graph in
``catalog/models/<name>/config.json``; nothing under /work/shared is needed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from jkernel.derive import (DERIVER_VERSION, SHIPPED_MODELS, derive_file, derive_graph,
                            write_model)
from jkernel.errors import Refusal

MODELS = Path(__file__).resolve().parents[1] / "catalog" / "models"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# -- helpers ----------------------------------------------------------------------------------

_LAUNCHES = {"GEMM": 1, "GroupedGEMM": 4, "Attention": 2, "Elementwise": 1,
             "RecurrentUpdate": 2, "AllReduce": 1, "AllGather": 1, "ReduceScatter": 1,
             "All2All": 2}


def _shipped(name: str) -> tuple[Path, Path | None]:
    d = MODELS / name
    q = d / "hf_quant_config.json"
    return d / "config.json", (q if q.exists() else None)


def _derive_shipped(name: str) -> dict:
    cfg, quant = _shipped(name)
    return derive_file(cfg, name=name, quant_config_path=quant)


_CACHE: dict[str, dict] = {}


def _graph(name: str) -> dict:
    if name not in _CACHE:
        _CACHE[name] = _derive_shipped(name)
    return _CACHE[name]


def _expanded(stack: dict) -> list[str]:
    pattern = list(stack.get("pattern", [])) * stack.get("repeat", 0)
    return list(stack.get("prologue", [])) + pattern + list(stack.get("epilogue", []))


def _emitted(node: dict, tp: int, moe_group: int, sp_moe: bool = False) -> bool:
    return {"": True, "tensor_parallel": tp > 1, "expert_parallel": moe_group > 1,
            "tensor_parallel_unless_sp_moe": tp > 1 and not sp_moe}[node.get("emit", "")]


def _launches(nodes: list[dict], tp: int, moe_group: int) -> int:
    return sum(_LAUNCHES[n["op"]] for n in nodes if _emitted(n, tp, moe_group))


def total_kernels(g: dict, tp: int, moe_group: int = 1) -> int:
    """documents.md §6.8: Σ_kinds count·launches(kind) + launches(head)."""
    kinds = {k["id"]: k["nodes"] for k in g["layer_kinds"]}
    seq = _expanded(g["stack"])
    return (sum(_launches(kinds[kid], tp, moe_group) for kid in seq)
            + _launches(g.get("head", []), tp, moe_group))


def _count_role(g: dict, role: str) -> int:
    kinds = {k["id"]: k["nodes"] for k in g["layer_kinds"]}
    return sum(sum(1 for n in kinds[kid] if n.get("role") == role) for kid in _expanded(g["stack"]))


def _facts(g: dict) -> dict:
    kinds = g["layer_kinds"]
    first = lambda pred: next((n for k in kinds for n in k["nodes"] if pred(n)), None)  # noqa
    att = first(lambda n: n["op"] == "Attention" and not n.get("role"))
    down = first(lambda n: n.get("role") == "mlp_down")
    moe = first(lambda n: n["op"] == "GroupedGEMM")
    spec = g.get("speculator")
    return {
        "L": len(_expanded(g["stack"])), "H": g["global"]["hidden_size"],
        "V": g["global"]["vocab_size"], "attn": att["kind"],
        "heads": (att["n_q"], att["n_kv"], att["d_h"]),
        "inter": down["k"] if down else None,
        "moe": (moe["experts"], moe["top_k"], moe.get("shared_experts", 0)) if moe else None,
        "e_inter": moe["n"] if moe else None,
        "latent": moe.get("latent_size") if moe else None,
        "dtype": g["global"]["weight_dtype"],
        "expert_dtype": moe.get("weight_dtype", g["global"]["weight_dtype"]) if moe else None,
        "spec": (spec["method"], spec["stack"]["repeat"]) if spec else None,
        "modality": g.get("modality", "text_only"),
    }


# -- every shipped graph is what the deriver makes of its shipped config ----------------------

@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_shipped_graph_equals_derivation(name):
    shipped = yaml.load((MODELS / name / "graph.yaml").read_text(), Loader=_Loader)
    g = _graph(name)
    assert g == shipped
    assert list(g)[:2] == ["kind", "name"]
    order = ["kind", "name", "modality", "derived_from", "global", "layer_kinds", "stack",
             "head", "speculator"]
    assert list(g) == [k for k in order if k in g]
    data = (MODELS / name / "config.json").read_bytes()
    assert g["derived_from"] == {"format": "hf_config_json", "path": "config.json",
                                 "sha256": hashlib.sha256(data).hexdigest(),
                                 "deriver_version": DERIVER_VERSION}
    ident = yaml.safe_load((MODELS / name / "model.yaml").read_text())
    assert ident["name"] == name


_OTHER_MODELS = sorted(p.name for p in MODELS.iterdir()
                       if p.is_dir() and p.name not in SHIPPED_MODELS)


@pytest.mark.parametrize("name", _OTHER_MODELS)
def test_catalog_graph_from_another_source_equals_derivation(name):
    """Catalog models whose config is not in the hf-configs folder (serving-run configs,
    checkpoints added with ``jkernel derive``) are still what the deriver makes of the
    config.json shipped beside them."""
    shipped = yaml.load((MODELS / name / "graph.yaml").read_text(), Loader=_Loader)
    assert _graph(name) == shipped
    data = (MODELS / name / "config.json").read_bytes()
    assert shipped["derived_from"]["sha256"] == hashlib.sha256(data).hexdigest()


# -- §7 model facts -----------------------------------------------------------------------------
# (L, H, V, attention kind, q/kv/d_h, inter, E/k/S, e-inter, weights, speculator)

F = dict
FACTS = {
    # rows of documents.md §7
    "deepseek-v3": F(L=61, H=7168, V=129280, attn="mla", heads=(128, 1, 576), inter=18432,
                     moe=(256, 8, 1), e_inter=2048, dtype="fp8", spec=("deepseek_mtp", 1)),
    "glm-5": F(L=78, H=6144, V=154880, attn="sparse_mla", heads=(64, 1, 576), inter=12288,
               moe=(256, 8, 1), e_inter=2048, dtype="fp8", spec=("deepseek_mtp", 1)),
    "gpt-oss-120b": F(L=36, H=2880, V=201088, attn="swa", heads=(64, 8, 64), inter=None,
                      moe=(128, 4, 0), e_inter=2880, dtype="bf16", expert_dtype="mxfp4",
                      spec=None),
    "kimi-k2.5": F(L=61, H=7168, V=163840, attn="mla", heads=(64, 1, 576), inter=18432,
                   moe=(384, 8, 1), e_inter=2048, dtype="int4", spec=None,
                   modality="text_decoder_of_multimodal"),
    "kimi-k3": F(L=93, H=7168, V=163840, attn="mla", heads=(96, 1, 576), inter=33792,
                 moe=(896, 16, 2), latent=3584, e_inter=3072, dtype="mxfp4", spec=None,
                 modality="text_decoder_of_multimodal"),
    "llama-3.1-70b-instruct": F(L=80, H=8192, V=128256, attn="gqa", heads=(64, 8, 128),
                                inter=28672, moe=None, dtype="bf16", spec=None),
    "llama-3.1-8b-instruct": F(L=32, H=4096, V=128256, attn="gqa", heads=(32, 8, 128),
                               inter=14336, moe=None, dtype="bf16", spec=None),
    "minimax-m2.5": F(L=62, H=3072, V=200064, attn="gqa", heads=(48, 8, 128), inter=None,
                      moe=(256, 8, 0), e_inter=1536, dtype="fp8", spec=None),
    "minimax-m3": F(L=60, H=6144, V=200064, attn="gqa", heads=(64, 4, 128), inter=12288,
                    moe=(128, 4, 1), e_inter=3072, dtype="bf16", spec=("minimax_m3_mtp", 7)),
    "mixtral-8x22b-v0.1": F(L=56, H=6144, V=32000, attn="gqa", heads=(48, 8, 128), inter=None,
                            moe=(8, 2, 0), e_inter=16384, dtype="bf16", spec=None),
    "mixtral-8x7b-v0.1": F(L=32, H=4096, V=32000, attn="gqa", heads=(32, 8, 128), inter=None,
                           moe=(8, 2, 0), e_inter=14336, dtype="bf16", spec=None),
    "qwen3-30b-a3b": F(L=48, H=2048, V=151936, attn="gqa", heads=(32, 4, 128), inter=None,
                       moe=(128, 8, 0), e_inter=768, dtype="bf16", spec=None),
    "qwen3.5-397b-a17b": F(L=60, H=4096, V=248320, attn="gqa", heads=(32, 2, 256), inter=None,
                           moe=(512, 10, 1), e_inter=1024, dtype="bf16",
                           spec=("qwen3_5_mtp", 1), modality="text_decoder_of_multimodal"),
    # no §7 row: figures read from the model's own config.json ("—" in §7 means exactly this)
    "llama-3.1-405b": F(L=126, H=16384, V=128256, attn="gqa", heads=(128, 8, 128), inter=53248,
                        moe=None, dtype="bf16", spec=None),
    "qwen3-32b": F(L=64, H=5120, V=151936, attn="gqa", heads=(64, 8, 128), inter=25600,
                   moe=None, dtype="bf16", spec=None),
    "qwen3-235b-a22b": F(L=94, H=4096, V=151936, attn="gqa", heads=(64, 4, 128), inter=None,
                         moe=(128, 8, 0), e_inter=1536, dtype="bf16", spec=None),
    "gpt-oss-20b": F(L=24, H=2880, V=201088, attn="swa", heads=(64, 8, 64), inter=None,
                     moe=(32, 4, 0), e_inter=2880, dtype="bf16", expert_dtype="mxfp4",
                     spec=None),
    # §7's Llama-4 row is the fp8-dynamic checkpoint; the bf16 Instruct config is shipped, and
    # vLLM's Llama4MoE runs one shared expert (S = 1).
    "llama-4-scout-17b-16e": F(L=48, H=5120, V=202048, attn="gqa", heads=(40, 8, 128),
                               inter=None, moe=(16, 1, 1), e_inter=8192, dtype="bf16",
                               spec=None, modality="text_decoder_of_multimodal"),
    "deepseek-v3.2": F(L=61, H=7168, V=129280, attn="sparse_mla", heads=(128, 1, 576),
                       inter=18432, moe=(256, 8, 1), e_inter=2048, dtype="fp8",
                       spec=("deepseek_mtp", 1)),
    "nemotron-3-nano-30b-a3b": F(L=52, H=2688, V=131072, attn="gqa", heads=(32, 2, 128),
                                 inter=None, moe=(128, 6, 1), e_inter=1856, dtype="bf16",
                                 spec=None),
    "nemotron-3-super-120b-a12b": F(L=88, H=4096, V=131072, attn="gqa", heads=(32, 2, 128),
                                    inter=None, moe=(512, 22, 1), latent=1024, e_inter=2688,
                                    dtype="fp8", spec=("nemotron_h_mtp", 1)),
}


def test_facts_cover_every_shipped_model():
    assert set(FACTS) == set(SHIPPED_MODELS)


@pytest.mark.parametrize("name", sorted(FACTS))
def test_facts_table(name):
    got = _facts(_graph(name))
    want = dict(FACTS[name])
    want.setdefault("modality", "text_only")
    for key, value in want.items():
        assert got[key] == value, (name, key)


def test_facts_stack_spellings():
    assert _graph("deepseek-v3")["stack"] == {"prologue": ["attn_dense"] * 3,
                                              "pattern": ["attn_moe"], "repeat": 58}
    assert _graph("gpt-oss-120b")["stack"] == {"pattern": ["swa_moe", "full_moe"], "repeat": 18}
    assert _graph("qwen3.5-397b-a17b")["stack"] == {
        "pattern": ["gdn_moe"] * 3 + ["attn_moe"], "repeat": 15}
    # §7: kda_dense, kda_moe + 22×(kda_moe, mla_moe, kda_moe, kda_moe) + kda_moe, mla_moe, mla_moe
    assert _graph("kimi-k3")["stack"] == {
        "prologue": ["kda_dense", "kda_moe"],
        "pattern": ["kda_moe", "mla_moe", "kda_moe", "kda_moe"], "repeat": 22,
        "epilogue": ["kda_moe", "mla_moe", "mla_moe"]}
    seq = _expanded(_graph("kimi-k3")["stack"])
    assert (seq.count("mla_moe"), seq.count("kda_moe") + seq.count("kda_dense")) == (24, 69)
    nano = _expanded(_graph("nemotron-3-nano-30b-a3b")["stack"])
    assert (nano.count("mamba"), nano.count("attention"), nano.count("moe")) == (23, 6, 23)


def test_dtype_decisions_d34():
    # mxfp4: experts only, the rest (and the not-converted modules) at torch_dtype.
    g = _graph("gpt-oss-120b")
    for kind in g["layer_kinds"]:
        for n in kind["nodes"]:
            if n["op"] == "GroupedGEMM":
                assert n["weight_dtype"] == "mxfp4"
            elif n["op"] == "GEMM":
                assert n["weight_dtype"] == "bf16"
    # compressed-tensors int4 on the routed experts; the ignored modules stay bf16.
    g = _graph("kimi-k2.5")
    moe = next(k for k in g["layer_kinds"] if k["id"] == "attn_moe")["nodes"]
    assert all(n.get("weight_dtype") == "bf16" for n in moe if n["op"] == "GEMM")
    assert "weight_dtype" not in next(n for n in moe if n["op"] == "GroupedGEMM")
    assert g["head"][1]["weight_dtype"] == "bf16"
    # fp8 with modules_to_not_convert: lm_head and router keep torch_dtype.
    g = _graph("minimax-m2.5")
    assert g["head"][1]["weight_dtype"] == "bf16"
    # GLM-5-FP8 lists the indexer weights projection as not converted.
    g = _graph("glm-5")
    nodes = g["layer_kinds"][1]["nodes"]
    wproj = next(n for n in nodes if n.get("role") == "indexer_weights_proj")
    assert wproj["weight_dtype"] == "bf16"
    assert "weight_dtype" not in next(n for n in nodes if n.get("role") == "indexer_wq_b")


# -- vectors.md §2 structural pins ----------------------------------------------------------------

def test_llama_8b_kernel_counts():
    g = _graph("llama-3.1-8b-instruct")
    assert total_kernels(g, tp=1) == 32 * 8 + 2 == 258
    assert total_kernels(g, tp=2) == total_kernels(g, tp=8) == 32 * 10 + 2 == 322
    assert len(_expanded(g["stack"])) + 1 == 33          # segments


def test_deepseek_v3_d36_router_difference():
    """vectors.md §2: the reference graph has 972 kernels at tp 8, EP off; a D36 graph differs
    by exactly its router GEMMs (no q/k norms in DeepSeek-V3), in kernels and in weights."""
    g = _graph("deepseek-v3")
    routers = _count_role(g, "router")
    assert routers == 58
    assert total_kernels(g, tp=8, moe_group=1) == 972 + routers * _LAUNCHES["GEMM"] == 1030
    assert _count_role(g, "q_norm") == _count_role(g, "k_norm") == 0
    kinds = {k["id"]: k["nodes"] for k in g["layer_kinds"]}
    fp8 = 1.0

    def gemm_bytes(nodes, roles):
        return sum(n["n"] * n["k"] * (2.0 if n.get("weight_dtype") == "bf16" else fp8)
                   for n in nodes if n["op"] == "GEMM" and n["role"] in roles)

    attn_roles = {"qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"}
    assert gemm_bytes(kinds["attn_moe"], attn_roles) == 187_105_280
    assert gemm_bytes(kinds["attn_dense"], {"mlp_gate_up", "mlp_down"}) == 396_361_728
    moe = next(n for n in kinds["attn_moe"] if n["op"] == "GroupedGEMM")
    assert 3 * moe["n"] * moe["k"] == 44_040_192
    assert 2 * 3 * moe["n"] * moe["k"] == 88_080_384
    # The only weights beyond the reference: one bf16 router (256 × 7168) per MoE layer.
    router = next(n for n in kinds["attn_moe"] if n.get("role") == "router")
    assert (router["n"], router["k"], router["weight_dtype"]) == (256, 7168, "bf16")
    ref_moe = [n for n in kinds["attn_moe"] if n.get("role") != "router"]
    assert [n["op"] for n in ref_moe] == [
        "Elementwise", "GEMM", "Elementwise", "Elementwise", "GEMM", "GEMM", "Attention",
        "GEMM", "AllReduce", "Elementwise", "GroupedGEMM", "All2All", "AllReduce"]
    assert 2 * g["head"][1]["n"] * g["head"][1]["k"] == 1_853_358_080
    assert _count_role(g, "attn_out") + _count_role(g, "mlp_out") == 122


def test_gpt_oss_d36_router_difference():
    g = _graph("gpt-oss-120b")
    routers = _count_role(g, "router")
    assert routers == 36
    assert total_kernels(g, tp=1) == 362 + routers
    assert total_kernels(g, tp=8) == 434 + routers
    assert total_kernels(g, tp=8, moe_group=8) == 506 + routers


def test_llama_70b_layer_weights():
    nodes = _graph("llama-3.1-70b-instruct")["layer_kinds"][0]["nodes"]
    assert sum(n["n"] * n["k"] for n in nodes if n["op"] == "GEMM") == 855_638_016


# -- refusals -------------------------------------------------------------------------------------

def _llama_config() -> dict:
    return json.loads((MODELS / "llama-3.1-8b-instruct" / "config.json").read_bytes())


def test_unknown_model_type_is_refused():
    cfg = _llama_config()
    cfg["model_type"] = "frobnicator"
    with pytest.raises(Refusal) as e:
        derive_graph(cfg, name="x", sha256="0" * 64)
    assert e.value.code == "R1" and e.value.field == "model_type"
    assert "frobnicator" in str(e.value)


def test_missing_hidden_size_is_refused():
    cfg = _llama_config()
    del cfg["hidden_size"]
    with pytest.raises(Refusal) as e:
        derive_graph(cfg, name="x", sha256="0" * 64)
    assert e.value.code == "R1" and e.value.field == "hidden_size"
    assert "hidden_size" in str(e.value)


def test_unknown_quant_method_and_nested_field_are_refused():
    cfg = _llama_config()
    cfg["quantization_config"] = {"quant_method": "mystery"}
    with pytest.raises(Refusal) as e:
        derive_graph(cfg, name="x", sha256="0" * 64)
    assert e.value.field == "quantization_config.quant_method"
    mm = json.loads((MODELS / "kimi-k2.5" / "config.json").read_bytes())
    del mm["text_config"]["num_hidden_layers"]
    with pytest.raises(Refusal) as e:
        derive_graph(mm, name="x", sha256="0" * 64)
    assert e.value.field == "text_config.num_hidden_layers"


def test_unknown_architecture_is_refused():
    cfg = _llama_config()
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    with pytest.raises(Refusal) as e:
        derive_graph(cfg, name="x", sha256="0" * 64)
    assert e.value.field == "architectures"


# -- smaller conventions --------------------------------------------------------------------------

def test_head_dim_default_and_sliding_window_switch():
    cfg = _llama_config()
    g = derive_graph(cfg, name="x", sha256="0" * 64)
    att = g["layer_kinds"][0]["nodes"][2]
    assert att["d_h"] == 4096 // 32
    # D35: a window without use_sliding_window applies to every layer; false switches it off.
    cfg2 = copy.deepcopy(cfg)
    cfg2["sliding_window"] = 4096
    g2 = derive_graph(cfg2, name="x", sha256="0" * 64)
    assert g2["layer_kinds"][0]["nodes"][2] == {"op": "Attention", "kind": "swa", "n_q": 32,
                                               "n_kv": 8, "d_h": 128, "window": 4096}
    cfg2["use_sliding_window"] = False
    g3 = derive_graph(cfg2, name="x", sha256="0" * 64)
    assert g3["layer_kinds"][0]["nodes"][2]["kind"] == "gqa"
    # neither quant_method nor torch_dtype → bf16
    del cfg["torch_dtype"]
    assert derive_graph(cfg, name="x", sha256="0" * 64)["global"]["weight_dtype"] == "bf16"


def test_qwen3_qk_norm_bytes():
    nodes = _graph("qwen3-32b")["layer_kinds"][0]["nodes"]
    qn = next(n for n in nodes if n.get("role") == "q_norm")
    kn = next(n for n in nodes if n.get("role") == "k_norm")
    assert (qn["bytes_per_token"], kn["bytes_per_token"]) == (2 * 2 * 64 * 128, 2 * 2 * 8 * 128)
    roles = [n.get("role") for n in nodes]
    assert roles.index("qkv_proj") < roles.index("q_norm") < roles.index("k_norm")


def test_llama4_empty_no_rope_layers_means_the_interval_rule():
    """An empty ``no_rope_layers`` list (RedHatAI's FP8-dynamic Scout ships one) is absent to
    HF Llama4TextConfig, so every 4th layer is NoPE as without the key; a non-empty list of the
    wrong length is still refused."""
    cfg = json.loads((MODELS / "llama-4-scout-17b-16e" / "config.json").read_bytes())
    base = derive_graph(cfg, name="x", sha256="0" * 64)
    cfg["text_config"]["no_rope_layers"] = []
    empty = derive_graph(cfg, name="x", sha256="0" * 64)
    assert empty == base
    assert [k["id"] for k in empty["layer_kinds"]] == ["attn_moe", "nope_moe"]
    cfg["text_config"]["no_rope_layers"] = [1, 1, 1]
    with pytest.raises(Refusal) as e:
        derive_graph(cfg, name="x", sha256="0" * 64)
    assert e.value.field == "text_config.no_rope_layers"


def test_write_model_round_trip(tmp_path):
    cfg, _ = _shipped("mixtral-8x7b-v0.1")
    gpath = write_model(cfg, "mixtral-8x7b-v0.1", tmp_path)
    assert gpath == tmp_path / "mixtral-8x7b-v0.1" / "graph.yaml"
    assert (gpath.parent / "config.json").read_bytes() == cfg.read_bytes()
    assert yaml.safe_load(gpath.read_text()) == _graph("mixtral-8x7b-v0.1")
    assert yaml.safe_load((gpath.parent / "model.yaml").read_text()) == {
        "name": "mixtral-8x7b-v0.1"}
