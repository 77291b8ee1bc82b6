"""DiffusionConfig: how the training objective corrupts and scores a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadlms.common.enums import Objective, PMaskMode, RunningMode, SFTLossNormalization
from megadlms.common.errors import Problems

MODEL_RUNNING_MODES = tuple(m.value for m in RunningMode)
P_MASK_MODES = tuple(m.value for m in PMaskMode)
OBJECTIVES = tuple(m.value for m in Objective)
_DIFFUSION_MODES = (RunningMode.DIFFLM_NOSHIFT, RunningMode.DIFFLM_SHIFT)
# (mask_eps, p_mask) of each objective: what each reference implementation trains with.
_OBJECTIVE_DEFAULTS = {
    Objective.MEGADLMS: (0.0, PMaskMode.REALISED),
    Objective.LLADA: (1e-3, PMaskMode.SAMPLED),
}


@dataclass(kw_only=True)
class DiffusionConfig:
    """Objective settings; field names follow the MegaDLMs flags in parentheses."""

    model_running_mode: RunningMode = RunningMode.DIFFLM_NOSHIFT
    """'difflm-noshift' (masked diffusion, bidirectional), 'difflm-shift' (masked diffusion
    whose logits at i predict token i + 1: Dream) or 'vanilla' (AR, causal, shifted labels)
    (--model-running-mode)."""
    mask_token_id: int = -1
    """Id of [MASK] in the vocabulary (--mask-token); required in the difflm modes."""
    mask_eps: float = None  # type: ignore[assignment]  # None until __post_init__ picks the objective's
    """Per-token mask probability p = (1 - eps) * t + eps (--difflm-mask-eps); default from
    ``objective``: 0 (MegaDLMs) or 1e-3 (LLaDA)."""
    p_mask: Optional[PMaskMode] = None
    """Loss weight 1/p with p the sampled probability ('sampled', LLaDA/MDLM) or the
    realised masked fraction of the row, forcing >= 1 masked token ('realised', MegaDLMs)
    (--difflm-p-mask); default from ``objective``."""
    varilen_prob: float = 0.01
    """Probability that a step's batch is cropped to a random length in [2, seq_length]
    (--difflm-varilen-prob)."""
    seed: int = 1234
    """Seed of the counter-based noise (--seed)."""

    eval_mc_samples: int = 1
    """K: Monte Carlo copies per sequence of the validation NELBO (--difflm-eval-mc-samples)."""
    objective: Objective = Objective.LLADA
    """difflm-noshift details (--difflm-objective; the CLI defaults to 'megadlms'):

    * 'megadlms' (MegaDLMs' pretrain_difflm.py + difflm GPTModel): the model input and the
      target are text[1:L] (``labels[:, :L-1]``, positions ``position_ids[:, 1:L]``), L = the
      crop or seq_length; eps 0 and the realised mask fraction with >= 1 masked token per
      row by default; the variable-length crop is drawn per micro-batch from
      numpy.random.seed(iteration * num_micro + micro), only with bidirectional attention.
    * 'llada' (LLaDA's pretraining recipe): the target is ``labels`` = text[1:S+1], S tokens;
      eps 1e-3 and the sampled p by default; one crop per step (counter-based).
    """

    block_size: Optional[int] = None
    """Block diffusion (BD3-LM) with blocks of this many tokens (--difflm-block-size): one pass
    over [x_t ; x_0] under the block mask, t drawn per block, the loss on x_t. A sequence of at
    most one block runs the full-sequence objective unchanged (the x_0 half would be dead
    weight: x_t's single block sees only itself). None: the full-sequence objective."""
    noise_clip_low: float = 0.0
    """Block diffusion: t ~ U(low, high) (BD3-LM's sampling_eps_min; --difflm-noise-clip-low)."""
    noise_clip_high: float = 1.0
    """Block diffusion: t ~ U(low, high) (BD3-LM's sampling_eps_max; --difflm-noise-clip-high)."""

    ar_loss_weight: float = 0.0
    """Block diffusion of a difflm-shift model: the weight of the autoregressive loss on the
    clean x_0 stream (which then attends token-causally), added to x_t's diffusion loss in the
    same pass (--difflm-ar-loss-weight); 0: none."""

    sft: bool = False
    """Supervised fine-tuning (--sft): batches carry ``answer_mask``; only answer positions are
    noised and scored (difflm-noshift), or carry the loss (vanilla: Megatron's SFT); no
    variable-length crop (the answer must stay whole)."""
    sft_loss_normalization: SFTLossNormalization = SFTLossNormalization.SAMPLE
    """--sft-loss-normalization: 'sample' (LLaDA's) or 'token' (the global answer-token mean)."""

    def __post_init__(self) -> None:
        bad = Problems("DiffusionConfig")
        bad.member(self, "sft_loss_normalization", SFTLossNormalization)
        bad.member(self, "objective", Objective)
        bad.member(self, "model_running_mode", RunningMode)
        bad.member(self, "p_mask", PMaskMode, optional=True)
        defaults = _OBJECTIVE_DEFAULTS.get(self.objective)  # None: an unknown objective (reported)
        eps, p_mask = defaults if defaults is not None else (0.0, PMaskMode.SAMPLED)
        self.mask_eps = eps if self.mask_eps is None else self.mask_eps
        self.p_mask = p_mask if self.p_mask is None else self.p_mask
        bad.check(0.0 <= self.mask_eps < 1.0, f"mask_eps must be in [0, 1), got {self.mask_eps}")
        bad.check(0.0 <= self.varilen_prob <= 1.0, f"varilen_prob must be in [0, 1], got {self.varilen_prob}")
        bad.check(
            not self.diffusion or self.mask_token_id >= 0,
            f"{self.model_running_mode} needs the [MASK] token id (mask_token_id, from the tokenizer's mask "
            f"token), got mask_token_id={self.mask_token_id}",
        )
        bad.check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        bad.check(
            isinstance(self.eval_mc_samples, int) and self.eval_mc_samples >= 1,
            f"eval_mc_samples must be >= 1, got {self.eval_mc_samples}",
        )
        bad.check(
            self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1),
            f"block_size must be a positive integer or None, got {self.block_size!r}",
        )
        bad.check(
            0.0 <= self.noise_clip_low < self.noise_clip_high <= 1.0,
            "noise clip must satisfy 0 <= low < high <= 1, got "
            f"({self.noise_clip_low}, {self.noise_clip_high})",
        )
        bad.check(
            self.block_size is None or (self.diffusion and not self.sft),
            "block_size (--difflm-block-size) needs masked-diffusion pretraining (not vanilla, not --sft)",
        )
        bad.check(
            not self.ar_loss_weight
            or (self.block_size is not None and self.model_running_mode is RunningMode.DIFFLM_SHIFT),
            f"ar_loss_weight ({self.ar_loss_weight}) needs block_size and the difflm-shift mode "
            "(its logits predict the next token)",
        )
        bad.check(self.ar_loss_weight >= 0, f"ar_loss_weight must be >= 0, got {self.ar_loss_weight}")
        bad.raise_if_any()

    def blocks(self, length: int) -> bool:
        """True when a model input of ``length`` tokens runs the block-diffusion pass (more than
        one block, or any length with the AR loss on x_0); False: the full-sequence objective."""
        if not self.diffusion or self.block_size is None:
            return False
        return length > self.block_size or self.ar_loss_weight > 0

    @property
    def diffusion(self) -> bool:
        """True in the masked-diffusion modes, False in the autoregressive (vanilla) one."""
        return self.model_running_mode in _DIFFUSION_MODES

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if the [MASK] id cannot be embedded by a model with ``vocab_size`` rows."""
        if self.diffusion and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the model vocabulary "
                f"[0, {vocab_size}): check the tokenizer's mask token and vocab_size"
            )


_BLOCK_FIELDS = ("block_size", "noise_clip_low", "noise_clip_high", "ar_loss_weight")


def block_diffusion_defaults(config: DiffusionConfig) -> tuple:
    """The block-diffusion fields of ``config`` still at their defaults (every one for a run
    without block diffusion): run records leave them out, so such a run's record keeps its bytes."""
    defaults = DiffusionConfig(mask_token_id=0)
    return tuple(f for f in _BLOCK_FIELDS if getattr(config, f) == getattr(defaults, f))
