"""The example simulator takes its clock, KV pages and scheduler limits from the kernel.

Each test writes a modified copy of a bundle to ``tmp_path`` and checks that the simulator
changes the way the kernel says it should.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jkernel  # noqa: E402
from examples import simulator as S  # noqa: E402

SMALL = ROOT / "catalog" / "scenarios" / "llama-3.1-8b-h100-tp1.yaml"
DISAGG = ROOT / "catalog" / "scenarios" / "llama-3.1-70b-h200-disagg.yaml"


def bundle_with(tmp_path: Path, source: Path = SMALL, pool: int = 0, **engine) -> Path:
    """A copy of ``source`` whose pool ``pool`` has ``engine`` settings replaced."""
    scenario, deployment = yaml.safe_load_all(source.read_text())
    deployment["pools"][pool].setdefault("engine", {}).update(engine)
    name = "-".join(f"{k}-{v}" for k, v in engine.items()) or "copy"
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump_all([scenario, deployment], sort_keys=False))
    return out


def one_request(prompt: int, output: int) -> list[S.Request]:
    return [S.Request(0, 0, prompt, output)]


# -- limits and pages come from the kernel ----------------------------------------------------

def test_block_size_sets_pages(tmp_path):
    pools = {}
    for block in (16, 32):
        sim = S.build_colocated(bundle_with(tmp_path, block_size=block))
        pool = sim.entry
        k = pool.kernel
        assert pool.block_size == k.settings["block_size"] == block
        assert pool.page_bytes == k.page_bytes() == k.sequence_variable_bytes(block)
        assert pool.pages == k.kv_cache_pages() > 0
        assert pool.pages_for(100) == math.ceil(100 / block)
        assert pool.engines[0].replicas[0].free_pages == pool.pages
        pools[block] = pool
    # Twice the block size: pages twice as large, about half as many of them.
    assert pools[32].page_bytes == 2 * pools[16].page_bytes
    assert pools[32].pages == pytest.approx(pools[16].pages / 2, abs=1)


def test_memory_utilization_sets_pages_and_forces_preemption(tmp_path):
    base = S.build_colocated(SMALL)
    k = base.entry.kernel
    assert base.entry.pages == k.kv_cache_pages()
    # A utilisation that leaves room for about 200 pages (3,200 tokens) after fixed bytes.
    util = (k.fixed_bytes().total() + 200.5 * k.page_bytes()) / k.inputs.chip.memory_bytes
    tight = S.build_colocated(bundle_with(tmp_path, gpu_memory_utilization=round(util, 6)))
    assert tight.entry.pages == tight.entry.kernel.kv_cache_pages()
    assert 150 <= tight.entry.pages <= 250 < base.entry.pages

    def burst():   # 16 requests at once needing 16 · (512 + 128) tokens ≫ 3,200
        return [S.Request(i, i, 512, 128) for i in range(16)]

    roomy = base.run(burst()).summary()
    squeezed = tight.run(burst()).summary()
    assert roomy["preemptions"] == 0
    assert squeezed["preemptions"] > 0
    assert squeezed["completed"] == 16
    replica = tight.entry.engines[0].replicas[0]
    assert replica.free_pages == tight.entry.pages and not replica.running


def test_max_num_seqs_and_token_budget_bound_every_step(tmp_path):
    sim = S.build_colocated(bundle_with(tmp_path, max_num_seqs=4, max_num_batched_tokens=512))
    assert sim.entry.max_num_seqs == sim.entry.kernel.settings["max_num_seqs"] == 4
    assert sim.entry.max_num_batched_tokens == 512
    reqs = [S.Request(i, 0, 300, 8) for i in range(10)]
    res = sim.run(reqs)
    assert res.summary()["completed"] == 10
    assert max(s.requests for s in res.steps) == 4
    assert max(s.tokens for s in res.steps) <= 512
    assert any(s.tokens == 512 for s in res.steps)        # chunked prefill fills the budget


# -- the clock ---------------------------------------------------------------------------------

@pytest.mark.parametrize("clock", ["expected_s", "no_overlap_s"])
def test_clock_is_the_kernels_step_time(clock):
    sim = S.build_colocated(SMALL, clock=clock)
    k = sim.entry.kernel
    prompt, output = 100, 3
    req = sim.run(one_request(prompt, output)).requests[0]

    def step(s, c):
        return S.step_ticks(getattr(k.step_time(jkernel.Batch([s], [c])), clock))

    adm = S.ticks(k.admission_overhead(prompt))
    out = S.ticks(k.output_token_overhead())
    d = [step(prompt, 0), step(1, prompt), step(1, prompt + 1)]
    assert req.first_token_us == adm + d[0] + out
    assert req.last_token_us == adm + sum(d) + out
    assert req.finish_us == req.last_token_us + S.ticks(k.completion_overhead())
    assert req.tpot_us == (d[1] + d[2]) / 2


def test_ticks_are_whole_microseconds_never_zero():
    assert S.ticks(1.5e-6) == 2 and S.ticks(2.5e-6) == 3       # half up, not half to even
    assert S.step_ticks(0.0) == 1 and S.step_ticks(1e-9) == 1
    assert S.step_ticks(0.0123456) == 12346


def test_clocks_differ():
    a = S.build_colocated(SMALL, clock="expected_s").run(one_request(2000, 4)).requests[0]
    b = S.build_colocated(SMALL, clock="no_overlap_s").run(one_request(2000, 4)).requests[0]
    assert a.finish_us != b.finish_us


# -- disaggregated -----------------------------------------------------------------------------

def test_disaggregated_pools_and_transfer():
    sim = S.build_disaggregated(DISAGG)
    pre, dec = sim.pools
    assert (pre.role, dec.role) == ("prefill", "decode")
    assert pre.max_num_seqs == pre.kernel.settings["max_num_seqs"] == 64
    assert dec.max_num_seqs == dec.kernel.settings["max_num_seqs"] == 512
    assert len(pre.engines) == 2 and len(dec.engines) == 1     # 8 GPUs as 2×tp4, 1×tp8
    assert {e.node for e in pre.engines} == {0} and dec.engines[0].node == 1
    prompt = 1000
    req = sim.run(one_request(prompt, 2)).requests[0]
    kp, kd = pre.kernel, dec.kernel
    xfer = S.ticks(kp.pd_transfer_time(prompt, jkernel.Placement(node=0),
                                       jkernel.Placement(node=1)))
    assert xfer > 0
    prefill = S.step_ticks(kp.step_time(jkernel.Batch([prompt], [0])).expected_s)
    first = S.step_ticks(kd.step_time(jkernel.Batch([1], [prompt - 1])).expected_s)
    expect = (S.ticks(kp.admission_overhead(prompt)) + prefill + xfer
              + S.ticks(kd.admission_overhead(prompt)) + first
              + S.ticks(kd.output_token_overhead()))
    assert req.first_token_us == expect
    # Every page on both sides is back when the run ends.
    for pool in sim.pools:
        for e in pool.engines:
            for r in e.replicas:
                assert r.free_pages == pool.pages


# -- a small deterministic run -----------------------------------------------------------------

def test_small_run_is_deterministic_and_sane():
    def run():
        sim = S.build_colocated(SMALL)
        reqs = S.poisson_workload(120, rate=6.0, prompt_mean=512, output_mean=64, seed=7)
        return sim.run(reqs).summary()

    a, b = run(), run()
    assert a == b
    assert a["completed"] == 120 and a["rejected"] == 0
    assert 0 < a["ttft_p50_ms"] <= a["ttft_p90_ms"] < 5_000
    assert 0 < a["tpot_p50_ms"] <= a["tpot_p90_ms"] < 200
    # Below saturation the pool keeps up with the offered load (6 requests/s).
    assert a["requests_per_s"] == pytest.approx(6.0, rel=0.25)
    assert a["output_tokens_per_s"] == pytest.approx(6.0 * 64, rel=0.25)


def test_workload_is_seeded():
    w1 = S.poisson_workload(50, 10.0, seed=3)
    w2 = S.poisson_workload(50, 10.0, seed=3)
    w3 = S.poisson_workload(50, 10.0, seed=4)
    key = lambda w: [(r.arrival_us, r.prompt, r.output) for r in w]  # noqa: E731
    assert key(w1) == key(w2) != key(w3)
    assert w1[0].arrival_us == 0
    assert all(a.arrival_us <= b.arrival_us for a, b in zip(w1, w1[1:]))
