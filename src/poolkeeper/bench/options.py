"""``KEY=VALUE`` pool options from the command line (``max_backing=64MiB``, ``growth_factor=1.5``)."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List, Sequence

from poolkeeper.errors import InvalidArgumentError

_SUFFIX = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
           "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_value(text: str) -> Any:
    t = text.strip()
    low = t.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for suf in sorted(_SUFFIX, key=len, reverse=True):
        if low.endswith(suf) and low[: -len(suf)].replace(".", "", 1).isdigit():
            return int(float(low[: -len(suf)]) * _SUFFIX[suf])
    try:
        return int(t, 0)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        raise InvalidArgumentError(f"option value {text!r} is not a number, size (e.g. 64MiB), bool or none") from None


def parse_options(items: Iterable[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidArgumentError(f"option {item!r} is not KEY=VALUE")
        out[key.strip()] = parse_value(value)
    return out


def accepted(pool_kind: str) -> List[str]:
    """Keyword options a pool kind's constructor accepts."""
    import poolkeeper as pk

    kind = pk.pools.pool_kind(pool_kind)
    params = inspect.signature(kind.cls.__init__).parameters
    names = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return [n for n in names if n not in kind.fixed] + list(kind.extra_options)


def split_for(pools: Sequence[str], options: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Give each pool kind the options it accepts; an option no selected pool accepts is an error."""
    per: Dict[str, Dict[str, Any]] = {k: {} for k in pools}
    for key, value in options.items():
        takers = [k for k in pools if key in accepted(k)]
        if not takers:
            raise InvalidArgumentError(f"option {key!r} is not accepted by {', '.join(pools)}")
        for k in takers:
            per[k][key] = value
    return per


__all__ = ["parse_value", "parse_options", "split_for", "accepted"]
