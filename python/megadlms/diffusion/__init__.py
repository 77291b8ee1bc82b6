"""megadlms.diffusion: the masked-diffusion objective, its validation NELBO and the sampler.

Forward process (LLaDA, Nie et al. 2025, eq. 3 and their "guidelines" pretraining code;
MDLM, Sahoo et al. 2024, linear schedule alpha_t = 1 - t). For a clean sequence x0 of
length S and one t ~ U(0, 1) per sequence:

    p = (1 - eps) * t + eps                     # --difflm-mask-eps, default 1e-3 (LLaDA)
    x_t[j] = [MASK] with probability p, else x0[j], independently per position j

Loss (--model-running-mode difflm-noshift), the ELBO's Monte Carlo estimate:

    loss = sum_{j masked, loss_mask[j]=1} -log p_theta(x0[j] | x_t) / p  /  N_loss

where N_loss is the number of loss tokens of the whole optimizer step (all micro-batches
and data-parallel ranks), so E_t,mask[loss] = mean token CE for a model that ignores the
context (E[1{masked}/p] = 1): the 1/p weight makes the estimator unbiased.
--difflm-p-mask realised reproduces MegaDLMs (with --difflm-mask-eps 0): a row with no
masked loss token gets one forced (its loss position with the smallest mask uniform) and
p is the row's realised masked fraction of its loss positions. "difflm-noshift": the
model sees x_t at the positions of x0 (no next-token shift); the clean sequence is the
dataset's ``labels`` (= text[1:], aligned with loss_mask), S tokens long (MegaDLMs feeds
text[1:S], S-1 tokens).

Variable length (--difflm-varilen-prob, default 0.01, as MegaDLMs): with that
probability a step's batch is cropped to a length uniform in [2, S], the same on every
rank and micro-batch of the step.

Noise (``noise.py``): every uniform is SplitMix64 hashed from (seed, stream, global sample
index, draw, position), computed with int64 torch ops (identical on CPU and GPU). So the
noise of a sample never depends on the rank, micro-batch size or data-parallel size, and
a run's loss curve is the same on 1, 2 or 3 ranks with or without gradient accumulation up
to float reduction order. (MegaDLMs draws from a per-rank torch.Generator instead.)

"difflm-shift" (Dream, Fast-dLLM v2; ``shift.py``, the one place that decides the shift):
the logits at position i predict token i + 1. The model reads text[0:L] (``tokens``),
text[1:L] may be masked, each target scored at the logit position before it; the sampler
and the answer likelihood read each position's prediction from the logits before it.

Vanilla mode (--model-running-mode vanilla): causal model, next-token CE on the shifted
``labels``, same normalisation.

One objective (``objective.py``): ``training_inputs`` / ``validation_inputs`` turn a batch
into the model's inputs and the targets a scorer (``loss.py``) reads; the trainer, its
pipeline stages, ``validation_nelbo`` and ``compute_loss`` all call them.

Validation (``validation_nelbo``): K Monte Carlo copies per sequence with stratified
t_k = (k + u_k) / K, sampled-p weights, no crop, noise from (seed, sample index, k): a
deterministic per-token NELBO and the perplexity bound exp(NELBO).

Sampling (``generate``): LLaDA's semi-autoregressive low-confidence remasking sampler with
optional Gumbel temperature (float64) and classifier-free guidance.

Vocabulary (``vocab.py``): the loss and the validation NELBO keep Megatron's softmax over
the padded vocabulary; the sampler and the answer likelihood see only the real tokens
(``token_logits``: vocab-parallel slices gathered, padding rows cut).
"""

from .config import MODEL_RUNNING_MODES, OBJECTIVES, P_MASK_MODES, DiffusionConfig
from .denoise import add_gumbel_noise, get_num_transfer_tokens
from .evaluation import validation_nelbo
from .likelihood import answer_nll_draws, conditional_log_likelihood
from .loss import (
    LossSums,
    ar_loss,
    check_model_for_mode,
    diffusion_loss,
    sft_loss,
    sft_weights,
    token_cross_entropy_of,
)
from .noise import (
    counter_uniform,
    forward_process,
    micro_batch_crop,
    sft_forward_process,
    validation_times,
    varilen_length,
)
from .objective import (
    MicroBatchLoss,
    ObjectiveBatch,
    compute_loss,
    loss_token_count,
    model_length,
    objective_inputs,
    training_inputs,
    validation_draws,
    validation_inputs,
)
from .sampler import generate
from .shift import position_logits, predicts_next, to_logit_positions
from .vocab import real_vocab_size, token_logits

__all__ = [
    "DiffusionConfig",
    "MODEL_RUNNING_MODES",
    "P_MASK_MODES",
    "OBJECTIVES",
    "ObjectiveBatch",
    "LossSums",
    "MicroBatchLoss",
    "training_inputs",
    "validation_inputs",
    "validation_draws",
    "model_length",
    "objective_inputs",
    "micro_batch_crop",
    "forward_process",
    "sft_forward_process",
    "sft_loss",
    "sft_weights",
    "varilen_length",
    "counter_uniform",
    "diffusion_loss",
    "ar_loss",
    "token_cross_entropy_of",
    "compute_loss",
    "check_model_for_mode",
    "loss_token_count",
    "validation_nelbo",
    "validation_times",
    "generate",
    "get_num_transfer_tokens",
    "add_gumbel_noise",
    "conditional_log_likelihood",
    "answer_nll_draws",
    "token_logits",
    "real_vocab_size",
    "predicts_next",
    "position_logits",
    "to_logit_positions",
]
