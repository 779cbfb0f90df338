"""Per-chip check of the fitted primitives against the per-operator profiles: held-out error
of a catalog's constants, under the law ``expected_s`` prices each primitive with, per chip.

    python -m validation.primitives --data ../shared/data/aic-op-profiles \
        [--before OLD_CATALOG] [--markdown]

For every profiled chip (``jkernel.calibration.regenerate.CHIPS``) and primitive, the rows a
fit keeps out (``jkernel.calibration.data.heldout``: 20 % by a hash of the row's shape, seed
0, the split every fit uses) are priced with the catalog's constants for the chip and
scored by the median |log(predicted / measured)|:

* ``gemm <dtype>``: one GEMM kernel, ``max(compute, memory)`` at the chip's ramp (the
  shape-aware one where the catalog states ``gemm_n_half_<dtype>``), no per-call floor
  (``kernel_gap`` is 0 until a step-trace fit): every row of the dtype;
* ``decode attention``: bf16-KV rows of vLLM's decode kernel on the chip
  (``jkernel.calibration.fit.attention.DECODE_KERNELS``), unwindowed and windowed (the
  ``_swa`` pair where stated), by :func:`jkernel.laws.decode_attention_time` (the row floor
  absent: step.md §6.3's floor + bytes/rate);
* ``prefill attention``: unwindowed bf16-KV rows of vLLM's prefill kernel
  (``PREFILL_KERNELS``), at the chip's bf16 token ramp;
* ``fused MoE``: rows of vLLM's fused-MoE kernels
  (``jkernel.calibration.fit.moe.MOE_KERNELS``) by ``expected_s``'s routed term: the
  fused-MoE law where the catalog states its constants, else ``max(compute, memory)`` at
  the step-level ramp with the whole expert FLOPs and the routing imbalance.

``--before`` adds the same table for another catalog (e.g. the catalog before a
regeneration, ``git archive`` of an older commit) beside it. Nothing is written. A dataset
study, run from the repository root; a few minutes (loading the tables dominates).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

__all__ = ["chip_values", "score_chip", "table", "main"]


def chip_values(chip: str, catalog: Path) -> dict[str, float]:
    """The SI values of every coefficient the catalog's sets state for ``chip`` (hardware
    scope naming it or unscoped; the last applicable entry wins, as selection does)."""
    from jkernel.catalog import COEFFICIENT_SETS
    from jkernel.documents.coefficients import load_coefficient_set
    from jkernel.params import si_scale

    out: dict[str, float] = {}
    for s in COEFFICIENT_SETS:
        path = Path(catalog) / "coefficients" / f"{s}.yaml"
        if not path.exists():
            continue
        for e in load_coefficient_set(path).entries:
            sc = e.scope
            if sc.model or sc.tp or sc.ep or sc.nodes_spanned:
                continue
            if sc.hardware is None or chip in {h.lower() for h in sc.hardware}:
                out[e.name] = e.value * si_scale(e.name)
    return out


def _stat(pred, meas) -> tuple[float, int]:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    if pred.size == 0:
        return float("nan"), 0
    r = np.abs(np.log(pred) - np.log(meas))
    r = np.where(np.isfinite(r), r, np.inf)
    return float(np.median(r)), int(pred.size)


def _gemm(obs, doc, v) -> dict[str, tuple[float, int]]:
    from jkernel import laws
    from jkernel.calibration.fit.gemm import ACTIVATION_BYTES, WEIGHT_BYTES, peak_for

    out = {}
    held = obs.held_mask(0.2, 0)
    for s in ("bf16", "fp8", "nvfp4"):
        m = held & (obs.dtype == s)
        if not m.any() or peak_for(doc, s) <= 0 or f"gemm_eps_max_{s}" not in v:
            continue
        mm, n, k = (obs.m[m].astype(float), obs.n[m].astype(float), obs.k[m].astype(float))
        eps, mh = v[f"gemm_eps_max_{s}"], v[f"gemm_m_half_{s}"]
        if f"gemm_n_half_{s}" in v:
            eff = laws.eff_shaped(mm, n, k, eps, mh, v[f"gemm_n_half_{s}"], v[f"gemm_k_half_{s}"])
        else:
            eff = laws.ramp(mm, eps, mh)
        c, w = laws.gemm_times(mm, n, k, n * k * WEIGHT_BYTES[s], peak_for(doc, s),
                               doc.hbm_tbs * 1e12 * v["hbm_derate"], eff, ACTIVATION_BYTES)
        pred, meas = np.maximum(c, w), obs.latency_s[m]
        out[f"gemm {s}"] = _stat(pred, meas)
        big = (n >= 1024) & (k >= 1024)
        out[f"gemm {s}, n and k ≥ 1024"] = _stat(pred[big], meas[big])
        small = big & (mm <= 64)
        out[f"gemm {s}, n and k ≥ 1024, m ≤ 64"] = _stat(pred[small], meas[small])
    return out


def _decode(obs, chip, v) -> dict[str, tuple[float, int]]:
    from jkernel import laws
    from jkernel.calibration.fit.attention import DECODE_KERNELS, DECODE_KV_DTYPE

    held = obs.held_mask(0.2, 0)
    use = held & (obs.kv_dtype == DECODE_KV_DTYPE)
    if chip in DECODE_KERNELS and np.any(obs.kernel == DECODE_KERNELS[chip]):
        use &= obs.kernel == DECODE_KERNELS[chip]
    sub = obs.select(use)
    swa = sub.window > 0
    floor = np.where(swa & ("attention_decode_rate_swa" in v),
                     v.get("attention_decode_floor_swa", v["attention_decode_floor"]),
                     v["attention_decode_floor"])
    rate = np.where(swa & ("attention_decode_rate_swa" in v),
                    v.get("attention_decode_rate_swa", 0.0), v["attention_decode_rate"])
    pred = laws.decode_attention_time(sub.kv_bytes, sub.batch_size * sub.n_kv.astype(float),
                                      floor, rate, v.get("attention_decode_row_floor", 0.0),
                                      v.get("attention_decode_overlap", 1.0))
    pred = np.asarray(pred)
    return {"decode attention": _stat(pred, sub.latency_s),
            "decode, batch ≤ 256, context ≥ 256": _stat(
                pred[(sub.batch_size <= 256) & (sub.ctx_tokens >= 256)],
                sub.latency_s[(sub.batch_size <= 256) & (sub.ctx_tokens >= 256)]),
            "decode, KV read ≥ 200 MB": _stat(pred[sub.kv_bytes >= 2e8],
                                              sub.latency_s[sub.kv_bytes >= 2e8])}


def _prefill(obs, chip, doc, v) -> dict[str, tuple[float, int]]:
    from jkernel import laws
    from jkernel.calibration.fit.attention import (DECODE_KV_DTYPE, PREFILL_KERNELS,
                                                   prefill_work)

    held = obs.held_mask(0.2, 0) & (obs.window == 0) & (obs.kv_dtype == DECODE_KV_DTYPE)
    if chip in PREFILL_KERNELS and np.any(held & (obs.kernel == PREFILL_KERNELS[chip])):
        held &= obs.kernel == PREFILL_KERNELS[chip]
    sub = obs.select(held)
    work, tokens = prefill_work(sub)
    eff = laws.ramp(tokens, v["gemm_eps_max_bf16"], v["gemm_m_half_bf16"])
    pred = laws.prefill_attention_time(work, v["attention_prefill_floor"],
                                       doc.bf16_peak_tflops * 1e12, eff,
                                       v["attention_prefill_work_scale"])
    return {"prefill attention": _stat(pred, sub.latency_s)}


def _moe(obs, chip, doc, v) -> dict[str, tuple[float, int]]:
    from jkernel import laws
    from jkernel.calibration.fit.gemm import peak_for
    from jkernel.calibration.fit.moe import MOE_FAMILY, _kernel_mask, moe_work

    keep, _ = _kernel_mask(obs, chip)
    fam = np.array([MOE_FAMILY.get(s, "") for s in obs.dtype])
    ok = np.array([bool(f) and peak_for(doc, f) > 0 and f"gemm_eps_max_{f}" in v
                   for f in fam])
    m = keep & ok & obs.held_mask(0.2, 0)
    if not m.any():
        return {}
    sub = obs.select(m)
    f = fam[m]
    work = moe_work(sub)
    peak = np.array([peak_for(doc, x) for x in f])
    bw = doc.hbm_tbs * 1e12 * v["hbm_derate"]
    floor = np.array([v.get(f"moe_kernel_floor_{x}", 0.0) for x in f])
    fused = any(v.get(n, 0.0) > 0 for n in ("moe_m_half", "moe_assignment_time")) \
        or floor.max() > 0
    if fused:
        pred = laws.routed_expert_time(work["flops"], work["bytes"], work["assignments"],
                                       work["touched"], peak, bw, floor,
                                       v.get("moe_m_half", 0.0),
                                       v.get("moe_assignment_time", 0.0), 1.0)
    else:
        eps = np.array([v[f"gemm_eps_max_{x}"] for x in f])
        mh = np.array([v[f"gemm_m_half_{x}"] for x in f])
        eff = laws.ramp(sub.num_tokens * sub.moe_ep, eps, mh)
        imb = v.get("moe_routing_imbalance_median", 1.0)
        compute = laws.compute_time(work["flops"] * sub.moe_tp * imb, peak, eff)
        pred = np.maximum(compute, laws.memory_time(work["bytes"], bw))
    pred = np.asarray(pred)
    small = sub.num_tokens * sub.moe_ep <= 32
    return {"fused MoE": _stat(pred, sub.latency_s),
            "fused MoE, tokens ≤ 32": _stat(pred[small], sub.latency_s[small])}


def score_chip(data: Path, chip: str, catalogs: dict[str, Path]) -> dict[str, dict]:
    """``{primitive: {catalog label: (median |log ratio|, rows)}}`` for one chip."""
    import jkernel
    from jkernel.calibration.data.profiles import load_chip, profile_folder
    from jkernel.calibration.fit.base import chip_document

    jkernel.enable_x64()
    root, folder = profile_folder(data, chip)
    prof = load_chip(root, folder)
    out: dict[str, dict] = {}
    for label, cat in catalogs.items():
        v = chip_values(chip, cat)
        doc = chip_document(chip, cat)
        parts = {}
        if prof.gemm is not None:
            parts.update(_gemm(prof.gemm, doc, v))
        if prof.decode_attention is not None:
            parts.update(_decode(prof.decode_attention, chip, v))
        if prof.prefill_attention is not None:
            parts.update(_prefill(prof.prefill_attention, chip, doc, v))
        if prof.moe is not None:
            parts.update(_moe(prof.moe, chip, doc, v))
        for name, stat in parts.items():
            out.setdefault(name, {})[label] = stat
    return out


def table(scores: dict[str, dict[str, dict]], labels) -> str:
    """Markdown: one row per (chip, primitive), one column per catalog."""
    head = "| chip | primitive | held-out rows | " + " | ".join(labels) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(labels)]
    for chip, prims in scores.items():
        for name, by in prims.items():
            rows = max(n for _, n in by.values())
            cells = [f"{by[lab][0]:.3f}" if lab in by else "–" for lab in labels]
            lines.append(f"| {chip} | {name} | {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from jkernel.calibration.regenerate import CHIPS
    from jkernel.catalog import catalog_root

    ap = argparse.ArgumentParser(prog="python -m validation.primitives", description=__doc__
                                 .split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the aic-op-profiles folder")
    ap.add_argument("--before", help="another catalog root to score beside the shipped one")
    ap.add_argument("--chips", default=",".join(CHIPS))
    a = ap.parse_args(argv)
    catalogs = {}
    if a.before:
        catalogs["before"] = Path(a.before)
    catalogs["shipped"] = catalog_root()
    scores = {}
    for chip in [c for c in a.chips.split(",") if c]:
        print(f"[{chip}] scoring", file=sys.stderr, flush=True)
        scores[chip] = score_chip(Path(a.data), chip, catalogs)
    print(table(scores, list(catalogs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
