"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers model.

The file reads top to bottom like the paper, and runs as it reads:

    §3.5    positional encoding ............... sinusoidal_table, VaswaniSinusoidalPositionalEncoding
    §3.2    attention ......................... eager_attention_forward (Eq. 1), VaswaniAttention (multi-head, §3.2.2)
    §3.2.3  masks ............................. padding_mask, causal_mask
    §3.1    encoder and decoder layers ........ VaswaniEncoderLayer, VaswaniDecoderLayer (FFN of §3.3, Eq. 2; residual
                                                dropout of §5.4; Add & Norm)
    §3.1    the two stacks .................... VaswaniEncoder, VaswaniDecoder
    §3.4    shared embeddings and softmax ..... VaswaniModel, VaswaniForConditionalGeneration
    §5.4    label-smoothed cross-entropy ...... cross_entropy_loss

Speed enters from outside and computes what this file computes: `fast_paths_vaswani.py` swaps the CPU fast paths in
for a training run or a `generate()` call (an attention function registered with transformers' `AttentionInterface`,
linear and dropout modules, a fused output projection and loss; what they compute is beside it), and
`generation_vaswani.py` decodes (beam search, the KV cache, finished sentences left out). A model you build or load
is made of plain `nn.Linear`, `nn.Dropout` and `nn.LayerNorm` modules. The `*_vaswani.py` files travel to the Hub
together for `trust_remote_code=True` and import only torch, transformers, safetensors and each other.

Shapes in comments: B batch, S source length, T target length (new tokens), P past (cached) target length,
D d_model, H heads, Dh = D / H, V vocabulary.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import CACHE_NAME, VaswaniGenerationMixin, VaswaniSelfAttentionCache, one_cache
from .inputs_vaswani import check_encoder_rows, check_input_ids, check_labels, check_model_inputs
from .loading_vaswani import VaswaniLoadingMixin


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder input `(B, T)` for teacher forcing: `labels` `(B, T)` shifted one position right after the start
    token, `-100` (ignored positions) as `pad_token_id`."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


# §3.5 Positional encoding ---------------------------------------------------------------------------------------------


def sinusoidal_table(num_positions: int, d_model: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5).

    Sines and cosines are interleaved as the formula writes them (even dimensions sin, odd cos), unlike Marian
    and fairseq, which put all sines first.

    Returns:
        `(num_positions, d_model)` table; row `pos` encodes position `pos` (counted from 0).
    """
    position = torch.arange(num_positions, dtype=torch.float64, device=device).unsqueeze(1)  # (N, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (ceil(D/2),)
    angle = position / torch.pow(10000.0, two_i / d_model)  # (N, ceil(D/2))
    table = torch.zeros(num_positions, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype)


class VaswaniSinusoidalPositionalEncoding(nn.Module):
    """The fixed positional encodings of §3.5, precomputed for `max_position_embeddings` positions.

    A non-persistent buffer, filled in `_init_weights` (`from_pretrained` builds on the meta device). `reserve(n)`
    grows it to n positions, up to `limit` (`config.max_positions`), before the stacks embed, in eager mode; a compiled
    or exported forward only reads it (its length checked with `torch._check`).
    """

    def __init__(self, num_positions: int, d_model: int, limit: int | None = None):
        super().__init__()
        self.d_model, self.limit = d_model, limit
        self.register_buffer("weight", sinusoidal_table(num_positions, d_model), persistent=False)

    def reserve(self, num_positions: int) -> None:
        """Grow the table to hold at least `num_positions` positions (doubling, so growth is rare).

        Raises:
            ValueError: `num_positions` is more than `limit`, before the attention's S x S tensors are allocated.
        """
        if self.limit is not None and num_positions > self.limit:
            raise ValueError(
                f"Sequence of {num_positions} tokens is longer than the {self.limit} positions this model attends "
                f"over: sinusoidal positions extrapolate, but attention would hold {num_positions}^2 scores per head "
                f"and sentence ({num_positions**2 * 4 / 2**30:.1f} GiB in fp32). Split the text into sentences or "
                "truncate it (tokenizer truncation=True, max_length=...); config.max_position_embeddings raises it.")
        if num_positions > self.weight.shape[0]:
            size = max(int(num_positions), 2 * self.weight.shape[0])
            self.weight = sinusoidal_table(size, self.d_model, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """`position_ids` `(T,)` or `(B, T)` -> encodings `(..., D)` in the table's dtype."""
        return self.weight[position_ids]


class VaswaniLearnedPositionalEmbedding(nn.Embedding):
    """Learned positional embeddings (Table 3, row E): one vector per position up to `max_position_embeddings`."""

    def reserve(self, num_positions: int) -> None:
        """Check that `num_positions` positions fit: learned positions cannot extrapolate.

        Raises:
            ValueError: `num_positions` is more than `max_position_embeddings`.
        """
        if num_positions > self.num_embeddings:
            raise ValueError(
                f"Sequence of {num_positions} tokens is longer than max_position_embeddings="
                f"{self.num_embeddings} of this model's learned positions. Truncate the input (tokenizer "
                "truncation=True, max_length=...) or use position_embedding_type='sinusoidal', which extrapolates."
            )


def embed_positions(table: nn.Module, position_ids: torch.Tensor | None, start, length: int, needed,
                    device: torch.device) -> torch.Tensor:
    """Encodings of `position_ids` (`(B, L)`), or of positions `start, ..., start + length - 1` (`(L, D)`).

    The table must hold `needed` positions (an int; a symbolic size while tracing; with `position_ids`, their largest
    plus one). In eager mode the table grows (or learned positions refuse) here; when compiling or exporting, a
    `torch._check` states the bound instead, with no host sync and no data-dependent branch."""
    if torch.compiler.is_compiling():
        if not torch.is_tensor(needed) and position_ids is None:
            torch._check(needed <= table.weight.shape[0])
    elif position_ids is not None:
        if position_ids.numel():
            table.reserve(int(position_ids.max()) + 1)
    else:
        table.reserve(int(needed))
    return table(position_ids if position_ids is not None else torch.arange(length, device=device) + start)


# §3.2 Attention -------------------------------------------------------------------------------------------------------


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, softmax(Q K^T / sqrt(d_k)) V (§3.2.1, Eq. 1), written out.

    Args:
        query: `(B, H, Tq, Dh)`; key, value: `(B, H, Tk, Dh)`.
        attention_mask: additive `(B, 1, Tq, Tk)` mask (0 attend, a large negative number not); `None`: none, a causal
            module (`module.is_causal`) still hiding later positions, as `is_causal` does in torch's SDPA.
    Returns:
        output `(B, Tq, H, Dh)` and attention probabilities `(B, H, Tq, Tk)`.
    """
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
    if attention_mask is None and getattr(module, "is_causal", False) and query.shape[2] > 1:  # no later positions
        attention_mask = additive_mask(torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1),
                                       scores.dtype)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, Tq, H, Dh)
    return output, probs


class VaswaniAttention(nn.Module):
    """Multi-head attention (§3.2.2): MultiHead(Q, K, V) = Concat(head_1..head_h) W^O.

    `q_proj`, `k_proj`, `v_proj` project queries, keys and values (D -> D each, the names PEFT uses). Encoder-decoder
    attention (§3.2.3, `is_cross_attention`) projects queries from the decoder, keys and values from the encoder
    output (once per `generate()` call, then cached). Eq. 1 is the function transformers' attention interface holds
    for `config._attn_implementation`: "sdpa" (the default), "eager" (`eager_attention_forward`, also whenever
    `output_attentions=True`), or one registered with `AttentionInterface` taking additive `(B, 1, T_q, T_k)` masks.
    """

    def __init__(self, config: VaswaniConfig, is_cross_attention: bool = False, is_causal: bool = False,
                 layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.d_model // config.num_heads
        self.scaling = self.head_dim**-0.5  # 1 / sqrt(d_k)
        self.dropout = config.attention_dropout
        self.is_cross_attention, self.is_causal, self.layer_idx = is_cross_attention, is_causal, layer_idx
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        for projection in (self.q_proj, self.k_proj, self.v_proj):  # W^Q, W^K, W^V: fairseq's initialization
            projection.is_attention_input = True

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Cache | None = None,
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: `(B, T, D)` queries (and keys and values for self-attention).
            key_value_states: `(B, S, D)` encoder output for encoder-decoder attention, else `None`.
            attention_mask: additive `(B, 1, T, T_k)` mask, or `None`.
            past_key_values: an `EncoderDecoderCache` (or a self-attention `Cache`) during incremental decoding.
            kwargs: passed on to the attention function (transformers' attention kwargs).
        Returns:
            `(B, T, D)` output and, if `output_attentions`, the `(B, H, T, T_k)` attention probabilities.
        """
        batch, length = hidden_states.shape[:2]
        query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        cache = past_key_values
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.cross_attention_cache if self.is_cross_attention else cache.self_attention_cache
        if self.is_cross_attention and cache is not None and past_key_values.is_updated.get(self.layer_idx):
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values  # (B, H, S, Dh)
        else:
            states = key_value_states if self.is_cross_attention else hidden_states
            key = self.k_proj(states).view(*states.shape[:2], -1, self.head_dim).transpose(1, 2)
            value = self.v_proj(states).view(*states.shape[:2], -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)  # self-attention: (B, H, P + T, Dh)
                if self.is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True
        attention = attention_function(self.config, output_attentions)
        output, probs = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                                  dropout=self.dropout if self.training else 0.0, **kwargs)
        output = self.out_proj(output.reshape(batch, length, -1))  # Concat(head_1..head_h) W^O
        return output, (probs if output_attentions else None)


def attention_function(config: VaswaniConfig, output_attentions: bool = False) -> Callable:
    """The attention function of `config._attn_implementation` (transformers' attention interface); the eager
    reference where attention probabilities are asked for, which only it returns."""
    if output_attentions:
        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


# §3.2.3 Masks: padding, and the future positions of the decoder -------------------------------------------------------


def additive_mask(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask (True: hidden) -> additive mask of its shape: 0 where attending, dtype's minimum elsewhere."""
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(blocked, torch.finfo(dtype).min)


def padding_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype, query_length: int) -> torch.Tensor | None:
    """`(B, L)` 1/0 mask -> additive `(B, 1, query_length, L)` mask (0 keep, dtype-min drop); `None` if no mask.

    Built whenever a mask is given, even one that keeps every position: deciding that would read the mask's values
    (a host sync, and a branch a traced or exported graph would freeze)."""
    if attention_mask is None:
        return None
    return additive_mask(attention_mask[:, None, None, :].eq(0).expand(-1, 1, query_length, -1), dtype)


def causal_mask(attention_mask: torch.Tensor | None, batch: int, length: int, past, key_length: int,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive `(B, 1, T, K)` mask hiding future positions (§3.2.3) and padded keys.

    `past`: cached positions (an int, or a 0-dim tensor for a static cache); `key_length` K: the keys attention sees,
    `past + T` or a static cache's full length (its unwritten slots lie in every query's future). `attention_mask`:
    `(B, T)`, `(B, P + T)` or `(B, K)` (1 keep, 0 pad), or a ready boolean (True attends) or additive `(B, 1, T, K)`
    mask. `None` where causality alone hides what must be hidden, with nothing cached: the attention functions then
    mask a causal module's future themselves (`is_causal`, as torch's SDPA does).
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return additive_mask(~attention_mask, dtype) if attention_mask.dtype == torch.bool else attention_mask.to(dtype)
    if attention_mask is None and isinstance(past, int) and key_length == past + length and (past == 0 or length == 1):
        return None
    query_pos = torch.arange(length, device=device) + past  # (T,)
    key_pos = torch.arange(key_length, device=device)  # (K,)
    blocked = (key_pos[None, :] > query_pos[:, None])[None, None]  # (1, 1, T, K)
    if attention_mask is not None:
        if attention_mask.shape[1] < key_length:  # a static cache's future slots: hidden by causality already
            attention_mask = F.pad(attention_mask, (0, key_length - attention_mask.shape[1]), value=1)
        blocked = blocked | attention_mask[:, None, None, -key_length:].eq(0)
    return additive_mask(blocked.expand(batch, 1, length, key_length), dtype)


# §3.1 Encoder and decoder layers --------------------------------------------------------------------------------------


class VaswaniEncoderLayer(GradientCheckpointingLayer):
    """One encoder layer (§3.1): self-attention, then the position-wise feed-forward network (§3.3, Eq. 2).

    Each sublayer's output is dropped out (§5.4) and added to its input, then normalized: LayerNorm(x +
    Dropout(Sublayer(x))), Figure 1's "Add & Norm" (post-LN, the paper). With `normalize_before=True` (pre-LN) a
    sublayer reads LayerNorm(x) instead, and the sum is not normalized.
    """

    def __init__(self, config: VaswaniConfig):
        super().__init__()
        self.normalize_before = config.normalize_before
        self.self_attn = VaswaniAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.activation_fn = ACT2FN[config.activation_function]
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(B, S, D)` -> `(B, S, D)`, and the self-attention probabilities if `output_attentions`."""
        pre_ln = self.normalize_before
        # Self-attention, Add & Norm
        residual = hidden_states
        if pre_ln:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, attn = self.self_attn(hidden_states, attention_mask=attention_mask,
                                             output_attentions=output_attentions, **kwargs)
        hidden_states = residual + self.dropout(hidden_states)
        if not pre_ln:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        # FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2), Add & Norm
        residual = hidden_states
        if pre_ln:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_dropout(self.activation_fn(self.fc1(hidden_states))))
        hidden_states = residual + self.dropout(hidden_states)
        if not pre_ln:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states, attn


class VaswaniDecoderLayer(GradientCheckpointingLayer):
    """One decoder layer (§3.1): masked self-attention, encoder-decoder attention (§3.2.3), then the feed-forward
    network (§3.3, Eq. 2), each wrapped in dropout (§5.4) and Add & Norm as in `VaswaniEncoderLayer`."""

    def __init__(self, config: VaswaniConfig, layer_idx: int):
        super().__init__()
        self.normalize_before = config.normalize_before
        self.self_attn = VaswaniAttention(config, is_causal=True, layer_idx=layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.encoder_attn = VaswaniAttention(config, is_cross_attention=True, layer_idx=layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.activation_fn = ACT2FN[config.activation_function]
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`(B, T, D)` -> `(B, T, D)`, and the self- and cross-attention probabilities if `output_attentions`."""
        pre_ln = self.normalize_before
        # Masked self-attention, Add & Norm
        residual = hidden_states
        if pre_ln:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, self_attn = self.self_attn(hidden_states, attention_mask=attention_mask,
                                                  past_key_values=past_key_values,
                                                  output_attentions=output_attentions, **kwargs)
        hidden_states = residual + self.dropout(hidden_states)
        if not pre_ln:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        # Encoder-decoder attention: queries from the decoder, keys and values from the encoder output, Add & Norm
        residual = hidden_states
        if pre_ln:
            hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states, cross_attn = self.encoder_attn(hidden_states, key_value_states=encoder_hidden_states,
                                                      attention_mask=encoder_attention_mask,
                                                      past_key_values=past_key_values,
                                                      output_attentions=output_attentions, **kwargs)
        hidden_states = residual + self.dropout(hidden_states)
        if not pre_ln:
            hidden_states = self.encoder_attn_layer_norm(hidden_states)
        # FFN (Eq. 2), Add & Norm
        residual = hidden_states
        if pre_ln:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_dropout(self.activation_fn(self.fc1(hidden_states))))
        hidden_states = residual + self.dropout(hidden_states)
        if not pre_ln:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states, self_attn, cross_attn


# Initialization and the common base -----------------------------------------------------------------------------------


class VaswaniPreTrainedModel(VaswaniLoadingMixin, PreTrainedModel):
    """Weights initialization as in fairseq's reference Transformer, and what transformers needs to know; loading
    (`from_pretrained`'s checks, old checkpoints) comes from `VaswaniLoadingMixin` (loading_vaswani.py)."""

    config_class = VaswaniConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    _supports_sdpa = True
    # Our masks are additive (B, 1, T_q, T_k) tensors, eager's and sdpa's format; flash attention (2D padding masks)
    # and flex attention (a BlockMask) are not verified, so transformers refuses them with a clear error.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = True

    @property
    def loss_function(self) -> Callable:
        """transformers' hook for `forward`'s loss: `cross_entropy_loss` (§5.4, below) unless set."""
        return getattr(self, "_loss_function", None) or cross_entropy_loss

    @loss_function.setter
    def loss_function(self, value: Callable) -> None:
        self._loss_function = value

    def resize_token_embeddings(self, new_num_tokens: int | None = None, *args, **kwargs) -> nn.Embedding:
        """transformers' `resize_token_embeddings`: with one shared matrix (§3.4) source, target and `lm_head` resize
        together; with `share_encoder_decoder_embeddings=False` only the source, and `config.target_vocab_size` keeps
        the decoder's size."""
        if not self.config.share_encoder_decoder_embeddings and self.config.target_vocab_size is None:
            self.config.target_vocab_size = self.config.decoder_vocab_size
        return super().resize_token_embeddings(new_num_tokens, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Xavier-uniform linears with zero bias, embeddings (and an untied `lm_head`) N(0, d_model^-0.5) with a zero
        padding row, unit LayerNorms, and the sinusoidal table (a buffer that v5's meta-device loading leaves empty)."""
        d_model = self.config.d_model
        if isinstance(module, nn.Linear) and getattr(module, "is_attention_input", False):
            # fairseq initializes W^Q, W^K, W^V as separate (D, D) matrices, xavier-uniform with gain 1/sqrt(2):
            # uniform(+-sqrt(6 / 4D)).
            bound = math.sqrt(6.0 / (4 * d_model))
            init.uniform_(module.weight, -bound, bound)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Linear) and module is getattr(self, "lm_head", None):
            # An untied output projection is initialized like the embedding it would otherwise share (fairseq).
            init.normal_(module.weight, mean=0.0, std=d_model**-0.5)
        elif isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, VaswaniSinusoidalPositionalEncoding):
            init.copy_(module.weight, sinusoidal_table(*module.weight.shape))


# §3.1 The encoder and decoder stacks ----------------------------------------------------------------------------------


def _positional_encoding(config: VaswaniConfig) -> nn.Module:
    if config.position_embedding_type == "learned":
        return VaswaniLearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
    return VaswaniSinusoidalPositionalEncoding(config.max_position_embeddings, config.d_model, config.max_positions)


class VaswaniEncoder(nn.Module):
    """The encoder (§3.1): embed x sqrt(d_model) + positional encoding, dropout (§5.4), then N layers."""

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = _positional_encoding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([VaswaniEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                output_attentions: bool = False, output_hidden_states: bool = False, return_dict: bool | None = None,
                **kwargs) -> BaseModelOutput | tuple:
        """
        Args:
            input_ids: `(B, S)` source token ids, or `inputs_embeds` `(B, S, D)` (unscaled, like `embed_tokens`).
            attention_mask: `(B, S)`, 1 for tokens and 0 for padding.
            position_ids: `(B, S)` positions of the tokens (default: 0, 1, ..., S - 1 in every row).
            return_dict: `False` returns the output's tuple (`config.return_dict` when `None`, True by default).
            kwargs: passed on to the attention function.
        Returns:
            `BaseModelOutput` with `last_hidden_state` `(B, S, D)`; `hidden_states` (N + 1 tensors, the embeddings
            first) and `attentions` (N tensors `(B, H, S, S)`) when asked for.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("VaswaniEncoder: pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            check_input_ids(input_ids, self.embed_tokens.num_embeddings, "input_ids")
            inputs_embeds = self.embed_tokens(input_ids)
        length = inputs_embeds.shape[1]
        positions = embed_positions(self.embed_positions, position_ids, 0, length, length, inputs_embeds.device)
        hidden_states = self.dropout(inputs_embeds * self.embed_scale + positions.to(inputs_embeds.dtype))
        mask = padding_mask(attention_mask, hidden_states.dtype, length)
        all_hidden, all_attn = (), ()
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            hidden_states, attn = layer(hidden_states, mask, output_attentions=output_attentions, **kwargs)
            all_attn += (attn,)
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        output = BaseModelOutput(last_hidden_state=hidden_states,
                                 hidden_states=all_hidden + (hidden_states,) if output_hidden_states else None,
                                 attentions=all_attn if output_attentions else None)
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


class VaswaniDecoder(nn.Module):
    """The decoder (§3.1): embed x sqrt(d_model) + positional encoding, dropout (§5.4), then N layers that attend to
    earlier target positions only and to the encoder output."""

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = _positional_encoding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([VaswaniDecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, use_cache: bool = False, cache: Cache | None = None,
                output_attentions: bool = False, output_hidden_states: bool = False, return_dict: bool | None = None,
                **kwargs) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """
        Args:
            input_ids: `(B, T)` target ids (the new ones only when the cache holds P earlier positions), or
                `inputs_embeds` `(B, T, D)`.
            attention_mask: `(B, T)` or `(B, P + T)` target padding mask (1 keep, 0 pad); causality is implied.
            encoder_hidden_states: `(B, S, D)`; encoder_attention_mask: `(B, S)`.
            cache: `EncoderDecoderCache` for incremental decoding (`past_key_values=`, its name before transformers
                5.24, is taken too; not both: ValueError).
            position_ids: `(B, T)` positions of the tokens (default: P, P + 1, ..., P + T - 1 in every row).
            return_dict: `False` returns the output's tuple (`config.return_dict` when `None`, True by default).
            kwargs: passed on to the attention function.
        Returns:
            `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state` `(B, T, D)`, the cache (under the
            installed transformers' name, `CACHE_NAME`) and when asked for `hidden_states`, `attentions`
            `(B, H, T, P + T)` and `cross_attentions` `(B, H, T, S)` per layer.
        """
        past_key_values = one_cache(past_key_values, cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("VaswaniDecoder: pass exactly one of decoder_input_ids or decoder_inputs_embeds.")
        if inputs_embeds is None:
            check_input_ids(input_ids, self.embed_tokens.num_embeddings, "decoder_input_ids")
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if encoder_hidden_states is not None and encoder_hidden_states.shape[0] != batch:
            check_encoder_rows(attention_function(self.config, output_attentions), batch,
                               encoder_hidden_states.shape[0])
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(VaswaniSelfAttentionCache(), DynamicCache())
        past, key_length = 0, length
        if past_key_values is not None:
            past = past_key_values.get_seq_length()  # a 0-dim tensor for a static cache
            key_length = past_key_values.get_mask_sizes(length, 0)[0] if past_key_values.is_compileable \
                else past + length
        # Positions past + 0..T-1; a static cache reserves its whole length (its `past` is a tensor).
        needed = past + length if isinstance(past, int) else key_length
        positions = embed_positions(self.embed_positions, position_ids, past, length, needed, inputs_embeds.device)
        hidden_states = self.dropout(inputs_embeds * self.embed_scale + positions.to(inputs_embeds.dtype))
        self_mask = causal_mask(attention_mask, batch, length, past, key_length, hidden_states.dtype,
                                hidden_states.device)
        cross_mask = padding_mask(encoder_attention_mask, hidden_states.dtype, length)
        all_hidden, all_self, all_cross = (), (), ()
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            hidden_states, self_attn, cross_attn = layer(
                hidden_states, self_mask, encoder_hidden_states, encoder_attention_mask=cross_mask,
                past_key_values=past_key_values if use_cache else None, output_attentions=output_attentions, **kwargs)
            all_self, all_cross = all_self + (self_attn,), all_cross + (cross_attn,)
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **{CACHE_NAME: past_key_values if use_cache else None},
            hidden_states=all_hidden + (hidden_states,) if output_hidden_states else None,
            attentions=all_self if output_attentions else None,
            cross_attentions=all_cross if output_attentions else None,
        )
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


# §3.4 Embeddings shared three ways, and the model ---------------------------------------------------------------------


class VaswaniModel(VaswaniPreTrainedModel):
    """The encoder-decoder without the output projection (§3.1).

    With `share_encoder_decoder_embeddings` (default), `shared` is the one embedding matrix that both stacks read
    (§3.4); otherwise each stack has its own.
    """

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        if config.share_encoder_decoder_embeddings:
            self.shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
            encoder_embed = decoder_embed = self.shared
            self._tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                                       "decoder.embed_tokens.weight": "shared.weight"}
        else:
            encoder_embed = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
            decoder_embed = nn.Embedding(config.decoder_vocab_size, config.d_model, config.pad_token_id)
        self.encoder = VaswaniEncoder(config, encoder_embed)
        self.decoder = VaswaniDecoder(config, decoder_embed)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.share_encoder_decoder_embeddings:
            self.shared = value
            self.decoder.embed_tokens = value
        self.encoder.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.LongTensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, decoder_inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, cache: Cache | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                position_ids: torch.LongTensor | None = None, decoder_position_ids: torch.LongTensor | None = None,
                **kwargs) -> Seq2SeqModelOutput:
        """
        Args:
            input_ids: `(B, S)` source ids; attention_mask: `(B, S)` (1 token, 0 padding).
            decoder_input_ids: `(B, T)` target ids starting with `decoder_start_token_id`.
            encoder_outputs: a previous encoder output to reuse (skips the encoder).
            cache: `EncoderDecoderCache` for incremental decoding; `past_key_values=` as transformers < 5.24 names it
                (either name, not both: ValueError).
            position_ids, decoder_position_ids: `(B, S)`, `(B, T)` token positions (default: counted from 0).
            kwargs: passed on to the attention functions.
        Returns:
            `Seq2SeqModelOutput` with `last_hidden_state` `(B, T, D)` from the decoder and the encoder's output.
        Raises:
            ValueError: ids or masks that do not fit together (`inputs_vaswani.check_model_inputs`).
        """
        past_key_values = one_cache(past_key_values, cache)
        check_model_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, inputs_embeds,
                           decoder_inputs_embeds, encoder_outputs, past_key_values)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, position_ids=position_ids,
                                           output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError("VaswaniModel needs decoder_input_ids (or decoder_inputs_embeds). For training pass "
                             "labels to VaswaniForConditionalGeneration, which shifts them into the decoder input.")
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            cache=past_key_values, inputs_embeds=decoder_inputs_embeds, position_ids=decoder_position_ids,
            use_cache=use_cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            return_dict=True, **kwargs)
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state, **{CACHE_NAME: getattr(decoder_outputs, CACHE_NAME)},
            decoder_hidden_states=decoder_outputs.hidden_states, decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions, encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state, encoder_attentions=encoder_outputs.attentions)
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, VaswaniGenerationMixin):
    """The whole Transformer: `VaswaniModel` plus the pre-softmax linear projection `lm_head` (§3.4), which shares
    its weight with the embeddings (`tie_word_embeddings`), and the cross-entropy loss.

    Its `generation_config` defaults to beam 4 with length penalty 0.6 (§6.1, the penalty as transformers applies it:
    the score over |Y|^0.6); `generate()` and its hooks come from `VaswaniGenerationMixin` (generation_vaswani.py).
    """

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.model = VaswaniModel(config)
        self.lm_head = nn.Linear(config.d_model, config.decoder_vocab_size, bias=False)
        if config.tie_word_embeddings:
            source = "model.shared.weight" if config.share_encoder_decoder_embeddings else \
                "model.decoder.embed_tokens.weight"
            self._tied_weights_keys = {"lm_head.weight": source}
            if config.share_encoder_decoder_embeddings:
                self._tied_weights_keys.update({"model.encoder.embed_tokens.weight": source,
                                                "model.decoder.embed_tokens.weight": source})
        self.post_init()
        self.generation_config = self.default_generation_config(config)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.LongTensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, decoder_inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, cache: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, position_ids: torch.LongTensor | None = None,
                decoder_position_ids: torch.LongTensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> Seq2SeqLMOutput:
        """
        Args:
            input_ids: `(B, S)` source ids; attention_mask: `(B, S)` (1 token, 0 padding).
            decoder_input_ids: `(B, T)`; made from `labels` (shifted right) when not given.
            labels: `(B, T)` target ids ending in `</s>`, `-100` where no loss is wanted.
            num_items_in_batch: the number of labelled tokens in the whole (accumulated, all-device) batch, as
                Trainer passes it; the loss is then a sum divided by it, which keeps gradient accumulation exact.
            logits_to_keep: without `labels`, project only the last `logits_to_keep` target positions (an int; 0, the
                default, keeps all) or those of a 1-D index tensor (`generate()` passes 1). Ignored with `labels`.
            cache, position_ids, decoder_position_ids, kwargs: as `VaswaniModel.forward`.
        Returns:
            `Seq2SeqLMOutput` with `logits` `(B, T, V)` (T: the kept positions) and, with `labels`, `loss`: the plain
            cross-entropy over labelled tokens (`loss_function`), as every transformers model returns it; the training
            commands train on §5.4's label-smoothed loss (fast_paths_vaswani.py). The cache comes back under the
            installed version's name.
        Raises:
            ValueError: both `cache` and `past_key_values` given; `labels` outside the vocabulary, or ids, masks or
                labels that do not fit together (`inputs_vaswani.check_model_inputs`).
        """
        if "label_smoothing" in kwargs:
            raise ValueError("forward() returns the plain cross-entropy and takes no label_smoothing: train on the "
                             "label-smoothed loss of §5.4 with Trainer's label_smoothing_factor, or inside "
                             "training_fast_paths(model, label_smoothing) of fast_paths_vaswani.py.")
        if labels is not None:
            check_model_inputs(input_ids, None, decoder_input_ids, None, inputs_embeds, decoder_inputs_embeds,
                               encoder_outputs, labels=labels)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
            cache=one_cache(past_key_values, cache), inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, position_ids=position_ids,
            decoder_position_ids=decoder_position_ids, return_dict=True, **kwargs)
        hidden_states = outputs.last_hidden_state
        if labels is None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            hidden_states = hidden_states[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int)
                                          else logits_to_keep]
        logits = self.lm_head(hidden_states)  # (B, T, V)
        loss = None if labels is None else self.loss_function(logits, labels, num_items_in_batch)
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            decoder_hidden_states=outputs.decoder_hidden_states, decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions, encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states, encoder_attentions=outputs.encoder_attentions)
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)


# §5.4 Label smoothing -------------------------------------------------------------------------------------------------


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None,
                       label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of `logits` `(..., V)` against `labels` `(...)`, summed over the labelled tokens (-100: no loss)
    and divided by `num_items_in_batch` (default: the number of labelled tokens in `labels`).

    `label_smoothing` is epsilon_ls of §5.4 (0.1 in the paper's training): the target is (1 - epsilon) on the label and
    epsilon spread evenly over the vocabulary, as torch's `F.cross_entropy` defines it; 0 (the default) gives the plain
    cross-entropy that `forward` returns. A batch without labelled tokens has the sum over none, 0, as its loss (as
    fairseq's), still in the graph: a step on it changes nothing.

    Raises:
        ValueError: a label outside `[0, V)` other than -100 (CPU tensors).
    """
    labels = labels.to(logits.device)
    check_labels(labels, logits.size(-1))
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100,
                            reduction="sum", label_smoothing=label_smoothing)
    if num_items_in_batch is None:
        num_items_in_batch = labels.ne(-100).sum()
    if torch.is_tensor(num_items_in_batch):  # clamped: 0 / 0 would be NaN where the sum is 0
        return total / num_items_in_batch.to(total.device).clamp(min=1)
    return total / max(num_items_in_batch, 1)


__all__ = [
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "cross_entropy_loss",
    "sinusoidal_table",
]
