"""Construction: documents → widths, defaults, refusals, provenance, plan and params.

Everything here runs once per pool, in plain Python, and may raise :class:`Refusal`
(resolution.md §13). :func:`resolve` composes pure stages, each returning a frozen record:

* :func:`resolve_layout` → :class:`Layout` (widths, groups, all-reduce backend, links);
* :func:`~jkernel.plan.plan_layers` → the kind plans, and :func:`graph_facts` →
  :class:`GraphFacts` (what the rules need to know of the model, read from the kind plans);
* :func:`resolve_dtypes` → :class:`Dtypes` (served dtype, GEMM family, cache layout);
* :func:`resolve_engine_defaults` → :class:`EngineDefaults` (unstated settings defaulted);
* :func:`resolve_context_parallel` → :class:`ContextParallel`;
* :func:`resolve_coefficients` → :class:`Coefficients` (lifted values, the collective keys of
  :func:`collective_keys`, the names the step reads);
* :func:`resolve_experts`, :func:`build_plan`, :func:`build_params`, :func:`provenance_of`;
* :func:`settings_of` → :class:`EngineSettings` (what ``Kernel.settings`` returns).

Each stage's assumptions and overrides travel in its record's :class:`Notes`. The result,
:class:`Resolved`, holds the static :class:`~jkernel.plan.Plan`, the
:class:`~jkernel.params.Params` pytree and the introspection records of §12.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import catalog as _catalog
from .documents import (Chip, CoefficientSet, Deployment, Fabric, ModelGraph, Scenario,
                        StorageClass, load_bundle, load_chip, load_coefficient_set,
                        load_fabric, load_graph, load_storage, parse_bundle, select)
from .documents.coefficients import outside_fitted
from .documents.graph import DTYPE_BYTES
from .errors import Refusal
from .memory import MemoryPlan, plan_memory
from .params import CHIP_NAMES, Params, si_scale
from .plan import (AttentionPlan, GraphMode, CollectiveKey, GroupPlan, KindPlan,
                   Plan, collectives_needed, plan_layers)

__all__ = ["ENGINE_BEHAVIOUR_VERSION", "KERNEL_ASSUMPTION_SET", "RULES", "Rules", "Inputs",
           "Override", "CoefficientOrigin", "Resolution", "EngineSettings", "Links",
           "Resolved", "open_inputs", "resolve"]

ENGINE_BEHAVIOUR_VERSION = "0.31.0"
KERNEL_ASSUMPTION_SET = "jkernel"


@dataclass(frozen=True)
class Rules:
    """The built-in engine rules table (documents.md §9), applied to every covered version."""

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
    bundle_file: str | None = None    # where the scenario bundle was read from, if a file
    model_file: str | None = None     # where the model graph was read from
    model_max_len: int = 0            # the model's longest context as vLLM derives it; 0 unknown
    allow_long_max_model_len: bool = False   # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 at open time


@dataclass(frozen=True)
class Override:
    field: str
    requested: Any
    resolved: Any
    reason: str


@dataclass(frozen=True)
class CoefficientOrigin:
    """Where one value came from (resolution.md §12): its coefficient set, method and scope;
    ``fitted_on``: the deployments of the data a fitted entry was fitted on ("" when not
    recorded); ``outside``: how this deployment lies outside them (another chip, engine
    version, model or tp: the value is borrowed there), "" when inside or not recorded."""

    name: str
    set: str
    method: str
    scope: str
    outside: str = ""
    fitted_on: str = ""


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
class EngineSettings:
    """The engine settings one pool runs with, unstated ones resolved as vLLM v0.31.0
    resolves them (resolution.md §7, §10, §11): ``Kernel.settings``. A scheduler sizes
    itself from the first group (the replay reads them here, never from the documents);
    :meth:`as_dict` gives them all as JSON-ready values."""

    # -- what a scheduler sizes itself from --------------------------------------------------
    block_size: int                 # tokens per KV page
    max_num_batched_tokens: int     # the token budget of one step
    max_num_seqs: int               # running requests at most, per replica
    #: The longest request (prompt + output tokens) the engine serves: the stated one, else
    #: the length vLLM derives from the model's config.json (0 when neither is known).
    max_model_len: int
    enable_prefix_caching: bool
    async_scheduling: bool
    #: A waiting request is admitted only if its whole known sequence (prompt, and the
    #: tokens sampled before a preemption) fits the free KV blocks, not only its first chunk
    #: (vLLM's ``scheduler_reserve_full_isl``, on by default in v0.31.0; docs/simulator.md).
    scheduler_reserve_full_isl: bool
    #: vLLM classifies a request as a decode up to the uniform decode width (1 + num_spec);
    #: a backend may raise it (FlashMLA 128), which the caller passes per batch (step.md §1.1).
    decode_threshold: int
    engines: int                    # identical engines in the pool
    engine_gpus: int                # GPUs of one engine (pp · tp · pcp · dp)
    gpu_memory_utilization: float
    # -- what the kernel priced and sized with ----------------------------------------------
    cudagraph_mode: str
    served_dtype: str
    cache_layout: str
    mamba_cache_mode: str           # "" without recurrent layers
    num_spec_tokens: int
    state_bytes: float              # recurrent state element bytes
    nodes_spanned: int
    moe_group: int
    dcp_comm_backend: str           # "" without decode context parallelism
    dcp_interleave: int
    dcp_shards_all_kv_layers: bool
    pd_floor_name: str | None       # the PD transfer floor coefficient, None when none applies

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name (plain ints, floats, strings, bools, None)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Links:
    """The pool's link rates and whether its chips share a rack-wide NVLink domain."""

    nvlink_bytes_per_s: float
    nic_bytes_per_s: float
    rack_domain: bool


@dataclass(frozen=True)
class Resolved:
    plan: Plan
    params: Params
    memory: MemoryPlan
    resolution: Resolution
    provenance: tuple[CoefficientOrigin, ...]
    settings: EngineSettings = field(hash=False, compare=False)
    inputs: Inputs = field(hash=False, compare=False)
    links: Links = field(hash=False, compare=False)


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
    bundle_file = None
    if isinstance(bundle, (str, Path)) and not (isinstance(bundle, str) and "\n" in bundle):
        path = _catalog.scenario_path(bundle, repos)
        scenario, deployment = load_bundle(path)
        bundle_file = str(path)
    else:
        scenario, deployment = parse_bundle(bundle)
    index = _pool_index(deployment, pool)
    croot = _catalog.catalog_root(repos)
    rroot = _catalog.registry_root(repos)
    model_path = _need(croot / "models" / scenario.model / "graph.yaml", "model", scenario.model)
    model = load_graph(model_path, expected_name=scenario.model)
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
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true")
    return Inputs(scenario, deployment, index, model, chip, fabric, devices, sets,
                  bundle_file=bundle_file, model_file=str(model_path),
                  model_max_len=_derived_max_model_len(model, model_path),
                  allow_long_max_model_len=allow_long)


#: Config keys vLLM reads a model's context length from, taking the smallest present
#: (vLLM v0.31.0 ModelConfig, _get_and_verify_max_len).
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")


def _derived_max_model_len(model: ModelGraph, graph_path: Path) -> int:
    """The longest context vLLM derives from the model's config.json, 0 when unknown.

    Follows vLLM v0.31.0 _get_and_verify_max_len: the smallest of the length keys, scaled by
    a RoPE scaling ``factor`` (yarn scales its ``original_max_position_embeddings``); the
    su, longrope and llama3 RoPE types are not scaled.
    """
    src = dict(model.derived_from).get("path") if model.derived_from else None
    cfg_path = graph_path.parent / (src or "config.json")
    if not cfg_path.is_file():
        return 0
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return 0
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    lengths = [cfg[k] for k in _MAX_LEN_KEYS
               if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)]
    if not lengths:
        return 0
    derived = float(min(lengths))
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict) and "factor" in rope:
        kind = rope.get("rope_type", rope.get("type", ""))
        if kind not in ("su", "longrope", "llama3"):
            if kind == "yarn" and "original_max_position_embeddings" in rope:
                derived = float(rope["original_max_position_embeddings"])
            derived *= float(rope["factor"])
    return int(derived)


def _need(path: Path, what: str, name: str) -> Path:
    if not path.is_file():
        raise Refusal("R2", f"{what} {name!r} not found (looked for {path})", file=str(path))
    return path


def _pool_index(dep: Deployment, pool: int | str) -> int:
    from .validate import pool_selector

    pool = pool_selector(pool)
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
                          f"does not divide the pool's {pool_gpus} GPUs, so the pool cannot "
                          "be split into whole engines", field=f)


def _check_heads(model_name: str, facts: "GraphFacts", dep: Deployment) -> None:
    """The attention heads must split over tp as vLLM splits them (R5)."""
    # spec silent; vLLM v0.31.0: ModelConfig.verify_with_parallel_config raises "Total
    # number of attention heads (N) must be divisible by tensor parallel size (tp)".
    # num_attention_heads is the primary (role-less) attention's n_q; a model without
    # attention (pure recurrent) is not checked.
    heads = sorted({a.n_q for a in facts.primaries if a.n_q})
    for i, p in enumerate(dep.pools):
        tp = p.parallel.tp
        bad = [h for h in heads if tp >= 1 and h % tp]
        if bad:
            ok = [w for w in range(1, bad[0] + 1) if all(h % w == 0 for h in heads)]
            raise Refusal("R5", f"tp {tp} does not divide the {bad[0]} attention heads of "
                          f"{model_name}; vLLM refuses it. Widths that divide: "
                          f"{', '.join(map(str, ok))}", field=f"pools[{i}].parallel.tp")
    # vLLM v0.31.0: the attention backends need whole query groups (num_heads divisible by
    # num_kv_heads), and QKVParallelLinear shards KV heads over tp (n_kv divisible by tp)
    # or replicates them (tp divisible by n_kv). Latent attention has one shared latent.
    grouped = sorted({(a.n_q, a.n_kv) for a in facts.primaries
                      if not a.kind.latent and a.n_q and a.n_kv})
    for n_q, n_kv in grouped:
        if n_q % n_kv:
            raise Refusal("R5", f"{model_name} has {n_q} query heads for {n_kv} KV heads; vLLM "
                          "does not start it: each KV head must serve a whole group of query "
                          "heads", field="n_kv")
    for i, p in enumerate(dep.pools):
        tp = p.parallel.tp
        for n_q, n_kv in grouped:
            if tp > 1 and (tp % n_kv if tp >= n_kv else n_kv % tp):
                raise Refusal("R5", f"tp {tp} neither divides nor is a multiple of the {n_kv} "
                              f"KV heads of {model_name}; vLLM does not start it, as it can "
                              "neither shard nor replicate them evenly",
                              field=f"pools[{i}].parallel.tp")


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
# Stage records: each stage is a pure function of the documents and the earlier records
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Notes:
    """What one stage assumed (``name → "value: reason"``) and overrode, in its order."""

    assumptions: tuple[tuple[str, str], ...] = ()
    overrides: tuple[Override, ...] = ()


class _Record:
    """Collects one stage's assumptions and overrides; :meth:`notes` freezes them."""

    def __init__(self):
        self.assumptions: dict[str, str] = {}
        self.overrides: list[Override] = []

    def assume(self, name: str, value: Any, reason: str) -> None:
        self.assumptions[name] = f"{value}: {reason}"

    def override(self, fld: str, requested: Any, resolved: Any, reason: str) -> None:
        self.overrides.append(Override(fld, requested, resolved, reason))

    def notes(self) -> Notes:
        return Notes(tuple(self.assumptions.items()), tuple(self.overrides))


@dataclass(frozen=True)
class Layout:
    """Parallel layout and links of one pool (resolution.md §2.3, §4): widths ≥ 1."""

    tp: int
    pp: int
    dp: int
    pcp: int
    dcp: int
    expert_parallel: bool
    ep: int
    moe_group: int
    sp_moe: bool
    routed_a2a: bool
    all_reduce_backend: str
    nodes_spanned: int
    groups: tuple[GroupPlan, ...]
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float
    rack_domain: bool
    notes: Notes = Notes()

    def group(self, name: str) -> GroupPlan:
        return next(g for g in self.groups if g.name == name)


@dataclass(frozen=True)
class GraphFacts:
    """What the resolution needs to know of the model, read from the kind plans.

    ``primaries``: each planned kind's role-less attention, in stack order.
    """

    primaries: tuple[AttentionPlan, ...]
    attention_kinds: frozenset[str]      # primary and secondary attention kinds
    recurrent_kinds: tuple[str, ...]     # sorted
    has_moe: bool
    experts: int                         # routed experts of the widest MoE kind

    @property
    def has_attention(self) -> bool:
        return bool(self.attention_kinds)

    @property
    def has_recurrent(self) -> bool:
        return bool(self.recurrent_kinds)

    @property
    def first_attention(self) -> AttentionPlan | None:
        return self.primaries[0] if self.primaries else None

    @property
    def latent(self) -> bool:
        return any(a.kind.latent for a in self.primaries)

    @property
    def sparse(self) -> bool:
        return any(a.kind == "sparse_mla" for a in self.primaries)

    @property
    def dsa(self) -> bool:
        """DeepSeek sparse attention: sparse MLA over the 576-wide latent."""
        return any(a.kind == "sparse_mla" and a.d_h == 576 for a in self.primaries)

    @property
    def dcp_shards_all_kv_layers(self) -> bool:
        """Every primary attention's KV is sharded by DCP (no window or recurrent kind)."""
        return bool(self.primaries) and all(a.kind in ("gqa", "mla", "sparse_mla")
                                            for a in self.primaries)


def graph_facts(kinds: tuple[KindPlan, ...]) -> GraphFacts:
    return GraphFacts(
        primaries=tuple(k.attention for k in kinds if k.attention is not None),
        attention_kinds=frozenset(
            [k.attention.kind for k in kinds if k.attention is not None]
            + [s.kind for k in kinds for s in k.secondaries]),
        recurrent_kinds=tuple(sorted({k.recurrent.kind for k in kinds
                                      if k.recurrent is not None})),
        has_moe=any(k.moe for k in kinds),
        experts=max((k.experts for k in kinds if k.moe), default=0))


@dataclass(frozen=True)
class Dtypes:
    """Served weight dtype, its compute peak, and the cache layout (§6, memory.md §1.2)."""

    served: str
    served_bytes: float
    suffix: str                 # the GEMM coefficient family: bf16, fp8, nvfp4
    peak_flops_per_s: float
    state_bytes: float          # recurrent state element bytes
    cache_element_bytes: float
    packed_cell_bytes: float    # one layer's packed cell, 0 when not packed
    cache_layout: str
    notes: Notes = Notes()


@dataclass(frozen=True)
class EngineDefaults:
    """Engine settings as the engine would run them, unstated ones defaulted (§7, §10, §11)."""

    cudagraph_mode: str
    decode_mode: int
    other_mode: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_spec_tokens: int
    uniform_decode_width: int
    capture_ceiling: int
    block_size: int
    mamba_cache_mode: str
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    async_scheduling: bool
    reserve_full_isl: bool
    notes: Notes = Notes()


@dataclass(frozen=True)
class ContextParallel:
    """The DCP combine, KV interleave and MLA context chunk (§8)."""

    dcp_comm_backend: str
    interleave: int
    mla_chunk: int
    notes: Notes = Notes()


@dataclass(frozen=True)
class Coefficients:
    """Registry values lifted for one pool (§2.12, §5) and the names the step reads."""

    values: dict = field(hash=False, compare=False)   # name → value in document units
    used: frozenset[str] = frozenset()
    gemm_names: tuple[str, str, str, str] = ("", "", "", "")
    shape_aware: bool = False
    collective_keys: tuple[CollectiveKey, ...] = ()
    pd_floor_name: str | None = None
    decode_pairs: tuple[tuple[str, str, str], ...] = ()
    recurrent_names: tuple[tuple[str, str, str], ...] = ()
    notes: Notes = Notes()


@dataclass(frozen=True)
class Experts:
    """Expert geometry (§4.7)."""

    physical: int
    per_rank: int
    shards: int
    redundant: int


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------

def _snap_memory(widths: list[int], w: int) -> int:
    """Memory-family width snapping (resolution.md §5.4)."""
    if not widths:
        return w
    below = [x for x in widths if x <= w]
    return max(below) if below else min(widths)


def resolve_layout(sc: Scenario, pool, chip: Chip, fabric: Fabric | None,
                   rules: Rules = RULES) -> Layout:
    """Widths, groups, the all-reduce backend and the links of one pool (§2.3, §4)."""
    cl, par, eng = sc.cluster, pool.parallel, pool.engine
    rec = _Record()
    nvlink = chip.nvlink_gbps * 1e9
    nic = fabric.inter_node_gbps * 1e9 if fabric is not None else nvlink
    rack_domain = chip.rack_domain
    tp, pp, dp = par.tp, par.pp, par.dp
    pcp, dcp = max(par.pcp, 1), max(par.dcp, 1)
    ep_on = par.enable_expert_parallel
    ep = tp * pcp * dp if ep_on else 1
    moe_group_width = ep if (ep_on or dp <= 1) else tp * pcp * dp
    moe_group = max(moe_group_width, ep)
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
            crosses = False   # a group inside a rack-wide NVLink domain stays on NVLink
        else:
            crosses = True
        return GroupPlan(name, width, stride, per_node, crosses)

    groups = (group("TP", tp, 1), group("Expert", moe_group, 1),
              group("DCP", dcp, tp if (pcp > 1 and dcp <= pcp) else 1), group("PCP", pcp, tp))
    routed_a2a = ep_on and eng.all2all_backend not in ("", "naive", "allgather_reducescatter")
    return Layout(tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp, expert_parallel=ep_on, ep=ep,
                  moe_group=moe_group, sp_moe=sp_moe, routed_a2a=routed_a2a,
                  all_reduce_backend=ar_backend, nodes_spanned=nodes_spanned, groups=groups,
                  nvlink_bytes_per_s=nvlink, nic_bytes_per_s=nic, rack_domain=rack_domain,
                  notes=rec.notes())


def _state_bytes(mamba_cache_dtype: str, pf: str) -> float:
    """Recurrent state element bytes (memory.md §3.1)."""
    state_bytes = {"": 4.0, "auto": 4.0, "float32": 4.0, "float16": 2.0,
                   "bfloat16": 2.0}.get(mamba_cache_dtype)
    if state_bytes is None:
        raise Refusal("R11", f"mamba_cache_dtype {mamba_cache_dtype!r} is not accepted; "
                      "allowed: auto, float32, float16, bfloat16",
                      field=f"{pf}.engine.mamba_cache_dtype")
    return state_bytes


def resolve_dtypes(eng, weight_dtype: str, chip: Chip, facts: GraphFacts, dcp: int,
                   pf: str) -> Dtypes:
    """Served dtype, GEMM family and peak, and the KV cache layout (§6)."""
    rec = _Record()
    served = _served_dtype(eng.quantization, weight_dtype, f"{pf}.engine.quantization")
    served_bytes = DTYPE_BYTES.get(served, 2.0)
    suffix, peak = _suffix_and_peak(served, chip)
    cache_elem, packed_cell, layout = _cache_layout(eng.cache_dtype, served_bytes, facts.dsa,
                                                    facts.latent, facts.sparse, chip, dcp,
                                                    rec, pf)
    return Dtypes(served, served_bytes, suffix, peak, _state_bytes(eng.mamba_cache_dtype, pf),
                  cache_elem, packed_cell, layout, rec.notes())


_GRAPH_MODES = {"PIECEWISE": (GraphMode.PIECEWISE, GraphMode.PIECEWISE),
                "FULL": (GraphMode.FULL, GraphMode.FULL),
                "FULL_AND_PIECEWISE": (GraphMode.FULL, GraphMode.PIECEWISE),
                "FULL_DECODE_ONLY": (GraphMode.FULL, GraphMode.EAGER),
                "NONE": (GraphMode.EAGER, GraphMode.EAGER)}


def resolve_engine_defaults(eng, chip: Chip, facts: GraphFacts, pf: str) -> EngineDefaults:
    """Graph modes, scheduler budgets, block size and recurrent cache mode (§7, §10, §11)."""
    rec = _Record()
    # vLLM v0.31.0 caches prefixes unless enable_prefix_caching is stated false.
    prefix_on = eng.enable_prefix_caching is not False
    mamba_mode = ""
    if facts.has_recurrent:
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
    mode_name = eng.cudagraph_mode or "FULL_AND_PIECEWISE"
    if mode_name not in _GRAPH_MODES:
        raise Refusal("R16", f"unknown cudagraph_mode {eng.cudagraph_mode!r}; allowed: "
                      f"{', '.join(_GRAPH_MODES)}", field=f"{pf}.engine.cudagraph_mode")
    if not eng.cudagraph_mode:
        rec.assume("cudagraph_mode", mode_name, "vLLM v0.31.0 default")
    decode_mode, other_mode = _GRAPH_MODES[mode_name]
    big = chip.memory_gib >= 70 and not chip.is_a100
    max_tokens = eng.max_num_batched_tokens
    if not max_tokens:
        max_tokens = 16384 if chip.memory_gib >= 160 else (8192 if big else 2048)
        rec.assume("max_num_batched_tokens", max_tokens,
                   f"vLLM v0.31.0 default for {chip.name} ({chip.memory_gib:g} GiB)")
    max_seqs = eng.max_num_seqs
    if not max_seqs:
        # vLLM v0.31.0 EngineArgs._set_default_args: an unstated max_num_seqs takes the
        # usage default, capped at the token budget (min(default, max_num_batched_tokens)).
        default = 1024 if big else 256
        max_seqs = min(default, max_tokens)
        cap = f", capped at max_num_batched_tokens {max_tokens}" if max_seqs < default else ""
        rec.assume("max_num_seqs", max_seqs,
                   f"vLLM v0.31.0 default for {chip.name} ({chip.memory_gib:g} GiB){cap}")
    num_spec = eng.speculative.num_spec_tokens if eng.speculative else 0
    uniform_width = 1 + num_spec
    if decode_mode == GraphMode.EAGER and other_mode == GraphMode.EAGER:
        ceiling = 0
    else:
        ceiling = min(max_seqs * uniform_width * 2, 1024 if chip.blackwell else 512)
        rec.assume("max_cudagraph_capture_size", ceiling,
                   "vLLM v0.31.0 capture sizes up to min(2·max_num_seqs·(1+num_spec), "
                   f"{1024 if chip.blackwell else 512}); the documents have no field for it")
    block = eng.block_size
    if not block:
        block = 64 if facts.dsa else 16
        rec.assume("block_size", block, "the sparse-MLA indexer accepts only 64" if facts.dsa
                   else "vLLM v0.31.0 default")
    util = eng.gpu_memory_utilization
    if not util:
        util = 0.92
        rec.assume("gpu_memory_utilization", 0.92, "vLLM v0.31.0 default")
    _check_budgets(max_tokens, max_seqs, block, mamba_mode, eng, pf)
    # vLLM v0.31.0 runs asynchronous scheduling unless it is turned off (resolution.md §10).
    async_on = eng.async_scheduling if eng.async_scheduling is not None else True
    # vLLM v0.31.0 SchedulerConfig.scheduler_reserve_full_isl defaults to true: a waiting
    # request is admitted only when the KV cache can hold its whole known sequence (engines
    # before it, e.g. 0.15, checked only the first chunk: state false for those).
    full_isl = (eng.scheduler_reserve_full_isl if eng.scheduler_reserve_full_isl is not None
                else True)
    return EngineDefaults(mode_name, decode_mode, other_mode, max_tokens, max_seqs, num_spec,
                          uniform_width, ceiling, block, mamba_mode, util, prefix_on,
                          async_on, full_isl, rec.notes())


def _check_budgets(max_tokens: int, max_seqs: int, block: int, mamba_mode: str, eng,
                   pf: str) -> None:
    """The scheduler's token budget against its sequence budget and the block (R1)."""
    # vLLM v0.31.0 SchedulerConfig.verify_max_model_len: max_num_batched_tokens must be at
    # least max_num_seqs (every running sequence needs a token each step), whatever the
    # chunked-prefill setting. Applied to the values the engine runs with, defaults included.
    # (An unstated max_num_seqs never trips it: its default is capped at the budget.)
    which = "max_num_batched_tokens" if eng.max_num_batched_tokens else "max_num_seqs"
    if max_tokens < max_seqs:
        raise Refusal("R1", f"max_num_batched_tokens ({max_tokens}) is below max_num_seqs "
                      f"({max_seqs}); vLLM does not start, since every running sequence "
                      "needs at least one token of the step's budget. Raise "
                      "max_num_batched_tokens or lower max_num_seqs",
                      field=f"{pf}.engine.{which}")
    # vLLM v0.31.0 VllmConfig (hybrid models): in Mamba cache align mode the block must fit
    # in one step's token budget ("block_size must be <= max_num_batched_tokens"); outside
    # align mode vLLM chunks a long prompt and a budget below one block still runs.
    if mamba_mode == "align" and block > max_tokens:
        raise Refusal("R1", f"block_size ({block}) exceeds max_num_batched_tokens "
                      f"({max_tokens}) in Mamba cache align mode; vLLM does not start, since "
                      "a step must be able to fill one whole block",
                      field=f"{pf}.engine.max_num_batched_tokens")


def resolve_max_model_len(stated: int, inputs: Inputs, pf: str) -> int:
    """The max_model_len the engine serves: the stated one, held within the model's
    positions (R1), else the length vLLM derives from the model's config.json (0 when the
    model has none)."""
    # vLLM v0.31.0 ModelConfig: a user max_model_len above the length derived from the model's
    # config is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set (then vLLM only warns),
    # which jkernel honours the same way when the inputs are opened.
    # vLLM v0.31.0 ModelConfig: an unstated max_model_len is the derived length.
    limit = inputs.model_max_len
    if not stated or not limit or stated <= limit or inputs.allow_long_max_model_len:
        return stated or limit
    raise Refusal("R1", f"max_model_len {stated} is greater than the {limit} positions "
                  f"{inputs.model.name} derives from its config.json; vLLM does not start "
                  "(set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to let it, and jkernel, run past the "
                  "model's positions)", field=f"{pf}.engine.max_model_len")


def resolve_context_parallel(eng, dep: Deployment, layout: Layout, facts: GraphFacts,
                             defaults: EngineDefaults, rules: Rules, pf: str
                             ) -> ContextParallel:
    """Context-parallel rules, the DCP combine, interleave and MLA chunk (§8)."""
    rec = _Record()
    pcp, dcp, block = layout.pcp, layout.dcp, defaults.block_size
    stated_backend = eng.dcp_comm_backend
    if pcp > 1:
        if not all(a.kind.latent for a in facts.primaries) or facts.has_recurrent:
            raise Refusal("R5", "pcp > 1 needs every primary attention latent (mla or "
                          "sparse_mla) and no recurrent layer", field=f"{pf}.parallel.pcp")
        if dcp > 1 and not all(a.kind == "sparse_mla" for a in facts.primaries):
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
        if eng.dcp_q_replicate is True and pcp <= 1 and facts.latent:
            raise Refusal("R14", "dcp_q_replicate with a latent attention implies a "
                          "replicated query projection the graph cannot identify; set it "
                          "false", field=f"{pf}.engine.dcp_q_replicate")
        if facts.latent:
            if eng.max_model_len:
                chunk0 = min(max(8 * eng.max_model_len, 4 * defaults.max_num_seqs * block),
                             65536)
            else:
                chunk0 = 65536
            align = math.lcm(block, dcp * interleave)
            mla_chunk = math.ceil(max(chunk0, align) / align) * align
            if not eng.max_model_len:
                rec.assume("mla_context_chunk", mla_chunk,
                           "max_model_len unstated: built from 65536, aligned to "
                           f"lcm(block, dcp·I) = {align}")
    return ContextParallel(dcp_backend, interleave, mla_chunk, rec.notes())


def collective_keys(layout: Layout, kinds: tuple[KindPlan, ...], facts: GraphFacts,
                    dcp_backend: str, chip_key: str, chosen: dict) -> tuple[CollectiveKey, ...]:
    """The (op, group) collective keys a pool needs (the one table,
    :func:`jkernel.plan.collectives_needed`), snapped to measured widths (§5.3)."""
    key_specs = collectives_needed(kinds, tp=layout.tp, moe_group=layout.moe_group,
                                   has_moe=facts.has_moe, dcp=layout.dcp, pcp=layout.pcp,
                                   dcp_backend=dcp_backend)
    keys = []
    for op, gname in key_specs:
        width = _snap_collective(op, layout.group(gname).width, chip_key, chosen)
        names = tuple(f"collective_{part}_{op}_fp16_{width}rank_{chip_key}"
                      for part in ("floor", "peak_rate", "transition_rate"))
        keys.append(CollectiveKey(op, gname, width, *names))
    return tuple(keys)


def _pd_floor_name(keys: tuple[CollectiveKey, ...], chip_key: str, chosen: dict
                   ) -> str | None:
    """methods.md §4: the PD transfer floor is the (alltoall, Expert) key's t0."""
    pd_floor = next((k.floor for k in keys if k.op == "alltoall" and k.group == "Expert"),
                    None)
    if pd_floor is None:
        # spec silent where no expert group exists: the chip's narrowest measured floor
        stem = "collective_floor_alltoall_fp16_"
        found = sorted((int(n[len(stem):].split("rank_")[0]), n) for n in chosen
                       if n.startswith(stem) and n.endswith(f"rank_{chip_key}")
                       and n[len(stem):].split("rank_")[0].isdigit())
        pd_floor = found[0][1] if found else None
    return pd_floor


def resolve_coefficients(chosen: dict, chip: Chip, hardware: str, layout: Layout,
                         kinds: tuple[KindPlan, ...], facts: GraphFacts, dtypes: Dtypes,
                         cp: ContextParallel, has_offload: bool) -> Coefficients:
    """Lift the coefficients a pool prices with, recording each optional one it lacks."""
    rec = _Record()
    values = {name: e.value for name, (e, _) in chosen.items()}
    if "hbm_derate" not in chosen:
        raise _missing("hbm_derate", hardware)
    if chip.hbm_tbs * 1e12 * values["hbm_derate"] <= 0 or dtypes.peak_flops_per_s <= 0:
        raise Refusal("R20", f"non-positive HBM rate or compute peak (BwPeakTBs "
                      f"{chip.hbm_tbs} × hbm_derate {values['hbm_derate']}, "
                      f"peak {dtypes.peak_flops_per_s})", field="hbm_derate")
    suffix = dtypes.suffix
    gemm = (f"gemm_eps_max_{suffix}", f"gemm_m_half_{suffix}", f"gemm_n_half_{suffix}",
            f"gemm_k_half_{suffix}")
    for name in gemm[:2]:
        if name not in chosen:
            raise _missing(name, hardware, f"served dtype {dtypes.served} prices with suffix "
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
    if facts.has_attention:
        optional_needed.update({
            "attention_decode_floor": "decode attention priced without a floor",
            "attention_decode_rate": "decode KV read priced at HBM bandwidth, no floor",
            "attention_prefill_floor": "prefill attention priced without a floor",
            "attention_prefill_work_scale": "prefill attention FLOPs priced on the plain "
                                            "ramp, no floor"})
    for k in ("swa", "mla", "sparse_mla"):
        if k in facts.attention_kinds:
            optional_needed[f"attention_decode_floor_{k}"] = f"{k} uses the part-wide floor"
            optional_needed[f"attention_decode_rate_{k}"] = f"{k} uses the part-wide pair"
    for r in facts.recurrent_kinds:
        optional_needed[f"recurrent_decode_floor_{r}"] = f"{r} mixers cost 0"
        optional_needed[f"recurrent_decode_rate_{r}"] = f"{r} mixers cost 0"
    if facts.has_moe:
        optional_needed["moe_routing_imbalance_median"] = "routed FLOPs not inflated (1)"
    if has_offload:
        optional_needed["host_link_bandwidth"] = "offload transfers not capped by the host link"
    for name, reason in optional_needed.items():
        used.add(name)
        if name not in chosen:
            rec.assume(name, "absent", reason)
    # methods.md §5: tier_time caps every known storage class by host_link_bandwidth, so an
    # applicable entry is lifted even without offload tiers; only its absence is recorded
    # conditionally (resolution.md §5.2).
    if "host_link_bandwidth" in chosen:
        used.add("host_link_bandwidth")
    # jkernel's own expected_s constants: defaults until a step-trace fit
    own_defaults = {"kernel_gap": (0.0, "no idle gap between kernels until a step-trace fit"),
                    "host_serial": (0.0, "no serial host time until a step-trace fit"),
                    "host_serial_per_request": (0.0, "no serial host time per request until "
                                                     "a step-trace fit"),
                    "compute_derate": (1.0, "compute at the profiles' rate until a "
                                            "step-trace fit"),
                    "host_api_server_per_request": (
                        0.0, "the API server's admission work never queues until a serving "
                             "fit"),
                    "host_api_server_per_token": (
                        0.0, "the API server's streaming work never queues until a serving "
                             "fit")}
    # expected_s's shape constants of the decode-attention and fused-MoE laws
    # (jkernel.laws.decode_attention_time, routed_expert_time): at these defaults the laws
    # are step.md §6.3's and §6.2's, until a profile fit (calibration.fit.attention, .moe)
    if facts.has_attention:
        own_defaults["attention_decode_row_floor"] = (
            0.0, "decode attention without a per-row time (step.md §6.3's law) until a "
                 "profile fit")
        own_defaults["attention_decode_overlap"] = (
            1.0, "the per-row time added to the stream until a profile fit")
    if facts.has_moe:
        own_defaults[f"moe_kernel_floor_{suffix}"] = (
            0.0, "routed experts without a kernel floor until a profile fit")
        own_defaults["moe_m_half"] = (
            0.0, "routed experts at the step-level token ramp (step.md §6.2) until a "
                 "profile fit")
        own_defaults["moe_assignment_time"] = (
            0.0, "no time per token-expert assignment until a profile fit")
    for name, (value, reason) in own_defaults.items():
        used.add(name)
        if name not in chosen:
            rec.assume(name, value, reason)
            values[name] = value
    chip_key = hardware.replace("-", "_")
    keys = collective_keys(layout, kinds, facts, cp.dcp_comm_backend, chip_key, chosen)
    for k in keys:
        used |= {k.floor, k.peak, k.transition}
    pd_floor = _pd_floor_name(keys, chip_key, chosen)
    if pd_floor is not None:
        used.add(pd_floor)
    decode_pairs = [("", "attention_decode_floor", "attention_decode_rate")]
    for k in ("swa", "mla", "sparse_mla"):
        if f"attention_decode_rate_{k}" in chosen:
            fl = (f"attention_decode_floor_{k}" if f"attention_decode_floor_{k}" in chosen
                  else "attention_decode_floor")
            decode_pairs.append((k, fl, f"attention_decode_rate_{k}"))
    rec_names = tuple((r, f"recurrent_decode_floor_{r}", f"recurrent_decode_rate_{r}")
                      for r in facts.recurrent_kinds)
    return Coefficients(values, frozenset(used), gemm, shape_aware, keys, pd_floor,
                        tuple(decode_pairs), rec_names, rec.notes())


def resolve_experts(eng, layout: Layout, facts: GraphFacts, pf: str) -> Experts:
    """Physical experts, experts per rank and expert tensor shards (§4.7)."""
    eplb_on = bool(eng.eplb and eng.eplb.enable_eplb)
    redundant = eng.eplb.num_redundant_experts if eplb_on else 0
    e_phys = facts.experts + redundant
    ep = layout.ep
    if facts.has_moe and layout.expert_parallel:
        base, extra = divmod(e_phys, ep)
        if base == 0:
            raise Refusal("R12", f"the EP width {ep} exceeds the {e_phys} physical experts, so "
                          f"some rank would hold none; use EP ≤ {e_phys}",
                          field=f"{pf}.parallel")
        per_rank = base + (1 if extra else 0)
    else:
        per_rank = e_phys
    shards = 1 if layout.expert_parallel else layout.tp * layout.dp
    return Experts(e_phys, per_rank, shards, redundant)


def _kv_bytes_per_token(kinds: tuple[KindPlan, ...], facts: GraphFacts, dtypes: Dtypes,
                        tp: int) -> float:
    """Whole-model KV bytes per token per rank, kvB (memory.md §1)."""
    first = facts.first_attention
    if first is None:
        return 0.0
    kv_layers = sum(k.count for k in kinds if k.attention is not None)
    if dtypes.packed_cell_bytes:
        return dtypes.packed_cell_bytes * kv_layers
    tensors = 1 if first.kind.latent else 2
    heads = max(1, first.n_kv // tp)
    return tensors * heads * first.d_h * dtypes.cache_element_bytes * kv_layers


def _draft_kinds(model: ModelGraph, kinds: tuple[KindPlan, ...], num_spec: int
                 ) -> tuple[tuple[str, int], ...]:
    """expected_s prices the MTP drafter (vLLM v0.31.0 runs one speculator module per draft
    token); the edges never do. Only kinds the main stack plans can be priced."""
    if num_spec <= 0 or model.speculator is None:
        return ()
    planned = {k.id for k in kinds}
    pattern = model.speculator.stack.pattern
    return tuple((kid, pattern.count(kid)) for kid in dict.fromkeys(pattern) if kid in planned)


def build_plan(model: ModelGraph, kinds: tuple[KindPlan, ...], head: dict, chip: Chip,
               layout: Layout, dtypes: Dtypes, defaults: EngineDefaults, cp: ContextParallel,
               coeffs: Coefficients, experts: Experts, facts: GraphFacts) -> Plan:
    """The static plan the step closes over (documents.md §6.8)."""
    kv_layers = sum(k.count for k in kinds if k.attention is not None)
    sparse_secondary = sum(k.count for k in kinds if k.attention is not None
                           and k.attention.kind == "sparse_mla" and k.secondaries)
    total_layers = model.total_layers
    ep, tp, dp = layout.ep, layout.tp, layout.dp
    return Plan(
        kinds=kinds, head_flops_per_token=head["flops_per_token"],
        head_weight_bytes=head["weight_bytes"], hidden_size=model.hidden_size,
        total_layers=total_layers, kv_layers=kv_layers,
        segments=total_layers + sparse_secondary + 1,
        total_kernels=sum(k.count * k.launches for k in kinds) + head["launches"],
        tp=tp, dp=dp, pcp=layout.pcp, dcp=layout.dcp, ep=ep, moe_group=layout.moe_group,
        interleave=cp.interleave, groups=layout.groups,
        collective_keys=coeffs.collective_keys, physical_experts=experts.physical,
        experts_per_rank=experts.per_rank,
        local_expert_share=(experts.per_rank / experts.physical
                            if (layout.expert_parallel and experts.physical) else 1.0),
        expert_tensor_shards=experts.shards,
        dp_slice=(experts.shards / tp if ep <= 1 else 1.0),
        funnel=dp if (layout.moe_group > 1 and dp > 1) else 1,
        shape_aware=coeffs.shape_aware, blackwell=chip.blackwell,
        decode_mode=defaults.decode_mode, other_mode=defaults.other_mode,
        capture_ceiling=defaults.capture_ceiling,
        uniform_decode_width=defaults.uniform_decode_width, num_spec=defaults.num_spec_tokens,
        kv_bytes_per_token=_kv_bytes_per_token(kinds, facts, dtypes, tp),
        block_size=defaults.block_size,
        dcp_comm_backend=cp.dcp_comm_backend, mla_chunk=cp.mla_chunk,
        gemm_names=coeffs.gemm_names, decode_pairs=coeffs.decode_pairs,
        recurrent_names=coeffs.recurrent_names,
        draft_kinds=_draft_kinds(model, kinds, defaults.num_spec_tokens))


def build_params(coeffs: Coefficients, chip: Chip, layout: Layout, dtypes: Dtypes) -> Params:
    """The params pytree: lifted coefficients in SI units and the chip's rates."""
    import jax.numpy as jnp

    values: dict[str, float] = {}
    for name in sorted(coeffs.used):
        values[name] = coeffs.values.get(name, 0.0) * si_scale(name)
    values.update({"peak_flops_per_s": dtypes.peak_flops_per_s,
                   "hbm_bytes_per_s": chip.hbm_tbs * 1e12,
                   "nvlink_bytes_per_s": layout.nvlink_bytes_per_s,
                   "nic_bytes_per_s": layout.nic_bytes_per_s,
                   "sm_count": float(chip.sm_count)})
    assert set(CHIP_NAMES) <= set(values)
    return Params({k: jnp.asarray(v, dtype=jnp.float64) for k, v in values.items()})


def provenance_of(chosen: dict, assumptions: dict[str, str], *, hardware: str = "",
                  engine_version: str = "", model: str = "", tp: int = 0
                  ) -> tuple[CoefficientOrigin, ...]:
    """Where every lifted value came from (§12): registry entries (each flagged where the
    deployment lies outside the data it was fitted on), then assumptions."""
    return tuple(
        CoefficientOrigin(name, set_name, e.method, e.scope.render(),
                          outside_fitted(e, hardware=hardware, engine_version=engine_version,
                                         model=model, tp=tp) if engine_version else "",
                          e.fitted_on.render() if e.fitted_on is not None else "")
        for name, (e, set_name) in sorted(chosen.items())
    ) + tuple(CoefficientOrigin(name, KERNEL_ASSUMPTION_SET, "assumed", scope)
              for name, scope in sorted(assumptions.items()))


def settings_of(layout: Layout, dtypes: Dtypes, defaults: EngineDefaults, cp: ContextParallel,
                coeffs: Coefficients, facts: GraphFacts, pool_gpus: int,
                max_model_len: int) -> EngineSettings:
    """The engine settings the kernel runs with, for ``Kernel.settings``."""
    engine_gpus = layout.pp * layout.tp * layout.pcp * layout.dp
    return EngineSettings(
        block_size=defaults.block_size,
        max_num_batched_tokens=defaults.max_num_batched_tokens,
        max_num_seqs=defaults.max_num_seqs, max_model_len=max_model_len,
        enable_prefix_caching=defaults.enable_prefix_caching,
        async_scheduling=defaults.async_scheduling,
        scheduler_reserve_full_isl=defaults.reserve_full_isl,
        decode_threshold=defaults.uniform_decode_width,
        engines=pool_gpus // engine_gpus, engine_gpus=engine_gpus,
        gpu_memory_utilization=defaults.gpu_memory_utilization,
        cudagraph_mode=defaults.cudagraph_mode, served_dtype=dtypes.served,
        cache_layout=dtypes.cache_layout, mamba_cache_mode=defaults.mamba_cache_mode,
        num_spec_tokens=defaults.num_spec_tokens, state_bytes=dtypes.state_bytes,
        nodes_spanned=layout.nodes_spanned, moe_group=layout.moe_group,
        dcp_comm_backend=cp.dcp_comm_backend, dcp_interleave=cp.interleave,
        dcp_shards_all_kv_layers=facts.dcp_shards_all_kv_layers,
        pd_floor_name=coeffs.pd_floor_name)


# ---------------------------------------------------------------------------------------
# The composer
# ---------------------------------------------------------------------------------------

#: Refusals about a setting of the bundle (cluster, pools, engine); R19 is the graph's.
_BUNDLE_CODES = frozenset({"R1", "R3", "R4", "R5", "R6", "R7", "R8", "R9", "R10", "R11",
                           "R12", "R13", "R14", "R15", "R16"})


def resolve(inputs: Inputs) -> Resolved:
    """Validate and resolve one pool (resolution.md §2). Raises :class:`Refusal`, naming the
    file the offending setting was read from when the inputs came from files."""
    try:
        return _resolve(inputs)
    except Refusal as e:
        if e.file is not None:
            raise
        graph_field = e.code == "R19" or (e.code == "R5" and e.field == "n_kv")
        file = inputs.model_file if graph_field else (
            inputs.bundle_file if e.code in _BUNDLE_CODES else None)
        if file is None:
            raise
        raise Refusal(e.code, e.reason, field=e.field, file=file) from None


def _resolve(inputs: Inputs) -> Resolved:
    sc, dep, model, chip = inputs.scenario, inputs.deployment, inputs.model, inputs.chip
    missing = [n for n, v in (("scenario", sc), ("deployment", dep), ("model", model),
                              ("chip", chip)) if v is None]
    if missing:
        raise Refusal("R3", f"required document(s) absent: {', '.join(missing)}")
    if not 0 <= inputs.pool_index < len(dep.pools):
        raise Refusal("R3", f"no pool at index {inputs.pool_index}", field="pools")
    # A built kernel never changes with its inputs. Every document is a frozen dataclass of
    # tuples and scalars (test_resolve holds them so) but the storage devices' mapping:
    # copy that and share the rest (a deep copy of the coefficient sets cost ~35 ms a pool).
    inputs = dataclasses.replace(inputs, devices=dict(inputs.devices))
    sc, dep, model, chip = inputs.scenario, inputs.deployment, inputs.model, inputs.chip
    cl = sc.cluster
    pool = dep.pools[inputs.pool_index]
    eng = pool.engine
    pf = f"pools[{inputs.pool_index}]"

    _check_consistency(sc, dep, chip, inputs.devices)
    layout = resolve_layout(sc, pool, chip, inputs.fabric, inputs.rules)
    served = _served_dtype(eng.quantization, model.weight_dtype, f"{pf}.engine.quantization")
    kinds, head = plan_layers(model, tp=layout.tp, moe_group=layout.moe_group,
                              sp_moe=layout.sp_moe, served_bytes=DTYPE_BYTES.get(served, 2.0),
                              state_bytes=_state_bytes(eng.mamba_cache_dtype, pf),
                              routed_a2a=layout.routed_a2a)
    facts = graph_facts(kinds)
    _check_heads(model.name, facts, dep)
    chosen = select(inputs.coefficient_sets, hardware=cl.hardware, model=sc.model,
                    tp=layout.tp, ep=layout.ep, nodes_spanned=layout.nodes_spanned,
                    engine_version=sc.engine_version)
    if not chosen:
        raise Refusal("R17", f"no coefficient of the sets {list(sc.coefficients)} applies to "
                      f"hardware {cl.hardware}, model {sc.model}, tp {layout.tp}, "
                      f"ep {layout.ep}, nodes_spanned {layout.nodes_spanned}",
                      field="coefficients")
    dtypes = resolve_dtypes(eng, model.weight_dtype, chip, facts, layout.dcp, pf)
    if layout.pp > 1:
        raise Refusal("R13", f"pp {layout.pp}: pipeline parallelism wider than 1 is not "
                      "priced; use pp 1 (widen tp or dp instead)", field=f"{pf}.parallel.pp")
    defaults = resolve_engine_defaults(eng, chip, facts, pf)
    max_model_len = resolve_max_model_len(eng.max_model_len, inputs, pf)
    cp = resolve_context_parallel(eng, dep, layout, facts, defaults, inputs.rules, pf)
    if facts.dsa:
        _check_dsa(facts, chip, eng, defaults.block_size, layout, cp.dcp_comm_backend,
                   dtypes.cache_layout, pf)
    coeffs = resolve_coefficients(chosen, chip, cl.hardware, layout, kinds, facts, dtypes,
                                  cp, dep.offload is not None)
    experts = resolve_experts(eng, layout, facts, pf)
    mem = plan_memory(model, kinds, head, chosen=chosen, tp=layout.tp, dcp=layout.dcp,
                      pcp=layout.pcp, moe_group=layout.moe_group, has_moe=facts.has_moe,
                      checkpoint_bytes=DTYPE_BYTES[model.weight_dtype],
                      max_tokens=defaults.max_num_batched_tokens,
                      mode_name=defaults.cudagraph_mode, snap=_snap_memory,
                      hardware=cl.hardware, experts_per_rank=experts.per_rank,
                      shards=experts.shards, redundant=experts.redundant, ep=max(layout.ep, 1),
                      mamba_mode=defaults.mamba_cache_mode, num_spec=defaults.num_spec_tokens,
                      missing=_missing, engine_version=sc.engine_version,
                      max_num_seqs=defaults.max_num_seqs, ep_on=layout.expert_parallel,
                      sm_count=chip.sm_count)
    coeffs = dataclasses.replace(coeffs, used=coeffs.used | set(mem.coefficient_names))
    plan = build_plan(model, kinds, head, chip, layout, dtypes, defaults, cp, coeffs, experts,
                      facts)
    params = build_params(coeffs, chip, layout, dtypes)
    version = _Record()
    if sc.engine_version != ENGINE_BEHAVIOUR_VERSION:
        version.assume("engine_version", ENGINE_BEHAVIOUR_VERSION,
                       f"declared {sc.engine_version}; priced as vLLM "
                       f"v{ENGINE_BEHAVIOUR_VERSION} behaviour")
    notes = (layout.notes, dtypes.notes, defaults.notes, cp.notes, coeffs.notes,
             version.notes())
    assumptions = {name: text for n in notes for name, text in n.assumptions}
    resolution = Resolution(
        tensor_parallel_width=layout.tp, data_parallel_width=layout.dp,
        expert_parallel_width=layout.ep, all_reduce_backend=layout.all_reduce_backend,
        async_scheduling=defaults.async_scheduling,
        cascade_attention=eng.disable_cascade_attn is False,
        sequence_parallel_moe=layout.sp_moe,
        overrides=tuple(o for n in notes for o in n.overrides),
        decode_context_parallel_width=layout.dcp, prefill_context_parallel_width=layout.pcp)
    settings = settings_of(layout, dtypes, defaults, cp, coeffs, facts,
                           pool.nodes * cl.gpus_per_node, max_model_len)
    links = Links(layout.nvlink_bytes_per_s, layout.nic_bytes_per_s, layout.rack_domain)
    provenance = provenance_of(chosen, assumptions, hardware=cl.hardware,
                               engine_version=sc.engine_version, model=sc.model, tp=layout.tp)
    return Resolved(plan, params, mem, resolution, provenance, settings, inputs, links)


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
    """DCP interleave (resolution.md §8.3)."""
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


def _check_dsa(facts: GraphFacts, chip: Chip, eng, block: int, par: Layout, backend: str,
               layout: str, pf: str) -> None:
    """Sparse-MLA (DSA) rules (resolution.md §9)."""
    dcp, pcp, tp = par.dcp, par.pcp, par.tp
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
            n_q = next(a.n_q for a in facts.primaries if a.kind == "sparse_mla")
            h_loc = n_q / tp
            pad = lambda h: 64 if h <= 64 else 128  # noqa: E731
            if h_loc >= 32 or pad(h_loc) != pad(h_loc * dcp):
                raise Refusal("R10", f"DSA with dcp {dcp} needs fewer than 32 local heads "
                              f"and the same head padding (n_q/tp = {h_loc:g})",
                              field=f"{pf}.parallel.dcp")
        elif layout != "fp8_ds_mla":
            raise Refusal("R10", "DSA with dcp > 1 and pcp > 1 needs the fp8_ds_mla layout",
                          field=f"{pf}.engine.cache_dtype")

