"""poolkeeper's CUDA code paths against a fake driver (tests/fake_cuda/fake_libcuda.c), so CI
without a GPU exercises the loader, error mapping, context handling, the event-driven stream
order and the warm-pool manager through the real CudaDevice / CudaAsync / CudaPinned classes.

The fake stands in for the driver's *interface*; what CUDA itself does with memory is checked by
the GPU tests (tests/gpu). Each scenario runs in a subprocess: the driver is loaded once per process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).parent / "fake_cuda" / "fake_libcuda.c"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to build the fake driver")


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakecuda")
    libs = {}
    for name, extra in (("full", []), ("nopool", ["-DFAKE_NO_POOL_API"]), ("novmm", ["-DFAKE_NO_VMM_API"])):
        out = d / name / "libcuda.so.1"
        out.parent.mkdir()
        subprocess.run([CC, "-shared", "-fPIC", "-O1", *extra, "-o", str(out), str(SRC), "-lpthread"], check=True)
        libs[name] = str(out)
    libs["dir"] = d
    return libs


def run(lib: str, code: str, **env) -> dict:
    e = dict(os.environ)
    e["POOLKEEPER_LIBCUDA"] = lib
    e.update({k: str(v) for k, v in env.items()})
    pre = "import json, threading\nimport poolkeeper as pk\nfrom poolkeeper import cuda, _core\nfrom poolkeeper.cuda import driver, warm\n"
    r = subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- loading and availability ----

@pytest.mark.parametrize("code,expect", [(100, "CUDA_ERROR_NO_DEVICE"), (34, "stub library"), (3, "cuInit failed")])
def test_cuinit_failure_makes_cuda_unavailable_with_the_reason(fakes, code, expect):
    out = run(fakes["full"], """
        try:
            pk.upstream.CudaDevice()
            err = None
        except pk.CudaUnavailableError as e:
            err = str(e)
        print(json.dumps({"avail": cuda.is_available(), "reason": cuda.unavailable_reason(), "err": err}))
    """, FAKE_CUDA_INIT_RESULT=code)
    assert out["avail"] is False
    assert expect in out["reason"]
    assert out["err"] and expect in out["err"]


def test_zero_devices_is_unavailable(fakes):
    out = run(fakes["full"], 'print(json.dumps({"avail": cuda.is_available(), "reason": cuda.unavailable_reason()}))',
              FAKE_CUDA_DEVICES=0)
    assert out == {"avail": False, "reason": "no CUDA device: the driver reports 0 devices"}


def test_devices_report_what_the_driver_says(fakes):
    out = run(fakes["full"], """
        print(json.dumps({"n": cuda.device_count(), "v": cuda.driver_version(),
                          "devs": [d.__dict__ for d in cuda.devices()]}))
    """, FAKE_CUDA_DEVICES=2)
    assert out["n"] == 2 and out["v"] == 13000
    assert [d["name"] for d in out["devs"]] == ["Fake GPU 0", "Fake GPU 1"]
    assert out["devs"][1]["pci_bus_id"] == "0000:02:00.0"
    assert out["devs"][0]["compute_capability"] == [9, 0]
    assert all(d["memory_pools_supported"] for d in out["devs"])


def test_driver_without_pool_api_still_serves_cuda_device(fakes):
    out = run(fakes["nopool"], """
        up = pk.upstream.CudaDevice()
        p = up.allocate(4096); up.deallocate(p, 4096)
        try:
            pk.upstream.CudaAsync(); err = None
        except pk.CudaUnavailableError as e:
            err = str(e)
        print(json.dumps({"pools": cuda.devices()[0].memory_pools_supported, "err": err,
                          "allocs": up.counters()["allocations"]}))
    """)
    assert out["pools"] is False and out["allocs"] == 1
    assert "stream-ordered allocator" in out["err"]


def test_bad_device_index_is_an_invalid_argument(fakes):
    out = run(fakes["full"], """
        try:
            pk.upstream.CudaDevice(3); err = None
        except pk.InvalidArgumentError as e:
            err = str(e)
        print(json.dumps({"err": err, "warm": warm.state().total_handles}))
    """, FAKE_CUDA_DEVICES=2)
    assert "CUDA device 3 does not exist (2 devices visible)" in out["err"]


# ---- upstreams, errors, contexts ----

def test_out_of_memory_carries_the_cuda_error_name(fakes):
    out = run(fakes["full"], """
        up = pk.upstream.CudaDevice()
        try:
            up.allocate(2 << 20); r = None
        except pk.UpstreamError as e:
            r = {"type": type(e).__name__, "name": e.error_name, "code": e.code, "msg": str(e)}
        pool = pk.SizeClassPool(up)
        try:
            pool.allocate(2 << 20); oom = None
        except pk.OutOfMemoryError as e:
            oom = {"cause": e.cause, "upstream_error": e.upstream_error}
        c = up.counters()
        print(json.dumps({"err": r, "oom": oom, "failed": c["failed_allocations"], "out": c["outstanding_bytes"]}))
    """, FAKE_CUDA_CAPACITY=1 << 20)
    assert out["err"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY" and out["err"]["code"] == 2
    assert "cuMemAlloc(2.00 MiB) on device 0 failed: CUDA_ERROR_OUT_OF_MEMORY" in out["err"]["msg"]
    assert out["oom"]["cause"] == "upstream"
    assert out["failed"] >= 2 and out["out"] == 0


def test_calls_leave_the_threads_current_context_as_it_was(fakes):
    out = run(fakes["full"], """
        res = {}
        def fresh_thread():
            # a thread with no current context keeps none
            up = pk.upstream.CudaDevice(1)
            p = up.allocate(256); up.deallocate(p, 256); up.synchronize()
            res["fresh"] = _core.cuda_current_device()
        t = threading.Thread(target=fresh_thread); t.start(); t.join()
        driver.set_device(0)
        up1 = pk.upstream.CudaDevice(1)
        p = up1.allocate(256)
        res["after_dev1_alloc"] = _core.cuda_current_device()
        up1.deallocate(p, 256)
        a = pk.upstream.CudaAsync(1)
        q = a.allocate(256); a.deallocate(q, 256)
        res["after_async"] = _core.cuda_current_device()
        del a
        res["after_warm_release"] = _core.cuda_current_device()
        print(json.dumps(res))
    """, FAKE_CUDA_DEVICES=2)
    assert out == {"fresh": -1, "after_dev1_alloc": 0, "after_async": 0, "after_warm_release": 0}


def test_pinned_upstream(fakes):
    out = run(fakes["full"], """
        import ctypes
        up = pk.upstream.CudaPinned()
        p = up.allocate(1 << 16)
        ctypes.memset(p, 7, 1 << 16)  # host-addressable
        up.deallocate(p, 1 << 16)
        print(json.dumps({"kind": up.kind, "name": up.name, "c": up.counters()["deallocations"]}))
    """)
    assert out == {"kind": "pinned", "name": "CudaPinned", "c": 1}


# ---- stream order on CUDA events ----

def test_pool_over_cuda_device_waits_for_the_event_before_cross_stream_reuse(fakes):
    out = run(fakes["full"], """
        up = pk.upstream.CudaDevice()
        pool = pk.SizeClassPool(up)
        a, b = driver.Stream(), driver.Stream()
        p = pool.allocate(4096, stream=a)
        pool.deallocate(p, stream=a)
        same = pool.allocate(4096, stream=a)   # same stream: reusable at once
        pool.deallocate(same, stream=a)
        q = pool.allocate(4096, stream=b)      # other stream: event not ready yet
        pend = [pool.stats()["pending_bytes"]]
        for _ in range(4):
            pool.process_pending(); pend.append(pool.stats()["pending_bytes"])
        r = pool.allocate(4096, stream=b)
        pool.deallocate(q, stream=b); pool.deallocate(r, stream=b)
        pool.synchronize()
        pool.validate()
        print(json.dumps({"same": same == p, "q_is_p": q == p, "pend": pend, "r_is_p": r == p,
                          "events_created": up.events_created, "events_in_use": up.events_in_use,
                          "final_pending": pool.stats()["pending_bytes"]}))
        pool.close()
    """, FAKE_CUDA_EVENT_NOT_READY=2)
    assert out["same"] is True
    assert out["q_is_p"] is False, "a block pending on stream A was handed to stream B"
    assert out["pend"][0] > 0 and out["pend"][-1] == 0
    assert out["r_is_p"] is True, "once the event completed, the block is reusable anywhere"
    assert out["events_in_use"] == 0 and 1 <= out["events_created"] <= 3
    assert out["final_pending"] == 0


def test_driver_helpers_round_trip(fakes):
    out = run(fakes["full"], """
        import ctypes
        up = pk.upstream.CudaDevice()
        d = up.allocate(64)
        src = ctypes.create_string_buffer(b"poolkeeper", 64)
        dst = ctypes.create_string_buffer(64)
        s = driver.Stream()
        driver.memcpy_htod_async(d, ctypes.addressof(src), 64, s.handle)
        ev = driver.Event.record(s.handle)
        q = [ev.query(), ev.query(), ev.query()]
        ev.synchronize()
        driver.memcpy_dtoh(ctypes.addressof(dst), d, 64)
        driver.memset_d8(d, 0x41, 4)
        driver.memcpy_dtoh(ctypes.addressof(dst), d, 64)
        proto = s.__cuda_stream__()
        s.close(); s.close()
        print(json.dumps({"q": q, "val": dst.value.decode(), "proto": proto[1] != 0}))
    """, FAKE_CUDA_EVENT_NOT_READY=2)
    assert out["q"] == [False, False, True]
    assert out["val"] == "AAAAkeeper"
    assert out["proto"] is True


# ---- the warm pool through CudaAsync ----

def test_cuda_async_keeps_the_default_pool_warm_and_gives_it_back(fakes):
    out = run(fakes["full"], """
        MiB = 1 << 20
        a = pk.upstream.CudaAsync()
        s = {"during": warm.release_threshold(0)}
        p = a.allocate(64 * MiB); a.deallocate(p, 64 * MiB); a.synchronize()
        s["retained"] = warm.reserved_bytes(0)
        live = a.allocate(8 * MiB)
        s["handles"] = warm.state().total_handles
        b = pk.upstream.CudaAsync(warm=False)
        del a
        s["after"] = warm.release_threshold(0)
        s["reserved_after"] = warm.reserved_bytes(0)
        s["used_after"] = warm.used_bytes(0)
        b.deallocate(live, 8 * MiB)
        print(json.dumps(s))
    """)
    assert out["during"] == 2**64 - 1
    assert out["retained"] >= 64 << 20
    assert out["handles"] == 1
    assert out["after"] == 0
    assert out["used_after"] == 8 << 20
    assert 8 << 20 <= out["reserved_after"] < 64 << 20


def test_release_trims_every_raised_device_in_its_own_context(fakes):
    log = fakes["dir"] / "two_dev.log"
    out = run(fakes["full"], """
        a0 = pk.upstream.CudaAsync(0); a1 = pk.upstream.CudaAsync(1)
        def teardown():
            driver.set_device(1)   # the destroying thread is current on the other device
            global a0, a1
            del a1
            del a0
        t = threading.Thread(target=teardown); t.start(); t.join()
        print(json.dumps({"t0": warm.release_threshold(0), "t1": warm.release_threshold(1)}))
    """, FAKE_CUDA_DEVICES=2, FAKE_CUDA_LOG=log)
    assert out == {"t0": 0, "t1": 0}
    lines = log.read_text().splitlines()
    trims = [l for l in lines if l.startswith("cuMemPoolTrimTo")]
    assert trims == ["cuMemPoolTrimTo dev=0 keep=0 cur=0", "cuMemPoolTrimTo dev=1 keep=0 cur=1"]
    syncs = [l for l in lines if l.startswith("cuCtxSynchronize")]
    assert "cuCtxSynchronize dev=0 cur=0" in syncs and "cuCtxSynchronize dev=1 cur=1" in syncs
    # order per device: synchronize, restore, trim
    i_sync = lines.index("cuCtxSynchronize dev=0 cur=0")
    i_set = lines.index("cuMemPoolSetAttribute dev=0 threshold=0 cur=0")
    i_trim = lines.index("cuMemPoolTrimTo dev=0 keep=0 cur=0")
    assert i_sync < i_set < i_trim


def test_release_from_a_thread_current_on_another_device_trims_the_recorded_one(fakes):
    log = fakes["dir"] / "seed_bug.log"
    run(fakes["full"], """
        a0 = pk.upstream.CudaAsync(0)
        driver.set_device(1)
        del a0
        print(json.dumps({}))
    """, FAKE_CUDA_DEVICES=2, FAKE_CUDA_LOG=log)
    lines = log.read_text().splitlines()
    assert [l for l in lines if l.startswith("cuMemPoolTrimTo")] == ["cuMemPoolTrimTo dev=0 keep=0 cur=0"]
    assert not any("dev=1" in l for l in lines if l.startswith("cuMemPool"))


# ---- virtual memory (CudaVirtual) and the expandable arena over it ----

def test_expandable_arena_over_cuda_virtual_maps_writes_trims_and_closes(fakes):
    out = run(fakes["full"], """
        import ctypes
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, max_step=4 << 20, thread_cache_bytes=0)
        sizes = (1000, 3 << 20, 5 << 20, 100)
        ps = [pool.allocate(n) for n in sizes]
        for i, (p, n) in enumerate(zip(ps, sizes)):
            ctypes.memset(p, i + 1, n)  # host memory stands in: a missing map would fault here
        ok = all(ctypes.string_at(p + n - 1, 1)[0] == i + 1 for i, (p, n) in enumerate(zip(ps, sizes)))
        pool.validate()
        grown = dict(maps=up.counters()["maps"], pieces=up.mapped_pieces, reserved=pool.stats()["reserved_bytes"])
        for p in ps[1:]:
            pool.deallocate(p)
        trimmed = pool.trim()
        after_trim = dict(pieces=up.mapped_pieces, reserved=pool.stats()["reserved_bytes"], unmaps=up.counters()["unmaps"])
        pool.deallocate(ps[0])
        pool.close()
        c = up.counters()
        print(json.dumps({"ok": ok, "grown": grown, "trimmed": trimmed, "after_trim": after_trim,
                          "end": [c["maps"], c["unmaps"], c["reserves"], c["unreserves"], c["outstanding_bytes"], up.mapped_pieces],
                          "gran": up.vm_granularity, "cap": up.memory_capacity}))
    """)
    MiB = 1 << 20
    assert out["ok"] and out["gran"] == 2 * MiB and out["cap"] == 80 << 30
    # 2 MiB first piece, then +2 MiB (tail extended for 3 MiB), then +4 MiB pieces as needed.
    assert out["grown"]["maps"] == out["grown"]["pieces"] >= 3
    assert out["after_trim"]["pieces"] == 1 and out["after_trim"]["reserved"] == 2 * MiB
    assert out["trimmed"] == out["grown"]["reserved"] - 2 * MiB
    maps = out["grown"]["maps"]
    assert out["end"] == [maps, maps, 1, 1, 0, 0]


def test_stitched_range_over_cuda_virtual_is_a_second_mapping_of_the_same_memory(fakes):
    out = run(fakes["full"], """
        import ctypes
        G = 2 << 20
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=G,
                            thread_cache_bytes=0, shrink_interval=0, stitch=True)
        blocks = [pool.allocate(G) for _ in range(7)]
        for i in (1, 3, 5):
            pool.deallocate(blocks[i])
        p = pool.allocate(3 * G)  # no contiguous 6 MiB free: stitched from pieces 1, 3, 5
        ctypes.memset(p, 0x5A, 3 * G)
        seen = [ctypes.string_at(blocks[i] + G - 1, 1)[0] for i in (1, 3, 5)]  # through the main range
        st = pool.stats()
        pool.validate()
        during = dict(maps=up.counters()["maps"], aliases=up.aliases, stitched=st["stitched_bytes"],
                      outside=not (blocks[0] <= p < blocks[0] + st["va_bytes"]))
        pool.deallocate(p)  # its last block: the range is torn down
        after = dict(aliases=up.aliases, ranges=pool.stats()["stitched_ranges"])
        pool.validate()
        for i in (0, 2, 4, 6):
            pool.deallocate(blocks[i])
        pool.close()
        c = up.counters()
        print(json.dumps({"seen": seen, "during": during, "after": after,
                          "end": [c["aliases"], c["unaliases"], c["reserves"], c["unreserves"], up.mapped_pieces]}))
    """)
    assert out["seen"] == [0x5A] * 3  # the same bytes at both addresses
    assert out["during"] == {"maps": 7, "aliases": 3, "stitched": 6 << 20, "outside": True}
    assert out["after"] == {"aliases": 0, "ranges": 0}
    assert out["end"] == [3, 3, 2, 2, 0]


def test_fragment_stitch_over_cuda_virtual_writes_only_the_lent_bytes(fakes):
    out = run(fakes["full"], """
        import ctypes
        G = 2 << 20
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=G,
                            thread_cache_bytes=0, shrink_interval=0, stitch=True, stitch_fragments=True)
        sizes = [G, G // 4, 3 * G // 4, G, G, G, G // 2, G // 2]
        blocks = [pool.allocate(n) for n in sizes]
        for i in (2, 4, 6):
            pool.deallocate(blocks[i])
        live = [(blocks[i], sizes[i]) for i in (0, 1, 3, 5, 7)]
        for k, (q, n) in enumerate(live):
            ctypes.memset(q, 0x10 + k, n)
        p = pool.allocate(9 * G // 4)  # piece 1's free end, piece 3, piece 5's free start
        ctypes.memset(p, 0x5A, 9 * G // 4)
        kept = [set(ctypes.string_at(q, n)) == {0x10 + k} for k, (q, n) in enumerate(live)]
        lent = [set(ctypes.string_at(blocks[0] + G + G // 4, 3 * G // 4)), set(ctypes.string_at(blocks[0] + 5 * G, G // 2))]
        st = pool.stats()
        pool.validate()
        during = dict(maps=up.counters()["maps"], aliases=up.aliases, fragments=st["stitched_fragments"])
        pool.deallocate(p)
        pool.validate()
        for q, _ in live:
            pool.deallocate(q)
        pool.close()
        c = up.counters()
        print(json.dumps({"kept": kept, "lent": [sorted(x) for x in lent], "during": during,
                          "end": [c["aliases"], c["unaliases"], up.mapped_pieces]}))
    """)
    assert out["kept"] == [True] * 5  # the live blocks sharing pieces 1 and 5: untouched
    assert out["lent"] == [[0x5A], [0x5A]]  # the lent bytes, through the main range
    assert out["during"] == {"maps": 6, "aliases": 3, "fragments": 2}
    assert out["end"] == [3, 3, 0]


def test_cuda_virtual_refused_map_undoes_itself_and_the_pool_stays_consistent(fakes):
    out = run(fakes["full"], """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, va_bytes=64 << 20, thread_cache_bytes=0)
        a = pool.allocate(6 << 20)
        try:
            pool.allocate(8 << 20)  # the device has 10 MiB: cuMemCreate fails
            err = None
        except pk.errors.OutOfMemoryError as e:
            err = [e.cause, "CUDA_ERROR_OUT_OF_MEMORY" in str(e)]
        pool.validate()
        mid = [pool.stats()["reserved_bytes"], up.mapped_pieces, up.counters()["outstanding_bytes"]]
        b = pool.allocate(2 << 20)
        pool.deallocate(a)
        pool.deallocate(b)
        pool.close()
        print(json.dumps({"err": err, "mid": mid, "end": [up.counters()["outstanding_bytes"], up.mapped_pieces]}))
    """, FAKE_CUDA_CAPACITY=10 << 20)
    assert out["err"] == ["upstream", True]
    MiB = 1 << 20
    assert out["mid"][0] == out["mid"][2] and out["mid"][0] >= 6 * MiB
    assert out["end"] == [0, 0]


RUNS_PRE = """
        import ctypes, os
        fake = ctypes.CDLL(os.environ["POOLKEEPER_LIBCUDA"])
        G = 2 << 20
        grants = fake.fake_cuda_set_access_calls
"""
# A stitching pool of one-granule steps over CudaVirtual (after RUNS_PRE).
STITCH_PRE = RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=G,
                            thread_cache_bytes=0, shrink_interval=0, stitch=True)
"""


def test_growth_over_cuda_virtual_grants_access_once_for_all_its_pieces(fakes):
    """A growth maps one physical piece per map_piece but asks the driver for access once over the
    run (cuMemMap alone grants none; the fake faults on any byte touched before cuMemSetAccess)."""
    out = run(fakes["full"], RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=64 << 20,
                            map_piece=G, thread_cache_bytes=0)
        a = pool.allocate(G)
        g0, m0 = grants(), up.counters()["maps"]
        b = pool.allocate(5 * G)            # one growth of five pieces
        ctypes.memset(b, 0x6B, 5 * G)       # every piece is reachable
        grew = dict(grants=grants() - g0, maps=up.counters()["maps"] - m0, pieces=up.mapped_pieces,
                    map_calls=pool.stats()["map_calls"], ok=set(ctypes.string_at(b, 5 * G)) == {0x6B})
        pool.validate()
        u0 = up.counters()["unmaps"]
        pool.deallocate(b)
        pool.trim()                          # still unmapped piece by piece
        unmaps = up.counters()["unmaps"] - u0
        pool.deallocate(a)
        pool.close()
        print(json.dumps({"grew": grew, "unmaps": unmaps, "end": [up.mapped_pieces, up.counters()["outstanding_bytes"]]}))
    """)
    assert out["grew"] == {"grants": 1, "maps": 5, "pieces": 6, "map_calls": 6, "ok": True}
    assert out["unmaps"] == 5
    assert out["end"] == [0, 0]


def test_stitch_over_cuda_virtual_grants_access_once_for_all_its_aliases(fakes):
    out = run(fakes["full"], STITCH_PRE + """
        blocks = [pool.allocate(G) for _ in range(9)]
        for i in (1, 3, 5, 7):
            pool.deallocate(blocks[i])
        g0 = grants()
        p = pool.allocate(4 * G)            # stitched from pieces 1, 3, 5, 7: four aliases, one grant
        ctypes.memset(p, 0x5A, 4 * G)
        seen = [ctypes.string_at(blocks[i], G) == bytes([0x5A]) * G for i in (1, 3, 5, 7)]
        during = dict(grants=grants() - g0, aliases=up.aliases, alias_calls=pool.stats()["alias_calls"])
        pool.validate()
        pool.deallocate(p)
        for i in (0, 2, 4, 6, 8):
            pool.deallocate(blocks[i])
        pool.close()
        c = up.counters()
        print(json.dumps({"seen": seen, "during": during, "end": [c["aliases"], c["unaliases"], up.aliases, up.mapped_pieces]}))
    """)
    assert out["seen"] == [True] * 4
    assert out["during"] == {"grants": 1, "aliases": 4, "alias_calls": 4}
    assert out["end"] == [4, 4, 0, 0]


def test_cuda_virtual_refused_grant_of_a_growth_maps_nothing_and_the_pool_stays_consistent(fakes):
    """cuMemSetAccess refused for a run: every piece of it is unmapped and released (none is
    reachable without the grant), the pool raises a typed error and serves the next request."""
    out = run(fakes["full"], RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=64 << 20,
                            map_piece=G, thread_cache_bytes=0)
        a = pool.allocate(G)                 # the 1st grant
        try:
            pool.allocate(4 * G)             # the 2nd grant, refused
            err = None
        except pk.errors.PoolkeeperError as e:
            err = [type(e).__name__, "cuMemSetAccess" in str(e)]
        pool.validate()
        st, c = pool.stats(), up.counters()
        mid = dict(reserved=st["reserved_bytes"], map_calls=st["map_calls"], pieces=up.mapped_pieces,
                   outstanding=c["outstanding_bytes"], maps=c["maps"], failed=c["failed_allocations"])
        b = pool.allocate(4 * G)             # granted this time
        ctypes.memset(b, 1, 4 * G)
        pool.validate()
        pool.deallocate(a); pool.deallocate(b); pool.close()
        print(json.dumps({"err": err, "mid": mid, "end": [up.mapped_pieces, up.counters()["outstanding_bytes"]]}))
    """, FAKE_CUDA_FAIL_SET_ACCESS_AT=2)
    assert out["err"] is not None and out["err"][1]
    assert out["mid"] == {"reserved": 2 << 20, "map_calls": 1, "pieces": 1, "outstanding": 2 << 20, "maps": 1, "failed": 1}
    assert out["end"] == [0, 0]


def test_cuda_virtual_refused_grant_of_a_stitch_aliases_nothing_and_the_request_grows(fakes):
    out = run(fakes["full"], STITCH_PRE + """
        blocks = [pool.allocate(G) for _ in range(7)]   # 7 growths: 7 grants
        for i in (1, 3, 5):
            pool.deallocate(blocks[i])
        p = pool.allocate(3 * G)             # the stitch's grant (the 8th) is refused: it grows instead
        ctypes.memset(p, 0x33, 3 * G)
        st = pool.stats()
        pool.validate()
        mid = dict(aliases=up.aliases, alias_failures=st["alias_failures"], stitched=st["stitched_ranges"],
                   inside=blocks[0] <= p < blocks[0] + st["va_bytes"])
        pool.deallocate(p)
        for i in (0, 2, 4, 6):
            pool.deallocate(blocks[i])
        pool.close()
        print(json.dumps({"mid": mid, "end": [up.aliases, up.mapped_pieces, up.counters()["outstanding_bytes"]]}))
    """, FAKE_CUDA_FAIL_SET_ACCESS_AT=8)
    assert out["mid"] == {"aliases": 0, "alias_failures": 1, "stitched": 0, "inside": True}
    assert out["end"] == [0, 0, 0]


def test_cuda_virtual_refused_piece_mid_run_keeps_the_granted_pieces_before_it(fakes):
    """The device runs out at the third piece of a five-piece growth: the two before it are
    granted and stay in the pool's books (free, usable); the request fails with the driver's
    out-of-memory error and nothing leaks."""
    out = run(fakes["full"], RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=64 << 20,
                            map_piece=G, thread_cache_bytes=0)
        a = pool.allocate(G)
        try:
            pool.allocate(5 * G)              # 6 MiB device: pieces 2 and 3 fit, the 4th does not
            err = None
        except pk.errors.OutOfMemoryError as e:
            err = "CUDA_ERROR_OUT_OF_MEMORY" in str(e)
        pool.validate()
        st = pool.stats()
        mid = dict(reserved=st["reserved_bytes"], free=st["free_bytes"], pieces=up.mapped_pieces)
        b = pool.allocate(2 * G)              # the two kept pieces serve it without a map
        ctypes.memset(b, 7, 2 * G)
        maps_after = pool.stats()["map_calls"]
        pool.deallocate(a); pool.deallocate(b); pool.close()
        print(json.dumps({"err": err, "mid": mid, "maps_after": maps_after, "end": [up.mapped_pieces, up.counters()["outstanding_bytes"]]}))
    """, FAKE_CUDA_CAPACITY=6 << 20)
    assert out["err"] is True
    assert out["mid"] == {"reserved": 6 << 20, "free": 4 << 20, "pieces": 3}
    assert out["maps_after"] == 3
    assert out["end"] == [0, 0]


UNMAP_PRE = RUNS_PRE + """
        unmap_calls = fake.fake_cuda_unmap_calls
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=64 << 20,
                            map_piece=G, thread_cache_bytes=0, shrink_interval=0)
        a = pool.allocate(G)
        def grow_and_trim():
            b = pool.allocate(5 * G)         # one growth of five pieces
            ctypes.memset(b, 0x11, 5 * G)
            pool.deallocate(b)
            u0, c0 = up.counters()["unmaps"], unmap_calls()
            pool.trim()                      # the five free pieces: one run
            pool.validate()
            return [up.counters()["unmaps"] - u0, unmap_calls() - c0, up.mapped_pieces]
"""


@pytest.mark.parametrize("runs", [0, 1])
def test_cuda_virtual_takes_a_run_of_free_pieces_down_in_one_unmap_where_the_driver_takes_runs(fakes, runs):
    """Five adjacent free pieces trimmed: five unmaps in the books either way. A driver that takes
    one cuMemUnmap over several mappings gets one call; one that refuses it gets the refused run
    and then one call per piece, twice, and is not asked again. The handles are released either way:
    the 12 MiB device fits the second growth only if the first one's memory came back."""
    out = run(fakes["full"], UNMAP_PRE + """
        first = grow_and_trim()
        asked = up.unmap_runs
        second = grow_and_trim()
        settled = up.unmap_runs
        third = grow_and_trim()
        pool.deallocate(a); pool.close()
        print(json.dumps({"first": first, "second": second, "third": third, "asked": asked, "settled": settled,
                          "driver": up.driver_unmaps,
                          "calls": unmap_calls(), "end": [up.mapped_pieces, up.counters()["outstanding_bytes"], up.leaked_handles]}))
    """, FAKE_CUDA_UNMAP_RUNS=runs, FAKE_CUDA_CAPACITY=12 << 20)
    if runs:
        assert out["first"] == [5, 1, 1] and out["second"] == [5, 1, 1] and out["asked"] is True
        assert out["third"] == [5, 1, 1] and out["settled"] is True
    else:
        # Refused, each piece alone: asked again at the next run, refused again: settled.
        assert out["first"] == [5, 6, 1] and out["second"] == [5, 6, 1] and out["asked"] is None
        assert out["third"] == [5, 5, 1] and out["settled"] is False
    assert out["driver"] == out["calls"]  # every cuMemUnmap the upstream made, counted by it
    assert out["end"] == [0, 0, 0]


@pytest.mark.parametrize("runs", [0, 1])
def test_close_over_cuda_virtual_gives_adjacent_pieces_back_as_one_run(fakes, runs):
    """A pool of six adjacent pieces closes in one cuMemUnmap where the driver takes runs (at exit a
    pool of thousands of pieces would otherwise make thousands of calls); else the refused run and
    one per piece. Everything goes back either way."""
    out = run(fakes["full"], UNMAP_PRE + """
        b = pool.allocate(5 * G)
        pool.deallocate(b)
        pool.deallocate(a)
        c0 = unmap_calls()
        pool.close()
        print(json.dumps({"calls": unmap_calls() - c0, "unmaps": up.counters()["unmaps"],
                          "end": [up.mapped_pieces, up.counters()["outstanding_bytes"], up.leaked_handles]}))
    """, FAKE_CUDA_UNMAP_RUNS=runs)
    assert out == {"calls": 1 if runs else 7, "unmaps": 6, "end": [0, 0, 0]}


def test_cuda_virtual_refused_unmap_inside_a_run_keeps_that_piece_and_those_before_it(fakes):
    """The driver refuses runs, and then the third cuMemUnmap (the second single one, the 4th
    piece) as well: the 5th piece is unmapped and out of the books, the first four stay mapped
    and free in the pool, the failure is counted, and a later trim takes them down. A refusal the
    single unmaps share is not an answer to whether runs work."""
    out = run(fakes["full"], UNMAP_PRE + """
        b = pool.allocate(5 * G)
        pool.deallocate(b)
        pool.trim()
        pool.validate()
        st, c = pool.stats(), up.counters()
        mid = dict(pieces=up.mapped_pieces, reserved=st["reserved_bytes"], outstanding=c["outstanding_bytes"],
                   unmaps=c["unmaps"], failed=c["failed_deallocations"], unmap_failures=st["unmap_failures"],
                   asked=up.unmap_runs)
        pool.trim()
        pool.validate()
        after = [up.mapped_pieces, up.counters()["unmaps"], up.unmap_runs]
        pool.deallocate(a); pool.close()
        print(json.dumps({"mid": mid, "after": after, "end": [up.mapped_pieces, up.counters()["outstanding_bytes"]]}))
    """, FAKE_CUDA_FAIL_UNMAP_AT=3)
    assert out["mid"] == {"pieces": 5, "reserved": 10 << 20, "outstanding": 10 << 20, "unmaps": 1, "failed": 1,
                          "unmap_failures": 1, "asked": None}
    # The second run is refused too and its pieces then go one by one: one such refusal is not
    # an answer yet (two in a row are).
    assert out["after"] == [1, 5, None]
    assert out["end"] == [0, 0]


@pytest.mark.parametrize("runs", [0, 1])
def test_cuda_virtual_tears_a_stitched_range_down_in_one_unmap_where_the_driver_takes_runs(fakes, runs):
    out = run(fakes["full"], STITCH_PRE + """
        unmap_calls = fake.fake_cuda_unmap_calls
        blocks = [pool.allocate(G) for _ in range(9)]
        for i in (1, 3, 5, 7):
            pool.deallocate(blocks[i])
        p = pool.allocate(4 * G)            # stitched from pieces 1, 3, 5, 7: four aliases
        ctypes.memset(p, 0x5A, 4 * G)
        c0, u0 = unmap_calls(), up.counters()["unaliases"]
        pool.deallocate(p)
        pool.trim()                          # the stitched range torn down (and the pieces unmapped)
        pool.validate()
        torn = dict(unaliases=up.counters()["unaliases"] - u0, aliases=up.aliases, teardowns=pool.stats()["stitch_teardowns"],
                    unmaps=pool.stats()["unmap_calls"], calls=unmap_calls() - c0,
                    runs=[pool.stats()["unalias_runs"], pool.stats()["unmap_runs"]])
        for i in (0, 2, 4, 6, 8):
            pool.deallocate(blocks[i])
        pool.close()
        print(json.dumps({"torn": torn, "asked": up.unmap_runs, "end": [up.aliases, up.mapped_pieces, up.leaked_handles]}))
    """, FAKE_CUDA_UNMAP_RUNS=runs)
    # The four aliases in one call (runs) or the refused run and four; the four pieces, apart
    # (live blocks between them), one call each either way.
    assert out["torn"] == {"unaliases": 4, "aliases": 0, "teardowns": 1, "unmaps": 4, "calls": 5 if runs else 9,
                           "runs": [1, 4]}
    assert out["asked"] is (True if runs else None)  # one refused run is not an answer yet
    assert out["end"] == [0, 0, 0]


def test_cuda_virtual_unalias_run_over_the_driver_counts_one_call_per_run(fakes):
    """unalias_pieces straight on the upstream: four aliases end to end go in one cuMemUnmap
    (runs taken), their sources stay mapped with their bytes, and can then be unmapped."""
    out = run(fakes["full"], RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        base = up.reserve(16 * G)
        for k in range(4):
            up.map(base + 2 * k * G, G)
        ctypes.memset(base, 0x42, G)
        dst = base + 8 * G
        n = up.alias_pieces(dst, [(base + 2 * k * G, G) for k in range(4)])
        c0 = fake.fake_cuda_unmap_calls()
        gone = up.unalias_pieces(dst, [G] * 4)
        calls = fake.fake_cuda_unmap_calls() - c0
        kept = ctypes.string_at(base, 16) == bytes([0x42]) * 16
        downs = up.unmap_pieces(base, [G])
        for k in range(1, 4):
            up.unmap(base + 2 * k * G, G)
        up.unreserve(base, 16 * G)
        c = up.counters()
        print(json.dumps({"n": n, "gone": gone, "calls": calls, "kept": kept, "downs": downs,
                          "counts": [c["aliases"], c["unaliases"], c["unmaps"]], "end": [up.aliases, up.mapped_pieces]}))
    """, FAKE_CUDA_UNMAP_RUNS=1)
    assert out == {"n": 4, "gone": 4, "calls": 1, "kept": True, "downs": 1, "counts": [4, 4, 4], "end": [0, 0]}


def test_regression_a_refused_context_switch_in_an_unalias_or_unmap_keeps_the_books(fakes):
    """A hostile review: unalias_pieces took its aliases out of the books and only then made the
    device's context current; a refused switch threw past the code that puts them back, so the
    alias stayed mapped in the driver but was gone from the books (a retry: "not one alias"; its
    source could never be unmapped). unmap_pieces lost its pieces the same way. The context is
    now made current before the books change."""
    out = run(fakes["full"], RUNS_PRE + """
        up = pk.upstream.CudaVirtual()
        base = up.reserve(16 * G)
        up.map_pieces(base, 2 * G, G)
        dst = base + 8 * G
        up.alias_pieces(dst, [(base, G), (base + G, G)])
        refused = []
        for call in (lambda: up.unalias_pieces(dst, [G, G]), lambda: up.unmap(base + G, G)):
            fake.fake_cuda_fail_ctx_set(1)
            try:
                call()
            except pk.errors.PoolkeeperError as e:
                refused.append(type(e).__name__)
        kept = [up.aliases, up.mapped_pieces]
        up.unalias_pieces(dst, [G, G])       # the retries go through
        up.unmap_pieces(base, [G, G])
        up.unreserve(base, 16 * G)
        print(json.dumps({"refused": refused, "kept": kept, "end": [up.aliases, up.mapped_pieces, up.leaked_handles]}))
    """)
    assert out["refused"] == ["UpstreamError", "UpstreamError"]
    assert out["kept"] == [2, 2]
    assert out["end"] == [0, 0, 0]


@pytest.mark.parametrize("runs", [0, 1])
def test_regression_one_refused_run_does_not_turn_unmap_runs_off(fakes, runs):
    """A hostile review: the first run's cuMemUnmap failing once (for any reason) turned runs off
    for good, though the driver took them. Now two runs in a row must be refused as invalid ranges
    (with their mappings then going one by one) before runs stop; one taken settles it the other
    way. FAKE_CUDA_FAIL_UNMAP_AT=1 refuses the first run once."""
    out = run(fakes["full"], UNMAP_PRE + """
        seen = []
        for _ in range(3):
            seen.append([grow_and_trim()[1], up.unmap_runs])
        pool.deallocate(a); pool.close()
        print(json.dumps({"seen": seen, "end": [up.mapped_pieces, up.leaked_handles]}))
    """, FAKE_CUDA_UNMAP_RUNS=runs, FAKE_CUDA_FAIL_UNMAP_AT=1, FAKE_CUDA_CAPACITY=12 << 20)
    if runs:  # refused once, then taken: runs from then on
        assert out["seen"] == [[6, None], [1, True], [1, True]]
    else:  # refused twice (each time the pieces went alone): settled, no more asking
        assert out["seen"] == [[6, None], [6, False], [5, False]]
    assert out["end"] == [0, 0]


def test_regression_alias_racing_an_unmap_of_its_source_never_maps_a_released_handle(fakes):
    """A hostile review: unmap checked that a piece had no alias, let go of the lock, then unmapped
    and released it; an alias taken in between mapped the handle being released (a leaked handle)
    and its unalias later counted down the aliases of whatever piece was mapped there next (the
    count wrapped and that piece could never be unmapped). Now the unmap takes the piece out of
    the books under the same lock, and such an alias is refused."""
    out = run(fakes["full"], RUNS_PRE + """
        import time
        up = pk.upstream.CudaVirtual()
        base = up.reserve(8 * G)
        src, dst = base, base + 4 * G
        up.map(src, G)
        stop = time.time() + 1.5
        done = {"alias": 0, "unmap": 0}
        def aliaser():
            while time.time() < stop:
                try:
                    up.alias_pieces(dst, [(src, G)])
                except pk.errors.PoolkeeperError:
                    continue
                done["alias"] += 1
                up.unalias(dst, G)
        def unmapper():
            while time.time() < stop:
                try:
                    up.unmap(src, G)
                except pk.errors.PoolkeeperError:
                    continue
                done["unmap"] += 1
                up.map(src, G)
        ts = [threading.Thread(target=f) for f in (aliaser, unmapper)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        up.unmap(src, G)  # never blocked by a phantom alias count
        up.unreserve(base, 8 * G)
        print(json.dumps({"done": done, "leaked": up.leaked_handles, "pieces": up.mapped_pieces, "aliases": up.aliases}))
    """)
    assert out["done"]["alias"] > 0 and out["done"]["unmap"] > 0
    assert (out["leaked"], out["pieces"], out["aliases"]) == (0, 0, 0)


def test_expandable_middle_hole_is_unmapped_and_refilled_over_cuda_virtual(fakes):
    out = run(fakes["full"], """
        import ctypes
        from poolkeeper.accounting import check
        up = pk.upstream.CudaVirtual()
        G = 2 << 20
        pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=G,
                            map_piece=G, thread_cache_bytes=0)
        a, b, c = (pool.allocate(G) for _ in range(3))
        pool.deallocate(b)
        freed = pool.trim()  # b's piece lies between two live ones
        pool.validate()
        check(pool.snapshot())
        mid = [freed, up.mapped_pieces, pool.stats()["holes"], up.counters()["outstanding_bytes"]]
        d = pool.allocate(G)  # the hole is mapped back and carved
        ctypes.memset(d, 7, G)  # a missing map would fault here
        pool.validate()
        refill = [d == b, up.mapped_pieces, pool.stats()["holes"], ctypes.string_at(d + G - 1, 1)[0]]
        for p in (a, c, d):
            pool.deallocate(p)
        pool.close()
        print(json.dumps({"mid": mid, "refill": refill, "end": [up.counters()["outstanding_bytes"], up.mapped_pieces]}))
    """)
    G = 2 << 20
    assert out["mid"] == [G, 2, 1, 2 * G]
    assert out["refill"] == [True, 3, 0, 7]
    assert out["end"] == [0, 0]


@pytest.mark.parametrize("lib,env,expect", [("novmm", {}, "virtual memory management"),
                                            ("full", {"FAKE_CUDA_NO_VMM": 1}, "does not support virtual memory")])
def test_cuda_virtual_without_vmm_is_unavailable_with_the_reason(fakes, lib, env, expect):
    out = run(fakes[lib], """
        try:
            pk.upstream.CudaVirtual()
            err = None
        except pk.CudaUnavailableError as e:
            err = str(e)
        dev_ok = pk.upstream.CudaDevice().name
        print(json.dumps({"err": err, "dev": dev_ok}))
    """, **env)
    assert out["err"] and expect in out["err"]
    assert out["dev"] == "CudaDevice(0)"


def test_expandable_bench_arm_draws_from_cuda_virtual_on_the_cuda_backend(fakes):
    out = run(fakes["full"], """
        from poolkeeper.bench.arms import make_arm, select_arms
        from poolkeeper.bench import backends
        arms, skipped = select_arms(["arena", "arena_expandable"], "cuda")
        pool, up = make_arm("arena_expandable").build(backends.upstream_factory("cuda"))
        p = pool.allocate(1 << 20)
        pool.deallocate(p)
        st = pool.stats()
        pool.close()
        print(json.dumps({"arms": [a.name for a in arms], "up": up.name, "maps": st["map_calls"]}))
    """)
    assert out == {"arms": ["arena", "arena_expandable"], "up": "CudaVirtual(0)", "maps": 1}


# ---- the benchmark's cuda backend ----

def test_bench_cuda_backend_reports_cuda_pools_own_footprint_for_cuda_async(fakes, tmp_path):
    """``poolkeeper bench --backend cuda`` runs end to end over the driver, and the cuda_async
    row's peak reserved is what CUDA's default pool held (its RESERVED_MEM_HIGH over that row
    alone), not the Direct pool's view of live bytes."""
    out = tmp_path / "rows.json"
    e = dict(os.environ, POOLKEEPER_LIBCUDA=fakes["full"], FAKE_CUDA_LOG=str(tmp_path / "log"))
    r = subprocess.run([sys.executable, "-m", "poolkeeper.cli", "bench", "--backend", "cuda", "--quick",
                        "--arms", "cuda_async,arena", "--workloads", "random_lifetime,large_recycle",
                        "--no-progress", "--json", str(out)], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(x["arm"], x["workload"]) for x in rows} == {
        (a, w) for a in ("cuda_async", "arena") for w in ("random_lifetime", "large_recycle")}
    for x in rows:
        assert x["backend"] == "cuda"
        if x["arm"] != "cuda_async":
            assert "footprint" not in x["extras"]
            continue
        fp = x["extras"]["footprint"]
        assert fp["source"].startswith("CUDA default pool")
        assert x["peak_reserved_bytes"] == fp["peak_reserved_bytes"]
        # Freed blocks stay in CUDA's warm pool, so it holds at least the peak of live bytes; the
        # pool above it saw the live bytes (rounded to the upstream's 256-byte alignment).
        view = x["extras"]["pool_view_peak_reserved_bytes"]
        assert x["peak_live_bytes"] <= view <= x["peak_live_bytes"] * 1.01
        assert fp["peak_reserved_bytes"] >= x["peak_live_bytes"]
        # Each row starts from a trimmed pool: nothing of the previous row is counted.
        assert fp["start_reserved_bytes"] == 0
    log = (tmp_path / "log").read_text()
    assert log.count("reset attr=6") >= 2 and "cuMemPoolTrimTo" in log


def test_mempool_high_watermark_resets_to_the_current_value(fakes):
    out = run(fakes["full"], """
        up = pk.upstream.CudaAsync()
        p = up.allocate(8 << 20); up.deallocate(p, 8 << 20); up.synchronize()
        before = warm.mempool_attribute(0, "reserved_mem_high")
        warm.trim_to(0, 0)
        warm.reset_high_watermarks(0)
        after = warm.mempool_attribute(0, "reserved_mem_high")
        try:
            _core.cuda_mempool_reset_high(0, "release_threshold"); bad = None
        except pk.errors.InvalidArgumentError as e:
            bad = str(e)
        print(json.dumps({"before": before, "after": after, "bad": bad}))
    """)
    assert out["before"] >= 8 << 20 and out["after"] == 0
    assert "high watermarks" in out["bad"]

# ---- the native upload engine's CUDA backend ----
# The fake defers each async copy until an event recorded after it is waited for (or queried
# complete), so an engine that refilled a staging buffer before waiting for its copy would
# corrupt the destination here, as on a real GPU.

UPLOAD_PRE = """
    import ctypes, os
    import numpy as np
    from poolkeeper.staging import PinnedStagingPool, Uploader
    fake = ctypes.CDLL(os.environ["POOLKEEPER_LIBCUDA"])
    MiB = 1 << 20
    def payload(n, seed):
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    def read(dev, n):
        out = np.empty(n, np.uint8); driver.memcpy_dtoh(out.ctypes.data, dev, n); return out
"""


def urun(lib: str, body: str, **env) -> dict:
    return run(lib, textwrap.dedent(UPLOAD_PRE) + textwrap.dedent(body), **env)


def test_fake_defers_copies_so_reuse_before_wait_is_caught(fakes):
    out = urun(fakes["full"], """
        hp = pk.upstream.CudaPinned().allocate(4096)
        dev = pk.upstream.CudaDevice().allocate(4096)
        s = driver.Stream()
        ctypes.memset(hp, 1, 4096)
        driver.memcpy_htod_async(dev, hp, 4096, s.handle)
        ev = driver.Event.record(s.handle)
        pending = fake.fake_cuda_pending()
        ctypes.memset(hp, 2, 4096)  # a refill before the wait: the copy has not read the buffer yet
        ev.synchronize()
        print(json.dumps({"pending": pending, "after": int(read(dev, 4096)[0]), "left": fake.fake_cuda_pending()}))
    """, FAKE_CUDA_DEFER_COPIES=1)
    assert out == {"pending": 1, "after": 2, "left": 0}


@pytest.mark.parametrize("nt", [False, True])
def test_native_upload_through_the_cuda_backend(fakes, nt):
    out = urun(fakes["full"], f"""
        driver.set_device(1)  # the uploader's stream, and so its events and workers, on device 1
        pool = PinnedStagingPool(pk.upstream.CudaPinned(1), max_buffers=16)
        n = 9 * MiB + 4321
        dev = pk.upstream.CudaDevice(1).allocate(n)
        oks, pins = [], []
        with Uploader(pool, chunk_bytes=MiB, workers=3, depth=2, engine="native", nt_fill={nt}, tail_ramp=True) as up:
            for seed in range(4):
                data = payload(n, seed)
                r = up.upload(data, dev)
                oks.append(bool(np.array_equal(read(dev, n), data)))
                pins.append(r.pinned_alloc_calls)
            eng = up._native
            threads = eng.threads_created
        s = pool.stats()
        print(json.dumps({{"oks": oks, "pins": pins, "engine": r.engine, "pending": fake.fake_cuda_pending(),
                          "live": s["live_buffers"], "leaked": s["leaked_unconfirmed"], "threads": threads,
                          "overlap": r.overlapped_fills, "chunks": r.chunks}}))
    """, FAKE_CUDA_DEVICES=2, FAKE_CUDA_DEFER_COPIES=1, FAKE_CUDA_EVENT_NOT_READY=1)
    assert out["oks"] == [True] * 4 and out["pins"] == [6, 0, 0, 0] and out["engine"] == "native"
    assert out["pending"] == 0 and out["live"] == 0 and out["leaked"] == 0
    assert out["threads"] == 3  # workers only: the CUDA backend has no copy thread
    # 256 KiB, 512 KiB, 5 full MiB + a 4321-byte rest, then the tail: 512 KiB x 3, 256 KiB x 3.
    assert out["chunks"] == 15 and out["overlap"] >= 1  # an event answers "not ready" once


def test_native_upload_failed_async_copy_raises_with_its_cuda_error(fakes):
    out = urun(fakes["full"], """
        pool = PinnedStagingPool(pk.upstream.CudaPinned(), max_buffers=16)
        n = 8 * MiB
        dev = pk.upstream.CudaDevice().allocate(n)
        with Uploader(pool, chunk_bytes=MiB, workers=2, depth=2, engine="native") as up:
            try:
                up.upload(payload(n, 1), dev)
                err = None
            except pk.errors.UpstreamError as e:
                err = [type(e).__name__, e.error_name, "cuMemcpyHtoDAsync" in str(e)]
            res = up._native.result()
            pending = fake.fake_cuda_pending()
            data = payload(n, 2)
            again = up.upload(data, dev)
            ok = bool(np.array_equal(read(dev, n), data))
        s = pool.stats()
        print(json.dumps({"err": err, "lost": res["lost"], "pending": pending, "live": s["live_buffers"],
                          "retained": s["retained_buffers"], "ok": ok, "pins": again.pinned_alloc_calls}))
    """, FAKE_CUDA_DEFER_COPIES=1, FAKE_CUDA_FAIL_HTOD_ASYNC_AT=5)
    assert out["err"] == ["UpstreamError", "CUDA_ERROR_INVALID_VALUE", True]
    assert out["lost"] == [] and out["pending"] == 0  # every enqueued copy was waited for
    assert out["live"] == 0 and out["retained"] == 4 and out["ok"] and out["pins"] == 0


def test_native_upload_failed_event_record_leaks_that_buffer(fakes):
    out = urun(fakes["full"], """
        pool = PinnedStagingPool(pk.upstream.CudaPinned(), max_buffers=16)
        n = 8 * MiB
        dev = pk.upstream.CudaDevice().allocate(n)
        with Uploader(pool, chunk_bytes=MiB, workers=2, depth=2, engine="native") as up:
            try:
                up.upload(payload(n, 1), dev)
                err = None
            except pk.errors.UpstreamError as e:
                err = [e.error_name, "cuEventRecord" in str(e)]
            lost = up._native.result()["lost"]
        s = pool.stats()
        print(json.dumps({"err": err, "lost": len(lost), "leaked": s["leaked_unconfirmed"],
                          "live": s["live_buffers"], "retained": s["retained_buffers"]}))
    """, FAKE_CUDA_DEFER_COPIES=1, FAKE_CUDA_FAIL_EVENT_RECORD_AT=3)
    assert out == {"err": ["CUDA_ERROR_INVALID_VALUE", True], "lost": 1, "leaked": 1, "live": 0, "retained": 3}


@pytest.mark.parametrize("kind", ["arena", "size_class"])
def test_a_failed_event_record_at_release_leaves_the_block_live_and_the_pool_intact(fakes, kind):
    """A release on a stream other than the allocating one records events; if that fails the
    release raises a typed error and changes nothing (no half-pending block, no counted bytes),
    and the same release succeeds once the driver recovers."""
    out = run(fakes["full"], f"""
        up = pk.upstream.CudaDevice()
        pool = pk.make_pool("{kind}", up)
        a, b = driver.Stream(), driver.Stream()
        p = pool.allocate(8 << 20, stream=a)
        before = pool.stats()
        try:
            pool.deallocate(p, stream=b)     # cross-stream: the 1st cuEventRecord of the process fails
            err = None
        except pk.errors.UpstreamError as e:
            err = str(e)
        pool.validate()
        after = pool.stats()
        pool.deallocate(p, stream=b)         # now it records and goes pending
        pending = pool.stats()["pending_bytes"]
        pool.synchronize(); pool.validate()
        print(json.dumps({{"err": err, "live_same": before["live_bytes"] == after["live_bytes"],
                          "blocks": after["live_blocks"], "pending_after_err": after["pending_bytes"],
                          "pending": pending, "in_use": up.events_in_use}}))
        pool.close()
    """, FAKE_CUDA_FAIL_EVENT_RECORD_AT=1)
    assert out["err"] and "cuEventRecord" in out["err"]
    assert out["live_same"] and out["blocks"] == 1 and out["pending_after_err"] == 0
    assert out["pending"] >= 8 << 20 and out["in_use"] == 0


def test_cuda_virtual_unmap_whose_release_fails_still_counts_as_unmapped(fakes):
    """Once cuMemUnmap succeeded the range is unmapped: a refused cuMemRelease afterwards is a
    counted leak, not an error -- else the pool would keep the range as mapped and hand out
    addresses with no memory behind them."""
    out = run(fakes["full"], """
        up = pk.upstream.CudaVirtual()
        pool = pk.ArenaPool(up, expandable=True, va_bytes=64 << 20, initial_backing=2 << 20,
                            step_fraction=0.0, max_step=2 << 20, thread_cache_bytes=0)
        a = pool.allocate(2 << 20)
        b = pool.allocate(4 << 20)
        pool.deallocate(b)
        released = pool.trim()          # unmaps the free tail; the 1st cuMemRelease fails
        pool.validate()
        st = pool.stats()
        mid = [st["reserved_bytes"], up.mapped_pieces, up.leaked_handles, st["unmap_calls"]]
        c = pool.allocate(4 << 20)      # must map again, not reuse unmapped addresses
        maps = pool.stats()["map_calls"]
        pool.deallocate(a); pool.deallocate(c); pool.close()
        print(json.dumps({"released": released, "mid": mid, "maps": maps,
                          "end": [up.mapped_pieces, up.leaked_handles]}))
    """, FAKE_CUDA_FAIL_MEM_RELEASE_AT=1)
    MiB = 1 << 20
    assert out["released"] == 4 * MiB
    assert out["mid"][0] == 2 * MiB and out["mid"][1] == 1 and out["mid"][2] == 1
    assert out["maps"] > out["mid"][3]  # new maps after the unmaps
    assert out["end"] == [0, 1]


# ---- CUDA-graph capture (issue: graphs with poolkeeper as the allocator) ----

CAPTURE_PRE = """
        import ctypes, os
        fake = ctypes.CDLL(os.environ["POOLKEEPER_LIBCUDA"])
        fake.fake_cuda_begin_capture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        fake.fake_cuda_end_capture.argtypes = [ctypes.c_void_p]
"""


@pytest.mark.parametrize("kind", ["arena", "size_class"])
def test_fake_driver_capture_growth_in_relaxed_mode_deferred_events_and_release(fakes, kind):
    # Global-mode capture (PyTorch's default): growth from an empty pool must run cuMemAlloc in
    # relaxed mode, no event may be recorded on the capturing stream, no free may happen, and the
    # graph pool's release must give its memory back to the device pool -- all with zero
    # violations reported by the driver.
    out = run(fakes["full"], CAPTURE_PRE + f"""
        up = pk.upstream.CudaDevice(0)
        pool = pk.make_pool("{kind}", up)
        gp = _core.GraphPools(pool)
        s, other = driver.Stream(), driver.Stream()
        cross = pool.allocate(1 << 20, stream=other.handle)   # used on another stream before
        allocs0 = up.counters()["allocations"]
        gp.begin((1, 0), s.handle)
        fake.fake_cuda_begin_capture(s.handle, 0)
        a = gp.allocate(3 << 20, s.handle)                      # grows: cuMemAlloc during the capture
        t = gp.allocate(1 << 20, s.handle)
        gp.deallocate(t, s.handle)                              # freed inside the capture
        gp.deallocate(cross, s.handle)                          # cross-stream release: events deferred
        pool.process_pending()
        trimmed = pool.trim()                                   # no cuMemFree during the scope
        valid = fake.fake_cuda_end_capture(s.handle)
        gp.end((1, 0))
        grew = up.counters()["allocations"] - allocs0
        pending_during = pool.stats()["pending_bytes"]
        pool.process_pending()                                  # capture over: events recorded now
        pending_after = pool.stats()["pending_bytes"]
        gp.validate(); pool.validate()
        gp.release((1, 0))
        gp.deallocate(a, s.handle)
        closed = gp.info() == []
        gp.validate(); pool.validate()
        print(json.dumps({{"valid": valid, "violations": fake.fake_cuda_capture_violations(), "grew": grew,
                          "trimmed": trimmed, "pending_during": pending_during, "pending_after": pending_after,
                          "closed": closed, "live": pool.stats()["live_bytes"]}}))
    """)
    assert out["violations"] == 0 and out["valid"] == 1, out
    assert out["grew"] >= 1 and out["trimmed"] == 0
    assert out["pending_during"] >= 1 << 20 and out["pending_after"] == 0
    assert out["closed"] and out["live"] == 0


def test_regression_a_graphs_last_free_reported_a_failed_close_and_its_pool_never_closed(fakes):
    # Found by hostile probing: a graph released before its last block was freed closes its pool at
    # that free. When the driver refused a step of the close (here the close's cuEventRecord),
    # poolkeeper_free returned 4 (upstream) although the block was freed: a retry was refused as
    # "points inside the live block" (2), and nothing tried the close again, so the device pool
    # kept the graph's memory live for good (its close() raised LiveBlocksError). The free now
    # succeeds, and the next empty_cache (or the end of a capture scope) closes the pool.
    out = run(fakes["full"], CAPTURE_PRE + """
        from capi_lib import load
        lib = load()
        pool = pk.ArenaPool(pk.upstream.CudaDevice(0))
        _core.registry_set(0, pool)
        s, o = driver.Stream(), driver.Stream()
        x = lib.poolkeeper_malloc(1 << 20, 0, o.handle)
        assert lib.poolkeeper_graph_begin(0, 1, 0, s.handle) == 0
        fake.fake_cuda_begin_capture(s.handle, 0)
        a = lib.poolkeeper_malloc(3 << 20, 0, s.handle)
        b = lib.poolkeeper_malloc(1 << 20, 0, s.handle)
        codes = [lib.poolkeeper_torch_record_stream(a, 0, o.handle), lib.poolkeeper_free(b, 0, s.handle),
                 lib.poolkeeper_free(x, 0, s.handle)]
        valid = fake.fake_cuda_end_capture(s.handle)
        codes += [lib.poolkeeper_graph_end(0, 1, 0), lib.poolkeeper_graph_release(0, 1, 0)]
        codes.append(lib.poolkeeper_free(a, 0, o.handle))  # the last block: its pool closes now
        failed_close_left = len(_core.graph_pools(0).info())
        lib.poolkeeper_empty_cache()
        left = _core.graph_pools(0).info()
        _core.graph_pools(0).validate()
        pool.validate()
        live = pool.stats()["live_blocks"]
        _core.registry_clear()
        pool.close()
        print(json.dumps({"codes": codes, "valid": valid, "failed_close_left": failed_close_left,
                          "left": left, "live": live}))
    """, FAKE_CUDA_FAIL_EVENT_RECORD_AT=3, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                                       os.environ.get("PYTHONPATH", "")]))
    assert out["valid"] == 1 and out["codes"] == [0] * 6, out
    assert out["failed_close_left"] == 1  # the driver refused the close (the fault is injected)
    assert out["left"] == [] and out["live"] == 0


@pytest.mark.parametrize("second", ["CudaDevice", "CudaVirtual"])
def test_regression_a_graph_release_over_another_upstream_of_the_device_synchronized_inside_a_capture(fakes, second):
    # Capture scopes were counted per upstream object: with two upstreams of device 0 (two
    # `poolkeeper.cuda` pools, or a pool made in Python beside the installed one), a graph released
    # over one closed its pool with a device synchronize inside a capture opened over the other
    # (the driver refused: UpstreamError 900, capture invalidated), and a trim there freed memory
    # during it. The count is per device now.
    out = run(fakes["full"], CAPTURE_PRE + f"""
        up_a, up_b = pk.upstream.CudaDevice(0), pk.upstream.{second}(0)
        pool_a, pool_b = pk.ArenaPool(up_a), pk.ArenaPool(up_b)
        a, b = _core.GraphPools(pool_a), _core.GraphPools(pool_b)
        s1, s2 = driver.Stream(), driver.Stream()
        b.begin((1, 0), s2.handle)
        fake.fake_cuda_begin_capture(s2.handle, 0)
        g1 = b.allocate(1 << 20, s2.handle)
        first_valid = fake.fake_cuda_end_capture(s2.handle)
        b.end((1, 0))
        x = pool_b.allocate(8 << 20)
        pool_b.deallocate(x)
        a.begin((2, 0), s1.handle)
        fake.fake_cuda_begin_capture(s1.handle, 0)
        a.allocate(4096, s1.handle)
        b.deallocate(g1, s2.handle)
        b.release((1, 0))                  # closing now would synchronize the device
        trimmed = pool_b.trim()            # a free now would too
        left_during = len(b.info())
        valid = fake.fake_cuda_end_capture(s1.handle)
        a.end((2, 0))                      # the last scope on the device: b's graph closes now
        a.validate(); b.validate(); pool_a.validate(); pool_b.validate()
        print(json.dumps({{"first_valid": first_valid, "valid": valid, "trimmed": trimmed,
                          "left_during": left_during, "left_after": len(b.info()),
                          "violations": fake.fake_cuda_capture_violations()}}))
    """)
    assert out == {"first_valid": 1, "valid": 1, "trimmed": 0, "left_during": 1, "left_after": 0,
                   "violations": 0}, out


def test_fake_driver_capture_is_invalidated_by_a_plain_alloc_outside_relaxed_mode(fakes):
    # The fake driver's rule itself (so the test above can fail): a cuMemAlloc from a thread in
    # global mode during a global capture is refused and invalidates the capture.
    out = run(fakes["full"], CAPTURE_PRE + """
        s = driver.Stream()
        fake.fake_cuda_begin_capture(s.handle, 0)
        fake.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
        driver.set_device(0)
        p = ctypes.c_ulonglong()
        r = fake.cuMemAlloc_v2(ctypes.byref(p), 4096)
        valid = fake.fake_cuda_end_capture(s.handle)
        print(json.dumps({"r": r, "valid": valid, "violations": fake.fake_cuda_capture_violations()}))
    """)
    assert out == {"r": 900, "valid": 0, "violations": 1}


# ---- issue 16: dead streams (item 14) and CudaAsync's stream/device check (item 16) ----

@pytest.mark.parametrize("kind", ["arena", "size_class"])
def test_destroyed_stream_does_not_wedge_the_pool_on_the_cuda_driver(fakes, kind):
    """Allocate on a temporary stream, destroy it, free on its dead handle. Before the fix every
    settling pass recorded an event on the handle and raised UpstreamError INVALID_HANDLE for good:
    process_pending, synchronize and close, and a healthy stream's pending bytes were never
    reclaimed either."""
    out = run(fakes["full"], f"""
        up = pk.upstream.CudaDevice()
        pool = pk.make_pool("{kind}", up)
        good = driver.Stream()
        tmp = driver.Stream()
        p = pool.allocate(1 << 20, stream=tmp)
        q = pool.allocate(1 << 20, stream=good)
        h = tmp.handle
        tmp.close()                          # cuStreamDestroy: the handle is dead from here on
        pool.deallocate(p, stream=h)
        pool.deallocate(q, stream=good)
        errs = []
        for step in (pool.process_pending, pool.synchronize):
            try:
                step()
            except pk.errors.UpstreamError as e:
                errs.append(str(e))
        st = pool.stats()
        pool.validate()
        r = pool.allocate(1 << 20, stream=good); pool.deallocate(r, stream=good)
        pool.synchronize()
        print(json.dumps({{"errs": errs, "pending": st["pending_bytes"], "dead": st["dead_stream_settles"],
                          "in_use": up.events_in_use}}))
        pool.close()
        good.close()
    """, FAKE_CUDA_EVENT_NOT_READY=1)
    assert out["errs"] == []
    assert out["pending"] == 0
    assert out["dead"] >= 1
    assert out["in_use"] == 0


def test_cuda_async_refuses_a_stream_of_another_device(fakes):
    """Before the fix CudaAsync(device=1, stream=<a stream of device 0>) was accepted: its memory
    came from device 0's pool while h.device said 1, and device 1 was warmed instead."""
    out = run(fakes["full"], """
        s0 = driver.Stream(device=0)
        s1 = driver.Stream(device=1)
        try:
            pk.upstream.CudaAsync(device=1, stream=s0)
            err = None
        except pk.errors.InvalidArgumentError as e:
            err = str(e)
        ok = pk.upstream.CudaAsync(device=1, stream=s1)   # its own device's stream: fine
        p = ok.allocate(4096); ok.deallocate(p, 4096)
        dead = driver.Stream(device=0); h = dead.handle; dead.close()
        try:
            pk.upstream.CudaAsync(device=0, stream=h)
            dead_err = None
        except pk.errors.InvalidArgumentError as e:
            dead_err = str(e)
        print(json.dumps({"err": err, "dead_err": dead_err, "dev": ok.device}))
    """, FAKE_CUDA_DEVICES=2)
    assert out["err"] and "belongs to device 0" in out["err"]
    assert out["dead_err"] and "not a usable stream" in out["dead_err"]
    assert out["dev"] == 1


@pytest.mark.parametrize("kind", ["arena", "size_class"])
def test_lagging_stream_holds_one_cuda_event_not_one_per_pass(fakes, kind):
    """Before the fix every settling pass on a lagging stream recorded (and kept) a new event:
    200 passes, 200 live events, each a cuEventCreate."""
    out = run(fakes["full"], f"""
        up = pk.upstream.CudaDevice()
        pool = pk.make_pool("{kind}", up)
        s = driver.Stream()
        for _ in range(200):
            p = pool.allocate(4096, stream=s)
            pool.deallocate(p, stream=s)
            pool.process_pending()
        print(json.dumps({{"created": up.events_created, "in_use": up.events_in_use,
                          "fences": pool.stats()["fences_recorded"]}}))
        pool.synchronize(); pool.close(); s.close()
    """, FAKE_CUDA_EVENT_NOT_READY=1000000)
    assert out["created"] == 1 and out["in_use"] == 1 and out["fences"] == 1


# ---- whether the expandable arena can run on a device ----

@pytest.mark.parametrize("lib,env,expect", [
    ("full", {}, True),
    ("full", {"FAKE_CUDA_NO_VMM": 1}, False),  # the device says no
    ("novmm", {}, False),                      # the driver lacks cuMemCreate and the rest
])
def test_devices_say_whether_virtual_memory_runs_there(fakes, lib, env, expect):
    out = run(fakes[lib], """
        print(json.dumps({"info": [d.virtual_memory_supported for d in cuda.devices()],
                          "direct": _core.cuda_virtual_memory_supported(0),
                          "bad_index": _core.cuda_virtual_memory_supported(7)}))
    """, **env)
    assert out == {"info": [expect], "direct": expect, "bad_index": False}


@pytest.mark.parametrize("lib, expect", [("full", True), ("novmm", False)])
def test_install_default_asks_about_virtual_memory_without_making_a_context(fakes, tmp_path, lib, expect):
    """install()'s default picks its kind by asking each device about virtual memory. The first
    version asked poolkeeper.cuda.device_info, which retains a context on every device it
    describes: every process with the default install held one on every visible GPU (review)."""
    log = tmp_path / "driver.log"
    out = run(fakes[lib], """
        from poolkeeper.integrations import torch as pkt
        print(json.dumps({"vmm": pkt._virtual_memory_everywhere()}))
    """, FAKE_CUDA_DEVICES=4, FAKE_CUDA_LOG=log)
    assert out["vmm"] is expect
    text = log.read_text() if log.exists() else ""
    assert "retain" not in text, text


# ---- fork while threads hold the pool directory's, a pool's and an upstream's locks ----

_FORK_LOCK_ORDER_CHILD = r"""
import os, sys, threading
import poolkeeper as pk
first = pk.ArenaPool(pk.upstream.CudaDevice())  # a pool before any Host/Simulated upstream
sim = pk.upstream.Simulated(latency_us=0)
pool = pk.ArenaPool(sim)
s1, s2 = sim.stream(), sim.stream()
stop = False
def settle():
    while not stop:
        xs = [pool.allocate(4096, s1) for _ in range(2000)]
        for x in xs:
            pool.deallocate(x, s2)     # pending behind events recorded on the upstream
        sim.advance(1000)
        pool.synchronize()             # the pool's lock held, the upstream's taken for each event
def exiting():
    xs = [pool.allocate(4096) for _ in range(50)]
    for x in xs:
        pool.deallocate(x)             # a thread cache, folded back at thread exit
for t in [threading.Thread(target=settle, daemon=True) for _ in range(2)]:
    t.start()
for i in range(int(sys.argv[1])):
    ts = [threading.Thread(target=exiting, daemon=True) for _ in range(3)]
    for t in ts:
        t.start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    for t in ts:
        t.join()
stop = True
print("FORKS-OK", flush=True)
"""


def test_regression_fork_deadlocked_when_the_leaf_locks_were_taken_before_the_pool_directory(fakes):
    """Found by review: ForkSafeMutex's prepare handler was registered at the first Host/Simulated
    upstream, the pool directory's at the first pool. glibc runs prepare handlers in reverse order
    of registration, so in a process whose first pool was a CUDA one, fork() took every upstream
    leaf lock first and then waited for the directory lock -- held by a thread folding its thread
    cache at exit, waiting for an arena's lock, whose holder (synchronize) waited for the
    Simulated upstream's leaf lock the forking thread held: os.fork() never returned (in 4 of 5
    runs of 300 forks). The leaf handler is now registered at load by a priority-101 constructor,
    before every other handler of the library."""
    e = dict(os.environ, POOLKEEPER_LIBCUDA=fakes["full"])
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_LOCK_ORDER_CHILD, "600"], env=e, capture_output=True,
                           text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("fork() deadlocked in its prepare handlers")
    assert r.returncode == 0 and "FORKS-OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_vmm_latency_script_measures_runs_beside_single_calls_over_the_fake_driver(fakes, tmp_path):
    """benchmarks/vmm_latency.py, the figure behind mapping and aliasing in runs: it runs end to
    end (through the real CudaVirtual code, on the fake driver) and reports every column."""
    out = tmp_path / "v.json"
    script = Path(__file__).parent.parent / "benchmarks" / "vmm_latency.py"
    e = dict(os.environ, POOLKEEPER_LIBCUDA=fakes["full"])
    r = subprocess.run([sys.executable, str(script), "--sizes-mib", "2", "--reps", "2", "--runs", "3", "--json", str(out)],
                       env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    (run_,) = data["runs"]
    assert run_["pieces"] == 3
    assert set(run_) == {"pieces", "map_each_us", "map_run_us", "alias_each_us", "alias_run_us", "unalias_each_us",
                         "unalias_run_us", "unmap_each_us", "unmap_run_us", "unmap_runs"}
    assert run_.pop("unmap_runs") is False  # the fake driver refuses runs unless told otherwise
    assert all(v > 0 for v in run_.values())


@pytest.mark.parametrize("runs", [0, 1])
def test_vmm_driver_calls_script_times_each_call_and_asks_about_unmapping_a_run(fakes, tmp_path, runs):
    """benchmarks/vmm_driver_calls.py calls libcuda itself (ctypes): over the fake driver it runs
    end to end, times every call it names, and reports the driver's answer to one cuMemUnmap over
    several mappings: refused by default (the fake takes exactly one mapping per unmap), accepted
    with FAKE_CUDA_UNMAP_RUNS=1, where every piece it took down maps again."""
    out = tmp_path / "d.json"
    script = Path(__file__).parent.parent / "benchmarks" / "vmm_driver_calls.py"
    e = dict(os.environ, POOLKEEPER_LIBCUDA=fakes["full"], FAKE_CUDA_UNMAP_RUNS=str(runs))
    r = subprocess.run([sys.executable, str(script), "--reps", "2", "--pieces", "3", "--background", "0,7",
                        "--json", str(out)], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["granularity"] == 2 << 20 and data["pieces"] == 3
    assert set(data["calls_us"]) == {"cuMemCreate", "cuMemMap", "cuMemSetAccess, one piece",
                                     "cuMemSetAccess, run of 3 (per piece)", "cuMemMap of a mapped handle (alias)",
                                     "cuMemUnmap of an alias", "cuMemUnmap", "cuMemRelease"}
    # The calls again with 7 other mappings present (--background), each timed as without them.
    assert set(data["background_calls_us"]) == {"0", "7"}
    assert data["background_calls_us"]["0"] == data["calls_us"]
    assert set(data["background_calls_us"]["7"]) == set(data["calls_us"])
    assert "other mappings present" in r.stdout
    assert data["unmap_run"]["accepted"] is bool(runs) and data["unmap_run"]["remapped"] == 3 * runs
    assert data["unmap_run"]["cleanup_ok"] is True
    assert ("accepted" if runs else "refused") in r.stdout
