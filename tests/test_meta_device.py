"""A model built on the meta device, materialised by run.wrap (hpc_ddp.runtime.session.meta):
initialised as the same model built with data, and refused where nothing would initialise
it. In this process, at world size 1 (tests/test_fsdp.py and test_exact_at_scale.py shard
such a model over real ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.session.meta import materialise, on_meta_device


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def test_a_meta_model_is_initialised_as_the_same_model_built_with_data() -> None:
    torch.manual_seed(3)
    built = net()
    torch.manual_seed(3)
    with torch.device("meta"):
        model = net()
    assert on_meta_device(model, None)
    materialise(model, torch.device("cpu"), None)
    assert not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    for (name, expected), actual in zip(
        built.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(actual, expected), name


def test_the_script_s_init_weights_replaces_reset_parameters() -> None:
    with torch.device("meta"):
        model = net()
    seen: list[nn.Module] = []

    def init_weights(module: nn.Module) -> None:
        seen.append(module)
        for parameter in module.parameters():
            parameter.fill_(0.5)

    materialise(model, torch.device("cpu"), init_weights)
    assert seen == [model]
    assert all(bool((parameter == 0.5).all()) for parameter in model.parameters())
    assert not any(parameter.requires_grad is False for parameter in model.parameters())


def test_what_nothing_would_initialise_is_refused_naming_it() -> None:
    assert not on_meta_device(net(), None)
    with pytest.raises(HpcDdpError, match="nothing to initialise"):
        on_meta_device(net(), init_weights=lambda model: None)
    with torch.device("meta"):
        attention = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2))
    with pytest.raises(HpcDdpError, match=r"1 holds parameters or buffers but no") as refused:
        on_meta_device(attention, None)
    assert "init_weights" in refused.value.hint
    on_meta_device(attention, init_weights=lambda model: None)  # the script's init covers it
    partly = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 2))
    with pytest.raises(HpcDdpError, match=r"2 of its 4 .* others \(1.weight, 1.bias\)"):
        on_meta_device(partly, None)
    with pytest.raises(HpcDdpError, match="init_weights is a int, expected a function"):
        on_meta_device(model_on_meta(), init_weights=3)  # type: ignore[arg-type]


def model_on_meta() -> nn.Module:
    with torch.device("meta"):
        return net()


class Tied(nn.Module):
    """A language model's embedding and output layer sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight


def test_a_tied_weight_stays_one_parameter() -> None:
    with torch.device("meta"):
        model = Tied()
    materialise(model, torch.device("cpu"), None)
    assert model.head.weight is model.embedding.weight
    assert len(list(model.parameters())) == 1


class Rotary(nn.Module):
    """A table computed when built and left out of the state dict, as rotary embeddings'."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        """Resets what it holds, except the table."""


class Counted(nn.Sequential):
    """A container whose own reset_parameters resets its children again."""

    calls = 0

    def reset_parameters(self) -> None:
        Counted.calls += 1


def test_a_buffer_not_in_the_state_dict_needs_the_script_s_init() -> None:
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(HpcDdpError, match=r"buffer\(s\) freqs are not in the state dict"):
        on_meta_device(model, None)
    assert on_meta_device(model, init_weights=lambda module: None)


def test_only_modules_holding_weights_themselves_are_reset() -> None:
    with torch.device("meta"):
        model = Counted(nn.Linear(4, 4))
    materialise(model, torch.device("cpu"), None)
    assert Counted.calls == 0, "the container holds no weight of its own"
    assert not model[0].weight.is_meta
