"""Deployment search: the best vLLM deployment of a model on a fleet, for a workload shape
and a latency target.

    import jkernel.search as search
    res = search.plan("llama-3.1-70b-instruct", chip="h200", gpus=16, isl=4096, osl=512,
                      ttft_s=2.0, itl_s=0.05, rate=20.0)
    res.table        # pandas DataFrame, one row per candidate, ranked (best first)
    res.front        # the Pareto front (output tokens/s/GPU against ITL p50) of SLA meeters
    res.reason       # why the front is empty, or ""

Three stages, each a pure function of its inputs (so a run on worker processes or on Ray
gives the same table as a run in one process):

1. **Enumerate** (:func:`enumerate_candidates`): every colocated deployment (tp, dp, expert
   parallelism for MoE models, served weight dtype, KV cache dtype) and every disaggregated
   one (a prefill and a decode pool in whole nodes, each with its own tp/dp/ep, sharing
   dtypes). tp runs over powers of two up to the pool; vLLM's own acceptance rules (tp
   divides the heads, engine sizes divide the pool, EP width ≤ experts, known collective
   widths…) are *not* re-implemented here: each candidate is built through
   :func:`jkernel.open_inputs` / :func:`jkernel.new` from in-memory documents, and the
   kernel's :class:`~jkernel.Refusal` is kept as the candidate's reason. One check is the
   planner's: a pool whose KV cache cannot hold one request of ``isl + osl`` tokens is
   refused, as vLLM v0.31.0 refuses to start when the KV cache cannot hold one sequence of
   ``max_model_len`` (``max_model_len`` is set to ``isl + osl``).
2. **Pre-screen** (:func:`prescreen`): steady state by bulk pricing (``Kernel.price_many``,
   one call per pool): a decode batch of ``B`` requests at the mean context ``isl + osl/2``
   with the prefill work that keeps it fed, for a grid of ``B`` up to the KV and
   ``max_num_seqs`` limits. It gives the throughput per GPU under the SLA (the largest batch
   whose step time stays within the ITL target and whose chunked prefill stays within the
   TTFT target), the bottleneck resource, KV capacity, and a load estimate.
3. **Replay** (:func:`replay_candidate`): the most promising candidates of each mode run the
   serving replay (:mod:`jkernel.replay`) on a seeded synthetic workload of the requested
   shape and load, giving TTFT and ITL p50/p90 at that load.

Replicas: vLLM schedules each data-parallel rank (and each separate engine) on its own
(memory.md §5) and the kernel prices one rank's batch, so the pre-screen prices one replica
and scales by the pool's replicas; the replay runs the whole fleet's workload, which
:mod:`jkernel.replay` routes over every engine and replica of each pool.

SLA: p90 TTFT and p90 ITL (every gap between two tokens of a request, pooled, as vLLM's
benchmark counts ITL) of the replay at the requested load; a candidate meets it when both
hold and the replay rejects no request. Each replayed candidate is also replayed under
``sla_draws`` draws of the constants, the model's structural error and the workload's
seed (:func:`jkernel.replay.intervals.replay_intervals`), which give ``p_sla``, the
probability that every target holds, and ``sla_margin``, the headroom of the binding
target at the draws' central value (:mod:`jkernel.uncertainty.sla`). With
``sla_confidence`` a candidate meets the SLA when ``p_sla`` is at least that instead
(ranked by the same key among those); without it the point estimate decides, and the
probability is printed beside it. The ranking key ``tok_s_gpu`` is the steady-state
output rate per GPU within the SLA from the pre-screen (how much the deployment carries
while meeting the targets); ``load_tok_s_gpu`` is the replay's steady-state rate at the
requested load.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from . import catalog as _catalog
from . import limits as _limits
from . import validate as _v
from .errors import Refusal
from .startup import check_start, request_pages

__all__ = ["Fleet", "Workload", "PoolSpec", "Candidate", "PlanResult", "fleet",
           "enumerate_candidates", "build_pool", "prescreen", "replay_candidate", "workload",
           "evaluate", "pareto_front", "rank", "plan", "plot_front", "format_table",
           "replay_figures", "screen_pool", "mode_fronts", "pool_key", "COEFFICIENT_SETS"]

#: The coefficient sets a planned scenario lists, in the shipped scenarios' order.
COEFFICIENT_SETS = ("cost-model-primitives", "cost-model-collectives",
                    "cost-model-host-overheads", "cost-model-attention",
                    "cost-model-recurrent", "cost-model-memory")

#: vLLM v0.31.0: a pool spanning nodes needs a fabric; the planner assumes InfiniBand NDR.
DEFAULT_FABRIC = "ib-400g"
#: vLLM v0.31.0's KV connector for disaggregated prefill (the catalog's PD scenarios use it).
PD_CONNECTOR = "NixlConnector"


# ---------------------------------------------------------------------------------------
# Static structure
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fleet:
    """``gpus`` GPUs of ``chip`` in nodes of ``gpus_per_node`` (a fleet smaller than one
    node is one node of ``gpus``)."""

    chip: str
    gpus: int
    gpus_per_node: int
    fabric: str = DEFAULT_FABRIC

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Workload:
    """The workload shape and load: prompts of ``isl`` tokens, answers of ``osl``; either a
    Poisson ``rate`` (requests/s over the whole fleet) or a ``concurrency``; SLA targets
    (seconds, 0 = none) on the p90 TTFT and p90 ITL."""

    isl: int
    osl: int
    rate: float = 0.0
    concurrency: int = 0
    ttft_s: float = 0.0
    itl_s: float = 0.0
    requests: int = 400
    seed: int = 0


@dataclass(frozen=True)
class PoolSpec:
    """One pool of a candidate: role, whole nodes, widths."""

    role: str            # colocated | prefill | decode
    nodes: int
    tp: int
    dp: int = 1
    ep: bool = False

    def label(self) -> str:
        s = f"tp{self.tp}"
        if self.dp > 1:
            s += f"·dp{self.dp}"
        if self.ep:
            s += "·ep"
        return s


@dataclass(frozen=True)
class Candidate:
    """One deployment: one colocated pool, or a prefill and a decode pool."""

    model: str
    fleet: Fleet
    pools: tuple[PoolSpec, ...]
    quantization: str = ""       # "" = the checkpoint's dtype
    kv_dtype: str = "auto"

    @property
    def mode(self) -> str:
        return "colocated" if len(self.pools) == 1 else "disaggregated"

    def label(self) -> str:
        q = self.quantization or "ckpt"
        if self.mode == "colocated":
            p = self.pools[0]
            body = p.label()
        else:
            pre, dec = self.pools
            body = f"P{pre.nodes}n {pre.label()} + D{dec.nodes}n {dec.label()}"
        return f"{body} w:{q} kv:{self.kv_dtype}"

    def bundle_yaml(self, max_model_len: int) -> str:
        """The candidate's bundle as YAML text (``jkernel.open`` / ``open_pool`` take it)."""
        import yaml

        return yaml.safe_dump_all(list(self.bundle(max_model_len)), sort_keys=False)

    def bundle(self, max_model_len: int) -> tuple[dict, dict]:
        """The in-memory (Scenario, Deployment) documents of this candidate."""
        fl = self.fleet
        nodes = fl.nodes
        gpn = fl.gpus if fl.gpus < fl.gpus_per_node else fl.gpus_per_node
        cluster: dict[str, Any] = {"hardware": fl.chip, "nodes": nodes, "gpus_per_node": gpn}
        if nodes > 1:
            cluster["fabric"] = fl.fabric
        sc = {"kind": "Scenario", "name": f"plan-{self.model}-{fl.chip}",
              "model": self.model, "coefficients": list(COEFFICIENT_SETS),
              "engine_version": "0.31.0", "cluster": cluster}
        pools = []
        for p in self.pools:
            engine: dict[str, Any] = {"max_model_len": int(max_model_len)}
            if self.quantization:
                engine["quantization"] = self.quantization
            if self.kv_dtype and self.kv_dtype != "auto":
                engine["cache_dtype"] = self.kv_dtype
            pools.append({"role": p.role, "nodes": p.nodes,
                          "parallel": {"tp": p.tp, "pp": 1, "dp": p.dp,
                                       "enable_expert_parallel": p.ep},
                          "engine": engine})
        dep: dict[str, Any] = {"kind": "Deployment", "name": self.label(), "pools": pools}
        if self.mode == "disaggregated":
            dep["pd_transfer"] = {"connector": PD_CONNECTOR}
        return sc, dep


# ---------------------------------------------------------------------------------------
# Fleet and model facts
# ---------------------------------------------------------------------------------------

def fleet(chip: str, gpus: int, gpus_per_node: int = 0, fabric: str = DEFAULT_FABRIC,
          repos: _catalog.Repos | None = None) -> Fleet:
    """Validate a fleet: a known chip, whole nodes, a node no larger than the chip's."""
    chips = _catalog.list_chips(repos)
    if chip not in chips:
        raise Refusal("R2", f"unknown chip {chip!r}; the catalog has {', '.join(chips)}",
                      field="chip")
    from .documents import load_chip

    doc = load_chip(_catalog.catalog_root(repos) / "hardware" / f"{chip}.yaml")
    gpus = _v.whole("gpus", gpus, lo=None, hi=_limits.MAX_DOCUMENT_INTEGER)
    gpus_per_node = _v.whole("gpus_per_node", gpus_per_node, hi=_limits.MAX_GPUS_PER_NODE,
                             limit="MAX_GPUS_PER_NODE")
    if gpus < 1:
        raise Refusal("R4", f"--gpus must be ≥ 1, got {gpus}", field="gpus")
    if gpus > _limits.MAX_PLAN_GPUS:           # before any candidate is enumerated
        raise Refusal("R4", _limits.beyond("MAX_PLAN_GPUS", gpus), field="gpus")
    # A chip that states its node (GB200 trays of 4) fixes it; HGX-style parts are 8 per node.
    node = doc.gpus_per_node or 8
    if gpus_per_node and doc.gpus_per_node and gpus_per_node > doc.gpus_per_node:
        raise Refusal("R4", f"a {chip} node holds {doc.gpus_per_node} GPUs, not "
                      f"{gpus_per_node}", field="gpus_per_node")
    gpn = gpus_per_node or node
    if gpus > gpn and gpus % gpn:
        raise Refusal("R4", f"{gpus} GPUs do not make whole nodes of {gpn} {chip} GPUs: ask "
                      f"for at most {gpn} (one node) or a multiple of {gpn}", field="gpus")
    if gpus > gpn and fabric not in _catalog.list_fabrics(repos):
        raise Refusal("R2", f"unknown fabric {fabric!r}; the catalog has "
                      f"{', '.join(_catalog.list_fabrics(repos))}", field="fabric")
    return Fleet(chip, int(gpus), int(gpn), fabric)


def _model_facts(model: str, repos: _catalog.Repos | None = None) -> dict:
    models = _catalog.list_models(repos)
    if model not in models:
        raise Refusal("R2", f"unknown model {model!r}; the catalog has {', '.join(models)}",
                      field="model")
    from .documents import load_graph

    g = load_graph(_catalog.catalog_root(repos) / "models" / model / "graph.yaml",
                   expected_name=model)
    nodes = [n for lk in g.layer_kinds for n in lk.nodes]
    moe = any(n.op == "GroupedGEMM" for n in nodes)
    latent = any(n.op == "Attention" and n.kind in ("mla", "sparse_mla") for n in nodes)
    return {"moe": moe, "weight_dtype": g.weight_dtype, "latent": latent}


def _quantizations(weight_dtype: str, chip) -> tuple[str, ...]:
    """Served weight options: the checkpoint as it is, and vLLM v0.31.0's online dynamic
    fp8 (``quantization: fp8``) of a 16-bit checkpoint on a part with native FP8. Online
    quantisation to 4 bits does not exist in vLLM (it needs a pre-quantised checkpoint)."""
    opts = [""]
    if weight_dtype in ("bf16", "fp16", "float16", "bfloat16") and chip.fp8_peak_tflops > 0:
        opts.append("fp8")
    return tuple(opts)


def _kv_dtypes(chip, latent: bool) -> tuple[str, ...]:
    """KV cache options: the model dtype (``auto``), fp8 on parts with native FP8 (vLLM
    v0.31.0 serves an fp8 KV cache on Hopper and later), nvfp4 on data-centre Blackwell for
    non-latent caches."""
    opts = ["auto"]
    if chip.fp8_peak_tflops > 0:
        opts.append("fp8")
    if chip.nvfp4_peak_tflops > 0 and not latent:
        opts.append("nvfp4")
    return tuple(opts)


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def _pool_layouts(role: str, nodes: int, pool_gpus: int, moe: bool,
                  tps: Sequence[int] | None = None, dps: Sequence[int] | None = None
                  ) -> list[PoolSpec]:
    """tp (powers of two up to the pool), dp and ep for MoE models. A dense model's dp
    ranks are independent replicas (vLLM v0.31.0 runs them without lockstep), so dp is
    enumerated only for MoE models, where the ranks share the expert group."""
    out = []
    for tp in _pow2_upto(pool_gpus):
        if tps is not None and tp not in tps:
            continue
        if not moe:
            out.append(PoolSpec(role, nodes, tp))
            continue
        for dp in _pow2_upto(pool_gpus // tp):
            if dps is not None and dp not in dps:
                continue
            for ep in ((False, True) if tp * dp > 1 else (False,)):
                out.append(PoolSpec(role, nodes, tp, dp, ep))
    return out


def enumerate_candidates(model: str, fl: Fleet, *, modes: Sequence[str] = ("colocated",
                         "disaggregated"), quantizations: Sequence[str] | None = None,
                         kv_dtypes: Sequence[str] | None = None,
                         tps: Sequence[int] | None = None, dps: Sequence[int] | None = None,
                         repos: _catalog.Repos | None = None) -> list[Candidate]:
    """Every deployment shape of ``model`` on the fleet (before the engine's rules);
    ``quantizations``, ``kv_dtypes``, ``tps`` and ``dps`` restrict the space."""
    facts = _model_facts(model, repos)
    from .documents import load_chip

    chip = load_chip(_catalog.catalog_root(repos) / "hardware" / f"{fl.chip}.yaml")
    quants = tuple(quantizations) if quantizations is not None else \
        _quantizations(facts["weight_dtype"], chip)
    kvs = tuple(kv_dtypes) if kv_dtypes is not None else _kv_dtypes(chip, facts["latent"])
    gpn = min(fl.gpus, fl.gpus_per_node)
    layouts: list[tuple[PoolSpec, ...]] = []
    if "colocated" in modes:
        layouts += [(p,) for p in _pool_layouts("colocated", fl.nodes, fl.gpus, facts["moe"],
                                                   tps, dps)]
    splits = []
    if "disaggregated" in modes and fl.nodes >= 2:
        # documents.md §2: a pool holds whole nodes, so the splits are in nodes.
        for pn in range(1, fl.nodes):
            dn = fl.nodes - pn
            splits.append((_pool_layouts("prefill", pn, pn * gpn, facts["moe"], tps, dps),
                           _pool_layouts("decode", dn, dn * gpn, facts["moe"], tps, dps)))
    # Counted before a candidate is built (MAX_PLAN_CANDIDATES, docs/limits.md).
    count = (len(layouts) + sum(len(a) * len(b) for a, b in splits)) * len(quants) * len(kvs)
    if count > _limits.MAX_PLAN_CANDIDATES:
        raise Refusal("R4", f"{count:,} candidate deployments: "
                      + _limits.beyond("MAX_PLAN_CANDIDATES", count)
                      + "; narrow the search (one --mode, fewer GPUs)", field="gpus")
    layouts += [(pre, dec) for pres, decs in splits for pre in pres for dec in decs]
    return [Candidate(model, fl, pools, q, kv) for pools in layouts for q in quants
            for kv in kvs]


# ---------------------------------------------------------------------------------------
# Building a pool through the engine's rules
# ---------------------------------------------------------------------------------------

_BASE: dict = {}


def _base_inputs(cand: Candidate, repos: _catalog.Repos | None):
    """The catalog documents a candidate's pools are built from, loaded once per process
    (model graph, chip, fabric, storage, coefficient sets; only the scenario and the
    deployment change between candidates)."""
    from .kernel import open_inputs

    key = (cand.model, cand.fleet, repos)
    if key not in _BASE:
        _BASE[key] = open_inputs(cand.bundle(1), repos, 0)
    return _BASE[key]


def build_pool(cand: Candidate, index: int, wl: Workload,
               repos: _catalog.Repos | None = None):
    """The kernel of pool ``index`` of ``cand``, resolved from its in-memory documents by
    :func:`jkernel.new`; raises :class:`Refusal` with the engine's reason, or the
    planner's KV-fit refusal (code ``FIT``)."""
    from .documents import parse_bundle
    from .kernel import new
    scenario, deployment = parse_bundle(list(cand.bundle(wl.isl + wl.osl)))
    inputs = replace(_base_inputs(cand, repos), scenario=scenario, deployment=deployment,
                     pool_index=index)
    k = new(inputs)
    # The engine's start-up refusal (jkernel.startup.start_refusal, vLLM v0.31.0), asked of
    # one request of the workload's length (the planner sizes max_model_len to it).
    check_start(k, max_model_len=max(wl.isl + wl.osl, 1), pool=f"pools[{index}]",
                        what="a workload request")
    return k


# ---------------------------------------------------------------------------------------
# Pre-screen by bulk pricing
# ---------------------------------------------------------------------------------------

#: Rows of every pre-screen batch (vLLM v0.31.0's largest default max_num_seqs is 1024).
_WIDTH = 1024


def _grid(b_max: int) -> np.ndarray:
    g = np.unique(np.round(np.geomspace(1, max(b_max, 1), 28)).astype(np.int64))
    return g[g >= 1]


def _price_rows(k, rows: list[list[tuple[int, int]]]):
    """Price batches given as lists of (scheduled, computed) rows with one bulk call."""
    from .batch import bucket_for
    from .bulk import aligned_empty

    # One width for every pool of a plan (prefill, decode or colocated): the bulk program
    # compiles once per (plan, width), and compiling dominates a pool's screen. The arrays
    # are 64-byte aligned so that the bulk path reads them in place with the plain bulk
    # program: a view from the boundary below an unaligned array is a program per offset,
    # which numpy's alignment made a different one from run to run (a miss of the
    # persistent compilation cache every time).
    width = bucket_for(max(_WIDTH, max(len(r) for r in rows)), k.buckets)
    s = aligned_empty((len(rows), width), np.int32)
    c = aligned_empty((len(rows), width), np.int32)
    s[...] = 0
    c[...] = 0
    for j, r in enumerate(rows):
        for i, (a, b) in enumerate(r):
            s[j, i], c[j, i] = a, b
    return k.price_many(scheduled=s, computed=c, decode_threshold=k.settings.decode_threshold)


def _resource(index: int) -> str:
    from .stages import RESOURCES

    return RESOURCES[int(index)]


def _colocated_screen(k, wl: Workload) -> dict:
    """Steady state of one colocated replica over a grid of running batch sizes ``B``.

    Three batches per ``B``, priced in one bulk call:

    * *steady*: ``B`` decode rows at the mean context ``isl + osl/2`` plus the prefill that
      keeps the batch fed (``B·isl/osl`` tokens: each prompt spread over its answer's
      steps), within the ``max_num_batched_tokens`` budget: the replica's output rate
      ``min(B, fed) / t``;
    * *decode*: the ``B`` decode rows alone, the gap between most tokens (ITL estimate);
    * *chunk*: the decodes beside a full prefill chunk: TTFT ≈ ``ceil(isl / chunk) · t``.
    """
    st = k.settings
    budget, max_seqs = st.max_num_batched_tokens, st.max_num_seqs
    per_req = request_pages(k, wl.isl + wl.osl)
    kv_pages = k.kv_cache_pages()
    b_max = max(1, min(max_seqs, kv_pages // max(per_req, 1), budget - 1, _WIDTH - 1))
    grid = _grid(b_max)
    ctx = wl.isl + wl.osl // 2
    steady, decode, chunked, fed, chunks = [], [], [], [], []
    for b in grid:
        b = int(b)
        pre = int(round(min(b * wl.isl / wl.osl, budget - b)))
        steady.append([(1, ctx)] * b + ([(pre, wl.isl // 2)] if pre > 0 else []))
        decode.append([(1, ctx)] * b)
        chunk = max(1, min(budget - b, wl.isl))
        chunked.append([(1, ctx)] * b + [(chunk, 0)])
        chunks.append(math.ceil(wl.isl / chunk))
        fed.append(min(float(b), pre * wl.osl / wl.isl))
    est = _price_rows(k, steady + decode + chunked)
    n = len(grid)
    t = np.asarray(est.expected_s, float)
    return {"grid": grid, "itl": t[n:2 * n], "ttft": np.asarray(chunks) * t[2 * n:],
            "out_tok_s": np.asarray(fed) / t[:n],
            "bottleneck": np.asarray(est.bottleneck[:n]), "b_max": b_max,
            "kv_tokens": kv_pages * k.plan.block_size}


def _decode_screen(k, wl: Workload) -> dict:
    st = k.settings
    per_req = request_pages(k, wl.isl + wl.osl)
    kv_pages = k.kv_cache_pages()
    b_max = max(1, min(st.max_num_seqs, kv_pages // max(per_req, 1),
                       st.max_num_batched_tokens))
    grid = _grid(b_max)
    ctx = wl.isl + wl.osl // 2
    est = _price_rows(k, [[(1, ctx)] * int(b) for b in grid])
    t = np.asarray(est.expected_s, float)
    return {"grid": grid, "itl": t, "out_tok_s": grid / t,
            "bottleneck": np.asarray(est.bottleneck), "b_max": b_max,
            "kv_tokens": kv_pages * k.plan.block_size}


def _prefill_screen(k, wl: Workload) -> dict:
    """Prefill replica: full steps of ``max_num_batched_tokens`` prompt tokens."""
    budget = k.settings.max_num_batched_tokens
    per_step = max(1, budget // wl.isl)
    if wl.isl <= budget:
        rows = [[(wl.isl, 0)] * per_step, [(wl.isl, 0)]]
    else:
        rows = [[(budget, 0)], [(budget, 0)]]
    est = _price_rows(k, rows)
    t_full, t_one = float(est.expected_s[0]), float(est.expected_s[1])
    if wl.isl <= budget:
        req_s = per_step / t_full
        ttft = t_one
    else:
        steps = math.ceil(wl.isl / budget)
        req_s = 1.0 / (steps * t_full)
        ttft = steps * t_full
    return {"req_s": req_s, "ttft": ttft, "bottleneck": int(est.bottleneck[0]),
            "kv_tokens": k.kv_cache_pages() * k.plan.block_size}


def _replicas(p: PoolSpec, gpn: int) -> int:
    return (p.nodes * gpn) // p.tp


def pool_key(cand: Candidate, index: int) -> tuple:
    """What a pool's screen depends on: its role, nodes, widths and the dtypes."""
    p = cand.pools[index]
    return (cand.model, cand.fleet, p, cand.quantization, cand.kv_dtype)


def screen_pool(cand: Candidate, index: int, wl: Workload,
                repos: _catalog.Repos | None = None) -> dict:
    """Build pool ``index`` of ``cand`` and price its steady state in one bulk call:
    ``{"refused": reason}`` or the role's screen (see the ``_*_screen`` functions)."""
    try:
        k = build_pool(cand, index, wl, repos)
    except Refusal as exc:
        return {"refused": f"[{exc.code}] {exc.field + ': ' if exc.field else ''}"
                           f"{exc.reason}"}
    role = cand.pools[index].role
    if role == "colocated":
        out = _colocated_screen(k, wl)
    elif role == "decode":
        out = _decode_screen(k, wl)
    else:
        from .overheads import Placement

        out = _prefill_screen(k, wl)
        # the KV of one prompt to the decode pool, whose nodes follow the prefill pool's
        out["xfer_s"] = k.pd_transfer_time(wl.isl, Placement(node=0),
                                           Placement(node=cand.pools[index].nodes))
    out["refused"] = ""
    return out


def prescreen(cand: Candidate, wl: Workload, repos: _catalog.Repos | None = None,
              screens: Sequence[dict] | None = None) -> dict:
    """Build every pool of ``cand`` and estimate its steady state; a row of the table.

    ``screens``: the pools' :func:`screen_pool` results when already computed. Returns
    ``refused`` (the reason, "" if built), ``tok_s_gpu`` (output tokens/s per GPU under the
    SLA, steady state), ``capacity_tok_s_gpu`` (without the SLA), estimated ITL and TTFT at
    the load, the bottleneck resource and KV capacity (tokens per replica).
    """
    row = _row_head(cand)
    if screens is None:
        screens = [screen_pool(cand, i, wl, repos) for i in range(len(cand.pools))]
    for sc in screens:
        if sc["refused"]:
            row["refused"] = sc["refused"]
            return row
    gpn = min(cand.fleet.gpus, cand.fleet.gpus_per_node)
    itl_cap = wl.itl_s if wl.itl_s > 0 else math.inf
    ttft_cap = wl.ttft_s if wl.ttft_s > 0 else math.inf
    if cand.mode == "colocated":
        (s,), (p,) = screens, cand.pools
        reps = _replicas(p, gpn)
        ok = (s["itl"] <= itl_cap) & (s["ttft"] <= ttft_cap)
        row.update(kv_tokens=int(s["kv_tokens"]), replicas=reps,
                   capacity_tok_s_gpu=float(s["out_tok_s"].max() / p.tp),
                   curve=[(float(a), float(b / p.tp)) for a, b in zip(s["itl"],
                                                                        s["out_tok_s"])])
        if ok.any():
            j = int(np.argmax(np.where(ok, s["out_tok_s"], -1)))
            row.update(tok_s_gpu=float(s["out_tok_s"][j] / p.tp), batch=int(s["grid"][j]),
                       bottleneck=_resource(s["bottleneck"][j]))
        else:
            row.update(tok_s_gpu=0.0, batch=0, bottleneck=_resource(s["bottleneck"][0]),
                       sla_reason=_sla_reason(s["itl"][0], s["ttft"][0], wl))
        load = _load_point(s["grid"], s["out_tok_s"], reps, wl)
        if load is None:
            row.update(est_itl_s=math.nan, est_ttft_s=math.nan, overloaded=True)
        else:
            row.update(est_itl_s=float(s["itl"][load]), est_ttft_s=float(s["ttft"][load]),
                       overloaded=False)
        return row
    (ps, ds), (pp_, dp_) = screens, cand.pools
    rp, rd = _replicas(pp_, gpn), _replicas(dp_, gpn)
    prefill_out = rp * ps["req_s"] * wl.osl            # output tokens/s the prefill pool feeds
    gpus = cand.fleet.gpus
    ok = ds["itl"] <= itl_cap
    ttft_est = ps["ttft"] + ps["xfer_s"]
    decode_cap = rd * ds["out_tok_s"]
    row.update(kv_tokens=int(ds["kv_tokens"]), replicas=rd, prefill_replicas=rp,
               capacity_tok_s_gpu=float(min(prefill_out, decode_cap.max()) / gpus),
               curve=[(float(a), float(min(prefill_out, b) / gpus))
                      for a, b in zip(ds["itl"], decode_cap)])
    if ok.any() and ttft_est <= ttft_cap:
        j = int(np.argmax(np.where(ok, decode_cap, -1)))
        tput = min(prefill_out, float(decode_cap[j]))
        dec_bound = decode_cap[j] <= prefill_out
        bott = ds["bottleneck"][j] if dec_bound else ps["bottleneck"]
        row.update(tok_s_gpu=float(tput / gpus), batch=int(ds["grid"][j]),
                   bottleneck=_resource(bott) + (" (decode)" if dec_bound else " (prefill)"))
    else:
        row.update(tok_s_gpu=0.0, batch=0, bottleneck=_resource(ds["bottleneck"][0]),
                   sla_reason=_sla_reason(ds["itl"][0], ttft_est, wl))
    load = _load_point(ds["grid"], ds["out_tok_s"], rd, wl)
    req_load = _fleet_rate(wl, ds, rd)
    if load is None or req_load > rp * ps["req_s"]:
        row.update(est_itl_s=math.nan, est_ttft_s=math.nan, overloaded=True)
    else:
        row.update(est_itl_s=float(ds["itl"][load]), est_ttft_s=float(ttft_est),
                   overloaded=False)
    return row


def _fleet_rate(wl: Workload, s: dict, reps: int) -> float:
    if wl.rate > 0:
        return wl.rate
    b = min(max(1, math.ceil(wl.concurrency / reps)), int(s["grid"][-1]))
    j = int(np.searchsorted(s["grid"], b))
    j = min(j, len(s["grid"]) - 1)
    return reps * float(s["out_tok_s"][j]) / wl.osl


def _load_point(grid, out_tok_s, reps: int, wl: Workload) -> int | None:
    """Index of the smallest batch that carries the load per replica; None if none does."""
    if wl.concurrency > 0:
        b = max(1, math.ceil(wl.concurrency / reps))
        if b > grid[-1]:
            return None
        return int(np.searchsorted(grid, b))
    need = wl.rate / reps * wl.osl
    ok = np.nonzero(out_tok_s >= need)[0]
    return int(ok[0]) if ok.size else None


def _sla_reason(itl_min: float, ttft_min: float, wl: Workload) -> str:
    parts = []
    if wl.itl_s > 0 and itl_min > wl.itl_s:
        parts.append(f"ITL {itl_min * 1e3:.1f} ms at batch 1 exceeds {wl.itl_s * 1e3:g} ms")
    if wl.ttft_s > 0 and ttft_min > wl.ttft_s:
        parts.append(f"TTFT {ttft_min:.3f} s of one prompt exceeds {wl.ttft_s:g} s")
    return "; ".join(parts) or "no batch meets both targets"


def _row_head(cand: Candidate) -> dict:
    row: dict[str, Any] = {"configuration": cand.label(), "mode": cand.mode,
                           "quantization": cand.quantization or "checkpoint",
                           "kv_dtype": cand.kv_dtype}
    for p in cand.pools:
        pre = "" if p.role == "colocated" else p.role[0] + "_"
        row.update({f"{pre}nodes": p.nodes, f"{pre}tp": p.tp, f"{pre}dp": p.dp,
                    f"{pre}ep": p.ep})
    row["refused"] = ""
    return row


# ---------------------------------------------------------------------------------------
# Replay at the requested load
# ---------------------------------------------------------------------------------------

def workload(wl: Workload):
    """The seeded synthetic requests of the whole fleet: ``wl.requests`` requests of
    ``isl`` prompt and ``osl`` answer tokens with Poisson arrivals at ``wl.rate``; under a
    concurrency target every request is due at once and :func:`clients` sends them (a
    closed loop). A DataFrame with the replay's columns."""
    import pandas as pd

    n = wl.requests
    rng = np.random.default_rng(wl.seed)
    arrivals = (np.cumsum(rng.exponential(1.0 / wl.rate, n)) if wl.rate > 0
                else np.zeros(n))
    arrivals -= arrivals[0]
    return pd.DataFrame({"request_id": np.arange(n), "arrival_s": arrivals,
                         "input_tokens": np.full(n, wl.isl, np.int64),
                         "output_tokens": np.full(n, wl.osl, np.int64)})


def clients(wl: Workload):
    """Who sends :func:`workload`'s requests: ``wl.concurrency`` closed-loop clients over
    the fleet (each sends its next request when its previous one completes, as vLLM's
    ``bench serve --max-concurrency`` does), or None for the open-loop rate."""
    from .replay import Clients

    return Clients(wl.concurrency) if wl.concurrency > 0 else None


#: Workload seeds among the draws of a candidate's interval replay.
SLA_SEEDS = 2
#: The level of the intervals the table and the plot show.
SLA_LEVEL = 0.8


def replay_candidate(cand: Candidate, wl: Workload,
                     repos: _catalog.Repos | None = None, draws: int = 0,
                     error_model=None) -> dict:
    """Replay ``cand`` (every engine and replica of its pools, as :mod:`jkernel.replay`
    routes them) on the seeded workload; the replay summary's figures. With ``draws``
    (≥ 2) the replay is the point of an interval replay of that many draws over
    :data:`SLA_SEEDS` workload seeds, and the figures add ``p_sla``, ``sla_margin``,
    ``sla_binding`` and the :data:`SLA_LEVEL` intervals of TTFT p90 and ITL p50/p90
    (``error_model``: default the catalog's)."""
    from . import replay as _replay

    kernels = [build_pool(cand, i, wl, repos) for i in range(len(cand.pools))]
    if draws >= 2:
        return _interval_figures(cand, wl, kernels, draws, error_model)
    reqs = workload(wl)
    if cand.mode == "colocated":
        res = _replay.replay(kernels[0], reqs, seed=wl.seed, clients=clients(wl))
    else:
        res = _replay.replay_disaggregated(kernels[0], kernels[1], reqs, seed=wl.seed,
                                           clients=clients(wl))
    return replay_figures(res, cand.fleet.gpus)


def _interval_figures(cand: Candidate, wl: Workload, kernels: list, draws: int,
                      error_model=None) -> dict:
    from .replay.intervals import replay_intervals
    from .uncertainty.sla import sla_probability

    tables = [workload(replace(wl, seed=wl.seed + j)) for j in range(SLA_SEEDS)]
    res = replay_intervals(kernels if len(kernels) > 1 else kernels[0], tables,
                           level=SLA_LEVEL, draws=draws, clients=clients(wl), seed=wl.seed,
                           error_model=error_model)
    out = replay_figures(res.point, cand.fleet.gpus)
    targets = {"ttft_p90_s": wl.ttft_s, "itl_p90_s": wl.itl_s}
    values = {m: np.asarray(res.metrics[m].draws) for m in targets}
    sla = sla_probability(values, targets)
    rejected = any(r.summary.get("rejected", 0) for r in res.results)
    out.update(p_sla=0.0 if rejected or out["rejected"] else sla.probability,
               p_sla_draws=sla.fraction, sla_margin=sla.margin, sla_binding=sla.binding,
               sla_draws=draws, extrapolation=res.extrapolation.cls)
    for m in ("ttft_p90_s", "itl_p50_s", "itl_p90_s"):
        iv = res.metrics[m]
        out[m.replace("_s", "_low_s")] = iv.low
        out[m.replace("_s", "_high_s")] = iv.high
    return out


def replay_figures(res, gpus: int) -> dict:
    """The table's replay columns from a :class:`jkernel.replay.ReplayResult`: TTFT and
    ITL p50/p90 from its summary (ITL: every gap between two tokens of a request, pooled),
    and the steady-state output rate per GPU: output tokens produced between the arrival
    of the first quarter of the requests and the last arrival (each request's tokens
    spread evenly from its first token to its finish), so neither the empty start nor the
    drain after the last arrival counts."""
    s = res.summary
    r = res.requests
    done = r[~r["rejected"].astype(bool) & r["finish_s"].notna()]
    arr = np.sort(r["arrival_s"].to_numpy(float))
    # warm-up: the system fills in about one request lifetime (the median E2E)
    warm = float(np.nanmedian(done["e2e_s"])) if len(done) else 0.0
    t0, t1 = arr[0] + warm, arr[-1]
    tok_s = float("nan")
    if t1 > t0 and len(done):
        first = done["first_token_s"].to_numpy(float)
        fin = done["finish_s"].to_numpy(float)
        out = done["output_tokens"].to_numpy(float)
        span = np.maximum(fin - first, 1e-12)
        inside = np.clip(np.minimum(fin, t1) - np.maximum(first, t0), 0.0, None) / span
        first_in = ((first >= t0) & (first <= t1)).astype(float)
        tokens = first_in + np.where(fin > first, inside * (out - 1), 0.0)
        tok_s = float(tokens.sum() / (t1 - t0))
    return {"ttft_p50_s": float(s["ttft_p50_s"]), "ttft_p90_s": float(s["ttft_p90_s"]),
            "itl_p50_s": float(s["itl_p50_s"]), "itl_p90_s": float(s["itl_p90_s"]),
            "load_tok_s_gpu": tok_s / gpus, "rejected": int(s.get("rejected", 0)),
            "replay_steps": int(s.get("steps", 0)), "replayed": True}


# ---------------------------------------------------------------------------------------
# Ranking and the front
# ---------------------------------------------------------------------------------------

def _meets(row: dict, wl: Workload, confidence: float = 0.0) -> bool:
    if row.get("refused") or not row.get("replayed"):
        return False
    if row.get("rejected"):
        return False
    if confidence > 0:
        p = row.get("p_sla", math.nan)
        if not (isinstance(p, float) and p >= confidence):
            return False
    else:
        if wl.ttft_s > 0 and not row["ttft_p90_s"] <= wl.ttft_s:
            return False
        if wl.itl_s > 0 and not row["itl_p90_s"] <= wl.itl_s:
            return False
    return row.get("tok_s_gpu", 0) > 0


def rank(rows: list[dict], wl: Workload, confidence: float = 0.0):
    """The table, best first: SLA meeters by tokens/s/GPU, then the other built
    candidates, then the refused ones (each group in a stable, deterministic order). With
    ``confidence`` a candidate meets the SLA when its ``p_sla`` is at least that."""
    import pandas as pd

    for r in rows:
        r["meets_sla"] = _meets(r, wl, confidence)
    df = pd.DataFrame(rows)
    for col in ("tok_s_gpu", "capacity_tok_s_gpu", "ttft_p50_s", "ttft_p90_s", "itl_p50_s",
                "itl_p90_s", "est_itl_s", "est_ttft_s", "load_tok_s_gpu", "p_sla",
                "sla_margin"):
        if col not in df:
            df[col] = np.nan
    for col in ("replayed", "overloaded"):
        df[col] = df[col].fillna(False).astype(bool) if col in df else False
    df["refused"] = df["refused"].fillna("")
    group = np.where(df["meets_sla"], 0, np.where(df["refused"] == "", 1, 2))
    df["_g"] = group
    df["_t"] = -df["tok_s_gpu"].fillna(-1.0)
    df = df.sort_values(["_g", "_t", "configuration"], kind="mergesort")
    df = df.drop(columns=["_g", "_t"]).reset_index(drop=True)
    df.insert(0, "rank", np.arange(1, len(df) + 1))
    return df


def pareto_front(df, x: str = "itl_p50_s", y: str = "tok_s_gpu"):
    """Rows not dominated in (higher ``y``, lower ``x``) among ``df``'s rows, by ``x``."""
    d = df.dropna(subset=[x, y]).sort_values([x, y], ascending=[True, False],
                                             kind="mergesort")
    keep, best = [], -math.inf
    for idx, r in d.iterrows():
        if r[y] > best:
            keep.append(idx)
            best = r[y]
    return d.loc[keep]


# ---------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------

@dataclass
class PlanResult:
    """What :func:`plan` returns: the ranked ``table``, its Pareto ``front`` (SLA meeters
    only), the ``reason`` the front is empty ("" otherwise), and the run's settings."""

    table: Any
    front: Any
    reason: str
    workload: Workload
    fleet: Fleet
    model: str
    seconds: float = 0.0
    candidates: dict = field(default_factory=dict)   # configuration label → Candidate
    sla_confidence: float = 0.0                      # 0: the point estimate decides

    def candidate(self, configuration: str) -> Candidate:
        """The :class:`Candidate` of a table row (its ``bundle()`` are the documents)."""
        return self.candidates[configuration]

    def best(self, mode: str | None = None) -> dict | None:
        t = self.table[self.table["meets_sla"]]
        if mode:
            t = t[t["mode"] == mode]
        return None if t.empty else t.iloc[0].to_dict()

    def to_json(self) -> dict:
        import json

        return {"model": self.model, "fleet": asdict(self.fleet),
                "workload": asdict(self.workload), "reason": self.reason,
                "sla_confidence": self.sla_confidence,
                "seconds": self.seconds,
                "table": json.loads(self.table.to_json(orient="records")),
                "front": json.loads(self.front.to_json(orient="records"))}


def _init_worker() -> None:
    """Worker start: one XLA CPU thread per process (the pool itself is the parallelism).
    Ctrl-C is the parent's to handle: a worker ignores SIGINT (a terminal sends it to the
    whole process group) and is stopped by the parent (:meth:`_Runner.__exit__`)."""
    import signal

    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _screen_task(args):
    items, wl, repos = args
    return [screen_pool(c, i, wl, repos) for _, c, i in items]


def _replay_task(args):
    cand, wl, repos, draws = args
    return replay_candidate(cand, wl, repos, draws)


@contextlib.contextmanager
def _sigint_held():
    """Hold Ctrl-C in this (main) thread while worker processes are spawned, then raise it.
    SIGINT is blocked meanwhile: a spawned process inherits the blocked signal and Python
    never unblocks it, so a Ctrl-C that reaches a worker still importing (before
    :func:`_init_worker` runs) neither kills it nor prints its traceback, and the parent
    stops the workers itself. One that reaches the parent meanwhile is kept, not lost (it
    once was: SIGINT was ignored here, and a search interrupted while its workers started
    ran to the end), and raised as KeyboardInterrupt when the spawning is done."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)    # a pending SIGINT lands in held
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


class _Runner:
    """Maps a task over items: in this process, on spawned worker processes, or on Ray.
    Results come back in item order whatever the executor, so every way gives one table."""

    def __init__(self, workers: int = 1, ray_address: str | None = None):
        self.workers, self.ray_address = workers, ray_address
        self._pool = None
        self._ray = None

    def __enter__(self):
        if self.ray_address:
            try:
                import ray
            except ImportError as exc:
                raise Refusal("R2", "--ray needs the ray package (pip install "
                              "'jkernel[ray]')") from exc
            if not ray.is_initialized():
                addr = None if self.ray_address == "local" else self.ray_address
                ray.init(address=addr, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": os.environ.get(
                             "PYTHONPATH", "")}})
            self._ray = ray
        elif self.workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            # spawn: JAX is not fork-safe once its runtime has started
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker)
        return self

    def __exit__(self, exc_type, *exc):
        if self._pool is None:
            return
        if exc_type is None:
            self._pool.shutdown(wait=True)
            return
        # Ctrl-C (KeyboardInterrupt) or a failed task: stop at once. Waiting for the running
        # tasks (shutdown's default) would keep the parent and its workers busy until they
        # finish; cancel the queued ones, terminate the workers and reap them, so nothing
        # is left running.
        procs = list((getattr(self._pool, "_processes", None) or {}).values())
        manager = getattr(self._pool, "_executor_manager_thread", None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()              # SIGKILL cannot be caught: wait until it is reaped
                proc.join()
        # The executor's own thread joins the workers too, and whichever thread reaps a
        # worker first records its exit: a worker that thread reaped is gone, but reads as
        # alive here until it has recorded it (a loaded machine once showed one so). Wait
        # for that thread, which ends once its workers are gone.
        if manager is not None:
            manager.join(timeout=10)

    def map(self, fn, items: list, progress: Callable[[int, Any], None] | None = None):
        out: list = [None] * len(items)
        if self._ray is not None:
            ray = self._ray
            remote = ray.remote(fn)
            refs = {remote.remote(it): i for i, it in enumerate(items)}
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                i = refs[done[0]]
                out[i] = ray.get(done[0])
                if progress:
                    progress(i, out[i])
            return out
        if self._pool is not None:
            from concurrent.futures import as_completed

            with _sigint_held():           # workers start with Ctrl-C blocked (see above)
                futs = {self._pool.submit(fn, it): i for i, it in enumerate(items)}
            for f in as_completed(futs):
                i = futs[f]
                out[i] = f.result()
                if progress:
                    progress(i, out[i])
            return out
        for i, it in enumerate(items):
            out[i] = fn(it)
            if progress:
                progress(i, out[i])
        return out


def evaluate(cands: Sequence[Candidate], wl: Workload, *, replay_top: int = 3,
             workers: int = 1, ray_address: str | None = None,
             repos: _catalog.Repos | None = None, log: Callable[[str], None] | None = None,
             replay: bool = True, sla_draws: int = 0) -> list[dict]:
    """Pre-screen every candidate, replay the ``replay_top`` most promising of each mode
    (by SLA-bound tokens/s/GPU among those not overloaded; with ``sla_draws`` draws of
    their intervals), and return the rows."""
    log = log or (lambda s: None)
    cands = list(cands)
    t0 = time.perf_counter()
    count = [0]
    # Unique pools, grouped so that pools sharing a static plan (same widths and dtypes,
    # any role) are priced in one process and compile once.
    first: dict[tuple, tuple[Candidate, int]] = {}
    for c in cands:
        for i in range(len(c.pools)):
            first.setdefault(pool_key(c, i), (c, i))
    groups: dict[tuple, list] = {}
    for key, (c, i) in first.items():
        p = c.pools[i]
        groups.setdefault((p.tp, p.dp, p.ep, c.quantization, c.kv_dtype), []).append(
            (key, c, i))
    tasks = [(items, wl, repos) for items in groups.values()]

    def screened(j, res):
        count[0] += 1
        for (key, c, i), r in zip(tasks[j][0], res):
            state = r["refused"] or "built"
            log(f"[screen {count[0]}/{len(tasks)} {time.perf_counter() - t0:6.1f}s] "
                f"{c.pools[i].role} {c.pools[i].label()} on {c.pools[i].nodes} node(s) "
                f"w:{c.quantization or 'ckpt'} kv:{c.kv_dtype}: {state}")

    with _Runner(workers, ray_address) as run:
        results = run.map(_screen_task, tasks, screened)
        screens = {key: r for (items, _, _), res in zip(tasks, results)
                   for (key, _, _), r in zip(items, res)}
        rows = [prescreen(c, wl, repos, [screens[pool_key(c, i)]
                                         for i in range(len(c.pools))]) for c in cands]
        chosen: list[int] = []
        if replay:
            for mode in ("colocated", "disaggregated"):
                idx = [i for i, r in enumerate(rows) if r["mode"] == mode and not r["refused"]
                       and not r.get("overloaded") and r.get("tok_s_gpu", 0) > 0]
                idx.sort(key=lambda i: (-rows[i]["tok_s_gpu"], rows[i]["configuration"]))
                chosen += idx[:replay_top]
        count[0] = 0

        def replayed(j, res):
            count[0] += 1
            r = rows[chosen[j]]
            log(f"[replay {count[0]}/{len(chosen)} {time.perf_counter() - t0:6.1f}s] "
                f"{r['configuration']}: TTFT p90 {res['ttft_p90_s']:.3f} s, ITL p90 "
                f"{res['itl_p90_s'] * 1e3:.1f} ms"
                + (f", P(SLA met) {res['p_sla']:.2f}" if "p_sla" in res else ""))

        results = run.map(_replay_task, [(cands[i], wl, repos, sla_draws) for i in chosen],
                          replayed)
    for i, res in zip(chosen, results):
        rows[i].update(res)
    return rows


def plan(model: str, *, chip: str, gpus: int, isl: int, osl: int, ttft_s: float = 0.0,
         itl_s: float = 0.0, rate: float = 0.0, concurrency: int = 0, gpus_per_node: int = 0,
         fabric: str = DEFAULT_FABRIC, modes: Sequence[str] = ("colocated", "disaggregated"),
         quantizations: Sequence[str] | None = None, kv_dtypes: Sequence[str] | None = None,
         tps: Sequence[int] | None = None, dps: Sequence[int] | None = None,
         requests: int = 0, seed: int = 0, replay_top: int = 3,
         workers: int = 1, ray_address: str | None = None,
         repos: _catalog.Repos | None = None, log: Callable[[str], None] | None = None,
         sla_confidence: float = 0.0, sla_draws: int = 16) -> PlanResult:
    """Search the deployments of ``model`` on ``gpus`` × ``chip`` for the workload shape
    (``isl``/``osl`` tokens) at a load (``rate`` requests/s, or ``concurrency``) under the
    SLA (p90 ``ttft_s`` and ``itl_s`` in seconds; 0 = no target). ``sla_draws``: draws of
    each replayed candidate's interval replay (``p_sla``; 0: none); ``sla_confidence``
    (in (0, 1)): rank by that probability instead of the point estimate. Raises
    :class:`~jkernel.Refusal` for an unknown model or chip or a fleet that is not whole
    nodes; every other outcome is in the table."""
    t0 = time.perf_counter()
    # Types, finiteness and limits first (docs/limits.md); the search's own ranges below.
    isl, osl = _v.whole("isl", isl, lo=None), _v.whole("osl", osl, lo=None)
    rate = _v.finite("rate", rate, lo=0.0)
    concurrency = _v.whole("concurrency", concurrency)
    ttft_s, itl_s = _v.finite("ttft_s", ttft_s), _v.finite("itl_s", itl_s)
    requests = _v.whole("requests", requests, hi=_limits.MAX_REQUESTS, limit="MAX_REQUESTS")
    seed = _v.whole("seed", seed, hi=_limits.MAX_DOCUMENT_INTEGER)
    replay_top = _v.whole("replay_top", replay_top)
    workers = _v.whole("workers", workers, lo=1, hi=_limits.MAX_WORKERS, limit="MAX_WORKERS")
    if isl < 1 or osl < 1:
        raise Refusal("R4", f"isl and osl must be ≥ 1 (isl {isl}, osl {osl})", field="isl")
    if (rate > 0) == (concurrency > 0):
        raise Refusal("R4", "state exactly one of a rate (> 0) or a concurrency (> 0)",
                      field="rate")
    if ttft_s < 0 or itl_s < 0:
        raise Refusal("R4", "TTFT and ITL targets are seconds ≥ 0", field="ttft")
    if not (0.0 <= sla_confidence < 1.0) or math.isnan(sla_confidence):
        raise Refusal("R4", f"sla_confidence is a probability in [0, 1), got {sla_confidence}",
                      field="sla_confidence")
    if sla_confidence > 0 and sla_draws < 2:
        raise Refusal("R4", "sla_confidence needs sla_draws ≥ 2 (the draws give the "
                      "probability)", field="sla_draws")
    if sla_draws < 0 or sla_draws == 1:
        raise Refusal("R4", f"sla_draws is 0 (no probability) or ≥ 2, got {sla_draws}",
                      field="sla_draws")
    _model_facts(model, repos)
    if requests <= 0:
        # long enough for a steady state: a minute of arrivals (at least 300 requests)
        requests = int(min(2000, max(300, math.ceil((rate or concurrency / 10.0) * 60))))
    if requests * osl > _limits.MAX_REPLAY_TOKENS:
        raise _v.ArgumentError("osl", f"{requests:,} requests of {osl:,} output tokens: "
                               + _limits.beyond("MAX_REPLAY_TOKENS", requests * osl))
    fl = fleet(chip, gpus, gpus_per_node, fabric, repos)
    wl = Workload(int(isl), int(osl), float(rate), int(concurrency), float(ttft_s),
                  float(itl_s), int(requests), int(seed))
    cands = enumerate_candidates(model, fl, modes=modes, quantizations=quantizations,
                                 kv_dtypes=kv_dtypes, tps=tps, dps=dps, repos=repos)
    if log:
        log(f"{len(cands)} candidate deployments of {model} on {fl.gpus} × {fl.chip} "
            f"({fl.nodes} node{'s' if fl.nodes > 1 else ''} of "
            f"{min(fl.gpus, fl.gpus_per_node)})")
    rows = evaluate(cands, wl, replay_top=replay_top, workers=workers,
                    ray_address=ray_address, repos=repos, log=log, sla_draws=sla_draws)
    table = rank(rows, wl, sla_confidence)
    meet = table[table["meets_sla"]]
    front = pareto_front(meet)
    reason = "" if not front.empty else _empty_reason(table, wl, sla_confidence)
    return PlanResult(table, front, reason, wl, fl, model, time.perf_counter() - t0,
                      {c.label(): c for c in cands}, sla_confidence)


def _empty_reason(table, wl: Workload, confidence: float = 0.0) -> str:
    built = table[table["refused"] == ""]
    if confidence > 0 and "p_sla" in table and table["p_sla"].notna().any():
        best = table["p_sla"].max()
        return (f"no replayed candidate meets every target with probability ≥ "
                f"{confidence:g} (the highest is {best:.2f})")
    if built.empty:
        return "every candidate was refused: " + "; ".join(
            sorted(set(table["refused"]))[:3])
    sla = " and ".join(s for s in (f"TTFT p90 ≤ {wl.ttft_s:g} s" if wl.ttft_s else "",
                                   f"ITL p90 ≤ {wl.itl_s * 1e3:g} ms" if wl.itl_s else "")
                       if s) or "the load"
    reasons = built["sla_reason"].dropna() if "sla_reason" in built else []
    best_itl = built["est_itl_s"].min() if "est_itl_s" in built else math.nan
    why = f"no candidate meets {sla}"
    if len(reasons) == len(built) and len(built):
        why += f" (the best pool: {sorted(set(reasons))[0]})"
    elif built.get("overloaded", False).all():
        why += " (every built candidate is overloaded at the requested load)"
    elif math.isfinite(best_itl):
        why += f" (the lowest estimated ITL at the load is {best_itl * 1e3:.1f} ms)"
    return why


def mode_fronts(result: PlanResult) -> dict:
    """Per mode, the Pareto front of output tokens/s/GPU against ITL over every built
    candidate's pre-screen curve (one point per running batch size): a DataFrame with
    ``itl_s``, ``tok_s_gpu`` and the ``configuration`` each point comes from."""
    import pandas as pd

    out = {}
    t = result.table
    for mode in ("colocated", "disaggregated"):
        pts = [(itl, tok, r["configuration"]) for _, r in t[(t["mode"] == mode) &
                                                            (t["refused"] == "")].iterrows()
               if isinstance(r.get("curve"), list) for itl, tok in r["curve"]]
        if not pts:
            continue
        d = pd.DataFrame(pts, columns=["itl_s", "tok_s_gpu", "configuration"])
        out[mode] = pareto_front(d, x="itl_s", y="tok_s_gpu").reset_index(drop=True)
    return out


def plot_front(result: PlanResult, path: str | None = None, ax=None):
    """Each mode's front of output tokens/s/GPU against ITL (pre-screen curves, steady
    state) as a line, and the replayed candidates as points at the offered load per GPU
    and their replayed ITL p50 with its :data:`SLA_LEVEL` interval where the candidate
    was replayed with draws; saved to ``path`` when given. Needs matplotlib (an
    optional dependency)."""
    try:
        import matplotlib
        if path is not None and ax is None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional: only the plot needs it
        raise ImportError("--plot needs matplotlib (pip install 'jkernel[notebooks]')"
                          ) from exc
    t = result.table
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fronts = mode_fronts(result)
    wl = result.workload
    # the replayed points sit at the offered output rate per GPU (rate × osl / GPUs)
    offered = wl.rate * wl.osl / result.fleet.gpus if wl.rate > 0 else 0.0
    for mode, marker in (("colocated", "o"), ("disaggregated", "s")):
        if mode in fronts:
            f = fronts[mode]
            line, = ax.plot(f["itl_s"] * 1e3, f["tok_s_gpu"], label=f"{mode} front")
            color = line.get_color()
        else:
            color = None
        d = t[(t["mode"] == mode) & t["replayed"]]
        if not d.empty and offered > 0:
            ax.scatter(d["itl_p50_s"] * 1e3, np.full(len(d), offered), marker=marker,
                       color=color, label=f"{mode} replayed at the load (ITL p50)")
            if "itl_p50_low_s" in d and d["itl_p50_low_s"].notna().any():
                x = d["itl_p50_s"].to_numpy(float) * 1e3
                err = np.abs(np.vstack([x - d["itl_p50_low_s"].to_numpy(float) * 1e3,
                                        d["itl_p50_high_s"].to_numpy(float) * 1e3 - x]))
                ax.errorbar(x, np.full(len(d), offered), xerr=err, fmt="none", color=color,
                            capsize=3, lw=1, label=f"{mode}: {SLA_LEVEL:.0%} interval")
    if result.workload.itl_s:
        ax.axvline(result.workload.itl_s * 1e3, color="grey", ls="--", lw=1, label="ITL target")
    ax.set_xlabel("ITL (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{result.model} on {result.fleet.gpus} × {result.fleet.chip}")
    ax.legend(fontsize=8)
    if path is not None and fig is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return ax


#: The table's columns as the command line prints them.
SHOW = ("rank", "configuration", "tok_s_gpu", "ttft_p50_s", "ttft_p90_s", "itl_p50_s",
        "itl_p90_s", "bottleneck", "kv_tokens", "meets_sla")


def format_table(result: PlanResult, every: bool = False, top: int = 15) -> str:
    """The ranked table as text: the best ``top`` built candidates (every row with
    ``every``), the front, and the reason when the front is empty."""
    wl, fl = result.workload, result.fleet
    load = f"{wl.rate:g} req/s" if wl.rate > 0 else f"concurrency {wl.concurrency}"
    sla = ", ".join(s for s in (f"TTFT p90 ≤ {wl.ttft_s:g} s" if wl.ttft_s else "",
                                f"ITL p90 ≤ {wl.itl_s * 1e3:g} ms" if wl.itl_s else "") if s)
    t = result.table
    built = t[t["refused"] == ""]
    conf = result.sla_confidence
    rule = (f"meets the SLA: P(every target met) ≥ {conf:g}" if conf > 0 else
            "meets the SLA: the point estimate; P = probability every target is met")
    lines = [f"{result.model} on {fl.gpus} × {fl.chip} ({fl.nodes} node(s)); isl {wl.isl}, "
             f"osl {wl.osl}, {load}; SLA: {sla or 'none'}; {wl.requests} requests replayed "
             f"per candidate (seed {wl.seed}); {rule}",
             f"{len(t)} candidates: {len(built)} built, {len(t) - len(built)} refused, "
             f"{int(t['replayed'].sum())} replayed, {int(t['meets_sla'].sum())} meet the "
             f"SLA; {result.seconds:.1f} s", ""]
    show = t if every else built.head(top)
    hdr = (f"{'#':>3} {'configuration':<40} {'tok/s/GPU':>9} {'TTFT p50':>9} {'p90':>7} "
           f"{'ITL p50':>8} {'p90':>7} {'bottleneck':<14} {'KV tokens':>10}  SLA "
           f"{'P':>5} {'margin':>7}")
    lines.append(hdr)

    def f(x, scale=1.0, fmt="{:.3f}"):
        return fmt.format(x * scale) if isinstance(x, (int, float)) and math.isfinite(x) \
            else "-"
    for _, r in show.iterrows():
        if r["refused"]:
            lines.append(f"{r['rank']:>3} {r['configuration']:<40} refused: {r['refused']}")
            continue
        lines.append(
            f"{r['rank']:>3} {r['configuration']:<40} {f(r['tok_s_gpu'], fmt='{:.0f}'):>9} "
            f"{f(r['ttft_p50_s']):>9} {f(r['ttft_p90_s']):>7} "
            f"{f(r['itl_p50_s'], 1e3, '{:.1f}ms'):>8} {f(r['itl_p90_s'], 1e3, '{:.1f}ms'):>7} "
            f"{str(r['bottleneck']):<14} {int(r['kv_tokens']):>10,d}  "
            f"{'yes' if r['meets_sla'] else ('no' if r['replayed'] else 'not replayed'):<3}"
            f" {f(r.get('p_sla', math.nan), fmt='{:.2f}'):>5} "
            f"{f(r.get('sla_margin', math.nan), 100, '{:+.0f}%'):>7}")
    if not every and len(t) - len(built):
        reasons = t[t["refused"] != ""]["refused"].value_counts()
        lines.append(f"refused ({len(t) - len(built)}):")
        for why, n in reasons.items():
            lines.append(f"  {n} × {why}")
    lines.append("")
    if result.front.empty:
        lines.append(f"Pareto front: empty: {result.reason}")
    else:
        lines.append("Pareto front (tokens/s/GPU against ITL p50, SLA meeters):")
        for _, r in result.front.iterrows():
            band = ""
            if isinstance(r.get("itl_p50_low_s"), float) and math.isfinite(r["itl_p50_low_s"]):
                band = (f" [{r['itl_p50_low_s'] * 1e3:.1f}, {r['itl_p50_high_s'] * 1e3:.1f}] "
                        f"({SLA_LEVEL:.0%}), P(SLA met) {r['p_sla']:.2f}")
            lines.append(f"  {r['configuration']:<40} {r['tok_s_gpu']:8.0f} tok/s/GPU  ITL "
                         f"p50 {r['itl_p50_s'] * 1e3:.1f} ms{band}")
    return "\n".join(lines)
