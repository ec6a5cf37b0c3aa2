"""Errors of the benchmark, compare and replay tools (all :class:`PoolkeeperError`, so the
``poolkeeper`` command prints them as one line instead of a traceback)."""
from __future__ import annotations

from typing import Optional

from poolkeeper.errors import InvalidArgumentError, PoolkeeperError


class ReplayError(PoolkeeperError, ValueError):
    """An allocation log that cannot be replayed: malformed, truncated or of an unknown format.

    Attributes: ``path`` (the log), ``line`` (1-based line of a CSV log, or None) and
    ``where`` (a location inside a non-line format, e.g. ``device_traces[0][17]``, or None).
    The message always names the location.
    """

    def __init__(self, message: str, *, path: str = "", line: Optional[int] = None, where: Optional[str] = None):
        loc = ""
        if line is not None:
            loc = f"line {line}: "
        elif where is not None:
            loc = f"{where}: "
        prefix = f"{path}: " if path else ""
        super().__init__(f"{prefix}{loc}{message}", path=path, line=line, where=where, detail=message)


class ResultsError(PoolkeeperError, ValueError):
    """A results file that is not poolkeeper benchmark output, or rows that cannot be compared."""


class ScaleMixError(ResultsError):
    """Rows of different config scales (``full``/``quick``) were asked to be combined.

    Rows of different scales measure different workloads; they are never averaged or paired.
    Attribute ``scales``: the scales found.
    """


class UnknownNameError(InvalidArgumentError):
    """An arm, workload or backend name that does not exist."""


__all__ = ["ReplayError", "ResultsError", "ScaleMixError", "UnknownNameError"]
