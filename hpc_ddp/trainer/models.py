"""Models: the built-in MLP, or a user's own factory named by import path."""

from __future__ import annotations

import importlib
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hpc_ddp import HpcDdpError
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


def call_factory(path: str, what: str, arguments: tuple[Any, ...], contract: str) -> Any:
    """Call the factory at ``path`` with ``arguments``; one that cannot take them is refused
    with its ``contract`` (``def name(a, b) -> what``). An error raised inside it is the
    user's and propagates with their frames."""
    factory = load_factory(path, what)
    try:
        inspect.signature(factory).bind(*arguments)
    except TypeError as error:
        raise HpcDdpError(
            f"{what}={path!r} cannot be called the way the trainer calls it ({error})",
            f"define it as: {contract}",
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin): the call says it
    return factory(*arguments)


MODEL_CONTRACT = "def build(config, num_features, num_classes) -> torch.nn.Module"


def check_model_takes(model: nn.Module, features: Any, num_classes: int) -> torch.Tensor:
    """One sample through the model, in eval mode and without gradients (no random stream
    is used): a model that does not fit the data is refused before training, not mid-way.
    Returns its logits."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(features.unsqueeze(0))
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else ""
        raise HpcDdpError(
            f"the model cannot take one sample of the data (features of shape "
            f"{tuple(features.shape)}): {type(error).__name__}: {reason}",
            "make the model's input width match the data's features (data.num_features, "
            "data.feature_columns or what data.factory returns)",
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (1, num_classes):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise HpcDdpError(
            f"the model returns {shape} for one sample; the trainer expects logits of shape "
            f"(batch, num_classes) = (1, {num_classes})",
            "end the model with a layer of num_classes outputs (cross-entropy on logits)",
        )
    return logits


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


class StagedMLP(nn.Module):
    """The MLP's layers (created in the same order, so from the same seed the same weights)
    in consecutive stages, each on its own device: model parallel inside a rank. The output
    comes back to the first stage's device, where the inputs and labels live."""

    def __init__(self, mlp: MLP, stages: int) -> None:
        super().__init__()
        linears = [i for i, layer in enumerate(mlp.layers) if isinstance(layer, nn.Linear)]
        per_stage = -(-len(linears) // stages)
        starts = [linears[i] for i in range(0, len(linears), per_stage)] + [len(mlp.layers)]
        layers = list(mlp.layers)
        self.stages = nn.ModuleList(
            nn.Sequential(*layers[begin:end]) for begin, end in itertools.pairwise(starts)
        )

    def place(self, devices: Sequence[torch.device]) -> StagedMLP:
        """Stage i on ``devices[i]``."""
        for stage, device in zip(self.stages, devices, strict=False):
            stage.to(device)
        return self

    def forward(self, features: Any) -> Any:
        first = features.device
        for stage in self.stages:
            features = stage(features.to(next(stage.parameters()).device))
        return features.to(first)


def build_model(config: Config, num_features: int, num_classes: int) -> nn.Module:
    """The model the config asks for, on CPU, initialised from the global RNG."""
    if config.model.kind == "mlp":
        mlp = MLP(num_features, list(config.model.hidden_sizes), num_classes, config.model.dropout)
        return mlp if config.model.stages == 1 else StagedMLP(mlp, config.model.stages)
    model = call_factory(
        str(config.model.factory),
        "model.factory",
        (config, num_features, num_classes),
        MODEL_CONTRACT,
    )
    if not isinstance(model, nn.Module):
        raise HpcDdpError(
            f"model.factory={config.model.factory!r} returned {type(model).__name__}, "
            "not a torch.nn.Module",
            f"return the module itself: {MODEL_CONTRACT}",
        )
    return model
