"""Shared fixtures: every pool x every upstream, and the gpu marker's clean skip."""
from __future__ import annotations

import pytest

import poolkeeper as pk


def _cuda_available() -> bool:
    try:
        from poolkeeper import _core

        return bool(_core.cuda_is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (gpu tests run on the device machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


UPSTREAMS = {
    "host": lambda: pk.upstream.Host(),
    "simulated": lambda: pk.upstream.Simulated(latency_us=0),
}

# Small backings so tests exercise growth, oversize and shrink without big numbers.
POOLS = {
    "direct": lambda up: pk.Direct(up),
    "size_class": lambda up: pk.SizeClassPool(up),
    "arena": lambda up: pk.ArenaPool(up, initial_backing=1 << 16, max_backing=1 << 20),
}


@pytest.fixture(params=sorted(UPSTREAMS))
def upstream(request):
    return UPSTREAMS[request.param]()


@pytest.fixture(params=sorted(POOLS))
def pool_kind(request):
    return request.param


@pytest.fixture
def make_pool(pool_kind):
    def make(up=None, **kw):
        up = up if up is not None else pk.upstream.Simulated(latency_us=0)
        if kw:
            return {"direct": pk.Direct, "size_class": pk.SizeClassPool, "arena": pk.ArenaPool}[pool_kind](up, **kw)
        return POOLS[pool_kind](up)

    return make


@pytest.fixture
def pool(make_pool, upstream):
    p = make_pool(upstream)
    yield p


@pytest.fixture
def sim():
    return pk.upstream.Simulated(latency_us=0)
