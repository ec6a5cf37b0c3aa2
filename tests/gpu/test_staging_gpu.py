"""Pinned staging on a real device: copies land (checked by copying back), witness rules hold,
the uploader streams numpy and file sources to device memory with no pinned allocation in the
steady state. Run on the device machine: ``pytest -m gpu tests/gpu/test_staging_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper.errors import WitnessError
from poolkeeper.staging import PinnedStagingPool, Uploader, copy, copy_async

pytestmark = pytest.mark.gpu
MiB = 1 << 20


@pytest.fixture
def driver():
    from poolkeeper.cuda import driver

    return driver


@pytest.fixture
def device_alloc():
    up = pk.upstream.CudaDevice()
    held = []

    def alloc(n: int) -> int:
        p = up.allocate(n)
        held.append((p, n))
        return p

    yield alloc
    for p, n in held:
        up.deallocate(p, n)


@pytest.fixture
def pinned():
    return pk.upstream.CudaPinned()


def read_back(driver, dev: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    driver.memcpy_dtoh(out.ctypes.data, dev, n)
    return out


def test_default_upstream_is_cuda_pinned():
    pool = PinnedStagingPool()
    assert pool.upstream.kind == "pinned"
    pool.close()


def test_64_same_size_cycles_pin_once(pinned, device_alloc, driver):
    pool = PinnedStagingPool(pinned)
    n = 4 * MiB
    dev = device_alloc(n)
    for i in range(64):
        b = pool.acquire(n)
        b.numpy()[:] = i  # temporary view, released at once
        w = copy(dev, b)
        b.retire(w)
        if i in (0, 63):
            assert (read_back(driver, dev, n) == i).all()
    s = pool.stats()
    assert s["pinned_alloc_calls"] == 1 and s["reuses"] == 63
    assert pinned.counters()["allocations"] == 1
    pool.close()


def test_async_copy_on_a_stream(pinned, device_alloc, driver):
    pool = PinnedStagingPool(pinned)
    n = 8 * MiB + 3
    dev = device_alloc(n)
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    s = driver.Stream()
    b = pool.acquire(n)
    b.fill(data)
    pending = copy_async(dev, b, stream=s)
    w = pending.wait()
    assert pending.done()
    b.retire(w)
    assert np.array_equal(read_back(driver, dev, n), data)
    s.close()
    pool.close()


def test_witness_cannot_cross_buffers_on_device(pinned, device_alloc):
    pool = PinnedStagingPool(pinned)
    dev = device_alloc(MiB)
    a, b = pool.acquire(MiB), pool.acquire(MiB)
    wa = copy_async(dev, a).wait()
    with pytest.raises(WitnessError):
        b.retire(wa)
    a.retire(wa)
    with pytest.raises(WitnessError):
        a.retire(wa)
    b.close()
    pool.close()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("n", [64 * MiB + 12345, 3 * MiB])
def test_uploader_numpy_to_device(pinned, device_alloc, driver, n, engine):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dev = device_alloc(n)
    with Uploader(PinnedStagingPool(pinned), chunk_bytes=4 * MiB, workers=4, depth=2, engine=engine) as up:
        first = up.upload(data, dev)
        assert np.array_equal(read_back(driver, dev, n), data)
        data2 = data[::-1].copy()
        again = up.upload(data2, dev)
        assert np.array_equal(read_back(driver, dev, n), data2)
    assert first.engine == engine
    assert first.pinned_alloc_calls == 8  # warm-up pins workers * depth buffers once
    # python: one acquire per chunk; native: each of the 8 buffers once per upload
    assert again.pinned_alloc_calls == 0 and again.reuses == (again.chunks if engine == "python" else 8)


@pytest.mark.parametrize("nt", [False, True])
def test_native_upload_64mib_verified_on_a_user_stream(pinned, device_alloc, driver, nt):
    n = 64 * MiB
    dev = device_alloc(n)
    s = driver.Stream()
    pool = PinnedStagingPool(pinned, max_buffers=16)
    with Uploader(pool, chunk_bytes=8 * MiB, workers=6, depth=2, engine="native", nt_fill=nt, stream=s) as up:
        for seed in range(3):
            data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
            calls: list = []
            r = up.upload(data, dev, progress=lambda d, t: calls.append(d))
            assert np.array_equal(read_back(driver, dev, n), data)
            assert calls[-1] == n and calls == sorted(calls)
            assert r.engine == "native" and r.phases["fill_s"] > 0
            if seed:
                assert r.pinned_alloc_calls == 0
    st = pool.stats()
    assert st["live_buffers"] == 0 and st["leaked_unconfirmed"] == 0 and st["pinned_alloc_calls"] == 12
    pool.close()


def test_native_upload_fault_mid_upload_leaves_the_pool_consistent(pinned, device_alloc, driver):
    from poolkeeper.errors import UpstreamError

    n = 32 * MiB
    dev = device_alloc(n)
    pool = PinnedStagingPool(pinned, max_buffers=16)
    with Uploader(pool, chunk_bytes=4 * MiB, workers=4, depth=2, engine="native") as up:
        up._faults = {"fail_copy_at": 5}
        with pytest.raises(UpstreamError, match="injected"):
            up.upload(np.zeros(n, np.uint8), dev)
        up._faults = {}
        data = np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8)
        again = up.upload(data, dev)
        assert np.array_equal(read_back(driver, dev, n), data) and again.pinned_alloc_calls == 0
    st = pool.stats()
    assert st["live_buffers"] == 0 and st["retained_buffers"] == 8 and st["leaked_unconfirmed"] == 0
    pool.close()


def test_uploader_file_to_device(pinned, device_alloc, driver, tmp_path):
    n = 20 * MiB + 7
    data = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    p = tmp_path / "w.bin"
    data.tofile(p)
    dev = device_alloc(n)
    with Uploader(PinnedStagingPool(pinned), chunk_bytes=4 * MiB, workers=4, depth=2) as up:
        handle = up.start(p, dev)
        report = handle.wait(timeout=120)
    assert report.nbytes == n
    assert np.array_equal(read_back(driver, dev, n), data)
