"""The prepared single-step pricer (jkernel/pricer.py) and step_time's reused buffers: the
figures the packed step program gives a freshly packed input, to the bit, whatever batches
came before, from any thread."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import jkernel
from jkernel.pricer import PRICED_FIGURES
from jkernel.programs import PACKED_FIELDS, programs

from conftest import catalog_kernel


def _batches(seed: int, count: int):
    """Random batches over the 16-, 64- and 256-request buckets (one program below 64
    requests, two from 64 up), empty ones included."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.choice([0, 1, 3, 16, 17, 40, 64, 65, 200, 256]))
        s = np.where(rng.random(n) < 0.2, rng.integers(2, 3000, n), 1).astype(np.int32)
        c = rng.integers(0, 60000, n).astype(np.int32)
        yield s, c, int(rng.integers(-3, 40))


def _fresh(k, s, c, thr, budget=0, pad=0) -> list:
    """What step_time returned before the reused buffers: the packed program on a newly
    allocated packed input (the 9 figures, then the negative count)."""
    p = programs(k.plan, k.options, tuple(k.params))
    return p.step(k._flat, k._pack(None, s, c, thr, budget, pad)).tolist()


def _row(est: jkernel.StepEstimate) -> list:
    return [est.overlap_s, est.no_overlap_s, est.expected_s, *est.per_resource_s,
            float(est.bottleneck)]


def test_pricer_and_step_time_equal_a_freshly_packed_program_in_any_order():
    """Batches of every bucket, each longer or shorter than the one before in its bucket
    (a shorter one must not see the longer one's rows), as lists and as arrays, with pad
    tokens: step_time's and the pricer's figures are the program's on a fresh input."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    thr = k.settings.decode_threshold
    p, q = k.pricer(), k.pricer("no_overlap_s")
    assert (p.clock, p.decode_threshold, p.sm_budget) == ("expected_s", thr, 0)
    for s, c, pad in _batches(0, 40):
        want = _fresh(k, s, c, thr, 0, pad)
        assert want[-1] == 0
        est = k.step_time(scheduled=s, computed=c, decode_threshold=thr, pad_tokens=pad)
        assert _row(est) == want[:-1]
        assert p.figures(s, c, pad) == want[:-1]
        assert p(s.tolist(), c.tolist(), pad) == want[PACKED_FIELDS.index("expected_s")]
        assert q(s, c, pad) == want[PACKED_FIELDS.index("no_overlap_s")]
        assert k.step_time(jkernel.Batch(s, c, decode_threshold=thr, pad_tokens=pad)) == est


@pytest.mark.parametrize("clock", PRICED_FIGURES)
def test_each_clock_is_its_column(clock):
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = k.pricer(clock, decode_threshold=4, sm_budget=60)
    s, c = [3, 5, 1, 700], [10, 0, 7, 0]
    est = k.step_time(jkernel.Batch(s, c, decode_threshold=4, sm_budget=60, pad_tokens=2))
    assert p(s, c, 2) == _row(est)[PACKED_FIELDS.index(clock)]
    assert p(s, c, 2) == _fresh(k, s, c, 4, 60, 2)[PACKED_FIELDS.index(clock)]


def test_pricer_unjitted_equals_the_unjitted_program():
    """With jit disabled the pricer runs the step function op by op on its buffer: the
    same figures as the unjitted program on a fresh input."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = k.pricer()
    s, c = np.array([1, 900, 1], np.int32), np.array([4000, 0, 12], np.int32)
    p([1] * 9, [50] * 9)                       # a longer batch first, in the same bucket
    with jax.disable_jit():
        want = _fresh(k, s, c, p.decode_threshold, 0, 5)
        assert p.figures(s, c, 5) == want[:-1]


def test_pricer_of_another_parameter_set_prices_with_its_own():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    slow = k.with_params(k.params.scaled(hbm_derate=0.5))
    s, c = [1] * 8, [30000] * 8
    assert slow.pricer()(s, c) == slow.step_time(
        jkernel.Batch(s, c, decode_threshold=k.settings.decode_threshold)).expected_s
    assert slow.pricer()(s, c) > k.pricer()(s, c)


def test_pricer_checks_its_settings_when_built():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    for clock in ("bottleneck", "latency_s", "", None, 2):
        with pytest.raises(jkernel.ArgumentError, match="clock"):
            k.pricer(clock)
    with pytest.raises(jkernel.ArgumentError, match="decode_threshold"):
        k.pricer(decode_threshold=-1)
    with pytest.raises(jkernel.ArgumentError, match="sm_budget"):
        k.pricer(sm_budget=1.5)
    assert isinstance(k.pricer(), jkernel.StepPricer)


def test_pricer_refusals_leave_it_pricing_right():
    """A negative count and unequal lengths are refused naming the array; a batch after a
    refusal, or after a write that failed part-way (a longer batch's rows already in the
    buffer), prices as on a fresh input."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = k.pricer()
    s, c = [3, 5, 1], [10, 0, 7]
    want = _fresh(k, s, c, p.decode_threshold)[PACKED_FIELDS.index("expected_s")]
    with pytest.raises(jkernel.ArgumentError, match="scheduled.*-2"):
        p([1, -2, 4, 4, 4], [0] * 5)
    assert p(s, c) == want
    with pytest.raises(jkernel.ArgumentError, match="computed.*-7"):
        p([1, 2], [0, -7])
    assert p(s, c) == want
    with pytest.raises(jkernel.ArgumentError, match="computed"):
        p([1, 2], [0])
    with pytest.raises(ValueError):
        p([9000] * 12, ["many"] * 12)          # scheduled written, computed refused by numpy
    assert p(s, c) == want


def test_step_time_after_a_larger_batch_of_the_bucket():
    """step_time reuses one buffer per bucket: a batch after a longer one of the same
    bucket prices as in a fresh kernel, also after a refused batch."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    fresh = k.with_params(k.params)
    big = jkernel.Batch([1] * 12, [5000] * 12, pad_tokens=9)
    small = jkernel.Batch([1, 1], [5000, 5000])
    k.step_time(big)
    assert k.step_time(small) == fresh.step_time(small)
    with pytest.raises(jkernel.ArgumentError):
        k.step_time(scheduled=np.array([1, -1, 1, 1], np.int32), computed=np.zeros(4, np.int32))
    assert k.step_time(small) == fresh.step_time(small)


def test_latent_dcp_plan_prices_its_one_program_through_the_buffers():
    """A plan that reads the requests after the reduction runs the one program at every
    bucket; the pricer and step_time equal it on a fresh input there too."""
    k = catalog_kernel("deepseek-v3.2-h200-fp8-tp8-dcp2")
    p = k.pricer()
    rng = np.random.default_rng(3)
    for n in (70, 20, 65):
        s = np.where(rng.random(n) < 0.8, 1, rng.integers(2, 900, n)).astype(np.int32)
        c = rng.integers(0, 30000, n).astype(np.int32)
        want = _fresh(k, s, c, p.decode_threshold, 0, 1)
        assert p.figures(s, c, 1) == want[:-1]
        est = k.step_time(scheduled=s, computed=c, decode_threshold=p.decode_threshold,
                          pad_tokens=1)
        assert _row(est) == want[:-1]


def test_step_time_and_a_shared_pricer_from_several_threads():
    """Each thread writes its own buffers: concurrent calls price their own batches."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = k.pricer()
    batches = list(_batches(1, 24))
    want = [_fresh(k, s, c, p.decode_threshold, 0, pad)[:-1] for s, c, pad in batches]
    errors: list = []

    def work(offset: int) -> None:
        for _ in range(3):
            for j in range(len(batches)):
                i = (j + offset) % len(batches)
                s, c, pad = batches[i]
                est = k.step_time(scheduled=s, computed=c, pad_tokens=pad,
                                  decode_threshold=p.decode_threshold)
                if _row(est) != want[i] or p.figures(s, c, pad) != want[i]:
                    errors.append((offset, i))

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 7, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
