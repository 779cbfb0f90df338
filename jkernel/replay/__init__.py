"""Serving replay: a vLLM-v1-style scheduler stepping one pool (or a prefill/decode pair),
every step priced by a :class:`jkernel.Kernel`. Request table in, per-request latencies out::

    import jkernel
    from jkernel.replay import replay, load_requests
    k = jkernel.open("qwen3-14b-h100-tp1")
    res = replay(k, load_requests("trace.csv"), progress=True)
    res.requests        # one row per request: ttft_s, e2e_s, itl_mean_s, preemptions, ...
    res.summary         # mean/p50/p90/p99 of TTFT, ITL, E2E; throughput; steps; KV peak

The replay sits above the kernel core: it reads the kernel's resolved settings and prices
with ``step_time`` and the overhead methods, and the kernel knows nothing of it. Modules:
:mod:`~jkernel.replay.workload` (request tables), :mod:`~jkernel.replay.scheduler` (one
replica's vLLM v0.31.0 scheduler and KV blocks), :mod:`~jkernel.replay.sim` (the event loop),
:mod:`~jkernel.replay.api` (the entry points), :mod:`~jkernel.replay.clients` (closed-loop
clients, sessions, the warm-up/cool-down window), :mod:`~jkernel.replay.spec` (workload
specs), :mod:`~jkernel.replay.formats` (benchmark clients' result files),
:mod:`~jkernel.replay.metrics` (the clients' metric definitions),
:mod:`~jkernel.replay.lockstep` (many variants of one replay stepped together) and
:mod:`~jkernel.replay.intervals` (prediction intervals, docs/intervals.md). The replay
of the measured residency-vllm runs against the client's timings is a dataset study:
``validation/replay.py`` at the repository root.
"""

from .api import ReplayResult, format_summary, replay, replay_disaggregated, summarize
from .clients import Clients, Window
from .compare import Comparison, compare, format_comparison
from .formats import BenchmarkRun, read_benchmark
from .intervals import IntervalReplay, format_intervals, replay_intervals
from .spec import GeneratedWorkload, WorkloadSpec, load_workload, read_spec
from .workload import REQUIRED, load_requests, validate_requests

__all__ = ["replay", "replay_disaggregated", "ReplayResult", "load_requests",
           "validate_requests", "summarize", "format_summary", "REQUIRED", "Clients",
           "Window", "load_workload", "read_spec", "WorkloadSpec", "GeneratedWorkload",
           "read_benchmark", "BenchmarkRun", "compare", "Comparison", "format_comparison",
           "replay_intervals", "IntervalReplay", "format_intervals"]
