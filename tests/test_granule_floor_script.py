"""benchmarks/granule_floor.py: the ideal whole-granule allocator's peak, on a trace small enough to
add up by hand, and the script's table over the committed traces."""
from __future__ import annotations

from benchmark_scripts import load_script, loading_imports_torch

gf = load_script("granule_floor.py")
MiB = 1 << 20


def test_script_imports_without_torch():
    assert not loading_imports_torch("granule_floor.py")


def test_large_blocks_take_whole_granules_and_small_ones_pack_into_the_fewest():
    pre = [(0x100, 3 * MiB)]  # 2 granules
    events = [
        (True, 0x200, 1 * MiB, 0),      # small: 1 granule for the small bytes
        (True, 0x300, 3 * MiB // 2, 0),  # small: 2.5 MiB of small bytes -> 2 granules
        (True, 0x400, 2 * MiB, 0),      # exactly one granule
        (False, 0x200, 0, 0),           # small bytes 1.5 MiB -> 1 granule
        (False, 0x999, 0, 0),           # not live: skipped, as the replays skip it
        (True, 0x500, 5 * MiB, 0),      # 3 granules
    ]
    peak_live, peak = gf.whole_granule_peak(events, pre)
    assert peak_live == 3 * MiB + 3 * MiB // 2 + 2 * MiB + 5 * MiB
    # At the end: large 4 + 2 + 6 MiB, small 1.5 MiB -> 2 MiB.
    assert peak == 14 * MiB


def test_the_peak_is_the_highest_moment_not_the_end():
    events = [(True, 1, 7 * MiB, 0), (False, 1, 0, 0), (True, 2, MiB, 0)]
    assert gf.whole_granule_peak(events) == (7 * MiB, 8 * MiB)


def test_a_second_allocation_at_a_live_address_replaces_the_first():
    events = [(True, 1, 4 * MiB, 0), (True, 1, 2 * MiB, 0)]
    assert gf.whole_granule_peak(events) == (4 * MiB, 4 * MiB)


def test_shared_granules_stitch_a_block_from_one_granules_free_end_and_anothers_free_start():
    G = 2 * MiB
    events = [
        (True, 1, 3 * MiB, 0),   # granules A (full) and B [0, 1 MiB)
        (True, 2, 3 * MiB, 0),   # B [1, 2) head: and C (full): A B C
        (True, 3, 3 * MiB, 0),   # D (full), E [0, 1)
        (False, 1, 0, 0),        # A goes (unmapped at once); B's free start [0, 1) is a tail
        (True, 4, 1 * MiB + 1, 0),  # no gap holds it: E's free end [1, 2) + 256 B of B's free start
    ]
    # Peak: 5 granules after event 3; then 4: the last block took no fresh granule, so a 4 MiB block
    # after it (nothing free to share) makes 6, not 7.
    assert gf.shared_granule_peak(events) == 5 * G
    assert gf.shared_granule_peak(events + [(True, 5, 4 * MiB, 0)]) == 6 * G
    # Without a head and a tail to share, whole granules: 3 MiB blocks take 2 each.
    assert gf.shared_granule_peak([(True, 1, 3 * MiB, 0), (True, 2, 3 * MiB, 0)]) == 3 * G


def test_shared_granules_put_a_small_block_in_the_smallest_gap_that_holds_it():
    G = 2 * MiB
    events = [
        (True, 1, MiB, 0), (True, 2, MiB // 2, 0), (True, 3, MiB // 4, 0),  # one granule: 1.75 MiB
        (False, 2, 0, 0),                     # a 0.5 MiB gap in the middle, 0.25 MiB at the end
        (True, 4, MiB // 4, 0),               # the end gap (smaller), not the middle one
        (True, 5, MiB // 2, 0),               # the middle gap
    ]
    assert gf.shared_granule_peak(events) == G
    assert gf.shared_granule_peak(events + [(True, 6, 256, 0)]) == 2 * G  # full now: a fresh granule


def test_the_table_covers_every_committed_trace_and_no_floor_is_below_peak_live(capsys):
    assert gf.main() == 0
    out = capsys.readouterr().out.splitlines()
    body = [line.split() for line in out[3:]]
    assert [r[0] for r in body] == ["bert_serve", "gpt2_generate", "llama", "live_bert", "live_llama"]
    for r in body:
        live, floor, shared, default = float(r[1]), float(r[2]), float(r[4]), float(r[6])
        assert floor >= live and shared >= live and default >= live


def test_shared_granules_a_zero_byte_block_holds_no_granule():
    # Found by review: it sat as an empty interval and kept its granule counted after every byte
    # around it was freed (4 MiB here, above the whole-granule floor of the same trace).
    events = [(True, 1, MiB, 0), (True, 2, 0, 0), (False, 1, 0, 0), (True, 3, 2 * MiB, 0), (False, 2, 0, 0)]
    assert gf.shared_granule_peak(events) == 2 * MiB == gf.whole_granule_peak(events)[1]
