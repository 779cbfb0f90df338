"""The pure laws against vectors.md §1, run eagerly and under jit, with finite gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkernel import laws

jax.config.update("jax_enable_x64", True)

MODES = {"eager": lambda f: f, "jit": jax.jit}


@pytest.fixture(params=list(MODES))
def run(request):
    """Call a law eagerly or jitted (static ints stay Python ints via closures)."""
    wrap = MODES[request.param]
    return lambda fn, *args: wrap(lambda *a: fn(*a))(*args)


@pytest.mark.parametrize("eps,mh,r512,r32", [(0.890, 102, 0.7421, 0.2125),
                                             (0.788, 94, 0.6658, 0.2001),
                                             (0.640, 110, 0.5268, 0.1442)])
def test_ramp_pins(run, eps, mh, r512, r32):
    """vectors.md §1.1."""
    assert float(run(laws.ramp, 512.0, eps, mh)) == pytest.approx(r512, abs=5e-5)
    assert float(run(laws.ramp, 32.0, eps, mh)) == pytest.approx(r32, abs=5e-5)
    assert float(run(laws.ramp, float(mh), eps, mh)) == eps / 2


def test_ramp_edges(run):
    assert float(run(laws.ramp, 0.0, 0.9, 100.0)) == 0.0
    assert float(run(laws.ramp, 50.0, 0.9, 0.0)) == 0.9
    assert float(run(laws.ramp, 50.0, 0.0, 100.0)) == 0.0


@pytest.mark.parametrize("fn,g,p,want", [
    (laws.ring_span, 16, 8, 1.533333), (laws.flat_span, 16, 8, 9.0),
    (laws.a2a_span, 16, 8, 5.266667), (laws.a2a_span, 72, 8, 8.211268),
    (laws.ring_span, 12, 8, 9.0), (laws.ring_span, 1, 8, 1.0), (laws.a2a_span, 1, 8, 1.0)])
def test_span_pins(run, fn, g, p, want):
    """vectors.md §1.2 (r = 9)."""
    assert float(run(lambda r: fn(g, p, r), 9.0)) == pytest.approx(want, abs=1e-6)


def test_span_ratio_rules(run):
    assert float(run(lambda r: laws.a2a_span(16, 8, r), 9.0) /
                 run(lambda r: laws.ring_span(16, 8, r), 9.0)) == pytest.approx(3.434783, 1e-6)
    for r in (1.0, 0.5, float("inf")):
        assert float(run(lambda x: laws.a2a_span(16, 8, x), r)) == 1.0


def test_collective_law_pins(run):
    """vectors.md §1.3: h200 all-reduce fp16 8-rank coefficients."""
    t0, peak, tr = 15.98e-6, 131566e6, 92500e6
    law = lambda b: laws.collective_time(b, t0, peak, tr)  # noqa: E731
    assert float(run(law, 0.0)) == t0
    assert 1.0 < float(run(law, 256.0)) / t0 < 1.0002
    assert float(run(law, 1048576.0)) * 1e6 == pytest.approx(15.98 + 1048576 / 92500, 1e-12)
    assert float(run(lambda b: laws.collective_time(b, t0, 0.0, tr), 1.0)) == np.inf
    assert float(run(lambda b: laws.collective_time(b, t0, peak, 0.0), 1e9)) == \
        pytest.approx(max(t0, 1e9 / peak))


def test_floor_rate_law(run):
    assert float(run(lambda b: laws.floor_rate_time(b, 1e-6, 0.0), 1.0)) == np.inf
    assert float(run(lambda b: laws.floor_rate_time(b, 1e-6, 0.0), 0.0)) == 1e-6
    assert float(run(lambda b: laws.floor_rate_time(b, 1e-6, 1e9), 1e9)) == 1.0


@pytest.mark.parametrize("s,p,d,want", [(17, 8, 2, 17), (16, 8, 2, 2), (16, 8, 1, 2),
                                        (100, 1, 1, -1), (0, 8, 1, -1)])
def test_pcp_local_tokens(run, s, p, d, want):
    """vectors.md §1.4."""
    assert float(run(lambda x: laws.pcp_local_tokens(x, p, d), float(s))) == want


@pytest.mark.parametrize("s,c,p,ratio,local", [(4096, 0, 8, 1.0, 512), (1001, 0, 8, 1.014035, 126),
                                               (1001, 8192, 4, 1.007398, 252),
                                               (100, 0, 8, 1.2544, 14)])
def test_pcp_causal_pairs(run, s, c, p, ratio, local):
    got = float(run(lambda a, b: laws.pcp_causal_pairs(a, b, p, 1), float(s), float(c)))
    assert got / (4 * (s * c + s * s / 2) / p) == pytest.approx(ratio, abs=1e-6)
    assert float(run(lambda a: laws.pcp_local_tokens(a, p, 1), float(s))) == local


@pytest.mark.parametrize("s,c,w,want", [(1024, 131072, 2176, 8912896), (1024, 0, 2176, 2097152),
                                        (1024, 1000, 2176, 6193152), (4096, 0, 2176, 26181632),
                                        (1000, 50, 10 ** 9, 2200000), (1000, 50, 0, 0)])
def test_windowed_causal_flops(run, s, c, w, want):
    """vectors.md §1.5."""
    got = run(lambda a, b: laws.windowed_causal_flops(a, b, w),
              jnp.array([float(s)]), jnp.array([float(c)]))
    assert float(got) == want


@pytest.mark.parametrize("L,d,i,want", [(1000, 8, 32, 128), (100, 8, 64, 64), (1000, 8, 1, 125),
                                        (4096, 4, 0, 1024)])
def test_dcp_local(run, L, d, i, want):
    """vectors.md §1.6."""
    assert float(run(lambda x: laws.dcp_local(x, d, i), float(L))) == want


def test_dcp_local_per_request_against_batch_total(run):
    per = run(lambda x: jnp.sum(laws.dcp_local(x, 3, 1)), jnp.full(4, 1000.0))
    assert float(per) == 1336
    assert float(run(lambda x: laws.dcp_local(x, 3, 1), 4000.0)) == 1334
    assert float(run(lambda x: jnp.sum(laws.dcp_local(x, 4, 1)), jnp.full(8, 1001.0))) == 2008


def test_sparse_read(run):
    """vectors.md §1.7."""
    assert float(run(lambda x: jnp.sum(laws.sparse_read(x, 1024, 4)), jnp.full(4, 1024.0))) == 4096
    assert float(run(lambda x: laws.sparse_read(x, 1024, 4), 4096.0)) == 1792
    assert float(run(lambda x: laws.sparse_read(x, 128, 128), 65536.0)) == 639


@pytest.mark.parametrize("t,e,k,loc,want", [(1, 224, 8, 14, 0.5), (4, 224, 8, 14, 1.895385),
                                            (128, 224, 8, 14, 13.866813),
                                            (256, 224, 8, 14, 13.998733),
                                            (32, 256, 8, 256, 163.313846), (0, 256, 8, 256, 0.0),
                                            (5, 8, 8, 4, 4.0)])
def test_experts_touched(run, t, e, k, loc, want):
    """vectors.md §1.8."""
    assert float(run(lambda x: laws.experts_touched(x, e, k, loc), float(t))) == \
        pytest.approx(want, abs=1e-6)


def test_round_half_up_is_not_bankers():
    assert float(laws.round_half_up(2.5)) == 3 and float(laws.round_half_up(3.5)) == 4


def test_zero_work_costs_zero_even_at_zero_rate():
    """Decision D5: 0/0 = 0, positive/0 = +inf."""
    assert float(laws.safe_div(0.0, 0.0)) == 0.0
    assert float(laws.safe_div(1.0, 0.0)) == np.inf


def test_gradients_finite_at_edges():
    """Gradient safety: the branch not taken never leaks a NaN (0 tokens, zero rates)."""
    g = jax.grad(lambda eps, mh: laws.ramp(0.0, eps, mh) + laws.ramp(10.0, eps, mh),
                 argnums=(0, 1))(0.9, 100.0)
    assert all(np.isfinite(x) for x in g)
    g = jax.grad(lambda r: laws.collective_time(0.0, 1e-5, r, r) +
                 laws.safe_div(0.0, r))(0.0)
    assert np.isfinite(g)
    g = jax.grad(lambda t: jnp.sum(laws.experts_touched(t, 256, 8, 256)))(jnp.array([0.0, 3.0]))
    assert np.all(np.isfinite(g))


def test_smooth_max_tends_to_max():
    v = jnp.array([1.0, 2.0, 3.0])
    assert float(laws.smooth_max(v, 0.0)) == 3.0
    assert float(laws.smooth_max(v, 1e-3)) == pytest.approx(3.0, abs=1e-6)
    assert float(laws.smooth_max(v, 1.0)) > 3.0


# -- expected_s's shape-aware decode attention and fused-MoE laws -------------------------

def test_p_norm_between_sum_and_max(run):
    assert float(run(laws.p_norm, 3.0, 4.0, 1.0)) == pytest.approx(7.0)
    assert float(run(laws.p_norm, 3.0, 4.0, 2.0)) == pytest.approx(5.0)
    assert float(run(laws.p_norm, 3.0, 4.0, 1e3)) == pytest.approx(4.0, rel=1e-3)
    assert float(run(laws.p_norm, 3.0, 4.0, 0.5)) == pytest.approx(7.0)   # below 1 counts as 1
    assert float(run(laws.p_norm, 0.0, 0.0, 2.0)) == 0.0
    # a large order on large times does not overflow
    assert float(run(laws.p_norm, 1e-3, 2e-3, 64.0)) == pytest.approx(2e-3, rel=1e-12)


def test_decode_attention_time_is_the_spec_law_without_a_row_floor(run):
    """With no row floor the law is step.md §6.3's floor + bytes/rate, whatever the order."""
    for order in (1.0, 3.0):
        got = run(lambda b, n: laws.decode_attention_time(b, n, 1e-5, 2e12, 0.0, order),
                  4e8, 2048.0)
        assert float(got) == pytest.approx(float(laws.floor_plus_rate(4e8, 1e-5, 2e12)))
    # positive bytes at a zero rate: +inf (D5); zero bytes: the floor
    assert float(laws.decode_attention_time(1.0, 1.0, 1e-5, 0.0)) == np.inf
    assert float(laws.decode_attention_time(0.0, 0.0, 1e-5, 2e12, 2e-8, 2.0)) == 1e-5


def test_decode_attention_time_rows_and_bytes(run):
    """The row term: rows of one-token contexts cost their rows, a long read its bytes, in
    between the p-norm of the two; more KV heads at the same bytes cost more rows, never a
    rate above the fitted one."""
    f, r, c, p = 1e-5, 3e12, 2.5e-8, 1.4
    law = lambda b, n: laws.decode_attention_time(b, n, f, r, c, p)  # noqa: E731
    short = float(run(law, 16e6, 16384.0))            # 2,048 requests × 8 heads, tiny reads
    assert short == pytest.approx(f + float(laws.p_norm(16e6 / r, 16384 * c, p)))
    assert short > f + 16384 * c                      # the rows, not the 5 µs of bytes
    long = float(run(law, 2e9, 512.0))                # 667 µs of bytes hide 13 µs of rows
    assert f + 2e9 / r < long < (f + 2e9 / r) * 1.005
    # the same bytes over more heads (32 instead of 8): more rows, never faster
    assert float(run(law, 1e9, 82 * 32.0)) >= float(run(law, 1e9, 82 * 8.0))
    # monotone in bytes and rows
    grid = np.array([[float(law(b, n)) for n in (1.0, 64.0, 4096.0)] for b in (0.0, 1e7, 1e9)])
    assert np.all(np.diff(grid, axis=0) >= 0) and np.all(np.diff(grid, axis=1) >= 0)


def test_routed_expert_time_neutral_and_parts(run):
    """At floor = m½ = c_a = 0 the fused-MoE law is max(compute at the given efficiency,
    memory); each constant adds its part."""
    F, B, P, bw = 2e12, 5e8, 1e15, 3e12
    base = run(lambda x: laws.routed_expert_time(x, B, 1024.0, 64.0, P, bw,
                                                 token_efficiency=0.5), F)
    assert float(base) == pytest.approx(max(F / (P * 0.5), B / bw))
    # per-expert ramp: 16 rows per expert at m½ = 48 runs at 1/4 of the peak
    ramp = run(lambda x: laws.routed_expert_time(x, 0.0, 1024.0, 64.0, P, bw, 0.0, 48.0), F)
    assert float(ramp) == pytest.approx(F / (P * 0.25))
    full = run(lambda x: laws.routed_expert_time(x, B, 1024.0, 64.0, P, bw, 3e-5, 48.0, 1e-8),
               F)
    assert float(full) == pytest.approx(3e-5 + max(F / (P * 0.25), B / bw) + 1024 * 1e-8)
    # no routed work, no time (not even the floor)
    assert float(laws.routed_expert_time(0.0, 0.0, 0.0, 0.0, P, bw, 3e-5, 48.0, 1e-8)) == 0.0


def test_routed_expert_time_monotone_in_tokens():
    """Priced over the step's tokens with the step's own work laws, the fused-MoE law never
    falls when a token is added (the touched experts, their rows and the FLOPs all grow)."""
    t = jnp.arange(0.0, 600.0)
    flops, nbytes = laws.routed_expert_work(t, 8, 1.0, 2 * 3 * 2048 * 768, 1.0, 1.0, 128,
                                            128, 3 * 2048 * 768 * 2.0, 1)
    touched = laws.experts_touched(laws.round_half_up(t), 128, 8, 128)
    s = laws.routed_expert_time(flops, nbytes, t * 8, touched, 989e12, 2.8e12, 3e-5, 330.0,
                                9e-9)
    assert np.all(np.diff(np.asarray(s)) >= -1e-15)


def test_new_laws_gradients_finite_at_edges():
    g = jax.grad(lambda c, p: laws.decode_attention_time(0.0, 0.0, 1e-5, 2e12, c, p),
                 argnums=(0, 1))(2e-8, 2.0)
    assert all(np.isfinite(x) for x in g)
    g = jax.grad(lambda c, p: laws.decode_attention_time(1e8, 64.0, 1e-5, 2e12, c, p),
                 argnums=(0, 1))(0.0, 2.0)
    assert all(np.isfinite(x) for x in g)
    g = jax.grad(lambda m, f, a: laws.routed_expert_time(0.0, 0.0, 0.0, 0.0, 1e15, 3e12, f, m,
                                                         a), argnums=(0, 1, 2))(48.0, 3e-5, 1e-8)
    assert all(np.isfinite(x) for x in g)
    g = jax.grad(lambda m: laws.routed_expert_time(1e9, 1e6, 16.0, 4.0, 1e15, 3e12, 3e-5, m))(
        48.0)
    assert np.isfinite(g)
