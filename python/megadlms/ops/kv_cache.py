"""Keys and values kept across forward passes: the one KV-cache of the model.

Diffusion sampling recomputes the whole sequence at every step. Fast-dLLM (arXiv 2505.22618)
keeps the keys/values of positions that change little within a block and recomputes only
the rest; block diffusion keeps those of committed blocks, which never change (exact). Both
are one mechanism here:

    cache = KVCache()
    logits = model(x, kv_cache=cache)                              # every position, recorded
    cache.truncate(start)                                          # keep [0, start) (prefix cache)
    logits = model(x[:, start:], kv_cache=cache, cache_offset=start)  # writes [start, S), attends to all

A forward with ``kv_cache`` writes the keys/values of its tokens at slots ``[cache_offset,
cache_offset + S)`` (overwriting or extending) and its queries attend to every slot of the
cache after that write. Slot t holds position t's keys after q/k norm and rotary (positions
are fixed per slot, so keys are stored rotated, never re-rotated). Each tensor-parallel
rank caches its own heads ([B, G/tp, T, D]); pipeline chunks cache their own layers (keys are
global layer numbers).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

KV = Tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """Per-layer keys and values [B, G, T, D] of slots [0, length) of a batch.

    ``key_mask`` bool [B, >= T] (True = a real token): slots of left padding, never attended to
    (None: every slot is real)."""

    def __init__(self, key_mask: Optional[torch.Tensor] = None) -> None:
        self.layers: Dict[int, KV] = {}
        self.key_mask = key_mask

    @property
    def length(self) -> int:
        """Slots held (0 when empty)."""
        return next(iter(self.layers.values()))[0].shape[2] if self.layers else 0

    def truncate(self, length: int) -> None:
        """Keep slots [0, length) of every layer (views: no copy)."""
        self.layers = {n: (k[:, :, :length], v[:, :, :length]) for n, (k, v) in self.layers.items()}

    def write(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Store ``k``/``v`` [B, G, L, D] at slots [offset, offset + L) of ``layer``; returns the
        layer's keys/values after the write. The first write returns ``k``/``v`` themselves, so a
        forward that starts the cache computes exactly what the uncached forward computes."""
        held = self.layers.get(layer)
        end = offset + k.shape[2]
        if held is None:
            if offset != 0:
                raise ValueError(
                    f"KVCache: layer {layer} is empty; the first write must start at slot 0, not {offset}"
                )
            self.layers[layer] = (k.contiguous(), v.contiguous())
            return k, v
        old_k, old_v = held
        if offset > old_k.shape[2]:
            raise ValueError(
                f"KVCache: write at slot {offset} leaves a gap after the {old_k.shape[2]} slots held"
            )
        if end > old_k.shape[2]:  # extends the cache: what stays before offset, then the new slots
            new = (torch.cat([old_k[:, :, :offset], k], dim=2), torch.cat([old_v[:, :, :offset], v], dim=2))
        else:  # replaces slots in place (Fast-dLLM's dual cache refreshes its block this way)
            old_k[:, :, offset:end] = k
            old_v[:, :, offset:end] = v
            new = (old_k, old_v)
        self.layers[layer] = new
        return new


class CachedAttention:
    """One forward's use of a :class:`KVCache`: its ``valid`` tokens sit at slots [offset,
    offset + valid) (a sequence-parallel forward pads after them; the padding is never written),
    and its queries attend to the cache's slots (causal models: only slots at or before their
    own). Passed to the layers in place of an attention mask, as ContextParallelPlan is."""

    def __init__(self, cache: KVCache, offset: int, valid: int, causal: bool) -> None:
        self.cache, self.offset, self.valid, self.causal = cache, offset, valid, causal

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool):
        """Attention of ``q`` [B, N, S, D] over the cache after writing ``k``/``v`` [B, G, S, D]."""
        keys, values = self.cache.write(layer, self.offset, k[:, :, : self.valid], v[:, :, : self.valid])
        T, S = keys.shape[2], q.shape[2]
        mask = None
        if self.cache.key_mask is not None:
            mask = self.cache.key_mask[:, None, None, :T].to(q.device)
        if self.causal:
            rows = torch.arange(self.offset, self.offset + S, device=q.device)[:, None]
            causal = torch.arange(T, device=q.device)[None, :] <= rows  # [S, T]
            mask = causal[None, None] if mask is None else mask & causal[None, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=enable_gqa)
