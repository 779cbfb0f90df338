"""Decode and prefill attention laws from AIConfigurator's attention tables.

**Decode** (``generation_attention_perf``; one new token per request). A row of ``batch``
requests attending over ``ctx`` tokens reads ``T·bpt`` KV bytes, with ``T = batch·ctx``
(``batch·min(ctx, window)`` for a sliding window, Decision D3) and
``bpt = 2·n_kv·d_h·kv_bytes`` per token, exactly the byte count of step.md §6.3, over
``rows = batch·n_kv`` (request, KV head) rows. The law is
:func:`jkernel.laws.decode_attention_time`::

    t = floor_kind + ‖(T·bpt / rate_kind, rows·c_row)‖_p

* ``floor_kind`` / ``rate_kind`` per kind: rows without a window give the part-wide pair
  ``attention_decode_floor`` / ``attention_decode_rate``; rows with a window (the tables
  hold windows of 128 to 8192) give ``attention_decode_floor_swa`` /
  ``attention_decode_rate_swa``;
* ``c_row`` (``attention_decode_row_floor``) and ``p`` (``attention_decode_overlap``),
  shared by the kinds: the least time one (request, KV head) row costs and how much of it
  the stream hides. Without them (``c_row = 0``) the law is step.md §6.3's
  ``floor + bytes/rate``: one rate for every shape fitted over rows whose cost is the rows,
  not the bytes (a batch of 2,048 one-token contexts costs 440 µs on H100, its bytes
  5 µs), which drags the rate of a large read far below what the kernel streams (H100: a
  2.4 TB/s fit against 2.9–3.2 TB/s measured above 200 MB) and cannot tell how a deployment
  with more KV heads per GPU than the tables hold (Llama-2-7b: 32) behaves. With the row
  term the rate is the large read's, bounded by the chip's bandwidth, and more heads cost
  more rows, not another rate.

**Which rows.** Only the kernel vLLM runs on the chip (:data:`DECODE_KERNELS`; the tables
also time FA4 on Hopper, FlashInfer and Triton on Ada and Blackwell, each with its own
speed), and only the KV-cache dtype a deployment uses by default, the model's (bf16): an
fp8 cache is read by other code at a lower byte rate (on H100 an fp8 row takes 0.65–0.7 of
its bf16 twin's time, not 0.5; on d = 256 no less), which one rate per kind cannot hold.
fp8-KV rows and the other kernels are reported as slices, not fitted.

The tables' calls repeat on the same cache, so a read that fits in the chip's L2 (50 MB on
H100, 96 MB on L40S) is served from it, faster than a serving step (whose layers' weights
pass through L2 between two reads of a layer's cache) would see; the error table's
slices by bytes show where (L40S: reads of 20–200 MB run up to 5× faster than its
bandwidth allows).

**Prefill** (``context_attention_perf``; causal, no cached prefix). A row of ``batch``
prompts of ``isl`` tokens does ``attn_work = batch·causal_pairs(isl, 0)·n_q·d_h`` FLOPs
(step.md §6.3 with tp = 1, ``n_q`` being the heads on the GPU) and is predicted by
:func:`jkernel.laws.prefill_attention_time`::

    t = f_p + attn_work / (P_bf16 · ramp(batch·isl) · w_p)

with the chip's bf16 peak and the bf16 token ramp the chip ships (the GEMM fit's ε_max, m½;
the step prices prefill attention through the plain ramp even when the shape-aware one is
on). Only rows of vLLM's prefill kernel with a bf16 cache (:data:`PREFILL_KERNELS`) without a
window are fitted: the registry has one prefill pair for every kind, and windowed rows, whose FLOPs the law counts with ``windowed_pairs``, want a work
scale about four times lower on every chip (they are reported as a separate slice).

Reference curves: the spec's reference pairs (documents.md §8.7), with the reference
ramp for prefill.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from jkernel import laws

from .base import (REFERENCE, ErrorRow, ErrorStats, Param, PrimitiveFit, Problem, columns,
                  plot_series, slices_table, solve)

__all__ = ["fit_decode_attention", "fit_prefill_attention", "prefill_work", "DECODE_KERNELS",
           "PREFILL_KERNELS", "DECODE_ROW_NAMES"]

KINDS = ("", "swa")

#: The decode kernel vLLM runs per chip (its attention backend choice, vLLM 0.15–0.31:
#: FlashAttention 3 on Hopper, FlashAttention 2 on Ampere and Ada, FlashInfer's TRT-LLM
#: decode kernels on data-centre Blackwell), by the tables' ``kernel_source``.
DECODE_KERNELS = {"h100": "vllm_flash_attn_fa3", "h200": "vllm_flash_attn_fa3",
                  "a100-sxm": "vllm_flash_attn", "l40s": "vllm_flash_attn_fa2",
                  "b200": "vllm_flashinfer_trtllmdecode",
                  "b300": "vllm_flashinfer_trtllmdecode"}
#: The prefill kernel vLLM runs per chip (the same backends; FlashInfer's TRT-LLM prefill
#: kernels on data-centre Blackwell), by the tables' ``kernel_source``.
PREFILL_KERNELS = {**DECODE_KERNELS, "b200": "vllm_flashinfer_trtllmprefill",
                   "b300": "vllm_flashinfer_trtllmprefill"}
#: The KV-cache dtype the fitted pairs describe (vLLM's default cache dtype is the model's).
DECODE_KV_DTYPE = "bf16"
#: The shape parameters of the decode law, shared by the kinds.
DECODE_ROW_NAMES = ("attention_decode_row_floor", "attention_decode_overlap")


def _suffix(kind: str) -> str:
    return f"_{kind}" if kind else ""


def _decode_predict(kinds, rows_term: bool = True):
    def predict(v, d):
        idx = d["kind_index"].astype(jnp.int32)
        floor = jnp.stack([v[f"attention_decode_floor{_suffix(k)}"] for k in kinds])[idx]
        rate = jnp.stack([v[f"attention_decode_rate{_suffix(k)}"] for k in kinds])[idx]
        if not rows_term:
            return laws.floor_plus_rate(d["kv_bytes"], floor, rate)
        return laws.decode_attention_time(d["kv_bytes"], d["rows"], floor, rate,
                                          v["attention_decode_row_floor"],
                                          v["attention_decode_overlap"])
    return predict


def _decode_rows(obs, kinds):
    kind = np.where(obs.window > 0, kinds.index("swa") if "swa" in kinds else -1, 0)
    return columns(obs, ("latency_s", "kv_bytes", "batch_size", "n_kv", "ctx_tokens"),
                   kind_index=kind, fp8_kv=(obs.kv_dtype == "fp8"),
                   rows=obs.batch_size.astype(np.float64) * obs.n_kv)


def _decode_params(kinds, chip_doc, rows_term: bool = True):
    params = []
    for k in kinds:
        params.append(Param(f"attention_decode_floor{_suffix(k)}", 12e-6, units="us_per_layer"))
        params.append(Param(f"attention_decode_rate{_suffix(k)}",
                            0.8 * chip_doc.hbm_tbs * 1e12, units="bytes_per_us"))
    if rows_term:
        params.append(Param("attention_decode_row_floor", 1e-8, units="us_per_request"))
        params.append(Param("attention_decode_overlap", 2.0, "logit", 1.0, 64.0))
    return tuple(params)


def fit_decode_attention(obs, chip_doc, *, chip: str, heldout: float = 0.2, seed: int = 0,
                         steps: int = 1500, lr: float = 0.05,
                         delta: float = 0.05) -> PrimitiveFit:
    """Fit the decode law of one chip (the module docstring): the floor/rate pairs
    (part-wide and, where the table has windowed rows, ``_swa``) and the shared row floor
    and overlap, from
    :class:`~jkernel.calibration.data.profiles.DecodeAttentionObservations`."""
    t0 = time.perf_counter()
    notes = []
    kernel = DECODE_KERNELS.get(chip)
    if kernel is not None and np.any(obs.kernel == kernel):
        others = sorted(set(obs.kernel[obs.kernel != kernel].tolist()) - {""})
        use = obs.kernel == kernel
        notes.append(f"fitted on vLLM's decode kernel on {chip}, {kernel}"
                     + (f"; not fitted (another kernel): {', '.join(others)} "
                        f"({int((~use).sum())} rows)" if others else ""))
    else:
        use = np.ones(len(obs), bool)
        notes.append(f"no decode kernel named for {chip}: every kernel of the table fitted")
    main = use & (obs.kv_dtype == DECODE_KV_DTYPE)
    if not np.any(main):
        raise ValueError(f"{obs.source}: no {DECODE_KV_DTYPE}-KV decode rows of the chip's "
                         "kernel")
    if np.any(use & ~main):
        notes.append(f"KV dtypes other than {DECODE_KV_DTYPE} not fitted (reported as "
                     f"slices): {int((use & ~main).sum())} rows")
    kinds = ("",) + (("swa",) if np.any(obs.window[main] > 0) else ())
    if not np.any(obs.window[main] == 0):
        raise ValueError(f"{obs.source}: no decode rows without a window; the part-wide pair "
                         "cannot be fitted")
    if "swa" not in kinds:
        notes.append("no windowed decode rows: no _swa pair fitted")
    held = obs.held_mask(heldout, seed)
    fit_obs, held_obs = obs.select(main & ~held), obs.select(main & held)
    params = _decode_params(kinds, chip_doc)
    prob = Problem(params, _decode_predict(kinds), _decode_rows(fit_obs, kinds),
                   _decode_rows(held_obs, kinds),
                   starts=[{"attention_decode_row_floor": 3e-8,
                            "attention_decode_overlap": 8.0}])
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    # the spec's law refitted on the same rows: the evidence for the row term
    plain = Problem(_decode_params(kinds, chip_doc, rows_term=False),
                    _decode_predict(kinds, rows_term=False), prob.fit_rows, prob.held_rows)
    plain_sol = solve(plain, steps=steps, lr=lr, delta=delta, uncertainty=False)
    variants = {"fitted": (prob, sol.values),
                "floor + bytes/rate refitted (step.md §6.3's law)": (plain, plain_sol.values)}
    ref = REFERENCE.get(chip, {})
    if ref.get("decode") is not None and ("swa" not in kinds or ref.get("swa") is not None):
        rv = {"attention_decode_floor": ref["decode"][0], "attention_decode_rate": ref["decode"][1]}
        if "swa" in kinds:
            rv["attention_decode_floor_swa"], rv["attention_decode_rate_swa"] = ref["swa"]
        variants["reference §8.7"] = (plain, rv)
    else:
        notes.append(f"the spec has no complete reference decode pairs for {chip}")
    slices = _decode_slices(prob, kinds)
    errors, preds = slices_table(prob, variants, slices, return_predictions=True)
    # the rows not fitted (other KV dtypes, other kernels) under the fitted law
    for label, mask in (("fp8 KV, vLLM's kernel (not fitted)",
                         use & (obs.kv_dtype == "fp8")),
                        ("other kernels (not fitted)", ~use)):
        if not np.any(mask):
            continue
        fo, ho = obs.select(mask & ~held), obs.select(mask & held)
        rf, rh = _decode_rows(fo, kinds), _decode_rows(ho, kinds)
        ok_f, ok_h = rf["kind_index"] >= 0, rh["kind_index"] >= 0
        rf = {k: v[ok_f] for k, v in rf.items()}
        rh = {k: v[ok_h] for k, v in rh.items()}
        for vlabel, (p, v) in variants.items():
            pf, ph = Problem(p.params, p.predict, rf, rh).evaluate_both(v)
            errors.append(ErrorRow(label, vlabel, ErrorStats.of(pf, rf["latency_s"]),
                                   ErrorStats.of(ph, rh["latency_s"])))
    written = {p.name: sol.values[p.name] for p in prob.params}
    entry_slice = {n: ("swa" if n.endswith("_swa") else "gqa") for n in written}
    for n in DECODE_ROW_NAMES:
        entry_slice[n] = "all fitted rows"
    plots = _decode_plots(_with_ctx(prob, fit_obs, held_obs), preds, fit_obs, held_obs, kinds)
    notes.append(f"row floor {sol.values['attention_decode_row_floor'] * 1e9:.2f} ns per "
                 f"(request, KV head), overlap order {sol.values['attention_decode_overlap']:.3g}"
                 f"; rate {sol.values['attention_decode_rate'] / 1e12:.3f} TB/s against "
                 f"{plain_sol.values['attention_decode_rate'] / 1e12:.3f} TB/s for the law "
                 f"without the row term, {chip_doc.hbm_tbs} TB/s nominal")
    return PrimitiveFit("decode_attention", chip, prob.params, sol.values, written, errors,
                        entry_slice, sol.laplace, str(obs.source), str(obs.sha256),
                        len(fit_obs), len(held_obs), dict(obs.skipped), notes,
                        time.perf_counter() - t0, plots)


def _decode_slices(prob, kinds) -> dict:
    """The error table's slices over the fitted rows: kind, shape and size."""
    f, h = prob.fit_rows, prob.held_rows
    both = lambda fn: (fn(f), fn(h))  # noqa: E731
    out = {"all fitted rows": both(lambda r: np.ones(len(r["latency_s"]), bool))}
    for j, k in enumerate(kinds):
        out[k or "gqa"] = both(lambda r, j=j: r["kind_index"] == j)
    out["batch ≤ 256"] = both(lambda r: r["batch_size"] <= 256)
    out["serving: batch ≤ 256, context ≥ 256"] = both(
        lambda r: (r["batch_size"] <= 256) & (r["ctx_tokens"] >= 256))
    out["batch ≥ 512, context ≤ 64"] = both(
        lambda r: (r["batch_size"] >= 512) & (r["ctx_tokens"] <= 64))
    for lo, hi, label in ((0, 2e7, "KV read < 20 MB"), (2e7, 2e8, "KV read 20–200 MB"),
                          (2e8, np.inf, "KV read ≥ 200 MB")):
        out[label] = both(lambda r, lo=lo, hi=hi: (r["kv_bytes"] >= lo) & (r["kv_bytes"] < hi))
    heads = sorted(set(np.concatenate([f["n_kv"], h["n_kv"]]).astype(int).tolist()))
    for n in heads:
        out[f"{n} KV heads"] = both(lambda r, n=n: r["n_kv"] == n)
    return out


def _decode_plots(prob, preds, fit_obs, held_obs, kinds):
    out = []
    both = [fit_obs, held_obs]
    for j, k in enumerate(kinds):
        combos = set()
        for o in both:
            sel = (o.window > 0) if k else (o.window == 0)
            combos |= set(zip(o.n_q[sel].tolist(), o.n_kv[sel].tolist(),
                              o.head_dim[sel].tolist(), o.kv_dtype[sel].tolist(),
                              o.window[sel].tolist()))
        combos = sorted(combos, key=lambda c: (c[3] != "bf16", abs(c[0] - 32) + abs(c[1] - 8),
                                               c[2] != 128, c[4]))
        if not combos:
            continue
        nq, nkv, d, kvd, w = combos[0]
        for b in (1, 64):
            mf, mh = [(o.n_q == nq) & (o.n_kv == nkv) & (o.head_dim == d) & (o.kv_dtype == kvd)
                      & (o.window == w) & (o.batch_size == b) for o in both]
            ps = plot_series(f"decode {k or 'gqa'}: {nq}/{nkv} heads, d {d}, {kvd} KV"
                             + (f", window {w}" if w else "") + f", batch {b}",
                             prob, preds, mf, mh, "ctx",
                             "context (tokens)")
            if ps is not None:
                out.append(ps)
    return out


def _with_ctx(prob, fit_obs, held_obs):
    """The problem's rows with a ``ctx`` column (for plots)."""
    return Problem(prob.params, prob.predict,
                   {**prob.fit_rows, "ctx": fit_obs.ctx_tokens.astype(float)},
                   {**prob.held_rows, "ctx": held_obs.ctx_tokens.astype(float)}, prob.fixed)


def prefill_work(obs) -> tuple[np.ndarray, np.ndarray]:
    """``(attn_work FLOPs, tokens)`` of prefill rows by the step's laws: per request
    ``4·Σ pairs`` (:func:`jkernel.laws.windowed_pairs` for a window, else
    :func:`jkernel.laws.causal_pairs` at prefix 0), times ``n_q·d_h`` and the batch."""
    s = obs.isl.astype(np.float64)
    w = obs.window.astype(np.float64)
    causal = np.asarray(laws.causal_pairs(s, 0.0))
    windowed = 4.0 * np.asarray(laws.windowed_pairs(s, 0.0, np.where(w > 0, w, 1.0)))
    pairs = np.where(w > 0, windowed, causal)
    work = obs.batch_size * pairs * obs.n_q * obs.head_dim
    return work.astype(np.float64), (obs.batch_size * obs.isl).astype(np.float64)


def _prefill_rows(obs):
    work, tokens = prefill_work(obs)
    return columns(obs, ("latency_s", "batch_size"), work=work, tokens=tokens)


def _prefill_predict(v, d):
    eff = laws.ramp(d["tokens"], v["ramp_eps_max"], v["ramp_m_half"])
    return laws.prefill_attention_time(d["work"], v["attention_prefill_floor"], v["peak"], eff,
                                       v["attention_prefill_work_scale"])


def fit_prefill_attention(obs, chip_doc, ramp: dict, *, chip: str, heldout: float = 0.2,
                          seed: int = 0, steps: int = 1500, lr: float = 0.05,
                          delta: float = 0.05) -> PrimitiveFit:
    """Fit ``attention_prefill_floor`` and ``attention_prefill_work_scale`` of one chip on the
    unwindowed rows of
    :class:`~jkernel.calibration.data.profiles.PrefillAttentionObservations`.

    ``ramp``: the bf16 ramp the chip ships, ``{"eps_max": ..., "m_half": ...}``.
    """
    t0 = time.perf_counter()
    notes = []
    kernel = PREFILL_KERNELS.get(chip)
    use = obs.kv_dtype == DECODE_KV_DTYPE
    if kernel is not None and np.any(use & (obs.kernel == kernel)):
        use &= obs.kernel == kernel
        notes.append(f"fitted on vLLM's prefill kernel on {chip}, {kernel}, with a "
                     f"{DECODE_KV_DTYPE} cache ({int((~use).sum())} rows of other kernels or "
                     "cache dtypes not fitted)")
    obs = obs.select(use)
    plain = obs.select(obs.window == 0)
    if len(plain) == 0:
        raise ValueError(f"{obs.source}: no prefill rows without a window")
    windowed = obs.select(obs.window > 0)
    fit_obs, held_obs = plain.split(heldout, seed)
    peak = chip_doc.bf16_peak_tflops * 1e12
    fixed = {"ramp_eps_max": ramp["eps_max"], "ramp_m_half": ramp["m_half"], "peak": peak}
    params = (Param("attention_prefill_floor", 18e-6, units="us_per_layer"),
              Param("attention_prefill_work_scale", 0.4))
    prob = Problem(params, _prefill_predict, _prefill_rows(fit_obs), _prefill_rows(held_obs),
                   fixed=fixed)
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    variants = {"fitted": (prob, sol.values)}
    ref = REFERENCE.get(chip, {})
    notes.append(f"priced through the bf16 ramp the chip ships (ε_max {ramp['eps_max']:.4g}, "
                 f"m½ {ramp['m_half']:.4g}) at the bf16 peak {peak / 1e12:.1f} TFLOP/s")
    if ref.get("prefill") is not None:
        e, m = ref["gemm"]["bf16"]
        rprob = Problem((), _prefill_predict, prob.fit_rows, prob.held_rows,
                        fixed={"ramp_eps_max": e, "ramp_m_half": m, "peak": peak})
        variants["reference §8.7"] = (rprob, {"attention_prefill_floor": ref["prefill"][0],
                                              "attention_prefill_work_scale": ref["prefill"][1]})
    fb = prob.fit_rows["batch_size"] <= 16
    hb = prob.held_rows["batch_size"] <= 16
    errors, preds = slices_table(prob, variants,
                                 {"unwindowed": (np.ones_like(fb), np.ones_like(hb)),
                                  "unwindowed, batch ≤ 16": (fb, hb)}, return_predictions=True)
    if len(windowed):
        wf, wh = windowed.split(heldout, seed)
        rf, rh = _prefill_rows(wf), _prefill_rows(wh)
        for label, (p, v) in variants.items():
            pf, ph = Problem(p.params, p.predict, rf, rh, p.fixed).evaluate_both(v)
            errors.append(ErrorRow("windowed (not fitted)", label,
                                   ErrorStats.of(pf, rf["latency_s"]),
                                   ErrorStats.of(ph, rh["latency_s"])))
        notes.append(f"{len(windowed)} windowed rows are not fitted (one prefill pair serves "
                     "every kind); their error under the fitted pair is the 'windowed' slice")
    written = {p.name: sol.values[p.name] for p in params}
    plots = []
    combos = sorted(set(zip(plain.n_q.tolist(), plain.n_kv.tolist(), plain.head_dim.tolist(),
                            plain.kv_dtype.tolist())),
                    key=lambda c: (c[3] != "bf16", abs(c[0] - 32) + abs(c[1] - 8), c[2] != 128))
    if combos:
        nq, nkv, d, kvd = combos[0]
        withx = Problem(prob.params, prob.predict,
                        {**prob.fit_rows, "isl": fit_obs.isl.astype(float)},
                        {**prob.held_rows, "isl": held_obs.isl.astype(float)}, prob.fixed)
        for b in (1, 16):
            mf, mh = [(o.n_q == nq) & (o.n_kv == nkv) & (o.head_dim == d) & (o.kv_dtype == kvd)
                      & (o.batch_size == b) for o in (fit_obs, held_obs)]
            ps = plot_series(f"prefill: {nq}/{nkv} heads, d {d}, batch {b}", withx, preds, mf,
                             mh, "isl", "prompt (tokens)")
            if ps is not None:
                plots.append(ps)
    return PrimitiveFit("prefill_attention", chip, params, sol.values, written, errors,
                        {n: "unwindowed" for n in written}, sol.laplace, str(obs.source),
                        str(obs.sha256), len(fit_obs), len(held_obs), dict(obs.skipped), notes,
                        time.perf_counter() - t0, plots)
