"""CUDA support on a machine without CUDA (CI): importing works and every entry point says why it
cannot run. The missing-driver path is forced with POOLKEEPER_LIBCUDA in a subprocess (the driver
is loaded once per process), so these tests hold on a GPU machine too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import poolkeeper as pk
from poolkeeper.errors import CudaUnavailableError


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True, timeout=120
    )


def test_import_never_loads_the_driver():
    r = run_py(
        """
        import poolkeeper, poolkeeper.cuda, poolkeeper.cuda.upstreams, poolkeeper.cuda.driver, poolkeeper.cuda.warm
        import poolkeeper.upstream as u
        assert u.CudaDevice is poolkeeper.cuda.upstreams.CudaDevice
        assert u.CudaAsync is poolkeeper.cuda.upstreams.CudaAsync
        assert u.CudaPinned is poolkeeper.cuda.upstreams.CudaPinned
        maps = open('/proc/self/maps').read()
        print('libcuda' in maps)
        """,
        POOLKEEPER_LIBCUDA="/nonexistent/dir/libcuda.so.1",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


MISSING = """
import json
import poolkeeper as pk
from poolkeeper import cuda
from poolkeeper.cuda import driver, warm
from poolkeeper.errors import CudaUnavailableError
out = {"available": cuda.is_available(), "reason": cuda.unavailable_reason(), "count": cuda.device_count(),
       "devices": cuda.devices(), "version": cuda.driver_version(), "warm_handles": warm.state().total_handles}
errors = {}
for name, make in [("CudaDevice", lambda: pk.upstream.CudaDevice()), ("CudaAsync", lambda: pk.upstream.CudaAsync()),
                   ("CudaPinned", lambda: pk.upstream.CudaPinned()), ("Stream", lambda: driver.Stream()),
                   ("memset", lambda: driver.memset_d8(1, 0, 1)), ("reserved", lambda: warm.reserved_bytes(0))]:
    try:
        make()
        errors[name] = None
    except CudaUnavailableError as e:
        errors[name] = str(e)
out["errors"] = errors
print(json.dumps(out))
"""


def test_missing_driver_library_is_reported_everywhere():
    r = run_py(MISSING, POOLKEEPER_LIBCUDA="/nonexistent/dir/libcuda.so.1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["available"] is False
    assert out["count"] == 0 and out["devices"] == [] and out["version"] is None
    assert "/nonexistent/dir/libcuda.so.1" in out["reason"] and "no CUDA driver" in out["reason"]
    assert out["warm_handles"] == 0
    for name, msg in out["errors"].items():
        assert msg is not None, f"{name} should raise CudaUnavailableError"
        assert "/nonexistent/dir/libcuda.so.1" in msg, (name, msg)
    assert out["errors"]["CudaDevice"].startswith("CudaDevice(device=0) needs a CUDA driver and device")


def test_library_that_is_not_a_driver_is_reported():
    r = run_py(MISSING, POOLKEEPER_LIBCUDA="libm.so.6")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["available"] is False
    assert "has no cuInit" in out["reason"]


def _no_cuda_here() -> bool:
    return not pk.cuda.is_available()


@pytest.mark.skipif(not _no_cuda_here(), reason="this machine has CUDA")
def test_in_process_without_cuda():
    from poolkeeper import cuda

    assert cuda.is_available() is False
    assert cuda.unavailable_reason()
    assert cuda.devices() == []
    for make in (pk.upstream.CudaDevice, pk.upstream.CudaAsync, pk.upstream.CudaPinned):
        with pytest.raises(CudaUnavailableError, match="needs a CUDA driver"):
            make()
    with pytest.raises(CudaUnavailableError):
        pk.cuda.driver.Stream()
    # a failed constructor leaves nothing behind: the warm manager holds no handle
    assert pk.cuda.warm.state().total_handles == 0


def test_simulated_and_host_upstreams_still_work_without_cuda():
    pool = pk.SizeClassPool(pk.upstream.Simulated(latency_us=0))
    p = pool.allocate(1000)
    pool.deallocate(p)
    pool.validate()
