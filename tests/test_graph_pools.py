"""CUDA-graph private pools and capture-safe paths, on the simulated device.

The simulated device models CUDA's capture rules (SimulatedUpstream.begin_capture): while a
stream is captured, a call that would invalidate the capture on a GPU -- a cuMemAlloc-like call
from a thread not in relaxed mode during a global-mode capture, anything that synchronizes the
device, an event recorded on the capturing stream -- is counted in ``capture_violations``. Every
test here asserts zero violations, the graph-pool bookkeeping, and ``validate()`` after each step.
"""
from __future__ import annotations

import ctypes
import threading

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError

from capi_lib import load as load_capi

MiB = 1 << 20
G1 = (1, 0)
G2 = (2, 0)
SHARED = (0, 7)  # what torch.cuda.graph_pool_handle() gives: second element nonzero


def make(kind="arena", **opts):
    sim = pk.upstream.Simulated(latency="none")
    pool = pk.make_pool(kind, sim, **opts) if kind != "arena" else pk.ArenaPool(sim, **opts)
    return sim, pool, _core.GraphPools(pool)


def check(sim, pool, gp):
    assert sim.capture_violations == 0, sim.last_capture_violation
    gp.validate()
    pool.validate()


def capture(sim, gp, gid, s, body):
    """What torch.cuda.graph does: begin the pool scope, capture, end the capture, end the scope."""
    gp.begin(gid, s)
    sim.begin_capture(s)  # global mode, PyTorch's default
    try:
        out = body()
    finally:
        valid = sim.end_capture(s)
        gp.end(gid)
    assert valid, sim.last_capture_violation
    return out


def test_intermediate_freed_inside_capture_is_reused_only_inside_it():
    sim, pool, gp = make()
    s = sim.stream()

    def body():
        x = gp.allocate(64 * 1024, s)
        h = gp.allocate(256 * 1024, s)  # intermediate
        gp.deallocate(h, s)
        y = gp.allocate(256 * 1024, s)  # same capture, same stream: may reuse h
        return x, h, y

    x, h, y = capture(sim, gp, G1, s, body)
    check(sim, pool, gp)
    assert y == h  # reused inside the capture
    assert gp.owns_private(x) and gp.owns_private(y)
    # Work outside the capture, on the same stream, never gets the graph's memory, freed or not.
    outside = [gp.allocate(256 * 1024, s) for _ in range(64)]
    assert not set(outside) & {x, h, y}
    for p in outside:
        assert not gp.owns_private(p)
        gp.deallocate(p, s)
    check(sim, pool, gp)
    [info] = gp.info()
    assert info["id"] == G1 and info["live_blocks"] == 2 and info["uses"] == 1


def test_growth_during_capture_with_nothing_cached_keeps_the_capture_valid():
    # The device pool is empty: the private pool's first backing makes it call the upstream
    # during a global-mode capture. Without relaxed mode around the call that is a violation.
    sim, pool, gp = make()
    s = sim.stream()
    before = sim.counters()["allocations"]
    p = capture(sim, gp, G1, s, lambda: gp.allocate(3 * MiB, s))
    assert sim.counters()["allocations"] > before  # it really grew during the capture
    check(sim, pool, gp)
    gp.deallocate(p, s)
    check(sim, pool, gp)


def test_unsafe_call_during_capture_is_a_violation_without_relaxed_mode():
    # The simulated device's rule itself: a plain upstream query from a thread in global mode.
    sim = pk.upstream.Simulated(latency="none")
    s = sim.stream()
    e_stream = sim.stream()
    pool = pk.ArenaPool(sim)
    p = pool.allocate(4096, stream=e_stream)
    sim.begin_capture(s)
    prev = sim.set_capture_mode(0)
    try:
        # A Python-level direct upstream allocation goes through Upstream.allocate, which relaxes:
        q = sim.allocate(2 * MiB)
        assert sim.capture_violations == 0
        sim.deallocate(q, 2 * MiB)  # a free synchronizes: a violation in any mode
        assert sim.capture_violations == 1
    finally:
        sim.set_capture_mode(prev)
        assert sim.end_capture(s) is False
    pool.deallocate(p, stream=e_stream)


def test_no_event_is_recorded_on_a_capturing_stream_cross_stream_release_is_deferred():
    sim, pool, gp = make()
    s, other = sim.stream(), sim.stream()
    b = pool.allocate(1 * MiB, stream=other)  # allocated outside the capture on another stream

    def body():
        # Freed on the capturing stream: it must wait for `other` and for s, but no event may be
        # recorded on s while it is captured. Pressure (process_pending) during the capture too.
        gp.deallocate(b, s)
        pool.process_pending()
        return pool.stats()

    st = capture(sim, gp, G1, s, body)
    assert st["pending_bytes"] >= 1 * MiB  # still pending: no event could cover s
    check(sim, pool, gp)
    sim.synchronize()
    pool.process_pending()  # capture over: the deferred events are recorded and complete
    assert pool.stats()["pending_bytes"] == 0
    check(sim, pool, gp)


def test_record_stream_during_and_outside_capture():
    sim, pool, gp = make()
    s, side = sim.stream(), sim.stream()
    a = gp.allocate(1 * MiB, side)  # outside any capture
    gp.record_stream(a, side)

    def body():
        c = gp.allocate(512 * 1024, s)
        gp.record_stream(c, side)  # a graph block used on another stream
        gp.record_stream(a, s)  # a device-pool block used by the graph
        gp.deallocate(c, s)
        pool.process_pending()
        return c

    c = capture(sim, gp, G1, s, body)
    check(sim, pool, gp)
    gp.deallocate(a, side)
    sim.synchronize()
    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0
    priv = gp.private_pool(G1)
    priv.process_pending()
    assert priv.stats()["pending_bytes"] == 0
    check(sim, pool, gp)


def test_trim_during_a_capture_scope_never_frees_and_empty_cache_keeps_graph_memory():
    sim, pool, gp = make()
    s = sim.stream()
    junk = [pool.allocate(8 * MiB) for _ in range(4)]
    for p in junk:
        pool.deallocate(p)

    def body():
        assert pool.trim() == 0  # a free would synchronize the device inside the capture
        return gp.allocate(5 * MiB, s)

    g = capture(sim, gp, G1, s, body)
    check(sim, pool, gp)
    graph_bytes = gp.info()[0]["stats"]["reserved_bytes"]
    assert graph_bytes >= 5 * MiB
    pool.synchronize()
    freed = pool.trim()  # torch.cuda.empty_cache(): the graph's memory is live to the device pool
    assert freed > 0
    assert pool.stats()["live_bytes"] >= graph_bytes
    assert gp.owns_private(g)
    check(sim, pool, gp)


@pytest.mark.parametrize("kind", ["direct", "logging direct", "arena", "size_class"])
def test_regression_a_direct_pools_synchronize_during_a_capture_invalidated_it(kind, c_abi, tmp_path):
    """A Direct pool's synchronize() synchronized the device whatever was under way; PyTorch's
    empty_cache hook calls it too. During a capture scope that invalidates the capture (PyTorch
    refuses empty_cache() then, a direct call did not). Now no pool's synchronize, trim or
    process_pending, nor the C ABI's empty_cache or PyTorch's hook, touches the device while a
    scope is open: Direct has nothing pending, so its synchronize waits for nothing then."""
    sim = pk.upstream.Simulated(latency="none")
    base = "direct" if "direct" in kind else kind
    pool = pk.make_pool(base, sim, log=str(tmp_path / "log.csv") if kind.startswith("logging") else None)
    gp = _core.GraphPools(pool)
    _core.registry_set(0, pool)
    s, other = sim.stream(), sim.stream()
    x = pool.allocate(MiB, other)
    pool.deallocate(x, other)

    def body():
        pool.synchronize()
        pool.process_pending()
        pool.trim()
        c_abi.poolkeeper_empty_cache()
        ctypes.CDLL(_core.__file__).poolkeeper_torch_empty_cache_hook()
        return gp.allocate(4096, s)

    g = capture(sim, gp, G1, s, body)
    pool.synchronize()  # the scope has ended: the device is waited for again
    gp.release(G1)
    gp.deallocate(g, s)
    check(sim, pool, gp)
    pk.accounting.check(pool.snapshot())


def test_regression_a_capture_scope_through_a_decorator_was_not_seen_by_pools_over_its_inner_upstream():
    """Capture scopes were counted on the upstream object they were opened through: a graph of a
    pool over Faulty(sim) capturing, a pool straight over sim saw no scope and handed memory back
    (a free synchronizes the device) and released its graph (a device synchronize) inside it. The
    count is the device's now (capture_counter): a decorator counts on its inner upstream."""
    sim = pk.upstream.Simulated(latency="none")
    plain = pk.ArenaPool(sim)
    wrapped = pk.ArenaPool(pk.upstream.Faulty(sim, armed=False))
    a, b = _core.GraphPools(wrapped), _core.GraphPools(plain)
    s1, s2 = sim.stream(), sim.stream()
    g1 = capture(sim, b, G1, s2, lambda: b.allocate(MiB, s2))
    junk = plain.allocate(8 * MiB)
    plain.deallocate(junk)
    a.begin(G2, s1)
    sim.begin_capture(s1)
    assert sim.captures_underway == 1
    a.allocate(4096, s1)
    assert plain.trim() == 0
    b.deallocate(g1, s2)
    b.release(G1)  # closing now would synchronize the device inside a's capture
    assert [i["id"] for i in b.info()] == [G1]
    assert sim.end_capture(s1), sim.last_capture_violation
    a.end(G2)
    assert b.info() == [] and plain.trim() > 0
    check(sim, plain, b)
    check(sim, wrapped, a)


def test_releasing_a_graph_returns_its_memory_to_the_device_pool():
    sim, pool, gp = make()
    s = sim.stream()
    live_before = pool.stats()["live_bytes"]

    def body():
        x = gp.allocate(3 * MiB, s)
        y = gp.allocate(1 * MiB, s)
        gp.deallocate(x, s)
        return y

    y = capture(sim, gp, G1, s, body)
    assert pool.stats()["live_bytes"] > live_before
    gp.release(G1)  # the graph is gone; its static output y is still held by the caller
    [info] = gp.info()
    assert info["released"] and info["live_blocks"] == 1
    check(sim, pool, gp)
    gp.deallocate(y, s)  # the last block: the private pool closes, its backings go home
    assert gp.info() == []
    assert pool.stats()["live_bytes"] == live_before
    assert gp.counters()["pools_closed"] == 1
    check(sim, pool, gp)
    # The memory is the device pool's again: an ordinary allocation can use it without growing.
    up_before = sim.counters()["allocations"]
    z = pool.allocate(3 * MiB)
    assert sim.counters()["allocations"] == up_before
    pool.deallocate(z)


def test_two_graphs_sharing_one_pool_handle():
    sim, pool, gp = make()
    s = sim.stream()

    def g1():
        t = gp.allocate(2 * MiB, s)
        gp.deallocate(t, s)  # graph 1's temporary
        return gp.allocate(64 * 1024, s)

    out1 = capture(sim, gp, SHARED, s, g1)
    reserved_after_g1 = gp.info()[0]["stats"]["reserved_bytes"]

    def g2():
        t = gp.allocate(1 * MiB, s)  # graph 2 reuses graph 1's freed temporary (replay order)
        gp.deallocate(t, s)
        return gp.allocate(64 * 1024, s)

    out2 = capture(sim, gp, SHARED, s, g2)
    [info] = gp.info()
    assert info["uses"] == 2
    assert info["stats"]["reserved_bytes"] == reserved_after_g1  # no growth for graph 2
    assert out1 != out2
    check(sim, pool, gp)
    gp.release(SHARED)  # graph 1 destroyed: graph 2 still uses the pool
    assert gp.info()[0]["uses"] == 1 and not gp.info()[0]["released"]
    gp.deallocate(out1, s)
    gp.deallocate(out2, s)
    assert len(gp.info()) == 1
    gp.release(SHARED)
    assert gp.info() == []
    check(sim, pool, gp)


def test_release_while_another_capture_is_under_way_waits_for_it_to_end():
    sim, pool, gp = make()
    s1, s2 = sim.stream(), sim.stream()
    capture(sim, gp, G1, s1, lambda: gp.deallocate(gp.allocate(MiB, s1), s1))
    gp.begin(G2, s2)
    sim.begin_capture(s2)
    gp.release(G1)  # closing now would synchronize the device inside G2's capture
    assert [i["id"] for i in gp.info()] == [G1, G2]
    gp.allocate(4096, s2)
    assert sim.end_capture(s2)
    gp.end(G2)  # the last scope ends: G1 closes now
    assert [i["id"] for i in gp.info()] == [G2]
    check(sim, pool, gp)


@pytest.mark.parametrize("layout", ["one pool", "one upstream"])
def test_regression_a_graph_released_during_another_graph_pools_capture_invalidated_it(layout):
    # Found by hostile probing: a release waited only for its own GraphPools's capture scopes, so
    # a graph of one GraphPools released (its block freed) while another GraphPools over the same
    # pool or upstream was capturing (two callers' GraphPools over one pool; a pool swap behind
    # the C ABI, below) synchronized the device inside that capture: on a GPU the capture fails.
    sim = pk.upstream.Simulated(latency="none")
    pool_a = pk.ArenaPool(sim)
    pool_b = pool_a if layout == "one pool" else pk.ArenaPool(sim)
    a, b = _core.GraphPools(pool_a), _core.GraphPools(pool_b)
    s1, s2 = sim.stream(), sim.stream()
    g1 = capture(sim, b, G1, s2, lambda: b.allocate(MiB, s2))
    a.begin(G2, s1)
    sim.begin_capture(s1)
    a.allocate(4096, s1)
    b.deallocate(g1, s2)
    b.release(G1)  # closing now would synchronize the device inside a's capture
    assert [i["id"] for i in b.info()] == [G1]
    assert sim.end_capture(s1), sim.last_capture_violation
    a.end(G2)  # the last scope on the upstream ends: b's G1 closes now
    assert b.info() == [] and b.counters()["pools_closed"] == 1
    check(sim, pool_a, a)
    check(sim, pool_b, b)


def test_regression_a_graph_released_during_a_capture_after_a_pool_swap_invalidated_it(c_abi):
    # The same through the C ABI: a graph captured before the device pool was replaced (by a pool
    # over the same upstream) is released while a new capture is under way.
    lib = c_abi
    # Relative: pools another test retired (over other upstreams) may still wait for their graphs.
    retired_before = _core.registry_retired()["graph_pools"]
    sim = pk.upstream.Simulated(latency="none")
    old, new = pk.ArenaPool(sim), pk.ArenaPool(sim)
    _core.registry_set(0, old)
    s1, s2 = sim.stream(), sim.stream()
    assert lib.poolkeeper_graph_begin(0, 1, 0, s1) == 0
    p = lib.poolkeeper_malloc(100_000, 0, s1)
    assert p and lib.poolkeeper_graph_end(0, 1, 0) == 0
    _core.registry_set(0, new)
    assert lib.poolkeeper_graph_begin(0, 2, 0, s2) == 0
    sim.begin_capture(s2)
    q = lib.poolkeeper_malloc(100_000, 0, s2)
    assert lib.poolkeeper_free(p, 0, s1) == 0 and lib.poolkeeper_graph_release(0, 1, 0) == 0
    assert sim.end_capture(s2), sim.last_capture_violation
    assert lib.poolkeeper_graph_end(0, 2, 0) == 0
    assert _core.registry_retired()["graph_pools"] == retired_before  # the old graph's pool closed at that end
    assert old.stats()["live_blocks"] == 0
    assert lib.poolkeeper_free(q, 0, s2) == 0 and lib.poolkeeper_graph_release(0, 2, 0) == 0
    assert sim.capture_violations == 0
    _core.graph_pools(0).validate()
    old.validate()
    new.validate()


def test_allocations_on_other_streams_during_a_capture_go_to_the_device_pool():
    sim, pool, gp = make()
    s, other = sim.stream(), sim.stream()

    def body():
        a = gp.allocate(4096, other)  # another thread's work, not in the graph
        b = gp.allocate(4096, s)
        return a, b

    a, b = capture(sim, gp, G1, s, body)
    assert not gp.owns_private(a) and gp.owns_private(b)
    gp.deallocate(a, other)
    gp.deallocate(b, s)
    check(sim, pool, gp)


def test_callable_filter_and_nested_scopes_latest_wins():
    sim, pool, gp = make()
    s = sim.stream()
    me = threading.get_ident()
    gp.begin(G1, lambda stream: threading.get_ident() == me)  # torch.cuda.use_mem_pool's filter
    gp.begin(G2, s)
    a = gp.allocate(4096, s)  # both claim it: the latest scope (G2) wins
    b = gp.allocate(4096, None)  # only G1's filter claims it
    gp.end(G2)
    gp.end(G1)
    assert gp.private_pool(G2).stats()["live_blocks"] == 1 and gp.private_pool(G1).stats()["live_blocks"] == 1
    assert gp.owns_private(a) and gp.owns_private(b)
    gp.deallocate(a, s)
    gp.deallocate(b)
    check(sim, pool, gp)


def test_a_filter_that_raises_does_not_claim_the_allocation():
    sim, pool, gp = make()

    def bad(stream):
        raise RuntimeError("driver said no")

    gp.begin(G1, bad)
    p = gp.allocate(4096)
    gp.end(G1)
    assert not gp.owns_private(p)
    assert gp.counters()["filter_errors"] == 1
    gp.deallocate(p)
    check(sim, pool, gp)


def test_bad_ids_are_typed_errors():
    sim, pool, gp = make()
    with pytest.raises(InvalidArgumentError):
        gp.end(G1)  # no open scope
    with pytest.raises(InvalidArgumentError):
        gp.begin("not a pair", None)
    gp.release((9, 9))  # PyTorch releases ids that never allocated: harmless
    check(sim, pool, gp)


BAD_GRAPH_POOLS_CALLS = {
    "GraphPools(None)": lambda gp, p: _core.GraphPools(None),
    "GraphPools(upstream)": lambda gp, p: _core.GraphPools(pk.upstream.Host()),
    "begin(None id)": lambda gp, p: gp.begin(None, 5),
    "end(None)": lambda gp, p: gp.end(None),
    "release(None)": lambda gp, p: gp.release(None),
    "private_pool(None)": lambda gp, p: gp.private_pool(None),
    "live_blocks(None)": lambda gp, p: gp.live_blocks(None),
    "allocate(None)": lambda gp, p: gp.allocate(None),
    "deallocate(None)": lambda gp, p: gp.deallocate(None),
    "owns_private(None)": lambda gp, p: gp.owns_private(None),
    "record_stream(None ptr)": lambda gp, p: gp.record_stream(None, 5),
    "record_stream(p, None)": lambda gp, p: gp.record_stream(p, None),
    "graph_pools(None)": lambda gp, p: _core.graph_pools(None),
    "graph_pools(2**40)": lambda gp, p: _core.graph_pools(2**40),
    "graph_pools_find('0')": lambda gp, p: _core.graph_pools_find("0"),
    "graph_pools_find(2**70)": lambda gp, p: _core.graph_pools_find(2**70),
    "registry_set(2**40)": lambda gp, p: _core.registry_set(2**40, None),
    "registry_set(0, 'pool')": lambda gp, p: _core.registry_set(0, "pool"),
    "registry_get(None)": lambda gp, p: _core.registry_get(None),
    "registry_ensure(-2**70)": lambda gp, p: _core.registry_ensure(-2**70),
}


@pytest.mark.parametrize("call", list(BAD_GRAPH_POOLS_CALLS), ids=list(BAD_GRAPH_POOLS_CALLS))
def test_regression_graph_pools_and_registry_calls_raised_bare_type_errors(c_abi, call):
    # Found by hostile probing: GraphPools (documented for Python callers, docs/integrations.md)
    # and the registry calls beside it took their arguments through nanobind's typed signatures,
    # so None, a non-pool or an int outside C's int was nanobind's TypeError, not a poolkeeper error.
    sim, pool, gp = make()
    p = gp.allocate(4096)
    with pytest.raises(pk.errors.PoolkeeperError):
        BAD_GRAPH_POOLS_CALLS[call](gp, p)
    gp.deallocate(p)
    check(sim, pool, gp)


@pytest.mark.parametrize("kind", ["arena", "size_class", "arena_expandable"])
def test_capture_on_every_device_pool_kind(kind):
    sim = pk.upstream.Simulated(latency="none")
    if kind == "arena_expandable":
        pool = pk.ArenaPool(sim, expandable=True)
    else:
        pool = pk.make_pool(kind, sim)
    gp = _core.GraphPools(pool)
    s, other = sim.stream(), sim.stream()
    warm = pool.allocate(MiB, stream=other)

    def body():
        out = []
        for i in range(20):
            p = gp.allocate((i % 5 + 1) * 100_000, s)
            if i % 3:
                gp.deallocate(p, s)
            else:
                out.append(p)
        gp.deallocate(warm, s)  # cross-stream release during the capture
        pool.process_pending()
        pool.trim()
        return out

    out = capture(sim, gp, G1, s, body)
    check(sim, pool, gp)
    for p in out:
        gp.deallocate(p, s)
    gp.release(G1)
    sim.synchronize()
    pool.process_pending()
    check(sim, pool, gp)
    assert gp.info() == []
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["pending_bytes"] == 0


def test_c_abi_routes_through_the_devices_graph_pools(c_abi):
    lib = c_abi
    sim = pk.upstream.Simulated(latency="none")
    pool = pk.ArenaPool(sim)
    _core.registry_set(0, pool)
    s = sim.stream()
    assert lib.poolkeeper_graph_begin(0, 11, 0, s) == 0
    sim.begin_capture(s)
    a = lib.poolkeeper_malloc(100_000, 0, s)
    b = lib.poolkeeper_torch_malloc(100_000, 0, s)  # torch's entry point routes the same way
    c = lib.poolkeeper_malloc(100_000, 0, sim.stream())  # not the captured stream
    assert sim.end_capture(s)
    assert lib.poolkeeper_graph_end(0, 11, 0) == 0
    gp = _core.graph_pools(0)
    assert gp.owns_private(a) and gp.owns_private(b) and not gp.owns_private(c)
    assert lib.poolkeeper_free(a, 0, s) == 0
    lib.poolkeeper_torch_free(b, 0, 0, s)
    assert lib.poolkeeper_free(c, 0, 2**64 - 1) == 0
    assert lib.poolkeeper_graph_release(0, 11, 0) == 0
    assert gp.info() == []
    gp.validate()
    pool.validate()
    assert sim.capture_violations == 0
    assert lib.poolkeeper_graph_end(0, 11, 0) != 0  # no open scope: an error code, no crash


def test_a_pool_over_faulty_keeps_the_capture_rules_of_the_device_under_it():
    """Faulty forwards the capture state: a trim inside a capture scope, over a disarmed Faulty,
    used to query an event in global capture mode (the relaxed mode the pool asked Faulty for
    never reached the device) and broke the capture (found by hostile probing)."""
    sim = pk.upstream.Simulated(latency="none")
    pool = pk.ArenaPool(pk.upstream.Faulty(sim, armed=False), expandable=True, single_stream=True,
                        thread_cache_bytes=0, shrink_interval=1)
    gp = _core.GraphPools(pool)
    home, side = sim.stream(), sim.stream()
    a = pool.allocate(225795, home)
    gp.begin(G1, side)
    sim.begin_capture(side)
    pool.deallocate(a, home)
    pool.trim()
    assert sim.end_capture(side), sim.last_capture_violation
    gp.end(G1)
    check(sim, pool, gp)


@pytest.mark.parametrize("kind", ["arena", "size_class", "direct"])
def test_a_private_pool_asks_the_device_pool_for_round_sizes_and_reuses_its_cached_block(kind):
    """Graph blocks start one alignment unit into their backing (the next test), and the private
    pool asks for round sizes less that unit: the device pool still sees 2 MiB, so a cached 2 MiB
    block serves the first backing with no upstream call (2 MiB + 256 B went to a size-class pool's
    2.5 MiB class, to a fresh driver allocation)."""
    sim, pool, gp = make(kind)
    home, cs = sim.stream(), sim.stream()
    pool.deallocate(pool.allocate(2 * MiB, home), home)
    pool.synchronize()
    calls = sim.counters()["allocations"]
    gp.begin(G1, cs)
    p = gp.allocate(100, cs)
    gp.end(G1)
    if kind != "direct":  # a direct pool caches nothing: it allocates, but 2 MiB exactly
        assert sim.counters()["allocations"] == calls
    assert pool.stats()["live_bytes"] == 2 * MiB
    gp.release(G1)
    gp.deallocate(p, cs)
    check(sim, pool, gp)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_graph_block_freed_through_the_device_pool_is_an_invalid_pointer(expandable):
    """A private pool's backing is a block of the device pool. Its first block used to have that
    block's address, so freeing it through the device pool by mistake was accepted: the device pool
    took the whole backing back and handed it out again while the graph still served from it (two
    live owners of the same bytes; found by hostile probing). Graph blocks now start inside the
    device pool's block, never at its start."""
    sim, pool, gp = make(single_stream=True, thread_cache_bytes=0, expandable=expandable)
    home, cs = sim.stream(), sim.stream()
    gp.begin(G1, cs)
    p = gp.allocate(100, cs)
    with pytest.raises(pk.errors.InvalidPointerError):
        pool.deallocate(p, cs)
    check(sim, pool, gp)
    q = gp.allocate(MiB, cs)
    r = pool.allocate(MiB, home)
    assert r + MiB <= q or q + MiB <= r  # no byte has two owners
    check(sim, pool, gp)
    gp.end(G1)
    gp.release(G1)
    gp.deallocate(p, cs)
    gp.deallocate(q, cs)  # the private pool's last block: its backing goes back to the device pool
    pool.deallocate(r, home)
    check(sim, pool, gp)
    assert pool.stats()["live_blocks"] == 0


def _capture_one_block_through_the_c_abi(lib, sim, gid):
    """A graph captured through the C ABI that keeps one block (a static output) live."""
    s = sim.stream()
    assert lib.poolkeeper_graph_begin(0, gid, 0, s) == 0
    p = lib.poolkeeper_malloc(100_000, 0, s)
    assert p and lib.poolkeeper_graph_end(0, gid, 0) == 0
    return p, s


@pytest.fixture
def c_abi():
    """The C ABI (tests/capi_lib.py); the registry, and with it the graph registry, is cleared
    afterwards whatever the test installed."""
    try:
        yield load_capi()
    finally:
        _core.registry_clear()


@pytest.fixture
def two_pools_on_device_0(c_abi):
    """The C ABI, and two arena pools on simulated devices of their own, the first installed on
    device 0 (the tests swap in the second)."""
    sim_a, sim_b = pk.upstream.Simulated(latency="none"), pk.upstream.Simulated(latency="none")
    a, b = pk.ArenaPool(sim_a), pk.ArenaPool(sim_b)
    _core.registry_set(0, a)
    yield c_abi, sim_a, sim_b, a, b


def test_regression_a_new_pools_block_was_freed_through_the_old_pools_graph_pools(two_pools_on_device_0):
    # Found by hostile probing: after registry_set replaced the device pool while a graph's block
    # was live, every C ABI free went through the old GraphPools (it held private blocks), which
    # handed the new pool's blocks to the old pool: "belongs to ArenaPool #3, not to #1", and the
    # new pool kept them live for good. Only a graph's own blocks go through it now.
    lib, sim_a, _, a, b = two_pools_on_device_0
    p, s = _capture_one_block_through_the_c_abi(lib, sim_a, 1)
    _core.registry_set(0, b)
    q = lib.poolkeeper_malloc(4096, 0, 2**64 - 1)
    assert b.owns(q)
    assert lib.poolkeeper_free(q, 0, 2**64 - 1) == 0, lib.poolkeeper_last_error()
    assert b.stats()["live_blocks"] == 0
    assert lib.poolkeeper_free(p, 0, s) == 0, lib.poolkeeper_last_error()  # the graph's block: its pool
    assert lib.poolkeeper_graph_release(0, 1, 0) == 0
    a.validate()
    b.validate()
    assert a.stats()["live_blocks"] == 0


def test_regression_a_graphs_block_could_not_be_freed_after_a_pool_swap_and_a_new_capture(two_pools_on_device_0):
    # Found by hostile probing: a capture after registry_set made a new GraphPools and retired the
    # old one, which no free looked at any more: the old graph's static output could never be
    # freed ("belongs to ArenaPool #2, not to #3") and its graph never released. Retired
    # GraphPools keep serving their blocks' frees and their graphs' release, and go once idle.
    lib, sim_a, sim_b, a, b = two_pools_on_device_0
    p, s = _capture_one_block_through_the_c_abi(lib, sim_a, 1)
    _core.registry_set(0, b)
    p2, s2 = _capture_one_block_through_the_c_abi(lib, sim_b, 2)  # a new GraphPools, over b
    assert lib.poolkeeper_torch_record_stream(p, 0, sim_a.stream()) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_free(p, 0, s) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_graph_release(0, 1, 0) == 0, lib.poolkeeper_last_error()
    a.synchronize()
    a.validate()
    assert a.stats()["live_blocks"] == 0  # the graph's private pool gave its backing back to a
    assert lib.poolkeeper_free(p2, 0, s2) == 0 and lib.poolkeeper_graph_release(0, 2, 0) == 0
    assert lib.poolkeeper_graph_release(0, 1, 0) == 0  # gone: nothing to do (as for ids never used)
    b.validate()


def test_regression_replacing_the_device_pool_while_threads_allocate_through_graph_scopes_crashed():
    # Found by hostile probing: the C ABI used the device's GraphPools through a raw pointer, and a
    # graph_begin after registry_set destroyed the replaced GraphPools (and with it the replaced
    # device pool) while other threads were inside poolkeeper_malloc: a segfault or "pure virtual
    # method called" within a second, in 7 of 7 runs. Calls now pin it (a per-thread hazard).
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import os, sys, threading, time
        sys.path.insert(0, %r)
        import poolkeeper as pk
        from poolkeeper import _core
        from capi_lib import load
        lib = load()
        sim = pk.upstream.Simulated(latency="none")
        s, other = sim.stream(), sim.stream()
        _core.registry_set(0, pk.ArenaPool(sim))
        stop = False
        def worker():
            while not stop:
                p = lib.poolkeeper_malloc(4096, 0, other)
                if p:
                    lib.poolkeeper_free(p, 0, other)  # may name the pool swapped in meanwhile: an error code
        ts = [threading.Thread(target=worker) for _ in range(3)]
        for t in ts:
            t.start()
        end = time.monotonic() + 3
        i = 0
        while time.monotonic() < end:
            _core.registry_set(0, pk.ArenaPool(sim))
            assert lib.poolkeeper_graph_begin(0, i, 0, s) == 0
            assert lib.poolkeeper_graph_end(0, i, 0) == 0
            assert lib.poolkeeper_graph_release(0, i, 0) == 0
            i += 1
        stop = True
        for t in ts:
            t.join()
        _core.registry_clear()
        print("rounds", i)
        os._exit(0)
        """
        % str(__import__("pathlib").Path(__file__).parent)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert int(r.stdout.split()[-1]) > 100


def test_regression_a_graph_release_on_one_device_released_another_devices_retired_graph(c_abi):
    # Found by review of the retired-GraphPools fix: release(device, id) looked through every
    # device's retired GraphPools, so releasing id 7 on device 1 released device 0's graph 7.
    lib = c_abi
    sim0, sim1 = pk.upstream.Simulated(latency="none"), pk.upstream.Simulated(latency="none")
    _core.registry_set(0, pk.ArenaPool(sim0))
    _core.registry_set(1, pk.ArenaPool(sim1))
    p, s = _capture_one_block_through_the_c_abi(lib, sim0, 7)
    old = _core.graph_pools(0)
    _core.registry_set(0, pk.ArenaPool(sim0))
    _capture_one_block_through_the_c_abi(lib, sim0, 8)  # retires device 0's first GraphPools
    s1 = sim1.stream()
    assert lib.poolkeeper_graph_begin(1, 9, 0, s1) == 0 and lib.poolkeeper_graph_end(1, 9, 0) == 0
    assert lib.poolkeeper_graph_release(1, 7, 0) == 0  # device 1 has no graph 7: nothing to do
    assert [(i["id"], i["uses"], i["released"]) for i in old.info()] == [((7, 0), 1, False)]
    assert lib.poolkeeper_free(p, 0, s) == 0
    assert [i["id"] for i in old.info()] == [(7, 0)]  # still held by its graph
    assert lib.poolkeeper_graph_release(0, 7, 0) == 0 and old.info() == []


@pytest.mark.parametrize("device", [-100, -3, -1, 70, 2**31 - 1])
def test_regression_a_free_naming_a_device_that_does_not_exist_freed_a_graphs_block(two_pools_on_device_0, device):
    # Found by hostile probing: the free's error path asked the graph registry with the caller's
    # device index unchecked, and a negative one meant "every device": a free naming device -100
    # freed device 0's graph block, and device -3 a replaced pool's block. A bad index is refused
    # now, and the blocks stay live where they are.
    from capi_lib import INVALID_ARGUMENT

    lib, sim_a, _, a, b = two_pools_on_device_0
    g, s = _capture_one_block_through_the_c_abi(lib, sim_a, 1)
    kept = lib.poolkeeper_malloc(4096, 0, 9)
    _core.registry_set(0, b)
    _core.graph_pools(0)  # a later capture retires the first GraphPools
    live = a.stats()["live_blocks"]
    for p, stream in ((g, s), (kept, 9)):
        assert lib.poolkeeper_free(p, device, stream) == INVALID_ARGUMENT
    assert a.stats()["live_blocks"] == live and a.owns(kept)
    assert lib.poolkeeper_free(kept, 0, 9) == 0 and lib.poolkeeper_free(g, 0, s) == 0
    assert lib.poolkeeper_graph_release(0, 1, 0) == 0
    a.validate()


def test_a_capture_open_across_a_pool_swap_ends_and_its_device_pool_blocks_free(two_pools_on_device_0):
    # Found by review: graph_end after the device's pool was replaced made a new GraphPools and
    # failed ("not open"), leaving the old one routing for good; and a block the replaced pool
    # served during that capture (an allocation the capture did not claim) could not be freed
    # through the C ABI any more once frees went to the new pool.
    lib, sim, _, a, b = two_pools_on_device_0
    s, other = sim.stream(), sim.stream()
    assert lib.poolkeeper_graph_begin(0, 1, 0, s) == 0
    g = lib.poolkeeper_malloc(100_000, 0, s)  # the graph's block
    gp = _core.graph_pools(0)
    _core.registry_set(0, b)
    q = lib.poolkeeper_malloc(4096, 0, other)  # not captured: the old GraphPools's device pool serves it
    assert a.owns(q)
    assert lib.poolkeeper_free(q, 0, other) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_graph_end(0, 1, 0) == 0, lib.poolkeeper_last_error()  # in the GraphPools that has it
    assert not gp.info()[0]["open_scopes"]
    assert lib.poolkeeper_free(g, 0, s) == 0 and lib.poolkeeper_graph_release(0, 1, 0) == 0
    assert a.stats()["live_blocks"] == 0
    a.validate()


def test_a_block_the_replaced_pool_served_outlives_the_graph_that_routed_it(c_abi):
    # Found by review: a block served by the replaced pool while a capture stayed open across the
    # swap (an allocation the capture did not claim) kept no GraphPools alive; once that graph
    # ended and was released, its GraphPools, and with it the last reference to the replaced
    # pool, went, and the block could not be freed any more. A retired GraphPools stays while its
    # device pool has live blocks.
    import gc

    lib = c_abi
    sim = pk.upstream.Simulated(latency="none")
    a = pk.ArenaPool(sim)
    _core.registry_set(0, a)
    s, other = sim.stream(), sim.stream()
    assert lib.poolkeeper_graph_begin(0, 1, 0, s) == 0
    g = lib.poolkeeper_malloc(100_000, 0, s)
    _core.registry_set(0, pk.ArenaPool(sim))
    q = lib.poolkeeper_malloc(4096, 0, other)  # served by a, through the GraphPools still published
    assert a.owns(q)
    assert lib.poolkeeper_graph_end(0, 1, 0) == 0
    assert lib.poolkeeper_free(g, 0, s) == 0 and lib.poolkeeper_graph_release(0, 1, 0) == 0
    stats = a.stats
    del a
    gc.collect()
    _core.graph_pools(0)  # retires the old GraphPools, and collects the idle ones
    assert lib.poolkeeper_free(q, 0, other) == 0, lib.poolkeeper_last_error()
    assert stats()["live_blocks"] == 0


def test_a_graphs_block_is_freed_after_the_registry_was_cleared(two_pools_on_device_0):
    # Found by review: with no pool installed any more, the C ABI's free refused every pointer
    # ("no poolkeeper pool is installed"), so a graph's static output could never be freed.
    lib, sim, _, a, _ = two_pools_on_device_0
    p, s = _capture_one_block_through_the_c_abi(lib, sim, 1)
    _core.registry_clear()
    assert lib.poolkeeper_torch_record_stream(p, 0, sim.stream()) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_free(p, 0, s) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_graph_release(0, 1, 0) == 0
    assert a.stats()["live_blocks"] == 0
    assert lib.poolkeeper_free(p, 0, s) != 0  # twice: an error code, as ever


def test_a_device_pool_free_does_not_wait_for_a_graphs_lock(c_abi):
    # While any graph held blocks, every C ABI free took the GraphPools's lock to ask whether the
    # pointer was a graph's, so ordinary frees queued behind a capture's growth (and paid a mutex
    # and a hash lookup each). A free the device pool takes on its lock-free path is its own block
    # (a graph's block never starts where a device-pool block does) and asks no graph.
    import time

    lib = c_abi
    sim = pk.upstream.Simulated(latency="none")
    _core.registry_set(0, pk.ArenaPool(pk.upstream.Faulty(sim, fail_at={2}, refuse_after_us=2_000_000)))
    s, other = sim.stream(), sim.stream()
    assert lib.poolkeeper_graph_begin(0, 1, 0, s) == 0
    first = lib.poolkeeper_malloc(4096, 0, s)  # a graph block: frees ask the graph from now on
    q = lib.poolkeeper_malloc(4096, 0, other)  # the device pool's (upstream call 1; the growth below is call 2)
    assert first and q
    got = []
    t = threading.Thread(target=lambda: got.append(lib.poolkeeper_malloc(64 << 20, 0, s)))
    t.start()  # the capture's growth sleeps in the upstream with the GraphPools's lock held
    time.sleep(0.3)
    assert t.is_alive()
    assert lib.poolkeeper_free(q, 0, other) == 0, lib.poolkeeper_last_error()
    assert t.is_alive()  # the free did not wait for the growth
    t.join()
    for p in [first] + got:
        assert lib.poolkeeper_free(p, 0, s) == 0, lib.poolkeeper_last_error()
    assert lib.poolkeeper_graph_end(0, 1, 0) == 0 and lib.poolkeeper_graph_release(0, 1, 0) == 0
    gp = _core.graph_pools(0)
    gp.validate()
    assert gp.info() == []


# ---------------------------------------------------------------- checkpoint restore (CUDA-graph trees)


def test_live_block_info_gives_each_private_blocks_size_and_stream():
    sim, pool, gp = make()
    s, t = sim.stream(), sim.stream()
    a, b = capture(sim, gp, G1, s, lambda: (gp.allocate(100_000, s), gp.allocate(3 * MiB + 5, s)))
    gp.record_stream(b, t)
    assert gp.live_block_info(G1) == sorted([(a, 100_000, s), (b, 3 * MiB + 5, s)])
    assert gp.live_block_info(G2) == []
    check(sim, pool, gp)


def test_checkpoint_restore_hands_a_freed_block_out_again_at_its_address():
    # What torch.compile's trees do: record a graph (its output lives in the private pool), take
    # the live blocks as a checkpoint, let the output die, then put the pool back to the
    # checkpoint before recording the next graph. Without reclaim_next the next allocation of the
    # same size lands wherever best fit puts it, not where the recorded graph writes.
    sim, pool, gp = make()
    s = sim.stream()
    x, out = capture(sim, gp, G1, s, lambda: (gp.allocate(MiB, s), gp.allocate(200_000, s)))
    checkpoint = gp.live_block_info(G1)
    gp.deallocate(out, s)
    filler = capture(sim, gp, G1, s, lambda: gp.allocate(150_000, s))  # a later recording takes part of it
    gp.deallocate(filler, s)
    gp.reclaim_next(G1, out, 200_000)
    assert gp.routing  # the C ABI sends the next allocation to the graph pools even with no scope open
    assert gp.allocate(200_000, s) == out
    assert not gp.routing
    assert gp.live_block_info(G1) == checkpoint
    assert gp.allocate(200_000, s) != out  # used up: the next goes to the device pool as before
    check(sim, pool, gp)


def test_reclaim_next_serves_only_its_own_thread_and_size():
    sim, pool, gp = make()
    s = sim.stream()
    big = capture(sim, gp, G1, s, lambda: gp.allocate(4 * MiB, s))
    gp.deallocate(big, s)
    gp.reclaim_next(G1, big + 1 * MiB, 512 * 1024)
    other = []
    th = threading.Thread(target=lambda: other.append(gp.allocate(512 * 1024, s)))
    th.start()
    th.join()
    assert not gp.owns_private(other[0])  # another thread: the device pool
    assert not gp.owns_private(gp.allocate(4096, s))  # another size: the device pool
    assert gp.allocate(512 * 1024, s) == big + 1 * MiB  # inside a free chunk: the parts around it stay free
    [info] = gp.info()
    assert info["live_blocks"] == 1
    check(sim, pool, gp)


def private_block(size=MiB, freed=True):
    """A fresh simulated device pool with graph pools, one block of `size` captured into G1,
    freed again unless `freed` is False: what a checkpoint restore finds."""
    sim, pool, gp = make()
    s = sim.stream()
    a = capture(sim, gp, G1, s, lambda: gp.allocate(size, s))
    if freed:
        gp.deallocate(a, s)
    return sim, pool, gp, s, a


def test_reclaim_of_memory_that_is_not_free_is_refused_and_changes_nothing():
    sim, pool, gp, s, a = private_block(freed=False)
    before = gp.live_block_info(G1)
    for where in (a, a + 4096, a + 8 * MiB + 123):
        gp.reclaim_next(G1, where, 4096)
        with pytest.raises(pk.errors.InvalidPointerError):
            gp.allocate(4096, s)
        assert not gp.routing  # a refused reclaim is used up too
    assert gp.live_block_info(G1) == before
    with pytest.raises(InvalidArgumentError):
        gp.reclaim_next(G2, a, 4096)  # no such pool
    gp.reclaim_next(G1, a, 4096)
    gp.reclaim_cancel()
    assert not gp.routing
    check(sim, pool, gp)


def test_reclaim_waits_for_a_pending_release_on_its_stream():
    # The restore frees blocks through the framework (a release on the block's stream: pending
    # while the stream has work queued) and then hands out blocks overlapping them.
    sim, pool, gp = make()
    s = sim.stream()
    a = capture(sim, gp, G1, s, lambda: gp.allocate(2 * MiB, s))
    sim.enqueue(s, 1_000.0)
    gp.deallocate(a, s)
    gp.reclaim_next(G1, a, MiB)
    assert gp.allocate(MiB, s) == a
    check(sim, pool, gp)


@pytest.mark.parametrize("kind", ["arena"])
def test_arena_allocate_at_takes_exactly_the_range_and_keeps_the_books(kind):
    sim = pk.upstream.Simulated(latency="none")
    pool = pk.ArenaPool(sim, thread_cache_bytes=0)
    a = pool.allocate(4 * MiB)
    pool.deallocate(a)
    p = pool._allocate_at(a + MiB, MiB + 1)
    assert p == a + MiB
    pool.validate()
    pk.accounting.check(pool.snapshot())
    assert pool.stats()["live_bytes"] == MiB + 1
    q = pool.allocate(MiB)  # the free part before the range still serves
    assert q == a
    with pytest.raises(pk.errors.InvalidPointerError):
        pool._allocate_at(a + MiB, 16)  # live now
    pool.deallocate(p)
    pool.deallocate(q)
    pool.validate()


def test_regression_a_reclaim_next_replaced_by_one_on_another_graph_pools_left_routing_on_for_good():
    # One reclaim per thread: a second reclaim_next on another GraphPools replaced the first
    # without giving back the first one's count, so the first GraphPools sent every allocation
    # down its slow path from then on (and the registry could never retire it).
    sim, pool, gp = make()
    other = _core.GraphPools(pool)
    s = sim.stream()
    a = capture(sim, gp, G1, s, lambda: gp.allocate(MiB, s))
    b = capture(sim, other, G1, s, lambda: other.allocate(MiB, s))
    gp.deallocate(a, s)
    gp.reclaim_next(G1, a, 4096)
    other.reclaim_next(G1, b, 4096)
    assert not gp.routing  # replaced: gp's reclaim is gone
    assert not gp.owns_private(gp.allocate(4096, s))
    other.reclaim_cancel()
    assert not other.routing
    check(sim, pool, gp)


def test_regression_a_thread_that_exited_with_a_reclaim_waiting_left_routing_on_for_good():
    sim, pool, gp, s, a = private_block()
    # A thread of our own: Thread.join() returns before the thread's C++ thread_locals are
    # destroyed, pthread_join only after.
    libc = ctypes.CDLL(None)
    body = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: gp.reclaim_next(G1, a, 4096))
    tid = ctypes.c_ulong()
    assert libc.pthread_create(ctypes.byref(tid), None, body, None) == 0
    assert libc.pthread_join(tid, None) == 0
    assert not gp.routing
    check(sim, pool, gp)


def test_regression_a_reclaim_left_by_a_destroyed_graph_pools_took_a_new_ones_count_below_zero():
    # The thread's record named its GraphPools by address: a new one made where a destroyed one
    # had been (nanobind keeps the object inside its Python wrapper, so the address comes back at
    # once) matched it, and its reclaim_cancel took the new one's count to -1; its own
    # reclaim_next then left routing off, and the block went to the device pool.
    sim, pool, _ = make()
    s = sim.stream()
    for _ in range(8):
        gp = _core.GraphPools(pool)
        a = capture(sim, gp, G1, s, lambda: gp.allocate(MiB, s))
        gp.deallocate(a, s)
        gp.reclaim_cancel()
        gp.reclaim_next(G1, a, 4096)
        assert gp.routing
        assert gp.allocate(4096, s) == a
        gp.deallocate(a, s)
        gp.reclaim_next(G1, a, 4096)  # left waiting as this GraphPools goes
        gp.release(G1)
        gp.validate()
        del gp
    pool.validate()


@pytest.mark.parametrize("captured", ["home", "another stream"])
def test_regression_allocate_at_on_another_stream_took_memory_a_single_stream_pool_had_freed_on_home(captured):
    # A single-stream pool files home's releases free at once; allocate() ends the mode before it
    # serves another stream (waiting for home, or, while home is captured, turning that memory
    # pending on home). allocate_at skipped that and handed the memory to the other stream while
    # home's queued work could still be using it.
    sim = pk.upstream.Simulated(latency="none")
    pool = pk.ArenaPool(sim, single_stream=True, thread_cache_bytes=0)
    gp = _core.GraphPools(pool)  # a capture scope, as PyTorch opens one around a capture
    home, other, side = sim.stream(), sim.stream(), sim.stream()
    a = pool.allocate(MiB, home)
    sim.enqueue(home, 1_000.0)
    pool.deallocate(a, home)
    captured_stream = home if captured == "home" else side
    gp.begin(G1, captured_stream)
    sim.begin_capture(captured_stream)
    try:
        if captured == "home":  # nothing may wait for home now: refused
            with pytest.raises(pk.errors.InvalidPointerError):
                pool._allocate_at(a, 4096, other)
        else:  # home is not captured: waited for
            assert pool._allocate_at(a, 4096, other) == a
            assert sim.now >= sim.busy_until(home)
            pool.deallocate(a, other)
    finally:
        assert sim.end_capture(captured_stream), sim.last_capture_violation
        gp.end(G1)
    assert sim.capture_violations == 0
    pool.validate()
    pk.accounting.check(pool.snapshot())
