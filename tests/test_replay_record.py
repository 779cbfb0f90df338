"""A replay reproduces a recorded run exactly: the whole per-request table, every gap
between tokens and the whole step log, on synthetic workloads that reach every branch of
the scheduler (chunked prefill, prefix-cache hits and evictions, preemption and recompute,
asynchronous and synchronous scheduling, data-parallel lockstep, a disaggregated pair).

The records in ``tests/data/replay_record/`` were written by this file's ``record`` (the
preempting ones last when a preempted request's cached blocks and the whole-sequence
admission check came in); a change to the scheduler or the event loop that moves any
decision (which request runs, how many tokens, when) moves a step or a token time and fails
here, naming the first differing row. Prices come from the shipped catalog, so a deliberate
change of a catalog constant, of a priced figure or of a scheduling rule needs a new
record: ``PYTHONPATH=. python tests/test_replay_record.py`` rewrites them (say why in the
commit).
"""

from __future__ import annotations

import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel.replay import replay, replay_disaggregated

ROOT = Path(__file__).resolve().parent.parent
if str(Path(__file__).resolve().parent) not in sys.path:          # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import bundle_with  # noqa: E402

RECORD = Path(__file__).resolve().parent / "data" / "replay_record"
SCENARIOS = ROOT / "catalog" / "scenarios"


def workload(n: int, rate: float, seed: int, *, prompt=(50, 2600), output=(1, 48),
             groups: int = 4) -> pd.DataFrame:
    """Poisson arrivals with mixed prompts; a third of the requests share a prefix with
    their group (prefix-cache hits), the rest have none."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    arrival -= arrival[0]
    prompts = rng.integers(prompt[0], prompt[1], n)
    df = pd.DataFrame({"request_id": np.arange(n), "arrival_s": np.round(arrival, 6),
                       "input_tokens": prompts,
                       "output_tokens": rng.integers(output[0], output[1], n)})
    shared = rng.random(n) < 0.35
    df["prefix_group"] = np.where(shared, [f"g{g}" for g in rng.integers(0, groups, n)], "")
    df["prefix_length"] = np.where(shared, np.minimum(prompts, rng.integers(16, 900, n)), 0)
    return df


@lru_cache(maxsize=None)
def _tight(**engine) -> jkernel.Kernel:
    """qwen3-14b on one H100 with a KV cache of a few hundred pages (preemptions)."""
    qwen = SCENARIOS / "qwen3-14b-h100-tp1.yaml"
    base = jkernel.open(qwen)
    util = (base.fixed_bytes().total() + 420.5 * base.page_bytes()) / base.device_memory_bytes()
    return jkernel.open(bundle_with(Path(tempfile.mkdtemp()), qwen,
                                    gpu_memory_utilization=round(util, 6), max_model_len=3000,
                                    max_num_batched_tokens=2048, **engine))


def _runs():
    """name → a function returning the replay's :class:`ReplayResult`."""
    # The first three admit on the first chunk's blocks, as engines before the
    # whole-sequence admission check run; the fourth replays the first one's workload with
    # the check on, vLLM v0.31.0's default.
    chunk = {"scheduler_reserve_full_isl": False}
    return {
        "qwen-tight-async": lambda: replay(_tight(**chunk), workload(260, 9.0, 1)),
        "qwen-tight-sync": lambda: replay(_tight(async_scheduling=False, **chunk),
                                          workload(200, 7.0, 2)),
        "qwen-tight-no-overlap-clock": lambda: replay(_tight(**chunk), workload(120, 9.0, 3),
                                                      clock="no_overlap_s"),
        "qwen-tight-whole-sequence": lambda: replay(_tight(), workload(260, 9.0, 1)),
        "qwen3-30b-dp": lambda: replay(jkernel.open("qwen3-30b-a3b-h200-ep"),
                                       workload(160, 30.0, 4)),
        "llama-70b-disagg": lambda: replay_disaggregated(
            jkernel.open_pool("llama-3.1-70b-h200-disagg", "prefill"),
            jkernel.open_pool("llama-3.1-70b-h200-disagg", "decode"),
            workload(90, 12.0, 5)),
    }


REQUEST_COLUMNS = ["request_id", "ttft_s", "e2e_s", "itl_mean_s", "first_token_s",
                   "finish_s", "preemptions", "cached_tokens", "rejected"]


def _tables(res) -> dict[str, pd.DataFrame]:
    return {"requests": res.requests[REQUEST_COLUMNS].reset_index(drop=True),
            "steps": res.steps.reset_index(drop=True),
            "gaps": pd.DataFrame({"itl_gap_s": res.itl_gaps_s})}


#: read floats back bit for bit (pandas 3 does by default and deprecates the argument)
_EXACT = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}


def _path(name: str, table: str) -> Path:
    return RECORD / f"{name}.{table}.csv.gz"


def record() -> None:
    RECORD.mkdir(parents=True, exist_ok=True)
    for name, run in _runs().items():
        res = run()
        for table, df in _tables(res).items():
            df.to_csv(_path(name, table), index=False, float_format="%.17g")
        s = res.summary
        print(f"{name}: {s['completed']} completed, {s['rejected']} rejected, {s['steps']} "
              f"steps, {s['preemptions']} preemptions, "
              f"{int(res.requests.cached_tokens.sum())} cached tokens")


def _first_difference(got: pd.DataFrame, want: pd.DataFrame) -> str:
    if list(got.columns) != list(want.columns) or len(got) != len(want):
        return f"shape {got.shape} {list(got.columns)} != recorded {want.shape}"
    for col in want.columns:
        a, b = got[col].to_numpy(), want[col].to_numpy()
        same = (a == b) | (pd.isna(a) & pd.isna(b))
        if not same.all():
            i = int(np.flatnonzero(~same)[0])
            return f"row {i}, column {col}: {a[i]!r} != recorded {b[i]!r}"
    return ""


@pytest.mark.parametrize("name", list(_runs()))
def test_a_replay_reproduces_its_recorded_tables_exactly(name):
    res = _runs()[name]()
    for table, got in _tables(res).items():
        want = pd.read_csv(_path(name, table), **_EXACT)
        if table == "requests":
            want["rejected"] = want["rejected"].astype(bool)
        got = got.astype({c: want[c].dtype for c in got.columns
                          if got[c].dtype != want[c].dtype and c != "pool"})
        diff = _first_difference(got, want)
        assert not diff, f"{name} {table}: {diff}"


def test_the_records_reach_every_scheduler_branch():
    """The workloads are worth recording: they preempt, hit the prefix cache, chunk
    prompts, step data-parallel replicas and run a disaggregated pair."""
    read = lambda n, t: pd.read_csv(_path(n, t))  # noqa: E731
    tight = read("qwen-tight-async", "requests")
    assert tight.preemptions.sum() > 0 and tight.cached_tokens.sum() > 0
    assert read("qwen-tight-sync", "requests").preemptions.sum() > 0
    whole = read("qwen-tight-whole-sequence", "requests")
    assert 0 < whole.preemptions.sum() < tight.preemptions.sum()   # fewer, not none
    steps = read("qwen-tight-async", "steps")
    assert steps.tokens.max() == 2048                         # a prompt chunked at the budget
    assert set(read("llama-70b-disagg", "steps").pool) == {"prefill", "decode"}
    assert read("qwen3-30b-dp", "steps").requests.max() > 1


# -- the scheduler alone (no kernel, no prices) ---------------------------------------------

def drive(pages: int, fixed: int, caching: bool, seed: int, whole: bool,
          steps: int = 3000) -> tuple:
    """Feed one :class:`Replica` random requests (prompts of 1–300 tokens whose blocks share
    prefixes within 4 groups) for ``steps`` schedules, ending finished requests as the event
    loop does; returns the sha256 of every step's batch and the replica's whole state after
    it (free and cached blocks, queues, each running request's pages, tokens and held
    hashes), and (scheduled requests, tokens, preemptions, prefix-cache hit tokens).
    ``whole``: the whole-sequence admission check (``reserve_full_isl``)."""
    import hashlib
    import random

    from jkernel.replay.scheduler import PoolLimits, Replica, Seq

    bs = 16
    lim = PoolLimits.manual(block_size=bs, max_num_batched_tokens=256, max_num_seqs=8,
                            pages=pages, prefix_caching=caching, reserve_full_isl=whole)
    lim.fixed_pages = fixed                   # a recurrent state charged at admission
    r = Replica(lim)
    rng = random.Random(seed)
    h = hashlib.sha256()
    rid = scheduled = tokens = hit = 0
    for _ in range(steps):
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2))):
            prompt = rng.randint(1, 300)
            blocks = prompt // bs
            group, shared = rng.randrange(4), rng.randint(0, blocks)
            hashes = tuple(group * 10_000 + j for j in range(shared)) + \
                tuple(10**9 + rid * 1000 + j for j in range(shared, blocks))
            r.waiting.append(Seq(rid, prompt, rng.randint(1, 40), hashes=hashes))
            rid += 1
        sched = r.schedule()
        scheduled += len(sched)
        tokens += sum(n for _, n, _, _ in sched)
        for seq, _n, _before, samples in sched:
            if samples and seq.done:
                hit += seq.cached_tokens
                r.release(seq)
                r.running.remove(seq)
        h.update(repr(([(q.rid, n, b, x) for q, n, b, x in sched], r.free_pages,
                       list(r.evictable), sorted(map(repr, r.cache.items())), [q.rid for q in r.waiting],
                       [q.rid for q in r.running], r.preemptions,
                       [(q.rid, q.pages, q.computed, q.num_tokens, q.sampled, q.cached_tokens,
                         tuple(q.held)) for q in r.running])).encode())
    return h.hexdigest(), (scheduled, tokens, r.preemptions, hit)


#: (pages, fixed pages, prefix caching, seed, whole-sequence admission) → what
#: :func:`drive` returned when recorded
SCHEDULES = {
    (60, 0, True, 1, False): "be102027fb3dedd282edf31b7fe627dd50c40a0e2ed6f591234f7ee32d907dc1",
    (60, 3, True, 2, False): "faa2e5b9d80f656bb4958fce2d96444153326b104b88a50293158214d341b9d4",
    (45, 0, False, 3, False): "3541add720554d4925099c01cb514803f7fceb11989f0b6b3f9a261599bd58bb",
    (400, 0, True, 4, False): "fb3959ced4c153184ee60ff8375ef4590c96f71c880d0ea9258c117c64ee7cf1",
    (60, 0, True, 1, True): "d4948dfa7456a385250da49d692b7a570f27ca8414ed2f4791268c4c2d29a2a5",
    (60, 3, True, 2, True): "0bd31e9654be855dd8b424c90028f97dd076b4d919e2fe8f2351d964e3e24731",
    (45, 0, False, 3, True): "7cdad0641c486888f717a60ffcac2a4b3c33da26a6b0a738cb274eab5711310f",
}


@pytest.mark.parametrize("config", list(SCHEDULES))
def test_the_scheduler_reproduces_its_recorded_schedules(config):
    digest, (scheduled, tokens, preemptions, hit) = drive(*config)
    assert scheduled > 10_000 and tokens > 80_000
    if config[0] < 100:
        assert preemptions > 0                 # the small caches preempt
    if config[2]:
        assert hit > 0                         # and prefix caching hits
    assert digest == SCHEDULES[config], f"{config}: a scheduling decision moved"


if __name__ == "__main__":
    record()
    for cfg in SCHEDULES:
        print(cfg, *drive(*cfg))
