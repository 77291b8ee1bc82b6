"""Metrics of one crossover checkpoint, AR and DLM scored on the same tokens.

* ``heldout_loss`` / ``train_loss``: nats per token on fixed rows of held-out / training
  text. AR (vanilla): the exact next-token NLL. DLM: the NELBO, an upper bound on its NLL
  (``validation_nelbo``, stratified t, p = t: the continuous-time ELBO of the masking
  process), over the same target tokens (the rows' text[1:]).
* ``cloze_acc``: the share of cloze questions whose true continuation scores highest.
  AR: exact log p(choice | prompt). DLM: LLaDA's estimate of log p(choice | prompt), the one
  the lm-eval adapter reports (``conditional_log_likelihood``; all choices of a question
  have equal length, so they are scored under the same masks). Both softmaxes are over the
  real tokens (Megatron's padding rows cut, ``token_logits``); the losses keep training's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Dict, List, Sequence

import torch

from megadlms.common.enums import AttnMaskType, Objective, RunningMode
from megadlms.diffusion import DiffusionConfig, conditional_log_likelihood, token_logits, validation_nelbo

from .crossover_data import ClozeItem

SCORING = "cloze over the real vocabulary"


def _row_batches(rows: torch.Tensor, batch_size: int):
    S = rows.shape[1] - 1
    for start in range(0, rows.shape[0], batch_size):
        chunk = rows[start : start + batch_size]
        yield {
            "tokens": chunk[:, :-1],
            "labels": chunk[:, 1:],
            "loss_mask": torch.ones(chunk.shape[0], S),
            "position_ids": torch.arange(S).expand(chunk.shape[0], S),
            "sample_idx": torch.arange(start, start + chunk.shape[0]),
        }


def loss_per_token(
    model, rows: torch.Tensor, *, causal: bool, mask_token_id: int, mc_samples: int, seed: int
) -> float:
    """AR: NLL per token of rows[:, 1:] given the preceding tokens. DLM: NELBO per token of
    rows[:, 1:] ('llada' layout: the target is the whole of text[1:]), eps 0."""
    cfg = DiffusionConfig(
        model_running_mode=RunningMode.VANILLA if causal else RunningMode.DIFFLM_NOSHIFT,
        mask_token_id=mask_token_id,
        objective=Objective.LLADA,
        mask_eps=0.0,
        seed=seed,
    )
    res = validation_nelbo(model, _row_batches(rows, 16), cfg, num_mc_samples=1 if causal else mc_samples)
    return float(res["nelbo"])


@torch.no_grad()
def causal_choice_scores(model, item: ClozeItem) -> List[float]:
    """Exact log p(choice | prompt) of every choice under a causal model (one forward)."""
    x = torch.tensor([item.prompt + c for c in item.choices], dtype=torch.int64)
    # Over the real tokens, as the DLM's scorer: Megatron's padding rows take no probability.
    logp = torch.log_softmax(token_logits(model, model(x[:, :-1])).double(), dim=-1)
    target = x[:, 1:]
    tok_lp = logp.gather(-1, target[..., None])[..., 0]
    P = len(item.prompt)
    return tok_lp[:, P - 1 :].sum(dim=1).tolist()  # the answer tokens: positions P.. of x


def diffusion_choice_scores(
    model, item: ClozeItem, *, mask_token_id: int, mc_samples: int, seed: int
) -> List[float]:
    """LLaDA's estimate of log p(choice | prompt) for every choice (the lm-eval adapter's)."""
    return [
        conditional_log_likelihood(
            model,
            item.prompt,
            c,
            mask_token_id=mask_token_id,
            mc_samples=mc_samples,
            batch_size=mc_samples,
            seed=seed,
        )
        for c in item.choices
    ]


def cloze_accuracy(model, items: Sequence[ClozeItem], *, causal: bool, **dlm_kwargs) -> float:
    """Share of questions whose true choice has the highest score (ties: the first choice)."""
    correct = 0
    for item in items:
        scores = (
            causal_choice_scores(model, item)
            if causal
            else diffusion_choice_scores(model, item, **dlm_kwargs)
        )
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item.answer)
    return correct / len(items)


def evaluate_checkpoint(
    ckpt: str,
    *,
    heldout_rows: torch.Tensor,
    train_rows: torch.Tensor,
    cloze: Sequence[ClozeItem],
    nelbo_mc: int,
    cloze_mc: int,
    seed: int,
) -> Dict[str, float]:
    """{heldout_loss, train_loss, cloze_acc} of the checkpoint directory ``ckpt`` (CPU)."""
    from megadlms.generate import load_for_inference

    model, tokenizer, _ = load_for_inference(ckpt, torch.device("cpu"))
    causal = model.config.attention == AttnMaskType.CAUSAL
    mask = tokenizer.mask_token_id
    kw = dict(causal=causal, mask_token_id=mask, mc_samples=nelbo_mc, seed=seed)
    return {
        "heldout_loss": loss_per_token(model, heldout_rows, **kw),
        "train_loss": loss_per_token(model, train_rows, **kw),
        "cloze_acc": cloze_accuracy(
            model, cloze, causal=causal, mask_token_id=mask, mc_samples=cloze_mc, seed=seed
        ),
    }


def _settings_key(kwargs: Dict) -> str:
    """A digest of everything the metrics depend on besides the weights."""
    h = hashlib.sha256()
    # The scoring rule's version: metrics cached under an older rule (a cloze softmax over the padded
    # rows) are computed again.
    h.update(SCORING.encode())
    for k in sorted(kwargs):
        v = kwargs[k]
        h.update(k.encode())
        h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def checkpoint_task(ckpt: str, threads: int, cache: str, **kwargs) -> Dict[str, float]:
    """``evaluate_checkpoint`` in a worker process (sets its thread count; prints a line).
    The result is kept in ``cache`` (json) with a digest of the settings and reused when they
    match, so re-running the report (or evaluating while training) scores each checkpoint once."""
    key = _settings_key(kwargs)
    if os.path.isfile(cache):
        with open(cache) as f:
            saved = json.load(f)
        if saved.get("settings") == key:
            return saved["metrics"]
    torch.set_num_threads(threads)
    t0 = time.time()
    m = evaluate_checkpoint(ckpt, **kwargs)
    shown = " | ".join(f"{k} {v:.4f}" for k, v in m.items())
    print(f"   {ckpt}: {shown} ({time.time() - t0:.0f} s)", flush=True)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache + ".tmp", "w") as f:
        json.dump({"settings": key, "metrics": m}, f)
    os.replace(cache + ".tmp", cache)
    return m
