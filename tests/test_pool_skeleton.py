"""Issue 19: the checks, error texts and upstream names every pool shares through Pool's skeleton
(pool.hpp: the public entry points map a pool's refusal to one InvalidPointer text per kind)."""
from __future__ import annotations

import re

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError, InvalidPointerError


def test_interior_pointer_worded_alike_in_every_pool(make_pool):
    # Before the skeleton each pool wrote its own text: only the arena said "live block".
    pool = make_pool()
    a = pool.allocate(4096)
    with pytest.raises(InvalidPointerError) as e:
        pool.deallocate(a + 256)
    assert re.search(r"points inside the live block at 0x[0-9a-f]+ \(offset 256\): free the block's start address",
                     str(e.value)), str(e.value)
    assert e.value.reason == "interior"
    pool.validate()  # the refusal changed nothing
    pool.deallocate(a)
    pool.validate()
    assert pool.stats()["live_blocks"] == 0


def test_upstream_by_name_is_the_factory_table():
    up = _core.upstream_by_name("simulated")
    assert isinstance(up, _core.Upstream)
    p = pk.SizeClassPool(up)
    p.deallocate(p.allocate(1000))
    assert up.counters()["allocations"] == 1
    with pytest.raises(InvalidArgumentError, match=r"unknown factory upstream 'bogus' \(valid: device, async, virtual, simulated\)"):
        _core.upstream_by_name("bogus")
    # The factory refuses the same names, before any device is touched.
    with pytest.raises(InvalidArgumentError, match="unknown factory upstream 'bogus'"):
        _core.registry_set_factory("arena", None, "bogus")
    assert not _core.registry_has_factory()
