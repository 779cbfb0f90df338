"""KV capacity against vLLM's own start-up reports (tests/data/kv_capacity.csv).

Each row is one real vLLM server start: its model, chip, parallelism, engine settings and
version, and the figures its log printed (``GPU KV cache size``, ``Available KV cache
memory``, ``Model loading took``). The kernel is opened on the catalog with the row's
engine_version, so the version-selected memory rules of jkernel/memory.py apply. Where a log
quotes no token count, the reported KV memory is turned into tokens at the row's own page
(floor(bytes / page) · block), which compares the budget alone.

Bounds: median |predicted/reported − 1| of KV tokens ≤ 2 %; every row within 5 %
unless its notes column explains the miss (then it is only reported); the weights term
within 1 % of ``Model loading took`` unless the notes explain it. Nothing is fitted per row:
the rules are general and each names the vLLM version it follows.

The ``fed_constants`` column names the constants of jkernel/memory.py (or the rule) that a
row's figures were used to choose; rows with it empty fed none and form the held-out set,
whose error is reported and bound separately from the whole table's.
"""

from __future__ import annotations

import csv
import json
import dataclasses
import math
import statistics
from pathlib import Path

import pytest

import jkernel
from jkernel import memory as M
from jkernel import startup
from jkernel.documents import parse_bundle

TABLE = Path(__file__).resolve().parent / "data" / "kv_capacity.csv"
CATALOG = Path(__file__).resolve().parents[1] / "catalog"
SETS = ["cost-model-primitives", "cost-model-collectives", "cost-model-host-overheads",
        "cost-model-attention", "cost-model-recurrent", "cost-model-memory"]
GIB = 2 ** 30
COLUMNS = ("id", "model", "hf_model", "gpu", "tp", "dp", "ep", "dtype", "quantization",
           "kv_cache_dtype", "gpu_memory_utilization", "max_model_len",
           "max_num_batched_tokens", "max_num_seqs", "block_size", "cudagraph_mode",
           "vllm_version", "reported_kv_tokens", "reported_gpu_blocks",
           "reported_available_kv_gib", "reported_model_loading_gib",
           "reported_max_concurrency", "fed_constants", "url", "notes")
# Words in a row's notes that mark an explained miss (a layout or override jkernel does not
# model); such a row is reported but not bound to 5 %.
EXPLAINED = ("not modelled", "jkernel does not model")
# Catalog models whose graphs have latent attention; the coverage test opens only their rows
# and checks the graph really has it (opening every row would double the module's time).
_MLA_CANDIDATES = ("deepseek-v3", "deepseek-v3.2", "kimi-k2.5", "kimi-k3", "glm-5")


def _rows() -> list[dict]:
    with TABLE.open(newline="") as f:
        return list(csv.DictReader(f))


def bundle(row: dict):
    """The row as a (Scenario, Deployment) pair on the shipped catalog."""
    eng = {"block_size": int(row["block_size"]),
           "max_num_batched_tokens": int(row["max_num_batched_tokens"]),
           "max_num_seqs": int(row["max_num_seqs"]), "max_model_len": int(row["max_model_len"]),
           "gpu_memory_utilization": float(row["gpu_memory_utilization"]),
           "cudagraph_mode": row["cudagraph_mode"]}
    if row["quantization"]:
        eng["quantization"] = row["quantization"]
    if row["kv_cache_dtype"] not in ("", "auto"):
        eng["cache_dtype"] = row["kv_cache_dtype"]
    tp, dp = int(row["tp"]), int(row["dp"])
    par = {"tp": tp, "pp": 1, "dp": dp}
    if int(row["ep"]):
        par["enable_expert_parallel"] = True
    sc = {"kind": "Scenario", "name": row["id"], "model": row["model"], "coefficients": SETS,
          "engine_version": row["vllm_version"],
          "cluster": {"hardware": row["gpu"], "nodes": 1, "gpus_per_node": tp * dp}}
    dep = {"kind": "Deployment", "name": row["id"],
           "pools": [{"role": "colocated", "nodes": 1, "parallel": par, "engine": eng}]}
    return sc, dep


_DOCUMENTS: dict = {}


def open_row(row: dict) -> jkernel.Kernel:
    """``open_row(row)`` on the shipped catalog; rows naming the same graph and
    chip share the parsed documents (immutable; YAML parsing is most of a construction)."""
    sc, dep = bundle(row)
    key = (sc["model"], repr(sc["cluster"]))
    if key not in _DOCUMENTS:
        _DOCUMENTS[key] = jkernel.open_inputs(
            (sc, dep), jkernel.Repos(catalog=CATALOG, registry=CATALOG))
    scenario, deployment = parse_bundle((sc, dep))
    return jkernel.new(dataclasses.replace(_DOCUMENTS[key], scenario=scenario,
                                           deployment=deployment, pool_index=0))


def compare(row: dict) -> dict:
    k = open_row(row)
    block, page = k.plan.block_size, k.page_bytes()
    predicted = k.kv_cache_pages() * block
    if row["reported_kv_tokens"]:
        reported = int(row["reported_kv_tokens"])
    else:
        reported = math.floor(float(row["reported_available_kv_gib"]) * GIB / page) * block
    out = {"id": row["id"], "predicted": predicted, "reported": reported,
           "error": predicted / reported - 1, "weights_error": None,
           "held_out": not row["fed_constants"].strip(),
           "explained": any(w in row["notes"] for w in EXPLAINED)}
    if row["reported_model_loading_gib"]:
        out["weights_error"] = (k.fixed_bytes().weights / GIB
                                / float(row["reported_model_loading_gib"]) - 1)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [compare(r) for r in _rows()]


def test_table_is_well_formed():
    """Every row has the columns, a public URL, a reported KV figure and a version from
    0.8 on; ids are unique."""
    rows = _rows()
    assert rows and tuple(rows[0]) == COLUMNS
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["url"].startswith("https://"), r["id"]
        assert r["reported_kv_tokens"] or r["reported_available_kv_gib"], r["id"]
        assert M.parse_version(r["vllm_version"]) >= (0, 8, 0), r["id"]
        assert 0 < float(r["gpu_memory_utilization"]) <= 1, r["id"]


def test_table_covers_enough_starts_models_chips_and_layouts():
    """At least 25 server starts, 8 models, 3 GPU kinds (a100-80 is a100-sxm),
    tp 1 to 8, vLLM versions from 0.8 on, fp8 weights or KV, a sliding-window model, an
    MLA model, and a held-out part that fed no constant."""
    rows = _rows()
    assert len(rows) >= 25, len(rows)
    assert len({r["model"] for r in rows}) >= 8
    chips = {{"a100-80": "a100-sxm"}.get(r["gpu"], r["gpu"]) for r in rows}
    assert len(chips) >= 3, chips
    assert {int(r["tp"]) for r in rows} >= {1, 2, 4, 8}
    assert min(M.parse_version(r["vllm_version"]) for r in rows) < (0, 9, 0)
    assert any(r["quantization"] == "fp8" or r["kv_cache_dtype"].startswith("fp8")
               for r in rows)
    assert any(r["model"].startswith("gpt-oss") for r in rows)      # sliding-window layers
    assert any(kind.attention is not None and kind.attention.kind.latent
               for r in rows for kind in open_row(r).plan.kinds      # latent (MLA) attention
               if r["model"] in _MLA_CANDIDATES), "no MLA row"
    assert sum(not r["fed_constants"].strip() for r in rows) >= len(rows) // 2


def _summary(rows: list[dict]) -> str:
    errs = [abs(r["error"]) for r in rows]
    return (f"{len(rows)} rows: median |err| {statistics.median(errs):.2%}, "
            f"max |err| {max(errs):.2%}")


def test_kv_tokens_median_within_two_percent(results):
    """The median |predicted/reported − 1| of KV tokens over the table ≤ 2 %."""
    errors = [abs(r["error"]) for r in results]
    print("\nKV tokens, all rows:", _summary(results))
    assert statistics.median(errors) <= 0.02, sorted(errors)


def test_held_out_rows_are_reported_and_bound(results):
    """The rows that fed no constant (``fed_constants`` empty), reported apart so the
    accuracy is not only that of the rows the constants were chosen on. The 2 % median
    is a bound on the whole table (the test above); the held-out median is printed
    with and without the rows whose notes explain a miss, and bound by the 5 % row limit
    (it measured 2.4 % with them and 2.0 % without at 28 rows, above the fitted rows'
    0.2 %: the held-out part is the honest figure)."""
    held = [r for r in results if r["held_out"]]
    fitted = [r for r in results if not r["held_out"]]
    plain = [r for r in held if not r["explained"]]
    assert len(held) >= len(results) // 2, "the table needs a held-out part"
    print("\nKV tokens, held-out:", _summary(held), "| held-out, unexplained:",
          _summary(plain), "| fitted:", _summary(fitted))
    assert statistics.median(abs(r["error"]) for r in plain) <= 0.05, \
        [(r["id"], round(r["error"], 4)) for r in plain]
    assert statistics.median(abs(r["error"]) for r in fitted) <= 0.02


def test_every_row_within_five_percent_or_explained(results):
    """Each row within 5 %, unless its notes explain the miss."""
    bad = [(r["id"], round(r["error"], 4)) for r in results
           if abs(r["error"]) > 0.05 and not r["explained"]]
    assert not bad


def test_weights_within_one_percent_of_model_loading(results):
    """The weights term within 1 % of the log's ``Model loading took`` where the
    log has it (rows whose notes explain a layout jkernel does not model are exempt)."""
    bad = [(r["id"], round(r["weights_error"], 4)) for r in results
           if r["weights_error"] is not None and abs(r["weights_error"]) > 0.01
           and not r["explained"]]
    assert not bad


def test_graph_memory_is_charged_only_from_v0_20():
    """vLLM v0.20.0 defaults VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS to 1, so the CUDA-graph
    estimate is part of the start-up budget; before it (v0.19.1 defaults it to 0) the graphs
    come out of the (1 − utilization) margin, so fixed_bytes charges none."""
    row = _rows()[0] | {"vllm_version": "0.19.1"}
    before = open_row(row).fixed_bytes()
    after = open_row(row | {"vllm_version": "0.20.0"}).fixed_bytes()
    assert before.cuda_graph == 0 < after.cuda_graph
    assert after.total() - before.total() == after.cuda_graph


def test_no_communicator_buffers_at_tp1():
    """A defect guard: the spec recipe charges NCCL-sized buffers at any width; vLLM v0.8+
    creates no communicator without a peer, so tp 1 carries only the cuBLAS-size base."""
    row = _rows()[0]
    one = open_row(row).fixed_bytes()
    two = open_row(row | {"tp": "2"}).fixed_bytes()
    assert one.comm_buffers == M.NON_TORCH_BASE_BYTES
    assert two.comm_buffers > one.comm_buffers


def test_budget_uses_the_reported_device_total():
    """Before v0.29 the budget is what CUDA reports (79.2 GiB on an H100), not 80 GiB."""
    row = _rows()[0]
    k = open_row(row)
    assert M.device_memory_bytes(k.memory_plan, k.inputs.chip) == pytest.approx(79.2 * GIB)
    spec = open_row(row | {"vllm_version": "0.31.0"})
    assert M.device_memory_bytes(spec.memory_plan, spec.inputs.chip) == 80 * GIB


def test_maximum_concurrency_follows_vllm_groups():
    """vLLM v0.10.1.1 logged 'Maximum concurrency for 16,384 tokens per request: 284.25x'
    for gpt-oss-120b at tp 4 with 2,640,144 tokens (165,009 pages of 16): 18 full layers need
    1,024 blocks per request, 18 sliding layers (window 128, 2048 batched tokens) 137, over
    the 2 · 165,009 group blocks. A full-attention model is pages / ceil(len / block)."""
    row = next(r for r in _rows() if r["id"] == "dennislee-gpt-oss-120b-a100-tp4")
    k = open_row(row)
    pages = int(row["reported_kv_tokens"]) // 16
    assert M.max_concurrency(k.memory_plan, pages, 16, 16384) == pytest.approx(284.25, abs=0.005)
    dense = open_row(_rows()[0])
    assert M.max_concurrency(dense.memory_plan, 1000, 128, 16000) == pytest.approx(1000 / 125)
    assert M.max_concurrency(dense.memory_plan, 0, 128, 16000) == 0.0


def test_sampler_peak_follows_the_version():
    """A defect guard: vLLM v0.17.0 replaced the sort in top-k/top-p by a Triton kernel (18
    B per logit against 38), which the v0.19.1 start of Qwen3-8B on an A100-40GB shows (0.67
    GiB more KV than v0.9.2); charging the sort at every version missed it by 3.5 %."""
    row = next(r for r in _rows() if r["id"] == "tokenkaki-qwen3-8b-a100-40-v0.19.1")
    old = open_row(row | {"vllm_version": "0.16.0"}).fixed_bytes().activation_peak
    new = open_row(row).fixed_bytes().activation_peak
    assert old == 256 * 151_936 * M.SAMPLER_BYTES_PER_LOGIT + 2048 * 4096 * 2
    scratch = 108 * 151_936 * 4                      # min(next_pow2(108), 108) SM rows
    assert new == 256 * 151_936 * M.TRITON_SAMPLER_BYTES_PER_LOGIT + scratch + 2048 * 4096 * 2


def test_weights_as_loaded_count_the_gemms_vllm_replicates_on_every_tp_rank():
    """vLLM v0.8+ keeps MLA's fused q_a/kv_a projection and the MoE router gate whole on each
    TP rank (ReplicatedLinear); the spec's weights divide every dense GEMM by tp. Kimi-K2
    shapes (bf16 attention, 61 layers of a 2112 x 7168 projection, 60 MoE layers of a
    384 x 7168 gate) at tp 8: 7/8 of those bytes come back on every rank (1.77 GiB), and the
    start-up charges them as weights; at tp 1 nothing is added. Guards the defect where the
    loaded weights of a tp-8 MLA start were 1.77 GiB low."""
    row = next(r for r in _rows() if r["id"] == "vllmrecipes-kimi-k2-thinking-h200-tp8")
    replicated = (61 * 2112 * 7168 * 2 + 60 * 384 * 7168 * 2) * (1 - 1 / 8)
    k8 = open_row(row)
    mem = k8.memory_plan
    assert abs(M._replicated_extra_bytes(k8.plan.kinds, tp=8) - replicated) < 2 ** 20
    assert k8.fixed_bytes().weights - mem.weights_bytes >= replicated - 2 ** 20
    k1 = open_row(row | {"tp": "1"})
    assert M._replicated_extra_bytes(k1.plan.kinds, tp=1) == 0


def test_cuda_context_is_charged_before_v0_9():
    """vLLM v0.8.x measured non-torch memory as total − free − torch, so the CUDA context
    counts; from v0.9.0 the snapshot is taken after the context exists."""
    row = next(r for r in _rows() if r["id"] == "ddiiwoong-qwen25-7b-l40s-bf16-v085")
    old = open_row(row).fixed_bytes().comm_buffers
    new = open_row(row | {"vllm_version": "0.9.2"}).fixed_bytes().comm_buffers
    assert old - new == M.CUDA_CONTEXT_BYTES


# -- the engine's start-up refusal: a pool vLLM would not start is refused at open ---------

def _bundle_with(row: dict, **engine):
    sc, dep = bundle(row)
    dep["pools"][0]["engine"].update(engine)
    return sc, dep


def test_no_kv_page_left_is_refused_at_open_with_the_engines_reason():
    """vLLM stops when no memory is left for the KV cache blocks, naming
    gpu_memory_utilization; jkernel.open refuses the same pool (code FIT, the field named),
    while the spec's recipe still gives 0 pages for it (memory.md §5, kv_cache_pages)."""
    row = next(r for r in _rows() if r["id"] == "llmd-qwen3-32b-h100-tp1")
    repos = jkernel.Repos(catalog=CATALOG, registry=CATALOG)
    doc = _bundle_with(row, gpu_memory_utilization=0.5)
    with pytest.raises(jkernel.Refusal) as exc:
        jkernel.open(doc, repos)
    assert exc.value.code == "FIT"
    assert exc.value.field == "pools[0].engine.gpu_memory_utilization"
    assert "no memory is left for the KV cache" in exc.value.reason
    assert "raise gpu_memory_utilization" in exc.value.reason
    k = jkernel.new(jkernel.open_inputs(doc, repos))
    assert k.kv_cache_pages() == 0
    assert startup.start_refusal(k).code == "FIT"


def test_a_max_model_len_the_cache_cannot_hold_is_refused_with_the_longest_that_fits():
    """vLLM refuses a max_model_len whose one request needs more KV cache than is left, and
    gives the needed and available GiB and an estimated longest length; so does open."""
    row = next(r for r in _rows() if r["id"] == "llmd-qwen3-32b-h100-tp1")
    repos = jkernel.Repos(catalog=CATALOG, registry=CATALOG)
    k = jkernel.open(bundle(row), repos)                    # 16,000 tokens fit
    pages, block = k.kv_cache_pages(), k.plan.block_size
    too_long = (pages + 1) * block
    with pytest.raises(jkernel.Refusal) as exc:
        jkernel.open(_bundle_with(row, max_model_len=too_long), repos)
    assert exc.value.code == "FIT" and exc.value.field == "pools[0].engine.max_model_len"
    assert f"max_model_len {too_long} needs {pages + 1} KV pages" in exc.value.reason
    assert f"only {pages} fit" in exc.value.reason
    assert f"about {pages * block:,} tokens" in exc.value.reason
    assert startup.start_refusal(k, max_model_len=pages * block) is None


def test_out_of_range_utilization_and_refused_block_size_name_the_setting():
    """gpu_memory_utilization outside (0, 1] and a block size vLLM refuses are refused
    before any memory is sized, naming the setting."""
    row = _rows()[0]
    repos = jkernel.Repos(catalog=CATALOG, registry=CATALOG)
    for util in (0.0, -0.1, 1.5):
        with pytest.raises(jkernel.Refusal) as exc:
            jkernel.open(_bundle_with(row, gpu_memory_utilization=util), repos)
        assert "gpu_memory_utilization" in str(exc.value)
    with pytest.raises(jkernel.Refusal) as exc:
        jkernel.open(_bundle_with(row, block_size=7), repos)
    assert "block_size" in str(exc.value)


@pytest.mark.parametrize("row_id, tp, engine, field, words", [
    # Llama-3.3-70B-FP8 at tp 1 on one H100: "Available KV cache memory: -1.44 GiB" and
    # "No available memory for the cache blocks" (llm-d empirical-vllm-memory-results.md,
    # vLLM 0.11.0, its failed run 4).
    ("llmd-llama33-70b-fp8-h100-tp2", 1, {}, "gpu_memory_utilization",
     "no memory is left for the KV cache"),
    # Qwen3-32B at max_model_len 32000 on one H100: 4.45 GiB available, one 32,000-token
    # request needs 7.8 GiB; the engine failed to start (the same study's failed Qwen3-32B run).
    ("llmd-qwen3-32b-h100-tp1", 1, {"max_model_len": 32000}, "max_model_len",
     "max_model_len 32000 needs"),
])
def test_the_starts_vllm_refused_are_refused(row_id, tp, engine, field, words):
    """Two starts the engine refused in the same study whose successful starts are rows of
    the table: jkernel.open refuses them too, naming the setting."""
    row = next(r for r in _rows() if r["id"] == row_id) | {"tp": str(tp)}
    repos = jkernel.Repos(catalog=CATALOG, registry=CATALOG)
    with pytest.raises(jkernel.Refusal) as exc:
        jkernel.open(_bundle_with(row, **engine), repos)
    assert exc.value.code == "FIT" and exc.value.field == f"pools[0].engine.{field}"
    assert words in exc.value.reason


def test_jkernel_memory_shows_the_comparison_terms(capsys):
    """`jkernel memory` prints the terms the table compares (weights,
    activation peak, graphs, buffers, what remains, pages, tokens), the version rules that
    chose them, and vLLM's Maximum concurrency for the deployment's max_model_len."""
    from jkernel.cli import main

    assert main(["memory", "qwen3-14b-h100-tp1"]) == 0
    out = capsys.readouterr().out
    for words in ("vLLM v0.23.0", "triton top-k/top-p", "CUDA-graph estimate charged",
                  "− weights", "− activation peak", "− CUDA graphs", "− buffers",
                  "remains for KV", "KV pages per rank", "KV tokens per rank",
                  "Maximum concurrency for 40,960 tokens per request"):
        assert words in out, words
    assert main(["memory", "qwen3-14b-h100-tp1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["rules_applied"]["sampler"].startswith("triton")
    assert row["kv_tokens"] == row["kv_pages"] * row["block_size"]


def test_an_assumed_utilization_is_priced_not_refused():
    """The spec's vectors open pools that overflow the budget at the utilization jkernel
    assumes when none is stated (D15): open prices them with 0 pages (memory.md §5); only a
    stated utilization is held to vLLM's start-up check."""
    row = next(r for r in _rows() if r["id"] == "llmd-llama33-70b-fp8-h100-tp2") | {
        "tp": "1", "quantization": ""}                      # 131 GiB of bf16 weights on 80
    sc, dep = bundle(row)
    del dep["pools"][0]["engine"]["gpu_memory_utilization"]
    k = jkernel.open((sc, dep), jkernel.Repos(catalog=CATALOG, registry=CATALOG))
    assert k.assumption("gpu_memory_utilization") is not None
    assert k.kv_cache_pages() == 0
    assert startup.start_refusal(k).code == "FIT"              # the replay and planner still ask
