"""Bulk pricing's plumbing (jkernel.bulk): aligned host buffers, in-place views, argument
checks of many batches, and the chunk runner, each on its own (a numpy stand-in for the
kernel's program); the kernel's use of them is tested in test_kernel.py and test_devices.py."""

from __future__ import annotations

import numpy as np
import pytest

from jkernel import Batch, bulk
from jkernel.validate import ArgumentError


def unaligned(shape, dtype=np.int32, items: int = 1) -> np.ndarray:
    """A C-contiguous array starting ``items`` items past a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(int(np.prod(shape)) + bulk.ALIGN, dtype)
    off = items + (-raw.ctypes.data // dtype.itemsize) % (bulk.ALIGN // dtype.itemsize)
    return raw[off:off + int(np.prod(shape))].reshape(shape)


# -- buffers and views --------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype", [((1,), np.int32), ((7,), np.int32),
                                          ((5, 3), np.float64), ((3, 1, 2), np.uint8)])
def test_aligned_empty_starts_on_the_boundary(shape, dtype):
    x = bulk.aligned_empty(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.flags.c_contiguous
    assert x.ctypes.data % bulk.ALIGN == 0 and bulk.in_place(x)


def test_in_place_needs_an_aligned_contiguous_array():
    x = bulk.aligned_empty((8, 16), np.int32)
    assert bulk.in_place(x)
    assert not bulk.in_place(x[:, ::2])                 # not contiguous
    assert not bulk.in_place(unaligned((8, 16)))


@pytest.mark.parametrize("items", [1, 5, 15])
def test_a_view_from_the_boundary_reads_the_array_in_place(items):
    x = unaligned((6, 4), items=items)
    x[...] = np.arange(24).reshape(6, 4)
    view, off = bulk.view_from_boundary(x)
    assert off == items and view.ctypes.data % bulk.ALIGN == 0
    np.testing.assert_array_equal(view[off:], x.ravel())
    assert np.shares_memory(view, x)                    # no copy


def test_no_view_for_an_array_off_its_item_size_or_not_contiguous():
    raw = bulk.aligned_empty((65,), np.uint8)
    odd = raw[1:65].view(np.int32)                      # starts one byte past the boundary
    assert bulk.view_from_boundary(odd) is None
    assert bulk.view_from_boundary(unaligned((4, 8))[:, ::2]) is None


def test_staging_reuses_a_returned_buffer_of_the_same_shape_and_keeps_a_few():
    st = bulk.Staging(keep=2)
    a = st.take((4, 8), np.int32)
    assert bulk.in_place(a)
    st.give(a)
    assert st.take((4, 8), np.int32) is a               # reused
    assert st.take((4, 8), np.int32) is not a           # held by the first taker
    bufs = [st.take((3,), np.int64) for _ in range(3)]
    for b in bufs:
        st.give(b)
    assert st.take((3,), np.int64) is bufs[2]           # the last returned, first reused
    assert st.take((3,), np.int64) is bufs[1]
    third = st.take((3,), np.int64)
    assert all(third is not b for b in bufs)            # only two were kept


def test_a_negative_token_count_is_named_with_its_array_and_value():
    s, c = np.ones((6, 3), np.int32), np.ones((6, 3), np.int32)
    c[4, 1] = -9
    with pytest.raises(ArgumentError, match="computed: must be ≥ 0, got -9"):
        bulk.raise_negative((s, c), 3, 3)
    s[0, 0] = -2
    with pytest.raises(ArgumentError, match="scheduled: must be ≥ 0, got -2"):
        bulk.raise_negative((s, c), 0, 6)


# -- many_inputs -------------------------------------------------------------------------------

BUCKETS = (8, 16, 32)


def test_batches_are_padded_to_their_bucket_with_their_scalars():
    batches = [Batch([3, 1], [0, 9], decode_threshold=2), Batch([1] * 10, [5] * 10,
                                                               sm_budget=4, pad_tokens=6)]
    s, c, scal = bulk.many_inputs(batches, None, None, 1, 0, 0, buckets=BUCKETS)
    assert s.shape == c.shape == (2, 16) and s.dtype == np.int32
    assert all(bulk.in_place(x) for x in (s, c, scal))
    assert s[0].tolist() == [3, 1] + [0] * 14 and c[1].tolist() == [5] * 10 + [0] * 6
    assert scal.tolist() == [[2, 0, 0], [1, 4, 6]]


def test_int32_arrays_are_taken_without_a_copy_and_scalars_broadcast():
    s = np.ones((5, 8), np.int32)
    c = np.full((5, 8), 100, np.int32)
    got_s, got_c, scal = bulk.many_inputs(None, s, c, np.arange(1, 6), 3, 0, buckets=BUCKETS)
    assert got_s is s and got_c is c
    assert scal[:, 0].tolist() == [1, 2, 3, 4, 5] and set(scal[:, 1]) == {3}
    got_s, got_c, _ = bulk.many_inputs(None, s, None, 1, 0, 0, buckets=BUCKETS)
    assert got_c.shape == s.shape and not got_c.any()


@pytest.mark.parametrize("kw, match", [
    (dict(batches=[Batch([1], [0])], scheduled=np.ones((1, 1))), "batches: give either"),
    (dict(batches=[[1, 2]]), r"batches\[0\]: must be a jkernel.Batch"),
    (dict(), "scheduled: price_many needs batches or a scheduled array"),
    (dict(scheduled=np.ones((2, 3)), computed=np.ones((2, 4))), "computed: must have the shape"),
    (dict(scheduled=np.ones((2, 3)), decode_threshold=-1), "decode_threshold: must be"),
])
def test_bad_many_batch_arguments_name_the_argument(kw, match):
    args = dict(batches=None, scheduled=None, computed=None, decode_threshold=1,
                sm_budget=0, pad_tokens=0) | kw
    with pytest.raises(ArgumentError, match=match):
        bulk.many_inputs(**args, buckets=BUCKETS)


# -- chunked -------------------------------------------------------------------------------------

def program(s, c, scal):
    """A stand-in for the batched pricing program: per batch, the sums of its scheduled and
    computed tokens and its decode_threshold, and its count of negative entries."""
    s, c, scal = (np.asarray(x) for x in (s, c, scal))
    rows = np.stack([s.sum(1), c.sum(1), scal[:, 0]], axis=-1).astype(np.float64)
    return rows, (s < 0).sum(1) + (c < 0).sum(1)


def arrays(n: int, r: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 5, (n, r)).astype(np.int32)
    c = rng.integers(0, 900, (n, r)).astype(np.int32)
    scal = np.stack([np.arange(1, n + 1), np.zeros(n), np.zeros(n)], -1).astype(np.int32)
    return s, c, scal


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 4096])
def test_chunks_give_the_rows_of_one_pass(chunk):
    s, c, scal = arrays(37)
    want, _ = program(s, c, scal)
    got = bulk.chunked(program, (s, c, scal), chunk, columns=3)
    np.testing.assert_array_equal(got, want)


def test_a_sweep_joins_its_chunks_on_the_batch_axis():
    s, c, scal = arrays(11)

    def sweep(s, c, scal):                      # two parameter sets: the rows, and twice them
        rows, neg = program(s, c, scal)
        return np.stack([rows, 2 * rows]), neg

    got = bulk.chunked(sweep, (s, c, scal), 4, columns=3, axis=1, sets=2)
    want, _ = program(s, c, scal)
    assert got.shape == (2, 11, 3)
    np.testing.assert_array_equal(got[1], 2 * want)


def test_no_batches_give_empty_rows_and_a_chunk_must_be_positive():
    s, c, scal = arrays(0)
    assert bulk.chunked(program, (s, c, scal), 8, columns=9).shape == (0, 9)
    assert bulk.chunked(program, (s, c, scal), 8, columns=9, axis=1, sets=3).shape == (3, 0, 9)
    with pytest.raises(ArgumentError, match="chunk: must be ≥ 1, got 0"):
        bulk.chunked(program, arrays(3), 0, columns=3)


def test_a_negative_entry_in_any_chunk_is_refused():
    s, c, scal = arrays(20)
    c[17, 2] = -4
    with pytest.raises(ArgumentError, match="computed: must be ≥ 0, got -4"):
        bulk.chunked(program, (s, c, scal), 6, columns=3)


def test_unaligned_whole_chunks_are_read_through_a_view_from_the_boundary():
    """On one CPU device an unaligned whole chunk of scheduled/computed goes to the program
    ``at(offsets)`` as flat views from the boundary below it (no copy); the short last chunk
    is staged. The rows are the same either way."""
    s0, c, scal = arrays(32)
    s = unaligned(s0.shape)
    s[...] = s0
    calls = []

    def at(offsets):
        calls.append(offsets)

        def run(s_view, c_view, scal):
            b = np.asarray(scal).shape[0]
            return program(np.asarray(s_view)[offsets[0]:].reshape(b, -1),
                           np.asarray(c_view)[offsets[1]:].reshape(b, -1), scal)
        return run

    want, _ = program(s0, c, scal)
    got = bulk.chunked(program, (s, c, scal), 8, columns=3, at=at)
    np.testing.assert_array_equal(got, want)
    assert len(calls) == 4 and all(o[0] > 0 for o in calls)
    calls.clear()
    got = bulk.chunked(program, (s, c, scal), 10, columns=3, at=at)   # 10, 10, 10, then 2
    np.testing.assert_array_equal(got, want)
    assert len(calls) == 3
