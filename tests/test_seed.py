"""The shipped catalog's data and the collective seed (jkernel/calibration/seed.py).

These tests read only the repository (never ``/work/shared``). They check:

* every shipped YAML parses;
* chips, fabrics and storage match the spec's fact tables (documents.md §3–§5);
* every coefficient entry is well formed (documents.md §8.2);
* every chip resolves the required coefficient names of resolution.md §5.2 at tp 1, 2, 4, 8,
  and every shipped scenario resolves the collective widths it needs (§5.3 snapping);
* the scenarios obey the consistency rules of resolution.md §3;
* the seed's fit recovers a known law from noisy synthetic data.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "catalog"
SETS = ["cost-model-primitives", "cost-model-collectives", "cost-model-host-overheads",
        "cost-model-attention", "cost-model-recurrent", "cost-model-memory"]
CHIPS = ["gb200-nvl72", "gb300", "b200", "b300", "h100", "h200", "l40s", "a100-sxm", "a100-80",
         "a100-40", "l4",       # chips of tests/data/kv_capacity.csv
         "rtx-4090", "rtx-pro-6000"]     # chips of the serving-runs (validation/BASELINE.md)
MODES = ["none", "piecewise", "full", "full_and_piecewise", "full_decode_only"]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "alltoall"]


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(path: Path):
    with path.open() as f:
        return yaml.load(f, Loader=_LOADER)


@functools.lru_cache(maxsize=None)
def _sets():
    """The six shipped sets, parsed once (callers must not mutate them)."""
    return {s: _load(CATALOG / "coefficients" / f"{s}.yaml") for s in SETS}


def _entries(sets=None):
    """[(set, name, body)] in scenario order, then file order."""
    sets = sets or _sets()
    return [(s, name, body) for s in SETS for item in sets[s]["coefficients"]
            for name, body in item.items()]


# ------------------------------------------------------------------ parsing


def test_every_shipped_yaml_parses():
    files = sorted(CATALOG.rglob("*.yaml"))
    assert len(files) >= 9 + 3 + 1 + 6 + 12
    for path in files:
        with path.open() as f:
            docs = list(yaml.load_all(f, Loader=_LOADER))
        assert docs and all(isinstance(d, dict) for d in docs), path
        if path.parent.name == "scenarios":
            assert [d["kind"] for d in docs] == ["Scenario", "Deployment"], path
        else:
            assert len(docs) == 1, path


# ------------------------------------------------------------------ chips, fabrics, storage

# documents.md §3.1: bf16, fp8, nvfp4, HBM TB/s, GiB, NVLink GB/s, SMs, GPUs/node, /rack, rack GB/s
FACTS = {
    "gb200-nvl72": (2500, 5000, 10000, 8.0, 173.2, 900, 148, 4, 72, 900),
    "gb300": (2500, 5000, 15000, 8.0, 277.5, 900, 152, 4, 72, 900),
    "b200": (2250, 4500, 9000, 7.7, 180, 900, 148, None, None, None),
    "b300": (2250, 4500, 14000, 7.75, 268.6, 900, 148, None, None, None),
    "h100": (989.5, 1979, None, 3.35, 80, 450, 132, None, None, None),
    "h200": (989.5, 1979, None, 4.8, 141, 450, 132, None, None, None),
    "l40s": (362.05, 733, None, 0.864, 48, 32, 142, None, None, None),
    "a100-80": (312, None, None, 2.039, 80, 300, 108, None, None, None),
    "a100-sxm": (312, None, None, 2.039, 80, 300, 108, None, None, None),
    # Not in documents.md §3.1: NVIDIA's A100 40GB and L4 datasheets (catalog/hardware).
    "a100-40": (312, None, None, 1.555, 40, 300, 108, None, None, None),
    "l4": (121, 242, None, 0.3, 24, 32, 58, None, None, None),
    # Dense FP32-accumulate tensor rates of the workstation parts (catalog/hardware comments).
    "rtx-4090": (165.2, 330.3, None, 1.008, 24, 32, 128, None, None, None),
    "rtx-pro-6000": (503.8, 1007.6, None, 1.792, 96, 64, 188, None, None, None),
}
CHIP_KEYS = ["TFlopsPeak", "TFlopsFP8", "TFlopsNVFP4", "BwPeakTBs", "MemoryGiB",
             "IntraNodeBwGBps", "SMCount", "GPUsPerNode", "GPUsPerRack", "IntraRackBwGBps"]


def _chip(name):
    return _load(CATALOG / "hardware" / f"{name}.yaml")


def test_hardware_files_match_the_facts_table():
    assert sorted(p.stem for p in (CATALOG / "hardware").glob("*.yaml")) == sorted(CHIPS)
    for name, facts in FACTS.items():
        doc = _chip(name)
        keys = {k for k in doc if not k.startswith("_")}
        # ReportedMemoryGiB: the total CUDA reports, a memory fact (jkernel/memory.py)
        assert keys <= set(CHIP_KEYS) | {"Provenance", "ReportedMemoryGiB"}, (name, keys)
        assert doc["Provenance"] == "vendor_spec"
        assert any(k.startswith("_comment") for k in doc), name
        for key, want in zip(CHIP_KEYS, facts):
            got = doc.get(key)
            if want is None:
                assert not got, (name, key, got)
            else:
                assert isinstance(got, (int, float)) and not isinstance(got, bool)
                assert got == pytest.approx(want), (name, key)
        if doc.get("TFlopsFP8"):
            assert doc["TFlopsFP8"] > doc["TFlopsPeak"]
        if doc.get("GPUsPerRack"):
            assert doc["GPUsPerRack"] % doc["GPUsPerNode"] == 0
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}
    assert strip(_chip("a100-80")) == strip(_chip("a100-sxm"))
    assert "alias" in _chip("a100-80")["_comment"].lower()


def test_fabrics_and_storage():
    for name, rate, rdma in (("ib-400g", 50, True), ("roce-200g", 25, True),
                             ("ethernet-100gbe", 12.5, False)):
        doc = _load(CATALOG / "networks" / f"{name}.yaml")
        assert {k for k in doc if not k.startswith("_")} == {"Provenance", "InterNodeBwGBps",
                                                              "RDMA"}
        assert doc["Provenance"] == "vendor_spec"
        assert doc["InterNodeBwGBps"] == rate and doc["RDMA"] is rdma
    storage = _load(CATALOG / "devices" / "storage.yaml")
    classes = {k: v for k, v in storage.items() if not k.startswith("_")}
    want = {"nvme_gen4": (7000, 5000, 80), "nvme_gen3": (3500, 3000, 100),
            "sata_ssd": (550, 500, 150), "cpu_dram": (20000, 20000, 1), "s3": (1000, 1000, 30000)}
    assert set(classes) == set(want)
    for name, (r, w, lat) in want.items():
        assert classes[name] == {"read_bandwidth_mb_s": r, "write_bandwidth_mb_s": w,
                                 "base_latency_us": lat}


# ------------------------------------------------------------------ entry fields (§8.2)

UNITS = {"dimensionless", "us_per_layer", "us_per_request", "us_per_step", "us_per_hop",
         "us_per_transfer", "us_per_load", "us_per_token", "bytes_per_us", "bytes_per_rank",
         "tokens", "sm_count"}
# the spec's six methods, plus jkernel calibration's `fitted` (by gradient from profiles or
# traces) and `derived` (by a documented rule from another chip's fit), with their fields
METHODS = {"measured", "literature", "vendor_spec", "copied", "assumed", "not_charged",
           "fitted", "derived"}
FIELDS = {"value", "units", "method", "fitted", "scope", "ci95", "sources", "rationale",
          "copied_from", "supersedes", "validated", "unsupported", "data_sha256", "rows",
          "heldout_error", "standard_error", "identifiable", "fitted_on"}
SCOPE_KEYS = {"hardware", "model", "tp", "ep", "nodes_spanned", "engine_version"}


def test_coefficient_sets_are_well_formed():
    sets = _sets()
    for s in SETS:
        assert sets[s]["kind"] == "CoefficientSet" and sets[s]["name"] == s
        assert set(sets[s]) == {"kind", "name", "coefficients"}
        seen = set()
        for item in sets[s]["coefficients"]:
            assert isinstance(item, dict) and len(item) == 1, item
            (name, body), = item.items()
            where = f"{s}:{name}"
            assert set(body) <= FIELDS, (where, set(body) - FIELDS)
            for req in ("value", "units", "method", "fitted", "scope"):
                assert req in body, (where, req)
            v = body["value"]
            assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            assert body["units"] in UNITS, where
            assert body["method"] in METHODS, where
            assert (v == 0) == (body["method"] == "not_charged"), where
            assert isinstance(body["fitted"], bool), where
            assert not body["fitted"] or body["method"] in ("measured", "fitted"), where
            scope = body["scope"]
            assert isinstance(scope, dict) and scope and set(scope) <= SCOPE_KEYS, where
            assert all(isinstance(x, list) and x for k, x in scope.items()
                       if k != "engine_version"), where
            if "engine_version" in scope:               # a version range: {from, before}
                assert set(scope["engine_version"]) <= {"from", "before"}, where
                assert "from" in scope["engine_version"], where
            for chip in scope.get("hardware", []):
                assert chip in CHIPS, (where, chip)
            if body["method"] in ("literature", "vendor_spec"):
                assert body.get("sources"), where
            for src in body.get("sources", []):
                assert set(src) == {"kind", "cite", "role"}, where
                assert src["kind"] in {"discussion", "publication", "datasheet", "model",
                                       "vendor_doc"}
                assert src["role"] in {"primary", "supporting", "upper_bound"}
                assert isinstance(src["cite"], str) and src["cite"].strip()
            if body["method"] != "measured":
                assert isinstance(body.get("rationale"), str) and body["rationale"].strip(), where
            if body["method"] == "copied":
                assert body.get("copied_from"), where
            if "ci95" in body:
                lo, hi = body["ci95"]
                assert lo <= v <= hi, where
            key = (name, tuple(sorted((k, tuple(sorted(map(str, x.items() if isinstance(x, dict)
                                                           else x))))
                                      for k, x in scope.items())))
            assert key not in seen, f"duplicate name and scope: {where}"
            seen.add(key)


# ------------------------------------------------------------------ resolution (§5)


class Registry:
    """Last-applicable-wins lookup over the six shipped sets (documents.md §8.3–§8.4)."""

    def __init__(self, chip, tp=1, ep=1):
        self.values = {}
        for _s, name, body in _entries():
            scope = body["scope"]
            ok = all(
                (str(want).lower() in [str(x).lower() for x in scope[k]]) for k, want in
                (("hardware", chip), ("tp", tp), ("ep", ep)) if k in scope)
            if ok and "model" not in scope and "nodes_spanned" not in scope:
                self.values[name] = body["value"]

    def has(self, name):
        return name in self.values

    def collective_width(self, op, chip, group):
        """resolution.md §5.3: the width used for a group of ``group`` ranks, or None (R18)."""
        stem = chip.replace("-", "_")
        widths = sorted(
            n for n in range(2, 129)
            if all(self.has(f"collective_{p}_{op}_fp16_{n}rank_{stem}")
                   for p in ("floor", "peak_rate", "transition_rate")))
        if not widths:
            return None
        if group <= widths[0]:
            return widths[0]
        if group in widths:
            return group
        if group > 16:
            return widths[-1]
        return None

    def snap(self, stem):
        """resolution.md §5.4 over widths {1, 2, 4, 8, 16}: returns a function of w."""
        declared = [n for n in (1, 2, 4, 8, 16) if self.has(stem.format(n))]

        def pick(w):
            below = [n for n in declared if n <= w]
            return below[-1] if below else (declared[0] if declared else w)
        return pick


def _suffixes(chip):
    doc = _chip(chip)
    fp8 = "fp8" if doc.get("TFlopsFP8") else "bf16"
    fp4 = "nvfp4" if doc.get("TFlopsNVFP4") else fp8
    return {"bf16", fp8, fp4}


@pytest.mark.parametrize("chip", CHIPS)
def test_required_names_resolve_for_every_chip(chip):
    for tp in (1, 2, 4, 8):
        reg = Registry(chip, tp=tp)
        missing = []
        need = ["hbm_derate", "engine_workspace_bytes", "activation_scratch_floor_bytes"]
        need += [f"cudagraph_capture_bytes_{m}" for m in MODES]
        for s in _suffixes(chip):
            need += [f"gemm_eps_max_{s}", f"gemm_m_half_{s}"]
            assert reg.has(f"gemm_n_half_{s}") == reg.has(f"gemm_k_half_{s}"), (chip, s)
        for fam in ("dense", "moe"):
            n = reg.snap(f"activation_buffer_count_{fam}_{{}}rank")(min(tp, 8))
            need.append(f"activation_buffer_count_{fam}_{n}rank")
        if tp > 1:
            n = reg.snap("nccl_communicator_bytes_{}rank")(tp)
            need.append(f"nccl_communicator_bytes_{n}rank")
            for op in OPS:
                assert reg.collective_width(op, chip, tp) is not None, (chip, op, tp)
        # Needed-optional names the catalog ships for every chip.
        need += ["host_admission_per_request", "host_admission_per_token", "host_output_token",
                 "host_completion", "host_launch_eager_per_layer", "host_launch_per_kernel",
                 "host_replay_graph_per_step", "attention_decode_floor", "attention_decode_rate",
                 "attention_prefill_floor", "attention_prefill_work_scale",
                 "moe_routing_imbalance_median", "host_link_bandwidth",
                 "recurrent_decode_floor_kda", "recurrent_decode_rate_kda",
                 "recurrent_decode_floor_mamba2", "recurrent_decode_rate_mamba2"]
        missing = [n for n in need if not reg.has(n)]
        assert not missing, (chip, tp, missing)
        assert reg.values["hbm_derate"] > 0
    # The 16-rank laws exist on every chip, so tp 16 and EP groups wider than 16 resolve.
    assert Registry(chip).collective_width("all_reduce", chip, 16) == 16
    assert Registry(chip).collective_width("alltoall", chip, 72) == 16


def test_a100_80_resolves_exactly_like_a100_sxm():
    a, b = Registry("a100-80", tp=8), Registry("a100-sxm", tp=8)
    strip = lambda reg, chip: {k.replace(chip.replace("-", "_"), "<chip>"): v
                               for k, v in reg.values.items()}
    assert strip(a, "a100-80") == strip(b, "a100-sxm")


def test_reference_values_kept_where_calibration_does_not_fit():
    """The memory magnitudes and the recurrent pairs are not refitted from the profiles: the
    spec's reference values (documents.md §8.7) stay in the shipped sets. The fitted GEMM,
    attention and collective values replace the reference ones, which calibration keeps as
    its comparison baseline (jkernel.calibration.fit.base.REFERENCE)."""
    h200 = Registry("h200", tp=8)
    assert h200.values["nccl_communicator_bytes_8rank"] == 411041792
    assert h200.values["nccl_communicator_bytes_2rank"] == 358612992
    assert h200.values["engine_workspace_bytes"] == 3758096384
    assert h200.values["cudagraph_capture_bytes_piecewise"] == 858783744
    assert h200.values["cudagraph_capture_bytes_none"] == 0
    assert h200.values["activation_buffer_count_moe_8rank"] == 10
    assert h200.values["activation_scratch_floor_bytes"] > 10 * 1 * 7168 * 2
    assert Registry("h100").values["recurrent_decode_rate_kda"] == 0.235
    from jkernel.calibration.fit.base import REFERENCE

    assert REFERENCE["h200"]["gemm"]["fp8"] == (0.788, 94)


# ---------------------------------- scenarios (documents.md §2, resolution.md §3)

ENGINE_KEYS = {"quantization", "cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
               "mamba_cache_mode", "block_size", "max_num_batched_tokens", "max_num_seqs",
               "max_model_len", "cudagraph_mode", "gpu_memory_utilization", "speculative", "eplb",
               "all2all_backend", "allreduce_backend", "disable_custom_all_reduce",
               "async_scheduling", "disable_cascade_attn", "enable_prefix_caching",
               "dcp_comm_backend", "dcp_q_replicate", "cp_kv_cache_interleave_size",
               "scheduling_policy", "dbo"}
PARALLEL_KEYS = {"tp", "pp", "dp", "dp_local", "enable_expert_parallel", "pcp", "dcp"}
SCENARIOS = sorted((CATALOG / "scenarios").glob("*.yaml"))
REQUIRED_SCENARIOS = {
    "llama-3.1-70b-h100-tp4", "llama-3.1-8b-h100-tp1", "deepseek-v3-h200-fp8-tp8",
    "llama-3.1-70b-instruct-h200-fp8-tp8", "qwen3-30b-a3b-h200-ep", "mixtral-8x7b-h100-tp2",
    "gpt-oss-120b-b200-tp8", "qwen3-32b-l40s-tp4", "llama-3.1-8b-a100-tp1",
    "deepseek-v3-h200-2node-tp16", "deepseek-v3-gb200-ep32", "llama-3.1-70b-h200-disagg"}


def _bundle(path):
    with path.open() as f:
        return list(yaml.safe_load_all(f))


def test_required_scenarios_are_shipped():
    assert REQUIRED_SCENARIOS <= {p.stem for p in SCENARIOS}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_is_consistent(path):
    scen, dep = _bundle(path)
    assert set(scen) <= {"kind", "name", "model", "coefficients", "engine_version", "workload",
                         "cluster"}
    # a scenario names a model the catalog ships (one of its derived graphs)
    assert scen["name"] == path.stem
    assert (CATALOG / "models" / scen["model"] / "graph.yaml").is_file()
    assert scen["coefficients"] == SETS
    assert isinstance(scen["engine_version"], str)
    cl = scen["cluster"]
    assert set(cl) <= {"hardware", "fabric", "nodes", "gpus_per_node", "gpus_per_rack", "storage"}
    assert (CATALOG / "hardware" / f"{cl['hardware']}.yaml").exists()
    if cl["nodes"] > 1:
        assert (CATALOG / "networks" / f"{cl['fabric']}.yaml").exists()
    if "gpus_per_rack" in cl:
        assert cl["gpus_per_rack"] % cl["gpus_per_node"] == 0
    assert set(dep) <= {"kind", "name", "pools", "offload", "pd_transfer"}
    pools = dep["pools"]
    roles = [p["role"] for p in pools]
    assert sum(p["nodes"] for p in pools) == cl["nodes"]
    assert ("prefill" in roles) == ("decode" in roles)
    assert not ("colocated" in roles and "prefill" in roles)
    if "prefill" in roles:
        assert dep["pd_transfer"]["connector"]
    storage = _load(CATALOG / "devices" / "storage.yaml")
    for tier in dep.get("offload", {}).get("tiers", []):
        assert tier["tier"] in storage and tier["bytes"] >= 1
        if "storage" in cl:
            assert tier["tier"] in cl["storage"]
    for pool in pools:
        par = pool["parallel"]
        assert set(par) <= PARALLEL_KEYS and {"tp", "pp", "dp"} <= set(par)
        assert set(pool.get("engine", {})) <= ENGINE_KEYS
        tp, dp, pcp = par["tp"], par["dp"], max(par.get("pcp", 0), 1)
        assert par["pp"] == 1
        engine_gpus = par["pp"] * tp * pcp * dp
        assert (pool["nodes"] * cl["gpus_per_node"]) % engine_gpus == 0, path.stem
        if "dp_local" in par:
            assert par["dp_local"] <= dp and cl["gpus_per_node"] % par["dp_local"] == 0
        mode = pool.get("engine", {}).get("cudagraph_mode")
        assert mode in (None, "NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE",
                        "FULL_DECODE_ONLY")
        # The collective widths this pool needs resolve on this chip (resolution.md §5.3).
        chip = cl["hardware"]
        reg = Registry(chip, tp=tp)
        if tp > 1:
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                assert reg.collective_width(op, chip, tp), (path.stem, op, tp)
        moe_group = tp * pcp * dp if (par.get("enable_expert_parallel") or dp > 1) else 1
        if moe_group > 1:
            assert reg.collective_width("alltoall", chip, moe_group), (path.stem, moe_group)


def test_deepseek_v3_vector_scenario_settings():
    scen, dep = _bundle(CATALOG / "scenarios" / "deepseek-v3-h200-fp8-tp8.yaml")
    assert scen["engine_version"] == "0.29.0" and scen["model"] == "deepseek-v3"
    assert scen["cluster"] == {"hardware": "h200", "nodes": 1, "gpus_per_node": 8}
    (pool,) = dep["pools"]
    assert pool["parallel"] == {"tp": 8, "pp": 1, "dp": 1, "enable_expert_parallel": False}
    assert pool["engine"] == {"quantization": "fp8", "cache_dtype": "fp8", "block_size": 16,
                              "max_num_batched_tokens": 8192, "max_num_seqs": 256,
                              "max_model_len": 32768, "cudagraph_mode": "PIECEWISE"}


# ------------------------------------------------------------------ the seed


def test_seed_fit_recovers_a_known_law():
    from jkernel.laws import collective_time
    from jkernel.calibration.fit.collectives import fit_collective

    rng = np.random.default_rng(20240601)
    nbytes = 2.0 ** np.arange(8, 30.5, 0.5)          # 256 B .. 1 GiB, 45 points
    for i, (floor_s, peak, trans) in enumerate(((12e-6, 3.0e11, 4.0e11),
                                                (20e-6, 1.2e11, 1.5e11))):
        clean = np.asarray(collective_time(nbytes, floor_s, peak, trans), float)
        noisy = clean * np.exp(rng.normal(0.0, 0.03, clean.shape))
        fit = fit_collective(nbytes, noisy)
        assert fit.floor_s == pytest.approx(floor_s, rel=0.10)
        assert fit.peak_per_s == pytest.approx(peak, rel=0.10)
        assert fit.transition_per_s == pytest.approx(trans, rel=0.10)
        assert fit.geo_error < 1.05
        if i == 0:
            assert fit_collective(nbytes, noisy) == fit     # deterministic


def test_seed_reads_elements_and_derives_chips(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is the optional extra jkernel[profiles]")
    import pyarrow.parquet as pq
    from jkernel.calibration.seed import build_entries, fit_chip, read_nccl_sweeps

    from jkernel.laws import collective_time

    rows = {"op_name": [], "nccl_dtype": [], "num_gpus": [], "message_size": [], "latency": []}
    sizes = [2 ** k for k in range(8, 29)]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "alltoall"):
        for n in (2, 4, 8):
            for dt in ("half", "int8"):
                for m in sizes:
                    t = float(collective_time(2.0 * m, 5e-6 * n, 2e11, 2.5e11))
                    rows["op_name"].append(op)
                    rows["nccl_dtype"].append(dt)
                    rows["num_gpus"].append(n)
                    rows["message_size"].append(m)
                    rows["latency"].append(t * 1e3 * (3.0 if dt == "int8" else 1.0))
    d = tmp_path / "aic-op-profiles" / "b200_sxm" / "comm" / "nccl" / "2.29.2"
    d.mkdir(parents=True)
    pq.write_table(pa.table(rows), d / "nccl_perf.parquet")

    sweeps = read_nccl_sweeps(d / "nccl_perf.parquet")
    b, t = sweeps[("all_reduce", 8)]
    assert len(b) == len(sizes) and b[0] == 2 * 256          # half rows only, 2 B per element
    fits = fit_chip(tmp_path / "aic-op-profiles", "b200_sxm")
    assert fits[("all_reduce", 4)].floor_s == pytest.approx(20e-6, rel=0.02)

    entries, table = build_entries({"b200": fits})
    by_name = {}
    for item in entries:
        (name, body), = item.items()
        by_name.setdefault(name, []).append(body)
    f8 = by_name["collective_floor_all_reduce_fp16_8rank_b200"][0]
    assert f8["method"] == "measured" and f8["fitted"] is True and f8["units"] == "us_per_transfer"
    assert f8["value"] == pytest.approx(40.0, rel=0.02)
    assert "nccl_perf.parquet" in f8["sources"][0]["cite"]
    f16 = by_name["collective_floor_all_reduce_fp16_16rank_b200"][0]
    assert f16["method"] == "assumed" and f16["value"] == pytest.approx(80.0, rel=0.03)
    peak16 = by_name["collective_peak_rate_all_reduce_fp16_16rank_b200"][0]["value"]
    peak8 = by_name["collective_peak_rate_all_reduce_fp16_8rank_b200"][0]["value"]
    assert peak16 == pytest.approx(peak8 * 14 / 15, rel=1e-4)
    gb = by_name["collective_transition_rate_alltoall_fp16_2rank_gb200_nvl72"][0]
    assert gb["method"] == "copied" and gb["copied_from"] == "hardware: [b200]"
    assert gb["units"] == "bytes_per_us" and gb["scope"] == {"hardware": ["gb200-nvl72"]}
    assert "collective_floor_all_reduce_fp16_16rank_gb200_nvl72" in by_name
    assert "gb300" not in table and "l40s" not in table      # their sources were not fitted


@pytest.mark.parametrize("chip", ["rtx-4090", "rtx-pro-6000", "l4"])
def test_ported_chips_follow_the_ridge_and_bandwidth_rules(chip):
    """Chips without profiles that run l40s's kernels take l40s's fit through their own
    ridge and bandwidth (jkernel.calibration.regenerate, PORTED): the GEMM ramp's half-width
    scales with the compute-to-bandwidth ridge (a copied width made the RTX 4090's decode
    GEMMs compute-bound), decode rates with the bandwidth and never above it (the L4 once
    borrowed l40s's 734 GB/s against its 300 GB/s), the rest is l40s's. Every entry says so."""
    src, dst = Registry("l40s"), Registry(chip)
    s, d = _chip("l40s"), _chip(chip)
    ridge = (d["TFlopsPeak"] / d["BwPeakTBs"]) / (s["TFlopsPeak"] / s["BwPeakTBs"])
    assert dst.values["gemm_m_half_bf16"] == pytest.approx(
        src.values["gemm_m_half_bf16"] * ridge, rel=1e-5)
    bw = d["BwPeakTBs"] / s["BwPeakTBs"]
    for name in ("attention_decode_rate", "attention_decode_rate_swa"):
        assert dst.values[name] == pytest.approx(src.values[name] * bw, rel=1e-5)
        assert dst.values[name] < d["BwPeakTBs"] * 1e6            # bytes/µs
    for name in ("gemm_eps_max_bf16", "hbm_derate", "attention_decode_floor",
                 "moe_kernel_floor_bf16", "attention_decode_overlap"):
        assert dst.values[name] == src.values[name]
    for _s, name, body in _entries():
        if body["scope"].get("hardware") == [chip] and name in dst.values \
                and not name.startswith(("collective_", "host_")):
            assert body["method"] == "derived" and "ported" in body["rationale"], name
