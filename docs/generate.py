"""Fill the example outputs of the docs from the program, so that they cannot go stale.

An example output in a page is a fenced block preceded by a marker naming its command::

    <!-- output: jkernel memory llama-3.1-70b-h200-disagg --pool decode -->
    ```
    $ jkernel memory llama-3.1-70b-h200-disagg --pool decode
    ...what the command prints...
    ```

A Markdown table (or any text that is not a code block) the program prints is a region
between a marker naming its command and an end marker::

    <!-- table: python -m validation.replay ../shared/data/residency-vllm --markdown -->
    | run | TTFT | ...
    <!-- end table -->

``python docs/generate.py`` runs every marked command (in process, from the repository root,
against the catalog jkernel imports; an ``--out FILE`` goes to a scratch folder) and rewrites
the block or region under it; ``--check`` rewrites nothing and exits 1 when a page is stale.
A command that reads the shared data (an argument under ``../shared``) is run only where that
data is present; elsewhere its region is kept as it is and the script says so.
``tests/test_docs.py`` compares the same blocks and regions with the program.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
#: The pages this script fills.
PAGES = ("cli.md", "api.md", "concepts.md", "add-model.md", "README.md", "simulator.md",
         "calibrate.md", "bulk.md", "workloads.md", "metrics.md", "intervals.md")
#: The modules a marked ``python -m MODULE ...`` command may name (each has ``main(argv)``):
#: the dataset studies of validation/, run as ``python -m`` runs them from the repository root.
MODULES = ("validation.replay", "validation.stepreport", "validation.error_model",
           "validation.coverage")

MARKER = re.compile(r"<!-- output: (?P<cmd>[^\n]+?) -->\n```\n(?P<body>.*?)```\n", re.S)
TABLE = re.compile(r"<!-- table: (?P<cmd>[^\n]+?) -->\n(?P<body>.*?)<!-- end table -->\n",
                   re.S)


def shared_inputs(command: str) -> list[str]:
    """The arguments of ``command`` that name the shared data (``../shared/...``)."""
    return [a for a in shlex.split(command.partition(" | ")[0])
            if a.startswith("../shared/")]


def missing_inputs(command: str) -> list[str]:
    """The shared-data arguments of ``command`` absent from this checkout."""
    return [a for a in shared_inputs(command) if not (ROOT / a).exists()]


def run_command(command: str) -> str:
    """What ``jkernel ARGS`` or ``python -m MODULE ARGS`` (one of :data:`MODULES`) prints on
    stdout, run in this process from the repository root. An ``--out FILE`` is written to a
    scratch folder instead; the output names it as the command did."""
    argv = shlex.split(command)
    if argv[:1] == ["jkernel"]:
        from jkernel import cli

        entry, args = cli.main, argv[1:]
    elif argv[:2] == ["python", "-m"] and argv[2:3] and argv[2] in MODULES:
        if str(ROOT) not in sys.path:         # as `python -m` from the repository root
            sys.path.insert(0, str(ROOT))
        entry, args = importlib.import_module(argv[2]).main, argv[3:]
    else:
        raise ValueError(f"a marked command starts with `jkernel` or `python -m` one of "
                         f"{', '.join(MODULES)}: {command!r}")
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(ROOT):
        named = None
        if "--out" in args:
            i = args.index("--out") + 1
            named, args[i] = args[i], str(Path(scratch) / Path(args[i]).name)
        with contextlib.redirect_stdout(out):
            rc = entry(args)
        text = out.getvalue()
        if named is not None:
            text = text.replace(args[i], named)
    if rc:
        raise RuntimeError(f"`{command}` exited with {rc}")
    return text


def block(command: str) -> str:
    """``$ command`` and its output; a trailing ``| head -N`` keeps the first N lines."""
    cmd, _, pipe = command.partition(" | ")
    out = run_command(cmd)
    if pipe:
        m = re.fullmatch(r"head -(\d+)", pipe.strip())
        if not m:
            raise ValueError(f"a marked command pipes only into `head -N`: {command!r}")
        out = "".join(out.splitlines(keepends=True)[:int(m[1])])
    return f"$ {command}\n{out}"


def region(command: str) -> str:
    """What ``command`` prints, as the body of a table region (ending in one newline)."""
    return run_command(command).rstrip("\n") + "\n"


def markers(text: str) -> list[tuple[str, str]]:
    """(command, current block body) for each marked block of a page."""
    return [(m["cmd"], m["body"]) for m in MARKER.finditer(text)]


def tables(text: str) -> list[tuple[str, str]]:
    """(command, current region body) for each marked table region of a page."""
    return [(m["cmd"], m["body"]) for m in TABLE.finditer(text)]


def fill(text: str, kept: list[str] | None = None) -> str:
    """``text`` with every marked block and region regenerated; a region whose command
    needs absent shared data is kept, and its command appended to ``kept``."""
    def table(m):
        if missing_inputs(m["cmd"]):
            if kept is not None:
                kept.append(m["cmd"])
            return m[0]
        return f"<!-- table: {m['cmd']} -->\n{region(m['cmd'])}<!-- end table -->\n"

    text = MARKER.sub(lambda m: f"<!-- output: {m['cmd']} -->\n```\n{block(m['cmd'])}```\n",
                      text)
    return TABLE.sub(table, text)


def main(argv: list[str] | None = None) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale, kept = [], []
    for name in PAGES:
        path = DOCS / name
        text = path.read_text()
        new = fill(text, kept)
        if new != text:
            stale.append(name)
            if not check:
                path.write_text(new)
    verb = "stale" if check else "regenerated"
    print(f"{verb}: {', '.join(stale)}" if stale else "docs up to date")
    for cmd in kept:
        print(f"kept as it was (needs {', '.join(missing_inputs(cmd))}, absent here): {cmd}")
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
