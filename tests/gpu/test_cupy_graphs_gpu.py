"""CuPy graph capture with poolkeeper as CuPy's allocator (poolkeeper.integrations.cupy.graph_capture):
the capture stays valid, the replay is exact, graph memory is private and returns to the device
pool when the graph is released. Each case in a fresh process (isolated.py)."""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy"),
]


def test_cupy_graph_capture_replay_and_release():
    run_isolated(
        """
import gc
import cupy
from poolkeeper.integrations import cupy as pkc
inst = pkc.install("arena")
x = cupy.random.random(1 << 20).astype(cupy.float32)
(x * 2 + 1).sum()                           # compile the kernels outside the capture
cupy.cuda.Device().synchronize()
live0 = inst.pools()[0].stats()["live_bytes"]
with pkc.graph_capture() as g:
    t = x * 2                                  # 4 MiB intermediate, freed inside the capture
    y = t + 1
    del t
    s = y.sum()
gp = inst.allocator.graphs[0]
assert gp.owns_private(y.data.ptr) and gp.owns_private(s.data.ptr)
junk = [cupy.empty(1000 + 37 * i, dtype=cupy.float32) for i in range(32)]
assert not any(gp.owns_private(j.data.ptr) for j in junk)
for step in range(3):
    x[...] = cupy.random.random(1 << 20).astype(cupy.float32)
    g.launch()
    cupy.cuda.Device().synchronize()
    assert cupy.array_equal(y, x * 2 + 1), step
    assert abs(float(s) - float((x * 2 + 1).sum())) <= 1e-3 * abs(float(s)), step
gp.validate()
del g, y, s, junk
gc.collect()
assert gp.info() == [], gp.info()
assert inst.pools()[0].stats()["live_bytes"] == live0
inst.pools()[0].validate()
print("ok")
"""
    )
