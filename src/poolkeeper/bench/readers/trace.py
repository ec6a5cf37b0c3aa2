"""The in-memory form every log reader produces: a sequence of allocation events."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional

ALLOC = "alloc"
FREE = "free"
ALLOC_FAILED = "alloc_failed"


class Event(NamedTuple):
    """One logged event. ``addr`` is the address in the logged process (only an identity here),
    ``where`` the line number (CSV) or entry index it came from, for messages."""

    kind: str
    addr: int
    size: int
    stream: int
    where: int


@dataclass
class Trace:
    """A parsed log: its events in log order, and what the reader saw besides them."""

    path: str
    format: str
    events: List[Event] = field(default_factory=list)
    ignored: Dict[str, int] = field(default_factory=dict)  # action -> count of entries not replayed
    info: Dict[str, Any] = field(default_factory=dict)  # format-specific facts (device, source peak, ...)
    location: str = "line"  # what Event.where counts: "line" or "entry"

    def ignore(self, action: str) -> None:
        self.ignored[action] = self.ignored.get(action, 0) + 1

    def where_text(self, where: Optional[int]) -> str:
        return f"{self.location} {where}" if where is not None else ""


__all__ = ["Event", "Trace", "ALLOC", "FREE", "ALLOC_FAILED"]
