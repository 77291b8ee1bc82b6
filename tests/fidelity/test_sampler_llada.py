"""low_confidence remasking ranks positions by p(x0) of the UNMODIFIED logits (LLaDA's
generate.py), not by the softmax taken after [MASK] is set to -inf."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megadlms.diffusion import generate

MASK = 3


class _Fixed(torch.nn.Module):
    """Returns the same log-probabilities at every step: position 1 has p = (.5, .1, 0, .4)
    (p(MASK) = .4), position 2 has p = (.6, .4, 0, 0)."""

    def forward(self, x):
        p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.1, 1e-9, 0.4], [0.6, 0.4, 1e-9, 1e-9]])
        return p.log()[None].expand(x.shape[0], -1, -1).clone()


def _llada_reference(model, x, steps):
    """LLaDA's loop (one block, temperature 0), with [MASK] excluded from the argmax."""
    x = x.clone()
    n = int((x == MASK).sum())
    for i in range(steps):
        mask_index = x == MASK
        logits = model(x)
        p = F.softmax(logits, dim=-1)
        masked_logits = logits.clone()
        masked_logits[..., MASK] = -torch.inf
        x0 = masked_logits.argmax(-1)
        x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
        conf = torch.where(mask_index, x0_p, torch.tensor(-torch.inf))
        k = n // steps + (i < n % steps)
        idx = torch.topk(conf[0], k).indices
        x[0, idx] = x0[0, idx]
        yield x.clone()


def test_low_confidence_ranks_by_unmodified_probabilities():
    model = _Fixed()
    prompt = torch.tensor([[0]])
    states = []

    class _Record(torch.nn.Module):
        def forward(self, x):
            states.append(x.clone())
            return model(x)

    out = generate(_Record(), prompt, mask_token_id=MASK, gen_length=2, steps=2, block_length=2)
    ref = list(_llada_reference(model, torch.tensor([[0, MASK, MASK]]), 2))
    # after step 1 LLaDA has committed position 2 (p(x0) .6 > .5); the renormalised
    # ranking (.5/.6 = .83 > .6) would have committed position 1 first
    assert ref[0].tolist() == [[0, MASK, 0]]
    assert states[1].tolist() == ref[0].tolist()
    assert out.tolist() == ref[1].tolist() == [[0, 0, 0]]
