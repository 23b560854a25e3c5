"""Side-by-side speed and memory of VaswaniForConditionalGeneration and transformers' MarianMTModel at one size.

Both models are built with identical sizes (same d_model, layers, heads, d_ff, shared vocabulary tied three ways,
sinusoidal positions, ReLU, post-LN, sqrt(d_model) embedding scale, the same dropout; the same number of trained
parameters) and fed the same random batch. Every measurement alternates the two models (ours, Marian, Marian, ours,
...) so that load from other processes on the machine hits both alike, and reports medians and ours/Marian ratios;
absolute numbers on a shared machine mean little. Three ratios are printed for each speed: `wall`, the ratio of the
rates from the median wall-clock times; `paired`, the median over repetitions of the ratio of the two back-to-back
calls of a repetition (they share the load of the moment); `CPU`, from the median process CPU times (user + system,
all threads; less disturbed by other processes taking the cores, but it counts threads spinning while they wait).

Measured:

* training: tokens/s of a whole step (forward, backward, fused Adam step, zero_grad) in train mode with dropout. The
  loss is the same on both: by default plain cross-entropy (`--label-smoothing 0`), which is what Marian's forward
  computes from `labels`; ours runs its step as the training commands do, inside `training_fast_paths(model,
  label_smoothing)` (vaswani_hf/fast_paths_vaswani.py); with `--label-smoothing 0.1` Marian is called without labels
  and its loss is the same `F.cross_entropy(..., label_smoothing=0.1)` computed on its logits, summed and divided by
  the number of labelled tokens, as ours does. Tokens are the labelled (non-padding) target tokens of the batch, as
  fairseq's `wps` counts them.
* peak training memory: CPU: in a fresh Python process per model and batch size, the model and its Adam optimizer
  are built, then the peak resident set size (VmHWM) is reset to the current RSS by writing 5 to
  /proc/self/clear_refs (Linux >= 4.0), two training steps run (the first creates Adam's state), and the peak is
  read back from /proc/self/status. The number reported is that peak minus the RSS right before the steps: what
  training adds on top of the built model (gradients, Adam state, activations, temporaries). The processes run with
  MALLOC_MMAP_THRESHOLD_=131072, so that glibc returns freed tensors' memory at once and the resident set follows
  the live tensors (by default it keeps freed memory around, which adds hundreds of MiB of noise). Where clear_refs
  cannot be written it falls back to ru_maxrss minus that RSS (an upper bound of the same quantity) and says so.
  CUDA: torch.cuda.max_memory_allocated() minus the allocated memory before the steps, also in a fresh process.
* generation: sentences/s of `generate()` with beam 4 (length penalty 0.6) and greedy, with
  `min_new_tokens = max_new_tokens` so that both models produce exactly the same number of tokens.
* how cost grows: beam-search time against the number of new tokens (16 ... 256), and peak training memory
  against batch tokens; written as a table, into the JSON file, and as a PNG plot (`--plot`).
* training MFU on any device: the training step's model FLOP/s counting real (non-padding) tokens only
  (`training_flops_real_tokens`, formula in its docstring) over the GEMM peak measured in the same run (the best
  median FLOP/s of a few large fp32 matmuls at the benchmark's threads, `measure_gemm_peak`), for ours and Marian,
  at the paper's base dims and at the `cpu` preset's dims (`--no-mfu` skips it). On a CPU our training step runs
  its position-wise layers, output projection and loss on the unpadded tokens only (`unpad_batch` in
  vaswani_hf/kernels_vaswani.py); MarianMTModel computes every padded position. On a CPU it also says where each
  model's step goes: one step timed operator by operator (`time_products`) splits it into the matrix products, the
  attention kernels and the rest, and the FLOPs over the first two give the MFU the step would reach, and the
  ours/Marian ratio, if the rest took no time (a ceiling that making the rest cheaper can approach but not pass).
* on CUDA: training MFU, model FLOPs per second over the device's peak dense bf16 FLOP/s (a table of known GPUs;
  `--peak-flops` for others). Model FLOPs of a training step are counted exactly for every matrix multiplication on
  the padded batch (projections, Q K^T, softmax x V, FFN, output projection over all target positions), times 3
  (the backward pass does two matmuls of the same size per forward matmul); the causal half of the decoder
  self-attention is counted in full, and element-wise work is not counted. tests/test_benchmark.py checks this
  count against torch.utils.flop_counter on the eager model.

Usage (the acceptance check in the README, paper base dims, vocabulary 8000):

    python benchmarks/benchmark.py --vocab-size 8000 --output /tmp/bench.json --plot /tmp/bench.png

`--quick` runs a tiny model in seconds (the test uses it). `--device cuda --dtype bf16` runs under bf16 autocast
on a GPU (README, "On a GPU (H100)"). On a CPU shared with other work, `--threads 1` gives steadier numbers: intra-op
threads that wait for each other while another process holds a core can make single calls many times slower.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import GenerationConfig, MarianConfig, MarianMTModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from vaswani_hf.configuration_vaswani import VaswaniConfig  # noqa: E402
from vaswani_hf.fast_paths_vaswani import training_fast_paths  # noqa: E402
from vaswani_hf.kernels_vaswani import cpu_training_matmul, has_onednn_linear  # noqa: E402
from vaswani_hf.modeling_vaswani import VaswaniForConditionalGeneration  # noqa: E402

hf_logging.set_verbosity_error()

MODELS = ("ours", "marian")
PAD, BOS, EOS = 0, 1, 2

# Peak dense (no sparsity) bf16 tensor FLOP/s, from the vendors' data sheets. Matched against
# torch.cuda.get_device_name() in order; override with --peak-flops.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


# Models and inputs ---------------------------------------------------------------------------------------------------


def build_model(name: str, args) -> torch.nn.Module:
    common = dict(dropout=args.dropout, attention_dropout=0.0, activation_dropout=0.0,
                  max_position_embeddings=args.max_positions)
    if name == "ours":
        config = VaswaniConfig(
            vocab_size=args.vocab_size, d_model=args.d_model, encoder_layers=args.layers, decoder_layers=args.layers,
            num_heads=args.heads, d_ff=args.d_ff, activation_function="relu", scale_embedding=True,
            share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=BOS,
            eos_token_id=EOS, decoder_start_token_id=BOS, **common)
        model = VaswaniForConditionalGeneration(config)
    else:
        config = MarianConfig(
            vocab_size=args.vocab_size, decoder_vocab_size=args.vocab_size, d_model=args.d_model,
            encoder_layers=args.layers, decoder_layers=args.layers, encoder_attention_heads=args.heads,
            decoder_attention_heads=args.heads, encoder_ffn_dim=args.d_ff, decoder_ffn_dim=args.d_ff,
            activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
            forced_eos_token_id=None, **common)
        model = MarianMTModel(config)
    model.config._attn_implementation = args.attn
    for module in model.modules():  # some transformers versions cache it per submodule config
        if hasattr(module, "config") and module.config is not model.config:
            module.config._attn_implementation = args.attn
    return model.to(args.device)


def count_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters (tied weights count once; Marian's frozen sinusoidal tables are not trained)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_batch(args, batch_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random batch of about `batch_tokens` target tokens: sentences padded to `--src-len`/`--tgt-len`, their real
    lengths uniform in [`--min-len-fraction` x length, length], ids in [3, vocab), labels ending in </s>, -100 on
    padding; the same for both models."""
    generator = torch.Generator().manual_seed(seed)
    batch = max(1, batch_tokens // args.tgt_len)

    def lengths(full: int) -> torch.Tensor:
        low = max(1, int(math.ceil(args.min_len_fraction * full)))
        return torch.randint(low, full + 1, (batch,), generator=generator)

    src_lengths, tgt_lengths = lengths(args.src_len), lengths(args.tgt_len)
    src_lengths[0], tgt_lengths[0] = args.src_len, args.tgt_len  # the batch is as long as its longest sentence
    input_ids = torch.randint(3, args.vocab_size, (batch, args.src_len), generator=generator)
    attention_mask = (torch.arange(args.src_len)[None, :] < src_lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask.eq(0), PAD)
    input_ids[torch.arange(batch), src_lengths - 1] = EOS
    labels = torch.randint(3, args.vocab_size, (batch, args.tgt_len), generator=generator)
    labels[torch.arange(batch), tgt_lengths - 1] = EOS
    labels = labels.masked_fill(torch.arange(args.tgt_len)[None, :] >= tgt_lengths[:, None], -100)
    return {"input_ids": input_ids.to(args.device), "attention_mask": attention_mask.to(args.device),
            "labels": labels.to(args.device)}


def generation_inputs(args, batch: int) -> dict[str, torch.Tensor]:
    data = make_batch(args, batch * args.tgt_len, seed=1)
    return {"input_ids": data["input_ids"][:batch], "attention_mask": data["attention_mask"][:batch]}


def autocast(args):
    if args.dtype == "bf16":
        return torch.autocast(device_type=args.device, dtype=torch.bfloat16)
    return torch.autocast(device_type=args.device, enabled=False)


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


# Training -------------------------------------------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam with §5.3's betas and eps, fused (one kernel for all parameters), as `PaperTrainer` trains; the same for
    both models."""
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)


def training_step(name: str, model, optimizer, batch, args) -> float:
    """One forward/backward/Adam step with the same loss on both models, ours as the training commands take it
    (`training_fast_paths`, installed for the step); returns the loss."""
    if name == "ours":
        with training_fast_paths(getattr(model, "_orig_mod", model), args.label_smoothing):
            with autocast(args):
                loss = model(**batch).loss
            loss.backward()  # inside: the backward pass of the step's own kernels
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
    with autocast(args):
        if args.label_smoothing > 0:
            # Marian's own loss is plain CE; compute the same label-smoothed sum / count that ours computes.
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=model.prepare_decoder_input_ids_from_labels(batch["labels"]))
            labels = batch["labels"]
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                   reduction="sum", label_smoothing=args.label_smoothing) / labels.ne(-100).sum()
        else:
            loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def interleaved(functions: dict, repetitions: int, warmup: int, args) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each function, alternating their order every repetition (A B, B A, ...), after `warmup`
    calls of each. Returns wall-clock seconds and this process's CPU seconds (user + system, all threads) per call:
    the CPU time is less disturbed by other processes taking the cores, the wall time is what a user waits."""
    names = list(functions)
    for _ in range(warmup):
        for name in names:
            functions[name]()
    times = {name: {"wall": [], "cpu": []} for name in names}
    for rep in range(repetitions):
        for name in (names if rep % 2 == 0 else names[::-1]):
            synchronize(args)
            start, cpu_start = time.perf_counter(), time.process_time()
            functions[name]()
            synchronize(args)
            times[name]["wall"].append(time.perf_counter() - start)
            times[name]["cpu"].append(time.process_time() - cpu_start)
    return times


def summarize(times: dict, work: float, unit: str) -> dict:
    """Per model: the seconds, `unit` per second from the median wall time (and from the median CPU time); and
    ours/Marian ratios of those rates (> 1: ours is faster)."""
    result = {}
    for name, measured in times.items():
        result[name] = {"seconds": measured["wall"], "cpu_seconds": measured["cpu"],
                        unit: work / statistics.median(measured["wall"]),
                        f"{unit}_cpu": work / statistics.median(measured["cpu"])}
    result["ratio"] = result["ours"][unit] / result["marian"][unit]
    result["ratio_cpu"] = result["ours"][f"{unit}_cpu"] / result["marian"][f"{unit}_cpu"]
    # Each repetition's two calls run back to back, so they share the machine's load of the moment: the median of
    # the per-repetition ratios resists load bursts better than the ratio of the medians.
    result["ratio_paired"] = statistics.median(
        marian / ours for ours, marian in zip(times["ours"]["wall"], times["marian"]["wall"], strict=True))
    result["ratio_best"] = min(times["marian"]["wall"]) / min(times["ours"]["wall"])
    return result


def bench_training(models, args) -> dict:
    batch = make_batch(args, args.batch_tokens)
    tokens = int(batch["labels"].ne(-100).sum())
    optimizers = {name: make_optimizer(model) for name, model in models.items()}
    for model in models.values():
        model.train()
    losses = {}
    # --compile: the training steps call torch.compile's wrapper of each model (compiled during the warm-up call);
    # generate() elsewhere runs the eager models.
    callables = {name: torch.compile(model) if args.compile else model for name, model in models.items()}

    def step(name):
        return lambda: losses.__setitem__(name, training_step(name, callables[name], optimizers[name], batch, args))

    times = interleaved({name: step(name) for name in models}, args.train_reps, 1, args)
    for optimizer in optimizers.values():  # free Adam's moments before the next section measures memory
        optimizer.state.clear()
    optimizers.clear()
    gc.collect()
    result = summarize(times, tokens, "tokens_per_s")
    for name in models:
        result[name]["last_loss"] = losses[name]
    result["target_tokens_per_step"] = tokens
    result["batch_shape"] = list(batch["labels"].shape)
    result["source_length"] = batch["input_ids"].shape[1]
    if args.device == "cuda":
        flops = training_flops(args, batch["input_ids"].shape, batch["labels"].shape)
        peak = peak_flops(args)
        for name in models:
            achieved = flops / statistics.median(times[name]["wall"])
            result[name]["model_flops_per_s"] = achieved
            result[name]["mfu"] = achieved / peak if peak else None
        result["flops_per_step"] = flops
        result["peak_flops"] = peak
    return result


def training_flops(args, src_shape, tgt_shape) -> float:
    """Matmul FLOPs of one training step on the padded batch (see the module docstring): 3 x forward."""
    (batch, s), (_, t) = src_shape, tgt_shape
    d, f, v, n = args.d_model, args.d_ff, args.vocab_size, args.layers
    encoder = 2 * batch * s * (3 * d * d + d * d + 2 * d * f) + 2 * 2 * batch * s * s * d
    decoder = (2 * batch * t * (3 * d * d + d * d + d * d + d * d + 2 * d * f) + 2 * batch * s * 2 * d * d
               + 2 * 2 * batch * t * t * d + 2 * 2 * batch * t * s * d)
    head = 2 * batch * t * d * v
    return 3.0 * (n * encoder + n * decoder + head)


def training_flops_real_tokens(args, batch: dict[str, torch.Tensor], d: int | None = None, f: int | None = None,
                               n: int | None = None) -> float:
    """Model FLOPs of one training step counting only real (non-padding) tokens, the CPU MFU's numerator.

    With n layers per stack, width d, FFN width f, vocabulary V, and per sentence i its real source length s_i and
    real target length t_i (S = sum s_i, T = sum t_i), a multiply-add counted as 2 FLOPs::

        encoder  = n * (2 S (4 d^2 + 2 d f) + 4 d sum s_i^2)
        decoder  = n * (2 T (4 d^2 + 2 d^2 + 2 d f) + 2 S (2 d^2) + 4 d sum t_i^2 + 4 d sum t_i s_i)
        head     = 2 T d V
        training = 3 * (encoder + decoder + head)

    (Q, K, V, output projections 4 d^2 per token; cross-attention: Q and output on the target, K and V on the
    source; scores and weighted sum 2 x 2 d per query-key pair, the decoder's causal half counted in full; backward
    = 2 x forward.) Element-wise work (softmax, LayerNorm, dropout, Adam) is not counted.
    """
    d = d or args.d_model
    f = f or args.d_ff
    n = n or args.layers
    v = args.vocab_size
    s_i = batch["attention_mask"].sum(1).double()
    t_i = batch["labels"].ne(-100).sum(1).double()
    S, T = float(s_i.sum()), float(t_i.sum())
    encoder = 2 * S * (4 * d * d + 2 * d * f) + 4 * d * float((s_i * s_i).sum())
    decoder = (2 * T * (6 * d * d + 2 * d * f) + 2 * S * 2 * d * d + 4 * d * float((t_i * t_i).sum())
               + 4 * d * float((t_i * s_i).sum()))
    return 3.0 * (n * (encoder + decoder) + 2 * T * d * v)


def measure_gemm_peak(args, repetitions: int = 5) -> dict:
    """The device's fp32 (or --dtype) matmul throughput, measured now with the benchmark's threads: the best median
    FLOP/s over square and transformer-shaped products (2 m n k FLOPs each). The CPU MFU's denominator.

    On a CPU each product runs in both libraries torch has for it, its default BLAS (`a @ b`: MKL on x86 builds) and
    oneDNN (the `_linear_pointwise` operator that our CPU training linears use where it is faster,
    `kernels_vaswani.cpu_training_matmul`), and the peak is the best of either: MKL runs AVX2 code on non-Intel CPUs,
    so on an AVX-512 AMD CPU oneDNN's peak is the machine's."""
    shapes = [(2048, 1024, 1024), (2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512), (2048, 512, 8000)]
    if args.device == "cuda":  # a GPU needs large products to reach its peak: the shapes of a 25,000-token step too
        shapes += [(8192, 8192, 8192), (25000, 512, 2048), (25000, 2048, 512), (25000, 512, 8000)]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    libraries = {"blas": lambda a, b: a @ b}
    if args.device == "cpu" and dtype == torch.float32 and has_onednn_linear():
        libraries["onednn"] = lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
    best, rows, by_library = 0.0, [], dict.fromkeys(libraries, 0.0)
    for m, k, n in shapes:
        a = torch.randn(m, k, device=args.device, dtype=dtype)
        b = torch.randn(k, n, device=args.device, dtype=dtype)
        for library, product in libraries.items():
            for _ in range(3 if args.device == "cuda" else 1):  # warm-up (cuBLAS picks its kernel, clocks rise)
                product(a, b)
            times = []
            for _ in range(repetitions if args.device == "cpu" else 4 * repetitions):
                synchronize(args)
                start = time.perf_counter()
                product(a, b)
                synchronize(args)
                times.append(time.perf_counter() - start)
            rate = 2 * m * n * k / statistics.median(times)
            rows.append({"shape": [m, k, n], "library": library, "flops_per_s": rate})
            by_library[library] = max(by_library[library], rate)
            best = max(best, rate)
    return {"peak_flops_per_s": best, "by_library": by_library, "shapes": rows,
            "dtype": str(dtype).replace("torch.", "")}


# The operators whose time `time_products` sums: matrix products (torch's BLAS and oneDNN's linear) and the fused
# attention kernels (whose Q K^T and weighted sum the FLOP count includes; they also do the softmax).
PRODUCT_OPERATORS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
ATTENTION_OPERATORS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def time_products(name: str, model, optimizer, batch, args) -> dict:
    """Seconds spent inside the matrix products and inside the attention kernels during one training step, and the
    step's wall time, measured by timing each operator call as it is dispatched (a `TorchDispatchMode`; CPU, where
    operators return when done). What the rest of the step costs is the step minus these two. Returns
    `{"products", "attention", "step"}` in seconds and `{"product_calls", "attention_calls"}`.

    Their sum is the least a step could take if everything else (element-wise work, copies, Adam, Python) took no time:
    `flops / (products + attention)` is the highest FLOP/s this step's products and attention kernels allow on this
    machine, the ceiling of its MFU. The mode's own overhead (a Python call per operator) falls into the step's wall
    time only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seconds = {"products": 0.0, "attention": 0.0}
    calls = {"products": 0, "attention": 0}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operator = func._schema.name
            kind = "products" if operator in PRODUCT_OPERATORS else (
                "attention" if operator in ATTENTION_OPERATORS else None)
            if kind is None:
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds[kind] += time.perf_counter() - start
            calls[kind] += 1
            return out

    start = time.perf_counter()
    with Timer():
        training_step(name, model, optimizer, batch, args)
    seconds["step"] = time.perf_counter() - start
    return {**seconds, "product_calls": calls["products"], "attention_calls": calls["attention"]}


# The sizes at which the CPU MFU is reported: the paper's base model and the `cpu` preset of training/lib/presets.py.
MFU_SIZES = {"base": {"d_model": 512, "layers": 6, "heads": 8, "d_ff": 2048},
             "cpu": {"d_model": 256, "layers": 3, "heads": 4, "d_ff": 1024}}


def bench_mfu(args, sizes: dict | None = None) -> dict:
    """Training-step model FLOP/s (real tokens only) as a fraction of the GEMM peak measured in the same run, for
    ours and Marian, at base dims and at the cpu preset's dims (tiny dims with --quick; `sizes` instead)."""
    peak = measure_gemm_peak(args)
    if sizes is None:
        sizes = {"quick": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "d_ff": args.d_ff}} \
            if args.quick else MFU_SIZES
    result = {"gemm_peak": peak, "sizes": {}}
    for label, dims in sizes.items():
        sized = argparse.Namespace(**{**vars(args), **dims})
        torch.manual_seed(args.seed)
        models = {name: build_model(name, sized) for name in MODELS}
        measured = bench_training(models, sized)
        batch = make_batch(sized, sized.batch_tokens)
        flops = training_flops_real_tokens(sized, batch)
        row = {"dims": dims, "flops_per_step_real_tokens": flops,
               "real_tokens": int(batch["attention_mask"].sum() + batch["labels"].ne(-100).sum()),
               "padded_tokens": int(batch["input_ids"].numel() + batch["labels"].numel()),
               "ratio": measured["ratio"], "ratio_paired": measured["ratio_paired"]}
        for name in MODELS:
            step = statistics.median(measured[name]["seconds"])
            rate = flops / step
            row[name] = {"model_flops_per_s": rate, "fraction_of_peak": rate / peak["peak_flops_per_s"],
                         "tokens_per_s": measured[name]["tokens_per_s"], "step_seconds": step}
            if args.device == "cpu":
                optimizer = make_optimizer(models[name])
                training_step(name, models[name], optimizer, batch, sized)  # Adam's state, as in the timed steps
                parts = sorted((time_products(name, models[name], optimizer, batch, sized) for _ in range(3)),
                               key=lambda part: part["products"] + part["attention"])
                median = parts[1]  # the step whose products and attention kernels took the median time
                row[name].update({
                    "products_seconds": median["products"], "attention_seconds": median["attention"],
                    "ceiling_fraction_of_peak": flops / (median["products"] + median["attention"])
                    / peak["peak_flops_per_s"]})
                del optimizer
        if args.device == "cpu":
            # The most ours could gain on Marian's measured step if only its products and attention kernels took time.
            row["ceiling_ratio"] = row["marian"]["step_seconds"] / (
                row["ours"]["products_seconds"] + row["ours"]["attention_seconds"])
        result["sizes"][label] = row
        del models
        gc.collect()
    return result


def peak_flops(args) -> float | None:
    if args.peak_flops:
        return args.peak_flops
    if args.device != "cuda":
        return None
    device_name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None


# Memory ---------------------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(args) -> dict:
    """Run in a fresh process: peak memory that two training steps add on top of the built model."""
    torch.manual_seed(0)
    model = build_model(args.memory_child, args).train()
    optimizer = make_optimizer(model)
    batch = make_batch(args, args.batch_tokens)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(2):
            training_step(args.memory_child, model, optimizer, batch, args)
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "method": "cuda max_memory_allocated"}
    before = _rss_bytes()
    exact = _reset_peak_rss()
    for _ in range(2):
        training_step(args.memory_child, model, optimizer, batch, args)
    peak = _peak_rss_bytes() if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - before,
            "method": "VmHWM after clear_refs" if exact else "ru_maxrss (upper bound; clear_refs not writable)"}


def start_memory_child(name: str, batch_tokens: int, args) -> subprocess.Popen:
    """Start a fresh interpreter running `memory_child` for one model and batch size."""
    command = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
               "--batch-tokens", str(batch_tokens)] + _size_arguments(args)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # glibc serves blocks >= 128 KiB with mmap and gives them back on free, so that the resident set follows the live
    # tensors; by default it raises that threshold after frees and keeps freed tensors' memory, which adds hundreds
    # of MiB of run-to-run noise to peak RSS.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_memory_child(name: str, child: subprocess.Popen) -> dict:
    stdout, stderr = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"memory measurement of {name} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _size_arguments(args) -> list[str]:
    pairs = {"--vocab-size": args.vocab_size, "--d-model": args.d_model, "--layers": args.layers,
             "--heads": args.heads, "--d-ff": args.d_ff, "--src-len": args.src_len, "--tgt-len": args.tgt_len,
             "--min-len-fraction": args.min_len_fraction, "--dropout": args.dropout,
             "--label-smoothing": args.label_smoothing, "--device": args.device, "--dtype": args.dtype,
             "--attn": args.attn, "--max-positions": args.max_positions, "--threads": args.threads}
    return [str(item) for pair in pairs.items() for item in pair]


def bench_memory(args) -> tuple[dict, list[dict]]:
    """Peak training memory at `--batch-tokens` and at each of `--memory-batch-tokens`. The two models' processes
    of one size run at the same time (each measures only itself; on CUDA they run one after the other)."""
    sizes = sorted(set(args.memory_batch_tokens) | {args.batch_tokens})
    rows = []
    for tokens in sizes:
        row = {"batch_tokens": tokens}
        if args.device == "cuda":
            measured = {name: finish_memory_child(name, start_memory_child(name, tokens, args)) for name in MODELS}
        else:
            children = {name: start_memory_child(name, tokens, args) for name in MODELS}
            measured = {name: finish_memory_child(name, child) for name, child in children.items()}
        for name in MODELS:
            row[f"{name}_mib"] = measured[name]["peak_bytes"] / 2**20
        row["method"] = measured["ours"]["method"]
        row["ratio"] = row["ours_mib"] / row["marian_mib"]
        rows.append(row)
    main = next(row for row in rows if row["batch_tokens"] == args.batch_tokens)
    return main, rows


# Generation -----------------------------------------------------------------------------------------------------------


def generation_config(args, new_tokens: int, beams: int) -> GenerationConfig:
    return GenerationConfig(
        num_beams=beams, do_sample=False, length_penalty=0.6 if beams > 1 else 1.0, early_stopping=beams > 1,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=1, use_cache=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=BOS)


def generate_fn(model, inputs, config, args):
    def run():
        with torch.inference_mode(), autocast(args):
            out = model.generate(**inputs, generation_config=config)
        expected = config.max_new_tokens + 1  # + the start token
        if out.shape[1] != expected:
            raise RuntimeError(f"generate() returned {out.shape[1]} positions, expected {expected}")
    return run


def bench_generation(models, args, beams: int, new_tokens: int, batch: int, repetitions: int,
                     warmup: int = 1) -> dict:
    inputs = generation_inputs(args, batch)
    config = generation_config(args, new_tokens, beams)
    for model in models.values():
        model.eval()
    times = interleaved({name: generate_fn(model, inputs, config, args) for name, model in models.items()},
                        repetitions, warmup, args)
    result = summarize(times, batch, "sentences_per_s")
    result.update(batch=batch, new_tokens=new_tokens, beams=beams)
    return result


def bench_generation_scaling(models, args) -> list[dict]:
    """generate() time against the number of new tokens; the models are warm from the measurements before."""
    rows = []
    for new_tokens in args.scaling_lengths:
        measured = bench_generation(models, args, args.scaling_beams, new_tokens, args.scaling_batch,
                                    args.scaling_reps, warmup=0)
        rows.append({"new_tokens": new_tokens,
                     "ours_s": statistics.median(measured["ours"]["seconds"]),
                     "marian_s": statistics.median(measured["marian"]["seconds"]),
                     "ours_cpu_s": statistics.median(measured["ours"]["cpu_seconds"]),
                     "marian_cpu_s": statistics.median(measured["marian"]["cpu_seconds"]),
                     "ratio": measured["ratio"], "ratio_cpu": measured["ratio_cpu"],
                     "ratio_paired": measured["ratio_paired"]})
    return rows


# Report ---------------------------------------------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    generation = results["generation_scaling"]
    lengths = [row["new_tokens"] for row in generation]
    for name, label in (("ours", "ours (Vaswani)"), ("marian", "MarianMTModel")):
        left.plot(lengths, [row[f"{name}_s"] for row in generation], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="new tokens", ylabel="seconds per generate()",
             title=f"beam {args_beams(results)} x batch {results['settings']['scaling_batch']}")
    left.set_xticks(lengths, [str(n) for n in lengths])
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend()
    memory = results["memory_scaling"]
    tokens = [row["batch_tokens"] for row in memory]
    for name, label in (("ours", "ours (Vaswani)"), ("marian", "MarianMTModel")):
        right.plot(tokens, [row[f"{name}_mib"] for row in memory], marker="o", label=label)
    right.set(xlabel="batch target tokens", ylabel="peak training memory added (MiB)",
              title="training step, Adam")
    right.legend()
    settings = results["settings"]
    fig.suptitle(f"d_model {settings['d_model']}, {settings['layers']}+{settings['layers']} layers, "
                 f"vocab {settings['vocab_size']}, {results['device']}, {results['threads']} threads, "
                 f"{settings['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def args_beams(results: dict) -> int:
    return results["settings"]["scaling_beams"]


HEADER = (f"{'measure':50s} {'ours':>9s} {'Marian':>9s} {'wall':>6s} {'paired':>6s} {'CPU':>6s}")


def print_rate(label: str, measured: dict, unit: str) -> None:
    print(f"{label:50s} {measured['ours'][unit]:9.2f} {measured['marian'][unit]:9.2f} {measured['ratio']:6.2f} "
          f"{measured['ratio_paired']:6.2f} {measured['ratio_cpu']:6.2f}")


def print_training_report(results: dict) -> None:
    """The training rows: tokens/s, on CUDA the MFU against the data-sheet peak, and the MFU table (unless
    --no-mfu)."""
    train = results.get("training")
    print()
    print("ours/Marian: > 1 means ours is faster (rates) or uses more memory (MiB). wall: ratio of the median "
          "wall-clock rates; paired: median of the per-repetition ratios of back-to-back calls; CPU: ratio of the "
          "median process CPU times." + (" Training steps run under torch.compile." if
                                         results["settings"].get("compile") else ""))
    if train is not None:
        print(HEADER)
        print_rate(f"training tokens/s ({train['batch_shape'][0]}x{train['batch_shape'][1]}, "
                   f"{train['target_tokens_per_step']} target tokens)", train, "tokens_per_s")
    if train is not None and "mfu" in train["ours"]:
        for name in MODELS:
            mfu = train[name]["mfu"]
            print(f"training MFU {name}: " + (f"{100 * mfu:.1f}%" if mfu is not None else "unknown peak") +
                  f" of {train['peak_flops'] / 1e12:.0f} TFLOP/s ({train[name]['model_flops_per_s'] / 1e12:.1f} "
                  f"TFLOP/s; {train['flops_per_step']:.3g} FLOPs/step = 3 x forward matmul FLOPs on the padded batch)"
                  if train["peak_flops"] else f"training {name}: {train[name]['model_flops_per_s'] / 1e12:.1f} "
                                              "TFLOP/s (no peak known for this device: --peak-flops)")
    if "mfu" in results:
        mfu = results["mfu"]
        peak = mfu["gemm_peak"]
        print()
        print(f"training model FLOP/s against the {peak['dtype']} GEMM peak measured in this run "
              f"({peak['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, the best of " + ", ".join(
                  f"{library} {rate / 1e9:.1f}" for library, rate in peak.get("by_library", {}).items())
              + "); FLOPs = 3 x forward matmul FLOPs over real (non-padding) tokens only (training_flops_real_tokens)"
              + (f"; our training linears multiply with {results['cpu_training_matmul']}, Marian's with blas"
                 if results.get("cpu_training_matmul") else "") + ":")
        print(f"{'dims':>6s} {'real/padded tokens':>19s} {'ours GFLOP/s':>13s} {'of peak':>8s} {'Marian GFLOP/s':>15s} "
              f"{'of peak':>8s} {'ours/Marian':>12s}")
        for label, row in mfu["sizes"].items():
            print(f"{label:>6s} {row['real_tokens']:>9d}/{row['padded_tokens']:<9d} "
                  f"{row['ours']['model_flops_per_s'] / 1e9:13.1f} {100 * row['ours']['fraction_of_peak']:7.1f}% "
                  f"{row['marian']['model_flops_per_s'] / 1e9:15.1f} {100 * row['marian']['fraction_of_peak']:7.1f}% "
                  f"{row['ratio']:12.2f}")
        if any("products_seconds" in row["ours"] for row in mfu["sizes"].values()):
            print("where a step's time goes (one step timed operator by operator, median of 3): the matrix products, "
                  "the attention kernels, and the rest; 'ceiling' is the FLOP/s over the peak, and ours over "
                  "Marian's measured step, if the rest took no time")
            print(f"{'dims':>6s} {'model':>7s} {'step s':>7s} {'products s':>11s} {'attention s':>12s} "
                  f"{'rest s':>7s} {'ceiling':>8s}")
            for label, row in mfu["sizes"].items():
                for name in MODELS:
                    part = row[name]
                    rest = part["step_seconds"] - part["products_seconds"] - part["attention_seconds"]
                    print(f"{label:>6s} {name:>7s} {part['step_seconds']:7.3f} {part['products_seconds']:11.3f} "
                          f"{part['attention_seconds']:12.3f} {rest:7.3f} "
                          f"{100 * part['ceiling_fraction_of_peak']:7.1f}%")
                print(f"{label:>6s} ceiling of ours/Marian: {row['ceiling_ratio']:.2f} (measured {row['ratio']:.2f})")


def print_report(results: dict) -> None:
    memory, beam, greedy = results["memory"], results["beam"], results["greedy"]
    print_training_report(results)
    print()
    print(HEADER)
    print_rate(f"beam-{beam['beams']} sentences/s ({beam['batch']} sentences, {beam['new_tokens']} new tokens)",
               beam, "sentences_per_s")
    print_rate(f"greedy sentences/s ({greedy['batch']} sentences, {greedy['new_tokens']} new tokens)",
               greedy, "sentences_per_s")
    print(f"{'peak training memory added, MiB (' + str(memory['batch_tokens']) + ' tokens)':50s} "
          f"{memory['ours_mib']:9.1f} {memory['marian_mib']:9.1f} {memory['ratio']:6.3f}")
    settings = results["settings"]
    print()
    print(f"beam-{settings['scaling_beams']} generate() seconds against new tokens "
          f"({settings['scaling_batch']} sentences; median wall; ratio = Marian time / ours):")
    print(f"{'new tokens':>10s} {'ours s':>10s} {'Marian s':>10s} {'wall':>6s} {'paired':>6s} {'CPU':>6s}")
    for row in results["generation_scaling"]:
        print(f"{row['new_tokens']:10d} {row['ours_s']:10.3f} {row['marian_s']:10.3f} {row['ratio']:6.2f} "
              f"{row['ratio_paired']:6.2f} {row['ratio_cpu']:6.2f}")
    print()
    print(f"peak training memory added (MiB) against batch tokens [{memory['method']}]:")
    print(f"{'tokens':>10s} {'ours':>10s} {'Marian':>10s} {'ours/Marian':>12s}")
    for row in results["memory_scaling"]:
        print(f"{row['batch_tokens']:10d} {row['ours_mib']:10.1f} {row['marian_mib']:10.1f} {row['ratio']:12.3f}")


# Command line ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    size = parser.add_argument_group("model size (both models)")
    size.add_argument("--vocab-size", type=int, default=8000)
    size.add_argument("--d-model", type=int, default=512)
    size.add_argument("--layers", type=int, default=6, help="encoder layers = decoder layers")
    size.add_argument("--heads", type=int, default=8)
    size.add_argument("--d-ff", type=int, default=2048)
    size.add_argument("--dropout", type=float, default=0.1)
    size.add_argument("--label-smoothing", type=float, default=0.0,
                      help="0: plain CE on both; > 0: the same label-smoothed CE on both")
    size.add_argument("--max-positions", type=int, default=512)
    size.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation, both")
    data = parser.add_argument_group("inputs")
    data.add_argument("--batch-tokens", type=int, default=2048, help="target tokens (padded) per training batch")
    data.add_argument("--src-len", type=int, default=32, help="padded source length")
    data.add_argument("--tgt-len", type=int, default=32, help="padded target length")
    data.add_argument("--min-len-fraction", type=float, default=0.75,
                      help="real sentence lengths are uniform in [fraction x padded length, padded length]")
    data.add_argument("--gen-batch", type=int, default=16, help="sentences per generate() call")
    data.add_argument("--gen-new-tokens", type=int, default=32)
    run = parser.add_argument_group("run")
    run.add_argument("--train-reps", type=int, default=5)
    run.add_argument("--gen-reps", type=int, default=5)
    run.add_argument("--memory-batch-tokens", type=int, nargs="*", default=[1024, 2048, 4096])
    run.add_argument("--scaling-lengths", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    run.add_argument("--scaling-batch", type=int, default=4)
    run.add_argument("--scaling-beams", type=int, default=4)
    run.add_argument("--scaling-reps", type=int, default=2)
    run.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    run.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16 runs under torch.autocast")
    run.add_argument("--threads", type=int, default=0,
                     help="torch intra-op threads (0: torch's default, one per core; --quick uses 1)")
    run.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s for MFU (CUDA)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-mfu", action="store_true",
                     help="skip the GEMM-peak measurement and the training MFU at base and cpu-preset dims")
    run.add_argument("--malloc", choices=("keep", "default"), default="keep",
                     help="keep: glibc's malloc keeps freed memory for reuse "
                          "(vaswani_training.lib.cpu_tuning.keep_freed_memory, as vaswani-train does), for both "
                          "models' speed measurements; default: glibc's defaults. The memory measurements run in fresh "
                          "processes with their own setting")
    run.add_argument("--compile", action="store_true",
                     help="torch.compile both models' forward for the training measurements (generate() stays eager)")
    run.add_argument("--main-job", action="store_true",
                     help="the training step at the cpu preset's dims and --batch-tokens (use 1024, the main job's) in "
                          "fp32 and, with native bf16, bf16: MFU and where the step's time goes, each precision "
                          "against its own GEMM peak")
    run.add_argument("--training-only", action="store_true",
                     help="measure training (tokens/s and MFU) only: no generation, no memory")
    run.add_argument("--quick", action="store_true", help="a tiny model and few repetitions (seconds)")
    run.add_argument("--output", default="benchmark.json", help="JSON file with all measurements")
    run.add_argument("--plot", default=None, help="PNG file for the scaling plots")
    parser.add_argument("--memory-child", default=None, choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab_size, args.d_model, args.layers, args.heads, args.d_ff = 256, 32, 2, 4, 64
        args.batch_tokens, args.src_len, args.tgt_len = 64, 8, 8
        args.gen_batch, args.gen_new_tokens = 2, 4
        args.train_reps = args.gen_reps = 2
        args.memory_batch_tokens = []
        args.scaling_lengths, args.scaling_batch, args.scaling_reps = [2, 4], 2, 1
        args.threads = args.threads or 1  # a tiny model gains nothing from threads, and spinning ones cost much
    args.max_positions = max(args.max_positions, args.src_len, args.tgt_len,
                             max(args.scaling_lengths + [args.gen_new_tokens]) + 2)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.dtype == "bf16" and args.device == "cpu":
        print("note: bf16 autocast on CPU is slow on CPUs without bf16 units", file=sys.stderr)
    return args


def progress(label: str, result: dict) -> None:
    print(f"{label}: ours/Marian {result['ratio']:.2f} (wall), {result['ratio_paired']:.2f} (paired), "
          f"{result['ratio_cpu']:.2f} (CPU)", flush=True)


def device_name(args) -> str:
    if args.device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {os.cpu_count()} x {name}"


def main_job_rows(args, results: dict, started: float) -> dict:
    """`--main-job`: the MFU table and the split of a step (products, attention kernels, the rest) at the `cpu`
    preset's dims and `--batch-tokens` (1,024: the main job's), in fp32 and, where the CPU computes bf16 natively,
    in bf16 autocast, each against the GEMM peak of its own precision measured in the same run."""
    from vaswani_training.lib.precision import cpu_has_native_bf16

    dtypes = ["fp32"] + (["bf16"] if args.device == "cuda" or cpu_has_native_bf16() else [])
    sizes = {"cpu": MFU_SIZES["cpu"]} if not args.quick else None
    results["mfu_by_dtype"] = {}
    for dtype in dtypes:
        measured = argparse.Namespace(**{**vars(args), "dtype": dtype})
        results["mfu_by_dtype"][dtype] = bench_mfu(measured, sizes)
        print(f"\n--- {dtype} ---")
        print_training_report({**results, "mfu": results["mfu_by_dtype"][dtype]})
    results["seconds"] = time.perf_counter() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.output} ({results['seconds']:.0f} s)")
    return results


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return None
    kept = False
    if args.malloc == "keep":
        from vaswani_training.lib.cpu_tuning import keep_freed_memory

        kept = keep_freed_memory()
    if args.main_job:
        return main_job_rows(args, {"device": device_name(args), "torch": torch.__version__,
                                    "threads": torch.get_num_threads(), "malloc_keeps_freed_memory": kept,
                                    "cpu_training_matmul": cpu_training_matmul() if args.device == "cpu" else None,
                                    "settings": {k: v for k, v in vars(args).items() if k != "memory_child"}},
                             time.perf_counter())
    torch.manual_seed(args.seed)
    models = {name: build_model(name, args) for name in MODELS}
    parameters = {name: count_parameters(model) for name, model in models.items()}
    device = device_name(args)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}; parameters "
          f"ours {parameters['ours']:,}, Marian {parameters['marian']:,}; glibc malloc keeps freed memory: "
          f"{'yes' if kept else 'no'} (--malloc {args.malloc})", flush=True)
    started = time.perf_counter()
    results = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "malloc_keeps_freed_memory": kept,
               # the library of our fp32 CPU training linears (bf16 autocast and CUDA do not use that path)
               "cpu_training_matmul": cpu_training_matmul() if args.device == "cpu" and args.dtype == "fp32" else None,
               "parameters": parameters, "settings": {k: v for k, v in vars(args).items() if k != "memory_child"}}
    import transformers

    results["transformers"] = transformers.__version__
    results["training"] = bench_training(models, args)
    progress("training tokens/s", results["training"])
    if not args.no_mfu:
        results["mfu"] = bench_mfu(args)
        for label, row in results["mfu"]["sizes"].items():
            print(f"training MFU at {label} dims: ours {100 * row['ours']['fraction_of_peak']:.1f}% of the measured "
                  f"GEMM peak, Marian {100 * row['marian']['fraction_of_peak']:.1f}%", flush=True)
    if args.training_only:
        results["seconds"] = time.perf_counter() - started
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2))
        print_training_report(results)
        print(f"\nwrote {args.output} ({results['seconds']:.0f} s)")
        return results
    results["beam"] = bench_generation(models, args, 4, args.gen_new_tokens, args.gen_batch, args.gen_reps)
    progress("beam-4 sentences/s", results["beam"])
    results["greedy"] = bench_generation(models, args, 1, args.gen_new_tokens, args.gen_batch, args.gen_reps)
    progress("greedy sentences/s", results["greedy"])
    results["generation_scaling"] = bench_generation_scaling(models, args)
    del models
    gc.collect()
    results["memory"], results["memory_scaling"] = bench_memory(args)
    results["seconds"] = time.perf_counter() - started
    print_report(results)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    print(f"\nwrote {args.output}" + (f" and {args.plot}" if args.plot else "") + f" ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
