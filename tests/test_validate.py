"""One validation for every entry point: ``Batch``, ``step_time``,
``price_many``, ``price_sweep`` and the command line share jkernel.validate's checks and its
:class:`jkernel.ArgumentError`, which names the argument. Each bad argument that once
slipped through or failed raw is a named test here."""

from __future__ import annotations

import numpy as np
import pytest

import jkernel
from conftest import catalog_kernel
from jkernel import ArgumentError, Batch
from jkernel.cli import main

SCENARIO = "llama-3.1-8b-h100-tp1"


@pytest.fixture(scope="module")
def k():
    return catalog_kernel(SCENARIO)


def argument_of(call) -> str:
    with pytest.raises(ArgumentError) as info:
        call()
    assert isinstance(info.value, ValueError)          # old `except ValueError` still works
    assert str(info.value).startswith(info.value.argument + ":")
    return info.value.argument


# -- Batch -------------------------------------------------------------------------------------

def test_huge_pad_tokens_is_a_named_error_not_overflow():
    """Guards: pad_tokens of 10¹² raised a raw OverflowError when packed as int32."""
    assert argument_of(lambda: Batch([1], [0], pad_tokens=10 ** 12)) == "pad_tokens"


def test_huge_decode_threshold_is_a_named_error_not_overflow():
    assert argument_of(lambda: Batch([1], [0], decode_threshold=10 ** 12)) == \
        "decode_threshold"


@pytest.mark.parametrize("kw,argument", [
    (dict(sm_budget=-1), "sm_budget"), (dict(sm_budget=2.5), "sm_budget"),
    (dict(decode_threshold=-1), "decode_threshold"), (dict(pad_tokens=float("nan")),
                                                      "pad_tokens"),
    (dict(decode_threshold=True), "decode_threshold"),
])
def test_batch_scalars(kw, argument):
    assert argument_of(lambda: Batch([1], [0], **kw)) == argument


def test_batch_token_arrays_name_the_argument():
    assert argument_of(lambda: Batch([1, -2], [0, 0])) == "scheduled"
    assert argument_of(lambda: Batch([1], [2 ** 31])) == "computed"
    assert argument_of(lambda: Batch([1], [0], [0.5])) == "prompt_len"
    assert argument_of(lambda: Batch(np.array([3, -1], np.int32))) == "scheduled"


def test_int32_arrays_are_taken_without_a_copy():
    s = np.ones(4, np.int32)
    b = Batch(s, np.zeros(4, np.int32))
    assert b.scheduled is s and list(b.prompt_len) == [1, 1, 1, 1]


def test_pad_to_is_zero_padded():
    arrays = Batch([3, 1], [5, 6], pad_tokens=-4).pad_to(4)
    assert list(arrays.scheduled) == [3, 1, 0, 0] and list(arrays.mask) == [1, 1, 0, 0]
    assert int(arrays.pad_tokens) == 0                            # negative pad is 0 (D27)


# -- step_time ---------------------------------------------------------------------------------

def test_step_time_takes_arrays_directly(k):
    rng = np.random.default_rng(3)
    s = rng.integers(1, 5, 40).astype(np.int32)
    c = rng.integers(0, 9000, 40).astype(np.int32)
    via_batch = k.step_time(Batch(s, c, decode_threshold=2, pad_tokens=3))
    direct = k.step_time(scheduled=s, computed=c, decode_threshold=2, pad_tokens=3)
    assert direct == via_batch
    assert k.step_time(scheduled=list(s), computed=list(c), decode_threshold=2,
                       pad_tokens=3) == via_batch


def test_step_time_arguments(k):
    assert argument_of(lambda: k.step_time([1, 2])) == "batch"
    assert argument_of(lambda: k.step_time(scheduled=[1], computed=[-1])) == "computed"
    assert argument_of(lambda: k.step_time(scheduled=[1], sm_budget=-3)) == "sm_budget"
    assert argument_of(lambda: k.step_time(Batch([1]), scheduled=[1])) == "batch"


def test_gradient_matches_jax_grad_of_step_fn(k):
    import jax

    batch = Batch([1] * 20 + [300], [1000] * 20 + [0], decode_threshold=1)
    value, g = k.gradient(batch, of="expected_s")
    ref = jax.grad(lambda p: k.step_fn(p, k.batch_arrays(batch)).expected_s)(k.params)
    assert value == k.step_time(batch).expected_s
    for name in k.params:
        assert float(g[name]) == pytest.approx(float(ref[name]), rel=1e-9, abs=1e-300)
    assert argument_of(lambda: k.gradient(batch, of="bottleneck")) == "of"


# -- price_many / price_sweep ------------------------------------------------------------------

def test_price_many_on_zero_batches_returns_empty_results(k):
    """Guards: price_many on zero batches raised instead of returning empty results."""
    est = k.price_many(scheduled=np.zeros((0, 16), np.int32))
    assert est.expected_s.shape == (0,) and est.per_resource_s["hbm"].shape == (0,)
    assert k.price_many([]).no_overlap_s.shape == (0,)
    sweep = k.price_sweep([k.params, k.params], scheduled=np.zeros((0, 4), np.int32))
    assert sweep.expected_s.shape == (2, 0)


def test_price_many_refuses_fractional_tokens(k):
    """Guards: price_many accepted fractional tokens that Batch refuses."""
    s = np.full((3, 4), 1.5)
    assert argument_of(lambda: k.price_many(scheduled=s, computed=np.zeros((3, 4)))) == \
        "scheduled"


def test_price_many_refuses_negative_sm_budget(k):
    """Guards: price_many accepted a negative sm_budget that Batch refuses."""
    s = np.ones((3, 4), np.int32)
    assert argument_of(lambda: k.price_many(scheduled=s, sm_budget=-1)) == "sm_budget"
    assert argument_of(lambda: k.price_many(scheduled=s, sm_budget=np.array([0, -2, 0]))
                       ) == "sm_budget"
    assert argument_of(lambda: k.price_many(scheduled=s, decode_threshold=[1, 2])) == \
        "decode_threshold"
    assert argument_of(lambda: k.price_many(scheduled=s, pad_tokens=10 ** 12)) == "pad_tokens"


def test_price_many_checks_int32_signs_in_the_program(k):
    """int32 arrays are not read on the host; the pricing program reports their minimum."""
    s = np.ones((40, 8), np.int32)
    c = np.zeros((40, 8), np.int32)
    c[37, 5] = -7
    assert argument_of(lambda: k.price_many(scheduled=s, computed=c, chunk=16)) == "computed"
    s[2, 2] = -1
    assert argument_of(lambda: k.price_many(scheduled=s, chunk=16)) == "scheduled"
    assert argument_of(lambda: k.price_sweep([k.params], scheduled=s)) == "scheduled"


def test_price_many_same_as_batches_and_negative_pad_is_zero(k):
    rng = np.random.default_rng(5)
    s = rng.integers(0, 3, (9, 16)).astype(np.int32)
    c = rng.integers(0, 5000, (9, 16)).astype(np.int32)
    pads = np.array([-3, 0, 4, -1, 0, 0, 2, 0, 0])
    est = k.price_many(scheduled=s, computed=c, pad_tokens=pads)
    batches = [Batch(s[j], c[j], pad_tokens=int(pads[j])) for j in range(9)]
    by_list = k.price_many(batches)
    assert np.array_equal(est.expected_s, by_list.expected_s)
    assert est.expected_s[0] == k.step_time(batches[0]).expected_s


def test_price_sweep_arguments(k):
    s = np.ones((2, 4), np.int32)
    assert argument_of(lambda: k.price_sweep([], scheduled=s)) == "params"
    assert argument_of(lambda: k.price_sweep(k.params, scheduled=s)) == "params"


# -- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--pad-tokens", "--decode-threshold", "--sm-budget"])
def test_cli_names_the_argument(flag, capsys):
    value = "-1" if flag == "--sm-budget" else str(10 ** 12)
    assert main(["price", SCENARIO, "--batch", "1x1@10", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag[2:].replace("-", "_") in err and "Traceback" not in err


# -- the kernel's own arguments: silent wrong answers and raw tracebacks once seen --------------

@pytest.mark.parametrize("dtype", [np.int32, "int64", np.float16, "banana", object])
def test_price_many_dtype_that_cannot_hold_seconds_is_refused(k, dtype):
    """``price_many(dtype=np.int32)`` returned NaN for every batch (float16 too);
    ``dtype='banana'`` raised a raw TypeError."""
    b = Batch.from_spec("4x1@100,1x50@0")
    assert argument_of(lambda: k.price_many([b], dtype=dtype)) == "dtype"


@pytest.mark.parametrize("dtype", [None, np.float32, "float64"])
def test_price_many_float_dtypes_price_finitely(k, dtype):
    b = Batch.from_spec("4x1@100,1x50@0")
    got = k.price_many([b], dtype=dtype).expected_s
    assert np.isfinite(got).all()
    assert got[0] == pytest.approx(k.step_time(b).expected_s, rel=1e-5)


@pytest.mark.parametrize("buckets", [(-16,), (0,), (), "abc", (2.5,), None, (16, "x"),
                                     (2 ** 40,)])
def test_bad_buckets_are_refused_when_the_kernel_is_built(buckets):
    """``buckets=(-16,)`` priced a real request as an empty batch; (), 'abc', (0,) raised
    IndexError, TypeError or ZeroDivisionError."""
    assert argument_of(lambda: jkernel.open(SCENARIO, buckets=buckets)) == "buckets"


def test_buckets_are_sorted_without_repeats():
    assert jkernel.open(SCENARIO, buckets=(64, 16, 16)).buckets == (16, 64)


@pytest.mark.parametrize("value", [0.0, -1e12, float("nan"), float("inf")])
def test_hbm_bandwidth_that_prices_nan_or_inf_is_refused(k, value):
    """A zero HBM bandwidth priced every step NaN, a negative one inf."""
    bad = k.params.replace(hbm_bytes_per_s=value)
    assert argument_of(lambda: k.with_params(bad)) == "params"
    with pytest.raises(ArgumentError, match=r"parameter set 1"):
        k.price_sweep([k.params, bad], [Batch.from_spec("1x1@10")])


@pytest.mark.parametrize("name, value", [("hbm_derate", 0.0), ("peak_flops_per_s", -1.0),
                                         ("host_serial", -1e-3)])
def test_params_that_price_a_step_wrong_are_refused(k, name, value):
    assert name in k.params
    with pytest.raises(ArgumentError, match=name):
        k.with_params(k.params.replace(**{name: value}))


def test_legitimate_params_still_build(k):
    same = k.with_params(k.params.scaled(hbm_bytes_per_s=0.5))
    b = Batch.from_spec("8x1@4000")
    assert same.step_time(b).per_resource_s["hbm"] > k.step_time(b).per_resource_s["hbm"]


def test_with_params_needs_params(k):
    assert argument_of(lambda: k.with_params({})) == "params"
    assert argument_of(lambda: k.with_params(None)) == "params"
    assert argument_of(lambda: k.with_params([1.0])) == "params"
    same = k.with_params(dict(k.params))              # a plain mapping of the names works
    b = Batch.from_spec("4x1@100")
    assert same.step_time(b).expected_s == k.step_time(b).expected_s


@pytest.mark.parametrize("rows, argument", [([(1,)], "requests[0]"), ([1], "requests[0]"),
                                            ("1x1", "requests"), ([(1, 2, 3, 4)],
                                                                  "requests[0]")])
def test_batch_of_bad_rows_names_the_row(rows, argument):
    """``Batch.of([(1,)])`` raised a raw IndexError."""
    assert argument_of(lambda: Batch.of(rows)) == argument


def test_batch_of_pairs_and_requests_still_work():
    b = Batch.of([(3, 10), jkernel.Request(1, 5), (2, 0, 7)])
    assert list(b.scheduled) == [3, 1, 2] and list(b.prompt_len) == [13, 6, 7]


@pytest.mark.parametrize("buckets", [[-5], [0], [10 ** 12], "16"])
def test_warm_up_bad_buckets_are_refused(k, buckets):
    """``warm_up([-5])`` raised 'negative dimensions'; 10¹² tried to allocate 7 TiB."""
    assert argument_of(lambda: k.warm_up(buckets)) == "buckets"


@pytest.mark.parametrize("pool", [None, 1.5, True, "", [0]])
def test_open_pool_of_no_pool_names_the_argument(pool):
    """``open_pool(bundle, None)`` raised a raw TypeError from int(None)."""
    assert argument_of(lambda: jkernel.open_pool(SCENARIO, pool)) == "pool"


@pytest.mark.parametrize("kw, argument", [(dict(node=-1), "node"), (dict(node=0.5), "node"),
                                          (dict(rack=-2), "rack"), (dict(pool=-1), "pool"),
                                          (dict(node=None), "node")])
def test_placement_fields_are_checked(kw, argument):
    """Negative or fractional Placement fields were never checked (and priced)."""
    assert argument_of(lambda: jkernel.Placement(**kw)) == argument


@pytest.mark.parametrize("pool, argument", [("banana", "src.pool"), (7, "src.pool")])
def test_placement_pool_must_be_a_pool_of_the_deployment(k, pool, argument):
    src, dst = jkernel.Placement(pool=pool), jkernel.Placement()
    assert argument_of(lambda: k.pd_transfer_time(100, src, dst)) == argument


def test_placement_of_a_known_pool_prices(k):
    t = k.pd_transfer_time(100, jkernel.Placement(pool="colocated"), jkernel.Placement(pool=0))
    assert t > 0


@pytest.mark.parametrize("chunk", [0, 1.5, "a", None])
def test_price_many_chunk_is_checked(k, chunk):
    """chunk=1.5 was truncated to 1 silently; 'a' raised a raw ValueError."""
    assert argument_of(lambda: k.price_many([Batch([1], [0])], chunk=chunk)) == "chunk"


def test_options_and_breakdown_arguments_are_named(k):
    assert argument_of(lambda: jkernel.open(SCENARIO, options="x")) == "options"
    assert argument_of(lambda: k.breakdown(None)) == "batch"


@pytest.mark.parametrize("flag, value", [("--rate", "inf"), ("--rate", "nan"),
                                         ("--ttft", "inf"), ("--itl", "nan"),
                                         ("--workers", "100000"), ("--requests", "-1"),
                                         ("--requests", str(10 ** 9))])
def test_plan_arguments_are_refused_before_the_search(capsys, flag, value):
    """``plan --rate inf`` raised a raw traceback."""
    args = ["plan", "llama-3.1-8b-instruct", "--chip", "h100", "--gpus", "1", "--isl", "64",
            "--osl", "4", "--workers", "1"]
    args += [] if flag == "--rate" else ["--rate", "1"]
    rc = main(args + [flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "[screen" not in err
    assert err.startswith(f"jkernel: {flag.lstrip('-').replace('-', '_')}")


def test_plan_of_a_billion_gpus_is_refused_at_once(capsys):
    """``plan --gpus 10⁹`` enumerated without bound (~150 MB/s until killed)."""
    import time

    t0 = time.perf_counter()
    rc = main(["plan", "llama-3.1-8b-instruct", "--chip", "h100", "--gpus", str(10 ** 9),
               "--isl", "64", "--osl", "4", "--rate", "1"])
    assert rc == 2 and time.perf_counter() - t0 < 30
    assert "MAX_PLAN_GPUS" in capsys.readouterr().err


def test_plan_candidates_are_counted_before_they_are_built(monkeypatch):
    from jkernel import limits, search

    fl = search.fleet("h200", 64)
    full = len(search.enumerate_candidates("llama-3.1-8b-instruct", fl))
    monkeypatch.setattr(limits, "MAX_PLAN_CANDIDATES", full - 1)
    monkeypatch.setattr(search, "Candidate", lambda *a: pytest.fail("a candidate was built"))
    with pytest.raises(jkernel.Refusal, match="MAX_PLAN_CANDIDATES"):
        search.enumerate_candidates("llama-3.1-8b-instruct", fl)
