"""The small network the single-process optimizer tests train (two linears and a norm: 2-D
weights that decay, 1-D weights and biases that do not)."""

from __future__ import annotations

import torch


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.fc2 = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))
