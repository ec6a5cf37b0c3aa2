"""Run a test body in a fresh Python process.

A framework allocator can only be installed before CUDA is initialized in a process, and pytest's
process may already have initialized it (other GPU tests, CuPy, torch), so each integration case
runs in its own interpreter. The body asserts; the child's failure output becomes the test's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_isolated(body: str, timeout: float = 180.0) -> str:
    """Run ``body`` (dedented) in a new interpreter; fail with its output unless it exits 0.
    Returns its stdout."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=timeout, env=env
    )
    if r.returncode != 0:
        raise AssertionError(f"isolated run failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}")
    return r.stdout
