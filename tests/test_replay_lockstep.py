"""The lockstep replay (jkernel.replay.lockstep): variants of one replay stepped together
reproduce the plain replay where they change nothing, reproduce a replay at scaled
constants exactly, and apply their regime factors, jitter and front-end time as stated."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel.regimes import (HOST_RESOURCE, REGIMES, Regime, classify, classify_one,
                             classify_row)
from jkernel.replay import replay, replay_disaggregated
from jkernel.replay.lockstep import Variant, lockstep_replay, paired_program



@pytest.fixture(scope="module")
def kernel():
    jkernel.enable_x64()
    return jkernel.open("qwen3-14b-h100-tp1")


def _requests(n=24, rate=4.0, prompt=300, output=24, seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"request_id": np.arange(n),
                         "arrival_s": np.cumsum(rng.exponential(1.0 / rate, n)),
                         "input_tokens": rng.integers(prompt // 2, prompt, n),
                         "output_tokens": rng.integers(output // 2, output, n)})


def _same(a, b):
    cols = ["ttft_s", "e2e_s", "first_token_s", "finish_s", "preemptions", "cached_tokens"]
    pd.testing.assert_frame_equal(a.requests[cols], b.requests[cols])
    assert a.summary == b.summary
    pd.testing.assert_frame_equal(a.steps, b.steps)


def test_a_variant_that_changes_nothing_is_the_plain_replay(kernel):
    reqs = _requests()
    plain = replay(kernel, reqs)
    out, ls = lockstep_replay([kernel], [reqs], [Variant(), Variant()])
    _same(plain, out[0])
    _same(plain, out[1])
    assert ls.iterations == plain.summary["steps"]


def test_scaled_constants_are_the_replay_of_a_kernel_with_those_constants(kernel):
    reqs = _requests(seed=1)
    scale = {"host_serial": math.log(3.0), "compute_derate": math.log(0.8)}
    other = kernel.with_params(kernel.params.scaled(host_serial=3.0, compute_derate=0.8))
    out, _ = lockstep_replay([kernel], [reqs], [Variant(), Variant(log_scale=scale)])
    _same(replay(kernel, reqs), out[0])
    _same(replay(other, reqs), out[1])


def test_variants_do_not_depend_on_each_other(kernel):
    reqs = _requests(seed=2)
    a = Variant(log_factor=(0.3,) * 4)
    b = Variant(log_factor=(-0.2,) * 4, front_s=0.01)
    alone, _ = lockstep_replay([kernel], [reqs], [a])
    both, _ = lockstep_replay([kernel], [reqs], [b, a])
    _same(alone[0], both[1])


def test_a_regime_factor_multiplies_that_regimes_steps(kernel):
    # one request alone: a prefill step, then decode steps only
    reqs = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "input_tokens": [500],
                         "output_tokens": [20]})
    factor = [0.0] * 4
    factor[Regime.DECODE] = math.log(2.0)
    out, _ = lockstep_replay([kernel], [reqs], [Variant(), Variant(log_factor=tuple(factor))])
    base, dbl = out[0].steps["duration_s"].to_numpy(), out[1].steps["duration_s"].to_numpy()
    assert len(base) == len(dbl) == 20
    assert dbl[0] == base[0]                                    # the prefill step
    np.testing.assert_allclose(dbl[1:], 2 * base[1:], atol=1e-6)   # whole microseconds
    gaps0, gaps1 = out[0].token_gaps_s[0], out[1].token_gaps_s[0]
    np.testing.assert_allclose(gaps1, 2 * gaps0, atol=2e-6)


def test_front_end_time_moves_each_requests_admission(kernel):
    reqs = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 5.0],
                         "input_tokens": [200, 200], "output_tokens": [4, 4]})
    out, _ = lockstep_replay([kernel], [reqs], [Variant(), Variant(front_s=0.008),
                                                Variant(front_s=-10.0)])
    d = out[1].requests["ttft_s"] - out[0].requests["ttft_s"]
    np.testing.assert_allclose(d, 0.008, atol=1e-6)
    # the admission delay never goes below zero
    assert (out[2].requests["ttft_s"] <= out[0].requests["ttft_s"]).all()
    assert (out[2].requests["ttft_s"] > 0).all()


def test_jitter_is_reproducible_and_spreads_the_steps(kernel):
    reqs = _requests(seed=3)
    v = [Variant(step_sd=(0.1,) * 4, seed=7), Variant(step_sd=(0.1,) * 4, seed=8)]
    one, _ = lockstep_replay([kernel], [reqs], v)
    two, _ = lockstep_replay([kernel], [reqs], v)
    _same(one[0], two[0])
    _same(one[1], two[1])
    plain = replay(kernel, reqs)
    r = np.log(one[0].steps["duration_s"].to_numpy()[:50]
               / plain.steps["duration_s"].to_numpy()[:50])
    assert 0.03 < np.std(r) < 0.3


def test_workloads_are_shared_by_the_variants_that_name_them(kernel):
    a, b = _requests(seed=4), _requests(seed=5)
    out, _ = lockstep_replay([kernel], [a, b], [Variant(workload=1), Variant(workload=0)])
    _same(replay(kernel, b), out[0])
    _same(replay(kernel, a), out[1])


def test_disaggregated_pools_lockstep_like_the_plain_replay():
    jkernel.enable_x64()
    pre = jkernel.open_pool("llama-3.1-70b-h200-disagg", "prefill")
    dec = jkernel.open_pool("llama-3.1-70b-h200-disagg", "decode")
    reqs = _requests(n=12, rate=8.0, prompt=2000, output=16, seed=6)
    out, _ = lockstep_replay([pre, dec], [reqs], [Variant()])
    _same(replay_disaggregated(pre, dec, reqs), out[0])


def test_paired_program_prices_each_row_at_its_own_constants(kernel):
    names = tuple(kernel.params)
    base = np.array([float(kernel.params[n]) for n in names])
    flat = np.stack([base, base * np.where(np.array(names) == "host_serial", 2.0, 1.0)])
    s = np.zeros((2, 16), np.int32)
    c = np.zeros((2, 16), np.int32)
    s[:, :3], c[:, :3] = 1, 1000
    scal = np.array([[1, 0, 0], [1, 0, 0]], np.int32)
    secs, neck, regime = paired_program(kernel.step_fn, names, "expected_s")(flat, s, c, scal)
    one = kernel.step_time(scheduled=np.ones(3, np.int32), computed=np.full(3, 1000, np.int32))
    assert float(secs[0]) == pytest.approx(one.expected_s, rel=1e-12)
    hs = float(kernel.params["host_serial"])
    assert float(secs[1]) - float(secs[0]) == pytest.approx(hs, rel=1e-9)
    assert int(neck[0]) == one.bottleneck
    assert int(regime[0]) == Regime.DECODE


def test_variant_refuses_bad_values():
    with pytest.raises(ValueError, match="one per regime"):
        Variant(log_factor=(0.0,))
    with pytest.raises(ValueError, match="step_sd"):
        Variant(step_sd=(-0.1, 0, 0, 0))
    with pytest.raises(ValueError, match="non-finite"):
        Variant(log_scale={"host_serial": float("nan")})


def test_regimes_classify_batches():
    s = np.array([[1, 1, 0], [300, 0, 0], [1, 200, 0], [0, 0, 0]])
    assert classify(s, 1).tolist() == [Regime.DECODE, Regime.PREFILL, Regime.MIXED,
                                       Regime.DECODE]
    assert classify(s, 1, np.array([0, HOST_RESOURCE, 1, 1])).tolist()[1] == Regime.HOST
    assert classify_one([4, 1], decode_threshold=4) is Regime.DECODE
    assert [r.label for r in REGIMES] == ["decode", "prefill", "mixed", "host"]


@pytest.mark.parametrize("jit", [False, True])
def test_the_traced_classification_of_a_row_is_the_regimes(jit):
    """The lockstep classifies its priced rows inside the pricing program
    (jkernel.regimes.classify_row, vmapped); it agrees with classify on the padded matrix,
    empty rows and host-bound rows included."""
    import jax

    fn = jax.vmap(classify_row)
    if jit:
        fn = jax.jit(fn)
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, r = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        s = rng.choice([0, 1, 2, 300], (n, r)).astype(np.int32)
        thr = rng.integers(1, 3, n).astype(np.int32)
        neck = rng.integers(0, len(jkernel.RESOURCES), n).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(fn(s, thr, neck)), classify(s, thr, neck))
