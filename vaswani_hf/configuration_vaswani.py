"""Configuration of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The defaults are the paper's *base* model (Table 3, first row); `VaswaniConfig.big()` gives the *big* model
(Table 3, last row). Options for the variants the paper studies (Table 3 rows A-E) and for widely used departures
from it (pre-LN) are fields of their own; the paper's choice is always the default.

This file imports only transformers and the standard library: it is copied to the Hub beside the model code and
must stand alone there.
"""

import math
import os

from transformers import PretrainedConfig

_CONFIG_JSON = "config.json"

_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "swish", "tanh")
_POSITIONS = ("sinusoidal", "learned")
_MAX_SIZE = 2**31 - 1
# Sinusoidal positions extrapolate, but attention over S positions holds S x S scores per head and sentence (and a mask
# as large): 16,384 positions are 1 GiB of fp32 scores. The model refuses longer inputs before allocating them.
SINUSOIDAL_MAX_POSITIONS = 16384
# The fields `VaswaniConfig._validate` checks.
_FIELDS = ("vocab_size", "target_vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff",
           "dropout", "attention_dropout", "activation_dropout", "activation_function", "normalize_before",
           "position_embedding_type", "max_position_embeddings", "share_encoder_decoder_embeddings",
           "tie_word_embeddings", "scale_embedding", "layer_norm_eps", "use_cache", "pad_token_id",
           "bos_token_id", "eos_token_id", "decoder_start_token_id")
# Written into every saved config.json: with the three code files saved beside it, a folder loads through these Auto
# classes with `trust_remote_code=True` where this package is not installed.
AUTO_MAP = {
    "AutoConfig": "configuration_vaswani.VaswaniConfig",
    "AutoModel": "modeling_vaswani.VaswaniModel",
    "AutoModelForSeq2SeqLM": "modeling_vaswani.VaswaniForConditionalGeneration",
}


class VaswaniConfig(PretrainedConfig):
    r"""
    Configuration of [`VaswaniModel`] and [`VaswaniForConditionalGeneration`].

    Args:
        vocab_size (`int`, defaults to 37000):
            Size of the (joint, shared) source vocabulary; also the target vocabulary unless `target_vocab_size` is
            set. 37000 is the paper's shared BPE vocabulary for WMT 2014 English-German (§5.1).
        target_vocab_size (`int`, *optional*):
            Size of a separate target vocabulary. `None` (default) means the target side uses `vocab_size`.
            A different size requires `share_encoder_decoder_embeddings=False`.
        d_model (`int`, defaults to 512): Width of every sublayer output and embedding, `d_model` (§3.1).
        encoder_layers (`int`, defaults to 6): Number of encoder layers, `N` (§3.1).
        decoder_layers (`int`, defaults to 6): Number of decoder layers, `N` (§3.1).
        num_heads (`int`, defaults to 8): Attention heads `h` (§3.2.2); `d_k = d_v = d_model / h`.
        d_ff (`int`, defaults to 2048): Inner width of the position-wise feed-forward network (§3.3, Eq. 2).
        dropout (`float`, defaults to 0.1):
            `P_drop`, applied to each sublayer output before the residual add and to the sums of embeddings and
            positional encodings (§5.4).
        attention_dropout (`float`, defaults to 0.0): Dropout on attention probabilities (not in the paper).
        activation_dropout (`float`, defaults to 0.0): Dropout after the FFN activation (not in the paper).
        activation_function (`str`, defaults to `"relu"`): FFN non-linearity; the paper uses ReLU (Eq. 2).
        normalize_before (`bool`, defaults to `False`):
            `False` is the paper's post-LN, `LayerNorm(x + Sublayer(x))` (§3.1). `True` gives pre-LN,
            `x + Sublayer(LayerNorm(x))`, with a final LayerNorm after each stack.
        position_embedding_type (`str`, defaults to `"sinusoidal"`):
            `"sinusoidal"`: the fixed encodings of §3.5; they extend to any length. `"learned"`: learned
            positional embeddings (Table 3, row E), limited to `max_position_embeddings` positions.
        max_position_embeddings (`int`, defaults to 1024):
            Positions precomputed (sinusoidal) or learned. Sinusoidal inputs longer than this still work, up to
            `max_positions` (16,384 positions, or this if larger), beyond which attention's S x S scores take more
            than 1 GiB per head and sentence and the model refuses the input.
        share_encoder_decoder_embeddings (`bool`, defaults to `True`):
            One embedding matrix for encoder and decoder input (§3.4; needs one vocabulary).
        tie_word_embeddings (`bool`, defaults to `True`):
            The pre-softmax projection (`lm_head`) shares the decoder's embedding matrix (§3.4). With both sharing
            flags on (the default), one matrix serves all three uses.
        scale_embedding (`bool`, defaults to `True`): Multiply embeddings by `sqrt(d_model)` (§3.4).
        layer_norm_eps (`float`, defaults to 1e-5): Epsilon of every LayerNorm.
        pad_token_id, bos_token_id, eos_token_id, decoder_start_token_id (`int`, defaults to 0, 1, 2, 1):
            Special token ids, matching the joint BPE tokenizer of this package (`<pad>`, `<s>`, `</s>`); the decoder
            input starts with `<s>`.

    Parameter count:
        With the defaults the model has 63,082,496 parameters, counting every shared tensor once: one 37000 x 512
        embedding matrix (18,944,000; also the decoder input and the pre-softmax projection) + 6 encoder layers x
        3,152,384 + 6 decoder layers x 4,204,032 (weights and biases of every projection and FFN, LayerNorm gains and
        biases; the sinusoidal encodings are not parameters). Table 3 reports 65M and does not say how it counted.
        The 1.9M difference is what 3,745 more vocabulary rows would add (a joint vocabulary of about 40.7k rather
        than "about 37000"), while unshared embedding and softmax matrices would add 18.9M per matrix, far more, so
        the paper most likely counted a somewhat larger actual vocabulary. `VaswaniConfig.big()` has 214,245,376
        (Table 3: 213M).

    Raises:
        ValueError: on impossible sizes (non-positive, `d_model` not divisible by `num_heads`), dropout outside
            `[0, 1)`, `layer_norm_eps` not in `(0, 1]`, a flag that is not a real bool (no `"false"` strings), a
            special token id outside `[0, vocab_size)`, an unknown activation or position type, or embedding sharing
            across different vocabularies. Checked at construction and on load (`from_dict`, `from_pretrained`),
            where the message names the config.json.

    Example:

    ```python
    >>> from vaswani_hf import VaswaniConfig
    >>> VaswaniConfig.big().d_model
    1024
    ```
    """

    model_type = "vaswani"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads",
        "num_hidden_layers": "encoder_layers",
        "intermediate_size": "d_ff",
    }

    def __init__(
        self,
        vocab_size: int = 37000,
        target_vocab_size: int | None = None,
        d_model: int = 512,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        num_heads: int = 8,
        d_ff: int = 2048,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        activation_function: str = "relu",
        normalize_before: bool = False,
        position_embedding_type: str = "sinusoidal",
        max_position_embeddings: int = 1024,
        share_encoder_decoder_embeddings: bool = True,
        tie_word_embeddings: bool = True,
        scale_embedding: bool = True,
        layer_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        decoder_start_token_id: int = 1,
        **kwargs,
    ):
        # Checked before anything is set: transformers' own checks would otherwise fail first, with less clear errors.
        arguments = locals()
        self._validate({name: arguments[name] for name in _FIELDS})
        self.vocab_size = vocab_size
        self.target_vocab_size = target_vocab_size
        self.d_model = d_model
        self.encoder_layers = encoder_layers
        self.decoder_layers = decoder_layers
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation_dropout = activation_dropout
        self.activation_function = activation_function
        self.normalize_before = normalize_before
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.share_encoder_decoder_embeddings = share_encoder_decoder_embeddings
        self.scale_embedding = scale_embedding
        self.layer_norm_eps = layer_norm_eps
        self.use_cache = use_cache
        # Label smoothing (§5.4) is a setting of training (Trainer's label_smoothing_factor), not of the model; configs
        # saved before it moved there still carry it.
        kwargs.pop("label_smoothing", None)
        kwargs.setdefault("is_encoder_decoder", True)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=decoder_start_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self._validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "VaswaniConfig":
        """`PretrainedConfig.from_dict`, refusing the config of another model type.

        transformers only warns when, say, a BART or Marian config.json is loaded as a `VaswaniConfig`, and then builds
        a model of made-up sizes (or fails deep inside) that loads none of the weights.
        """
        model_type = config_dict.get("model_type")
        if model_type is not None and model_type != cls.model_type:
            architectures = ", ".join(config_dict.get("architectures") or []) or "unknown architecture"
            raise ValueError(
                f"{_CONFIG_JSON}: model_type is {model_type!r} ({architectures}), not {cls.model_type!r}: this is "
                f"not a VaswaniForConditionalGeneration folder. Load it with its own class (e.g. "
                f"AutoModelForSeq2SeqLM), or point to a folder saved from this model."
            )
        try:
            loaded = super().from_dict(config_dict, **kwargs)
            # Fields given as keyword arguments are set after construction: check the result once more.
            (loaded[0] if isinstance(loaded, tuple) else loaded)._validate()
        except Exception as error:
            # transformers' own field checks (huggingface_hub strict dataclasses) raise errors of their own types
            if not isinstance(error, (TypeError, ValueError)) and "StrictDataclass" not in type(error).__name__:
                raise
            message = str(error)
            if message.startswith(_CONFIG_JSON):
                raise
            raise ValueError(f"{_CONFIG_JSON}: {message.removeprefix('VaswaniConfig: ')} Fix the field in config.json "
                             f"(or re-save the config with save_pretrained()).") from None
        return loaded

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "VaswaniConfig":
        """`PretrainedConfig.from_pretrained`, with the config.json of the folder named in every validation error."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except ValueError as error:
            message = str(error)
            if message.startswith(_CONFIG_JSON):
                where = pretrained_model_name_or_path
                if os.path.isdir(where):
                    where = os.path.join(where, kwargs.get("subfolder") or "", "config.json")
                    message = message[len(_CONFIG_JSON) + 1:].lstrip()
                raise ValueError(f"{where}: {message}") from None
            raise

    @property
    def max_positions(self) -> int:
        """The most positions a source or a target (its start token included) may have: `max_position_embeddings`
        for learned positions; for sinusoidal ones, which extrapolate, `SINUSOIDAL_MAX_POSITIONS` or more."""
        if self.position_embedding_type == "learned":
            return self.max_position_embeddings
        return max(self.max_position_embeddings, SINUSOIDAL_MAX_POSITIONS)

    @property
    def decoder_vocab_size(self) -> int:
        """Size of the target vocabulary: `target_vocab_size`, or `vocab_size` when that is `None`."""
        return self.target_vocab_size or self.vocab_size

    def _validate(self, values: dict | None = None) -> None:
        """Raise ValueError for an impossible field; `values` (field -> value) checks arguments before they are set."""
        if values is None:
            values = {name: getattr(self, name, None) for name in _FIELDS}
        v = values.get
        vocab_size, target_vocab_size = v("vocab_size"), v("target_vocab_size")
        sizes = {name: v(name) for name in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads",
                                            "d_ff", "max_position_embeddings")}
        if target_vocab_size is not None:
            sizes["target_vocab_size"] = target_vocab_size
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"VaswaniConfig: {name} must be a positive integer, got {value!r}.")
            if value > _MAX_SIZE:
                raise ValueError(f"VaswaniConfig: {name} must be at most {_MAX_SIZE} (a tensor dimension torch can "
                                 f"index), got {value}.")
        decoder_vocab_size = target_vocab_size or vocab_size
        # A bool is a bool: "false" or "no" in a config.json (or 0/1) would otherwise read as truthy or be taken
        # for the other choice, silently building another model (pre-LN instead of post-LN, untied embeddings...).
        for name in ("normalize_before", "share_encoder_decoder_embeddings", "tie_word_embeddings", "scale_embedding",
                     "use_cache"):
            value = v(name)
            if not isinstance(value, bool):
                raise ValueError(f"VaswaniConfig: {name} must be true or false (a JSON boolean), got {value!r} "
                                 f"({type(value).__name__}).")
        eps = v("layer_norm_eps")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or not 0 < eps <= 1:
            raise ValueError(f"VaswaniConfig: layer_norm_eps must be a small positive number (0 < eps <= 1; the "
                             f"default is 1e-5), got {eps!r}.")
        limit = min(vocab_size, decoder_vocab_size)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = v(name)
            items = value if isinstance(value, list) and name == "eos_token_id" and value else [value]
            for item in items:
                if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < limit:
                    raise ValueError(f"VaswaniConfig: {name} must be a token id in [0, {limit}) (the vocabulary has "
                                     f"{limit} entries), got {value!r}. Use the special ids of the tokenizer saved "
                                     f"with the model.")
        d_model, num_heads = v("d_model"), v("num_heads")
        if d_model % num_heads:
            raise ValueError(
                f"VaswaniConfig: d_model ({d_model}) must be divisible by num_heads ({num_heads}) so that "
                f"each head has d_k = d_model / num_heads dimensions (§3.2.2); choose e.g. num_heads="
                f"{max(h for h in range(1, num_heads + 1) if d_model % h == 0)}."
            )
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = v(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"VaswaniConfig: {name} must be in [0, 1), got {value!r}.")
        activation = v("activation_function")
        if not isinstance(activation, str) or activation not in _ACTIVATIONS:
            raise ValueError(
                f"VaswaniConfig: unknown activation_function {activation!r}; "
                f"choose one of {', '.join(_ACTIVATIONS)} (the paper uses 'relu')."
            )
        positions = v("position_embedding_type")
        if not isinstance(positions, str) or positions not in _POSITIONS:
            raise ValueError(
                f"VaswaniConfig: unknown position_embedding_type {positions!r}; "
                f"choose 'sinusoidal' (the paper, §3.5) or 'learned' (Table 3, row E)."
            )
        if v("share_encoder_decoder_embeddings") and decoder_vocab_size != vocab_size:
            raise ValueError(
                f"VaswaniConfig: share_encoder_decoder_embeddings=True needs one vocabulary, but vocab_size="
                f"{vocab_size} and target_vocab_size={target_vocab_size}. Set "
                "share_encoder_decoder_embeddings=False for separate source and target vocabularies."
            )

    @classmethod
    def base(cls, **kwargs) -> "VaswaniConfig":
        """The paper's base model (Table 3): d_model 512, 8 heads, d_ff 2048, 6+6 layers, dropout 0.1.

        Any field can be overridden, e.g. `VaswaniConfig.base(vocab_size=8000)`.
        """
        return cls(**kwargs)

    @classmethod
    def big(cls, **kwargs) -> "VaswaniConfig":
        """The paper's big model (Table 3): d_model 1024, 16 heads, d_ff 4096, 6+6 layers, dropout 0.3.

        Any field can be overridden, e.g. `VaswaniConfig.big(dropout=0.1)` as used for English-French (§6.1).
        """
        params = {"d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3}
        params.update(kwargs)
        return cls(**params)


__all__ = ["VaswaniConfig"]
