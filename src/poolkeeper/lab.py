"""The queue lab: a one-line model of a backlog that fills and drains (the pending-release analogy).

It is an *analogy* for pending releases, nothing more: work arrives at ``arrival_rate`` units per
second, is served at ``service_rate`` units per second, and whatever is not yet served waits in
the backlog -- as released blocks wait for their stream's work to finish before they can be
reused. The model has no pointers, free lists, byte sizes or CUDA streams, and its numbers mean
nothing about a real pool.

The page served by ``poolkeeper lab`` runs the same model in JavaScript; its constants and the
rate-parsing pattern are generated from this module (see ``poolkeeper.report.lab_page``) so the
two cannot drift apart, and the browser tests compare them value for value.
"""
from __future__ import annotations

import math
import re
from numbers import Real
from typing import Any

#: Seconds one :meth:`QueueLab.step` advances.
STEP_SECONDS = 0.5
#: Backlog (in units) right after :meth:`QueueLab.reset`.
RESET_BACKLOG = 4.0
#: Rates a fresh lab starts with (units per second).
DEFAULT_ARRIVAL_RATE = 1.0
DEFAULT_SERVICE_RATE = 2.0

#: What the page accepts as a rate before converting it: an optionally signed decimal number.
#: Written in the subset of syntax Python's ``re`` and JavaScript's ``RegExp`` read alike.
RATE_PATTERN = r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$"
_RATE_RE = re.compile(RATE_PATTERN)


def check_rate(value: Any, name: str = "rate") -> float:
    """Return ``value`` as a float if it is a finite, non-negative real number.

    Raises ``ValueError`` for anything else: negative numbers, NaN, infinities, booleans
    (a ``True`` rate is almost certainly a bug), strings and other non-numbers.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an int (or Fraction) beyond float range: no more finite than inf
        raise ValueError(f"{name} must be a finite number, not a value beyond float range ({type(value).__name__})") from None
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"{name} must be a finite number, not {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0 units per second, not {x!r}")
    return x + 0.0  # -0.0 becomes 0.0, as the page does


def parse_rate(text: str, name: str = "rate") -> float:
    """Parse a rate typed into the page's text box, with the page's rules.

    Surrounding whitespace is ignored; anything that is not a plain decimal number (``"abc"``,
    ``""``, ``"1,5"``, ``"0x10"``, ``"nan"``) raises ``ValueError``, and so do negative and
    overflowing (``"1e999"``) values.
    """
    if not isinstance(text, str):
        raise ValueError(f"{name} must be text, not {type(text).__name__}")
    stripped = text.strip()
    if not _RATE_RE.match(stripped):
        raise ValueError(f"{name} must be a number, not {text!r}")
    return check_rate(float(stripped), name)


class QueueLab:
    """The queue lab: Reset, set the two rates, Step, watch the backlog.

    Attributes:
        arrival_rate: units arriving per second (>= 0).
        service_rate: units served per second (>= 0).
        elapsed: seconds since the last :meth:`reset`.
        backlog: units waiting (never negative).
        history: ``(elapsed, backlog)`` after the last reset and after each step since.

    Setting a rate keeps ``elapsed`` and ``backlog`` as they are -- the run continues with the new
    rate -- so comparing two settings needs an explicit :meth:`reset` in between.

    >>> lab = QueueLab()
    >>> lab.arrival_rate, lab.service_rate = 0, 4
    >>> lab.step(); lab.step()
    >>> (lab.elapsed, lab.backlog)
    (1.0, 0.0)
    """

    def __init__(self, arrival_rate: float = DEFAULT_ARRIVAL_RATE, service_rate: float = DEFAULT_SERVICE_RATE) -> None:
        self._arrival = check_rate(arrival_rate, "arrival_rate")
        self._service = check_rate(service_rate, "service_rate")
        self.elapsed = 0.0
        self.backlog = RESET_BACKLOG
        self.history: list[tuple[float, float]] = []
        self.reset()

    @property
    def arrival_rate(self) -> float:
        """Units arriving per second. Setting it keeps elapsed time and backlog."""
        return self._arrival

    @arrival_rate.setter
    def arrival_rate(self, value: float) -> None:
        self._arrival = check_rate(value, "arrival_rate")

    @property
    def service_rate(self) -> float:
        """Units served per second. Setting it keeps elapsed time and backlog."""
        return self._service

    @service_rate.setter
    def service_rate(self, value: float) -> None:
        self._service = check_rate(value, "service_rate")

    def reset(self) -> None:
        """Start over: elapsed 0 s, backlog 4 units. The rates are kept."""
        self.elapsed = 0.0
        self.backlog = RESET_BACKLOG
        self.history = [(self.elapsed, self.backlog)]

    def step(self) -> None:
        """Advance 0.5 s: ``backlog <- max(0, backlog + (arrival - service) * 0.5)``."""
        # The page evaluates exactly this expression, in this order, on IEEE doubles.
        self.backlog = max(0.0, self.backlog + (self._arrival - self._service) * STEP_SECONDS)
        self.elapsed = self.elapsed + STEP_SECONDS
        self.history.append((self.elapsed, self.backlog))

    def __repr__(self) -> str:
        return (
            f"QueueLab(arrival_rate={self._arrival!r}, service_rate={self._service!r}, "
            f"elapsed={self.elapsed!r}, backlog={self.backlog!r})"
        )


__all__ = [
    "QueueLab",
    "check_rate",
    "parse_rate",
    "STEP_SECONDS",
    "RESET_BACKLOG",
    "DEFAULT_ARRIVAL_RATE",
    "DEFAULT_SERVICE_RATE",
    "RATE_PATTERN",
]
