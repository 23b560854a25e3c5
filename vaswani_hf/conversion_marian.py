"""Weights between `VaswaniForConditionalGeneration` and transformers' `MarianMTModel`, exactly.

MarianMTModel is the same architecture as the paper's base model when its config says so: post-LN layers (§3.1),
one embedding matrix shared by both stacks and the pre-softmax projection and scaled by `sqrt(d_model)` (§3.4), ReLU
feed-forward networks (§3.3, Eq. 2) and fixed sinusoidal positions (§3.5). The parameter names are the same too
(`model.shared`, `self_attn.q_proj`, `fc1`, `final_layer_norm`, ...). One thing differs: the positional table. The
paper interleaves the two functions, `PE(pos, 2i) = sin(...)`, `PE(pos, 2i+1) = cos(...)`, while Marian lays all
sines first and all cosines after them. That is a fixed permutation of the `d_model` dimensions,

    P = [0, 2, 4, ..., 1, 3, 5, ...]    Marian's dimension k holds our dimension P[k]

(Marian's dimension k < d_model / 2 is the sine of our dimension 2k; its dimension d_model / 2 + k the cosine of our
dimension 2k + 1). Permuting every tensor of the residual stream by P gives a Marian model that computes exactly what
ours computes, dimension for dimension in Marian's order: the embedding columns, the input columns of every linear
layer that reads the residual stream (q/k/v projections, `fc1`, the pre-softmax projection), the output rows and
biases of every linear layer that writes it (`out_proj`, `fc2`), and every LayerNorm gain and bias (LayerNorm's mean
and variance do not depend on the order of the dimensions). The attention heads live inside the projections and
keep their order.

`to_marian(model)` gives a MarianMTModel to check this model against an implementation this project did not write
(tests/test_marian_reference.py does, for logits, greedy and beam search); `from_marian(marian)` brings a
Marian-architecture checkpoint with these choices to this model. Configurations either side cannot express are
refused with a `ValueError` that names the field.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import MarianConfig, MarianMTModel

from .configuration_vaswani import VaswaniConfig
from .modeling_vaswani import VaswaniForConditionalGeneration

__all__ = ["from_marian", "from_marian_config", "marian_permutation", "to_marian", "to_marian_config"]

# Marian's LayerNorms are `nn.LayerNorm(d_model)`: torch's default epsilon, not a config field.
MARIAN_LAYER_NORM_EPS = 1e-5
# Suffixes of the linear layers that read the residual stream (input columns permuted) and that write it (output rows
# and biases permuted); the attention heads are inside, between the two.
_READS_RESIDUAL = ("q_proj", "k_proj", "v_proj", "fc1")
_WRITES_RESIDUAL = ("out_proj", "fc2")
_EMBEDDINGS = ("shared", "embed_tokens", "lm_head")
_LAYER_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
# Fields of older BART-family Marian configs that describe layers this model does not have, and the value under which
# they are absent.
_ABSENT_FIELDS = {"normalize_before": False, "add_final_layer_norm": False, "normalize_embedding": False,
                  "layernorm_embedding": False, "static_position_embeddings": True, "add_bias_logits": False}


def marian_permutation(d_model: int) -> torch.Tensor:
    """The permutation `P` of the residual-stream dimensions from this model's order to Marian's (§3.5).

    `P = [0, 2, 4, ..., 1, 3, 5, ...]`: Marian's dimension `k` holds this model's dimension `P[k]`, so a `(..., D)`
    tensor in our order becomes Marian's as `x[..., P]`, and back as `x[..., P.argsort()]`. For an odd `d_model`
    (Marian then puts `ceil(D / 2)` sines first) the same formula holds.

    Returns:
        `(d_model,)` int64 tensor.
    Raises:
        ValueError: `d_model` is not a positive integer.
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"marian_permutation: d_model must be a positive integer, got {d_model!r}.")
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian_table(num_positions: int, d_model: int) -> torch.Tensor:
    """Marian's positional table, `(num_positions, d_model)` float64: the sines of §3.5 first, then the cosines."""
    position = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (N, 1)
    angle = position / torch.pow(10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (N, ceil(D/2))
    return torch.cat([torch.sin(angle), torch.cos(angle[:, : d_model // 2])], dim=1)


def to_marian_config(config: VaswaniConfig) -> MarianConfig:
    """The `MarianConfig` of the same model: ReLU (or `config`'s activation), `scale_embedding`, post-LN, the special
    token ids and `max_position_embeddings` as in `config`, no forced `</s>` at the length limit.

    Raises:
        TypeError: `config` is not a `VaswaniConfig`.
        ValueError: `config` describes what MarianMTModel cannot hold: pre-LN (`normalize_before=True`; Marian is
            post-LN only), learned positions (Marian's are sinusoidal), or a LayerNorm epsilon other than 1e-5.
    """
    if not isinstance(config, VaswaniConfig):
        raise TypeError(f"to_marian_config: expected a VaswaniConfig, got {type(config).__name__}.")
    if config.normalize_before:
        raise ValueError("to_marian: normalize_before=True (pre-LN) cannot be mapped: MarianMTModel's layers are "
                         "post-LN only, LayerNorm(x + Sublayer(x)) (§3.1).")
    if config.position_embedding_type != "sinusoidal":
        raise ValueError(f"to_marian: position_embedding_type={config.position_embedding_type!r} cannot be mapped: "
                         "MarianMTModel has the fixed sinusoidal positions of §3.5 only.")
    if config.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        raise ValueError(f"to_marian: layer_norm_eps={config.layer_norm_eps} cannot be mapped: MarianMTModel's "
                         f"LayerNorms use {MARIAN_LAYER_NORM_EPS}, which is not a config field.")
    return MarianConfig(
        vocab_size=config.vocab_size,
        decoder_vocab_size=config.decoder_vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=config.activation_function,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=config.scale_embedding,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=config.use_cache,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        # MarianConfig forces </s> at the length limit by default; this model's decoding does not.
        forced_eos_token_id=None,
        is_encoder_decoder=True,
    )


def from_marian_config(config: MarianConfig) -> VaswaniConfig:
    """The `VaswaniConfig` of a MarianMTModel's config (post-LN, sinusoidal positions, LayerNorm epsilon 1e-5).

    The special ids are Marian's; a missing `bos_token_id` (Marian checkpoints have none) becomes
    `decoder_start_token_id`, which is what starts every target sentence.

    Raises:
        TypeError: `config` is not a `MarianConfig`.
        ValueError: what this model cannot hold: encoder and decoder of different widths (heads or FFN), LayerDrop,
            layers Marian's BART ancestors had (`normalize_before`, `add_final_layer_norm`, a LayerNorm on the
            embeddings, learned positions, a bias on the logits), a missing pad/eos/decoder-start id, or a field
            `VaswaniConfig` refuses (e.g. an activation it does not know).
    """
    if not isinstance(config, MarianConfig):
        raise TypeError(f"from_marian_config: expected a MarianConfig, got {type(config).__name__}.")
    for name, absent in _ABSENT_FIELDS.items():
        value = getattr(config, name, absent)
        if value != absent:
            raise ValueError(f"from_marian: the Marian config has {name}={value!r}; this model has no such layer "
                             f"(it is post-LN with sinusoidal positions and no embedding LayerNorm, §3.1, §3.5).")
    for encoder_field, decoder_field in (("encoder_attention_heads", "decoder_attention_heads"),
                                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if getattr(config, encoder_field) != getattr(config, decoder_field):
            raise ValueError(f"from_marian: {encoder_field}={getattr(config, encoder_field)} and {decoder_field}="
                             f"{getattr(config, decoder_field)} differ; this model has one num_heads and one d_ff.")
    for name in ("encoder_layerdrop", "decoder_layerdrop"):
        if getattr(config, name, 0.0):
            raise ValueError(f"from_marian: {name}={getattr(config, name)}; this model has no LayerDrop. Set it to 0 "
                             f"in the Marian config first.")
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        if getattr(config, name) is None:
            raise ValueError(f"from_marian: the Marian config has no {name}; this model needs one.")
    share = bool(config.share_encoder_decoder_embeddings)
    decoder_vocab_size = config.vocab_size if share else (config.decoder_vocab_size or config.vocab_size)
    return VaswaniConfig(
        vocab_size=config.vocab_size,
        target_vocab_size=None if decoder_vocab_size == config.vocab_size else decoder_vocab_size,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        num_heads=config.encoder_attention_heads,
        d_ff=config.encoder_ffn_dim,
        dropout=float(config.dropout),
        attention_dropout=float(config.attention_dropout),
        activation_dropout=float(config.activation_dropout),
        activation_function=config.activation_function,
        normalize_before=False,
        position_embedding_type="sinusoidal",
        max_position_embeddings=config.max_position_embeddings,
        share_encoder_decoder_embeddings=share,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        scale_embedding=bool(config.scale_embedding),
        layer_norm_eps=MARIAN_LAYER_NORM_EPS,
        use_cache=bool(config.use_cache),
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else config.decoder_start_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def _residual_axis(name: str) -> int | None:
    """Which axis of parameter `name` runs over the residual stream: 1 (input columns), 0 (output rows, LayerNorm
    vectors, biases of writers), or None (not on it: the biases of q/k/v and `fc1`)."""
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _EMBEDDINGS or leaf in _READS_RESIDUAL:
        return 1 if kind == "weight" else None
    if leaf in _WRITES_RESIDUAL or leaf in _LAYER_NORMS:
        return 0
    raise ValueError(f"parameter {name!r} is not one the Marian mapping knows (embeddings, attention projections, "
                     f"fc1/fc2, post-LN LayerNorms): a wrapped or added module (an adapter?) cannot be mapped; merge "
                     f"or remove it first.")


def _permuted(state: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every residual-stream axis of every tensor in `state` reordered by `index` (`x.index_select(axis, index)`)."""
    mapped = {}
    for name, tensor in state.items():
        axis = _residual_axis(name)
        mapped[name] = tensor if axis is None else tensor.index_select(axis, index.to(tensor.device))
    return mapped


def _parameters(model: nn.Module, skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`model.state_dict()` without the entries in `skip` (positional tables, Marian's logits bias), detached."""
    return {name: tensor.detach() for name, tensor in model.state_dict().items() if name not in skip}


def _load(target: nn.Module, state: dict[str, torch.Tensor], keep: tuple[str, ...], what: str) -> None:
    """Copy `state` into `target`, which must have exactly these entries besides its own `keep` ones."""
    own = set(target.state_dict()) - set(keep)
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise ValueError(f"{what}: the parameters do not match (missing {missing[:5]}, unexpected {unexpected[:5]}).")
    with torch.no_grad():
        for name, tensor in target.state_dict().items():
            if name in state:
                tensor.copy_(state[name])


def _position_keys(model: nn.Module) -> tuple[str, ...]:
    return tuple(name for name in model.state_dict() if "embed_positions" in name)


def to_marian(model: VaswaniForConditionalGeneration, length_penalty: float | None = None) -> MarianMTModel:
    """A `MarianMTModel` that computes what `model` computes, with every residual-stream dimension permuted by
    `marian_permutation(d_model)` (see the module docstring; §3.5).

    The Marian model has `model`'s dtype, device and train/eval mode, zero `final_logits_bias`, Marian's own positional
    table (the permuted §3.5 table), and a copy of `model.generation_config` (beam 4 and length penalty 0.6 of §6.1
    unless changed), so that `generate()` without arguments decodes alike on both. MarianMTModel has only
    transformers' length penalty (score / |Y|^alpha): a model whose generation config chose the paper's GNMT form
    (`length_penalty_style="gnmt"`) is converted only with `length_penalty` given, the alpha of transformers' form
    its copy then holds (which decodes differently from the GNMT setting). Its hidden states are ours with the
    dimensions in Marian's order (`ours[..., P]`); its logits are ours.

    Raises:
        TypeError: `model` is not a `VaswaniForConditionalGeneration`.
        ValueError: its config cannot be mapped
            (`to_marian_config`), or it holds parameters the mapping does not know (an adapter, a pre-LN final norm);
            a GNMT length penalty in its generation config and no `length_penalty`.
    """
    if not isinstance(model, VaswaniForConditionalGeneration):
        raise TypeError(f"to_marian: expected a VaswaniForConditionalGeneration, got {type(model).__name__}.")
    generation = copy.deepcopy(model.generation_config)
    style = getattr(generation, "length_penalty_style", None)
    if style == "gnmt" and length_penalty is None:
        raise ValueError(
            f"to_marian: the model's generation config decodes with the paper's GNMT length penalty (alpha "
            f"{generation.length_penalty}), which MarianMTModel's generate() cannot express (it divides by |Y|^alpha "
            "only). Pass to_marian(model, length_penalty=ALPHA) for transformers' form with that alpha.")
    if length_penalty is not None:
        generation.length_penalty = float(length_penalty)
    if style is not None:  # a field of ours that MarianMTModel would carry and ignore
        del generation.length_penalty_style
    config = to_marian_config(model.config)
    source = model.model.shared.weight if model.config.share_encoder_decoder_embeddings else \
        model.model.encoder.embed_tokens.weight
    marian = MarianMTModel(config).to(dtype=source.dtype, device=source.device)
    keep = _position_keys(marian) + ("final_logits_bias",)
    state = _permuted(_parameters(model, _position_keys(model)), marian_permutation(config.d_model))
    _load(marian, state, keep, "to_marian")
    marian.generation_config = generation
    return marian.train(model.training)


def from_marian(marian: MarianMTModel) -> VaswaniForConditionalGeneration:
    """A `VaswaniForConditionalGeneration` that computes what `marian` computes: the inverse of `to_marian`, for a
    MarianMTModel whose config `from_marian_config` accepts (ReLU or another activation this model knows,
    `scale_embedding` as it is, post-LN).

    The new model has `marian`'s dtype, device, train/eval mode and a copy of its `generation_config` (so `generate()`
    without arguments decodes as `marian` did; set `model.generation_config =
    model.default_generation_config(model.config)` for beam 4 and length penalty 0.6, §6.1).

    Raises:
        TypeError: `marian` is not a `MarianMTModel`.
        ValueError: its config cannot be mapped (`from_marian_config`); its
            `final_logits_bias` is not zero (this model's pre-softmax projection has no bias, §3.4); its positional
            table is not the sinusoidal one of §3.5 (edited or trained); or it holds parameters the mapping does not
            know.
    """
    if not isinstance(marian, MarianMTModel):
        raise TypeError(f"from_marian: expected a MarianMTModel, got {type(marian).__name__}.")
    config = from_marian_config(marian.config)
    bias = marian.final_logits_bias.detach()
    if bool(bias.ne(0).any()):
        raise ValueError(f"from_marian: final_logits_bias is not zero (max |bias| {bias.abs().max().item():.3g}); this "
                         "model's pre-softmax projection has no bias (§3.4), so its logits would differ.")
    expected = _marian_table(config.max_position_embeddings, config.d_model)
    for name in _position_keys(marian):
        table = marian.state_dict()[name].detach().to("cpu", torch.float64)
        if table.shape != expected.shape or not torch.allclose(table, expected, rtol=0.0, atol=1e-6):
            raise ValueError(f"from_marian: {name} is not the sinusoidal table of §3.5 (sines first, then cosines); "
                             "this model's positions are fixed and cannot hold another table.")
    weight = marian.model.shared.weight if marian.config.share_encoder_decoder_embeddings else \
        marian.model.encoder.embed_tokens.weight
    model = VaswaniForConditionalGeneration(config).to(dtype=weight.dtype, device=weight.device)
    inverse = marian_permutation(config.d_model).argsort()
    state = _permuted(_parameters(marian, _position_keys(marian) + ("final_logits_bias",)), inverse)
    _load(model, state, _position_keys(model), "from_marian")
    model.generation_config = copy.deepcopy(marian.generation_config)
    return model.train(marian.training)
