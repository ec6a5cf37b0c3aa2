"""The warm default pool (docs/cuda.md) on a real GPU: CUDA's default stream-ordered pool kept warm by poolkeeper's manager.

Every test reads the pool's reserved memory (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) after
allocate, free, synchronize, so none can pass without the threshold change: with the default
threshold of 0 the synchronize hands the block back (test_cold_pool_gives_memory_back shows the
contrast on the same device).
"""
from __future__ import annotations

import threading

import pytest

import poolkeeper as pk
from poolkeeper.cuda import driver, warm

pytestmark = pytest.mark.gpu

MiB = 1 << 20
MAX = warm.MAX_THRESHOLD


def _reset(device: int) -> None:
    warm.set_release_threshold(device, 0)
    driver.device_synchronize(device)
    warm.trim_to(device, 0)


@pytest.fixture(autouse=True)
def clean_default_pool():
    assert warm.state().total_handles == 0, "a CudaAsync from another test is still alive"
    for d in range(pk.cuda.device_count()):
        _reset(d)
    yield
    for d in range(pk.cuda.device_count()):
        _reset(d)


def cycle(up, nbytes: int) -> None:
    """allocate, free, synchronize: the seed's per-allocation pattern."""
    p = up.allocate(nbytes)
    up.deallocate(p, nbytes)
    up.synchronize()


def test_cold_pool_gives_memory_back():
    base = warm.reserved_bytes(0)
    cold = pk.upstream.CudaAsync(0, warm=False)
    assert warm.release_threshold(0) == 0
    cycle(cold, 64 * MiB)
    assert warm.reserved_bytes(0) <= base, "with threshold 0 a synchronize releases the freed block"
    assert warm.state().total_handles == 0


def test_warm_pool_retains_the_block_while_held():
    base = warm.reserved_bytes(0)
    up = pk.upstream.CudaAsync(0)
    assert warm.release_threshold(0) == MAX
    assert warm.state().raised_devices == [0]
    cycle(up, 64 * MiB)
    assert warm.reserved_bytes(0) >= base + 64 * MiB, "the pool handed the block back despite the raised threshold"
    # a second cycle is served from what the pool holds: reserved does not grow
    held = warm.reserved_bytes(0)
    cycle(up, 64 * MiB)
    assert warm.reserved_bytes(0) == held
    del up
    assert warm.reserved_bytes(0) <= base, "the last handle's release trims the pool"


def test_release_restores_the_exact_previous_threshold():
    previous = 3 * MiB + 17  # an odd value someone chose, below the maximum
    warm.set_release_threshold(0, previous)
    up = pk.upstream.CudaAsync(0)
    assert warm.release_threshold(0) == MAX
    assert warm.state().devices[0]["previous"] == previous
    cycle(up, 64 * MiB)
    assert warm.reserved_bytes(0) >= 64 * MiB
    del up
    assert warm.release_threshold(0) == previous
    st = warm.state()
    assert st.raised_devices == [] and st.last_error is None


def test_release_with_a_live_allocation_lowers_reserved_but_keeps_the_live_block():
    holder = pk.upstream.CudaAsync(0, warm=False)  # holds the live block; takes no warm handle
    # The live block first, so the 256 MiB cycle needs memory of its own (a live block inside
    # the cycled one would pin it).
    live = holder.allocate(32 * MiB)
    up = pk.upstream.CudaAsync(0)
    cycle(up, 256 * MiB)
    before = warm.reserved_bytes(0)
    assert before >= 256 * MiB
    del up  # last handle: synchronize, restore 0, trim
    after = warm.reserved_bytes(0)
    assert warm.release_threshold(0) == 0
    assert after < before, "release did not lower reserved memory"
    assert after >= 32 * MiB, "reserved fell below the block still in use"
    assert warm.used_bytes(0) >= 32 * MiB
    holder.deallocate(live, 32 * MiB)
    holder.synchronize()


def test_another_users_higher_threshold_is_restored_not_lowered():
    mine = 1 << 30  # another user keeps up to 1 GiB
    warm.set_release_threshold(0, mine)
    up = pk.upstream.CudaAsync(0)
    cycle(up, 256 * MiB)
    del up
    assert warm.release_threshold(0) == mine
    # trimmed to their threshold, not to 0: the 256 MiB they allowed the pool to keep stays
    assert warm.reserved_bytes(0) >= 256 * MiB


def test_another_users_max_threshold_is_left_alone():
    warm.set_release_threshold(0, MAX)
    left_before = warm.state().left_alone
    up = pk.upstream.CudaAsync(0)
    assert warm.state().raised_devices == [], "already max: not ours to restore"
    cycle(up, 64 * MiB)
    del up
    assert warm.release_threshold(0) == MAX
    assert warm.reserved_bytes(0) >= 64 * MiB, "someone else's warm pool was trimmed"
    assert warm.state().left_alone == left_before + 1


def test_threshold_changed_by_someone_else_while_held_is_kept():
    up = pk.upstream.CudaAsync(0)
    warm.set_release_threshold(0, 5 * MiB)
    del up
    assert warm.release_threshold(0) == 5 * MiB


@pytest.mark.skipif(pk.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
def test_release_trims_both_devices_from_a_thread_current_on_the_other():
    ups = [pk.upstream.CudaAsync(0), pk.upstream.CudaAsync(1)]
    for i in range(2):  # (no loop variable may keep a handle alive)
        cycle(ups[i], 64 * MiB)
    assert warm.reserved_bytes(0) >= 64 * MiB and warm.reserved_bytes(1) >= 64 * MiB

    def teardown():
        driver.set_device(1)
        ups.pop(1)  # device 1's handle
        driver.set_device(0)
        ups.pop(0)  # the last handle, released while device 0 is current

    t = threading.Thread(target=teardown)
    t.start()
    t.join()
    assert warm.release_threshold(0) == 0 and warm.release_threshold(1) == 0
    assert warm.reserved_bytes(0) < 64 * MiB and warm.reserved_bytes(1) < 64 * MiB


@pytest.mark.skipif(pk.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
def test_release_on_a_thread_current_on_device_1_trims_device_0():
    ups = [pk.upstream.CudaAsync(0)]
    cycle(ups[0], 64 * MiB)

    def teardown():
        driver.set_device(1)
        ups.clear()

    t = threading.Thread(target=teardown)
    t.start()
    t.join()
    assert warm.release_threshold(0) == 0
    assert warm.reserved_bytes(0) < 64 * MiB
    assert warm.release_threshold(1) == 0  # never raised, never touched
