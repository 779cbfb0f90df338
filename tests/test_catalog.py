"""The shipped catalog as an installed user sees it, and the command line over it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import jkernel
from jkernel import catalog
from jkernel.cli import main
from jkernel.documents import graph_to_dict, load_graph, parse_graph

CHIPS = ["a100-sxm", "b200", "b300", "gb200-nvl72", "gb300", "h100", "h200", "l40s"]
MODELS = ["llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "llama-3.1-405b", "qwen3-32b",
          "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b-v0.1", "mixtral-8x22b-v0.1",
          "deepseek-v3", "kimi-k2.5", "gpt-oss-120b", "gpt-oss-20b", "minimax-m2.5",
          "llama-4-scout-17b-16e"]
SCENARIOS = catalog.list_scenarios()


def test_catalog_lists_every_chip_and_model():
    assert set(CHIPS) <= set(catalog.list_chips())
    assert set(MODELS) <= set(catalog.list_models())
    assert {"ib-400g", "roce-200g", "ethernet-100gbe"} <= set(catalog.list_fabrics())
    assert {"cost-model-primitives", "cost-model-collectives", "cost-model-memory",
            "cost-model-attention", "cost-model-recurrent", "cost-model-host-overheads"} <= \
        set(catalog.list_coefficient_sets())


def test_shipped_catalog_is_found_without_a_source_tree():
    """A non-editable install must carry its catalog (the data package jkernel_catalog)."""
    root = catalog.shipped_root()
    assert (root / "hardware" / "h100.yaml").is_file()
    assert (root / "coefficients" / "cost-model-primitives.yaml").is_file()


@pytest.mark.parametrize("model", catalog.list_models())
def test_model_documents_round_trip(model):
    """derive → load → write → load gives equal objects."""
    g = load_graph(catalog.catalog_root() / "models" / model / "graph.yaml", model)
    assert parse_graph(graph_to_dict(g)) == g


def _pools(name):
    inputs = jkernel.open_inputs(name)
    return list(range(len(inputs.deployment.pools)))


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_prices_and_sizes(name, capsys):
    """`jkernel price` and `jkernel memory` run on every shipped scenario."""
    assert main(["price", name, "--batch", "8x1@2048,1x512@0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows if isinstance(rows, list) else [rows]
    assert len(rows) == len(_pools(name))
    for row in rows:
        assert math.isfinite(row["expected_s"]) and row["no_overlap_s"] >= row["overlap_s"] > 0
    assert main(["memory", name, "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    for row in (mem if isinstance(mem, list) else [mem]):
        assert row["kv_pages"] > 0 and row["page_bytes"] > 0


def test_open_refuses_a_disaggregated_bundle_naming_open_pool():
    with pytest.raises(jkernel.Refusal, match="open_pool"):
        jkernel.open("llama-3.1-70b-h200-disagg")
    assert jkernel.open_pool("llama-3.1-70b-h200-disagg", "decode").pool().role == "decode"


def test_cli_price_prints_expected_first(capsys):
    assert main(["price", "llama-3.1-70b-h100-tp4", "--batch", "32x1@4096"]) == 0
    out = capsys.readouterr().out.splitlines()
    labels = [line.split()[0] for line in out[2:5]]
    assert labels == ["expected", "overlap", "no_overlap"]
    assert out[-1].split() == ["bottleneck", "hbm"]


def test_cli_memory_deepseek_v3_page():
    """vectors.md §3.1 from the command line: DeepSeek-V3 H200 fp8 TP 8: 35,136 B per token,
    562,176 B page."""
    out = subprocess.run([sys.executable, "-m", "jkernel", "memory", "deepseek-v3-h200-fp8-tp8"],
                         capture_output=True, text=True, check=True).stdout
    assert "35,136 B" in out and "562,176 B" in out


def test_cli_catalog_lists(capsys):
    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    for name in CHIPS + MODELS:
        assert f"  {name}\n" in out


def test_cli_refusal_is_reported_not_raised(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((catalog.catalog_root() / "scenarios" / "llama-3.1-8b-h100-tp1.yaml")
                   .read_text().replace("pp: 1", "pp: 2").replace("gpus_per_node: 1",
                                                                   "gpus_per_node: 2"))
    assert main(["price", str(bad), "--batch", "1x1@10"]) == 2
    assert "R13" in capsys.readouterr().err


def test_cli_derive_prints_a_graph(capsys):
    cfg = catalog.catalog_root() / "models" / "llama-3.1-8b-instruct" / "config.json"
    assert main(["derive", str(cfg), "--name", "llama-3.1-8b-instruct"]) == 0
    assert "kind: ModelGraph" in capsys.readouterr().out


def test_readme_worked_example_by_hand():
    """The README's worked step: every resource of `jkernel price llama-3.1-70b-h100-tp4
    --batch 32x1@4096` recomputed by hand from the kernel's own constants."""
    from jkernel import laws

    k = jkernel.open("llama-3.1-70b-h100-tp4")
    p = {n: float(v) for n, v in k.params.items()}
    # the compute rate the engine sustains (compute_derate, fitted from H100 step traces)
    P = p["peak_flops_per_s"] * p["compute_derate"]
    B = p["hbm_bytes_per_s"] * p["hbm_derate"]
    eps, mh, nh, kh = (p.get(n, 0.0) for n in k.plan.gemm_names)
    est = k.step_time(jkernel.Batch.from_spec("32x1@4096"))
    params_per_layer = (10240 + 8192 + 57344) * 8192 + 8192 * 28672
    head_params = 128256 * 8192
    weights = params_per_layer * 2 / 4 / B
    kv = p["attention_decode_floor"] + 32 * 4097 * (2 * 2 * 128 * 2) / p["attention_decode_rate"]
    norms = 32 * 2 * (2 * 8192 * 2) / 4 / B
    hbm = 80 * (weights + kv + norms) + head_params * 2 / 4 / B
    assert est.per_resource_s["hbm"] == pytest.approx(hbm, rel=1e-9)
    gemms = [(2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168)]   # per-rank (n, k)
    if k.plan.shape_aware:
        eff = [float(laws.eff_shaped(32, n, kk, eps, mh, nh, kh)) for n, kk in gemms]
    else:
        eff = [float(laws.ramp(32, eps, mh))] * 4
    sm = 80 * sum(32 * 2 * n * kk / (P * e) for (n, kk), e in zip(gemms, eff))
    sm += 32 * 2 * head_params / 4 / (P * float(laws.ramp(32, eps, mh)))
    assert est.per_resource_s["sm"] == pytest.approx(sm, rel=1e-9)
    ar = [p[n] for n in ("collective_floor_all_reduce_fp16_4rank_h100",
                         "collective_peak_rate_all_reduce_fp16_4rank_h100",
                         "collective_transition_rate_all_reduce_fp16_4rank_h100")]
    one = max(ar[0] + 524288 / ar[2], 524288 / ar[1])
    assert est.per_resource_s["nvlink"] == pytest.approx(160 * one, rel=1e-9)
    host = p["host_replay_graph_per_step"] + p["host_launch_per_kernel"] * 802
    assert est.per_resource_s["host"] == pytest.approx(host, rel=1e-12)
    assert est.bottleneck_name == "hbm"
