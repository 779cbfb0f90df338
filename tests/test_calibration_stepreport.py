"""validation/stepreport.py: the step-trace fit's figures as docs/calibrate.md shows them.

The run on the committed excerpt is tests/test_docs.py's
test_step_fit_figures_format_on_the_committed_excerpt; here the rendering and the refusal."""

from __future__ import annotations

from types import SimpleNamespace

from validation import stepreport


def _summary(part, when, decode, prefill, bias, pred, meas):
    return {"part": part, "when": when, "decode": decode, "prefill": prefill,
            "prefill_bias": bias, "slope_predicted_s": pred, "slope_measured_s": meas}


def test_markdown_renders_residuals_r2_and_the_held_out_rows():
    cal = SimpleNamespace(
        residuals={"decode": {"per_step_s": 737e-6, "per_request_s": 26.7e-6},
                   "prefill": {"per_step_s": 985e-6, "per_request_s": 195.7e-6,
                               "per_prefill_token_s": 1.956e-6}},
        r2={"host_serial": 0.77, "kernel_gap": 1.0, "hbm_derate": 0.99999},
        fit=SimpleNamespace(names=("host_serial",)),
        summaries=[_summary("last 30% of the fitted run", "before", 0.0716, 0.0906, -0.0906,
                            74.75e-6, 102.32e-6),
                   _summary("last 30% of the fitted run", "after", 0.0143, 0.0174, 0.009,
                            100.56e-6, 102.32e-6),
                   _summary("other", "before", 0.070, 0.1231, -0.1227, 74.68e-6, 101.45e-6),
                   _summary("other", "after", 0.0147, 0.0259, -0.023, 100.49e-6, 101.45e-6)])
    md = stepreport.markdown(cal).splitlines()
    assert md[0].startswith("*Residuals*") and "+737 µs per decode step" in md[0]
    assert "+1.96 µs per prefill token" in md[0] and "9–12 % short" in md[0]
    assert md[2] == ("*R²* (stage 3) of each candidate's column by the fitted constants' "
                     "columns: `kernel_gap` 1.0000, `hbm_derate` 1.0000.")
    assert md[-4:] == ["| last 30 %, profiles only | 0.072 | 0.091 | 74.8 µs (102.3) |",
                       "| last 30 %, fitted | **0.014** | **0.017** | **100.6 µs** (102.3) |",
                       "| second run, profiles only | 0.070 | 0.123 | 74.7 µs (101.5) |",
                       "| second run, fitted | **0.015** | **0.026** | **100.5 µs** (101.5) |"]


def test_main_refuses_a_missing_folder(tmp_path, capsys):
    assert stepreport.main([str(tmp_path / "nope"), "--markdown"]) == 2
    assert "no such folder" in capsys.readouterr().err
