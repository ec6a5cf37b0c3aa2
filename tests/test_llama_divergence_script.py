"""benchmarks/llama_divergence.py: its pure parts (where two runs part, the layout digest of a
pool's log) without torch."""
from __future__ import annotations

import gzip

from benchmark_scripts import load_script, loading_imports_torch

ld = load_script("llama_divergence.py")


def _run(tokens, modules, last_tokens=None, margins=None):
    return {"tokens": tokens, "modules": modules, "last_tokens": last_tokens, "margins": margins or []}


def test_script_imports_without_torch():
    assert not loading_imports_torch("llama_divergence.py")


def test_compare_names_the_first_module_whose_bits_differ_and_the_addresses_there():
    base = _run(["a", "b"], [[0, "m.in (input)", 1, 0], [0, "m.in", 2, 0], [1, "m.out (input)", 3, 0], [1, "m.out", 4, 512]])
    run = _run(["a", "b"], [[0, "m.in (input)", 1, 0], [0, "m.in", 2, 0], [1, "m.out (input)", 3, 256], [1, "m.out", 5, 768]])
    c = ld.compare(base, run)
    assert c["requests_differ"] == []
    # The input's bits are the same (its address is not what is compared): the output is first.
    assert c["first_module_differs"] == {"step": 1, "module": "m.out", "addr_mod_4k": [512, 768]}


def test_compare_finds_an_input_that_differs_before_its_module_output():
    base = _run(["a"], [[3, "attn.o_proj (input)", 7, 0], [3, "attn.o_proj", 8, 0]])
    run = _run(["a"], [[3, "attn.o_proj (input)", 9, 0], [3, "attn.o_proj", 10, 0]])
    assert ld.compare(base, run)["first_module_differs"]["module"] == "attn.o_proj (input)"


def test_compare_reports_the_margin_of_the_first_token_that_differs():
    # Two rows, 3 steps; row 1 parts at step 2, where the base's margin was one bf16 step and the
    # run's an exact tie.
    base = _run(["x", "y"], [], last_tokens=[[1, 2, 3], [4, 5, 6]], margins=[[0.5, 0.5], [0.25, 0.2], [0.1, 0.03125]])
    run = _run(["x", "z"], [], last_tokens=[[1, 2, 3], [4, 5, 7]], margins=[[0.5, 0.5], [0.25, 0.2], [0.1, 0.0]])
    c = ld.compare(base, run)
    assert c["requests_differ"] == [1]
    assert c["first_token_differs"] == {"row": 1, "step": 2, "margin_base": 0.03125, "margin_run": 0.0}
    assert c["rows_differ"] == [1]
    assert "first_module_differs" not in c


def test_compare_takes_the_earliest_flip_over_every_row_not_the_lowest_row():
    # Row 0 parts at step 3, row 1 at step 1 (a tie there): the flip that matters is row 1's.
    margins = [[0.5, 0.5], [0.5, 0.0], [0.5, 0.5], [0.5, 0.5]]
    base = _run(["x"], [], last_tokens=[[1, 2, 3, 4], [5, 6, 7, 8]], margins=margins)
    run = _run(["y"], [], last_tokens=[[1, 2, 3, 9], [5, 0, 7, 8]], margins=margins)
    c = ld.compare(base, run)
    assert c["first_token_differs"] == {"row": 1, "step": 1, "margin_base": 0.0, "margin_run": 0.0}
    assert c["rows_differ"] == [0, 1]


def test_compare_says_when_one_run_recorded_more_modules():
    base = _run(["a"], [[0, "m", 1, 0]])
    run = _run(["a"], [[0, "m", 1, 0], [1, "m", 2, 0]])
    assert ld.compare(base, run)["module_records"] == [1, 2]


def test_compare_says_when_the_runs_called_other_modules():
    base = _run(["a"], [[0, "m1", 1, 0]])
    run = _run(["a"], [[0, "m2", 1, 0]])
    assert ld.compare(base, run)["module_order_differs"] == [[0, "m1"], [0, "m2"]]


def test_layout_digest_is_the_calls_in_order_with_addresses_relative_to_the_log(tmp_path):
    def log(name, rows, gz=False):
        p = tmp_path / name
        text = "Thread,Time,Action,Pointer,Size,Stream\n" + "".join(",".join(r) + "\n" for r in rows)
        if gz:
            with gzip.open(p, "wt") as f:
                f.write(text)
        else:
            p.write_text(text)
        return str(p)

    def calls(base, second=0x100, t="10:00:00.1", thread="1"):
        return [(thread, t, "allocate", hex(base), "256", "0"), (thread, t, "allocate", hex(base + second), "512", "0"),
                (thread, t, "free", hex(base), "256", "0")]

    a = log("a.csv", calls(0x7F0000))
    b = log("b.csv.gz", calls(0x9A0000, t="11:11:11.9", thread="9"), gz=True)  # another base, time, thread
    c = log("c.csv", calls(0x7F0000, second=0x200))  # the second block elsewhere
    d = log("d.csv", list(reversed(calls(0x7F0000))))  # the calls in another order
    assert ld.layout_digest(a) == ld.layout_digest(b)
    assert ld.layout_digest(a) != ld.layout_digest(c)
    assert ld.layout_digest(a) != ld.layout_digest(d)
    assert ld.layout_digest(str(tmp_path / "missing.csv")) is None
