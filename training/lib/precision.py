"""The precision of a CPU training run (`--cpu_bf16`): bf16 autocast where the CPU computes bf16 natively and a
training step measured in both precisions is faster in it, else fp32.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from vaswani_hf import VaswaniConfig

from .arguments import ModelArguments, RecipeArguments
from .presets import parse_overrides

# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) below which it has no bf16 instructions.
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_native_bf16() -> bool:
    """True where torch can compute bf16 natively on this CPU: /proc/cpuinfo (Linux) has avx512_bf16 or amx_bf16, and
    neither torch's kernels (ATEN_CPU_CAPABILITY, e.g. avx2) nor oneDNN (ONEDNN_MAX_CPU_ISA, e.g. AVX2) are limited
    below them. Elsewhere bf16 on the CPU is emulated and hundreds of times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


# On a CPU with native bf16, --cpu_bf16 auto takes bf16 autocast only when a training step measured in both
# precisions is at least this much faster in bf16; closer than that, fp32 (exact, and noise cannot flip the choice).
BF16_MIN_SPEEDUP = 1.15


def _timed_step(model, batch: dict[str, torch.Tensor], bf16: bool) -> float:
    """Wall-clock seconds of one forward and backward pass of `model` on `batch` (gradients then cleared)."""
    started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def time_training_precisions(config: VaswaniConfig, *, rows: int = 32, length: int = 32,
                             repetitions: int = 5) -> tuple[float, float]:
    """The fastest of `repetitions` wall-clock times of one CPU training step's forward and backward pass, in seconds,
    `(fp32, bf16 autocast)`.

    The step is that of a fresh model of `config`'s widths (d_model, heads, d_ff, vocabulary, activation, layer
    norm placement) with one layer per stack, on a random batch of `rows` x `length` source and target tokens
    (the last quarter of half the source rows padding; at most `max_position_embeddings` tokens with learned
    positions), in train mode with dropout: the ratio of the two times, not the times, is what it is for, and a
    layer's products and the output projection keep their shapes. The two precisions alternate, after one untimed
    step each, so that load from other processes hits both alike, and the fastest step of each counts, so that a
    burst of load that slows some of one precision's steps does not decide (docs/results.md, "What the main job does").
    The global random state is restored afterwards. About 2 s at the `cpu` preset's widths.
    """
    import copy

    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.fast_paths_vaswani import training_fast_paths

    probe = copy.deepcopy(config)
    probe.encoder_layers = probe.decoder_layers = 1
    if probe.position_embedding_type == "learned":  # a learned table refuses longer input
        length = min(length, probe.max_position_embeddings)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(probe).train()
        ids = torch.randint(4, probe.vocab_size, (rows, length))
        labels = torch.randint(4, probe.vocab_size, (rows, length))
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[: rows // 2, length - length // 4:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        with training_fast_paths(model):  # the step as the run takes it
            for repetition in range(repetitions + 1):
                for bf16 in (False, True):
                    seconds = _timed_step(model, batch, bf16)
                    if repetition:
                        times[bf16].append(seconds)
    return min(times[False]), min(times[True])


def precision_probe_config(model_args: ModelArguments, preset: dict[str, Any]) -> VaswaniConfig:
    """The config whose widths `time_training_precisions` measures: a local --model_name_or_path's, else the preset's
    with --config_overrides and the preset's (or --vocab_size's) vocabulary."""
    path = model_args.model_name_or_path
    if path and Path(path).is_dir():
        return VaswaniConfig.from_pretrained(path)
    return VaswaniConfig(vocab_size=model_args.vocab_size or preset["vocab_size"],
                         **{**preset["model"], **parse_overrides(model_args.config_overrides)})


def cpu_precision(recipe: RecipeArguments, model_args: ModelArguments, preset: dict[str, Any]) -> tuple[bool, str]:
    """Whether a training run on the CPU computes in bf16 autocast, and why in words, per --cpu_bf16.

    `yes` and `no` are taken as given. `auto`: fp32 where the CPU has no native bf16 (`cpu_has_native_bf16`; there
    torch emulates bf16 matmuls, hundreds of times slower). Where it has, bf16 is not always faster: CPUs with
    AVX512-BF16 but no AMX can multiply bf16 at half their fp32 rate (MKL's AVX-512 fp32 GEMMs). So the two are
    measured (`time_training_precisions`, about 2 s) and bf16 is taken when it is at least `BF16_MIN_SPEEDUP` (1.15)
    times faster. Several processes (WORLD_SIZE > 1) do not measure, since each would time its own step and they
    could choose differently: native bf16 means bf16 there.
    """
    native = cpu_has_native_bf16()
    if recipe.cpu_bf16 == "yes":
        return True, "--cpu_bf16 yes" + ("" if native else "; this CPU has no native bf16, expect it slow")
    if recipe.cpu_bf16 == "no":
        return False, "--cpu_bf16 no"
    if not native:
        return False, ("no native bf16 here (no avx512_bf16/amx_bf16 CPU flag, or torch limited below it by "
                       "ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA): bf16 matmuls would be emulated, far slower than fp32")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True, "the CPU has native bf16 (avx512_bf16/amx_bf16; not measured with several processes); " \
                     "--cpu_bf16 no for fp32"
    fp32, bf16 = time_training_precisions(precision_probe_config(model_args, preset))
    measured = (f"a one-layer training step at the model's widths took {bf16 * 1e3:.0f} ms in bf16 autocast "
                f"against {fp32 * 1e3:.0f} ms in fp32")
    if fp32 >= BF16_MIN_SPEEDUP * bf16:
        return True, f"the CPU has native bf16 and {measured}; --cpu_bf16 no for fp32"
    return False, (f"the CPU has native bf16, but {measured} (bf16 is taken when at least {BF16_MIN_SPEEDUP}x "
                   f"faster); --cpu_bf16 yes for bf16")
