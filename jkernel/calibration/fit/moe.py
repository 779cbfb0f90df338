"""MoE routing imbalance from fused-MoE timings (AIConfigurator ``moe_perf``).

A row runs ``T`` tokens through ``E`` experts (hidden ``H``, intermediate ``I``, ``top_k``)
on one GPU holding ``E/ep`` of them (``moe_ep``). Its work is what step.md §6.2 charges one
rank, from :func:`jkernel.laws.routed_expert_work` with EP on (share ``per_rank/E``,
``per_rank = ⌈E/ep⌉`` as the resolver computes it, one tensor shard, dp slice 1), expert
FLOPs ``2·3·H·I`` and bytes ``3·H·I·w`` per expert (gate, up, down). It is predicted in
``expected_s``'s routed form (``StepOptions.expected_routed_max``)::

    t = max(flops(imb) / (P_s · ramp(T)), bytes / (B_hbm · hbm_derate)) + t_call

with the chip's GEMM ramp and HBM derate as shipped (so the imbalance is fitted against the
constants the step will price with). ``imb`` (``moe_routing_imbalance_median``) multiplies
the routed FLOPs; ``t_call`` (``moe_call_floor``) is the per-call floor of the fused kernel's
launches (routing, permute, two grouped GEMMs), fitted and not written, like the GEMM's.

**EP rows.** AIConfigurator's ``moe_ep > 1`` rows time one rank of an attention-data-parallel
EP group: ``num_tokens`` is that rank's tokens and every rank's tokens are routed, so the
routed tokens are ``num_tokens·ep`` (jkernel's funnel ``dp = ep``). Read per rank instead,
the implied imbalance grows in proportion to ep (1.7 at ep 1 to 67 at ep 128 on H100); read
this way it stays between 0.6 and 1.7.

Rows: ``moe_tp = 1`` only (with ``moe_tp > 1`` the kernel runs a 1/tp slice of the
intermediate dimension while the law charges a rank the whole expert FLOPs, step.md §6.2's
kept over-charge, which the imbalance must not absorb; those rows are reported as a slice),
dtype bf16 by default (the quantised fused-MoE kernels of the tables read their weights
several times slower than the GEMMs do: H100 fp8 memory-bound rows measure about 4.5× the
streaming time, which a FLOP multiplier cannot describe; they are reported as a slice),
every routing distribution of the table together (balanced and power-law: one imbalance
over them). The reference curve is the spec's imbalance with the reference ramps in the
step's sum form.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from jkernel import laws

from .base import (REFERENCE, REFERENCE_HBM_DERATE, Param, PrimitiveFit, Problem, columns,
                  plot_series, slices_table, solve)
from .gemm import WEIGHT_BYTES, peak_for, reference_ramps

__all__ = ["fit_moe", "moe_work"]


def moe_work(obs) -> tuple[np.ndarray, np.ndarray]:
    """``(routed FLOPs at imbalance 1, routed weight bytes)`` per row, by the step's law."""
    flops = np.zeros(len(obs))
    nbytes = np.zeros(len(obs))
    w = np.array([WEIGHT_BYTES.get(s, np.nan) for s in obs.dtype])
    keys = np.stack([obs.topk, obs.experts, obs.moe_ep], axis=1)
    uniq = np.unique(keys, axis=0)
    groups = [np.all(keys == u, axis=1) for u in uniq]
    # every group is padded to one length, so the eager law compiles its primitives once
    width = 1 << int(np.ceil(np.log2(max(int(m.sum()) for m in groups))))
    pad = lambda a: np.pad(np.asarray(a, np.float64), (0, width - len(a)),  # noqa: E731
                           constant_values=1.0)
    for (topk, experts, ep), m in zip(uniq, groups):
        n = int(m.sum())
        base, extra = divmod(int(experts), int(ep))
        per_rank = max(base + (1 if extra else 0), 1)
        # the EP rows run attention data-parallel across the EP group: every rank's tokens
        # reach the experts (jkernel's funnel = dp = ep), num_tokens being one rank's tokens
        f, b = laws.routed_expert_work(
            pad(obs.num_tokens[m] * int(ep)), int(topk), per_rank / int(experts),
            pad(2.0 * 3 * obs.hidden[m] * obs.inter[m]), 1.0, 1.0, int(experts), per_rank,
            pad(3.0 * obs.hidden[m] * obs.inter[m] * w[m]), 1)
        flops[m] = np.asarray(f)[:n]
        nbytes[m] = np.asarray(b)[:n]
    return flops, nbytes


def _rows(obs, chip_doc, ramps, dists):
    flops, nbytes = moe_work(obs)
    eps = np.array([ramps[s]["eps_max"] for s in obs.dtype])
    mh = np.array([ramps[s]["m_half"] for s in obs.dtype])
    peak = np.array([peak_for(chip_doc, s) for s in obs.dtype])
    dist = np.array([dists.index(d) for d in obs.distribution], dtype=np.float64)
    return columns(obs, ("latency_s", "num_tokens", "moe_tp"), flops=flops, bytes=nbytes,
                   eps=eps, m_half=mh, peak=peak, dist=dist,
                   )


def _predict(form: str, floor: bool):
    def predict(v, d):
        eff = laws.ramp(d["num_tokens"], d["eps"], d["m_half"])
        compute = laws.compute_time(d["flops"] * v["moe_routing_imbalance_median"], d["peak"],
                                    eff)
        memory = laws.memory_time(d["bytes"], v["hbm_bytes_per_s"] * v["hbm_derate"])
        t = jnp.maximum(compute, memory) if form == "max" else compute + memory
        return t + v["moe_call_floor"] if floor else t
    return predict


def _subset(rows: dict, mask: np.ndarray) -> dict:
    return {k: v[mask] for k, v in rows.items()}


def fit_moe(obs, chip_doc, ramps: dict, hbm_derate: float, *, chip: str,
            dtypes: tuple[str, ...] = ("bf16",), heldout: float = 0.2, seed: int = 0,
            steps: int = 1500, lr: float = 0.05, delta: float = 0.05) -> PrimitiveFit:
    """Fit ``moe_routing_imbalance_median`` of one chip.

    ``ramps``: ``{dtype: {"eps_max", "m_half", ...}}`` as the chip ships them;
    ``hbm_derate``: the chip's derate. ``dtypes``: the MoE dtypes fitted (default bf16:
    the quantised fused-MoE kernels of the tables stream their weights several times slower
    than the GEMMs do, which a FLOP multiplier cannot describe; they are reported).
    """
    t0 = time.perf_counter()
    usable = [s for s in ramps if s in WEIGHT_BYTES and peak_for(chip_doc, s) > 0]
    fitted = [s for s in dtypes if s in usable]
    if not fitted:
        raise ValueError(f"{obs.source}: none of the MoE dtypes {dtypes} has a ramp on "
                         f"{chip} ({', '.join(usable)})")
    dists = sorted(set(obs.distribution.tolist()))
    known = np.isin(obs.dtype, usable)
    notes = []
    other = sorted(set(obs.dtype[~known].tolist()))
    if other:
        notes.append(f"rows of dtypes without a jkernel ramp not evaluated: {', '.join(other)} "
                     f"({int((~known).sum())} rows)")
    data = obs.select(known)
    held = data.held_mask(heldout, seed)
    rows = _rows(data, chip_doc, ramps, dists)
    main = np.isin(data.dtype, fitted) & (data.moe_tp == 1)
    if not main.any():
        raise ValueError(f"{obs.source}: no MoE rows with moe_tp = 1 of dtype "
                         f"{', '.join(fitted)}")
    fixed = {"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12, "hbm_derate": hbm_derate}
    params = (Param("moe_routing_imbalance_median", 1.0),
              Param("moe_call_floor", 20e-6, units="us_per_transfer", written=False))
    prob = Problem(params, _predict("max", True), _subset(rows, main & ~held),
                   _subset(rows, main & held), fixed=fixed)
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    whole = Problem(params, _predict("max", True), _subset(rows, ~held), _subset(rows, held),
                    fixed)
    variants = {"fitted": (whole, sol.values),
                "fitted, as shipped (no call floor)": (
                    Problem(params, _predict("max", False), whole.fit_rows, whole.held_rows,
                            fixed), sol.values)}
    ref = REFERENCE.get(chip, {})
    ref_ramps = reference_ramps(chip)
    if ref.get("imbalance") is not None and all(s in ref_ramps for s in usable):
        rrows = _rows(data, chip_doc, ref_ramps, dists)
        rprob = Problem((), _predict("sum", False), _subset(rrows, ~held), _subset(rrows, held),
                        {"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12,
                         "hbm_derate": REFERENCE_HBM_DERATE})
        variants["reference §8.7, sum form"] = (rprob, {"moe_routing_imbalance_median":
                                                       ref["imbalance"]})
    d_fit, d_held = data.select(~held), data.select(held)
    fm = np.isin(d_fit.dtype, fitted) & (d_fit.moe_tp == 1)
    hm = np.isin(d_held.dtype, fitted) & (d_held.moe_tp == 1)
    label = "/".join(fitted)
    slices = {f"{label}, moe_tp = 1 (fitted)": (fm, hm)}
    for dname in dists:
        slices[f"{label}, moe_tp = 1, {dname}"] = (fm & (d_fit.distribution == dname),
                                                   hm & (d_held.distribution == dname))
    for s in usable:
        if s not in fitted:
            slices[f"{s}, moe_tp = 1 (not fitted)"] = ((d_fit.dtype == s) & (d_fit.moe_tp == 1),
                                                       (d_held.dtype == s)
                                                       & (d_held.moe_tp == 1))
    slices[f"{label}, moe_tp > 1 (not fitted)"] = (np.isin(d_fit.dtype, fitted)
                                                  & (d_fit.moe_tp > 1),
                                                  np.isin(d_held.dtype, fitted)
                                                  & (d_held.moe_tp > 1))
    errors, preds = slices_table(whole, variants, slices, return_predictions=True)
    for s in usable:
        if s in fitted:
            continue
        m = (data.dtype == s) & (data.moe_tp == 1)
        f1, b1 = rows["flops"][m], rows["bytes"][m]
        mem = b1 / (chip_doc.hbm_tbs * 1e12 * hbm_derate)
        comp = f1 / (rows["peak"][m] * np.asarray(laws.ramp(rows["num_tokens"][m],
                                                            rows["eps"][m], rows["m_half"][m])))
        bound = mem > 2 * comp
        if bound.any():
            notes.append(f"{s} rows (not fitted): where the law is memory-bound they measure "
                         f"{np.median(rows['latency_s'][m][bound] / mem[bound]):.2f}× the weight "
                         "streaming time (median); no FLOP multiplier can describe that")
    notes.append(f"per-call floor (not written): {sol.values['moe_call_floor'] * 1e6:.2f} µs")
    notes.append("EP rows are read as attention data-parallel across the EP group (each rank "
                 "holds num_tokens, so num_tokens·ep tokens are routed: jkernel's funnel)")
    written = {"moe_routing_imbalance_median": sol.values["moe_routing_imbalance_median"]}
    plots = _plots(whole, preds, d_fit, d_held, fm, hm)
    return PrimitiveFit("moe", chip, params, sol.values, written, errors,
                        {"moe_routing_imbalance_median": f"{label}, moe_tp = 1 (fitted)"},
                        sol.laplace, str(obs.source), str(obs.sha256), len(prob.fit_rows["flops"]),
                        len(prob.held_rows["flops"]), dict(obs.skipped), notes,
                        time.perf_counter() - t0, plots)


def _plots(whole, preds, d_fit, d_held, fm, hm):
    out = []
    combos = sorted(set(zip(d_fit.dtype[fm].tolist(), d_fit.hidden[fm].tolist(),
                            d_fit.inter[fm].tolist(), d_fit.topk[fm].tolist(),
                            d_fit.experts[fm].tolist(), d_fit.moe_ep[fm].tolist())),
                    key=lambda c: (c[0] != "bf16", c[5] != 1,
                                   abs(c[1] - 4096) + abs(c[2] - 1536)))
    if not combos:
        return out
    s, h, i, k, e, ep = combos[0]
    dists = sorted(set(d_fit.distribution.tolist()))
    keep = [v for v in preds if not v.startswith("reference")]
    for dname in dists[:2]:
        mf, mh = [m & (o.dtype == s) & (o.hidden == h) & (o.inter == i) & (o.topk == k)
                  & (o.experts == e) & (o.moe_ep == ep) & (o.distribution == dname)
                  for o, m in ((d_fit, fm), (d_held, hm))]
        ps = plot_series(f"MoE {s}: H {h}, I {i}, top-{k} of {e}, ep {ep}, {dname}", whole,
                         preds, mf, mh, "num_tokens", "tokens", variants=keep)
        if ps is not None:
            out.append(ps)
    return out
