"""The step's one pass over the requests (``jkernel.stages.sum_requests``).

The whole-number lanes (token and request counts, contexts, window-capped reads) are summed
in int64 from int inputs, the rest in float: every sum must equal, to the last bit, the
all-float reduction the step used before (the int path is only a speed change), for plans
with windows, DCP, PCP and a drafter; the sign check lane counts negative inputs per batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import catalog_kernel
import jax
import jax.numpy as jnp

from jkernel.stages import BatchArrays, RequestLanes, request_lanes, sum_requests

SCENARIOS = ["llama-3.1-8b-h100-tp1", "gpt-oss-120b-b200-tp8", "qwen3-235b-a22b-h200-tp8-dcp2",
             "glm-5-h200-2node-pcp2-dcp2", "nemotron-3-super-120b-a12b-b200-tp2-mtp"]


def _batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    s = np.where(rng.random((40, 32)) < 0.6, 1, rng.integers(0, 9000, (40, 32)))
    s[rng.random((40, 32)) < 0.2] = 0
    c = rng.integers(0, 200_000, (40, 32))
    c[:4] = 0
    thr = rng.integers(0, 5, 40)
    return s.astype(np.int32), c.astype(np.int32), thr.astype(np.int32)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_integer_lanes_sum_exactly_as_the_float_reduction(scenario):
    k = catalog_kernel(scenario)
    s, c, thr = _batches()
    zeros = np.zeros(40, np.int32)

    def sums(sched, comp):
        b = BatchArrays(sched, comp, sched > 0, thr, zeros, zeros)
        return sum_requests(RequestLanes.of(k.plan), b, np.float64).as_dict()   # eager

    ints = sums(s, c)
    floats = sums(s.astype(np.float64), c.astype(np.float64))      # the all-float path
    assert set(ints) == set(floats)
    for name in floats:
        assert ints[name].dtype == np.float64, name
        np.testing.assert_array_equal(np.asarray(ints[name]), np.asarray(floats[name]),
                                      err_msg=str(name))
    names = list(floats)                    # the lanes as a list through jit
    jitted = jax.jit(lambda a, b: [sums(a, b)[n] for n in names])(s, c)   # the speed path
    for name, got in zip(names, jitted):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(floats[name]),
                                      err_msg=str(name))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_int_inputs_take_the_integer_lanes(scenario):
    """The whole-number lanes really are integers on int inputs (a change that sent int
    inputs down the float path would still sum equal, so the equality test cannot see it)."""
    k = catalog_kernel(scenario)
    s, c, thr = _batches()
    lanes = request_lanes(RequestLanes.of(k.plan), s, c, s > 0, thr[:, None], jnp.float64,
                          it=jnp.int64).as_dict()
    for name in ("tokens", "n_live", "decode_kv_tokens", "live_kv_tokens"):
        assert jnp.issubdtype(lanes[name].dtype, jnp.integer), name
    if "context_max" in lanes:
        assert jnp.issubdtype(lanes["context_max"].dtype, jnp.integer)
    floats = request_lanes(RequestLanes.of(k.plan), s.astype(np.float64),
                           c.astype(np.float64), s > 0, thr[:, None], jnp.float64,
                           it=jnp.int64).as_dict()
    assert all(not jnp.issubdtype(v.dtype, jnp.integer) for v in floats.values())


def test_sign_check_lane_counts_negative_requests_per_batch():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    s, c, thr = _batches(1)
    s[3, :5] = -1
    c[3, 2:7] = -4                            # requests 0-6 of batch 3 hold a negative
    c[7, 31] = -2
    zeros = np.zeros(40, np.int32)
    b = BatchArrays(s, c, s > 0, thr, zeros, zeros)
    got = sum_requests(RequestLanes.of(k.plan), b, np.float64, check=True).negative
    want = np.zeros(40, np.int32)
    want[3], want[7] = 7, 1
    np.testing.assert_array_equal(np.asarray(got), want)
