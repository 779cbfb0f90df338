"""Construction: documents → widths, defaults, refusals, provenance, plan and params.

Everything here runs once per pool, in plain Python, and may raise :class:`Refusal`
(resolution.md §13). The order of checks follows resolution.md §2. The result,
:class:`Resolved`, holds the static :class:`~jkernel.plan.Plan`, the
:class:`~jkernel.params.Params` pytree and the introspection records of §12.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import catalog as _catalog
from .documents import (Chip, CoefficientSet, Deployment, Fabric, ModelGraph, Scenario,
                        StorageClass, load_bundle, load_chip, load_coefficient_set,
                        load_fabric, load_graph, load_storage, parse_bundle, select)
from .documents.graph import DTYPE_BYTES, LATENT_KINDS
from .errors import Refusal
from .memory import MemoryPlan, plan_memory
from .params import CHIP_NAMES, Params, si_scale
from .plan import (EAGER, FULL, PIECEWISE, CollectiveKey, GroupPlan, Plan,
                   collectives_needed, plan_layers)

__all__ = ["ENGINE_BEHAVIOUR_VERSION", "KERNEL_ASSUMPTION_SET", "RULES", "Rules", "Inputs",
           "Override", "CoefficientOrigin", "Resolution", "Resolved", "open_inputs",
           "resolve"]

ENGINE_BEHAVIOUR_VERSION = "0.31.0"
KERNEL_ASSUMPTION_SET = "jkernel"


@dataclass(frozen=True)
class Rules:
    """The built-in engine rules table (documents.md §9), applied to every version (D11)."""

    custom_allreduce_widths: tuple[int, ...] = (2, 4, 6, 8, 16)
    sp_moe_backends: tuple[str, ...] = (
        "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency",
        "flashinfer_nvlink_one_sided", "mori_high_throughput", "mori_low_latency", "nixl_ep")
    dcp_combine_backends: tuple[str, ...] = ("a2a", "ag_rs")


RULES = Rules()


@dataclass(frozen=True)
class Inputs:
    """Every document one pool's kernel is built from (resolution.md §1)."""

    scenario: Scenario | None
    deployment: Deployment | None
    pool_index: int
    model: ModelGraph | None
    chip: Chip | None
    fabric: Fabric | None
    devices: dict[str, StorageClass]
    coefficient_sets: tuple[CoefficientSet, ...]
    rules: Rules = RULES


@dataclass(frozen=True)
class Override:
    field: str
    requested: Any
    resolved: Any
    reason: str


@dataclass(frozen=True)
class CoefficientOrigin:
    name: str
    set: str
    method: str
    scope: str


@dataclass(frozen=True)
class Resolution:
    """What the kernel resolved (resolution.md §12.3)."""

    tensor_parallel_width: int
    data_parallel_width: int
    expert_parallel_width: int
    all_reduce_backend: str
    async_scheduling: bool
    cascade_attention: bool
    sequence_parallel_moe: bool
    overrides: tuple[Override, ...]
    decode_context_parallel_width: int = 1
    prefill_context_parallel_width: int = 1

    def tensor_parallel(self) -> int:
        return max(self.tensor_parallel_width, 1)

    def data_parallel(self) -> int:
        return max(self.data_parallel_width, 1)

    def expert_parallel(self) -> int:
        return max(self.expert_parallel_width, 1)


@dataclass(frozen=True)
class Resolved:
    plan: Plan
    params: Params
    memory: MemoryPlan
    resolution: Resolution
    provenance: tuple[CoefficientOrigin, ...]
    settings: dict = field(hash=False, compare=False)   # resolved engine settings used
    inputs: Inputs = field(hash=False, compare=False)
    links: dict = field(hash=False, compare=False)      # nvlink/nic rates, rack domain


# ---------------------------------------------------------------------------------------
# Loading (open_inputs)
# ---------------------------------------------------------------------------------------

def open_inputs(bundle: Any, repos: _catalog.Repos | None = None, pool: int | str = 0
                ) -> Inputs:
    """Load a bundle and every document it names, without building a kernel.

    ``bundle``: a path (relative paths join ``repos.scenarios``; a bare catalog scenario name
    works too), YAML text, or a pair of mappings (Scenario, Deployment). ``pool``: an index or
    a role (``"prefill"``, ``"decode"``, ``"colocated"``).
    """
    if isinstance(bundle, (str, Path)) and not (isinstance(bundle, str) and "\n" in bundle):
        path = _catalog.scenario_path(bundle, repos)
        scenario, deployment = load_bundle(path)
    else:
        scenario, deployment = parse_bundle(bundle)
    index = _pool_index(deployment, pool)
    croot = _catalog.catalog_root(repos)
    rroot = _catalog.registry_root(repos)
    model = load_graph(_need(croot / "models" / scenario.model / "graph.yaml", "model",
                             scenario.model), expected_name=scenario.model)
    chip = load_chip(_need(croot / "hardware" / f"{scenario.cluster.hardware}.yaml", "chip",
                           scenario.cluster.hardware))
    fabric = None
    if scenario.cluster.fabric:
        fabric = load_fabric(_need(croot / "networks" / f"{scenario.cluster.fabric}.yaml",
                                   "fabric", scenario.cluster.fabric))
    devices = load_storage(_need(croot / "devices" / "storage.yaml", "storage file",
                                 "devices/storage.yaml"))
    sets = tuple(load_coefficient_set(_need(rroot / "coefficients" / f"{s}.yaml",
                                            "coefficient set", s))
                 for s in scenario.coefficients)
    return Inputs(scenario, deployment, index, model, chip, fabric, devices, sets)


def _need(path: Path, what: str, name: str) -> Path:
    if not path.is_file():
        raise Refusal("R2", f"{what} {name!r} not found (looked for {path})", file=str(path))
    return path


def _pool_index(dep: Deployment, pool: int | str) -> int:
    if isinstance(pool, str) and not pool.isdigit():
        roles = [p.role for p in dep.pools]
        if pool not in roles:
            raise Refusal("R3", f"no pool with role {pool!r}; the pools are {roles}",
                          field="pools")
        return roles.index(pool)
    index = int(pool)
    if not 0 <= index < len(dep.pools):
        raise Refusal("R3", f"no pool at index {index}; the deployment has {len(dep.pools)}",
                      field="pools")
    return index


# ---------------------------------------------------------------------------------------
# Consistency (R4, R5)
# ---------------------------------------------------------------------------------------

def _check_consistency(sc: Scenario, dep: Deployment, chip: Chip,
                       devices: dict[str, StorageClass]) -> None:
    cl = sc.cluster
    roles = [p.role for p in dep.pools]
    if sum(p.nodes for p in dep.pools) != cl.nodes:
        raise Refusal("R4", f"the pools' nodes sum to {sum(p.nodes for p in dep.pools)} but "
                      f"the cluster has {cl.nodes}", field="pools")
    if ("prefill" in roles) != ("decode" in roles):
        raise Refusal("R4", "prefill and decode pools come together or not at all",
                      field="pools")
    if "colocated" in roles and ("prefill" in roles or len(roles) > 1):
        raise Refusal("R4", "a colocated pool stands alone (never beside prefill/decode "
                      "pools or another colocated pool)", field="pools")
    if "prefill" in roles and dep.pd_transfer_connector is None:
        raise Refusal("R4", "pd_transfer is required when a pool is prefill",
                      field="pd_transfer")
    if cl.nodes > 1 and not cl.fabric:
        raise Refusal("R4", f"cluster.fabric is required for {cl.nodes} nodes",
                      field="cluster.fabric")
    if cl.gpus_per_rack and cl.gpus_per_rack % cl.gpus_per_node:
        raise Refusal("R4", f"gpus_per_rack {cl.gpus_per_rack} is not a multiple of "
                      f"gpus_per_node {cl.gpus_per_node}", field="cluster.gpus_per_rack")
    if dep.offload is not None:
        for j, t in enumerate(dep.offload.tiers):
            if t.tier not in devices:
                raise Refusal("R4", f"offload tier {t.tier!r} is not a storage class of the "
                              f"catalog ({', '.join(sorted(devices))})",
                              field=f"offload.tiers[{j}].tier")
            if cl.storage is not None and t.tier not in cl.storage:
                raise Refusal("R4", f"offload tier {t.tier!r} is not in cluster.storage "
                              f"{list(cl.storage)}", field=f"offload.tiers[{j}].tier")
    for i, p in enumerate(dep.pools):
        par = p.parallel
        f = f"pools[{i}].parallel"
        if par.tp < 1 or par.dp < 1:
            raise Refusal("R5", f"tp and dp must be ≥ 1 (tp {par.tp}, dp {par.dp})",
                          field=f"{f}.{'tp' if par.tp < 1 else 'dp'}")
        if par.dp_local and (par.dp_local > par.dp or cl.gpus_per_node % par.dp_local):
            raise Refusal("R4", f"dp_local {par.dp_local} must be ≤ dp {par.dp} and divide "
                          f"gpus_per_node {cl.gpus_per_node}", field=f"{f}.dp_local")
        pcp, dcp = max(par.pcp, 1), par.dcp
        if pcp <= 1 and dcp > 1 and par.tp % dcp:
            raise Refusal("R5", f"dcp {dcp} must divide tp {par.tp}", field=f"{f}.dcp")
        if pcp > 1 and dcp not in (0, 1, pcp, par.tp * pcp):
            raise Refusal("R5", f"with pcp {pcp}, dcp must be one of 1, {pcp}, "
                          f"{par.tp * pcp} (got {dcp})", field=f"{f}.dcp")
        engine_gpus = par.pp * par.tp * pcp * par.dp
        pool_gpus = p.nodes * cl.gpus_per_node
        if pool_gpus % engine_gpus:
            raise Refusal("R4", f"one engine takes pp·tp·pcp·dp = {engine_gpus} GPUs, which "
                          f"does not divide the pool's {pool_gpus} GPUs (D17)", field=f)


def _check_heads(model: ModelGraph, dep: Deployment) -> None:
    """tp must divide the attention heads (R5): the engine would not start otherwise."""
    # spec silent; vLLM v0.31.0: ModelConfig.verify_with_parallel_config raises "Total
    # number of attention heads (N) must be divisible by tensor parallel size (tp)".
    # num_attention_heads is the primary (role-less) attention's n_q; a model without
    # attention (pure recurrent) is not checked.
    heads = sorted({n.n_q for lk in model.layer_kinds for n in lk.nodes
                    if n.op == "Attention" and not n.role and n.n_q})
    for i, p in enumerate(dep.pools):
        tp = p.parallel.tp
        bad = [h for h in heads if tp >= 1 and h % tp]
        if bad:
            ok = [w for w in range(1, bad[0] + 1) if all(h % w == 0 for h in heads)]
            raise Refusal("R5", f"tp {tp} does not divide the {bad[0]} attention heads of "
                          f"{model.name}; vLLM refuses it. Widths that divide: "
                          f"{', '.join(map(str, ok))}", field=f"pools[{i}].parallel.tp")


# ---------------------------------------------------------------------------------------
# Dtypes (§6, memory.md §1.2)
# ---------------------------------------------------------------------------------------

_QUANT_FP8 = ("fp8", "ptpc_fp8", "fbgemm_fp8", "modelopt")
_QUANT_FP4 = ("modelopt_fp4", "nvfp4")
_QUANT_GRAPH = ("bitsandbytes", "awq", "awq_marlin", "gptq", "gptq_marlin",
                "compressed-tensors")
_CACHE_REFUSED_R15 = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                      "turboquant_3bit_nc", "int4_per_token_head", "int8_per_token_head",
                      "fp8_per_token_head")


def _served_dtype(quant: str, checkpoint: str, field: str = "engine.quantization") -> str:
    if quant == "":
        return checkpoint
    if quant in _QUANT_FP8:
        return "fp8"
    if quant in _QUANT_FP4:
        return "nvfp4"
    if quant == "mxfp4":
        return "mxfp4"
    if quant in _QUANT_GRAPH:
        return checkpoint
    raise Refusal("R16", f"unknown quantization {quant!r}; allowed: "
                  f"{', '.join(_QUANT_FP8 + _QUANT_FP4 + ('mxfp4',) + _QUANT_GRAPH)}",
                  field=field)


def _suffix_and_peak(served: str, chip: Chip) -> tuple[str, float]:
    if served in ("fp8", "int8") and chip.fp8_peak_tflops > 0:
        return "fp8", chip.fp8_peak_tflops * 1e12
    if served in ("nvfp4", "mxfp4"):
        if chip.nvfp4_peak_tflops > 0:
            return "nvfp4", chip.nvfp4_peak_tflops * 1e12
        if chip.fp8_peak_tflops > 0:
            return "fp8", chip.fp8_peak_tflops * 1e12
    return "bf16", chip.bf16_peak_tflops * 1e12


# ---------------------------------------------------------------------------------------
# The resolution proper
# ---------------------------------------------------------------------------------------

class _Record:
    """Collects assumptions and overrides while resolving."""

    def __init__(self):
        self.assumptions: dict[str, str] = {}
        self.overrides: list[Override] = []

    def assume(self, name: str, value: Any, reason: str) -> None:
        self.assumptions[name] = f"{value}: {reason}"

    def override(self, fld: str, requested: Any, resolved: Any, reason: str) -> None:
        self.overrides.append(Override(fld, requested, resolved, reason))


def _snap_memory(widths: list[int], w: int) -> int:
    """Memory-family width snapping (resolution.md §5.4)."""
    if not widths:
        return w
    below = [x for x in widths if x <= w]
    return max(below) if below else min(widths)


def resolve(inputs: Inputs) -> Resolved:
    """Validate and resolve one pool (resolution.md §2). Raises :class:`Refusal`."""
    sc, dep, model, chip = inputs.scenario, inputs.deployment, inputs.model, inputs.chip
    missing = [n for n, v in (("scenario", sc), ("deployment", dep), ("model", model),
                              ("chip", chip)) if v is None]
    if missing:
        raise Refusal("R3", f"required document(s) absent: {', '.join(missing)}")
    if not 0 <= inputs.pool_index < len(dep.pools):
        raise Refusal("R3", f"no pool at index {inputs.pool_index}", field="pools")
    inputs = copy.deepcopy(inputs)   # a built kernel never changes with its inputs
    sc, dep, model, chip, fabric = (inputs.scenario, inputs.deployment, inputs.model,
                                    inputs.chip, inputs.fabric)
    rules = inputs.rules
    rec = _Record()
    _check_consistency(sc, dep, chip, inputs.devices)
    _check_heads(model, dep)
    cl = sc.cluster
    pool = dep.pools[inputs.pool_index]
    par, eng = pool.parallel, pool.engine
    pf = f"pools[{inputs.pool_index}]"

    # -- links (§2.3) ---------------------------------------------------------------------
    nvlink = chip.nvlink_gbps * 1e9
    nic = fabric.inter_node_gbps * 1e9 if fabric is not None else nvlink
    rack_domain = chip.rack_domain

    # -- parallel layout (§4) -------------------------------------------------------------
    tp, pp, dp = par.tp, par.pp, par.dp
    pcp, dcp = max(par.pcp, 1), max(par.dcp, 1)
    ep_on = par.enable_expert_parallel
    ep = tp * pcp * dp if ep_on else 1
    moe_group_width = ep if (ep_on or dp <= 1) else tp * pcp * dp
    moe_group = max(moe_group_width, ep)
    has_moe = any(n.op == "GroupedGEMM" for lk in model.layer_kinds for n in lk.nodes)
    sp_moe = ep_on and tp > 1 and dp > 1 and eng.all2all_backend in rules.sp_moe_backends
    requested_custom = not (eng.disable_custom_all_reduce is True
                            or eng.allreduce_backend == "nccl")
    ar_backend = "custom" if requested_custom else "nccl"
    if requested_custom and tp > 1:
        why = None
        if tp not in rules.custom_allreduce_widths:
            why = (f"custom all-reduce supports widths "
                   f"{', '.join(map(str, rules.custom_allreduce_widths))}, not tp {tp}")
        elif tp > cl.gpus_per_node and not rack_domain:
            why = f"tp {tp} spans nodes of {cl.gpus_per_node} GPUs without a rack NVLink domain"
        if why:
            ar_backend = "nccl"
            rec.override("allreduce_backend", "custom", "nccl", why)
    gpn = cl.gpus_per_node
    rack_gpus = cl.gpus_per_rack if cl.gpus_per_rack > 0 else chip.gpus_per_rack
    widest = max(tp, moe_group_width, tp * pcp)
    if rack_domain and rack_gpus > 0 and widest <= rack_gpus:
        nodes_spanned = 1
    else:
        nodes_spanned = math.ceil(widest / gpn) if gpn > 0 else 1

    def group(name: str, width: int, stride: int) -> GroupPlan:
        per_node = max(gpn // stride, 1) if gpn > 0 else 1
        if gpn <= 0 or width <= per_node:
            crosses = False
        elif rack_domain and width * stride <= rack_gpus:
            crosses = False   # D9: a group inside a rack-wide NVLink domain stays on NVLink
        else:
            crosses = True
        return GroupPlan(name, width, stride, per_node, crosses)

    groups = (group("TP", tp, 1), group("Expert", moe_group, 1),
              group("DCP", dcp, tp if (pcp > 1 and dcp <= pcp) else 1), group("PCP", pcp, tp))

    # -- coefficients (§5) ----------------------------------------------------------------
    chosen = select(inputs.coefficient_sets, hardware=cl.hardware, model=sc.model, tp=tp,
                    ep=ep, nodes_spanned=nodes_spanned)
    if not chosen:
        raise Refusal("R17", f"no coefficient of the sets {list(sc.coefficients)} applies to "
                      f"hardware {cl.hardware}, model {sc.model}, tp {tp}, ep {ep}, "
                      f"nodes_spanned {nodes_spanned}", field="coefficients")

    # -- dtypes (§6) ----------------------------------------------------------------------
    # resolution.md §13: `field` is the setting's document path, pools[i].engine.… like every
    # other engine refusal (before: the pool prefix was missing).
    served = _served_dtype(eng.quantization, model.weight_dtype, f"{pf}.engine.quantization")
    served_bytes = DTYPE_BYTES.get(served, 2.0)
    suffix, peak = _suffix_and_peak(served, chip)
    primaries = [n for lk in model.layer_kinds for n in lk.nodes
                 if n.op == "Attention" and not n.role]
    kinds_in_stack = set(model.stack.expanded())
    stack_primaries = [n for lk in model.layer_kinds if lk.id in kinds_in_stack
                       for n in lk.nodes if n.op == "Attention" and not n.role]
    first_attn = next((n for kid in _first_appearance(model) for n in model.kind(kid).nodes
                       if n.op == "Attention" and not n.role), None)
    latent_model = any(n.kind in LATENT_KINDS for n in primaries)
    sparse_model = any(n.kind == "sparse_mla" for n in primaries)
    dsa = any(n.kind == "sparse_mla" and n.d_h == 576 for n in primaries)
    has_recurrent = any(n.op == "RecurrentUpdate" for lk in model.layer_kinds
                        for n in lk.nodes)
    cache_elem, packed_cell, layout = _cache_layout(eng.cache_dtype, served_bytes, dsa,
                                                    latent_model, sparse_model, chip, dcp,
                                                    rec, pf)
    state_bytes = {"": 4.0, "auto": 4.0, "float32": 4.0, "float16": 2.0,
                   "bfloat16": 2.0}.get(eng.mamba_cache_dtype)
    if state_bytes is None:
        raise Refusal("R11", f"mamba_cache_dtype {eng.mamba_cache_dtype!r} is not accepted; "
                      "allowed: auto, float32, float16, bfloat16",
                      field=f"{pf}.engine.mamba_cache_dtype")

    # -- pipeline parallelism (§2.7) --------------------------------------------------------
    if pp > 1:
        raise Refusal("R13", f"pp {pp}: pipeline parallelism wider than 1 is not priced; use "
                      "pp 1 (widen tp or dp instead)", field=f"{pf}.parallel.pp")

    # -- plan (§2.8) ----------------------------------------------------------------------
    routed_a2a = ep_on and eng.all2all_backend not in ("", "naive", "allgather_reducescatter")
    kinds, head = plan_layers(model, tp=tp, moe_group=moe_group, sp_moe=sp_moe,
                              served_bytes=served_bytes, state_bytes=state_bytes,
                              routed_a2a=routed_a2a)

    # -- recurrent cache mode (§10) ---------------------------------------------------------
    prefix_on = eng.enable_prefix_caching is not False
    mamba_mode = ""
    if has_recurrent:
        stated = eng.mamba_cache_mode
        if stated not in ("", "none", "align", "all"):
            raise Refusal("R16", f"unknown mamba_cache_mode {stated!r}; allowed: none, align, "
                          "all", field=f"{pf}.engine.mamba_cache_mode")
        if stated in ("all", "align"):
            mamba_mode = stated
        elif stated == "none":
            mamba_mode = "align" if prefix_on else "none"
            if prefix_on:
                rec.override("mamba_cache_mode", "none", "align",
                             "prefix caching is on, and vLLM keeps aligned recurrent "
                             "checkpoints for it")
        else:
            mamba_mode = "align" if prefix_on else "none"
            rec.assume("mamba_cache_mode", mamba_mode,
                       "vLLM v0.31.0 default with prefix caching " + ("on" if prefix_on
                                                                      else "off"))

    # -- graph modes, capture ceiling, block size, scheduler defaults (§7, §11) ----------
    modes = {"PIECEWISE": (PIECEWISE, PIECEWISE), "FULL": (FULL, FULL),
             "FULL_AND_PIECEWISE": (FULL, PIECEWISE), "FULL_DECODE_ONLY": (FULL, EAGER),
             "NONE": (EAGER, EAGER)}
    mode_name = eng.cudagraph_mode or "FULL_AND_PIECEWISE"
    if mode_name not in modes:
        raise Refusal("R16", f"unknown cudagraph_mode {eng.cudagraph_mode!r}; allowed: "
                      f"{', '.join(modes)}", field=f"{pf}.engine.cudagraph_mode")
    if not eng.cudagraph_mode:
        rec.assume("cudagraph_mode", mode_name, "vLLM v0.31.0 default")
    decode_mode, other_mode = modes[mode_name]
    big = chip.memory_gib >= 70 and not chip.is_a100
    max_tokens = eng.max_num_batched_tokens
    if not max_tokens:
        max_tokens = 16384 if chip.memory_gib >= 160 else (8192 if big else 2048)
        rec.assume("max_num_batched_tokens", max_tokens,
                   f"vLLM v0.31.0 default for {chip.name} ({chip.memory_gib:g} GiB)")
    max_seqs = eng.max_num_seqs
    if not max_seqs:
        max_seqs = 1024 if big else 256
        rec.assume("max_num_seqs", max_seqs,
                   f"vLLM v0.31.0 default for {chip.name} ({chip.memory_gib:g} GiB)")
    num_spec = eng.speculative.num_spec_tokens if eng.speculative else 0
    uniform_width = 1 + num_spec
    if decode_mode == EAGER and other_mode == EAGER:
        ceiling = 0
    else:
        ceiling = min(max_seqs * uniform_width * 2, 1024 if chip.blackwell else 512)
        rec.assume("max_cudagraph_capture_size", ceiling,
                   "vLLM v0.31.0 capture sizes up to min(2·max_num_seqs·(1+num_spec), "
                   f"{1024 if chip.blackwell else 512}); the documents have no field for it")
    block = eng.block_size
    if not block:
        block = 64 if dsa else 16
        rec.assume("block_size", block, "the sparse-MLA indexer accepts only 64" if dsa
                   else "vLLM v0.31.0 default")

    # -- context parallelism (§8) and sparse MLA (§9) -----------------------------------
    stated_backend = eng.dcp_comm_backend
    if pcp > 1:
        if not all(n.kind in LATENT_KINDS for n in stack_primaries) or has_recurrent:
            raise Refusal("R5", "pcp > 1 needs every primary attention latent (mla or "
                          "sparse_mla) and no recurrent layer", field=f"{pf}.parallel.pcp")
        if dcp > 1 and not all(n.kind == "sparse_mla" for n in stack_primaries):
            raise Refusal("R6", "pcp > 1 with dcp > 1 is served only when every primary "
                          "attention is sparse_mla", field=f"{pf}.parallel.dcp")
        if stated_backend == "a2a":
            raise Refusal("R7", "the a2a DCP combine does not run with pcp > 1; use ag_rs",
                          field=f"{pf}.engine.dcp_comm_backend")
    dcp_backend = ""
    interleave = max(eng.cp_kv_cache_interleave_size, 1)
    mla_chunk = 0
    if dcp > 1:
        if stated_backend and stated_backend not in rules.dcp_combine_backends:
            raise Refusal("R8", f"dcp_comm_backend {stated_backend!r} is not accepted; "
                          f"allowed: {', '.join(rules.dcp_combine_backends)}",
                          field=f"{pf}.engine.dcp_comm_backend")
        dcp_backend = stated_backend or "ag_rs"
        if not stated_backend:
            rec.assume("dcp_comm_backend", "ag_rs", "vLLM v0.31.0 default DCP combine")
        interleave = _interleave(eng, dep, block, rec, pf)
        if eng.dcp_q_replicate is True and pcp <= 1 and latent_model:
            raise Refusal("R14", "dcp_q_replicate with a latent attention implies a "
                          "replicated query projection the graph cannot identify; set it "
                          "false", field=f"{pf}.engine.dcp_q_replicate")
        if latent_model:
            if eng.max_model_len:
                chunk0 = min(max(8 * eng.max_model_len, 4 * max_seqs * block), 65536)
            else:
                chunk0 = 65536
            align = math.lcm(block, dcp * interleave)
            mla_chunk = math.ceil(max(chunk0, align) / align) * align
            if not eng.max_model_len:
                rec.assume("mla_context_chunk", mla_chunk,
                           "max_model_len unstated: built from 65536, aligned to "
                           f"lcm(block, dcp·I) = {align}")
    if dsa:
        _check_dsa(model, chip, eng, block, dcp, pcp, tp, dcp_backend, layout, pf)

    # -- lift constants (§2.12) ---------------------------------------------------------
    coeff_value = {name: e.value for name, (e, _) in chosen.items()}
    if "hbm_derate" not in chosen:
        raise _missing("hbm_derate", cl.hardware)
    if chip.hbm_tbs * 1e12 * coeff_value["hbm_derate"] <= 0 or peak <= 0:
        raise Refusal("R20", f"non-positive HBM rate or compute peak (BwPeakTBs "
                      f"{chip.hbm_tbs} × hbm_derate {coeff_value['hbm_derate']}, peak {peak})",
                      field="hbm_derate")
    gemm = [f"gemm_eps_max_{suffix}", f"gemm_m_half_{suffix}", f"gemm_n_half_{suffix}",
            f"gemm_k_half_{suffix}"]
    for name in gemm[:2]:
        if name not in chosen:
            raise _missing(name, cl.hardware, f"served dtype {served} prices with suffix "
                           f"{suffix}")
    if (gemm[2] in chosen) != (gemm[3] in chosen):
        one, other = (gemm[2], gemm[3]) if gemm[2] in chosen else (gemm[3], gemm[2])
        raise Refusal("R17", f"{one} is stated without {other}: the shape-aware ramp needs "
                      "both or neither", field=one)
    shape_aware = gemm[2] in chosen

    used: set[str] = {"hbm_derate", *gemm[:2]}
    if shape_aware:
        used |= set(gemm[2:])
    optional_needed: dict[str, str] = {
        "host_admission_per_request": "admission charged without a per-request term",
        "host_admission_per_token": "admission charged without a per-token term",
        "host_output_token": "output tokens cost no host time",
        "host_completion": "completion costs no host time",
        "host_launch_eager_per_layer": "eager steps cost no per-layer launch time",
        "host_launch_per_kernel": "kernel launches cost no host time",
        "host_replay_graph_per_step": "graph replay costs no host time",
    }
    if primaries or any(n.op == "Attention" for lk in model.layer_kinds for n in lk.nodes):
        optional_needed.update({
            "attention_decode_floor": "decode attention priced without a floor",
            "attention_decode_rate": "decode KV read priced at HBM bandwidth, no floor",
            "attention_prefill_floor": "prefill attention priced without a floor",
            "attention_prefill_work_scale": "prefill attention FLOPs priced on the plain "
                                            "ramp, no floor"})
    attn_kinds = {n.kind for lk in model.layer_kinds for n in lk.nodes if n.op == "Attention"}
    for k in ("swa", "mla", "sparse_mla"):
        if k in attn_kinds:
            optional_needed[f"attention_decode_floor_{k}"] = f"{k} uses the part-wide floor"
            optional_needed[f"attention_decode_rate_{k}"] = f"{k} uses the part-wide pair"
    rec_kinds = sorted({n.recurrent_kind for lk in model.layer_kinds for n in lk.nodes
                        if n.op == "RecurrentUpdate"})
    for r in rec_kinds:
        optional_needed[f"recurrent_decode_floor_{r}"] = f"{r} mixers cost 0"
        optional_needed[f"recurrent_decode_rate_{r}"] = f"{r} mixers cost 0"
    if has_moe:
        optional_needed["moe_routing_imbalance_median"] = "routed FLOPs not inflated (1)"
    if dep.offload is not None:
        optional_needed["host_link_bandwidth"] = "offload transfers not capped by the host link"
    for name, reason in optional_needed.items():
        used.add(name)
        if name not in chosen:
            rec.assume(name, "absent", reason)
    # methods.md §5: tier_time caps every known tier (D25: every storage class, offload tiers
    # or not) by host_link_bandwidth, so an applicable entry is lifted even without offload
    # tiers; only its absence is recorded conditionally (§5.2). (Before: it was lifted only
    # with offload tiers, and tier_time then ran uncapped.)
    if "host_link_bandwidth" in chosen:
        used.add("host_link_bandwidth")
    # jkernel's own expected_s constants (expected.md): defaults until a trace fit
    own_defaults = {"kernel_gap": (0.0, "no idle gap between kernels until a step-trace fit"),
                    "host_serial": (0.0, "no serial host time until a step-trace fit")}
    for name, (value, reason) in own_defaults.items():
        used.add(name)
        if name not in chosen:
            rec.assume(name, value, reason)
            coeff_value[name] = value

    # collective keys (§5.3)
    chip_key = cl.hardware.replace("-", "_")
    key_specs = collectives_needed(kinds, tp=tp, moe_group=moe_group, has_moe=has_moe,
                                   dcp=dcp, pcp=pcp, dcp_backend=dcp_backend)
    coll_keys = []
    for op, gname in key_specs:
        g = next(x for x in groups if x.name == gname)
        width = _snap_collective(op, g.width, chip_key, chosen)
        names = tuple(f"collective_{part}_{op}_fp16_{width}rank_{chip_key}"
                      for part in ("floor", "peak_rate", "transition_rate"))
        coll_keys.append(CollectiveKey(op, gname, width, *names))
        used |= set(names)

    # expert geometry (§4.7)
    eplb_on = bool(eng.eplb and eng.eplb.enable_eplb)
    redundant = eng.eplb.num_redundant_experts if eplb_on else 0   # D24
    experts = max((k.experts for k in kinds if k.moe), default=0)
    e_phys = experts + redundant
    if has_moe and ep_on:
        base, extra = divmod(e_phys, ep)
        if base == 0:
            raise Refusal("R12", f"the EP width {ep} exceeds the {e_phys} physical experts, so "
                          f"some rank would hold none; use EP ≤ {e_phys}",
                          field=f"{pf}.parallel")
        per_rank = base + (1 if extra else 0)
    else:
        per_rank = e_phys
    shards = 1 if ep_on else tp * dp

    # methods.md §4: the PD transfer floor is the (alltoall, Expert) key's t0. spec silent
    # where no expert group exists: take the chip's narrowest measured alltoall floor.
    pd_floor = next((k.floor for k in coll_keys if k.op == "alltoall" and k.group == "Expert"),
                    None)
    if pd_floor is None:
        stem = f"collective_floor_alltoall_fp16_"
        found = sorted((int(n[len(stem):].split("rank_")[0]), n) for n in chosen
                       if n.startswith(stem) and n.endswith(f"rank_{chip_key}")
                       and n[len(stem):].split("rank_")[0].isdigit())
        pd_floor = found[0][1] if found else None
    if pd_floor is not None:
        used.add(pd_floor)

    # memory magnitudes (memory.md §4)
    mem = plan_memory(model, kinds, head, chosen=chosen, tp=tp, dcp=dcp, pcp=pcp,
                      moe_group=moe_group, has_moe=has_moe,
                      checkpoint_bytes=DTYPE_BYTES[model.weight_dtype], max_tokens=max_tokens,
                      mode_name=mode_name, snap=_snap_memory, hardware=cl.hardware,
                      experts_per_rank=per_rank, shards=shards, redundant=redundant,
                      ep=max(ep, 1), mamba_mode=mamba_mode, num_spec=num_spec,
                      missing=_missing)
    used |= set(mem.coefficient_names)

    # KV geometry (memory.md §1)
    kv_layers = sum(k.count for k in kinds if k.attention is not None)
    if first_attn is not None:
        if packed_cell:
            kvB = packed_cell * kv_layers
        else:
            tensors = 1 if first_attn.kind in LATENT_KINDS else 2
            heads = max(1, first_attn.n_kv // tp)
            kvB = tensors * heads * first_attn.d_h * cache_elem * kv_layers
    else:
        kvB = 0.0
    sparse_secondary = sum(k.count for k in kinds if k.attention is not None
                           and k.attention.kind == "sparse_mla" and k.secondaries)
    total_layers = model.total_layers
    total_kernels = sum(k.count * k.launches for k in kinds) + head["launches"]

    decode_pairs = [("", "attention_decode_floor", "attention_decode_rate")]
    for k in ("swa", "mla", "sparse_mla"):
        if f"attention_decode_rate_{k}" in chosen:
            fl = (f"attention_decode_floor_{k}" if f"attention_decode_floor_{k}" in chosen
                  else "attention_decode_floor")
            decode_pairs.append((k, fl, f"attention_decode_rate_{k}"))
    rec_names = tuple((r, f"recurrent_decode_floor_{r}", f"recurrent_decode_rate_{r}")
                      for r in rec_kinds)

    # expected_s prices the MTP drafter (vLLM v0.31.0 runs one speculator module per draft
    # token); the edges never do (D7). Only kinds the main stack plans can be priced.
    draft_kinds: tuple = ()
    if num_spec > 0 and model.speculator is not None:
        planned = {k.id for k in kinds}
        pattern = model.speculator.stack.pattern
        draft_kinds = tuple((kid, pattern.count(kid)) for kid in dict.fromkeys(pattern)
                            if kid in planned)
    plan = Plan(
        kinds=kinds, head_flops_per_token=head["flops_per_token"],
        head_weight_bytes=head["weight_bytes"], hidden_size=model.hidden_size,
        total_layers=total_layers, kv_layers=kv_layers,
        segments=total_layers + sparse_secondary + 1, total_kernels=total_kernels,
        tp=tp, dp=dp, pcp=pcp, dcp=dcp, ep=ep, moe_group=moe_group, interleave=interleave,
        groups=groups, collective_keys=tuple(coll_keys), physical_experts=e_phys,
        experts_per_rank=per_rank,
        local_expert_share=(per_rank / e_phys if (ep_on and e_phys) else 1.0),
        expert_tensor_shards=shards, dp_slice=(shards / tp if ep <= 1 else 1.0),
        funnel=dp if (moe_group > 1 and dp > 1) else 1, routed_a2a=routed_a2a,
        shape_aware=shape_aware, blackwell=chip.blackwell,
        decode_mode=decode_mode, other_mode=other_mode, capture_ceiling=ceiling,
        uniform_decode_width=uniform_width, num_spec=num_spec, kv_bytes_per_token=kvB,
        block_size=block, dcp_comm_backend=dcp_backend, mla_chunk=mla_chunk,
        gemm_names=tuple(gemm), decode_pairs=tuple(decode_pairs), recurrent_names=rec_names,
        draft_kinds=draft_kinds)

    # -- params pytree ------------------------------------------------------------------
    values: dict[str, float] = {}
    for name in sorted(used):
        values[name] = coeff_value.get(name, 0.0) * si_scale(name)
    values.update({"peak_flops_per_s": peak, "hbm_bytes_per_s": chip.hbm_tbs * 1e12,
                   "nvlink_bytes_per_s": nvlink, "nic_bytes_per_s": nic,
                   "sm_count": float(chip.sm_count)})
    assert set(CHIP_NAMES) <= set(values)
    import jax.numpy as jnp

    params = Params({k: jnp.asarray(v, dtype=jnp.float64) for k, v in values.items()})

    # -- version and provenance (§7, §12) ---------------------------------------------------
    if sc.engine_version != ENGINE_BEHAVIOUR_VERSION:
        rec.assume("engine_version", ENGINE_BEHAVIOUR_VERSION,
                   f"declared {sc.engine_version}; priced as vLLM v{ENGINE_BEHAVIOUR_VERSION} "
                   "behaviour (D11)")
    util = eng.gpu_memory_utilization
    if not util:
        util = 0.92
        rec.assume("gpu_memory_utilization", 0.92, "vLLM v0.31.0 default (D15)")
    provenance = tuple(
        CoefficientOrigin(name, set_name, e.method, e.scope.render())
        for name, (e, set_name) in sorted(chosen.items())
    ) + tuple(CoefficientOrigin(name, KERNEL_ASSUMPTION_SET, "assumed", scope)
              for name, scope in sorted(rec.assumptions.items()))
    resolution = Resolution(
        tensor_parallel_width=tp, data_parallel_width=dp, expert_parallel_width=ep,
        all_reduce_backend=ar_backend,
        async_scheduling=eng.async_scheduling if eng.async_scheduling is not None else True,
        cascade_attention=eng.disable_cascade_attn is False, sequence_parallel_moe=sp_moe,
        overrides=tuple(rec.overrides), decode_context_parallel_width=dcp,
        prefill_context_parallel_width=pcp)
    settings = {"block_size": block, "max_num_batched_tokens": max_tokens,
                "max_num_seqs": max_seqs, "cudagraph_mode": mode_name,
                "gpu_memory_utilization": util, "served_dtype": served,
                "cache_layout": layout, "mamba_cache_mode": mamba_mode,
                "num_spec_tokens": num_spec, "nodes_spanned": nodes_spanned,
                "moe_group": moe_group, "dcp_comm_backend": dcp_backend,
                "dcp_interleave": interleave, "state_bytes": state_bytes,
                "pd_floor_name": pd_floor,
                # vLLM classifies a request as a decode up to the uniform decode width
                # (1 + num_spec); a backend may raise it (FlashMLA 128), which the caller
                # passes per batch (step.md §1.1, D27).
                "decode_threshold": uniform_width,
                "engine_gpus": pp * tp * pcp * dp,
                "engines": (pool.nodes * cl.gpus_per_node) // (pp * tp * pcp * dp),
                "dcp_shards_all_kv_layers": bool(stack_primaries) and all(
                    n.kind in ("gqa", "mla", "sparse_mla") for n in stack_primaries)}
    links = {"nvlink_bytes_per_s": nvlink, "nic_bytes_per_s": nic, "rack_domain": rack_domain}
    return Resolved(plan, params, mem, resolution, provenance, settings, inputs, links)


def _first_appearance(model: ModelGraph) -> list[str]:
    seen: list[str] = []
    for kid in model.stack.expanded():
        if kid not in seen:
            seen.append(kid)
    return seen


def _missing(name: str, hardware: str, why: str = "") -> Refusal:
    extra = f" ({why})" if why else ""
    return Refusal("R17", f"required coefficient {name} has no applicable entry for hardware "
                   f"{hardware}{extra}; add it to a listed coefficient set", field=name)


def _snap_collective(op: str, width: int, chip_key: str, chosen: dict) -> int:
    """Collective width snapping (resolution.md §5.3); R18 when no width fits."""
    measured = []
    cands = sorted({int(name.split("_fp16_")[1].split("rank_")[0])
                    for name in chosen if name.startswith(f"collective_floor_{op}_fp16_")
                    and name.endswith(f"rank_{chip_key}")
                    and name.split("_fp16_")[1].split("rank_")[0].isdigit()})
    for n in cands:
        stem = f"{op}_fp16_{n}rank_{chip_key}"
        if all(f"collective_{p}_{stem}" in chosen for p in ("floor", "peak_rate",
                                                             "transition_rate")):
            measured.append(n)
    if not measured:
        raise Refusal("R18", f"no measured width for collective {op} on {chip_key}: need "
                      f"collective_floor/peak_rate/transition_rate_{op}_fp16_<N>rank_{chip_key}",
                      field=f"collective_{op}")
    if width <= min(measured):
        return min(measured)
    if width in measured:
        return width
    if width > 16:
        return max(measured)
    raise Refusal("R18", f"a {width}-rank {op} group is not measured on {chip_key} (measured "
                  f"widths {measured}); borrowing another width would misprice it",
                  field=f"collective_{op}")


def _interleave(eng, dep: Deployment, block: int, rec: _Record, pf: str) -> int:
    """DCP interleave (resolution.md §8.3, D16)."""
    stated = eng.cp_kv_cache_interleave_size
    connectors = {dep.pd_transfer_connector or ""}
    if dep.offload is not None:
        connectors.add(dep.offload.connector)
    multi, nixl = "MultiConnector" in connectors, "NixlConnector" in connectors
    fits = lambda i: i <= block and block % i == 0  # noqa: E731
    f = f"{pf}.engine.cp_kv_cache_interleave_size"
    if stated > 0:
        if stated == 1:
            return 1
        if nixl and not multi:
            return stated
        if not eng.block_size:
            raise Refusal("R9", f"interleave {stated} with an unstated (assumed) block size "
                          "cannot be confirmed to fit; state block_size or use 1", field=f)
        if not fits(stated):
            raise Refusal("R9", f"interleave {stated} does not fit block {block} (it must be "
                          "≤ block and divide it)", field=f)
        return stated
    if multi:
        raise Refusal("R9", "MultiConnector needs a stated cp_kv_cache_interleave_size",
                      field=f)
    if nixl and block > 1:
        rec.override("cp_kv_cache_interleave_size", 0, block,
                     "NixlConnector transfers whole blocks, so vLLM stripes by the block")
        return block
    return 1


def _cache_layout(cache: str, served_bytes: float, dsa: bool, latent: bool, sparse: bool,
                  chip: Chip, dcp: int, rec: _Record, pf: str
                  ) -> tuple[float, float, str]:
    """Cache element bytes, packed per-layer cell bytes (0 if not packed), layout name."""
    f = f"{pf}.engine.cache_dtype"
    if cache in _CACHE_REFUSED_R15:
        raise Refusal("R15", f"cache layout {cache!r} is not sized by the kernel; use fp8 or "
                      "auto", field=f)
    if cache in ("", "auto"):
        if dsa and dcp > 1:
            raise Refusal("R10", "a 16-bit sparse-MLA cache does not run with dcp > 1; use "
                          "cache_dtype fp8 (packed fp8_ds_mla)", field=f)
        return (2.0 if served_bytes < 2 else served_bytes), 0.0, cache or "auto"
    if cache in ("bfloat16", "float16"):
        if dsa and dcp > 1:
            raise Refusal("R10", "a 16-bit sparse-MLA cache does not run with dcp > 1; use "
                          "cache_dtype fp8 (packed fp8_ds_mla)", field=f)
        return 2.0, 0.0, cache
    if cache == "float32":
        return 4.0, 0.0, cache
    if cache in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        if dsa:
            rec.override("cache_dtype", cache, "fp8_ds_mla", "packed sparse-MLA layout")
            return 1.0, 656.0, "fp8_ds_mla"
        return 1.0, 0.0, cache
    if cache == "fp8_ds_mla":
        if not sparse:
            raise Refusal("R11", "fp8_ds_mla needs a sparse_mla model; use fp8", field=f)
        return 1.0, 656.0, cache
    if cache == "nvfp4_ds_mla":
        if not sparse:
            raise Refusal("R11", "nvfp4_ds_mla needs a sparse_mla model; use fp8", field=f)
        if dsa and not chip.blackwell:
            raise Refusal("R10", "nvfp4_ds_mla needs native FP4 (data-centre Blackwell); "
                          "use fp8", field=f)
        return 0.5625, 352.0, cache
    if cache in ("nvfp4", "nvfp4_4over6"):
        if latent:
            raise Refusal("R11", f"{cache} is not accepted on a latent (MLA) cache; use fp8",
                          field=f)
        return 0.5625, 0.0, cache
    if cache == "fp8_inc":
        raise Refusal("R11", "fp8_inc is not accepted by vLLM v0.31.0 for this cache; use fp8",
                      field=f)
    raise Refusal("R11", f"cache_dtype {cache!r} is not accepted; allowed: auto, fp8, "
                  "fp8_e4m3, fp8_e5m2, bfloat16, float16, float32, nvfp4, fp8_ds_mla, "
                  "nvfp4_ds_mla", field=f)


def _check_dsa(model: ModelGraph, chip: Chip, eng, block: int, dcp: int, pcp: int, tp: int,
               backend: str, layout: str, pf: str) -> None:
    """Sparse-MLA (DSA) rules (resolution.md §9, D12)."""
    if chip.pre_hopper:
        raise Refusal("R10", f"sparse MLA (DSA) needs Hopper or newer, not {chip.name}",
                      field="cluster.hardware")
    if eng.block_size and eng.block_size % 64:
        raise Refusal("R10", f"block_size {eng.block_size}: the DSA indexer needs a multiple "
                      "of 64; use 64", field=f"{pf}.engine.block_size")
    if dcp > 1:
        if backend == "a2a":
            raise Refusal("R10", "the a2a DCP combine is not served for sparse MLA; use ag_rs",
                          field=f"{pf}.engine.dcp_comm_backend")
        if pcp <= 1:
            n_q = next(n.n_q for lk in model.layer_kinds for n in lk.nodes
                       if n.op == "Attention" and not n.role and n.kind == "sparse_mla")
            h_loc = n_q / tp
            pad = lambda h: 64 if h <= 64 else 128  # noqa: E731
            if h_loc >= 32 or pad(h_loc) != pad(h_loc * dcp):
                raise Refusal("R10", f"DSA with dcp {dcp} needs fewer than 32 local heads "
                              f"and the same head padding (n_q/tp = {h_loc:g})",
                              field=f"{pf}.parallel.dcp")
        elif layout != "fp8_ds_mla":
            raise Refusal("R10", "DSA with dcp > 1 and pcp > 1 needs the fp8_ds_mla layout",
                          field=f"{pf}.engine.cache_dtype")

