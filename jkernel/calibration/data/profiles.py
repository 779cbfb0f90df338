"""Typed loaders for measured operator profiles, with units made explicit.

Two public sources are read (see ``shared/data/README.md`` and ``tests/data/README.md``):

* **AIConfigurator** (``ai-dynamo/aiconfigurator``, Apache-2.0): Parquet tables laid out
  as ``<chip>/<op>/<framework>/<version>/<table>.parquet``. ``latency`` is milliseconds per
  call of one operator on one GPU (one layer).
* **Vidur** (``microsoft/vidur``, MIT): CSV profiles, ``compute/<chip>/<org>/<model>/mlp.csv``
  (per-op ``time_stats.<op>.{min,max,mean,median,std}`` in milliseconds vs ``num_tokens`` at
  ``num_tensor_parallel_workers`` 1/2/4/8) and ``network/<topology>/{all_reduce,send_recv}.csv``
  (``size`` in bytes of a float16 buffer, times in milliseconds).

Every loader returns a frozen observation set: one read-only numpy array per column, all of
the same length, with the units in the field names (``latency_s`` in seconds per call,
``message_bytes`` in bytes, token counts as integers) and derived quantities as properties
(``GemmObservations.flops``, ``DecodeAttentionObservations.kv_bytes``, ...). Data types are
renamed to jkernel's spelling (``bfloat16`` → ``bf16``, ``half`` → ``fp16``, ``fp8``,
``fp8_block``, ``nvfp4``; names jkernel has no spelling for are kept as the table writes them).

Strictness: a table without a column the loader needs, or with a column of an unexpected
Arrow type, raises :class:`ProfileError` naming the file and the column. Rows with a missing,
NaN, infinite or non-positive latency, or a missing / non-positive shape value, are dropped
and counted in ``skipped`` (reason → rows; every dropped row is counted once, under the first
reason found), so ``len(obs) + sum(obs.skipped.values())`` is the number of rows in the table.
A table with no rows, or none left after dropping, raises :class:`ProfileError`.

pyarrow is only needed for the Parquet loaders (extra ``pip install 'jkernel[profiles]'``);
it is imported inside them. The Vidur CSV loaders need only the standard library and numpy.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Iterable, Mapping, NamedTuple, Sequence, TypeVar

import numpy as np

from .heldout import held_out, row_hash

__all__ = [
    "ProfileError",
    "DTYPE_NAMES",
    "ELEMENT_BYTES",
    "dtype_name",
    "Observations",
    "GemmObservations",
    "DecodeAttentionObservations",
    "PrefillAttentionObservations",
    "MoeObservations",
    "MlaObservations",
    "CollectiveObservations",
    "VidurOpObservations",
    "Source",
    "ChipProfiles",
    "load_gemm",
    "load_decode_attention",
    "load_prefill_attention",
    "load_moe",
    "load_mla",
    "load_nccl",
    "load_custom_allreduce",
    "load_vidur_mlp",
    "load_vidur_network",
    "load_chip",
    "file_sha256",
    "PROFILE_DIRS",
    "CATALOG_NAMES",
    "profile_folder",
]

PathLike = str | os.PathLike

#: Catalog chip name → AIConfigurator profile folder, where the two differ by more than the
#: rules of :func:`profile_folder` (the one table of chip folders in the package).
PROFILE_DIRS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm",
                "b300": "b300_sxm", "l40s": "l40s", "a100-sxm": "a100_sxm"}
#: Profile folder → catalog chip name.
CATALOG_NAMES = {v: k for k, v in PROFILE_DIRS.items()}

#: Milliseconds → seconds. Both sources report milliseconds per call.
MS = 1e-3

_PROFILES_EXTRA = "pip install 'jkernel[profiles]'"


class ProfileError(ValueError):
    """A profile table the loaders will not turn into observations.

    Attributes:
      file: the table's path (str), or None.
      column: the offending column, or None when the whole table is at fault.
      reason: the message without the file/column prefix.
    """

    def __init__(self, reason: str, *, file: PathLike | None = None, column: str | None = None):
        self.file = None if file is None else str(file)
        self.column = column
        self.reason = reason
        where = ""
        if self.file:
            where += f"{self.file}: "
        if column:
            where += f"column {column!r}: "
        super().__init__(where + reason)

    def __reduce__(self):  # keep the fields through pickling
        return (_rebuild_profile_error, (self.reason, self.file, self.column))


def _rebuild_profile_error(reason, file, column):
    return ProfileError(reason, file=file, column=column)


def _pyarrow():
    """Import pyarrow (and its Parquet reader) on demand, with an installation hint."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - exercised with pyarrow hidden
        raise ImportError(
            "reading AIConfigurator Parquet profiles needs pyarrow, an optional dependency of "
            f"jkernel; install it with: {_PROFILES_EXTRA}"
        ) from exc
    return pa, pc, pq


# --------------------------------------------------------------------------------------
# Data type names
# --------------------------------------------------------------------------------------

#: Table spelling (lower case) → jkernel spelling. Names not listed are kept as written.
DTYPE_NAMES: Mapping[str, str] = MappingProxyType({
    "bfloat16": "bf16",
    "bf16": "bf16",
    "half": "fp16",
    "float16": "fp16",
    "fp16": "fp16",
    "float": "fp32",
    "float32": "fp32",
    "fp32": "fp32",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "fp8_block": "fp8_block",
    "nvfp4": "nvfp4",
    "int8": "int8",
})

#: Bytes per element of the jkernel dtypes whose element size is one number.
ELEMENT_BYTES: Mapping[str, float] = MappingProxyType({
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
})


def dtype_name(name: str) -> str:
    """jkernel's spelling of a table's dtype name (``'bfloat16'`` → ``'bf16'``)."""
    key = str(name).strip().lower()
    return DTYPE_NAMES.get(key, key)


def _map_dtypes(values: np.ndarray) -> np.ndarray:
    """jkernel spellings of an array of table dtype names."""
    values = np.asarray(values, dtype=str)
    if values.size == 0:
        return values
    uniq, inv = np.unique(values, return_inverse=True)
    return np.array([dtype_name(u) for u in uniq], dtype=str)[inv].reshape(values.shape)


def _element_bytes(dtypes: np.ndarray, *, file: PathLike | None, column: str) -> np.ndarray:
    """Bytes per element of each (already mapped) dtype; ProfileError for an unknown one."""
    uniq, inv = np.unique(dtypes, return_inverse=True)
    sizes = []
    for u in uniq:
        if u not in ELEMENT_BYTES:
            raise ProfileError(
                f"no element size known for dtype {u!r} (known: {sorted(ELEMENT_BYTES)})",
                file=file, column=column)
        sizes.append(ELEMENT_BYTES[u])
    return np.asarray(sizes, dtype=np.float64)[inv].reshape(dtypes.shape)


# --------------------------------------------------------------------------------------
# Observation sets
# --------------------------------------------------------------------------------------

_O = TypeVar("_O", bound="Observations")

@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class Observations:
    """Base of the observation sets: equal-length, read-only numpy columns.

    Attributes (common to every set):
      chip: chip the rows were measured on (``'h100_sxm'``; Vidur: ``'h100'``).
      source: the file the rows came from (``';'``-joined after :meth:`concat`).
      sha256: hex SHA-256 of that file's bytes.
      skipped: rows dropped while loading, by reason (``'latency_nan'``,
        ``'latency_nonpositive'``, ``'m_nonpositive'``, ...). Never changed by
        :meth:`select` or :meth:`split`.

    Subclasses list their array fields in ``_columns`` and the columns that define a row's
    shape (what :meth:`split` hashes) in ``_shape_columns``.
    """

    _columns: ClassVar[tuple[str, ...]] = ()
    _shape_columns: ClassVar[tuple[str, ...]] = ()

    chip: str
    source: str = ""
    sha256: str = ""
    skipped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        n = None
        for name in self._columns:
            a = np.asarray(getattr(self, name))
            if a.ndim != 1:
                raise ValueError(f"{type(self).__name__}.{name} must be one-dimensional, "
                                 f"got shape {a.shape}")
            if n is None:
                n = len(a)
            elif len(a) != n:
                raise ValueError(f"{type(self).__name__}.{name} has {len(a)} rows, "
                                 f"expected {n} like {self._columns[0]}")
            a = a.view()  # read-only view: the caller's array keeps its own flags
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        object.__setattr__(self, "skipped", {str(k): int(v) for k, v in self.skipped.items()})

    # -- basic protocol ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(getattr(self, self._columns[0])) if self._columns else 0

    def __repr__(self) -> str:
        skipped = f", skipped={self.skipped}" if self.skipped else ""
        return (f"{type(self).__name__}(chip={self.chip!r}, rows={len(self)}, "
                f"source={self.source!r}{skipped})")

    def columns(self) -> dict[str, np.ndarray]:
        """The array fields by name (read-only arrays)."""
        return {name: getattr(self, name) for name in self._columns}

    # -- subsets ---------------------------------------------------------------------------

    def select(self: _O, mask: np.ndarray | Sequence[bool] | Sequence[int]) -> _O:
        """The rows picked by a boolean mask (of this set's length) or an index array."""
        m = np.asarray(mask)
        if m.dtype == bool:
            if m.shape != (len(self),):
                raise ValueError(f"mask has shape {m.shape}, expected ({len(self)},)")
        elif m.size == 0:
            m = np.zeros(0, dtype=np.intp)
        elif m.dtype.kind not in "iu":
            raise TypeError(f"select() takes a boolean mask or integer indices, got {m.dtype}")
        return dataclasses.replace(self, **{c: getattr(self, c)[m] for c in self._columns})

    def where(self: _O, **equals: Any) -> _O:
        """Rows whose columns equal the given values, e.g. ``obs.where(dtype='bf16', n=8192)``.

        A value may also be a set/list/tuple of accepted values.
        """
        mask = np.ones(len(self), dtype=bool)
        for name, want in equals.items():
            if name not in self._columns:
                raise KeyError(f"{type(self).__name__} has no column {name!r} "
                               f"(columns: {', '.join(self._columns)})")
            col = getattr(self, name)
            if isinstance(want, (set, frozenset, list, tuple)):
                mask &= np.isin(col, list(want))
            else:
                mask &= col == want
        return self.select(mask)

    def shape_hash(self, seed: int = 0, by: Sequence[str] | None = None) -> np.ndarray:
        """A uint64 per row that depends only on ``seed`` and the ``by`` columns' values
        (default: the shape columns), stable across processes and platforms."""
        cols = tuple(self._shape_columns if by is None else by)
        if not cols:
            raise ValueError(f"{type(self).__name__} has no shape columns to hash")
        for c in cols:
            if c not in self._columns:
                raise KeyError(f"{type(self).__name__} has no column {c!r}")
        return row_hash(seed, [getattr(self, c) for c in cols])

    def held_mask(self, fraction: float = 0.2, seed: int = 0,
                  by: Sequence[str] | None = None) -> np.ndarray:
        """The held-out rows of :meth:`split` as a boolean mask, shape ``(len(self),)``:
        :func:`~jkernel.calibration.data.heldout.held_out` on :meth:`shape_hash` (``seed``,
        ``by``)."""
        return held_out(fraction, key_hash=self.shape_hash(seed, by))

    def split(self: _O, fraction: float = 0.2, seed: int = 0,
              by: Sequence[str] | None = None) -> tuple[_O, _O]:
        """Deterministic ``(fit, held_out)`` split; ``fraction`` is the held-out share.

        A row is held out when a hash of ``seed`` and its shape columns (or the ``by``
        columns), mapped to [0, 1), is below ``fraction``
        (:func:`~jkernel.calibration.data.heldout.held_out`). Rows with the same shape
        therefore always fall on the same side, and the assignment of a shape does not
        depend on which other rows are in the set (so it survives :meth:`select` and
        :meth:`concat`).
        """
        held = self.held_mask(fraction, seed, by)
        return self.select(~held), self.select(held)

    @classmethod
    def concat(cls: type[_O], parts: Iterable[_O]) -> _O:
        """One set holding the rows of several sets of this type (in order)."""
        parts = list(parts)
        if not parts:
            raise ValueError("concat() needs at least one observation set")
        for p in parts:
            if type(p) is not cls:
                raise TypeError(f"cannot concat {type(p).__name__} into {cls.__name__}")
        chips = list(dict.fromkeys(p.chip for p in parts))
        if len(chips) > 1:
            raise ValueError(f"cannot concat observations of different chips: {chips}")
        skipped: dict[str, int] = {}
        for p in parts:
            for k, v in p.skipped.items():
                skipped[k] = skipped.get(k, 0) + v
        first = parts[0]
        extra = {f.name: getattr(first, f.name) for f in dataclasses.fields(cls)
                 if f.name not in cls._columns
                 and f.name not in ("chip", "source", "sha256", "skipped")}
        return cls(
            chip=chips[0],
            source=";".join(dict.fromkeys(p.source for p in parts)),
            sha256=";".join(dict.fromkeys(p.sha256 for p in parts)),
            skipped=skipped,
            **extra,
            **{c: np.concatenate([getattr(p, c) for p in parts]) for c in cls._columns},
        )


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class GemmObservations(Observations):
    """Dense GEMM ``[m, k] @ [k, n]`` timings (AIConfigurator ``gemm_perf``).

    Columns: ``dtype`` (jkernel spelling: bf16, fp8, fp8_block, nvfp4), ``m`` (tokens),
    ``n``, ``k``, ``latency_s`` (seconds per call), ``kernel`` (the table's kernel_source).
    """

    _columns: ClassVar[tuple[str, ...]] = ("dtype", "m", "n", "k", "latency_s", "kernel")
    _shape_columns: ClassVar[tuple[str, ...]] = ("m", "n", "k")

    dtype: np.ndarray
    m: np.ndarray
    n: np.ndarray
    k: np.ndarray
    latency_s: np.ndarray
    kernel: np.ndarray

    @property
    def flops(self) -> np.ndarray:
        """Floating-point operations per call, ``2·m·n·k`` (float64)."""
        return 2.0 * self.m.astype(np.float64) * self.n * self.k


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class DecodeAttentionObservations(Observations):
    """Decode ("generation") attention timings, one new token per request.

    Columns: ``batch_size`` (requests), ``ctx_tokens`` (tokens each request attends over =
    the table's ``step`` + 1), ``n_q`` (query heads on this GPU), ``n_kv`` (KV heads),
    ``head_dim``, ``attn_dtype``, ``kv_dtype`` (KV-cache dtype), ``kv_elem_bytes`` (bytes per
    cached element), ``window`` (sliding window in tokens; 0 = none), ``latency_s``,
    ``kernel``.
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "batch_size", "ctx_tokens", "n_q", "n_kv", "head_dim", "attn_dtype", "kv_dtype",
        "kv_elem_bytes", "window", "latency_s", "kernel")
    _shape_columns: ClassVar[tuple[str, ...]] = (
        "batch_size", "ctx_tokens", "n_q", "n_kv", "head_dim", "window")

    batch_size: np.ndarray
    ctx_tokens: np.ndarray
    n_q: np.ndarray
    n_kv: np.ndarray
    head_dim: np.ndarray
    attn_dtype: np.ndarray
    kv_dtype: np.ndarray
    kv_elem_bytes: np.ndarray
    window: np.ndarray
    latency_s: np.ndarray
    kernel: np.ndarray

    @property
    def attended_tokens(self) -> np.ndarray:
        """KV tokens read per request: ``ctx_tokens``, bounded by ``window`` when set."""
        return np.where(self.window > 0, np.minimum(self.ctx_tokens, self.window),
                        self.ctx_tokens)

    @property
    def kv_bytes(self) -> np.ndarray:
        """KV-cache bytes read per call: ``batch·attended·2·n_kv·head_dim·kv_elem_bytes``."""
        return (self.batch_size.astype(np.float64) * self.attended_tokens * 2.0
                * self.n_kv * self.head_dim * self.kv_elem_bytes)


def _causal_pairs(isl: np.ndarray, window: np.ndarray) -> np.ndarray:
    """(query, key) pairs of one causal sequence of ``isl`` tokens, windowed when window>0."""
    L = isl.astype(np.float64)
    w = np.where(window > 0, window, isl).astype(np.float64)
    w = np.minimum(w, L)
    return w * (w + 1.0) / 2.0 + (L - w) * w


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class PrefillAttentionObservations(Observations):
    """Prefill ("context") attention timings, causal, no cached prefix.

    Columns: ``batch_size``, ``isl`` (prompt tokens per request), ``n_q`` (query heads on
    this GPU), ``n_kv``, ``head_dim``, ``attn_dtype``, ``kv_dtype``, ``kv_elem_bytes``,
    ``window`` (0 = none), ``latency_s``, ``kernel``.
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "batch_size", "isl", "n_q", "n_kv", "head_dim", "attn_dtype", "kv_dtype",
        "kv_elem_bytes", "window", "latency_s", "kernel")
    _shape_columns: ClassVar[tuple[str, ...]] = (
        "batch_size", "isl", "n_q", "n_kv", "head_dim", "window")

    batch_size: np.ndarray
    isl: np.ndarray
    n_q: np.ndarray
    n_kv: np.ndarray
    head_dim: np.ndarray
    attn_dtype: np.ndarray
    kv_dtype: np.ndarray
    kv_elem_bytes: np.ndarray
    window: np.ndarray
    latency_s: np.ndarray
    kernel: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        """Prompt tokens per call, ``batch_size·isl``."""
        return self.batch_size * self.isl

    @property
    def flops(self) -> np.ndarray:
        """Attention FLOPs per call (QKᵀ and PV, causal, windowed):
        ``4·batch·n_q·head_dim·pairs`` with ``pairs = Σ_i min(i, window)``."""
        return (4.0 * self.batch_size * self.n_q * self.head_dim
                * _causal_pairs(self.isl, self.window))


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class MoeObservations(Observations):
    """Fused MoE layer timings (AIConfigurator ``moe_perf``) on one GPU.

    Columns: ``dtype`` (jkernel spelling; int4_wo, w4a16_mxfp4, ... kept as written),
    ``num_tokens``, ``hidden``, ``inter`` (the table's hidden_size and inter_size),
    ``topk``, ``experts``, ``moe_tp``, ``moe_ep``, ``distribution`` (``balanced``,
    ``power_law_<alpha>``), ``latency_s``, ``kernel``.
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "dtype", "num_tokens", "hidden", "inter", "topk", "experts", "moe_tp", "moe_ep",
        "distribution", "latency_s", "kernel")
    _shape_columns: ClassVar[tuple[str, ...]] = (
        "num_tokens", "hidden", "inter", "topk", "experts", "moe_tp", "moe_ep")

    dtype: np.ndarray
    num_tokens: np.ndarray
    hidden: np.ndarray
    inter: np.ndarray
    topk: np.ndarray
    experts: np.ndarray
    moe_tp: np.ndarray
    moe_ep: np.ndarray
    distribution: np.ndarray
    latency_s: np.ndarray
    kernel: np.ndarray

    @property
    def routed_tokens(self) -> np.ndarray:
        """Token-expert assignments per call, ``num_tokens·topk``."""
        return self.num_tokens * self.topk


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class MlaObservations(Observations):
    """Whole MLA attention module timings (DeepSeek-V3 style; AIConfigurator ``mla/``).

    One row times the module of one layer on one GPU (projections, attention, and the
    absorbed BMMs as the collector ran them) for ``model``.

    Columns: ``phase`` (``'context'`` = prefill, ``'generation'`` = decode), ``op`` (the
    table's op_name), ``model`` (``''`` where the table has none), ``dtype`` (the table's
    mla_dtype), ``kv_dtype``, ``gemm_dtype`` (the table's gemm_type; ``''`` where absent),
    ``n_heads`` (attention heads on this GPU), ``batch_size``, ``isl`` (new tokens per
    request: the prompt in context rows, 1 in generation rows), ``step`` (tokens already
    cached per request), ``tp_size``, ``latency_s``, ``kernel``.
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "phase", "op", "model", "dtype", "kv_dtype", "gemm_dtype", "n_heads", "batch_size",
        "isl", "step", "tp_size", "latency_s", "kernel")
    _shape_columns: ClassVar[tuple[str, ...]] = (
        "n_heads", "batch_size", "isl", "step", "tp_size")

    phase: np.ndarray
    op: np.ndarray
    model: np.ndarray
    dtype: np.ndarray
    kv_dtype: np.ndarray
    gemm_dtype: np.ndarray
    n_heads: np.ndarray
    batch_size: np.ndarray
    isl: np.ndarray
    step: np.ndarray
    tp_size: np.ndarray
    latency_s: np.ndarray
    kernel: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        """New tokens per call, ``batch_size·isl``."""
        return self.batch_size * self.isl

    @property
    def ctx_tokens(self) -> np.ndarray:
        """Tokens each request attends over, ``step + isl`` (cached plus new)."""
        return self.step + self.isl


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class CollectiveObservations(Observations):
    """Collective communication timings.

    Columns: ``op`` (all_reduce, all_gather, reduce_scatter, alltoall, send_recv),
    ``dtype`` (jkernel spelling), ``num_gpus``, ``devices_per_node`` (GPUs per node taking
    part; equal to ``num_gpus`` for the single-node AIConfigurator tables),
    ``message_bytes`` (the table's message size in bytes: AIConfigurator's element count ×
    the dtype's element bytes; Vidur's size, already bytes), ``latency_s``, ``backend``
    (``'nccl'`` or ``'custom_allreduce'``), ``variant`` (custom all-reduce: ``'graph'`` or
    ``'eager'``; Vidur: the topology folder, e.g. ``'h100_dgx'``; else ``''``).
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "op", "dtype", "num_gpus", "devices_per_node", "message_bytes", "latency_s",
        "backend", "variant")
    _shape_columns: ClassVar[tuple[str, ...]] = ("num_gpus", "message_bytes")

    op: np.ndarray
    dtype: np.ndarray
    num_gpus: np.ndarray
    devices_per_node: np.ndarray
    message_bytes: np.ndarray
    latency_s: np.ndarray
    backend: np.ndarray
    variant: np.ndarray

    @property
    def algorithm_bandwidth(self) -> np.ndarray:
        """``message_bytes / latency_s`` in bytes per second."""
        return self.message_bytes / self.latency_s


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class VidurOpObservations(Observations):
    """Vidur per-op timings of one model's transformer layer vs token count, long format:
    one row per (CSV row, op).

    Columns: ``model`` (``'<org>/<model>'``), ``op`` (emb, input_layernorm, attn_pre_proj,
    attn_rope, attn_post_proj, post_attention_layernorm, mlp_up_proj, mlp_act,
    mlp_down_proj, add), ``num_tokens``, ``tp`` (tensor-parallel workers), ``latency_s`` (the
    median), ``mean_s``, ``min_s``, ``max_s``, ``std_s``, and the model's ``n_head``,
    ``n_kv_head``, ``hidden`` (n_embd), ``inter`` (n_expanded_embd), ``vocab``,
    ``gated_mlp``.
    """

    _columns: ClassVar[tuple[str, ...]] = (
        "model", "op", "num_tokens", "tp", "latency_s", "mean_s", "min_s", "max_s", "std_s",
        "n_head", "n_kv_head", "hidden", "inter", "vocab", "gated_mlp")
    _shape_columns: ClassVar[tuple[str, ...]] = ("num_tokens", "tp", "hidden", "inter")

    model: np.ndarray
    op: np.ndarray
    num_tokens: np.ndarray
    tp: np.ndarray
    latency_s: np.ndarray
    mean_s: np.ndarray
    min_s: np.ndarray
    max_s: np.ndarray
    std_s: np.ndarray
    n_head: np.ndarray
    n_kv_head: np.ndarray
    hidden: np.ndarray
    inter: np.ndarray
    vocab: np.ndarray
    gated_mlp: np.ndarray


# --------------------------------------------------------------------------------------
# Column extraction and row validation
# --------------------------------------------------------------------------------------

_REQUIRED = object()


@dataclass(frozen=True)
class _Col:
    """One table column a loader reads.

    kind: 'int' | 'float' | 'str'. check: 'latency' (finite, > 0), 'positive' (> 0),
    'nonnegative' (>= 0) or None. default: value used when the column is absent
    (_REQUIRED: absence is a ProfileError).
    """

    src: str
    kind: str
    check: str | None = None
    default: Any = _REQUIRED


_KIND_TEXT = {"int": "an integer column", "float": "a numeric column",
              "str": "a string column"}


def file_sha256(path: PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_parquet(path: PathLike):
    """(table, sha256) of a Parquet file, hashing exactly the bytes that are parsed."""
    pa, _, pq = _pyarrow()
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read the file: {exc}", file=path) from exc
    try:
        table = pq.read_table(pa.BufferReader(data))
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise ProfileError(f"not a readable Parquet table: {exc}", file=path) from exc
    return table, hashlib.sha256(data).hexdigest()


def _arrow_extract(table, cols: Sequence[_Col], file: PathLike):
    """{src: (values, null_mask | None)} for the wanted columns, type-checked."""
    pa, pc, _ = _pyarrow()
    names = set(table.column_names)
    n = table.num_rows
    out: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    for c in cols:
        if c.src not in names:
            if c.default is _REQUIRED:
                raise ProfileError(
                    f"missing column (expected {_KIND_TEXT[c.kind]}); the table has "
                    f"{', '.join(table.column_names)}", file=file, column=c.src)
            out[c.src] = (np.full(n, c.default), None)
            continue
        col = table.column(c.src)
        t = col.type
        if pa.types.is_dictionary(t):
            col = col.cast(t.value_type)
            t = t.value_type
        ok = {
            "int": pa.types.is_integer(t),
            "float": pa.types.is_floating(t) or pa.types.is_integer(t),
            "str": pa.types.is_string(t) or pa.types.is_large_string(t),
        }[c.kind]
        if not ok:
            raise ProfileError(f"unexpected type {t} (expected {_KIND_TEXT[c.kind]})",
                               file=file, column=c.src)
        nulls = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
        if c.kind == "str":
            col = pc.fill_null(col, "")
            enc = pc.dictionary_encode(col.combine_chunks() if hasattr(col, "combine_chunks")
                                       else col)
            words = np.array(enc.dictionary.to_pylist(), dtype=str)
            idx = enc.indices.to_numpy(zero_copy_only=False)
            vals = words[idx] if len(words) else np.zeros(n, dtype=str)
        elif c.kind == "int":
            vals = pc.fill_null(col, 0).to_numpy().astype(np.int64)
        else:
            vals = pc.fill_null(col.cast(pa.float64()), float("nan")).to_numpy().astype(
                np.float64)
        out[c.src] = (vals, nulls)
    return out


def _validate(raw: Mapping[str, tuple[np.ndarray, np.ndarray | None]], cols: Sequence[_Col],
              n: int, file: PathLike, skipped: dict[str, int] | None = None):
    """Drop (and count) invalid rows. Returns ({src: kept values}, skipped)."""
    if n == 0:
        raise ProfileError("the table is empty (0 rows)", file=file)
    keep = np.ones(n, dtype=bool)
    skipped = {} if skipped is None else skipped

    def drop(reason: str, bad: np.ndarray):
        bad = bad & keep
        k = int(bad.sum())
        if k:
            skipped[reason] = skipped.get(reason, 0) + k
            keep[bad] = False

    # Missing values first, then latency, then shapes: a row is counted under one reason.
    # Optional descriptive columns (kernel_source, device, ...) may be null: they read "".
    for c in cols:
        vals, nulls = raw[c.src]
        if nulls is not None and (c.check is not None or c.default is _REQUIRED):
            drop(f"{c.src}_missing", nulls)
    for c in cols:
        if c.check != "latency":
            continue
        v = raw[c.src][0]
        drop(f"{c.src}_nan", np.isnan(v))
        drop(f"{c.src}_inf", np.isinf(v))
        drop(f"{c.src}_nonpositive", ~(v > 0))
    for c in cols:
        v = raw[c.src][0]
        if c.check == "positive":
            drop(f"{c.src}_nonpositive", ~(v > 0))
        elif c.check == "nonnegative":
            drop(f"{c.src}_negative", v < 0)
    if not keep.any():
        raise ProfileError(f"no valid rows left: all {n} rows were dropped ({skipped})",
                           file=file)
    return {c.src: raw[c.src][0][keep] for c in cols}, skipped


def _load_aic(path: PathLike, cols: Sequence[_Col], *, op_names: Sequence[str] | None = None):
    """Read, type-check and validate one AIConfigurator table.

    Returns (values by source column, skipped, sha256, table-derived chip or None).
    """
    table, sha = _read_parquet(path)
    want = list(cols)
    if op_names is not None:
        want.append(_Col("op_name", "str"))
    want.append(_Col("device", "str", default=""))
    raw = _arrow_extract(table, want, path)
    if op_names is not None:
        found = sorted(set(raw["op_name"][0].tolist()))
        wrong = [o for o in found if o not in op_names]
        if wrong:
            raise ProfileError(
                f"holds op_name {wrong}, expected {list(op_names)}: this loader reads "
                f"another table", file=path, column="op_name")
    vals, skipped = _validate(raw, want, table.num_rows, path)
    return vals, skipped, sha


_LAYOUT_FRAMEWORKS = {"vllm", "nccl", "trtllm", "sglang", "trt", "tensorrt_llm"}

_DEVICE_CHIPS = (
    (re.compile(r"\bA100\b.*SXM", re.I), "a100_sxm"),
    (re.compile(r"\bH100\b", re.I), "h100_sxm"),
    (re.compile(r"\bH200\b", re.I), "h200_sxm"),
    (re.compile(r"\bGB200\b", re.I), "gb200"),
    (re.compile(r"\bB200\b", re.I), "b200_sxm"),
    (re.compile(r"\bB300\b", re.I), "b300_sxm"),
    (re.compile(r"\bL40S\b", re.I), "l40s"),
)


def _aic_chip(path: PathLike, device: np.ndarray, chip: str | None) -> str:
    """The chip of an AIConfigurator table: explicit, else from the
    ``<chip>/<op>/<framework>/<version>/<file>`` layout, else from the device column."""
    if chip:
        return chip
    parts = Path(path).parts
    if (len(parts) >= 5 and parts[-3].lower() in _LAYOUT_FRAMEWORKS
            and parts[-2][:1].isdigit()):
        return parts[-5]
    names = sorted({d for d in device.tolist() if d})
    if len(names) == 1:
        for pattern, name in _DEVICE_CHIPS:
            if pattern.search(names[0]):
                return name
        return names[0]
    return "unknown"


def _strs(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=str)


# --------------------------------------------------------------------------------------
# AIConfigurator loaders
# --------------------------------------------------------------------------------------

_LAT = _Col("latency", "float", "latency")


def load_gemm(path: PathLike, *, chip: str | None = None) -> GemmObservations:
    """GEMM timings from ``gemm_perf.parquet`` (columns gemm_dtype, m, n, k, latency [ms])."""
    cols = [_Col("gemm_dtype", "str"), _Col("m", "int", "positive"),
            _Col("n", "int", "positive"), _Col("k", "int", "positive"), _LAT,
            _Col("kernel_source", "str", default="")]
    v, skipped, sha = _load_aic(path, cols, op_names=None)
    return GemmObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        dtype=_map_dtypes(v["gemm_dtype"]), m=v["m"], n=v["n"], k=v["k"],
        latency_s=v["latency"] * MS, kernel=_strs(v["kernel_source"]))


def _attention_cols(step_check: str) -> list[_Col]:
    return [_Col("batch_size", "int", "positive"), _Col("isl", "int", "positive"),
            _Col("num_heads", "int", "positive"),
            _Col("num_key_value_heads", "int", "positive"),
            _Col("head_dim", "int", "positive"), _Col("attn_dtype", "str"),
            _Col("kv_cache_dtype", "str"), _Col("step", "int", step_check),
            _Col("window_size", "int", "nonnegative", default=0), _LAT,
            _Col("kernel_source", "str", default="")]


def load_decode_attention(path: PathLike, *,
                          chip: str | None = None) -> DecodeAttentionObservations:
    """Decode attention from ``generation_attention_perf.parquet``.

    ``step`` is the number of cached tokens per request; the kernel attends over
    ``step + 1`` (``ctx_tokens``). ``window_size`` 0 (or absent, as in the A100 table) means
    no sliding window.
    """
    v, skipped, sha = _load_aic(path, _attention_cols("nonnegative"),
                                op_names=("generation_attention",))
    kv = _map_dtypes(v["kv_cache_dtype"])
    return DecodeAttentionObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        batch_size=v["batch_size"], ctx_tokens=v["step"] + 1, n_q=v["num_heads"],
        n_kv=v["num_key_value_heads"], head_dim=v["head_dim"],
        attn_dtype=_map_dtypes(v["attn_dtype"]), kv_dtype=kv,
        kv_elem_bytes=_element_bytes(kv, file=path, column="kv_cache_dtype"),
        window=v["window_size"], latency_s=v["latency"] * MS,
        kernel=_strs(v["kernel_source"]))


def load_prefill_attention(path: PathLike, *,
                           chip: str | None = None) -> PrefillAttentionObservations:
    """Prefill attention from ``context_attention_perf.parquet`` (``isl`` tokens per request,
    causal; ``step`` is 0 throughout the tables and not kept)."""
    v, skipped, sha = _load_aic(path, _attention_cols("nonnegative"),
                                op_names=("context_attention",))
    kv = _map_dtypes(v["kv_cache_dtype"])
    return PrefillAttentionObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        batch_size=v["batch_size"], isl=v["isl"], n_q=v["num_heads"],
        n_kv=v["num_key_value_heads"], head_dim=v["head_dim"],
        attn_dtype=_map_dtypes(v["attn_dtype"]), kv_dtype=kv,
        kv_elem_bytes=_element_bytes(kv, file=path, column="kv_cache_dtype"),
        window=v["window_size"], latency_s=v["latency"] * MS,
        kernel=_strs(v["kernel_source"]))


def load_moe(path: PathLike, *, chip: str | None = None) -> MoeObservations:
    """Fused MoE timings from ``moe_perf.parquet``."""
    cols = [_Col("moe_dtype", "str"), _Col("num_tokens", "int", "positive"),
            _Col("hidden_size", "int", "positive"), _Col("inter_size", "int", "positive"),
            _Col("topk", "int", "positive"), _Col("num_experts", "int", "positive"),
            _Col("moe_tp_size", "int", "positive"), _Col("moe_ep_size", "int", "positive"),
            _Col("distribution", "str"), _LAT, _Col("kernel_source", "str", default="")]
    v, skipped, sha = _load_aic(path, cols, op_names=None)
    return MoeObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        dtype=_map_dtypes(v["moe_dtype"]), num_tokens=v["num_tokens"],
        hidden=v["hidden_size"], inter=v["inter_size"], topk=v["topk"],
        experts=v["num_experts"], moe_tp=v["moe_tp_size"], moe_ep=v["moe_ep_size"],
        distribution=_strs(v["distribution"]), latency_s=v["latency"] * MS,
        kernel=_strs(v["kernel_source"]))


def load_mla(path: PathLike, *, chip: str | None = None) -> MlaObservations:
    """MLA module timings from ``mla_context_module_perf`` / ``mla_generation_module_perf``
    (and the A100 tables ``context_mla_perf`` / ``generation_mla_perf``, which lack model and
    gemm_type). The phase comes from ``op_name`` (``*context*`` or ``*generation*``); the
    sparse-attention module tables of the same layout (dsa_*, msa_*) load too.
    """
    cols = [_Col("op_name", "str"), _Col("model", "str", default=""),
            _Col("mla_dtype", "str"), _Col("kv_cache_dtype", "str"),
            _Col("gemm_type", "str", default=""), _Col("num_heads", "int", "positive"),
            _Col("batch_size", "int", "positive"), _Col("isl", "int", "positive"),
            _Col("step", "int", "nonnegative"), _Col("tp_size", "int", "positive"), _LAT,
            _Col("kernel_source", "str", default="")]
    v, skipped, sha = _load_aic(path, cols, op_names=None)
    ops = _strs(v["op_name"])
    phase = np.where(np.char.find(ops, "context") >= 0, "context",
                     np.where(np.char.find(ops, "generation") >= 0, "generation", ""))
    if (phase == "").any():
        bad = sorted(set(ops[phase == ""].tolist()))
        raise ProfileError(f"cannot tell the phase of op_name {bad} (expected a name "
                           f"containing 'context' or 'generation')", file=path,
                           column="op_name")
    gemm = _strs(v["gemm_type"])
    return MlaObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        phase=phase.astype(str), op=ops, model=_strs(v["model"]),
        dtype=_map_dtypes(v["mla_dtype"]), kv_dtype=_map_dtypes(v["kv_cache_dtype"]),
        gemm_dtype=np.where(gemm == "", "", _map_dtypes(gemm)).astype(str),
        n_heads=v["num_heads"], batch_size=v["batch_size"], isl=v["isl"], step=v["step"],
        tp_size=v["tp_size"], latency_s=v["latency"] * MS, kernel=_strs(v["kernel_source"]))


def _collectives(path, v, skipped, sha, chip, *, dtype_col: str, backend: str,
                 variant: np.ndarray) -> CollectiveObservations:
    dt = _map_dtypes(v[dtype_col])
    elem = _element_bytes(dt, file=path, column=dtype_col)
    return CollectiveObservations(
        chip=_aic_chip(path, v["device"], chip), source=str(path), sha256=sha,
        skipped=skipped,
        op=_strs(v["op_name"]), dtype=dt, num_gpus=v["num_gpus"],
        devices_per_node=v["num_gpus"].copy(),
        message_bytes=(v["message_size"] * elem).astype(np.int64),
        latency_s=v["latency"] * MS,
        backend=np.full(len(dt), backend), variant=np.asarray(variant, dtype=str))


def load_nccl(path: PathLike, *, chip: str | None = None) -> CollectiveObservations:
    """NCCL collectives from ``nccl_perf.parquet``: ``message_size`` is in elements of
    ``nccl_dtype`` (half = 2 bytes, int8 = 1) and becomes ``message_bytes``."""
    cols = [_Col("op_name", "str"), _Col("nccl_dtype", "str"),
            _Col("num_gpus", "int", "positive"), _Col("message_size", "int", "positive"),
            _LAT]
    v, skipped, sha = _load_aic(path, cols, op_names=None)
    return _collectives(path, v, skipped, sha, chip, dtype_col="nccl_dtype", backend="nccl",
                        variant=np.full(len(v["latency"]), ""))


def load_custom_allreduce(path: PathLike, *,
                          chip: str | None = None) -> CollectiveObservations:
    """vLLM custom all-reduce from ``custom_allreduce_perf.parquet``: ``message_size`` in
    elements of ``allreduce_dtype``; ``backend`` vllm_graph / vllm_eager becomes
    ``variant`` graph / eager."""
    cols = [_Col("op_name", "str", default="all_reduce"), _Col("allreduce_dtype", "str"),
            _Col("num_gpus", "int", "positive"), _Col("message_size", "int", "positive"),
            _LAT, _Col("backend", "str")]
    v, skipped, sha = _load_aic(path, cols, op_names=None)
    variant = np.char.replace(_strs(v["backend"]), "vllm_", "")
    return _collectives(path, v, skipped, sha, chip, dtype_col="allreduce_dtype",
                        backend="custom_allreduce", variant=variant)


# --------------------------------------------------------------------------------------
# Vidur loaders (CSV; no pyarrow needed)
# --------------------------------------------------------------------------------------

def _read_csv(path: PathLike) -> tuple[list[str], list[list[str]], str]:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read the file: {exc}", file=path) from exc
    reader = csv.reader(io.StringIO(data.decode("utf-8")))
    try:
        header = next(reader)
    except StopIteration:
        raise ProfileError("the table is empty (no header)", file=path) from None
    rows = [r for r in reader if r]
    for i, r in enumerate(rows):
        if len(r) != len(header):
            raise ProfileError(f"row {i + 1} has {len(r)} fields, the header {len(header)}",
                               file=path)
    return header, rows, hashlib.sha256(data).hexdigest()


def _csv_column(header: list[str], rows: list[list[str]], c: _Col, file: PathLike):
    """(values, null_mask | None) of one CSV column, parsed as c.kind."""
    n = len(rows)
    if c.src not in header:
        if c.default is _REQUIRED:
            raise ProfileError(f"missing column (expected {_KIND_TEXT[c.kind]})", file=file,
                               column=c.src)
        return np.full(n, c.default), None
    j = header.index(c.src)
    cells = [r[j].strip() for r in rows]
    nulls = np.array([s == "" for s in cells], dtype=bool)
    if c.kind == "str":
        return np.array(cells, dtype=str), (nulls if nulls.any() else None)
    out = np.empty(n, dtype=np.float64 if c.kind == "float" else np.int64)
    for i, s in enumerate(cells):
        if s == "":
            out[i] = np.nan if c.kind == "float" else 0
            continue
        try:
            if c.kind == "float":
                out[i] = float(s)
            else:
                f = float(s)
                if not f.is_integer():
                    raise ValueError(s)
                out[i] = int(f)
        except ValueError:
            raise ProfileError(f"row {i + 1}: {s!r} is not "
                               f"{'a number' if c.kind == 'float' else 'an integer'}",
                               file=file, column=c.src) from None
    return out, (nulls if nulls.any() else None)


def _csv_bool(values: np.ndarray, file: PathLike, column: str) -> np.ndarray:
    low = np.char.lower(values.astype(str))
    ok = np.isin(low, ["true", "false", "1", "0"])
    if not ok.all():
        raise ProfileError(f"expected True/False, found {sorted(set(values[~ok].tolist()))}",
                           file=file, column=column)
    return np.isin(low, ["true", "1"])


_VIDUR_STATS = ("min", "max", "mean", "median", "std")
_TP_COLUMNS = ("num_tensor_parallel_workers",)


def load_vidur_mlp(path: PathLike, *, chip: str | None = None,
                   model: str | None = None) -> VidurOpObservations:
    """Vidur per-op timings from ``compute/<chip>/<org>/<model>/mlp.csv``, long format.

    Every ``time_stats.<op>.median`` column gives one row per CSV row (times in ms →
    seconds). ``chip`` and ``model`` default to the path's ``<chip>`` and ``<org>/<model>``
    folders. A row whose median is missing, NaN, infinite or non-positive is dropped for
    that op only and counted as ``'<op>.latency_nan'`` etc.
    """
    header, rows, sha = _read_csv(path)
    if not rows:
        raise ProfileError("the table is empty (0 rows)", file=path)
    ops = [m.group(1) for h in header
           if (m := re.fullmatch(r"time_stats\.(.+)\.median", h))]
    if not ops:
        raise ProfileError("no time_stats.<op>.median column: not a Vidur compute profile",
                           file=path, column="time_stats.<op>.median")
    for op in ops:
        for stat in _VIDUR_STATS:
            if f"time_stats.{op}.{stat}" not in header:
                raise ProfileError("missing column (expected a numeric column)", file=path,
                                   column=f"time_stats.{op}.{stat}")
    shape_cols = [_Col("num_tokens", "int", "positive"),
                  _Col("num_tensor_parallel_workers", "int", "positive"),
                  _Col("n_head", "int", "positive"), _Col("n_kv_head", "int", "positive"),
                  _Col("n_embd", "int", "positive"), _Col("n_expanded_embd", "int", "positive"),
                  _Col("vocab_size", "int", "positive"), _Col("use_gated_mlp", "str")]
    shape_raw = {c.src: _csv_column(header, rows, c, path) for c in shape_cols}
    parts = Path(path).parts
    chip = chip or (parts[-4] if len(parts) >= 4 else "unknown")
    model = model or (f"{parts[-3]}/{parts[-2]}" if len(parts) >= 3 else "unknown")
    skipped: dict[str, int] = {}
    pieces: list[dict[str, np.ndarray]] = []
    n = len(rows)
    for op in ops:
        stat_cols = [_Col(f"time_stats.{op}.median", "float", "latency")] + [
            _Col(f"time_stats.{op}.{s}", "float") for s in _VIDUR_STATS if s != "median"]
        raw = dict(shape_raw)
        raw.update({c.src: _csv_column(header, rows, c, path) for c in stat_cols})
        op_skipped: dict[str, int] = {}
        try:
            vals, _ = _validate(raw, shape_cols + stat_cols, n, path, op_skipped)
        except ProfileError:
            vals = None  # every row of this op dropped; op_skipped holds the counts
        for k, c in op_skipped.items():
            key = k.replace(f"time_stats.{op}.median", f"{op}.latency")
            skipped[key] = skipped.get(key, 0) + c
        if vals is None:
            continue
        m = len(vals["num_tokens"])
        pieces.append(dict(
            op=np.full(m, op), num_tokens=vals["num_tokens"],
            tp=vals["num_tensor_parallel_workers"],
            latency_s=vals[f"time_stats.{op}.median"] * MS,
            mean_s=vals[f"time_stats.{op}.mean"] * MS,
            min_s=vals[f"time_stats.{op}.min"] * MS,
            max_s=vals[f"time_stats.{op}.max"] * MS,
            std_s=vals[f"time_stats.{op}.std"] * MS,
            n_head=vals["n_head"], n_kv_head=vals["n_kv_head"], hidden=vals["n_embd"],
            inter=vals["n_expanded_embd"], vocab=vals["vocab_size"],
            gated_mlp=_csv_bool(vals["use_gated_mlp"], path, "use_gated_mlp")))
    if not pieces:
        raise ProfileError(f"no valid rows left: every op's rows were dropped ({skipped})",
                           file=path)
    cols = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
    return VidurOpObservations(chip=chip, source=str(path), sha256=sha, skipped=skipped,
                               model=np.full(len(cols["op"]), model), **cols)


def load_vidur_network(path: PathLike, *, chip: str | None = None) -> CollectiveObservations:
    """Vidur collective timings from ``network/<topology>/{all_reduce,send_recv}.csv``.

    ``size`` is bytes (Vidur writes twice the float16 element count); the time is the
    median in ms. ``variant`` is the topology folder (``h100_dgx``, ``a100_pairwise_nvlink``,
    ...), ``chip`` its first word unless given. ``backend`` is ``'nccl'``.
    """
    header, rows, sha = _read_csv(path)
    if not rows:
        raise ProfileError("the table is empty (0 rows)", file=path)
    colls = sorted({m.group(1) for h in header
                    if (m := re.fullmatch(r"time_stats\.(.+)\.median", h))})
    if len(colls) != 1:
        raise ProfileError(f"expected one time_stats.<collective>.median column, found "
                           f"{colls}", file=path, column="time_stats.<collective>.median")
    op = colls[0]
    cols = [_Col(f"time_stats.{op}.median", "float", "latency"),
            _Col("num_workers", "int", "positive"), _Col("size", "int", "positive"),
            _Col("collective", "str", default=op),
            _Col("devices_per_node", "int", "positive")]
    raw = {c.src: _csv_column(header, rows, c, path) for c in cols}
    vals, skipped = _validate(raw, cols, len(rows), path)
    skipped = {k.replace(f"time_stats.{op}.median", "latency"): v for k, v in skipped.items()}
    topology = Path(path).parent.name
    m = len(vals["size"])
    return CollectiveObservations(
        chip=chip or topology.split("_")[0], source=str(path), sha256=sha, skipped=skipped,
        op=_strs(vals["collective"]), dtype=np.full(m, "fp16"),
        num_gpus=vals["num_workers"], devices_per_node=vals["devices_per_node"],
        message_bytes=vals["size"], latency_s=vals[f"time_stats.{op}.median"] * MS,
        backend=np.full(m, "nccl"), variant=np.full(m, topology))


# --------------------------------------------------------------------------------------
# One chip's tables
# --------------------------------------------------------------------------------------

class Source(NamedTuple):
    """A table read by :func:`load_chip`: path relative to the data directory (POSIX
    separators), hex SHA-256 of its bytes, and the number of rows kept from it."""

    path: str
    sha256: str
    rows: int


#: AIConfigurator table file → (ChipProfiles field, loader).
_AIC_TABLES = {
    "gemm_perf.parquet": ("gemm", load_gemm),
    "generation_attention_perf.parquet": ("decode_attention", load_decode_attention),
    "context_attention_perf.parquet": ("prefill_attention", load_prefill_attention),
    "moe_perf.parquet": ("moe", load_moe),
    "mla_context_module_perf.parquet": ("mla_context", load_mla),
    "context_mla_perf.parquet": ("mla_context", load_mla),
    "mla_generation_module_perf.parquet": ("mla_generation", load_mla),
    "generation_mla_perf.parquet": ("mla_generation", load_mla),
    "nccl_perf.parquet": ("nccl", load_nccl),
    "custom_allreduce_perf.parquet": ("custom_allreduce", load_custom_allreduce),
}


_TABLE_FIELDS = ("gemm", "decode_attention", "prefill_attention", "moe", "mla_context",
                 "mla_generation", "nccl", "custom_allreduce")


@dataclass(frozen=True, eq=False)
class ChipProfiles:
    """Every AIConfigurator table of one chip that the loaders read (None where the chip has
    no such table).

    ``sources`` lists each table read as :class:`Source` (relative path, sha256, rows kept);
    ``unloaded`` lists the newest-version Parquet tables found that no loader reads yet
    (sparse attention, gdn, mla_bmm, ...), so nothing is passed over silently.
    """

    chip: str
    data_dir: str
    gemm: GemmObservations | None = None
    decode_attention: DecodeAttentionObservations | None = None
    prefill_attention: PrefillAttentionObservations | None = None
    moe: MoeObservations | None = None
    mla_context: MlaObservations | None = None
    mla_generation: MlaObservations | None = None
    nccl: CollectiveObservations | None = None
    custom_allreduce: CollectiveObservations | None = None
    sources: tuple[Source, ...] = ()
    unloaded: tuple[str, ...] = ()

    @property
    def collectives(self) -> CollectiveObservations | None:
        """NCCL and custom all-reduce rows together (None if the chip has neither)."""
        parts = [p for p in (self.nccl, self.custom_allreduce) if p is not None]
        return CollectiveObservations.concat(parts) if parts else None

    def tables(self) -> dict[str, Observations]:
        """The observation sets present, by field name."""
        return {name: getattr(self, name) for name in _TABLE_FIELDS
                if getattr(self, name) is not None}


def _version_key(name: str):
    """Sort key of a version folder name: numeric parts compare as numbers, and a release
    sorts after its pre-releases / dev builds (``0.24.0 > 0.24.0rc1 > 0.1.dev5``)."""
    parts = re.split(r"[.\-+_]", name)
    key = []
    for p in parts:
        m = re.fullmatch(r"(\d+)(.*)", p)
        if m:
            key.append((1, int(m.group(1)), 0 if m.group(2) else 1, m.group(2)))
        else:
            key.append((0, 0, 0, p))
    key.append((0, 0, 1, ""))  # the end of a version sorts after words like 'dev'
    return key


_OPS = ("gemm", "attention", "moe", "comm", "mla", "mla_bmm", "linear_attention",
        "sparse_attention", "msa")


def _is_chip_folder(p: Path) -> bool:
    """A folder in the ``<op>/<framework>/<version>/<table>.parquet`` layout."""
    return p.is_dir() and any((p / op).is_dir() and any((p / op).glob("*/*/*.parquet"))
                              for op in _OPS)


def profile_folder(data_dir: PathLike, chip: str) -> tuple[Path, str]:
    """``(root, folder)`` of ``chip``'s AIConfigurator tables, so that ``root / folder`` holds
    ``<op>/<framework>/<version>/*.parquet``.

    ``data_dir`` is either the chip's folder itself (any name) or a data root whose folders
    are named as AIConfigurator names its systems. Under a root the folder is, in order:
    :data:`PROFILE_DIRS`'s entry, the chip's name, with ``-`` as ``_``, with ``_sxm``
    appended, and the part before the first ``-`` (``gb200-nvl72`` → ``gb200``) with and
    without ``_sxm``. None found is a :class:`ProfileError` listing the folders there.
    """
    root = Path(data_dir)
    if _is_chip_folder(root):
        return root.parent, root.name
    base = chip.lower()
    cands = [PROFILE_DIRS.get(base), base, base.replace("-", "_"),
             base.replace("-", "_") + "_sxm", base.split("-")[0], base.split("-")[0] + "_sxm"]
    for c in dict.fromkeys(x for x in cands if x):
        if _is_chip_folder(root / c):
            return root, c
    have = sorted(p.name for p in root.iterdir() if _is_chip_folder(p)) if root.is_dir() else []
    raise ProfileError(f"no profile folder for chip {chip!r} under {root} (tried "
                       f"{list(dict.fromkeys(x for x in cands if x))}; chip folders here: "
                       f"{have or 'none'}; or pass the chip's folder itself)", file=root)


def load_chip(data_dir: PathLike, chip: str) -> ChipProfiles:
    """Load every known table of ``chip`` under an AIConfigurator-layout ``data_dir``
    (``<data_dir>/<chip>/<op>/<framework>/<version>/*.parquet``).

    Where an ``<op>/<framework>`` has several version folders, the newest is read. A table
    name found twice among the newest folders, or a chip folder that does not exist, is a
    :class:`ProfileError`.
    """
    root = Path(data_dir)
    chip_dir = root / chip
    if not chip_dir.is_dir():
        have = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ProfileError(f"no folder for chip {chip!r} (chips here: {have})", file=chip_dir)
    # <op>/<framework>/<version>/<file>: group version folders by (op, framework).
    groups: dict[tuple[str, str], list[Path]] = {}
    for f in sorted(chip_dir.glob("*/*/*/*.parquet")):
        version_dir = f.parent
        op, fw = version_dir.parent.parent.name, version_dir.parent.name
        groups.setdefault((op, fw), [])
        if version_dir not in groups[(op, fw)]:
            groups[(op, fw)].append(version_dir)
    loaded: dict[str, Observations] = {}
    origin: dict[str, str] = {}
    sources: list[Source] = []
    unloaded: list[str] = []
    for key in sorted(groups):
        newest = max(groups[key], key=lambda p: _version_key(p.name))
        for f in sorted(newest.glob("*.parquet")):
            rel = f.relative_to(root).as_posix()
            entry = _AIC_TABLES.get(f.name)
            if entry is None:
                unloaded.append(rel)
                continue
            name, loader = entry
            if name in loaded:
                raise ProfileError(f"two tables for {name}: {origin[name]} and {rel}", file=f)
            obs = loader(f, chip=chip)
            loaded[name] = obs
            origin[name] = rel
            sources.append(Source(rel, obs.sha256, len(obs)))
    if not loaded:
        raise ProfileError(f"no known profile table under {chip_dir}", file=chip_dir)
    return ChipProfiles(chip=chip, data_dir=str(root), sources=tuple(sources),
                        unloaded=tuple(unloaded), **loaded)
