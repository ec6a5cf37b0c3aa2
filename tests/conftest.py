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
# Opt-in (a module widens its ``pool_kind`` params to include it): the arena over an expandable
# virtual-memory backing, small steps and frequent shrink scans so growth and unmapping happen in
# every run. Only upstreams with virtual memory can hold it; with others the case is skipped.
EXTRA_POOLS = {
    "arena_expandable": lambda up: pk.ArenaPool(up, expandable=True, max_step=2 << 20, shrink_interval=64),
}
_CLASSES = {"direct": pk.Direct, "size_class": pk.SizeClassPool, "arena": pk.ArenaPool}


def build_pool(kind: str, up, **kw):
    """Pool ``kind`` over ``up``: its configuration above, or the class with ``kw`` when given."""
    if kind in EXTRA_POOLS:
        if not up.supports_virtual:
            pytest.skip(f"{up.name} has no virtual memory (expandable arena)")
        return pk.ArenaPool(up, expandable=True, **kw) if kw else EXTRA_POOLS[kind](up)
    return _CLASSES[kind](up, **kw) if kw else POOLS[kind](up)


@pytest.fixture(params=sorted(UPSTREAMS))
def upstream(request):
    return UPSTREAMS[request.param]()


@pytest.fixture(params=sorted(POOLS))
def pool_kind(request):
    return request.param


@pytest.fixture
def make_pool(pool_kind):
    def make(up=None, **kw):
        return build_pool(pool_kind, up if up is not None else pk.upstream.Simulated(latency_us=0), **kw)

    return make


@pytest.fixture
def pool(make_pool, upstream):
    p = make_pool(upstream)
    yield p


@pytest.fixture
def sim():
    return pk.upstream.Simulated(latency_us=0)
