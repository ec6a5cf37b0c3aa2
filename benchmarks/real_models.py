"""Real models under every allocator: PyTorch's own (plain and expandable segments) and each
poolkeeper pool installed as PyTorch's allocator, in one invocation.

Workloads (random weights built from a configuration; nothing is downloaded):

- ``bert``: HF-transformers BERT-base (BertConfig with bert-base dimensions), fp16, eval mode under
  ``torch.no_grad``, serving requests of random batch x sequence length (full: 60 requests,
  batch 1-32, length 8-512);
- ``llama``: a Llama-style model (8 layers, hidden 1024, bf16), greedy generation with a KV cache
  for requests of random batch and left-padded prompt length (full: batch 1-8, prompt 16-700).

Arms: ``torch`` (PyTorch's caching allocator), ``torch_expandable`` (the same with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), and every poolkeeper pool kind installed
through ``poolkeeper.integrations.torch.install(kind)`` (``arena``, ``arena_expandable``,
``size_class``). The allocator is chosen when CUDA initializes, so every (arm, workload) runs in a
fresh process with the same seeds, the same warm-up and the same requests. An arm that fails is
reported with its error; the others still run.

Reported per arm and workload: peak reserved and peak live bytes, upstream calls (driver-level
allocations/frees, plus maps/unmaps where the pool exposes them), per-request wall time p50/p90
(synchronized), and a SHA-256 over the outputs (BERT's last hidden states, Llama's generated
tokens) so that "same outputs" can be checked across arms. Ratios: peak reserved vs ``torch`` and
vs ``torch_expandable``, ms/request vs ``torch``.

Usage (device):  PYTHONPATH=/tmp/site python3 benchmarks/real_models.py --out benchmarks/results
Time is noisy from process to process (the machine's speed drifts over minutes by more than the
allocators differ): ``--rounds N`` runs every arm N times in a rotated order and judges time on the
fastest of the rounds request by request (a disturbance only adds time), with the medians beside.
Each arm's process also times a fixed pure-Python loop before and after its requests (the "host
probe"), so that a process that got a slow host shows as one; ``--cpus 0-3`` runs every arm on the
same cores.
Dry run (CPU):   python3 benchmarks/real_models.py --device cpu --arms torch --quick --out /tmp/x
Writes <stem>.json and <stem>.md; the stem is --out without its suffix, or real_models_<tag> inside
--out when --out is a directory.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "real_models_h200")

NATIVE_ARMS = ("torch", "torch_expandable")
# "KIND+OPTION": the kind installed with OPTION=True (not in the default run; name them in --arms).
VARIANT_ARMS = ("arena+single_stream", "arena_expandable+single_stream", "arena_expandable+single_stream+wide_stitch",
                "arena_expandable+single_stream+wide_stitch+no_stitch_top_up",
                "arena_expandable+single_stream+wide_stitch+no_stitch_fragments",
                # install()'s default in 20 MiB pieces: copies out of 2 MiB pieces run 1.18x slower on
                # the H200 (docs/expandable.md, "Not done"); does the decode step follow?
                "arena_expandable+single_stream+wide_stitch+map_piece=20MiB")
# Named option sets an arm may add after "+": "wide_stitch" is poolkeeper.pools.WIDE_STITCH (what
# install() adds to its default pool; docs/expandable.md, "Stitching moves on"). "+no_OPTION" sets
# OPTION=False (after a preset: "+wide_stitch+no_stitch_top_up"); "+OPTION=VALUE" sets a value as
# `poolkeeper replay -o` reads it ("+map_piece=20MiB").
PRESETS = ("wide_stitch",)
POOL_ARMS = ("arena", "arena_expandable", "size_class") + VARIANT_ARMS
DEFAULT_ARMS = NATIVE_ARMS + POOL_ARMS[:3]
ALL_ARMS = NATIVE_ARMS + POOL_ARMS


def arm_pool(arm: str) -> Tuple[str, Dict[str, Any]]:
    """The pool kind and options of one of poolkeeper's arms (``"arena_expandable+single_stream"``
    is ``("arena_expandable", {"single_stream": True})``; a name in PRESETS adds its options,
    ``no_OPTION`` sets OPTION to False and ``OPTION=VALUE`` sets a value, read as ``poolkeeper
    replay -o`` reads it)."""
    kind, *flags = arm.split("+")
    options: Dict[str, Any] = {}
    for flag in flags:
        if "=" in flag:
            from poolkeeper.bench.options import parse_options

            options.update(parse_options([flag]))
        elif flag in PRESETS:
            from poolkeeper import pools

            options.update(getattr(pools, flag.upper()))
        elif flag.startswith("no_"):
            options[flag[3:]] = False
        else:
            options[flag] = True
    return kind, options
WORKLOADS = ("bert", "llama")

BERT_CONFIG = dict(
    vocab_size=30522,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    max_position_embeddings=512,
    type_vocab_size=2,
)

LLAMA_CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)

# The full plan keeps all ten processes (5 arms x 2 workloads) near four minutes on an H200.
PLANS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "full": {
        "bert": dict(requests=60, batch=(1, 32), length=(8, 512)),
        "llama": dict(requests=8, batch=(1, 8), prompt=(16, 700), new_tokens=32),
    },
    "quick": {
        "bert": dict(requests=16, batch=(1, 16), length=(8, 256)),
        "llama": dict(requests=3, batch=(1, 4), prompt=(16, 256), new_tokens=8),
    },
    # --device cpu: the same models and code paths, sized for a laptop-class CPU
    "cpu": {
        "bert": dict(requests=3, batch=(1, 2), length=(8, 24)),
        "llama": dict(requests=2, batch=(1, 2), prompt=(16, 24), new_tokens=3),
    },
}

EXPANDABLE_ENV = "expandable_segments:True"


# -- pure helpers (tested without torch) ---------------------------------------------------------


def quantiles(xs: Iterable[float]) -> Dict[str, float]:
    """p50 / p90 (nearest rank on the sorted samples), mean, total and count of ``xs``; NaNs
    when there are no samples."""
    s = sorted(float(x) for x in xs)
    if not s:
        nan = float("nan")
        return {"p50": nan, "p90": nan, "mean": nan, "total": 0.0, "n": 0}

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(math.ceil(p * len(s))) - 1)] if p > 0 else s[0]

    return {"p50": q(0.5), "p90": q(0.9), "mean": statistics.fmean(s), "total": math.fsum(s), "n": len(s)}


def ratio(a: Any, b: Any) -> Optional[float]:
    """a / b, or None when either is missing, not a finite number, or b is not positive."""
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError, OverflowError):
        return None
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def fmt_mib(n: Any) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:,.1f} MiB"


def fmt_ratio(r: Optional[float]) -> str:
    return "n/a" if r is None else f"{r:.3f}x"


def fmt_ms(x: Any) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError, OverflowError):
        return "n/a"
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def fmt_calls(a: Any, b: Any) -> str:
    if a is None and b is None:
        return "n/a"
    return f"{'n/a' if a is None else a} / {'n/a' if b is None else b}"


def differing_requests(r: Dict[str, Any], base: Dict[str, Any]) -> List[int]:
    """The indices of the requests whose output hash differs between run ``r`` and ``base``; a
    request one of them lacks differs too (zip alone would call a shorter run the same)."""
    a, b = list(r.get("request_sha256") or []), list(base.get("request_sha256") or [])
    return [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]


def request_times(r: Any) -> Optional[List[float]]:
    """A run's per-request times in ms, or None: a failed run (an ``error`` key), one that served no
    request, or times that are not finite, non-negative numbers."""
    each = r.get("request_ms_each") if isinstance(r, dict) and "error" not in r else None
    try:
        xs = [float(x) for x in each or ()]
    except (TypeError, ValueError):
        return None
    return xs if xs and all(math.isfinite(x) and x >= 0 for x in xs) else None


def compare(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per arm of one workload: ratios against ``torch`` / ``torch_expandable`` and whether its
    output hash equals ``torch``'s (None where either is missing or failed)."""
    base = runs.get("torch") or {}
    exp = runs.get("torch_expandable") or {}
    ok = lambda r: bool(r) and "error" not in r  # noqa: E731
    out: Dict[str, Dict[str, Any]] = {}
    for arm, r in runs.items():
        if not ok(r):
            out[arm] = {}
            continue
        c: Dict[str, Any] = {
            "reserved_vs_torch": ratio(r.get("peak_reserved_bytes"), base.get("peak_reserved_bytes")) if ok(base) else None,
            "reserved_vs_torch_expandable": (
                ratio(r.get("peak_reserved_bytes"), exp.get("peak_reserved_bytes")) if ok(exp) else None
            ),
            "reserved_over_live": ratio(r.get("peak_reserved_bytes"), r.get("peak_live_bytes")),
            "ms_p50_vs_torch": ratio(r.get("request_ms", {}).get("p50"), base.get("request_ms", {}).get("p50")) if ok(base) else None,
            "ms_total_vs_torch": (
                ratio(r.get("request_ms", {}).get("total"), base.get("request_ms", {}).get("total")) if ok(base) else None
            ),
            "decode_p50_vs_torch": (
                ratio(r.get("decode_step_ms", {}).get("p50"), base.get("decode_step_ms", {}).get("p50")) if ok(base) else None
            ),
            "same_output_as_torch": (r.get("output_sha256") == base.get("output_sha256")) if ok(base) else None,
        }
        if ok(base) and not c["same_output_as_torch"]:
            c["first_differing_request"] = next(iter(differing_requests(r, base)), None)
        out[arm] = c
    return out


def round_times(rounds: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Time over several rounds of one workload (``rounds``: arm -> its runs, one per round, in
    round order). Per arm:

    - ``total_ms``: the summed request time of each round, and ``median_ms`` of those;
    - ``best_ms``: request by request, the fastest of the rounds, summed. Every request is the same
      work in every round, and a disturbance of the machine (another process, a clock change) only
      ever adds time, so the fastest of a request's runs is the closest to what it costs;
    - ``best_round_share``: the largest share of the requests whose fastest run fell in one round
      (a request tied between k rounds counts 1/k to each). Near 1, ``best_ms`` is that one round:
      on the H200 one quiet round of torch's held 56 of its 60 fastest requests while no round of
      the other arm was as quiet, and the best-of-rounds ratio said 1.069x where, request by
      request, the median of the rounds said 0.971x (benchmarks/results/real_models_h200.md);
    - ``median_each_ms``: request by request, the median of the rounds, summed (steadier than
      ``best_ms`` when the quiet spells are rarer than the rounds);
    - against ``torch``: ``best_vs_torch``, ``median_each_vs_torch``, ``median_vs_torch`` and
      ``paired_vs_torch`` (round i against torch's round i) with their median ``paired_median_vs_torch``;
    - ``paired_each_vs_torch``: request by request against torch's same request of the same round,
      the geometric mean over every round with a 95% interval (:func:`paired_each`; None for torch);
    - where the runs time decode steps (Llama): ``decode_p50_ms``, each round's median decode step,
      and ``decode_paired_vs_torch`` (round i against torch's round i) with their median
      ``decode_paired_median_vs_torch``: the "ms/step" of a server's steady state, apart from the
      prefills that dominate the summed request time.

    Left out: failed runs, runs that served no request, and times that are not finite,
    non-negative numbers (a report is written whatever the runs did). The best of the rounds is compared with torch's
    only over the same number of requests. Ratios are None without a ``torch`` run."""
    times = request_times
    def total(r: Any) -> Optional[float]:
        if not isinstance(r, dict) or "error" in r or not isinstance(r.get("request_ms"), dict):
            return None
        if "request_ms_each" in r and times(r) is None:  # its requests' times are not numbers
            return None
        rq = r["request_ms"]
        t = ratio(rq.get("total"), 1.0)  # a finite number or None
        return t if t is not None and t > 0 and rq.get("n", 1) else None

    def totals(runs: List[Dict[str, Any]]) -> List[Optional[float]]:
        return [total(r) for r in runs]

    def best(runs: List[Dict[str, Any]]) -> Optional[Tuple[float, int, float, float, int]]:
        # (best ms, requests, the largest share of fastest runs in one round, median-each ms, rounds)
        each = [xs for xs in map(times, runs) if xs is not None]
        if not each or not each[0] or any(len(e) != len(each[0]) for e in each):
            return None
        fastest: Dict[int, float] = collections.defaultdict(float)
        lows = []
        for xs in zip(*each):
            lows.append(min(xs))
            tied = [k for k, x in enumerate(xs) if x == lows[-1]]
            for k in tied:
                fastest[k] += 1 / len(tied)
        return (math.fsum(lows), len(each[0]), max(fastest.values()) / len(each[0]),
                math.fsum(statistics.median(xs) for xs in zip(*each)), len(each))

    def decode_p50(r: Any) -> Optional[float]:
        # Only from a run the time table counts (a review found failed rounds paired here).
        if total(r) is None or not isinstance(r.get("decode_step_ms"), dict):
            return None
        x = ratio(r["decode_step_ms"].get("p50"), 1.0)
        return x if x is not None and x > 0 else None

    base = totals(rounds.get("torch", []))
    base_ok = [t for t in base if t is not None]
    each = paired_each(rounds)
    base_decode = [decode_p50(r) for r in rounds.get("torch", [])]
    base_best = best(rounds.get("torch", []))
    out: Dict[str, Dict[str, Any]] = {}
    for arm, runs in rounds.items():
        ts = totals(runs)
        ok = [t for t in ts if t is not None]
        paired = [ratio(t, b) for t, b in zip(ts, base) if t is not None and b is not None]
        paired = [x for x in paired if x is not None]
        b = best(runs)
        dec = [decode_p50(r) for r in runs]
        dec_paired = [x for x in (ratio(d, bd) for d, bd in zip(dec, base_decode) if d is not None and bd is not None)
                      if x is not None]
        # Against torch over the same requests, and over several rounds on both sides: from one
        # round the best and the median are that round, and the verdict falls back to its ratio.
        same = bool(b and base_best and b[1] == base_best[1] and min(b[4], base_best[4]) >= 2)
        out[arm] = {
            "total_ms": ts,
            "median_ms": statistics.median(ok) if ok else None,
            "best_ms": b[0] if b else None,
            "best_vs_torch": ratio(b[0], base_best[0]) if b and base_best and b[1] == base_best[1] else None,
            "best_round_share": b[2] if b else None,
            "median_each_ms": b[3] if b else None,
            "median_each_vs_torch": ratio(b[3], base_best[3]) if same else None,
            "median_vs_torch": ratio(statistics.median(ok), statistics.median(base_ok)) if ok and base_ok else None,
            "paired_median_vs_torch": statistics.median(paired) if paired else None,
            "paired_vs_torch": paired,
            "decode_p50_ms": dec,
            "decode_paired_vs_torch": dec_paired,
            "decode_paired_median_vs_torch": statistics.median(dec_paired) if dec_paired else None,
            "paired_each_vs_torch": each.get(arm),
        }
    return out


def _paired_upto(r: Dict[str, Any], n: int) -> int:
    """How many of a run's first requests ran paired: all ``n``, or those before the request at which
    its ``--together`` peers stopped meeting it (``barrier_broken_at``, "request<i>")."""
    m = re.fullmatch(r"request(\d+)", str(r.get("barrier_broken_at") or ""))
    return min(n, int(m.group(1))) if m else n


def paired_each(rounds: Dict[str, List[Dict[str, Any]]], resamples: int = 2000,
                seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """Request by request against torch's same request of the same round, over every round: per arm,
    the geometric mean of those ratios (``gm``) and a 95% interval for it (``lo``, ``hi``) from
    ``resamples`` bootstrap draws of rounds and of requests, both with replacement (a draw takes
    every pair that lies in one of its rounds and one of its requests). Both are drawn because
    both repeat: a request that costs an arm more costs it in every round, and a round whose CPUs
    or layout suit one arm suits it in every request; drawing requests alone would call a round's
    luck a difference between the arms.

    Under ``--together`` the two runs of a pair started each request at the same moment, so a drift
    of the machine falls on both and cancels in the ratio. Only paired requests count: both runs
    measured, the request's output hash the same in both (the same work), and before either run's
    peers stopped meeting it. Arms with no such pair, and torch itself, are left out."""
    base = rounds.get("torch", [])
    out: Dict[str, Dict[str, Any]] = {}
    for arm, runs in rounds.items():
        if arm == "torch":
            continue
        cells: List[Dict[int, float]] = []  # one per round that paired anything: request -> log ratio
        for r, b in zip(runs, base):
            xs, ys = request_times(r), request_times(b)
            if xs is None or ys is None:
                continue
            n = _paired_upto(b, _paired_upto(r, min(len(xs), len(ys))))
            differ = set(differing_requests(r, b))
            row = {i: math.log(xs[i] / ys[i]) for i in range(n) if xs[i] > 0 and ys[i] > 0 and i not in differ}
            if row:
                cells.append(row)
        if not cells:
            continue
        requests = sorted({i for row in cells for i in row})
        rng = random.Random(seed)
        draws = []
        for _ in range(resamples):
            picked = collections.Counter(requests[rng.randrange(len(requests))] for _ in requests)
            logs, n = 0.0, 0
            for _ in cells:
                row = cells[rng.randrange(len(cells))]
                for i, k in picked.items():
                    if i in row:
                        logs += k * row[i]
                        n += k
            if n:
                draws.append(logs / n)
        draws.sort()
        allv = [v for row in cells for v in row.values()]
        out[arm] = {"gm": math.exp(math.fsum(allv) / len(allv)),
                    # No draw met a pair only where pairs are too few to give an interval.
                    "lo": math.exp(draws[int(0.025 * (len(draws) - 1))]) if draws else None,
                    "hi": math.exp(draws[int(math.ceil(0.975 * (len(draws) - 1)))]) if draws else None,
                    "pairs": len(allv), "requests": len(requests), "rounds": len(cells)}
    return out


# torch.empty + drop sizes timed in every arm's process: a decode step's hidden states (batch 8 x
# hidden 1024 in bf16), a logits row block, and a KV-cache copy of a long prompt.
EMPTY_DROP_SIZES = (16 << 10, 512 << 10, 8 << 20)


def allocator_share(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """What the allocator itself can account for in one unit of work (a Llama decode step, a BERT
    request), per arm (``runs``: arm -> its runs, one per round):

    - ``allocations``: allocations per unit, the median over the arm's runs (the model asks for the
      same tensors under every allocator, so torch's count is the workload's);
    - ``pair_ns``: ``torch.empty`` + drop in that arm's process, the fastest run of each size,
      averaged over the sizes (a disturbance only adds time);
    - ``extra_ms``: the workload's allocations per unit x (this arm's pair - torch's pair): the time
      per unit this allocator's calls cost beyond PyTorch's own, and ``extra_share`` that over
      torch's median unit time (decode step p50, or mean request time);
    - ``inside_ms``: for poolkeeper's arms, the wall time inside its allocate and free calls per
      unit during the timed work itself (``allocator_ms_per_unit``, median over the runs), and
      ``inside_share`` that over the arm's own median unit time; ``timing_ms``: what the timing
      itself added to the unit (its allocations x ``timing_overhead_ns``, the measured cost of the
      clock reads per pair on that host).

    The pair includes ``torch.empty``'s Python dispatch, which the model's own allocations (made in
    C++) do not pay; it is the same in every arm, so the difference is the allocators'. Missing or
    malformed figures give None."""
    def num(x: Any) -> Optional[float]:
        r = ratio(x, 1.0)
        return r if r is not None and r >= 0 else None

    def summary(rs: List[Dict[str, Any]]) -> Dict[str, Any]:
        rs = [r for r in rs if isinstance(r, dict) and "error" not in r]
        allocs = [a for a in (num(r.get("allocations_per_unit")) for r in rs) if a is not None]
        inside = [a for a in (num(r.get("allocator_ms_per_unit")) for r in rs) if a is not None]
        clock = [a for a in (ratio(r.get("timing_overhead_ns"), 1.0) for r in rs) if a is not None]
        by_size: Dict[str, List[float]] = {}
        for r in rs:
            ns = r.get("empty_drop_ns")
            for k, v in (ns.items() if isinstance(ns, dict) else ()):
                if re.fullmatch(r"[0-9]{1,12}", str(k), flags=re.ASCII) and num(v) is not None and num(v) > 0:
                    by_size.setdefault(str(int(k)), []).append(float(v))

        def unit_ms(r: Dict[str, Any]) -> Optional[float]:
            step, req = r.get("decode_step_ms"), r.get("request_ms")
            if "decode_step_ms" in r:
                return num(step.get("p50")) if isinstance(step, dict) else None
            return num(req.get("mean")) if isinstance(req, dict) else None
        units = [u for u in map(unit_ms, rs) if u]
        return {
            "allocations": statistics.median(allocs) if allocs else None,
            "inside_ms": statistics.median(inside) if inside else None,
            "timing_overhead_ns": statistics.median(clock) if clock else None,
            "pair_ns_by_size": {k: min(v) for k, v in by_size.items()},
            "pair_ns": statistics.fmean(min(v) for v in by_size.values()) if by_size else None,
            "unit_ms": statistics.median(units) if units else None,
            "unit": next((r.get("alloc_unit") for r in rs if r.get("alloc_unit")), None),
        }

    s = {arm: summary(rs if isinstance(rs, list) else []) for arm, rs in runs.items()}
    base = s.get("torch", {})
    for arm, x in s.items():
        allocs = base.get("allocations") if base.get("allocations") is not None else x["allocations"]
        sizes = set(x["pair_ns_by_size"]) & set(base.get("pair_ns_by_size") or {})
        extra = None
        if allocs is not None and sizes:
            d = statistics.fmean(x["pair_ns_by_size"][k] - base["pair_ns_by_size"][k] for k in sizes)
            extra = allocs * d / 1e6
        x["extra_ms"] = extra
        x["extra_share"] = None if extra is None else ratio(extra, base.get("unit_ms"))
        x["inside_share"] = None if x["inside_ms"] is None else ratio(x["inside_ms"], x["unit_ms"])
        x["timing_ms"] = (None if x["timing_overhead_ns"] is None or x["allocations"] is None
                          else x["allocations"] * x["timing_overhead_ns"] / 1e6)
    return s


# What a round's run keeps (--rounds): what round_times, round_outputs, allocator_share and
# recurring_excess read, and each request's driver calls (request_excess reads round 1's).
ROUND_RUN_KEYS = ("request_ms", "request_ms_each", "request_calls_each", "decode_step_ms", "error", "request_sha256", "output_sha256",
                  "peak_reserved_bytes", "peak_live_bytes", "host_probe_ms", "cpus", "alloc_unit",
                  "allocations_per_unit", "allocator_ms_per_unit", "timing_overhead_ns", "empty_drop_ns",
                  "log_path", "log_events", "barrier_timeouts", "barrier_broken_at")

RESERVED_TARGET = 0.95  # issue 15: peak reserved vs torch_expandable
MS_TARGET = 1.02  # issue 14: time vs torch, within noise


def targets(cmp_: Dict[str, Dict[str, Any]],
            times: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Dict[str, Any]]:
    """Per poolkeeper arm: whether peak reserved is at most 0.95x ``torch_expandable``'s and the
    summed request time at most 1.02x ``torch``'s (None where a ratio is missing). With ``times``
    (:func:`round_times` of several rounds), time is judged on the fastest of the rounds, request by
    request (``best_vs_torch``), and on the median of the rounds, request by request
    (``median_each_vs_torch``, only from two rounds or more on both sides): met when both are within
    the target, missed when neither is, and ``"unsettled"`` when they disagree (the best of the
    rounds can be one quiet round, ``best_round_share``). With only the best, on it; with neither,
    on the median of the paired ratios."""
    out: Dict[str, Dict[str, Any]] = {}
    for arm, c in cmp_.items():
        if arm not in POOL_ARMS:
            continue
        r, m = c.get("reserved_vs_torch_expandable"), c.get("ms_total_vs_torch")
        time: Any = None if m is None else m <= MS_TARGET
        if times and arm in times:
            t = times[arm]
            verdicts = {x <= MS_TARGET for x in (t.get("best_vs_torch"), t.get("median_each_vs_torch")) if x is not None}
            if not verdicts:
                m = t.get("paired_median_vs_torch")
                time = None if m is None else m <= MS_TARGET
            else:
                time = verdicts.pop() if len(verdicts) == 1 else "unsettled"
        out[arm] = {"reserved": None if r is None else r <= RESERVED_TARGET, "time": time}
    return out


def table_head(*columns: str) -> List[str]:
    """A Markdown table's header row and its separator."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(results: Dict[str, Any]) -> str:
    """The results as Markdown: a header line, then one table per workload."""
    meta = results.get("meta", {})
    lines = [
        "# Real models under each allocator (random weights, one process per arm and workload)",
        "",
        f"{meta.get('device_name', '?')}, torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}, "
        f"plan `{results.get('plan_name')}`, seed {results.get('seed')}, device `{results.get('device')}`"
        + (", deterministic algorithms with uninitialized memory filled (times include the filling)."
           if results.get("deterministic") else "."),
        "",
    ]
    titles = {
        "bert": "BERT-base serving",
        "llama": "Llama-style greedy generation with a KV cache (8 layers, hidden 1024)",
    }
    for wl in results.get("workloads", []):
        runs = results.get("runs", {}).get(wl, {})
        cmp_ = results.get("comparison", {}).get(wl, {})
        plan = results.get("plan", {}).get(wl, {})
        dtypes = sorted({r.get("meta", {}).get("dtype") for r in runs.values() if r.get("meta")})
        lines += [f"## {titles.get(wl, wl)}", "", f"Plan: `{json.dumps(plan)}`, dtype {', '.join(dtypes) or '?'}.", ""]
        lines += table_head("arm", "peak reserved", "peak live", "reserved / live", "vs torch", "vs torch_expandable",
                            "upstream allocs / frees", "maps / unmaps", "ms/request p50", "p90", "total ms",
                            "ms p50 vs torch", "total vs torch", "decode step p50 (vs torch)", "output", "same as torch")
        for arm in results.get("arms", []):
            r = runs.get(arm)
            if r is None:
                continue
            if "error" in r:
                err = str(r["error"]).strip().splitlines()
                lines.append(f"| {arm} | failed: {(err[-1] if err else '?').replace('|', '/')[:160]} |" + " |" * 14)
                continue
            c = cmp_.get(arm, {})
            rq = r.get("request_ms", {})
            same = c.get("same_output_as_torch")
            lines.append(
                "| "
                + " | ".join(
                    [
                        arm,
                        fmt_mib(r.get("peak_reserved_bytes")),
                        fmt_mib(r.get("peak_live_bytes")),
                        fmt_ratio(c.get("reserved_over_live")),
                        fmt_ratio(c.get("reserved_vs_torch")),
                        fmt_ratio(c.get("reserved_vs_torch_expandable")),
                        fmt_calls(r.get("upstream_allocations"), r.get("upstream_deallocations")),
                        fmt_calls(r.get("maps"), r.get("unmaps")),
                        fmt_ms(rq.get("p50")),
                        fmt_ms(rq.get("p90")),
                        fmt_ms(rq.get("total")),
                        fmt_ratio(c.get("ms_p50_vs_torch")),
                        fmt_ratio(c.get("ms_total_vs_torch")),
                        "n/a" if "decode_step_ms" not in r
                        else f"{fmt_ms(r['decode_step_ms'].get('p50'))} ({fmt_ratio(c.get('decode_p50_vs_torch'))})",
                        f"`{str(r.get('output_sha256', ''))[:12]}`",
                        "n/a" if same is None else ("yes" if same else f"no (request {c.get('first_differing_request')})"),
                    ]
                )
                + " |"
            )
        lines.append("")
        times = results.get("round_times", {}).get(wl)
        if times:
            n = max(len(t["total_ms"]) for t in times.values())
            how = ("every arm at once in each round, each on its own CPUs, the CPUs rotated each round, every "
                   "request started in all arms together" if results.get("together")
                   else "every arm once per round, the order rotated each round")
            lines += [f"Time over {n} rounds ({how}; summed request time per round, ms):", ""]
            lines += table_head("arm", "per round", "median", "median vs torch", "per-round ratio vs torch",
                                "median of those", "fastest of the rounds, per request, summed", "that vs torch",
                                "most fastest requests in one round", "median of the rounds, per request, summed",
                                "that vs torch")
            for arm in results.get("arms", []):
                t = times.get(arm)
                if t is None:
                    continue
                lines.append(
                    f"| {arm} | {', '.join(fmt_ms(x) if x is not None else 'failed' for x in t['total_ms'])} "
                    f"| {fmt_ms(t['median_ms'])} | {fmt_ratio(t['median_vs_torch'])} "
                    f"| {', '.join(f'{x:.3f}' for x in t['paired_vs_torch']) or 'n/a'} "
                    f"| {fmt_ratio(t['paired_median_vs_torch'])} "
                    f"| {fmt_ms(t.get('best_ms'))} | {fmt_ratio(t.get('best_vs_torch'))} "
                    f"| {'n/a' if t.get('best_round_share') is None else format(t['best_round_share'], '.0%')} "
                    f"| {fmt_ms(t.get('median_each_ms'))} | {fmt_ratio(t.get('median_each_vs_torch'))} |"
                )
            lines.append("")
            each = [(a, times[a]["paired_each_vs_torch"]) for a in results.get("arms", [])
                    if a in times and times[a].get("paired_each_vs_torch")]
            if each:
                lines += ["Request by request against torch's same request of the same round, over every round "
                          "(geometric mean of the ratios, and a 95% interval from drawing rounds and requests "
                          "again 2,000 times; only requests both ran paired with the same output):", ""]
                lines += table_head("arm", "per request vs torch", "95% interval", "pairs", "requests", "rounds")
                for arm, e in each:
                    span = "n/a" if e.get("lo") is None else f"{e['lo']:.3f}-{e['hi']:.3f}"
                    lines.append(f"| {arm} | {fmt_ratio(e['gm'])} | {span} "
                                 f"| {e['pairs']} | {e['requests']} | {e['rounds']} |")
                lines.append("")
            dec_arms = [a for a in results.get("arms", []) if any(x is not None for x in (times.get(a) or {}).get("decode_p50_ms", []))]
            if dec_arms:
                lines += ["Decode step over the rounds (each round's median decode step, ms; the steady state of "
                          "generation, apart from the prefills):", ""]
                lines += table_head("arm", "decode step p50 per round", "per-round ratio vs torch", "median of those")
                for arm in dec_arms:
                    t = times[arm]
                    lines.append(
                        f"| {arm} | {', '.join(fmt_ms(x) if x is not None else 'n/a' for x in t['decode_p50_ms'])} "
                        f"| {', '.join(f'{x:.3f}' for x in t['decode_paired_vs_torch']) or 'n/a'} "
                        f"| {fmt_ratio(t['decode_paired_median_vs_torch'])} |")
                lines.append("")
            lines += round_outputs(results.get("round_runs", {}).get(wl, {}), results.get("arms", []))
        rr = (results.get("round_runs") or {}).get(wl) or {a: [r] for a, r in runs.items()}
        rr = {a: v for a, v in rr.items() if isinstance(v, list)} if isinstance(rr, dict) else {}
        lines += share_table(allocator_share({a: rr[a] for a in results.get("arms", []) if a in rr}))
        lines += excess_table(request_excess({a: r for a, r in runs.items() if a in results.get("arms", [])}),
                              recurring_excess({a: rr[a] for a in results.get("arms", []) if a in rr}))
        logs = [f"`{re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(str(r['log_path'])))}` "
                f"({r.get('log_events', '?')} events)"
                for a in results.get("arms", []) for r in rr.get(a, []) if isinstance(r, dict) and r.get("log_path")]
        if logs:
            lines += ["Allocation logs (`--log-dir`; those runs' times include the logging; `poolkeeper replay "
                      "FILE` replays one): " + ", ".join(logs), ""]
        for arm, lay in sorted((results.get("layouts") or {}).get(wl, {}).items()):
            if "error" in lay:
                text = f"a log could not be read ({lay['error']})"
            elif lay.get("same"):
                text = f"the same calls at the same addresses in every round ({', '.join(map(str, lay['events']))} events)"
            else:
                text = f"differs from round 1 from event {lay.get('first_difference')} on"
            lines += [f"Layout over the rounds, {arm}: {text}", ""]
        word = {True: "met", False: "missed", None: "n/a", "unsettled": "unsettled (the two figures disagree)"}
        tg = targets(cmp_, times)
        if tg:
            lines += [
                f"Targets (peak reserved <= {RESERVED_TARGET}x torch_expandable; total time <= {MS_TARGET}x torch): "
                + "; ".join(f"{a}: reserved {word[t['reserved']]}, time {word[t['time']]}" for a, t in tg.items()),
                "",
            ]
    lines += [
        "Peak reserved: `torch.cuda.max_memory_reserved()` for PyTorch's allocator, the pool's "
        "`peak_reserved_bytes` for poolkeeper. Peak live: `max_memory_allocated()` (block sizes rounded "
        "to 512 B) / the pool's `peak_live_bytes` (bytes requested). Upstream calls: PyTorch's "
        "`num_device_alloc` / `num_device_free`, poolkeeper's `upstream_allocations` / "
        "`upstream_deallocations`; maps / unmaps: the expandable arena's `map_calls` / `unmap_calls`. "
        "ms/request: wall time of each request (BERT: one forward; Llama: prefill plus every decode step), "
        "synchronized before and after; the `total` column sums them, which is steadier than p50 over a "
        "few requests of random size. Decode step: one Llama decode forward, synchronized. Each arm ran the same warm-up before its timed requests.",
        "",
    ]
    return "\n".join(lines)


def excess_each(r: Any, base: Any, basis: Optional[Sequence[bool]] = None) -> Optional[Tuple[float, List[float]]]:
    """(the run's median ratio to ``base`` request by request, over the requests ``basis`` marks
    (default: all), and each request's time beyond ``base``'s same request scaled by it), or None
    when the two runs' requests do not line up."""
    t = request_times(r) if isinstance(r, dict) and "error" not in r else None
    tb = request_times(base) if isinstance(base, dict) and "error" not in base else None
    if not t or not tb or len(t) != len(tb) or any(y <= 0 for y in tb) or (basis is not None and len(basis) != len(t)):
        return None
    ratios = [x / y for i, (x, y) in enumerate(zip(t, tb)) if basis is None or basis[i]]
    if not ratios:
        return None
    m = statistics.median(ratios)
    return m, [x - m * y for x, y in zip(t, tb)]


def recurring_excess(round_runs: Dict[str, List[Dict[str, Any]]], top: Optional[int] = None) -> Dict[str, Dict[str, Any]]:
    """Per poolkeeper arm, over two rounds or more: the requests among the ``top`` (default: a
    tenth of the requests, 1 to 5) of largest time beyond torch's (:func:`excess_each`, round i against torch's round i) in more than one round,
    with how many rounds. Host noise lands on other requests each round; a cost of the arm's own
    (a request that makes many driver calls) lands on the same ones. Per arm: ``requests``
    (request -> rounds), ``rounds``, ``top`` and ``n`` (requests per round), for
    :func:`chance_repeats`."""
    base = round_runs.get("torch") or []
    out: Dict[str, Dict[str, Any]] = {}
    for arm, runs in round_runs.items():
        if arm not in POOL_ARMS:
            continue
        if not isinstance(runs, list):
            continue
        seen: Dict[int, int] = collections.Counter()
        rounds, k, n_req = 0, 0, 0
        for r, b in zip(runs, base):
            ex = excess_each(r, b)
            if ex is None or (n_req and len(ex[1]) != n_req):
                continue
            rounds += 1
            n_req = len(ex[1])
            k = top if top is not None else max(1, min(5, n_req // 10))
            for i in sorted(range(len(ex[1])), key=lambda i: -ex[1][i])[:k]:
                seen[i] += 1
        if rounds >= 2:
            out[arm] = {"requests": {i: n for i, n in sorted(seen.items(), key=lambda x: (-x[1], x[0])) if n > 1},
                        "rounds": rounds, "top": k, "n": n_req}
    return out


def _call_count(v: Any) -> Optional[int]:
    """A count read from a saved run: a non-negative whole number, else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if 0 <= v <= 2**53 else None
    if isinstance(v, float) and math.isfinite(v) and 0 <= v <= 2**53 and v == int(v):
        return int(v)
    return None


def request_excess(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per poolkeeper arm whose run counted its driver calls request by request
    (``request_calls_each``): its time beyond torch's, request by request, set beside those calls.

    A process runs at its own speed on this host (whole runs of one arm differ by more than the
    arms do), so each request is measured against torch's same request scaled by the arm's median
    ratio to torch over the requests that made no driver call (``median_ratio``; over all of them
    when every request made some): ``excess_ms`` = time - median_ratio x torch's time. A request's
    driver calls (:data:`DRIVER_CALLS`) cost what they cost wherever they fall, so the summed excess
    of the requests that made calls, over their calls, is what a call costs the request
    (``ms_per_call``), host stalls and all; ``mean_excess_without_calls_ms``, the other requests'
    mean, shows how far the scaling itself is off (a single ratio fits requests of every size only
    roughly). ``top``: the requests of largest excess, with their calls and the time inside
    poolkeeper's allocate and free calls during them. A request whose counts cannot be read (not a
    dict, a count that is not a non-negative whole number) is left out."""
    base = runs.get("torch") or {}
    out: Dict[str, Dict[str, Any]] = {}
    for arm, r in runs.items():
        if arm not in POOL_ARMS or not isinstance(r, dict) or "error" in r:
            continue
        calls = r.get("request_calls_each")
        if not isinstance(calls, list):
            continue
        rows: List[Optional[Dict[str, Any]]] = []  # None: a request whose counts cannot be read
        for i, c in enumerate(calls):
            counts = {k: _call_count(c.get(k)) for k in DRIVER_CALLS} if isinstance(c, dict) else None
            if counts is None or any(v is None for v in counts.values()):
                rows.append(None)
                continue
            ns = _call_count(c.get("allocator_ns"))
            runs_ = {k: _call_count(c.get(k)) for k in RUN_CALLS}  # absent from runs saved before them
            rows.append({"request": i, "calls": sum(counts.values()), **counts,
                         "allocator_ms": None if ns is None else ns / 1e6,
                         "runs": None if None in runs_.values() else runs_})
        quiet = [row is not None and not row["calls"] for row in rows]
        ex = excess_each(r, base, quiet if any(quiet) else [row is not None for row in rows])
        if ex is None:
            continue
        m = ex[0]
        for row, e in zip(rows, ex[1]):
            if row is not None:
                row["excess_ms"] = e
        rows = [row for row in rows if row is not None]
        with_calls = [row for row in rows if row["calls"]]
        others = [row for row in rows if not row["calls"]]
        n_calls = sum(row["calls"] for row in with_calls)
        excess_with = math.fsum(row["excess_ms"] for row in with_calls)
        out[arm] = {
            "median_ratio": m,
            "requests": len(rows),
            "requests_with_calls": len(with_calls),
            "calls": {k: sum(row[k] for row in with_calls) for k in DRIVER_CALLS},
            "runs": ({k: sum(row["runs"][k] for row in rows) for k in RUN_CALLS}
                     if rows and all(row["runs"] is not None for row in rows) else None),
            "excess_with_calls_ms": excess_with,
            "ms_per_call": excess_with / n_calls if n_calls else None,
            "mean_excess_with_calls_ms": excess_with / len(with_calls) if with_calls else None,
            "mean_excess_without_calls_ms": math.fsum(row["excess_ms"] for row in others) / len(others) if others else None,
            "allocator_ms_with_calls": (math.fsum(row["allocator_ms"] for row in with_calls)
                                        if with_calls and all(row["allocator_ms"] is not None for row in with_calls) else None),
            "top": sorted(rows, key=lambda row: -row["excess_ms"])[:5],
        }
    return out


def chance_repeats(n: int, k: int, rounds: int) -> float:
    """How many of n requests would be among the k largest of a round in more than one of
    ``rounds`` rounds if each round drew its k at random: what recurring_excess finds by chance."""
    if n <= 0 or rounds < 2:
        return 0.0
    p = min(1.0, k / n)
    return n * (1.0 - sum(math.comb(rounds, j) * p**j * (1 - p) ** (rounds - j) for j in (0, 1)))


def excess_table(ex: Dict[str, Dict[str, Any]], recurring: Optional[Dict[str, Dict[str, Any]]] = None) -> List[str]:
    """Markdown of :func:`request_excess` and :func:`recurring_excess` (nothing without either)."""
    lines: List[str] = []
    for arm, rec in (recurring or {}).items():
        said = ", ".join(f"{i} ({n} rounds)" for i, n in rec["requests"].items()) or "none"
        lines += [f"Requests among the {rec['top']} of largest time beyond torch's (each round against torch's) in more "
                  f"than one of {rec['rounds']} rounds, {arm}: {said} (by chance about "
                  f"{chance_repeats(rec['n'], rec['top'], rec['rounds']):.1f} requests would be)", ""]
    if not ex:
        return lines
    lines += ["Driver calls request by request (round 1): each request's time beyond torch's same request "
              "scaled by the arm's median ratio to torch over the requests without driver calls (that "
              "process's own speed); driver calls: upstream allocations and frees (the expandable arena's "
              "maps and unmaps among them), aliases and unaliases:", ""]
    lines += table_head("arm", "median ratio to torch", "requests with calls", "allocations / frees / aliases / unaliases",
                        "their time beyond, ms", "per call, us", "per such request, ms",
                        "inside poolkeeper's calls then, ms", "per other request, ms")
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    for arm, e in ex.items():
        c = e["calls"]
        lines.append(f"| {arm} | {e['median_ratio']:.3f} | {e['requests_with_calls']} of {e['requests']} "
                     f"| {' / '.join(str(c[k]) for k in DRIVER_CALLS)} "
                     f"| {e['excess_with_calls_ms']:+.1f} "
                     f"| {fmt(None if e['ms_per_call'] is None else e['ms_per_call'] * 1e3, '.0f')} "
                     f"| {fmt(e['mean_excess_with_calls_ms'], '+.2f')} "
                     f"| {fmt(e['allocator_ms_with_calls'], '.1f')} "
                     f"| {fmt(e['mean_excess_without_calls_ms'], '+.2f')} |")
    lines.append("")
    for arm, e in ex.items():
        if e.get("runs"):
            lines += [f"{arm}: its unmaps and unaliases went in {e['runs']['unmap_runs']} / {e['runs']['unalias_runs']} "
                      "runs (one driver call each where the driver takes a run of mappings at once)", ""]
    for arm, e in ex.items():
        tops = ", ".join(f"{row['request']} ({row['excess_ms']:+.1f} ms, {row['calls']} calls)" for row in e["top"])
        lines += [f"Largest time beyond, {arm}: request {tops}", ""]
    return lines


def share_table(share: Dict[str, Dict[str, Any]]) -> List[str]:
    """Markdown lines for :func:`allocator_share` (nothing when no arm measured its pair)."""
    if not any(x.get("pair_ns") is not None for x in share.values()):
        return []
    unit = str(next((x["unit"] for x in share.values() if x.get("unit")), "unit"))
    sizes = sorted({int(k) for x in share.values() for k in x.get("pair_ns_by_size", {})})
    size_txt = " / ".join(f"{k >> 20} MiB" if k >= 1 << 20 else f"{k >> 10} KiB" for k in sizes)
    lines = [f"What the allocator can account for per {unit}: allocations per {unit} (median over the runs), "
             f"`torch.empty` + drop in each arm's process (ns, fastest run; {size_txt}), and allocations x "
             "(that pair - torch's pair), the time per " + unit + " the arm's allocator calls cost beyond "
             "PyTorch's own; for poolkeeper's arms also the wall time inside its allocate and free calls "
             "during the timed work (`call_timing`, median over the runs), and what that timing itself added to "
             "their time (they ran their requests with it on: two clock reads per call, measured per "
             "allocation and free on the same host):", ""]
    lines += table_head("arm", f"allocations per {unit}", "torch.empty + drop, ns", f"allocator time vs torch, ms per {unit}",
                        f"÷ torch's {unit}", f"inside poolkeeper's calls, ms per {unit}", f"÷ the arm's {unit}",
                        f"the timing's own cost, ms per {unit}")
    for arm, x in share.items():
        pairs = x.get("pair_ns_by_size", {})
        allocs, extra, frac = x.get("allocations"), x.get("extra_ms"), x.get("extra_share")
        inside, inside_frac, clock = x.get("inside_ms"), x.get("inside_share"), x.get("timing_ms")
        lines.append(
            f"| {arm} | {'n/a' if allocs is None else f'{allocs:.0f}'} "
            f"| {' / '.join(f'{pairs[str(k)]:.0f}' if str(k) in pairs else 'n/a' for k in sizes)} "
            f"| {'n/a' if extra is None else f'{extra:+.3f}'} | {'n/a' if frac is None else f'{100 * frac:+.2f}%'} "
            f"| {'n/a' if inside is None else f'{inside:.3f}'} | {'n/a' if inside_frac is None else f'{100 * inside_frac:.2f}%'} "
            f"| {'n/a' if clock is None else f'{clock:.3f}'} |")
    return lines + [""]


def round_outputs(round_runs: Dict[str, List[Dict[str, Any]]], arms: List[str]) -> List[str]:
    """Markdown lines: each arm's summed request time, host probe, peak reserved and output in every
    round, and which requests differ from torch's output of the same round. The first round alone can hide a layout (and so an
    output) that changes from one process to the next: the pools' layout depends on when the GPU
    passes each stream-ordered release."""
    base = round_runs.get("torch", [])
    rows = []
    for arm in arms:
        runs = round_runs.get(arm) or []
        if not runs or not any(r.get("request_sha256") for r in runs):
            continue
        cells = []
        for i, r in enumerate(runs):
            if not isinstance(r, dict) or "error" in r:
                cells.append("failed")
                continue
            ref = base[i] if i < len(base) and isinstance(base[i], dict) else {}
            diff = differing_requests(r, ref)
            same = "n/a" if not ref.get("request_sha256") else ("same" if not diff else f"differs at {diff}")
            xs = request_times(r)
            total = math.fsum(xs) if xs else None
            probe = r.get("host_probe_ms")
            probe_text = ("/".join(f"{x:.1f}" for x in probe)
                          if isinstance(probe, list) and probe and all(isinstance(x, (int, float)) for x in probe) else "n/a")
            # --together: a run whose peers stopped meeting it ran its later requests unpaired.
            alone = f", unpaired from its {r['barrier_broken_at']} on" if r.get("barrier_broken_at") else ""
            cells.append(f"{fmt_ms(total)} ms, host probe {probe_text} ms, "
                         f"{fmt_mib(r.get('peak_reserved_bytes'))}, `{str(r.get('output_sha256', ''))[:12]}` {same}{alone}")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    n = max(len(round_runs.get(a) or []) for a in arms)
    return (["Every round: summed request time, the host probe before and after the requests (a fixed "
             "pure-Python loop, the fastest of 5: a slow process shows there), peak reserved, output, and the "
             "requests whose output differs from torch's in the same round:", ""] + table_head("arm", *[f"round {i + 1}" for i in range(n)]) + rows + [""])


def layout_key(path: str) -> List[Tuple[str, int, int]]:
    """One allocation log (``--log-dir``) as its layout: every allocation and free in order, as
    (kind, size, address minus the log's lowest allocated address)."""
    from poolkeeper.bench.readers import read_log

    events = read_log(path, "auto", None).events
    base = min((ev.addr for ev in events if ev.size), default=0)
    return [(ev.kind, ev.size, ev.addr - base) for ev in events]


def same_layouts(paths: Sequence[str]) -> Dict[str, Any]:
    """Whether the runs behind ``paths`` (one arm's logs, a round each) made the same calls and got
    the same addresses (relative to each log's lowest): ``same`` (True/False), ``events`` (per log)
    and ``first_difference`` (the event index where the first log and another part, or None). An
    output that differs between runs of the same layout did not come from the memory's layout."""
    keys = [layout_key(p) for p in paths]
    first: Optional[int] = None
    for k in keys[1:]:
        n = next((i for i, (x, y) in enumerate(zip(keys[0], k)) if x != y), None)
        if n is None and len(k) != len(keys[0]):
            n = min(len(k), len(keys[0]))
        if n is not None:
            first = n if first is None else min(first, n)
    return {"same": first is None, "events": [len(k) for k in keys], "first_difference": first}


def out_stem(out: Optional[str], device: str, quick: bool) -> str:
    """Where to write: ``out`` minus a .json/.md suffix, or ``out/real_models_<tag>`` when ``out``
    is a directory (or ends with a slash)."""
    if not out:
        return DEFAULT_OUT if device == "cuda" and not quick else DEFAULT_OUT.replace("_h200", "_" + tag(device, quick))
    if out.endswith(os.sep) or os.path.isdir(out):
        return os.path.join(out, "real_models_" + tag(device, quick))
    for ext in (".json", ".md"):
        if out.endswith(ext):
            return out[: -len(ext)]
    return out


def tag(device: str, quick: bool) -> str:
    return ("h200" if device == "cuda" else device) + ("_quick" if quick else "")


def child_env(arm: str, base: Dict[str, str]) -> Dict[str, str]:
    """The environment of one arm's process: unbuffered, deterministic cuBLAS, and
    ``PYTORCH_CUDA_ALLOC_CONF`` set for ``torch_expandable`` only (and removed elsewhere, so an
    inherited setting cannot leak into the other arms)."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if arm == "torch_expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_ENV
    return env


# -- one (arm, workload) in its own process -------------------------------------------------------


def _digest(torch: Any, t: Any) -> bytes:
    """The tensor's raw bytes, whatever its dtype (numpy has no bfloat16)."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.element_size() > 1 else t.numpy().tobytes()


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def left_padded_batch(np: Any, rng: Any, batch: Sequence[int], length: Sequence[int], vocab: int) -> Any:
    """A random batch of token ids, left-padded: ``(ids, mask)`` as int64 arrays. The batch size
    is drawn from ``batch``, each row's length from ``length`` (both inclusive), then the ids."""
    b = int(rng.integers(batch[0], batch[1] + 1))
    lens = rng.integers(length[0], length[1] + 1, size=b)
    L = int(lens.max())
    mask = (np.arange(L)[None, :] >= (L - lens)[:, None]).astype(np.int64)
    return rng.integers(3, vocab, size=(b, L)) * mask, mask


def native_memory_stats(torch: Any) -> Dict[str, Any]:
    """PyTorch's caching allocator figures of device 0, under the names poolkeeper's stats use."""
    ms = torch.cuda.memory_stats()
    return dict(
        peak_reserved_bytes=torch.cuda.max_memory_reserved(),
        peak_live_bytes=torch.cuda.max_memory_allocated(),
        upstream_allocations=ms.get("num_device_alloc", ms.get("segment.all.allocated")),
        upstream_deallocations=ms.get("num_device_free", ms.get("segment.all.freed")),
        segments_allocated=ms.get("segment.all.allocated"),
        segments_freed=ms.get("segment.all.freed"),
        alloc_retries=ms.get("num_alloc_retries"),
        reserved_bytes_end=ms.get("reserved_bytes.all.current"),
    )


def _bert(torch: Any, np: Any, plan: Dict[str, Any], seed: int, device: str, dtype: Any,
          count: Callable[[], Dict[str, Optional[int]]],
          calls: Callable[[], Optional[Dict[str, int]]] = lambda: None,
          meet: Callable[[str], None] = lambda tag: None) -> Dict[str, Any]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = BertModel(BertConfig(**BERT_CONFIG)).eval().to(device=device, dtype=dtype)
    dev = torch.device(device)
    per_request: List[str] = []
    total = hashlib.sha256()
    ms: List[float] = []
    calls_each: List[Optional[Dict[str, int]]] = []
    with torch.no_grad():
        for b, L in ((1, 8), (2, 64)):  # warm-up: kernels, cuBLAS handles; same in every arm
            model(input_ids=torch.ones((b, L), dtype=torch.long, device=dev))
        _sync(torch, device)
        c0 = count()
        for i in range(plan["requests"]):
            b = int(rng.integers(plan["batch"][0], plan["batch"][1] + 1))
            L = int(rng.integers(plan["length"][0], plan["length"][1] + 1))
            ids = torch.from_numpy(rng.integers(1000, BERT_CONFIG["vocab_size"], size=(b, L))).to(dev)
            am = torch.ones((b, L), dtype=torch.long, device=dev)
            _sync(torch, device)
            meet(f"request{i}")  # --together: every arm starts this request at once
            k0 = calls()
            t0 = time.perf_counter()
            out = model(input_ids=ids, attention_mask=am).last_hidden_state
            _sync(torch, device)
            ms.append((time.perf_counter() - t0) * 1e3)
            calls_each.append(calls_between(k0, calls()))
            h = hashlib.sha256(_digest(torch, out))
            per_request.append(h.hexdigest()[:16])
            total.update(h.digest())
            del out, ids, am
            print(f"[real_models]   bert request {i + 1}/{plan['requests']}: {b}x{L} {ms[-1]:.1f} ms", flush=True)
        c1 = count()
    return {"request_ms": quantiles(ms), "request_ms_each": ms, "request_sha256": per_request,
            "output_sha256": total.hexdigest(), "alloc_unit": "request", **per_unit([(c0, c1)], len(ms)),
            **({"request_calls_each": calls_each} if any(c is not None for c in calls_each) else {})}


def _llama(torch: Any, np: Any, plan: Dict[str, Any], seed: int, device: str, dtype: Any,
           count: Callable[[], Dict[str, Optional[int]]],
           calls: Callable[[], Optional[Dict[str, int]]] = lambda: None,
           meet: Callable[[str], None] = lambda tag: None) -> Dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).eval().to(device=device, dtype=dtype)
    dev = torch.device(device)
    per_request: List[str] = []
    total = hashlib.sha256()
    ms: List[float] = []
    step_ms: List[float] = []
    calls_each: List[Optional[Dict[str, int]]] = []
    decode_counts: List[Tuple[Dict[str, Optional[int]], Dict[str, Optional[int]]]] = []  # per timed request, around its decode steps

    def generate(ids: Any, am: Any, n: int, timed: bool) -> Any:
        out = model(input_ids=ids, attention_mask=am, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        toks = [nxt]
        c0 = count() if timed else None
        for _ in range(n - 1):
            am = torch.cat([am, torch.ones((am.shape[0], 1), dtype=am.dtype, device=dev)], dim=1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, attention_mask=am, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            if timed:
                _sync(torch, device)
                step_ms.append((time.perf_counter() - t0) * 1e3)
            toks.append(nxt)
        if timed:
            decode_counts.append((c0, count()))
        return torch.cat(toks, dim=1)

    with torch.no_grad():
        for b, L in ((1, 16), (2, 48)):  # warm-up: same in every arm
            generate(torch.ones((b, L), dtype=torch.long, device=dev), torch.ones((b, L), dtype=torch.long, device=dev), 3, False)
        _sync(torch, device)
        for i in range(plan["requests"]):
            ids, mask = left_padded_batch(np, rng, plan["batch"], plan["prompt"], LLAMA_CONFIG["vocab_size"])
            b, L = ids.shape
            ids, am = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
            _sync(torch, device)
            meet(f"request{i}")  # --together: every arm starts this request at once
            k0 = calls()
            t0 = time.perf_counter()
            toks = generate(ids, am, plan["new_tokens"], True)
            _sync(torch, device)
            ms.append((time.perf_counter() - t0) * 1e3)
            calls_each.append(calls_between(k0, calls()))
            h = hashlib.sha256(toks.to(torch.int64).cpu().numpy().tobytes())
            per_request.append(h.hexdigest()[:16])
            total.update(h.digest())
            del toks, ids, am
            print(f"[real_models]   llama request {i + 1}/{plan['requests']}: batch {b} prompt {L} "
                  f"+{plan['new_tokens']} tokens {ms[-1]:.1f} ms", flush=True)
    return {
        "request_ms": quantiles(ms),
        "request_ms_each": ms,
        "decode_step_ms": quantiles(step_ms),
        "request_sha256": per_request,
        "output_sha256": total.hexdigest(),
        "alloc_unit": "decode step",
        **per_unit(decode_counts, len(step_ms)),
        **({"request_calls_each": calls_each} if any(c is not None for c in calls_each) else {}),
    }


def allocation_counter(torch: Any, arm: str, device: str) -> Callable[[], Dict[str, Optional[int]]]:
    """A callable returning, so far on device 0, ``allocations`` (how many the arm's allocator
    served) and ``allocator_ns`` (wall time inside poolkeeper's allocate and free calls; None for
    PyTorch's allocator, which has no such clock). PyTorch's allocator counts allocations in
    ``allocation.all.allocated``; poolkeeper's arms read both from
    :func:`poolkeeper.integrations.torch.call_timing`, which ``run_child`` turns on (None while it
    is off). The readings bracket the timed work with a little around it (a request's input
    tensors, the attention mask a decode step extends), the same in every arm."""
    if device != "cuda":
        return lambda: {"allocations": None, "allocator_ns": None}
    if arm in POOL_ARMS:
        from poolkeeper.integrations import torch as pkt

        def pool_count() -> Dict[str, Optional[int]]:
            ct = pkt.call_timing()
            if not ct["enabled"]:  # counters that do not move would read as 0 calls, 0 ns
                return {"allocations": None, "allocator_ns": None}
            return {"allocations": int(ct["malloc_calls"]), "allocator_ns": int(ct["malloc_ns"]) + int(ct["free_ns"])}
        return pool_count
    return lambda: {"allocations": torch.cuda.memory_stats().get("allocation.all.allocated"), "allocator_ns": None}


# A pool's driver calls, each tens of microseconds on the H200: its upstream allocations and frees
# (cuMemAlloc / cuMemFree; the expandable arena's maps and unmaps count as these) and the expandable
# arena's aliases and unaliases.
DRIVER_CALLS = ("upstream_allocations", "upstream_deallocations", "alias_calls", "unalias_calls")
# The runs the expandable arena's unmaps and unaliases went in: one cuMemUnmap each where the driver
# takes a run of mappings at once (CudaVirtual.unmap_runs), so the frees' and unaliases' driver
# calls are these rather than DRIVER_CALLS' counts there.
RUN_CALLS = ("unmap_runs", "unalias_runs")


def driver_call_counter(arm: str, device: str) -> Callable[[], Optional[Dict[str, int]]]:
    """A callable returning the driver calls poolkeeper's pool on device 0 has made so far
    (:data:`DRIVER_CALLS`), and the
    wall time inside its allocate and free calls (``allocator_ns``, with call timing on); None for
    PyTorch's allocator. Read around each request, outside its timed window, so that each request's
    time can be set beside the calls made during it (:func:`request_excess`). (Reading the stats
    takes the pool's lock and settles frees from other threads, which these single-threaded runs
    do not make.)"""
    if device != "cuda" or arm not in POOL_ARMS:
        return lambda: None
    from poolkeeper.integrations import torch as pkt

    def calls() -> Dict[str, int]:
        st = pkt.stats(0)
        out = {k: int(st.get(k) or 0) for k in DRIVER_CALLS + RUN_CALLS}
        ct = pkt.call_timing()
        if ct["enabled"]:
            out["allocator_ns"] = int(ct["malloc_ns"]) + int(ct["free_ns"])
        return out
    return calls


def calls_between(a: Optional[Dict[str, int]], b: Optional[Dict[str, int]]) -> Optional[Dict[str, int]]:
    """What a :func:`driver_call_counter` counted between two readings."""
    if a is None or b is None:
        return None
    return {k: b[k] - a[k] for k in b if k in a}


def per_unit(spans: Sequence[Tuple[Dict[str, Optional[int]], Dict[str, Optional[int]]]], units: int) -> Dict[str, Optional[float]]:
    """From (before, after) counter readings around the timed work and the number of units in it:
    ``allocations_per_unit`` and ``allocator_ms_per_unit`` (None where a reading lacks the figure)."""
    def per(key: str, scale: float) -> Optional[float]:
        d = [None if a.get(key) is None or b.get(key) is None else b[key] - a[key] for a, b in spans]
        return None if not spans or not units or None in d else sum(d) / units / scale  # type: ignore[arg-type]
    return {"allocations_per_unit": per("allocations", 1.0), "allocator_ms_per_unit": per("allocator_ns", 1e6)}


def empty_drop_ns(torch: Any, device: str, sizes: Sequence[int] = EMPTY_DROP_SIZES, n: int = 2000,
                  reps: int = 5) -> Dict[str, float]:
    """``torch.empty(size, uint8)`` + drop in this process, ns per pair, the fastest of ``reps`` runs
    of ``n`` pairs per size: what one allocation and its free cost through this arm's allocator
    (PyTorch's dispatch included, the same in every arm)."""
    dev = torch.device(device)
    out: Dict[str, float] = {}
    for size in sizes:
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.empty(size, dtype=torch.uint8, device=dev)
            best = min(best, time.perf_counter() - t0)
        out[str(size)] = best / n * 1e9
    _sync(torch, device)
    return out


def timing_overhead_ns(pkt: Any, n: int = 100_000, reps: int = 5) -> float:
    """What call timing adds to one allocate + free pair through the C ABI on this host, in ns:
    poolkeeper's native pair loop on device 0, the fastest of ``reps`` runs with timing on less the
    fastest with it off (the clock reads cost more on some hosts than others). Leaves timing off."""
    from poolkeeper import _core

    def best() -> float:
        return min(_core.capi_bench_pair(0, 4096, n) for _ in range(reps))
    pkt.call_timing(True)
    try:
        on = best()
    finally:
        pkt.call_timing(False)
    return on - best()


def host_probe_ms(reps: int = 5) -> float:
    """The fastest of ``reps`` runs of a fixed pure-Python loop, in ms: the speed of the host thread
    this process got, with no allocator and no GPU in it. On the H200 machine whole processes ran
    about 30% slower than others (every request and decode step alike, the pool's counters
    identical between a fast and a slow run of one arm); a process's probe says which kind it
    was, so that arms are compared in runs of the same kind."""
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc = (acc + i * i) % 1_000_003
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


MAX_CPU = 4095  # above any machine this runs on: a range is refused before it is built


def parse_cpus(text: str) -> List[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; a ValueError for anything else (empty, reversed, negative,
    non-ASCII digits, a CPU number above MAX_CPU)."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part, flags=re.ASCII)
        if not m:
            raise ValueError(f"bad CPU list {text!r} (expected e.g. 0-3,8)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a or b > MAX_CPU:
            raise ValueError(f"bad CPU range {part!r} in {text!r} (CPUs 0..{MAX_CPU}, low-high)")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def run_child(arm: str, workload: str, plan: Dict[str, Any], seed: int, device: str,
              log_path: Optional[str] = None, deterministic: bool = False,
              barrier: Optional["RequestBarrier"] = None) -> Dict[str, Any]:
    """One arm on one workload in this (fresh) process. ``log_path``: for poolkeeper's arms, the
    pool installed on device 0 is wrapped in a :class:`poolkeeper.LoggingPool` writing every
    allocation and free there (RMM's CSV, which ``poolkeeper replay`` reads), so the live sequence
    can be replayed offline; its times then include the logging. ``deterministic``: PyTorch's
    deterministic algorithms (warnings only where an op has none), with every uninitialized
    tensor filled (``torch.utils.deterministic.fill_uninitialized_memory``), so that outputs cannot
    depend on what an allocator's memory held before; its times include the filling. ``barrier``:
    a ``--together`` round's, met before each timed request."""
    probe_start = host_probe_ms()
    if arm in POOL_ARMS:
        from poolkeeper.integrations import torch as pkt

        if log_path:
            from poolkeeper.pools import make_device_pool

            kind, options = arm_pool(arm)
            pkt.install(make_device_pool(kind, 0, log=log_path, **options))  # before anything touches CUDA
        else:
            kind, options = arm_pool(arm)
            pkt.install(kind, **options)  # before anything touches CUDA
    elif arm == "torch_expandable" and os.environ.get("PYTORCH_CUDA_ALLOC_CONF") != EXPANDABLE_ENV:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_ENV  # the parent sets it; run alone, set it here
    import numpy as np
    import torch
    import transformers

    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    cuda = device == "cuda"
    dtype = {"bert": torch.float16, "llama": torch.bfloat16}[workload] if cuda else torch.float32
    t_start = time.perf_counter()
    res: Dict[str, Any] = {"arm": arm, "workload": workload}
    if arm in POOL_ARMS:
        pkt.call_timing(True)  # the pool's own time per step, beside the step (off by default)
    count = allocation_counter(torch, arm, device)
    res.update((_bert if workload == "bert" else _llama)(torch, np, plan, seed, device, dtype, count,
                                                         driver_call_counter(arm, device),
                                                         barrier.meet if barrier else lambda tag: None))
    if barrier:
        res.update(barrier_timeouts=barrier.timeouts, barrier_broken_at=barrier.broken_at)
    _sync(torch, device)
    res["wall_s"] = time.perf_counter() - t_start
    res["host_probe_ms"] = [probe_start, host_probe_ms()]  # before and after the requests
    if hasattr(os, "sched_getaffinity"):
        res["cpus"] = sorted(os.sched_getaffinity(0))
    res["meta"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "dtype": str(dtype),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if arm in POOL_ARMS:
        from poolkeeper.integrations import torch as pkt

        st = pkt.stats(0)
        inst = pkt.installation()
        res.update(
            peak_reserved_bytes=st["peak_reserved_bytes"],
            peak_live_bytes=st["peak_live_bytes"],
            upstream_allocations=st.get("upstream_allocations"),
            upstream_deallocations=st.get("upstream_deallocations"),
            maps=st.get("map_calls"),
            unmaps=st.get("unmap_calls"),
            max_memory_reserved=pkt.max_memory_reserved(0),
            pool={"kind": inst.kind, "upstream": inst.upstream, "options": inst.options, "oom_type": str(inst.oom_type)},
            pool_stats_end={k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None},
        )
        if log_path:
            res["pool"].update(kind=arm, logged=True)
            res.update(log_path=log_path, log_events=st.get("log_events"), log_write_errors=st.get("log_write_errors"))
            try:
                pkt.installation().pool.flush()
            except Exception as e:  # a full disk must not cost the measured run
                res["log_error"] = f"{type(e).__name__}: {e}"
    elif cuda:
        res.update(native_memory_stats(torch), maps=None, unmaps=None)
    else:  # CPU dry run: no device allocator to read
        res.update(peak_reserved_bytes=None, peak_live_bytes=None, upstream_allocations=None,
                   upstream_deallocations=None, maps=None, unmaps=None)
    # Last, after the figures above were read: the pairs would count in them. Not in a logged run:
    # the logging would weigh on its pairs alone, and a million pairs would go into its log.
    if arm in POOL_ARMS:
        pkt.call_timing(False)  # its clock reads would weigh on the pairs, in this arm only
    if not log_path:
        if arm in POOL_ARMS:
            res["timing_overhead_ns"] = timing_overhead_ns(pkt)
        res["empty_drop_ns"] = empty_drop_ns(torch, device, n=2000 if cuda else 50)
    return res


# -- the parent -----------------------------------------------------------------------------------


def _parse_list(s: str, valid: Sequence[str], what: str) -> List[str]:
    items = list(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))  # each once, in order
    bad = [x for x in items if x not in valid]
    if bad or not items:
        raise SystemExit(f"unknown {what} {bad or s!r} (valid: {', '.join(valid)})")
    return items


def log_name(workload: str, arm: str, rnd: int) -> str:
    """The allocation log of one run under ``--log-dir`` (``rnd`` counts from 0)."""
    return f"{workload}_{arm}_round{rnd + 1}.csv"


def check_log_dir(ap: argparse.ArgumentParser, log_dir: str, names: List[str]) -> None:
    """Make ``--log-dir`` and refuse, as a usage error, one that is empty, not a writable folder,
    not encodable as UTF-8, or that already holds one of the logs this invocation would write
    (a LoggingPool truncates its file: an earlier invocation's logs would be lost)."""
    if not log_dir:
        ap.error("--log-dir: an empty path")
    try:
        log_dir.encode("utf-8")
        os.makedirs(log_dir, exist_ok=True)
    except (OSError, UnicodeError) as e:
        ap.error(f"--log-dir {log_dir!r}: {e}")
    if not os.access(log_dir, os.W_OK | os.X_OK):
        ap.error(f"--log-dir {log_dir!r}: not writable")
    there = [n for n in names if os.path.exists(os.path.join(log_dir, n))]
    if there:
        ap.error(f"--log-dir {log_dir!r} already holds {', '.join(there[:3])}{' ...' if len(there) > 3 else ''}: "
                 "choose another folder (the logs would be overwritten)")
    if not names:
        print("[real_models] --log-dir: no poolkeeper arm selected, nothing will be logged", flush=True)


def arm_command(arm: str, workload: str, args: argparse.Namespace, path: str,
                log_file: Optional[str] = None, barrier: Optional[Tuple[str, int, int]] = None) -> List[str]:
    """The command line of one (arm, workload) child writing its result to ``path``. ``barrier``:
    (folder, arms, this arm's index) of a ``--together`` round (:class:`RequestBarrier`)."""
    return [sys.executable, os.path.abspath(__file__), "--child", arm, "--workloads", workload, "--result-file", path,
            *(["--log-file", log_file] if log_file else []),
            *(["--barrier", barrier[0], "--barrier-arms", str(barrier[1]), "--barrier-index", str(barrier[2])]
              if barrier else []),
            "--seed", str(args.seed), "--device", args.device] + (["--quick"] if args.quick else []) + \
        (["--deterministic"] if getattr(args, "deterministic", False) else [])


def arm_result(path: str, rc: Any, t0: float) -> Dict[str, Any]:
    """What a finished child left at ``path`` (its stderr beside it), or ``{"error": ...}``."""
    errpath = path + ".stderr"
    with open(errpath, errors="replace") as f:
        stderr = f.read()
    res: Dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    if rc != 0 and "error" not in res:
        res = {"error": f"exit {rc}: {stderr.strip()[-2000:]}" if stderr.strip() else f"exit {rc}"}
    res["process_s"] = time.perf_counter() - t0
    # Anything a clean run prints to stderr at exit (leak reports, aborts) is worth seeing.
    res["stderr_tail"] = stderr[-1500:]
    return res


def run_arm_process(arm: str, workload: str, args: argparse.Namespace, tmp: str,
                    log_file: Optional[str] = None) -> Dict[str, Any]:
    """Run one (arm, workload) in a fresh interpreter; its result, or ``{"error": ...}``.
    ``log_file``: where a poolkeeper arm logs its allocations (``--log-dir``)."""
    path = os.path.join(tmp, f"{arm}-{workload}.json")
    cmd = arm_command(arm, workload, args, path, log_file)
    t0 = time.perf_counter()
    try:
        with open(path + ".stderr", "w") as err:
            r = subprocess.run(cmd, env=child_env(arm, dict(os.environ)), stderr=err, timeout=args.timeout)
        rc: Any = r.returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {args.timeout} s"
    return arm_result(path, rc, t0)


def cpu_slices(cpus: Sequence[int], arms: int, rnd: int) -> List[List[int]]:
    """``--together``: the CPUs split into one equal slice per arm (the remainder unused), arm i
    on slice (i + rnd) mod arms, so that over the rounds every arm runs on every slice."""
    k = len(cpus) // arms
    if k < 1:
        raise ValueError(f"{len(cpus)} CPUs cannot give {arms} arms one each")
    slices = [list(cpus[j * k:(j + 1) * k]) for j in range(arms)]
    return [slices[(i + rnd) % arms] for i in range(arms)]


def run_arms_together(arms: Sequence[str], workload: str, args: argparse.Namespace, tmp: str, rnd: int,
                      cpus: Sequence[int], log_files: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, Dict[str, Any]]:
    """``--together``: every arm's process at once, each pinned to its own slice of ``cpus``
    (:func:`cpu_slices`), the same request started in all of them together
    (:class:`RequestBarrier`): whatever slows the machine meanwhile slows every arm alike, so
    the per-round ratios compare arms under one host. They share the one GPU, whose share of a
    decode step is small beside the host's here (both wait on it alike)."""
    slices = cpu_slices(cpus, len(arms), rnd)
    bar = tempfile.mkdtemp(prefix=f"barrier-{rnd}-", dir=tmp)
    procs = []
    t0 = time.perf_counter()
    out: Dict[str, Dict[str, Any]] = {}
    for i, arm in enumerate(arms):
        path = os.path.join(tmp, f"{arm}-{workload}-together.json")
        env = child_env(arm, dict(os.environ))
        env["OMP_NUM_THREADS"] = str(len(slices[i]))  # its own cores' worth of threads, as every arm
        cmd = arm_command(arm, workload, args, path, (log_files or {}).get(arm), (bar, len(arms), i))
        try:
            with open(path + ".stderr", "w") as err:  # the child holds its own copy
                procs.append((arm, path, subprocess.Popen(
                    cmd, env=env, stderr=err, preexec_fn=lambda c=slices[i]: os.sched_setaffinity(0, c))))
        except (OSError, subprocess.SubprocessError) as e:  # the others must not wait for it
            RequestBarrier(bar, len(arms), i).leave()
            out[arm] = {"error": f"could not start: {type(e).__name__}: {e}", "process_s": 0.0}
    deadline = time.monotonic() + args.timeout
    for arm, path, p in procs:
        try:
            rc: Any = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = f"timed out after {args.timeout} s"
        out[arm] = arm_result(path, rc, t0)
    for arm in arms:
        out[arm]["together"] = {"arms": len(arms), "round": rnd + 1}
    return {arm: out[arm] for arm in arms}


class RequestBarrier:
    """The arms of a ``--together`` round meet here before each timed request: each leaves a file
    ``<tag>.<index>`` in the shared folder and waits until every arm's is there. A peer that failed
    (it leaves ``gone.<index>``, :meth:`leave`) or fell behind by ``timeout`` s breaks the barrier
    for the rest of the run (a timeout is counted in ``timeouts``, and the arm that waited leaves
    too, so the late one does not wait in turn): from ``broken_at`` on they run unpaired, and the
    report says so."""

    def __init__(self, folder: str, arms: int, index: int, timeout: float = 120.0) -> None:
        self.folder, self.arms, self.index, self.timeout = folder, arms, index, timeout
        self.timeouts = 0
        self.broken_at: Optional[str] = None  # the tag where it broke

    @property
    def broken(self) -> bool:
        return self.broken_at is not None

    def meet(self, tag: str) -> None:
        if self.broken:
            return
        open(os.path.join(self.folder, f"{tag}.{self.index}"), "w").close()
        end = time.monotonic() + self.timeout
        while True:
            names = [n.rsplit(".", 1)[0] for n in os.listdir(self.folder)]
            if "gone" in names:
                self.broken_at = tag
                return
            if names.count(tag) >= self.arms:
                return
            if time.monotonic() > end:
                self.timeouts += 1
                self.broken_at = tag
                self.leave()
                return
            time.sleep(0.0005)

    def leave(self) -> None:
        """This arm failed: its peers stop waiting for it."""
        open(os.path.join(self.folder, f"gone.{self.index}"), "w").close()


def _readopt_saved_run(r: Dict[str, Any]) -> None:
    """A round's run as an earlier version saved it, in the current form (in place): some kept every
    key of ROUND_RUN_KEYS, ``"error": None`` on a run that did not fail (read as failed now), and
    no ``request_ms`` where only ``request_ms_each`` was kept."""
    if "error" in r and r["error"] is None:
        del r["error"]
    each = r.get("request_ms_each")
    if not isinstance(r.get("request_ms"), dict) and isinstance(each, list) and each and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in each):
        r["request_ms"] = quantiles(each)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated, of {', '.join(ALL_ARMS)} (default: {', '.join(DEFAULT_ARMS)})")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--quick", action="store_true", help="a smaller plan (well under a minute per arm)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run of the plumbing with tiny requests (only the torch arm can work there)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the uncounted first child that warms the disk cache")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per (arm, workload) process")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every arm this many times, the arm order rotated each round; the table keeps "
                         "round 1, and a time table gives each arm's median and paired ratios over the rounds")
    ap.add_argument("--cpus", default=None,
                    help="run every arm's process on these CPUs only (e.g. 0-3): the same cores for every arm")
    ap.add_argument("--together", action="store_true",
                    help="each round runs every arm's process at once, each on its own equal slice of the CPUs "
                         "(--cpus, else all this process may use; the slices rotate each round), every request "
                         "started in all arms together: the machine's drift falls on all arms alike")
    ap.add_argument("--out", default=None, help="output stem or directory (default benchmarks/results/real_models_h200)")
    ap.add_argument("--deterministic", action="store_true",
                    help="PyTorch's deterministic algorithms, every uninitialized tensor filled: outputs that "
                         "still differ between arms cannot come from what the memory held before")
    ap.add_argument("--child", choices=ALL_ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--log-file", help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    ap.add_argument("--barrier-arms", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--barrier-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", default=None,
                    help="poolkeeper's arms log every allocation and free to DIR/<workload>_<arm>_round<N>.csv "
                         "(RMM's CSV: `poolkeeper replay` reads it), to replay the live sequence offline; "
                         "their times then include the logging")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="print the Markdown of a saved run's JSON again, its round figures recomputed "
                         "by this version (runs nothing)")
    args = ap.parse_args(argv)
    if args.render:
        try:
            with open(args.render) as f:
                saved = json.load(f)
            saved_runs = saved.get("round_runs") or {}
            for runs in saved_runs.values():
                for r in (x for v in runs.values() for x in v if isinstance(x, dict)):
                    _readopt_saved_run(r)
            # A workload saved without its round runs keeps the round times it was saved with.
            saved["round_times"] = {**(saved.get("round_times") or {}),
                                    **{wl: round_times(rr) for wl, rr in saved_runs.items()}}
            print(markdown(saved), end="")
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
            ap.error(f"--render {args.render}: {type(e).__name__}: {e}")
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    if args.cpus is not None and not args.child:
        try:
            cpus = parse_cpus(args.cpus)
            # Every CPU asked for, or none: the kernel would silently drop the missing ones, and the
            # arms would not run on the cores the command line names.
            missing = sorted(set(cpus) - os.sched_getaffinity(0))
            if missing:
                raise ValueError(f"CPUs {missing} are not available to this process")
            os.sched_setaffinity(0, cpus)  # inherited by every arm's process
        except (ValueError, OSError, AttributeError) as e:
            ap.error(f"--cpus {args.cpus}: {e}")
    plan_name = "cpu" if args.device == "cpu" else ("quick" if args.quick else "full")
    plan = PLANS[plan_name]
    workloads = _parse_list(args.workloads, WORKLOADS, "workload")

    if args.child:
        try:
            res = run_child(args.child, workloads[0], plan[workloads[0]], args.seed, args.device, args.log_file,
                            args.deterministic,
                            RequestBarrier(args.barrier, args.barrier_arms, args.barrier_index) if args.barrier else None)
            code = 0
        except BaseException as e:  # reported by the parent; the other arms still run
            if args.barrier:
                RequestBarrier(args.barrier, args.barrier_arms, args.barrier_index).leave()
            res = {"arm": args.child, "workload": workloads[0], "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
            code = 1
        with open(args.result_file, "w") as f:
            json.dump(res, f)
        return code

    arms = _parse_list(args.arms, ALL_ARMS, "arm")
    together_cpus: List[int] = []
    if args.together:
        together_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(together_cpus) < len(arms):
            ap.error(f"--together: {len(together_cpus)} CPUs cannot give {len(arms)} arms one each")
    if args.log_dir is not None:
        check_log_dir(ap, args.log_dir, [log_name(wl, a, r) for wl in workloads for a in arms
                                         if a in POOL_ARMS for r in range(args.rounds)])
    results: Dict[str, Any] = {
        "plan_name": plan_name,
        "deterministic": args.deterministic,
        "together": args.together,
        "plan": {w: plan[w] for w in workloads},
        "seed": args.seed,
        "device": args.device,
        "arms": arms,
        "workloads": workloads,
        "configs": {"bert": BERT_CONFIG, "llama": LLAMA_CONFIG},
        "runs": {w: {} for w in workloads},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.warmup and args.device == "cuda":
            # The first CUDA process on a machine reads libtorch's kernels from a cold disk cache:
            # in a quick run on the H200 that made the first arm's Llama requests 4x slower than
            # every other arm's. One uncounted child per workload pays for it, with the same plan
            # as the measured runs: after a quick-plan warm-up the first full-size run was still
            # the slowest (25 s against 15-19 s for the 8 Llama requests, H200).
            for wl in workloads:
                t0 = time.perf_counter()
                run_arm_process("torch", wl, args, tmp)
                print(f"[real_models] warm-up {wl} (not counted): {time.perf_counter() - t0:.1f} s", flush=True)
        rounds: Dict[str, Dict[str, List[Dict[str, Any]]]] = {w: {a: [] for a in arms} for w in workloads}
        for rnd, wl in ((rnd, wl) for rnd in range(args.rounds) for wl in workloads):
            # Rotated, so that no arm always runs first or right after the same neighbour: the
            # machine's speed drifts over minutes by more than the arms differ.
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            logs = {arm: (os.path.join(os.path.abspath(args.log_dir), log_name(wl, arm, rnd))
                          if args.log_dir and arm in POOL_ARMS else None) for arm in arms}
            if args.together:
                print(f"[real_models] round {rnd + 1}: {wl} / {', '.join(arms)} together ...", flush=True)
                done = run_arms_together(arms, wl, args, tmp, rnd, together_cpus, logs)
            for arm in (arms if args.together else order):
                if not args.together:
                    print(f"[real_models] round {rnd + 1}: {wl} / {arm} ...", flush=True)
                r = done[arm] if args.together else run_arm_process(arm, wl, args, tmp, logs[arm])
                rounds[wl][arm].append(r)
                if rnd == 0:
                    results["runs"][wl][arm] = r
                if "error" in r:
                    print(f"[real_models] {wl} / {arm} FAILED: {str(r['error']).strip().splitlines()[-1][:300]}", flush=True)
                else:
                    print(f"[real_models] {wl} / {arm}: peak reserved {fmt_mib(r.get('peak_reserved_bytes'))}, "
                          f"live {fmt_mib(r.get('peak_live_bytes'))}, ms/request p50 {fmt_ms(r['request_ms']['p50'])}, "
                          f"total {fmt_ms(r['request_ms']['total'])} ms, {r['process_s']:.1f} s", flush=True)
                if "meta" in r and "meta" not in results:
                    results["meta"] = r["meta"]
    results["total_s"] = time.perf_counter() - t_all
    if args.rounds > 1:
        results["rounds"] = args.rounds
        results["round_times"] = {wl: round_times(rounds[wl]) for wl in workloads}
        # Every round's runs as round_times reads them (only a failed run has "error"), so that runs
        # of several invocations can be pooled.
        results["round_runs"] = {
            wl: {a: [{k: r[k] for k in ROUND_RUN_KEYS if k in r} for r in rs]
                 for a, rs in rounds[wl].items()} for wl in workloads}
    if args.log_dir is not None and args.rounds > 1:
        # Does an arm's layout change from one process to the next? (Outputs that differ between
        # rounds of one layout come from elsewhere.)
        results["layouts"] = {}
        for wl in workloads:
            for arm in arms:
                paths = [os.path.join(args.log_dir, log_name(wl, arm, r)) for r in range(args.rounds)]
                if arm in POOL_ARMS and all(os.path.exists(p) for p in paths):
                    try:
                        results["layouts"].setdefault(wl, {})[arm] = same_layouts(paths)
                    except Exception as e:  # an unreadable log is reported, not fatal to the results
                        results["layouts"].setdefault(wl, {})[arm] = {"same": None, "error": str(e)}
    results["comparison"] = {wl: compare(results["runs"][wl]) for wl in workloads}
    stem = out_stem(args.out, args.device, args.quick)
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    md = markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(md)
    print(f"[real_models] wrote {stem}.json and {stem}.md ({results['total_s']:.0f} s)", flush=True)
    failed = [(w, a) for w in workloads for a, r in results["runs"][w].items() if "error" in r]
    return 1 if failed and len(failed) == len(workloads) * len(arms) else 0


if __name__ == "__main__":
    sys.exit(main())
