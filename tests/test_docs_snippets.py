"""Every ```python block in README.md and docs/*.md runs as written, on its own.

Each block runs in a fresh interpreter (so it must import what it uses) with an empty temporary
directory as its working directory (so files it writes land there). Blocks that need a GPU or a
framework (torch, CuPy, a CUDA upstream) form the gpu-marked variant: skipped here, run by the GPU
job (``pytest -m gpu tests/test_docs_snippets.py``), and skipped there too only if the framework is
not installed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import poolkeeper

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Code (comments stripped) naming one of these needs a GPU; torch and cupy also need the framework.
GPU_NAMES = re.compile(r"\b(torch|cupy|CudaDevice|CudaAsync|CudaPinned|CudaVirtual)\b")
FRAMEWORKS = ("torch", "cupy")
TIMEOUT_S = 120


def _code_only(src: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in src.splitlines())


def _blocks():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield f"{doc.relative_to(ROOT)}:{line}", m.group(1)


ALL = list(_blocks())
CPU = [(name, src) for name, src in ALL if not GPU_NAMES.search(_code_only(src))]
GPU = [(name, src) for name, src in ALL if GPU_NAMES.search(_code_only(src))]


def _run(src: str, cwd: Path) -> None:
    env = dict(os.environ)
    # The poolkeeper under test (an installed wheel, or a private build on PYTHONPATH).
    site = str(Path(poolkeeper.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("MPLBACKEND", "Agg")
    r = subprocess.run([sys.executable, "-c", src], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, f"snippet failed ({r.returncode}):\n{src}\n--- stderr ---\n{r.stderr[-4000:]}"


def test_every_doc_has_its_blocks_found():
    # A renamed fence or an empty docs/ would otherwise pass vacuously.
    assert len(ALL) >= 14 and CPU and GPU
    names = {n.split(":")[0] for n, _ in ALL}
    assert {"README.md", "docs/staging.md", "docs/accounting.md", "docs/cuda.md", "docs/integrations.md"} <= names


@pytest.mark.parametrize("name,src", CPU, ids=[n for n, _ in CPU])
def test_snippet_runs(name, src, tmp_path):
    _run(src, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name,src", GPU, ids=[n for n, _ in GPU])
def test_snippet_runs_on_gpu(name, src, tmp_path):
    code = _code_only(src)
    for fw in FRAMEWORKS:
        if re.search(rf"\b{fw}\b", code) and importlib.util.find_spec(fw) is None:
            pytest.skip(f"{fw} is not installed")
    _run(src, tmp_path)
