"""The queue lab model: the two scenarios of docs/report_and_lab.md, controls mid-run, and refused input."""
from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

from poolkeeper.lab import RATE_PATTERN, RESET_BACKLOG, STEP_SECONDS, QueueLab, check_rate, parse_rate


def test_seed_drains_to_zero_at_one_second():
    lab = QueueLab()
    lab.reset()
    lab.arrival_rate = 0
    lab.service_rate = 4
    lab.step()
    assert (lab.elapsed, lab.backlog) == (0.5, 2.0)
    lab.step()
    assert (lab.elapsed, lab.backlog) == (1.0, 0.0)


def test_seed_fresh_reset_leaves_two_units():
    lab = QueueLab()
    # Leave the lab dirty first, so the Reset has something to undo.
    lab.arrival_rate, lab.service_rate = 0, 4
    lab.step()
    lab.step()
    lab.step()
    lab.reset()
    assert (lab.elapsed, lab.backlog) == (0.0, RESET_BACKLOG)
    lab.arrival_rate, lab.service_rate = 2, 4
    lab.step()
    lab.step()
    assert (lab.elapsed, lab.backlog) == (1.0, 2.0)


def test_reset_keeps_rates_and_restarts_history():
    lab = QueueLab(arrival_rate=3, service_rate=1)
    lab.step()
    lab.reset()
    assert (lab.arrival_rate, lab.service_rate) == (3.0, 1.0)
    assert lab.history == [(0.0, 4.0)]


def test_changing_a_control_mid_run_keeps_elapsed_and_backlog():
    lab = QueueLab(arrival_rate=3, service_rate=1)
    lab.step()
    lab.step()
    assert (lab.elapsed, lab.backlog) == (1.0, 6.0)
    lab.arrival_rate = 0
    assert (lab.elapsed, lab.backlog) == (1.0, 6.0)
    lab.service_rate = 8
    assert (lab.elapsed, lab.backlog) == (1.0, 6.0)
    lab.step()
    # The new rates apply from the next step on; elapsed carries on from 1.0 s.
    assert (lab.elapsed, lab.backlog) == (1.5, 2.0)
    assert lab.history == [(0.0, 4.0), (0.5, 5.0), (1.0, 6.0), (1.5, 2.0)]


def test_backlog_never_goes_negative():
    lab = QueueLab(arrival_rate=0, service_rate=100)
    lab.step()
    assert lab.backlog == 0.0
    lab.step()
    assert lab.backlog == 0.0 and lab.elapsed == 1.0


def test_balanced_rates_hold_the_backlog():
    lab = QueueLab(arrival_rate=2.5, service_rate=2.5)
    for _ in range(10):
        lab.step()
    assert (lab.elapsed, lab.backlog) == (5.0, 4.0)


def test_update_rule_against_exact_arithmetic():
    # Seeded: rates that are exact in binary, so float arithmetic must equal the exact rule.
    import random

    rng = random.Random(8)
    lab = QueueLab()
    exact_backlog, exact_elapsed = Fraction(4), Fraction(0)
    for _ in range(200):
        if rng.random() < 0.3:
            lab.arrival_rate = rng.randrange(0, 17) / 4
        if rng.random() < 0.3:
            lab.service_rate = rng.randrange(0, 17) / 4
        if rng.random() < 0.05:
            lab.reset()
            exact_backlog, exact_elapsed = Fraction(4), Fraction(0)
            continue
        lab.step()
        delta = (Fraction(lab.arrival_rate) - Fraction(lab.service_rate)) * Fraction(STEP_SECONDS)
        exact_backlog = max(Fraction(0), exact_backlog + delta)
        exact_elapsed += Fraction(STEP_SECONDS)
        assert Fraction(lab.backlog) == exact_backlog
        assert Fraction(lab.elapsed) == exact_elapsed


@pytest.mark.parametrize(
    "bad",
    [-1, -0.5, -1e-300, math.nan, math.inf, -math.inf, True, False, "2", "abc", None, [1], 1j],
    ids=repr,
)
@pytest.mark.parametrize("which", ["arrival_rate", "service_rate"])
def test_invalid_rate_is_refused_and_state_kept(which, bad):
    lab = QueueLab(arrival_rate=3, service_rate=1)
    lab.step()
    before = (lab.arrival_rate, lab.service_rate, lab.elapsed, lab.backlog, list(lab.history))
    with pytest.raises(ValueError, match=which):
        setattr(lab, which, bad)
    assert (lab.arrival_rate, lab.service_rate, lab.elapsed, lab.backlog, lab.history) == before


@pytest.mark.parametrize("bad", [-2, math.nan, "x", True])
def test_invalid_rate_in_constructor(bad):
    with pytest.raises(ValueError):
        QueueLab(arrival_rate=bad)
    with pytest.raises(ValueError):
        QueueLab(service_rate=bad)


def test_rates_accept_ints_floats_and_other_reals():
    assert check_rate(0) == 0.0 and isinstance(check_rate(0), float)
    assert check_rate(Fraction(1, 4)) == 0.25
    assert math.copysign(1.0, check_rate(-0.0)) == 1.0


@pytest.mark.parametrize(
    "text, value",
    [("0", 0.0), ("4", 4.0), (" 2.5 ", 2.5), (".5", 0.5), ("3.", 3.0), ("1e1", 10.0), ("+2", 2.0), ("-0", 0.0)],
)
def test_parse_rate_accepts_plain_decimals(text, value):
    assert parse_rate(text) == value


@pytest.mark.parametrize("text", ["", "  ", "abc", "-1", "-0.1", "1,5", "0x10", "nan", "NaN", "inf", "Infinity", "1e999", "1 2", "2a"])
def test_parse_rate_refuses_what_the_page_refuses(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_rate_pattern_is_portable_to_javascript():
    # The page compiles RATE_PATTERN with `new RegExp`; keep it to syntax both engines read alike.
    # No lookbehind, named groups, \d (Unicode digits in Python) or inline flags.
    assert re.fullmatch(r"[\^$\[\]0-9+\-.\\?:()|*eE]+", RATE_PATTERN)


@pytest.mark.parametrize("set_rate", [
    lambda v: check_rate(v),
    lambda v: QueueLab(arrival_rate=v),
    lambda v: setattr(QueueLab(), "service_rate", v),
], ids=["check_rate", "constructor", "setter"])
@pytest.mark.parametrize("value", [10**400, -10**400, Fraction(10**400, 3)])
def test_regression_a_huge_int_rate_raised_overflow_error(set_rate, value):
    # Found by hostile probing: check_rate called float() unguarded, so an int beyond float range
    # raised OverflowError, not the ValueError the docstring promises (a caller's
    # `except ValueError` missed it).
    with pytest.raises(ValueError, match="finite"):
        set_rate(value)
