"""``replay`` and ``replay_disaggregated``: a request table in, per-request latencies out."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .. import validate as _v
from ..startup import check_start
from .clients import ClientLoop, Clients, Window, sessions_of
from .scheduler import PoolLimits
from .sim import Pool, Simulation, StepRecord, gc_paused, ticks
from .workload import validate_requests

__all__ = ["ReplayResult", "replay", "replay_disaggregated", "summarize", "format_summary",
           "Prepared", "prepare"]

#: Summary keys for each latency: mean and percentiles, seconds.
STATS = ("mean", "p50", "p90", "p99")


@dataclass
class ReplayResult:
    """What a replay produced.

    Attributes:
      requests: one row per input request, in arrival order: ``request_id``, ``arrival_s``,
        ``input_tokens``, ``output_tokens``, ``ttft_s``, ``e2e_s``, ``itl_mean_s`` (mean gap
        between a request's tokens), ``first_token_s`` / ``finish_s`` (absolute, on the
        input's clock), ``preemptions``, ``cached_tokens`` (prefix-cache hits), ``rejected``
        (bool) and ``reject_reason``; latencies are NaN for a rejected request.
      summary: ``ttft_{mean,p50,p90,p99}_s``, the same for ``itl`` (every gap between two
        consecutive tokens of a request, pooled over requests, as vLLM's benchmark counts
        ITL) and ``e2e``; ``throughput_tokens_per_s`` (prompt + output tokens of completed
        requests per second of the run), ``output_tokens_per_s``, ``requests_per_s``,
        ``steps``, ``preemptions``, ``kv_usage_peak`` (fraction of the KV cache),
        ``completed``, ``rejected``, ``duration_s`` (first arrival to last finish).
      steps: one row per engine step: ``pool``, ``engine``, ``start_s``, ``duration_s``,
        ``requests``, ``tokens``, ``prefill_tokens``, ``kv_usage``.
      itl_gaps_s: every gap between consecutive tokens of a request, pooled over the
        requests the summary counts (seconds).
      token_gaps_s: per row of ``requests``, its gaps between consecutive tokens (seconds;
        empty for a rejected or one-token request).
      record: with ``record=True``, the :class:`~jkernel.replay.sim.StepRecord` of the run
        (its steps in the order of ``steps``; ``first_step`` / ``last_step`` per row of
        ``requests``, −1 for a rejected request), else None.

    With closed-loop clients or sessions (:class:`~jkernel.replay.Clients`) ``arrival_s``
    is when the request was sent, and ``scheduled_s`` the input's ``arrival_s`` (the
    earliest send); with a :class:`~jkernel.replay.Window` a ``measured`` column says which
    requests the summary counts (warm-up and cool-down excluded).
    """

    requests: pd.DataFrame
    summary: dict
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    itl_gaps_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    token_gaps_s: list = field(default_factory=list)
    record: StepRecord | None = None

    def __repr__(self) -> str:
        s = self.summary
        return (f"ReplayResult({len(self.requests)} requests, {s['completed']} completed, "
                f"{s['rejected']} rejected, {s['steps']} steps; TTFT mean "
                f"{s['ttft_mean_s'] * 1e3:.1f} ms, ITL mean {s['itl_mean_s'] * 1e3:.2f} ms, "
                f"E2E mean {s['e2e_mean_s']:.3f} s)")


def _content_hashes(df: pd.DataFrame, block: int) -> list[tuple]:
    """Block hashes from the content columns: the group's shared prefix (``prefix_group``,
    ``prefix_length``), then the prompt's own blocks where its content recurs: a
    ``prompt_key`` (requests sending the same prompt share every full prompt block) or a
    ``session_id`` (a later turn's prompt begins with the previous turn's prompt and answer:
    the hashes run over prompt and answer, so that the answer's blocks, cached as they are
    computed, are hits for the next turn)."""
    n = len(df)
    if "prefix_group" in df.columns and "prefix_length" in df.columns:
        groups = df["prefix_group"].to_numpy()
        lengths = pd.to_numeric(df["prefix_length"], errors="coerce").fillna(0).to_numpy()
    else:
        groups, lengths = [None] * n, np.zeros(n)
    session = df["session_id"].to_numpy() if "session_id" in df.columns else None
    key = df["prompt_key"].to_numpy() if "prompt_key" in df.columns else None
    prompt = df["input_tokens"].to_numpy()
    answer = df["output_tokens"].to_numpy()

    def blank(v) -> bool:
        return v is None or (isinstance(v, float) and np.isnan(v)) or v == ""

    out = []
    for i in range(n):
        g, shared = groups[i], int(lengths[i])
        own = ("s", session[i]) if session is not None and not blank(session[i]) else (
            ("p", key[i]) if key is not None and not blank(key[i]) else None)
        if own is None:
            full = shared // block if not blank(g) else 0
        elif own[0] == "s":
            full = (int(prompt[i]) + int(answer[i]) - 1) // block
        else:
            full = int(prompt[i]) // block
        pre = shared // block if not blank(g) else 0
        out.append(tuple(hash((g, j)) if j < pre else hash((own, j)) for j in range(full)))
    return out


def _hashes(df: pd.DataFrame, block: int) -> list[tuple] | None:
    """Per request, the hashes of its full prompt blocks (None when none are given)."""
    if "block_hashes" not in df.columns and (
            "prompt_key" in df.columns or "session_id" in df.columns):
        return _content_hashes(df, block)
    if "block_hashes" in df.columns:
        out = []
        for v in df["block_hashes"]:
            if isinstance(v, str):
                out.append(tuple(int(x) for x in v.split()))
            elif v is None or (isinstance(v, float) and np.isnan(v)):
                out.append(())
            else:
                out.append(tuple(int(x) for x in v))
        return out
    if "prefix_group" in df.columns and "prefix_length" in df.columns:
        groups = df["prefix_group"].to_numpy()
        lengths = pd.to_numeric(df["prefix_length"], errors="coerce").fillna(0).to_numpy()
        out = []
        for g, n in zip(groups, lengths):
            if g is None or (isinstance(g, float) and np.isnan(g)) or g == "" or n < block:
                out.append(())
            else:
                out.append(tuple(hash((g, j)) for j in range(int(n) // block)))
        return out
    return None


def _reject(df: pd.DataFrame, limits: list[PoolLimits]) -> tuple[np.ndarray, list[str]]:
    """Requests vLLM would refuse, and why (never dropped: they are rows of the output)."""
    n = len(df)
    rejected = np.zeros(n, bool)
    reasons = [""] * n
    total = (df["input_tokens"] + df["output_tokens"]).to_numpy()
    for lim in limits:
        if lim.max_model_len:
            # vLLM v0.31.0's OpenAI server answers 400 when prompt + max_tokens exceeds
            # max_model_len ("maximum context length is … tokens"); the engine never sees it.
            over = total > lim.max_model_len
            for i in np.flatnonzero(over & ~rejected):
                reasons[i] = (f"max_model_len: {int(total[i])} tokens (prompt + output) > "
                              f"{lim.max_model_len}")
            rejected |= over
        # Without a max_model_len a request that cannot fit the empty cache would wait
        # forever; vLLM would not have started (it sizes max_model_len to fit), so refuse it.
        big = np.array([lim.request_pages(int(x)) > lim.pages for x in total], bool) & ~rejected
        for i in np.flatnonzero(big):
            reasons[i] = f"kv_cache: {int(total[i])} tokens need more than {lim.pages} pages"
        rejected |= big
    return rejected, reasons


def _check_start(pool: Pool) -> None:
    """vLLM's start-up refusal for the pool (:func:`jkernel.startup.check_start`): no KV page
    left, or a max_model_len (the kernel's resolved one) the cache cannot hold. Raises
    :class:`jkernel.Refusal`."""
    lim = pool.limits
    check_start(pool.kernel, max_model_len=lim.max_model_len or None,
                        pool=f"pools[{pool.kernel.inputs.pool_index}]")


def _progress_bar(show: bool, total: int):
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:             # tqdm is a dependency; a stripped install runs without a bar
        return None
    return tqdm(total=total, unit="req", desc="replay", file=sys.stderr, mininterval=0.5)


@dataclass
class Prepared:
    """A request table checked and refused as the replay reads it, ready to become one or
    more :class:`~jkernel.replay.sim.Simulation` s (:meth:`simulation`) whose results
    :meth:`result` collects. ``keep``: the rows replayed (not rejected)."""

    df: pd.DataFrame
    rejected: np.ndarray
    reasons: list
    keep: np.ndarray
    arrival_us: np.ndarray
    hashes: list | None
    sessions: object
    clients: Clients | None
    window: Window | None

    def simulation(self, pools: list[Pool], progress: bool = False, *,
                   cls: type = Simulation, record: bool = False) -> Simulation:
        """A fresh simulation (of class ``cls``) of the kept requests on ``pools``, with its
        own client loop (closed-loop clients and sessions keep state per simulation);
        ``record``: keep each step's batch (:class:`~jkernel.replay.sim.StepRecord`)."""
        keep, sessions, clients = self.keep, self.sessions, self.clients
        loop = None
        if self.looped:
            loop = ClientLoop(self.arrival_us[keep],
                              None if sessions is None else sessions.session[keep],
                              None if sessions is None else
                              np.array([ticks(x) for x in sessions.think_s[keep]], np.int64),
                              clients or Clients())
        df = self.df
        return cls(pools, self.arrival_us[keep], df["input_tokens"].to_numpy()[keep],
                   df["output_tokens"].to_numpy()[keep],
                   None if self.hashes is None else [self.hashes[i] for i in keep],
                   progress=_progress_bar(progress, len(keep)), clients=loop,
                   record=record)

    @property
    def looped(self) -> bool:
        """Whether a client loop decides the sends (closed-loop clients or sessions)."""
        return (self.clients is not None and self.clients.closed) or self.sessions is not None

    def result(self, sim: Simulation) -> ReplayResult:
        """The :class:`ReplayResult` of a finished simulation of these requests (with the
        cyclic garbage collector paused, as during the simulation: the tables are built
        from the simulation's millions of live objects, which each collection would walk)."""
        with gc_paused():
            return _collect(self, sim)


def prepare(pools: list[Pool], requests: pd.DataFrame, clients: Clients | None = None,
            window: Window | None = None) -> Prepared:
    """Check ``requests`` and the pools' start-up, and refuse what vLLM would refuse
    (:class:`Prepared`); nothing is simulated yet."""
    source = getattr(requests, "attrs", {}).get("source", "requests")
    df = validate_requests(requests, source=source)
    if clients is not None and not isinstance(clients, Clients):
        raise _v.ArgumentError("clients", f"must be a jkernel.replay.Clients, not "
                               f"{type(clients).__name__}")
    if window is not None and not isinstance(window, Window):
        raise _v.ArgumentError("window", f"must be a jkernel.replay.Window, not "
                               f"{type(window).__name__}")
    sessions = sessions_of(df, source)
    rejected, reasons = _reject(df, [p.limits for p in pools])
    for p in pools:
        _check_start(p)
    keep = np.flatnonzero(~rejected)
    arrival_us = np.array([ticks(x) for x in df["arrival_s"].to_numpy()], np.int64)
    hashes = _hashes(df, pools[0].limits.block_size)
    return Prepared(df, rejected, reasons, keep, arrival_us, hashes, sessions, clients,
                    window)


def _run(pools: list[Pool], requests: pd.DataFrame, progress: bool,
         clients: Clients | None = None, window: Window | None = None,
         record: bool = False) -> ReplayResult:
    prep = prepare(pools, requests, clients, window)
    sim = prep.simulation(pools, progress, record=record)
    sim.run()
    return prep.result(sim)


def _collect(prep: Prepared, sim: Simulation) -> ReplayResult:
    df, keep, rejected, reasons = prep.df, prep.keep, prep.rejected, prep.reasons
    arrival_us, window = prep.arrival_us, prep.window
    looped = prep.looped
    n = len(df)
    rec = sim.record
    if rec is not None:                          # steps per row of the input table
        for name in ("first_step", "last_step"):
            full = np.full(n, -1, np.int64)
            full[keep] = getattr(rec, name)
            setattr(rec, name, full)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    last = np.full(n, np.nan)
    pre = np.zeros(n, np.int64)
    cached = np.zeros(n, np.int64)
    token_gaps = [_NO_GAPS] * n
    sent_us = arrival_us.copy()
    if looped:
        sent_us[keep] = sim.arrival_us
    # every request's token times in one array: the gaps are one diff, each request's a
    # slice of it (the gap across two requests' boundary is never read)
    tokens_us = sim.tokens_us
    lengths = [len(t) for t in tokens_us]
    flat_us = np.fromiter(itertools.chain.from_iterable(tokens_us), np.int64, sum(lengths))
    all_gaps = np.diff(flat_us) / 1e6
    start = 0
    for j, i in enumerate(keep):
        count = lengths[j]
        if sim.finish_us[j] >= 0:
            first[i] = sim.first_us[j] / 1e6
            last[i] = tokens_us[j][-1] / 1e6
            finish[i] = sim.finish_us[j] / 1e6
            if count > 1:
                token_gaps[i] = all_gaps[start:start + count - 1]
        start += count
        pre[i] = sim.preemptions[j]
        cached[i] = sim.cached_tokens[j]
    arrival = sent_us / 1e6
    out = pd.DataFrame({
        "request_id": df["request_id"].to_numpy(),
        "arrival_s": arrival if looped else df["arrival_s"].to_numpy(),
        "input_tokens": df["input_tokens"].to_numpy(),
        "output_tokens": df["output_tokens"].to_numpy(),
        "ttft_s": first - arrival,
        "e2e_s": finish - arrival,
        "itl_mean_s": np.where(df["output_tokens"].to_numpy() > 1,
                               (last - first) / np.maximum(df["output_tokens"] - 1, 1),
                               np.nan),
        "first_token_s": first,
        "finish_s": finish,
        "preemptions": pre,
        "cached_tokens": cached,
        "rejected": rejected,
        "reject_reason": reasons,
    })
    if looped:
        out["scheduled_s"] = df["arrival_s"].to_numpy()
    measured = None
    if window is not None and not window.empty:
        measured = window.measured(out["arrival_s"].to_numpy(float), finish)
    if "warm_up" in df.columns and df["warm_up"].to_numpy(bool).any():
        warm = df["warm_up"].to_numpy(bool)          # replayed, never counted
        measured = ~warm if measured is None else measured & ~warm
    if measured is not None:
        out["measured"] = measured
    for col in df.columns:                       # carry what the input had besides
        if col not in out.columns:
            out[col] = df[col].to_numpy()
    steps = _step_table(sim.step_log)
    steps["start_s"] /= 1e6
    steps["duration_s"] /= 1e6
    counted = range(n) if measured is None else np.flatnonzero(measured)
    gaps = [token_gaps[i] for i in counted if len(token_gaps[i])]
    gap_s = np.concatenate(gaps) if gaps else np.zeros(0)
    table = out if measured is None else out[measured]
    summary = summarize(table, gap_s, steps=len(steps), kv_usage_peak=sim.kv_usage_peak)
    return ReplayResult(out, summary, steps, gap_s, token_gaps, rec)


_NO_GAPS = np.zeros(0)

#: The columns of a replay's step table, in the order of the step log's tuples.
STEP_COLUMNS = ("pool", "engine", "start_s", "duration_s", "requests", "tokens",
                "prefill_tokens", "kv_usage")


def _step_table(log: list) -> pd.DataFrame:
    """The step log (tuples in :data:`STEP_COLUMNS` order, times in ticks) as a table,
    column by column: the dtypes pandas infers from the rows (object, int64 and float64),
    without its row-wise conversion of every tuple."""
    if not log:
        return pd.DataFrame(log, columns=list(STEP_COLUMNS))
    cols = list(zip(*log))
    return pd.DataFrame({name: (np.array(col, object) if name == "pool" else np.array(col))
                         for name, col in zip(STEP_COLUMNS, cols)})


def summarize(table: pd.DataFrame, itl_gaps_s: np.ndarray | None = None, *, steps: int = 0,
              kv_usage_peak: float = float("nan")) -> dict:
    """The summary of a per-request table (see :class:`ReplayResult`)."""
    done = table[~table["rejected"] & table["e2e_s"].notna()]

    def stats(name: str, x: np.ndarray) -> dict:
        x = np.asarray(x, float)
        if x.size == 0:
            return {f"{name}_{s}_s": float("nan") for s in STATS}
        return {f"{name}_mean_s": float(x.mean()),
                **{f"{name}_p{q}_s": float(np.percentile(x, q)) for q in (50, 90, 99)}}

    if itl_gaps_s is None:
        itl_gaps_s = done["itl_mean_s"].dropna().to_numpy()
    start = float(table["arrival_s"].min()) if len(table) else 0.0
    end = float(done["finish_s"].max()) if len(done) else start
    span = max(end - start, 1e-9)
    out_tok = int(done["output_tokens"].sum())
    all_tok = out_tok + int(done["input_tokens"].sum())
    return {
        **stats("ttft", done["ttft_s"].to_numpy()),
        **stats("itl", itl_gaps_s),
        **stats("e2e", done["e2e_s"].to_numpy()),
        "throughput_tokens_per_s": all_tok / span,
        "output_tokens_per_s": out_tok / span,
        "requests_per_s": len(done) / span,
        "steps": int(steps),
        "preemptions": int(table["preemptions"].sum()),
        "kv_usage_peak": float(kv_usage_peak),
        "completed": int(len(done)),
        "rejected": int(table["rejected"].sum()),
        "duration_s": end - start,
    }


def format_summary(summary: dict) -> str:
    """The summary as a small text table (what ``jkernel replay`` prints)."""
    rows = [f"{'':6}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}"]
    for name, unit, scale in (("ttft", "ms", 1e3), ("itl", "ms", 1e3), ("e2e", "s", 1.0)):
        vals = "".join(f"{summary[f'{name}_{s}_s'] * scale:12.3f}" for s in STATS)
        rows.append(f"{name.upper() + ' ' + unit:6}{vals}")
    rows.append(f"requests {summary['completed']} completed, {summary['rejected']} rejected, "
                f"{summary['preemptions']} preemptions; {summary['steps']} steps over "
                f"{summary['duration_s']:.1f} s")
    rows.append(f"throughput {summary['throughput_tokens_per_s']:.0f} tokens/s "
                f"({summary['output_tokens_per_s']:.0f} output tokens/s, "
                f"{summary['requests_per_s']:.2f} requests/s); KV usage peak "
                f"{summary['kv_usage_peak'] * 100:.1f} %")
    return "\n".join(rows)


def replay(kernel, requests: pd.DataFrame, *, progress: bool = False, seed: int = 0,
           clock: str = "expected_s", clients: Clients | None = None,
           window: Window | None = None, record: bool = False) -> ReplayResult:
    """Replay ``requests`` on the pool of ``kernel`` (a colocated deployment).

    Args:
      kernel: a :class:`jkernel.Kernel`; its settings (block size, token budget,
        ``max_num_seqs``, prefix caching, async scheduling) and ``kv_cache_pages()`` size
        the scheduler.
      requests: a DataFrame with ``request_id``, ``arrival_s`` (s), ``input_tokens``,
        ``output_tokens`` (see :func:`jkernel.replay.load_requests`).
      progress: show a progress bar (tqdm) on stderr.
      seed: accepted for a stable interface; the replay itself is deterministic (FCFS,
        least-loaded routing with ties to the lowest index) and draws no random numbers.
      clock: ``"expected_s"`` (jkernel's estimate) or ``"no_overlap_s"``.
      clients: who sends the requests (:class:`~jkernel.replay.Clients`): closed-loop
        clients, whose schedule ``arrival_s`` is the earliest send; None (or
        concurrency 0): each request at its ``arrival_s``, a session's later turns when
        the previous turn has finished (``session_id``, ``think_s`` columns).
      window: the warm-up and cool-down the summary leaves out
        (:class:`~jkernel.replay.Window`); None: every request counts.
      record: keep the batch of every step and the steps of each request's first and last
        token (``ReplayResult.record``), for the serving fit to price them again.
    """
    del seed
    _v.kernel("kernel", kernel)
    if not isinstance(record, bool):
        raise _v.ArgumentError("record", f"must be true or false, not {record!r}")
    return _run([Pool(kernel, clock=clock)], requests, progress, clients, window, record)


def replay_disaggregated(prefill_kernel, decode_kernel, requests: pd.DataFrame, *,
                         progress: bool = False, seed: int = 0,
                         clock: str = "expected_s", clients: Clients | None = None,
                         window: Window | None = None) -> ReplayResult:
    """Replay ``requests`` on a prefill pool and a decode pool (vLLM's proxy flow with a KV
    connector). The prefill pool's nodes come first, then the decode pool's; the KV
    transfer is priced on the prefill kernel. Same arguments and result as :func:`replay`.
    """
    del seed
    _v.disaggregated_pair(prefill_kernel, decode_kernel)
    pre = Pool(prefill_kernel, name="prefill", clock=clock)
    dec = Pool(decode_kernel, name="decode", first_node=pre.nodes, clock=clock)
    return _run([pre, dec], requests, progress, clients, window)
