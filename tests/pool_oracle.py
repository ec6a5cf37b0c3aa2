"""The oracle the conformance, model and thread tests share: it keeps its own record of every
live block and checks a pool against it (alignment, no overlap, payload intact, accounting).

On Host memory each block carries a cookie (its serial number repeated over the whole requested
size), written at allocation and compared byte for byte at free, so two blocks that overlap in
real memory are caught even where the address bookkeeping agrees.
"""
from __future__ import annotations

import bisect
import ctypes
import struct
from typing import Optional

from poolkeeper.accounting import check as check_snapshot

TERMS = ("live_bytes", "free_bytes", "pending_bytes", "overhead_bytes")
# Fields of stats() that describe the pool's state (not counters of passes or hits).
STATE_KEYS = (
    "reserved_bytes",
    "live_bytes",
    "free_bytes",
    "pending_bytes",
    "overhead_bytes",
    "thread_cached_bytes",
    "live_blocks",
    "free_chunks",
    "pending_blocks",
    "backings",
    "upstream_allocations",
    "upstream_deallocations",
)


def state(pool) -> dict:
    st = pool.stats()
    return {k: st[k] for k in STATE_KEYS}


def check_equation(st: dict) -> None:
    """reserved == live + free + pending + overhead, and the figures around it are sane."""
    for k in ("reserved_bytes",) + TERMS + ("thread_cached_bytes", "largest_free_block"):
        assert isinstance(st[k], int) and 0 <= st[k] < 1 << 62, (k, st[k])
    total = sum(st[k] for k in TERMS)
    assert st["reserved_bytes"] == total, (
        f"reserved {st['reserved_bytes']} != live {st['live_bytes']} + free {st['free_bytes']}"
        f" + pending {st['pending_bytes']} + overhead {st['overhead_bytes']}"
    )
    assert st["thread_cached_bytes"] <= st["free_bytes"], st
    assert st.get("thread_cached_pending_bytes", 0) <= st["pending_bytes"], st
    assert st["largest_free_block"] <= st["free_bytes"], st
    assert st["peak_reserved_bytes"] >= st["reserved_bytes"], st
    assert st["peak_live_bytes"] >= st["live_bytes"], st


def cookie_bytes(serial: int, n: int) -> bytes:
    c = struct.pack("<Q", (serial * 0x9E3779B97F4A7C15 + 1) & (2**64 - 1))
    return c * (n // 8) + c[: n % 8]


class Oracle:
    """What a correct pool must agree with: the live blocks as the caller knows them.

    Args:
        pool: the pool under test.
        cookies: write/check payload cookies (only done when the upstream is host memory).
        exclusive_upstream: the upstream serves only this pool, so its outstanding bytes must equal
            the pool's reserved bytes.
    """

    def __init__(self, pool, cookies: bool = True, exclusive_upstream: bool = True) -> None:
        self.pool = pool
        self.align = pool.alignment
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (requested, serial)
        self.starts: list[int] = []  # sorted live addresses
        self.cookies = cookies and pool.upstream.kind == "host"
        self.exclusive = exclusive_upstream
        self.serial = 0

    # ---------------------------------------------------------------- blocks
    def span(self, n: int) -> int:
        # Every pool hands out at least the request rounded up to its alignment.
        return -(-n // self.align) * self.align

    def on_alloc(self, p: int, n: int) -> None:
        assert isinstance(p, int) and p > 0, p
        assert p % self.align == 0, f"{p:#x} is not aligned to {self.align}"
        assert p not in self.live, f"{p:#x} handed out twice"
        i = bisect.bisect_left(self.starts, p)
        if i > 0:
            q = self.starts[i - 1]
            assert q + self.span(self.live[q][0]) <= p, f"new block {p:#x} overlaps live block {q:#x}"
        if i < len(self.starts):
            q = self.starts[i]
            assert p + self.span(n) <= q, f"new block {p:#x}+{n} overlaps live block {q:#x}"
        self.starts.insert(i, p)
        self.serial += 1
        self.live[p] = (n, self.serial)
        if self.cookies:
            ctypes.memmove(p, cookie_bytes(self.serial, n), n)

    def check_cookie(self, p: int) -> None:
        if not self.cookies:
            return
        n, serial = self.live[p]
        got = ctypes.string_at(p, n)
        if got != cookie_bytes(serial, n):
            want = cookie_bytes(serial, n)
            first = next(i for i in range(n) if got[i] != want[i])
            raise AssertionError(f"payload of block {p:#x} ({n} B) overwritten at offset {first}")

    def on_free(self, p: int) -> None:
        # The payload is checked before the pool gets the block back (it may reuse it at once).
        del self.live[p]
        self.starts.pop(bisect.bisect_left(self.starts, p))

    def allocate(self, n: int, stream=None) -> int:
        p = self.pool.allocate(n, stream)
        self.on_alloc(p, n)
        return p

    def deallocate(self, p: int, stream=None) -> None:
        self.check_cookie(p)  # before the pool may reuse it
        self.pool.deallocate(p, stream)
        self.on_free(p)

    # ---------------------------------------------------------------- pool
    def check(self, snapshot: bool = False, validate: bool = True) -> dict:
        if validate:
            self.pool.validate()
        st = self.pool.stats()
        check_equation(st)
        assert st["live_blocks"] == len(self.live), (st["live_blocks"], len(self.live))
        assert st["live_bytes"] == sum(n for n, _ in self.live.values()), st
        if self.exclusive:
            c = self.pool.upstream.counters()
            assert c["outstanding_bytes"] == st["reserved_bytes"], (c, st)
            assert c["allocations"] == st["upstream_allocations"], (c, st)
            assert c["deallocations"] == st["upstream_deallocations"], (c, st)
        if snapshot:
            snap = self.pool.snapshot()
            part = check_snapshot(snap)
            assert part.live == st["live_bytes"]
            live_chunks = {b.address + c.offset for b in snap.backings for c in b.chunks if c.state == "live"}
            assert live_chunks == set(self.live), "snapshot's live chunks differ from the live blocks"
        return st

    def free_all(self, stream=None) -> None:
        for p in list(self.live):
            self.deallocate(p, stream)


def pick(rng, seq: list) -> Optional[int]:
    return seq[rng.randrange(len(seq))] if seq else None
