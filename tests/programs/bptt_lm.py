"""pytorch/examples' word_language_model in small, converted as docs/converting.md says: an
LSTM trained by truncated backpropagation through time over each rank's own columns of one
token stream, its hidden state carried from batch to batch (registered per rank), weights
updated by hand (no optimizer), the learning rate divided by 4 when the validation loss
does not improve (kept in run.state), batches as a ``range`` of offsets.

``python bptt_lm.py [--epochs N] [--hidden-unregistered]``: the second leaves the hidden
state out of the checkpoints, as the original script has it, which a resume mid-epoch
cannot make up for."""

import argparse
from typing import Any

import torch
from torch import nn

import hpc_ddp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--hidden-unregistered", action="store_true")
args = parser.parse_args()

VOCAB, BPTT, BATCH, TOKENS = 50, 8, 4, 4 * 8 * 10 + 4  # 10 steps an epoch
run = hpc_ddp.start(run={"name": "bptt"})

stream = torch.Generator().manual_seed(0)
jumps = torch.randint(1, 4, (TOKENS + 400,), generator=stream)
tokens = torch.cumsum(jumps, 0) % VOCAB  # a walk the model can learn to predict
columns = run.micro_batch_size(BATCH)


def batchify(data: torch.Tensor, batch: int) -> torch.Tensor:
    data = data[: data.numel() // batch * batch].view(batch, -1).t()
    return data[:, run.rank * columns : (run.rank + 1) * columns].contiguous()


train_data, val_data = batchify(tokens[:TOKENS], BATCH), batchify(tokens[TOKENS:], BATCH)


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, dropout=0.2)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, data: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        output, hidden = self.lstm(self.embed(data), hidden)
        return self.head(output).view(-1, VOCAB), hidden

    def init_hidden(self, batch: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(2, batch, 32) for _ in range(2))


class Hidden:
    def __init__(self) -> None:
        self.value: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


language_model = LanguageModel()
model = run.wrap(language_model)
hidden = Hidden()
run.register(model=model)  # weights updated by hand: no optimizer to register
if not args.hidden_unregistered:
    run.register_per_rank(hidden=hidden)
run.state.setdefault("lr", 20.0)  # divided by 4 at the end of epoch 1 (step 20)
run.state.setdefault("best_val_loss", None)


def batch_at(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = min(BPTT, len(source) - 1 - i)
    return source[i : i + length], source[i + 1 : i + 1 + length].reshape(-1)


def evaluate() -> float:
    model.eval()
    sums = run.sums()
    state = language_model.init_hidden(columns)
    with torch.no_grad():
        for i in range(0, val_data.size(0) - 1, BPTT):
            data, targets = batch_at(val_data, i)
            output, state = language_model(data, state)
            loss = nn.functional.cross_entropy(output, targets)
            sums.add("loss", loss * len(targets), len(targets))
    model.train()
    return float(sums.reduce()["loss"].mean)


for _epoch in run.epochs(args.epochs):
    if args.hidden_unregistered:  # as the original: a fresh state wherever a pass starts
        hidden.value = language_model.init_hidden(columns)
    for i in run.steps(range(0, train_data.size(0) - 1, BPTT)):
        if i == 0:  # a resume mid-epoch starts past 0 and keeps the restored state
            hidden.value = language_model.init_hidden(columns)
        data, targets = batch_at(train_data, i)
        model.zero_grad()
        output, state = model(data, tuple(part.detach() for part in hidden.value))
        hidden.value = tuple(part.detach() for part in state)
        loss = nn.functional.cross_entropy(output, targets)
        loss.backward()
        run.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-run.state["lr"])
        run.log("loss", loss.detach() * len(targets), len(targets))
    val_loss = evaluate()
    run.log_metrics({"val_loss": val_loss})
    best = run.state["best_val_loss"]
    if best is None or val_loss < best:
        run.state["best_val_loss"] = val_loss
    else:
        run.state["lr"] /= 4.0
print("LR", run.state["lr"])
run.finish()
