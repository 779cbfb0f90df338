"""``jkernel price``'s text stands on its own: it cited the spec's file names
("jkernel's estimate (expected.md)"), which a user of the installed package cannot look up.
"""

from __future__ import annotations

import re

from jkernel import cli

#: a spec file name, a section sign or a decision id such as D17
SPEC_CITATION = re.compile(r"\.md\b|§|\bD[0-9]{1,2}\b")


def test_price_text_cites_no_spec_file_or_decision(capsys):
    argv = ["price", "llama-3.1-8b-h100-tp1", "--batch", "4x1@1000,1x512@0", "--breakdown"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "expected" in out and "overlap" in out and "no_overlap" in out
    hits = [line for line in out.splitlines() if SPEC_CITATION.search(line)]
    assert not hits, hits
