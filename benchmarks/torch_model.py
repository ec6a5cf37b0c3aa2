"""A real model under each allocator: PyTorch's native caching allocator vs poolkeeper's arena.

One invocation runs two fresh processes with the same seeds and the same work (poolkeeper must be
installed before CUDA initializes, so each arm needs its own process):

- a Llama model built from its configuration with random weights (transformers' LlamaConfig /
  LlamaForCausalLM; no download), bf16 on the GPU;
- prefill: batches of varying size and varying, padded sequence length;
- decode: greedy generation with a KV cache (transformers' DynamicCache grows by concatenation,
  one new tensor per layer per token: the allocator's daily bread).

Reported side by side: peak reserved and peak live bytes, upstream (cudaMalloc-level) calls, and
per-step latency p50/p90 per phase; and whether the outputs are identical (SHA-256 over the
last-position logits of every prefill step and over every generated token).

Usage:  python benchmarks/torch_model.py [--quick] [--out benchmarks/results]
Writes torch_model.json and torch_model.md into --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The same Llama configuration, batches and PyTorch figures as real_models.py's llama workload.
from real_models import LLAMA_CONFIG as CONFIG, left_padded_batch, native_memory_stats  # noqa: E402

FULL = dict(prefill_steps=48, prefill_batch=(1, 16), prefill_len=(32, 1024), decode_runs=4, decode_batch=(1, 8),
            decode_prompt=(16, 256), decode_tokens=128)
QUICK = dict(prefill_steps=16, prefill_batch=(1, 8), prefill_len=(32, 512), decode_runs=2, decode_batch=(1, 4),
             decode_prompt=(16, 128), decode_tokens=48)


def quantiles(xs: List[float]) -> Dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "n": 0}
    q = lambda p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]
    return {"p50": q(0.5), "p90": q(0.9), "mean": statistics.fmean(xs), "n": len(xs)}


# -- one arm (child process) ----------------------------------------------------------------------


def _write_trace(torch, path: str) -> None:
    """alloc / free_completed events of device 0 as gzipped CSV: action,addr,size,stream."""
    import gzip

    snap = torch.cuda.memory._snapshot()
    with gzip.open(path, "wt") as f:
        f.write("action,addr,size,stream\n")
        for e in snap["device_traces"][0]:
            if e["action"] in ("alloc", "free_completed"):
                f.write(f"{e['action']},{e['addr']},{e['size']},{e.get('stream', 0)}\n")
    torch.cuda.memory._record_memory_history(enabled=None)


def _top2_margin(logits):
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def run_arm(arm: str, plan: Dict[str, Any], seed: int, trace_out: str = None) -> Dict[str, Any]:
    if arm == "poolkeeper":
        from poolkeeper.integrations import torch as pkt

        pkt.install("arena")  # before anything touches CUDA
    import numpy as np
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if trace_out:  # native arm only: PyTorch's allocation history, for offline replay against pools
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(cfg)  # random weights, initialized on the CPU: identical in both arms
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    torch.cuda.synchronize()
    dev = torch.device("cuda")
    logits_hash = hashlib.sha256()
    tokens_hash = hashlib.sha256()
    prefill_ms: List[float] = []
    decode_ms: List[float] = []
    decode_tokens: List[Any] = []  # per run: [batch][step] greedy tokens
    decode_margins: List[Any] = []  # per run: [batch][step] top-1 minus top-2 logit
    t_start = time.perf_counter()

    with torch.inference_mode():
        # warm-up (kernels, cuBLAS handles): one tiny prefill, not timed, not hashed
        model(torch.ones((1, 8), dtype=torch.long, device=dev))
        torch.cuda.synchronize()

        for _ in range(plan["prefill_steps"]):
            ids, mask = left_padded_batch(np, rng, plan["prefill_batch"], plan["prefill_len"], CONFIG["vocab_size"])
            ids, am = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=ids, attention_mask=am, use_cache=False)
            last = out.logits[:, -1, :]
            torch.cuda.synchronize()
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
            logits_hash.update(last.float().cpu().numpy().tobytes())
            del out, last, ids, am

        for _ in range(plan["decode_runs"]):
            ids, mask = left_padded_batch(np, rng, plan["decode_batch"], plan["decode_prompt"], CONFIG["vocab_size"])
            b = ids.shape[0]
            ids, am = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
            out = model(input_ids=ids, attention_mask=am, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            generated = [nxt]
            margins = [_top2_margin(out.logits[:, -1, :])]
            for _t in range(plan["decode_tokens"] - 1):
                am = torch.cat([am, torch.ones((b, 1), dtype=am.dtype, device=dev)], dim=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(input_ids=nxt, attention_mask=am, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                decode_ms.append((time.perf_counter() - t0) * 1e3)
                generated.append(nxt)
                margins.append(_top2_margin(out.logits[:, -1, :]))
            toks = torch.cat(generated, dim=1).cpu().numpy().astype(np.int64)
            tokens_hash.update(toks.tobytes())
            decode_tokens.append(toks.tolist())
            decode_margins.append(torch.stack(margins, dim=1).float().cpu().numpy().tolist())
            del out, past, nxt, generated, ids, am

    torch.cuda.synchronize()
    wall = time.perf_counter() - t_start
    if trace_out:
        try:
            _write_trace(torch, trace_out)
        except Exception as e:  # the trace is a by-product; the run's results still count
            print(f"[torch_model] trace not written: {e!r}", file=sys.stderr)
    res: Dict[str, Any] = {
        "arm": arm,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "wall_s": wall,
        "logits_sha256": logits_hash.hexdigest(),
        "tokens_sha256": tokens_hash.hexdigest(),
        "prefill_ms": quantiles(prefill_ms),
        "decode_ms": quantiles(decode_ms),
        "decode_tokens": decode_tokens,
        "decode_margins": decode_margins,
    }
    if arm == "native":
        res.update(native_memory_stats(torch), live_counts="allocated block sizes (rounded to 512 B)")
    else:
        from poolkeeper.integrations import torch as pkt

        st = pkt.stats(0)
        res.update(
            peak_reserved_bytes=st["peak_reserved_bytes"],
            peak_live_bytes=st["peak_live_bytes"],
            upstream_allocations=st["upstream_allocations"],
            upstream_deallocations=st["upstream_deallocations"],
            reserved_bytes_end=st["reserved_bytes"],
            backings_end=st["backings"],
            hooks=pkt.installation().hooks,
            hook_counters=pkt.hook_counters(),
            live_counts="requested bytes",
        )
    return res


# -- the parent: both arms, then the comparison -------------------------------------------------


def first_divergence(a: Dict[str, Any], b: Dict[str, Any]) -> Any:
    """Where greedy decoding first picks a different token, and how close the call was there (the
    top-1 minus top-2 logit in each run: a near tie flips on any rounding difference)."""
    for run, (ta, tb) in enumerate(zip(a["decode_tokens"], b["decode_tokens"])):
        for row, (ra, rb) in enumerate(zip(ta, tb)):
            for step, (x, y) in enumerate(zip(ra, rb)):
                if x != y:
                    return {
                        "run": run, "row": row, "step": step, "tokens": [x, y],
                        "margin_a": a["decode_margins"][run][row][step],
                        "margin_b": b["decode_margins"][run][row][step],
                        "margin_a_before": a["decode_margins"][run][row][step - 1] if step else None,
                    }
    return None


def fmt_bytes(n: Any) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:,.1f} MiB"


def markdown(results: Dict[str, Any]) -> str:
    n, p = results["native"], results["poolkeeper"]
    rows = [
        ("peak reserved", fmt_bytes(n["peak_reserved_bytes"]), fmt_bytes(p["peak_reserved_bytes"])),
        ("peak live", fmt_bytes(n["peak_live_bytes"]), fmt_bytes(p["peak_live_bytes"])),
        ("upstream allocations (cudaMalloc-level)", n["upstream_allocations"], p["upstream_allocations"]),
        ("upstream frees", n["upstream_deallocations"], p["upstream_deallocations"]),
        ("prefill step p50 / p90 (ms)", f"{n['prefill_ms']['p50']:.2f} / {n['prefill_ms']['p90']:.2f}",
         f"{p['prefill_ms']['p50']:.2f} / {p['prefill_ms']['p90']:.2f}"),
        ("decode step p50 / p90 (ms)", f"{n['decode_ms']['p50']:.3f} / {n['decode_ms']['p90']:.3f}",
         f"{p['decode_ms']['p50']:.3f} / {p['decode_ms']['p90']:.3f}"),
        ("steps timed (prefill, decode)", f"{n['prefill_ms']['n']}, {n['decode_ms']['n']}",
         f"{p['prefill_ms']['n']}, {p['decode_ms']['n']}"),
        ("wall (s)", f"{n['wall_s']:.1f}", f"{p['wall_s']:.1f}"),
    ]
    out = [
        f"# Llama ({CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, random weights, bf16): "
        "native caching allocator vs poolkeeper arena",
        "",
        f"{n['device']}, torch {n['torch']}, transformers {n['transformers']}, plan: {results['plan_name']} "
        f"({json.dumps(results['plan'])}), seed {results['seed']}.",
        "",
        "| | PyTorch native | poolkeeper arena |",
        "|---|---|---|",
    ]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    out += [
        "",
        f"Outputs identical: logits {results['identical']['logits']}, tokens {results['identical']['tokens']}.",
        "",
    ]
    if "identical_native_repeat" in results:
        r = results["identical_native_repeat"]
        out += [f"Native run twice, identical to itself: logits {r['logits']}, tokens {r['tokens']}.", ""]
    for k, d in results.get("divergence", {}).items():
        if d:
            out += [f"First differing greedy token ({k}): decode run {d['run']}, row {d['row']}, step {d['step']}, "
                    f"tokens {d['tokens']}, top-1 minus top-2 logit there {d['margin_a']:.4g} vs {d['margin_b']:.4g}.", ""]
    out += [
        "Peak live: native counts allocated block sizes (rounded up to 512 B), poolkeeper the bytes requested. "
        "Native upstream calls are `num_device_alloc`/`num_device_free` from `torch.cuda.memory_stats()`; "
        "poolkeeper's are the arena's calls to its CudaDevice upstream (cuMemAlloc/cuMemFree).",
        "",
    ]
    return "\n".join(out)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter plan (about a minute per arm)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--repeat-native", action="store_true",
                    help="run the native arm a second time, to tell allocator effects from run-to-run noise")
    ap.add_argument("--trace-out", help="with --repeat-native: write the repeat run's allocation trace here "
                    "(gzipped CSV action,addr,size,stream; the repeat's timings are then not comparable)")
    ap.add_argument("--arm", choices=["native", "poolkeeper"], help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    plan_name = "quick" if args.quick else "full"
    plan = QUICK if args.quick else FULL

    if args.arm:  # child
        res = run_arm(args.arm, plan, args.seed, args.trace_out)
        with open(args.result_file, "w") as f:
            json.dump(res, f)
        return 0

    env = dict(os.environ)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS in both arms
    results: Dict[str, Any] = {"plan_name": plan_name, "plan": plan, "seed": args.seed, "config": CONFIG}
    runs = [("native", "native"), ("poolkeeper", "poolkeeper")]
    if args.repeat_native:
        runs.append(("native_repeat", "native"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, arm in runs:
            path = os.path.join(tmp, name + ".json")
            cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--result-file", path, "--seed",
                   str(args.seed)] + (["--quick"] if args.quick else [])
            if name == "native_repeat" and args.trace_out:
                cmd += ["--trace-out", os.path.abspath(args.trace_out)]
            print(f"[torch_model] running {name} ...", flush=True)
            r = subprocess.run(cmd, env=env)
            if r.returncode != 0:
                print(f"[torch_model] {name} failed with exit {r.returncode}", file=sys.stderr)
                if name == "native_repeat":  # a diagnostic run: keep the comparison of the other two
                    results["native_repeat_error"] = r.returncode
                    continue
                return 1
            with open(path) as f:
                results[name] = json.load(f)
    results["identical"] = {
        "logits": results["native"]["logits_sha256"] == results["poolkeeper"]["logits_sha256"],
        "tokens": results["native"]["tokens_sha256"] == results["poolkeeper"]["tokens_sha256"],
    }
    results["divergence"] = {"native_vs_poolkeeper": first_divergence(results["native"], results["poolkeeper"])}
    if "native_repeat" in results:
        results["identical_native_repeat"] = {
            "logits": results["native"]["logits_sha256"] == results["native_repeat"]["logits_sha256"],
            "tokens": results["native"]["tokens_sha256"] == results["native_repeat"]["tokens_sha256"],
        }
        results["divergence"]["native_vs_native_repeat"] = first_divergence(results["native"], results["native_repeat"])
    results["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "torch_model" + ("_quick" if args.quick else ""))
    md = markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    slim = {k: ({kk: vv for kk, vv in v.items() if kk not in ("decode_tokens", "decode_margins")}
                if isinstance(v, dict) and "decode_tokens" in v else v) for k, v in results.items()}
    with open(stem + ".json", "w") as f:  # the per-token lists stay out of the committed file
        json.dump(slim, f, indent=2)
    return 0 if all(results["identical"].values()) else 2


if __name__ == "__main__":
    sys.exit(main())
