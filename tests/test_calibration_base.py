"""data/heldout.py's held_out, the one held-out split of every fit and report: a stable hash
of a row key (profile rows by shape, trace steps by index) or a time-ordered tail (the step
traces), and the fits and reports that read it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jkernel.calibration.data import profiles as P
from jkernel.calibration.data.heldout import held_out, row_hash
from jkernel.calibration.data.traces import StepTrace


def _gemm(m, n, k):
    m, n, k = (np.asarray(x, dtype=np.int64) for x in (m, n, k))
    return P.GemmObservations(chip="t", dtype=np.full(len(m), "bf16"), m=m, n=n, k=k,
                              latency_s=np.arange(1, len(m) + 1, dtype=float),
                              kernel=np.full(len(m), ""))


def test_row_hash_is_pinned():
    """The shipped profile coefficients were fitted on the rows this hash leaves in: a change
    to it (another mixer, another column encoding) moves rows across the split and so the
    shipped figures. Values from the SplitMix64 chain as first shipped."""
    assert [hex(int(x)) for x in row_hash(0, [np.array([1, 2, 3])])] == [
        "0xd300120a5ea35cac", "0xd4993d56a5f40fb6", "0x794dfd8909773e4f"]
    assert [hex(int(x)) for x in row_hash(7, [np.array([1, 2]), np.array(["bf16", "fp8"])])] \
        == ["0xb45896c10077582f", "0x4ef7f837cb7aaa0a"]


def test_hash_split_is_the_hash_below_the_fraction():
    h = np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)
    assert held_out(0.5, key_hash=h).tolist() == [True, False, False]
    assert held_out(0.0, key_hash=h).tolist() == [False] * 3
    assert held_out(1.0, key_hash=h).tolist() == [True] * 3


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=40), st.floats(0.05, 0.95),
       st.integers(0, 2**40))
def test_equal_keys_fall_on_one_side_whatever_the_other_rows(keys, fraction, seed):
    keys = np.array(keys)
    held = held_out(fraction, key_hash=row_hash(seed, [keys]))
    for v in set(keys.tolist()):
        assert len(set(held[keys == v].tolist())) == 1
    half = keys[: len(keys) // 2]
    np.testing.assert_array_equal(held_out(fraction, key_hash=row_hash(seed, [half])),
                                  held[: len(half)])


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=50),
       st.floats(0.0, 1.0))
def test_time_split_holds_out_the_last_fraction(times, fraction):
    t = np.array(times)
    held = held_out(fraction, time_s=t)
    assert (~held).sum() == int(round((1 - fraction) * len(t)))
    assume(held.any() and (~held).any())
    assert t[~held].max() <= t[held].min()          # never a fit step after a held-out one


def test_time_split_breaks_ties_in_row_order():
    assert held_out(0.5, time_s=np.zeros(4)).tolist() == [False, False, True, True]
    assert held_out(0.3, time_s=np.array([5.0, 1.0, 3.0])).tolist() == [True, False, False]


def test_split_arguments_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        held_out(0.2)
    with pytest.raises(ValueError, match="exactly one"):
        held_out(0.2, key_hash=np.zeros(2, np.uint64), time_s=np.zeros(2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        held_out(1.5, time_s=np.zeros(2))


def test_profile_split_is_held_out_on_the_shape_hash():
    obs = _gemm([1, 2, 3, 1, 2, 3, 4, 5], [8] * 8, [8] * 8)
    mask = held_out(0.4, key_hash=obs.shape_hash(3))
    np.testing.assert_array_equal(obs.held_mask(0.4, 3), mask)
    fit, held = obs.split(0.4, 3)
    np.testing.assert_array_equal(held.latency_s, obs.latency_s[mask])
    np.testing.assert_array_equal(fit.latency_s, obs.latency_s[~mask])


def _trace(end_s=None, n=10):
    one = [np.array([1], np.int32)] * n
    return StepTrace(None, one, one, one, np.ones(n, np.int32), np.zeros(n, np.int32),
                     np.full(n, 8192, np.int32), np.full(n, 1e-3), [()] * n,
                     end_s=None if end_s is None else np.asarray(end_s, float))


def test_trace_splits_are_held_out():
    """A trace's time split is the tail by end_s (file order without it); its hash split is
    keyed on the step index."""
    tr = _trace(end_s=np.arange(10)[::-1])
    np.testing.assert_array_equal(tr.held_mask(0.3, split="time"),
                                  np.arange(10) < 3)      # the last steps in time come first
    np.testing.assert_array_equal(_trace().held_mask(0.3, split="time"), np.arange(10) >= 7)
    np.testing.assert_array_equal(tr.held_mask(0.3, 5, split="hash"),
                                  held_out(0.3, key_hash=row_hash(5, [np.arange(10)])))
    with pytest.raises(ValueError, match="split"):
        tr.held_mask(0.3, split="random")
