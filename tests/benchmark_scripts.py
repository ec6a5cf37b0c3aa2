"""The benchmarks/ scripts as modules for their tests: loading one by file name, and asking a fresh
interpreter whether loading it imports torch (a script's parent process must stay torch-free:
torch is imported only in the processes it starts)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_path(name: str) -> str:
    return os.path.join(ROOT, "benchmarks", name)


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.replace(".py", "") + "_script", script_path(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loading_imports_torch(name: str) -> bool:
    code = f"import importlib.util,sys; s=importlib.util.spec_from_file_location('m', {script_path(name)!r}); " \
           "m=importlib.util.module_from_spec(s); s.loader.exec_module(m); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"
