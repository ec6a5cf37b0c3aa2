"""The warm-pool policy (docs/cuda.md) against a simulated pool control: runs on any machine.

The control logs every driver call the manager makes ("get d", "set d v", "sync d", "trim d v",
"support d"), so these tests pin down *what* is called, in which order, on which device.
"""
from __future__ import annotations

import threading

import pytest

from poolkeeper.cuda.warm import MAX_THRESHOLD, SimulatedPoolControl, WarmPoolManager
from poolkeeper.errors import InvalidArgumentError

MAX = "max"


def make(devices=1):
    ctl = SimulatedPoolControl(devices)
    return ctl, WarmPoolManager(ctl)


def test_first_handle_raises_to_max_and_remembers_previous():
    ctl, m = make()
    ctl.set_external(0, 12345)
    m.acquire(0)
    assert ctl.threshold(0) == MAX_THRESHOLD
    st = m.state()
    assert st["raised_devices"] == [0]
    assert st["devices"][0]["previous"] == 12345
    assert ctl.calls() == ["support 0", "get 0", "set 0 max"]


def test_more_handles_do_not_touch_the_driver_again():
    ctl, m = make()
    m.acquire(0)
    ctl.clear_calls()
    m.acquire(0)
    m.acquire(0)
    assert ctl.calls() == []
    assert m.state()["total_handles"] == 3


def test_last_release_synchronizes_then_restores_then_trims():
    ctl, m = make()
    ctl.set_external(0, 777)
    m.acquire(0)
    m.acquire(0)
    ctl.clear_calls()
    m.release(0)
    assert ctl.calls() == [], "a handle is still alive: nothing may be restored yet"
    m.release(0)
    assert ctl.calls() == ["sync 0", "get 0", "set 0 777", "trim 0 777"]
    assert ctl.threshold(0) == 777
    st = m.state()
    assert st["raised_devices"] == [] and st["restores"] == 1 and st["trims"] == 1


def test_already_max_is_left_alone_and_never_restored():
    ctl, m = make()
    ctl.set_external(0, MAX_THRESHOLD)  # another user (e.g. PyTorch) chose the maximum
    m.acquire(0)
    assert ctl.calls() == ["support 0", "get 0"]
    m.release(0)
    assert ctl.calls() == ["support 0", "get 0"], "not ours to restore or trim"
    assert ctl.threshold(0) == MAX_THRESHOLD
    assert m.state()["left_alone"] == 1


def test_value_changed_by_someone_else_while_held_is_not_overwritten():
    ctl, m = make()
    m.acquire(0)
    ctl.set_external(0, 5 << 30)  # another user sets their own value while we hold it
    m.release(0)
    assert ctl.threshold(0) == 5 << 30
    assert "set 0 0" not in ctl.calls() and not any(c.startswith("trim") for c in ctl.calls())


def test_release_restores_every_raised_device_from_its_own_record():
    ctl, m = make(devices=3)
    ctl.set_external(1, 100)
    ctl.set_external(2, 200)
    m.acquire(2)
    m.acquire(1)  # device 0 never used: must not be touched
    ctl.clear_calls()
    m.release(2)
    assert ctl.calls() == [], "device 1 still holds a handle"
    m.release(1)
    calls = ctl.calls()
    assert calls == ["sync 1", "get 1", "set 1 100", "trim 1 100", "sync 2", "get 2", "set 2 200", "trim 2 200"]
    assert not any(c.endswith(" 0") or " 0 " in c for c in calls)


def test_release_from_another_thread_restores_the_recorded_device():
    ctl, m = make(devices=2)
    m.acquire(1)
    t = threading.Thread(target=m.release, args=(1,))
    t.start()
    t.join()
    assert ctl.threshold(1) == 0
    assert "trim 1 0" in ctl.calls()


def test_configure_failure_is_logged_and_not_latched():
    ctl, m = make(devices=2)
    ctl.fail_next("set", "CUDA_ERROR_NOT_PERMITTED")
    m.acquire(0)  # must not raise: a failure costs speed only
    st = m.state()
    assert st["configure_failures"] == 1
    assert "CUDA_ERROR_NOT_PERMITTED" in st["last_error"]
    assert st["raised_devices"] == []
    assert ctl.threshold(0) == 0
    # the next, unrelated device configures normally: nothing was left behind
    m.acquire(1)
    assert ctl.threshold(1) == MAX_THRESHOLD
    assert m.state()["configure_failures"] == 1
    m.release(0)
    m.release(1)
    assert ctl.threshold(1) == 0
    assert "set 0 0" not in ctl.calls(), "device 0 was never raised, so it is never restored"


def test_failed_device_is_configured_again_after_all_handles_went():
    ctl, m = make()
    ctl.fail_next("get", "CUDA_ERROR_UNKNOWN")
    m.acquire(0)
    m.release(0)
    m.acquire(0)
    assert ctl.threshold(0) == MAX_THRESHOLD


def test_release_failure_is_logged_and_counted():
    ctl, m = make()
    m.acquire(0)
    ctl.fail_next("sync", "CUDA_ERROR_ILLEGAL_ADDRESS")
    m.release(0)
    st = m.state()
    assert st["release_failures"] == 1
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in st["last_error"]
    assert st["raised_devices"] == []


def test_unsupported_device_is_a_no_op_that_says_so():
    ctl, m = make()
    ctl.set_unsupported(0, "driver has no stream-ordered allocator")
    m.acquire(0)
    st = m.state()
    assert st["devices"][0]["unsupported"] == "driver has no stream-ordered allocator"
    assert any("no-op" in line for line in st["messages"])
    m.release(0)
    assert ctl.calls() == ["support 0"]
    assert st["configure_failures"] == 0


def test_release_without_acquire_is_a_typed_error_and_changes_nothing():
    ctl, m = make()
    with pytest.raises(InvalidArgumentError):
        m.release(0)
    m.acquire(0)
    m.release(0)
    with pytest.raises(InvalidArgumentError):
        m.release(0)
    assert m.state()["total_handles"] == 0


def test_concurrent_acquire_release_keeps_counts_consistent():
    ctl, m = make(devices=2)

    def worker(dev):
        for _ in range(200):
            m.acquire(dev)
            m.release(dev)

    ts = [threading.Thread(target=worker, args=(i % 2,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    st = m.state()
    assert st["total_handles"] == 0
    assert st["raised_devices"] == []
    assert ctl.threshold(0) == 0 and ctl.threshold(1) == 0
    assert st["raises"] == st["restores"]
