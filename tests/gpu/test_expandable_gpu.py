"""ArenaPool(expandable=True) over CudaVirtual on a real GPU: physical pieces mapped onto one
reserved range by cuMemCreate/cuMemMap/cuMemSetAccess, checked by content (every live block is
filled on its stream and read back in full before it is freed), a trim that unmaps the free tail
(the device's free memory comes back), blocks that survive the trim, and exact call counts."""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk
from poolkeeper.cuda import driver
from device_io import read

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def test_cuda_virtual_contract_on_the_device():
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    assert up.supports_virtual and g >= 64 * 1024 and g & (g - 1) == 0
    base = up.reserve(8 * g)
    up.map(base, 2 * g)
    up.map(base + 2 * g, g)
    driver.memset_d8(base, 7, 3 * g)  # one write across two pieces: the range is contiguous
    assert (read(base + 2 * g - 16, 32) == 7).all()
    with pytest.raises(pk.errors.UpstreamError):
        up.unmap(base, g)  # half of a piece
    assert up.mapped_pieces == 2
    up.unmap(base + 2 * g, g)
    up.unmap(base, 2 * g)
    up.unreserve(base, 8 * g)
    c = up.counters()
    assert (c["maps"], c["unmaps"], c["allocations"], c["deallocations"], c["outstanding_bytes"]) == (2, 2, 2, 2, 0)
    assert up.mapped_pieces == 0


def test_cuda_virtual_runs_grant_access_once_over_many_pieces_on_the_device():
    """map_pieces / alias_pieces: each piece its own physical handle, one cuMemSetAccess over the
    run. A write across the whole run proves every piece is reachable; the alias run shows the
    same bytes; each piece is unmapped alone."""
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    base, dst = up.reserve(16 * g), up.reserve(16 * g)
    assert up.map_pieces(base, 5 * g, g) == 5 * g
    assert up.mapped_pieces == 5 and up.counters()["maps"] == 5
    driver.memset_d8(base, 9, 5 * g)
    assert (read(base + 5 * g - 64, 64) == 9).all()
    assert up.alias_pieces(dst, [(base + 3 * g, g), (base + g, g), (base + 4 * g, g)]) == 3
    driver.memset_d8(dst + g - 8, 4, 16)  # across the first two aliases: pieces 3 and 1
    assert (read(base + 4 * g - 8, 8) == 4).all() and (read(base + g, 8) == 4).all()
    for k in range(3):
        up.unalias(dst + k * g, g)
    with pytest.raises(pk.errors.UpstreamError):
        up.unmap(base, 2 * g)  # two pieces are two maps
    for k in range(5):
        up.unmap(base + k * g, g)
    up.unreserve(base, 16 * g)
    up.unreserve(dst, 16 * g)
    c = up.counters()
    assert (c["maps"], c["unmaps"], c["aliases"], c["unaliases"], c["outstanding_bytes"]) == (5, 5, 3, 3, 0)


def test_cuda_virtual_unmap_and_unalias_runs_on_the_device():
    """unalias_pieces / unmap_pieces: the driver is asked whether one cuMemUnmap may take down a
    run of mappings (either answer is the driver's to give: unmap_runs says which it gave, at the
    first run if it takes them, at the second refused one if not); the runs go either way, the
    sources keep their bytes, and nothing stays mapped."""
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    base, dst = up.reserve(16 * g), up.reserve(16 * g)
    assert up.map_pieces(base, 6 * g, g) == 6 * g
    driver.memset_d8(base, 7, 6 * g)
    assert up.alias_pieces(dst, [(base + k * g, g) for k in (5, 0, 3, 2)]) == 4
    assert up.unmap_runs is None  # not asked yet
    d0 = up.driver_unmaps
    assert up.unalias_pieces(dst, [g] * 4) == 4
    first = up.unmap_runs
    assert first in (True, None) and up.aliases == 0
    assert up.driver_unmaps - d0 == (1 if first else 5)  # a refused run, then one per alias
    assert (read(base + 6 * g - 64, 64) == 7).all() and (read(base, 64) == 7).all()
    d0 = up.driver_unmaps
    assert up.unmap_pieces(base, [g] * 6) == 6
    answer = up.unmap_runs
    print(f"driver takes unmap runs: {answer}")
    assert answer is (True if first else False)
    assert up.driver_unmaps - d0 == (1 if first else 7)
    c = up.counters()
    assert (c["unmaps"], c["unaliases"], c["outstanding_bytes"], up.mapped_pieces, up.leaked_handles) == (6, 4, 0, 0, 0)
    up.unreserve(base, 16 * g)
    up.unreserve(dst, 16 * g)


def test_expandable_arena_by_content_then_trim_and_close():
    rng = random.Random(4321)
    up = pk.upstream.CudaVirtual(0)
    pool = pk.ArenaPool(up, expandable=True, max_step=16 * MiB)
    streams = [None, driver.Stream(), driver.Stream()]
    live = {}
    tag = 0
    sizes = [256, 1000, 4096, 65536, 300_000, MiB, 3 * MiB + 5, 40 * MiB]
    for step in range(400):
        if live and (len(live) >= 48 or rng.random() < 0.45):
            ptr = rng.choice(list(live))
            size, byte, s = live.pop(ptr)
            if s is not None:
                s.synchronize()
            assert (read(ptr, size) == byte).all(), f"step {step}: block {ptr:#x} of {size} B was overwritten"
            pool.deallocate(ptr, stream=s)
        else:
            size = rng.choice(sizes)
            s = rng.choice(streams)
            ptr = pool.allocate(size, stream=s)
            tag = tag % 250 + 1
            driver.memset_d8(ptr, tag, size, None if s is None else s.handle)
            live[ptr] = (size, tag, s)
        if step % 50 == 0:
            pool.validate()
            st = pool.stats()
            assert st["reserved_bytes"] == st["mapped_bytes"] == up.counters()["outstanding_bytes"]
            assert st["backings"] == 1
    # Keep the lowest blocks, free the rest: trim unmaps the free tail, the kept blocks stay intact.
    keep = sorted(live)[:4]
    for ptr in sorted(live)[4:]:
        size, byte, s = live.pop(ptr)
        if s is not None:
            s.synchronize()
        pool.deallocate(ptr, stream=s)
    pool.synchronize()
    before = pool.stats()
    free_before = driver.mem_get_info()[0]
    released = pool.trim()
    after = pool.stats()
    assert released == before["reserved_bytes"] - after["reserved_bytes"]
    assert after["unmap_calls"] - before["unmap_calls"] == before["mapped_pieces"] - after["mapped_pieces"]
    assert up.mapped_pieces == after["mapped_pieces"]
    if released:  # the driver's free memory grows by what was unmapped (others may allocate meanwhile)
        assert driver.mem_get_info()[0] >= free_before + released - 64 * MiB
    for ptr in keep:
        size, byte, s = live.pop(ptr)
        if s is not None:
            s.synchronize()
        assert (read(ptr, size) == byte).all()
        pool.deallocate(ptr, stream=s)
    pool.synchronize()
    pool.validate()
    pool.close()
    c = up.counters()
    assert c["maps"] == c["unmaps"] == c["allocations"] == c["deallocations"] and c["outstanding_bytes"] == 0
    assert (c["reserves"], c["unreserves"]) == (1, 1) and up.mapped_pieces == 0
    for s in streams[1:]:
        s.close()


def test_fragment_stitch_writes_only_the_lent_bytes_of_shared_pieces():
    """stitch_fragments on the device: a stitched block that begins in piece 1's free end and ends
    in piece 5's free start. Writing all of it changes those bytes (seen through the main range)
    and none of the live blocks that share the two pieces."""
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    pool = pk.ArenaPool(up, expandable=True, initial_backing=g, step_fraction=0.0, max_step=g, thread_cache_bytes=0,
                        shrink_interval=0, stitch=True, stitch_fragments=True)
    sizes = [g, g // 4, 3 * g // 4, g, g, g, g // 2, g // 2]
    blocks = [pool.allocate(n) for n in sizes]
    base = blocks[0]
    for i in (2, 4, 6):
        pool.deallocate(blocks[i])
    live = [(blocks[i], sizes[i]) for i in (0, 1, 3, 5, 7)]
    for k, (q, n) in enumerate(live):
        driver.memset_d8(q, 0x10 + k, n)
    maps = up.counters()["maps"]
    p = pool.allocate(9 * g // 4)  # 3/4 g + g + 1/2 g: nothing mapped
    assert up.counters()["maps"] == maps and up.aliases == 3 and pool.stats()["stitched_fragments"] == 2
    driver.memset_d8(p, 0x5A, 9 * g // 4)
    for k, (q, n) in enumerate(live):
        assert (read(q, n) == 0x10 + k).all()  # the pieces' other bytes: untouched
    assert (read(base + g + g // 4, 3 * g // 4) == 0x5A).all()  # piece 1's free end, through the main range
    assert (read(base + 5 * g, g // 2) == 0x5A).all()  # piece 5's free start
    pool.validate()
    pool.deallocate(p)
    assert up.aliases == 0 and pool.stats()["stitched_bytes"] == 0
    assert pool.allocate(3 * g // 4) == base + g + g // 4  # the free end is the main range's again
    pool.validate()
    for q, _ in live:
        pool.deallocate(q)
    pool.deallocate(base + g + g // 4)
    pool.close()
    c = up.counters()
    assert (c["aliases"], c["unaliases"], c["outstanding_bytes"]) == (3, 3, 0) and up.mapped_pieces == 0


def test_stitched_range_is_the_same_device_memory_and_goes_back_cleanly():
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    pool = pk.ArenaPool(up, expandable=True, initial_backing=g, step_fraction=0.0, max_step=g,
                        thread_cache_bytes=0, shrink_interval=0, stitch=True)
    blocks = [pool.allocate(g) for _ in range(7)]
    for i in (1, 3, 5):
        pool.deallocate(blocks[i])
    maps = up.counters()["maps"]
    p = pool.allocate(3 * g)  # no contiguous 3 granules free: stitched from pieces 1, 3, 5
    assert up.counters()["maps"] == maps and up.aliases == 3 and pool.stats()["stitched_ranges"] == 1
    driver.memset_d8(p, 0x5A, 3 * g)  # one write across the stitched range
    for i in (1, 3, 5):
        assert (read(blocks[i], g) == 0x5A).all()  # the same memory through the main range
    pool.validate()
    pool.deallocate(p)  # its last block: the aliases go, the pieces rejoin the main range
    assert up.aliases == 0 and pool.stats()["stitched_ranges"] == 0
    pool.validate()
    for i in (0, 2, 4, 6):
        pool.deallocate(blocks[i])
    pool.close()
    c = up.counters()
    assert (c["aliases"], c["unaliases"], c["outstanding_bytes"], c["reserves"], c["unreserves"]) == (3, 3, 0, 2, 2)
    assert up.mapped_pieces == 0
