"""The serving-runs study (validation/serving_runs.py) on its committed excerpt.

Runs on a fresh clone: the excerpt under tests/data/serving-runs/ (a Llama-2-7b trainval run's
first 60 requests of each load stage with its runs.csv rows, the first 60 requests of the
llm-d 4 req/s load point, the first 60 of the LLMServingSim RTX 4090 run) keeps the shared
folder's layout, so the study's own discovery, conversion, replay and comparison run on it
unchanged. The figures of the full data set are validation/BASELINE.md's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from jkernel.calibration.data.serving import read_conversations
from validation import serving_runs as S

EXCERPT = Path(__file__).resolve().parent / "data" / "serving-runs"
TRAINVAL_RUN = "20260217-155451-llama-2-7b-tp1-codegen"


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return S.baseline(EXCERPT)


@pytest.fixture(scope="module")
def llama2():
    return S.open_kernel("llama-2-7b-h100-tp1-vllm0.15")


def test_discover_finds_each_source_of_the_excerpt():
    runs = S.discover(EXCERPT)
    assert [(r.source, r.run) for r in runs] == [
        ("trainval", TRAINVAL_RUN), ("llm-d", "4 req/s"),
        ("llmservingsim", "RTX4090_Llama-3.1-8B")]
    assert all(r.bundle.is_file() for r in runs)
    assert S.discover(EXCERPT, ("llm-d",)) == runs[1:2]
    assert S.discover(EXCERPT, runs=["RTX4090_Llama-3.1-8B"]) == runs[2:]


def test_every_run_of_the_data_set_has_a_bundle_that_opens():
    """Every deployment the study names is a bundle under validation/scenarios that resolves
    on the shipped catalog (with the engine version and chip its comment states)."""
    names = set(S.TRAINVAL.values()) | set(S.LLMSERVINGSIM.values()) | {S.LLMD}
    assert names == {p.stem for p in S.SCENARIOS.glob("*.yaml")}
    for name in sorted(names):
        sc, dep = yaml.safe_load_all((S.SCENARIOS / f"{name}.yaml").read_text())
        assert sc["name"] == dep["name"] == name
        k = S.open_kernel(name)
        assert k.kv_cache_pages() > 0, name
        assert k.settings.block_size == 16
        eng = dep["pools"][0]["engine"]
        assert k.settings.max_num_batched_tokens == eng["max_num_batched_tokens"], name
        assert k.settings.max_num_seqs == eng["max_num_seqs"], name


def test_baseline_compares_every_group_as_predicted_over_measured(table):
    assert list(zip(table["source"], table["group"])) == [
        ("trainval", "stage 0 (5 req/s)"), ("trainval", "stage 1 (10 req/s)"),
        ("llm-d", "all"), ("llmservingsim", "all")]
    assert (table["replayed"] == [60, 60, 60, 60]).all()
    assert (table["rejected"] == 0).all()
    for m in S.METRICS:
        np.testing.assert_allclose(table[f"{m}_error"],
                                   table[f"{m}_predicted"] / table[f"{m}_measured"] - 1)
        assert (table[f"{m}_predicted"] > 0).all(), m
    assert set(table["split"]) <= {"fit", "held-out"}
    assert list(table["chip"]) == ["h100", "h100", "h100", "rtx-4090"]
    assert list(table["family"]) == ["llama-2", "llama-2", "llama-4 (MoE)", "llama-3.1"]


def test_per_request_sources_are_measured_from_their_own_rows(table):
    """llm-d and LLMServingSim: the measured side is computed from the replayed rows' own
    timings (TTFT including the engine's queueing, ITL as (E2E − TTFT) / (output − 1) of the
    means), so a limited replay compares like with like."""
    for source, path in (("llm-d", "llm-d-lmbench/exp4_scout_fp8_tp4_h100/"
                                   "LMBench_sharegpt_output_4.csv"),
                         ("llmservingsim", "llmservingsim/RTX4090_Llama-3.1-8B/requests.csv")):
        raw = pd.read_csv(EXCERPT / path)
        row = table[table["source"] == source].iloc[0]
        ttft, e2e = raw["ttft_us"] / 1e6, raw["e2e_us"] / 1e6
        assert row["ttft_mean_measured"] == pytest.approx(ttft.mean())
        assert row["e2e_p90_measured"] == pytest.approx(np.percentile(e2e, 90))
        assert row["itl_mean_measured"] == pytest.approx(
            (e2e.mean() - ttft.mean()) / (raw["output_tokens"].mean() - 1))
    q = pd.read_csv(EXCERPT / "llmservingsim/RTX4090_Llama-3.1-8B/requests.csv")
    assert (q["ttft_us"] >= q["queue_us"]).all()


def test_trainval_itl_divides_by_the_servers_output_length():
    """The three Llama-2-7b training runs' client counted ~195 of the 247 tokens the server
    generated; with the server's count the stage ITL is training_stages.csv's
    itl_ms_spec_tokens, not runs.csv's client-count itl_mean_ms (about 20 % higher)."""
    run = S.discover(EXCERPT, ("trainval",))[0]
    m = S.measured(run, EXCERPT)
    spec = pd.read_csv(EXCERPT / "inference-sim-trainval" / "training_stages.csv")
    spec = spec[spec["stage"].str.startswith("stage_")].sort_values("stage")
    np.testing.assert_allclose(m["itl_mean"] * 1e3, spec["itl_ms_spec_tokens"], rtol=1e-9)
    client = pd.read_csv(EXCERPT / "inference-sim-trainval" / "runs.csv")
    client = client[client["stage_index"] >= 0].sort_values("stage_index")
    assert (client["itl_mean_ms"].to_numpy() / (m["itl_mean"].to_numpy() * 1e3) > 1.2).all()


def test_prefix_hypotheses_build_the_hashes_they_describe():
    run = S.discover(EXCERPT, ("trainval",))[0]
    none = S.requests_for(run, prefix="none")
    assert "prefix_group" not in none and "block_hashes" not in none
    system = S.requests_for(run, prefix="system")
    assert (system["prefix_length"] == system["shared_prefix_tokens"]).all()
    prompt = S.requests_for(run, prefix="prompt")
    blocks = [h.split() for h in prompt["block_hashes"]]
    assert all(len(b) == n // 16 for b, n in zip(blocks, prompt["input_tokens"]))
    seen = {}
    for b, pid, grp in zip(blocks, prompt["prompt_id"], system["prefix_group"]):
        for (opid, ogrp), other in seen.items():
            shared = next((j for j, (x, y) in enumerate(zip(b, other)) if x != y), len(b))
            want = len(b) if opid == pid else 100 // 16 if ogrp == grp else 0
            assert shared == want, (pid, opid)
        seen[(pid, grp)] = b
    assert len(seen) < len(blocks)                # the excerpt repeats some prompts
    with pytest.raises(ValueError, match="prefix must be one of"):
        S.requests_for(run, prefix="half")


def test_prefix_hypotheses_order_the_cache_hits(llama2):
    """Whole-prompt hits cache more than system-prompt hits, which cache more than none;
    a hit can only shorten the mean TTFT of the same requests."""
    run = S.discover(EXCERPT, ("trainval",))[0]
    out = {p: S.replay_run(run, EXCERPT, llama2, prefix=p)[0] for p in S.PREFIXES}
    cached = [out[p]["cached_fraction"].iloc[0] for p in S.PREFIXES]
    assert cached[0] == 0 < cached[1] < cached[2]
    ttft = [out[p]["ttft_mean_predicted"].iloc[0] for p in S.PREFIXES]
    assert ttft[0] >= ttft[1] >= ttft[2]


def test_held_out_is_a_third_of_each_source_by_run_hash():
    names = [f"run-{i}" for i in range(15)]
    out = S.held_out("trainval", names)
    assert len(out) == 5 and out <= set(names)
    assert S.held_out("trainval", list(reversed(names))) == out          # order-free
    assert S.held_out("llm-d", names) != out                            # keyed by source
    assert len(S.held_out("llm-d", [f"{r} req/s" for r in range(28)])) == 9
    assert len(S.held_out("llmservingsim", list(S.LLMSERVINGSIM))) == 1
    full = sorted(S.TRAINVAL)
    assert len(S.held_out("trainval", full)) == 5


def test_the_fixed_split_of_the_data_set_is_the_one_in_baseline_md():
    """The held-out runs are fixed by the rule before any fit; BASELINE.md lists them."""
    text = (Path(S.__file__).parent / "BASELINE.md").read_text()
    llmd = [f"{q:g} req/s" for q in (4, 5, 8, 10, 12, 15, 16, 20, 24, 25, 28, 30, 32, 35, 36,
                                     40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 100)]
    for source, names in (("trainval", S.TRAINVAL), ("llm-d", llmd),
                          ("llmservingsim", S.LLMSERVINGSIM)):
        for name in S.held_out(source, list(names)):
            assert f"`{name}`" in text, (source, name)


def test_markdown_names_every_source_and_the_medians(table):
    text = S.markdown(table)
    for head in ("### trainval", "### llm-d", "### llmservingsim", "### Medians per source",
                 "### Medians per chip", "### Medians per family"):
        assert head in text
    med = S.medians(table, "source")
    row = med[(med["source"] == "trainval") & (med["split"] == "all")].iloc[0]
    assert row["rows"] == 2
    assert row["e2e_mean_median"] == pytest.approx(
        table[table["source"] == "trainval"]["e2e_mean_error"].median())


def test_family_names_the_catalog_models_of_the_runs():
    assert S.family("llama-4-scout-17b-16e-instruct-fp8-dynamic") == "llama-4 (MoE)"
    assert S.family("qwen3-30b-a3b") == "qwen3 (MoE)"
    assert S.family("qwen3-32b") == "qwen3"
    assert S.family("llama-3.1-70b-instruct") == "llama-3.1"
    assert S.family("unknown-model") == "unknown-model"


def test_main_refuses_a_missing_folder(tmp_path, capsys):
    assert S.main(["--data", str(tmp_path / "nope"), "--quiet"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_llmd_load_points_are_sent_as_lmbench_sent_them():
    """The llm-d files are LMBench's ShareGPT workload (validation/workloads/README.md): 55
    conversations, their round-2 prompts as a warm-up, then rounds 3, 4, … round by round;
    the replay sends the warm-up first and keys every prompt by its conversation."""
    conv = read_conversations(S.LLMD_CONVERSATIONS)
    warm, run = conv[conv["phase"] == "warm-up"], conv[conv["phase"] == "run"]
    assert len(warm) == 55 and len(run) == 252
    assert sorted(warm["conversation"]) == list(range(55)) == sorted(set(run["conversation"]))
    assert list(run["request_id"]) == [str(i) for i in range(252)]
    for _, turns in run.groupby("conversation"):                 # round by round
        assert list(turns["round"]) == list(range(3, 3 + len(turns)))
    assert (warm["input_tokens"] > 0).all() and (warm["output_tokens"] > 0).all()

    (llmd,) = S.discover(EXCERPT, ("llm-d",))
    df = S.requests_for(llmd)
    assert df["warm_up"].sum() == 55 and (~df["warm_up"]).sum() == 60
    assert df["warm_up"].iloc[:55].all()                          # sent first
    live = df[~df["warm_up"]]
    assert list(live["prefix_group"]) == list(run["conversation"].iloc[:60])
