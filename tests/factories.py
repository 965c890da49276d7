"""User-style factories named by import path in tests (data.factory / model.factory)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset


def tiny_dataset(config: Any, seed: int) -> tuple[TensorDataset, TensorDataset, int, int]:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(300, 5, generator=generator)
    labels = (features[:, 0] > 0).long()
    return (
        TensorDataset(features[:256], labels[:256]),
        TensorDataset(features[256:], labels[256:]),
        5,
        2,
    )


def linear_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return nn.Linear(num_features, num_classes)


class _FailsOnRankOne(nn.Module):
    """Rank 1 raises on its 4th forward pass, while rank 0 goes on into the next all-reduce."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 4:
            raise RuntimeError("injected failure on rank 1")
        return self.linear(features)  # type: ignore[no-any-return]


def failing_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return _FailsOnRankOne(num_features, num_classes)


def not_a_module(config: Any, num_features: int, num_classes: int) -> object:
    return "not a module"


class _HangsOnRankOne(nn.Module):
    """Rank 1 stops making progress (outside any collective) on its 4th forward pass."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 4:
            import time

            time.sleep(3600)
        return self.linear(features)  # type: ignore[no-any-return]


def hanging_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return _HangsOnRankOne(num_features, num_classes)


class _DriftsOnRankOne(nn.Module):
    """Rank 1 changes its own weights outside the optimizer on its 3rd forward pass: the user
    error that leaves DDP replicas silently different."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            with torch.no_grad():
                self.linear.bias.add_(0.5)
        return self.linear(features)  # type: ignore[no-any-return]


def drifting_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return _DriftsOnRankOne(num_features, num_classes)
