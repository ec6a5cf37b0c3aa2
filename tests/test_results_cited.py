"""benchmarks/results/ holds the figures the docs cite, nothing else: every file there is named by
README.md, docs/*.md or benchmarks/README*.md, and every ``results/...`` path those name exists.

Citations may use shell-like shorthand: ``name.{json,txt}``, ``name{,_final}``, ``name*``,
``replay_<trace>.json`` (any name in the angle brackets' place) and ``name[_suffix]`` (optional part).
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Iterator, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("README*.md"))]

PATH = re.compile(r"results/([\w.*{},<>\[\]-]+)")
# A path a command writes (``--json benchmarks/results/x.json``) names an output, not a citation.
OUTPUT = re.compile(r"(--json|--plot|--out|>|\$OUT/)\s*(benchmarks/)?$")
CODE = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[\w*{},<>\[\]-]+\.[\w.*{},<>\[\]-]+")


def expand(pattern: str) -> List[str]:
    """Shell-like shorthand -> fnmatch patterns."""
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m:  # an optional part
        return expand(pattern[: m.start()] + pattern[m.end():]) + expand(pattern[: m.start()] + m.group(1) + pattern[m.end():])
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return [p for alt in m.group(1).split(",") for p in expand(pattern[: m.start()] + alt + pattern[m.end():])]
    return [re.sub(r"<[^>]*>", "*", pattern).rstrip(".,")]


def _citations() -> Iterator[tuple]:
    for doc in CITING:
        text = doc.read_text(encoding="utf-8")
        for m in PATH.finditer(text):
            before = text[max(0, m.start() - 40): m.start()]
            yield doc, m.group(1), not OUTPUT.search(before)
        for span in CODE.findall(text):  # a bare file name in code quotes, e.g. `h200.txt`
            for word in NAME.findall(span):
                yield doc, word.rsplit("/", 1)[-1], False


def results_files() -> List[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


def test_expand_reads_the_shorthand():
    assert expand("a.{json,txt}") == ["a.json", "a.txt"]
    assert expand("hot{,_final}.{json,txt}") == ["hot.json", "hot.txt", "hot_final.json", "hot_final.txt"]
    assert expand("replay_<trace>[_pre].json") == ["replay_*.json", "replay_*_pre.json"]


def test_every_results_file_is_cited_by_the_docs():
    patterns = {p for _, c, _ in _citations() for p in expand(c)}
    uncited = [f for f in results_files() if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    assert not uncited, (
        f"benchmarks/results files no doc cites (cite them, with their command, in benchmarks/README.md "
        f"or the doc that uses the figure, or delete them): {uncited}"
    )


def test_every_cited_results_path_exists():
    files = results_files()
    dangling = sorted(
        {f"{doc.relative_to(ROOT)}: results/{c}" for doc, c, is_path in _citations() if is_path
         if c.rstrip(".,") and not any(fnmatch.fnmatchcase(f, p) for p in expand(c) for f in files)}
    )
    assert not dangling, f"docs cite results files that do not exist: {dangling}"


def test_results_stay_few():
    assert len(results_files()) <= 40, "benchmarks/results is for the figures the docs cite (issue 19: at most 40)"
