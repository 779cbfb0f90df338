"""Output files written whole or not at all, to paths checked before any work starts.

Every file a command writes (``replay --out``, ``plan --csv/--json/--plot``, ``derive
--out``) goes through this module:

* :func:`check_target` refuses, *before* the work, an output path that cannot be written
  as asked: empty, an existing directory, inside a folder that does not exist or is not a
  folder, or the same file as one of the command's inputs (which the output would
  overwrite). :func:`check_targets` also refuses two outputs of one command that name the
  same file.
* :func:`replacing` writes to a temporary file beside the target (same folder, so the same
  file system) and renames it over the target only when the writer has finished and the
  data is on disk: a full disk, a failed writer or Ctrl-C leave the previous file as it was
  and no temporary file behind.

Refusals are :class:`~jkernel.validate.ArgumentError` naming the option (``--out``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from .validate import ArgumentError

__all__ = ["check_target", "check_targets", "replacing", "write_text", "write_bytes",
           "write_with"]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists()
                                              and os.path.samefile(a, b))
    except OSError:
        return False


def check_target(path, *, argument: str, inputs: Iterable = ()) -> Path:
    """``path`` as a :class:`~pathlib.Path` if a file can be written there; else raises
    :class:`ArgumentError` naming ``argument`` and why. ``inputs``: the paths the command
    reads (an output equal to one of them would destroy it)."""
    if path is None or not str(path).strip():
        raise ArgumentError(argument, "needs a file path, got an empty one")
    p = Path(path)
    if p.is_dir():
        raise ArgumentError(argument, f"{p} is a directory; name a file to write")
    folder = p.parent
    if not folder.exists():
        raise ArgumentError(argument, f"the folder {folder} does not exist; create it first "
                            f"(nothing was run)")
    if not folder.is_dir():
        raise ArgumentError(argument, f"{folder} is not a folder, so {p} cannot be written")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ArgumentError(argument, f"the folder {folder} is not writable")
    if p.exists() and not p.is_file():
        raise ArgumentError(argument, f"{p} exists and is not a regular file")
    for other in inputs:
        if other is None:
            continue
        if _same_file(p, Path(other)):
            raise ArgumentError(argument, f"{p} is also an input of this command; writing "
                                "it would overwrite the input — choose another file")
    return p


def check_targets(targets: Mapping[str, object], *, inputs: Iterable = ()) -> dict[str, Path]:
    """:func:`check_target` for each ``{argument: path}`` given (None skipped), and refuse
    two arguments naming one file."""
    inputs = list(inputs)
    out: dict[str, Path] = {}
    for arg, path in targets.items():
        if path is None:
            continue
        p = check_target(path, argument=arg, inputs=inputs)
        for prev_arg, prev in out.items():
            if _same_file(p, prev):
                raise ArgumentError(arg, f"{p} is also the file of {prev_arg}; give each "
                                    "output its own file")
        out[arg] = p
    return out


@contextlib.contextmanager
def replacing(path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same folder and suffix); when the block ends
    without an exception, flush it to disk and rename it over ``path`` (atomic on POSIX);
    on any exception, remove it and leave ``path`` untouched. The file gets the mode of
    the file it replaces, else the usual mode for a new file (0666 less the umask)."""
    target = Path(path)
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(4)}.tmp{target.suffix}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:          # the writer may have closed its own handle
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_with(path, writer: Callable[[Path], object]) -> Path:
    """Run ``writer(temporary_path)`` and put its file at ``path`` atomically."""
    with replacing(path) as tmp:
        writer(tmp)
    return Path(path)


def write_bytes(path, data: bytes) -> Path:
    """``data`` at ``path``, atomically."""
    return write_with(path, lambda tmp: tmp.write_bytes(data))


def write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """``text`` at ``path``, atomically."""
    return write_with(path, lambda tmp: tmp.write_text(text, encoding=encoding))
