"""The objectives, written once: what a micro-batch becomes before the model (its inputs)
and what the model's logits are scored against (its targets).

Every caller goes through :func:`training_inputs` / :func:`validation_inputs` and
:meth:`ObjectiveBatch.score`: the trainer (training/pipeline_run.py, every layout; under
pipeline parallelism the last stage scores, under context parallelism each rank scores its
slice of the same targets), the validation NELBO (:func:`~.evaluation.validation_nelbo` and
the trainer's forward-only pipeline) and a user's :func:`compute_loss`. So ``compute_loss``
on one process gives the trainer's number for the same batch, crop and weights.

Adding an objective: a member of the mode enum (``megadlms.common.enums``) and one builder
here (``_TRAINING`` / ``_VALIDATION``); the scorer it names lives in loss.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, NamedTuple, Optional, TypedDict

import torch

from megadlms.common.enums import AttnMaskType, Objective, PMaskMode, RunningMode, SFTLossNormalization
from megadlms.ops.block_mask import BlockDiffusion

from .block import (
    block_forward_process,
    block_score,
    block_times,
    clip_times,
    logit_index,
    num_blocks,
    two_stream,
)
from .config import DiffusionConfig
from .loss import (
    LossSums,
    TokenCrossEntropy,
    ar_loss,
    check_model_for_mode,
    diffusion_loss,
    num_tokens,
    sft_weights,
)
from .loss import token_cross_entropy_of as _scorer_of
from .noise import (
    TAG_TIME,
    counter_uniform,
    forward_process,
    micro_batch_crop,
    sft_forward_process,
    validation_times,
)
from .shift import predicts_next, to_logit_positions

Batch = Dict[str, torch.Tensor]


@dataclasses.dataclass
class ObjectiveBatch:
    """One micro-batch as the model and the loss see it: the model's inputs, and the scorer
    ``scorer(logits, cross_entropy, **targets) -> LossSums`` with its [B, S] ``targets`` (kept
    apart from the inputs so that context parallelism can slice both alike)."""

    tokens: torch.Tensor
    position_ids: Optional[torch.Tensor]
    document_ids: Optional[torch.Tensor]
    scorer: Callable[..., LossSums]
    targets: Dict[str, Optional[torch.Tensor]]
    block: Optional[BlockDiffusion] = None
    """Block diffusion: ``tokens`` is [x_t ; x_0] and the model runs BD3-LM's mask (None: plain)."""

    def forward(
        self, model: Callable[..., torch.Tensor], hidden_states: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``model``'s output on these inputs (``hidden_states``: a later pipeline chunk's input;
        the token ids still give it the batch shape)."""
        kw: Dict[str, Any] = {} if self.document_ids is None else {"document_ids": self.document_ids}
        if hidden_states is not None:
            kw["hidden_states"] = hidden_states
        if self.block is not None:
            kw["block_diffusion"] = self.block
        return model(self.tokens, self.position_ids, **kw)

    def score(self, logits: torch.Tensor, cross_entropy: TokenCrossEntropy) -> LossSums:
        """(loss sum, loss tokens) of ``logits`` against the targets."""
        return self.scorer(logits, cross_entropy, **self.targets)


def _ar_score(logits, cross_entropy, labels, loss_mask) -> LossSums:
    return ar_loss(logits, labels, loss_mask, cross_entropy)


def _diffusion_score(logits, cross_entropy, clean, masked, p_mask, loss_mask) -> LossSums:
    return diffusion_loss(logits, clean, masked, p_mask, loss_mask, cross_entropy)


def _noise(clean, sample_idx, config: DiffusionConfig, loss_mask, **kw):
    """forward_process, or its block version (t per block) for a block-diffusion sequence; a
    one-block sequence draws today's t (clipped to the noise range when the block size is set)."""
    offset = 1 if predicts_next(config.model_running_mode) else 0  # the model reads a first token before
    if config.blocks(clean.shape[1] + offset):
        return block_forward_process(clean, sample_idx, config, loss_mask, offset=offset, **kw)
    if config.block_size is not None and kw.get("t") is None:
        idx = torch.as_tensor(sample_idx, dtype=torch.int64, device=clean.device).reshape(-1)
        kw["t"] = clip_times(counter_uniform(config.seed, TAG_TIME, idx, kw.get("draw", 0)), config)
    return forward_process(clean, sample_idx, config, loss_mask, **kw)


class ObjectiveInputs(TypedDict):
    """:func:`objective_inputs`' result: the clean target sequence and what goes with it."""

    clean: torch.Tensor
    loss_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    document_ids: Optional[torch.Tensor]
    answer_mask: Optional[torch.Tensor]
    """Fine-tuning batches: True at the answer positions of ``clean`` (else None)."""
    first: Optional[torch.Tensor]
    """difflm-shift: the [b, 1] first tokens, read by the model before ``clean`` and never
    masked or scored (no position predicts them); else None. ``position_ids`` and
    ``document_ids`` then describe the model input ``[first, clean]``."""


def objective_inputs(batch: Batch, config: DiffusionConfig, crop: Optional[int] = None) -> ObjectiveInputs:
    """The clean sequence the difflm-noshift objective denoises, with its loss mask, position
    ids and (document packing) document ids, after an optional crop to ``crop`` positions.

    'megadlms': MegaDLMs crops tokens/labels/positions to L = crop (or S), then drops one
    position: input and target are text[1:L] = ``labels[:, :L-1]``, positions
    ``position_ids[:, 1:L]``, loss mask ``loss_mask[:, :L-1]`` (L-1 tokens).
    'llada': the target is ``labels[:, :L]`` with ``position_ids[:, :L]`` (L tokens).
    ``document_ids`` (present when packing) are aligned with ``labels``; cropped like them.
    """
    labels = batch["labels"]
    S = labels.shape[1]
    L = S if crop is None else crop
    if predicts_next(config.model_running_mode):
        return _shifted_inputs(batch, L)
    loss_mask, position_ids = batch.get("loss_mask"), batch.get("position_ids")
    document_ids, answer_mask = batch.get("document_ids"), batch.get("answer_mask")
    if config.objective is Objective.MEGADLMS:
        # labels[j] is text[j + 1] and position_ids[j + 1] is its position: the two slices are one token apart
        # but describe the same tokens text[1:L].
        lab, pos = slice(0, L - 1), slice(1, L)
    else:
        lab, pos = slice(0, L), slice(0, L)
    docs = None if document_ids is None else document_ids[:, lab]
    if docs is not None and config.objective is Objective.LLADA:
        # the target is labels (text[1:]): positions restart at each of ITS documents
        idx = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
        new_doc = torch.ones_like(docs, dtype=torch.bool)
        new_doc[:, 1:] = docs[:, 1:] != docs[:, :-1]
        # cummax carries the start of the latest document forward; subtracting it restarts positions at 0.
        position_ids = idx - torch.where(new_doc, idx, torch.zeros_like(idx)).cummax(dim=1).values
        pos = slice(None)
    return ObjectiveInputs(
        clean=labels[:, lab],
        loss_mask=None if loss_mask is None else loss_mask[:, lab],
        position_ids=None if position_ids is None else position_ids[:, pos],
        document_ids=docs,
        answer_mask=None if answer_mask is None else answer_mask[:, lab],
        first=None,
    )


def _shifted_inputs(batch: Batch, L: int) -> ObjectiveInputs:
    """difflm-shift (Dream's layout, whatever the objective): the model reads text[0:L]
    (``tokens[:, :L]``, the autoregressive input); text[1:L] = ``labels[:, :L-1]`` may be
    masked, each scored at the position before it (``megadlms.diffusion.shift``)."""
    loss_mask, answer_mask = batch.get("loss_mask"), batch.get("answer_mask")
    position_ids, document_ids = batch.get("position_ids"), batch.get("document_ids")
    return ObjectiveInputs(
        clean=batch["labels"][:, : L - 1],
        loss_mask=None if loss_mask is None else loss_mask[:, : L - 1],
        # As the autoregressive input: positions and documents of tokens[:, :L].
        position_ids=None if position_ids is None else position_ids[:, :L],
        document_ids=None if document_ids is None else document_ids[:, :L],
        answer_mask=None if answer_mask is None else answer_mask[:, : L - 1],
        first=batch["tokens"][:, :1],
    )


def _sample_idx(batch: Batch) -> torch.Tensor:
    if "sample_idx" not in batch:
        raise ValueError(
            "difflm-noshift needs batch['sample_idx'] (the global sample indices "
            "that seed the noise); use the data package's collate"
        )
    return batch["sample_idx"]


def _ar_inputs(batch: Batch, config: DiffusionConfig, crop: Optional[int]) -> ObjectiveBatch:
    targets = {"labels": batch["labels"], "loss_mask": batch.get("loss_mask")}
    return ObjectiveBatch(
        batch["tokens"], batch.get("position_ids"), batch.get("document_ids"), _ar_score, targets
    )


def _answer(inputs: ObjectiveInputs) -> torch.Tensor:
    answer = inputs["answer_mask"]
    if answer is None:
        raise ValueError(
            "--sft needs batch['answer_mask'] (True at answer positions): use the fine-tuning data "
            "(megadlms.data.sft), not pretraining data"
        )
    return answer


def _diffusion_training(batch: Batch, config: DiffusionConfig, crop: Optional[int]) -> ObjectiveBatch:
    sample_idx = _sample_idx(batch)
    inputs = objective_inputs(batch, config, crop)
    clean, loss_mask = inputs["clean"], inputs["loss_mask"]
    if config.sft:
        # LLaDA's SFT: the prompt stays clean; the weights carry the per-sample normalisation.
        answer = _answer(inputs)
        noisy, masked, p_mask = sft_forward_process(clean, answer, sample_idx, config)
        loss_mask = sft_weights(answer, config.sft_loss_normalization)
    else:
        noisy, masked, p_mask = _noise(clean, sample_idx, config, loss_mask)
    return _diffusion_batch(inputs, config, noisy, masked, p_mask, loss_mask)


def _diffusion_batch(inputs: ObjectiveInputs, config: DiffusionConfig, noisy, masked, p_mask, loss_mask):
    """The model input and the targets of a noised ``inputs``; difflm-shift: the first token
    before the input, each target at the logit position that predicts it. Block diffusion
    (more than one block): the input is [x_t ; x_0] under the block mask, x_t scored."""
    clean, first = inputs["clean"], inputs["first"]
    if first is not None:
        noisy = torch.cat([first, noisy], dim=1)
        # Every loss position needs an explicit weight: the last logit position predicts nothing.
        weight = torch.ones_like(clean, dtype=torch.float32) if loss_mask is None else loss_mask
        clean, masked, loss_mask = (
            to_logit_positions(clean, 0),
            to_logit_positions(masked, False),
            to_logit_positions(weight, 0.0),
        )
        p_mask = to_logit_positions(p_mask, 1.0)
    targets = {"clean": clean, "masked": masked, "p_mask": p_mask, "loss_mask": loss_mask}
    n = noisy.shape[1]
    if not config.blocks(n):
        return ObjectiveBatch(
            noisy, inputs["position_ids"], inputs["document_ids"], _diffusion_score, targets
        )
    # The x_t half is scored; the x_0 half gives it its clean context (and, weighted, the AR loss).
    x0 = inputs["clean"] if first is None else torch.cat([first, inputs["clean"]], dim=1)
    tokens, positions = two_stream(noisy, x0, inputs["position_ids"])
    B = int(config.block_size)  # type: ignore[arg-type]  # blocks() holds only with a block size
    index = None if first is None else logit_index(n, B, noisy.device)
    scorer = functools.partial(block_score, index=index, ar_weight=config.ar_loss_weight)
    spec = BlockDiffusion(B, causal_clean=config.ar_loss_weight > 0)
    return ObjectiveBatch(tokens, positions, None, scorer, targets, spec)


def _diffusion_validation(batch: Batch, config: DiffusionConfig, draw: int, num_draws: int) -> ObjectiveBatch:
    inputs = objective_inputs(batch, config)  # the whole sequence: validation never crops
    clean, loss_mask = inputs["clean"], inputs["loss_mask"]
    sample_idx = torch.as_tensor(_sample_idx(batch), dtype=torch.int64, device=clean.device)
    t = validation_times(config.seed, sample_idx, draw, num_draws)
    # draw k+1: training uses draw 0, so validation masks never alias training ones.
    # 'sampled' even when training uses 'realised': only 1/p(t) makes the NELBO an unbiased bound.
    if config.sft:  # the answer NELBO per answer token, the prompt clean
        answer = _answer(inputs)
        noisy, masked, p_mask = sft_forward_process(
            clean, answer, sample_idx, config, t=t, draw=draw + 1, p_mask_mode=PMaskMode.SAMPLED
        )
        loss_mask = answer.to(torch.float32)
    else:
        shifted = 1 if inputs["first"] is not None else 0
        if config.blocks(clean.shape[1] + shifted):  # stratified t per block
            nb = num_blocks(clean.shape[1] + shifted, int(config.block_size))  # type: ignore[arg-type]
            t = block_times(config, sample_idx, draw, nb, num_draws)
        noisy, masked, p_mask = _noise(
            clean, sample_idx, config, loss_mask, t=t, draw=draw + 1, p_mask_mode=PMaskMode.SAMPLED
        )
    return _diffusion_batch(inputs, config, noisy, masked, p_mask, loss_mask)


_TRAINING = {
    RunningMode.VANILLA: _ar_inputs,
    RunningMode.DIFFLM_NOSHIFT: _diffusion_training,
    RunningMode.DIFFLM_SHIFT: _diffusion_training,
}
_VALIDATION = {
    RunningMode.VANILLA: lambda batch, config, draw, num_draws: _ar_inputs(batch, config, None),
    RunningMode.DIFFLM_NOSHIFT: _diffusion_validation,
    RunningMode.DIFFLM_SHIFT: _diffusion_validation,
}


def training_inputs(batch: Batch, config: DiffusionConfig, crop: Optional[int] = None) -> ObjectiveBatch:
    """``batch`` as one training micro-batch of ``config``'s objective, after the crop to
    ``crop`` positions (difflm-noshift: the noise of (seed, sample index, draw 0))."""
    return _TRAINING[config.model_running_mode](batch, config, crop)


def model_length(config: DiffusionConfig, length: int) -> int:
    """Tokens the model runs for a micro-batch of ``length`` positions (FLOPs, tokens/s): 2x
    under block diffusion ([x_t ; x_0]), else ``length``."""
    return 2 * length if config.blocks(length) else length


def validation_draws(config: DiffusionConfig, num_mc_samples: int) -> int:
    """Monte Carlo draws per sequence of the validation loss: K, or 1 where the loss is exact
    (the autoregressive NLL)."""
    if num_mc_samples < 1:
        raise ValueError(f"num_mc_samples must be >= 1, got {num_mc_samples}")
    return num_mc_samples if config.diffusion else 1


def validation_inputs(batch: Batch, config: DiffusionConfig, draw: int, num_draws: int) -> ObjectiveBatch:
    """``batch`` as validation draw ``draw`` of ``num_draws`` (:func:`validation_draws`):
    difflm-noshift: stratified t (``validation_times``), the sampled p, no crop."""
    return _VALIDATION[config.model_running_mode](batch, config, draw, num_draws)


def loss_token_count(
    batch: Batch,
    crop: Optional[int] = None,
    config: Optional[DiffusionConfig] = None,
    *,
    validation: bool = False,
) -> torch.Tensor:
    """Loss tokens of ``batch`` after an optional crop to ``crop`` positions (0-d fp32), the
    count ``compute_loss`` returns; the trainer sums it over the step before the forward.
    With a difflm-noshift ``config`` its objective's inputs are counted (MegaDLMs': L-1).
    Fine-tuning counts what its weights sum to: the rows ('sample') or the answer tokens
    ('token', and always for ``validation``: the NELBO per answer token)."""
    if config is not None and config.diffusion:
        # The same objective_inputs as the loss, so the counted N is exactly the tokens the losses sum over.
        inputs = objective_inputs(batch, config, crop)
        if config.sft:  # what the fine-tuning weights sum to: rows ('sample') or answer tokens
            answer = _answer(inputs).to(torch.float32)
            if validation or config.sft_loss_normalization is SFTLossNormalization.TOKEN:
                return answer.sum()
            return (answer.sum(dim=1) > 0).to(torch.float32).sum()
        return num_tokens(inputs["clean"], inputs["loss_mask"])
    labels, loss_mask = batch["labels"], batch.get("loss_mask")
    if crop is not None:
        labels = labels[:, :crop]
        loss_mask = None if loss_mask is None else loss_mask[:, :crop]
    return num_tokens(labels, loss_mask)


class MicroBatchLoss(NamedTuple):
    """:func:`compute_loss`'s result."""

    loss_sum: torch.Tensor
    """0-d fp32: the micro-batch's summed (ELBO-weighted) token losses."""
    num_tokens: torch.Tensor
    """0-d fp32: its loss tokens (the caller divides the step's sums by the global count)."""
    stats: Dict[str, object]
    """"seq_length" (int, the model's input length) and, in difflm mode, "num_masked" (0-d
    tensor; reading it with .item() is a device sync)."""


_AUTO = object()


def compute_loss(
    model: torch.nn.Module,
    batch: Batch,
    config: DiffusionConfig,
    iteration: int,
    crop=_AUTO,
    *,
    check: bool = True,
) -> MicroBatchLoss:
    """One micro-batch's loss, as the trainer computes it: :func:`training_inputs`, the
    model's forward, :meth:`ObjectiveBatch.score` with ``token_cross_entropy_of(model)``
    (vocab-parallel under tensor parallelism: the loss is then the same on every TP rank).

    batch: "tokens", "labels" (= text[1:]), "loss_mask", "position_ids", "sample_idx" and,
    when packing documents, "document_ids". ``crop``: the variable-length crop; default: drawn
    here with :func:`micro_batch_crop` for micro-batch 0 of 1 (the trainer draws it per
    micro-batch and passes it). ``check``: run :func:`check_model_for_mode` on ``model`` first.
    """
    if check:
        check_model_for_mode(model, config)
    if crop is _AUTO:
        # A model that does not say is assumed bidirectional: the difflm default.
        bidirectional = getattr(model, "attention", AttnMaskType.BIDIRECTIONAL) != AttnMaskType.CAUSAL
        crop = micro_batch_crop(
            config, iteration, 0, 1, batch["labels"].shape[1], bidirectional=bidirectional
        )
    inputs = training_inputs(batch, config, crop)
    loss_sum, _ = inputs.score(inputs.forward(model), _scorer_of(model))
    # The trainer's count (exact: fine-tuning's 'sample' weights only sum to the rows up to rounding).
    count = loss_token_count(batch, crop, config)
    stats: Dict[str, object] = {"seq_length": inputs.tokens.shape[1]}
    masked = inputs.targets.get("masked")
    if masked is not None:
        stats["num_masked"] = masked.sum()
    return MicroBatchLoss(loss_sum, count, stats)
