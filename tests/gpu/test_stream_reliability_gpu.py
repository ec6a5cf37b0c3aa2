"""Issue 16 stream items on a real GPU, each in a fresh process: what the driver answers for a
destroyed stream (the CPU tests assume CUDA_ERROR_INVALID_HANDLE, as the fake driver answers), that
a pool is not wedged by one (arena and size_class, CudaDevice; and through CuPy, whose arrays are
freed on their stream after a `with cupy.cuda.Stream():` block destroyed it), and CudaAsync's
stream/device check on two GPUs."""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = pytest.mark.gpu

PRELUDE = """
import gc, json
import poolkeeper as pk
from poolkeeper.cuda import driver
"""


@pytest.mark.parametrize("kind", ["arena", "size_class"])
def test_destroyed_stream_does_not_wedge_the_pool_gpu(kind):
    out = run_isolated(PRELUDE + f"""
up = pk.upstream.CudaDevice()
pool = pk.make_pool("{kind}", up)
good = driver.Stream()
tmp = driver.Stream()
p = pool.allocate(1 << 20, stream=tmp)
q = pool.allocate(1 << 20, stream=good)
h = tmp.handle
tmp.close()
pool.deallocate(p, stream=h)
pool.deallocate(q, stream=good)
pool.process_pending()
pool.synchronize()
st = pool.stats()
assert st["pending_bytes"] == 0, st
pool.validate()
r = pool.allocate(1 << 20, stream=good); pool.deallocate(r, stream=good)
pool.synchronize()
pool.close()
good.close()
print(json.dumps({{"dead_stream_settles": st["dead_stream_settles"]}}))
""")
    print(out)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy")
def test_cupy_array_outliving_its_stream_block_does_not_wedge_the_pool_gpu():
    run_isolated("""
import gc
import cupy
import poolkeeper as pk
from poolkeeper.integrations import cupy as pkc
inst = pkc.install("arena")
pool = inst.allocator.pools.get(0)   # made on first use: make it now
keep = []
for _ in range(4):
    with cupy.cuda.Stream():
        keep.append(cupy.arange(1 << 18, dtype=cupy.float32) * 2)
    # the with block destroyed the stream; the array is freed on its handle below
cupy.cuda.Device().synchronize()
del keep
gc.collect()
pool.process_pending()
pool.synchronize()
assert pool.stats()["pending_bytes"] == 0, pool.stats()
x = cupy.ones(1 << 20, dtype=cupy.float32)
assert float(x.sum()) == float(1 << 20)
""")


def test_cuda_async_refuses_a_stream_of_another_device_gpu():
    run_isolated(PRELUDE + """
from poolkeeper import _core
if _core.cuda_device_count() < 2:
    print("one GPU: skipped"); raise SystemExit(0)
s0 = driver.Stream(device=0)
try:
    pk.upstream.CudaAsync(device=1, stream=s0)
    raise AssertionError("a stream of device 0 was accepted for device 1")
except pk.errors.InvalidArgumentError as e:
    assert "belongs to device 0" in str(e), e
ok = pk.upstream.CudaAsync(device=1, stream=driver.Stream(device=1))
assert ok.device == 1
""")
