"""Regenerate the small profile fixtures under tests/data/aic and tests/data/vidur.

Run from the project root with the shared data present:

    python tests/data/aic/make_fixtures.py [/path/to/shared/data]

Rows are picked by value (no randomness), written with pyarrow in the source table's own
schema, and each table's collection_meta.yaml and the sources' LICENSE files are copied.
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent          # tests/data/aic
TESTS_DATA = HERE.parent                        # tests/data


def _cols(table, names):
    return {n: table.column(n).to_numpy(zero_copy_only=False) for n in names}


def _write(src_root: Path, rel: str, mask_fn) -> int:
    src = src_root / rel
    table = pq.read_table(src)
    idx = np.flatnonzero(mask_fn(table))
    out = HERE / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.take(idx), out, compression="zstd")
    shutil.copyfile(src.parent / "collection_meta.yaml", out.parent / "collection_meta.yaml")
    print(f"{rel}: {len(idx)} rows, {out.stat().st_size} bytes")
    return len(idx)


GEMM_M = [1, 2, 4, 8, 16, 17, 32, 33, 48, 64, 65, 96, 128, 129, 160, 192, 256, 257, 512,
          513, 768, 1024, 1025, 1536, 2048, 2304, 2560, 3072, 4096, 4352, 8192, 16384, 32768]
GEMM_NK = [(32, 8192), (256, 4096), (1024, 1024), (2048, 8192), (4096, 512), (4096, 4096),
           (5120, 5120), (6144, 4096), (8192, 3584), (8192, 8192), (12288, 8192),
           (16384, 4096), (4096, 16384), (51200, 4096)]


def gemm_h100(t):
    c = _cols(t, ["gemm_dtype", "m", "n", "k"])
    nk = np.zeros(len(c["m"]), bool)
    for n, k in GEMM_NK:
        nk |= (c["n"] == n) & (c["k"] == k)
    bf16 = (c["gemm_dtype"] == "bfloat16") & nk & np.isin(c["m"], GEMM_M)
    other = (np.isin(c["gemm_dtype"], ["fp8", "fp8_block"]) & (c["n"] == 8192)
             & (c["k"] == 8192) & np.isin(c["m"], [1, 16, 64, 256, 1024, 4096, 16384]))
    return bf16 | other


def gemm_b200(t):
    c = _cols(t, ["gemm_dtype", "m", "n", "k"])
    return ((c["n"] == 8192) & (c["k"] == 8192)
            & np.isin(c["m"], [1, 8, 64, 256, 1024, 4096, 16384]))


def decode_h100(t):
    c = _cols(t, ["batch_size", "step", "num_heads", "num_key_value_heads", "head_dim",
                  "kv_cache_dtype", "window_size"])
    base = (c["num_heads"] == 16) & (c["num_key_value_heads"] == 2) & (c["head_dim"] == 128)
    steps_all = [1, 15, 127, 511, 2047, 8191, 32767, 131071]
    steps_few = [1, 127, 2047, 32767]
    plain = (base & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 0)
             & np.isin(c["batch_size"], [1, 8, 64]) & np.isin(c["step"], steps_all))
    fp8 = (base & (c["kv_cache_dtype"] == "fp8") & (c["window_size"] == 0)
           & (c["batch_size"] == 8) & np.isin(c["step"], steps_all))
    win = (base & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 128)
           & (c["batch_size"] == 8) & np.isin(c["step"], steps_all))
    other = ((c["num_heads"] == 64) & (c["num_key_value_heads"] == 8) & (c["head_dim"] == 128)
             & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 0)
             & np.isin(c["batch_size"], [1, 32]) & np.isin(c["step"], steps_few))
    return plain | fp8 | win | other


def prefill_h100(t):
    c = _cols(t, ["batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim",
                  "kv_cache_dtype", "window_size"])
    base = (c["num_heads"] == 16) & (c["num_key_value_heads"] == 2) & (c["head_dim"] == 128)
    isl_all = [1, 16, 128, 512, 1024, 2048, 4096, 8192, 16384]
    plain = (base & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 0)
             & np.isin(c["batch_size"], [1, 4]) & np.isin(c["isl"], isl_all))
    fp8 = (base & (c["kv_cache_dtype"] == "fp8") & (c["window_size"] == 0)
           & (c["batch_size"] == 1) & np.isin(c["isl"], [128, 1024, 4096, 16384]))
    win = (base & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 128)
           & (c["batch_size"] == 1) & np.isin(c["isl"], [128, 1024, 4096, 16384]))
    other = ((c["num_heads"] == 64) & (c["num_key_value_heads"] == 8) & (c["head_dim"] == 128)
             & (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 0)
             & (c["batch_size"] == 1) & np.isin(c["isl"], [128, 1024, 4096, 16384]))
    return plain | fp8 | win | other


def moe_h100(t):
    c = _cols(t, ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk",
                  "num_experts", "moe_tp_size", "moe_ep_size", "distribution"])
    shape = ((c["hidden_size"] == 2048) & (c["inter_size"] == 768) & (c["topk"] == 8)
             & (c["num_experts"] == 128))
    toks = [1, 4, 16, 64, 256, 1024, 4096, 16384]
    bal = (shape & (c["moe_dtype"] == "bfloat16") & (c["distribution"] == "balanced")
           & (c["moe_tp_size"] == 1) & (c["moe_ep_size"] == 1) & np.isin(c["num_tokens"], toks))
    pl = (shape & (c["moe_dtype"] == "bfloat16") & (c["distribution"] == "power_law_1.2")
          & (c["moe_tp_size"] == 1) & (c["moe_ep_size"] == 1)
          & np.isin(c["num_tokens"], [16, 256, 4096]))
    fp8 = (shape & (c["moe_dtype"] != "bfloat16") & (c["distribution"] == "balanced")
           & (c["moe_tp_size"] == 1) & (c["moe_ep_size"] == 1)
           & np.isin(c["num_tokens"], [16, 256, 4096]))
    par = (shape & (c["moe_dtype"] == "bfloat16") & (c["distribution"] == "balanced")
           & (((c["moe_tp_size"] == 2) & (c["moe_ep_size"] == 1))
              | ((c["moe_tp_size"] == 1) & (c["moe_ep_size"] == 4)))
           & np.isin(c["num_tokens"], [16, 256, 4096]))
    return bal | pl | fp8 | par


def mla_ctx_h100(t):
    c = _cols(t, ["num_heads", "batch_size", "isl", "kv_cache_dtype", "gemm_type"])
    return (np.isin(c["num_heads"], [16, 128]) & (c["kv_cache_dtype"] == "bfloat16")
            & (c["gemm_type"] == "bfloat16") & np.isin(c["batch_size"], [1, 8])
            & np.isin(c["isl"], [1, 128, 1024, 4096, 16384]))


def mla_gen_h100(t):
    c = _cols(t, ["num_heads", "batch_size", "step", "kv_cache_dtype", "gemm_type"])
    return (np.isin(c["num_heads"], [16, 128]) & (c["kv_cache_dtype"] == "bfloat16")
            & (c["gemm_type"] == "bfloat16") & np.isin(c["batch_size"], [1, 64])
            & np.isin(c["step"], [2, 128, 2048, 32768]))


def nccl_h100(t):
    c = _cols(t, ["op_name", "nccl_dtype", "num_gpus", "message_size"])
    sizes = [256, 512, 4096, 65536, 1048576, 16777216, 67108864, 268435456, 536870912]
    ar = ((c["op_name"] == "all_reduce") & (c["nccl_dtype"] == "half")
          & np.isin(c["message_size"], sizes))
    i8 = ((c["op_name"] == "all_reduce") & (c["nccl_dtype"] == "int8") & (c["num_gpus"] == 8)
          & np.isin(c["message_size"], sizes))
    oth = ((c["op_name"] != "all_reduce") & (c["nccl_dtype"] == "half") & (c["num_gpus"] == 8)
           & np.isin(c["message_size"], [4096, 1048576, 67108864]))
    return ar | i8 | oth


def car_h100(t):
    c = _cols(t, ["num_gpus", "message_size"])
    return np.isin(c["message_size"], [128, 2048, 32768, 524288, 8388608, 134217728])


def vidur_fixtures(shared: Path):
    src_root = shared / "vidur"
    dst_root = TESTS_DATA / "vidur"
    rel = Path("data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv")
    with open(src_root / rel, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    nt = header.index("num_tokens")
    keep = [r for r in body if r[nt] in {"1", "8", "64", "512", "2048", "4096"}]
    (dst_root / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(dst_root / rel, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([header] + keep)
    print(f"vidur/{rel}: {len(keep)} rows")
    rel = Path("data/profiling/network/h100_dgx/all_reduce.csv")
    with open(src_root / rel, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    sz = header.index("size")
    keep = [r for r in body if int(r[sz]) in {2048, 10240, 1048576, 4194304, 16777216,
                                               67108864}]
    (dst_root / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(dst_root / rel, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([header] + keep)
    print(f"vidur/{rel}: {len(keep)} rows")
    shutil.copyfile(src_root / "LICENSE", dst_root / "LICENSE")


def main(shared: Path):
    aic = shared / "aic-op-profiles"
    _write(aic, "h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet", gemm_h100)
    _write(aic, "b200_sxm/gemm/vllm/0.24.0/gemm_perf.parquet", gemm_b200)
    _write(aic, "h100_sxm/attention/vllm/0.24.0/generation_attention_perf.parquet",
           decode_h100)
    _write(aic, "h100_sxm/attention/vllm/0.24.0/context_attention_perf.parquet",
           prefill_h100)
    _write(aic, "h100_sxm/moe/vllm/0.24.0/moe_perf.parquet", moe_h100)
    _write(aic, "h100_sxm/mla/vllm/0.24.0/mla_context_module_perf.parquet", mla_ctx_h100)
    _write(aic, "h100_sxm/mla/vllm/0.24.0/mla_generation_module_perf.parquet", mla_gen_h100)
    _write(aic, "h100_sxm/comm/nccl/2.29.2/nccl_perf.parquet", nccl_h100)
    _write(aic, "h100_sxm/comm/vllm/0.24.0/custom_allreduce_perf.parquet", car_h100)
    shutil.copyfile(aic / "LICENSE", HERE / "LICENSE")
    vidur_fixtures(shared)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data").resolve())
