"""The replay's scheduler, rule by rule, on tiny hand-built workloads (no kernel needed).

Each test builds one :class:`Replica` with :meth:`PoolLimits.manual` limits and checks what
one or a few calls of ``schedule()`` do, as vLLM v0.31.0's v1 scheduler would.
"""

from __future__ import annotations

from jkernel.replay.scheduler import PoolLimits, Replica, Seq


def replica(**kw) -> Replica:
    return Replica(PoolLimits.manual(**kw))


def step_end(r: Replica, sched) -> None:
    """What the event loop does at a step's end: finished requests leave and free blocks."""
    for seq, _n, _before, samples in sched:
        if samples and seq.done:
            r.release(seq)
            r.running.remove(seq)


def tokens(sched) -> list[int]:
    return [n for _, n, _, _ in sched]


def test_token_budget_is_split_running_first_then_waiting_in_order():
    r = replica(max_num_batched_tokens=100, block_size=16)
    a = Seq(0, 10, 5)
    r.waiting.append(a)
    first = r.schedule()
    assert tokens(first) == [10] and first[0][3]              # prompt done: samples
    b, c = Seq(1, 60, 5), Seq(2, 60, 5)
    r.waiting.extend([b, c])
    sched = r.schedule()
    # a decodes one token, b gets its whole prompt, c the 39 tokens left of the budget.
    assert [(s.rid, n) for s, n, _, _ in sched] == [(0, 1), (1, 60), (2, 39)]
    assert sum(tokens(sched)) == 100
    assert [x[3] for x in sched] == [True, True, False]       # c's partial chunk samples nothing
    assert c.computed == 39 and c.sampled == 0
    sched = r.schedule()
    assert [(s.rid, n, before) for s, n, before, _ in sched] == [(0, 1, 11), (1, 1, 60),
                                                                (2, 21, 39)]


def test_a_long_prompt_runs_in_chunks_of_the_budget():
    r = replica(max_num_batched_tokens=64)
    s = Seq(0, 200, 2)
    r.waiting.append(s)
    chunks = []
    while s.sampled == 0:
        chunks.append(r.schedule()[0][1:3])
    assert chunks == [(64, 0), (64, 64), (64, 128), (8, 192)]
    assert s.num_tokens == 201                                 # the first output token


def test_max_num_seqs_bounds_the_running_set():
    r = replica(max_num_seqs=3, max_num_batched_tokens=10_000)
    r.waiting.extend(Seq(i, 20, 4) for i in range(5))
    sched = r.schedule()
    assert [s.rid for s, *_ in sched] == [0, 1, 2]
    assert len(r.running) == 3 and [s.rid for s in r.waiting] == [3, 4]
    # Still three until one finishes (4 output tokens: 3 more steps).
    for _ in range(3):
        sched = r.schedule()
        assert len(sched) == 3
        step_end(r, sched)
    assert len(r.running) == 0
    sched = r.schedule()
    assert [s.rid for s, *_ in sched] == [3, 4]


def test_preemption_when_blocks_run_out_evicts_the_last_admitted():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens take 2 blocks each.
    r = replica(block_size=4, pages=4, max_num_batched_tokens=100)
    a, b = Seq(0, 7, 10), Seq(1, 7, 10)
    r.waiting.extend([a, b])
    r.schedule()                                 # both prompts: 2 + 2 blocks, cache full
    assert r.free_pages == 0 and a.num_tokens == 8
    sched = r.schedule()                         # a's 8th token fits block 2; b's too
    assert tokens(sched) == [1, 1]
    sched = r.schedule()                         # a needs a 3rd block: b is preempted
    assert [s.rid for s, *_ in sched] == [0]
    assert b.preemptions == 1 and b.computed == 0 and b.pages == 0
    assert list(r.waiting) == [b] and r.running == [a] and r.preemptions == 1
    # b's two computed blocks stay cached, freed tail first; a's third block evicted b's
    # tail. No admission in the step that preempted; b comes back first once blocks free up.
    assert r.free_pages == 0 and list(r.evictable) == [b.block_hash(0)]


def test_a_request_that_cannot_grow_preempts_itself_and_nothing_is_admitted():
    r = replica(block_size=4, pages=2, max_num_batched_tokens=100)
    a = Seq(0, 8, 4)
    r.waiting.append(a)
    r.schedule()                                 # 8 tokens: both blocks
    r.waiting.append(Seq(1, 2, 1))
    sched = r.schedule()                         # a needs a 3rd block: preempts itself
    assert sched == [] and a.preemptions == 1
    assert [s.rid for s in r.waiting] == [0, 1]  # a back at the front, FCFS kept
    assert r.free_pages == 0 and r.available() == 2   # a's blocks cached, evictable


def test_recompute_after_preemption_reruns_what_its_cached_blocks_do_not_hold():
    # vLLM hashes every full block of every request: the two full blocks a preempted
    # request had computed stay cached, and its re-admission hits them. Without prefix
    # caching it recomputes its prompt and both sampled tokens.
    for caching, recompute in ((True, (4, 8)), (False, (12, 0))):
        r = replica(block_size=4, pages=100, prefix_caching=caching)
        s = Seq(0, 10, 5)
        r.waiting.append(s)
        r.schedule()
        r.schedule()                             # two tokens sampled, 11 computed
        r.running.remove(s)
        r._preempt(s)
        sched = r.schedule()
        assert sched[0][1:3] == recompute, caching
        assert s.sampled == 3 and s.cached_tokens == 0   # vLLM counts the first admission


def test_a_preempted_request_recomputes_the_blocks_evicted_meanwhile():
    # Its blocks were freed tail first, so an allocation in between evicts its last block
    # and its re-admission still hits the first.
    r = replica(block_size=4, pages=3, max_num_batched_tokens=100)
    s = Seq(0, 10, 5)
    r.waiting.append(s)
    r.schedule()                                 # 10 tokens: 3 blocks, 2 of them full
    r.running.remove(s)
    r._preempt(s)
    assert list(r.evictable) == [s.block_hash(1), s.block_hash(0)] and r.free_pages == 1
    r._take(2)                                   # another request's blocks: 1 free + 1 evicted
    assert list(r.evictable) == [s.block_hash(0)]
    r.free_pages += 2                            # which it frees again, uncached
    sched = r.schedule()
    assert sched[0][1:3] == (7, 4)               # block 0 hit, the rest of 11 tokens computed


def test_admission_stops_at_the_first_request_whose_blocks_do_not_fit():
    r = replica(block_size=4, pages=3, max_num_batched_tokens=100)
    r.waiting.extend([Seq(0, 4, 1), Seq(1, 12, 1), Seq(2, 4, 1)])
    sched = r.schedule()
    assert [s.rid for s, *_ in sched] == [0]     # 1 needs 3 blocks, 2 left: FCFS stops
    assert [s.rid for s in r.waiting] == [1, 2]


def test_prefix_cache_hits_share_blocks_and_leave_the_last_token():
    r = replica(block_size=4, pages=100, max_num_batched_tokens=100)
    shared = (11, 12, 13)                        # three full blocks of a common prefix
    a = Seq(0, 14, 1, hashes=shared)
    r.waiting.append(a)
    step_end(r, r.schedule())                    # a computes 14, registers 3 blocks, ends
    assert r.free_pages + len(r.evictable) == 100 and len(r.evictable) == 3
    b = Seq(1, 14, 1, hashes=shared)
    r.waiting.append(b)
    sched = r.schedule()
    assert sched[0][1:3] == (2, 12) and b.cached_tokens == 12
    # A prompt made only of cached blocks still computes its last token.
    c = Seq(2, 12, 1, hashes=shared)
    r.waiting.append(c)
    sched = r.schedule()
    assert sched[0][1:3] == (4, 8)


def test_prefix_cache_off_ignores_hashes():
    r = replica(block_size=4, prefix_caching=False)
    a = Seq(0, 14, 1, hashes=(1, 2, 3))
    r.waiting.append(a)
    step_end(r, r.schedule())
    b = Seq(1, 14, 1, hashes=(1, 2, 3))
    r.waiting.append(b)
    assert r.schedule()[0][1:3] == (14, 0)


def test_cached_blocks_are_evicted_least_recently_freed_first():
    r = replica(block_size=4, pages=4, max_num_batched_tokens=100)
    a = Seq(0, 8, 1, hashes=(1, 2))
    r.waiting.append(a)
    step_end(r, r.schedule())
    assert list(r.evictable) == [2, 1] and r.free_pages == 2   # freed tail first
    big = Seq(1, 12, 1)                          # needs 3 blocks: 2 free + evict hash 2
    r.waiting.append(big)
    r.schedule()
    assert list(r.evictable) == [1] and 2 not in r.cache


def test_blocks_all_return_when_everything_finishes():
    r = replica(block_size=4, pages=20, max_num_batched_tokens=16)
    r.waiting.extend(Seq(i, 9, 3) for i in range(6))
    for _ in range(100):
        sched = r.schedule()
        if not sched and not r.waiting:
            break
        step_end(r, sched)
    assert not r.running and not r.waiting
    assert r.free_pages == 20


# -- the whole-sequence admission check (vLLM's scheduler_reserve_full_isl) -----------------

def test_whole_sequence_admission_waits_until_the_whole_prompt_fits():
    # 4 blocks of 4 tokens; a runs with 2 of them. b's 12-token prompt needs 3 blocks, its
    # first chunk (7 tokens of the 8-token budget left after a's decode) only 2.
    for whole, admitted in ((True, False), (False, True)):
        r = replica(block_size=4, pages=4, max_num_batched_tokens=8, reserve_full_isl=whole)
        a = Seq(0, 7, 10)
        r.waiting.append(a)
        r.schedule()
        b = Seq(1, 12, 1)
        r.waiting.append(b)
        sched = r.schedule()
        assert [s.rid for s, *_ in sched] == ([0, 1] if admitted else [0]), whole
        if admitted:                              # only the chunk's blocks are taken
            assert sched[1][1] == 7 and b.pages == 2 and r.free_pages == 0
        else:
            assert list(r.waiting) == [b] and b.pages == 0 and r.free_pages == 2


def test_whole_sequence_admission_counts_the_tokens_sampled_before_a_preemption():
    # b was preempted after sampling 2 tokens: 7 + 2 = 9 tokens to recompute, 3 blocks.
    r = replica(block_size=4, pages=5, max_num_batched_tokens=4)
    a = Seq(0, 8, 10)
    r.waiting.append(a)
    r.schedule()
    r.schedule()                                 # a: 8 prompt tokens in 2 chunks, 2 blocks
    b = Seq(1, 7, 5)
    b.num_tokens, b.sampled, b.preemptions = 9, 2, 1
    r.waiting.append(b)
    r.free_pages = 2                             # another request holds one block
    sched = r.schedule()                         # a chunk of 3 would fit 1 block: not enough
    assert [s.rid for s, *_ in sched] == [0] and list(r.waiting) == [b]
    r.free_pages = 3
    sched = r.schedule()
    assert [(s.rid, n) for s, n, _, _ in sched] == [(0, 1), (1, 3)]


def test_whole_sequence_admission_needs_no_blocks_for_a_shared_cached_prefix():
    # a holds the two cached blocks of an 8-token prefix (and a third for its decodes); b's
    # 12 tokens hit both, so the whole of b needs one block more, which fits the four free.
    r = replica(block_size=4, pages=7, max_num_batched_tokens=8)
    a = Seq(0, 8, 10, hashes=(1, 2))
    r.waiting.append(a)
    r.schedule()                                 # a's prompt (2 blocks)
    b = Seq(1, 12, 5, hashes=(1, 2))
    r.waiting.append(b)
    sched = r.schedule()                         # a's 9th token takes a 3rd block
    assert [(s.rid, n, before) for s, n, before, _ in sched] == [(0, 1, 8), (1, 4, 8)]
    assert b.cached_tokens == 8 and r.free_pages == 3
    # c is as long but cached nowhere: its 6-token chunk would fit the 2 blocks left, its 12
    # tokens do not.
    c = Seq(2, 12, 1, hashes=(7, 8))
    r.waiting.append(c)
    sched = r.schedule()                         # b's 13th token takes one more block
    assert [s.rid for s, *_ in sched] == [0, 1] and list(r.waiting) == [c]
    assert r.free_pages == 2
