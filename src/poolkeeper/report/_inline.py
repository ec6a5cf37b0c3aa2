"""Helpers for building self-contained HTML pages: read packaged assets, embed data safely.

Pages are assembled from small template files in ``assets/`` so the HTML, CSS and JavaScript stay
readable on their own; nothing is fetched at view time.
"""
from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any, Mapping

_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def asset(name: str) -> str:
    """Text of ``poolkeeper/report/assets/<name>``."""
    return resources.files("poolkeeper.report").joinpath("assets", name).read_text(encoding="utf-8")


def script_json(data: Any) -> str:
    """JSON safe to place inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` can only occur inside JSON strings, where ``\\u003c`` etc. mean the same
    character to ``JSON.parse`` -- so a pool or upstream name containing ``</script>`` cannot end
    the element early. U+2028/U+2029 are escaped too, for older JavaScript parsers.
    """
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def fill(template: str, values: Mapping[str, str]) -> str:
    """Replace each ``{{NAME}}`` in one pass (so inserted text is never rescanned)."""

    def sub(m: "re.Match[str]") -> str:
        return values[m.group(1)]

    return _PLACEHOLDER.sub(sub, template)


def inline_code(text: str, closing: str) -> str:
    """Check that packaged CSS/JS cannot close its own ``<style>``/``<script>`` element."""
    if closing.lower() in text.lower():
        raise ValueError(f"asset contains {closing!r}")
    return text
