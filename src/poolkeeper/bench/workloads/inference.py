"""Inference-shaped workloads: a layer-by-layer transformer forward pass (single- and
multi-threaded) and KV-cache growth with sequence length.

The model is a 1B-class decoder (hidden 2048, MLP 5632, fp16 activations). Weights are allocated
once and held; activations are allocated and freed layer by layer as a framework would, with the
token count of each request drawn at random (16..2048 prefill tokens, then single-token decode
steps), so request shapes keep changing. Weight allocation is timed separately (``extras``);
the row's per-op figures cover the request phase only.
"""
from __future__ import annotations

import random
from time import perf_counter_ns
from typing import Any, Dict, List, Tuple

from poolkeeper.bench.workloads.base import KiB, Measurement, Meter, RunContext, Selection, Workload, run_threads, single

DTYPE = 2  # fp16


def _model(scale: str) -> Dict[str, int]:
    return {"layers": 16 if scale == "full" else 8, "hidden": 2048, "ffn": 5632, "vocab": 32000}


def _setup_extras(up: Any, before: Dict[str, int], w_ns: int, w_bytes: int, blocks: int) -> Dict[str, Any]:
    """The weights phase's own figures: the row's upstream counters cover it, its wall time does not."""
    after = up.counters()
    return {
        "weights_alloc_ns": w_ns,
        "weights_bytes": w_bytes,
        "weights_blocks": blocks,
        "setup_upstream_allocations": after["allocations"] - before["allocations"],
        "setup_upstream_ns": (after["alloc_ns"] - before["alloc_ns"]) + (after["dealloc_ns"] - before["dealloc_ns"]),
    }


def _alloc_weights(pool: Any, m: Dict[str, int]) -> Tuple[List[Tuple[int, int]], int, int]:
    h, f, v = m["hidden"], m["ffn"], m["vocab"]
    sizes = [v * h * DTYPE]  # embedding
    for _ in range(m["layers"]):
        sizes += [3 * h * h * DTYPE, h * h * DTYPE, f * h * DTYPE, f * h * DTYPE, h * f * DTYPE, h * DTYPE, h * DTYPE]
    sizes += [h * DTYPE, v * h * DTYPE]  # final norm, lm head
    t0 = perf_counter_ns()
    held = [(pool.allocate(n), n) for n in sizes]
    return held, perf_counter_ns() - t0, sum(sizes)


def _free_weights(pool: Any, held: List[Tuple[int, int]]) -> None:
    for ptr, _ in held:
        pool.deallocate(ptr)


def _forward(m: Meter, model: Dict[str, int], tokens: int) -> None:
    """One forward pass over ``tokens`` tokens: activations live only as long as a framework keeps them."""
    h, f = model["hidden"], model["ffn"]
    act = tokens * h * DTYPE
    wide = tokens * f * DTYPE
    x = m.alloc(act)
    for _ in range(model["layers"]):
        n = m.alloc(act)  # attention norm
        qkv = m.alloc(3 * act)
        m.free(n, act)
        att = m.alloc(act)
        m.free(qkv, 3 * act)
        o = m.alloc(act)
        m.free(att, act)
        x2 = m.alloc(act)  # residual
        m.free(o, act)
        m.free(x, act)
        x = x2
        n = m.alloc(act)  # MLP norm
        g = m.alloc(wide)
        u = m.alloc(wide)
        m.free(n, act)
        a = m.alloc(wide)
        m.free(g, wide)
        m.free(u, wide)
        d = m.alloc(act)
        m.free(a, wide)
        x2 = m.alloc(act)
        m.free(d, act)
        m.free(x, act)
        x = x2
    logits = m.alloc(model["vocab"] * 4)  # last-token logits, fp32
    m.free(x, act)
    m.free(logits, model["vocab"] * 4)


def _requests(rng: random.Random, n: int) -> List[int]:
    return [rng.randint(16, 2048) for _ in range(n)]


def _serve(m: Meter, model: Dict[str, int], prompts: List[int], decode_steps: int) -> None:
    for t in prompts:
        _forward(m, model, t)
        for _ in range(decode_steps):
            _forward(m, model, 1)


def _inference_params(sel: Selection) -> List[Dict[str, Any]]:
    full = sel.scale == "full"
    return [{**_model(sel.scale), "requests": 128 if full else 16, "decode_steps": 16 if full else 4}]


def _inference(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    rng = random.Random(ctx.seed)
    before = ctx.upstream.counters()
    held, w_ns, w_bytes = _alloc_weights(pool, p)
    setup = _setup_extras(ctx.upstream, before, w_ns, w_bytes, len(held))
    m = Meter(pool)
    t0 = perf_counter_ns()
    _serve(m, p, _requests(rng, p["requests"]), p["decode_steps"])
    meas = single(m, perf_counter_ns() - t0, **setup)
    meas.peak_live_bytes = None  # weights are live too: the pool's peak covers both
    _free_weights(pool, held)
    return meas


INFERENCE = Workload(
    "inference",
    "layer-by-layer forward passes of a 1B-class model (weights held, activations per layer), random prompt lengths + decode steps",
    _inference_params,
    _inference,
)


def _inference_mt_params(sel: Selection) -> List[Dict[str, Any]]:
    full = sel.scale == "full"
    return [
        {**_model(sel.scale), "threads": 8 if full else 4, "requests": 128 if full else 16, "decode_steps": 16 if full else 4}
    ]


def _inference_mt(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    before = ctx.upstream.counters()
    held, w_ns, w_bytes = _alloc_weights(pool, p)
    setup = _setup_extras(ctx.upstream, before, w_ns, w_bytes, len(held))
    n = p["threads"]
    prompts = _requests(random.Random(ctx.seed), p["requests"])

    def body(i: int, m: Meter) -> None:
        _serve(m, p, prompts[i::n], p["decode_steps"])

    meas = run_threads(pool, n, body)
    meas.extras.update(setup)
    _free_weights(pool, held)
    return meas


INFERENCE_MT = Workload(
    "inference_mt",
    "the inference workload served by several Python threads sharing the weights and the pool",
    _inference_mt_params,
    _inference_mt,
)

# --- kv_cache -----------------------------------------------------------------------------------
# Each live sequence keeps a K and a V buffer per layer; every decode step grows them by 16 tokens
# the way a framework without a paged cache does (allocate the longer buffer, copy, free the old).
# The sizes keep changing, so a size-class pool meets new classes all the time, while the total
# stays bounded by the high-water mark.


def _kv_params(sel: Selection) -> List[Dict[str, Any]]:
    full = sel.scale == "full"
    return [
        {
            "live_sequences": 8 if full else 4,
            "sequences": 24 if full else 8,
            "layers": 16 if full else 4,
            "bytes_per_token": 2 * KiB,  # per layer, per K or V: 8 KV heads x 128 dims x fp16
            "grow_tokens": 16,
            "max_tokens": 4096 if full else 2048,
        }
    ]


def _kv_cache(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    rng = random.Random(ctx.seed)
    bpt, g, layers = p["bytes_per_token"], p["grow_tokens"], p["layers"]
    m = Meter(pool)
    sizes_seen = set()
    started = 0

    def start() -> Dict[str, Any]:
        nonlocal started
        started += 1
        length = rng.randint(64, 512)
        target = rng.randint(p["max_tokens"] // 2, p["max_tokens"])
        n = length * bpt
        sizes_seen.add(n)
        return {"len": length, "target": target, "bufs": [m.alloc(n) for _ in range(2 * layers)]}

    t0 = perf_counter_ns()
    active = [start() for _ in range(min(p["live_sequences"], p["sequences"]))]
    while active:
        for seq in list(active):
            old = seq["len"] * bpt
            seq["len"] += g
            new = seq["len"] * bpt
            sizes_seen.add(new)
            bufs = seq["bufs"]
            for i in range(len(bufs)):
                nb = m.alloc(new)
                m.free(bufs[i], old)
                bufs[i] = nb
            if seq["len"] >= seq["target"]:
                for b in bufs:
                    m.free(b, new)
                active.remove(seq)
                if started < p["sequences"]:
                    active.append(start())
    return single(m, perf_counter_ns() - t0, distinct_sizes=len(sizes_seen))


KV_CACHE = Workload(
    "kv_cache",
    "per-layer K/V buffers regrown by 16 tokens per decode step up to 2-4k tokens, several live sequences",
    _kv_params,
    _kv_cache,
)

__all__ = ["INFERENCE", "INFERENCE_MT", "KV_CACHE"]
