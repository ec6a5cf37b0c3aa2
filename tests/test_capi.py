"""The C ABI (PyTorch's pluggable-allocator entry points and the general ones), driven through
ctypes over a pool installed in the process-wide registry, for every pool kind.

No C++ exception may cross the boundary: a failure is NULL or a nonzero code plus a message in
poolkeeper_last_error() (thread-local), and the pool is left exactly as it was.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

import poolkeeper as pk
from poolkeeper import _core
import capi_lib
from capi_lib import CLOSED, INVALID_ARGUMENT, INVALID_POINTER, NO_STREAM, OK, last_error
from pool_oracle import Oracle, check_equation, cookie_bytes

KiB, MiB = 1 << 10, 1 << 20
HOST = -1  # the registry slot these tests install into


@pytest.fixture(scope="module")
def lib():
    return capi_lib.load()


@pytest.fixture
def installed(make_pool):
    pool = make_pool(pk.upstream.Host())
    _core.registry_set(HOST, pool)
    yield pool
    _core.registry_set(HOST, None)


def _state(pool) -> dict:
    st = pool.stats()
    st.pop("fragmentation")
    return st


def test_symbols_are_exported(lib):
    for name in capi_lib.SYMBOLS:
        assert hasattr(lib, name), f"{name} is not exported from {_core.__file__}"


def test_malloc_and_free_use_the_installed_pool(lib, installed):
    assert _core.registry_get(HOST) is not None
    ptrs = []
    for i, n in enumerate((1, 1000, 70 * KiB, 2 * MiB)):
        p = lib.poolkeeper_malloc(n, HOST, NO_STREAM)
        assert p and p % installed.alignment == 0
        assert installed.owns(p)
        ctypes.memmove(p, cookie_bytes(i, n), n)
        ptrs.append((p, n, i))
    st = installed.stats()
    assert st["live_blocks"] == 4 and st["live_bytes"] == 1 + 1000 + 70 * KiB + 2 * MiB
    check_equation(st)
    for p, n, i in ptrs:
        assert ctypes.string_at(p, n) == cookie_bytes(i, n)
        assert lib.poolkeeper_free(p, HOST, NO_STREAM) == OK
    st = installed.stats()
    assert st["live_blocks"] == 0 and st["live_bytes"] == 0
    installed.validate()


def test_torch_entry_points_use_the_installed_pool(lib, installed):
    p = lib.poolkeeper_torch_malloc(5000, HOST, None)
    assert p and installed.owns(p)
    assert installed.stats()["live_bytes"] == 5000
    # A NULL stream is the legacy default stream: a real stream, so the release is stream-ordered.
    lib.poolkeeper_torch_free(p, 5000, HOST, None)
    installed.synchronize()
    st = installed.stats()
    assert st["live_blocks"] == 0 and st["pending_bytes"] == 0
    check_equation(st)
    installed.validate()


def test_the_stream_argument_reaches_the_pool(lib, make_pool, pool_kind):
    sim = pk.upstream.Simulated(latency_us=0)
    pool = make_pool(sim)
    _core.registry_set(HOST, pool)
    try:
        s = sim.stream()
        p = lib.poolkeeper_malloc(4096, HOST, s)
        snap = pool.snapshot()
        (chunk,) = [c for b in snap.backings for c in b.chunks if c.state == "live"]
        assert chunk.alloc_stream == s
        sim.enqueue(s, 100.0)  # the stream still uses the block
        assert lib.poolkeeper_free(p, HOST, s) == OK
        if pool_kind != "direct":  # Direct holds nothing: its release goes straight upstream
            assert pool.stats()["pending_bytes"] > 0
        pool.synchronize()
        assert pool.stats()["pending_bytes"] == 0
        pool.validate()
    finally:
        _core.registry_set(HOST, None)


def test_size_zero(lib, installed):
    before = _state(installed)
    assert lib.poolkeeper_torch_malloc(0, HOST, None) is None  # PyTorch's empty tensors
    assert lib.poolkeeper_malloc(0, HOST, NO_STREAM) is None
    assert re.search(r"must be positive; got 0", last_error(lib))
    assert _state(installed) == before
    installed.validate()


def test_torch_free_of_null_is_a_no_op(lib, installed):
    before = _state(installed)
    lib.poolkeeper_torch_free(None, 0, HOST, None)
    lib.poolkeeper_torch_free(None, 123, HOST, ctypes.c_void_p(7))
    assert _state(installed) == before
    installed.validate()


@pytest.mark.parametrize("n", [2**62 + 1, 2**63, 2**64 - 1], ids=["2^62+1", "2^63", "2^64-1 (a negative size_t)"])
def test_absurd_sizes_return_null_with_a_message(lib, installed, n):
    before = _state(installed)
    assert lib.poolkeeper_malloc(n, HOST, NO_STREAM) is None
    assert re.search(r"absurd \(above 2\^62\)", last_error(lib))
    assert lib.poolkeeper_torch_malloc(n, HOST, None) is None
    assert _state(installed) == before
    installed.validate()


# ---------------------------------------------------------------------------------- bad pointers


@pytest.fixture
def blocks(lib, installed, make_pool):
    """A live block, a freed one and another pool's block (the other pool shares nothing)."""
    other_pool = make_pool(pk.upstream.Host())
    other = other_pool.allocate(1000)  # before the free below, so it cannot take the freed address
    a = lib.poolkeeper_malloc(1000, HOST, NO_STREAM)
    freed = lib.poolkeeper_malloc(3000, HOST, NO_STREAM)
    assert lib.poolkeeper_free(freed, HOST, NO_STREAM) == OK
    yield dict(a=a, freed=freed, other=other, other_pool=other_pool)
    other_pool.deallocate(other)
    other_pool.close()


BAD_POINTERS = [
    ("unknown", lambda b: 0x3039_0000, r"0x30390000 is not a (live )?block", {}),
    ("interior+256", lambda b: b["a"] + 256, r"points inside the (live )?block at", {}),
    ("interior+1", lambda b: b["a"] + 1, r"points inside the (live )?block at .*offset 1\)", {}),
    ("double-free", lambda b: b["freed"], r"already freed", {}),
    ("other-pool", lambda b: b["other"], r"belongs to \w+ #\d+, not to \w+ #\d+", {}),
    ("high-address", lambda b: 2**64 - 4096, r"0xfffffffffffff000 is not a (live )?block", {}),
]


@pytest.mark.parametrize("name,ptr,match,xfail", BAD_POINTERS, ids=[r[0] for r in BAD_POINTERS])
def test_bad_pointers_return_an_error_code_and_change_nothing(lib, installed, blocks, pool_kind, request,
                                                              name, ptr, match, xfail):
    if pool_kind in xfail:
        request.applymarker(pytest.mark.xfail(strict=True, reason=xfail[pool_kind]))
    p = ptr(blocks)
    before = _state(installed)
    assert lib.poolkeeper_free(p, HOST, NO_STREAM) == INVALID_POINTER
    assert re.search(match, last_error(lib)), last_error(lib)
    # The PyTorch hook has no return code: the failure is swallowed, its message kept.
    lib.poolkeeper_torch_free(p, 1000, HOST, None)
    assert re.search(match, last_error(lib)), last_error(lib)
    assert _state(installed) == before
    installed.validate()
    assert blocks["other_pool"].owns(blocks["other"])
    # Still serving; the live block frees normally.
    q = lib.poolkeeper_malloc(4000, HOST, NO_STREAM)
    assert q and lib.poolkeeper_free(q, HOST, NO_STREAM) == OK
    assert lib.poolkeeper_free(blocks["a"], HOST, NO_STREAM) == OK
    installed.validate()
    assert installed.stats()["live_blocks"] == 0


def test_record_stream_hook(lib, installed, blocks):
    a = blocks["a"]
    assert lib.poolkeeper_torch_record_stream(a, HOST, ctypes.c_void_p(7)) == OK
    before = _state(installed)
    assert lib.poolkeeper_torch_record_stream(0x3039_0000, HOST, ctypes.c_void_p(7)) == INVALID_POINTER
    assert re.search(r"record_stream: 0x30390000 is not (a )?live", last_error(lib))
    assert _state(installed) == before
    lib.poolkeeper_torch_free(a, 1000, HOST, None)  # released on stream 0, also waits for 7
    installed.synchronize()
    st = installed.stats()
    assert st["live_blocks"] == 0 and st["pending_bytes"] == 0
    installed.validate()


def test_empty_cache_trims_the_installed_pools(lib, installed):
    ptrs = [lib.poolkeeper_malloc(n, HOST, NO_STREAM) for n in (1000, 70 * KiB, 2 * MiB, 3 * MiB)]
    for p in ptrs:
        assert lib.poolkeeper_free(p, HOST, NO_STREAM) == OK
    installed.synchronize()
    before = installed.stats()["reserved_bytes"]
    released = lib.poolkeeper_empty_cache()
    after = installed.stats()["reserved_bytes"]
    assert released == before - after >= 0
    assert all(b.resident for b in installed.snapshot().backings)
    installed.validate()


# ---------------------------------------------------------------------------------- registry


@pytest.mark.parametrize("device", [-1, -100, 64, 2**31 - 1])
def test_regression_graph_release_of_a_device_that_cannot_exist_returned_ok(lib, device):
    # poolkeeper_graph_release answered 0 ("nothing to release") for a device index outside
    # [0, 64), where poolkeeper_graph_begin and _end answer 1 (invalid argument) with a message.
    # The three agree now; an id a real device never used is still 0 (PyTorch releases those).
    assert lib.poolkeeper_graph_end(device, 1, 0) == INVALID_ARGUMENT
    assert lib.poolkeeper_graph_release(device, 1, 0) == INVALID_ARGUMENT
    assert f"device index {device} out of range" in last_error(lib)
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"))
    try:
        _core.registry_set(0, pool)
        assert lib.poolkeeper_graph_release(0, 12345, 0) == OK
    finally:
        _core.registry_clear()
    pool.validate()


def test_regression_the_torch_empty_cache_hook_stopped_at_a_closed_pool(lib):
    # Found by hostile probing: PyTorch's empty_cache hook trimmed the installed pools in one try
    # block, and a closed pool's trim() refused: every pool after it kept its free memory.
    # poolkeeper_empty_cache already skipped closed pools; the hook does the same now.
    hook = ctypes.CDLL(_core.__file__).poolkeeper_torch_empty_cache_hook
    closed = pk.ArenaPool(pk.upstream.Host())
    closed.close()
    rest = [pk.ArenaPool(pk.upstream.Host(), thread_cache_bytes=0) for _ in range(2)]
    try:
        for device, pool in enumerate([closed] + rest):
            _core.registry_set(device, pool)
        for device in (1, 2):
            ptrs = [lib.poolkeeper_malloc(3 * MiB, device, NO_STREAM) for _ in range(4)]
            for p in ptrs:
                assert lib.poolkeeper_free(p, device, NO_STREAM) == OK
        before = [p.stats()["reserved_bytes"] for p in rest]
        hook()
        after = [p.stats()["reserved_bytes"] for p in rest]
        assert all(a < b for a, b in zip(after, before)), (before, after)
        for p in rest:
            p.validate()
    finally:
        _core.registry_clear()


def test_no_pool_installed(lib):
    _core.registry_set(HOST, None)
    assert lib.poolkeeper_malloc(1000, HOST, NO_STREAM) is None
    assert "no poolkeeper pool is installed for device -1" in last_error(lib)
    assert lib.poolkeeper_torch_malloc(1000, HOST, None) is None
    assert lib.poolkeeper_free(0x1000, HOST, NO_STREAM) == INVALID_ARGUMENT
    assert "no poolkeeper pool is installed" in last_error(lib)
    lib.poolkeeper_torch_free(ctypes.c_void_p(0x1000), 1000, HOST, None)  # no pool: nothing to do, no crash
    assert lib.poolkeeper_torch_record_stream(0x1000, HOST, None) == INVALID_ARGUMENT


@pytest.mark.parametrize("device", [-2, 64, 1 << 30])
def test_device_index_out_of_range(lib, installed, device):
    assert lib.poolkeeper_malloc(1000, device, NO_STREAM) is None
    assert re.search(rf"device index {device} out of range \[-1, 64\)", last_error(lib))
    assert lib.poolkeeper_free(0x1000, device, NO_STREAM) == INVALID_ARGUMENT


def test_use_after_close_through_the_c_abi(lib, installed):
    p = lib.poolkeeper_malloc(1000, HOST, NO_STREAM)
    assert lib.poolkeeper_free(p, HOST, NO_STREAM) == OK
    installed.close()
    assert lib.poolkeeper_malloc(1000, HOST, NO_STREAM) is None
    assert re.search(r"#\d+ is closed", last_error(lib))
    assert lib.poolkeeper_free(p, HOST, NO_STREAM) == CLOSED
    assert installed.upstream.counters()["outstanding_bytes"] == 0


def test_last_error_is_per_thread(lib, installed):
    assert lib.poolkeeper_malloc(0, HOST, NO_STREAM) is None
    mine = last_error(lib)
    seen = []

    def other():
        lib.poolkeeper_free(0x3039_0000, HOST, NO_STREAM)
        seen.append(last_error(lib))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert "0x30390000" in seen[0]
    assert last_error(lib) == mine  # another thread's failure did not overwrite this thread's message


def test_oracle_run_through_the_c_abi(lib, installed):
    # A seeded mixed run through the C entry points, checked like the Python conformance runs.
    import random

    class CAbiPool:  # the oracle's view of the pool, with allocate/deallocate going through C
        def __init__(self, pool):
            self.pool = pool
            self.alignment = pool.alignment
            self.upstream = pool.upstream

        def allocate(self, n, stream=None):
            p = lib.poolkeeper_malloc(n, HOST, NO_STREAM)
            assert p, last_error(lib)
            return p

        def deallocate(self, p, stream=None):
            assert lib.poolkeeper_free(p, HOST, NO_STREAM) == OK, last_error(lib)

        def __getattr__(self, name):
            return getattr(self.pool, name)

    o = Oracle(CAbiPool(installed))
    rng = random.Random(5)
    for step in range(600):
        if o.live and (len(o.live) > 30 or rng.random() < 0.45):
            o.deallocate(rng.choice(o.starts))
        else:
            o.allocate(rng.choice([1, 255, 256, 257, 4096, 4096, 70 * KiB, MiB - 1, MiB + 1, rng.randint(1, 200_000)]))
        o.check(snapshot=step % 100 == 0)
    o.free_all()
    o.check(snapshot=True)


# ---------------------------------------------------------------------------------- NULL
# Rows that crash today run in a child process (a segfault fails the row, not the session).

NULL_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, sys.argv[3])
    import poolkeeper as pk
    from poolkeeper import _core
    import capi_lib
    lib = capi_lib.load()
    kind, op = sys.argv[1], sys.argv[2]
    pool = pk.make_pool(kind, pk.upstream.Simulated(latency_us=0))
    _core.registry_set(-1, pool)
    keep = lib.poolkeeper_malloc(1000, -1, capi_lib.NO_STREAM)
    before = pool.stats()
    if op == "free":
        rc = lib.poolkeeper_free(None, -1, capi_lib.NO_STREAM)
        assert rc == capi_lib.INVALID_POINTER, rc
        assert "null" in capi_lib.last_error(lib), capi_lib.last_error(lib)
    else:
        rc = lib.poolkeeper_torch_record_stream(None, -1, ctypes.c_void_p(7))
        assert rc == capi_lib.INVALID_POINTER, rc
    assert pool.stats() == before
    pool.validate()
    assert lib.poolkeeper_free(keep, -1, capi_lib.NO_STREAM) == 0
    _core.registry_set(-1, None)
    print("NULL-OK")
    """
)
NULL_XFAIL = {
    ("free", "arena"): "ArenaPool::try_deallocate_fast looks NULL up in the pointer table (0 is its empty key): segfault",
    ("record_stream", "direct"): "record_stream looks NULL up in the pointer table (0 is its empty key): segfault",
    ("record_stream", "size_class"): "record_stream looks NULL up in the pointer table (0 is its empty key): segfault",
    ("record_stream", "arena"): "record_stream looks NULL up in the pointer table (0 is its empty key): segfault",
}


@pytest.mark.parametrize("op", ["free", "record_stream"])
def test_null_pointer_is_an_error_code(pool_kind, op, request):
    # NULL_XFAIL records how these broke before the pointer table refused key 0 (regression).
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", NULL_SCRIPT, pool_kind, op, here], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert r.returncode == 0 and "NULL-OK" in r.stdout, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
