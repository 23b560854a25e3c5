"""Conversion of a trained model to CTranslate2 (https://github.com/OpenNMT/CTranslate2), a C++ inference engine for
Transformer models with int8 quantization, for fast CPU and GPU translation; and translating with the converted model.

CTranslate2 has no converter for this model, so `build_ct2_spec` fills its `TransformerSpec` directly, as
its own fairseq and transformers (BART/Marian) converters do:

- post-LN (§3.1) is `pre_norm=False`: every sublayer's LayerNorm follows the residual sum; `normalize_before=True`
  models convert to `pre_norm=True` with the final LayerNorm of each stack;
- embeddings are multiplied by `sqrt(d_model)` (§3.4): `scale_embeddings`;
- positions (§3.5) are written as an explicit table. This model interleaves sines and cosines as the paper's
  formula does (`PE(pos, 2i) = sin`, `PE(pos, 2i+1) = cos`); CTranslate2's built-in sinusoidal encoding is a
  different table (sines and cosines in two blocks, as in fairseq and OpenNMT; with it the log-probabilities of a
  test model move by up to 1.5 nats), so it is not used. The table has
  `max_positions` rows (default `config.max_position_embeddings`), which bounds source and output lengths;
- self-attention's `q_proj`, `k_proj`, `v_proj` stacked (q|k|v blocks, heads contiguous in each) are exactly
  CTranslate2's fused `linear[0]`; encoder-decoder attention maps `q_proj` to `linear[0]` and `k_proj`,
  `v_proj` stacked (k|v) to `linear[1]`; `out_proj` is `linear[2]` / `linear[1]`;
- the embeddings and output projection are one matrix (§3.4); CTranslate2 stores it once (it aliases equal
  variables);
- the vocabulary is the tokenizer's, in id order; `<s>` starts the decoder, `</s>` ends it, and sources are
  passed with their `</s>` as the tokenizer makes them (`add_source_eos=False`).

Numerics: in float32, CTranslate2's greedy and beam search outputs are token-identical to `model.generate` with the
same settings (tested), with `length_penalty` meaning the same `|Y| ** alpha` when |Y| counts `</s>`, which
CTranslate2 does with `return_end_token=True` (`ct2_translate` sets it). CTranslate2 has no GNMT penalty and
one maximum length per call (`max_decoding_length`); a hypothesis that reaches it ends without `</s>`.

`ctranslate2` is an optional dependency (`pip install ctranslate2`, or the `ct2` extra).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from ..checks import swap_in_folder
from ..modeling_vaswani import sinusoidal_table

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")
# Files a model folder may have that make the tokenizer loadable from the converted folder too.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_new": "GELUTanh", "silu": "SWISH", "swish": "SWISH",
                "tanh": "Tanh"}

DECODING_FILE = "decoding.json"  # the converted folder's notes: the decoding that reproduces the model folder's

__all__ = ["DECODING_FILE", "QUANTIZATIONS", "build_ct2_spec", "convert_to_ct2", "ct2_decoding", "ct2_translate",
           "vocabulary_from_tokenizer"]


def _import_ctranslate2():
    try:
        import ctranslate2
    except ImportError as error:
        raise ImportError("Converting to CTranslate2 needs the ctranslate2 package: pip install ctranslate2 (or "
                          "pip install 'vaswani-hf[ct2]').") from error
    return ctranslate2


def vocabulary_from_tokenizer(tokenizer, size: int | None = None) -> list[str]:
    """The tokenizer's tokens in id order (`tokens[i]` is id `i`), padded to `size` entries with unused
    placeholder tokens when the model's embedding has more rows than the tokenizer has tokens.

    Raises:
        ValueError: ids that are not `0..n-1`, or a tokenizer larger than `size`.
    """
    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        if not 0 <= index < len(tokens) or tokens[index] is not None:
            raise ValueError(f"The tokenizer's ids are not 0..{len(vocab) - 1} (token {token!r} has id {index}).")
        tokens[index] = token
    if size is not None:
        if len(tokens) > size:
            raise ValueError(f"The tokenizer has {len(tokens)} tokens but the model's vocabulary has only {size}; "
                             "this tokenizer does not belong to this model.")
        taken = set(tokens)
        extra = (f"<unused{i}>" for i in range(size * 2))
        tokens += [t for t in extra if t not in taken][: size - len(tokens)]
    return tokens


def _numpy(tensor: torch.Tensor):
    return tensor.detach().to(torch.float32).cpu().clone().numpy()


def _set_linear(spec, linear: torch.nn.Linear) -> None:
    spec.weight = _numpy(linear.weight)
    if linear.bias is not None:
        spec.bias = _numpy(linear.bias)


def _set_layer_norm(spec, layer_norm: torch.nn.LayerNorm) -> None:
    spec.gamma = _numpy(layer_norm.weight)
    spec.beta = _numpy(layer_norm.bias)


def _set_stack_inputs(spec, stack, config, max_positions: int) -> None:
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = _numpy(stack.embed_tokens.weight)
    spec.scale_embeddings = math.sqrt(config.d_model) if config.scale_embedding else 1.0
    if config.position_embedding_type == "learned":
        table = stack.embed_positions.weight
    else:
        table = sinusoidal_table(max_positions, config.d_model)  # interleaved sin/cos, §3.5
    spec.position_encodings.encodings = _numpy(table)
    if stack.layer_norm is not None:  # pre-LN: the final LayerNorm of the stack
        _set_layer_norm(spec.layer_norm, stack.layer_norm)


def _set_stacked_linear(spec, *linears: torch.nn.Linear) -> None:
    spec.weight = _numpy(torch.cat([linear.weight for linear in linears]))
    spec.bias = _numpy(torch.cat([linear.bias for linear in linears]))


def _set_self_attention(spec, attention) -> None:
    # (3D, D): q | k | v, the layout CTranslate2 fuses to
    _set_stacked_linear(spec.linear[0], attention.q_proj, attention.k_proj, attention.v_proj)
    _set_linear(spec.linear[1], attention.out_proj)


def _set_cross_attention(spec, attention) -> None:
    _set_linear(spec.linear[0], attention.q_proj)
    _set_stacked_linear(spec.linear[1], attention.k_proj, attention.v_proj)  # (2D, D): k | v
    _set_linear(spec.linear[2], attention.out_proj)


def _set_ffn(spec, layer) -> None:
    _set_linear(spec.linear_0, layer.fc1)
    _set_linear(spec.linear_1, layer.fc2)
    _set_layer_norm(spec.layer_norm, layer.final_layer_norm)


def build_ct2_spec(model, vocabulary: Sequence[str], max_positions: int | None = None):
    """Fill a `ctranslate2.specs.TransformerSpec` from a `VaswaniForConditionalGeneration`.

    Args:
        model: the model (any device and dtype; weights are copied as float32).
        vocabulary: tokens in id order, `len(vocabulary) == config.vocab_size` (see
            `vocabulary_from_tokenizer`); the target side uses the first `config.decoder_vocab_size`.
        max_positions: rows of the written sinusoidal table (default `config.max_position_embeddings`); sources
            and outputs must fit in it. Learned positions keep their own table, so it is refused for them.
    Returns:
        the spec, not yet validated, quantized or saved.
    Raises:
        ValueError: a vocabulary of the wrong size, special token ids outside it, an activation CTranslate2 lacks;
            a `max_positions` that is not a positive integer, or given for a model with learned positions.
        ImportError: ctranslate2 is not installed.
    """
    ctranslate2 = _import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    vocabulary = list(vocabulary)
    if len(vocabulary) != config.vocab_size:
        raise ValueError(f"The vocabulary has {len(vocabulary)} tokens but the model's embedding has "
                         f"{config.vocab_size} rows.")
    if config.activation_function not in _ACTIVATIONS:
        raise ValueError(f"CTranslate2 has no {config.activation_function!r} activation; supported: "
                         f"{', '.join(_ACTIVATIONS)}.")
    if max_positions is not None:
        if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions (--max_positions) must be a positive integer, the rows of the converted "
                             f"position table (the longest source or output), got {max_positions!r}; leave it out "
                             f"for the model's max_position_embeddings={config.max_position_embeddings}.")
        if config.position_embedding_type == "learned":
            raise ValueError(f"max_positions (--max_positions) sizes a sinusoidal position table, but this model's "
                             f"positions are learned: their table of max_position_embeddings="
                             f"{config.max_position_embeddings} rows is fixed by its weights and is converted as it "
                             f"is. Leave --max_positions out.")
    max_positions = max_positions or config.max_position_embeddings
    del ctranslate2

    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers),
        config.num_heads,
        pre_norm=config.normalize_before,
        activation=getattr(common_spec.Activation, _ACTIVATIONS[config.activation_function]),
    )
    encoder, decoder = model.get_encoder(), model.get_decoder()
    _set_stack_inputs(spec.encoder, encoder, config, max_positions)
    for layer_spec, layer in zip(spec.encoder.layer, encoder.layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attn)
        _set_layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _set_ffn(layer_spec.ffn, layer)

    _set_stack_inputs(spec.decoder, decoder, config, max_positions)
    for layer_spec, layer in zip(spec.decoder.layer, decoder.layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attn)
        _set_layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _set_cross_attention(layer_spec.attention, layer.encoder_attn)
        _set_layer_norm(layer_spec.attention.layer_norm, layer.encoder_attn_layer_norm)
        _set_ffn(layer_spec.ffn, layer)
    _set_linear(spec.decoder.projection, model.lm_head)

    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary[: config.decoder_vocab_size])
    special = {}
    for name in ("bos_token_id", "eos_token_id", "decoder_start_token_id"):
        index = getattr(config, name)
        if index is None or not 0 <= index < config.decoder_vocab_size:
            raise ValueError(f"config.{name}={index} is not an id of the target vocabulary.")
        special[name] = vocabulary[index]
    spec.config.bos_token = special["bos_token_id"]
    spec.config.eos_token = special["eos_token_id"]
    spec.config.decoder_start_token = special["decoder_start_token_id"]
    spec.config.unk_token = "<unk>" if "<unk>" in vocabulary else vocabulary[0]
    spec.config.add_source_eos = False  # the tokenizer already ends sources with </s>
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    return spec


def ct2_decoding(model_dir: str | os.PathLike, generation, length_penalty: float | None = None) -> dict:
    """The beam and length penalty CTranslate2 decodes a converted folder with, and why, for its `decoding.json`.

    CTranslate2 has only transformers' length penalty (score / |Y|^alpha). A folder whose `generation_config.json`
    says that form (or nothing) keeps its beam and alpha. One that chose the paper's GNMT form
    (`length_penalty_style: "gnmt"`) gets `length_penalty` where it is given, else the nearest equivalent by the rule
    its run chose with: among the validation scores its `metrics.json` holds for the same checkpoints and beam
    (`chosen_on_validation`), the best setting in transformers' form whose output is at least as long as the
    references (`best_setting(..., 1.0)`).

    Returns:
        `{"num_beams", "length_penalty", "length_penalty_style": "hf", "source": "generation_config.json" | "given" |
        "validation", "note"}`.
    Raises:
        ValueError: a GNMT folder, no `length_penalty`, and no validation scores in transformers' form to choose from.
    """
    from ..checks import read_json
    from .search import best_setting

    beams = getattr(generation, "num_beams", None) or 4
    alpha = getattr(generation, "length_penalty", None)
    alpha = 1.0 if alpha is None else float(alpha)
    style = getattr(generation, "length_penalty_style", None) or "hf"
    decoding = {"num_beams": beams, "length_penalty_style": "hf"}
    if style != "gnmt":
        return {**decoding, "length_penalty": alpha, "source": "generation_config.json",
                "note": f"beam {beams}, length penalty {alpha:g} (transformers' form), as generation_config.json says"}
    if length_penalty is not None:
        return {**decoding, "length_penalty": float(length_penalty), "source": "given",
                "note": f"beam {beams}, length penalty {float(length_penalty):g} in transformers' form as given; the "
                        f"model folder chose {alpha:g} in the paper's GNMT form, which CTranslate2 cannot express"}
    metrics_path = Path(model_dir) / "metrics.json"
    search = read_json(metrics_path).get("chosen_on_validation") if metrics_path.is_file() else None
    rows = []
    if isinstance(search, dict) and isinstance(search.get("chosen"), dict):
        chosen = search["chosen"]
        rows = [row for row in search.get("tried", []) if isinstance(row, dict)
                and row.get("length_penalty_style") == "hf" and row.get("num_beams") == beams
                and row.get("average_last") == chosen.get("average_last")
                and isinstance(row.get("bleu"), (int, float)) and isinstance(row.get("length_ratio"), (int, float))]
    if not rows:
        raise ValueError(
            f"{model_dir}: its generation_config.json decodes with the paper's GNMT length penalty (alpha {alpha:g}), "
            "which CTranslate2 cannot express (it divides by |Y|^alpha only), and its metrics.json holds no "
            "validation scores in that form to choose the nearest setting from. Pass --length_penalty ALPHA "
            "(length_penalty=ALPHA) to convert with transformers' form and that alpha.")
    best = best_setting(rows, 1.0)
    return {**decoding, "length_penalty": float(best["length_penalty"]), "source": "validation",
            "note": f"beam {beams}, length penalty {best['length_penalty']:g} in transformers' form: the best such "
                    f"setting on validation by the run's rule (BLEU {best['bleu']}, length ratio "
                    f"{best['length_ratio']}); the model folder chose {alpha:g} in the paper's GNMT form (BLEU "
                    f"{search['chosen'].get('bleu')}), which CTranslate2 cannot express"}


def convert_to_ct2(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    quantization: str | None = None,
    vocabulary: Sequence[str] | None = None,
    max_positions: int | None = None,
    force: bool = False,
    length_penalty: float | None = None,
) -> Path:
    """Convert a saved `VaswaniForConditionalGeneration` folder into a CTranslate2 model folder.

    Args:
        model_dir: a folder from `save_pretrained` (or a Trainer checkpoint, or an averaged model) with its
            tokenizer.
        output_dir: the CTranslate2 folder to write (`model.bin`, `config.json`, `shared_vocabulary.json`, and the
            tokenizer files so that `AutoTokenizer.from_pretrained(output_dir)` works). Written to a temporary folder
            beside it and renamed into place.
        quantization: `None` (keep float32) or one of `QUANTIZATIONS`, e.g. `"int8"` for CPU inference.
            CTranslate2 can also convert at load time: `ctranslate2.Translator(path, compute_type="int8")`.
        vocabulary: tokens in id order, when `model_dir` has no tokenizer.
        max_positions: rows of the written position table (default `config.max_position_embeddings`).
        force: replace an existing `output_dir`; never one that is, contains or lies inside `model_dir`.
        length_penalty: transformers'-form alpha for a folder that chose the GNMT form (`ct2_decoding`).
    Returns:
        `Path(output_dir)`, which also holds `decoding.json`: the beam and length penalty to translate with, and why
        (`ct2_decoding`).
    Raises:
        FileExistsError: `output_dir` exists and `force` is False.
        ValueError: `output_dir` is, contains or lies inside `model_dir` (`vaswani_hf.checks.CheckError`), an
            unknown quantization, no tokenizer and no `vocabulary`, a vocabulary that does not fit, a GNMT length
            penalty that no setting can stand for (`ct2_decoding`).
        ImportError: ctranslate2 is not installed.
    """
    from ..checks import check_output_dir, check_output_not_in_inputs

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    # Replacing output_dir must never remove the model folder (a training run: checkpoints, metrics), force or not.
    check_output_not_in_inputs(output_dir, [model_dir])
    check_output_dir(output_dir)
    _import_ctranslate2()
    from transformers import AutoTokenizer

    from ..modeling_vaswani import VaswaniForConditionalGeneration

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}.")
    if output_dir.exists() and not force:
        raise FileExistsError(f"{output_dir} already exists; pass force=True (--force) to replace it.")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a saved model folder (no config.json).")
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).eval()
    decoding = ct2_decoding(model_dir, model.generation_config, length_penalty)  # before any work
    tokenizer_files = [model_dir / name for name in _TOKENIZER_FILES if (model_dir / name).is_file()]
    if vocabulary is None:
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: save the tokenizer with the model, or pass "
                             "vocabulary=[tokens in id order].")
        vocabulary = vocabulary_from_tokenizer(AutoTokenizer.from_pretrained(model_dir), model.config.vocab_size)

    spec = build_ct2_spec(model, vocabulary, max_positions)
    for path in tokenizer_files:
        spec.register_file(str(path))
    spec.validate()
    spec.optimize(quantization=quantization)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.", suffix=".tmp"))
    try:
        spec.save(str(staging))
        (staging / DECODING_FILE).write_text(json.dumps(decoding, indent=2) + "\n", encoding="utf-8")
        swap_in_folder(staging, output_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def ct2_translate(
    translator,
    tokenizer,
    sentences: Sequence[str],
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_b: int = 50,
    **translate_kwargs,
) -> list[str]:
    """Translate `sentences` with a `ctranslate2.Translator` of a converted model (`convert_to_ct2`).

    Sources are tokenized with `tokenizer` (ending in `</s>`, as the model was trained); the decoding matches
    `model.generate(num_beams=beam_size, length_penalty=length_penalty, early_stopping=True)`: |Y| counts
    `</s>` (`return_end_token=True`, and the `</s>` is removed afterwards). The maximum output length is the
    longest source in the call + `max_len_b` tokens.

    Returns:
        one detokenized translation per sentence, in input order.
    """
    sentences = list(sentences)
    if not sentences:
        return []
    ids = tokenizer(sentences)["input_ids"]
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in ids]
    translate_kwargs.setdefault("max_decoding_length", max(map(len, ids)) + max_len_b)
    results = translator.translate_batch(tokens, beam_size=beam_size, length_penalty=length_penalty,
                                         return_end_token=True, **translate_kwargs)
    eos = tokenizer.eos_token
    outputs = []
    for result in results:
        hypothesis = result.hypotheses[0]
        if hypothesis and hypothesis[-1] == eos:
            hypothesis = hypothesis[:-1]
        outputs.append(tokenizer.decode(tokenizer.convert_tokens_to_ids(hypothesis), skip_special_tokens=True).strip())
    return outputs
