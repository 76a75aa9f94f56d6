"""The CPU heap keeps what a step frees: the next pass does not fault those pages in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's adaptive thresholds (Linux)",
)

# A pass's memory as glibc sees it: 40 blocks of 512 KiB, written, then freed top first (as
# W frees what B held), after a 600 KiB block freed once set glibc's adaptive thresholds as
# a program's first tensors do. Measured: the minor page faults of the third pass.
_ROUNDS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free(libc.malloc(600 << 10))

def faults_of_a_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [libc.malloc(512 << 10) for _ in range(40)]
    for block in held:
        libc.memset(block, 1, 512 << 10)
    for block in reversed(held):
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print([faults_of_a_pass() for _ in range(3)][-1])
"""


def _third_pass_faults(setup: str, **malloc: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | malloc
    code = textwrap.dedent(setup) + _ROUNDS
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_without_it_glibc_faults_a_freed_pass_in_again() -> None:
    """The reference: glibc's defaults give the 20 MiB back, so each pass faults 5,120 pages."""
    assert _third_pass_faults("") > 4000


def test_kept_the_next_pass_reuses_the_pages() -> None:
    assert (
        _third_pass_faults(
            "from pipesched.runtime.heap import keep_freed_memory; keep_freed_memory()"
        )
        < 200
    )


def test_building_a_cpu_pipeline_keeps_them() -> None:
    setup = """
    import torch
    from torch import nn
    from pipesched import Pipeline
    Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, devices=["cpu", "cpu"])
    """
    assert _third_pass_faults(setup) < 200


def test_thresholds_the_user_set_stay_in_charge() -> None:
    """Set thresholds turn glibc's adaptation off, and with it what pipesched does."""
    keep = "from pipesched.runtime.heap import keep_freed_memory; keep_freed_memory()"
    assert _third_pass_faults(keep, MALLOC_TRIM_THRESHOLD_="131072") > 4000
