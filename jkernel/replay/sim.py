"""The replay's event loop: pools of engines stepping their schedulers, priced by kernels.

Time is an integer count of microseconds. Each engine step lasts its batch's ``expected_s``
(``clock="no_overlap_s"`` for reference parity), rounded half up, at least one tick. Around
the step (methods.md), per request:

* it becomes schedulable ``admission_overhead(prompt)`` after it reaches a pool;
* each sampled token reaches the client ``output_token_overhead()`` after the step ends;
* a finished request adds ``completion_overhead()`` to its end-to-end latency (not to TTFT);
* the API server is one process per pool that works through its jobs one at a time, in the
  order they reach it (vLLM's OpenAI server: one process, one event loop, unless
  ``--api-server-count`` starts more): a request's admission
  (``host_api_server_per_request``) when it arrives, and at each step's end the streaming of
  the tokens the step sampled (``host_api_server_per_token`` each). A request reaches the
  engine ``admission_overhead`` after its admission job starts (the job is part of it; when
  the job is done, if that is later), so it waits only while the process is busy with
  earlier jobs; a step's tokens reach the client ``output_token_overhead`` after the process
  has streamed them all. Both constants are 0 until a serving fit measures them: then the
  process never queues and these rules are the two above;
* disaggregated: when the prefill pool has computed the prompt (its sampled token is
  discarded), the KV cache moves to a decode engine in ``pd_transfer_time`` (priced on the
  prefill kernel, D26); the prefill engine holds the blocks until the transfer is done; the
  decode engine recomputes the last prompt token and samples every output token.

When a step is scheduled (vLLM v0.31.0's engine core):

* synchronous scheduling: when the previous step's outputs are processed, i.e. at its end;
  requests that became ready by then are admitted;
* asynchronous scheduling (``async_scheduling``, on by default in v0.31.0): step N+1 is
  scheduled while step N runs, right after step N is launched (the batch queue holds two
  steps), so a request that becomes ready during step N first runs in step N+2; a request
  that finished in step N still holds its blocks and its ``max_num_seqs`` slot when N+1 is
  scheduled (its outputs are processed at the end of N). If nothing could be scheduled
  ahead, the engine schedules again at the end of the step.

Engines: a pool holds ``settings.engines`` identical engines; a request is routed, when
it becomes ready, to the engine and then the replica with the fewest outstanding requests
(vLLM's data-parallel coordinator balances by queue length). The replicas of one engine step
in lockstep, each padded to the busiest one's token count (``pad_tokens``).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math

import numpy as np

from ..overheads import Placement
from .scheduler import PoolLimits, Replica, Seq

__all__ = ["Pool", "Engine", "Simulation", "StepRecord", "ticks", "step_ticks"]

US_PER_S = 1_000_000
# Events at one instant run in this order: requests reaching a busy API server, arrivals,
# step ends, landed transfers, then the wake-ups of idle engines, so that requests arriving
# together are scheduled together (the engine core drains its input queue before it
# schedules).
_FRONT, _ARRIVE, _STEP_END, _XFER_DONE, _WAKE = -1, 0, 1, 2, 3


def ticks(seconds: float) -> int:
    """Seconds as whole microseconds, rounded half up."""
    return int(math.floor(seconds * US_PER_S + 0.5))


def step_ticks(seconds: float) -> int:
    """A step's duration in ticks: at least one, so the clock always moves."""
    return max(1, ticks(seconds))


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block, as it was after. A replay
    allocates millions of small objects that live to its end (token times, batch tuples,
    the step log) and no garbage cycle worth collecting meanwhile; every collection of the
    oldest generation walked all of them, about a quarter of a replay's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Engine:
    """One engine of a pool: its replicas, the step in flight and (async) the next one."""

    __slots__ = ("pool", "index", "node", "replicas", "busy", "inflight", "next", "waking",
                 "inflight_step")

    def __init__(self, pool: "Pool", index: int, node: int):
        self.pool = pool
        self.index = index
        self.node = node
        self.replicas = [Replica(pool.limits) for _ in range(pool.dp)]
        self.busy = False
        self.inflight = None
        self.next = None
        self.waking = False
        self.inflight_step = -1       # index in the step log of the step in flight

    def outstanding(self) -> int:
        return sum(r.outstanding() for r in self.replicas)

    def least_loaded_replica(self) -> Replica:
        return min(self.replicas, key=Replica.outstanding)


class Pool:
    """One pool: its kernel, scheduler limits, engines and the around-the-step overheads."""

    def __init__(self, kernel, *, name: str = "", first_node: int = 0,
                 clock: str = "expected_s"):
        if clock not in ("expected_s", "no_overlap_s"):
            raise ValueError(f"clock must be 'expected_s' or 'no_overlap_s', not {clock!r}")
        self.kernel = kernel
        self.name = name or kernel.pool().role
        self.clock = clock
        self.limits = PoolLimits(kernel)
        s = kernel.settings
        self.decode_threshold = s.decode_threshold
        self.dp = kernel.resolution().data_parallel()
        gpn = kernel.inputs.scenario.cluster.gpus_per_node
        engine_gpus = s.engine_gpus
        count = max(1, s.engines)
        self.engines = [Engine(self, e, first_node + e * engine_gpus // gpn)
                        for e in range(count)]
        self.nodes = kernel.pool().nodes
        self.output_token_us = ticks(kernel.output_token_overhead())
        self.completion_us = ticks(kernel.completion_overhead())
        api = kernel.api_server_work()
        #: the API server's work per request (ticks) and per streamed token (seconds); a
        #: pool whose server does none never queues there (``api`` False)
        self.api_request_us = ticks(api.per_request_s)
        self.api_token_s = float(api.per_token_s)
        self.api = self.api_request_us > 0 or self.api_token_s > 0
        self.api_free_us = 0          # when the API server has done every job given so far
        self._admission: dict[int, int] = {}
        self.steps = 0
        #: the slowest replica's batch of the last priced step, ``(scheduled, computed,
        #: pad)``, kept only when a recording simulation asks (``keep_batch``)
        self.keep_batch = False
        self.last_batch = None
        self._pricer = kernel.pricer(clock, decode_threshold=s.decode_threshold)

    def _price(self, sched: list, comp: list, pad: int) -> float:
        """One replica's step, in seconds of the pool's clock, through the kernel's
        :class:`~jkernel.pricer.StepPricer` (the figures ``step_time`` gives, to the bit;
        the token lists written into reused buffers, one figure read back)."""
        return self._pricer(sched, comp, pad)

    def prime_admission(self, prompts) -> None:
        """Price the admission of every prompt length in ``prompts`` not yet priced, in one
        vectorised call (:meth:`jkernel.Kernel.admission_overheads`; one scalar call per
        length cost ~20 µs, a tenth of a replay whose prompts all differ)."""
        new = [p for p in np.unique(np.asarray(prompts, np.int64)).tolist()
               if p not in self._admission]
        if new:
            secs = self.kernel.admission_overheads(new).tolist()
            for p, s in zip(new, secs):
                self._admission[p] = ticks(s)

    def admission_us(self, prompt: int) -> int:
        us = self._admission.get(prompt)
        if us is None:
            us = self._admission[prompt] = ticks(self.kernel.admission_overhead(prompt))
        return us

    def least_loaded_engine(self) -> Engine:
        return min(self.engines, key=Engine.outstanding)

    def api_job(self, t: int, work_us: int) -> tuple[int, int]:
        """A job of ``work_us`` ticks given to the API server at ``t``: ``(start, done)``,
        after every job given before it."""
        start = t if t > self.api_free_us else self.api_free_us
        self.api_free_us = start + work_us
        return start, self.api_free_us

    def price(self, per_replica: list) -> int:
        """One engine step over its replicas' batches, in ticks; the slowest replica sets it."""
        if self.dp == 1:
            b = per_replica[0]
            sched, comp = [x[1] for x in b], [x[2] for x in b]
            if self.keep_batch:
                self.last_batch = (sched, comp, 0)
            return step_ticks(self._price(sched, comp, 0))
        worst, slowest = 0.0, None
        for row in self.rows(per_replica):
            s = self._price(*row)
            if slowest is None or s > worst:
                worst, slowest = s, row
        if self.keep_batch:
            self.last_batch = slowest
        return step_ticks(worst)

    def rows(self, per_replica: list) -> list:
        """The batches one engine step prices: ``(scheduled, computed, pad_tokens)`` per
        replica that runs something, each padded to the busiest replica's token count
        (``pad_tokens``); the step lasts as long as the slowest of them."""
        if self.dp == 1:
            b = per_replica[0]
            return [([x[1] for x in b], [x[2] for x in b], 0)]
        tokens = [sum(x[1] for x in b) for b in per_replica]
        top = max(tokens)
        return [([x[1] for x in b], [x[2] for x in b], top - t)
                for b, t in zip(per_replica, tokens) if b or top - t]


class StepRecord:
    """What a recording :class:`Simulation` keeps of its steps and requests, for the serving
    fit (:mod:`jkernel.calibration.fit.serving`) to price them again at other constants.

    Per step, in step-log order: ``engine`` (its index) and the batch that set its duration
    (``scheduled``, ``computed`` token lists and ``pad`` tokens of the slowest replica). Per
    request: ``first_step`` and ``last_step``, the steps whose end delivers its first and
    its last token (−1 if none). An engine's steps between two wake-ups run back to back, so
    a token reaches the client ``output_token_overhead`` after the end of its step, which is
    the step's start plus the durations of the engine's steps from the one running when the
    request became ready (``arrival + admission_overhead``): a linear function of the step
    durations and the overheads while the batches stay the same.
    """

    __slots__ = ("engine", "scheduled", "computed", "pad", "first_step", "last_step",
                 "admit_wait_us", "first_wait_us", "last_wait_us")

    def __init__(self, n: int):
        self.engine: list[int] = []
        self.scheduled: list[list[int]] = []
        self.computed: list[list[int]] = []
        self.pad: list[int] = []
        self.first_step = np.full(n, -1, np.int64)
        self.last_step = np.full(n, -1, np.int64)
        #: per request, the ticks it waited on the API server: before its admission, and
        #: between the end of the step that sampled its first (last) token and that token's
        #: ``output_token_overhead`` (0 where the server does no work)
        self.admit_wait_us = np.zeros(n, np.int64)
        self.first_wait_us = np.zeros(n, np.int64)
        self.last_wait_us = np.zeros(n, np.int64)


class Simulation:
    """Replay ``requests`` through ``pools`` (one colocated pool, or prefill then decode).

    ``arrival_us``, ``prompt``, ``output``: int arrays, one entry per request (only the
    accepted ones are replayed); ``hashes``: per request, a tuple of prompt-block hashes.
    ``clients``: a :class:`~jkernel.replay.clients.ClientLoop` deciding when each request
    is sent (closed-loop clients, sessions); then ``arrival_us`` is overwritten with the
    sends it chose. Without one every request arrives at its ``arrival_us``.
    ``record``: keep a :class:`StepRecord` (``self.record``) of a colocated replay.
    """

    def __init__(self, pools: list[Pool], arrival_us, prompt, output, hashes=None,
                 *, progress=None, clients=None, record: bool = False):
        self.pools = pools
        self.disaggregated = len(pools) == 2
        self.arrival_us = np.array(arrival_us, np.int64)
        self._clients = clients
        self.prompt = np.asarray(prompt, np.int64)
        self.output = np.asarray(output, np.int64)
        self._output = self.output.tolist()      # read per token: plain ints are cheaper
        for pool in pools:
            pool.prime_admission(self.prompt)
        n = len(self.arrival_us)
        self.hashes = hashes if hashes is not None else [()] * n
        self.n = n
        self.first_us = [-1] * n
        self.finish_us = [-1] * n
        self.tokens_us: list[list[int]] = [[] for _ in range(n)]
        self.preemptions = [0] * n
        self.cached_tokens = [0] * n
        self.step_log: list[tuple] = []
        self.kv_usage_peak = 0.0
        self._heap: list = []
        self._seq = 0
        self._progress = progress
        self._done = 0
        self.record = None
        if record:
            if self.disaggregated:
                raise ValueError("a step record is kept for a colocated replay only")
            self.record = StepRecord(n)
            for p in pools:
                p.keep_batch = True

    # -- events --------------------------------------------------------------------------
    def _push(self, t: int, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, obj))

    def _send(self, rid: int, t: int) -> None:
        """Request ``rid`` reaches the entry pool at ``t``."""
        entry = self.pools[0]
        p = int(self.prompt[rid])
        wanted = 1 if self.disaggregated else int(self.output[rid])
        seq = Seq(rid, p, wanted, prefill_only=self.disaggregated,
                  hashes=self.hashes[rid] if entry.limits.prefix_caching else ())
        self.arrival_us[rid] = t
        self._reach(t, entry, None, seq)

    def _reach(self, t: int, pool: Pool, engine, seq: Seq) -> None:
        """``seq`` reaches ``pool`` at ``t``: its API server when that does work
        (:meth:`_front`), else the engine ``admission_overhead`` later."""
        if pool.api:
            self._push(t, _FRONT, (pool, engine, seq))
        else:
            self._push(t + pool.admission_us(seq.prompt), _ARRIVE, (pool, engine, seq))

    def _front(self, t: int, pool: Pool, engine, seq: Seq) -> None:
        """``seq`` reaches ``pool``'s API server at ``t``: its admission job waits for the
        jobs before it, and the request reaches the engine ``admission_overhead`` after the
        job starts (the job is part of it), or when the job is done if that is later."""
        start, done = pool.api_job(t, pool.api_request_us)
        if self.record is not None and pool is self.pools[0]:
            self.record.admit_wait_us[seq.rid] = start - t
        self._push(max(start + pool.admission_us(seq.prompt), done), _ARRIVE,
                   (pool, engine, seq))

    def run(self) -> "Simulation":
        self._start()
        heap = self._heap
        pop = heapq.heappop
        handle = self._handle
        with gc_paused():
            while heap:
                handle(*pop(heap))
        if self._progress is not None:
            self._progress.close()
        return self

    def _start(self) -> None:
        """Every request's send (or the clients' first sends) onto the event heap."""
        if self._clients is None:
            for rid in range(self.n):
                self._send(rid, int(self.arrival_us[rid]))
        else:
            for rid, t in self._clients.start():
                self._send(rid, t)

    def _handle(self, t: int, kind: int, _seq: int, obj) -> None:
        """One event of the heap at ``t``."""
        if kind == _STEP_END:
            self._step(obj, t)
        elif kind == _FRONT:
            self._front(t, *obj)
        elif kind == _ARRIVE:
            pool, engine, seq = obj
            if engine is None:
                engine = pool.least_loaded_engine()
            replica = engine.least_loaded_replica()
            seq.replica = replica
            replica.waiting.append(seq)
            if not engine.busy and not engine.waking:
                engine.waking = True
                self._push(t, _WAKE, engine)
        elif kind == _WAKE:
            obj.waking = False
            if not obj.busy:
                self._step(obj, t)
        else:                                      # a KV transfer has landed
            seq, engine = obj
            seq.replica.release(seq)
            dec = self.pools[1]
            dseq = Seq(seq.rid, seq.prompt, int(self.output[seq.rid]),
                       computed=seq.prompt - 1)
            dseq.preemptions = seq.preemptions
            self._reach(t, dec, engine, dseq)

    def _schedule(self, engine: Engine):
        per = [r.schedule() for r in engine.replicas]
        return per if any(per) else None

    def _step(self, engine: Engine, t: int) -> None:
        """End of ``engine``'s step at ``t`` (or a wake-up): outputs, then the next step."""
        cur = self._next_batch(engine, t)
        if cur is not None:
            self._launch(engine, t, cur, engine.pool.price(cur))

    def _next_batch(self, engine: Engine, t: int):
        """The first half of :meth:`_step`: the finished step's outputs, then the batch of
        the next step (per replica), or None when the engine goes idle."""
        if engine.inflight is not None:
            self._outputs(engine, engine.inflight, t)
            engine.inflight = None
        pool = engine.pool
        if pool.limits.async_scheduling and engine.next is not None:
            cur, engine.next = engine.next, None
        else:
            cur = self._schedule(engine)
        if cur is None:
            engine.busy = False
        return cur

    def _launch(self, engine: Engine, t: int, cur, dur: int) -> None:
        """The second half of :meth:`_step`: batch ``cur`` runs from ``t`` for ``dur`` ticks
        (its end is an event), and under async scheduling the step after it is scheduled."""
        pool = engine.pool
        engine.busy = True
        engine.inflight = cur
        self._push(t + dur, _STEP_END, engine)
        pool.steps += 1
        replicas = engine.replicas
        if len(replicas) == 1:
            usage = replicas[0].usage()
            tokens = [x[1] for x in cur[0]]
        else:
            usage = max(r.usage() for r in replicas)
            tokens = [x[1] for b in cur for x in b]
        if usage > self.kv_usage_peak:
            self.kv_usage_peak = usage
        nreq = len(tokens)
        tok = sum(tokens)
        thr = pool.decode_threshold
        # prefill tokens: most steps are decodes only, which max() tells without a loop
        pre = sum([x for x in tokens if x > thr]) if tokens and max(tokens) > thr else 0
        engine.inflight_step = len(self.step_log)
        self.step_log.append((pool.name, engine.index, t, dur, nreq, tok, pre, usage))
        rec = self.record
        if rec is not None:
            sched, comp, pad = pool.last_batch
            rec.engine.append(engine.index)
            rec.scheduled.append(sched)
            rec.computed.append(comp)
            rec.pad.append(pad)
        if pool.limits.async_scheduling:
            engine.next = self._schedule(engine)

    def _outputs(self, engine: Engine, per: list, t: int) -> None:
        pool = engine.pool
        tok_us = t + pool.output_token_us
        if pool.api:                  # the API server streams the step's tokens, then they go
            n = sum(1 for items in per for x in items if x[3] and not x[0].prefill_only)
            if n:
                _, done = pool.api_job(t, ticks(n * pool.api_token_s))
                tok_us = done + pool.output_token_us
        wait = tok_us - t - pool.output_token_us
        output = self._output
        tokens_us = self.tokens_us
        for replica, items in zip(engine.replicas, per):
            for seq, _n, _before, samples in items:
                if not samples:
                    continue
                rid = seq.rid
                times = tokens_us[rid]
                if times and not seq.prefill_only:    # a later token: the common case
                    times.append(tok_us)
                    if len(times) < output[rid]:
                        continue
                    if self.record is not None:
                        self.record.last_wait_us[rid] = wait
                    self._finish(engine, replica, seq, tok_us)
                    continue
                if seq.prefill_only:
                    # The prefill pool's token is discarded; the KV cache moves on.
                    self._leave(replica, seq)
                    self.preemptions[rid] = seq.preemptions
                    self.cached_tokens[rid] = seq.cached_tokens
                    dst = self.pools[1].least_loaded_engine()
                    xfer = ticks(pool.kernel.pd_transfer_time(
                        seq.prompt, Placement(node=engine.node), Placement(node=dst.node)))
                    seq.replica = replica
                    self._push(t + xfer, _XFER_DONE, (seq, dst))
                    continue
                # its first token
                self.first_us[rid] = tok_us
                if self.record is not None:
                    self.record.first_step[rid] = engine.inflight_step
                    self.record.first_wait_us[rid] = wait
                times.append(tok_us)
                if len(times) >= output[rid]:
                    if self.record is not None:
                        self.record.last_wait_us[rid] = wait
                    self._finish(engine, replica, seq, tok_us)

    def _finish(self, engine: Engine, replica: Replica, seq: Seq, tok_us: int) -> None:
        """``seq``'s last token reaches the client at ``tok_us``: it completes and leaves."""
        rid = seq.rid
        self.finish_us[rid] = tok_us + engine.pool.completion_us
        if self.record is not None:
            self.record.last_step[rid] = engine.inflight_step
        self.preemptions[rid] = seq.preemptions
        if not self.disaggregated:
            self.cached_tokens[rid] = seq.cached_tokens
        replica.release(seq)
        self._leave(replica, seq)
        self._done += 1
        if self._progress is not None:
            self._progress.update(1)
        if self._clients is not None:      # a client sends its next request
            for nxt, at in self._clients.finished(rid, self.finish_us[rid]):
                self._send(nxt, at)

    @staticmethod
    def _leave(replica: Replica, seq: Seq) -> None:
        if seq in replica.running:
            replica.running.remove(seq)
        elif seq in replica.waiting:               # preempted with its last token in flight
            replica.waiting.remove(seq)
