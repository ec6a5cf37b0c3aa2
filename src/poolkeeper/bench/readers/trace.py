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
    # Blocks the logged process held from before the log began, as ALLOC events (where = -1): the
    # ones the log frees without having allocated, and (snapshots) the ones still allocated at the
    # end that the log never allocated. Replayed only with include_pre_trace.
    pre_trace: List[Event] = field(default_factory=list)

    def ignore(self, action: str) -> None:
        self.ignored[action] = self.ignored.get(action, 0) + 1

    def find_pre_trace(self) -> None:
        """Fill ``pre_trace`` with the blocks the log frees without having allocated them."""
        allocated = set()
        seen = set()
        for ev in self.events:
            if ev.kind == ALLOC:
                allocated.add(ev.addr)
            elif ev.kind == FREE and ev.addr and ev.addr not in allocated and ev.addr not in seen:
                seen.add(ev.addr)
                self.pre_trace.append(Event(ALLOC, ev.addr, ev.size, ev.stream, -1))

    def where_text(self, where: Optional[int]) -> str:
        return f"{self.location} {where}" if where is not None else ""


__all__ = ["Event", "Trace", "ALLOC", "FREE", "ALLOC_FAILED"]
