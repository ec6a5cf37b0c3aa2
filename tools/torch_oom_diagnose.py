"""Which build of the torch.OutOfMemoryError shim survives an out-of-memory inside PyTorch, and why
the others do not (docs/integrations.md, "Out of memory inside PyTorch").

    PYTHONPATH=... python tools/torch_oom_diagnose.py [--variants NAME,...] [--timeout 240] [--fill]

Each variant runs in its own process (a crash there ends only that process): it builds the shim
one way (the flags install() uses by hand, torch.utils.cpp_extension's flags, or
torch.utils.cpp_extension.load_inline itself) and with one kind of exception (c10::OutOfMemoryError
without a captured backtrace -- install()'s default --, the same through TORCH_CHECK_WITH, which
captures one, c10::Error, std::runtime_error), installs it as PyTorch's allocator over an arena with
a 64 MiB limit, overflows the limit, and allocates again. ``--fill`` also fills the whole device
with the default variant (what the GPU test does). Per variant it prints: whether the process was
killed by a signal, which Python exception came out and its message, the compile command, and on a
crash the Python stack (faulthandler) and the C stack (a small signal handler built here).

Needs a CUDA device, torch with its C++ headers and a C++ compiler. ``--self-test`` checks the
harness itself without torch or a GPU: one child exits cleanly, one segfaults.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, List, Optional, Tuple

# name -> (build, throw, extra environment). build: "hand" | "torch" (cpp_extension's flags, by
# hand) | "load_inline" (torch.utils.cpp_extension.load_inline). throw: PK_SHIM_THROW (see
# poolkeeper/integrations/_torch_oom_shim.py SOURCE).
VARIANTS: Dict[str, Tuple[str, int, Dict[str, str]]] = {
    "hand/oom_no_backtrace": ("hand", 0, {}),  # install()'s default
    "hand/oom_torch_check": ("hand", 1, {}),  # the build that crashed on the H200 (torch 2.11)
    "hand/c10_error": ("hand", 2, {}),
    "hand/runtime_error": ("hand", 3, {}),
    "hand/oom_no_backtrace+cpp_stacktraces": ("hand", 0, {"TORCH_SHOW_CPP_STACKTRACES": "1"}),
    "hand/oom_torch_check+cpp_stacktraces": ("hand", 1, {"TORCH_SHOW_CPP_STACKTRACES": "1"}),
    "torch_flags/oom_torch_check": ("torch", 1, {}),
    "torch_flags/oom_no_backtrace": ("torch", 0, {}),
    "load_inline/oom_torch_check": ("load_inline", 1, {}),
    "load_inline/oom_no_backtrace": ("load_inline", 0, {}),
}

SEGV_TRACE = r"""
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static char g_stack[1 << 16];
static void on_signal(int sig, siginfo_t* si, void*) {
  char buf[160];
  int n = snprintf(buf, sizeof buf, "\n[c-stack] signal %d (%s) at address %p; C stack, innermost first:\n", sig,
                   strsignal(sig), si ? si->si_addr : nullptr);
  if (n > 0) write(2, buf, (size_t)n);
  void* frames[96];
  int k = backtrace(frames, 96);
  backtrace_symbols_fd(frames, k, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
extern "C" void pk_install_c_stack_trace() {
  void* warm[4];
  backtrace(warm, 4);  // loads the unwinder now, not inside the handler
  stack_t ss;
  ss.ss_sp = g_stack;
  ss.ss_size = sizeof g_stack;
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
  for (int s : sigs) sigaction(s, &sa, nullptr);
}
"""

# The child: C stack handler first, then faulthandler (which dumps the Python stack and hands the
# signal on to the C handler).
CHILD_PRELUDE = """
import ctypes, faulthandler, os, sys
if os.environ.get("PK_DIAG_TRACE_LIB"):
    ctypes.CDLL(os.environ["PK_DIAG_TRACE_LIB"]).pk_install_c_stack_trace()
faulthandler.enable(all_threads=True)
def say(*a):
    print(*a, flush=True)
"""

CHILD_BODY = """
import json, subprocess
build, throw = os.environ["PK_DIAG_BUILD"], int(os.environ["PK_DIAG_THROW"])
import torch
from poolkeeper.integrations import _torch_oom_shim as shim
from poolkeeper.integrations import torch as pkt
say("torch", torch.__version__, "cuda", torch.version.cuda, "compiler", shim._compiler())
if build == "load_inline":
    from torch.utils import cpp_extension
    d = os.environ["PK_DIAG_DIR"]
    name = "pk_oom_shim_v%d" % throw
    cpp_extension.load_inline(name=name, cpp_sources=[shim.SOURCE], extra_cflags=["-DPK_SHIM_THROW=%d" % throw],
                              build_directory=d, is_python_module=False, verbose=True)
    path = os.path.join(d, name + ".so")
    say("compile: torch.utils.cpp_extension.load_inline ->", path)
    b = shim.ShimBuild(path, "load_inline")
else:
    b = shim.build(torch, throw=throw, flags=build, force=True)
    say("compile:", " ".join(shim.compile_command(torch, "shim.cpp", "shim.so", throw, build)))
if b.path is None:
    say("BUILD FAILED:", b.reason)
    sys.exit(3)
say("library:", b.path, "(" + b.reason + ")")
try:
    say(subprocess.run(["ldd", b.path], capture_output=True, text=True).stdout.strip())
except OSError:
    pass
shim.build = lambda torch, *a, **k: shim.ShimBuild(b.path, "diagnostic variant")  # install() takes this one
inst = pkt.install("arena", limit=64 << 20)
say("installed:", inst.oom_type, "|", inst.oom_note)
lib = ctypes.CDLL(b.path)
code, msg = shim.probe(lib, 1 << 30, 0)  # C++ catches the throw in this process: no PyTorch frame involved
say("probe (thrown and caught in C++):", code, msg[:160])
x = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
say("overflowing the limit inside PyTorch ...")
try:
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    say("RESULT no exception")
except BaseException as e:
    say("RESULT exception", type(e).__module__ + "." + type(e).__qualname__,
        "| torch.OutOfMemoryError:", isinstance(e, torch.OutOfMemoryError), "| message:", str(e)[:300])
y = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
say("after: allocation works:", int(x.sum()) + int(y.sum()) == 2 << 20)
if os.environ.get("PK_DIAG_FILL") == "1":
    held, GiB = [], 1 << 30
    try:
        while len(held) < 4096:
            held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    except BaseException as e:
        say("FILL exception after", len(held), "GiB:", type(e).__qualname__, "|", str(e)[:300])
    del held[: len(held) // 2]
    z = [torch.ones(GiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    say("FILL recovered:", sum(int(t[:1024].sum()) for t in z) == 2048)
say("CHILD DONE")
"""

SELF_TEST_BODIES = {
    "self/clean": "say('RESULT exception builtins.ValueError | torch.OutOfMemoryError: False | message: x')\nsay('CHILD DONE')\n",
    "self/segfault": "say('about to crash')\nctypes.string_at(0)\n",
}


def build_trace_lib(out_dir: str) -> Optional[str]:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        return None
    src = os.path.join(out_dir, "c_stack.cpp")
    lib = os.path.join(out_dir, "c_stack.so")
    with open(src, "w") as f:
        f.write(SEGV_TRACE)
    r = subprocess.run([cxx, "-O1", "-g", "-shared", "-fPIC", src, "-o", lib], capture_output=True, text=True)
    return lib if r.returncode == 0 else None


def run_variant(name: str, body: str, env_extra: Dict[str, str], timeout: float, trace_lib: Optional[str],
                work: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["POOLKEEPER_CACHE_DIR"] = os.path.join(work, "cache")
    d = os.path.join(work, name.replace("/", "_").replace("+", "_"))
    os.makedirs(d, exist_ok=True)
    env["PK_DIAG_DIR"] = d
    if trace_lib:
        env["PK_DIAG_TRACE_LIB"] = trace_lib
    try:
        r = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + body], capture_output=True, text=True,
                           timeout=timeout, env=env)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    if rc is None:
        outcome = f"TIMEOUT after {timeout:.0f} s"
    elif rc < 0:
        import signal

        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        outcome = f"CRASHED: killed by {sig}"
    elif rc == 0:
        outcome = "exit 0"
    else:
        outcome = f"exit {rc}"
    result = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), "RESULT (none: see output)")
    return {"name": name, "outcome": outcome, "result": result[len("RESULT "):], "stdout": out, "stderr": err}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (default: all)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    ap.add_argument("--fill", action="store_true", help="also fill the device with install()'s default variant")
    ap.add_argument("--self-test", action="store_true", help="check the harness (no torch or GPU needed)")
    ap.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    args = ap.parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="pk-oom-diag-")
    os.makedirs(work, exist_ok=True)
    trace_lib = build_trace_lib(work)
    print(f"work dir {work}; C stack handler: {trace_lib or 'not built (no compiler)'}", flush=True)
    jobs = []
    if args.self_test:
        jobs = [(n, b, {}) for n, b in SELF_TEST_BODIES.items()]
    else:
        for n in [v for v in args.variants.split(",") if v]:
            if n not in VARIANTS:
                ap.error(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
            build, throw, env = VARIANTS[n]
            env = {**env, "PK_DIAG_BUILD": build, "PK_DIAG_THROW": str(throw)}
            if args.fill and n == "hand/oom_no_backtrace":
                env["PK_DIAG_FILL"] = "1"
            jobs.append((n, CHILD_BODY, env))
    results = []
    for n, body, env in jobs:
        print(f"\n===== {n} =====", flush=True)
        r = run_variant(n, body, env, args.timeout, trace_lib, work)
        results.append(r)
        print(r["stdout"].rstrip())
        err = r["stderr"].rstrip()
        if err:
            lines = err.splitlines()
            print("--- stderr (last 80 lines) ---")
            print("\n".join(lines[-80:]))
        print(f"--> {r['outcome']}; {r['result']}", flush=True)
    print("\n===== summary =====")
    w = max(len(r["name"]) for r in results) if results else 10
    for r in results:
        print(f"{r['name']:<{w}}  {r['outcome']:<28}  {r['result'][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
