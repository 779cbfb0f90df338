"""Regenerate the shipped catalog's calibrated coefficients from the profiles.

::

    python -m jkernel.calibration.regenerate --data ../shared/data/aic-op-profiles

1. **Fitted chips** (``h100``, ``h200``, ``b200``, ``b300``, ``l40s``, ``a100-sxm``): every
   primitive is fitted with :func:`jkernel.calibration.fit.chip.fit_chip` (the same fit as
   ``python -m jkernel.calibration profiles``) and its entries (``method: fitted``, with data
   source, sha256, rows, held-out error, standard error) replace, in the standard sets of
   ``catalog/coefficients/`` (:data:`jkernel.catalog.COEFFICIENT_SETS`), the entries of the
   same name for that chip. ``a100-sxm``'s entries are scoped to its alias ``a100-80`` too,
   and its collectives are also written under ``a100-80``'s names (``method: derived``, the
   same part). ``l40s`` has no NCCL table: its collectives are kept.
2. **16-rank collectives** (no sweep is wider than 8): re-derived from the new 4- and 8-rank
   fits by the seed's rule (:func:`jkernel.calibration.fit.collectives.extrapolate_16`: the
   floor continues its 4→8 growth, both rates × 14/15), ``method: derived``.
3. **Chips without profiles** (``method: derived``):

   | chip | source | rule |
   |---|---|---|
   | gb200-nvl72 | b200 (same GB100 die, NVLink 5) | where the spec gives gb200-nvl72 a reference value (documents.md §8.7: GEMM ramps, imbalance, attention), **ratio transfer**: gb200's reference × (b200's fit / b200's reference), which keeps the measured difference between the two parts and carries over the change of law; otherwise b200's fit, with byte rates (attention decode rates) × the HBM bandwidth ratio 8.0/7.7; collectives: b200's, renamed |
   | gb300 | b300 (same Blackwell Ultra die, NVLink 5) | b300's fit, byte rates × 8.0/7.75; collectives: b300's, renamed |

   A transferred ε_max is capped at 0.999.

   **Chips of another part** (:data:`PORTED`, ``method: derived``): a chip without profiles
   whose kernels are those of a profiled chip of another die (its source) takes the source's
   fit through the two figures that differ, its compute-to-bandwidth ridge and its memory
   bandwidth (:func:`ported_entries`):

   | entry | rule |
   |---|---|
   | ``gemm_m_half_<s>``, ``moe_m_half`` | the source's × ridge(target)/ridge(source), ridge = the dtype's peak / BwPeakTBs (bf16 for ``moe_m_half``): the ramp's half-width is a width in units of the ridge, since at small m a GEMM is memory-bound exactly while 2·m½/(P·ε_max) < w/B, so a width copied to a chip with a lower ridge (rtx-4090 from l40s: 164 against 419 FLOP/B) would price its decode GEMMs compute-bound |
   | decode rates (``attention_decode_rate*``) | the source's × BwPeakTBs(target)/BwPeakTBs(source) |
   | ``attention_decode_row_floor``, ``moe_assignment_time`` | the source's × BwPeakTBs(source)/BwPeakTBs(target) (a row's smallest key tile, an assignment's activations: bytes) |
   | floors (µs), ε_max, n½, k½, ``hbm_derate``, the imbalance, the prefill work scale, the overlap order | the source's (times and fractions of the chip's own peak or bandwidth) |

   A name with a dtype the target has no peak for is not written. Collectives, the host
   link and the other entries the fit does not produce are kept as they are.

The GEMM fit's per-call floor is reported; with ``--kernel-gap`` it is also written as
``kernel_gap`` (``cost-model-host-overheads``, per chip), see
:mod:`jkernel.calibration.fit.gemm`. Entries the fit does not produce (host overheads, memory
magnitudes, recurrent laws, the host link, l40s collectives, ``kernel_gap`` / ``host_serial``
by default) are kept as they are. Replacement rule: an existing entry of the same name whose
hardware scope names the chip, and whose engine versions (every version when unscoped) meet
the new entry's, loses the chip from its list (and is dropped when nothing is left) but keeps
it for its versions outside the new entry's (a step-trace fit at vLLM 0.23 stays for 0.23
when a serving fit at 0.15 writes the versions before it); the new entry takes its place in
file order; a name not present is appended. Entries of one name
and chip for disjoint engine versions live side by side. Each file's comment header is
kept, with a note.

4. **Step-trace constants** (``--steps``, the residency-vllm data root): the two measured
   vLLM runs on one H100 (:data:`STEP_RUNS`) are imported
   (:mod:`jkernel.calibration.data.residency`) and
   :func:`jkernel.calibration.fit.stepfit.calibrate_steps` fits the engine-level constants
   (``host_serial``, ``host_serial_per_request`` → ``cost-model-host-overheads``,
   ``compute_derate`` → ``cost-model-primitives``), written for ``h100`` by the same
   replacement rule (``regenerate_steps``).

5. **Serving constants** (``--serving MANIFEST --serving-data DIR``): every deployment class
   (chip, engine version) of the run manifest with fit runs is fitted by
   :func:`jkernel.calibration.fit.serving.fit_serving` (the front end only where stage 4's
   step traces measured the class's step constants); what the catalog takes of each fit
   (:meth:`~jkernel.calibration.fit.serving.ServingFit.taken`: the front end where the fit
   pins it, step constants only where the fitted ITLs scatter at most
   :data:`~jkernel.calibration.fit.serving.ACCEPT_SIGMA` around it) is written
   scoped by chip and engine version (front-end constants for every chip of the catalog),
   each entry with the deployments it was fitted on (``fitted_on``). Then, per class with
   runs on the client's clock, the API server's work per request and per streamed token
   (:func:`jkernel.calibration.fit.api_server.refit_with_api_server`: a grid of replays at
   the fitted constants; where the groups keep the work, the class is fitted again with it),
   written for every chip and the class's engine versions, 0 where none is kept.
   ``host_completion`` is measured from the residency runs' chunk times (``--steps`` or
   ``DIR/residency-vllm``).
   The report goes to ``--reports``/serving.md. After the primitive laws change, this stage
   and stage 4 are the refit:
   ``python -m jkernel.calibration.regenerate --steps ../shared/data/residency-vllm
   --serving validation/serving-runs.yaml --serving-data ../shared/data``.

Afterwards every scenario of ``catalog/scenarios`` is opened (``jkernel.open``, or
``jkernel.open_pool`` per pool of a disaggregated one) and prices a batch; a failure is
reported and the exit status is 1. Reports (Markdown and plots) of each chip's fit go to
``--reports`` (default ``build/calibration``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from jkernel.atomic import write_text
from jkernel.documents.coefficients import (CoefficientSet, Entry, FittedOn, Scope,
                                            load_coefficient_set)
from jkernel.params import si_scale

from jkernel.catalog import COEFFICIENT_SETS

from .data.residency import import_residency
from .fit.base import REFERENCE, chip_document
from .fit.chip import ChipFit, FitSettings, fit_chip
from .fit.collectives import Fit, extrapolate_16
from .fit.stepfit import StepCalibration, calibrate_steps
from .report.coefficients import (catalog_yaml, make_entry, profile_entries, round_sig,
                                  set_for, step_entries)
from .report.markdown import profile_report
from .report.plots import save_plots

__all__ = ["CHIPS", "ALIASES", "DERIVED", "PORTED", "STEP_RUNS", "STEP_FITTED_ON",
           "FRONT_END_FIT", "merge_entries", "derived_entries", "ported_entries",
           "sixteen_rank_entries", "regenerate", "calibrate_step_runs", "regenerate_steps",
           "regenerate_serving", "front_end_only", "front_end_chips",
           "check_scenarios", "main"]

CHIPS = ("h100", "h200", "b200", "b300", "l40s", "a100-sxm")
ALIASES = {"a100-sxm": ("a100-80",)}
DERIVED = {"gb200-nvl72": "b200", "gb300": "b300"}
#: Chips without profiles priced through a profiled chip of another die (module docstring,
#: rule 3): the Ada workstation card and the L4 run l40s's sm_89 kernels; the RTX PRO 6000
#: (sm_120) runs the same FlashAttention-2 and Triton kernel family.
PORTED = {"rtx-4090": ("l40s", "GeForce RTX 4090: the AD102 die of l40s with 128 of its "
                               "SMs, GDDR6X, PCIe Gen4 x16"),
          "rtx-pro-6000": ("l40s", "RTX PRO 6000 Blackwell (GB202, sm_120): vLLM runs the "
                                   "sm_80 FlashAttention-2 build and Triton kernels on it, "
                                   "as on l40s"),
          "l4": ("l40s", "L4: the AD104 die, sm_89, the kernels of l40s")}
_NOTE = ("# Calibrated entries (method fitted / derived) were regenerated by "
         "`python -m jkernel.calibration.regenerate`\n# (see jkernel/calibration/regenerate.py for "
         "the rules).\n")


# --------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------

def _hw(e: Entry) -> tuple[str, ...] | None:
    s = e.scope
    if s.model is not None or s.tp is not None or s.ep is not None or s.nodes_spanned is not None:
        return None
    return s.hardware


def _versions_meet(a, b) -> bool:
    """Whether two engine-version scopes (None: every version) share a version."""
    if a is None or b is None:
        return True
    from jkernel.documents.scenario import parse_version as pv

    lo = max(pv(a.first), pv(b.first))
    his = [pv(x.before) for x in (a, b) if x.before is not None]
    return not his or lo < min(his)


def _versions_outside(a, b) -> list:
    """The engine versions of scope ``a`` (None: every version) outside scope ``b``, as at
    most two ranges (below ``b`` and from its end on)."""
    from jkernel.documents.coefficients import VersionRange
    from jkernel.documents.scenario import parse_version as pv

    from .fit.serving import OLDEST

    if b is None:
        return []
    first = OLDEST if a is None else a.first
    before = None if a is None else a.before
    out = []
    if pv(first) < pv(b.first):
        end = b.first if before is None or pv(b.first) < pv(before) else before
        out.append(VersionRange(first, end))
    if b.before is not None and (before is None or pv(b.before) < pv(before)):
        out.append(VersionRange(max(first, b.before, key=pv), before))
    return out


def merge_entries(existing: Iterable[Entry], new: Iterable[Entry]) -> list[Entry]:
    """``existing`` with ``new`` merged in by the replacement rule of the module docstring."""
    out = list(existing)
    for e in new:
        H = {h.lower() for h in e.scope.hardware or ()}
        result: list[Entry] = []
        placed = False
        for old in out:
            hw = _hw(old)
            if old.name == e.name and hw and H & {h.lower() for h in hw} \
                    and _versions_meet(old.scope.engine_version, e.scope.engine_version):
                rest = tuple(h for h in hw if h.lower() not in H)
                if rest:
                    result.append(replace(old, scope=Scope(
                        hardware=rest, engine_version=old.scope.engine_version)))
                if not placed:
                    result.append(e)
                    placed = True
                mine = tuple(h for h in hw if h.lower() in H)
                for part in _versions_outside(old.scope.engine_version, e.scope.engine_version):
                    result.append(replace(old, scope=Scope(hardware=mine, engine_version=part)))
            else:
                result.append(old)
        if not placed:
            result.append(e)
        out = result
    return out


# --------------------------------------------------------------------------------------
# Derived entries
# --------------------------------------------------------------------------------------

def _reference_of(chip: str, name: str) -> float | None:
    ref = REFERENCE.get(chip)
    if ref is None:
        return None
    for stem, idx in (("gemm_eps_max_", 0), ("gemm_m_half_", 1)):
        if name.startswith(stem):
            g = ref["gemm"].get(name[len(stem):])
            return None if g is None else g[idx]
    table = {"moe_routing_imbalance_median": ("imbalance", None),
             "attention_decode_floor": ("decode", 0), "attention_decode_rate": ("decode", 1),
             "attention_prefill_floor": ("prefill", 0),
             "attention_prefill_work_scale": ("prefill", 1),
             "attention_decode_floor_swa": ("swa", 0), "attention_decode_rate_swa": ("swa", 1)}
    if name not in table:
        return None
    key, idx = table[name]
    v = ref.get(key)
    if v is None:
        return None
    return v if idx is None else v[idx]


def _shown(path) -> str:
    """A path as written into rationales: relative to the working directory (the repository
    root when run as documented, e.g. ``../shared/data/aic-op-profiles``), so the catalog
    does not record one machine's absolute paths."""
    import os
    try:
        return os.path.relpath(Path(path).resolve(), Path.cwd())
    except ValueError:
        return str(path)


def _rekey(name: str, src: str, dst: str) -> str:
    a, b = src.replace("-", "_"), dst.replace("-", "_")
    return name[: -len(a)] + b if name.endswith(a) else name


def derived_entries(target: str, source: str, source_values: dict[str, float], *,
                    source_fit_note: str, catalog: str | Path | None = None) -> list[Entry]:
    """Entries of a chip without profiles from its source chip's fitted SI values (module
    docstring, rule 3)."""
    tdoc, sdoc = chip_document(target, catalog), chip_document(source, catalog)
    bw = tdoc.hbm_tbs / sdoc.hbm_tbs
    out = []
    for name, v in source_values.items():
        if name.startswith("collective_"):
            new_name = _rekey(name, source, target)
            value, how = v, (f"{source}'s fitted value: same NVLink 5 at 900 GB/s per GPU, and "
                             "the NVL72 switch keeps these widths on NVLink")
        else:
            new_name = name
            rt, rs = _reference_of(target, name), _reference_of(source, name)
            if rt is not None and rs:
                value = rt * v / rs            # REFERENCE and v are both SI
                how = (f"ratio transfer: the spec's {target} reference {_show(name, rt)} × "
                       f"({source}'s fit {_show(name, v)} / {source}'s reference "
                       f"{_show(name, rs)})")
            elif "_rate" in name and name.startswith("attention_"):
                value = v * bw
                how = (f"{source}'s fit {_show(name, v)} × the HBM bandwidth ratio "
                       f"{tdoc.hbm_tbs}/{sdoc.hbm_tbs}")
            else:
                value = v
                how = f"{source}'s fit (same GPU die)"
            if name.startswith("gemm_eps_max_"):
                value = min(value, 0.999)
        rationale = (f"Derived by jkernel/calibration/regenerate.py: {target} has no "
                     f"per-operator profiles; its GPU is {source}'s die. Value = {how}.")
        out.append(make_entry(new_name, value, hardware=(target,),
                              cite=f"jkernel calibration fit of {source} ({source_fit_note})",
                              sha256="", rows=0, heldout=None, se_si=None, ci_si=None,
                              identifiable=False, rationale=rationale, method="derived"))
    return [_strip_derived(e) for e in out]


def _strip_derived(e: Entry) -> Entry:
    """A derived entry carries no data fields (no sha256, rows or identifiability)."""
    return replace(e, extra=(), sources=((("kind", "model"), *e.sources[0][1:]),))


def _ridge(doc, dtype: str) -> float:
    """The chip's compute-to-bandwidth ridge for a dtype, FLOP per byte (0: no peak)."""
    peak = {"bf16": doc.bf16_peak_tflops, "fp8": doc.fp8_peak_tflops,
            "nvfp4": doc.nvfp4_peak_tflops}.get(dtype, 0.0)
    return peak / doc.hbm_tbs if peak and doc.hbm_tbs else 0.0


def ported_entries(target: str, source: str, source_values: dict[str, float], *,
                   why: str, source_fit_note: str,
                   catalog: str | Path | None = None) -> list[Entry]:
    """Entries of a chip of another part from its source chip's fitted SI values (module
    docstring, rule 3, :data:`PORTED`); collectives are not ported."""
    tdoc, sdoc = chip_document(target, catalog), chip_document(source, catalog)
    bw = tdoc.hbm_tbs / sdoc.hbm_tbs
    out = []
    for name, v in source_values.items():
        if name.startswith("collective_"):
            continue
        dtype = name.rsplit("_", 1)[-1]
        if name.startswith("gemm_") and _ridge(tdoc, dtype) <= 0:
            continue
        if name.startswith("moe_kernel_floor_") and _ridge(tdoc, dtype) <= 0:
            continue
        if name.startswith("gemm_m_half_") or name == "moe_m_half":
            d = "bf16" if name == "moe_m_half" else dtype
            r = _ridge(tdoc, d) / _ridge(sdoc, d)
            value = v * r
            how = (f"{source}'s fit {_show(name, v)} × the {d} ridge ratio "
                   f"{_ridge(tdoc, d):.0f}/{_ridge(sdoc, d):.0f} FLOP/B (peak/BwPeakTBs): the "
                   "half-width in units of the chip's ridge")
        elif name.startswith("attention_") and "_rate" in name:
            value = v * bw
            how = (f"{source}'s fit {_show(name, v)} × the bandwidth ratio "
                   f"{tdoc.hbm_tbs}/{sdoc.hbm_tbs}")
        elif name in ("attention_decode_row_floor", "moe_assignment_time"):
            value = v / bw
            how = (f"{source}'s fit {_show(name, v)} × the bandwidth ratio "
                   f"{sdoc.hbm_tbs}/{tdoc.hbm_tbs} (bytes per row or assignment)")
        else:
            value = v
            how = f"{source}'s fit (a time or a fraction of the chip's own rates, kept)"
        rationale = (f"Derived by jkernel/calibration/regenerate.py (rule 3, ported): {target} "
                     f"has no per-operator profiles; {why}. Value = {how}. Replace with a fit "
                     "of this chip's own profiles.")
        out.append(make_entry(name, value, hardware=(target,),
                              cite=f"jkernel calibration fit of {source} ({source_fit_note})",
                              sha256="", rows=0, heldout=None, se_si=None, ci_si=None,
                              identifiable=False, rationale=rationale, method="derived"))
    return [_strip_derived(e) for e in out]


def _show(name: str, si: float) -> str:
    return f"{round_sig(si / si_scale(name), 4):g}"


def sixteen_rank_entries(values: dict[str, float], chip: str) -> list[Entry]:
    """16-rank collective entries by the seed's rule from 4- and 8-rank SI values."""
    key = chip.replace("-", "_")
    out = []
    ops = sorted({n.split("collective_floor_")[1].split("_fp16_")[0] for n in values
                  if n.startswith("collective_floor_")})
    for op in ops:
        def fit(n):
            names = [f"collective_{p}_{op}_fp16_{n}rank_{key}"
                     for p in ("floor", "peak_rate", "transition_rate")]
            if not all(x in values for x in names):
                return None
            return Fit(values[names[0]], values[names[1]], values[names[2]])
        f4, f8 = fit(4), fit(8)
        if f4 is None or f8 is None:
            continue
        f16 = extrapolate_16(f4, f8)
        growth = max(f8.floor_s / f4.floor_s, 1.0)
        why = (f"Derived by jkernel/calibration/regenerate.py with the seed's rule: no sweep "
               f"is wider than 8 ranks; the floor continues the fitted 4→8 growth "
               f"(×{growth:.3f}) and both rates are the 8-rank fit × 14/15 (NCCL's ring bus-bandwidth correction). "
               "A group this wide usually spans nodes; the kernel prices that crossing with its "
               "span multiplier, so this law describes the NVLink part only.")
        for part, v in (("floor", f16.floor_s), ("peak_rate", f16.peak_per_s),
                        ("transition_rate", f16.transition_per_s)):
            name = f"collective_{part}_{op}_fp16_16rank_{key}"
            e = make_entry(name, v, hardware=(chip,), cite=f"jkernel calibration fit of {chip}'s "
                           f"4- and 8-rank {op}", sha256="", rows=0, heldout=None, se_si=None,
                           ci_si=None, identifiable=False, rationale=why, method="derived")
            out.append(_strip_derived(e))
    return out


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------



def _header(path: Path) -> str:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("#") or not line.strip():
            lines.append(line)
        else:
            break
    text = "".join(lines)
    if _NOTE not in text:
        text = text.rstrip("\n") + ("\n#\n" if text.strip() else "") + _NOTE
    return text


def write_set(path: Path, cs: CoefficientSet) -> None:
    text = catalog_yaml(cs)
    header = _header(path) if path.exists() else _NOTE
    write_text(path, header + text)


def _write_entries(root: Path, entries: Iterable[Entry],
                   say: Callable[[str], None]) -> dict[str, list[str]]:
    """Merge ``entries`` into the catalog's coefficient sets under ``root`` (each into its
    standard set, by the replacement rule); set name → the names written."""
    new: dict[str, list[Entry]] = {}
    for e in entries:
        new.setdefault(set_for(e.name), []).append(e)
    written = {}
    for sname, ents in new.items():
        path = root / "coefficients" / f"{sname}.yaml"
        existing = load_coefficient_set(path).entries if path.exists() else ()
        write_set(path, CoefficientSet(sname, tuple(merge_entries(existing, ents))))
        written[sname] = [e.name for e in ents]
        say(f"{path}: wrote {', '.join(e.name for e in ents)}")
    return written


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------

def check_scenarios(catalog: str | Path | None = None) -> list[tuple[str, str, float | str]]:
    """Open every catalog scenario (each pool of a disaggregated one) and price a batch:
    ``[(scenario, pool, expected_s or the error)]``."""
    import jkernel
    from jkernel.catalog import catalog_root
    from jkernel.documents import load_bundle

    root = Path(catalog) if catalog is not None else catalog_root()
    repos = jkernel.Repos(catalog=root, registry=root) if catalog is not None else None
    batch = jkernel.Batch.from_spec("8x1@1024,1x512@0")
    out = []
    for path in sorted((root / "scenarios").glob("*.yaml")):
        try:
            _, dep = load_bundle(path)
            roles = [p.role for p in dep.pools]
            kernels = ([(r, jkernel.open_pool(path, r, repos)) for r in roles] if len(roles) > 1
                       else [(roles[0], jkernel.open(path, repos))])
            for role, k in kernels:
                est = k.step_time(batch)
                ok = math.isfinite(est.expected_s) and est.expected_s > 0
                out.append((path.stem, role, est.expected_s if ok else
                            f"non-finite expected_s {est.expected_s}"))
        except Exception as exc:  # a refusal or a loader error: report, do not stop
            out.append((path.stem, "?", f"{type(exc).__name__}: {exc}"))
    return out


# --------------------------------------------------------------------------------------
# The whole regeneration
# --------------------------------------------------------------------------------------

def regenerate(data_dir: str | Path, *, catalog: str | Path | None = None,
               chips: Iterable[str] = CHIPS, settings: FitSettings = FitSettings(),
               reports: str | Path | None = "build/calibration",
               progress: Callable[[str], None] | None = None) -> dict:
    """Fit, derive, merge and write (module docstring). Returns a summary dict with the
    chip fits, the entries written per set, and the scenario check."""
    from jkernel.catalog import catalog_root

    say = progress or (lambda m: None)
    root = Path(catalog) if catalog is not None else catalog_root()
    coeff_dir = root / "coefficients"
    new: dict[str, list[Entry]] = {s: [] for s in COEFFICIENT_SETS}
    fits: dict[str, ChipFit] = {}
    t0 = time.perf_counter()
    for chip in chips:
        cf = fit_chip(data_dir, chip, settings=settings, catalog=root, progress=say)
        fits[chip] = cf
        hw = (chip,) + ALIASES.get(chip, ())
        cmd = f"python -m jkernel.calibration.regenerate --data {_shown(data_dir)}"
        for e in profile_entries(cf, hardware=hw, command=cmd):
            if e.name.startswith("collective_"):
                # the chip is part of a collective's name: the alias gets renamed copies
                e = replace(e, scope=Scope(hardware=(chip,)))
            new[set_for(e.name)].append(e)
        values = cf.written()
        coll = {n: v for n, v in values.items() if n.startswith("collective_")}
        for e in sixteen_rank_entries(coll, chip):
            new["cost-model-collectives"].append(e)
        for alias in ALIASES.get(chip, ()):
            for e in derived_entries(alias, chip, coll, catalog=root,
                                     source_fit_note=f"{cf.profile_dir} NCCL sweep"):
                src_name = _rekey(e.name, alias, chip)
                new["cost-model-collectives"].append(replace(e, rationale=(
                    f"Derived by jkernel/calibration/regenerate.py: {alias} is an alias of "
                    f"{chip} (the same part); value = {chip}'s fitted {src_name}.")))
            for e in sixteen_rank_entries({_rekey(n, chip, alias): v for n, v in coll.items()},
                                          alias):
                new["cost-model-collectives"].append(e)
        if reports:
            rdir = Path(reports)
            rdir.mkdir(parents=True, exist_ok=True)
            plots = save_plots(cf.fits, rdir, chip)
            write_text(rdir / f"{chip}.md", profile_report(cf, plots=plots, command=cmd))
    for target, source in DERIVED.items():
        if source not in fits:
            continue
        values = fits[source].written()
        ents = derived_entries(target, source, values, catalog=root,
                               source_fit_note=f"{fits[source].profile_dir} profiles")
        coll = {_rekey(n, source, target): v for n, v in values.items()
                if n.startswith("collective_")}
        ents += sixteen_rank_entries(coll, target)
        for e in ents:
            new[set_for(e.name)].append(e)
    for target, (source, why) in PORTED.items():
        if source not in fits:
            continue
        for e in ported_entries(target, source, fits[source].written(), why=why,
                                catalog=root,
                                source_fit_note=f"{fits[source].profile_dir} profiles"):
            new[set_for(e.name)].append(e)
    written = {}
    for s in COEFFICIENT_SETS:
        if not new[s]:
            continue
        path = coeff_dir / f"{s}.yaml"
        existing = load_coefficient_set(path).entries if path.exists() else ()
        merged = merge_entries(existing, new[s])
        write_set(path, CoefficientSet(s, tuple(merged)))
        written[s] = len(new[s])
        say(f"{path}: {len(new[s])} entries written, {len(merged)} in the set")
    checks = check_scenarios(root)
    bad = [c for c in checks if isinstance(c[2], str)]
    say(f"scenarios: {len(checks) - len(bad)} pools price a batch, {len(bad)} fail")
    return {"fits": fits, "written": written, "checks": checks, "failed": bad,
            "seconds": time.perf_counter() - t0}


#: The residency-vllm runs (relative to its root): the fitted one and the one held out.
STEP_RUNS = ("sweep_rate/agg_2rps", "sweep_tenants/1T_agg_2rps")
#: The deployment of those runs (their step constants' ``fitted_on``).
STEP_FITTED_ON = FittedOn(hardware=("h100",), engine_version=("0.23.0",), model=("qwen3-14b",),
                          tp=(1,))


def calibrate_step_runs(residency_root: str | Path, runs: Sequence[str] = STEP_RUNS, *,
                        progress: Callable[[str], None] | None = None) -> StepCalibration:
    """The step-constant fit of stage 4 (module docstring): ``runs`` (folders under
    ``residency_root``) imported, the first fitted on its first 70 % in time, the others held
    out entirely (:func:`jkernel.calibration.fit.stepfit.calibrate_steps`)."""
    say = progress or (lambda m: None)
    data = Path(residency_root)
    traces = []
    for rel in runs:
        rec = import_residency(data / rel)
        say(f"{rel}: {rec.summary()}")
        traces.append((rel, rec.trace))
    return calibrate_steps(traces[0][1], traces[1:], progress=say)


def regenerate_steps(residency_root: str | Path, *, catalog: str | Path | None = None,
                     hardware: tuple[str, ...] = ("h100",),
                     progress: Callable[[str], None] | None = None) -> dict:
    """Stage 4 of the module docstring. Returns ``{"calibration", "written", "checks",
    "failed"}``."""
    from jkernel.catalog import catalog_root

    say = progress or (lambda m: None)
    root = Path(catalog) if catalog is not None else catalog_root()
    cal = calibrate_step_runs(residency_root, progress=say)
    cite = (f"inference-sim/residency-vllm @ 2641b576: {STEP_RUNS[0]} (fitted) and "
            f"{STEP_RUNS[1]} (held out), vLLM 0.23.0, Qwen3-14B bf16, one H100 80GB")
    cmd = f"python -m jkernel.calibration.regenerate --steps {residency_root}"
    written = _write_entries(root, step_entries(cal, hardware=hardware, cite=cite, command=cmd,
                                                fitted_on=STEP_FITTED_ON), say)
    checks = check_scenarios(root)
    bad = [c for c in checks if isinstance(c[2], str)]
    return {"calibration": cal, "written": written, "checks": checks, "failed": bad}


#: The front-end constants a serving fit takes where step traces already measured the step
#: constants of the deployment class (``front_end_only``).
FRONT_END_FIT = ("host_admission_per_request", "host_admission_per_token")


def front_end_only(kernel) -> bool:
    """Whether the catalog's step constants for this deployment were fitted on step traces
    of it (every one ``fitted`` on the step-trace runs, :data:`STEP_FITTED_ON`, and the
    deployment inside them): then a serving fit of its runs takes only the front end, the
    steps having measured the rest. Step constants an earlier serving fit wrote do not count
    (they are fitted on serving runs): the serving stage fits them again, so that it gives
    the same catalog however often it runs."""
    from .fit.serving import STEP

    prov = {p.name: p for p in kernel.provenance()}
    traced = STEP_FITTED_ON.render()
    return all(n in prov and prov[n].method == "fitted" and prov[n].fitted_on == traced
               and not prov[n].outside for n in STEP)


def _completion_entry(residency_root: Path, hardware: tuple[str, ...], runs: Sequence[str]
                      ) -> Entry | None:
    """``host_completion`` as the clients see it, measured: the gap between a streamed
    request's last token chunk and its final chunk (residency-vllm's per-chunk times), the
    median over the requests of ``runs``. A benchmark client's end-to-end latency ends at
    that final chunk (vLLM bench serve at the last chunk with choices; inference-perf and
    the residency client at the end of the stream: docs/metrics.md), so the replay adds this
    much after the last token, not the engine's teardown."""
    import hashlib

    import numpy as np
    import pandas as pd

    gaps, digests, used = [], [], []
    for rel in runs:
        f = residency_root / rel / "patched" / "trace.itl.csv"
        if not f.is_file():
            continue
        itl = pd.read_csv(f).sort_values(["request_id", "chunk_index"])
        last = itl.groupby("request_id")["timestamp_us"].agg(lambda x: x.iloc[-1] - x.iloc[-2])
        gaps.append(last.to_numpy(float))
        digests.append(hashlib.sha256(f.read_bytes()).hexdigest())
        used.append(rel)
    if not gaps:
        return None
    g = np.concatenate(gaps)
    value = float(np.median(g))
    cite = ("inference-sim/residency-vllm @ 2641b576: " + ", ".join(used)
            + " trace.itl.csv (vLLM 0.23.0, streamed /v1/completions)")
    rationale = (f"Measured: the median gap between a streamed request's last token chunk and "
                 f"its final chunk over {g.size} requests (p90 {np.percentile(g, 90):.0f} µs). "
                 "A benchmark client's end-to-end latency ends at the final chunk "
                 "(docs/metrics.md), so this is what a request's completion adds to it; the "
                 "engine's teardown runs after the response and is not on the client's clock. "
                 "Host CPU work of the API server: one value for every chip. Written by "
                 "python -m jkernel.calibration.regenerate --serving.")
    return Entry("host_completion", round_sig(value), "us_per_request", "measured", True,
                 Scope(hardware=hardware), None,
                 ((("kind", "model"), ("cite", cite), ("role", "primary")),), rationale, None,
                 (("data_sha256", hashlib.sha256(";".join(digests).encode()).hexdigest()),
                  ("rows", int(g.size))),
                 STEP_FITTED_ON)


def front_end_chips(root: str | Path) -> tuple[str, ...] | None:
    """Every chip the catalog at ``root`` prices a front end for (the hardware of its
    ``host_admission_per_request`` entries, in the order first met), or None when it has
    none. The front end is the API server's CPU work, the same on any chip, so the serving
    stage writes each version's front end for all of them. (It took the chips from an entry
    without an engine-version scope; once every entry was scoped by version there was none,
    the stage wrote the fitted chip's entries alone, and the other chips kept a front end an
    earlier fit had given them.)"""
    host = Path(root) / "coefficients" / "cost-model-host-overheads.yaml"
    seen: dict[str, None] = {}
    for e in load_coefficient_set(host).entries if host.exists() else ():
        if e.name == "host_admission_per_request":
            seen.update((h, None) for h in e.scope.hardware or ())
    return tuple(seen) or None


def regenerate_serving(manifest: str | Path, *, data: str | Path | None = None,
                       catalog: str | Path | None = None, sample: int | None = None,
                       residency: str | Path | None = None, reports: str | Path | None = None,
                       progress: Callable[[str], None] | None = None) -> dict:
    """Stage 5 of the module docstring: the serving fit of every deployment class of the
    run manifest with fit runs (:func:`jkernel.calibration.fit.serving.fit_serving`; the
    front end only where step traces measured the class's step constants,
    :func:`front_end_only`), what the catalog takes of them (:meth:`ServingFit.taken`)
    written scoped by chip and engine version (front-end constants for every chip of the
    catalog), ``host_completion`` measured from ``residency``'s chunk times. Returns
    ``{"fits", "written", "checks", "failed", "report"}``."""
    from jkernel.catalog import catalog_root

    from .data.serving import read_manifest
    from .fit.api_server import refit_with_api_server
    from .fit.serving import SAMPLE, fit_classes
    from .report.coefficients import api_server_set, serving_set
    from .report.markdown import serving_report

    say = progress or (lambda m: None)
    root = Path(catalog) if catalog is not None else catalog_root()
    runs = read_manifest(manifest, root=data)
    kernels: dict = {}
    traced = []          # classes whose step constants step traces measured (stage 4)

    def names_for(cls, fit_runs):
        if front_end_only(kernels[fit_runs[0].label]):
            traced.append(cls)
            return FRONT_END_FIT
        return None

    n = SAMPLE if sample is None else sample
    fits = fit_classes(runs, kernels=kernels, names_for=names_for, log=say, sample=n)
    fits, api = refit_with_api_server(fits, kernels, names_for, sample=n, log=say)
    chips = front_end_chips(root)
    cmd = (f"python -m jkernel.calibration.regenerate --serving {manifest}"
           + (f" --serving-data {data}" if data else ""))
    entries = serving_set([f for f in fits if f.accepted], command=cmd,
                          front_end_hardware=chips, step_traced=traced)
    entries += api_server_set(api, command=cmd, hardware=chips)
    if residency is not None and chips:
        done = _completion_entry(Path(residency), tuple(chips), STEP_RUNS)
        if done is not None:
            entries.append(done)
    written = _write_entries(root, entries, say)
    text = serving_report(fits, command=cmd, manifest=str(manifest))
    if reports:
        out = Path(reports) / "serving.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, text)
    checks = check_scenarios(root)
    bad = [c for c in checks if isinstance(c[2], str)]
    return {"fits": fits, "written": written, "checks": checks, "failed": bad, "report": text}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jkernel.calibration.regenerate",
                                 description="Regenerate the catalog's calibrated coefficients.")
    ap.add_argument("--data", help="the aic-op-profiles directory (the profile stages)")
    ap.add_argument("--steps", help="the residency-vllm data root (the step-trace stage)")
    ap.add_argument("--serving", help="a run manifest of serving runs (the serving stage; "
                                      "validation/serving-runs.yaml lists the shared ones)")
    ap.add_argument("--serving-data", help="the folder the manifest's data paths are "
                                           "relative to (the shared data folder)")
    ap.add_argument("--serving-sample", type=int, default=None,
                    help="requests replayed per group after its transient (0: whole runs)")
    ap.add_argument("--catalog", help="catalog root (default: the shipped catalog)")
    ap.add_argument("--chips", default=",".join(CHIPS))
    ap.add_argument("--reports", default="build/calibration",
                    help="folder for the per-chip Markdown reports and plots ('' for none)")
    ap.add_argument("--kernel-gap", action="store_true",
                    help="also write the GEMM per-call floor as kernel_gap")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    def say(m):
        if not a.quiet:
            print(f"[{time.perf_counter() - t0:7.1f} s] {m}", file=sys.stderr, flush=True)
    if not a.data and not a.steps and not a.serving:
        ap.error("give --data (profiles), --steps (step traces), --serving (serving runs)")
    out = {"checks": [], "failed": []}
    if a.data:
        out = regenerate(a.data, catalog=a.catalog, chips=[c for c in a.chips.split(",") if c],
                         settings=FitSettings(kernel_gap=a.kernel_gap),
                         reports=a.reports or None, progress=say)
    if a.steps:
        out = regenerate_steps(a.steps, catalog=a.catalog, progress=say)
    if a.serving:
        out = regenerate_serving(a.serving, data=a.serving_data, catalog=a.catalog,
                                 sample=a.serving_sample, residency=a.steps or (
                                     Path(a.serving_data) / "residency-vllm"
                                     if a.serving_data else None),
                                 reports=a.reports or None, progress=say)
    for name, role, res in out["checks"]:
        status = f"expected_s {res * 1e3:.3f} ms" if not isinstance(res, str) else f"FAILED: {res}"
        print(f"{name:45s} {role:10s} {status}")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
