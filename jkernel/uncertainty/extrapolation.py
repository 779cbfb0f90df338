"""Extrapolation flags: where a deployment (or the batches a replay ran) is outside the data
the constants were fitted on, why, and which class of the error model that puts it in.

Every flag names what is outside and the evidence (:class:`Flag`); the deployment's class
(:data:`jkernel.uncertainty.errormodel.CLASSES`) is the farthest class any flag names, and
the error model's spreads for that class (estimated from runs that were that far from the
fit) widen the interval. The checks, in one place:

* ``chip`` → ``unfitted_chip``: the engine constants a step trace fixes
  (:data:`jkernel.calibration.fit.stepfit.STEP_CONSTANTS`) are not fitted for this chip
  (the kernel runs with assumed, copied or profile-only values), or the chip's primitive
  laws (GEMM, attention, HBM, MoE, collectives) are copied from another chip or assumed;
* ``model``, ``tp``, ``engine_version`` → ``other_deployment``: the engine constants were
  fitted on other models, widths or vLLM versions (the error model's ``fitted_range``);
* ``batch`` → ``fitted_deployment``: more than :data:`BATCH_SHARE` of a replay's steps run
  more requests or more tokens than any fitted step (a class of its own only for the
  fitted deployment: another deployment's data already spans every batch size).

The fitted range comes from the error model (regenerated with it from the step fit's
data); it is read by :func:`fitted_range` only, the one place to change when coefficient
entries record their own fitted range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errormodel import CLASSES, ErrorModel, FittedRange

__all__ = ["Flag", "Extrapolation", "DeploymentFacts", "deployment_facts", "fitted_range",
           "assess", "BATCH_SHARE", "CHIP_PREFIXES"]

#: Share of a replay's steps outside the fitted batch range that raises the ``batch`` flag.
BATCH_SHARE = 0.01
#: Constants whose names start so are the chip's primitive laws.
CHIP_PREFIXES = ("gemm_", "attention_", "hbm_derate", "moe_", "collective_")
_EVIDENCED = ("fitted", "measured", "derived", "vendor_spec", "literature")


def _engine_constants() -> tuple[str, ...]:
    from ..calibration.fit.stepfit import STEP_CONSTANTS

    return tuple(STEP_CONSTANTS)



@dataclass(frozen=True)
class Flag:
    """One way a deployment is outside the fitted data: ``what`` (chip, primitives, model,
    tp, engine_version, batch), the class it implies and ``why``, in words."""

    what: str
    cls: str
    why: str


@dataclass(frozen=True)
class Extrapolation:
    """The class of a deployment and the flags that put it there (none: ``fitted``)."""

    cls: str
    flags: tuple[Flag, ...] = ()

    def describe(self) -> str:
        if not self.flags:
            return "within the fitted data (class fitted)"
        return f"class {self.cls}: " + "; ".join(f"{f.what}: {f.why}" for f in self.flags)


@dataclass(frozen=True)
class DeploymentFacts:
    """What a kernel's pool is, as coefficient selection and the fitted range see it."""

    hardware: str
    model: str
    tp: int
    ep: int
    nodes_spanned: int
    engine_version: str


def deployment_facts(kernel) -> DeploymentFacts:
    """The kernel's chip, model, widths and engine version."""
    sc = kernel.inputs.scenario
    res = kernel.resolution()
    return DeploymentFacts(str(sc.cluster.hardware), str(sc.model),
                           int(res.tensor_parallel_width), int(res.expert_parallel_width),
                           int(kernel.settings.nodes_spanned), str(sc.engine_version))


def fitted_range(kernel, error_model: ErrorModel | FittedRange) -> FittedRange:
    """The data the engine constants were fitted on (the error model's record, or the
    range itself)."""
    del kernel
    return error_model if isinstance(error_model, FittedRange) else error_model.fitted_range


def assess(kernel, error_model: ErrorModel | FittedRange, *, steps=None) -> Extrapolation:
    """The extrapolation class and flags of ``kernel``'s deployment against the fitted
    range of ``error_model`` (or a :class:`FittedRange`); ``steps``: a replay's step table
    (:attr:`jkernel.replay.ReplayResult.steps`) to check its batches too."""
    from .posterior import selected_entries

    facts = deployment_facts(kernel)
    rng = fitted_range(kernel, error_model)
    chosen = selected_entries(kernel)
    params = kernel.params
    flags: list[Flag] = []
    engine = [n for n in _engine_constants() if n in params]
    unfitted = [n for n in engine
                if n not in chosen or chosen[n].method not in ("fitted", "measured")]
    if unfitted:
        how = ", ".join(f"{n} ({chosen[n].method})" if n in chosen else f"{n} (no entry: "
                        f"{float(np.asarray(params[n])):g}, the profile-only value)"
                        for n in unfitted)
        flags.append(Flag("chip", "unfitted_chip",
                          f"engine constants not fitted for {facts.hardware}: {how}"))
    elif rng.hardware and facts.hardware not in rng.hardware:
        flags.append(Flag("chip", "unfitted_chip",
                          f"{facts.hardware} is not a chip the engine constants were fitted "
                          f"on ({', '.join(rng.hardware)})"))
    borrowed = sorted(n for n in params if n.startswith(CHIP_PREFIXES) and n in chosen
                      and chosen[n].method not in _EVIDENCED)
    if borrowed:
        methods = sorted({chosen[n].method for n in borrowed})
        flags.append(Flag("primitives", "unfitted_chip",
                          f"{len(borrowed)} chip laws priced with {'/'.join(methods)} "
                          f"values, not this chip's fit (e.g. {borrowed[0]})"))
    if rng.model and facts.model not in rng.model:
        flags.append(Flag("model", "other_deployment",
                          f"{facts.model} is not a model the engine constants were fitted on "
                          f"({', '.join(rng.model)})"))
    if rng.tp and facts.tp not in rng.tp:
        flags.append(Flag("tp", "other_deployment",
                          f"tp {facts.tp} outside the fitted widths "
                          f"({', '.join(map(str, rng.tp))})"))
    if rng.engine_version and facts.engine_version not in rng.engine_version:
        flags.append(Flag("engine_version", "other_deployment",
                          f"vLLM {facts.engine_version} is not a fitted engine version "
                          f"({', '.join(rng.engine_version)})"))
    if steps is not None and len(steps) and (rng.max_requests or rng.max_scheduled_tokens):
        req = np.asarray(steps["requests"])
        tok = np.asarray(steps["tokens"])
        out = np.zeros(len(req), bool)
        if rng.max_requests:
            out |= req > rng.max_requests
        if rng.max_scheduled_tokens:
            out |= tok > rng.max_scheduled_tokens
        share = float(out.mean())
        if share > BATCH_SHARE:
            flags.append(Flag("batch", "fitted_deployment",
                              f"{share:.0%} of the replay's steps run more than "
                              f"{rng.max_requests} requests or {rng.max_scheduled_tokens} "
                              f"tokens (the fitted steps' largest; this replay's: "
                              f"{int(req.max())} requests, {int(tok.max())} tokens)"))
    cls = max((f.cls for f in flags), key=CLASSES.index, default="fitted")
    return Extrapolation(cls, tuple(flags))
