"""Coefficient-set documents (spec documents.md §8): entries, scopes, selection.

Values are kept in the units the registry states them in (µs, bytes/µs, tokens/µs, bytes);
``params.py`` converts the selected ones to SI units for the step function.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ._strict import Reader, read_yaml_file

__all__ = ["UNITS", "METHODS", "Scope", "Entry", "CoefficientSet", "parse_coefficient_set",
           "load_coefficient_set", "coefficient_set_to_dict", "dump_coefficient_set", "select",
           "EVIDENCED"]

UNITS = ("dimensionless", "us_per_layer", "us_per_request", "us_per_step", "us_per_hop",
         "us_per_transfer", "us_per_load", "us_per_token", "bytes_per_us", "bytes_per_rank",
         "tokens", "sm_count")
METHODS = ("measured", "literature", "vendor_spec", "copied", "assumed", "not_charged",
           "fitted", "derived")
# jkernel's calibration writes `fitted` (by gradient, from profiles or traces) and `derived`
# (by a documented rule from another chip's fit); the spec's six methods are the others.
EVIDENCED = ("measured", "literature", "vendor_spec", "fitted")
SCOPE_KEYS = ("hardware", "model", "tp", "ep", "nodes_spanned")


@dataclass(frozen=True)
class Scope:
    """An entry applies iff every stated dimension lists the deployment's value."""

    hardware: tuple[str, ...] | None = None
    model: tuple[str, ...] | None = None
    tp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    nodes_spanned: tuple[int, ...] | None = None

    def applies(self, hardware: str, model: str, tp: int, ep: int, nodes_spanned: int) -> bool:
        if self.hardware is not None and hardware.lower() not in {h.lower() for h in self.hardware}:
            return False
        if self.model is not None and model.lower() not in {m.lower() for m in self.model}:
            return False
        for got, allowed in ((tp, self.tp), (ep, self.ep), (nodes_spanned, self.nodes_spanned)):
            if allowed is not None and got not in allowed:
                return False
        return True

    def render(self) -> str:
        """Provenance rendering (resolution.md §12.1)."""
        if self.hardware is not None:
            return "hardware: " + ", ".join(self.hardware)
        if self.model is not None:
            return "model: " + ", ".join(self.model)
        return "unscoped"

    def to_dict(self) -> dict:
        return {k: list(getattr(self, k)) for k in SCOPE_KEYS if getattr(self, k) is not None}


@dataclass(frozen=True)
class Entry:
    name: str
    value: float
    units: str
    method: str
    fitted: bool
    scope: Scope
    ci95: tuple[float, float] | None = None
    sources: tuple[tuple[tuple[str, str], ...], ...] = ()
    rationale: str | None = None
    copied_from: Any = None
    extra: tuple[tuple[str, Any], ...] = ()   # supersedes, validated, unsupported, and
                                             # jkernel's calibration fields: kept, not read


@dataclass(frozen=True)
class CoefficientSet:
    name: str
    entries: tuple[Entry, ...]
    file: str | None = None


_EXTRA_KEYS = ("supersedes", "validated", "unsupported",
               # written by jkernel's calibration (profile and step-trace fits): data source, fit quality
               "data_sha256", "rows", "heldout_error", "standard_error", "identifiable")


def _parse_entry(item: Any, file: str | None, path: str) -> Entry:
    if not isinstance(item, dict) or len(item) != 1:
        top = Reader({}, file, path)
        raise top.error(None, "each coefficient is a single-key map `- <name>: {fields}`")
    (name, body), = item.items()
    if not isinstance(name, str):
        raise Reader({}, file, path).error(None, "a coefficient name must be a string")
    r = Reader(body, file, f"{path}.{name}")
    value = r.num("value", required=True)
    units = r.str("units", required=True, choices=UNITS)
    method = r.str("method", required=True, choices=METHODS)
    if not r.has("fitted"):
        raise r.error("fitted", "required key is missing (true only with measured or fitted)")
    fitted = r.bool("fitted", required=True)
    if fitted and method not in ("measured", "fitted"):
        raise r.error("fitted", f"true only with method measured or fitted, not {method}")
    if (value == 0) != (method == "not_charged"):
        raise r.error("value", "the value is 0 exactly when the method is not_charged "
                      f"(value {value}, method {method})")
    sr = r.sub("scope", required=True)
    scope_vals: dict[str, Any] = {}
    for key in SCOPE_KEYS:
        v = sr.list(key, None)
        if v is None:
            continue
        want = str if key in ("hardware", "model") else int
        if not v or not all(isinstance(x, want) and not isinstance(x, bool) for x in v):
            raise sr.error(key, f"expected a non-empty list of {want.__name__}s")
        scope_vals[key] = tuple(v)
    sr.done()
    if not scope_vals:
        raise r.error("scope", "needs at least one dimension of: " + ", ".join(SCOPE_KEYS))
    ci = r.list("ci95", None)
    if ci is not None:
        if (len(ci) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                    for x in ci) or not ci[0] <= value <= ci[1]):
            raise r.error("ci95", f"expected [low, high] containing the value {value}")
        ci = (float(ci[0]), float(ci[1]))
    sources_raw = r.list("sources", None)
    sources = []
    for i, s in enumerate(sources_raw or []):
        sr2 = Reader(s, file, f"{path}.{name}.sources[{i}]")
        src = tuple((k, sr2.str(k, required=True)) for k in ("kind", "cite", "role"))
        sr2.done()
        sources.append(src)
    if method in ("literature", "vendor_spec") and not sources:
        raise r.error("sources", f"required for method {method}")
    rationale = r.str("rationale", None)
    if method not in ("measured", "fitted") and not rationale:
        raise r.error("rationale", f"required for method {method}")
    copied_from = r.raw("copied_from", None)
    if method == "copied" and copied_from is None:
        raise r.error("copied_from", "required for method copied")
    extra = tuple((k, r.raw(k)) for k in _EXTRA_KEYS if r.has(k))
    r.done()
    return Entry(name, value, units, method, fitted, Scope(**scope_vals), ci, tuple(sources),
                 rationale, _freeze(copied_from), tuple((k, _freeze(v)) for k, v in extra))


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple((k, _freeze(x)) for k, x in v.items())
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2
                                          and isinstance(x[0], str) for x in v):
        return {k: _thaw(x) for k, x in v}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def parse_coefficient_set(data: Any, file: str | None = None) -> CoefficientSet:
    r = Reader(data, file)
    r.str("kind", required=True, choices=("CoefficientSet",))
    name = r.str("name", required=True)
    items = r.list("coefficients", required=True)
    entries = tuple(_parse_entry(it, file, f"coefficients[{i}]") for i, it in enumerate(items))
    r.done()
    return CoefficientSet(name, entries, file)


def load_coefficient_set(path: Path | str) -> CoefficientSet:
    data, file = read_yaml_file(path, what="coefficient set")
    return parse_coefficient_set(data, file)


def coefficient_set_to_dict(cs: CoefficientSet) -> dict:
    out = []
    for e in cs.entries:
        body: dict[str, Any] = {"value": e.value, "units": e.units, "method": e.method,
                                "fitted": e.fitted, "scope": e.scope.to_dict()}
        if e.ci95 is not None:
            body["ci95"] = list(e.ci95)
        if e.sources:
            body["sources"] = [dict(s) for s in e.sources]
        if e.rationale:
            body["rationale"] = e.rationale
        if e.copied_from is not None:
            body["copied_from"] = _thaw(e.copied_from)
        for k, v in e.extra:
            body[k] = _thaw(v)
        out.append({e.name: body})
    return {"kind": "CoefficientSet", "name": cs.name, "coefficients": out}


def dump_coefficient_set(cs: CoefficientSet) -> str:
    return yaml.safe_dump(coefficient_set_to_dict(cs), sort_keys=False, width=100,
                          allow_unicode=True)


def select(sets: list[CoefficientSet] | tuple[CoefficientSet, ...], *, hardware: str,
           model: str, tp: int, ep: int, nodes_spanned: int) -> dict[str, tuple[Entry, str]]:
    """Last-applicable-wins selection (documents.md §8.4): name → (entry, set name)."""
    chosen: dict[str, tuple[Entry, str]] = {}
    for cs in sets:
        for e in cs.entries:
            if e.scope.applies(hardware, model, tp, ep, nodes_spanned):
                chosen[e.name] = (e, cs.name)
    return chosen
