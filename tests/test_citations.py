"""Citations a reader of the repository can open: every decision id (D1 … D38) that the code,
tests, catalog, docs or notebooks cite has its line in docs/decisions.md, and that line points
at a section of the specification in docs/spec/ that exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DIRS = ("jkernel", "calibration", "tests", "docs", "examples", "benchmarks", "notebooks",
        "catalog")
DECISION = re.compile(r"\bD\d{1,2}\b")


def _texts():
    """(path, text) of every source and document file, notebooks by their cells' sources
    (their outputs hold base64 images)."""
    for top in DIRS:
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix == ".ipynb":
                cells = json.loads(p.read_text(encoding="utf-8"))["cells"]
                yield p, "\n".join("".join(c["source"]) for c in cells)
            elif p.suffix in (".py", ".md", ".yaml") and p != DOCS / "decisions.md":
                yield p, p.read_text(encoding="utf-8")


def _decision_lines() -> dict[str, str]:
    text = (DOCS / "decisions.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| (D\d+) \|.*$", text, re.M)}


def _spec_sections(name: str) -> set[str]:
    """Section numbers of docs/spec/<name>: headings, and the numbered items under them."""
    secs, cur = set(), None
    for line in (DOCS / "spec" / name).read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            cur = m.group(1)
            secs.add(cur)
            continue
        if line.startswith("#"):
            cur = None
        m = re.match(r"(\d+)\.\s", line)
        if m and cur:
            secs.add(f"{cur}.{m.group(1)}")
    return secs


def test_every_cited_decision_id_has_a_line_in_decisions_md():
    listed = _decision_lines()
    cited: dict[str, str] = {}
    for p, text in _texts():
        for d in DECISION.findall(text):
            cited.setdefault(d, str(p.relative_to(ROOT)))
    missing = {d: where for d, where in cited.items() if d not in listed}
    assert not missing, f"decision ids cited but not in docs/decisions.md: {missing}"
    assert len(cited) >= 30, sorted(cited)           # the scan reads the code at all


def test_decisions_md_lists_the_spec_index_and_points_at_existing_sections():
    """docs/decisions.md holds every id of the spec's decision index, in order, and each
    line's 'in full' cell names spec files and sections that exist."""
    index = re.findall(r"^\| (D\d+)(?:–(D\d+))? \|", (DOCS / "spec" / "README.md").read_text(),
                       re.M)
    want = set()
    for lo, hi in index:
        want |= {f"D{i}" for i in range(int(lo[1:]), int((hi or lo)[1:]) + 1)}
    lines = _decision_lines()
    assert list(lines) == [f"D{i}" for i in range(1, len(lines) + 1)]
    assert set(lines) == want
    for d, line in lines.items():
        where = line.rsplit("|", 2)[-2]
        refs = re.findall(r"\[(\w+\.md)\]\(spec/\1\) ((?:§[\d.]+)(?:, §[\d.]+)*)", where)
        assert refs, (d, where)
        for name, secs in refs:
            for sec in re.findall(r"§([\d.]+)", secs):
                assert sec in _spec_sections(name), (d, name, sec)


CITE = re.compile(r"\b(README|documents|expected|memory|methods|resolution|step|vectors)\.md`?"
                  r"\s+((?:§\d+(?:\.\d+)*(?:\s*(?:,|–|-|/|and)\s*)?)+)")


def test_every_spec_citation_names_a_section_that_exists():
    """`step.md §6.3` in a comment means section 6.3 of docs/spec/step.md (and `vectors.md
    §4.4.5` item 5 of §4.4): each one a reader follows must be there (memory.py once cited a
    section of documents.md that does not exist, 7.3)."""
    bad = []
    for p, text in _texts():
        if "spec" in p.relative_to(ROOT).parts:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in CITE.finditer(line):
                have = _spec_sections(f"{m.group(1)}.md")
                bad += [f"{p.relative_to(ROOT)}:{n}: {m.group(1)}.md §{s}"
                        for s in re.findall(r"§(\d+(?:\.\d+)*)", m.group(2)) if s not in have]
    assert not bad, bad


#: "issue 14", "issues 21 and 23", "issue-11", "(#12)": the project's own tracker, which a
#: reader of the repository cannot open. Public threads of other projects are cited as
#: ``owner/repo#N`` or by their project ("vLLM issue 19012"), which this does not match.
OWN_ISSUE = re.compile(r"(?<![\w/])(?<!vLLM )(?<!vllm )(?:[Ii]ssues? ?#?\d+|issue-\d+|\(#\d+\))")


def test_no_text_cites_an_issue_of_the_projects_own_tracker():
    """Comments, docs and notebooks cite what a reader can open (docs/), never an issue
    number of the project's tracker."""
    bad = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
           for p, text in _texts() if "spec" not in p.relative_to(ROOT).parts
           and p != Path(__file__).resolve() for m in OWN_ISSUE.finditer(text)]
    bad += [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in (ROOT / "README.md",)
            for m in OWN_ISSUE.finditer(p.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad[:20])
