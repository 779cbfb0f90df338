"""Process configuration (jkernel.runtime): float64, CPU dispatch and threads, and the
persistent compilation cache (on by default, moved by JKERNEL_CACHE_DIR, off with 0).

What changes JAX's process-wide configuration runs in a fresh subprocess (XLA reads its
flags when its backend starts, and the test session's own configuration must not change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from jkernel import runtime


def _run(code: str, env: dict, timeout: int = 600) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("PJRT_NPROC", "JKERNEL_CPU_THREADS", "JKERNEL_CPU_ASYNC_DISPATCH",
                         "JAX_ENABLE_X64")}
    env = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("PYTHONPATH"), str(ROOT)])), "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# -- the cache directory ------------------------------------------------------------------------

def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JKERNEL_CACHE_DIR", "0")
    assert runtime.default_cache_dir() is None
    monkeypatch.setenv("JKERNEL_CACHE_DIR", " ~/jk ")
    assert runtime.default_cache_dir() == os.path.expanduser("~/jk")
    monkeypatch.setenv("JKERNEL_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.default_cache_dir() == str(tmp_path / "jkernel" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime.default_cache_dir() == str(tmp_path / "home" / ".cache" / "jkernel" / "xla")


def test_a_cache_that_is_off_or_cannot_be_made_changes_nothing(monkeypatch, tmp_path):
    """Off (JKERNEL_CACHE_DIR=0), or a directory that cannot be made (it only costs compile
    time): None, and JAX's cache setting is left as it was."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JKERNEL_CACHE_DIR", "0")
    assert runtime.enable_compilation_cache() is None
    (tmp_path / "file").write_text("")
    assert runtime.enable_compilation_cache(tmp_path / "file" / "xla") is None
    assert jax.config.jax_compilation_cache_dir == before


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


def test_a_second_process_reuses_the_cached_programs_and_prices_the_same(tmp_path):
    """JKERNEL_CACHE_DIR turns on JAX's persistent cache: a second process reuses programs."""
    code = ("import jkernel; k = jkernel.open('llama-3.1-8b-h100-tp1'); "
            "print(k.step_time(jkernel.Batch([1], [10])).no_overlap_s)")
    env = {"JKERNEL_CACHE_DIR": str(tmp_path / "xla")}
    first = _run(code, env)
    assert any((tmp_path / "xla").iterdir())
    assert _run(code, env) == first


# -- configure(): what an entry point sets before JAX starts ------------------------------------

_CONFIGURE = """
import json, os, sys, jax
from jkernel import runtime
if sys.argv[1:] == ["started"]:
    jax.devices()                                   # the caller started the backend first
x64_before = jax.config.jax_enable_x64
runtime.configure()
runtime.configure()                                 # a second entry point changes nothing
print(json.dumps({"x64": [x64_before, jax.config.jax_enable_x64],
                  "nproc": os.environ.get("PJRT_NPROC"),
                  "async": jax.config.read("jax_cpu_enable_async_dispatch"),
                  "cache": jax.config.jax_compilation_cache_dir}))
"""


@pytest.mark.parametrize("env, started, nproc, async_", [
    ({}, False, "1", False),                                  # one thread, synchronous
    ({"JKERNEL_CPU_THREADS": "3", "JKERNEL_CPU_ASYNC_DISPATCH": "1"}, False, "3", True),
    ({"PJRT_NPROC": "2", "JKERNEL_CPU_THREADS": "0"}, False, "2", False),  # the caller's
    ({}, True, None, True),                                   # too late: nothing changes
])
def test_configure_sets_float64_dispatch_and_threads_before_the_backend_starts(
        tmp_path, env, started, nproc, async_):
    code = _CONFIGURE.replace("sys.argv[1:]", repr(["started"] if started else []))
    out = json.loads(_run(code, {"JKERNEL_CACHE_DIR": str(tmp_path / "xla"), **env})
                     .splitlines()[-1])
    assert out["x64"] == [False, True]
    assert (out["nproc"], out["async"]) == (nproc, async_)
    assert out["cache"] == str(tmp_path / "xla")


def test_configure_leaves_a_cache_the_caller_set(tmp_path):
    code = ("import jax; jax.config.update('jax_compilation_cache_dir', %r)\n" %
            str(tmp_path / "mine")) + _CONFIGURE.replace("sys.argv[1:]", "[]")
    out = json.loads(_run(code, {"JKERNEL_CACHE_DIR": str(tmp_path / "xla")})
                     .splitlines()[-1])
    assert out["cache"] == str(tmp_path / "mine")
