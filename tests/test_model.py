"""Stateful property test: each pool against a small pure-Python reference model.

The model knows what the caller knows: which blocks are live, their sizes and streams, which
addresses were freed. Hypothesis drives random programs of allocate / deallocate (with and
without a stream) / record_stream / double free / trim / process_pending / synchronize / clock
moves on the simulated device, and after every rule the pool must agree with the model: the live
set (in stats and in the snapshot), live bytes and blocks, peak live, alignment, no overlap, the
accounting equation, its upstream's books, and ``validate()``.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import poolkeeper as pk
from poolkeeper.accounting import check as check_snapshot
from poolkeeper.errors import InvalidPointerError
from expandable_helpers import assert_disjoint
from pool_oracle import check_equation, state

KiB, MiB = 1 << 10, 1 << 20

# Boundaries of the pools: alignment, size classes, arena fast bins (32 KiB), the arena's initial
# backing below (64 KiB), thread-cache block limit and max backing (1 MiB).
EDGES = [1, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 1280, 1281, 1792, 2048, 2049,
         32 * KiB - 1, 32 * KiB, 32 * KiB + 1, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1,
         MiB - 1, MiB, MiB + 1, 2 * MiB + 3]
SIZES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(1, 4 * KiB),
    st.integers(1, 80 * KiB),
    st.integers(1, 3 * MiB),
)

MODEL_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=50,
    derandomize=True,  # the same programs on every run: CI-reproducible
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def make(kind: str, up):
    if kind == "arena":
        # Small backings: growth, oversize backings and shrink scans happen within 50 steps.
        return pk.ArenaPool(up, initial_backing=64 * KiB, max_backing=1 * MiB, shrink_interval=16)
    if kind == "arena_expandable":
        # One granule per growth step and frequent scans: maps and tail unmaps within 50 steps.
        return pk.ArenaPool(up, expandable=True, max_step=2 * MiB, shrink_interval=16, shrink_hysteresis=1)
    if kind == "arena_nocache":
        return pk.ArenaPool(up, initial_backing=64 * KiB, max_backing=1 * MiB, thread_cache_bytes=0)
    return pk.make_pool(kind, up)


class PoolVersusModel(RuleBasedStateMachine):
    KIND = "direct"

    def __init__(self) -> None:
        super().__init__()
        self.sim = pk.upstream.Simulated(latency_us=0)
        self.pool = make(self.KIND, self.sim)
        self.align = self.pool.alignment
        self.streams = [self.sim.stream(), self.sim.stream()]
        self.live: dict[int, tuple[int, object]] = {}  # ptr -> (requested, stream)
        self.freed: list[int] = []  # addresses freed (candidates for a double free)
        self.peak_live = 0

    # ---------------------------------------------------------------- helpers
    def span(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def stream(self, i):
        return None if i is None else self.streams[i]

    def pick_live(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.live)), label="block")

    def forget(self, p: int) -> None:
        del self.live[p]
        self.freed.append(p)

    # ---------------------------------------------------------------- rules
    @rule(n=SIZES, s=st.sampled_from([None, None, 0, 1]))
    def allocate(self, n, s):
        p = self.pool.allocate(n, self.stream(s))
        assert p % self.align == 0, f"{p:#x} not aligned to {self.align}"
        assert p not in self.live, f"{p:#x} handed out twice"
        for q, (m, _) in self.live.items():
            assert p + self.span(n) <= q or q + self.span(m) <= p, f"{p:#x}+{n} overlaps {q:#x}+{m}"
        self.live[p] = (n, s)
        self.peak_live = max(self.peak_live, sum(m for m, _ in self.live.values()))
        if self.KIND == "arena_expandable":  # no memory behind two live blocks either (stitched aliases)
            assert_disjoint(self.sim, [(q, m) for q, (m, _) in self.live.items()])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def deallocate(self, data):
        p = self.pick_live(data)
        self.pool.deallocate(p)
        self.forget(p)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), s=st.sampled_from([0, 1]), work_us=st.sampled_from([0.0, 5.0, 100.0]))
    def deallocate_on_stream(self, data, s, work_us):
        p = self.pick_live(data)
        if work_us:
            self.sim.enqueue(self.streams[s], work_us)  # the block is still in use on the device
        self.pool.deallocate(p, self.streams[s])
        self.forget(p)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), s=st.sampled_from([0, 1]))
    def record_stream(self, data, s):
        p = self.pick_live(data)
        before = state(self.pool)
        self.pool.record_stream(p, self.streams[s])
        assert state(self.pool) == before  # marks the block; moves no bytes

    @precondition(lambda self: any(p not in self.live for p in self.freed))
    @rule(data=st.data())
    def double_free(self, data):
        p = data.draw(st.sampled_from([q for q in self.freed if q not in self.live]), label="freed")
        before = state(self.pool)
        try:
            self.pool.deallocate(p)
        except InvalidPointerError as e:
            # double_free while the pool still knows the chunk; unknown once its memory went back
            # upstream; interior once it merged into a neighbour or lies inside a newer block.
            assert e.reason in ("double_free", "unknown", "interior"), (e.reason, str(e))
        else:
            raise AssertionError(f"double free of {p:#x} was accepted")
        assert state(self.pool) == before

    @rule()
    def trim(self):
        before = self.pool.stats()["reserved_bytes"]
        released = self.pool.trim()
        assert self.pool.stats()["reserved_bytes"] == before - released

    @rule()
    def process_pending(self):
        before = self.pool.stats()["pending_bytes"]
        self.pool.process_pending()
        assert self.pool.stats()["pending_bytes"] <= before

    @rule()
    def synchronize(self):
        self.pool.synchronize()
        st_ = self.pool.stats()
        assert st_["pending_bytes"] == 0 and st_["pending_blocks"] == 0, st_

    @rule(us=st.sampled_from([1.0, 50.0, 500.0]))
    def advance_clock(self, us):
        self.sim.advance(us)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_the_model(self):
        self.pool.validate()
        st_ = self.pool.stats()
        check_equation(st_)
        assert st_["live_blocks"] == len(self.live)
        assert st_["live_bytes"] == sum(n for n, _ in self.live.values())
        assert st_["peak_live_bytes"] == self.peak_live, (st_["peak_live_bytes"], self.peak_live)
        c = self.sim.counters()
        assert c["outstanding_bytes"] == st_["reserved_bytes"]
        assert c["allocations"] - c["deallocations"] == st_["upstream_allocations"] - st_["upstream_deallocations"]
        snap = self.pool.snapshot()
        check_snapshot(snap)
        live = {b.address + ch.offset: ch.requested for b in snap.backings for ch in b.chunks if ch.state == "live"}
        assert live == {p: n for p, (n, _) in self.live.items()}

    def teardown(self):
        for p in list(self.live):
            self.pool.deallocate(p)
        self.pool.synchronize()
        self.pool.validate()
        self.pool.close()
        assert self.sim.counters()["outstanding_bytes"] == 0


def _machine(kind: str):
    cls = type(f"Model_{kind}", (PoolVersusModel,), {"KIND": kind})
    case = cls.TestCase
    case.settings = MODEL_SETTINGS
    return case


TestDirectModel = _machine("direct")
TestSizeClassModel = _machine("size_class")
TestArenaModel = _machine("arena")
TestArenaNoCacheModel = _machine("arena_nocache")
TestArenaExpandableModel = _machine("arena_expandable")
