"""A toy MoE block carrying contract C's marks, for the expert-parallel DDP, optimizer and
checkpoint tests (tests/distributed/test_ddp_experts.py, tests/checkpoint/test_checkpoint_ep.py).

``ExpertToy``: dense ``fc_in`` -> gelu -> experts (ONE 3-D parameter ``experts.weight``
[E_local, H, H] declared ``expert_dim = 0``;
EP rank e holds experts [e*E/ep, (e+1)*E/ep)) added residually -> dense ``fc_out``. Tokens
are routed by a fixed table over GLOBAL token ids (``route(step)``); the EP dispatch is an
all-gather of the EP group's tokens (an autograd all-reduce of a zero-padded buffer, which
gloo supports) and the combine an autograd all-reduce of the local experts' outputs; the
experts compute with ``megadlms.ops.grouped_matmul``. Initialisation draws the FULL tensors
from one seed, so every layout starts from the same model.

``Reference``: the same function on one process with ``nn.Linear`` and a per-token loop over
the full expert tensor (independent of the grouped GEMM and of the dispatch).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megadlms.parallel.sharding import set_sharding

H, E, T = 8, 4, 6  # hidden, experts, tokens per rank


def route(step: int, n_tokens: int) -> torch.Tensor:
    """Expert of every global token at ``step``; at even steps expert E-1 gets no token."""
    r = torch.randint(0, E, (n_tokens,), generator=torch.Generator().manual_seed(1000 + step))
    if step % 2 == 0:
        r[r == E - 1] = 0
    return r


def batch(step: int, n_tokens: int):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n_tokens, H, generator=g), torch.randn(n_tokens, H, generator=g)


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return {
        "fc_in.weight": torch.randn(H, H, generator=g) * 0.4,
        "fc_in.bias": torch.randn(H, generator=g) * 0.1,
        "experts.weight": torch.randn(E, H, H, generator=g) * 0.4,
        "fc_out.weight": torch.randn(H, H, generator=g) * 0.4,
        "fc_out.bias": torch.randn(H, generator=g) * 0.1,
    }


def _all_reduce(t, group):
    """Sum over ``group`` with autograd (backward: the sum of the gradients)."""
    import warnings

    import torch.distributed.nn.functional as dnn

    with warnings.catch_warnings():  # deprecated in favour of a functional API without gloo autograd
        warnings.simplefilter("ignore", FutureWarning)
        return dnn.all_reduce(t, group=group)


class Experts(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        set_sharding(self.weight, expert_dim=0)


class ExpertToy(nn.Module):
    """The EP block; ``ep_group``/``ep_rank``/``ep_ranks`` describe this rank's EP group."""

    def __init__(self, ep_group=None, ep_rank: int = 0, ep_ranks=(0,), fusion: bool = False) -> None:
        super().__init__()
        full = _full_weights()
        self.ep_group, self.ep_rank, self.ep_ranks = ep_group, ep_rank, tuple(ep_ranks)
        self.ep = len(self.ep_ranks)
        self.local = E // self.ep
        self.fusion = fusion
        self.fc_in, self.fc_out = nn.Linear(H, H), nn.Linear(H, H)
        with torch.no_grad():
            for name in ("fc_in", "fc_out"):
                getattr(self, name).weight.copy_(full[f"{name}.weight"])
                getattr(self, name).bias.copy_(full[f"{name}.bias"])
        lo = ep_rank * self.local
        self.experts = Experts(full["experts.weight"][lo : lo + self.local].clone())

    def forward(self, x, step: int, first_token: int):
        """``x``: this rank's tokens, global ids ``first_token + arange(len(x))``."""
        from megadlms.ops import grouped_matmul

        n = x.shape[0]
        h = F.gelu(self.fc_in(x))
        if self.ep > 1:  # dispatch: every EP rank sees the EP group's tokens
            pad = torch.zeros(self.ep * n, H)
            pad = pad.index_copy(0, torch.arange(self.ep_rank * n, (self.ep_rank + 1) * n), h)
            h_all = _all_reduce(pad, self.ep_group)
        else:
            h_all = h
        # global ids of the gathered tokens: EP peers hold consecutive data shards of n tokens
        base = first_token - self.ep_rank * n
        ids = base + torch.arange(self.ep * n)
        experts = route(step, 10_000)[ids]
        lo = self.ep_rank * self.local
        mine = ((experts >= lo) & (experts < lo + self.local)).nonzero().squeeze(1)
        order = torch.sort(experts[mine], stable=True).indices
        idx = mine[order]
        counts = torch.bincount(experts[idx] - lo, minlength=self.local)
        y_sel = grouped_matmul(
            h_all[idx], self.experts.weight, counts, gradient_accumulation_fusion=self.fusion
        )
        y_all = torch.zeros(self.ep * n, H).index_add(0, idx, y_sel)
        if self.ep > 1:  # combine: the owner's outputs back to every token's rank
            y_all = _all_reduce(y_all, self.ep_group)
        y = y_all[self.ep_rank * n : (self.ep_rank + 1) * n]
        return self.fc_out(h + y)


class Reference(nn.Module):
    """The same function on one process: nn.Linear and a per-token loop over all experts."""

    def __init__(self) -> None:
        super().__init__()
        full = _full_weights()
        self.fc_in, self.fc_out = nn.Linear(H, H), nn.Linear(H, H)
        self.experts = nn.Module()
        self.experts.weight = nn.Parameter(full["experts.weight"].clone())
        with torch.no_grad():
            for name in ("fc_in", "fc_out"):
                getattr(self, name).weight.copy_(full[f"{name}.weight"])
                getattr(self, name).bias.copy_(full[f"{name}.bias"])

    def forward(self, x, step: int, first_token: int = 0):
        h = F.gelu(self.fc_in(x))
        experts = route(step, 10_000)[first_token + torch.arange(x.shape[0])]
        y = torch.stack([self.experts.weight[int(e)] @ h[t] for t, e in enumerate(experts)])
        return self.fc_out(h + y)


def token_losses(out, target):
    return 0.5 * (out - target).pow(2).sum(-1)
