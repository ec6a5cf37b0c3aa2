"""``KEY=VALUE`` pool options from the command line (``max_backing=64MiB``, ``growth_factor=1.5``)."""
from __future__ import annotations

import inspect
import math
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Sequence

from poolkeeper.errors import InvalidArgumentError

_SUFFIX = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
           "kb": 1000, "mb": 1000**2, "gb": 1000**3}


#: Every pool option is a 64-bit quantity in the core; a larger integer is a typo, refused here as
#: one line rather than as an OverflowError wherever it is first converted.
_MAX_INT = 1 << 64


def parse_value(text: str) -> Any:
    """``text`` as None, a bool, an int (``0x`` prefixes, size suffixes: ``64MiB`` / ``1.5GiB``,
    truncated to whole bytes) or a float; :class:`InvalidArgumentError` for anything else,
    including an integer of 2**64 or more in magnitude and a float that is not finite."""
    t = text.strip()
    low = t.lower()
    shown = repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    value: Any = None
    try:
        for suf in sorted(_SUFFIX, key=len, reverse=True):
            digits = low[: -len(suf)]
            if low.endswith(suf) and digits.replace(".", "", 1).isdigit():
                # Exact: float() turned 400 digits into inf and int(inf) raised OverflowError.
                value = int(Fraction(digits) * _SUFFIX[suf])
                break
        else:
            try:
                value = int(t, 0)
            except ValueError:
                value = float(t)
    except ValueError:  # not a number, or more digits than int() converts (sys.get_int_max_str_digits)
        raise InvalidArgumentError(f"option value {shown} is not a number, size (e.g. 64MiB), bool or none") from None
    if isinstance(value, int) and not -_MAX_INT < value < _MAX_INT:
        raise InvalidArgumentError(f"option value {shown} is out of range (at most 2**64 - 1)")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(f"option value {shown} is not a finite number")
    return value


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
