"""The whole-chip profile fit: every primitive of one chip, in dependency order.

:func:`fit_chip` runs every primitive of one chip (``python -m jkernel.calibration
profiles``): the GEMM ramp and HBM derate (:mod:`~jkernel.calibration.fit.gemm`), decode and
prefill attention (:mod:`~jkernel.calibration.fit.attention`), MoE routing imbalance
(:mod:`~jkernel.calibration.fit.moe`) and the collectives
(:mod:`~jkernel.calibration.fit.collectives`), in that order, since attention prefill and
MoE are priced through the GEMM ramp the chip will ship. The shared machinery lives in
:mod:`jkernel.calibration.fit.base`; the tables come from
:func:`jkernel.calibration.data.profiles.load_chip`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..data.profiles import CATALOG_NAMES, load_chip, profile_folder
from . import attention, collectives, gemm, moe
from .base import REFERENCE_HBM_DERATE, PrimitiveFit, chip_document, subsample

__all__ = ["ChipFit", "FitSettings", "fit_chip"]


@dataclass
class ChipFit:
    """Every primitive fitted for one chip (``fit_chip``)."""

    chip: str
    profile_dir: str
    data_dir: str
    fits: list[PrimitiveFit]
    seconds: float
    notes: list[str] = field(default_factory=list)
    unloaded: tuple[str, ...] = ()

    def get(self, primitive: str) -> PrimitiveFit | None:
        for f in self.fits:
            if f.primitive == primitive:
                return f
        return None

    def written(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.fits:
            out.update(f.written)
        return out


@dataclass(frozen=True)
class FitSettings:
    """Knobs of :func:`fit_chip` (defaults are those of the shipped catalog)."""

    heldout: float = 0.2
    seed: int = 0
    steps: int = 1500
    lr: float = 0.05
    delta: float = 0.05
    max_rows: int | None = 200_000
    shape_aware: str = "auto"           # "auto" | "on" | "off"
    allreduce: str = "nccl"             # "nccl" | "vllm" (custom all-reduce below 8 MiB)
    kernel_gap: bool = False            # write the GEMM per-call floor as kernel_gap
    primitives: tuple[str, ...] = ("gemm", "decode_attention", "prefill_attention", "moe",
                                   "collectives")


def fit_chip(data_dir: str | Path, chip: str, *, settings: FitSettings = FitSettings(),
             catalog: str | Path | None = None,
             progress: Callable[[str], None] | None = None) -> ChipFit:
    """Fit every primitive of ``chip`` (a catalog name, e.g. ``h100``) from the
    AIConfigurator tables under ``data_dir`` (``<data_dir>/<profile dir>/...``).

    A primitive whose table is missing is skipped with a note; a table that fails to load
    raises :class:`jkernel.calibration.data.profiles.ProfileError` naming the file.
    """

    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    name = CATALOG_NAMES.get(chip, chip)
    doc = chip_document(name, catalog)
    data_dir, folder = profile_folder(data_dir, name)
    say(f"[{name}] loading profiles from {Path(data_dir) / folder}")
    profiles = load_chip(data_dir, folder)
    fits: list[PrimitiveFit] = []
    notes: list[str] = []
    root = Path(data_dir)

    def rel(obs) -> str:
        out = []
        for s in str(obs.source).split(";"):
            try:
                out.append(Path(s).resolve().relative_to(root.resolve()).as_posix())
            except ValueError:
                out.append(s)
        return ";".join(out)

    kw = dict(heldout=settings.heldout, seed=settings.seed, steps=settings.steps,
              lr=settings.lr, delta=settings.delta)

    def run(key: str, obs, label: str, missing: str, fit: Callable[[], PrimitiveFit], *,
            rows: str | None = None, source: str | None = None) -> PrimitiveFit | None:
        """One primitive (``key`` of ``settings.primitives``) on its table ``obs``: a note
        when the table is absent, else the fit, with its source and timing reported."""
        if key not in settings.primitives:
            return None
        if obs is None:
            notes.append(missing)
            return None
        say(f"[{name}] {label}: {rows or f'{len(obs)} rows'}")
        f = fit()
        f.source = source if source is not None else rel(obs)
        fits.append(f)
        say(f"[{name}] {label} done in {f.seconds:.1f} s: {_summary(f)}")
        return f

    g = run("gemm", profiles.gemm, "GEMM", "no GEMM table: GEMM ramp and HBM derate not fitted",
            lambda: gemm.fit_gemm(subsample(profiles.gemm, settings.max_rows), doc, chip=name,
                                  shape_aware=settings.shape_aware,
                                  kernel_gap=settings.kernel_gap, **kw))
    ramp = gemm.shipped_ramps(g) if g is not None else gemm.reference_ramps(name, doc)
    derate = g.written.get("hbm_derate", REFERENCE_HBM_DERATE) if g is not None \
        else REFERENCE_HBM_DERATE
    run("decode_attention", profiles.decode_attention, "decode attention",
        "no decode attention table: decode floors and rates not fitted",
        lambda: attention.fit_decode_attention(
            subsample(profiles.decode_attention, settings.max_rows), doc, chip=name, **kw))
    run("prefill_attention", profiles.prefill_attention, "prefill attention",
        "no prefill attention table: prefill floor and work scale not fitted",
        lambda: attention.fit_prefill_attention(
            subsample(profiles.prefill_attention, settings.max_rows), doc, ramp["bf16"],
            chip=name, **kw))
    imb = run("moe", profiles.moe, "MoE (spec law)", "no MoE table: routing imbalance not "
              "fitted", lambda: moe.fit_moe_imbalance(subsample(profiles.moe, settings.max_rows),
                                                      doc, ramp, derate, chip=name, **kw))
    run("moe", profiles.moe, "fused MoE", "no MoE table: fused-MoE law not fitted",
        lambda: moe.fit_moe(subsample(profiles.moe, settings.max_rows), doc, ramp, derate,
                            chip=name, imbalance=(imb.written["moe_routing_imbalance_median"]
                                                  if imb is not None else None), **kw))
    custom = profiles.custom_allreduce
    nccl_rows = nccl_source = None
    if profiles.nccl is not None:
        nccl_rows = f"{len(profiles.nccl)} NCCL rows" + (
            f", {len(custom)} custom all-reduce rows" if custom is not None else "")
        nccl_source = rel(profiles.nccl) + (
            ";" + rel(custom) if custom is not None and settings.allreduce == "vllm" else "")
    run("collectives", profiles.nccl, "collectives",
        "no NCCL table: collectives not fitted (the catalog keeps its entries for this chip)",
        lambda: collectives.fit_collectives(profiles.nccl, chip=name, custom=custom,
                                            allreduce=settings.allreduce, **kw),
        rows=nccl_rows, source=nccl_source)
    return ChipFit(name, folder, str(data_dir), fits, time.perf_counter() - t0, notes,
                   profiles.unloaded)


def _summary(f: PrimitiveFit) -> str:
    rows = [r for r in f.errors if r.variant == f.primary]
    if not rows:
        return "no error rows"
    r = rows[0]
    return f"held-out |log ratio| median {r.held.median:.3f}, p90 {r.held.p90:.3f} ({r.slice})"


