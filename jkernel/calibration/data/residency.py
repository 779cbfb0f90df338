"""Importer of streamed-token serving traces (``trace.csv`` + ``trace.itl.csv``) into step traces.

The format is the one of the public ``inference-sim/residency-vllm`` runs (and of the
inference-sim client that wrote them): ``trace.csv`` holds one row per request (times in µs,
``send_time_us``, ``first_chunk_time_us``, ``last_chunk_time_us`` on the client clock,
``server_input_tokens``, ``output_tokens``, ``num_chunks``, ``status``) and ``trace.itl.csv``
one row per streamed chunk (``request_id``, ``chunk_index``, ``timestamp_us``).

Method (:func:`import_residency`), the timestamp method of :mod:`calibration.importers` (b)
adapted to what a streamed chat/completions response really carries:

1. **Chunks → token events.** vLLM's OpenAI server sends a *role chunk* before the first
   token (it carries no token; it leaves with the first token's step) and a *final empty
   chunk* after the last one (finish reason / usage). With ``role_chunk`` / ``final_chunk``
   (default on) the first and last chunk of every request are set aside; the rest carry
   tokens. When a request has fewer token chunks than ``output_tokens``, the stream
   coalesced several tokens into one chunk (the client fell behind): which chunks did is
   inferred in step 3.
2. **Cluster** all token chunks by time (a new step starts when a chunk is more than
   ``tolerance_s`` after the step's first chunk, or when its request already has a chunk in
   the step). ``tolerance_s`` defaults to 0.3 × the median gap between a request's chunks.
   A step ends at its earliest chunk.
3. **Composition.** Without speculation a running request emits one token per step, so a
   request whose chunks span ``output_tokens`` consecutive steps ran a decode in each of
   them, including the steps where it sent nothing (its next chunk carried those tokens:
   counted as ``coalesced_chunks``). A request spanning more steps than it has tokens was
   paused (preemption) or a step was split by jitter; a request spanning fewer was merged.
   Its steps cannot be composed and are dropped (``inconsistent_request``). The step of a
   request's first token ran its prefill (or the last chunk of it); later steps run one
   decode at ``computed = prompt + j − 1`` for token ``j``.
4. **Chunked prefill** (vLLM V1, ``max_num_batched_tokens``): a prompt longer than the
   step's token budget left after the decodes and earlier prefills is split, FCFS, over
   consecutive steps ending at its first token's step; each earlier chunk is added to those
   steps' composition (``scheduled`` = the chunk, ``computed`` = the prompt already done).
   If those steps are invisible (the engine ran nothing else, so no chunk marks them), their
   time is in the first token's step, which is dropped (``prefill_chunks_hidden``).
5. **Start** = the previous step's end, unless every request of the step is new and the last
   of them was sent after that end (the engine was idle: start = that send time, flag
   ``idle_before``, also on the first step). Such steps include HTTP, tokenisation and
   admission; the fits leave them out. Prefix-cache hits are taken as 0 (the runs' prompts
   are random).

Everything dropped is counted by reason in :attr:`ResidencyImport.dropped` (requests and
steps), nothing silently.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .importers import default_tolerance_s
from .traces import StepTrace, TraceError

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
    ``trace`` is the :class:`~calibration.traces.StepTrace` (steps in time order)."""
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
    n_req = len(times)
    tol = float(default_tolerance_s(times) if tolerance_s is None else tolerance_s)

    # -- 2. cluster ------------------------------------------------------------------------
    ev_t = np.concatenate(times)
    ev_r = np.concatenate([np.full(len(t), k) for k, t in enumerate(times)])
    order = np.lexsort((ev_r, ev_t))
    ev_t, ev_r = ev_t[order], ev_r[order]
    cl = np.empty(len(ev_t), np.int64)
    c, first_t, members = -1, -math.inf, set()
    for e in range(len(ev_t)):
        r = int(ev_r[e])
        if c >= 0 and ev_t[e] - first_t <= tol and r not in members:
            members.add(r)
        else:
            c += 1
            first_t = ev_t[e]
            members = {r}
        cl[e] = c
    n_cl = c + 1
    end = np.full(n_cl, np.inf)
    np.minimum.at(end, cl, ev_t)

    # -- 3. composition --------------------------------------------------------------------
    first_c = np.full(n_req, n_cl)
    last_c = np.full(n_req, -1)
    np.minimum.at(first_c, ev_r, cl)
    np.maximum.at(last_c, ev_r, cl)
    span = last_c - first_c + 1
    n_tok = np.asarray(ntok)
    n_chunks = np.bincount(ev_r, minlength=n_req)
    good = span == n_tok
    coalesced = int(np.sum((n_tok - n_chunks)[good]))
    bad_step = np.zeros(n_cl, bool)
    for r in np.nonzero(~good)[0]:
        bad_step[first_c[r]:last_c[r] + 1] = True
    drop("request_inconsistent", int((~good).sum()))
    # per step: (request, scheduled, computed) lists; decodes first
    comp: list[list[tuple[int, int, int]]] = [[] for _ in range(n_cl)]
    used = np.zeros(n_cl, np.int64)
    starts = np.zeros(n_cl, np.int64)   # +1 per request whose span starts there
    np.add.at(starts, first_c[good], 1)
    for r in np.nonzero(good)[0]:
        a, b = int(first_c[r]), int(last_c[r])
        if b > a:
            used[a + 1:b + 1] += 1
    # prefills in FCFS order (send time), chunked over the budget left
    hidden = np.zeros(n_cl, bool)
    chunked = 0
    for r in sorted(np.nonzero(good)[0], key=lambda k: sends[k]):
        a, p = int(first_c[r]), prompts[r]
        # the steps it can have run in, back from its first token's step until their spare
        # budget covers the prompt; then filled forward (each chunk as large as the budget
        # left, the remainder last: vLLM V1's scheduler)
        steps_back, room, k = [], 0, a
        while room < p and k >= 0:
            if k < a and (k == 0 or end[k - 1] < sends[r]):
                break                        # step k was scheduled before the request came
            cap = max(budget - int(used[k]), 0)
            if cap > 0 or k == a:
                steps_back.append(k)
                room += cap
            k -= 1
        if room < p:
            hidden[a] = True                 # chunks ran in steps nobody else marked
            steps_back = [a]
        chunks, need = [], p
        for k in reversed(steps_back):
            take = need if k == a else min(max(budget - int(used[k]), 0), need)
            if take > 0:
                chunks.append((k, take))
                need -= take
        if len(chunks) > 1:
            chunked += 1
        done = 0
        for k, take in chunks:               # forward in time
            comp[k].append((r, take, done))
            used[k] += take
            done += take
    for r in np.nonzero(good)[0]:
        a, b = int(first_c[r]), int(last_c[r])
        for k in range(a + 1, b + 1):
            comp[k].append((r, 1, prompts[r] + (k - a) - 1))

    # -- 5. start, duration ----------------------------------------------------------------
    steps = []
    prev_end = None
    for k in range(n_cl):
        e = float(end[k])
        rows = comp[k]
        flags = []
        new = [r for r, s, cc in rows if first_c[r] == k or (s > 1 and cc == 0)]
        if prev_end is None:
            start = max([sends[r] for r in new], default=e)
            flags.append("idle_before")
        elif rows and len(new) == len(rows) and max(sends[r] for r in new) > prev_end:
            start = max(sends[r] for r in new)
            flags.append("idle_before")
        else:
            start = prev_end
        prev_end = e
        if bad_step[k]:
            drop("inconsistent_request")
            continue
        if hidden[k]:
            drop("prefill_chunks_hidden")
            continue
        if not rows:
            drop("empty")
            continue
        dur = e - start
        if not dur > 0:
            drop("nonpositive_duration")
            continue
        rows = sorted(rows, key=lambda x: (x[1] > 1, x[0]))
        steps.append({"scheduled": [s for _, s, _ in rows], "computed": [cc for _, _, cc in rows],
                      "prompt": [prompts[r] for r, _, _ in rows], "start_s": start, "end_s": e,
                      "duration_s": dur, "flags": tuple(flags),
                      "requests": [ids[r] for r, _, _ in rows]})
    if not steps:
        raise TraceError(f"no step could be rebuilt (dropped: {dropped})", file=str(run))
    from .importers import _trace
    tr = _trace(deployment, steps, source=f"{run} (import residency, tolerance "
                                          f"{tol * 1e6:.0f} µs)",
                skipped=dict(dropped), sha256=digest)
    tr.file = str(run)
    tr.end_s = np.array([s["end_s"] for s in steps])
    return ResidencyImport(steps, dropped, tol, int(len(req)), int(len(chk)), int(len(ev_t)),
                           n_cl, coalesced, chunked, tr)
