"""DiffusionConfig: how the training objective corrupts and scores a batch."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_RUNNING_MODES = ("difflm-noshift", "vanilla")
P_MASK_MODES = ("sampled", "realised")


@dataclass(kw_only=True)
class DiffusionConfig:
    """Objective settings; field names follow the MegaDLMs flags in parentheses."""

    model_running_mode: str = "difflm-noshift"
    """'difflm-noshift' (masked diffusion, bidirectional) or 'vanilla' (AR, causal, shifted
    labels) (--model-running-mode)."""
    mask_token_id: int = -1
    """Id of [MASK] in the vocabulary (--mask-token); required in difflm-noshift mode."""
    mask_eps: float = 1e-3
    """Per-token mask probability p = (1 - eps) * t + eps (--difflm-mask-eps); LLaDA uses
    1e-3, 0 reproduces MegaDLMs."""
    p_mask: str = "sampled"
    """Loss weight 1/p with p the sampled probability ('sampled', LLaDA/MDLM) or the
    realised masked fraction of the row, forcing >= 1 masked token ('realised', MegaDLMs)
    (--difflm-p-mask)."""
    varilen_prob: float = 0.01
    """Probability that a step's batch is cropped to a random length in [2, seq_length]
    (--difflm-varilen-prob)."""
    seed: int = 1234
    """Seed of the counter-based noise (--seed)."""

    def __post_init__(self) -> None:
        if self.model_running_mode not in MODEL_RUNNING_MODES:
            raise ValueError(
                f"--model-running-mode must be one of {MODEL_RUNNING_MODES}, got {self.model_running_mode!r}"
            )
        if self.p_mask not in P_MASK_MODES:
            raise ValueError(f"--difflm-p-mask must be one of {P_MASK_MODES}, got {self.p_mask!r}")
        if not 0.0 <= self.mask_eps < 1.0:
            raise ValueError(f"--difflm-mask-eps must be in [0, 1), got {self.mask_eps}")
        if not 0.0 <= self.varilen_prob <= 1.0:
            raise ValueError(f"--difflm-varilen-prob must be in [0, 1], got {self.varilen_prob}")
        if self.model_running_mode == "difflm-noshift" and self.mask_token_id < 0:
            raise ValueError(
                "difflm-noshift needs the [MASK] token id (--mask-token / the "
                f"tokenizer's mask id), got mask_token_id={self.mask_token_id}"
            )
        if not isinstance(self.seed, int):
            raise ValueError(f"--seed must be an integer, got {self.seed!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if the [MASK] id cannot be embedded by a model with ``vocab_size`` rows."""
        if self.model_running_mode == "difflm-noshift" and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"mask token id {self.mask_token_id} (--mask-token) is outside the "
                f"model vocabulary [0, {vocab_size}); check --vocab-size/--mask-token"
            )
