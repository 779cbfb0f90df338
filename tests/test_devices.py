"""Many devices: price_many and price_sweep split each chunk's batch axis over
every local device, with results bit-identical to one device; and the persistent
compilation cache (on by default, moved by JKERNEL_CACHE_DIR, off with 0).

Each test runs jkernel in a fresh subprocess (XLA reads its flags when its backend starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import catalog_kernel

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "mixtral-8x7b-h100-tp2"


def _inputs():
    rng = np.random.default_rng(11)
    s = rng.integers(0, 4, (37, 20)).astype(np.int32)
    s[:, 0] = 600
    c = rng.integers(0, 9000, (37, 20)).astype(np.int32)
    return s, c


def _run(code: str, env: dict, timeout: int = 600) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("PYTHONPATH"), str(ROOT)])), "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_two_cpu_devices_price_bit_identically(tmp_path):
    k = catalog_kernel(SCENARIO)
    s, c = _inputs()
    one = k.price_many(scheduled=s, computed=c, decode_threshold=3, chunk=16)
    sweep = k.price_sweep([k.params, k.params.scaled(hbm_derate=0.5)], scheduled=s,
                          computed=c, chunk=16)
    np.savez(tmp_path / "one.npz", s=s, c=c, many=np.stack(
        [one.expected_s, one.overlap_s, one.no_overlap_s, one.per_resource_s["hbm"]]),
        sweep=sweep.expected_s)
    code = f"""
import numpy as np, jax, jkernel
k = jkernel.open({SCENARIO!r})
assert jax.local_device_count() == 2, jax.devices()
ref = np.load({str(tmp_path / "one.npz")!r})
for chunk in (16, 4096):          # padded chunks (16 is not a multiple of 37) and one chunk
    est = k.price_many(scheduled=ref["s"], computed=ref["c"], decode_threshold=3, chunk=chunk)
    got = np.stack([est.expected_s, est.overlap_s, est.no_overlap_s, est.per_resource_s["hbm"]])
    # the edges and the resource totals are bit-identical; expected_s's per-row maxima
    # (refinement 7) reduce in a different order in the partitioned program, so it may
    # differ in the last bits (seen: 3.5e-18 s on 0.026 s, one ulp)
    assert np.array_equal(got[1:], ref["many"][1:]), np.abs(got - ref["many"]).max()
    assert np.allclose(got[0], ref["many"][0], rtol=4e-16, atol=0), np.abs(got - ref["many"]).max()
sw = k.price_sweep([k.params, k.params.scaled(hbm_derate=0.5)], scheduled=ref["s"],
                   computed=ref["c"], chunk=16)
assert np.allclose(sw.expected_s, ref["sweep"], rtol=4e-16, atol=0)
# the chunks really were split: one shard per device
from jax.sharding import NamedSharding
x = jax.device_put(ref["s"][:16], NamedSharding(jax.sharding.Mesh(np.asarray(jax.local_devices()),
                   ("batches",)), jax.sharding.PartitionSpec("batches")))
assert len(x.addressable_shards) == 2
print("ok")
"""
    out = _run(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                      "JKERNEL_CACHE_DIR": "0"})
    assert out.strip().endswith("ok")


def test_compilation_cache_is_used_moved_and_turned_off(tmp_path):
    code = """
import json, os, jax, jkernel
k = jkernel.open("llama-3.1-8b-h100-tp1")
k.step_time(jkernel.Batch([1], [10]))
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir}))
"""
    cache = tmp_path / "xla"
    first = json.loads(_run(code, {"JKERNEL_CACHE_DIR": str(cache)}).splitlines()[-1])
    assert first["dir"] == str(cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries                                             # the step program was stored
    _run(code, {"JKERNEL_CACHE_DIR": str(cache)})
    assert sorted(p.name for p in cache.iterdir()) == entries  # second run: nothing new
    off = json.loads(_run(code, {"JKERNEL_CACHE_DIR": "0"}).splitlines()[-1])
    assert off["dir"] is None
    home = tmp_path / "home"
    default = json.loads(_run(code, {"HOME": str(home), "XDG_CACHE_HOME": ""}
                              | {"JKERNEL_CACHE_DIR": ""}).splitlines()[-1])
    assert default["dir"] == str(home / ".cache" / "jkernel" / "xla")
