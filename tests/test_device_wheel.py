"""tools/device_wheel.sh and run_h200.sh's build step: a wheel built beforehand is installed only
when it was built from the tree that travelled, so a lease never times stale code.

The build step runs against a copy of the scripts and a stand-in ``python3`` on PATH that answers
the interpreter-tag question and records what pip was asked to install.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum")


@pytest.fixture
def tree(tmp_path):
    """A tree holding what the stamp reads, the two scripts, and a stand-in python3."""
    t = tmp_path / "tree"
    for rel in ("tools/device_wheel.sh", "benchmarks/run_h200.sh"):
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, t / rel)
    (t / "cpp" / "src").mkdir(parents=True)
    (t / "cpp" / "src" / "pool.cpp").write_text("int f() { return 1; }\n")
    (t / "src" / "poolkeeper").mkdir(parents=True)
    (t / "src" / "poolkeeper" / "__init__.py").write_text("")
    (t / "CMakeLists.txt").write_text("project(x)\n")
    (t / "pyproject.toml").write_text("[project]\nname='x'\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake = bin_ / "python3"
    # `-c ...` is the tag query (cp312, the device's Python); anything else is a pip call, logged.
    # FAIL_WHEEL=1: installing a wheel fails, as a corrupt one would.
    fake.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo cp312; exit 0; fi\n'
                    'echo "$*" >> "$PIP_LOG"\n'
                    'case "$*" in *.whl*) [ -n "$FAIL_WHEEL" ] && exit 1;; esac\nexit 0\n')
    fake.chmod(0o755)
    return t


def stamp(t: Path) -> str:
    return subprocess.run(["bash", "tools/device_wheel.sh", "--stamp"], cwd=t, check=True,
                          capture_output=True, text=True).stdout.strip()


def build_step(t: Path, tmp_path: Path, **extra: str) -> str:
    log = tmp_path / "pip.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               PIP_LOG=str(log), **extra)
    subprocess.run(["bash", "benchmarks/run_h200.sh", "build"], cwd=t, env=env, check=True,
                   capture_output=True, text=True, timeout=60)
    return log.read_text()


def put_wheel(t: Path, tag: str = "cp312", version: str = "0.1.0") -> Path:
    d = t / ".devwheel"
    d.mkdir(exist_ok=True)
    w = d / f"poolkeeper-{version}-{tag}-{tag}-linux_x86_64.whl"
    w.write_bytes(b"")
    (d / "STAMP").write_text(stamp(t) + "\n")
    return w


def test_stamp_follows_sources_not_build_outputs(tree):
    s0 = stamp(tree)
    assert len(s0) == 16
    (tree / "src" / "poolkeeper" / "_core.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0")
    (tree / "src" / "poolkeeper" / "__pycache__").mkdir()
    (tree / "src" / "poolkeeper" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    assert stamp(tree) == s0
    (tree / "cpp" / "src" / "pool.cpp").write_text("int f() { return 2; }\n")
    assert stamp(tree) != s0


def test_build_installs_the_wheel_of_this_tree(tree, tmp_path):
    wheel = put_wheel(tree)
    log = build_step(tree, tmp_path)
    assert str(wheel.relative_to(tree)) in log and "--no-build-isolation" not in log


def test_build_compiles_when_the_wheel_is_stale(tree, tmp_path):
    put_wheel(tree)
    (tree / "cpp" / "src" / "pool.cpp").write_text("int f() { return 3; }\n")
    log = build_step(tree, tmp_path)
    assert ".whl" not in log and "--no-build-isolation" in log and log.rstrip().endswith(" .")


def test_build_compiles_when_the_wheel_is_for_another_python(tree, tmp_path):
    put_wheel(tree, tag="cp311")
    log = build_step(tree, tmp_path)
    assert ".whl" not in log and "--no-build-isolation" in log


def test_build_compiles_without_a_wheel(tree, tmp_path):
    log = build_step(tree, tmp_path)
    assert "--no-build-isolation" in log


def test_stamp_follows_a_linked_header_to_what_it_points_at(tree):
    ext = tree / "ext"
    ext.mkdir()
    (ext / "h.hpp").write_text("#define A 1\n")
    (tree / "cpp" / "include").mkdir()
    (tree / "cpp" / "include" / "h.hpp").symlink_to(ext / "h.hpp")
    s0 = stamp(tree)
    (ext / "h.hpp").write_text("#define A 2\n")
    assert stamp(tree) != s0


def test_build_compiles_when_two_wheels_could_be_meant(tree, tmp_path):
    put_wheel(tree)
    put_wheel(tree, version="0.0.9")  # a leftover: the stamp cannot say which one it vouches for
    log = build_step(tree, tmp_path)
    assert ".whl" not in log and "--no-build-isolation" in log


def test_build_compiles_when_no_stamp_can_be_taken(tree, tmp_path):
    put_wheel(tree)
    (tree / ".devwheel" / "STAMP").write_text("")
    # Without a working sha256sum both sides would be empty, and empty must not match empty.
    bad = tmp_path / "bin" / "sha256sum"
    bad.write_text("#!/bin/sh\nexit 1\n")
    bad.chmod(0o755)
    log = build_step(tree, tmp_path)
    assert ".whl" not in log and "--no-build-isolation" in log


def test_build_compiles_when_the_wheel_does_not_install(tree, tmp_path):
    wheel = put_wheel(tree)
    log = build_step(tree, tmp_path, FAIL_WHEEL="1").splitlines()
    assert str(wheel.relative_to(tree)) in log[0]
    assert "--no-build-isolation" in log[1] and log[1].endswith(" .")


def test_device_wheel_refuses_sources_that_changed_during_the_build(tree):
    # A stand-in build that edits a source while it "builds": no stamp may vouch for that wheel.
    fake_build = tree / "tools" / "build_wheels.sh"
    fake_build.write_text('#!/bin/sh\nmkdir -p "$WHEEL_DIR"\n'
                          'touch "$WHEEL_DIR/poolkeeper-0.1.0-cp312-cp312-linux_x86_64.whl"\n'
                          'echo "int g();" >> cpp/src/pool.cpp\n')
    fake_build.chmod(0o755)
    r = subprocess.run(["bash", "tools/device_wheel.sh", "python3"], cwd=tree, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "changed during the build" in r.stderr
    assert not (tree / ".devwheel").exists()
    fake_build.write_text('#!/bin/sh\nmkdir -p "$WHEEL_DIR"\n'
                          'touch "$WHEEL_DIR/poolkeeper-0.1.0-cp312-cp312-linux_x86_64.whl"\n')
    r = subprocess.run(["bash", "tools/device_wheel.sh", "python3"], cwd=tree, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and (tree / ".devwheel" / "STAMP").read_text().strip() == stamp(tree)
