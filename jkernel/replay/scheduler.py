"""One data-parallel replica's scheduler and KV block allocator, after vLLM v0.31.0's v1
scheduler (``vllm/v1/core/sched/scheduler.py``) and KV cache manager.

Everything here is plain Python state; nothing is priced. :class:`Replica.schedule` forms one
step's batch and advances the scheduler's bookkeeping the way vLLM does at scheduling time
(``num_computed_tokens`` grows when a request is scheduled, not when its step ends), so that
the same code serves synchronous and asynchronous scheduling: the caller decides *when* a
schedule happens (see :mod:`jkernel.replay.sim`).

Rules, each as vLLM v0.31.0 does it (FCFS policy, RECOMPUTE preemption, chunked prefill on):

1. Running requests first, in the order they were admitted: each gets
   ``min(tokens not yet computed, token budget left)`` tokens (a decode 1, a partially
   computed prompt its next chunk).
2. A running request whose new tokens need more KV blocks than are free preempts the
   *last* running request (FCFS keeps ``running`` in admission order and pops its tail),
   repeatedly, until the blocks fit or it has preempted itself. A preempted request frees
   all its blocks, loses its computed tokens (it will recompute prompt and outputs so far)
   and goes to the *front* of the waiting queue.
3. Waiting requests are admitted only in a step that preempted nobody, in FCFS order, while
   the budget lasts and fewer than ``max_num_seqs`` run; a prompt longer than the budget
   left is chunked. The first waiting request whose blocks do not fit stops admission
   (no skipping ahead: FCFS). With ``scheduler_reserve_full_isl`` (v0.31.0's default) the
   blocks that must fit are those of the request's whole known sequence (its prompt, and
   the tokens it sampled before a preemption), counting its prefix-cache hits, not only
   those of the chunk it is given: ``allocate_slots(..., full_sequence_must_fit=True)`` on
   the waiting path. Only the chunk's blocks are allocated; the rest is not reserved, so
   running requests may still take them and preempt (rule 2).
4. Prefix caching (when on): a request being admitted with nothing computed looks up its
   full blocks by hash, longest prefix first; a hit shares the block. At most
   ``num_tokens − 1`` tokens are hits, so the last one is always computed (it produces the
   logits). Freed blocks that hold a hash stay cached (evictable, least recently freed
   first; a request's blocks are freed tail first, so its prefix outlives its tail, as
   ``KVCacheManager.free`` orders them) until a new block is needed. vLLM hashes every
   full block of every request, its own content included: the blocks a preempted request
   had computed stay cached like any freed block, and its re-admission hits those not yet
   evicted (:meth:`Seq.block_hash`), so a preemption recomputes only what was evicted.
   A request's cached-token count is that of its first admission (vLLM sets
   ``num_cached_tokens`` once).
"""

from __future__ import annotations

from collections import OrderedDict, deque

__all__ = ["Seq", "Replica", "PoolLimits"]


class Seq:
    """A request's state on one pool.

    ``num_tokens``: prompt + tokens sampled so far on this pool (a sampled token counts as
    soon as its step is scheduled, vLLM's output placeholder); ``computed``: tokens whose KV
    is in the cache (or scheduled into it); ``sampled``: tokens sampled on this pool;
    ``wanted``: tokens to sample here (1 for a prefill-only request of a disaggregated
    pair, whose token is discarded).
    """

    __slots__ = ("rid", "prompt", "wanted", "num_tokens", "computed", "sampled", "pages",
                 "hashes", "held", "prefill_only", "done", "preemptions", "cached_tokens",
                 "replica")

    def __init__(self, rid: int, prompt: int, wanted: int, *, computed: int = 0,
                 prefill_only: bool = False, hashes: tuple = ()):
        self.rid = rid
        self.prompt = prompt
        self.wanted = wanted
        self.num_tokens = prompt
        self.computed = computed
        self.sampled = 0
        self.pages = 0
        self.hashes = hashes          # one per full prompt block, for prefix caching
        self.held: list = []          # hashes of cached blocks this request references
        self.prefill_only = prefill_only
        self.done = False             # every wanted token is sampled (or scheduled to be)
        self.preemptions = 0
        self.cached_tokens = 0
        self.replica = None

    def block_hash(self, j: int):
        """The hash of the request's ``j``-th full block: its content hash where the
        workload gives one (``hashes``), else a key of its own that no other request has
        (content nobody shares, which only the request itself finds again, after a
        preemption)."""
        return self.hashes[j] if j < len(self.hashes) else ("own", self.rid, j)


class PoolLimits:
    """The scheduler limits and KV geometry of one pool, read once from its kernel."""

    def __init__(self, kernel):
        s = kernel.settings
        self.block_size = s.block_size
        self.max_num_batched_tokens = s.max_num_batched_tokens
        self.max_num_seqs = s.max_num_seqs
        self.page_bytes = int(kernel.page_bytes())
        self.pages = int(kernel.kv_cache_pages())          # per rank, per replica
        self.fixed_pages = -(-int(kernel.sequence_fixed_bytes()) // self.page_bytes)
        # As the kernel resolved them (never re-read from the documents): prefix caching
        # and async scheduling with vLLM v0.31.0's defaults, max_model_len stated or derived
        # from the model's config.json.
        self.prefix_caching = s.enable_prefix_caching
        self.async_scheduling = s.async_scheduling
        self.max_model_len = s.max_model_len or None
        self.reserve_full_isl = s.scheduler_reserve_full_isl
        self.kernel = kernel
        self._pages_for: dict[int, int] = {}
        # For a plain paged KV cache a page holds block_size tokens exactly; then the page
        # count is arithmetic and the kernel is asked only to confirm it.
        self._linear = all(kernel.sequence_variable_bytes(n) == -(-n // self.block_size)
                           * self.page_bytes for n in (1, self.block_size + 1, 1000, 4097))

    @classmethod
    def manual(cls, *, block_size: int = 16, max_num_batched_tokens: int = 8192,
               max_num_seqs: int = 256, pages: int = 1000, prefix_caching: bool = True,
               async_scheduling: bool = False, max_model_len: int | None = None,
               reserve_full_isl: bool = True) -> "PoolLimits":
        """Limits without a kernel (a paged cache of ``pages`` blocks): for tests and
        for studying the scheduler alone."""
        lim = cls.__new__(cls)
        lim.block_size, lim.max_num_batched_tokens = block_size, max_num_batched_tokens
        lim.max_num_seqs, lim.pages, lim.fixed_pages = max_num_seqs, pages, 0
        lim.page_bytes = 0
        lim.prefix_caching, lim.async_scheduling = prefix_caching, async_scheduling
        lim.max_model_len, lim.kernel, lim._pages_for, lim._linear = (max_model_len, None,
                                                                       {}, True)
        lim.reserve_full_isl = reserve_full_isl
        return lim

    def pages_for(self, tokens: int) -> int:
        """KV pages a sequence of ``tokens`` tokens holds (memory.md §5)."""
        if self._linear:
            return -(-tokens // self.block_size)
        p = self._pages_for.get(tokens)
        if p is None:
            p = -(-self.kernel.sequence_variable_bytes(tokens) // self.page_bytes)
            self._pages_for[tokens] = p
        return p

    def request_pages(self, tokens: int) -> int:
        """Pages one running request of ``tokens`` tokens holds: its KV pages
        (:meth:`pages_for`) plus its recurrent state (``fixed_pages``; 0 unless the model
        has recurrent layers). memory.md §5: each running sequence also holds
        ``sequence_fixed_bytes()``, charged against the same pages. The cached form of
        :func:`jkernel.startup.request_pages` (a test holds them equal)."""
        return self.pages_for(tokens) + self.fixed_pages


class Replica:
    """One replica's queues and KV blocks (each data-parallel replica has its own)."""

    def __init__(self, limits: PoolLimits):
        self.lim = limits
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.free_pages = limits.pages
        self.cache: dict = {}                     # hash -> references by live requests
        self.evictable: OrderedDict = OrderedDict()   # cached hashes nobody references
        self.preemptions = 0

    # -- blocks ------------------------------------------------------------------------
    def available(self) -> int:
        """Blocks a new allocation may take: free plus cached-but-unreferenced."""
        return self.free_pages + len(self.evictable)

    def usage(self) -> float:
        """Fraction of the KV cache in use (vLLM's ``kv_cache_usage``)."""
        pages = self.lim.pages
        return 1.0 - (self.free_pages + len(self.evictable)) / pages if pages else 0.0

    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def _take(self, n: int) -> None:
        take = min(n, self.free_pages)
        self.free_pages -= take
        for _ in range(n - take):                 # evict the least recently freed
            h, _ = self.evictable.popitem(last=False)
            del self.cache[h]

    def _need(self, seq: Seq, tokens: int) -> int:
        """Pages ``seq`` must take to hold ``tokens`` tokens: beyond those it holds, and its
        recurrent state if it holds nothing yet (charged at admission)."""
        need = self.lim.pages_for(tokens) - seq.pages
        if seq.pages == 0:
            need += self.lim.fixed_pages
        return need

    def _grow(self, seq: Seq, tokens: int) -> bool:
        need = self._need(seq, tokens)
        if need <= 0:
            return True
        if need > self.available():
            return False
        self._take(need)
        seq.pages += need
        return True

    def _lookup(self, seq: Seq) -> list:
        """Cached prefix blocks of ``seq`` (vLLM: at most num_tokens − 1 tokens hit)."""
        if not self.lim.prefix_caching:
            return []
        cache = self.cache
        limit = (seq.num_tokens - 1) // self.lim.block_size
        shared = seq.hashes
        hits = []
        for h in shared[:limit]:               # Seq.block_hash, inline (the hot path)
            if h not in cache:
                return hits
            hits.append(h)
        for j in range(len(shared), limit):  # a request's own blocks: cached only if preempted
            h = seq.block_hash(j)
            if h not in cache:
                break
            hits.append(h)
        return hits

    def _register(self, seq: Seq) -> None:
        """Full prompt blocks now computed become cached under their hashes."""
        full = min(seq.computed // self.lim.block_size, len(seq.hashes))
        for h in seq.hashes[len(seq.held):full]:
            if h in self.cache:
                # Another request computed the same block meanwhile: vLLM keeps both
                # copies; this one stays private and is not cached twice.
                break
            self.cache[h] = 1
            seq.held.append(h)

    def release(self, seq: Seq) -> None:
        """Free ``seq``'s blocks, its last first; its cached blocks stay cached until
        evicted."""
        private = seq.pages - len(seq.held)
        for h in reversed(seq.held):
            refs = self.cache[h] - 1
            self.cache[h] = refs
            if refs == 0:
                self.evictable[h] = None
        self.free_pages += private
        seq.pages = 0
        seq.held = []

    def _preempt(self, seq: Seq) -> None:
        """RECOMPUTE preemption (vLLM v0.31.0 v1's only mode): free, reset, requeue first.
        With prefix caching its computed full blocks not cached yet are cached under their
        hashes before they are freed (rule 4), as far as no other request holds the same
        hash (a copy of a cached block stays private and ends the chain)."""
        if self.lim.prefix_caching:
            cache = self.cache
            for j in range(len(seq.held), seq.computed // self.lim.block_size):
                h = seq.block_hash(j)
                if h in cache:
                    break
                cache[h] = 1
                seq.held.append(h)
        self.release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # -- one schedule --------------------------------------------------------------------
    def schedule(self, budget: int | None = None) -> list:
        """Form one step's batch: ``[(seq, tokens, computed_before, samples)]``.

        ``samples`` is True when the step completes the request's known tokens, i.e. it
        samples a token (a partial prefill chunk samples nothing). The bookkeeping is
        advanced as vLLM does it at schedule time.

        Speed (the replay calls this once per replica per step): a request is advanced as
        soon as it is scheduled (a preemption only ever takes a request later in
        ``running`` than the one being scheduled, and admission reads only the waiting
        request it admits, so no decision reads a scheduled request's tokens); a request
        whose new tokens fit its blocks skips the block allocator; prefix-cache blocks
        are registered after admission, in batch order, as before, and only for a request
        with a computed full block not yet registered.
        """
        lim = self.lim
        if budget is None:
            budget = lim.max_num_batched_tokens
        out: list = []
        pending: list = []                        # requests with blocks to register
        caching = lim.prefix_caching
        bs = lim.block_size
        # pages_for's arithmetic inline for a plain paged cache (the common case)
        linear = getattr(lim, "_linear", False)
        fixed = lim.fixed_pages
        preempted = False
        running = self.running
        i = 0
        count = len(running)
        while i < count and budget > 0:
            seq = running[i]
            i += 1
            if seq.done:                          # its last token is in flight (async)
                continue
            before = seq.computed
            n = seq.num_tokens - before
            if n > budget:
                n = budget
            if n <= 0:
                continue
            total = before + n
            pages = seq.pages
            need = ((total + bs - 1) // bs if linear else lim.pages_for(total)) - pages
            if pages == 0 and fixed:
                need += fixed
            if need > 0:                          # as _grow: allocate, or preempt
                scheduled = True
                while not self._grow(seq, total):
                    victim = running.pop()        # FCFS: the last admitted goes first
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        scheduled = False
                        break
                count = len(running)
                if not scheduled:
                    break
            budget -= n
            seq.computed = total                  # _advance, inline (the hot path)
            if total == seq.num_tokens:
                seq.sampled += 1
                seq.num_tokens = total + 1
                if seq.sampled >= seq.wanted:
                    seq.done = True
                out.append((seq, n, before, True))
            else:
                out.append((seq, n, before, False))
            if caching and len(seq.held) < len(seq.hashes):
                pending.append(seq)
        # vLLM v0.31.0: no new request is admitted in a step that preempted one.
        if not preempted:
            whole = lim.reserve_full_isl
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < lim.max_num_seqs:
                seq = waiting[0]
                hits: list = []
                if seq.computed == 0 and seq.pages == 0:
                    hits = self._lookup(seq)
                if hits:
                    hit_tokens = len(hits) * bs
                    n = min(seq.num_tokens - hit_tokens, budget)
                    # an evictable hit becomes allocated: vLLM counts it against the free
                    # blocks; with the whole-sequence check (rule 3) the gate is the pages
                    # of all its tokens, else those of this chunk
                    touched = sum(1 for h in hits if h in self.evictable)
                    need = self._need(seq, hit_tokens + n) - len(hits)
                    gate = self._need(seq, seq.num_tokens) - len(hits) if whole else need
                    if gate > self.available() - touched:
                        break
                    for h in hits:
                        if h in self.evictable:
                            del self.evictable[h]
                        self.cache[h] = self.cache.get(h, 0) + 1
                    seq.held = list(hits)
                    seq.pages = len(hits)
                    seq.computed = hit_tokens
                    if not seq.preemptions:       # vLLM keeps the first admission's count
                        seq.cached_tokens = hit_tokens
                    self._take(need)
                    seq.pages += need
                else:
                    n = min(seq.num_tokens - seq.computed, budget)   # chunked prefill
                    if whole and self._need(seq, seq.num_tokens) > self.available():
                        break
                    if not self._grow(seq, seq.computed + n):
                        break
                waiting.popleft()
                running.append(seq)
                before = seq.computed
                budget -= n
                out.append(self._advance(seq, n, before, before + n))
                if caching and len(seq.held) < len(seq.hashes):
                    pending.append(seq)
        for seq in pending:                       # blocks computed and not yet registered
            if len(seq.held) < seq.computed // bs:
                self._register(seq)
        return out

    @staticmethod
    def _advance(seq: Seq, n: int, before: int, total: int) -> tuple:
        """Schedule ``n`` tokens of ``seq`` (computed ``before`` → ``total``): the batch
        entry ``(seq, n, before, samples)``."""
        seq.computed = total
        if total == seq.num_tokens:               # it samples a token (a placeholder
            seq.sampled += 1                      # until its step ends)
            seq.num_tokens = total + 1
            if seq.sampled >= seq.wanted:
                seq.done = True
            return (seq, n, before, True)
        return (seq, n, before, False)

    def remove(self, seq: Seq) -> None:
        """Take a finished request out of ``running`` (its blocks are released apart)."""
        self.running.remove(seq)
