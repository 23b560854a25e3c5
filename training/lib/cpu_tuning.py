"""Process-wide CPU settings the training commands make at start-up, before the first tensor: glibc's malloc keeps
freed memory, and torch's oneDNN caches stay bounded. Each is skipped where the user set the variables it sets.
"""

from __future__ import annotations

import os

MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS at once (Linux only).

    By default glibc serves large allocations with mmap and gives them back on free, so every training step
    page-faults its activations in again. With mmap threshold 2 GiB, trim threshold 2 GiB and top pad 1 GiB (the
    same as the environment variables MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_) a training
    step page-faults about 0 times instead of about 100,000 and runs faster; the price is that freed memory stays in
    the process (a higher peak RSS). `benchmarks/bench_training_paths.py --malloc keep|default` measures both.
    Skipped when any MALLOC_* variable above is set (the user's choice wins), when VASWANI_KEEP_FREED_MEMORY=0, or
    where the C library is not glibc.

    Returns:
        True if all three settings were applied.
    """
    if os.environ.get("VASWANI_KEEP_FREED_MEMORY", "1") == "0" or any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and others have no mallopt with these meanings
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        settings = ((m_mmap_threshold, 2**31 - 1), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30))
        return all(libc.mallopt(option, ctypes.c_int(value)) == 1 for option, value in settings)
    except (OSError, AttributeError):
        return False


ONEDNN_CACHE_ENV = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = 256) -> bool:
    """Keep at most `capacity` oneDNN computations in each of torch's two caches of them (default 256; torch's and
    oneDNN's default is 1,024). Call it before the process's first oneDNN product.

    torch caches a oneDNN computation, with its buffers, for every input shape it meets: ideep's cache
    (`LRU_CACHE_CAPACITY`) and oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`). A CPU training step of
    this project multiplies in oneDNN (bf16 autocast, or fp32 where `cpu_training_matmul()` chose it), and with
    token-budget batches many of its shapes are new every step, so both caches would fill to 1,024 entries of a few
    MiB each and more than double the run's peak memory. Its linears round their row counts up to a multiple of
    `TRAINING_ROW_MULTIPLE`, so that the kernels of the few row counts a run meets most are reused: 256 keeps them
    (docs/performance.md, "Row counts that recur"). Skipped when the user set any of those variables (the user's
    choice wins).

    Returns:
        True if the capacities were set.
    """
    if any(name in os.environ for name in ONEDNN_CACHE_ENV):
        return False
    os.environ["LRU_CACHE_CAPACITY"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    return True
