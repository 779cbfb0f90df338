"""A small discrete-event simulator of LLM serving, priced step by step by jkernel.

jkernel is a pure cost model: it prices one forward pass, the memory a pool holds and the
work around a step. Everything stateful (queues, batch formation, the KV-page allocator,
preemption, the clock) lives here, outside the package, the way the spec's ``resolution.md``
§1 and ``memory.md`` §5 say a simulator should use a kernel:

* **One kernel per pool.** A colocated deployment gets one from ``jkernel.open``; a
  disaggregated one gets a prefill and a decode kernel from ``jkernel.open_pool``.
* **Everything configurable comes from the kernel.** The scheduler limits (``block_size``,
  ``max_num_batched_tokens``, ``max_num_seqs``) are read from ``kernel.settings``; the KV
  cache holds ``kernel.kv_cache_pages()`` pages per rank, and a sequence of n tokens takes
  ``ceil(sequence_variable_bytes(n) / page_bytes())`` of them.
* **Continuous batching** in the manner of vLLM's v1 scheduler: running requests first (one
  decode token each, or the next chunk of a prefill), then waiting requests while the token
  budget and ``max_num_seqs`` allow (chunked prefill). When a running request needs a page
  and none is free, the most recently admitted running request is preempted: its pages are
  freed and it is recomputed from scratch later (vLLM's RECOMPUTE mode).
* **The clock** is an integer count of microseconds. Each step advances it by the step's
  ``expected_s`` (or ``no_overlap_s``, for parity with the reference kernel), rounded half up
  and never less than one tick.
* **Around the step**: a request becomes schedulable ``admission_overhead(prompt)`` after it
  reaches a pool; each emitted token reaches the client ``output_token_overhead()`` after the
  step that produced it; a finished request pays ``completion_overhead()`` on its end-to-end
  latency; in a disaggregated deployment the prompt's KV cache moves from the prefill engine
  to the decode engine in ``pd_transfer_time`` (priced on the prefill pool's kernel).

Disaggregated serving follows vLLM's proxy flow: the prefill pool computes the prompt (its
sampled token is discarded), the KV cache is transferred, and the decode pool recomputes the
last prompt token and streams every output token, the first included, to the client.

Simplifications, stated so that nobody mistakes them for kernel behaviour: no prefix cache;
no link contention between concurrent KV transfers; the decode side allocates a transferred
request's pages when it first schedules it; a request is routed, once admitted, to the engine
with the fewest outstanding requests; an engine with data parallelism > 1 steps its replicas
in lockstep, padding each to the busiest replica's token count (``pad_tokens``).

Run ``python -m examples.simulator`` from the repository root for a colocated against
disaggregated comparison of Llama-3.1-70B on 16 H200s. Only numpy and jkernel are needed.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import jkernel

__all__ = ["Request", "poisson_workload", "Pool", "Engine", "Replica", "Simulator",
           "Result", "build_colocated", "build_disaggregated", "ticks", "step_ticks"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COLOCATED_BUNDLE = HERE / "llama-3.1-70b-h200-colocated.yaml"
DISAGG_BUNDLE = ROOT / "catalog" / "scenarios" / "llama-3.1-70b-h200-disagg.yaml"

US_PER_S = 1_000_000


def ticks(seconds: float) -> int:
    """Seconds as whole microseconds, rounded half up (never Python's half-to-even)."""
    return int(math.floor(seconds * US_PER_S + 0.5))


def step_ticks(seconds: float) -> int:
    """A step's duration in ticks: at least one, so the clock always moves."""
    return max(1, ticks(seconds))


# --------------------------------------------------------------------------------------------
# Requests and the workload
# --------------------------------------------------------------------------------------------

@dataclass
class Request:
    """One client request and what happened to it (times in µs)."""

    id: int
    arrival_us: int
    prompt: int                       # prompt tokens
    output: int                       # output tokens wanted
    emitted: int = 0                  # output tokens delivered so far
    first_token_us: int | None = None
    last_token_us: int | None = None
    finish_us: int | None = None
    preemptions: int = 0
    rejected: bool = False

    @property
    def ttft_us(self) -> int | None:
        return None if self.first_token_us is None else self.first_token_us - self.arrival_us

    @property
    def tpot_us(self) -> float | None:
        """Mean time per output token after the first."""
        if self.emitted < 2 or self.first_token_us is None:
            return None
        return (self.last_token_us - self.first_token_us) / (self.emitted - 1)


def poisson_workload(n: int, rate: float, *, prompt_mean: int = 1024, output_mean: int = 256,
                     spread: float = 0.5, seed: int = 0) -> list[Request]:
    """``n`` requests arriving as a Poisson process of ``rate`` requests/s.

    Prompt and output lengths are uniform on ``mean · [1 − spread, 1 + spread]``. The same
    seed always gives the same workload.
    """
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]          # the first request arrives at t = 0

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
        return rng.integers(lo, hi + 1, size=n)

    prompts, outputs = np.maximum(lengths(prompt_mean), 2), lengths(output_mean)
    return [Request(i, ticks(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


# --------------------------------------------------------------------------------------------
# A pool: its kernel, limits and engines
# --------------------------------------------------------------------------------------------

class Seq:
    """A request's state on one pool: tokens that exist, tokens whose KV is computed, pages."""

    __slots__ = ("req", "length", "computed", "pages", "prefill_only")

    def __init__(self, req: Request, length: int, computed: int, prefill_only: bool):
        self.req = req
        self.length = length          # prompt + tokens sampled so far on this pool
        self.computed = computed      # tokens already in the KV cache
        self.pages = 0
        self.prefill_only = prefill_only


class Replica:
    """One data-parallel replica: its own queues and its own KV pages (memory.md §5)."""

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.free_pages = pool.pages

    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give ``seq`` the pages ``tokens`` tokens need; False if the cache is full."""
        need = self.pool.pages_for(tokens) - seq.pages
        if seq.pages == 0:
            need += self.pool.seq_fixed_pages      # recurrent state, charged at admission
        if need <= 0:
            return True
        if need > self.free_pages:
            return False
        self.free_pages -= need
        seq.pages += need
        return True

    def release(self, seq: Seq) -> None:
        self.free_pages += seq.pages
        seq.pages = 0

    def _preempt(self, seq: Seq) -> None:
        """vLLM's RECOMPUTE preemption: drop the KV, go back to the head of the queue."""
        self.release(seq)
        seq.computed = 0
        seq.req.preemptions += 1
        self.pool.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[tuple[Seq, int]]:
        """Form this step's batch: ``[(seq, tokens scheduled)]`` (vLLM v1 scheduler order)."""
        budget = self.pool.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.length - seq.computed, budget)
            while not self._grow(seq, seq.computed + n):
                victim = self.running.pop()          # the lowest priority: the last admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
                i += 1
                continue
            break                                    # ``seq`` preempted itself
        # New requests are admitted only in a step that preempted nobody (vLLM v1).
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.pool.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.length - seq.computed, budget)     # chunked prefill
            if not self._grow(seq, seq.computed + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch


class Engine:
    """One engine (pp·tp·pcp·dp GPUs) of a pool: its replicas step together."""

    def __init__(self, pool: "Pool", index: int, node: int):
        self.pool = pool
        self.index = index
        self.node = node
        self.replicas = [Replica(pool) for _ in range(pool.dp)]
        self.busy = False
        self.inflight: list[list[tuple[Seq, int]]] = []

    def outstanding(self) -> int:
        return sum(r.outstanding() for r in self.replicas)

    def least_loaded_replica(self) -> Replica:
        return min(self.replicas, key=Replica.outstanding)


class Pool:
    """One pool of a deployment, everything read from its kernel.

    Args:
      kernel: the pool's :class:`jkernel.Kernel`.
      first_node: the node index of the pool's first GPU (pools are laid out in order).
      clock: ``"expected_s"`` (jkernel's estimate) or ``"no_overlap_s"`` (reference parity).
      decode_threshold: passed to every :class:`jkernel.Batch` (vLLM's default is 1).
    """

    def __init__(self, kernel: jkernel.Kernel, *, first_node: int = 0,
                 clock: str = "expected_s", decode_threshold: int = 1):
        if clock not in ("expected_s", "no_overlap_s"):
            raise ValueError(f"clock must be 'expected_s' or 'no_overlap_s', not {clock!r}")
        self.kernel = kernel
        self.clock = clock
        self.decode_threshold = decode_threshold
        self.role = kernel.deployment().role
        s = kernel.settings                                  # the values the kernel used
        self.block_size = int(s["block_size"])
        self.max_num_batched_tokens = int(s["max_num_batched_tokens"])
        self.max_num_seqs = int(s["max_num_seqs"])
        self.page_bytes = kernel.page_bytes()
        self.pages = kernel.kv_cache_pages()                 # per rank, per replica
        self.seq_fixed_pages = math.ceil(kernel.sequence_fixed_bytes() / self.page_bytes)
        self.dp = kernel.resolved().data_parallel()
        self._pages_for: dict[int, int] = {}
        # The around-the-step overheads, in ticks (constants of the kernel).
        self.output_token_us = ticks(kernel.output_token_overhead())
        self.completion_us = ticks(kernel.completion_overhead())
        # Engines: each takes pp·tp·max(pcp,1)·dp GPUs; the pool holds several (D17).
        dep = kernel.deployment()
        par = dep.parallel
        gpn = kernel.inputs.scenario.cluster.gpus_per_node
        engine_gpus = par.pp * par.tp * max(par.pcp, 1) * par.dp
        count = dep.nodes * gpn // engine_gpus
        self.engines = [Engine(self, e, first_node + e * engine_gpus // gpn)
                        for e in range(count)]
        self.steps = 0
        self.preemptions = 0
        self.busy_us = 0

    def pages_for(self, tokens: int) -> int:
        """KV pages a sequence of ``tokens`` tokens holds (memory.md §5), memoised."""
        p = self._pages_for.get(tokens)
        if p is None:
            p = -(-self.kernel.sequence_variable_bytes(tokens) // self.page_bytes)
            self._pages_for[tokens] = p
        return p

    def fits(self, tokens: int) -> bool:
        """Can a sequence of ``tokens`` tokens ever fit in one replica's empty cache?"""
        return self.pages_for(tokens) + self.seq_fixed_pages <= self.pages

    def admission_us(self, prompt: int) -> int:
        return ticks(self.kernel.admission_overhead(prompt))

    def least_loaded_engine(self) -> Engine:
        return min(self.engines, key=Engine.outstanding)

    def price(self, batches: list[list[tuple[Seq, int]]]) -> int:
        """Price one engine step over its replicas' batches; the slowest replica sets it."""
        tokens = [sum(n for _, n in b) for b in batches]
        top = max(tokens)
        worst = 0.0
        for b, t in zip(batches, tokens):
            pad = top - t if self.dp > 1 else 0
            if not b and pad == 0:
                continue
            batch = jkernel.Batch([n for _, n in b], [s.computed for s, _ in b],
                                  decode_threshold=self.decode_threshold, pad_tokens=pad)
            est = self.kernel.step_time(batch)
            worst = max(worst, getattr(est, self.clock))
        return step_ticks(worst)


# --------------------------------------------------------------------------------------------
# The event loop
# --------------------------------------------------------------------------------------------

@dataclass
class StepRecord:
    """One engine step, for plots: start and duration in µs, requests and tokens."""

    pool: str
    engine: int
    start_us: int
    duration_us: int
    requests: int
    tokens: int
    prefill_tokens: int


@dataclass
class Result:
    """What a run produced: the requests (with their timings) and the step log."""

    name: str
    requests: list[Request]
    steps: list[StepRecord]
    pools: dict = field(default_factory=dict)

    def done(self) -> list[Request]:
        return [r for r in self.requests if r.finish_us is not None]

    def summary(self) -> dict:
        """TTFT and TPOT percentiles (ms), end-to-end p50 (s) and throughput."""
        done = self.done()
        ttft = np.array([r.ttft_us for r in done], float) / 1e3
        tpot = np.array([r.tpot_us for r in done if r.tpot_us is not None], float) / 1e3
        e2e = np.array([r.finish_us - r.arrival_us for r in done], float) / 1e6
        start = min(r.arrival_us for r in self.requests)
        end = max((r.finish_us for r in done), default=start)
        span = max(end - start, 1) / 1e6
        pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa
        return {
            "requests": len(self.requests),
            "completed": len(done),
            "rejected": sum(r.rejected for r in self.requests),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p90_ms": pct(tpot, 90),
            "e2e_p50_s": pct(e2e, 50),
            "output_tokens_per_s": sum(r.emitted for r in done) / span,
            "requests_per_s": len(done) / span,
            "makespan_s": span,
            "steps": len(self.steps),
            "preemptions": sum(r.preemptions for r in self.requests),
        }


class Simulator:
    """Discrete-event simulation of one deployment.

    ``pools``: a colocated pool alone, or ``(prefill, decode)`` pools for disaggregated
    serving. Build one with :func:`build_colocated` or :func:`build_disaggregated`.
    """

    def __init__(self, name: str, pools: list[Pool]):
        if len(pools) not in (1, 2):
            raise ValueError("a simulator takes one colocated pool or a prefill and a decode pool")
        self.name = name
        self.pools = pools
        self.entry = pools[0]
        self.decode = pools[1] if len(pools) == 2 else None
        self._events: list = []
        self._order = itertools.count()
        self.now = 0
        self.steps: list[StepRecord] = []

    # -- events ------------------------------------------------------------------------------
    def _at(self, time_us: int, fn, *args) -> None:
        heapq.heappush(self._events, (time_us, next(self._order), fn, args))

    def run(self, requests: list[Request]) -> Result:
        """Simulate ``requests`` (fresh :class:`Request` objects) to completion."""
        for r in requests:
            self._at(r.arrival_us, self._arrive, r)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        pools = {p.role: {"steps": p.steps, "preemptions": p.preemptions,
                          "busy_s": p.busy_us / 1e6, "engines": len(p.engines),
                          "kv_pages": p.pages, "block_size": p.block_size,
                          "max_num_batched_tokens": p.max_num_batched_tokens,
                          "max_num_seqs": p.max_num_seqs} for p in self.pools}
        return Result(self.name, requests, self.steps, pools)

    def _arrive(self, req: Request) -> None:
        pool = self.entry
        total = req.prompt + (1 if self.decode else req.output)
        if not pool.fits(total) or (self.decode and not self.decode.fits(req.prompt + req.output)):
            req.rejected = True                      # it could never fit: refuse it
            return
        seq = Seq(req, length=req.prompt, computed=0, prefill_only=self.decode is not None)
        self._at(self.now + pool.admission_us(req.prompt), self._admit, pool, seq)

    def _admit(self, pool: Pool, seq: Seq) -> None:
        """Admission is over: route to the engine with the fewest outstanding requests."""
        self._enqueue(pool.least_loaded_engine(), seq)

    def _enqueue(self, engine: Engine, seq: Seq) -> None:
        engine.least_loaded_replica().waiting.append(seq)
        self._kick(engine)

    def _kick(self, engine: Engine) -> None:
        """Start a step on an idle engine if any replica can schedule something."""
        if engine.busy:
            return
        batches = [r.schedule() for r in engine.replicas]
        if not any(batches):
            return
        pool = engine.pool
        duration = pool.price(batches)
        engine.busy = True
        engine.inflight = batches
        pool.steps += 1
        pool.busy_us += duration
        flat = [x for b in batches for x in b]
        self.steps.append(StepRecord(pool.role, engine.index, self.now, duration, len(flat),
                                     sum(n for _, n in flat),
                                     sum(n for _, n in flat if n > pool.decode_threshold)))
        self._at(self.now + duration, self._step_done, engine)

    def _step_done(self, engine: Engine) -> None:
        pool = engine.pool
        for replica, batch in zip(engine.replicas, engine.inflight):
            for seq, n in batch:
                seq.computed += n
                if seq.computed < seq.length:
                    continue                               # a prefill chunk, more to come
                if seq.prefill_only:
                    replica.running.remove(seq)
                    self._hand_over(engine, replica, seq)
                    continue
                self._emit(pool, seq)
                seq.length += 1                            # the sampled token joins the sequence
                if seq.req.emitted >= seq.req.output:
                    replica.running.remove(seq)
                    replica.release(seq)
                    req = seq.req
                    req.finish_us = req.last_token_us + pool.completion_us
        engine.inflight = []
        engine.busy = False
        self._kick(engine)

    def _emit(self, pool: Pool, seq: Seq) -> None:
        req = seq.req
        seen = self.now + pool.output_token_us
        req.emitted += 1
        if req.first_token_us is None:
            req.first_token_us = seen
        req.last_token_us = seen

    # -- disaggregated: prefill → decode -------------------------------------------------------
    def _hand_over(self, engine: Engine, replica: Replica, seq: Seq) -> None:
        """The prompt's KV moves to a decode engine; prefill pages free when it lands."""
        req = seq.req
        dst = self.decode.least_loaded_engine()
        transfer = engine.pool.kernel.pd_transfer_time(
            req.prompt, jkernel.Placement(node=engine.node), jkernel.Placement(node=dst.node))
        arrive = self.now + ticks(transfer)
        self._at(arrive, self._landed, engine, replica, seq, dst)

    def _landed(self, src: Engine, replica: Replica, seq: Seq, dst: Engine) -> None:
        replica.release(seq)
        self._kick(src)                                    # freed pages may unblock it
        # The decode engine recomputes the last prompt token, whose output is the first token.
        dseq = Seq(seq.req, length=seq.req.prompt, computed=seq.req.prompt - 1,
                   prefill_only=False)
        self._at(self.now + self.decode.admission_us(seq.req.prompt), self._enqueue, dst, dseq)


# --------------------------------------------------------------------------------------------
# Building simulators from bundles
# --------------------------------------------------------------------------------------------

def build_colocated(bundle=COLOCATED_BUNDLE, *, clock: str = "expected_s",
                    decode_threshold: int = 1, **open_kw) -> Simulator:
    """A simulator of a colocated deployment: one kernel from ``jkernel.open``."""
    kernel = jkernel.open(bundle, **open_kw)
    pool = Pool(kernel, clock=clock, decode_threshold=decode_threshold)
    return Simulator(kernel.inputs.scenario.name, [pool])


def build_disaggregated(bundle=DISAGG_BUNDLE, *, clock: str = "expected_s",
                        decode_threshold: int = 1, **open_kw) -> Simulator:
    """A simulator of a prefill/decode deployment: one kernel per pool from ``open_pool``."""
    prefill = jkernel.open_pool(bundle, "prefill", **open_kw)
    decode = jkernel.open_pool(bundle, "decode", **open_kw)
    pools = prefill.inputs.deployment.pools
    first = {p.role: sum(q.nodes for q in pools[:i]) for i, p in enumerate(pools)}
    return Simulator(prefill.inputs.scenario.name,
                     [Pool(prefill, first_node=first["prefill"], clock=clock,
                           decode_threshold=decode_threshold),
                      Pool(decode, first_node=first["decode"], clock=clock,
                           decode_threshold=decode_threshold)])


def compare(n: int = 2000, rate: float = 12.0, *, prompt_mean: int = 2048,
            output_mean: int = 256, seed: int = 0, clock: str = "expected_s") -> dict:
    """Run the same workload colocated and disaggregated; return both summaries."""
    out = {}
    for label, build in (("colocated", build_colocated), ("disaggregated", build_disaggregated)):
        sim = build(clock=clock)
        reqs = poisson_workload(n, rate, prompt_mean=prompt_mean, output_mean=output_mean,
                                seed=seed)
        out[label] = sim.run(reqs)
    return out


def _print(results: dict) -> None:
    keys = ["completed", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms",
            "e2e_p50_s", "output_tokens_per_s", "requests_per_s", "steps", "preemptions"]
    rows = {label: res.summary() for label, res in results.items()}
    print(f"{'':22s}" + "".join(f"{label:>16s}" for label in rows))
    for k in keys:
        print(f"{k:22s}" + "".join(f"{rows[label][k]:16.2f}" if isinstance(rows[label][k], float)
                                   else f"{rows[label][k]:16d}" for label in rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.simulator",
                                 description="Colocated against disaggregated serving, priced "
                                             "by jkernel.")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    ap.add_argument("--prompt", type=int, default=2048, help="mean prompt tokens")
    ap.add_argument("--output", type=int, default=256, help="mean output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["expected_s", "no_overlap_s"], default="expected_s")
    a = ap.parse_args(argv)
    _print(compare(a.requests, a.rate, prompt_mean=a.prompt, output_mean=a.output,
                   seed=a.seed, clock=a.clock))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
