"""Models: the built-in MLP, or a user's own factory named by import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.trainer.config import Config


def load_factory(path: str, what: str) -> Callable[..., Any]:
    """Import 'pkg.module:function' and return the function."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise HpcDdpError(
            f"{what}={path!r} is not an import path",
            f"write it as 'package.module:function', e.g. {what}=mylab.models:build",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise HpcDdpError(
            f"{what}={path!r}: cannot import module {module_name!r} ({error})",
            "install the package into the environment the job runs in, or add it to PYTHONPATH",
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise HpcDdpError(
            f"{what}={path!r}: module {module_name!r} has no callable {attribute!r}",
            f"define {attribute}(...) in {module_name}",
        )
    return factory  # type: ignore[no-any-return]


class MLP(nn.Module):
    """Linear-ReLU(-Dropout) layers ending in a linear layer to the class logits."""

    def __init__(
        self, num_features: int, hidden_sizes: list[int], num_classes: int, dropout: float
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: Any) -> Any:
        return self.layers(features)


def build_model(config: Config, num_features: int, num_classes: int) -> nn.Module:
    """The model the config asks for, on CPU, initialised from the global RNG."""
    if config.model.kind == "mlp":
        return MLP(num_features, list(config.model.hidden_sizes), num_classes, config.model.dropout)
    factory = load_factory(str(config.model.factory), "model.factory")
    model = factory(config, num_features, num_classes)
    if not isinstance(model, nn.Module):
        raise HpcDdpError(
            f"model.factory={config.model.factory!r} returned {type(model).__name__}, "
            "not a torch.nn.Module",
            "return the module itself from the factory",
        )
    return model
