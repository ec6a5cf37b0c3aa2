"""CUDA graphs with poolkeeper as PyTorch's allocator (torch.cuda.graph, shared pool handles,
torch.compile(mode="reduce-overhead"), record_stream, empty_cache, growth during capture), and
with a poolkeeper-backed torch.cuda.MemPool. Each case runs in a fresh process (isolated.py):
the allocator must be installed before CUDA is initialized."""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]

PRELUDE_OF = """
import gc, torch
import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.integrations import torch as pkt
_kind, _, _flag = KIND.partition("+")  # "KIND+FLAG": KIND installed with FLAG=True
inst = pkt.install(_kind, **({_flag: True} if _flag else {}))
assert all(inst.hooks[h] for h in ("graph_begin", "graph_end", "graph_release")), inst.hooks
torch.manual_seed(0)

def private(t):
    gp = _core.graph_pools_find(t.device.index)
    return gp is not None and gp.owns_private(t.data_ptr())

def warm(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
"""


@pytest.fixture(params=["arena", "arena_expandable", "arena_expandable+single_stream"])
def PRELUDE(request):
    """The prelude with poolkeeper installed as the arena, the expandable arena, or that with
    single_stream (install()'s default where devices map memory; a capture ends the mode:
    docs/stream_order.md, "One stream"): graphs must work over each."""
    return f"KIND = {request.param!r}\n" + PRELUDE_OF


def run_compiled(prelude: str, body: str, needs=("triton",)) -> None:
    """A torch.compile case: skipped without the modules it needs, run in its own process (long:
    compiling), and it must print "ok"."""
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip("torch.compile case needs " + " and ".join(missing))
    assert "ok" in run_isolated(prelude + body, timeout=600)


def test_capture_replay_exact_with_intermediate_freed_and_tensors_allocated_between(PRELUDE):
    run_isolated(
        PRELUDE
        + """
w = torch.randn(512, 512, device="cuda")
x = torch.randn(128, 512, device="cuda")
warm(lambda: (x @ w).relu() @ w)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    h = (x @ w).relu()       # an intermediate, freed inside the capture
    out = h @ w
    del h
assert private(out)
junk = [torch.randn(1000 + 97 * i, device="cuda") for i in range(64)]  # between capture and replay
assert not any(private(t) for t in junk)
for step in range(3):
    x.copy_(torch.randn_like(x))
    ref = (x @ w).relu() @ w
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref), (step, (out - ref).abs().max().item())
info = pkt.graph_pools()
assert len(info) == 1 and info[0]["live_blocks"] >= 1, info
for p in pkt.pools().values():
    p.validate()
_core.graph_pools(0).validate()
print("ok", info[0]["stats"]["reserved_bytes"])
"""
    )


def test_growth_during_capture_with_nothing_cached(PRELUDE):
    out = run_isolated(
        PRELUDE
        + """
a = torch.ones(1024, device="cuda")  # the device pool exists, with next to nothing cached
before = pkt.stats()["upstream_allocations"]
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    big = torch.ones(64 << 20, device="cuda") * 3   # 256 MiB: must grow during the capture
    s = big.sum()
grew = pkt.stats()["upstream_allocations"] - before
assert grew >= 1, grew
g.replay()
torch.cuda.synchronize()
assert s.item() == 3 * (64 << 20), s.item()
print("grew", grew)
"""
    )
    assert "grew" in out


def test_two_graphs_sharing_one_pool_handle(PRELUDE):
    run_isolated(
        PRELUDE
        + """
x = torch.randn(256, 256, device="cuda")
warm(lambda: (x * 2).sin() + 1)
handle = torch.cuda.graph_pool_handle()
g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, pool=handle):
    t1 = (x * 2).sin()
    y1 = t1 + 1
    del t1
with torch.cuda.graph(g2, pool=handle):
    t2 = (y1 * 3).cos()
    y2 = t2 - 1
    del t2
info = pkt.graph_pools()
assert len(info) == 1 and info[0]["uses"] == 2, info
x.copy_(torch.randn_like(x))
g1.replay(); g2.replay()
torch.cuda.synchronize()
assert torch.equal(y1, (x * 2).sin() + 1)
assert torch.equal(y2, (y1 * 3).cos() - 1)
print("ok")
"""
    )


def test_record_stream_across_streams_during_and_outside_capture(PRELUDE):
    run_isolated(
        PRELUDE
        + """
side = torch.cuda.Stream()
# outside a capture
a = torch.randn(1 << 20, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    b = a * 2
a.record_stream(side)
del a
served = pkt.hook_counters()["record_stream"]
assert served >= 1
# during a capture: fork a side stream inside the graph and join it back
x = torch.randn(1 << 16, device="cuda")
warm(lambda: x * 2)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    cap = torch.cuda.current_stream()
    t = x + 1
    side.wait_stream(cap)
    with torch.cuda.stream(side):
        u = t * 2
    t.record_stream(side)
    cap.wait_stream(side)
    out = u + 0
    del t
assert pkt.hook_counters()["record_stream"] > served
x.copy_(torch.randn_like(x))
g.replay()
torch.cuda.synchronize()
assert torch.equal(out, (x + 1) * 2)
print("ok")
"""
    )


def test_empty_cache_keeps_graph_memory_and_releasing_the_graph_returns_it(PRELUDE):
    run_isolated(
        PRELUDE
        + """
x = torch.randn(1 << 20, device="cuda")
warm(lambda: x.exp())
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    t = x.exp()          # 4 MiB temporary, freed in the capture
    out = t.sum()
    del t
graph_bytes = pkt.graph_pools()[0]["stats"]["reserved_bytes"]
live_with_graph = pkt.stats()["live_bytes"]
assert live_with_graph >= graph_bytes > 0
junk = [torch.empty(8 << 20, device="cuda") for _ in range(4)]
del junk
torch.cuda.empty_cache()   # returns the junk's memory, never the graph's
assert pkt.graph_pools()[0]["stats"]["reserved_bytes"] == graph_bytes
x.copy_(torch.randn_like(x))
g.replay()
torch.cuda.synchronize()
assert torch.allclose(out, x.exp().sum(), rtol=1e-5), (out.item(), x.exp().sum().item())
del g, out
gc.collect()
assert pkt.graph_pools() == [], pkt.graph_pools()
assert pkt.stats()["live_bytes"] <= live_with_graph - graph_bytes, (pkt.stats()["live_bytes"], live_with_graph, graph_bytes)
for p in pkt.pools().values():
    p.validate()
print("ok", graph_bytes)
"""
    )


def test_torch_compile_reduce_overhead_mlp_matches_eager(PRELUDE):
    run_compiled(
        PRELUDE,
        """
mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().eval()
f = torch.compile(mlp, mode="reduce-overhead")
with torch.no_grad():
    for i in range(6):
        x = torch.randn(32, 256, device="cuda")
        got = f(x).clone()
        ref = mlp(x)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
assert pkt.graph_pools(), "reduce-overhead captured no graph through poolkeeper"
print("ok", len(pkt.graph_pools()))
""",
    )


def test_torch_compile_reduce_overhead_without_trees_over_several_shapes(PRELUDE):
    # With cudagraph_trees off, each compiled graph captures into a pool of its own: several batch
    # sizes, each its own graph, all through poolkeeper's graph pools.
    run_compiled(
        PRELUDE,
        """
import torch._inductor.config as icfg
icfg.triton.cudagraph_trees = False
mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).cuda().eval()
f = torch.compile(mlp, mode="reduce-overhead", dynamic=False)
with torch.no_grad():
    for rep in range(3):
        for bs in (4, 16, 32):
            x = torch.randn(bs, 128, device="cuda")
            torch.testing.assert_close(f(x).clone(), mlp(x), rtol=1e-4, atol=1e-4)
assert len(pkt.graph_pools()) >= 3, pkt.graph_pools()
print("ok", len(pkt.graph_pools()))
""",
    )


def test_regression_trees_checkpoint_restore_after_a_graph_break_raised_integration_error(PRELUDE):
    # With cudagraph_trees on (PyTorch's default), a new shape reaching the part after a graph
    # break while the first part's outputs are alive makes the trees put the graph pool back to a
    # checkpoint (setCheckpointPoolState) before recording; poolkeeper raised IntegrationError
    # there. slow_path_cudagraph_asserts has the trees check after each restore that the pool's
    # live blocks are exactly their live storages and that each has the allocator's deleter.
    run_compiled(
        PRELUDE,
        """
import torch._dynamo
import torch._inductor.config as icfg
icfg.triton.slow_path_cudagraph_asserts = True
restores = [0]
real = torch._C._cuda_setCheckpointPoolState
def counted(*args):
    restores[0] += 1
    return real(*args)
torch._C._cuda_setCheckpointPoolState = counted
lin1 = torch.nn.Linear(64, 64).cuda()
lin2 = torch.nn.Linear(64, 64).cuda()
def fwd(x, n):
    h = lin1(x).relu()
    torch._dynamo.graph_break()
    return lin2(h[:n]).sigmoid()
f = torch.compile(fwd, mode="reduce-overhead")
kept = []
with torch.no_grad():
    for rep in range(4):
        for n in (8, 4, 2, 6):
            x = torch.randn(8, 64, device="cuda")
            y = f(x, n)
            torch.testing.assert_close(y.clone(), torch.sigmoid(lin2(lin1(x).relu()[:n])), rtol=1e-4, atol=1e-4)
            kept = kept[-1:] + [y]  # an output of the step before stays alive while this one records
del kept, y
gc.collect()
assert restores[0] > 0, "the trees never restored a checkpoint: the case is not exercised"
gp = _core.graph_pools_find(0)
gp.validate()
print("ok", restores[0])
""",
    )


def test_torch_compile_reduce_overhead_hf_decode_step_matches_eager(PRELUDE):
    run_compiled(
        PRELUDE,
        """
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
model = LlamaForCausalLM(cfg).cuda().eval()
def step(ids):
    return model(input_ids=ids, use_cache=False).logits[:, -1, :]
f = torch.compile(step, mode="reduce-overhead")
with torch.no_grad():
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    for i in range(5):
        got = f(ids).clone()
        ref = step(ids)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
        ids = torch.cat([ids[:, 1:], ref.argmax(-1, keepdim=True)], dim=1)  # next token, fixed shape
assert pkt.graph_pools()
print("ok")
""",
        needs=("triton", "transformers"),
    )


def test_graph_capture_with_a_poolkeeper_mempool_and_the_native_allocator():
    run_isolated(
        '''
import torch, gc
from poolkeeper.integrations import torch as pkt
mp = pkt.mempool("arena")
x = torch.randn(256, 256, device="cuda")
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        (x @ x).relu()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=mp.id):   # the graph's private pool draws segments from poolkeeper
    t = (x @ x).relu()
    out = t * 2
    del t
x.copy_(torch.randn_like(x))
g.replay()
torch.cuda.synchronize()
assert torch.equal(out, (x @ x).relu() * 2)
print("ok", pkt.stats()["live_bytes"])
'''
    )
