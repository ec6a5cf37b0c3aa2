"""Reading JSON that poolkeeper wrote (snapshots, results files): strict about duplicate keys.

Python's ``json`` keeps the last of two equal keys in one object without a word, and so does
JavaScript's ``JSON.parse``. poolkeeper never writes a key twice, so a file holding one was edited
or spliced, and which of the two values is meant cannot be known: it is refused instead.
"""
from __future__ import annotations

import json

from typing import Any, List, Optional, Tuple

#: The most bytes a snapshot or results file may hold. Parsed JSON takes several times its text in
#: memory; without a bound ``poolkeeper report /dev/zero`` read until memory ran out.
MAX_JSON_BYTES = 1 << 30


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice."""


class TooLargeError(ValueError):
    """A file larger than poolkeeper reads (or an endless one: ``/dev/zero``)."""


def read_text(path: str, limit: Optional[int] = None) -> str:
    """The UTF-8 text of ``path`` (a byte-order mark dropped), at most ``limit`` bytes of it
    (default :data:`MAX_JSON_BYTES`): :class:`TooLargeError` beyond, ``UnicodeDecodeError`` for
    bytes that are not UTF-8, the ``OSError`` of ``open()``."""
    if limit is None:
        limit = MAX_JSON_BYTES
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLargeError(f"{path} holds more than {limit:,} bytes; poolkeeper reads JSON files up to that size")
    return data.decode("utf-8-sig")


def load(path: str, limit: Optional[int] = None) -> Any:
    """:func:`read_text`, parsed with :data:`unique_keys` (``ValueError``s as there, and
    ``json.JSONDecodeError``, :class:`DuplicateKeyError`, ``RecursionError``)."""
    return json.loads(read_text(path, limit), object_pairs_hook=unique_keys)


def _unique(pairs: List[Tuple[str, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                shown = repr(k[:40]) + ("..." if len(k) > 40 else "")
                raise DuplicateKeyError(f"an object names the key {shown} twice")
            seen.add(k)
    return d


#: ``object_pairs_hook`` for :func:`json.load` / :func:`json.loads`.
unique_keys = _unique

__all__ = ["DuplicateKeyError", "TooLargeError", "MAX_JSON_BYTES", "read_text", "load", "unique_keys"]
