"""Framework parity on a real GPU (issue 14): out of memory inside PyTorch is torch.OutOfMemoryError
with the pool's diagnosis (the shim, checked in a separate process first), PyTorch's memory API
names and snapshot, the expandable arena by name, a clean exit.
Each case runs in a fresh process (see isolated.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

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


def test_filling_the_device_raises_torch_oom_with_the_pools_diagnosis_and_recovers():
    out = run_isolated(
        PRELUDE
        + """
inst = pkt.install("arena")
print("oom:", inst.oom_type, "|", inst.oom_note)
assert inst.oom_type == "torch.OutOfMemoryError", inst.oom_note
held = []
GiB = 1 << 30
try:
    while True:
        held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
        assert len(held) < 4096, "never ran out"
except torch.OutOfMemoryError as e:  # what batch-size finders and retry loops catch
    err = e  # the except clause deletes its name on exit
    msg = str(e)
    print("raised torch.OutOfMemoryError after", len(held), "GiB:", msg[:300])
    assert "poolkeeper: cannot allocate" in msg and "out of memory in" in msg, msg
assert isinstance(err, RuntimeError)  # PyTorch's OOM is a RuntimeError subclass; older except clauses still work
assert len(held) > 8
assert pkt.memory_stats()["num_ooms"] >= 1
# The process keeps working: free half, allocate again, compute.
del held[: len(held) // 2]
gc.collect()
again = [torch.ones(GiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
assert sum(int(t[:1024].sum()) for t in again) == 4 * 1024
torch.cuda.synchronize()
for p in pkt.pools().values():
    p.validate()
print("recovered")
""",
        timeout=600,
    )
    assert "raised torch.OutOfMemoryError" in out and "recovered" in out


def test_a_pool_limit_is_torch_oom_too():
    run_isolated(
        PRELUDE
        + """
inst = pkt.install("arena", limit=64 << 20)
assert inst.oom_type == "torch.OutOfMemoryError", inst.oom_note
x = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
try:
    torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    assert "limit" in str(e), str(e)
else:
    raise AssertionError("no error")
y = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
assert int(x.sum()) + int(y.sum()) == 2 << 20
"""
    )


def test_without_the_shim_out_of_memory_is_a_runtime_error_with_the_diagnosis():
    run_isolated(
        """
import os
os.environ["POOLKEEPER_TORCH_OOM_SHIM"] = "0"
"""
        + PRELUDE
        + """
inst = pkt.install("arena", limit=64 << 20)
assert inst.oom_type == "RuntimeError" and "disabled" in inst.oom_note, inst.oom_note
try:
    torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
except RuntimeError as e:
    assert not isinstance(e, torch.OutOfMemoryError) and "limit" in str(e), repr(e)
else:
    raise AssertionError("no error")
"""
    )


def test_memory_api_names_and_snapshot_on_the_device(tmp_path):
    path = tmp_path / "snap.pickle"
    run_isolated(
        PRELUDE
        + f"""
import pickle
from torch.cuda import _memory_viz as viz
pkt.install("arena")
xs = [torch.ones(n, device="cuda") for n in (10, 1000, 1 << 20, 3 << 20)]
m = pkt.memory_stats()
assert m["allocated_bytes.all.current"] == pkt.memory_allocated() == sum(x.numel() * 4 for x in xs), m
assert pkt.max_memory_allocated() >= pkt.memory_allocated()
assert pkt.memory_reserved() >= pkt.memory_allocated()
del xs[-1]
pkt.reset_peak_memory_stats()
assert pkt.max_memory_allocated() == pkt.memory_allocated()
print(pkt.memory_summary())
pkt.dump_snapshot({str(path)!r})
data = pickle.load(open({str(path)!r}, "rb"))
assert sum(s["total_size"] for s in data["segments"]) == pkt.memory_reserved()
print(viz.segsum(data))
"""
    )


def test_install_the_expandable_arena_by_name():
    run_isolated(
        PRELUDE
        + """
inst = pkt.install("arena_expandable")
assert inst.upstream == "virtual"
a = torch.randn(1024, 1024, device="cuda")
b = a @ a
torch.cuda.synchronize()
st = pkt.stats()
assert st["expandable"] == 1 and st["live_bytes"] >= 2 * 4 * 1024 * 1024, st
for p in pkt.pools().values():
    p.validate()
"""
    )


def test_process_with_poolkeeper_installed_exits_cleanly():
    body = textwrap.dedent(
        PRELUDE
        + """
import threading
pkt.install("arena", device=0)   # an eagerly made pool in the C ABI registry
x = torch.ones(1 << 20, device="cuda")
buf = pkt.pools()[0].buffer(1 << 20)
import time
threading.Thread(target=lambda: ([torch.ones(1 << 16, device="cuda") for _ in range(100)], time.sleep(600)), daemon=True).start()
user_pool = pk.ArenaPool(pk.upstream.CudaDevice(0))
staged = user_pool.buffer(4096)
print("done")
"""
    )
    r = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "nanobind" not in r.stderr and "terminate" not in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["arena", "arena_expandable"])
def test_single_stream_pool_makes_a_side_stream_wait_for_the_home_streams_last_use(kind):
    """single_stream files a release on the home stream free at once. A side stream asking for
    memory must not get that block until the home stream's queued work on it has run: here the
    home stream sleeps, then writes 1s into the freed block; the side stream, given the same
    block, writes 2s. Without the wait the late 1s would land over the side stream's 2s."""
    out = run_isolated(
        PRELUDE
        + f"""
pkt.install("{kind}", single_stream=True)
n = 64 << 20
x = torch.empty(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
ptr = x.data_ptr()
torch.cuda._sleep(200_000_000)  # ~0.1 s of device time on the home (default) stream
x.fill_(1)
del x  # released on the home stream: free at once, for the home stream
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    y = torch.empty(n, dtype=torch.uint8, device="cuda")
    y.fill_(2)
torch.cuda.synchronize()
st = pkt.pools()[0].stats()
print("same block:", y.data_ptr() == ptr, "barriers:", st["home_barriers"], "mode:", st["single_stream"])
assert y.data_ptr() == ptr, "the side stream got other memory: the test proves nothing"
assert st["home_barriers"] == 1 and st["single_stream"] == 0, st
assert bool((y == 2).all()), "the home stream's late write landed in the side stream's block"
"""
    )
    assert "same block: True" in out


@pytest.mark.parametrize("kind", ["arena", "arena_expandable"])
def test_single_stream_shrink_scans_wait_for_their_event_not_for_the_device(kind):
    """Automatic shrink in single-stream mode: while the home stream still has queued work on a
    released block, scans (one per release here) must leave it mapped (the late fill would fault
    on unmapped memory); once the device has run past it, a later scan gives it back, without a
    wait of its own (home_barriers stays 0)."""
    out = run_isolated(
        PRELUDE
        + f"""
import time
pkt.install("{kind}", single_stream=True, shrink_interval=1, shrink_hysteresis=1, thread_cache_bytes=0)
small = [torch.empty(256, dtype=torch.uint8, device="cuda") for _ in range(64)]
big = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
for b in big:
    b.fill_(0)  # loads the fill kernel now: its first launch loads the module, and that waits for the device
torch.cuda.synchronize()
before = pkt.pools()[0].stats()
t0 = time.perf_counter()
torch.cuda._sleep(2_000_000_000)  # about 1 s of device time on the home (default) stream
for b in big:
    b.fill_(1)
del b
big.clear()  # released on home while the fills are still queued
for _ in range(32):
    small.pop()  # releases: a shrink scan each
st = pkt.pools()[0].stats()
# The premise, read after the figures: home was still busy, so whatever they show went upstream
# while its queued fills could still write the memory.
busy = not torch.cuda.current_stream().query()
print("released while busy:", st["upstream_deallocations"] - before["upstream_deallocations"],
      st.get("unmap_calls", 0) - before.get("unmap_calls", 0), "home busy:", busy,
      "host s since the sleep: %.3f" % (time.perf_counter() - t0), "scans:", st["shrink_scans"],
      "settles:", st["home_settles"], "barriers:", st["home_barriers"])
assert busy, "the device finished the sleep before the check: the test proves nothing"
assert st["upstream_deallocations"] == before["upstream_deallocations"], st
assert st.get("unmap_calls", 0) == before.get("unmap_calls", 0), st
torch.cuda.synchronize()  # the device has run past every release
for _ in range(32):
    small.pop()
st = pkt.pools()[0].stats()
gone = st["upstream_deallocations"] + st.get("unmap_calls", 0)
print("released after:", gone, "barriers:", st["home_barriers"], "mode:", st["single_stream"])
assert gone > 0 and st["home_barriers"] == 0 and st["single_stream"] == 1, st
x = torch.ones(1 << 20, device="cuda")
assert float(x.sum()) == float(1 << 20)
pkt.pools()[0].validate()
"""
    )
    print(out)  # the figures, also when it passes (pytest -s)
    assert "released after:" in out
