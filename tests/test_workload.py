"""Request tables (jkernel.replay.workload): every reader goes through validate_requests,
which refuses what the replay would otherwise read wrongly or without bound, naming the
file, the column and the rows.

Guards behaviours once seen: a ``prefix_length`` of −5 became 0 and one past the prompt was
clipped, so every prompt of the group counted as identical; with ``arrival_s`` and
``arrival_time_us`` both present and disagreeing, one won silently; arrival times past
int64 microseconds, a request path that is a directory and an unreadable file raised raw
tracebacks; ``replay(k, None)`` raised an AttributeError; a replay of zero requests printed
bare ``NaN`` in its JSON."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import catalog_kernel
from jkernel import ArgumentError, cli, limits
from jkernel.replay import load_requests, replay, replay_disaggregated, validate_requests

SCENARIO = "llama-3.1-8b-h100-tp1"
ROOT = Path(__file__).resolve().parent.parent
DISAGG = ROOT / "catalog" / "scenarios" / "llama-3.1-70b-h200-disagg.yaml"


def table(n: int = 3, **cols) -> pd.DataFrame:
    df = pd.DataFrame({"request_id": range(n), "arrival_s": [0.5 * i for i in range(n)],
                       "input_tokens": [100] * n, "output_tokens": [4] * n})
    for k, v in cols.items():
        df[k] = v
    return df


def message(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


# -- columns read two ways --------------------------------------------------------------------

def test_arrival_s_and_arrival_time_us_that_disagree_are_refused():
    df = table(arrival_time_us=[0, 500_000, 9_000_000])
    text = message(lambda: validate_requests(df, source="t.csv"))
    assert text.startswith("t.csv:") and "disagree" in text and "row 2" in text


def test_arrival_s_and_arrival_time_us_that_agree_are_accepted():
    df = table(arrival_time_us=[0, 500_000, 1_000_000])
    assert list(validate_requests(df).arrival_s) == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("length, why", [(-5, "≥ 0"), (101, "exceeds the prompt"),
                                         (2.5, "whole"), (None, "missing")])
def test_bad_prefix_length_is_refused_naming_the_row(length, why):
    """−5 became 0 and a length past the prompt was clipped: every prompt of the group
    then counted as identical."""
    df = table(prefix_group=["g", "g", "g"], prefix_length=[50, 50, length])
    text = message(lambda: validate_requests(df, source="p.csv"))
    assert "'prefix_length'" in text and why in text and "row 2" in text


def test_prefix_length_is_free_where_no_group_is_named():
    df = table(prefix_group=["g", "g", None], prefix_length=[50, 50, None])
    assert len(validate_requests(df)) == 3


@pytest.mark.parametrize("col", ["prefix_group", "prefix_length"])
def test_a_prefix_column_alone_is_refused(col):
    df = table(**{col: ["g", "g", "g"] if col == "prefix_group" else [10, 10, 10]})
    assert "needs column" in message(lambda: validate_requests(df))


@pytest.mark.parametrize("hashes", [["1 2", "3 x", ""], ["1", [1.5], ""]])
def test_block_hashes_that_are_not_whole_numbers_are_refused(hashes):
    text = message(lambda: validate_requests(table(block_hashes=hashes)))
    assert "'block_hashes' at row 1" in text


# -- limits -----------------------------------------------------------------------------------

def test_arrival_past_the_clock_is_refused():
    """Arrival times past int64 microseconds raised a raw OverflowError in the replay."""
    df = table(arrival_s=[0.0, 1e13, 2e13])
    text = message(lambda: validate_requests(df, source="far.csv"))
    assert "MAX_ARRIVAL_S" in text and "rows 1, 2" in text


def test_too_many_output_tokens_are_refused():
    df = table(2, output_tokens=[limits.INT32_MAX, limits.INT32_MAX])
    assert "MAX_REPLAY_TOKENS" in message(lambda: validate_requests(df))


def test_a_huge_shared_prefix_is_refused_before_it_is_hashed():
    """One row of a 2³¹-token prompt sharing all of it would have the replay build a
    134-million-entry tuple of block hashes."""
    big = limits.INT32_MAX
    df = table(1, input_tokens=[big], prefix_group=["g"], prefix_length=[big])
    assert "shared-prefix tokens" in message(lambda: validate_requests(df))


def test_token_counts_past_int32_are_refused():
    df = table(input_tokens=[100, 2 ** 40, 100])
    assert "INT32_MAX" in message(lambda: validate_requests(df))


def test_a_parquet_file_of_too_many_rows_is_refused_from_its_footer(tmp_path, monkeypatch):
    """A few kilobytes of Parquet can hold a billion equal rows: the count is read from
    the footer before the rows."""
    pytest.importorskip("pyarrow")
    p = tmp_path / "many.parquet"
    table(50).to_parquet(p)
    monkeypatch.setattr(limits, "MAX_REQUESTS", 10)
    import pyarrow.parquet as pq

    monkeypatch.setattr(pd, "read_parquet", lambda *a, **k: pytest.fail("rows were read"))
    assert pq.ParquetFile(p).metadata.num_rows == 50
    assert "MAX_REQUESTS" in message(lambda: load_requests(p))


def test_a_csv_file_of_too_many_rows_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "many.csv"
    table(50).to_csv(p, index=False)
    monkeypatch.setattr(limits, "MAX_REQUESTS", 10)
    assert "MAX_REQUESTS" in message(lambda: load_requests(p))


# -- files that cannot be read ----------------------------------------------------------------

def test_a_directory_request_path_is_refused(tmp_path):
    assert "is a directory" in message(lambda: load_requests(tmp_path))


@pytest.mark.parametrize("name, data, why", [
    ("bin.csv", b"\x89PNG\x00\xff\xfe", "not a CSV text file"),
    ("bin.parquet", b"\x89PNG\x00\xff\xfe", "not a readable Parquet"),
    ("empty.csv", b"", "is empty"),
])
def test_an_unreadable_request_file_is_refused_naming_it(tmp_path, name, data, why):
    p = tmp_path / name
    p.write_bytes(data)
    text = message(lambda: load_requests(p))
    assert text.startswith(str(p)) and why in text


def test_a_request_file_that_cannot_be_opened_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "r.csv"
    table().to_csv(p, index=False)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(pd, "read_csv", denied)
    text = message(lambda: load_requests(p))
    assert text.startswith(str(p)) and "Permission denied" in text


# -- the replay's own arguments ---------------------------------------------------------------

@pytest.mark.parametrize("value", [None, "reqs.csv", [1, 2]])
def test_replay_of_a_non_table_names_the_argument(value):
    """``replay(k, None)`` raised an AttributeError."""
    with pytest.raises(ArgumentError) as info:
        replay(catalog_kernel(SCENARIO), value)
    assert info.value.argument == "requests"


def test_replay_of_no_kernel_names_the_argument():
    with pytest.raises(ArgumentError) as info:
        replay(None, table())
    assert info.value.argument == "kernel"


def test_disaggregated_replay_refuses_swapped_pools():
    pre, dec = catalog_kernel(str(DISAGG), "prefill"), catalog_kernel(str(DISAGG), "decode")
    with pytest.raises(ArgumentError, match="pass the prefill pool first") as info:
        replay_disaggregated(dec, pre, table())
    assert info.value.argument == "prefill_kernel"


def test_disaggregated_replay_refuses_pools_of_two_models():
    """A 70B prefill pool beside an 8B decode pool was replayed as one deployment."""
    import jkernel
    import yaml

    sc, dep = yaml.safe_load_all(DISAGG.read_text())
    sc["model"] = "llama-3.1-8b-instruct"
    small_decode = jkernel.open_pool([sc, dep], "decode")
    pre = catalog_kernel(str(DISAGG), "prefill")
    with pytest.raises(ArgumentError, match="both serve one model") as info:
        replay_disaggregated(pre, small_decode, table())
    assert info.value.argument == "decode_kernel"
    with pytest.raises(ArgumentError, match="is a colocated pool") as info:
        replay_disaggregated(pre, catalog_kernel(SCENARIO), table())
    assert info.value.argument == "decode_kernel"


def test_zero_requests_give_strict_json_with_nulls(tmp_path):
    """A replay of zero requests printed bare NaN, which JSON readers refuse."""
    p = tmp_path / "none.csv"
    table(0).to_csv(p, index=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["replay", SCENARIO, "--requests", str(p), "--json"]) == 0
    assert "NaN" not in out.getvalue()
    doc = json.loads(out.getvalue())
    assert doc["ttft_mean_s"] is None and doc["completed"] == 0
    res = replay(catalog_kernel(SCENARIO), table(0))
    assert np.isnan(res.summary["ttft_mean_s"])       # the API keeps NaN, as documented


@pytest.mark.parametrize("case", ["bundle-binary", "bundle-directory", "requests-directory",
                                  "requests-binary", "requests-late"])
def test_the_command_reports_unreadable_inputs_without_a_traceback(tmp_path, case):
    """An unreadable bundle or request file, a request path that is a directory and arrival
    times past int64 microseconds each raised a raw traceback from ``jkernel``."""
    reqs = tmp_path / "r.csv"
    table().to_csv(reqs, index=False)
    scenario = SCENARIO
    if case == "bundle-binary":
        scenario = str(tmp_path / "b.yaml")
        Path(scenario).write_bytes(b"\x89PNG\x00\xff")
    elif case == "bundle-directory":
        scenario = str(tmp_path)
    elif case == "requests-directory":
        reqs = tmp_path
    elif case == "requests-binary":
        reqs.write_bytes(b"\xff\xfe\x00garbage")
    else:
        table(arrival_s=[0.0, 1e13, 2e13]).to_csv(reqs, index=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["replay", scenario, "--requests", str(reqs)])
    assert rc == 2 and err.getvalue().startswith("jkernel: ")
    assert "Traceback" not in err.getvalue() and len(err.getvalue().splitlines()) == 1
