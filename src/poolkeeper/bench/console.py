"""The rich console the bench, compare and replay commands print to."""
from __future__ import annotations

from typing import Any


def make_console(stderr: bool = False) -> Any:
    """A rich Console; when output is not a terminal (a file, a pipe, a test) it is 160 columns
    wide instead of rich's default 80, so tables are written whole rather than squeezed."""
    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal:
        c = Console(stderr=stderr, width=160)
    return c


__all__ = ["make_console"]
