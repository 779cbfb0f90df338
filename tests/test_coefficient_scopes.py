"""Coefficient entries that follow the deployment: an engine-version scope, the deployments
an entry was fitted on (``fitted_on``), selection by engine version and the provenance flag
of a deployment outside the fitted data (jkernel/documents/coefficients.py)."""

from __future__ import annotations

import pytest

from jkernel.documents.coefficients import (FittedOn, VersionRange, coefficient_set_to_dict,
                                            outside_fitted, parse_coefficient_set, select)
from jkernel.errors import Refusal


def _set(*entries: str):
    body = "".join(entries)
    import yaml

    from jkernel.documents._strict import _Loader
    return parse_coefficient_set(yaml.load("kind: CoefficientSet\nname: t\ncoefficients:\n"
                                           + body, Loader=_Loader), file="t.yaml")


def _entry(value: float, scope: str, extra: str = "") -> str:
    return (f"- host_serial:\n    value: {value}\n    units: us_per_step\n    method: fitted\n"
            f"    fitted: true\n    scope: {scope}\n{extra}")


def test_version_range_contains_from_and_stops_before():
    r = VersionRange("0.14.0", "0.19.0")
    assert r.contains("0.14.0") and r.contains("0.15.1") and r.contains("0.18.9")
    assert not r.contains("0.13.2") and not r.contains("0.19.0")
    assert VersionRange("0.19.0").contains("0.31.0")
    assert r.render() == "vLLM ≥ 0.14.0, < 0.19.0"


def test_selection_follows_the_engine_version():
    """Entries of one name and chip for disjoint versions: each deployment selects the one
    its version lies in; an unscoped entry before them is the fallback."""
    cs = _set(_entry(100.0, "{hardware: [h100]}"),
              _entry(300.0, "{hardware: [h100], engine_version: {from: '0.8.0', "
                            "before: '0.14.0'}}"),
              _entry(700.0, "{hardware: [h100], engine_version: {from: '0.14.0'}}"))
    pick = lambda v: select([cs], hardware="h100", model="m", tp=1, ep=1, nodes_spanned=1,  # noqa: E731
                            engine_version=v)["host_serial"][0].value
    assert pick("0.8.5") == 300.0
    assert pick("0.15.1") == 700.0
    assert pick("0.31.0") == 700.0
    assert pick("0.7.0") == 100.0          # below every range: the unscoped entry
    # without a version, version-scoped entries never apply
    assert select([cs], hardware="h100", model="m", tp=1, ep=1,
                  nodes_spanned=1)["host_serial"][0].value == 100.0


def test_a_scope_and_fitted_on_round_trip():
    cs = _set(_entry(700.0, "{hardware: [h100], engine_version: {from: '0.14.0'}}",
                     "    fitted_on: {hardware: [h100], engine_version: ['0.23.0'], "
                     "model: [qwen3-14b], tp: [1]}\n"))
    e = cs.entries[0]
    assert e.scope.engine_version == VersionRange("0.14.0")
    assert e.fitted_on == FittedOn(("h100",), ("0.23.0",), ("qwen3-14b",), (1,))
    d = coefficient_set_to_dict(cs)["coefficients"][0]["host_serial"]
    assert d["scope"]["engine_version"] == {"from": "0.14.0"}
    assert d["fitted_on"]["tp"] == [1]
    assert "vLLM ≥ 0.14.0" in e.scope.render()


@pytest.mark.parametrize("scope,extra,key", [
    ("{hardware: [h100], engine_version: {from: '0.19.0', before: '0.14.0'}}", "",
     "engine_version.before"),
    ("{hardware: [h100], engine_version: {from: 'latest'}}", "", "engine_version.from"),
    ("{hardware: [h100], engine_version: {from: '0.14.0', to: '0.19.0'}}", "", "to"),
    ("{hardware: [h100], engine_version: ['0.14.0']}", "", "engine_version"),
    ("{hardware: [h100]}", "    fitted_on: {tp: [one]}\n", "fitted_on.tp"),
    ("{hardware: [h100]}", "    fitted_on: {engine_version: [v15]}\n", "fitted_on.engine_version"),
    ("{hardware: [h100]}", "    fitted_on: {chip: [h100]}\n", "fitted_on.chip"),
])
def test_a_bad_version_scope_or_fitted_on_is_refused_naming_the_key(scope, extra, key):
    with pytest.raises(Refusal) as exc:
        _set(_entry(700.0, scope, extra))
    assert "t.yaml" in str(exc.value) and key in str(exc.value)


def test_outside_fitted_names_each_dimension_that_differs():
    cs = _set(_entry(700.0, "{hardware: [h100]}",
                     "    fitted_on: {hardware: [h100], engine_version: ['0.23.0'], "
                     "model: [qwen3-14b], tp: [1]}\n"))
    e = cs.entries[0]
    assert outside_fitted(e, hardware="h100", engine_version="0.23.0", model="qwen3-14b",
                          tp=1) == ""
    why = outside_fitted(e, hardware="a100-sxm", engine_version="0.31.0", model="llama",
                         tp=2)
    for part in ("hardware a100-sxm", "engine_version 0.31.0", "model llama", "tp 2"):
        assert part in why
    # an entry without fitted_on is never flagged
    plain = _set(_entry(700.0, "{hardware: [h100]}")).entries[0]
    assert outside_fitted(plain, hardware="b200", engine_version="0.31.0", model="x",
                          tp=8) == ""


def test_provenance_flags_a_deployment_outside_the_fitted_data():
    """The shipped step constants of h100 from vLLM 0.23 on were fitted on vLLM 0.23.0,
    Qwen3-14B, tp 1, those below it on the trainval runs at vLLM 0.15.1 and below 0.14 on the
    llm-d runs at 0.8.5: a deployment of either kind is inside, another model or engine
    version is flagged."""
    import jkernel

    from pathlib import Path

    inside = {p.name: p for p in jkernel.open("qwen3-14b-h100-tp1").provenance()}
    assert inside["host_serial"].fitted_on.startswith("h100; vLLM 0.23.0")
    assert inside["host_serial"].outside == ""
    other = {p.name: p for p in jkernel.open("llama-3.1-8b-h100-tp1").provenance()}
    assert "model llama-3.1-8b-instruct" in other["host_serial"].outside
    scenarios = Path(__file__).resolve().parents[1] / "validation" / "scenarios"
    trainval = {p.name: p for p in jkernel.open(
        scenarios / "mistral-nemo-h100-tp1-vllm0.15.yaml").provenance()}
    assert trainval["host_serial"].fitted_on.startswith("h100; vLLM 0.15.1")
    assert trainval["host_serial"].outside == ""
    older = {p.name: p for p in jkernel.open(
        scenarios / "llama-4-scout-fp8-h100-tp4-vllm0.8.5.yaml").provenance()}
    # its own runs fitted every step constant (sent as conversations, the per-request host
    # time is pinned by loads of 12 to 175 running requests)
    for name in ("host_serial", "host_serial_per_request", "compute_derate"):
        assert older[name].fitted_on.startswith("h100; vLLM 0.8.5"), name
        assert older[name].outside == "", name
