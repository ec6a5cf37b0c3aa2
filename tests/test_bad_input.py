"""Bad input through the Python API, for every pool x upstream: each row must raise its specific
typed error from poolkeeper.errors (class, ``.reason`` for pointers, a message naming the
problem), change nothing (stats before == after), and leave the pool valid and serving.

Rows whose failure mode is a crash (null and sentinel pointers in the lock-free pointer table)
run in a child process, so a segfault fails one row instead of killing the session.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest

import poolkeeper as pk
from poolkeeper.errors import (
    InvalidArgumentError,
    InvalidPointerError,
    InvalidStreamError,
    PoolClosedError,
)
from pool_oracle import Oracle, check_equation

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Ctx:
    pool: Any
    oracle: Oracle
    a: int  # live, 1000 B (its chunk spans 1024 B: interior offsets 1 and 256 are inside)
    b: int  # live, 70 KiB
    freed: int  # allocated and freed once
    other_pool: Any
    other: int  # live in other_pool
    stream: int  # a valid stream handle


@pytest.fixture
def ctx(make_pool, upstream, pool_kind):
    pool = make_pool(upstream)
    # The other pool shares the upstream, as two pools on one device do (two Simulated upstreams
    # would hand out the same fake addresses).
    o = Oracle(pool, exclusive_upstream=False)
    other_pool = make_pool(upstream)
    other = other_pool.allocate(1000)  # before the free below, so it cannot take the freed address
    a = o.allocate(1000)
    b = o.allocate(70 * KiB)
    freed = o.allocate(3000)
    o.deallocate(freed)
    stream = upstream.stream() if hasattr(upstream, "stream") else 7
    c = Ctx(pool, o, a, b, freed, other_pool, other, stream)
    yield c
    other_pool.deallocate(other)
    other_pool.close()


@dataclass
class Row:
    id: str
    call: Callable[[Ctx], Any]
    exc: type
    match: str  # regex the message must contain
    reason: Optional[str] = None  # InvalidPointerError.reason
    reason_by_pool: dict = field(default_factory=dict)  # per-pool reason where a pool knows less
    xfail: dict = field(default_factory=dict)  # pool kind -> why it fails today


NOT_A_STREAM = "stream must be None, an int handle, or an object with __cuda_stream__"

SIZE_ROWS = [
    Row("size-zero", lambda c: c.pool.allocate(0), InvalidArgumentError, r"must be positive; got 0"),
    Row("size-negative", lambda c: c.pool.allocate(-1), InvalidArgumentError, r"must be positive; got -1"),
    Row("size-very-negative", lambda c: c.pool.allocate(-(2**70)), InvalidArgumentError, r"must be positive"),
    Row("size-float", lambda c: c.pool.allocate(1.5), InvalidArgumentError, r"must be an integer.*float"),
    Row("size-integral-float", lambda c: c.pool.allocate(1024.0), InvalidArgumentError, r"must be an integer.*float"),
    Row("size-bool", lambda c: c.pool.allocate(True), InvalidArgumentError, r"must be an integer, not bool"),
    Row("size-str", lambda c: c.pool.allocate("10"), InvalidArgumentError, r"must be an integer.*str"),
    Row("size-none", lambda c: c.pool.allocate(None), InvalidArgumentError, r"must be an integer.*NoneType"),
    Row("size-2^62+1", lambda c: c.pool.allocate(2**62 + 1), InvalidArgumentError, r"absurd \(above 2\^62\)"),
    Row("size-2^64", lambda c: c.pool.allocate(2**64), InvalidArgumentError, r"absurd \(above 2\^62\)"),
    Row("size-2^80", lambda c: c.pool.allocate(2**80), InvalidArgumentError, r"absurd \(above 2\^62\)"),
]

POINTER_ROWS = [
    Row(
        "ptr-unknown",
        lambda c: c.pool.deallocate(0x3039_0000),
        InvalidPointerError,
        r"0x30390000 is not a (live )?block",
        reason="unknown",
    ),
    Row(
        "ptr-interior+256",
        lambda c: c.pool.deallocate(c.a + 256),
        InvalidPointerError,
        r"points inside the (live )?block at",
        reason="interior",
    ),
    Row(
        "ptr-interior+1",
        lambda c: c.pool.deallocate(c.a + 1),
        InvalidPointerError,
        r"points inside the (live )?block at .*offset 1\)",
        reason="interior",
    ),
    Row(
        "ptr-double-free",
        lambda c: c.pool.deallocate(c.freed),
        InvalidPointerError,
        r"already freed",
        reason="double_free",
        # Direct gives every freed block back to the upstream, which may hand the address out
        # again: it cannot tell a double free from an unknown pointer, and says so.
        reason_by_pool={"direct": "unknown"},
    ),
    Row(
        "ptr-other-pool",
        lambda c: c.pool.deallocate(c.other),
        InvalidPointerError,
        r"belongs to \w+ #\d+, not to \w+ #\d+",
        reason="other_pool",
    ),
    Row("ptr-negative", lambda c: c.pool.deallocate(-4096), InvalidPointerError, r"negative", reason="unknown"),
    Row("ptr-2^64", lambda c: c.pool.deallocate(2**64), InvalidPointerError, r"not an address", reason="unknown"),
    Row("ptr-2^64-1", lambda c: c.pool.deallocate(2**64 - 1), InvalidPointerError, r"not an address", reason="unknown"),
    Row("ptr-float", lambda c: c.pool.deallocate(float(c.a)), InvalidArgumentError, r"ptr must be an integer.*float"),
    Row("ptr-str", lambda c: c.pool.deallocate(hex(c.a)), InvalidArgumentError, r"ptr must be an integer.*str"),
    Row("ptr-bool", lambda c: c.pool.deallocate(True), InvalidArgumentError, r"ptr must be an integer, not bool"),
    Row("ptr-none", lambda c: c.pool.deallocate(None), InvalidArgumentError, r"ptr must be an integer.*NoneType"),
    Row(
        "record-stream-unknown-ptr",
        lambda c: c.pool.record_stream(0x3039_0000, c.stream),
        InvalidPointerError,
        r"record_stream: 0x30390000 is not (a )?live",
        reason="unknown",
    ),
    Row(
        "record-stream-freed-ptr",
        lambda c: c.pool.record_stream(c.freed, c.stream),
        InvalidPointerError,
        r"record_stream: 0x[0-9a-f]+ is not (a )?live",
        reason="unknown",
    ),
]


def _stream_rows(name: str, call: Callable[[Ctx, Any], Any]) -> list[Row]:
    return [
        Row(f"{name}-stream-str", lambda c: call(c, "stream0"), InvalidStreamError, NOT_A_STREAM + r".*got <class 'str'>"),
        Row(f"{name}-stream-float", lambda c: call(c, 1.0), InvalidStreamError, NOT_A_STREAM + r".*got <class 'float'>"),
        Row(f"{name}-stream-object", lambda c: call(c, object()), InvalidStreamError, NOT_A_STREAM + r".*got <class 'object'>"),
        Row(f"{name}-stream-bool", lambda c: call(c, True), InvalidStreamError, NOT_A_STREAM + r".*got <class 'bool'>"),
        Row(f"{name}-stream-negative", lambda c: call(c, -1), InvalidStreamError, r"stream -1 is not a stream handle"),
        Row(f"{name}-stream-2^64", lambda c: call(c, 2**64), InvalidStreamError, r"is not a stream handle"),
        # 2^64-1 is the core's own "no stream" sentinel: refused as a handle, never taken as None.
        Row(f"{name}-stream-2^64-1", lambda c: call(c, 2**64 - 1), InvalidStreamError, r"is not a stream handle"),
        # The stream protocol's version was ignored: (1, handle) was read as (0, handle).
        Row(f"{name}-stream-protocol-v1", lambda c: call(c, _Proto((1, 5))), InvalidStreamError, r"protocol version 1"),
        Row(f"{name}-stream-protocol-v-str", lambda c: call(c, _Proto(("0", 5))), InvalidStreamError, r"protocol version '0'"),
        Row(f"{name}-stream-protocol-v-bad-repr", lambda c: call(c, _Proto((_BadRepr(), 5))), InvalidStreamError,
            r"protocol version of type"),
    ]


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr boom")


class _Proto:
    """An object speaking the CUDA stream protocol with a given answer."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def __cuda_stream__(self) -> Any:
        return self.answer


STREAM_ROWS = (
    _stream_rows("allocate", lambda c, s: c.pool.allocate(1000, s))
    + _stream_rows("deallocate", lambda c, s: c.pool.deallocate(c.a, s))
    + _stream_rows("record_stream", lambda c, s: c.pool.record_stream(c.a, s))
    + [
        Row(
            "record_stream-stream-none",
            lambda c: c.pool.record_stream(c.a, None),
            InvalidStreamError,
            r"record_stream needs a stream, not None",
        )
    ]
)

ROWS = SIZE_ROWS + POINTER_ROWS + STREAM_ROWS


def _apply_xfail(request, row: Row, pool_kind: str) -> None:
    if pool_kind in row.xfail:
        request.applymarker(pytest.mark.xfail(strict=True, reason=row.xfail[pool_kind]))
    # (every row passes now; the field stays for a future known breach)


def _full_state(pool) -> dict:
    # Everything stats() says except derived floats: a refused call must not move any of it.
    st = pool.stats()
    st.pop("fragmentation")
    return st


def _still_serves(c: Ctx) -> None:
    c.pool.validate()
    check_equation(c.pool.stats())
    p = c.oracle.allocate(4000)
    c.oracle.check()
    c.oracle.deallocate(p)
    c.oracle.check(snapshot=True)
    # The blocks alive before the refused call are intact and can be freed; the other pool's
    # block is still its own.
    assert c.other_pool.owns(c.other)
    c.other_pool.validate()
    c.oracle.free_all()
    c.pool.close()
    assert c.pool.upstream.counters()["outstanding_bytes"] == c.other_pool.stats()["reserved_bytes"]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_refused_with_a_typed_error_and_changes_nothing(row: Row, ctx: Ctx, pool_kind, request):
    _apply_xfail(request, row, pool_kind)
    before = _full_state(ctx.pool)
    with pytest.raises(Exception) as ei:
        row.call(ctx)
    e = ei.value
    assert type(e) is row.exc, f"{type(e).__name__}: {e}"
    assert ei.match(row.match)
    if row.exc is InvalidPointerError:
        assert e.reason == row.reason_by_pool.get(pool_kind, row.reason), (e.reason, str(e))
    assert _full_state(ctx.pool) == before
    _still_serves(ctx)


# ---------------------------------------------------------------------------------- after close

CLOSED_ROWS = [
    Row("closed-allocate", lambda c: c.pool.allocate(1000), PoolClosedError, r"#\d+ is closed"),
    Row("closed-allocate-stream", lambda c: c.pool.allocate(1000, c.stream), PoolClosedError, r"#\d+ is closed"),
    Row("closed-deallocate", lambda c: c.pool.deallocate(c.a), PoolClosedError, r"#\d+ is closed"),
    Row("closed-deallocate-stream", lambda c: c.pool.deallocate(c.a, c.stream), PoolClosedError, r"#\d+ is closed"),
    Row(
        "closed-record_stream",
        lambda c: c.pool.record_stream(c.a, c.stream),
        PoolClosedError,
        r"#\d+ is closed",
    ),
]


@pytest.mark.parametrize("row", CLOSED_ROWS, ids=[r.id for r in CLOSED_ROWS])
def test_use_after_close_is_refused(row: Row, ctx: Ctx, pool_kind, request):
    _apply_xfail(request, row, pool_kind)
    ctx.oracle.free_all()
    ctx.pool.close()
    before = _full_state(ctx.pool)
    with pytest.raises(Exception) as ei:
        row.call(ctx)
    assert type(ei.value) is row.exc, f"{type(ei.value).__name__}: {ei.value}"
    assert ei.match(row.match)
    assert _full_state(ctx.pool) == before
    ctx.pool.validate()
    ctx.pool.close()  # still closed, still idempotent
    assert ctx.pool.upstream.counters()["outstanding_bytes"] == ctx.other_pool.stats()["reserved_bytes"]


# ---------------------------------------------------------------------------------- boundary

def test_the_largest_legal_size_is_an_oom_not_a_crash(ctx: Ctx):
    # 2^62 passes the argument check; no upstream has it. The pool recovers (may trim) and says so.
    with pytest.raises(pk.OutOfMemoryError) as ei:
        ctx.pool.allocate(2**62)
    assert ei.value.requested == 2**62
    assert "out of memory" in str(ei.value)
    ctx.oracle.check(snapshot=True)
    _still_serves(ctx)


# ---------------------------------------------------------------------------------- construction

CTOR_ROWS = [
    ("alignment-3", dict(alignment=3), InvalidArgumentError, r"alignment must be a power of two; got 3", ()),
    ("alignment-100", dict(alignment=100), InvalidArgumentError, r"power of two; got 100", ()),
    ("alignment-0", dict(alignment=0), InvalidArgumentError, r"power of two; got 0", ()),
    ("alignment-negative", dict(alignment=-256), InvalidArgumentError, r"alignment must be positive", ()),
    ("alignment-float", dict(alignment=256.0), InvalidArgumentError, r"alignment must be an integer", ()),
    ("alignment-2^70", dict(alignment=2**70), InvalidArgumentError, r"alignment .* is absurd", ()),
    ("limit-negative", dict(limit=-1), InvalidArgumentError, r"limit must be positive", ()),
    ("limit-2^70", dict(limit=2**70), InvalidArgumentError, r"limit .* is absurd",
     ("direct", "size_class", "arena")),
    ("unknown-option", dict(bogus=1), InvalidArgumentError, r"unknown option 'bogus' \(valid: .*alignment", ()),
]
CTOR_XFAIL = {
    "limit-2^70": "options that allow 0 are read with nb::cast<long long> first: RuntimeError std::bad_cast",
}
KIND_CTOR_ROWS = [
    ("size_class", "classes-per-doubling-3", dict(classes_per_doubling=3), InvalidArgumentError, r"1, 2, 4 or 8; got 3"),
    ("arena", "growth-factor-str", dict(growth_factor="fast"), InvalidArgumentError, r"growth_factor"),
    ("arena", "thread-cache-negative", dict(thread_cache_bytes=-1), InvalidArgumentError, r"thread_cache_bytes must be positive"),
]


def _ctor_case(request, upstream, pool_kind, kwargs, exc, match):
    before = upstream.counters()
    with pytest.raises(Exception) as ei:
        pk.make_pool(pool_kind, upstream, **kwargs)
    assert type(ei.value) is exc, f"{type(ei.value).__name__}: {ei.value}"
    assert ei.match(match)
    assert upstream.counters() == before  # nothing was allocated for a pool that never existed
    with pk.make_pool(pool_kind, upstream) as ok:  # the upstream still serves a good pool
        ok.deallocate(ok.allocate(100))


@pytest.mark.parametrize("row", CTOR_ROWS, ids=[r[0] for r in CTOR_ROWS])
def test_bad_options_are_refused_at_construction(row, upstream, pool_kind, request):
    name, kwargs, exc, match, _fixed = row
    _ctor_case(request, upstream, pool_kind, kwargs, exc, match)


@pytest.mark.parametrize("row", KIND_CTOR_ROWS, ids=[r[1] for r in KIND_CTOR_ROWS])
def test_pool_specific_bad_options_are_refused(row, upstream, request):
    kind, name, kwargs, exc, match = row
    _ctor_case(request, upstream, kind, kwargs, exc, match)


@pytest.mark.parametrize("bad_upstream", [None, "host"], ids=["none", "str"])
@pytest.mark.filterwarnings("ignore:nanobind:RuntimeWarning")  # repr of the half-built pool in the traceback
def test_a_pool_needs_an_upstream(pool_kind, bad_upstream):
    with pytest.raises(InvalidArgumentError, match="upstream"):
        pk.make_pool(pool_kind, bad_upstream)


def test_unknown_pool_kind():
    with pytest.raises(InvalidArgumentError, match=r"unknown pool kind 'slab' \(valid: direct, size_class, arena, arena_expandable\)"):
        pk.make_pool("slab", pk.upstream.Host())


# ---------------------------------------------------------------------------------- sentinels
# The pointer table uses key 0 for an empty slot and key 1 for a tombstone. A lookup of those
# keys must never match a slot: null must be refused as null, 1 as unknown, owns() must say no.
# After churn (frees leave tombstones), pointer 1 walks into them. Simulated addresses make the
# table layout, and so each row, deterministic.

SENTINEL_SCRIPT = textwrap.dedent(
    """
    import sys
    import poolkeeper as pk
    from poolkeeper.errors import InvalidPointerError
    kind, op, bad = sys.argv[1], sys.argv[2], int(sys.argv[3])
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.make_pool(kind, up)
    keep = [pool.allocate(1000) for _ in range(3)]
    def state():
        st = pool.stats()
        st.pop("fragmentation")
        return st
    for n in range(1, 40):
        xs = [pool.allocate(256 * (1 + i % 7)) for i in range(n)]
        for x in xs:
            pool.deallocate(x)
        if kind == "arena":
            pool.flush_thread_cache()
        pool.trim()
        before = state()
        if op == "owns":
            assert pool.owns(bad) is False, f"round {n}: owns({bad}) is True"
        else:
            want = "null" if (bad == 0 and op == "free") else "unknown"
            try:
                pool.deallocate(bad) if op == "free" else pool.record_stream(bad, 5)
            except InvalidPointerError as e:
                assert e.reason == want, f"round {n}: reason {e.reason!r}, want {want!r}: {e}"
            else:
                raise AssertionError(f"round {n}: {op}({bad}) raised nothing")
        assert state() == before, f"round {n}: state changed"
        pool.validate()
    for p in keep:
        pool.deallocate(p)
    pool.close()
    print("SENTINEL-OK")
    """
)

_SEGV = "segfault: the lookup matched an empty slot and used its null record"
_STALE = "the lookup matched a tombstone and used a stale (destroyed) record"
SENTINEL_ROWS = [
    # (op, pointer, {pool: why it fails today})
    ("free", 0, {"arena": "try_deallocate_fast looks 0 up in the table: " + _SEGV}),
    ("free", 1, {"direct": _STALE + " (freed it upstream: UpstreamError)", "size_class": _STALE + " (reason 'double_free')"}),
    ("record_stream", 0, {k: _SEGV for k in ("direct", "size_class", "arena")}),
    ("record_stream", 1, {"direct": _STALE + " (and wrote to it)"}),
    ("owns", 0, {"direct": "owns(0) is True: " + _SEGV.split(":")[1], "size_class": _SEGV, "arena": _SEGV}),
    ("owns", 1, {"direct": "owns(1) is True: " + _STALE}),
]


@pytest.mark.parametrize("op,bad,failing", SENTINEL_ROWS, ids=[f"{r[0]}-{r[1]}" for r in SENTINEL_ROWS])
def test_table_sentinel_pointers_are_refused(pool_kind, op, bad, failing, request):
    # `failing` names how each pool broke before the pointer table refused its sentinel keys
    # (regression: 0 matched an empty slot, 1 a tombstone).
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    r = subprocess.run(
        [sys.executable, "-c", SENTINEL_SCRIPT, pool_kind, {"record_stream": "rs"}.get(op, op), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0 and "SENTINEL-OK" in r.stdout, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"


# ---------------------------------------------------------------------------------- stale pointers

def test_arena_double_free_after_coalescing_is_called_a_double_free():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0), thread_cache_bytes=0)
    a, b, keep = pool.allocate(1000), pool.allocate(1000), pool.allocate(1000)
    pool.deallocate(a)
    pool.deallocate(b)
    pool.trim()  # settles: a and b merge into one free chunk starting at a
    before = _full_state(pool)
    with pytest.raises(InvalidPointerError) as ei:
        pool.deallocate(b)
    assert _full_state(pool) == before
    pool.validate()
    assert ei.value.reason == "double_free", str(ei.value)
    assert "free the block's start address" not in str(ei.value)


def test_stream_protocol_version_0_in_any_integer_type_is_read():
    # The version check must not refuse a 0 that is not exactly an int (an IntEnum, an int
    # subclass): found by hostile probing of the check itself.
    import enum

    class V(enum.IntEnum):
        ZERO = 0

    class Int(int):
        pass

    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    for v in (0, V.ZERO, Int(0)):
        pool.deallocate(pool.allocate(1000, _Proto((v, 0))), _Proto((v, 0)))
    pool.synchronize()
    pool.validate()
    pool.close()
