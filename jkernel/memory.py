"""GPU memory of one rank (spec memory.md): fixed bytes, bytes per sequence, KV pages.

Two recipes, selected by the scenario's ``engine_version``:

* **vLLM v0.29.0 and later: the spec's recipe** (memory.md §4–§5). The spec's memory
  magnitudes are those of the vLLM 0.29 rules pack (documents.md §9, D11) and its pins are
  declared at 0.29.0 and 0.31.0, so from 0.29.0 on the spec governs. Weights and KV geometry
  come from the plan (coefficient-free); activation, CUDA-graph and communicator magnitudes
  are registry coefficients read from the params pytree (so tripling them changes
  ``fixed_bytes()`` and no step time), and the budget is the datasheet capacity. The spec
  governs where it speaks, so its pins hold there.
* **Earlier versions (v0.8 to v0.28): what vLLM's V1 worker measures** at start-up
  (``gpu_worker.determine_available_memory``): the weights as loaded, the torch peak of the
  profile run over ``max_num_batched_tokens`` tokens plus the dummy sampler run over
  ``max_num_seqs`` rows, the non-torch memory that appeared since the start-up snapshot
  (cuBLAS workspaces; NCCL and custom all-reduce buffers only when a communicator exists),
  and, from v0.20.0, the CUDA-graph estimate. The dummy sampler sorts the logits up to v0.16
  and runs the Triton top-k/top-p kernel from v0.17.0; before v0.9.0 the non-torch term also
  holds the CUDA context. The budget is the total CUDA reports
  (``torch.cuda.mem_get_info``), the chip's ``ReportedMemoryGiB``. Each rule below names the
  version it follows; ``tests/data/kv_capacity.csv`` holds the engine logs they are checked
  against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .documents.graph import ModelGraph
from .plan import KindPlan, Plan

__all__ = ["MemoryBreakdown", "MemoryPlan", "VllmMemoryRules", "plan_memory", "fixed_bytes",
           "sequence_variable_bytes", "sequence_fixed_bytes", "kv_cache_pages",
           "device_memory_bytes", "memory_rules", "max_concurrency", "parse_version",
           "rule_summary"]

GIB = 2 ** 30

# -- version-selected engine rules -----------------------------------------------------------

SPEC_RECIPE_FROM = (0, 29, 0)        # the spec's recipe (memory.md §4–§5): its registry
#   magnitudes are the vLLM 0.29 rules pack's and its pins are declared at 0.29.0 / 0.31.0.
GRAPH_PROFILE_FROM = (0, 20, 0)      # vLLM v0.20.0: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS
#   defaults to 1 (vllm/envs.py of v0.20.0; "0" in v0.19.1), and gpu_worker subtracts the
#   estimate from the KV budget (its log line says "default since v0.21.0", but the v0.20.0
#   wheel already defaults it on). Before it the graphs are captured after the KV cache is
#   allocated and come out of the (1 - utilization) margin (v0.19.1 logs the estimate and
#   advises raising the utilization by estimate / total to keep the KV size).
TRITON_SAMPLER_FROM = (0, 17, 0)     # vLLM v0.17.0: apply_top_k_top_p runs the Triton
#   top-k/top-p kernel (v1/sample/ops/topk_topp_triton.py) when Triton is present and the
#   batch has at least 8 rows; v0.16.0 and earlier sort the logits (PyTorch-native path).

# vLLM V1 (v0.8 to v0.28) profile run: `_dummy_run(max_num_batched_tokens)`, then
# `_dummy_sampler_run` over `max_num_seqs` rows of full-vocabulary logits with temperature,
# top-k and top-p set, so the PyTorch-native sort path runs. Bytes per logit element alive at
# its peak: bf16 logits upcast to float32 (4), the sorted values and their int64 indices
# (4 + 8) with the sort's scratch of the same size (4 + 8), the softmax and cumulative sum
# of the sorted probabilities (4 + 4), the mask (1) and the final float32 probabilities (4):
# 41 B, of which 38 B are alive together. Measured: 38.4–38.9 B per logit element on one H100
# at max_num_seqs 1024 (peak activation 4.76 GiB for Llama-3.1-8B, 5.56 GiB for Qwen3-0.6B,
# 7.38 GiB for gpt-oss-20b: llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-
# results.md, vLLM 0.11.0). With FlashInfer's sampler (logged "Using FlashInfer for top-p &
# top-k sampling") the sort is skipped and the peak is lower; it is not modelled.
SAMPLER_BYTES_PER_LOGIT = 38
# vLLM v0.17.0+ Triton top-k/top-p (batch ≥ 8 rows): the caller's bf16 logits (2), their
# float32 copy masked in place (4), the float32 softmax (4), the exponential noise q (4) and
# probs / q (4) before the argmax: 18 B per logit element, plus the kernel's cached scratch
# of min(next_pow2(min(SMs, rows)), SMs) rows of float32 vocabulary. This is read off the
# v0.17–v0.19 code, not fitted: Qwen3-8B on one A100-40GB at v0.9.2 (sort) and v0.19.1
# (Triton) logged 18.69 and 19.36 GiB available (dariustanrd/tokenkaki), 0.67 GiB apart
# for 256 × 151,936 logits, which is 17–18 B per element.
TRITON_SAMPLER_BYTES_PER_LOGIT = 18
TRITON_SAMPLER_MIN_ROWS = 8
ACTIVATION_BYTES = 2                 # activations stay 16-bit whatever the weight format
# Non-torch memory the profile measures beyond the start-up snapshot (v0.9+ takes the
# snapshot after the CUDA context exists, so the context is not in it): cuBLAS / cuBLASLt
# workspaces and kernel-library scratch, 0.13-0.14 GiB on one H100 at tp 1 in every run of
# llm-d/llm-d-benchmark's empirical-vllm-memory-results.md (vLLM 0.11.0).
NON_TORCH_BASE_BYTES = int(0.13 * GIB)
# vLLM v0.8.x V1 worker (gpu_worker.determine_available_memory before v0.9.0): the non-torch
# term is everything CUDA reports in use at the end of the profile run minus torch's current
# allocation, so the process's CUDA context (and the allocator's cuBLAS / NCCL state) is
# charged too. v0.9.0 moved to a MemorySnapshot taken at init, after the context exists, so
# from v0.9.0 the context is outside the non-torch growth. The context is what one vLLM
# process holds before loading anything: 79.18 − 78.57 = 0.61 GiB on one H100 ("free
# 78.57/79.18 GiB at start", llm-d/llm-d-benchmark empirical-vllm-memory-results.md, vLLM
# 0.11.0, the rows that also fed NON_TORCH_BASE_BYTES).
CONTEXT_IN_NON_TORCH_BEFORE = (0, 9, 0)
CUDA_CONTEXT_BYTES = int(0.61 * GIB)
# With a communicator (tp, EP or context parallel wider than 1) NCCL's buffers and vLLM's
# custom all-reduce IPC buffers appear on first use in the profile run: the same study
# measured 0.54-0.55 GiB non-torch at tp 2 (Qwen3-32B, Llama-3.3-70B-FP8), 0.41 GiB above
# tp 1. Wider groups add NVIDIA's AIConfigurator increment from 2 to 4 ranks (misc.nccl_mem:
# 358,612,992 B at 2 ranks, 411,041,792 B at 4 and wider; the registry's
# nccl_communicator_bytes_<N>rank restates them).
NCCL_BYTES_BY_WIDTH = ((2, int(0.41 * GIB)), (4, int(0.41 * GIB) + 411_041_792 - 358_612_992))
# From v0.20.0 the start-up subtracts its CUDA-graph estimate: it captures the first two
# graphs of each mode with a dummy KV cache and extrapolates. The logged estimates are
# 0.1-0.4 GiB per rank for the default capture list (gpustack/runner#251 0.36 GiB at tp 2;
# noonghunna/club-3090#127 0.17 GiB at tp 4): 0.15 GiB is charged per captured mode family
# (FULL and PIECEWISE count one each; NONE captures nothing). The estimate depends on the
# model and the capture list, which this constant does not follow: the v0.19.1 start of
# Qwen3-8B on an A100-40GB logged 2.35 GiB (51 PIECEWISE + 35 FULL graphs; not charged at
# that version), while the v0.24-v0.28 rows of tests/data/kv_capacity.csv on L40S and L4
# balance with 0.1-0.8 GiB. A known limit of the pre-0.29 rules.
GRAPH_ESTIMATE_BYTES_PER_MODE = int(0.15 * GIB)
# vLLM v0.10.1+ MXFP4 MoE layout (gpt-oss; the Hopper/Blackwell triton and FlashInfer
# backends): the packed 4-bit experts carry one e8m0 scale byte per 32 elements and each
# rank's expert intermediate size is padded up to a multiple of 256. This reproduces the
# logged "Model loading took" of gpt-oss-20b (13.47 GiB) and gpt-oss-120b (64.38 GiB) on one
# H100 within 0.3 % (llm-d/llm-d-benchmark empirical-vllm-memory-results.md, vLLM 0.11.0).
MXFP4_BLOCK = 32
MXFP4_PAD = 256


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.23.0"`` → (0, 23, 0); suffixes such as ``rc1`` or ``.post1`` are dropped."""
    parts = []
    for piece in str(version).lstrip("v").split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


@dataclass(frozen=True)
class VllmMemoryRules:
    """Which memory rules a vLLM version follows (each flag names its version above)."""

    version: tuple[int, int, int]
    spec_recipe: bool          # v0.29.0+: memory.md §4–§5 with registry magnitudes
    reported_total: bool       # budget against what CUDA reports (v0.8+ V1 worker)
    graphs_subtracted: bool    # v0.20.0+: CUDA-graph estimate charged before the KV cache


def memory_rules(engine_version: str) -> VllmMemoryRules:
    v = parse_version(engine_version)
    spec = v >= SPEC_RECIPE_FROM
    return VllmMemoryRules(v, spec, not spec, v >= GRAPH_PROFILE_FROM)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Fixed occupancy per rank, bytes (memory.md §4). ``total()`` sums the five."""

    weights: int
    activation_peak: int
    cuda_graph: int
    eplb_redundant: int
    comm_buffers: int

    def total(self) -> int:
        return (self.weights + self.activation_peak + self.cuda_graph + self.eplb_redundant
                + self.comm_buffers)


@dataclass(frozen=True)
class MemoryPlan:
    """Static memory figures and the coefficient names the magnitudes come from."""

    weights_bytes: int                 # already net of eplb_redundant
    eplb_redundant_bytes: int
    activation_count_name: str
    activation_floor_name: str
    capture_name: str
    workspace_name: str
    communicator_name: str | None
    max_num_batched_tokens: int
    activation_width: int              # h_act
    recurrent_layer_pages: tuple[tuple[str, int, float], ...]   # (kind, layers, page bytes)
    mamba_cache_mode: str
    num_spec: int
    rules: VllmMemoryRules = memory_rules("0.31.0")
    loaded_weights_bytes: int = 0          # vLLM: weights as its loader lays them out
    activation_bytes_per_token: int = 0    # vLLM profile run: live bytes per batched token
    sampler_bytes: int = 0                 # vLLM dummy sampler run over max_num_seqs rows
    hidden_size: int = 0
    non_torch_bytes: int = 0               # vLLM: cuBLAS + communicator buffers
    graph_modes: int = 0                   # captured mode families (FULL, PIECEWISE)
    attention_windows: tuple[tuple[int, int], ...] = ()   # (window or 0 = full, KV layers)

    @property
    def coefficient_names(self) -> tuple[str, ...]:
        names = [self.activation_count_name, self.activation_floor_name, self.capture_name,
                 self.workspace_name]
        if self.communicator_name:
            names.append(self.communicator_name)
        return tuple(names)


def _weights(model: ModelGraph, kinds: tuple[KindPlan, ...], head: dict, *, tp: int,
             experts_per_rank: int, shards: int, redundant: int, ep: int,
             checkpoint_bytes: float) -> tuple[int, int]:
    """Weights and EPLB redundant bytes per rank (memory.md §4.1–§4.2), truncated to ints."""
    redundant_bytes = sum(k.count * k.expert_weight_bytes_per_expert * redundant / ep / shards
                          for k in kinds if k.moe)
    w = sum(k.count * k.dense_weight_bytes / tp for k in kinds)
    w += sum(k.count * (k.expert_weight_bytes_per_expert * experts_per_rank / shards
                        + k.shared_expert_weight_bytes / tp) for k in kinds if k.moe)
    w += head["weight_bytes"] / tp
    if model.tie_word_embeddings is not True:   # D22: a tied table is counted once, in the head
        w += model.vocab_size * model.hidden_size * checkpoint_bytes / tp
    w -= redundant_bytes
    return int(w), int(redundant_bytes)


def plan_memory(model: ModelGraph, kinds: tuple[KindPlan, ...], head: dict, *,
                chosen: dict, tp: int, dcp: int, pcp: int, moe_group: int, has_moe: bool,
                checkpoint_bytes: float, max_tokens: int, mode_name: str, snap,
                hardware: str, experts_per_rank: int, shards: int, redundant: int, ep: int,
                mamba_mode: str, num_spec: int, missing, engine_version: str = "0.31.0",
                max_num_seqs: int = 256, ep_on: bool = False,
                sm_count: int = 132) -> MemoryPlan:
    """Resolve the memory coefficient names (R17 via ``missing``) and the static figures.

    ``engine_version`` selects the recipe (``memory_rules``); the vLLM-measured figures
    (activation bytes per token, sampler bytes, non-torch bytes, graph modes) are computed
    for every version and used by ``fixed_bytes`` only where the spec's recipe does not
    govern."""
    family = "moe" if has_moe else "dense"

    def declared(prefix: str) -> list[int]:
        out = []
        for w in (1, 2, 4, 8, 16):
            if f"{prefix}_{w}rank" in chosen:
                out.append(w)
        return out

    act = f"activation_buffer_count_{family}_{snap(declared(f'activation_buffer_count_{family}'), min(tp, 8))}rank"
    comm = None
    if tp > 1 or moe_group > 1 or pcp > 1 or dcp > 1:
        comm = f"nccl_communicator_bytes_{snap(declared('nccl_communicator_bytes'), tp)}rank"
    capture = f"cudagraph_capture_bytes_{mode_name.lower()}"
    for name in (act, "activation_scratch_floor_bytes", capture, "engine_workspace_bytes",
                 comm):
        if name is not None and name not in chosen:
            raise missing(name, hardware)
    h_act = model.hidden_size
    widths = [k.attention for k in kinds if k.attention is not None]
    if widths:
        h_act = max(model.hidden_size if a.kind.latent else a.n_q * a.d_h
                    for a in widths)
    weights, redundant_bytes = _weights(model, kinds, head, tp=tp,
                                        experts_per_rank=experts_per_rank, shards=shards,
                                        redundant=redundant, ep=ep,
                                        checkpoint_bytes=checkpoint_bytes)
    pages = []
    for k in kinds:
        if k.recurrent is not None:
            pages.append((k.recurrent.kind, k.count, k.recurrent.page_bytes))
    rules = memory_rules(engine_version)
    per_token = _profile_live_bytes_per_token(model, kinds, tp=tp, ep=ep if ep_on else 1)
    sampler = _sampler_bytes(rules, max_num_seqs, model.vocab_size, sm_count)
    communicator = tp > 1 or moe_group > 1 or pcp > 1 or dcp > 1
    non_torch = NON_TORCH_BASE_BYTES
    if rules.version < CONTEXT_IN_NON_TORCH_BEFORE:
        non_torch += CUDA_CONTEXT_BYTES       # v0.8.x: total − free − torch (module notes)
    if communicator:
        # vLLM v0.8+: no NCCL or custom all-reduce buffers exist at width 1 (no group is
        # initialised with a peer), so none are charged at tp 1.
        width = max(tp, moe_group, pcp, dcp)
        non_torch += next(b for w, b in reversed(NCCL_BYTES_BY_WIDTH) if width >= w)
    graph_modes = {"NONE": 0, "PIECEWISE": 1, "FULL": 1, "FULL_DECODE_ONLY": 1,
                   "FULL_AND_PIECEWISE": 2}.get(mode_name.upper(), 2)
    # vLLM v0.8+ quantizes linear layers only: the lm_head (ParallelLMHead, an embedding
    # subclass) stays at the checkpoint width under fp8 / fp4 quantization, where the spec
    # charges it at the served width (memory.md §4.1). Llama-3.3-70B-FP8 at tp 2 loads
    # 33.88 GiB (llm-d empirical results), which the served-width head misses by 0.5 GiB.
    head_loaded = model.vocab_size * model.hidden_size * checkpoint_bytes
    head_extra = max(0.0, head_loaded - head["weight_bytes"]) / tp
    loaded = weights + head_extra + _mxfp4_layout_extra_bytes(model, kinds,
                                                 experts_per_rank=experts_per_rank,
                                                 shards=shards)
    loaded += _replicated_extra_bytes(kinds, tp=tp)
    return MemoryPlan(weights, redundant_bytes, act, "activation_scratch_floor_bytes", capture,
                      "engine_workspace_bytes", comm, max_tokens, h_act, tuple(pages),
                      mamba_mode, num_spec, rules, int(loaded), int(per_token), int(sampler),
                      model.hidden_size, int(non_torch), graph_modes,
                      _attention_windows(kinds))


def _sampler_bytes(rules: VllmMemoryRules, rows: int, vocab: int, sm_count: int) -> int:
    """Peak bytes of vLLM's dummy sampler run over ``rows`` × ``vocab`` logits (v0.8+ V1
    ``_dummy_sampler_run``: temperature 0.5, top-p 0.9, top-k vocab − 1, so top-k/top-p
    always runs): the sort path up to v0.16, the Triton kernel from v0.17.0 (8+ rows)."""
    if rules.version >= TRITON_SAMPLER_FROM and rows >= TRITON_SAMPLER_MIN_ROWS:
        programs = min(max(sm_count, 1), rows)
        scratch_rows = min(1 << (programs - 1).bit_length(), max(sm_count, 1))
        return rows * vocab * TRITON_SAMPLER_BYTES_PER_LOGIT + scratch_rows * vocab * 4
    return rows * vocab * SAMPLER_BYTES_PER_LOGIT


def _attention_windows(kinds: tuple[KindPlan, ...]) -> tuple[tuple[int, int], ...]:
    """KV-holding layers by sliding window (0 = full attention), for vLLM's KV groups."""
    counts: dict[int, int] = {}
    for k in kinds:
        if k.attention is not None:
            w = int(k.attention.window or 0)
            counts[w] = counts.get(w, 0) + k.count
    return tuple(sorted(counts.items()))


def _mxfp4_layout_extra_bytes(model: ModelGraph, kinds: tuple[KindPlan, ...], *,
                              experts_per_rank: int, shards: int) -> int:
    """Bytes vLLM's MXFP4 MoE layout adds per rank over packed 4-bit experts (v0.10.1+):
    the e8m0 block scales and the expert intermediate padded to ``MXFP4_PAD``."""
    extra = 0.0
    H = model.hidden_size
    for k in kinds:
        if not k.moe:
            continue
        nodes = [n for n in model.kind(k.id).nodes if n.op == "GroupedGEMM"]
        if not nodes or getattr(nodes[0], "weight_dtype", None) != "mxfp4":
            continue
        inter = k.expert_flops_per_token_per_expert / (2 * 3 * H)
        per_rank = inter / max(shards, 1)          # expert_tensor_shards (memory.md §4.1)
        padded = math.ceil(per_rank / MXFP4_PAD) * MXFP4_PAD
        packed = 3 * H * per_rank * 0.5                         # what the plan charges
        loaded = 3 * H * padded * (0.5 + 1.0 / MXFP4_BLOCK)
        extra += k.count * experts_per_rank * (loaded - packed)
    return int(extra)


def _replicated_extra_bytes(kinds: tuple[KindPlan, ...], *, tp: int) -> int:
    """Bytes per rank vLLM loads beyond the spec's weights / tp for GEMMs it does not shard.

    vLLM v0.8+ (to v0.28, the versions whose start-up this module follows): MLA's fused
    q_a / kv_a projection (``fused_qkv_a_proj``, a ReplicatedLinear) and the MoE router gate
    are whole on every TP rank, and QKVParallelLinear replicates KV heads when tp exceeds
    their number. The plan records each GEMM's real per-rank share
    (``GemmPlan.vllm_rank_fraction``, the expected_s refinement); the spec's weights divide
    every dense GEMM by tp (memory.md §4.1), so the difference is added to what is loaded.
    For Kimi-K2 at tp 8 (a bf16 2112 × 7168 projection in 61 layers, a 384 × 7168 gate in
    60) this is 1.77 GiB per rank; for DeepSeek-V3's fp8 projection about 0.9 GiB."""
    if tp <= 1:
        return 0
    extra = 0.0
    for k in kinds:
        for g in k.gemms:
            extra += k.count * g.weight_bytes * max(0.0, g.vllm_rank_fraction - 1.0 / tp)
    return int(extra)


def _profile_live_bytes_per_token(model: ModelGraph, kinds: tuple[KindPlan, ...], *, tp: int,
                                  ep: int) -> float:
    """Bytes per batched token alive at the peak of vLLM's V1 profile forward (v0.8+).

    Under torch.compile the fused layer keeps the residual stream and the layer input (2·H)
    plus the widest intermediate of one sub-block: the attention's q/k/v projection and its
    output, the dense MLP's fused gate_up output and the activation's half of it, or the
    fused-MoE caches (per routed row: gate_up 2·I, the activation I and the down output H,
    with top_k rows per token, divided over EP ranks when EP is on). All 16-bit.
    """
    H = model.hidden_size
    widest = 0.0
    for k in kinds:
        col = [g for g in k.gemms if g.shard_n]
        if k.attention is not None:
            a = k.attention
            proj = sum(g.n for g in col if any(r in ("qkv_proj", "q_b_proj", "kv_b_proj")
                                               for r in g.roles))
            qkv = proj or (a.n_q + 2 * a.n_kv) * a.d_h
            widest = max(widest, (qkv + a.n_q * a.d_h) / tp)
        mlp = [g for g in col if any("gate_up" in r for r in g.roles)]
        if mlp:
            n = max(g.n for g in mlp)
            widest = max(widest, 1.5 * n / tp)
        if k.moe and k.top_k:
            inter = k.expert_flops_per_token_per_expert / (2 * 3 * H)
            shards = 1 if ep > 1 else tp
            rows = k.top_k / ep
            widest = max(widest, rows * (3 * inter / shards + H))
    return ACTIVATION_BYTES * (2 * H + widest)


def fixed_bytes(mem: MemoryPlan, params) -> MemoryBreakdown:
    """Fixed occupancy per rank charged before the KV cache, bytes; ints, then summed.

    v0.29.0+: the spec's breakdown (memory.md §4) from registry magnitudes. Earlier: what
    vLLM's V1 start-up profile subtracts (module docstring): ``activation_peak`` is the
    profile run's torch peak, ``comm_buffers`` the non-torch memory, ``cuda_graph`` the
    graph estimate from v0.20.0 and 0 before it (graphs are captured after the KV cache
    then, from the margin ``gpu_memory_utilization`` leaves).
    """
    if not mem.rules.spec_recipe:
        return _vllm_fixed_bytes(mem)
    count = params.value(mem.activation_count_name)
    floor = params.value(mem.activation_floor_name)
    activation = max(count * mem.max_num_batched_tokens * mem.activation_width * 2, floor)
    comm = params.value(mem.workspace_name)
    if mem.communicator_name:
        comm += params.value(mem.communicator_name)
    return MemoryBreakdown(weights=mem.weights_bytes, activation_peak=int(activation),
                           cuda_graph=int(params.value(mem.capture_name)),
                           eplb_redundant=mem.eplb_redundant_bytes, comm_buffers=int(comm))


def _vllm_fixed_bytes(mem: MemoryPlan) -> MemoryBreakdown:
    """vLLM V1 ``determine_available_memory`` (v0.8 to v0.28): weights as loaded, the profile
    run's torch peak, non-torch growth, and from v0.20.0 the CUDA-graph estimate."""
    tokens = mem.max_num_batched_tokens
    forward = tokens * mem.activation_bytes_per_token
    # The sampler run follows the forward with the final hidden states still alive.
    sampler = tokens * mem.hidden_size * ACTIVATION_BYTES + mem.sampler_bytes
    activation = max(forward, sampler)
    graphs = mem.graph_modes * GRAPH_ESTIMATE_BYTES_PER_MODE if mem.rules.graphs_subtracted \
        else 0
    return MemoryBreakdown(weights=mem.loaded_weights_bytes or mem.weights_bytes,
                           activation_peak=int(activation), cuda_graph=int(graphs),
                           eplb_redundant=mem.eplb_redundant_bytes,
                           comm_buffers=int(mem.non_torch_bytes))


def rule_summary(mem: MemoryPlan) -> dict:
    """Which version-selected rules a pool's fixed bytes follow, by name (for ``jkernel
    memory``): the recipe, the dummy sampler's path, whether the CUDA-graph estimate and the
    CUDA context are charged, and the device total used."""
    r = mem.rules
    if r.spec_recipe:
        return {"recipe": "spec", "sampler": None, "cuda_graph_charged": True,
                "cuda_context_charged": None, "device_total": "datasheet capacity"}
    triton = r.version >= TRITON_SAMPLER_FROM
    return {"recipe": "vllm-profile",
            "sampler": "triton top-k/top-p (v0.17.0+)" if triton
            else "sort top-k/top-p (v0.16 and earlier)",
            "cuda_graph_charged": r.graphs_subtracted,
            "cuda_context_charged": r.version < CONTEXT_IN_NON_TORCH_BEFORE,
            "device_total": "CUDA-reported total"}


def device_memory_bytes(mem: MemoryPlan, chip) -> float:
    """The memory ``gpu_memory_utilization`` multiplies, bytes: the datasheet capacity under
    the spec's recipe (memory.md §5, v0.29.0+); what CUDA reports as total
    (``torch.cuda.mem_get_info``, the chip's ``ReportedMemoryGiB``) for the vLLM V1 worker
    of v0.8 to v0.28, falling back to the capacity where the chip states none."""
    reported = getattr(chip, "reported_memory_gib", 0.0)
    if mem.rules.reported_total and reported:
        return reported * 2.0 ** 30
    return chip.memory_bytes


def max_concurrency(mem: MemoryPlan, pages: int, block_size: int, max_model_len: int) -> float:
    """vLLM's start-up ``Maximum concurrency for N tokens per request`` (v0.10+ hybrid
    allocator): the pool's blocks over the blocks one request of ``max_model_len`` tokens
    holds in every KV group. Layers of one window form groups of the smallest type's layer
    count; a full-attention group needs ceil(len / block) blocks, a sliding-window group
    ceil(min(window − 1 + max_num_batched_tokens, len) / block) + 1 (vLLM
    ``SlidingWindowSpec.max_memory_usage_bytes``). jkernel's page covers every KV layer, so
    the pool holds ``pages · groups`` group blocks. With full attention only this is
    pages / ceil(len / block). gpt-oss-120b at tp 4 (18 + 18 layers, window 128, 2048
    batched tokens, len 16384) gives the logged 284.25x (vLLM 0.10.1.1)."""
    if max_model_len <= 0 or pages <= 0:
        return 0.0
    block = max(block_size, 1)
    windows = mem.attention_windows or ((0, 1),)
    size = min(n for _, n in windows)
    groups, per_request = 0, 0
    for window, layers in windows:
        n = math.ceil(layers / size)
        if window:
            span = min(window - 1 + mem.max_num_batched_tokens, max_model_len)
            need = math.ceil(span / block) + 1
        else:
            need = math.ceil(max_model_len / block)
        groups += n
        per_request += n * need
    return pages * groups / per_request


def sequence_variable_bytes(plan: Plan, mem: MemoryPlan, tokens: int, *,
                            dcp_shards_all_kv_layers: bool) -> int:
    """KV bytes of one sequence of ``tokens`` tokens, whole pages (memory.md §2)."""
    if tokens <= 0:
        return 0
    block = plan.block_size
    t = math.ceil(tokens / plan.dcp) if plan.dcp > 1 and dcp_shards_all_kv_layers else tokens
    kvB = plan.kv_bytes_per_token
    if block <= 1:
        kv = math.trunc(t * kvB)
    else:
        kv = math.trunc(math.ceil(t / block) * block * kvB)
    if mem.mamba_cache_mode == "all":
        kv += int(sum(layers * page * (math.ceil(tokens / max(block, 1)) + mem.num_spec)
                      for _, layers, page in mem.recurrent_layer_pages))
    return int(kv)


def sequence_fixed_bytes(mem: MemoryPlan) -> int:
    """Per-sequence recurrent state outside the pages (memory.md §3.2)."""
    if not mem.recurrent_layer_pages or mem.mamba_cache_mode in ("", "all"):
        return 0
    copies = (1 if mem.mamba_cache_mode == "none" else 2) + mem.num_spec
    return int(sum(layers * page * copies for _, layers, page in mem.recurrent_layer_pages))


def kv_cache_pages(memory_bytes: float, utilization: float, fixed_total: int,
                   page_bytes: int) -> int:
    """The simulator's KV sizing recipe (memory.md §5): whole pages left after fixed bytes."""
    if page_bytes <= 0:
        return 0
    return max(0, math.floor((memory_bytes * utilization - fixed_total) / page_bytes))
