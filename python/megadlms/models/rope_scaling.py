"""RoPE scaling (``--rope-scaling``): the inverse frequencies of the long-context variants that
Llama 3.x, Qwen2.5 / Qwen3 (yarn) and linear-interpolation checkpoints were trained with, as
``transformers.modeling_rope_utils`` computes them, so an imported model's logits are its own.

``rope_scaling`` is a dict with ``rope_type`` and that type's parameters:

* ``linear``: ``factor`` (every frequency divided by it: positions interpolated);
* ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings`` (long wavelengths divided by the factor, short ones kept,
  a smooth blend between);
* ``yarn``: ``factor``, ``original_max_position_embeddings`` and optionally ``beta_fast`` (32),
  ``beta_slow`` (1), ``attention_factor`` (default 0.1 ln(factor) + 1, or from ``mscale`` /
  ``mscale_all_dim``), ``truncate`` (True): the frequencies blended by a linear ramp over the
  head dims, and cos / sin multiplied by the attention factor.

Other types (dynamic, longrope, ...) are refused by name (:func:`rope_scaling_problems`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
OPTIONAL = {
    "linear": (),
    "llama3": (),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
}


def rope_scaling_problems(scaling: Optional[Dict[str, Any]]) -> List[str]:
    """What is wrong with ``scaling`` (empty when None or valid), worded with field names."""
    if scaling is None:
        return []
    kind = scaling.get("rope_type")
    if kind not in REQUIRED:
        return [f"rope_scaling rope_type {kind!r} is not implemented (megadlms has {sorted(REQUIRED)})"]
    out = [f"rope_scaling {kind} needs {name}" for name in REQUIRED[kind] if scaling.get(name) is None]
    unknown = set(scaling) - {"rope_type", *REQUIRED[kind], *OPTIONAL[kind]}
    if unknown:
        out.append(f"rope_scaling {kind}: unknown parameters {sorted(unknown)}")
    return out


def _yarn_attention_factor(s: Dict[str, Any], factor: float) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def _yarn(pos_freqs: torch.Tensor, dim: int, base: float, s: Dict[str, Any]) -> Tuple[torch.Tensor, float]:
    factor, original = float(s["factor"]), s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the head dim whose wavelength makes ``rotations`` turns
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low), 0, 1
    )
    extrapolation = 1 - ramp  # 1: keep the frequency (short wavelengths), 0: interpolate it
    # Written as transformers writes it (1 / (factor * p), not (1 / p) / factor): the same float32 roundings.
    interpolated, kept = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + kept * extrapolation, _yarn_attention_factor(s, factor)


def _llama3(inv_freq: torch.Tensor, s: Dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def scaled_inv_freq(
    pos_freqs: torch.Tensor, dim: int, base: float, scaling: Optional[Dict[str, Any]]
) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies, cos / sin factor) of RoPE with ``scaling`` from ``pos_freqs`` =
    base ** (2j / dim) (None: 1 / pos_freqs and 1.0, plain RoPE)."""
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(pos_freqs, dim, base, scaling)
