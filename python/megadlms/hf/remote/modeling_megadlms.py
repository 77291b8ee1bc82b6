"""Hugging Face modeling file of a megadlms export (loaded with ``trust_remote_code=True``).

Self-contained on purpose: it needs only torch and transformers (and the sampler next to
it, ``generation_megadlms.py``), so an exported directory works without megadlms
installed. The network is megadlms' GPTModel (pre-norm transformer, LayerNorm or RMSNorm,
RoPE or learned positions, SwiGLU or GeLU MLP, optional qk-norm, grouped-query
attention), run bidirectionally (a masked-diffusion LM) or causally, with Llama-style
parameter names (``model.layers.0.self_attn.q_proj.weight``, ...).

``MegaDLMsModelLM`` is registered for AutoModel, AutoModelForCausalLM (what MegaDLMs'
dlm_inference.py loads) and AutoModelForMaskedLM. Its ``generate`` is LLaDA's sampler,
taking MegaDLMs' argument names or LLaDA's (see generation_megadlms.py); at temperature 0
it gives the tokens ``megadlms-generate`` gives. Attention always runs through torch's
scaled_dot_product_attention: ``attn_implementation="flash_attention_2"`` (MegaDLMs'
script) is accepted and maps to it, with one warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput
from transformers.utils import logging

from .generation_megadlms import IGNORED, block_diffusion_generate, diffusion_generate, resolve

logger = logging.get_logger(__name__)


class MegaDLMsConfig(PretrainedConfig):
    """Shape of a megadlms GPTModel, in Hugging Face names where one exists."""

    model_type = "megadlms"

    def __init__(
        self,
        vocab_size: int = 384,
        hidden_size: int = 64,
        intermediate_size: int = 256,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        max_position_embeddings: int = 128,
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        swiglu: bool = True,
        add_bias_linear: bool = False,
        add_qkv_bias: bool = False,
        qk_layernorm: bool = False,
        position_embedding_type: str = "rope",
        rope_theta: float = 10000.0,
        attention: str = "bidirectional",
        mask_token_id: Optional[int] = None,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.swiglu = swiglu
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias
        self.qk_layernorm = qk_layernorm
        self.position_embedding_type = position_embedding_type
        self.rope_theta = rope_theta
        self.attention = attention
        self.mask_token_id = mask_token_id
        kwargs["tie_word_embeddings"] = tie_word_embeddings  # PretrainedConfig's own field
        super().__init__(**kwargs)


def _norm(config: MegaDLMsConfig, size: int) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.norm_eps)
    return nn.LayerNorm(size, eps=config.norm_eps)


def _rotary(position_ids: torch.Tensor, dim: int, base: float):
    """(cos, sin) fp32 [B, S, 1, D]: non-interleaved RoPE, angles in fp32."""
    exponent = torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (float(base) ** exponent)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class MegaDLMsAttention(nn.Module):
    def __init__(self, config: MegaDLMsConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.causal = config.attention == "causal"
        h, bias = config.hidden_size, config.add_bias_linear
        qkv_bias = bias or config.add_qkv_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.d, h, bias=bias)
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if config.qk_layernorm:
            self.q_norm, self.k_norm = _norm(config, self.d), _norm(config, self.d)

    def forward(self, x, rotary, attn_mask, layer_past=None, slots=None):
        """(output, (k, v)): ``layer_past`` the layer's cached (keys, values) [B, n_kv, T, D]
        (rotated); the new keys/values go after them, or at ``slots`` (the dual cache)."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.d)
        k = self.k_proj(x).view(B, S, self.n_kv, self.d)
        v = self.v_proj(x).view(B, S, self.n_kv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if layer_past is not None:
            past_k, past_v = layer_past
            if slots is None:
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            else:  # in place, as Fast-dLLM's dual cache refreshes its block
                past_k[:, :, slots], past_v[:, :, slots] = k, v
                k, v = past_k, past_v
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=self.causal and attn_mask is None and layer_past is None,
            enable_gqa=self.n_kv != self.n_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * self.d)), (k, v)


class MegaDLMsMLP(nn.Module):
    def __init__(self, config: MegaDLMsConfig) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.add_bias_linear
        self.swiglu = config.swiglu
        self.gate_proj = nn.Linear(h, f, bias=bias) if config.swiglu else None
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class MegaDLMsLayer(nn.Module):
    def __init__(self, config: MegaDLMsConfig) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = MegaDLMsAttention(config)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.mlp = MegaDLMsMLP(config)

    def forward(self, x, rotary, attn_mask, layer_past=None, slots=None):
        attn, present = self.self_attn(self.input_layernorm(x), rotary, attn_mask, layer_past, slots)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), present


class MegaDLMsPreTrainedModel(PreTrainedModel):
    config_class = MegaDLMsConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegaDLMsLayer"]
    _supports_sdpa = True
    # Accepted so that attn_implementation="flash_attention_2" loads (MegaDLMs' script asks for it); the
    # attention is SDPA whatever is requested (see _check_and_adjust_attn_implementation).
    _supports_flash_attn = True
    _supports_flash_attn_2 = True

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation not in (None, "sdpa"):
            logger.warning_once(
                f"megadlms export: attn_implementation={attn_implementation!r} runs as torch SDPA "
                "(its flash kernel on GPU when a batch is unpadded); the numerics are SDPA's"
            )
        # Never flash_attn itself: it is not needed (and often not installed) for SDPA.
        return super()._check_and_adjust_attn_implementation("sdpa", *args, **kwargs)

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()


class MegaDLMsModel(MegaDLMsPreTrainedModel):
    """Embeddings, layers and final norm (the hidden states)."""

    def __init__(self, config: MegaDLMsConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions: Optional[nn.Embedding] = None
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(MegaDLMsLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _norm(config, config.hidden_size)
        self.post_init()

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, replace_position=None
    ):
        """(hidden states, per-layer (keys, values)). Fast-dLLM's cache protocol: the new tokens sit
        after ``past_key_values``' T slots, or at the slots ``replace_position`` (bool [B, T]) marks;
        ``attention_mask`` covers the query tokens, or every key slot when a cache is given."""
        B, S = input_ids.shape
        past = _check_past(past_key_values, len(self.layers))
        slots = _replace_slots(replace_position, S, past)
        T = S if past is None else (past[0][0].shape[2] + (S if slots is None else 0))
        if position_ids is None:
            position_ids = _positions(attention_mask, B, S, T, slots, input_ids.device)
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(position_ids)
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = _rotary(position_ids, self.config.head_dim, self.config.rope_theta)
        mask = _attention_mask(attention_mask, self.config.attention == "causal", S, T, slots, x.device, past)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, rotary, mask, None if past is None else past[i], slots)
            presents.append(present)
        return self.norm(x), tuple(presents)


def _check_past(past_key_values, num_layers: int):
    """The cache as a list of per-layer (keys, values), or None (empty or absent)."""
    if past_key_values is None or len(past_key_values) == 0:
        return None
    if len(past_key_values) != num_layers or not all(len(kv) == 2 for kv in past_key_values):
        raise ValueError(
            f"past_key_values must hold one (key, value) pair per layer ({num_layers}), as "
            "model(x, use_cache=True).past_key_values returns"
        )
    return list(past_key_values)


def _replace_slots(replace_position, S: int, past):
    """The cache slots [L] that the new tokens replace (Fast-dLLM's dual cache), or None."""
    if replace_position is None:
        return None
    if past is None:
        raise ValueError("replace_position needs past_key_values (the cache whose slots it replaces)")
    slots = replace_position[0].nonzero(as_tuple=True)[0]
    if not bool((replace_position == replace_position[:1]).all()) or slots.numel() != S:
        raise ValueError(f"replace_position must mark the same {S} slots (the input's length) in every row")
    return slots


def _positions(attention_mask, B: int, S: int, T: int, slots, device):
    """Position ids of the new tokens: MegaDLMs' rule (positions count from each row's first
    token, so left padding shifts nothing) over the T key slots, taken at the new tokens' slots."""
    if attention_mask is None:
        all_positions = torch.arange(T, device=device).expand(B, T)
    else:
        all_positions = attention_mask.to(torch.int64).cumsum(-1) - 1
        all_positions = all_positions.masked_fill(attention_mask == 0, 1)
    return all_positions[:, T - S :] if slots is None else all_positions[:, slots]


def _attention_mask(attention_mask, causal: bool, S: int, T: int, slots, device, past):
    """The SDPA mask [B, 1, 1 or S, T] (True = attend): padded keys out, causal models' later
    keys out; None when nothing is masked (the plain attention path)."""
    mask = None
    if attention_mask is not None and not bool(attention_mask.all()):
        mask = attention_mask.to(torch.bool)[:, None, None, :]  # key padding mask
    if causal and (mask is not None or past is not None):
        rows = torch.arange(T - S, T, device=device) if slots is None else slots.to(device)
        allowed = torch.arange(T, device=device)[None, :] <= rows[:, None]
        mask = allowed[None, None] if mask is None else mask & allowed[None, None]
    return mask


class MegaDLMsModelLM(MegaDLMsPreTrainedModel):
    """The language model: ``forward(input_ids, attention_mask=None, position_ids=None)
    -> .logits [B, S, V]`` over the tokenizer's vocabulary, and LLaDA's ``generate``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegaDLMsConfig) -> None:
        super().__init__(config)
        self.model = MegaDLMsModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        labels=None,
        past_key_values=None,
        use_cache: bool = False,
        replace_position=None,
        **kwargs,
    ):
        """``.logits`` [B, S, V]; with ``use_cache`` also ``.past_key_values`` (one (key, value)
        pair [B, kv heads, T, head_dim] per layer), Fast-dLLM's protocol (see MegaDLMsModel)."""
        hidden, presents = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            replace_position=replace_position,
        )
        logits = self.lm_head(hidden)
        if use_cache:
            return CausalLMOutputWithPast(logits=logits, past_key_values=presents)
        return MaskedLMOutput(logits=logits)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Union[torch.Tensor, Mapping],
        attention_mask: Optional[torch.Tensor] = None,
        *,
        mask_id: Optional[int] = None,
        seed: int = 0,
        generator: Optional[torch.Generator] = None,
        verbose: bool = False,
        stats: Optional[dict] = None,
        **kwargs,
    ) -> torch.Tensor:
        """Complete (left-padded) ``input_ids`` [b, P] -> [b, P + gen_length] with LLaDA's sampler
        (``input_ids`` may also be a tokenizer's output holding input_ids and attention_mask).

        Keyword arguments under MegaDLMs' names (``sample_steps``, ``inference_block_size``,
        ``max_new_tokens`` or ``max_length``, ``cfg``, ``remasking``, ``temperature``,
        ``top_p``, a ``generation_config``) or LLaDA's (``steps``, ``gen_length``,
        ``block_length``, ``temperature``, ``cfg_scale``, ``remasking``, ``mask_id``); see
        generation_megadlms.py. Unset: the export's defaults (config.json
        ``generation_defaults``), then temperature 0, and the model's positions after the
        prompt as MegaDLMs. ``verbose``: one line per finished block on stderr.
        ``threshold``: Fast-dLLM's parallel decoding (every masked token of the block whose
        confidence reaches it, at least one a step); ``stats``: a dict that receives "nfe", the
        forward passes used.
        """
        input_ids, attention_mask = _unpack_inputs(input_ids, attention_mask)
        unknown = sorted(k for k in kwargs if k not in IGNORED and k not in _GENERATE_NAMES)
        if unknown:
            logger.warning_once(f"megadlms export: generate ignores {unknown}")
        mask_id = self.config.mask_token_id if mask_id is None else mask_id
        if mask_id is None:
            raise ValueError("generate needs the [MASK] id: the config has no mask_token_id; pass mask_id")
        if self.config.attention != "bidirectional":
            raise ValueError("generate is the diffusion sampler: this export is a causal model")
        if input_ids.dim() != 2:
            raise ValueError(
                f"generate: input_ids must be [batch, length], got shape {tuple(input_ids.shape)}"
            )
        defaults = getattr(self.config, "generation_defaults", None) or {}
        args = {k: v for k, v in kwargs.items() if k in _GENERATE_NAMES}
        block_size = (getattr(self.config, "megadlms_model_config", None) or {}).get("difflm_block_size")
        if block_size is not None:  # a block-diffusion export: its block size, unless the caller gave it
            _check_block_call(args, attention_mask, block_size)
            args.setdefault("block_length", block_size)
            defaults = {k: v for k, v in defaults.items() if k != "block_length"}
        s = resolve(args, defaults, input_ids.shape[1], self.config.max_position_embeddings)
        total = input_ids.shape[1] + s["gen_length"]
        if self.config.position_embedding_type != "rope" and total > self.config.max_position_embeddings:
            raise ValueError(
                f"generate: prompt + new tokens = {total} exceeds the {self.config.max_position_embeddings} "
                "learned positions; generate fewer tokens"
            )
        if generator is None:
            generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            if block_size is not None:
                eos = kwargs.get("eos_token_id", self.config.eos_token_id)
                return block_diffusion_generate(
                    self, input_ids, s, mask_id, generator, block_size, eos, stats
                )
            return diffusion_generate(self, input_ids, attention_mask, s, mask_id, generator, verbose, stats)
        finally:
            self.train(was_training)


def _check_block_call(args: dict, attention_mask, block_size: int) -> None:
    """A block-diffusion export generates with its own block size, unpadded, with its exact cache."""
    given = args.get("block_length", args.get("inference_block_size"))
    if given not in (None, block_size):
        raise ValueError(
            f"generate: this export is a block-diffusion model of block size {block_size}, got {given}"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "generate: a block-diffusion export takes unpadded prompts (no attention_mask padding)"
        )
    if args.get("cfg", args.get("cfg_scale")) or args.get("cache") not in (None, "none", "prefix"):
        raise ValueError("generate: a block-diffusion export runs its exact prefix cache, without cfg")


def _unpack_inputs(
    inputs: Union[torch.Tensor, Mapping], attention_mask: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(input_ids, attention_mask) from a tensor or a tokenizer's output: transformers 5's
    ``apply_chat_template(..., return_tensors="pt")`` returns a BatchEncoding (input_ids +
    attention_mask), which ``generate`` takes as is."""
    if not isinstance(inputs, Mapping):
        return inputs, attention_mask
    return inputs["input_ids"], inputs.get("attention_mask") if attention_mask is None else attention_mask


_GENERATE_NAMES = (
    "threshold",
    "cache",
    "steps",
    "gen_length",
    "block_length",
    "temperature",
    "cfg_scale",
    "remasking",
    "top_p",
    "sample_steps",
    "inference_block_size",
    "max_new_tokens",
    "max_length",
    "cfg",
    "generation_config",
)
