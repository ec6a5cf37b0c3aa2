"""Where two processes' Llama generations part: the first module output that differs, and how
close the tokens were where the outputs part.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/llama_divergence.py [--runs torch:3,default:5] [--requests 3]

Each run is a fresh process that builds ``benchmarks/real_models.py``'s Llama-style model (same
seed, same warm-up, the same first requests of its full plan, PyTorch's deterministic algorithms
with uninitialized memory filled; warnings only where an op has no deterministic version) under
one allocator:

- ``torch``: PyTorch's caching allocator;
- ``torch_layout``: the same with ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:21,roundup_power2_divisions:16``
  (PyTorch's allocator, its blocks laid out differently);
- ``default``: the pool ``install()`` makes with no arguments on a device with virtual memory
  (``poolkeeper.pools.default_device_pool``: the expandable arena, single-stream), built with a
  log of every allocation and free and installed, so the layouts of the runs can be compared;
- ``KIND`` or ``KIND+OPTION``: that pool installed.

In the last request every module's output is checksummed (its bits, exactly) at every step
(prefill and each decode step), with its address modulo 4 KiB, and each generated token's margin
over the runner-up logit is kept. The report compares each run with the first torch run: the
requests whose tokens differ, the first (step, module) whose output bits differ and the addresses
there, and the margin of the first token that differs. A module whose inputs are bit-identical
but whose output is not computes differently depending on where its tensors lie.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TORCH_LAYOUT_ENV = "max_split_size_mb:21,roundup_power2_divisions:16"


def child(arm: str, requests: int, out: str, log: Optional[str]) -> None:
    import real_models as rm

    if arm not in ("torch", "torch_layout"):
        from poolkeeper.integrations import torch as pkt

        if arm == "default":
            from poolkeeper.pools import default_device_pool, make_device_pool

            kind, options = default_device_pool(None, lambda: True)
            if log:
                pkt.install(make_device_pool(kind, 0, log=log, **options))
            else:
                pkt.install()
        else:
            kind, options = rm.arm_pool(arm)
            pkt.install(kind, **options)
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    plan = rm.PLANS["full"]["llama"]
    seed = 1234
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda")
    model = LlamaForCausalLM(LlamaConfig(**rm.LLAMA_CONFIG))
    model = model.eval().to(device=dev, dtype=torch.bfloat16)
    names = {m: n for n, m in model.named_modules() if n}
    record: List[Tuple[int, str, Any, int]] = []  # (step, module, checksum tensor, address % 4096)
    step = [0]
    hooking = [False]

    def checksum(t: Any) -> Any:
        b = t.detach().contiguous().view(-1)
        v = b.view(torch.int16).to(torch.int64) if b.element_size() == 2 else b.view(torch.int32).to(torch.int64)
        w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 1000003 + 1
        return (v * w).sum()

    def hook(mod: Any, inp: Any, out: Any) -> None:
        if not hooking[0]:
            return
        t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        if torch.is_tensor(t) and t.is_cuda and t.numel():
            record.append((step[0], names[mod], checksum(t), t.data_ptr() % 4096))

    def pre_hook(mod: Any, inp: Any) -> None:
        # The input too: a module whose input bits are the same in two runs but whose output bits
        # are not is where the runs part (an input that differs was made by an op outside any
        # module, such as attention itself).
        if hooking[0] and inp and torch.is_tensor(inp[0]) and inp[0].is_cuda and inp[0].numel():
            record.append((step[0], names[mod] + " (input)", checksum(inp[0]), inp[0].data_ptr() % 4096))

    for m in names:
        m.register_forward_pre_hook(pre_hook)
        m.register_forward_hook(hook)
    margins: List[List[float]] = []
    tokens: List[str] = []

    def pick(logits: Any) -> Any:
        if hooking[0]:
            top = logits.float().topk(2, dim=-1).values
            margins.append((top[:, 0] - top[:, 1]).tolist())
        return logits.argmax(-1, keepdim=True)

    def generate(ids: Any, am: Any, n: int) -> Any:
        step[0] = 0
        out = model(input_ids=ids, attention_mask=am, use_cache=True)
        past = out.past_key_values
        nxt = pick(out.logits[:, -1, :])
        toks = [nxt]
        for i in range(n - 1):
            step[0] = i + 1
            am = torch.cat([am, torch.ones((am.shape[0], 1), dtype=am.dtype, device=dev)], dim=1)
            out = model(input_ids=nxt, attention_mask=am, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = pick(out.logits[:, -1, :])
            toks.append(nxt)
        return torch.cat(toks, dim=1)

    shapes = []
    last_tokens: List[Any] = []
    with torch.no_grad():
        for b, L in ((1, 16), (2, 48)):  # real_models.py's warm-up
            generate(torch.ones((b, L), dtype=torch.long, device=dev), torch.ones((b, L), dtype=torch.long, device=dev), 3)
        for i in range(requests):
            ids, mask = rm.left_padded_batch(np, rng, plan["batch"], plan["prompt"], rm.LLAMA_CONFIG["vocab_size"])
            shapes.append(list(ids.shape))
            ids, am = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
            hooking[0] = i == requests - 1
            toks = generate(ids, am, plan["new_tokens"])
            tokens.append(hashlib.sha256(toks.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16])
            if hooking[0]:
                last_tokens = toks.cpu().tolist()
            hooking[0] = False
    torch.cuda.synchronize()
    sums = torch.stack([r[2] for r in record]).cpu().tolist() if record else []
    res = {"arm": arm, "tokens": tokens, "shapes": shapes, "last_tokens": last_tokens, "margins": margins,
           "modules": [[s, n, c, a] for (s, n, _, a), c in zip(record, sums)]}
    if log:
        from poolkeeper.integrations import torch as pkt

        pkt.installation().pool.flush()
    with open(out, "w") as f:
        json.dump(res, f)


def layout_digest(path: str) -> Optional[str]:
    """A short digest of a pool log's layout as ``real_models.layout_key`` reads it (every call's
    kind, size and address relative to the log's lowest, in order); None without the log."""
    if not path or not os.path.exists(path):
        return None
    import real_models as rm

    return hashlib.sha256(repr(rm.layout_key(path)).encode()).hexdigest()[:12]


def compare(base: Dict[str, Any], r: Dict[str, Any]) -> Dict[str, Any]:
    diff = [i for i, (a, b) in enumerate(zip(base["tokens"], r["tokens"])) if a != b]
    out: Dict[str, Any] = {"requests_differ": diff}
    first = None
    if len(base["modules"]) != len(r["modules"]):
        out["module_records"] = [len(base["modules"]), len(r["modules"])]
    for x, y in zip(base["modules"], r["modules"]):
        if x[:2] != y[:2]:
            out["module_order_differs"] = [x[:2], y[:2]]
            break
        if x[2] != y[2]:
            first = (x, y)
            break
    if first:
        out["first_module_differs"] = {"step": first[0][0], "module": first[0][1],
                                       "addr_mod_4k": [first[0][3], first[1][3]]}
    bt, rt = base.get("last_tokens"), r.get("last_tokens")
    if bt and rt and bt != rt:
        # The earliest step at which any row's token differs (each row's later tokens follow from
        # its first difference), and every row that differs there.
        firsts = [(next(j for j in range(min(len(a), len(b))) if a[j] != b[j]), row)
                  for row, (a, b) in enumerate(zip(bt, rt)) if a != b and any(x != y for x, y in zip(a, b))]
        if firsts:
            k = min(f[0] for f in firsts)
            rows = [row for step, row in firsts if step == k]
            out["first_token_differs"] = {"row": rows[0], "step": k, "margin_base": base["margins"][k][rows[0]],
                                          "margin_run": r["margins"][k][rows[0]]}
            if len(rows) > 1:
                out["first_token_differs"]["also_rows"] = rows[1:]
        out["rows_differ"] = [row for _, row in sorted(firsts, key=lambda f: f[1])]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="torch:3,default:5,torch_layout:1",
                    help="ARM:N,... (arms: torch, torch_layout, default, KIND[+OPTION])")
    ap.add_argument("--requests", type=int, default=3, help="requests of the full plan; the last is checksummed")
    ap.add_argument("--out", default=None, help="write the runs and the report here (JSON)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.requests, args.result, args.log)
        return 0
    plan = []
    for item in args.runs.split(","):
        arm, _, n = item.partition(":")
        plan += [arm] * int(n or 1)
    # Interleave the arms, so that a slow spell of the machine does not fall on one arm.
    order = []
    counts = {a: plan.count(a) for a in dict.fromkeys(plan)}
    for k in range(max(counts.values())):
        order += [a for a in counts if counts[a] > k]
    runs = []
    tmp = tempfile.mkdtemp(prefix="llama_divergence_")
    for i, arm in enumerate(order):
        res_path = os.path.join(tmp, f"run{i}.json")
        log = os.path.join(tmp, f"run{i}.csv") if arm == "default" else None
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if arm == "torch_layout":
            env["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_LAYOUT_ENV
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--child", arm, "--requests", str(args.requests), "--result", res_path]
        if log:
            cmd += ["--log", log]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            print(f"run {i} ({arm}) failed: {p.stderr[-2000:]}", flush=True)
            continue
        with open(res_path) as f:
            r = json.load(f)
        r["layout"] = layout_digest(log) if log else None
        r["seconds"] = round(time.perf_counter() - t0, 1)
        runs.append(r)
        print(f"run {i} {arm}: {r['seconds']} s, tokens {r['tokens']}, layout {r['layout']}", flush=True)
    print("\noutputs and layouts by arm:")
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        outs = {}
        for r in mine:
            outs.setdefault(" ".join(t[:8] for t in r["tokens"]), []).append(r["layout"])
        print(f"  {arm}: " + "; ".join(f"{k} in {len(v)} run(s), layouts {sorted(set(map(str, v)))}" for k, v in outs.items()))
        if len(mine) > 1:
            for r in mine[1:]:
                print(f"    against its own first run: {json.dumps(compare(mine[0], r))}")
    base = next((r for r in runs if r["arm"] == "torch"), runs[0] if runs else None)
    report = []
    print(f"\nshapes of the requests: {base['shapes'] if base else None}; each run against the first {base['arm'] if base else ''} run:")
    for r in runs:
        c = compare(base, r)
        report.append({"arm": r["arm"], **c, "layout": r["layout"]})
        print(json.dumps(report[-1]), flush=True)
    if base and base["margins"]:
        flat = sorted(abs(m) for row in base["margins"] for m in row)
        print(f"\nbase run, last request: smallest token margins {flat[:5]}; median {flat[len(flat) // 2]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "report": report}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
