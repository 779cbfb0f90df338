"""Tests of jkernel/calibration/data/profiles.py on the committed fixtures (tests/data, see
its README)."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow", reason="pyarrow is the optional extra jkernel[profiles]")
pq = pytest.importorskip("pyarrow.parquet")

from jkernel.calibration.data import profiles as P  # noqa: E402
from jkernel.calibration.data.profiles import ProfileError  # noqa: E402

DATA = Path(__file__).parent / "data"
AIC = DATA / "aic"
H100 = AIC / "h100_sxm"
GEMM = H100 / "gemm/vllm/0.24.0/gemm_perf.parquet"
B200_GEMM = AIC / "b200_sxm/gemm/vllm/0.24.0/gemm_perf.parquet"
DECODE = H100 / "attention/vllm/0.24.0/generation_attention_perf.parquet"
PREFILL = H100 / "attention/vllm/0.24.0/context_attention_perf.parquet"
MOE = H100 / "moe/vllm/0.24.0/moe_perf.parquet"
MLA_CTX = H100 / "mla/vllm/0.24.0/mla_context_module_perf.parquet"
MLA_GEN = H100 / "mla/vllm/0.24.0/mla_generation_module_perf.parquet"
NCCL = H100 / "comm/nccl/2.29.2/nccl_perf.parquet"
CUSTOM_AR = H100 / "comm/vllm/0.24.0/custom_allreduce_perf.parquet"
VIDUR = DATA / "vidur/data/profiling"
VIDUR_MLP = VIDUR / "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
VIDUR_AR = VIDUR / "network/h100_dgx/all_reduce.csv"
SHARED_GEMM = (Path(__file__).resolve().parents[2]
               / "shared/data/aic-op-profiles/h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet")


def _rows(path) -> int:
    return pq.read_metadata(path).num_rows


def _raw(path, *cols):
    t = pq.read_table(path)
    return {c: t.column(c).to_numpy(zero_copy_only=False) for c in cols}


def _gemm_table(**overrides):
    """A small valid gemm_perf-like table; keyword arguments replace columns."""
    n = len(overrides.get("latency", [0.01] * 4))
    cols = {
        "op_name": ["gemm"] * n,
        "kernel_source": ["torch.nn.functional.linear"] * n,
        "gemm_dtype": ["bfloat16"] * n,
        "m": list(range(1, n + 1)),
        "n": [4096] * n,
        "k": [4096] * n,
        "latency": [0.01] * n,
    }
    cols.update(overrides)
    return pa.table(cols)


# -- units and derived quantities -----------------------------------------------------


def test_gemm_units_known_h100_row():
    g = P.load_gemm(GEMM)
    assert g.chip == "h100_sxm"
    assert g.sha256 == P.file_sha256(GEMM)
    assert len(g) + sum(g.skipped.values()) == _rows(GEMM)
    assert set(g.dtype) == {"bf16", "fp8", "fp8_block"}
    row = g.where(dtype="bf16", m=1, n=8192, k=8192)
    assert len(row) == 1
    assert row.latency_s[0] == pytest.approx(5.16e-5, rel=2e-3)  # 51.6 µs, not ms
    assert row.flops[0] == 2 * 8192 * 8192
    bf16 = g.where(dtype="bf16")
    assert len(bf16) >= 300
    assert len(set(zip(bf16.n.tolist(), bf16.k.tolist()))) >= 10
    assert len(set(bf16.m.tolist())) >= 30
    # everything is seconds-scale: no H100 GEMM here takes more than a second or < 1 µs
    assert (g.latency_s > 1e-6).all() and (g.latency_s < 1.0).all()


def test_b200_gemm_dtype_names():
    g = P.load_gemm(B200_GEMM)
    assert g.chip == "b200_sxm"
    assert set(g.dtype) == {"bf16", "fp8", "fp8_block", "nvfp4"}


def test_dtype_name_mapping():
    assert P.dtype_name("bfloat16") == "bf16"
    assert P.dtype_name("half") == "fp16"
    assert P.dtype_name("fp8_block") == "fp8_block"
    assert P.dtype_name("NVFP4") == "nvfp4"
    assert P.dtype_name("w4a16_mxfp4") == "w4a16_mxfp4"  # no jkernel name: kept


def test_nccl_elements_to_bytes():
    c = P.load_nccl(NCCL)
    raw = _raw(NCCL, "nccl_dtype", "message_size", "latency")
    per_elem = np.where(raw["nccl_dtype"] == "half", 2, 1)
    assert set(c.dtype) == {"fp16", "int8"}
    np.testing.assert_array_equal(c.message_bytes, raw["message_size"] * per_elem)
    np.testing.assert_allclose(c.latency_s, raw["latency"] * 1e-3)
    assert set(c.backend) == {"nccl"} and set(c.variant) == {""}
    np.testing.assert_array_equal(c.devices_per_node, c.num_gpus)
    # the half and int8 sweeps cover the same bytes (512 B … 512 MiB) in different elements
    for dt in ("fp16", "int8"):
        b = c.where(op="all_reduce", dtype=dt).message_bytes
        assert (b.min(), b.max()) == (512, 2**29)
    big = c.where(op="all_reduce", dtype="fp16", num_gpus=8, message_bytes=2 * 67108864)
    assert len(big) == 1
    # 128 MiB all-reduce over 8 H100s: algorithm bandwidth of a few hundred GB/s
    assert 1e11 < big.algorithm_bandwidth[0] < 5e11


def test_custom_allreduce_variants_and_bytes():
    c = P.load_custom_allreduce(CUSTOM_AR)
    raw = _raw(CUSTOM_AR, "message_size")
    np.testing.assert_array_equal(c.message_bytes, raw["message_size"] * 2)  # bfloat16
    assert set(c.variant) == {"graph", "eager"}
    assert set(c.backend) == {"custom_allreduce"} and set(c.op) == {"all_reduce"}
    both = P.CollectiveObservations.concat([P.load_nccl(NCCL), c])
    assert len(both) == len(c) + len(P.load_nccl(NCCL))
    assert set(both.backend) == {"nccl", "custom_allreduce"}


def test_decode_attention_context_and_kv_bytes():
    d = P.load_decode_attention(DECODE)
    raw = _raw(DECODE, "step", "latency")
    np.testing.assert_array_equal(d.ctx_tokens, raw["step"] + 1)
    np.testing.assert_allclose(d.latency_s, raw["latency"] * 1e-3)
    i = int(np.flatnonzero((d.window == 0) & (d.kv_dtype == "bf16"))[0])
    expected = d.batch_size[i] * d.ctx_tokens[i] * 2 * d.n_kv[i] * d.head_dim[i] * 2
    assert d.kv_bytes[i] == expected
    assert set(d.kv_elem_bytes[d.kv_dtype == "fp8"]) == {1.0}
    w = d.where(window=128)
    assert len(w) > 0 and (w.attended_tokens == np.minimum(w.ctx_tokens, 128)).all()
    assert (w.kv_bytes == w.batch_size * np.minimum(w.ctx_tokens, 128) * 2 * w.n_kv
            * w.head_dim * w.kv_elem_bytes).all()
    floor = d.where(n_q=16, n_kv=2, head_dim=128, kv_dtype="bf16", window=0).latency_s.min()
    assert 8e-6 < floor < 15e-6  # the data README's ~11 µs floor


def test_prefill_attention_tokens_and_flops():
    p = P.load_prefill_attention(PREFILL)
    assert (p.tokens == p.batch_size * p.isl).all()
    full = p.where(window=0)
    pairs = full.isl * (full.isl + 1) / 2
    np.testing.assert_allclose(full.flops, 4.0 * full.batch_size * full.n_q * full.head_dim
                               * pairs)
    win = p.where(window=128, isl=4096)
    pairs_w = 128 * 129 / 2 + (4096 - 128) * 128
    np.testing.assert_allclose(win.flops, 4.0 * win.batch_size * win.n_q * win.head_dim
                               * pairs_w)


def test_attention_loaders_refuse_each_others_tables():
    with pytest.raises(ProfileError, match="op_name") as e:
        P.load_decode_attention(PREFILL)
    assert e.value.column == "op_name"
    with pytest.raises(ProfileError, match="op_name"):
        P.load_prefill_attention(DECODE)


def test_moe_and_mla():
    m = P.load_moe(MOE)
    assert {"bf16", "fp8", "fp8_block"} <= set(m.dtype)
    assert {"balanced", "power_law_1.2"} <= set(m.distribution)
    assert (m.routed_tokens == m.num_tokens * m.topk).all()
    assert set(m.hidden) == {2048} and set(m.inter) == {768}
    ctx, gen = P.load_mla(MLA_CTX), P.load_mla(MLA_GEN)
    assert set(ctx.phase) == {"context"} and set(gen.phase) == {"generation"}
    assert (gen.isl == 1).all() and (gen.ctx_tokens == gen.step + 1).all()
    assert set(ctx.model) == {"deepseek-ai/DeepSeek-V3"} and set(ctx.gemm_dtype) == {"bf16"}


def test_vidur_mlp_long_format_in_seconds():
    v = P.load_vidur_mlp(VIDUR_MLP)
    assert v.chip == "h100" and set(v.model) == {"meta-llama/Llama-2-7b-hf"}
    ops = set(v.op)
    assert {"mlp_up_proj", "mlp_down_proj", "attn_pre_proj", "add"} <= ops
    with open(VIDUR_MLP) as f:
        n_csv = sum(1 for _ in f) - 1
    assert len(v) + sum(v.skipped.values()) == n_csv * len(ops)
    assert set(v.tp) == {1, 2, 4, 8}
    up = v.where(op="mlp_up_proj", num_tokens=4096, tp=1)
    # Vidur writes ms: about 1 ms for this 4096×4096×22016 projection on an H100
    assert (0.5e-3 < up.latency_s).all() and (up.latency_s < 2e-3).all()
    assert (v.min_s <= v.latency_s).all() and (v.latency_s <= v.max_s).all()
    assert set(v.hidden) == {4096} and set(v.inter) == {11008} and v.gated_mlp.all()


def test_vidur_network_bytes():
    c = P.load_vidur_network(VIDUR_AR)
    assert c.chip == "h100" and set(c.variant) == {"h100_dgx"} and set(c.op) == {"all_reduce"}
    with open(VIDUR_AR) as f:
        import csv
        sizes = sorted({int(r["size"]) for r in csv.DictReader(f)})
    assert sorted(set(c.message_bytes.tolist())) == sizes  # Vidur's size is already bytes
    assert set(c.num_gpus) == {2, 4, 8}


# -- strictness ----------------------------------------------------------------------------


def test_missing_column_names_file_and_column(tmp_path):
    bad = tmp_path / "gemm_perf.parquet"
    pq.write_table(_gemm_table().drop_columns(["k"]), bad)
    with pytest.raises(ProfileError) as e:
        P.load_gemm(bad)
    assert isinstance(e.value, ValueError)
    assert e.value.column == "k" and e.value.file == str(bad)
    assert str(bad) in str(e.value) and "'k'" in str(e.value) and "missing" in str(e.value)
    # the error survives pickling with its fields
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.column, again.file, str(again)) == ("k", str(bad), str(e.value))


def test_unexpected_column_type(tmp_path):
    bad = tmp_path / "gemm_perf.parquet"
    pq.write_table(_gemm_table(m=[1.0, 2.0, 3.0, 4.0]), bad)
    with pytest.raises(ProfileError, match="unexpected type double") as e:
        P.load_gemm(bad)
    assert e.value.column == "m"
    pq.write_table(_gemm_table(latency=["1", "2", "3", "4"]), bad)
    with pytest.raises(ProfileError) as e:
        P.load_gemm(bad)
    assert e.value.column == "latency"


def test_bad_rows_are_dropped_and_counted(tmp_path):
    path = tmp_path / "gemm_perf.parquet"
    lat = [0.01, float("nan"), -0.5, 0.0, float("inf"), 0.02, None, 0.03]
    m = [1, 2, 3, 4, 5, 0, 7, 8]
    kernel = [None] + ["k"] * 7  # a null descriptive column is no reason to drop a row
    pq.write_table(_gemm_table(latency=lat, m=m, kernel_source=kernel), path)
    g = P.load_gemm(path)
    assert g.skipped == {"latency_missing": 1, "latency_nan": 1, "latency_nonpositive": 2,
                         "latency_inf": 1, "m_nonpositive": 1}
    assert len(g) + sum(g.skipped.values()) == len(lat)
    np.testing.assert_array_equal(g.m, [1, 8])
    np.testing.assert_allclose(g.latency_s, [1e-5, 3e-5])
    assert g.kernel.tolist() == ["", "k"]
    assert "skipped" in repr(g)
    # a subset keeps the load-time counts
    assert g.select(g.m > 1).skipped == g.skipped


def test_empty_table_and_nothing_left(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(_gemm_table().slice(0, 0), empty)
    with pytest.raises(ProfileError, match="empty"):
        P.load_gemm(empty)
    dead = tmp_path / "dead.parquet"
    pq.write_table(_gemm_table(latency=[float("nan"), 0.0, -1.0, 0.0]), dead)
    with pytest.raises(ProfileError, match="no valid rows left"):
        P.load_gemm(dead)


def test_unknown_kv_dtype_is_an_error(tmp_path):
    t = pq.read_table(DECODE)
    i = t.schema.get_field_index("kv_cache_dtype")
    t = t.set_column(i, "kv_cache_dtype", pa.array(["mystery"] * t.num_rows))
    path = tmp_path / "generation_attention_perf.parquet"
    pq.write_table(t, path)
    with pytest.raises(ProfileError, match="mystery") as e:
        P.load_decode_attention(path)
    assert e.value.column == "kv_cache_dtype"


def test_vidur_missing_column(tmp_path):
    lines = VIDUR_MLP.read_text().splitlines()
    header = lines[0].split(",")
    j = header.index("num_tokens")
    out = [",".join(c for i, c in enumerate(line.split(",")) if i != j) for line in lines]
    bad = tmp_path / "mlp.csv"
    bad.write_text("\n".join(out) + "\n")
    with pytest.raises(ProfileError) as e:
        P.load_vidur_mlp(bad)
    assert e.value.column == "num_tokens"


def test_missing_pyarrow_names_the_extra(monkeypatch):
    for mod in ("pyarrow", "pyarrow.parquet", "pyarrow.compute"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"jkernel\[profiles\]"):
        P.load_gemm(GEMM)


def test_package_import_is_light():
    code = ("import sys, jkernel.calibration, jkernel.calibration.data; "
            "heavy = [m for m in ('numpy', 'jax', 'pyarrow', 'jkernel.calibration.data.profiles') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[1])


# -- observation-set protocol ----------------------------------------------------------


def test_arrays_are_read_only_and_equal_length():
    g = P.load_gemm(GEMM)
    with pytest.raises(ValueError):
        g.m[0] = 7
    with pytest.raises(ValueError, match="rows"):
        P.GemmObservations(chip="x", dtype=np.array(["bf16"]), m=np.array([1, 2]),
                           n=np.array([1]), k=np.array([1]), latency_s=np.array([1.0]),
                           kernel=np.array([""]))
    cols = g.columns()
    assert set(cols) == set(P.GemmObservations._columns)
    assert len({len(a) for a in cols.values()}) == 1


def test_select_and_where():
    g = P.load_gemm(GEMM)
    sub = g.select(g.m == 1)
    assert (sub.m == 1).all() and len(sub) == int((g.m == 1).sum())
    idx = g.select([0, 2])
    assert idx.m.tolist() == [g.m[0], g.m[2]]
    quantised = g.where(dtype={"fp8", "fp8_block"})
    assert len(quantised) == int(np.isin(g.dtype, ["fp8", "fp8_block"]).sum())
    with pytest.raises(KeyError):
        g.where(bogus=1)


def _no_shape_on_both_sides(fit, held, cols):
    a = set(zip(*(getattr(fit, c).tolist() for c in cols)))
    b = set(zip(*(getattr(held, c).tolist() for c in cols)))
    return not (a & b)


def test_split_is_deterministic_and_keeps_shapes_together():
    g = P.load_gemm(GEMM)
    twice = P.GemmObservations.concat([g, g])  # every shape now repeated
    fit, held = twice.split(0.25, seed=3)
    fit2, held2 = twice.split(0.25, seed=3)
    np.testing.assert_array_equal(held.m, held2.m)
    np.testing.assert_array_equal(fit.latency_s, fit2.latency_s)
    assert len(fit) + len(held) == len(twice)
    assert 0.1 < len(held) / len(twice) < 0.4
    assert _no_shape_on_both_sides(fit, held, ("m", "n", "k"))
    # a shape's side does not depend on the other rows in the set
    _, held_sub = twice.where(dtype="bf16").split(0.25, seed=3)
    np.testing.assert_array_equal(np.sort(held_sub.shape_hash(3)),
                                  np.sort(held.where(dtype="bf16").shape_hash(3)))
    # another seed gives another split; grouping by weight shape keeps (n, k) together
    _, held_other = twice.split(0.25, seed=4)
    assert not np.array_equal(held.shape_hash(0), held_other.shape_hash(0))
    fit_nk, held_nk = twice.split(0.3, seed=0, by=("n", "k"))
    assert _no_shape_on_both_sides(fit_nk, held_nk, ("n", "k"))
    assert len(twice.split(0.0)[1]) == 0 and len(twice.split(1.0)[0]) == 0
    with pytest.raises(ValueError):
        twice.split(1.5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3)),
                min_size=1, max_size=60),
       st.floats(0.0, 1.0), st.integers(0, 2**40))
def test_split_property(shapes, fraction, seed):
    m, n, k = (np.array(x, dtype=np.int64) for x in zip(*shapes))
    obs = P.GemmObservations(chip="t", dtype=np.full(len(m), "bf16"), m=m, n=n, k=k,
                             latency_s=np.arange(1, len(m) + 1, dtype=float),
                             kernel=np.full(len(m), ""))
    fit, held = obs.split(fraction, seed)
    assert len(fit) + len(held) == len(obs)
    assert sorted(fit.latency_s.tolist() + held.latency_s.tolist()) == obs.latency_s.tolist()
    assert _no_shape_on_both_sides(fit, held, ("m", "n", "k"))


# -- one chip ----------------------------------------------------------------------------


def test_load_chip_reads_every_table():
    cp = P.load_chip(AIC, "h100_sxm")
    assert cp.chip == "h100_sxm"
    assert set(cp.tables()) == {"gemm", "decode_attention", "prefill_attention", "moe",
                                "mla_context", "mla_generation", "nccl", "custom_allreduce"}
    assert len(cp.sources) == 8 and cp.unloaded == ()
    by_path = {s.path: s for s in cp.sources}
    src = by_path["h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet"]
    assert src.sha256 == P.file_sha256(GEMM) and src.rows == len(cp.gemm)
    for path, sha, rows in cp.sources:  # plain (path, sha256, rows) tuples
        assert not Path(path).is_absolute() and len(sha) == 64 and rows > 0
    assert set(cp.collectives.backend) == {"nccl", "custom_allreduce"}
    b200 = P.load_chip(AIC, "b200_sxm")
    assert b200.gemm is not None and b200.moe is None and b200.collectives is None


def test_load_chip_takes_the_newest_version(tmp_path):
    root = tmp_path / "aic"
    shutil.copytree(H100 / "gemm", root / "h100_sxm/gemm")
    old = root / "h100_sxm/gemm/vllm/0.9.0"  # sorts after 0.24.0 as text, older as version
    old.mkdir()
    pq.write_table(_gemm_table().drop_columns(["k"]), old / "gemm_perf.parquet")
    extra = root / "h100_sxm/linear_attention/vllm/0.24.0"
    extra.mkdir(parents=True)
    pq.write_table(_gemm_table(), extra / "gdn_perf.parquet")
    cp = P.load_chip(root, "h100_sxm")
    assert [s.path for s in cp.sources] == ["h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet"]
    assert cp.unloaded == ("h100_sxm/linear_attention/vllm/0.24.0/gdn_perf.parquet",)
    assert len(cp.gemm) == _rows(GEMM)
    with pytest.raises(ProfileError, match="no folder for chip"):
        P.load_chip(root, "z100")


def test_version_order():
    names = ["0.9.0", "0.24.0", "0.1.dev19262+gb6bbf29dd", "0.24.0rc1", "0.14.0"]
    assert max(names, key=P._version_key) == "0.24.0"
    assert sorted(names, key=P._version_key)[0] == "0.1.dev19262+gb6bbf29dd"


@pytest.mark.skipif(not SHARED_GEMM.exists(),
                    reason="../shared/data/aic-op-profiles is absent (a clone without the "
                           "shared data); the committed excerpts are tested above")
def test_full_h100_gemm_table_when_present():
    g = P.load_gemm(SHARED_GEMM)
    assert len(g) == _rows(SHARED_GEMM) and g.skipped == {}
    assert g.where(dtype="bf16", m=1, n=8192, k=8192).latency_s[0] == pytest.approx(5.16e-5,
                                                                                     rel=2e-3)
