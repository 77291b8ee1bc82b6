"""DiffusionConfig: how the training objective corrupts and scores a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadlms.config_errors import Problems

MODEL_RUNNING_MODES = ("difflm-noshift", "vanilla")
P_MASK_MODES = ("sampled", "realised")
OBJECTIVES = ("megadlms", "llada")
# (mask_eps, p_mask) of each objective: what each reference implementation trains with.
_OBJECTIVE_DEFAULTS = {"megadlms": (0.0, "realised"), "llada": (1e-3, "sampled")}


@dataclass(kw_only=True)
class DiffusionConfig:
    """Objective settings; field names follow the MegaDLMs flags in parentheses."""

    model_running_mode: str = "difflm-noshift"
    """'difflm-noshift' (masked diffusion, bidirectional) or 'vanilla' (AR, causal, shifted
    labels) (--model-running-mode)."""
    mask_token_id: int = -1
    """Id of [MASK] in the vocabulary (--mask-token); required in difflm-noshift mode."""
    mask_eps: Optional[float] = None
    """Per-token mask probability p = (1 - eps) * t + eps (--difflm-mask-eps); default from
    ``objective``: 0 (MegaDLMs) or 1e-3 (LLaDA)."""
    p_mask: Optional[str] = None
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
    objective: str = "llada"
    """difflm-noshift details (--difflm-objective; the CLI defaults to 'megadlms'):

    * 'megadlms' (MegaDLMs' pretrain_difflm.py + difflm GPTModel): the model input and the
      target are text[1:L] (``labels[:, :L-1]``, positions ``position_ids[:, 1:L]``), L = the
      crop or seq_length; eps 0 and the realised mask fraction with >= 1 masked token per
      row by default; the variable-length crop is drawn per micro-batch from
      numpy.random.seed(iteration * num_micro + micro), only with bidirectional attention.
    * 'llada' (LLaDA's pretraining recipe): the target is ``labels`` = text[1:S+1], S tokens;
      eps 1e-3 and the sampled p by default; one crop per step (counter-based).
    """

    def __post_init__(self) -> None:
        bad = Problems("DiffusionConfig")
        if bad.check(
            self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}, got {self.objective!r}"
        ):
            eps, p_mask = _OBJECTIVE_DEFAULTS[self.objective]
            self.mask_eps = eps if self.mask_eps is None else self.mask_eps
            self.p_mask = p_mask if self.p_mask is None else self.p_mask
        else:  # keep the remaining checks meaningful
            self.mask_eps, self.p_mask = self.mask_eps or 0.0, self.p_mask or "sampled"
        bad.check(
            self.model_running_mode in MODEL_RUNNING_MODES,
            f"model_running_mode must be one of {MODEL_RUNNING_MODES}, got {self.model_running_mode!r}",
        )
        bad.check(self.p_mask in P_MASK_MODES, f"p_mask must be one of {P_MASK_MODES}, got {self.p_mask!r}")
        bad.check(0.0 <= self.mask_eps < 1.0, f"mask_eps must be in [0, 1), got {self.mask_eps}")
        bad.check(0.0 <= self.varilen_prob <= 1.0, f"varilen_prob must be in [0, 1], got {self.varilen_prob}")
        bad.check(
            self.model_running_mode != "difflm-noshift" or self.mask_token_id >= 0,
            "difflm-noshift needs the [MASK] token id (mask_token_id, from the tokenizer's mask "
            f"token), got mask_token_id={self.mask_token_id}",
        )
        bad.check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        bad.check(
            isinstance(self.eval_mc_samples, int) and self.eval_mc_samples >= 1,
            f"eval_mc_samples must be >= 1, got {self.eval_mc_samples}",
        )
        bad.raise_if_any()

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if the [MASK] id cannot be embedded by a model with ``vocab_size`` rows."""
        if self.model_running_mode == "difflm-noshift" and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the model vocabulary "
                f"[0, {vocab_size}): check the tokenizer's mask token and vocab_size"
            )
