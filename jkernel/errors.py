"""The one error type a deployment is refused with.

Every condition of spec resolution.md §13 raises :class:`Refusal`, a ``ValueError`` carrying
the refusal ``code`` (``"R1"`` … ``"R20"``), the document ``field`` it concerns and, for
document errors, the ``file`` it was read from. The message says why the engine (or the
kernel) would not start, and what would work where there is such a setting.
"""

from __future__ import annotations

__all__ = ["Refusal"]


class Refusal(ValueError):
    """A deployment, document or configuration that jkernel will not build a kernel for.

    Attributes:
      code: refusal code of resolution.md §13, e.g. ``"R13"``.
      field: document path of the offending setting (``"pools[0].parallel.pp"``), or None.
      file: the file the offending document came from, or None for in-memory documents.
      reason: the message without the code/file prefix.
    """

    def __init__(self, code: str, reason: str, *, field: str | None = None,
                 file: str | None = None):
        self.code = code
        self.field = field
        self.file = file
        self.reason = reason
        where = ""
        if file:
            where += f"{file}: "
        if field:
            where += f"{field}: "
        super().__init__(f"[{code}] {where}{reason}")

    def __reduce__(self):  # keep the fields through pickling (multiprocessing, pytest-xdist)
        return (_rebuild, (self.code, self.reason, self.field, self.file))


def _rebuild(code, reason, field, file):
    return Refusal(code, reason, field=field, file=file)
