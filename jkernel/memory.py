"""GPU memory of one rank (spec memory.md): fixed bytes, bytes per sequence, KV pages.

Weights and KV geometry come from the plan (coefficient-free); activation, CUDA-graph and
communicator magnitudes are registry coefficients read from the params pytree, so tripling
them changes ``fixed_bytes()`` and no step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .documents.graph import LATENT_KINDS, ModelGraph
from .plan import KindPlan, Plan

__all__ = ["MemoryBreakdown", "MemoryPlan", "plan_memory", "fixed_bytes",
           "sequence_variable_bytes", "sequence_fixed_bytes", "kv_cache_pages"]


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
                mamba_mode: str, num_spec: int, missing) -> MemoryPlan:
    """Resolve the memory coefficient names (R17 via ``missing``) and the static figures."""
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
        h_act = max(model.hidden_size if a.kind in LATENT_KINDS else a.n_q * a.d_h
                    for a in widths)
    weights, redundant_bytes = _weights(model, kinds, head, tp=tp,
                                        experts_per_rank=experts_per_rank, shards=shards,
                                        redundant=redundant, ep=ep,
                                        checkpoint_bytes=checkpoint_bytes)
    pages = []
    for k in kinds:
        if k.recurrent is not None:
            pages.append((k.recurrent.kind, k.count, k.recurrent.page_bytes))
    return MemoryPlan(weights, redundant_bytes, act, "activation_scratch_floor_bytes", capture,
                      "engine_workspace_bytes", comm, max_tokens, h_act, tuple(pages),
                      mamba_mode, num_spec)


def fixed_bytes(mem: MemoryPlan, params) -> MemoryBreakdown:
    """Fixed occupancy per rank (memory.md §4): components truncated to ints, then summed."""
    count = params.value(mem.activation_count_name)
    floor = params.value(mem.activation_floor_name)
    activation = max(count * mem.max_num_batched_tokens * mem.activation_width * 2, floor)
    comm = params.value(mem.workspace_name)
    if mem.communicator_name:
        comm += params.value(mem.communicator_name)
    return MemoryBreakdown(weights=mem.weights_bytes, activation_peak=int(activation),
                           cuda_graph=int(params.value(mem.capture_name)),
                           eplb_redundant=mem.eplb_redundant_bytes, comm_buffers=int(comm))


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
