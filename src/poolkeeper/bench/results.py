"""The results file: ``{"format": "poolkeeper-bench", "schema": 1, "created", "command",
"machine", "rows": [...]}``. Rows are self-contained (each carries its machine and scale), so
rows from several files can be pooled by ``poolkeeper compare``."""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Sequence

from poolkeeper.bench.errors import ResultsError
from poolkeeper.bench.machine import machine_info

FORMAT = "poolkeeper-bench"
SCHEMA = 1
REQUIRED = (
    "arm", "workload", "params", "backend", "scale", "ops", "p50_ns", "p90_ns", "p99_ns", "max_ns", "ops_per_s",
    "upstream_allocations", "upstream_deallocations", "peak_reserved_bytes", "peak_live_bytes", "machine",
    "stream_ordered",
)


def document(rows: Sequence[Dict[str, Any]], command: Optional[Sequence[str]] = None, **meta: Any) -> Dict[str, Any]:
    return {
        "format": FORMAT,
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else ["poolkeeper"] + sys.argv[1:],
        "machine": machine_info(),
        **meta,
        "rows": list(rows),
    }


def write(path: str, rows: Sequence[Dict[str, Any]], command: Optional[Sequence[str]] = None, **meta: Any) -> None:
    """Write rows as a results file (parent directories are created)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document(rows, command, **meta), f, indent=1, sort_keys=False, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def _jsonable(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """All rows of the given results files, each checked for the fields compare needs."""
    rows: List[Dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        if isinstance(doc, list):  # a bare list of rows is accepted too
            file_rows = doc
        elif isinstance(doc, dict) and doc.get("format") == FORMAT:
            if doc.get("schema") != SCHEMA:
                raise ResultsError(f"{path}: results schema {doc.get('schema')!r}; this poolkeeper reads schema {SCHEMA}")
            file_rows = doc.get("rows")
        else:
            raise ResultsError(f"{path}: not a poolkeeper bench results file (no \"format\": \"{FORMAT}\")")
        if not isinstance(file_rows, list):
            raise ResultsError(f"{path}: \"rows\" is not a list")
        for i, r in enumerate(file_rows):
            if not isinstance(r, dict):
                raise ResultsError(f"{path}: row {i} is not an object")
            missing = [k for k in REQUIRED if k not in r]
            if missing:
                raise ResultsError(f"{path}: row {i} lacks {', '.join(missing)}")
            rows.append(r)
    return rows


__all__ = ["write", "load", "document", "FORMAT", "SCHEMA", "REQUIRED"]
