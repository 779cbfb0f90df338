"""Request tables for the replay: read any accepted file into one validated DataFrame.

The replay takes a :class:`pandas.DataFrame` with one row per request and the columns

=================  =========================================================================
``request_id``     any hashable id, carried to the output unchanged
``arrival_s``      float seconds, when the request reaches the server (the first is usually 0)
``input_tokens``   int ≥ 1, prompt tokens as the server counts them
``output_tokens``  int ≥ 1, tokens to generate (the run's ``max_tokens`` with ``min_tokens``
                   equal to it: the replay never stops a request early)
=================  =========================================================================

and optionally ``prefix_group`` / ``prefix_length`` (requests of one group share their first
``prefix_length`` prompt tokens, which makes them prefix-cache hits) or ``block_hashes``
(space-separated integers, one per full prompt block), and ``warm_up`` (True: a request a
benchmark client sends before its run and never measures, as LMBench's warm-up round or
vLLM's ``--num-warmups``: replayed, so that it warms the prefix cache, and left out of the
summary).

:func:`load_requests` reads three shapes of file (CSV or Parquet):

* the replay's own: ``request_id, arrival_time_us, input_tokens, output_tokens``;
* the same with ``arrival_s`` in place of ``arrival_time_us``;
* a client trace as inference-sim/residency-vllm writes it (``trace.csv`` with
  ``send_time_us``, ``server_input_tokens``, ``status`` …): the arrival is the time the
  client sent the request (``send_time_us`` less the run's first), the prompt is what the
  server tokenised (``server_input_tokens``, the client's count where the server has none),
  and rows whose ``status`` is not ``ok`` are kept and flagged (``client_status``) rather
  than dropped.

Bad input never loses data: a missing column is an error naming the column and the file;
negative, fractional or missing token counts are errors naming the rows; unsorted arrivals
are sorted (stably, so ties keep the file's order) and the table says so in
``DataFrame.attrs["sorted"]``. Every request reader goes through :func:`validate_requests`,
which also holds a table to :mod:`jkernel.limits` (rows, output tokens, arrival times) and
refuses what would be read two ways: ``arrival_s`` beside an ``arrival_time_us`` that
disagrees, a ``prefix_length`` that is negative or longer than its prompt, a
``prefix_group`` without its ``prefix_length`` (or the reverse), ``block_hashes`` that are
not whole numbers or more than the prompt's tokens.
"""

from __future__ import annotations

import math
import os
from numbers import Real
from pathlib import Path

import numpy as np
import pandas as pd

from .. import limits as _limits
from ..validate import ArgumentError

__all__ = ["load_requests", "validate_requests", "rows_named", "REQUIRED"]

#: The columns the replay reads (``arrival_s`` may come as ``arrival_time_us``).
REQUIRED = ("request_id", "arrival_s", "input_tokens", "output_tokens")


def _read(path: Path) -> pd.DataFrame:
    """The file as a DataFrame, at most ``MAX_REQUESTS`` rows read (a Parquet file's row
    count is read from its footer first: a few kilobytes can hold a billion equal rows);
    every failure to read is a ValueError naming the file."""
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".pq", ".csv", ".txt", ""):
        raise ValueError(f"{path}: unknown request file type {suffix!r}; allowed: .csv, "
                         ".parquet")
    parquet = suffix in (".parquet", ".pq")
    kind = "Parquet" if parquet else "CSV"
    try:
        if parquet:
            import pyarrow.parquet as pq

            rows = pq.ParquetFile(path).metadata.num_rows
            if rows > _limits.MAX_REQUESTS:
                raise ValueError(f"{path}: {rows:,} requests: "
                                 + _limits.beyond("MAX_REQUESTS", rows))
            return pd.read_parquet(path)
        df = pd.read_csv(path, nrows=_limits.MAX_REQUESTS + 1)
    except ImportError as exc:
        raise ValueError(f"{path}: reading Parquet needs pyarrow ({exc})") from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: the request file is empty (not even a header row of "
                         f"columns: {', '.join(REQUIRED)})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a {kind} text file (byte {exc.start} is not UTF-8)"
                         ) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the request file: "
                         f"{exc.strerror or exc}") from None
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable {kind} request file: {exc}") from None
    if len(df) > _limits.MAX_REQUESTS:
        raise ValueError(f"{path}: more than {_limits.MAX_REQUESTS:,} requests: "
                         + _limits.beyond("MAX_REQUESTS", len(df)))
    return df


def rows_named(mask: np.ndarray, limit: int = 5) -> str:
    """The rows a boolean mask selects, as a refusal names them: ``"rows 3, 7, 9"``, the first
    ``limit`` and how many more (data rows, counted from 0)."""
    idx = np.flatnonzero(mask)
    shown = ", ".join(str(int(i)) for i in idx[:limit])
    return f"row{'s' if idx.size > 1 else ''} {shown}" + (f" (and {idx.size - limit} more)"
                                                         if idx.size > limit else "")


def _tokens(df: pd.DataFrame, col: str, where: str) -> np.ndarray:
    """A token column as int64, refusing missing, fractional, negative or zero counts."""
    raw = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(raw)
    if bad.any():
        raise ValueError(f"{where}: column {col!r} has missing or non-numeric values at "
                         f"{rows_named(bad)} (data rows, counted from 0)")
    frac = raw != np.round(raw)
    if frac.any():
        raise ValueError(f"{where}: column {col!r} must hold whole token counts; "
                         f"{rows_named(frac)} do not (e.g. {raw[frac][0]!r})")
    low = raw < 1
    if low.any():
        raise ValueError(f"{where}: column {col!r} must be ≥ 1 token; {rows_named(low)} are not "
                         f"(e.g. {int(raw[low][0])})")
    high = raw > _limits.INT32_MAX
    if high.any():
        raise ValueError(f"{where}: column {col!r} at {rows_named(high)}: "
                         + _limits.beyond("INT32_MAX", int(raw[high][0])))
    return raw.astype(np.int64)


def _arrivals(df: pd.DataFrame, source: str) -> np.ndarray:
    """``arrival_s`` (from ``arrival_time_us`` when only that is given), refusing both
    given and disagreeing by more than a microsecond: one would silently win."""
    us = None
    if "arrival_time_us" in df.columns:
        us = pd.to_numeric(df["arrival_time_us"], errors="coerce").to_numpy(dtype=float)
    if "arrival_s" not in df.columns:
        return us / 1e6
    arrival = pd.to_numeric(df["arrival_s"], errors="coerce").to_numpy(dtype=float)
    if us is not None:
        with np.errstate(invalid="ignore"):
            differ = ~(np.abs(arrival - us / 1e6) <= 1e-6)
        differ &= np.isfinite(arrival) | np.isfinite(us)
        if differ.any():
            i = int(np.flatnonzero(differ)[0])
            raise ValueError(f"{source}: columns 'arrival_s' and 'arrival_time_us' disagree "
                             f"at {rows_named(differ)} (e.g. {arrival[i]:g} s against "
                             f"{us[i]:g} µs); give one of them, or the same time in both")
    return arrival


def _prefix_columns(df: pd.DataFrame, source: str) -> None:
    """``prefix_group`` / ``prefix_length``: both or neither; a length a whole number in
    ``[0, input_tokens]`` wherever a group is named."""
    has_group, has_len = "prefix_group" in df.columns, "prefix_length" in df.columns
    if has_group != has_len:
        given, needed = (("prefix_group", "prefix_length") if has_group
                         else ("prefix_length", "prefix_group"))
        raise ValueError(f"{source}: column {given!r} needs column {needed!r} (requests of "
                         "one prefix_group share their first prefix_length prompt tokens)")
    if not has_group:
        return
    group = df["prefix_group"]
    named = ~(group.isna() | (group.astype(str) == "")).to_numpy()
    length = pd.to_numeric(df["prefix_length"], errors="coerce").to_numpy(dtype=float)
    where = f"{source}: column 'prefix_length'"
    bad = named & ~np.isfinite(length)
    if bad.any():
        raise ValueError(f"{where} is missing or not a number at {rows_named(bad)}, where a "
                         "prefix_group is named")
    with np.errstate(invalid="ignore"):
        frac = np.isfinite(length) & (length != np.round(length))
        neg = length < 0
        over = named & (length > df["input_tokens"].to_numpy())
    if frac.any():
        raise ValueError(f"{where} must hold whole token counts; {rows_named(frac)} do not")
    if neg.any():
        raise ValueError(f"{where} must be ≥ 0; it is negative at {rows_named(neg)} "
                         f"(e.g. {length[neg][0]:g})")
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"{where} exceeds the prompt (input_tokens) at {rows_named(over)} "
                         f"(e.g. {length[i]:g} > {int(df['input_tokens'].iloc[i])}): a "
                         "shared prefix is part of the prompt")


def _shared_prefix_tokens(df: pd.DataFrame) -> int:
    """Tokens of the shared prefixes the replay hashes block by block (validated columns)."""
    if "prefix_group" not in df.columns:
        return 0
    group = df["prefix_group"]
    named = ~(group.isna() | (group.astype(str) == "")).to_numpy()
    length = pd.to_numeric(df["prefix_length"], errors="coerce").to_numpy(dtype=float)
    return int(np.nansum(np.where(named, length, 0.0)))


def _hash_count(v) -> int | None:
    """How many whole-number hashes ``v`` holds (a space-separated string or a sequence),
    or None when it holds anything else."""
    if isinstance(v, str):
        items = v.split()
    elif isinstance(v, (list, tuple, np.ndarray, pd.Series)):
        items = list(v)
    else:
        return None
    for x in items:
        if isinstance(x, str):
            try:
                int(x)
            except ValueError:
                return None
        elif isinstance(x, (bool, np.bool_)) or not isinstance(x, Real) \
                or not math.isfinite(x) or x != math.floor(x):
            return None
    return len(items)


def _block_hashes(df: pd.DataFrame, source: str) -> None:
    """``block_hashes``: per request, whole numbers (a space-separated string or a
    sequence), at most one per prompt token; empty or missing means none."""
    if "block_hashes" not in df.columns:
        return
    where = f"{source}: column 'block_hashes'"
    prompts = df["input_tokens"].to_numpy()
    for i, v in enumerate(df["block_hashes"]):
        if v is None or (isinstance(v, float) and np.isnan(v)):
            continue
        count = _hash_count(v)
        if count is None:
            raise ValueError(f"{where} at row {i}: {v!r} is not a list of whole numbers (one "
                             "hash per full prompt block, space-separated)")
        if count > prompts[i]:
            raise ValueError(f"{where} at row {i}: {count} hashes for a {prompts[i]}-token "
                             "prompt; there is one per full prompt block")


def validate_requests(df: pd.DataFrame, *, source: str = "requests") -> pd.DataFrame:
    """Check and normalise a request table; returns a new DataFrame sorted by arrival.

    ``source`` names the table in errors (the file path when loaded from a file).
    """
    if not isinstance(df, pd.DataFrame):
        raise ArgumentError("requests", f"must be a pandas DataFrame (jkernel.replay."
                            f"load_requests reads a file into one), not {type(df).__name__}")
    if len(df) > _limits.MAX_REQUESTS:
        raise ValueError(f"{source}: {len(df):,} requests: "
                         + _limits.beyond("MAX_REQUESTS", len(df)))
    df = df.copy()
    if "arrival_s" in df.columns or "arrival_time_us" in df.columns:
        df["arrival_s"] = _arrivals(df, source)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        hint = " (or arrival_time_us)" if "arrival_s" in missing else ""
        raise ValueError(f"{source}: missing column{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(c) for c in missing)}{hint}; the replay needs "
                         f"{', '.join(REQUIRED)}")
    if df["request_id"].isna().any():
        raise ValueError(f"{source}: column 'request_id' is empty at "
                         f"{rows_named(df['request_id'].isna().to_numpy())}")
    dup = df["request_id"].duplicated(keep=False).to_numpy()
    if dup.any():
        raise ValueError(f"{source}: column 'request_id' repeats at {rows_named(dup)}")
    arrival = pd.to_numeric(df["arrival_s"], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(arrival)
    if bad.any():
        raise ValueError(f"{source}: column 'arrival_s' has missing or non-numeric values at "
                         f"{rows_named(bad)}")
    if (arrival < 0).any():
        raise ValueError(f"{source}: column 'arrival_s' must be ≥ 0; {rows_named(arrival < 0)} "
                         "are negative")
    late = arrival > _limits.MAX_ARRIVAL_S
    if late.any():
        raise ValueError(f"{source}: column 'arrival_s' at {rows_named(late)}: "
                         + _limits.beyond("MAX_ARRIVAL_S", float(arrival[late][0])))
    df["arrival_s"] = arrival
    df["input_tokens"] = _tokens(df, "input_tokens", source)
    df["output_tokens"] = _tokens(df, "output_tokens", source)
    _prefix_columns(df, source)
    _block_hashes(df, source)
    if "warm_up" in df.columns:
        df["warm_up"] = _flags(df, "warm_up", source)
    total = int(df["output_tokens"].sum()) + _shared_prefix_tokens(df)
    if total > _limits.MAX_REPLAY_TOKENS:
        raise ValueError(f"{source}: {total:,} output and shared-prefix tokens in all: "
                         + _limits.beyond("MAX_REPLAY_TOKENS", total))
    was_sorted = bool(np.all(np.diff(arrival) >= 0))
    if not was_sorted:
        df = df.sort_values("arrival_s", kind="stable")
    df = df.reset_index(drop=True)
    df.attrs["source"] = source
    df.attrs["sorted"] = not was_sorted
    return df


def _flags(df: pd.DataFrame, column: str, source: str) -> np.ndarray:
    """A yes/no column: booleans, 0/1 or the words true/false (any case)."""
    words = {"true": True, "false": False, "1": True, "0": False}
    out, bad = np.zeros(len(df), bool), np.zeros(len(df), bool)
    for i, v in enumerate(df[column].to_numpy()):
        if isinstance(v, (bool, np.bool_)):
            out[i] = bool(v)
        elif isinstance(v, (int, np.integer, float, np.floating)) and v in (0, 1):
            out[i] = bool(v)
        elif isinstance(v, str) and v.strip().lower() in words:
            out[i] = words[v.strip().lower()]
        else:
            bad[i] = True
    if bad.any():
        raise ValueError(f"{source}: column {column!r} at {rows_named(bad)}: allowed True or "
                         "False (or 1, 0)")
    return out


def _from_client_trace(df: pd.DataFrame, where: str) -> pd.DataFrame:
    """The residency-vllm client trace (``trace.csv``) as a request table."""
    need = ["request_id", "send_time_us", "output_tokens"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{where}: a client trace needs column(s) {', '.join(missing)}")
    out = pd.DataFrame({"request_id": df["request_id"]})
    send = pd.to_numeric(df["send_time_us"], errors="coerce")
    out["arrival_s"] = (send - send.min()) / 1e6
    if "server_input_tokens" not in df.columns and "input_tokens" not in df.columns:
        raise ValueError(f"{where}: a client trace needs 'server_input_tokens' or "
                         "'input_tokens'")
    if "server_input_tokens" in df.columns:
        server = pd.to_numeric(df["server_input_tokens"], errors="coerce")
        # A request the server never tokenised (a failed one) has no server count: it keeps
        # the client's, and says so, rather than being dropped.
        known = server.notna() & (server > 0)
        fallback = df["input_tokens"] if "input_tokens" in df.columns else server
        out["input_tokens"] = server.where(known, fallback)
        out["input_tokens_source"] = np.where(known, "server", "client")
    else:
        out["input_tokens"] = df["input_tokens"]
        out["input_tokens_source"] = "client"
    out["output_tokens"] = df["output_tokens"]
    for col in ("prefix_group", "prefix_length"):
        if col in df.columns:
            out[col] = df[col]
    if "status" in df.columns:
        out["client_status"] = df["status"].astype(str)
    # The measured client timings, kept so that a validation can compare like with like.
    for col in ("send_time_us", "first_chunk_time_us", "last_chunk_time_us", "num_chunks"):
        if col in df.columns:
            out[f"measured_{col}"] = df[col]
    return out


def load_requests(path: str | os.PathLike | pd.DataFrame) -> pd.DataFrame:
    """Read a request file (CSV or Parquet, any accepted shape) into a validated table.

    Returns a DataFrame with at least :data:`REQUIRED`, sorted by ``arrival_s``;
    ``attrs["source"]`` is the file and ``attrs["sorted"]`` says whether it had to be sorted.
    """
    if isinstance(path, pd.DataFrame):
        return validate_requests(path)
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ArgumentError("path", f"must be a request file path or a DataFrame, got "
                            f"{path!r}")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such request file")
    if p.is_dir():
        raise ValueError(f"{p}: is a directory; name a request file (CSV or Parquet)")
    df = _read(p)
    if "send_time_us" in df.columns and "arrival_s" not in df.columns:
        df = _from_client_trace(df, str(p))
    return validate_requests(df, source=str(p))
