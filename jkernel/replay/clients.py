"""How requests are sent: open-loop arrivals, closed-loop clients, multi-turn sessions, and
the warm-up and cool-down a summary leaves out.

A request table says *when a request may be sent* (``arrival_s``: its schedule) and,
optionally, which conversation it belongs to (``session_id``: the turns of one session, in
table order) and how long its user thinks first (``think_s``: seconds after the session's
previous turn finished). :class:`Clients` says *who sends*:

* ``concurrency=0`` (open loop): every session's first turn is sent at its ``arrival_s``;
  each later turn when the previous one has finished plus its ``think_s``, not before its
  own ``arrival_s`` (inference-perf's multi-turn sessions wait for the previous round the
  same way). A table without sessions replays exactly as it always has.
* ``concurrency=N`` (closed loop): N clients. A free client takes the next session in
  schedule order and sends its turns one after another, each when the previous one has
  finished plus its ``think_s``; when the session is done, the client waits
  ``think_time_s`` and takes the next one. No request is sent before its ``arrival_s``, so
  a schedule is a rate cap: with every ``arrival_s`` 0 it is the pure closed loop of
  vLLM's ``bench serve --max-concurrency N`` (``--request-rate inf``), guidellm's
  ``concurrent`` strategy (N streams) and inference-perf's ``concurrent`` load; with a
  Poisson schedule it is ``--max-concurrency N --request-rate R`` (its semaphore lets
  requests go in schedule order, each as soon as one of N slots is free).

A request the server refuses (longer than ``max_model_len``) takes no time: its client goes
on at once, and a session goes on with its next turn.

:class:`Window` drops warm-up and cool-down requests from the summary as guidellm does
(``--warmup`` / ``--cooldown``): by count (the first / last requests to *complete*), by
fraction of the requests, or by time (requests *sent* within the first seconds of the run,
or within its last seconds before the last send). vLLM's ``--num-warmups`` sends extra
requests before the run and measures none of them; a replay starts warm, so it needs none.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

__all__ = ["Clients", "Window", "ClientLoop", "Send", "Sessions", "sessions_of"]


@dataclass(frozen=True)
class Clients:
    """Who sends the requests: ``concurrency`` clients (0: open loop), each pausing
    ``think_time_s`` seconds between the end of one session (or single request) and the
    next one it sends."""

    concurrency: int = 0
    think_time_s: float = 0.0

    def __post_init__(self):
        c = self.concurrency
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
            raise ValueError(f"concurrency must be a whole number of clients ≥ 0 (0: open "
                             f"loop), not {c!r}")
        z = self.think_time_s
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) \
                or z < 0:
            raise ValueError(f"think_time_s must be seconds ≥ 0, not {z!r}")
        if z > 0 and c == 0:
            raise ValueError("think_time_s needs closed-loop clients (concurrency > 0); an "
                             "open-loop session's pauses are its turns' think_s")

    @property
    def closed(self) -> bool:
        return self.concurrency > 0


@dataclass(frozen=True)
class Window:
    """Which requests a summary counts: all but the warm-up and the cool-down. Give each at
    most one way: ``*_requests`` (a count), ``*_fraction`` (of all requests, 0 ≤ f < 1) or
    ``*_s`` (seconds of the run). See the module text for guidellm's rules followed."""

    warmup_requests: int = 0
    warmup_fraction: float = 0.0
    warmup_s: float = 0.0
    cooldown_requests: int = 0
    cooldown_fraction: float = 0.0
    cooldown_s: float = 0.0

    def __post_init__(self):
        for end in ("warmup", "cooldown"):
            n = getattr(self, f"{end}_requests")
            f = getattr(self, f"{end}_fraction")
            s = getattr(self, f"{end}_s")
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"{end}_requests must be a whole number ≥ 0, not {n!r}")
            if not (isinstance(f, (int, float)) and 0 <= f < 1):
                raise ValueError(f"{end}_fraction must be a fraction 0 ≤ f < 1, not {f!r}")
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 0):
                raise ValueError(f"{end}_s must be seconds ≥ 0, not {s!r}")
            if sum(bool(x) for x in (n, f, s)) > 1:
                raise ValueError(f"give the {end} one way: a count ({end}_requests), a "
                                 f"fraction ({end}_fraction) or seconds ({end}_s)")

    @property
    def empty(self) -> bool:
        return not any((self.warmup_requests, self.warmup_fraction, self.warmup_s,
                        self.cooldown_requests, self.cooldown_fraction, self.cooldown_s))

    @classmethod
    def parse(cls, warmup: str | None = None, cooldown: str | None = None) -> "Window":
        """From the command line's ``--warmup`` / ``--cooldown``: ``N`` (requests), ``P%``
        (percent of the requests) or ``Ts`` (seconds)."""
        kw: dict = {}
        for end, text in (("warmup", warmup), ("cooldown", cooldown)):
            if text is None:
                continue
            t = str(text).strip()
            try:
                if t.endswith("%"):
                    kw[f"{end}_fraction"] = float(t[:-1]) / 100.0
                elif t.endswith("s"):
                    kw[f"{end}_s"] = float(t[:-1])
                else:
                    kw[f"{end}_requests"] = int(t)
            except ValueError:
                raise ValueError(f"--{end} {text!r}: allowed: N (requests), P% (percent of "
                                 "the requests) or Ts (seconds)") from None
        return cls(**kw)

    def measured(self, sent_s: np.ndarray, finish_s: np.ndarray) -> np.ndarray:
        """Which requests count: a boolean array over the requests, given when each was
        sent and when it finished (NaN: never, e.g. refused; it completes at its send)."""
        sent = np.asarray(sent_s, float)
        fin = np.asarray(finish_s, float)
        n = len(sent)
        keep = np.ones(n, bool)
        if n == 0:
            return keep
        done_at = np.where(np.isfinite(fin), fin, sent)
        order = np.argsort(done_at, kind="stable")           # completion order
        warm_n = self.warmup_requests or int(self.warmup_fraction * n)
        cool_n = self.cooldown_requests or int(self.cooldown_fraction * n)
        if warm_n:
            keep[order[:warm_n]] = False
        if cool_n:
            keep[order[max(n - cool_n, 0):]] = False
        valid = np.isfinite(sent)
        if self.warmup_s and valid.any():
            keep &= ~(sent <= np.min(sent[valid]) + self.warmup_s)
        if self.cooldown_s and valid.any():
            keep &= ~(sent > np.max(sent[valid]) - self.cooldown_s)
        return keep


class Send(NamedTuple):
    """A request the clients send: its index and the tick it reaches the server."""

    request: int
    at_us: int


class Sessions(NamedTuple):
    """A request table's conversations: per row, its session index and think seconds."""

    session: np.ndarray
    think_s: np.ndarray


def sessions_of(df: pd.DataFrame, where: str) -> Sessions | None:
    """The ``session_id`` and ``think_s`` columns of a validated request table as a session
    index per row (0…) and think seconds per row; None when the table has neither. Refuses
    a missing session id, a negative or non-finite think time, and a turn whose prompt is
    shorter than the previous turn's prompt and answer (the context grows turn by turn)."""
    has_s, has_t = "session_id" in df.columns, "think_s" in df.columns
    if not has_s and not has_t:
        return None
    n = len(df)
    if has_t:
        think = pd.to_numeric(df["think_s"], errors="coerce").to_numpy(float)
        bad = ~np.isfinite(think) | (think < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{where}: column 'think_s' must be seconds ≥ 0; row {i} has "
                             f"{df['think_s'].iloc[i]!r}")
    else:
        think = np.zeros(n)
    if has_s:
        ids = df["session_id"]
        if ids.isna().any():
            i = int(np.flatnonzero(ids.isna().to_numpy())[0])
            raise ValueError(f"{where}: column 'session_id' is empty at row {i}; a request "
                             "outside any session needs an id of its own")
        codes, _ = pd.factorize(ids, sort=False)
    else:
        codes = np.arange(n)
    prompt = df["input_tokens"].to_numpy()
    answer = df["output_tokens"].to_numpy()
    last: dict[int, int] = {}
    for i, s in enumerate(codes):
        j = last.get(s)
        if j is not None and prompt[i] < prompt[j] + answer[j]:
            raise ValueError(
                f"{where}: row {i} is a later turn of session {ids.iloc[i]!r} whose prompt "
                f"({prompt[i]} tokens) is shorter than the previous turn's prompt and answer "
                f"({prompt[j]} + {answer[j]}); a turn's prompt holds the conversation so far")
        last[s] = i
    return Sessions(codes.astype(np.int64), think)


class ClientLoop:
    """The sender the simulation consults: :meth:`start` gives the first sends and
    :meth:`finished` the sends a completion releases, each as ``(request, time_us)``.

    ``scheduled_us``: per request, the earliest send (its ``arrival_s``) in ticks;
    ``session``: per request, its session index (turns in request order); ``think_us``: per
    request, the pause after its session's previous turn; ``clients``: who sends.
    """

    __slots__ = ("sched", "think", "next_turn", "queue", "closed", "client_think", "_clients")

    def __init__(self, scheduled_us, session, think_us, clients: Clients):
        self.sched = np.asarray(scheduled_us, np.int64)
        n = len(self.sched)
        session = np.asarray(session, np.int64) if session is not None else np.arange(n)
        self.think = (np.asarray(think_us, np.int64) if think_us is not None
                      else np.zeros(n, np.int64))
        self.next_turn = np.full(n, -1, np.int64)
        first: dict[int, int] = {}
        prev: dict[int, int] = {}
        for i, s in enumerate(session.tolist()):
            if s in prev:
                self.next_turn[prev[s]] = i
            else:
                first[s] = i
            prev[s] = i
        starts = sorted(first.values(), key=lambda i: (int(self.sched[i]), i))
        self.queue = deque(starts)
        self.closed = clients.closed
        self.client_think = round(clients.think_time_s * 1e6) if clients.closed else 0
        self._clients = clients.concurrency

    def start(self) -> list[Send]:
        """The sends at the start: every session's first turn (open loop), or the first
        ``concurrency`` sessions' (closed loop)."""
        q = self.queue
        take = len(q) if not self.closed else min(self._clients, len(q))
        return [Send(i, int(self.sched[i])) for i in (q.popleft() for _ in range(take))]

    def finished(self, rid: int, t_us: int) -> list[Send]:
        """Request ``rid`` finished at ``t_us``: the next turn of its session, or (closed
        loop) its client's next session."""
        nxt = int(self.next_turn[rid])
        if nxt >= 0:
            return [Send(nxt, max(t_us + int(self.think[nxt]), int(self.sched[nxt])))]
        if self.closed and self.queue:
            i = self.queue.popleft()
            return [Send(i, max(t_us + self.client_think, int(self.sched[i])))]
        return []
