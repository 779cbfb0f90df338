"""The residency-vllm serving-run reader: a streamed run (``trace.csv`` + ``trace.itl.csv``)
rebuilt into a step trace.

The format is the one of the public ``inference-sim/residency-vllm`` runs (and of the
inference-sim client that wrote them): ``trace.csv`` holds one row per request (times in µs,
``send_time_us``, ``first_chunk_time_us``, ``last_chunk_time_us`` on the client clock,
``server_input_tokens``, ``output_tokens``, ``num_chunks``, ``status``) and ``trace.itl.csv``
one row per streamed chunk (``request_id``, ``chunk_index``, ``timestamp_us``).

Method (:func:`import_residency`): the chunks become token times, and the one
reconstruction of calibration, :func:`jkernel.calibration.data.timestamps.reconstruct_steps`,
rebuilds the steps from them, adapted to what a streamed chat/completions response really
carries:

1. **Chunks → token events.** vLLM's OpenAI server sends a *role chunk* before the first
   token (it carries no token; it leaves with the first token's step) and a *final empty
   chunk* after the last one (finish reason / usage). With ``role_chunk`` / ``final_chunk``
   (default on) the first and last chunk of every request are set aside; the rest carry
   tokens. When a request has fewer token chunks than ``output_tokens``, the stream
   coalesced several tokens into one chunk (the client fell behind): the reconstruction
   reads a step in which a running request sent nothing as such a coalesced token
   (``gap="coalesced"``), and a request whose chunks span more or fewer steps than its
   tokens (preemption, a step split by jitter, steps merged) as inconsistent: its steps are
   dropped.
2. **Chunked prefill** (vLLM V1, ``max_num_batched_tokens``, the reconstruction's
   ``token_budget``): a prompt longer than the step's token budget is split FCFS over the
   steps before its first token; a prompt whose chunks ran in steps nobody else marked
   leaves its first token's step unpriceable (dropped).
3. Steps after an idle engine are flagged ``idle_before`` (they include HTTP, tokenisation
   and admission; the fits leave them out). Prefix-cache hits are taken as 0 (the runs'
   prompts are random).

Everything dropped is counted by reason in :attr:`ResidencyImport.dropped` (requests and
steps), nothing silently.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .timestamps import TokenStream, reconstruct_steps
from .traces import StepTrace, TraceError, from_steps

__all__ = ["ResidencyImport", "import_residency", "find_run", "DEFAULT_DEPLOYMENT",
           "REQUEST_COLUMNS", "CHUNK_COLUMNS"]

#: The catalog scenario of the residency-vllm runs (Qwen3-14B bf16 on one H100, vLLM defaults).
DEFAULT_DEPLOYMENT = "qwen3-14b-h100-tp1"
REQUEST_COLUMNS = ("request_id", "send_time_us", "server_input_tokens", "output_tokens",
                   "num_chunks", "status")
CHUNK_COLUMNS = ("request_id", "chunk_index", "timestamp_us")


@dataclass
class ResidencyImport:
    """What :func:`import_residency` rebuilt. ``steps``: dicts (``scheduled``, ``computed``,
    ``prompt``, ``start_s``, ``end_s`` (seconds since the run's first send), ``duration_s``,
    ``flags``); ``dropped``: reason → count (``request_*`` reasons count requests, the others
    steps); the rest counts what was seen."""

    steps: list[dict]
    dropped: dict[str, int]
    tolerance_s: float
    requests: int
    chunks: int
    token_chunks: int
    clusters: int
    coalesced_chunks: int
    chunked_prefills: int
    trace: StepTrace | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        d = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "nothing"
        return (f"{self.requests} requests, {self.chunks} chunks ({self.token_chunks} with "
                f"tokens) → {self.clusters} steps seen, {len(self.steps)} kept "
                f"(tolerance {self.tolerance_s * 1e6:.0f} µs; {self.coalesced_chunks} "
                f"coalesced chunks, {self.chunked_prefills} chunked prefills); dropped: {d}")


def find_run(path: str | Path) -> Path:
    """The folder holding ``trace.csv`` and ``trace.itl.csv``: ``path`` itself or its
    ``patched/`` subfolder (the residency-vllm layout)."""
    p = Path(path)
    for cand in (p, p / "patched"):
        if (cand / "trace.csv").is_file() and (cand / "trace.itl.csv").is_file():
            return cand
    raise TraceError(f"no trace.csv and trace.itl.csv in {p} (nor in {p / 'patched'})",
                     file=str(p))


def _read(path: Path, need: tuple[str, ...]):
    import pandas as pd
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read: {exc}", file=str(path)) from exc
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise TraceError(f"missing column(s) {missing} (has {list(df.columns)})", file=str(path))
    return df


def import_residency(path: str | Path, deployment=DEFAULT_DEPLOYMENT, *,
                     max_num_batched_tokens: int = 8192, tolerance_s: float | None = None,
                     role_chunk: bool = True, final_chunk: bool = True) -> ResidencyImport:
    """Rebuild the engine steps of one streamed run (module docstring); the result's
    ``trace`` is the :class:`~jkernel.calibration.data.traces.StepTrace` (steps in time
    order)."""
    run = find_run(path)
    rf, cf = run / "trace.csv", run / "trace.itl.csv"
    req = _read(rf, REQUEST_COLUMNS)
    chk = _read(cf, CHUNK_COLUMNS)
    digest = hashlib.sha256(rf.read_bytes() + cf.read_bytes()).hexdigest()
    dropped: dict[str, int] = {}

    def drop(reason, n=1):
        if n:
            dropped[reason] = dropped.get(reason, 0) + int(n)

    budget = int(max_num_batched_tokens)
    if budget <= 0:
        raise ValueError(f"max_num_batched_tokens must be > 0, got {max_num_batched_tokens}")
    strip = int(bool(role_chunk)) + int(bool(final_chunk))
    chk = chk.sort_values(["request_id", "chunk_index"], kind="stable")
    groups = {int(k): g["timestamp_us"].to_numpy(np.float64)
              for k, g in chk.groupby("request_id", sort=False)}
    t0 = float(np.nanmin(req["send_time_us"].to_numpy(np.float64)))
    ids, sends, prompts, ntok, times = [], [], [], [], []
    for row in req.itertuples(index=False):
        rid = int(row.request_id)
        if str(row.status) != "ok":
            drop(f"request_status_{row.status}")
            continue
        ts = groups.get(rid)
        if ts is None or len(ts) <= strip:
            drop("request_no_token_chunk")
            continue
        if not np.all(np.isfinite(ts)) or np.any(np.diff(ts) < 0):
            drop("request_chunk_times_invalid")
            continue
        if int(row.num_chunks) != len(ts):
            drop("request_chunk_count_mismatch")
            continue
        tok = ts[int(bool(role_chunk)):len(ts) - int(bool(final_chunk))]
        n_out, p = int(row.output_tokens), int(row.server_input_tokens)
        if p <= 0 or n_out <= 0:
            drop("request_counts_invalid")
            continue
        if len(tok) > n_out:
            drop("request_more_chunks_than_tokens")
            continue
        send = float(row.send_time_us)
        if not math.isfinite(send) or send > tok[0]:
            drop("request_sent_after_first_token")
            continue
        ids.append(rid)
        sends.append((send - t0) * 1e-6)
        prompts.append(p)
        ntok.append(n_out)
        times.append((tok - t0) * 1e-6)
    if not times:
        raise TraceError(f"no usable request (dropped: {dropped})", file=str(rf))
    streams = [TokenStream(*x) for x in zip(ids, sends, prompts, times, ntok)]
    rec = reconstruct_steps(streams, tolerance_s=tolerance_s, gap="coalesced",
                            token_budget=budget)
    for reason, n in rec.dropped.items():
        drop(reason, n)
    if not rec.steps:
        raise TraceError(f"no step could be rebuilt (dropped: {dropped})", file=str(run))
    tol = rec.tolerance_s
    tr = from_steps(deployment, rec.steps, source=f"{run} (import residency, tolerance "
                                                  f"{tol * 1e6:.0f} µs)",
                    skipped=dict(dropped), sha256=digest)
    tr.file = str(run)
    tr.end_s = np.array([s["end_s"] for s in rec.steps])
    return ResidencyImport(rec.steps, dropped, tol, int(len(req)), int(len(chk)), rec.events,
                           rec.clusters, rec.coalesced, rec.chunked_prefills, tr)
