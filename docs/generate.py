"""Fill the example outputs of the docs from the program, so that they cannot go stale.

An example output in a page is a fenced block preceded by a marker naming its command::

    <!-- output: jkernel memory llama-3.1-70b-h200-disagg --pool decode -->
    ```
    $ jkernel memory llama-3.1-70b-h200-disagg --pool decode
    ...what the command prints...
    ```

``python docs/generate.py`` runs every marked command (in process, against the catalog
jkernel imports) and rewrites the block under it; ``--check`` rewrites nothing and exits 1
when a page is stale. ``tests/test_docs.py`` compares the same blocks with the program.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
#: The pages this script fills (docs/simulator.md and docs/calibrate.md have their owners).
PAGES = ("cli.md", "api.md", "concepts.md", "add-model.md", "README.md")

MARKER = re.compile(r"<!-- output: (?P<cmd>[^\n]+?) -->\n```\n(?P<body>.*?)```\n", re.S)


def run_command(command: str) -> str:
    """What ``jkernel ARGS`` prints on stdout, run in this process."""
    from jkernel import cli

    argv = shlex.split(command)
    if argv[:1] != ["jkernel"]:
        raise ValueError(f"a marked command starts with `jkernel`: {command!r}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv[1:])
    if rc:
        raise RuntimeError(f"`{command}` exited with {rc}")
    return out.getvalue()


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


def markers(text: str) -> list[tuple[str, str]]:
    """(command, current block body) for each marked block of a page."""
    return [(m["cmd"], m["body"]) for m in MARKER.finditer(text)]


def fill(text: str) -> str:
    return MARKER.sub(lambda m: f"<!-- output: {m['cmd']} -->\n```\n{block(m['cmd'])}```\n",
                      text)


def main(argv: list[str] | None = None) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for name in PAGES:
        path = DOCS / name
        text = path.read_text()
        new = fill(text)
        if new != text:
            stale.append(name)
            if not check:
                path.write_text(new)
    verb = "stale" if check else "regenerated"
    print(f"{verb}: {', '.join(stale)}" if stale else "docs up to date")
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
