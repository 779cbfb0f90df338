"""Strict document loaders (spec documents.md §2–§8, resolution.md §13 R1/R2/R19).

Every refusal here is checked for its code and for the file and key it names: a document
error that does not say where it is cannot be fixed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

import jkernel
from jkernel import Refusal
from jkernel.documents import (graph_to_dict, load_bundle, load_chip, load_coefficient_set,
                               load_fabric, load_graph, load_storage, parse_bundle,
                               parse_chip, parse_coefficient_set, parse_fabric, parse_graph,
                               parse_storage)
from jkernel.documents.graph import dump_graph

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).resolve().parent / "data" / "spec_catalog"
SHIPPED = ROOT / "catalog"
SPEC_REPOS = jkernel.Repos(catalog=SPEC, registry=SPEC)


# -- helpers ------------------------------------------------------------------------------

def _write(tmp_path: Path, name: str, doc) -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return p


def _refused(fn, *args, code: str = "R1", field: str | None = None, file=None, **kw):
    """Call ``fn`` expecting a Refusal with ``code``; check it names ``field`` and ``file``."""
    with pytest.raises(Refusal) as info:
        fn(*args, **kw)
    exc = info.value
    assert isinstance(exc, ValueError)           # resolution.md §13: Refusal is a ValueError
    assert exc.code == code, str(exc)
    assert str(exc).startswith(f"[{code}]")
    if field is not None:
        assert exc.field == field, str(exc)
        assert field in str(exc)                 # the message names the key
    if file is not None:
        assert exc.file == str(file), str(exc)
        assert str(file) in str(exc)             # the message names the file
    return exc


def _graph() -> dict:
    """A small valid graph document (documents.md §6), mutated one rule at a time below."""
    return {
        "kind": "ModelGraph", "name": "toy",
        "derived_from": {"format": "hf_config_json", "path": "config.json",
                         "sha256": "a" * 64, "deriver_version": 1},
        "global": {"hidden_size": 1024, "vocab_size": 32000, "weight_dtype": "bf16"},
        "layer_kinds": [
            {"id": "dense", "nodes": [
                {"op": "Elementwise", "role": "input_norm"},
                {"op": "GEMM", "role": "qkv_proj", "n": 1536, "k": 1024},
                {"op": "Attention", "kind": "gqa", "n_q": 8, "n_kv": 2, "d_h": 128},
                {"op": "GEMM", "role": "o_proj", "n": 1024, "k": 1024},
                {"op": "AllReduce", "role": "attn_out", "emit": "tensor_parallel"},
                {"op": "GEMM", "role": "mlp_gate_up", "n": 8192, "k": 1024},
                {"op": "GEMM", "role": "mlp_down", "n": 1024, "k": 4096},
                {"op": "AllReduce", "role": "mlp_out",
                 "emit": "tensor_parallel_unless_sp_moe"}],
             "edges": [[0, 1], [1, 2], [2, 3]]},
            {"id": "moe", "nodes": [
                {"op": "Attention", "kind": "mla", "n_q": 8, "n_kv": 1, "d_h": 576,
                 "kv_lora_rank": 512, "qk_rope_head_dim": 64},
                {"op": "GroupedGEMM", "role": "experts", "n": 512, "k": 1024, "experts": 16,
                 "top_k": 4, "shared_experts": 1, "shared_intermediate_size": 1024},
                {"op": "All2All", "role": "moe_dispatch_combine", "emit": "expert_parallel"}]},
        ],
        "stack": {"prologue": ["dense"], "pattern": ["moe"], "repeat": 3},
        "head": [{"op": "Elementwise", "role": "final_norm"},
                 {"op": "GEMM", "role": "lm_head", "n": 32000, "k": 1024}],
        "speculator": {"method": "deepseek_mtp", "num_spec_tokens": 1,
                       "stack": {"pattern": ["moe"], "repeat": 1}},
    }


def _node(doc: dict, kind: int, i: int) -> dict:
    return doc["layer_kinds"][kind]["nodes"][i]


def _chip() -> dict:
    return {"Provenance": "vendor_spec", "TFlopsPeak": 989.5, "TFlopsFP8": 1979,
            "BwPeakTBs": 4.8, "MemoryGiB": 141, "IntraNodeBwGBps": 450, "SMCount": 132}


def _bundle_docs() -> list[dict]:
    sc = {"kind": "Scenario", "name": "t", "model": "tiny-llm", "coefficients": ["spec-vectors"],
          "engine_version": "0.31.0", "cluster": {"hardware": "h200", "nodes": 1,
                                                  "gpus_per_node": 8}}
    dep = {"kind": "Deployment", "name": "t",
           "pools": [{"role": "colocated", "nodes": 1,
                      "parallel": {"tp": 1, "pp": 1, "dp": 1}}]}
    return [sc, dep]


# -- the baseline documents are valid -------------------------------------------------------

def test_baseline_graph_parses():
    """The mutation tests below start from a valid graph: each changes one thing."""
    g = parse_graph(_graph())
    assert [lk.id for lk in g.layer_kinds] == ["dense", "moe"]
    assert g.total_layers == 4
    assert g.speculator.num_spec_tokens == 1


# -- strict decoding: unknown keys, wrong types (documents.md's introduction, R1) ----------

@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.__setitem__("extra", 1), "extra"),
    (lambda d: d["global"].__setitem__("hidden", 7), "global.hidden"),
    (lambda d: _node(d, 0, 1).__setitem__("bias", True), "layer_kinds[0].nodes[1].bias"),
    (lambda d: d["stack"].__setitem__("repeats", 2), "stack.repeats"),
    (lambda d: d["derived_from"].__setitem__("url", "x"), "derived_from.url"),
])
def test_graph_unknown_key_is_refused_naming_file_and_key(tmp_path, mutate, field):
    """Strict decoding: an unknown key is R1, and the error names the file and the key."""
    doc = _graph()
    mutate(doc)
    p = _write(tmp_path, "graph.yaml", doc)
    _refused(load_graph, p, field=field, file=p)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["global"].__setitem__("hidden_size", "1024"), "global.hidden_size"),
    (lambda d: d["global"].__setitem__("hidden_size", 1024.0), "global.hidden_size"),
    (lambda d: d["global"].__setitem__("tie_word_embeddings", "yes please"),
     "global.tie_word_embeddings"),
    (lambda d: _node(d, 0, 1).__setitem__("n", "1536"), "layer_kinds[0].nodes[1].n"),
    (lambda d: _node(d, 0, 2).__setitem__("n_q", True), "layer_kinds[0].nodes[2].n_q"),
    (lambda d: d.__setitem__("layer_kinds", {"id": "dense"}), "layer_kinds"),
    (lambda d: d["stack"].__setitem__("prologue", "dense"), "stack.prologue"),
])
def test_graph_wrong_type_is_refused(tmp_path, mutate, field):
    """A value of the wrong type is R1 (a string for an int, a float for an int, …)."""
    doc = _graph()
    mutate(doc)
    p = _write(tmp_path, "graph.yaml", doc)
    _refused(load_graph, p, field=field, file=p)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: _node(d, 0, 1).__setitem__("n", -1536), "layer_kinds[0].nodes[1].n"),
    (lambda d: _node(d, 0, 2).__setitem__("d_h", -128), "layer_kinds[0].nodes[2].d_h"),
    (lambda d: _node(d, 1, 1).__setitem__("experts", -16), "layer_kinds[1].nodes[1].experts"),
    (lambda d: d["global"].__setitem__("hidden_size", 0), "global.hidden_size"),
    (lambda d: d["stack"].__setitem__("repeat", 0), "stack.repeat"),
    (lambda d: d["speculator"].__setitem__("num_spec_tokens", 0), "speculator.num_spec_tokens"),
])
def test_graph_negative_width_is_refused(tmp_path, mutate, field):
    """A negative (or zero where ≥ 1 is required) width is out of range: R1."""
    doc = _graph()
    mutate(doc)
    p = _write(tmp_path, "graph.yaml", doc)
    exc = _refused(load_graph, p, field=field, file=p)
    assert "out of range" in exc.reason


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["global"].__setitem__("weight_dtype", "fp6"), "global.weight_dtype"),
    (lambda d: _node(d, 0, 1).__setitem__("weight_dtype", "bfloat16"),
     "layer_kinds[0].nodes[1].weight_dtype"),
    (lambda d: _node(d, 1, 1).__setitem__("weight_dtype", "e2m1"),
     "layer_kinds[1].nodes[1].weight_dtype"),
])
def test_graph_unknown_dtype_is_refused(tmp_path, mutate, field):
    """Dtypes are the closed list of documents.md §6.2; anything else is R1 listing them."""
    doc = _graph()
    mutate(doc)
    p = _write(tmp_path, "graph.yaml", doc)
    exc = _refused(load_graph, p, field=field, file=p)
    assert "nvfp4" in exc.reason and "mxfp4" in exc.reason   # says what is allowed


@pytest.mark.parametrize("dtype, width", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1),
                                          ("int8", 1), ("nvfp4", 0.5), ("mxfp4", 0.5),
                                          ("int4", 0.5)])
def test_every_listed_dtype_is_accepted(dtype, width):
    """documents.md §6.2: the eight dtypes parse, on the graph and on a GEMM node."""
    from jkernel.documents import DTYPE_BYTES

    doc = _graph()
    doc["global"]["weight_dtype"] = dtype
    _node(doc, 0, 1)["weight_dtype"] = dtype
    g = parse_graph(doc)
    assert g.weight_dtype == dtype and DTYPE_BYTES[dtype] == width


def test_scenario_and_deployment_unknown_key_and_wrong_type(tmp_path):
    """Strict decoding applies to the bundle: control-plane keys such as `scheduler` are
    unknown (README 'out of scope'), and `tp: "8"` is a wrong type. Both R1, naming file and
    key."""
    sc, dep = _bundle_docs()
    dep["pools"][0]["scheduler"] = {"policy": "fcfs"}
    p = _write(tmp_path, "b.yaml", yaml.safe_dump_all([sc, dep]))
    _refused(load_bundle, p, field="deployment.pools[0].scheduler", file=p)

    sc, dep = _bundle_docs()
    dep["pools"][0]["parallel"]["tp"] = "8"
    p = _write(tmp_path, "b2.yaml", yaml.safe_dump_all([sc, dep]))
    _refused(load_bundle, p, field="deployment.pools[0].parallel.tp", file=p)

    sc, dep = _bundle_docs()
    dep["pools"][0]["engine"] = {"max_num_seqs": 256, "max_num_seq": 256}
    p = _write(tmp_path, "b3.yaml", yaml.safe_dump_all([sc, dep]))
    _refused(load_bundle, p, field="deployment.pools[0].engine.max_num_seq", file=p)

    sc, dep = _bundle_docs()
    sc["cluster"]["gpus"] = 8
    p = _write(tmp_path, "b4.yaml", yaml.safe_dump_all([sc, dep]))
    _refused(load_bundle, p, field="scenario.cluster.gpus", file=p)


@pytest.mark.parametrize("key, value, code", [
    ("pcp", -1, "R1"),     # documents.md §2.4: out of range at decoding
    ("dcp", -2, "R1"),
    ("pp", 0, "R1"),       # pp is an int ≥ 1
])
def test_negative_parallel_width_is_refused_at_decoding(tmp_path, key, value, code):
    sc, dep = _bundle_docs()
    dep["pools"][0]["parallel"][key] = value
    p = _write(tmp_path, "b.yaml", yaml.safe_dump_all([sc, dep]))
    _refused(load_bundle, p, code=code, field=f"deployment.pools[0].parallel.{key}", file=p)


@pytest.mark.parametrize("key", ["tp", "dp"])
@pytest.mark.parametrize("value", [0, -1])
def test_tp_or_dp_below_one_is_r5(key, value):
    """resolution.md §3 'Parallel widths (R5)': tp ≥ 1 and dp ≥ 1; the deployment decodes and
    construction refuses it under R5, naming the setting."""
    sc, dep = _bundle_docs()
    dep["pools"][0]["parallel"][key] = value
    _refused(jkernel.open, (sc, dep), SPEC_REPOS, code="R5",
             field=f"pools[0].parallel.{key}")


def test_engine_setting_out_of_range_is_r1():
    """resolution.md §3 'Settings (R1)': gpu_memory_utilization ∈ [0, 1]; speculative needs a
    method and num_spec_tokens ≥ 1; custom all-reduce must not contradict its disable flag;
    a switch such as scheduler_reserve_full_isl is true or false."""
    for engine, field in [
        ({"gpu_memory_utilization": 1.5}, "engine.gpu_memory_utilization"),
        ({"speculative": {"method": "mtp", "num_spec_tokens": 0}},
         "engine.speculative.num_spec_tokens"),
        ({"speculative": {"num_spec_tokens": 1}}, "engine.speculative.method"),
        ({"allreduce_backend": "custom", "disable_custom_all_reduce": True},
         "engine.disable_custom_all_reduce"),
        ({"scheduler_reserve_full_isl": "yes"}, "engine.scheduler_reserve_full_isl"),
    ]:
        sc, dep = _bundle_docs()
        dep["pools"][0]["engine"] = engine
        _refused(parse_bundle, [sc, dep], field=f"deployment.pools[0].{field}")


# -- tp must divide the attention heads (spec silent → vLLM v0.31.0) ------------------------

def test_tp_not_dividing_heads_is_r5_and_dividing_twin_builds():
    """The spec is silent; vLLM v0.31.0 refuses a tp that does not divide
    num_attention_heads (ModelConfig.verify_with_parallel_config), so the kernel refuses it
    under R5 (engine would not start). tiny-llm has 16 heads: tp 3 is refused, tp 2 builds.
    Guards against pricing a sharding vLLM cannot run (e.g. 16/3 heads per rank)."""
    sc, dep = _bundle_docs()
    sc["cluster"]["gpus_per_node"] = 6
    dep["pools"][0]["parallel"]["tp"] = 3
    exc = _refused(jkernel.open, (sc, dep), SPEC_REPOS, code="R5",
                   field="pools[0].parallel.tp")
    assert "16" in exc.reason and "heads" in exc.reason
    twin = copy.deepcopy(dep)
    twin["pools"][0]["parallel"]["tp"] = 2
    assert jkernel.open((sc, twin), SPEC_REPOS).plan.tp == 2


# -- comment keys (documents.md intro) ---------------------------------------------------

def test_comment_keys_accepted_on_chip_fabric_storage(tmp_path):
    """Chip, fabric and storage files may carry `_comment` and `_comment_<anything>`."""
    chip = _chip() | {"_comment": "vendor figures", "_comment_links": "NVLink 4"}
    p = _write(tmp_path, "h200.yaml", chip)
    c = load_chip(p)
    assert c.name == "h200" and c.bf16_peak_tflops == 989.5 and c.sm_count == 132
    f = load_fabric(_write(tmp_path, "ib.yaml", {"_comment": "NDR", "Provenance": "vendor_spec",
                                                 "InterNodeBwGBps": 50}))
    assert f.inter_node_gbps == 50.0
    s = load_storage(_write(tmp_path, "storage.yaml", {
        "_comment": "tiers", "cpu_dram": {"_comment_src": "pinned", "read_bandwidth_mb_s": 2e4,
                                          "write_bandwidth_mb_s": 2e4, "base_latency_us": 1}}))
    assert list(s) == ["cpu_dram"]


def test_comment_keys_refused_on_graph_and_bundle(tmp_path):
    """Model graphs (and the other documents) may not carry `_comment` keys: R1."""
    doc = _graph()
    doc["_comment"] = "hand-edited"
    p = _write(tmp_path, "graph.yaml", doc)
    _refused(load_graph, p, field="_comment", file=p)
    doc = _graph()
    _node(doc, 0, 0)["_comment_why"] = "x"
    p = _write(tmp_path, "graph2.yaml", doc)
    _refused(load_graph, p, field="layer_kinds[0].nodes[0]._comment_why", file=p)
    sc, dep = _bundle_docs()
    sc["_comment"] = "x"
    _refused(parse_bundle, [sc, dep], field="scenario._comment")


def test_chip_rules(tmp_path):
    """documents.md §3: a fitted factor such as `_mfu` is an unknown key; FP8 peak must
    exceed the BF16 peak; GPUsPerRack a multiple of GPUsPerNode; required > 0."""
    p = _write(tmp_path, "x.yaml", _chip() | {"_mfu": 0.5})
    _refused(load_chip, p, field="_mfu", file=p)
    p = _write(tmp_path, "c.yaml", _chip() | {"_commentary": "not a comment key"})
    _refused(load_chip, p, field="_commentary", file=p)
    p = _write(tmp_path, "n.yaml", _chip() | {"name": "h200"})      # identity is the file
    _refused(load_chip, p, field="name", file=p)
    p = _write(tmp_path, "y.yaml", _chip() | {"TFlopsFP8": 900})
    _refused(load_chip, p, field="TFlopsFP8", file=p)
    p = _write(tmp_path, "z.yaml", _chip() | {"GPUsPerNode": 4, "GPUsPerRack": 70})
    _refused(load_chip, p, field="GPUsPerRack", file=p)
    p = _write(tmp_path, "w.yaml", _chip() | {"BwPeakTBs": 0})
    _refused(load_chip, p, field="BwPeakTBs", file=p)
    chip = _chip()
    del chip["SMCount"]
    p = _write(tmp_path, "v.yaml", chip)
    _refused(load_chip, p, field="SMCount", file=p)


# -- storage spellings (documents.md §5, D21) -----------------------------------------------

def test_storage_either_spelling_accepted_and_both_refused(tmp_path):
    """D21: either spelling per field is accepted (mixing fields is fine); stating both
    spellings of one field is R1, naming the class and key."""
    new = {"read_bandwidth_mb_s": 7000, "write_bandwidth_mb_s": 5000, "base_latency_us": 80}
    old = {"read_bandwidth": 7000, "write_bandwidth": 5000, "base_latency": 80}
    mixed = {"read_bandwidth_mb_s": 7000, "write_bandwidth": 5000, "base_latency_us": 80}
    for body in (new, old, mixed):
        s = parse_storage({"nvme_gen4": body})["nvme_gen4"]
        assert (s.read_mb_s, s.write_mb_s, s.base_latency_us) == (7000.0, 5000.0, 80.0)
    p = _write(tmp_path, "storage.yaml", {"nvme_gen4": new | {"write_bandwidth": 5000}})
    exc = _refused(load_storage, p, field="nvme_gen4.write_bandwidth_mb_s", file=p)
    assert "write_bandwidth" in exc.reason and "both" in exc.reason
    p = _write(tmp_path, "storage2.yaml", {"s3": {"read_bandwidth": 1000}})
    _refused(load_storage, p, field="s3.write_bandwidth_mb_s", file=p)


def test_spec_catalog_storage_uses_older_spelling_with_yaml12_floats():
    """The fixture storage file is the published copy: older spelling, YAML 1.2 floats
    (`7.0e3`), read to the spec's table (documents.md §5)."""
    s = load_storage(SPEC / "devices" / "storage.yaml")
    assert {k: (v.read_mb_s, v.write_mb_s, v.base_latency_us) for k, v in s.items()} == {
        "nvme_gen4": (7000.0, 5000.0, 80.0), "nvme_gen3": (3500.0, 3000.0, 100.0),
        "sata_ssd": (550.0, 500.0, 150.0), "cpu_dram": (20000.0, 20000.0, 1.0),
        "s3": (1000.0, 1000.0, 30000.0)}


# -- YAML 1.2 float forms ----------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("7.0e3", 7000.0), ("1e3", 1000.0), ("1E3", 1000.0), ("2.5e-1", 0.25), ("1e-6", 1e-6),
    ("5.0e+3", 5000.0), ("+1.5e2", 150.0), (".5", 0.5), ("450", 450.0), ("450.0", 450.0)])
def test_yaml_12_float_forms(tmp_path, text, value):
    """PyYAML reads YAML 1.1, where `7.0e3` and `1e-6` are strings; the catalog is written for
    a YAML 1.2 reader, where they are floats. Guards against a chip rate read as a string
    (R1) or, worse, silently as text."""
    p = tmp_path / "chip.yaml"
    p.write_text(f"Provenance: vendor_spec\nTFlopsPeak: 989.5\nBwPeakTBs: 4.8\n"
                 f"MemoryGiB: 141\nIntraNodeBwGBps: {text}\nSMCount: 132\n")
    assert load_chip(p).nvlink_gbps == pytest.approx(value, rel=0, abs=0)


def test_yaml_12_exponent_in_an_integer_field_is_not_an_integer(tmp_path):
    """`1e3` is a float in YAML 1.2, so an integer field refuses it (R1) instead of
    truncating; plain integers stay integers."""
    p = tmp_path / "chip.yaml"
    p.write_text("Provenance: vendor_spec\nTFlopsPeak: 989.5\nBwPeakTBs: 4.8\nMemoryGiB: 141\n"
                 "IntraNodeBwGBps: 450\nSMCount: 1.32e2\n")
    _refused(load_chip, p, field="SMCount", file=p)
    cs = parse_coefficient_set(yaml.load(
        "kind: CoefficientSet\nname: x\ncoefficients:\n- host_output_token:\n"
        "    value: 4.59e1\n    units: us_per_token\n    method: measured\n    fitted: true\n"
        "    scope: {hardware: [h200]}\n", Loader=__import__(
            "jkernel.documents._strict", fromlist=["_Loader"])._Loader))
    assert cs.entries[0].value == 45.9


# -- bundles (resolution.md §1, D18) -------------------------------------------------------------

def test_bundle_with_one_or_three_documents_is_refused(tmp_path):
    """A bundle is exactly two documents, Scenario then Deployment. The old single-document
    combined shape, a third document, or the wrong order are R1, naming the file."""
    sc, dep = _bundle_docs()
    for i, docs in enumerate(([sc], [sc, dep, dep], [dep, sc])):
        p = _write(tmp_path, f"b{i}.yaml", yaml.safe_dump_all(docs))
        exc = _refused(load_bundle, p, file=p)
        assert "Scenario then Deployment" in exc.reason
    p = _write(tmp_path, "ok.yaml", yaml.safe_dump_all([sc, dep]))
    scenario, deployment = load_bundle(p)
    assert scenario.model == "tiny-llm" and deployment.pools[0].parallel.tp == 1


def test_open_refuses_a_single_document_bundle_text():
    """The same rule through `open` with YAML text (one document) and with one mapping."""
    sc, _ = _bundle_docs()
    _refused(jkernel.open, yaml.safe_dump(sc) + "\n", SPEC_REPOS)
    _refused(jkernel.open, [sc], SPEC_REPOS)


def test_missing_bundle_or_document_is_r2(tmp_path):
    """R2: a document the scenario names cannot be found (bundle, model, set)."""
    _refused(load_bundle, tmp_path / "nope.yaml", code="R2", file=tmp_path / "nope.yaml")
    sc, dep = _bundle_docs()
    sc["model"] = "no-such-model"
    exc = _refused(jkernel.open_inputs, (sc, dep), SPEC_REPOS, code="R2")
    assert "no-such-model" in str(exc) and exc.file.endswith("no-such-model/graph.yaml")
    sc, dep = _bundle_docs()
    sc["coefficients"] = ["spec-vectors", "cost-model-missing"]
    exc = _refused(jkernel.open_inputs, (sc, dep), SPEC_REPOS, code="R2")
    assert exc.file.endswith("cost-model-missing.yaml")


# -- graph validation rules (documents.md §6.3–§6.6) -----------------------------------------

@pytest.mark.parametrize("mutate, field, code", [
    # n_kv ≤ n_q
    (lambda d: _node(d, 0, 2).__setitem__("n_kv", 16), "layer_kinds[0].nodes[2].n_kv", "R1"),
    # mla (and sparse_mla) hold one latent: n_kv = 1
    (lambda d: _node(d, 1, 0).__setitem__("n_kv", 2), "layer_kinds[1].nodes[0].n_kv", "R1"),
    # top_k ≤ experts
    (lambda d: _node(d, 1, 1).__setitem__("top_k", 17), "layer_kinds[1].nodes[1].top_k", "R1"),
    # window only on swa / sparse_mla
    (lambda d: _node(d, 0, 2).__setitem__("window", 4096), "layer_kinds[0].nodes[2].window",
     "R1"),
    (lambda d: _node(d, 1, 0).__setitem__("window", 128), "layer_kinds[1].nodes[0].window",
     "R1"),
    # window required on swa
    (lambda d: _node(d, 0, 2).__setitem__("kind", "swa"), "layer_kinds[0].nodes[2].window",
     "R1"),
    # index_topk / compress_ratio only on sparse_mla
    (lambda d: _node(d, 1, 0).__setitem__("index_topk", 2048),
     "layer_kinds[1].nodes[0].index_topk", "R1"),
    # sparse_mla needs index_topk or compress_ratio
    (lambda d: _node(d, 1, 0).__setitem__("kind", "sparse_mla"),
     "layer_kinds[1].nodes[0].index_topk", "R1"),
    # shared_intermediate_size requires shared_experts
    (lambda d: _node(d, 1, 1).pop("shared_experts"),
     "layer_kinds[1].nodes[1].shared_intermediate_size", "R1"),
    # weight_dtype only on GEMM / GroupedGEMM
    (lambda d: _node(d, 0, 2).__setitem__("weight_dtype", "fp8"),
     "layer_kinds[0].nodes[2].weight_dtype", "R1"),
    # a parameter the primitive does not price
    (lambda d: _node(d, 0, 1).__setitem__("experts", 8), "layer_kinds[0].nodes[1].experts",
     "R1"),
    (lambda d: _node(d, 0, 4).__setitem__("n", 1024), "layer_kinds[0].nodes[4].n", "R1"),
    # required parameters
    (lambda d: _node(d, 0, 1).pop("k"), "layer_kinds[0].nodes[1].k", "R1"),
    (lambda d: _node(d, 0, 2).pop("d_h"), "layer_kinds[0].nodes[2].d_h", "R1"),
    (lambda d: _node(d, 1, 1).pop("top_k"), "layer_kinds[1].nodes[1].top_k", "R1"),
    # a collective needs an emit condition
    (lambda d: _node(d, 0, 4).pop("emit"), "layer_kinds[0].nodes[4].emit", "R1"),
    # unknown op / attention kind
    (lambda d: _node(d, 0, 1).__setitem__("op", "Conv2D"), "layer_kinds[0].nodes[1].op", "R1"),
    (lambda d: _node(d, 0, 2).__setitem__("kind", "linear"), "layer_kinds[0].nodes[2].kind",
     "R1"),
    # emit: closed set (§6.6) → R19
    (lambda d: _node(d, 0, 4).__setitem__("emit", "sometimes"), "layer_kinds[0].nodes[4].emit",
     "R19"),
    (lambda d: _node(d, 0, 1).__setitem__("emit", "data_parallel"),
     "layer_kinds[0].nodes[1].emit", "R19"),
    # a stack or speculator naming an undeclared layer kind → R19
    (lambda d: d["stack"].__setitem__("pattern", ["moe", "swa"]), "stack.pattern[1]", "R19"),
    (lambda d: d["stack"].__setitem__("epilogue", ["dense_tail"]), "stack.epilogue[0]", "R19"),
    (lambda d: d["speculator"]["stack"].__setitem__("pattern", ["mtp"]),
     "speculator.stack.pattern[0]", "R19"),
    # edges: pairs of node indices, acyclic (D19)
    (lambda d: d["layer_kinds"][0].__setitem__("edges", [[0, 1], [1, 2], [2, 0]]),
     "layer_kinds[0].edges", "R1"),
    (lambda d: d["layer_kinds"][0].__setitem__("edges", [[3, 3]]), "layer_kinds[0].edges", "R1"),
    (lambda d: d["layer_kinds"][0].__setitem__("edges", [[0, 8]]), "layer_kinds[0].edges[0]",
     "R1"),
    # pattern needs repeat (§6.4)
    (lambda d: d["stack"].pop("repeat"), "stack.repeat", "R1"),
    # layer-kind ids are unique
    (lambda d: d["layer_kinds"][1].__setitem__("id", "dense"), "layer_kinds[1].id", "R1"),
    # mamba2 needs n_groups, conv_kernel, intermediate_size
    (lambda d: d["layer_kinds"][0]["nodes"].append(
        {"op": "RecurrentUpdate", "recurrent_kind": "mamba2", "n_heads": 8, "state_size": 64}),
     "layer_kinds[0].nodes[8].n_groups", "R1"),
])
def test_graph_validation_rule_refused(tmp_path, mutate, field, code):
    """documents.md §6.3 validation rules (R1), §6.6 emit conditions and §6.4/§6.5 undeclared
    kinds (R19), D19 edges (R1). Each case changes one thing in a valid graph, and the
    refusal names the file and the node key."""
    doc = _graph()
    mutate(doc)
    p = _write(tmp_path, "graph.yaml", doc)
    _refused(load_graph, p, code=code, field=field, file=p)


@pytest.mark.parametrize("mutate", [
    # the twins that build: window on sparse_mla; emit on a non-collective (a warning, D19);
    # a node with tensor_parallel; a swa with its window; a sparse_mla with compress_ratio
    lambda d: _node(d, 1, 0).update(kind="sparse_mla", index_topk=2048, window=128),
    lambda d: _node(d, 1, 0).update(kind="sparse_mla", compress_ratio=4),
    lambda d: _node(d, 0, 1).__setitem__("emit", "tensor_parallel"),
    lambda d: _node(d, 0, 2).update(kind="swa", window=128),
    lambda d: d["layer_kinds"][0].__setitem__("edges", [[0, 2], [1, 2], [2, 3]]),
    lambda d: _node(d, 1, 1).update(top_k=16),
    lambda d: _node(d, 0, 2).update(n_kv=8),
])
def test_graph_validation_twins_build(mutate):
    """One setting away from a refusal, each graph parses."""
    doc = _graph()
    mutate(doc)
    parse_graph(doc)


def test_emit_sometimes_r19_and_tensor_parallel_twin_through_open(tmp_path):
    """vectors.md §6: a graph with a node `emit: sometimes` is R19; the twin with
    `tensor_parallel` opens. Driven through open() with a catalog that holds the graph."""
    cat = tmp_path / "cat"
    (cat / "models" / "toy").mkdir(parents=True)
    for sub in ("hardware", "devices", "coefficients"):
        (cat / sub).symlink_to(SPEC / sub)
    doc = _graph()
    doc["layer_kinds"][0]["nodes"][4]["emit"] = "sometimes"
    graph = cat / "models" / "toy" / "graph.yaml"
    graph.write_text(yaml.safe_dump(doc, sort_keys=False))
    sc, dep = _bundle_docs()
    sc["model"] = "toy"
    repos = jkernel.Repos(catalog=cat, registry=cat)
    _refused(jkernel.open, (sc, dep), repos, code="R19",
             field="layer_kinds[0].nodes[4].emit", file=graph)
    doc["layer_kinds"][0]["nodes"][4]["emit"] = "tensor_parallel"
    graph.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert jkernel.open((sc, dep), repos).plan.total_layers == 4


def test_graph_name_must_match_directory(tmp_path):
    """documents.md §6.1: `name` equals the catalog directory name (R1 naming `name`)."""
    p = _write(tmp_path, "graph.yaml", _graph())
    _refused(load_graph, p, expected_name="other", field="name", file=p)
    assert load_graph(p, expected_name="toy").name == "toy"


def test_derived_from_sha256_is_64_hex(tmp_path):
    doc = _graph()
    doc["derived_from"]["sha256"] = "abc"
    p = _write(tmp_path, "graph.yaml", doc)
    _refused(load_graph, p, field="derived_from.sha256", file=p)


# -- coefficient sets (documents.md §8.1–§8.2) ---------------------------------------------

def _coeff_doc(**body) -> dict:
    entry = {"value": 45.9, "units": "us_per_token", "method": "measured", "fitted": True,
             "scope": {"hardware": ["h200"]}} | body
    return {"kind": "CoefficientSet", "name": "x", "coefficients": [{"host_output_token": entry}]}


@pytest.mark.parametrize("body, field", [
    ({"colour": "red"}, "coefficients[0].host_output_token.colour"),
    ({"value": "fast"}, "coefficients[0].host_output_token.value"),
    ({"units": "seconds"}, "coefficients[0].host_output_token.units"),
    ({"method": "guessed"}, "coefficients[0].host_output_token.method"),
    ({"method": "assumed", "rationale": "x"}, "coefficients[0].host_output_token.fitted"),
    ({"value": 0}, "coefficients[0].host_output_token.value"),
    ({"scope": {}}, "coefficients[0].host_output_token.scope"),
    ({"scope": {"chip": ["h200"]}}, "coefficients[0].host_output_token.scope.chip"),
    ({"ci95": [50, 60]}, "coefficients[0].host_output_token.ci95"),
    ({"method": "vendor_spec", "fitted": False, "rationale": "x"},
     "coefficients[0].host_output_token.sources"),
])
def test_coefficient_entry_rules(tmp_path, body, field):
    """documents.md §8.2: fields, units, methods, `fitted` only with measured, value 0 iff
    not_charged, ≥ 1 scope dimension, ci95 containing the value, sources for vendor_spec."""
    p = _write(tmp_path, "x.yaml", _coeff_doc(**body))
    _refused(load_coefficient_set, p, field=field, file=p)


def test_coefficient_entry_must_be_single_key_map(tmp_path):
    doc = _coeff_doc()
    doc["coefficients"][0]["host_completion"] = doc["coefficients"][0]["host_output_token"]
    p = _write(tmp_path, "x.yaml", doc)
    _refused(load_coefficient_set, p, field="coefficients[0]", file=p)


def test_coefficient_fitted_key_must_be_present(tmp_path):
    doc = _coeff_doc()
    del doc["coefficients"][0]["host_output_token"]["fitted"]
    p = _write(tmp_path, "x.yaml", doc)
    _refused(load_coefficient_set, p, field="coefficients[0].host_output_token.fitted", file=p)


# -- graph round trip: parse → write → parse -----------------------------------------------

def _graph_files() -> list[Path]:
    files = sorted((SPEC / "models").glob("*/graph.yaml"))
    files += sorted((SHIPPED / "models").glob("*/graph.yaml"))
    return files


@pytest.mark.parametrize("path", _graph_files(),
                         ids=lambda p: f"{p.parents[2].name}/{p.parent.name}")
def test_graph_round_trip(path):
    """`parse(write(parse(doc))) == parse(doc)` for every graph of the fixture and the shipped
    catalogs, through the dict form and through YAML text. A shipped graph that does not load
    fails here (it is a defect of the catalog, never a reason to skip)."""
    g = load_graph(path, expected_name=path.parent.name)
    d = graph_to_dict(g)
    assert parse_graph(d) == g
    assert parse_graph(yaml.safe_load(dump_graph(g))) == g
    assert graph_to_dict(parse_graph(d)) == d


def test_shipped_catalog_has_graphs():
    """The round trip above covers the shipped catalog only if it holds graphs (the catalog is
    part of the repository, so a missing folder fails)."""
    assert len(list((SHIPPED / "models").glob("*/graph.yaml"))) >= 5
