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
(space-separated integers, one per full prompt block).

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
``DataFrame.attrs["sorted"]``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["load_requests", "validate_requests", "REQUIRED"]

#: The columns the replay reads (``arrival_s`` may come as ``arrival_time_us``).
REQUIRED = ("request_id", "arrival_s", "input_tokens", "output_tokens")


def _read(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return pd.read_parquet(path)
    if suffix in (".csv", ".txt", ""):
        return pd.read_csv(path)
    raise ValueError(f"{path}: unknown request file type {suffix!r}; allowed: .csv, .parquet")


def _rows(mask: np.ndarray, limit: int = 5) -> str:
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
                         f"{_rows(bad)} (data rows, counted from 0)")
    frac = raw != np.round(raw)
    if frac.any():
        raise ValueError(f"{where}: column {col!r} must hold whole token counts; "
                         f"{_rows(frac)} do not (e.g. {raw[frac][0]!r})")
    low = raw < 1
    if low.any():
        raise ValueError(f"{where}: column {col!r} must be ≥ 1 token; {_rows(low)} are not "
                         f"(e.g. {int(raw[low][0])})")
    return raw.astype(np.int64)


def validate_requests(df: pd.DataFrame, *, source: str = "requests") -> pd.DataFrame:
    """Check and normalise a request table; returns a new DataFrame sorted by arrival.

    ``source`` names the table in errors (the file path when loaded from a file).
    """
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"requests must be a pandas DataFrame, not {type(df).__name__}")
    df = df.copy()
    if "arrival_s" not in df.columns and "arrival_time_us" in df.columns:
        df["arrival_s"] = pd.to_numeric(df["arrival_time_us"], errors="coerce") / 1e6
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        hint = " (or arrival_time_us)" if "arrival_s" in missing else ""
        raise ValueError(f"{source}: missing column{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(c) for c in missing)}{hint}; the replay needs "
                         f"{', '.join(REQUIRED)}")
    if df["request_id"].isna().any():
        raise ValueError(f"{source}: column 'request_id' is empty at "
                         f"{_rows(df['request_id'].isna().to_numpy())}")
    dup = df["request_id"].duplicated(keep=False).to_numpy()
    if dup.any():
        raise ValueError(f"{source}: column 'request_id' repeats at {_rows(dup)}")
    arrival = pd.to_numeric(df["arrival_s"], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(arrival)
    if bad.any():
        raise ValueError(f"{source}: column 'arrival_s' has missing or non-numeric values at "
                         f"{_rows(bad)}")
    if (arrival < 0).any():
        raise ValueError(f"{source}: column 'arrival_s' must be ≥ 0; {_rows(arrival < 0)} "
                         "are negative")
    df["arrival_s"] = arrival
    df["input_tokens"] = _tokens(df, "input_tokens", source)
    df["output_tokens"] = _tokens(df, "output_tokens", source)
    was_sorted = bool(np.all(np.diff(arrival) >= 0))
    if not was_sorted:
        df = df.sort_values("arrival_s", kind="stable")
    df = df.reset_index(drop=True)
    df.attrs["source"] = source
    df.attrs["sorted"] = not was_sorted
    return df


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
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such request file")
    df = _read(p)
    if "send_time_us" in df.columns and "arrival_s" not in df.columns:
        df = _from_client_trace(df, str(p))
    return validate_requests(df, source=str(p))
