"""Closed-loop clients, rate caps, multi-turn sessions and the warm-up/cool-down window of
the replay (jkernel.replay.clients and the simulation's completion hook)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel.replay import Clients, Window, replay
from jkernel.replay.clients import ClientLoop


@lru_cache(maxsize=None)
def qwen() -> jkernel.Kernel:
    return jkernel.open("qwen3-14b-h100-tp1")


def hand_built(n: int, seed: int = 0, arrival=0.0) -> pd.DataFrame:
    """A hand-built workload: n requests of 200–800 prompt and 16–64 answer tokens."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"request_id": np.arange(n), "arrival_s": arrival,
                         "input_tokens": rng.integers(200, 800, n),
                         "output_tokens": rng.integers(16, 64, n)})


def in_flight(r: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight (sent, not finished) after every instant something happened."""
    t = np.unique(np.concatenate([r.arrival_s, r.finish_s]))
    sent, fin = np.sort(r.arrival_s.to_numpy()), np.sort(r.finish_s.to_numpy())
    return t, np.searchsorted(sent, t, "right") - np.searchsorted(fin, t, "right")


def littles_law(r: pd.DataFrame, think_s: float = 0.0) -> tuple[float, float]:
    """Throughput X (completions per second) and response time R (mean E2E) of the requests
    finishing while every client is busy (from the first to the last send)."""
    t0, t1 = r.arrival_s.min(), r.arrival_s.max()
    inside = (r.finish_s > t0) & (r.finish_s <= t1)
    return inside.sum() / (t1 - t0), float(r.e2e_s[inside].mean()) + think_s


@pytest.mark.parametrize("n_clients", [1, 8])
def test_closed_loop_holds_exactly_n_requests_in_flight_and_follows_littles_law(n_clients):
    reqs = hand_built(240)
    res = replay(qwen(), reqs, clients=Clients(concurrency=n_clients))
    r = res.requests
    assert res.summary["completed"] == 240 and (r.scheduled_s == 0).all()
    t, count = in_flight(r)
    busy = (t >= r.arrival_s.min()) & (t < r.arrival_s.max())
    assert count.max() == n_clients
    assert set(count[busy]) == {n_clients}                 # never fewer while work is left
    x, resp = littles_law(r)
    assert x * resp == pytest.approx(n_clients, rel=0.03)   # N = X·R
    # the clients send in table order, each request as its predecessor-but-N finishes
    order = r.sort_values("arrival_s", kind="stable").request_id.to_numpy()
    assert (order == np.arange(240)).all()


def test_think_time_keeps_clients_out_of_flight_and_littles_law_counts_it():
    reqs = hand_built(200, seed=1)
    think = 0.25
    res = replay(qwen(), reqs, clients=Clients(concurrency=6, think_time_s=think))
    r = res.requests
    t, count = in_flight(r)
    assert count.max() <= 6 and count.min() >= 0
    x, resp = littles_law(r, think)
    assert x * resp == pytest.approx(6, rel=0.05)          # N = X·(R + Z)
    # each client's next send is exactly think_time after one of the completions
    sends = np.sort(r.arrival_s.to_numpy())[6:]
    fins = r.finish_s.to_numpy()
    assert all(np.min(np.abs(fins + think - s)) < 1e-6 for s in sends)


def test_a_rate_cap_is_the_schedule_and_concurrency_caps_it():
    """vLLM's --max-concurrency with --request-rate: requests go in schedule order, none
    before its time, at most N at once; at a low rate the cap never binds and the replay is
    the open-loop one."""
    rng = np.random.default_rng(2)
    arr = np.cumsum(rng.exponential(1 / 3.0, 150))
    reqs = hand_built(150, seed=2, arrival=arr)
    open_loop = replay(qwen(), reqs)
    loose = replay(qwen(), reqs, clients=Clients(concurrency=1000))
    assert np.allclose(loose.requests.arrival_s, open_loop.requests.arrival_s, atol=1e-6)
    assert np.allclose(loose.requests.e2e_s, open_loop.requests.e2e_s, atol=1e-6)
    tight = replay(qwen(), reqs, clients=Clients(concurrency=2)).requests
    assert (tight.arrival_s >= tight.scheduled_s - 1e-6).all()    # whole microseconds
    assert (np.diff(tight.arrival_s) >= -1e-9).all()                 # schedule order
    assert in_flight(tight)[1].max() == 2
    assert (tight.arrival_s > tight.scheduled_s + 1e-3).any()       # the cap bound


def test_sessions_send_each_turn_after_the_previous_and_reuse_its_context():
    """Multi-turn: turn k+1 is sent when turn k has finished plus its think time, and its
    prompt (the conversation so far) hits the cache for turn k's prompt and answer."""
    rows = []
    for s in range(4):
        prompt = 300
        for turn in range(3):
            rows.append((f"s{s}t{turn}", 0.5 * s, prompt, 40, f"s{s}", 0.0 if turn == 0 else 1.5))
            prompt += 40 + 120
    reqs = pd.DataFrame(rows, columns=["request_id", "arrival_s", "input_tokens",
                                       "output_tokens", "session_id", "think_s"])
    r = replay(qwen(), reqs).requests.set_index("request_id")
    block = qwen().settings.block_size
    for s in range(4):
        for turn in (1, 2):
            prev, cur = r.loc[f"s{s}t{turn - 1}"], r.loc[f"s{s}t{turn}"]
            assert cur.arrival_s == pytest.approx(prev.finish_s + 1.5, abs=1e-6)
            reusable = (prev.input_tokens + prev.output_tokens - 1) // block * block
            assert cur.cached_tokens == reusable
        assert r.loc[f"s{s}t0"].arrival_s == pytest.approx(0.5 * s)
        assert r.loc[f"s{s}t0"].cached_tokens == 0


def test_a_session_under_closed_loop_clients_keeps_its_client():
    """Two clients, three sessions of two turns: a client finishes its session before it
    takes the next, so the third session starts only when a whole session has ended."""
    rows = [(f"{s}-{t}", 0.0, 200 + t * 300, 30, s) for s in "abc" for t in range(2)]
    reqs = pd.DataFrame(rows, columns=["request_id", "arrival_s", "input_tokens",
                                       "output_tokens", "session_id"])
    r = replay(qwen(), reqs, clients=Clients(concurrency=2)).requests.set_index("request_id")
    assert r.loc["a-1"].arrival_s == pytest.approx(r.loc["a-0"].finish_s, abs=1e-6)
    assert r.loc["c-0"].arrival_s == pytest.approx(
        min(r.loc["a-1"].finish_s, r.loc["b-1"].finish_s), abs=1e-6)


def test_client_loop_orders_sessions_by_schedule_and_caps_the_start():
    loop = ClientLoop([5, 0, 9, 0], [0, 1, 0, 2], [0, 0, 7, 0], Clients(concurrency=2))
    assert loop.start() == [(1, 0), (3, 0)]           # sessions by first schedule
    assert loop.finished(1, 100) == [(0, 100)]        # client of session 1 takes session 0
    assert loop.finished(0, 200) == [(2, 207)]        # its next turn after think 7
    assert loop.finished(3, 300) == []                 # nothing left to take
    open_loop = ClientLoop([5, 0, 9, 0], [0, 1, 0, 2], [0, 0, 7, 0], Clients())
    assert sorted(open_loop.start()) == [(0, 5), (1, 0), (3, 0)]
    assert open_loop.finished(0, 1) == [(2, 9)]       # never before its own schedule


def test_window_drops_warmup_and_cooldown_as_guidellm_does():
    sent = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    fin = np.array([9.0, 1.5, 2.5, 3.5, 4.5, 5.5])
    # by count: the first / last to complete
    assert Window(warmup_requests=2).measured(sent, fin).tolist() == [
        True, False, False, True, True, True]
    assert Window(cooldown_requests=1).measured(sent, fin).tolist() == [
        False, True, True, True, True, True]
    assert Window(warmup_fraction=0.5).measured(sent, fin).sum() == 3
    # by time: sent within the first / last seconds
    assert Window(warmup_s=1.0, cooldown_s=1.0).measured(sent, fin).tolist() == [
        False, False, True, True, True, False]
    assert Window.parse("10%", "3s") == Window(warmup_fraction=0.1, cooldown_s=3.0)
    assert Window.parse("5") == Window(warmup_requests=5)


def test_windowed_summary_counts_only_the_measured_requests():
    reqs = hand_built(120, seed=3)
    full = replay(qwen(), reqs, clients=Clients(concurrency=4))
    cut = replay(qwen(), reqs, clients=Clients(concurrency=4),
                 window=Window(warmup_requests=10, cooldown_requests=10))
    r = cut.requests
    assert r.measured.sum() == 100 and cut.summary["completed"] == 100
    assert np.allclose(full.requests.e2e_s, r.e2e_s)                 # same replay
    assert cut.summary["e2e_mean_s"] == pytest.approx(r.e2e_s[r.measured].mean())
    gaps = np.concatenate([g for g, m in zip(cut.token_gaps_s, r.measured) if m])
    assert np.array_equal(np.sort(cut.itl_gaps_s), np.sort(gaps))


def test_warm_up_requests_are_replayed_and_never_counted():
    """A ``warm_up`` column (LMBench's warm-up round, vLLM's --num-warmups): the warm-up
    runs first, so the run's prompts find what it cached, and the summary counts the run
    alone; with a window as well, both leave requests out."""
    reqs = hand_built(12, seed=5)
    reqs["arrival_s"] = np.arange(12) * 2.0
    reqs["prefix_group"] = np.arange(12) % 4
    reqs["prefix_length"] = reqs["input_tokens"] - 8
    reqs["warm_up"] = ["true"] * 4 + ["False"] * 8
    res = replay(qwen(), reqs)
    r = res.requests
    assert r.measured.tolist() == [False] * 4 + [True] * 8
    assert res.summary["completed"] == 8
    assert res.summary["ttft_mean_s"] == pytest.approx(r.ttft_s[4:].mean())
    assert (r.cached_tokens[4:] > 0).all() and (r.cached_tokens[:4] == 0).all()
    cut = replay(qwen(), reqs, window=Window(cooldown_requests=2))
    assert cut.requests.measured.sum() == 6 and cut.summary["completed"] == 6
    reqs.loc[2, "warm_up"] = "maybe"
    with pytest.raises(ValueError, match="'warm_up' at row 2"):
        replay(qwen(), reqs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(concurrency=-1), "concurrency"), (dict(concurrency=2.5), "concurrency"),
    (dict(concurrency=2, think_time_s=-1.0), "think_time_s"),
    (dict(think_time_s=1.0), "closed-loop"),
])
def test_bad_clients_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Clients(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(warmup_requests=2, warmup_s=1.0), "one way"),
    (dict(cooldown_fraction=1.0), "cooldown_fraction"),
    (dict(warmup_s=-1.0), "warmup_s"),
])
def test_bad_windows_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Window(**kwargs)
    with pytest.raises(ValueError, match="allowed: N"):
        Window.parse("ten")


def test_bad_session_columns_name_the_row():
    reqs = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.0],
                         "input_tokens": [100, 120], "output_tokens": [50, 5],
                         "session_id": ["a", "a"]})
    with pytest.raises(ValueError, match="row 1 is a later turn of session 'a'"):
        replay(qwen(), reqs)
    reqs["input_tokens"] = [100, 200]
    reqs["think_s"] = [0.0, -2.0]
    with pytest.raises(ValueError, match="'think_s' must be seconds ≥ 0; row 1"):
        replay(qwen(), reqs)


def test_closed_loop_clients_drive_a_disaggregated_pair():
    pre = jkernel.open_pool("llama-3.1-70b-h200-disagg", "prefill")
    dec = jkernel.open_pool("llama-3.1-70b-h200-disagg", "decode")
    from jkernel.replay import replay_disaggregated

    r = replay_disaggregated(pre, dec, hand_built(60, seed=4),
                             clients=Clients(concurrency=5)).requests
    t, count = in_flight(r)
    assert r.finish_s.notna().all() and count.max() == 5
    assert set(count[(t >= r.arrival_s.min()) & (t < r.arrival_s.max())]) == {5}
