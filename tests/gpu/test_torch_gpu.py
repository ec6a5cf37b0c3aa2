"""poolkeeper as PyTorch's allocator, on a real GPU. Each case runs in a fresh process (see
isolated.py). Includes our port of PyTorch's TestMemPool custom-allocator case
(test/test_cuda.py::TestMemPool::test_mempool_with_allocator): same facts, our allocator."""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]

PRELUDE = """
import gc, torch
import poolkeeper as pk
from poolkeeper.integrations import torch as pkt
"""


def test_tensors_allocate_through_poolkeeper():
    run_isolated(
        PRELUDE
        + """
inst = pkt.install("arena")
assert inst.hooks == {"record_stream": True, "empty_cache": True, "graph_begin": True, "graph_end": True,
                      "graph_release": True}, inst.hooks
x = torch.empty(1000, dtype=torch.uint8, device="cuda")
st = pkt.stats()
assert st["live_bytes"] == 1000, st["live_bytes"]  # exactly the storage: PyTorch asked us for it
assert st["upstream_allocations"] >= 1
y = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
assert pkt.stats()["live_bytes"] == 1000 + 4 * (1 << 20)
assert float((y * 2).sum()) == float((torch.arange(1 << 20, dtype=torch.float64) * 2).sum())
del x, y
gc.collect()
assert pkt.stats()["live_bytes"] == 0, pkt.stats()["live_bytes"]
pkt.stats()  # still readable
snap = pkt.snapshot()
assert snap.to_dict()["backings"]
for p in pkt.pools().values():
    p.synchronize()
    p.validate()
print("ok")
"""
    )


def test_install_without_a_kind_makes_the_expandable_arena_in_single_stream_mode():
    """install()'s default on a device with virtual memory (docs/integrations.md, "Which pool by
    default"): home releases are free at once, and a side stream ends the mode with one wait."""
    run_isolated(
        PRELUDE
        + """
assert all(d.virtual_memory_supported for d in pk.cuda.devices())
inst = pkt.install()
assert (inst.kind, inst.upstream, inst.options) == ("arena_expandable", "virtual",
                                                   {"single_stream": True, **pk.pools.WIDE_STITCH}), inst
x = torch.randn(1 << 20, device="cuda")
y = (x * 2).sum()
del x
st = pkt.stats(0)
assert st["expandable"] == 1 and st["single_stream"] == 1 and st["home_frees"] >= 1, st
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    z = torch.ones(1 << 10, device="cuda")
torch.cuda.synchronize()
st = pkt.stats(0)
assert st["single_stream"] == 0 and st["home_barriers"] == 1, st
assert float(y) == float(y) and float(z.sum()) == 1024.0
for p in pkt.pools().values():
    p.synchronize()
    p.validate()
print("ok")
"""
    )


def test_install_after_cuda_init_is_refused():
    out = run_isolated(
        PRELUDE
        + """
from poolkeeper.integrations._common import AllocatorInitializedError
torch.zeros(1, device="cuda")
try:
    pkt.install()
except AllocatorInitializedError as e:
    print("refused:", str(e)[:80])
else:
    raise AssertionError("install() after CUDA init must fail")
assert pkt.installation() is None
"""
    )
    assert "refused" in out


def test_record_stream_reaches_the_pool():
    run_isolated(
        PRELUDE
        + """
pkt.install("arena")
side = torch.cuda.Stream()
x = torch.ones(1 << 20, device="cuda")
before = pkt.hook_counters()["record_stream"]
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(50_000_000)  # keep the side stream busy with the tensor in use
    y = x * 3
x.record_stream(side)
assert pkt.hook_counters()["record_stream"] == before + 1
del x
gc.collect()
st = pkt.stats()
assert st["live_bytes"] == y.numel() * 4, st["live_bytes"]
# the released block waits for the side stream, not only the allocating one
snap = pkt.snapshot().to_dict()
waits = [c for b in snap["backings"] for c in b["chunks"] if c["state"] == "pending"]
assert waits, "block released while the side stream uses it must be pending"
assert any(side.cuda_stream in c["waits_on"] for c in waits), waits
torch.cuda.synchronize()
for p in pkt.pools().values():
    p.synchronize()
assert pkt.stats()["pending_bytes"] == 0
assert float(y.sum()) == 3.0 * (1 << 20)
print("ok")
"""
    )


def test_allocation_the_pool_cannot_serve_raises():
    # PyTorch's pluggable allocator takes whatever malloc returns; a NULL would become a tensor at
    # address 0. install() wires the raising entry point, so the failure is a Python error.
    out = run_isolated(
        PRELUDE
        + """
pkt.install("arena", limit=64 << 20)
x = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
try:
    y = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
except RuntimeError as e:
    msg = str(e)
    print("raised:", msg[:200])
    assert "poolkeeper" in msg and "limit" in msg, msg
else:
    raise AssertionError(f"no error; data_ptr={y.data_ptr():#x}")
z = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")  # still usable afterwards
assert int(x.sum()) + int(z.sum()) == 2 << 20
st = pkt.stats()
assert st["live_bytes"] == 2 << 20, st["live_bytes"]
for p in pkt.pools().values():
    p.validate()
"""
    )
    assert "raised" in out


def test_empty_cache_trims_free_backings():
    run_isolated(
        PRELUDE
        + """
pkt.install("arena", max_backing=8 << 20)
keep = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # oversize: its own backing
del big
gc.collect()
reserved = pkt.stats()["reserved_bytes"]
assert reserved >= 256 << 20
n = pkt.hook_counters()["empty_cache"]
torch.cuda.empty_cache()
assert pkt.hook_counters()["empty_cache"] == n + 1
after = pkt.stats()
assert after["reserved_bytes"] <= reserved - (256 << 20), (reserved, after["reserved_bytes"])
assert after["upstream_deallocations"] >= 1
print("ok")
"""
    )


def test_port_of_pytorch_mempool_with_allocator():
    # PyTorch's test: MemPool(custom allocator) starts with use count 1, 2 inside use_mem_pool;
    # the custom alloc is called; 1 MiB tensors pack into 2 MiB segments (1, 1, then 2
    # segments); deleting the tensors and the pool frees through the custom free.
    run_isolated(
        PRELUDE
        + """
mp = pkt.mempool("arena")
assert mp.use_count() == 1
nelem_1mb = 1024 * 1024 // 4
with torch.cuda.use_mem_pool(mp):
    out_0 = torch.randn(nelem_1mb, device="cuda")
    assert mp.use_count() == 2
assert mp.use_count() == 1
st = pkt.stats()
assert st["live_blocks"] == 1 and st["live_bytes"] == 2 << 20, (st["live_blocks"], st["live_bytes"])
outside = torch.empty(nelem_1mb, device="cuda")  # the native allocator's, not ours
assert pkt.stats()["live_bytes"] == 2 << 20
with pkt.use_mempool(mp):
    assert len(mp.snapshot()) == 1
    out_1 = torch.randn(nelem_1mb, device="cuda")
    assert len(mp.snapshot()) == 1 and pkt.stats()["live_blocks"] == 1
    out_2 = torch.randn(nelem_1mb, device="cuda")
    assert len(mp.snapshot()) == 2 and pkt.stats()["live_blocks"] == 2
del out_0, out_1, out_2
del mp
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
st = pkt.stats()
assert st["live_bytes"] == 0, st["live_bytes"]
print("ok")
"""
    )


def test_pool_buffers_interoperate_with_torch():
    run_isolated(
        PRELUDE
        + """
import numpy as np
pool = pk.ArenaPool(pk.upstream.CudaDevice(0))
b = pool.buffer(4096, stream=0)
t = torch.from_dlpack(b)
assert t.device.type == "cuda" and t.data_ptr() == b.ptr and t.numel() == 4096
t.fill_(7)
b.release()
assert pool.stats()["live_bytes"] == 4096  # torch still holds it
assert int(t.sum()) == 7 * 4096
del t
gc.collect()
torch.cuda.synchronize()
assert pool.stats()["live_bytes"] == 0
pinned = pk.ArenaPool(pk.upstream.CudaPinned())
hb = pinned.buffer(1024)
assert hb.__dlpack_device__() == (3, 0)
a = np.asarray(hb)
a[:] = 9
assert bytes(memoryview(hb)[:2]) == b"\\x09\\x09"
dev = torch.from_numpy(a).to("cuda")
assert int(dev.sum()) == 9 * 1024
print("ok")
"""
    )


def test_install_checks_an_existing_pool_and_is_idempotent_for_it():
    """Issue 16 item 19: a pool over pinned host memory is refused; a device pool serves its
    device, and installing the same pool again returns the same installation."""
    run_isolated(
        PRELUDE
        + """
from poolkeeper.errors import InvalidArgumentError
pinned = pk.ArenaPool(pk.upstream.CudaPinned(0))
try:
    pkt.install(pinned)
except InvalidArgumentError as e:
    assert "CudaPinned" in str(e), e
else:
    raise AssertionError("a pool over CudaPinned must be refused")
assert pkt.installation() is None
pool = pk.ArenaPool(pk.upstream.CudaDevice(0))
inst = pkt.install(pool)
assert pkt.install(pool) is inst
x = torch.empty(4096, dtype=torch.uint8, device="cuda")
assert pool.stats()["live_bytes"] == 4096
del x
print("ok")
"""
    )
