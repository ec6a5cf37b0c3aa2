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

# Every pool kind of the one table (poolkeeper.pools.KINDS), built by make_pool. Test options per
# kind: small backings so tests exercise growth, oversize and shrink without big numbers; for the
# expandable arena small steps and frequent shrink scans so growth and unmapping happen in every run.
TEST_OPTIONS = {
    "arena": dict(initial_backing=1 << 16, max_backing=1 << 20),
    "arena_expandable": dict(max_step=2 << 20, shrink_interval=64),
}
# Kinds that need virtual memory are opt-in (a module widens its ``pool_kind`` params to include
# them): only upstreams with virtual memory can hold them; with others the case is skipped.
POOLS = [k for k, kind in pk.pools.KINDS.items() if not kind.needs_virtual]
EXTRA_POOLS = [k for k, kind in pk.pools.KINDS.items() if kind.needs_virtual]


def build_pool(kind: str, up, **kw):
    """Pool ``kind`` (or a variant, ``"KIND+FLAG"``) over ``up``: with its test options above, or
    with ``kw`` when given."""
    kind, _, flag = kind.partition("+")
    if pk.pools.KINDS[kind].needs_virtual and not up.supports_virtual:
        pytest.skip(f"{up.name} has no virtual memory ({kind})")
    opts = dict(kw or TEST_OPTIONS.get(kind, {}))
    if flag:
        opts[flag] = True
    return pk.make_pool(kind, up, **opts)


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
