"""benchmarks/benchmark.py: it runs end to end on a tiny size and writes what it promises; its FLOP count is exact.

No timing is asserted here: timings belong to the benchmark's own output (ratios measured in one run).
"""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "benchmark.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vaswani_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("benchmark")
    output, plot = folder / "bench.json", folder / "bench.png"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--output", str(output), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=600, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ours/Marian" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(output.read_text())


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_quick_run_writes_every_measurement(quick_run):
    results = quick_run
    # identical sizes: the same number of trained parameters (Marian's frozen sinusoidal tables are not trained)
    assert results["parameters"]["ours"] == results["parameters"]["marian"] > 0
    train = results["training"]
    for name in ("ours", "marian"):
        assert positive(train[name]["tokens_per_s"]) and positive(train[name]["tokens_per_s_cpu"])
        assert len(train[name]["seconds"]) == results["settings"]["train_reps"]
        assert all(positive(s) for s in train[name]["seconds"] + train[name]["cpu_seconds"])
        assert positive(train[name]["last_loss"])
    assert positive(train["ratio"]) and positive(train["ratio_cpu"]) and positive(train["target_tokens_per_step"])
    for part, beams in (("beam", 4), ("greedy", 1)):
        measured = results[part]
        assert measured["beams"] == beams and positive(measured["ratio"]) and positive(measured["ratio_cpu"])
        for name in ("ours", "marian"):
            assert positive(measured[name]["sentences_per_s"])
    memory = results["memory"]
    assert positive(memory["ours_mib"]) and positive(memory["marian_mib"]) and positive(memory["ratio"])
    assert memory["batch_tokens"] == results["settings"]["batch_tokens"]
    rows = results["generation_scaling"]
    assert [row["new_tokens"] for row in rows] == results["settings"]["scaling_lengths"]
    assert all(positive(row["ours_s"]) and positive(row["marian_s"]) and positive(row["ratio"]) for row in rows)
    assert all(positive(row["ours_mib"]) and positive(row["marian_mib"]) for row in results["memory_scaling"])


def test_models_are_built_with_identical_sizes():
    benchmark = load_benchmark()
    args = benchmark.parse_args(["--quick"])
    ours, marian = (benchmark.build_model(name, args) for name in benchmark.MODELS)

    # Marian's weight matrices and ours have the same shapes (q, k, v separate in both).
    ours_rows = sum(p.shape[0] for p in ours.parameters() if p.dim() == 2)
    marian_rows = sum(p.shape[0] for p in marian.parameters() if p.dim() == 2 and p.requires_grad)
    assert ours_rows == marian_rows
    assert benchmark.count_parameters(ours) == benchmark.count_parameters(marian)
    assert marian.config.activation_function == ours.config.activation_function == "relu"
    assert marian.config.scale_embedding and ours.config.scale_embedding
    assert marian.config.decoder_start_token_id == ours.config.decoder_start_token_id
    assert marian.config.pad_token_id == ours.config.pad_token_id


def test_same_batch_for_both_models_with_padding_and_labels():
    benchmark = load_benchmark()
    args = benchmark.parse_args(["--quick"])
    first, again = benchmark.make_batch(args, 64), benchmark.make_batch(args, 64)
    assert all(torch.equal(first[key], again[key]) for key in first)
    labels, mask = first["labels"], first["attention_mask"]
    assert labels.shape == (64 // args.tgt_len, args.tgt_len)
    assert labels.eq(-100).any() and mask.eq(0).any()  # some padding on both sides
    assert first["input_ids"].masked_select(mask.eq(0)).eq(benchmark.PAD).all()


def test_training_flops_count_every_matmul_exactly():
    """The CUDA MFU numerator: `training_flops` equals torch's FLOP counter on a forward + backward of our model on
    the padded batch (eager attention, whose matmuls the counter sees one by one; dropout off): the plain model's
    step, what runs on a GPU. On a CPU the training commands' step skips the padding and may multiply in oneDNN,
    whose operator the counter does not know."""
    from torch.utils.flop_counter import FlopCounterMode

    benchmark = load_benchmark()
    args = benchmark.parse_args(["--quick", "--attn", "eager", "--dropout", "0"])
    model = benchmark.build_model("ours", args).train()
    batch = benchmark.make_batch(args, args.batch_tokens)
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    assert counter.get_total_flops() == benchmark.training_flops(args, batch["input_ids"].shape,
                                                                 batch["labels"].shape)


def test_real_token_flops_equal_the_counter_on_unpadded_sentences():
    """The CPU MFU numerator counts real tokens only: on a batch of one sentence per row length (no padding) it is
    torch's FLOP count of the plain model's forward + backward; adding padding to the same sentences does not change
    it."""
    from torch.utils.flop_counter import FlopCounterMode

    benchmark = load_benchmark()
    args = benchmark.parse_args(["--quick", "--attn", "eager", "--dropout", "0"])
    model = benchmark.build_model("ours", args).train()
    padded = benchmark.make_batch(args, args.batch_tokens)
    total = 0
    for row in range(padded["labels"].shape[0]):  # each sentence alone, cut to its real lengths
        s = int(padded["attention_mask"][row].sum())
        t = int(padded["labels"][row].ne(-100).sum())
        one = {"input_ids": padded["input_ids"][row:row + 1, :s],
               "attention_mask": padded["attention_mask"][row:row + 1, :s],
               "labels": padded["labels"][row:row + 1, :t]}
        with FlopCounterMode(display=False) as counter:
            model(**one).loss.backward()
        total += counter.get_total_flops()
        assert counter.get_total_flops() == benchmark.training_flops_real_tokens(args, one)
    real = benchmark.training_flops_real_tokens(args, padded)
    assert real == total
    assert real < benchmark.training_flops(args, padded["input_ids"].shape, padded["labels"].shape)


def test_quick_run_reports_mfu_against_the_measured_gemm_peak(quick_run):
    mfu = quick_run["mfu"]
    assert positive(mfu["gemm_peak"]["peak_flops_per_s"]) and len(mfu["gemm_peak"]["shapes"]) >= 3
    row = mfu["sizes"]["quick"]
    assert 0 < row["real_tokens"] < row["padded_tokens"]
    for name in ("ours", "marian"):
        assert positive(row[name]["model_flops_per_s"])
        assert row[name]["fraction_of_peak"] == pytest.approx(
            row[name]["model_flops_per_s"] / mfu["gemm_peak"]["peak_flops_per_s"])


def test_quick_run_says_where_the_step_goes(quick_run):
    """The split's fields and the formulas that derive the ceilings from them. How the ceilings compare with the
    measured fractions compares separately timed runs: that stays in the benchmark's output."""
    row = quick_run["mfu"]["sizes"]["quick"]
    peak = quick_run["mfu"]["gemm_peak"]["peak_flops_per_s"]
    for name in ("ours", "marian"):
        part = row[name]
        inside = part["products_seconds"] + part["attention_seconds"]
        assert positive(part["products_seconds"]) and part["attention_seconds"] >= 0 and positive(part["step_seconds"])
        assert part["ceiling_fraction_of_peak"] == pytest.approx(row["flops_per_step_real_tokens"] / inside / peak)
    assert row["ceiling_ratio"] == pytest.approx(row["marian"]["step_seconds"] / (
        row["ours"]["products_seconds"] + row["ours"]["attention_seconds"]))


def test_the_main_job_rows_split_a_step_in_each_precision_the_cpu_computes(tmp_path):
    from vaswani_training.lib.precision import cpu_has_native_bf16

    output = tmp_path / "main_job.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--main-job", "--output", str(output)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    expected = {"fp32", "bf16"} if cpu_has_native_bf16() else {"fp32"}
    assert set(results["mfu_by_dtype"]) == expected and "training" not in results
    for dtype, mfu in results["mfu_by_dtype"].items():
        assert mfu["gemm_peak"]["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
        row = mfu["sizes"]["quick"]
        assert positive(row["ours"]["products_seconds"]) and positive(row["marian"]["step_seconds"])
        assert f"--- {dtype} ---" in done.stdout


def test_time_products_sees_every_product_and_attention_kernel_of_a_step():
    """Each linear layer's three products (forward, input gradient, weight gradient; the fused output projection and
    loss too) and each attention block's flash kernel, forward and backward, are timed; nothing else is."""
    benchmark = load_benchmark()
    args = benchmark.parse_args(["--quick"])
    torch.manual_seed(0)
    model = benchmark.build_model("ours", args).train()
    optimizer = benchmark.make_optimizer(model)
    batch = benchmark.make_batch(args, args.batch_tokens)
    # the first training step of a process times the two matmul libraries once (cpu_training_matmul)
    benchmark.training_step("ours", model, optimizer, batch, args)
    measured = benchmark.time_products("ours", model, optimizer, batch, args)
    layers = args.layers
    linears = layers * 6 + layers * 10 + 1  # encoder: q, k, v, out, fc1, fc2; decoder: + cross q, k, v, out; lm_head
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == linears
    assert measured["product_calls"] == 3 * linears
    assert measured["attention_calls"] == 2 * (layers + 2 * layers)  # forward + backward per attention block
    # disjoint intervals inside the one timed step, not a comparison of two timed runs
    assert 0 < measured["products"] + measured["attention"] < measured["step"]


def test_dropout_benchmark_times_both_dropouts_and_restores_the_kernel(monkeypatch):
    from vaswani_hf import kernels_vaswani

    spec = importlib.util.spec_from_file_location("bench_dropout", ROOT / "benchmarks" / "bench_dropout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = {"cpu": 0, "torch": 0}
    cheap, dropout = kernels_vaswani._CPUDropoutFunction.apply, torch.nn.functional.dropout
    monkeypatch.setattr(kernels_vaswani._CPUDropoutFunction, "apply",
                        lambda *a: calls.__setitem__("cpu", calls["cpu"] + 1) or cheap(*a))
    monkeypatch.setattr(torch.nn.functional, "dropout",
                        lambda *a, **k: calls.__setitem__("torch", calls["torch"] + 1) or dropout(*a, **k))
    result = bench.main(["--d-model", "16", "--layers", "1", "--heads", "2", "--d-ff", "32", "--vocab-size", "50",
                         "--batch-tokens", "64", "--src-len", "8", "--tgt-len", "8", "--train-reps", "1"])
    assert len(result["seconds"]["torch"]) == len(result["seconds"]["cpu"]) == 2
    assert result["ratio"] > 0 and result["ratio_paired"] > 0
    # three steps of each variant (one untimed); a step has 2 embedding and 2 + 3 sublayer dropouts of p = 0.1 (1
    # encoder, 1 decoder layer) and 2 activation dropouts of p = 0, which F.dropout takes in both variants
    assert calls["cpu"] == 3 * 7  # the cheaper mask
    assert calls["torch"] == 3 * 7 + 2 * 3 * 2
    assert kernels_vaswani.cpu_dropout is bench.SHIPPED["cpu_dropout"]


def test_training_paths_benchmark_times_the_four_variants(monkeypatch):
    from vaswani_hf import fast_paths_vaswani, kernels_vaswani

    spec = importlib.util.spec_from_file_location("bench_training_paths",
                                                  ROOT / "benchmarks" / "bench_training_paths.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = {"plain": 0, "fused": 0}
    plain, fused = bench.BASELINE["attention"], bench.SHIPPED["loss"]
    # the kernels the benchmark swaps, put back by monkeypatch when the test ends whatever happens
    monkeypatch.setattr(kernels_vaswani, "sdpa_attention_forward", bench.SHIPPED["attention"])
    monkeypatch.setattr(fast_paths_vaswani, "cpu_projected_cross_entropy", fused)
    monkeypatch.setitem(bench.BASELINE, "attention",
                        lambda *a, **k: calls.__setitem__("plain", calls["plain"] + 1) or plain(*a, **k))
    monkeypatch.setitem(bench.SHIPPED, "loss", lambda *a: calls.__setitem__("fused", calls["fused"] + 1) or fused(*a))
    result = bench.main(["--d-model", "16", "--layers", "1", "--heads", "2", "--d-ff", "32", "--vocab-size", "50",
                         "--batch-tokens", "64", "--src-len", "8", "--tgt-len", "8", "--train-reps", "1",
                         "--malloc", "default"])
    assert all(len(seconds) == 2 for seconds in result["seconds"].values()) and len(result["seconds"]) == 4
    assert result["ratio"]["baseline (plain attention, F.cross_entropy)"] == 1.0
    assert all(ratio > 0 for ratio in result["ratio_paired"].values())
    # 3 steps (1 untimed, 2 timed) of each variant; a step has 3 attentions (1 encoder, 1 decoder layer)
    assert calls["plain"] == 2 * 3 * 3  # the baseline and "fused loss only"
    assert calls["fused"] == 2 * 3  # "fused loss only" and the default
    # the shipped kernels are back where the training step looks them up
    assert kernels_vaswani.sdpa_attention_forward is bench.SHIPPED["attention"]
    assert fast_paths_vaswani.cpu_projected_cross_entropy is bench.SHIPPED["loss"]


def test_real_steps_benchmark_trains_on_real_batches_and_writes_its_record(tmp_path):
    output = tmp_path / "real.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_real_steps.py"), "--steps", "4",
                           "--warmup", "1", "--precision", "fp32", "--long-run-dropout", "--output", str(output)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["steps_timed"] == 3 and result["precision"] == "fp32" and result["long_run_dropout"] is True
    assert positive(result["median_step_s"]) and positive(result["tokens_per_second"])
    # a real batch of the cpu preset: about 1,024 padded tokens a side, so 1,000-2,048 real ones a step
    assert 1000 < result["tokens_per_second"] * result["mean_step_s"] <= 2048
    assert result["code"] != "unknown" and result["torch"] == torch.__version__
    assert f"median step {result['median_step_s'] * 1e3:.1f} ms" in done.stdout


def test_real_steps_benchmark_alternates_batch_by_batch_with_a_baseline_kernels_file(tmp_path):
    """--baseline-kernels: every batch once with the tree's kernels and once with the file's, whose names and classes
    (the installed dropout modules', the fused loss the step looks up in fast_paths_vaswani) are the ones in use."""
    calls, baseline = tmp_path / "calls.txt", tmp_path / "kernels_baseline.py"
    baseline.write_text((ROOT / "vaswani_hf" / "kernels_vaswani.py").read_text() + textwrap.dedent(f"""

        def _note(what):
            with open({str(calls)!r}, "a") as file:
                file.write(what + "\\n")

        _fused_loss = cpu_projected_cross_entropy

        def cpu_projected_cross_entropy(*args, **kwargs):
            _note("loss")
            return _fused_loss(*args, **kwargs)

        class CPUDropout(CPUDropout):
            def forward(self, x):
                _note("dropout")
                return super().forward(x)
        """))
    output = tmp_path / "paired.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_real_steps.py"), "--steps", "4",
                           "--warmup", "1", "--precision", "fp32", "--baseline-kernels", str(baseline),
                           "--output", str(output)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    noted = calls.read_text().split()
    assert noted.count("loss") == 4  # one fused loss a batch, the baseline's: 4 batches, each once with it
    dropouts = noted.count("dropout")
    assert dropouts > 0 and dropouts % 4 == 0  # the baseline's class on the model's dropout modules, every step
    assert result["steps_timed"] == 3 and positive(result["paired"]["baseline_median_step_s"])
    assert positive(result["paired"]["median_paired_ratio"]) and positive(result["paired"]["ratio_of_medians"])
    assert "baseline / this tree" in done.stdout


def test_decoding_products_benchmark_times_every_product_of_a_step_in_each_library(monkeypatch):
    from vaswani_hf import kernels_vaswani

    spec = importlib.util.spec_from_file_location("bench_decoding_products",
                                                  ROOT / "benchmarks" / "bench_decoding_products.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []
    packed_linear = kernels_vaswani.packed_linear
    monkeypatch.setattr(kernels_vaswani, "packed_linear", lambda x, packed, bias: calls.append(packed[2])
                        or packed_linear(x, packed, bias))
    shapes = bench.step_shapes(d_model=16, d_ff=32, layers=2, vocab_size=50)
    assert len(shapes) == 2 * 6 + 1 and shapes[-1] == (16, 50) and shapes[0] == (16, 48)
    report = bench.main(["--preset", "cpu", "--vocab_size", "50", "--rows", "3", "8", "--steps", "2", "--warmup", "1"])
    libraries = {"blas"} | ({"onednn"} if kernels_vaswani.has_onednn_linear() else set()) \
        | ({"mkl"} if kernels_vaswani.has_mkl_packed_linear() else set())
    for result in report["results"].values():
        assert set(result["ms_per_step"]) == libraries and all(positive(t) for t in result["ms_per_step"].values())
        if "onednn" in libraries:
            assert result["over_onednn"]["onednn"] == 1.0
    # each packed library: 2 row counts x (1 warm-up + 2 timed) steps x 19 products (3 layers x 6 + the projection)
    assert {name: calls.count(name) for name in set(calls)} == {name: 2 * 3 * 19 for name in libraries - {"blas"}}


def test_translate_benchmark_times_both_layouts_and_digests_the_translations(model_folder):
    import hashlib

    from transformers import AutoTokenizer

    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.decoding.translate import translate_sentences

    spec = importlib.util.spec_from_file_location("bench_translate", ROOT / "benchmarks" / "bench_translate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--model_dir", str(model_folder), "--one_at_a_time", "3", "--batched", "5",
                         "--batch_size", "2"])
    assert result["one_at_a_time"]["sentences"] == 3 and result["batched"]["sentences"] == 5
    assert positive(result["one_at_a_time"]["sentences_per_second"])
    assert positive(result["batched"]["sentences_per_second"])
    model = VaswaniForConditionalGeneration.from_pretrained(model_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    expected = translate_sentences(model, tokenizer, bench.german("test")[:3], batch_size=1) + translate_sentences(
        model, tokenizer, bench.german("validation")[:5], batch_size=2)
    assert result["outputs_md5"] == hashlib.md5("\n".join(expected).encode()).hexdigest()
    assert len(bench.german("validation")) == 1014 and len(bench.german("test")) == 1000
