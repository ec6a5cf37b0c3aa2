"""``poolkeeper compare --plot``: the comparisons as a picture (matplotlib, Agg backend).

One heat map per comparison, side by side over the same rows (every workload that appears in
any comparison; a comparison that lacks one shows "-"): a column per metric, each cell the arena
advantage written in it and coloured on a log scale (green: the arena is better on that metric,
red: the other arm is; the colour saturates at 1000x). An infinite advantage (the other arm made
upstream calls, the arena none) is written as ∞. cuda_async's panel carries the stream-ordered
caveat.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

METRIC_LABELS = {"p50": "p50", "p99": "p99", "ops_per_s": "ops/s", "upstream_calls": "upstream\ncalls",
                 "peak_reserved": "peak\nreserved"}
SATURATE = 3.0  # log10 of the advantage where the colour saturates


def _text(adv: Optional[float]) -> str:
    if adv is None:
        return "-"
    if adv == math.inf:
        return "∞"
    if adv >= 10:
        return f"{adv:.0f}"
    if adv >= 0.1:
        return f"{adv:.2f}"
    return f"{adv:.1e}"


def _key(e: Dict[str, Any]) -> Tuple[str, str, str]:
    return (e["workload"], json.dumps(e["params"], sort_keys=True), e["backend"])


#: Longest row label drawn: a 100,000-character workload name took matplotlib minutes to lay out.
MAX_LABEL = 60
#: Most rows drawn (the table and ``compare --json`` have them all): the figure grows with the rows,
#: 2,500 took 48 s, and past ~190,000 (a results file of a few hundred MB) the image exceeded what
#: matplotlib draws and savefig raised a bare ValueError, after hours of layout.
MAX_ROWS = 200


def _label(e: Dict[str, Any], backends: int) -> str:
    from poolkeeper.bench.runner import short_params

    extra = short_params(e["params"])
    if "upstream" in e["params"]:
        extra = f"{extra} {e['params']['upstream']}".strip()  # any scalar, not only a str
    if backends > 1:
        extra = (extra + f" [{e['backend']}]").strip()
    label = e["workload"] + (f" {extra}" if extra else "")
    return label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…"


def _format(path: str, fig: Any) -> str:
    """The file format matplotlib would infer from ``path``'s extension (PNG without one)."""
    import os

    from poolkeeper.errors import InvalidArgumentError

    ext = os.path.splitext(os.fspath(path))[1][1:].lower()
    if not ext:
        return "png"
    supported = fig.canvas.get_supported_filetypes()
    if ext not in supported:
        raise InvalidArgumentError(f"--plot {os.fspath(path)[-60:]!r}: matplotlib cannot write .{ext[:20]} files "
                                   f"(it writes {', '.join(sorted(supported))})")
    return ext


def plot(piv: Dict[str, Any], path: str, inputs: Sequence[str] = ()) -> None:
    """Write the pivot's comparisons to ``path`` (PNG; never one of ``inputs``)."""
    try:
        import matplotlib
    except ImportError:
        from poolkeeper.errors import PoolkeeperError

        raise PoolkeeperError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, e) for n, e in piv["comparisons"].items() if e]
    backends = sorted({e["backend"] for _, es in panels for e in es})
    rows: Dict[Tuple[str, str, str], str] = {}
    for _, entries in panels:
        for e in entries:
            rows.setdefault(_key(e), _label(e, len(backends)))
    keys = list(rows)
    left_out = max(0, len(keys) - MAX_ROWS)
    keys = keys[:MAX_ROWS]
    metrics = list(METRIC_LABELS)
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 3.5, 0.36 * max(1, len(keys)) + 2.6), squeeze=False,
                             layout="constrained")
    image = None
    for k, (ax, (name, entries)) in enumerate(zip(axes[0], panels)):
        by_key = {_key(e): e for e in entries}
        grid: List[List[float]] = []
        for key in keys:
            e = by_key.get(key)
            line = []
            for m in metrics:
                adv = e[m]["advantage"] if e else None
                if adv is None:
                    line.append(float("nan"))
                elif adv == math.inf:
                    line.append(SATURATE)
                elif adv <= 0:
                    line.append(-SATURATE)
                else:
                    line.append(max(-SATURATE, min(SATURATE, math.log10(adv))))
                ax.text(len(line) - 1, len(grid), _text(adv), ha="center", va="center", fontsize=7)
            grid.append(line)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=-SATURATE, vmax=SATURATE, aspect="auto")
        ax.set_xticks(range(len(metrics)))
        ax.set_xticklabels([METRIC_LABELS[m] for m in metrics], fontsize=7)
        ax.xaxis.tick_top()
        ax.set_yticks(range(len(keys)))
        # Labels come from the results files: drawn as plain text (parse_math=False), since a "$"
        # starts matplotlib's mathtext and a malformed formula raised ValueError.
        ax.set_yticklabels([rows[key] for key in keys] if k == 0 else [], fontsize=7, parse_math=False)
        other = name.split("_vs_")[0]
        title = f"{other} vs arena"
        if other == "cuda_async":
            title = "cuda_async† vs arena\n† stream-ordered: weaker release\nguarantee, not a drop-in speedup"
        ax.set_title(title, fontsize=9, pad=26)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "nothing to compare: no workload has the arena and another arm",
                        ha="center", va="center")
        axes[0, 0].set_axis_off()
    elif image is not None:
        bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
        bar.set_ticks([-3, -2, -1, 0, 1, 2, 3])
        bar.set_ticklabels(["1/1000", "1/100", "1/10", "1", "10", "100", "1000"], fontsize=7)
        bar.set_label("arena advantage (>1: arena better)", fontsize=8)
    shown = ", ".join(backends) or "-"
    if len(shown) > MAX_LABEL:
        shown = shown[: MAX_LABEL - 1] + "…"
    more = f"\nthe first {len(keys)} rows of {len(keys) + left_out}: the table and --json have them all" if left_out else ""
    fig.suptitle(f"poolkeeper compare — arena advantage per workload (scale {piv['scale']}, backend {shown}){more}",
                 fontsize=10, parse_math=False)
    import io

    from poolkeeper._paths import output_path, write_output

    output_path(path, "plot path")
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=_format(path, fig), dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    write_output(path, buf.getvalue(), "plot path", inputs)  # whole or not at all


__all__ = ["plot"]
