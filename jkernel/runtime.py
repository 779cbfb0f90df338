"""Process configuration the entry points apply before JAX is first used: float64, CPU
dispatch and threads, and the persistent compilation cache.

Nothing here runs at import (jax.config is set by entry points, never by importing a
module): :func:`configure` is called by ``jkernel.open`` / ``open_pool`` / ``new`` /
``open_inputs``; :func:`enable_x64` and :func:`enable_compilation_cache` are public for
callers that drive JAX themselves (calibration, notebooks).
"""

from __future__ import annotations

import os

import jax

__all__ = ["enable_x64", "default_cache_dir", "enable_compilation_cache", "configure"]


def enable_x64() -> None:
    """Turn on float64 in JAX (the spec's arithmetic). Called by the entry points."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def default_cache_dir() -> str | None:
    """Where compiled step programs persist: ``$JKERNEL_CACHE_DIR`` (``0`` turns the cache
    off: None), else the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``)
    ``/jkernel/xla``."""
    env = (os.environ.get("JKERNEL_CACHE_DIR") or "").strip()
    if env == "0":
        return None
    if env:
        return os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jkernel", "xla")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Persist compiled step programs across processes in ``path`` (default
    :func:`default_cache_dir`), so a second run of a command compiles nothing. Returns the
    directory used, or None when ``JKERNEL_CACHE_DIR=0`` turns the cache off (or the
    directory cannot be made, which only costs compile time)."""
    path = str(path) if path is not None else default_cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _backend_started() -> bool:
    """Whether a JAX backend (CPU client) has started. JAX has no public probe; this reads
    its private backend table, and assumes started (changing nothing) if that moved."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge._backends)
    except Exception:          # private API moved: assume started, change nothing
        return True


_CONFIGURED = False


def configure() -> None:
    """What every entry point (``jkernel.open``, ``open_pool``, ``new``, ``open_inputs``)
    sets before JAX is first used (never at import); idempotent.

    * float64 (the spec's arithmetic);
    * synchronous dispatch on CPU: a step is a few microseconds of work, and JAX's
      asynchronous CPU dispatch adds ~40 µs per call around it. It takes effect only if JAX's
      CPU backend has not started yet (let jkernel open a kernel first for the fastest
      ``step_time``); ``JKERNEL_CPU_ASYNC_DISPATCH=1`` keeps JAX's default;
    * one intra-op thread in XLA's CPU client (``PJRT_NPROC=1``, read when the client
      starts, unless the caller set it): a step is too small to gain from a second thread,
      and XLA splitting it over two cost 2–3 × (see benchmarks/RESULTS.md); ``price_many``
      keeps the cores busy with a thread per chunk instead. ``JKERNEL_CPU_THREADS=N`` asks
      for N;
    * the persistent compilation cache in :func:`default_cache_dir` (on by default,
      ``JKERNEL_CACHE_DIR=0`` turns it off), unless the caller configured JAX's own.
    """
    global _CONFIGURED
    enable_x64()
    if _CONFIGURED:
        return
    _CONFIGURED = True
    if not _backend_started():
        if os.environ.get("JKERNEL_CPU_ASYNC_DISPATCH", "0") != "1":
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        threads = os.environ.get("JKERNEL_CPU_THREADS", "1")
        if "PJRT_NPROC" not in os.environ and threads.strip() not in ("", "0"):
            os.environ["PJRT_NPROC"] = threads.strip()
    if not jax.config.jax_compilation_cache_dir:
        enable_compilation_cache()
