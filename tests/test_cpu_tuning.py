"""The training scripts' process memory settings (training/lib/cpu_tuning.py), each in a fresh process:

- `vaswani_training.lib.cpu_tuning.keep_freed_memory`: glibc keeps freed memory, so training steps stop page-faulting
  their activations in again; the user's own MALLOC_* settings and VASWANI_KEEP_FREED_MEMORY=0 win.
- `vaswani_training.lib.cpu_tuning.bound_onednn_caches`: torch's caches of oneDNN computations stay small when every
  training step brings new row counts; the user's own cache settings win."""

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from vaswani_hf.kernels_vaswani import has_onednn_linear
from vaswani_training.lib.cpu_tuning import MALLOC_ENV, ONEDNN_CACHE_ENV, bound_onednn_caches

MALLOC_PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
import vaswani_hf  # the training commands have imported the model (torch, transformers) when they call it
from vaswani_training.lib.cpu_tuning import keep_freed_memory
applied = keep_freed_memory()
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 20 allocations of BLOCK bytes, written and freed, as a training step's activations are
    block = torch.ones({block} // 4)
    del block
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


CACHE_PROBE = """
import sys
sys.path.insert(0, {root!r})
from vaswani_training.lib.cpu_tuning import bound_onednn_caches
applied = bound_onednn_caches()
import torch
def _onednn_linear(x, weight):  # vaswani_hf.kernels_vaswani._onednn_linear's operator, without importing transformers
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
weight, x, grad = torch.randn(2048, 256), torch.randn(600, 256), torch.randn(600, 2048)
print("applied", applied, flush=True)
for rows in [*range(450, 600), *range(450, 600), *range(595, 600)]:  # two passes over 150 row counts, then the last 5
    print("rows", rows, flush=True)  # a linear's forward, input- and weight-gradient products at this row count
    _onednn_linear(x[:rows], weight), _onednn_linear(grad[:rows], weight.t())
    _onednn_linear(grad[:rows].t(), x[:rows].t())
"""


def run_cache_probe(**env_overrides) -> tuple[bool, list[int]]:
    """Run CACHE_PROBE with oneDNN reporting each computation it creates or finds in its cache: (applied, hits per
    stage) for the first pass over 150 row counts (450 products), the second pass, and the last 5 row counts again."""
    out = subprocess.run([sys.executable, "-c", CACHE_PROBE.format(root=str(ROOT))], capture_output=True, text=True,
                         check=True, env={**clean_env(), "ONEDNN_VERBOSE": "profile_create", **env_overrides}).stdout
    applied, hits, rows_seen = False, [0, 0, 0], 0
    for line in out.splitlines():
        if line.startswith("applied"):
            applied = line.split()[1] == "True"
        elif line.startswith("rows"):
            rows_seen += 1
        elif ",primitive,create" in line and "cache_" in line:
            stage = 0 if rows_seen <= 150 else 1 if rows_seen <= 300 else 2
            hits[stage] += "cache_hit" in line.split(",")[3]
    assert rows_seen == 305, out[-2000:]
    return applied, hits


SETTINGS_ENV = (*MALLOC_ENV, "VASWANI_KEEP_FREED_MEMORY", *ONEDNN_CACHE_ENV)


def clean_env() -> dict[str, str]:
    """This process's environment without the user's memory and oneDNN cache settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in SETTINGS_ENV}


def run_probe(probe: str = MALLOC_PROBE, **env_overrides):
    """Run `probe` in a fresh Python without the user's memory settings (plus `env_overrides`): (applied, number)."""
    out = subprocess.run([sys.executable, "-c", probe.format(root=str(ROOT), block=BLOCK)],
                         env={**clean_env(), **env_overrides},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
BLOCK = 64 * 1024 * 1024  # bytes: above glibc's default mmap threshold, so each block is mapped and faulted in anew


def largest_fault() -> int:
    """The most bytes one page fault maps in: a transparent huge page where the kernel backs every anonymous mapping
    with them (`always`), else a page (4 KiB on x86-64, 16 or 64 KiB on some ARM kernels)."""
    page = resource.getpagesize()
    try:
        if "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return max(page, int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text()))
    except (OSError, ValueError):
        pass
    return page


@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory tunes glibc's malloc only; elsewhere it does nothing, which "
                                      "test_malloc_is_left_alone_when_asked_or_not_glibc checks")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    applied, faults = run_probe()
    assert applied
    default_applied, default_faults = run_probe(VASWANI_KEEP_FREED_MEMORY="0")
    assert not default_applied
    # by default each of the 20 blocks is mapped and faulted in anew (with 4 KiB pages 16,384 faults a block, some
    # 327,000 in all); kept, the first block's pages are reused
    assert default_faults > 20 * (BLOCK // largest_fault()) * 0.9, default_faults
    assert faults < 3 * BLOCK // resource.getpagesize() and faults < default_faults / 5, (faults, default_faults)


def test_malloc_is_left_alone_when_asked_or_not_glibc(monkeypatch):
    import ctypes

    from vaswani_training.lib.cpu_tuning import keep_freed_memory

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


@pytest.mark.isa  # oneDNN's computations, and the memory they keep, are chosen by the instruction set
@pytest.mark.skipif(not has_onednn_linear(), reason="this torch build multiplies without oneDNN, so it keeps no oneDNN "
                                                    "computations to bound; test_user_cache_settings_win checks what "
                                                    "bound_onednn_caches sets on every build")
def test_onednn_caches_stay_small_with_new_row_counts():
    applied, hits = run_cache_probe()
    assert applied
    # 256 kept: the second pass over 450 computations finds none of them (each was evicted), the last 15 all (within
    # 256 even where a product keeps a few entries, as oneDNN's nested computations do)
    assert hits == [0, 0, 15], hits
    # torch's and oneDNN's default capacity, 1,024, set by the user: kept, and every computation found again
    user_applied, user_hits = run_cache_probe(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert not user_applied
    assert user_hits == [0, 450, 15], user_hits


def test_user_cache_settings_win(monkeypatch):
    clean = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_ENV}
    for name in ONEDNN_CACHE_ENV:
        monkeypatch.setattr(os, "environ", {**clean, name: "512"})
        assert bound_onednn_caches() is False
        assert {k: os.environ.get(k) for k in ONEDNN_CACHE_ENV} == {k: "512" if k == name else None
                                                                   for k in ONEDNN_CACHE_ENV}
    monkeypatch.setattr(os, "environ", dict(clean))
    assert bound_onednn_caches(capacity=32) is True
    assert os.environ["LRU_CACHE_CAPACITY"] == os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
