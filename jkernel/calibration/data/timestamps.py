"""Streamed token timestamps → engine steps: the one reconstruction of calibration.

A serving client sees when each request's tokens arrive, not the engine's steps. Both
importers of such measurements rebuild the steps with :func:`reconstruct_steps`: the
timestamps importer (:func:`jkernel.calibration.data.importers.from_timestamps`, one time per
token) and the residency-vllm reader (:mod:`jkernel.calibration.data.residency`, one time per
streamed chunk, a chunk carrying one or more tokens). Input, per request
(:class:`TokenStream`, or a mapping with those keys): ``arrival_s`` (when it was sent),
``prompt_tokens``, ``token_times_s`` (when each token, or token-carrying chunk, was received)
and optionally ``output_tokens`` and ``id``. Method:

1. **Cluster** all token events by time. Events are sorted; a new step starts when an event
   is more than ``tolerance_s`` after the first event of the current step, or when its
   request already has an event in the current step (a request emits at most one token per
   step without speculation). ``tolerance_s`` defaults to :func:`default_tolerance_s`, 0.3 ×
   the median gap between consecutive events of one request (the typical step time): the
   tokens of one step arrive within streaming jitter, far less than a step apart.
2. **End** of a step: its earliest event (delivery delays only add).
3. **Composition.** Without speculation a running request runs one token per step: the step
   of its first event ran its prefill (``scheduled = prompt``, ``computed = 0``), a later
   step holding its token ``j`` ran a decode at ``computed = prompt + j − 1``. A step inside
   a request's span in which it sent nothing (a *gap*) is read by ``gap``:

   * ``"missed"`` (one time per token: the timestamps importer): the request missed its
     token there; that step cannot be composed and is dropped (``missed_token``), the
     request's other steps are kept, token ``j`` at its ``j``-th event;
   * ``"coalesced"`` (a chunk may carry several tokens: the residency reader): a request
     whose events span exactly ``output_tokens`` steps ran a decode in each of them,
     including those where it sent nothing (its next chunk carried those tokens: counted as
     ``coalesced``); a request spanning more steps than it has tokens (paused, or a step
     split by jitter) or fewer (steps merged) is inconsistent
     (``request_inconsistent``) and every step of its span is dropped
     (``inconsistent_request``).
4. **Chunked prefill** (with ``token_budget``, vLLM V1's ``max_num_batched_tokens``): a
   prompt longer than the budget left after the decodes and earlier prefills is split, FCFS
   in arrival order, over consecutive steps ending at its first token's step; each earlier
   chunk joins those steps' composition (``scheduled`` = the chunk, ``computed`` = the
   prompt already done). If those steps are invisible (the engine ran nothing else, so no
   event marks them), their time is in the first token's step, which is dropped
   (``prefill_chunks_hidden``). Without a budget a prompt runs whole in one step.
5. **Start**: the previous step's end, unless every request of the step is new and the last
   of them arrived after that end; then the engine was idle and the start is that arrival
   (flag ``idle_before``, also on the first step). Duration = end − start; a step with a
   non-positive duration is dropped (``nonpositive_duration``). A step lists its decodes
   first, then its prefills (vLLM's running-then-waiting order), each by request.

Failure modes (each leaves a count in :attr:`Reconstruction.dropped` or a flag):

* two steps closer than ``tolerance_s`` with disjoint requests merge into one (rule 1's
  same-request split catches it only when they share a request): durations too long, a step
  missing — keep the tolerance well below the shortest step;
* jitter larger than ``tolerance_s`` splits a step: its requests then look silent in one half
  (``missed_token`` or ``inconsistent_request``, dropped);
* chunked prefill without a budget: the chunks before the last emit no token, so their
  steps are invisible and their time is charged to the step that emits token 0;
* speculative decoding: more than one token per request per step breaks rule 1;
* preemption / recomputation: a request stops emitting, then resumes (a gap);
* async scheduling and output processing shift emission after the GPU work by a roughly
  constant lag, which cancels in end − end durations but not in the idle-start rule;
* the first step after an idle gap includes admission and tokenisation between the
  arrival and the GPU work (``idle_before``; the fits leave such steps out);
* data-parallel replicas must be reconstructed one stream per replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from .traces import TraceError

__all__ = ["GAPS", "TokenStream", "Reconstruction", "default_tolerance_s",
           "reconstruct_steps"]

#: How a step in which a running request sent nothing is read (module docstring, rule 3).
GAPS = ("missed", "coalesced")


class TokenStream(NamedTuple):
    """One request as a client saw it: ``arrival_s`` (seconds, the clock of the times),
    ``prompt_tokens``, ``token_times_s`` (one per token, or per token-carrying chunk;
    non-decreasing), ``output_tokens`` (None: one token per time) and ``id``."""

    id: Any
    arrival_s: float
    prompt_tokens: int
    token_times_s: Sequence[float]
    output_tokens: int | None = None


@dataclass
class Reconstruction:
    """Steps rebuilt by :func:`reconstruct_steps`. ``steps``: dicts with ``scheduled``,
    ``computed``, ``prompt`` (token lists, decodes first), ``start_s``, ``end_s``,
    ``duration_s``, ``flags``, ``decode_threshold``, ``requests`` (ids); ``dropped``: reason
    → count (``no_tokens`` and ``request_*`` count requests, the others steps);
    ``tolerance_s`` used; ``events`` clustered into ``clusters`` steps seen;
    ``coalesced``: tokens that arrived in a later chunk; ``chunked_prefills``: prompts split
    over several steps."""

    steps: list[dict]
    dropped: dict[str, int]
    tolerance_s: float
    events: int
    clusters: int
    coalesced: int = 0
    chunked_prefills: int = 0
    notes: list[str] = field(default_factory=list)


def default_tolerance_s(times: Sequence[np.ndarray]) -> float:
    """How close two token timestamps must be to belong to one engine step, seconds: 0.3 of
    the median gap between a request's consecutive tokens (1 ms when no request has two)."""
    gaps = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.zeros(0)])
    gaps = gaps[gaps > 0]
    return 0.3 * float(np.median(gaps)) if gaps.size else 1e-3


def _get(req, key, default=None):
    return req.get(key, default) if isinstance(req, Mapping) else getattr(req, key, default)


def reconstruct_steps(requests: Iterable[TokenStream | Mapping[str, Any]], *,
                      tolerance_s: float | None = None, gap: str = "missed",
                      token_budget: int | None = None,
                      decode_threshold: int = 1) -> Reconstruction:
    """Rebuild engine steps from per-request token timestamps (module docstring).

    ``requests``: :class:`TokenStream` records or mappings with the same keys (``id``
    defaults to the request's position). A request with no token time is ignored (counted as
    ``no_tokens``); one whose times are not finite or go backwards, that arrived after its
    first token, has no prompt, or has more times than ``output_tokens`` is a
    :class:`~jkernel.calibration.data.traces.TraceError`. ``gap``: one of :data:`GAPS`
    (``"missed"`` reads one token per time); ``token_budget``: the engine's token budget per
    step (None: a prompt runs whole in one step).
    """
    if gap not in GAPS:
        raise ValueError(f"gap must be one of {GAPS}, got {gap!r}")
    if token_budget is not None and int(token_budget) <= 0:
        raise ValueError(f"token_budget must be > 0, got {token_budget}")
    dropped: dict[str, int] = {}

    def drop(reason: str, n: int = 1) -> None:
        if n:
            dropped[reason] = dropped.get(reason, 0) + int(n)

    ids, arrivals, prompts, times, counts = [], [], [], [], []
    for i, r in enumerate(requests):
        tt = np.asarray(_get(r, "token_times_s", []), dtype=np.float64)
        name = _get(r, "id", i)
        if tt.size == 0:
            drop("no_tokens")
            continue
        if not np.all(np.isfinite(tt)):
            raise TraceError(f"request {name!r}: non-finite token time")
        if np.any(np.diff(tt) < 0):
            raise TraceError(f"request {name!r}: token times go backwards")
        a = float(_get(r, "arrival_s"))
        if not math.isfinite(a) or a > tt[0]:
            raise TraceError(f"request {name!r}: arrival {a} is not before its first token "
                             f"{tt[0]}")
        p = int(_get(r, "prompt_tokens"))
        if p <= 0:
            raise TraceError(f"request {name!r}: prompt_tokens must be > 0")
        n = _get(r, "output_tokens")
        n = len(tt) if n is None else int(n)
        if n < len(tt) or (gap == "missed" and n != len(tt)):
            raise TraceError(f"request {name!r}: {len(tt)} token times for {n} output tokens"
                             + (" (gap='missed' reads one token per time)"
                                if gap == "missed" else ""))
        ids.append(name)
        arrivals.append(a)
        prompts.append(p)
        times.append(tt)
        counts.append(n)
    if not times:
        raise TraceError("no request has a token")
    tol = float(default_tolerance_s(times) if tolerance_s is None else tolerance_s)
    n_req = len(times)

    # -- 1, 2. cluster; a step ends at its earliest event -----------------------------------
    ev_t = np.concatenate(times)
    ev_r = np.concatenate([np.full(len(t), k) for k, t in enumerate(times)])
    ev_j = np.concatenate([np.arange(len(t)) for t in times])
    order = np.lexsort((ev_j, ev_r, ev_t))
    ev_t, ev_r, ev_j = ev_t[order], ev_r[order], ev_j[order]
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

    # -- 3. composition: which requests decode in which step --------------------------------
    first_c = np.full(n_req, n_cl)
    last_c = np.full(n_req, -1)
    np.minimum.at(first_c, ev_r, cl)
    np.maximum.at(last_c, ev_r, cl)
    span = last_c - first_c + 1
    n_tok = np.asarray(counts)
    n_ev = np.bincount(ev_r, minlength=n_req)
    gap_step = np.zeros(n_cl, bool)          # steps dropped for a request's gap
    decodes: list[tuple[int, int, int]] = []   # (request, step, computed)
    if gap == "coalesced":
        good = span == n_tok
        coalesced = int(np.sum((n_tok - n_ev)[good]))
        for r in np.nonzero(~good)[0]:
            gap_step[first_c[r]:last_c[r] + 1] = True
        drop("request_inconsistent", int((~good).sum()))
        for r in np.nonzero(good)[0]:
            a, b = int(first_c[r]), int(last_c[r])
            decodes += [(r, k, prompts[r] + (k - a) - 1) for k in range(a + 1, b + 1)]
        gap_reason = "inconsistent_request"
    else:
        good = np.ones(n_req, bool)
        coalesced = 0
        for r in np.nonzero(span > n_ev)[0]:
            gap_step[np.setdiff1d(np.arange(first_c[r], last_c[r] + 1), cl[ev_r == r])] = True
        later = np.nonzero(ev_j > 0)[0]
        decodes = [(int(ev_r[e]), int(cl[e]), prompts[ev_r[e]] + int(ev_j[e]) - 1)
                   for e in later]
        gap_reason = "missed_token"
    used = np.zeros(n_cl, np.int64)          # tokens scheduled per step so far
    np.add.at(used, np.asarray([k for _, k, _ in decodes], np.int64), 1)

    # -- 4. prefills in FCFS order (arrival), chunked over the budget left -------------------
    comp: list[list[tuple[int, int, int]]] = [[] for _ in range(n_cl)]
    hidden = np.zeros(n_cl, bool)
    chunked = 0
    for r in sorted(np.nonzero(good)[0], key=lambda k: arrivals[k]):
        a, p = int(first_c[r]), prompts[r]
        chunks = [(a, p)] if token_budget is None else _prefill_chunks(
            a, p, arrivals[r], int(token_budget), used, end, hidden)
        if len(chunks) > 1:
            chunked += 1
        done = 0
        for k, take in chunks:               # forward in time
            comp[k].append((r, take, done))
            used[k] += take
            done += take
    for r, k, cc in decodes:
        comp[k].append((r, 1, cc))

    # -- 5. start, duration --------------------------------------------------------------------
    steps = []
    prev_end = None
    for k in range(n_cl):
        e = float(end[k])
        rows = comp[k]
        flags = []
        new = [r for r, s, cc in rows if first_c[r] == k or (s > 1 and cc == 0)]
        if prev_end is None:
            start = max([arrivals[r] for r in new], default=e)
            flags.append("idle_before")
        elif rows and len(new) == len(rows) and max(arrivals[r] for r in new) > prev_end:
            start = max(arrivals[r] for r in new)
            flags.append("idle_before")
        else:
            start = prev_end
        prev_end = e
        if gap_step[k]:
            drop(gap_reason)
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
                      "decode_threshold": decode_threshold,
                      "requests": [ids[r] for r, _, _ in rows]})
    return Reconstruction(steps, dropped, tol, int(len(ev_t)), n_cl, coalesced, chunked)


def _prefill_chunks(a: int, p: int, arrival: float, budget: int, used: np.ndarray,
                    end: np.ndarray, hidden: np.ndarray) -> list[tuple[int, int]]:
    """``[(step, tokens)]`` of a prompt of ``p`` tokens whose first token came in step ``a``:
    back from ``a`` through the steps the request can have run in (not before it arrived)
    until their spare budget covers the prompt, then filled forward, each chunk as large as
    the budget left, the remainder last (vLLM V1's scheduler). When those steps cannot hold
    it (nobody else marked them), step ``a`` is marked in ``hidden`` and the prompt is
    placed whole there."""
    steps_back, room, k = [], 0, a
    while room < p and k >= 0:
        if k < a and (k == 0 or end[k - 1] < arrival):
            break                            # step k was scheduled before the request came
        cap = max(budget - int(used[k]), 0)
        if cap > 0 or k == a:
            steps_back.append(k)
            room += cap
        k -= 1
    if room < p:
        hidden[a] = True                     # chunks ran in steps nobody else marked
        steps_back = [a]
    chunks, need = [], p
    for k in reversed(steps_back):
        take = need if k == a else min(max(budget - int(used[k]), 0), need)
        if take > 0:
            chunks.append((k, take))
            need -= take
    return chunks
