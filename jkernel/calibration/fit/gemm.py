"""GEMM efficiency ramp and HBM derate from per-GEMM timings (AIConfigurator ``gemm_perf``).

Each measured GEMM ``[m, k] @ [k, n]`` of dtype ``s`` is predicted as ``expected_s`` prices
one GEMM kernel (``docs/spec/expected.md``), with :func:`jkernel.laws.gemm_times`::

    compute = 2·m·n·k / (P_s · ε(m, n, k))                     (step.md §2 ramp)
    memory  = (n·k·w_s + m·(n + k)·2) / (B_hbm · hbm_derate)    (weights + bf16 activations)
    t       = max(compute, memory) + kernel_gap

* ``ε`` is the shape-aware ramp ``eff_shaped`` (ε_max, m½, n½, k½) or the plain token ramp
  ``ramp`` (ε_max, m½); ``shape_aware="auto"`` fits both and keeps the shape-aware one when
  its held-out error over all dtypes is lower.
* ``P_s`` is the chip's peak for the dtype (bf16 → ``TFlopsPeak``, fp8 → ``TFlopsFP8``,
  nvfp4 → ``TFlopsNVFP4``), ``w_s`` the weight bytes per element of jkernel's plans (2, 1,
  0.5: block scales excluded, documents.md §6.2), ``B_hbm`` the chip's ``BwPeakTBs``.
* ``hbm_derate`` is shared by all dtypes of the chip (the registry has one per chip).
* ``kernel_gap`` is the per-kernel term ``expected_s`` adds to the GPU time
  (``gpu_s = … + kernels · kernel_gap_s``, expected.md), here the floor of one call: the
  2–3 µs that a small GEMM takes whatever its size (``n = k = 32`` rows measure 2.5 µs
  against a law value of 1 ns). Without it the small shapes drag the ramp far from the large
  ones. It is reported and, only on request (``kernel_gap=True``; ``--kernel-gap`` on the
  command line), written as ``kernel_gap`` (``cost-model-host-overheads``): expected.md
  leaves ``kernel_gap`` (GPU idle between kernels) at 0 until a step-trace fit, and a
  profile's per-call floor also holds a small kernel's minimum run time and the harness's
  launch overhead. The error table's "fitted, without kernel_gap" row is the law as shipped
  by default (the fitted ramp, kernel_gap 0).

Rows of ``fp8_block`` (``gemm_*_fp8_block`` is never read, documents.md §8.6) and of dtypes
the chip has no peak for are not fitted. The comparison curves on the same rows are the
spec's reference values (documents.md §8.7, derate 0.8) in the reference's **sum** form
(``compute + weights/B``, no activation traffic: the step's edges) and in the max form, and
our own constants refitted in the sum form (expected.md asks for both).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from jkernel import laws

from .base import (REFERENCE, REFERENCE_HBM_DERATE, Param, PlotSeries, PrimitiveFit,
                  Problem, columns, plot_series, slices_table, solve)

__all__ = ["GEMM_DTYPES", "WEIGHT_BYTES", "ACTIVATION_BYTES", "peak_for", "gemm_problem",
           "fit_gemm", "shipped_ramps", "reference_ramps"]

GEMM_DTYPES = ("bf16", "fp8", "nvfp4")
#: Weight bytes per element as jkernel's plans count them (documents.md §6.2).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5}
#: Activation bytes per element in and out (expected.md refinement 2; step.py passes 2).
ACTIVATION_BYTES = 2.0
CALL_FLOOR = "kernel_gap"


def peak_for(chip_doc, dtype: str) -> float:
    """The chip's dense peak for a GEMM dtype, FLOP/s (0 when the chip has none)."""
    tflops = {"bf16": chip_doc.bf16_peak_tflops, "fp8": chip_doc.fp8_peak_tflops,
              "nvfp4": chip_doc.nvfp4_peak_tflops}.get(dtype, 0.0)
    return float(tflops) * 1e12


def _params(dtypes, shaped: bool, floor: bool, start: dict | None = None,
            write_floor: bool = False) -> tuple[Param, ...]:
    start = start or {}
    out = []
    for s in dtypes:
        out.append(Param(f"gemm_eps_max_{s}", start.get(f"gemm_eps_max_{s}", 0.8), "logit",
                         0.0, 1.0))
        out.append(Param(f"gemm_m_half_{s}", start.get(f"gemm_m_half_{s}", 100.0),
                         units="tokens"))
        if shaped:
            out.append(Param(f"gemm_n_half_{s}", 300.0))
            out.append(Param(f"gemm_k_half_{s}", 300.0))
    out.append(Param("hbm_derate", 0.8, "logit", 0.0, 1.0))
    if floor:
        out.append(Param(CALL_FLOOR, 3e-6, units="us_per_transfer", written=write_floor))
    return tuple(out)


def _predictor(dtypes, *, form: str, shaped: bool, floor: bool,
               activation_bytes: float = ACTIVATION_BYTES):
    def predict(v, d):
        idx = d["dtype_index"].astype(jnp.int32)
        pick = lambda stem: jnp.stack([v[f"{stem}_{s}"] for s in dtypes])[idx]  # noqa: E731
        eps, mh = pick("gemm_eps_max"), pick("gemm_m_half")
        if shaped:
            eff = laws.eff_shaped(d["m"], d["n"], d["k"], eps, mh, pick("gemm_n_half"),
                                  pick("gemm_k_half"))
        else:
            eff = laws.ramp(d["m"], eps, mh)
        compute, memory = laws.gemm_times(d["m"], d["n"], d["k"], d["n"] * d["k"] * d["w"],
                                          d["peak"], v["hbm_bytes_per_s"] * v["hbm_derate"],
                                          eff, activation_bytes)
        t = jnp.maximum(compute, memory) if form == "max" else compute + memory
        return t + v[CALL_FLOOR] if floor else t
    return predict


def _rows(obs, chip_doc, dtypes) -> dict[str, np.ndarray]:
    idx = np.array([dtypes.index(s) for s in obs.dtype], dtype=np.float64)
    peak = np.array([peak_for(chip_doc, s) for s in dtypes])[idx.astype(int)]
    w = np.array([WEIGHT_BYTES[s] for s in dtypes])[idx.astype(int)]
    return columns(obs, ("m", "n", "k", "latency_s"), dtype_index=idx, peak=peak, w=w)


def gemm_problem(fit_obs, held_obs, chip_doc, dtypes, *, form: str = "max", shaped: bool = True,
                 floor: bool = True, start: dict | None = None,
                 write_floor: bool = False) -> Problem:
    """The GEMM fit as a :class:`~jkernel.calibration.fit.base.Problem` (rows already split)."""
    starts = []
    if shaped:
        starts = [{f"gemm_{h}_half_{s}": x for s in dtypes for h in ("n", "k")}
                  for x in (30.0, 3000.0)]
    return Problem(_params(dtypes, shaped, floor, start, write_floor),
                   _predictor(dtypes, form=form, shaped=shaped, floor=floor),
                   _rows(fit_obs, chip_doc, dtypes), _rows(held_obs, chip_doc, dtypes),
                   fixed={"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12}, starts=starts)


def _reference_values(chip: str, dtypes) -> dict[str, float] | None:
    ref = REFERENCE.get(chip, {}).get("gemm", {})
    if not all(s in ref for s in dtypes):
        return None
    v = {"hbm_derate": REFERENCE_HBM_DERATE}
    for s in dtypes:
        v[f"gemm_eps_max_{s}"], v[f"gemm_m_half_{s}"] = ref[s]
    return v


def fit_gemm(obs, chip_doc, *, chip: str, dtypes=None, shape_aware: str = "auto",
             kernel_gap: bool = False, heldout: float = 0.2, seed: int = 0, steps: int = 1500,
             lr: float = 0.05, delta: float = 0.05) -> PrimitiveFit:
    """Fit the GEMM ramp(s) and the HBM derate of one chip (see the module docstring).

    ``obs``: :class:`jkernel.calibration.data.profiles.GemmObservations`. ``dtypes``:
    default every one of :data:`GEMM_DTYPES` present in the table with a peak on the chip.
    ``kernel_gap``: write the fitted per-call floor as ``kernel_gap`` (it is fitted either
    way).
    """
    t0 = time.perf_counter()
    if shape_aware not in ("auto", "on", "off"):
        raise ValueError("shape_aware must be 'auto', 'on' or 'off'")
    present = set(np.unique(obs.dtype).tolist())
    if dtypes is None:
        dtypes = tuple(s for s in GEMM_DTYPES if s in present and peak_for(chip_doc, s) > 0)
    dtypes = tuple(dtypes)
    if not dtypes:
        raise ValueError(f"{obs.source}: no GEMM rows of a dtype the chip has a peak for "
                         f"(dtypes here: {sorted(present)})")
    notes = []
    dropped = {s: int(np.sum(obs.dtype == s)) for s in sorted(present) if s not in dtypes}
    if dropped:
        notes.append("rows not fitted (dtype without a jkernel ramp name or a chip peak): "
                     + ", ".join(f"{s} {n}" for s, n in dropped.items()))
    sel = obs.where(dtype=set(dtypes))
    fit_obs, held_obs = sel.split(heldout, seed)
    kw = dict(steps=steps, lr=lr, delta=delta)

    variants: dict[str, tuple[Problem, dict]] = {}
    solutions = {}
    shaped_opts = {"auto": (True, False), "on": (True,), "off": (False,)}[shape_aware]
    for shaped in shaped_opts:
        prob = gemm_problem(fit_obs, held_obs, chip_doc, dtypes, shaped=shaped,
                            write_floor=kernel_gap)
        sol = solve(prob, **kw)
        label = "fitted, shape-aware ramp" if shaped else "fitted, token ramp"
        variants[label] = (prob, sol.values)
        solutions[label] = (prob, sol, shaped)
    # choose the shipped ramp by held-out error over all dtypes
    def held_median(label):
        prob, sol, _ = solutions[label]
        return float(np.median(np.abs(np.log(sol.held_pred / prob.held_rows["latency_s"]))))
    primary = min(solutions, key=held_median) if len(solutions) > 1 else next(iter(solutions))
    prob, sol, shaped = solutions[primary]
    if len(solutions) > 1:
        other = [k for k in solutions if k != primary][0]
        notes.append(f"shape-aware choice: '{primary}' has the lower held-out median "
                     f"|log ratio| over all dtypes ({held_median(primary):.4f} against "
                     f"{held_median(other):.4f} for '{other}')")
    # sum-form refit with the same parameters (expected.md: report max against sum)
    sum_prob = prob.started_at(sol.values,
                               _predictor(dtypes, form="sum", shaped=shaped, floor=True))
    sum_sol = solve(sum_prob, uncertainty=False, **{**kw, "steps": max(steps // 2, 1)})
    variants["fitted, sum form"] = (sum_prob, sum_sol.values)
    # the fitted ramp alone (kernel_gap 0)
    bare = Problem(prob.params, _predictor(dtypes, form="max", shaped=shaped, floor=False),
                   prob.fit_rows, prob.held_rows, prob.fixed)
    variants["fitted, without kernel_gap"] = (bare, sol.values)
    ref = _reference_values(chip, dtypes)
    if ref is not None:
        ref_sum = Problem((), _predictor(dtypes, form="sum", shaped=False, floor=False,
                                         activation_bytes=0.0),
                          prob.fit_rows, prob.held_rows, prob.fixed)
        ref_max = Problem((), _predictor(dtypes, form="max", shaped=False, floor=False),
                          prob.fit_rows, prob.held_rows, prob.fixed)
        variants["reference §8.7, sum form"] = (ref_sum, ref)
        variants["reference §8.7, max form"] = (ref_max, ref)
    else:
        notes.append(f"the spec has no reference GEMM values for {chip} "
                     f"({', '.join(dtypes)}); no reference comparison")
    order = [primary] + [k for k in variants if k != primary]
    variants = {k: variants[k] for k in order}
    fi = prob.fit_rows["dtype_index"]
    hi = prob.held_rows["dtype_index"]
    slices = {"all": (np.ones_like(fi, bool), np.ones_like(hi, bool))}
    for j, s in enumerate(dtypes):
        slices[s] = (fi == j, hi == j)
    errors, preds = slices_table(prob, variants, slices, return_predictions=True)
    written = {p.name: sol.values[p.name] for p in prob.params if p.written}
    entry_slice = {}
    for name in written:
        entry_slice[name] = ("all" if name in ("hbm_derate", CALL_FLOOR)
                             else name.rsplit("_", 1)[1])
    notes.append(f"per-call floor, expected_s's kernel_gap term: "
                 f"{sol.values[CALL_FLOOR] * 1e6:.2f} µs"
                 + ("" if kernel_gap else " (not written)"))
    plots = _plots(prob, preds, dtypes, primary)
    return PrimitiveFit("gemm", chip, prob.params, sol.values, written, errors, entry_slice,
                        sol.laplace, str(obs.source), str(obs.sha256), len(fit_obs),
                        len(held_obs), dict(obs.skipped), notes, time.perf_counter() - t0,
                        plots, primary)


def _plots(prob, preds, dtypes, primary) -> list[PlotSeries]:
    out = []
    rows = [prob.fit_rows, prob.held_rows]
    pairs = sorted(set(zip(np.concatenate([r["n"] for r in rows]).tolist(),
                           np.concatenate([r["k"] for r in rows]).tolist())),
                   key=lambda nk: (abs(np.log(nk[0] / 8192.0)) + abs(np.log(nk[1] / 8192.0))))
    if not pairs:
        return out
    n, k = pairs[0]
    keep = [v for v in preds if v == primary or v.startswith("reference") or "sum form" in v]
    for j, s in enumerate(dtypes):
        mf, mh = [(r["dtype_index"] == j) & (r["n"] == n) & (r["k"] == k) for r in rows]
        ps = plot_series(f"{s} GEMM, n = {int(n)}, k = {int(k)}", prob, preds, mf, mh, "m",
                         "m (tokens)", variants=keep)
        if ps is not None:
            out.append(ps)
    return out


def shipped_ramps(fit: PrimitiveFit) -> dict[str, dict[str, float]]:
    """``{dtype: {eps_max, m_half, n_half, k_half}}`` as written by a GEMM fit (halves 0 when
    the token ramp was chosen)."""
    out = {}
    w = fit.values
    for s in GEMM_DTYPES:
        if f"gemm_eps_max_{s}" in fit.written:
            out[s] = {"eps_max": w[f"gemm_eps_max_{s}"], "m_half": w[f"gemm_m_half_{s}"],
                      "n_half": fit.written.get(f"gemm_n_half_{s}", 0.0),
                      "k_half": fit.written.get(f"gemm_k_half_{s}", 0.0)}
    if "bf16" not in out and out:
        out["bf16"] = next(iter(out.values()))
    return out


def reference_ramps(chip: str, chip_doc=None) -> dict[str, dict[str, float]]:
    """The spec's reference ramps of ``chip`` in the shape of :func:`shipped_ramps`."""
    ref = REFERENCE.get(chip, {}).get("gemm", {"bf16": (0.8, 100.0)})
    return {s: {"eps_max": e, "m_half": m, "n_half": 0.0, "k_half": 0.0}
            for s, (e, m) in ref.items()}
