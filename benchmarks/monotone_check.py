"""Monotonicity of ``expected_s``: more work never costs less.

    PYTHONPATH=. python benchmarks/monotone_check.py [--pairs 2000] [--scenario NAME ...]

For every shipped scenario and pool, draws ``--pairs`` pairs of batches (base, more) where
``more`` holds at least the work of ``base``, aimed at the cases that broke before:

* ``add``: a request added (often a tiny one beside a long prefill);
* ``grow_scheduled`` / ``grow_cached``: one request's scheduled or cached tokens grow;
* ``threshold``: a request at the decode threshold gains one token (decode → prefill);
* ``past_budget``: the same moves on batches beyond the scheduler's token budget.

and prices both sides with one ``price_many`` call each. Prints, per scenario, the pairs
checked and the violations of ``expected_s(more) ≥ expected_s(base)`` (relative slack
1e-12) by move, with the worst one; and the same count for the reference edges, which keep
the spec's non-monotone rules on purpose (reported, not a failure).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

MOVES = ("add", "grow_scheduled", "grow_cached", "threshold")


def draw_pairs(rng, n_pairs: int, width: int, budget: int, thr_choices=(1, 1, 4)):
    """``(base_s, base_c, more_s, more_c, thr, move)`` arrays of shape (pairs, width)."""
    bs = np.zeros((n_pairs, width), np.int64)
    bc = np.zeros((n_pairs, width), np.int64)
    thr = rng.choice(thr_choices, n_pairs)
    moves = rng.integers(0, len(MOVES), n_pairs)
    past = rng.random(n_pairs) < 0.25
    for i in range(n_pairs):
        n = rng.integers(1, width)                         # leave a free slot for "add"
        kinds = rng.choice(["decode", "decode", "prefill", "long", "edge"], n)
        for j, kind in enumerate(kinds):
            if kind == "decode":
                bs[i, j] = rng.integers(1, thr[i] + 1)
            elif kind == "prefill":
                bs[i, j] = rng.integers(thr[i] + 1, 3000)
            elif kind == "long":
                bs[i, j] = rng.integers(8000, 40000) if past[i] else rng.integers(2000, 12000)
            else:
                bs[i, j] = thr[i]                          # at the decode threshold
            bc[i, j] = rng.choice([0, rng.integers(0, 4096), rng.integers(0, 60000)])
        if past[i] and bs[i].sum() <= budget:
            bs[i, 0] += budget - bs[i].sum() + rng.integers(1, 4096)
    ms, mc = bs.copy(), bc.copy()
    for i in range(n_pairs):
        n = int((bs[i] > 0).sum())
        j = rng.integers(0, n)
        m = MOVES[moves[i]]
        if m == "add":
            ms[i, n] = rng.choice([1, 1, 2, rng.integers(1, 64)])
            mc[i, n] = rng.choice([0, rng.integers(0, 30000)])
        elif m == "grow_scheduled":
            ms[i, j] += rng.choice([1, rng.integers(1, 2000)])
        elif m == "grow_cached":
            mc[i, j] += rng.choice([1, rng.integers(1, 20000)])
        else:
            at = np.nonzero(bs[i, :n] == thr[i])[0]
            j = at[0] if at.size else j
            bs[i, j] = thr[i]
            ms[i, j] = thr[i] + 1
    return bs, bc, ms, mc, thr, moves


def check(kernel, rng, n_pairs: int):
    width = 16
    budget = kernel.settings.max_num_batched_tokens
    bs, bc, ms, mc, thr, moves = draw_pairs(rng, n_pairs, width, budget)
    a = kernel.price_many(scheduled=bs, computed=bc, decode_threshold=thr)
    b = kernel.price_many(scheduled=ms, computed=mc, decode_threshold=thr)
    bad = b.expected_s < a.expected_s * (1 - 1e-12)
    edge_bad = (b.no_overlap_s < a.no_overlap_s * (1 - 1e-12)) | \
        (b.overlap_s < a.overlap_s * (1 - 1e-12))
    by_move = {m: int(bad[moves == i].sum()) for i, m in enumerate(MOVES)}
    worst = None
    if bad.any():
        drop = np.where(bad, (a.expected_s - b.expected_s) / a.expected_s, 0.0)
        i = int(np.argmax(drop))
        fmt = lambda s, c: ",".join(f"1x{x}@{y}" for x, y in zip(s, c) if x > 0)  # noqa: E731
        worst = (f"{MOVES[moves[i]]} thr {thr[i]}: {fmt(bs[i], bc[i])} {a.expected_s[i]:.6g} s"
                 f" → {fmt(ms[i], mc[i])} {b.expected_s[i]:.6g} s (−{drop[i]:.2%})")
    return int(bad.sum()), by_move, int(edge_bad.sum()), worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenario", nargs="*", default=None)
    args = ap.parse_args(argv)
    import jkernel
    from jkernel import catalog

    names = args.scenario or catalog.list_scenarios()
    rng = np.random.default_rng(args.seed)
    total = total_bad = 0
    t0 = time.perf_counter()
    print(f"{'scenario/pool':<58}{'pairs':>7}{'expected↓':>10}{'edges↓':>8}  by move")
    for name in names:
        inputs = jkernel.open_inputs(name)
        for i, pool in enumerate(inputs.deployment.pools):
            k = jkernel.open_pool(name, i)
            n_bad, by_move, edge_bad, worst = check(k, rng, args.pairs)
            total += args.pairs
            total_bad += n_bad
            moves = " ".join(f"{m}={v}" for m, v in by_move.items() if v)
            print(f"{name + '/' + (pool.role or str(i)):<58}{args.pairs:>7}{n_bad:>10}"
                  f"{edge_bad:>8}  {moves}", flush=True)
            if worst:
                print(f"    worst: {worst}")
    print(f"{total} pairs, {total_bad} violations of expected_s monotonicity "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
