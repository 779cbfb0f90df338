"""The fused-MoE law from fused-MoE timings (AIConfigurator ``moe_perf``).

A row runs ``T`` tokens through ``E`` experts (hidden ``H``, intermediate ``I``, ``top_k``)
on one GPU holding ``E/ep`` of them (``moe_ep``) and a ``1/moe_tp`` slice of each expert's
intermediate dimension. Its work is what step.md §6.2 charges one rank, from
:func:`jkernel.laws.routed_expert_work` with EP on (share ``per_rank/E``, ``per_rank =
⌈E/ep⌉`` as the resolver computes it, dp slice 1), expert FLOPs ``2·m·H·I`` and bytes
``m·H·I·w`` per expert (``m`` = 3 matrices, gate, up and down; 2 for the non-gated experts of
:data:`NON_GATED`), bytes divided by ``moe_tp`` (the expert tensor shards) and, as vLLM runs
it, FLOPs too (``expected_s`` prices a rank's slice, not the spec's whole-expert charge).
It is predicted by :func:`jkernel.laws.routed_expert_time`, ``expected_s``'s routed term::

    t = floor_s + max(FLOPs / (P_s · ε(m_e)), touched·bytes_e / (B_hbm · hbm_derate))
        + assignments · c_a,        ε(m_e) = m_e / (m_e + m½),  m_e = assignments / touched

with the chip's peak for the dtype's GEMM family ``s`` (bf16, fp8, nvfp4) and its HBM
derate as shipped. Fitted per chip (:func:`fit_moe`): ``moe_kernel_floor_<s>`` (the kernel's
floor per dtype family: routing, alignment and the grouped GEMMs' launches, 10–50 µs),
``moe_m_half`` (the grouped GEMM's token ramp in rows per expert: a fused-MoE kernel
reaches the chip's peak only with hundreds of tokens per expert, so no FLOP multiplier is
needed: one fitted freely settles at 1.00) and ``moe_assignment_time`` (per token-expert
pair: the permute and un-permute of activations around the grouped GEMMs).

The spec's routed law (step.md §6.2: the step-level token ramp, every rank charged the whole
expert FLOPs, no floor), which the edges price with, keeps its one constant,
``moe_routing_imbalance_median``, fitted as before on ``moe_tp = 1`` bf16 rows
(:func:`fit_moe_imbalance`, with a per-call floor that is fitted and not written).

What the law before this one missed, on H100's profile of Llama-4-Scout's experts (fp8,
tp 2): no floor (0.144 ms at 8 tokens against 0.159–0.219 measured), and the large-token
calls, which ran up to 2.5× slower than a token ramp at the step's tokens allows (a
Triton fused MoE reaches 200–650 TFLOP/s on H100 bf16, by tokens per expert).

**Distributions.** The tables route by ``balanced`` (tokens spread round-robin: at ``T·k ≤
E`` every assignment lands on its own expert) or ``power_law`` (skewed: fewer experts, a
hot one). The law's touched count is the expectation under uniform random routing
(:func:`jkernel.laws.experts_touched`), between the two; all distributions are fitted
together, and each is reported as a slice.

**EP rows.** AIConfigurator's ``moe_ep > 1`` rows time one rank of an attention-data-parallel
EP group: ``num_tokens`` is that rank's tokens and every rank's tokens are routed, so the
routed tokens are ``num_tokens·ep`` (jkernel's funnel ``dp = ep``).

**Which rows.** Per dtype, the kernel vLLM runs (:data:`MOE_KERNELS`): Triton's fused MoE on
Hopper, Ada and Ampere, FlashInfer's TRT-LLM monolithic kernels on data-centre Blackwell;
``fp8`` means block-scaled fp8 (``fp8_block``) and, where vLLM runs it through the same
kernel family, per-tensor fp8. H100's per-tensor ``fp8`` rows (ModelOpt through FlashInfer's
CUTLASS path, 5× slower per byte) and MXFP4 / INT4 weight-only rows are reported, not
fitted. The comparison curves: the spec's imbalance with the reference ramps in the step's
sum form (no floor), and ``expected_s``'s routed term before this law (the step-level ramp,
no floor, the whole expert FLOPs) at the chip's fitted imbalance.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from jkernel import laws

from .base import (REFERENCE, REFERENCE_HBM_DERATE, ErrorRow, ErrorStats, Param, PrimitiveFit,
                   Problem, columns, plot_series, slices_table, solve)
from .gemm import peak_for, reference_ramps

__all__ = ["fit_moe", "fit_moe_imbalance", "moe_work", "MOE_KERNELS", "NON_GATED", "MOE_SHAPES", "MOE_FAMILY"]

#: The table's MoE dtype → the GEMM family (coefficient suffix) whose peak prices it.
MOE_FAMILY = {"bf16": "bf16", "fp8_block": "fp8", "fp8": "fp8", "nvfp4": "nvfp4"}
#: Weight bytes per element of the fitted MoE dtypes (block scales excluded, as in the plans).
MOE_WEIGHT_BYTES = {"bf16": 2.0, "fp8_block": 1.0, "fp8": 1.0, "nvfp4": 0.5,
                    "w4a16_mxfp4": 0.5}

#: The fused-MoE kernel vLLM runs per (chip family, dtype), as a substring of the tables'
#: ``kernel_source``; a dtype not listed is not fitted on that chip.
MOE_KERNELS = {
    "hopper": {"bf16": "triton", "fp8_block": "triton"},
    "ada": {"bf16": "triton", "fp8_block": "triton", "fp8": "triton"},
    "ampere": {"bf16": "fused_moe"},
    "blackwell": {"bf16": "trtllm", "fp8_block": "monolithic", "fp8": "monolithic",
                  "nvfp4": "monolithic"},
}
_FAMILY_OF = {"h100": "hopper", "h200": "hopper", "l40s": "ada", "a100-sxm": "ampere",
              "b200": "blackwell", "b300": "blackwell"}

#: (hidden, inter, experts, top_k) of the tables' non-gated experts (two matrices, up and
#: down): NVIDIA's Nemotron-H MoE shapes, ReLU² experts. Their memory-bound calls measure
#: 2/3 of a gated expert's weight streaming.
NON_GATED = frozenset({(2688, 1856, 128, 6), (2048, 5120, 512, 22), (1024, 2688, 512, 22)})

#: Named model shapes (hidden, inter, experts, top_k) reported as slices.
MOE_SHAPES = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "Qwen3-235B-A22B": (4096, 1536, 128, 8),
              "gpt-oss-120b": (2880, 2880, 128, 4), "gpt-oss-20b": (2880, 2880, 32, 4),
              "Mixtral-8x7B": (4096, 14336, 8, 2), "Mixtral-8x22B": (6144, 16384, 8, 2),
              "DeepSeek-V3": (7168, 2048, 256, 8), "Llama-4-Scout": (5120, 8192, 16, 1),
              "Llama-4-Maverick": (5120, 8192, 128, 1)}


def _matrices(obs) -> np.ndarray:
    keys = zip(obs.hidden.tolist(), obs.inter.tolist(), obs.experts.tolist(), obs.topk.tolist())
    return np.array([2.0 if k in NON_GATED else 3.0 for k in keys])


def moe_work(obs) -> dict[str, np.ndarray]:
    """Per row, by the step's laws: routed FLOPs of the rank at imbalance 1 (its tensor
    slice), touched weight bytes, token-expert assignments and touched experts."""
    n = len(obs)
    out = {k: np.zeros(n) for k in ("flops", "bytes", "assignments", "touched")}
    w = np.array([MOE_WEIGHT_BYTES.get(s, np.nan) for s in obs.dtype])
    mats = _matrices(obs)
    keys = np.stack([obs.topk, obs.experts, obs.moe_ep], axis=1)
    uniq = np.unique(keys, axis=0)
    groups = [np.all(keys == u, axis=1) for u in uniq]
    # every group is padded to one length, so the eager law compiles its primitives once
    width = 1 << int(np.ceil(np.log2(max(int(m.sum()) for m in groups))))
    pad = lambda a: np.pad(np.asarray(a, np.float64), (0, width - len(a)),  # noqa: E731
                           constant_values=1.0)
    for (topk, experts, ep), m in zip(uniq, groups):
        k = int(m.sum())
        base, extra = divmod(int(experts), int(ep))
        per_rank = max(base + (1 if extra else 0), 1)
        tp = obs.moe_tp[m].astype(np.float64)
        hi = obs.hidden[m] * obs.inter[m] * mats[m]
        # the EP rows run attention data-parallel across the EP group: every rank's tokens
        # reach the experts (jkernel's funnel = dp = ep), num_tokens being one rank's tokens
        routed = obs.num_tokens[m] * int(ep)
        f, b = laws.routed_expert_work(pad(routed), int(topk), per_rank / int(experts),
                                       pad(2.0 * hi), 1.0, 1.0, int(experts), per_rank,
                                       pad(hi * w[m]), 1)
        touched = laws.experts_touched(laws.round_half_up(pad(routed)), int(experts),
                                       int(topk), per_rank)
        out["flops"][m] = np.asarray(f)[:k] / tp
        out["bytes"][m] = np.asarray(b)[:k] / tp
        out["assignments"][m] = routed * int(topk) * per_rank / int(experts)
        out["touched"][m] = np.asarray(touched)[:k]
    return out


def _rows(obs, chip_doc, families, dists, extra_ramps=None):
    work = moe_work(obs)
    fam = [MOE_FAMILY.get(s, "") for s in obs.dtype]
    peak = np.array([peak_for(chip_doc, f) if f else np.nan for f in fam])
    fidx = np.array([families.index(f) if f in families else -1 for f in fam], np.float64)
    dist = np.array([dists.index(d) for d in obs.distribution], dtype=np.float64)
    extra = {}
    if extra_ramps is not None:
        extra["eps"] = np.array([extra_ramps.get(f, {}).get("eps_max", np.nan) for f in fam])
        extra["ramp_m_half"] = np.array([extra_ramps.get(f, {}).get("m_half", np.nan)
                                         for f in fam])
    return columns(obs, ("latency_s", "num_tokens", "moe_tp"), flops=work["flops"],
                   bytes=work["bytes"], assignments=work["assignments"],
                   touched=work["touched"], peak=peak, family=fidx, dist=dist, **extra)


def _predict(families):
    def predict(v, d):
        idx = jnp.maximum(d["family"], 0).astype(jnp.int32)
        floor = jnp.stack([v[f"moe_kernel_floor_{f}"] for f in families])[idx]
        return laws.routed_expert_time(
            d["flops"], d["bytes"], d["assignments"],
            d["touched"], d["peak"], v["hbm_bytes_per_s"] * v["hbm_derate"], floor,
            v["moe_m_half"], v["moe_assignment_time"])
    return predict


def _before_predict(v, d):
    """``expected_s``'s routed term before the fused-MoE law: ``max(compute, memory)`` at the
    step-level token ramp, the whole expert FLOPs (step.md §6.2), no floor."""
    eff = laws.ramp(d["num_tokens"], d["eps"], d["ramp_m_half"])
    compute = laws.compute_time(d["flops"] * d["moe_tp"] * v["moe_routing_imbalance_median"],
                                d["peak"], eff)
    return jnp.maximum(compute, laws.memory_time(d["bytes"],
                                                 v["hbm_bytes_per_s"] * v["hbm_derate"]))


def _reference_predict(v, d):
    """The spec's routed term (step.md §6.2) in the sum form at the reference ramps: the
    whole expert FLOPs on every rank (not the tensor slice), no floor."""
    eff = laws.ramp(d["num_tokens"], d["eps"], d["ramp_m_half"])
    compute = laws.compute_time(d["flops"] * d["moe_tp"] * v["moe_routing_imbalance_median"],
                                d["peak"], eff)
    return compute + laws.memory_time(d["bytes"], v["hbm_bytes_per_s"] * v["hbm_derate"])


def _subset(rows: dict, mask: np.ndarray) -> dict:
    return {k: v[mask] for k, v in rows.items()}


def _kernel_mask(obs, chip: str) -> tuple[np.ndarray, str]:
    table = MOE_KERNELS.get(_FAMILY_OF.get(chip, ""))
    if table is None:
        return np.isin(obs.dtype, list(MOE_FAMILY)), f"no MoE kernels named for {chip}: " \
            "every kernel of the fitted dtypes"
    keep = np.zeros(len(obs), bool)
    for dtype, sub in table.items():
        keep |= (obs.dtype == dtype) & (np.char.find(obs.kernel.astype(str), sub) >= 0)
    what = ", ".join(f"{d} ({s})" for d, s in table.items())
    return keep, f"fitted on the fused-MoE kernels vLLM runs on {chip}: {what}"


def fit_moe(obs, chip_doc, ramps: dict, hbm_derate: float, *, chip: str,
            imbalance: float | None = None, heldout: float = 0.2, seed: int = 0,
            steps: int = 1500, lr: float = 0.05, delta: float = 0.05) -> PrimitiveFit:
    """Fit the fused-MoE law of one chip (the module docstring).

    ``ramps``: ``{family: {"eps_max", "m_half", ...}}`` as the chip ships them;
    ``hbm_derate``: the chip's derate; ``imbalance``: the chip's fitted
    ``moe_routing_imbalance_median``, for the comparison with the routed term before this
    law (omitted without it).
    """
    t0 = time.perf_counter()
    notes = []
    keep, what = _kernel_mask(obs, chip)
    fam = np.array([MOE_FAMILY.get(s, "") for s in obs.dtype])
    has_peak = np.array([bool(f) and peak_for(chip_doc, f) > 0 for f in fam])
    main = keep & has_peak
    if not main.any():
        raise ValueError(f"{obs.source}: no fused-MoE rows of a dtype vLLM's kernels run on "
                         f"{chip} with a peak for it")
    notes.append(what)
    families = tuple(f for f in ("bf16", "fp8", "nvfp4") if np.any(main & (fam == f)))
    dists = sorted(set(obs.distribution.tolist()))
    held = obs.held_mask(heldout, seed)
    fixed = {"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12, "hbm_derate": hbm_derate}
    params = (Param("moe_m_half", 100.0, units="tokens"),
              Param("moe_assignment_time", 5e-9, units="us_per_token"),
              *(Param(f"moe_kernel_floor_{f}", 20e-6, units="us_per_layer") for f in families))
    data = obs.select(main)
    dheld = held[main]
    rows = _rows(data, chip_doc, families, dists, extra_ramps=ramps)
    prob = Problem(params, _predict(families), _subset(rows, ~dheld), _subset(rows, dheld),
                   fixed=fixed, starts=[{"moe_m_half": 400.0, "moe_assignment_time": 2e-8}])
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    variants = {"fitted": (prob, sol.values)}
    if imbalance is not None and all(f in ramps for f in families):
        variants["expected_s before: step-level ramp, no floor"] = (
            Problem((), _before_predict, prob.fit_rows, prob.held_rows, fixed),
            {"moe_routing_imbalance_median": imbalance})
    ref = REFERENCE.get(chip, {})
    ref_ramps = reference_ramps(chip)
    if ref.get("imbalance") is not None and all(f in ref_ramps for f in families):
        rrows = _rows(data, chip_doc, families, dists, extra_ramps=ref_ramps)
        rprob = Problem((), _reference_predict, _subset(rrows, ~dheld), _subset(rrows, dheld),
                        {"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12,
                         "hbm_derate": REFERENCE_HBM_DERATE})
        variants["reference §8.7, sum form (step.md §6.2)"] = (
            rprob, {"moe_routing_imbalance_median": ref["imbalance"]})
    fo, ho = data.select(~dheld), data.select(dheld)
    slices = _slices(fo, ho, families, dists)
    errors, preds = slices_table(prob, variants, slices, return_predictions=True)
    # rows not fitted: other kernels of the fitted dtypes, MXFP4 and other weight formats,
    # priced as the step would (the family of the served dtype on this chip)
    others = {"other kernels of the fitted dtypes (not fitted)": ~keep & has_peak}
    mx_family = ("nvfp4" if chip_doc.nvfp4_peak_tflops > 0
                 else "fp8" if chip_doc.fp8_peak_tflops > 0 else "bf16")
    if mx_family in families:
        others["MXFP4 weights, gpt-oss (not fitted)"] = obs.dtype == "w4a16_mxfp4"
    for label, mask in others.items():
        if not mask.any():
            continue
        sub = obs.select(mask)
        if label.startswith("MXFP4"):
            sub_rows = _rows(sub, chip_doc, families, dists, extra_ramps=ramps)
            sub_rows["peak"] = np.full(len(sub), peak_for(chip_doc, mx_family))
            sub_rows["family"] = np.full(len(sub), float(families.index(mx_family)))
        else:
            sub_rows = _rows(sub, chip_doc, families, dists, extra_ramps=ramps)
        sh = held[mask]
        p = Problem(params, prob.predict, _subset(sub_rows, ~sh), _subset(sub_rows, sh),
                    fixed)
        pf, ph = p.evaluate_both(sol.values)
        errors.append(ErrorRow(label, "fitted", ErrorStats.of(pf, p.fit_rows["latency_s"]),
                               ErrorStats.of(ph, p.held_rows["latency_s"])))
    skipped = sorted(set(obs.dtype[~main].tolist()))
    if skipped:
        notes.append("rows not fitted (another kernel, or a weight format without a fitted "
                     f"family): {int((~main).sum())} ({', '.join(skipped)})")
    notes.append("EP rows are read as attention data-parallel across the EP group (each rank "
                 "holds num_tokens, so num_tokens·ep tokens are routed: jkernel's funnel)")
    notes.append("floors " + ", ".join(f"{f} {sol.values[f'moe_kernel_floor_{f}'] * 1e6:.1f} µs"
                                       for f in families)
                 + f"; m½ {sol.values['moe_m_half']:.0f} tokens per expert; "
                 f"{sol.values['moe_assignment_time'] * 1e9:.2f} ns per assignment")
    written = {p.name: sol.values[p.name] for p in params}
    plots = _plots(prob, preds, fo, ho)
    return PrimitiveFit("moe", chip, params, sol.values, written, errors,
                        {n: "all fitted rows" for n in written}, sol.laplace, str(obs.source),
                        str(obs.sha256), len(fo), len(ho), dict(obs.skipped), notes,
                        time.perf_counter() - t0, plots)


def _imb_rows(obs, chip_doc, ramps, dists):
    work = moe_work(obs)
    # the spec's charge: the whole expert FLOPs on every rank (step.md §6.2)
    flops, nbytes = work["flops"] * obs.moe_tp, work["bytes"]
    eps = np.array([ramps[s]["eps_max"] for s in obs.dtype])
    mh = np.array([ramps[s]["m_half"] for s in obs.dtype])
    peak = np.array([peak_for(chip_doc, s) for s in obs.dtype])
    dist = np.array([dists.index(d) for d in obs.distribution], dtype=np.float64)
    return columns(obs, ("latency_s", "num_tokens", "moe_tp"), flops=flops, bytes=nbytes,
                   eps=eps, m_half=mh, peak=peak, dist=dist,
                   )


def _imb_predict(form: str, floor: bool):
    def predict(v, d):
        eff = laws.ramp(d["num_tokens"], d["eps"], d["m_half"])
        compute = laws.compute_time(d["flops"] * v["moe_routing_imbalance_median"], d["peak"],
                                    eff)
        memory = laws.memory_time(d["bytes"], v["hbm_bytes_per_s"] * v["hbm_derate"])
        t = jnp.maximum(compute, memory) if form == "max" else compute + memory
        return t + v["moe_call_floor"] if floor else t
    return predict


def fit_moe_imbalance(obs, chip_doc, ramps: dict, hbm_derate: float, *, chip: str,
            dtypes: tuple[str, ...] = ("bf16",), heldout: float = 0.2, seed: int = 0,
            steps: int = 1500, lr: float = 0.05, delta: float = 0.05) -> PrimitiveFit:
    """Fit ``moe_routing_imbalance_median`` of one chip under the spec's routed law
    (step.md §6.2: the step-level token ramp, the whole expert FLOPs), the constant the edges
    price with, on ``moe_tp = 1`` rows of vLLM's kernels (the module docstring).

    ``ramps``: ``{dtype: {"eps_max", "m_half", ...}}`` as the chip ships them;
    ``hbm_derate``: the chip's derate. ``dtypes``: the MoE dtypes fitted (default bf16:
    the quantised fused-MoE kernels of the tables stream their weights several times slower
    than the GEMMs do, which a FLOP multiplier cannot describe; they are reported).
    """
    t0 = time.perf_counter()
    keep, _ = _kernel_mask(obs, chip)
    obs = obs.select(keep & np.isin(obs.dtype, list(ramps)))
    usable = [s for s in ramps if s in MOE_WEIGHT_BYTES and peak_for(chip_doc, s) > 0]
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
    rows = _imb_rows(data, chip_doc, ramps, dists)
    main = np.isin(data.dtype, fitted) & (data.moe_tp == 1)
    if not main.any():
        raise ValueError(f"{obs.source}: no MoE rows with moe_tp = 1 of dtype "
                         f"{', '.join(fitted)}")
    fixed = {"hbm_bytes_per_s": chip_doc.hbm_tbs * 1e12, "hbm_derate": hbm_derate}
    params = (Param("moe_routing_imbalance_median", 1.0),
              Param("moe_call_floor", 20e-6, units="us_per_transfer", written=False))
    prob = Problem(params, _imb_predict("max", True), _subset(rows, main & ~held),
                   _subset(rows, main & held), fixed=fixed)
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    whole = Problem(params, _imb_predict("max", True), _subset(rows, ~held), _subset(rows, held),
                    fixed)
    variants = {"fitted": (whole, sol.values),
                "fitted, as shipped (no call floor)": (
                    Problem(params, _imb_predict("max", False), whole.fit_rows, whole.held_rows,
                            fixed), sol.values)}
    ref = REFERENCE.get(chip, {})
    ref_ramps = reference_ramps(chip)
    if ref.get("imbalance") is not None and all(s in ref_ramps for s in usable):
        rrows = _imb_rows(data, chip_doc, ref_ramps, dists)
        rprob = Problem((), _imb_predict("sum", False), _subset(rrows, ~held), _subset(rrows, held),
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
    return PrimitiveFit("moe_imbalance", chip, params, sol.values, written, errors,
                        {"moe_routing_imbalance_median": f"{label}, moe_tp = 1 (fitted)"},
                        sol.laplace, str(obs.source), str(obs.sha256), len(prob.fit_rows["flops"]),
                        len(prob.held_rows["flops"]), dict(obs.skipped), notes,
                        time.perf_counter() - t0, [])


def _slices(fo, ho, families, dists) -> dict:
    both = lambda fn: (fn(fo), fn(ho))  # noqa: E731
    out = {"all fitted rows": both(lambda o: np.ones(len(o), bool))}
    for f in families:
        out[f"{f} family"] = both(lambda o, f=f: np.array([MOE_FAMILY.get(s) == f
                                                           for s in o.dtype]))
    out["tokens ≤ 32"] = both(lambda o: o.num_tokens * o.moe_ep <= 32)
    out["tokens 48–512"] = both(lambda o: (o.num_tokens * o.moe_ep > 32)
                                & (o.num_tokens * o.moe_ep <= 512))
    out["tokens ≥ 2048"] = both(lambda o: o.num_tokens * o.moe_ep >= 2048)
    out["moe_tp = 1, moe_ep = 1"] = both(lambda o: (o.moe_tp == 1) & (o.moe_ep == 1))
    out["moe_tp > 1"] = both(lambda o: o.moe_tp > 1)
    out["moe_ep > 1"] = both(lambda o: o.moe_ep > 1)
    for dname in dists:
        out[dname] = both(lambda o, d=dname: o.distribution == d)
    for name, (h, i, e, k) in MOE_SHAPES.items():
        sel = lambda o, h=h, i=i, e=e, k=k: ((o.hidden == h) & (o.inter == i)  # noqa: E731
                                             & (o.experts == e) & (o.topk == k))
        m = both(sel)
        if m[0].any() or m[1].any():
            out[name] = m
            out[f"{name}, tokens ≤ 64"] = both(lambda o, sel=sel: sel(o)
                                               & (o.num_tokens * o.moe_ep <= 64))
    return out


def _plots(prob, preds, fo, ho):
    out = []
    dists = set(fo.distribution.tolist()) | set(ho.distribution.tolist())
    dist = "power_law_1.2" if "power_law_1.2" in dists else min(dists, default="")
    for name, tp in (("Llama-4-Scout", 2), ("Qwen3-30B-A3B", 1)):
        h, i, e, k = MOE_SHAPES[name]
        for dtype in ("fp8_block", "bf16"):
            mf, mh = [(o.hidden == h) & (o.inter == i) & (o.experts == e) & (o.topk == k)
                      & (o.dtype == dtype) & (o.moe_ep == 1) & (o.moe_tp == tp)
                      & (o.distribution == dist) for o in (fo, ho)]
            ps = plot_series(f"MoE {dtype}: {name} experts (H {h}, I {i}, top-{k} of {e}, "
                             f"tp {tp}, {dist})", prob, preds, mf, mh, "num_tokens", "tokens")
            if ps is not None:
                out.append(ps)
                break
    return out
