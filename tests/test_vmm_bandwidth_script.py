"""benchmarks/vmm_bandwidth.py runs only on a GPU with torch; here: loading it imports neither torch
nor the device, and the raw ranges it hands torch describe exactly the bytes asked for."""
from __future__ import annotations

import subprocess
import sys

from benchmark_scripts import load_script, loading_imports_torch, script_path


def test_loading_vmm_bandwidth_imports_no_torch_and_help_runs():
    assert not loading_imports_torch("vmm_bandwidth.py")
    r = subprocess.run([sys.executable, script_path("vmm_bandwidth.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--pieces" in r.stdout


def test_a_raw_range_is_a_float16_array_over_exactly_its_bytes():
    raw = load_script("vmm_bandwidth.py")._Raw(0x7F0000000000, 8 << 20)
    cai = raw.__cuda_array_interface__
    assert cai["shape"] == (4 << 20,) and cai["typestr"] == "<f2" and cai["data"] == (0x7F0000000000, False)
    assert cai["version"] == 3 and cai["strides"] is None
