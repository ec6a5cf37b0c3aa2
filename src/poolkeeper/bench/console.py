"""The rich console the bench, compare and replay commands print to."""
from __future__ import annotations

import os
from typing import Any


def make_console(stderr: bool = False) -> Any:
    """A rich Console. In a terminal it is the terminal's width; otherwise (a file, a pipe, a test)
    it is ``$COLUMNS`` wide when that is set, else 160 columns instead of rich's default 80, so
    tables are written whole rather than squeezed."""
    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        c = Console(stderr=stderr, width=160)
    return c


__all__ = ["make_console"]
