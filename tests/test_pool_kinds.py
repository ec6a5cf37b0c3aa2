"""One table of pool kinds (poolkeeper.pools.KINDS) and one upstream-by-name helper
(poolkeeper.upstream.make_upstream), read by every entry point: make_pool, the per-device
factories (PyTorch's C ABI, CuPy), the Dask/Ray worker pools, bench arms, replay, the tests."""
from __future__ import annotations

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError
from poolkeeper.integrations._worker import WorkerPoolSpec


def test_every_consumer_lists_exactly_the_kinds_of_the_table():
    import importlib.util
    from pathlib import Path

    from poolkeeper.bench.arms import ARM_NAMES
    from poolkeeper.bench.replay import POOLS

    # This directory's conftest by path: "import conftest" may find tests/gpu's first.
    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    kinds = list(pk.pools.KINDS)
    assert [a for a in ARM_NAMES if a != "cuda_async"] == kinds
    assert list(POOLS) == kinds
    assert sorted(conftest.POOLS + conftest.EXTRA_POOLS) == sorted(kinds)
    assert pk.pools.POOL_KINDS == {n: k.cls for n, k in pk.pools.KINDS.items()}


@pytest.mark.parametrize(
    "name, cls",
    [("host", "Host"), ("simulated", "Simulated"), ("device", "CudaDevice"), ("async", "CudaAsync"),
     ("virtual", "CudaVirtual")],
)
def test_make_upstream_by_name(name, cls):
    if name in pk.upstream.CUDA_UPSTREAMS:
        # No device here: the class is the one named, so its constructor reports the missing driver.
        with pytest.raises(pk.errors.CudaUnavailableError, match=cls):
            pk.upstream.make_upstream(name, 0)
        return
    up = pk.upstream.make_upstream(name)
    assert type(up).__name__ == cls


def test_make_upstream_passes_options_and_refuses_unknown_names():
    assert pk.upstream.make_upstream("simulated", latency_us=0).latency_model["alloc_base_us"] == 0
    with pytest.raises(InvalidArgumentError, match=r"unknown upstream 'gpu' \(valid: device, async, virtual, host, simulated\)"):
        pk.upstream.make_upstream("gpu")


def test_the_c_abi_factory_gets_the_kinds_class_and_its_fixed_options(monkeypatch):
    calls = []
    monkeypatch.setattr(_core, "registry_set_factory", lambda *a: calls.append(a))
    pk.pools.set_device_factory("arena_expandable", {"max_step": 1 << 21}, "simulated")
    pk.pools.set_device_factory("size_class", None, "device")
    assert calls == [("arena", {"max_step": 1 << 21, "expandable": True}, "simulated"), ("size_class", {}, "device")]
    with pytest.raises(InvalidArgumentError, match="fixes expandable=True"):
        pk.pools.set_device_factory("arena_expandable", {"expandable": False}, "virtual")
    assert len(calls) == 2


def test_the_real_c_abi_factory_builds_an_expandable_arena_from_the_table():
    pk.pools.set_device_factory("arena_expandable", {"max_step": 2 << 20}, "simulated")
    try:
        _core.registry_ensure(0)
        pool = _core.registry_get(0)
        p = pool.allocate(4096)
        assert pool.stats()["expandable"] == 1 and pool.upstream.counters()["maps"] == 1
        pool.deallocate(p)
    finally:
        _core.registry_clear()


def test_worker_pools_take_every_kind_and_default_to_its_upstream():
    assert WorkerPoolSpec("arena_expandable").upstream == "virtual"
    assert WorkerPoolSpec("arena").upstream == "device"
    assert WorkerPoolSpec("arena", upstream="virtual").upstream == "virtual"
    assert WorkerPoolSpec("arena_expandable", upstream="simulated").upstream == "simulated"
    with pytest.raises(InvalidArgumentError, match="cannot run over upstream 'device'"):
        WorkerPoolSpec("arena_expandable", upstream="device")
    with pytest.raises(InvalidArgumentError, match="cannot run over upstream 'host'"):
        WorkerPoolSpec("arena_expandable", upstream="host")


def test_a_simulated_worker_pool_of_the_expandable_kind_maps_its_memory():
    st = WorkerPoolSpec("arena_expandable", upstream="simulated").build("w")
    try:
        p = st.pool.allocate(1 << 20)
        st.pool.deallocate(p)
        assert st.pool.stats()["expandable"] == 1 and st.pool.upstream.counters()["maps"] == 1
        st.pool.validate()
    finally:
        st.close()


def test_per_device_entry_points_accept_virtual_for_every_kind():
    for kind in pk.pools.KINDS:
        assert pk.pools.resolve_cuda_upstream(kind, "virtual") == "virtual"
    with pytest.raises(InvalidArgumentError, match="unknown upstream 'host'"):
        pk.pools.resolve_cuda_upstream("arena", "host")  # a device pool needs device memory


def test_make_upstream_and_make_pool_refuse_bad_options_with_a_typed_error():
    # Hostile probing: an unknown keyword, a device that is not an ordinal or a log that is not a
    # path raised a bare TypeError from the class or the binding.
    for call in (lambda: pk.upstream.make_upstream("simulated", bogus=1),
                 lambda: pk.upstream.make_upstream("host", latency_us=0),
                 lambda: pk.upstream.make_upstream("device", 2**31),
                 lambda: pk.upstream.make_upstream("device", "0"),
                 lambda: pk.upstream.make_upstream("virtual", None),
                 lambda: pk.upstream.make_upstream("async", True),
                 lambda: pk.pools.make_pool("arena", pk.upstream.Simulated(latency_us=0), log=123)):
        with pytest.raises(InvalidArgumentError):
            call()
