"""Models whose Megatron padding rows carry the largest logits on purpose (tests of issue 43:
the sampler and the scorers must never choose or count them)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megadlms.models import GPTModel


def _output_rows(model: GPTModel):
    """(output weight of this rank, global id of its first row)."""
    out = model.output_layer.weight
    if out is None:  # tied within the chunk: the output layer multiplies by the word embedding
        out = model.embedding.word_embeddings.weight
    return out, model.tp.rank * out.shape[0]


@torch.no_grad()
def padding_rows_win(model: GPTModel, real: int, runner_up: Optional[int] = None) -> GPTModel:
    """Set the weights so every padding row (id >= ``real``) out-scores every real row at every
    position, whatever the input. The final LayerNorm's output becomes 3u + 0.3 n (u a fixed
    unit vector, |n| = sqrt(H)), so u.h = s > 0 for H < 100; padding rows are 50u (logit 50 s),
    real rows keep their init (|logit| < 1), ``runner_up`` (a real id) gets 20u (logit 20 s):
    the best real token. Needs normalization LayerNorm (a bias); works at any tp (each rank sets
    its own rows) and on the tied matrix (padding ids are never inputs)."""
    norm = model.decoder.final_layernorm
    if norm.bias is None:
        raise ValueError("padding_rows_win needs a LayerNorm model (its bias steers the hidden state)")
    H = norm.weight.shape[0]
    u = torch.zeros(H, dtype=norm.weight.dtype)
    u[0] = 1.0
    norm.weight.fill_(0.3)
    norm.bias.copy_(3.0 * u)
    weight, first = _output_rows(model)
    ids = first + torch.arange(weight.shape[0])
    weight[ids >= real] = 50.0 * u.to(weight.dtype)
    if runner_up is not None and bool((ids == runner_up).any()):
        weight[ids == runner_up] = 20.0 * u.to(weight.dtype)
    return model


def pin_logits(model: GPTModel, values: Dict[int, float]):
    """A forward hook on ``model.output_layer`` that sets the logits of the global ids in
    ``values`` (any tp: each rank pins the ids of its vocab slice). Returns the hook handle."""
    local = model.output_layer.weight
    rows = (local if local is not None else model.embedding.word_embeddings.weight).shape[0]
    first = model.tp.rank * rows
    mine = {i - first: v for i, v in values.items() if first <= i < first + rows}

    def hook(_module, _inputs, out):
        out = out.clone()
        for j, v in mine.items():
            out[..., j] = v
        return out

    return model.output_layer.register_forward_hook(hook)


def unpadded_copy(model: GPTModel, real: int) -> GPTModel:
    """The same model without the padding rows (vocab_size = ``real``): what the Hugging Face
    export holds. One process only."""
    cfg = type(model.config).from_dict(
        {**model.config.to_dict(), "vocab_size": real, "unpadded_vocab_size": None}
    )
    copy = GPTModel(cfg).to(next(model.parameters()).dtype)
    state = {}
    for name, t in model.state_dict().items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = t[:real]
        state[name] = t
    copy.load_state_dict(state)
    return copy.eval()


def checkpoint_generates_real_tokens(path: str, gen_length: int = 8) -> dict:
    """Load checkpoint ``path`` for inference (any layout it was saved from: tp, pp, MoE), pin
    its padding rows' logits above every real one and 'x' above the other real ones, and
    generate greedily: {"rows", "real", "text"} (``text`` is 'x' * gen_length when only real
    tokens are drawn)."""
    from megadlms.generate import generate_text, load_for_inference

    model, tok, common = load_for_inference(path, torch.device("cpu"))
    real, rows = model.config.unpadded_vocab_size, model.config.vocab_size
    handle = pin_logits(model, {**dict.fromkeys(range(real, rows), 100.0), ord("x"): 50.0})
    try:
        text = generate_text(model, tok, common, "ab", gen_length=gen_length, steps=gen_length // 2)[0]
    finally:
        handle.remove()
    return {"rows": rows, "real": real, "text": text}
