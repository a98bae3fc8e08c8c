"""Simulated devices live in one process hand out disjoint addresses, as CUDA's unified
addressing gives every device its own (issue 25, item 10)."""
import gc
import os
import subprocess
import sys

import pytest

from pyalloc import CachingAllocator, NotAllocatedError, SimDevice

from units import MiB
BASE = 0x7F0000000000               # the first live SimDevice's segments start here
RESERVATIONS = 0x200000000000       # and its expandable segments' reservations here


def collect():
    gc.collect()                    # devices of earlier tests may wait in reference cycles


def test_the_first_live_device_keeps_the_default_addresses():
    # In a fresh interpreter: here devices of failed tests may live on in stored tracebacks.
    code = ("from pyalloc import SimDevice; s = SimDevice(); "
            "print(s.base_address, s.reservation_base)")
    # cwd: the tests folder, so that a checkout's unbuilt pyalloc/ never shadows the installed one.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert tuple(int(x) for x in out.stdout.split()) == (BASE, RESERVATIONS)


def test_a_second_live_device_gets_other_addresses():
    collect()
    first, second = SimDevice(), SimDevice()
    assert second.base_address != first.base_address
    assert second.reservation_base != first.reservation_base


def test_a_device_gives_its_range_back_when_it_dies():
    collect()
    first = SimDevice()
    base = first.base_address
    del first
    collect()
    assert SimDevice().base_address == base


def test_an_explicit_base_address_is_kept():
    collect()
    a = SimDevice()
    b = SimDevice(base_address=a.base_address)
    assert b.base_address == a.base_address


def test_two_devices_for_device_0_never_hand_out_the_same_pointer():
    collect()
    a = CachingAllocator(backend=SimDevice(), config="")
    b = CachingAllocator(backend=SimDevice(), config="")
    a_ptr = a.malloc(MiB)
    b.malloc(MiB)
    with pytest.raises(NotAllocatedError):
        b.free(a_ptr)


def test_expandable_segments_of_two_devices_never_share_an_address():
    collect()
    a = CachingAllocator(backend=SimDevice(), config="expandable_segments:True")
    b = CachingAllocator(backend=SimDevice(), config="expandable_segments:True")
    a_ptr = a.malloc(MiB)
    b.malloc(MiB)
    with pytest.raises(NotAllocatedError):
        b.free(a_ptr)
