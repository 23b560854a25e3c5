"""`training.common.keep_freed_memory`: glibc keeps freed memory, so training steps stop page-faulting their
activations in again; the user's own MALLOC_* settings and VASWANI_KEEP_FREED_MEMORY=0 win."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
from training.common import keep_freed_memory
applied = keep_freed_memory()
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 20 allocations of 64 MiB, written and freed, as a training step's activations are
    block = torch.ones(16 * 1024 * 1024)
    del block
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_probe(**env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "VASWANI_KEEP_FREED_MEMORY"}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory tunes glibc's malloc only; elsewhere it does nothing, which "
                                      "test_malloc_is_left_alone_when_asked_or_not_glibc checks")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    applied, faults = run_probe()
    assert applied
    default_applied, default_faults = run_probe(VASWANI_KEEP_FREED_MEMORY="0")
    assert not default_applied
    # 64 MiB is 16,384 pages: by default each of the 20 blocks is mmapped and faulted in anew (~327,000 faults);
    # kept, the first block's pages are reused
    assert default_faults > 20 * 16384 * 0.9
    assert faults < 3 * 16384


def test_malloc_is_left_alone_when_asked_or_not_glibc(monkeypatch):
    import ctypes

    from training.common import keep_freed_memory

    for name, value in (("VASWANI_KEEP_FREED_MEMORY", "0"), ("MALLOC_ARENA_MAX", "2")):  # the user's choice wins
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert keep_freed_memory() is False
    for name in ("VASWANI_KEEP_FREED_MEMORY", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(name, raising=False)

    class NotGlibc:  # a C library without gnu_get_libc_version (musl, macOS): mallopt must not be called
        def mallopt(self, *args):
            raise AssertionError("mallopt called outside glibc")

    monkeypatch.setattr(ctypes, "CDLL", lambda name: NotGlibc())
    assert keep_freed_memory() is False
