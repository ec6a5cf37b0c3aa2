"""The results file: ``{"format": "poolkeeper-bench", "schema": 1, "created", "command",
"machine", "rows": [...]}``. Rows are self-contained (each carries its machine and scale), so
rows from several files can be pooled by ``poolkeeper compare``."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Sequence

from poolkeeper._json import load as load_json
from poolkeeper._paths import check_not_input, is_special, output_path, write_output
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


def _target(path: str) -> str:
    """The file :func:`write` replaces: ``path`` through any symlinks. Renaming over the link itself
    would turn it into a regular file and leave what it pointed at stale; ``open(path, "w")``, as
    every other output of poolkeeper is written, writes through the link too."""
    return os.path.realpath(output_path(path, "results path"))


def check_writable(path: str, inputs: Sequence[str] = ()) -> None:
    """Raise :class:`ResultsError` now if ``path`` cannot be written (before minutes of
    benchmarking, not after): refuses a directory, block device or socket (see
    :func:`poolkeeper._paths.output_path`) and one of ``inputs``, creates missing parent
    directories and probes the folder with a new empty file of a name of its own (not for a
    character device or FIFO, which is written straight)."""
    if not isinstance(path, str) or not path:
        raise ResultsError(f"--json needs a file path; got {path!r}")
    try:
        if is_special(output_path(path, "results path")):
            return
        check_not_input(path, inputs, "results path")
        target = _target(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix="." + os.path.basename(target) + ".", suffix=".tmp",
                                     dir=os.path.dirname(target))
        os.close(fd)
        os.remove(probe)
    except (OSError, ValueError) as e:  # ValueError: a refused path (InvalidArgumentError)
        raise ResultsError(f"cannot write results to {path!r}: {e}") from None


def write(path: str, rows: Sequence[Dict[str, Any]], command: Optional[Sequence[str]] = None, **meta: Any) -> None:
    """Write rows as a results file (parent directories are created), whole or not at all
    (:func:`poolkeeper._paths.write_output`: a file beside it renamed over it once written; on
    failure ``PATH`` keeps what it had and no temporary file is left). ``path`` is checked again
    here, since it may have changed during the run: a directory, block device or socket raises
    :class:`~poolkeeper.errors.InvalidArgumentError`; a character device or FIFO
    (``/dev/stdout``, a pipe) is written straight, never renamed over; a symlink is written
    through (its target is replaced, the link stays)."""
    text = json.dumps(document(rows, command, **meta), indent=1, sort_keys=False, default=_jsonable) + "\n"
    if not is_special(output_path(path, "results path")):  # on the path as given: a pipe's target has no name
        os.makedirs(os.path.dirname(_target(path)), exist_ok=True)
    write_output(path, text, "results path")


def write_or_rescue(path: str, rows: Sequence[Dict[str, Any]], **meta: Any) -> str:
    """Write rows to ``path``; if that fails after all (disk full, the directory removed meanwhile),
    write them to a new file in the system's temporary directory instead so no measured row is
    lost, and raise :class:`ResultsError` naming both. Returns the path written."""
    try:
        write(path, rows, **meta)
        return path
    except (OSError, TypeError, ValueError) as e:
        fd, rescue = tempfile.mkstemp(prefix="poolkeeper-bench-", suffix=".json")
        os.close(fd)
        write(rescue, rows, **meta)
        raise ResultsError(f"cannot write results to {path!r} ({e}); the {len(rows)} rows were saved to {rescue}") from None


def _jsonable(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _number(v: Any) -> bool:
    # A measurement: a finite int/float, or null (not measured). Not a bool, a string, a list.
    if v is None:
        return True
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) < 1e300 if isinstance(v, float) else v.bit_length() <= 128


def _scalar_params(v: Any) -> bool:
    # Scalars; a float must be finite (NaN never equals itself, and JSON has no NaN to write back).
    return isinstance(v, dict) and all(
        (isinstance(x, (str, int, bool)) or x is None or (isinstance(x, float) and math.isfinite(x))) for x in v.values())


_FIELD_TYPES = {
    "arm": lambda v: isinstance(v, str),
    "workload": lambda v: isinstance(v, str),
    "backend": lambda v: isinstance(v, str),
    "scale": lambda v: isinstance(v, str),
    "params": _scalar_params,
    "machine": lambda v: isinstance(v, dict),
    "stream_ordered": lambda v: isinstance(v, bool) or v is None,
    **{k: _number for k in ("ops", "p50_ns", "p90_ns", "p99_ns", "max_ns", "ops_per_s", "upstream_allocations",
                            "upstream_deallocations", "peak_reserved_bytes", "peak_live_bytes")},
}


def _kind(v: Any) -> str:
    return type(v).__name__ if not isinstance(v, (int, float)) or isinstance(v, bool) else f"{v!r}"[:30]


def load(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """All rows of the given results files, each checked for the fields compare needs."""
    rows: List[Dict[str, Any]] = []
    for path in paths:
        try:
            doc = load_json(path)  # bounded, strict about duplicate keys
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        except (ValueError, RecursionError) as e:  # undecodable bytes, an int over the digit limit, deep nesting
            raise ResultsError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:200]})") from None
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
            bad = [f"{k} ({_kind(r[k])})" for k, ok in _FIELD_TYPES.items() if not ok(r[k])]
            if bad:
                raise ResultsError(f"{path}: row {i} has fields of the wrong type: {', '.join(bad)}")
            rows.append(r)
    return rows


__all__ = ["write", "write_or_rescue", "check_writable", "load", "document", "FORMAT", "SCHEMA", "REQUIRED"]
