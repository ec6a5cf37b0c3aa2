"""The torch.OutOfMemoryError shim's switch, its check in a separate process, and the diagnostic
harness that compares its builds on a device (tools/torch_oom_diagnose.py), without torch or a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from poolkeeper.integrations import _torch_oom_shim as shim

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    lib = tmp_path / "cache" / "torch-oom-shim-x" / "poolkeeper_torch_oom_shim.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.setattr(shim, "build", lambda torch, *a, **k: shim.ShimBuild(str(lib), "cached"))
    return lib


def test_the_shim_is_on_by_default_and_off_or_unchecked_on_request(monkeypatch):
    monkeypatch.delenv("POOLKEEPER_TORCH_OOM_SHIM", raising=False)
    assert shim.mode() == "auto"
    for v, m in (("0", "off"), ("off", "off"), ("1", "on"), ("force", "on"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv("POOLKEEPER_TORCH_OOM_SHIM", v)
        assert shim.mode() == m, v


def test_a_shim_that_fails_its_check_is_not_used_and_the_verdict_is_kept(fake_build, monkeypatch):
    monkeypatch.delenv("POOLKEEPER_TORCH_OOM_SHIM", raising=False)
    calls = []

    def crashed(path):
        calls.append(path)
        return False, "the check in a separate process failed (killed by signal 11): Fatal Python error"

    b = shim.load(types.SimpleNamespace(), "/nonexistent/core.so", verify=crashed)
    assert b.path is None and "signal 11" in b.reason and b.reason.startswith("not used")
    assert calls == [str(fake_build)]
    b = shim.load(types.SimpleNamespace(), "/nonexistent/core.so", verify=crashed)  # cached: no second check
    assert b.path is None and "(cached)" in b.reason and len(calls) == 1


def test_a_check_that_does_not_finish_is_not_cached(fake_build, monkeypatch):
    monkeypatch.delenv("POOLKEEPER_TORCH_OOM_SHIM", raising=False)
    calls = []

    def hung(path):
        calls.append(path)
        return None

    assert shim.load(types.SimpleNamespace(), "/x", verify=hung).path is None
    assert shim.load(types.SimpleNamespace(), "/x", verify=hung).path is None
    assert len(calls) == 2 and not (fake_build.parent / "verdict.json").exists()


def test_a_passed_check_leads_to_binding_and_forced_mode_skips_the_check(fake_build, monkeypatch):
    monkeypatch.delenv("POOLKEEPER_TORCH_OOM_SHIM", raising=False)
    calls = []

    def passed(path):
        calls.append(path)
        return True, "passed a check in a separate process"

    # The verdict says yes, so load() goes on to bind: the empty stand-in library cannot be loaded.
    b = shim.load(types.SimpleNamespace(), "/x", verify=passed)
    assert b.path is None and b.reason.startswith("loading the shim failed") and len(calls) == 1
    monkeypatch.setenv("POOLKEEPER_TORCH_OOM_SHIM", "1")
    (fake_build.parent / "verdict.json").unlink()
    b = shim.load(types.SimpleNamespace(), "/x", verify=passed)
    assert b.reason.startswith("loading the shim failed") and len(calls) == 1  # no check when forced


def test_every_variant_of_the_source_names_its_exception():
    # The diagnostic builds PK_SHIM_THROW 0..3; install() builds 0 (no backtrace at the throw).
    src = shim.SOURCE
    assert "#define PK_SHIM_THROW 0" in src
    for k in range(3):
        assert f"PK_SHIM_THROW == {k}" in src
    cmd = shim.compile_command(types.SimpleNamespace(__file__="/t/torch/__init__.py", _C=None), "a.cpp", "a.so")
    assert "-DPK_SHIM_THROW=0" in cmd and "-lc10" in cmd and "-fvisibility=hidden" in cmd
    cmd = shim.compile_command(types.SimpleNamespace(__file__="/t/torch/__init__.py"), "a.cpp", "a.so", 1, "torch")
    assert "-DPK_SHIM_THROW=1" in cmd and "-ltorch_python" in cmd and "-O2" not in cmd


def test_diagnostic_harness_reports_a_crash_with_both_stacks():
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "torch_oom_diagnose.py"), "--self-test"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = r.stdout[r.stdout.index("===== summary ====="):]
    assert "self/clean" in summary and "exit 0" in summary
    assert "self/segfault" in summary and "CRASHED: killed by SIGSEGV" in summary
    assert "Fatal Python error: Segmentation fault" in r.stdout  # faulthandler's Python stack
    if "not built" not in r.stdout.splitlines()[0]:
        assert "[c-stack] signal" in r.stdout  # and the C stack
