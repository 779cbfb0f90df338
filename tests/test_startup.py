"""The engine's start-up check (jkernel.startup): the pages one request holds, the longest
request that fits, and the refusal vLLM v0.31.0 stops at start-up with."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest

import jkernel
from conftest import ROOT, bundle_with
from jkernel import startup

QWEN = ROOT / "catalog" / "scenarios" / "qwen3-14b-h100-tp1.yaml"
NEMOTRON = ROOT / "catalog" / "scenarios" / "nemotron-3-nano-30b-a3b-h100-fp8-tp1-cache-all.yaml"


@lru_cache(maxsize=None)
def built(source: Path = QWEN, **engine) -> jkernel.Kernel:
    """``jkernel.new`` of ``source`` with engine settings changed (``new`` never refuses)."""
    import tempfile

    doc = bundle_with(Path(tempfile.mkdtemp()), source, **engine) if engine else source
    return jkernel.new(jkernel.open_inputs(doc))


def test_request_pages_of_a_paged_cache_are_whole_blocks():
    k = built()
    block = k.plan.block_size
    assert k.sequence_fixed_bytes() == 0
    for tokens in (0, 1, block, block + 1, 1000, 40960):
        assert startup.request_pages(k, tokens) == math.ceil(tokens / block)


def test_request_pages_add_the_recurrent_state_of_a_hybrid_model():
    """memory.md §5: each running sequence's recurrent state outside the pages (align mode)
    is charged against the same pages, whole pages; in `all` mode it is inside the KV."""
    align = built(NEMOTRON, mamba_cache_mode="align")
    page, fixed = align.page_bytes(), align.sequence_fixed_bytes()
    assert fixed > 0
    for tokens in (1, 17, 5000):
        want = (math.ceil(align.sequence_variable_bytes(tokens) / page)
                + math.ceil(fixed / page))
        assert startup.request_pages(align, tokens) == want
    everything = built(NEMOTRON)
    assert everything.sequence_fixed_bytes() == 0
    assert startup.request_pages(everything, 17) == math.ceil(
        everything.sequence_variable_bytes(17) / everything.page_bytes())


@pytest.mark.parametrize("pages", [0, 1, 7, 300])
def test_longest_fitting_request_is_the_edge_of_the_fit(pages):
    for k in (built(), built(NEMOTRON, mamba_cache_mode="align")):
        longest = startup.longest_fitting_request(k, pages)
        if longest == 0:
            assert startup.request_pages(k, 1) > pages
        else:
            assert startup.request_pages(k, longest) <= pages
            assert startup.request_pages(k, longest + 1) > pages


def test_a_roomy_pool_starts():
    k = built()
    assert startup.start_refusal(k) is None
    assert startup.start_refusal(k, max_model_len=k.settings.max_model_len) is None
    startup.check_start(k, max_model_len=k.settings.max_model_len)


def test_a_max_model_len_the_cache_cannot_hold_is_refused_naming_the_longest_that_fits():
    k = built()
    pages, block = k.kv_cache_pages(), k.plan.block_size
    assert startup.start_refusal(k, max_model_len=pages * block) is None
    too_long = pages * block + 1
    r = startup.start_refusal(k, max_model_len=too_long, pool="pools[0]")
    assert (r.code, r.field, r.file) == ("FIT", "pools[0].engine.max_model_len", str(QWEN))
    assert f"max_model_len {too_long} needs {pages + 1} KV pages" in r.reason
    assert f"only {pages} fit" in r.reason and f"about {pages * block:,} tokens" in r.reason
    planner = startup.start_refusal(k, max_model_len=too_long, pool="pools[1]",
                                    what="a workload request")
    assert planner.field == "pools[1]"
    assert planner.reason.startswith(f"a workload request of {too_long} tokens needs")
    assert "lower the request length" in planner.reason
    with pytest.raises(jkernel.Refusal, match="would not start") as exc:
        startup.check_start(k, max_model_len=too_long)
    assert exc.value.field is None


def test_no_kv_page_left_is_refused_naming_the_utilization():
    k = built(gpu_memory_utilization=0.2)                # 28 GiB of weights on 0.2 · 80 GiB
    assert k.kv_cache_pages() == 0
    r = startup.start_refusal(k, pool="pools[0]")
    assert (r.code, r.field) == ("FIT", "pools[0].engine.gpu_memory_utilization")
    assert "no memory is left for the KV cache blocks" in r.reason
    assert "raise gpu_memory_utilization" in r.reason


def test_open_checks_a_stated_utilization_against_the_stated_max_model_len():
    """``jkernel.open`` holds a stated gpu_memory_utilization to the start-up check, with
    the stated max_model_len; an assumed utilization (the spec's vectors) is priced."""
    k = built()
    fit = (k.fixed_bytes().total() + 100.5 * k.page_bytes()) / k.device_memory_bytes()
    tight = built(gpu_memory_utilization=round(fit, 6), max_model_len=100 * 16)
    startup.check_opened(tight)
    longer = built(gpu_memory_utilization=round(fit, 6), max_model_len=101 * 16 + 1)
    with pytest.raises(jkernel.Refusal, match="max_model_len 1617 needs 102 KV pages"):
        startup.check_opened(longer)
    with pytest.raises(jkernel.Refusal, match="max_model_len 1617"):
        jkernel.open(longer.inputs.bundle_file)
    assumed = built(NEMOTRON)
    assert assumed.assumption("gpu_memory_utilization") is not None
    startup.check_opened(assumed)
