"""A small decoder-only transformer trained on the Python standard library's own source.

Byte-level tokens (vocabulary 256) from the ``.py`` files that ship with the interpreter,
split into training and validation by file; nothing downloads. Next-token cross-entropy,
AdamW with warmup and cosine decay, gradient clipping, gradient accumulation with the
gradient sync skipped on the micro-steps before the last, bf16 autocast on GPUs and optional
torch.compile. The validation loss (and perplexity) counts every validation token exactly
once, at any world size. A few lines are sampled at the end. ``--fsdp`` shards the model
over the ranks (FSDP2, block by block) instead of replicating it.

    hpc-ddp local --nproc 2 examples/lm/train.py --epochs 1
    hpc-ddp local --nproc 2 examples/lm/train.py --epochs 1 --fsdp
    sbatch slurm/train.sh examples/lm/train.py --epochs 1
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import hpc_ddp

IGNORE = -100


def stdlib_text(validation: bool, max_bytes: int) -> torch.Tensor:
    """The bytes of the standard library's top-level .py files, in name order: every tenth
    file is validation, the rest training; at most ``max_bytes`` of them."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [path for index, path in enumerate(files) if (index % 10 == 9) == validation]
    text = b"\n\n".join(path.read_bytes() for path in chosen)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Windows(Dataset[dict[str, torch.Tensor]]):
    """Consecutive windows of ``length`` tokens and their next tokens; the last window may be
    shorter (the evaluation set keeps it, so every token is predicted once)."""

    def __init__(self, tokens: torch.Tensor, length: int, keep_partial: bool) -> None:
        self.tokens, self.length = tokens, length
        predicted = len(tokens) - 1
        self.count = math.ceil(predicted / length) if keep_partial else predicted // length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = self.tokens[index * self.length : (index + 1) * self.length + 1]
        return {"input": chunk[:-1], "target": chunk[1:]}


def pad(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack windows, padding a short last one; padded targets are ignored by the loss."""
    length = max(len(item["input"]) for item in batch)
    inputs = torch.zeros(len(batch), length, dtype=torch.long)
    targets = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    for row, item in enumerate(batch):
        inputs[row, : len(item["input"])] = item["input"]
        targets[row, : len(item["target"])] = item["target"]
    return {"input": inputs, "target": targets}


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.projection = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True
        )
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, and a head tied to the embedding."""

    def __init__(self, width: int, layers: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.tokens(tokens) + self.positions(positions))))


def evaluate(run: hpc_ddp.Run, model: nn.Module, loader: Any, autocast: Any) -> hpc_ddp.Sum:
    """Summed next-token loss over every validation token exactly once (float64)."""
    sums = run.sums()
    model.eval()
    with torch.no_grad(), autocast:
        for batch in loader:
            logits = model(batch["input"]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="sum")
            sums.add("loss", loss.double(), (batch["target"] != IGNORE).sum())
    model.train()
    return sums.reduce()["loss"]


@torch.no_grad()
def sample(model: TinyGPT, prompt: bytes, length: int, device: torch.device) -> str:
    """``length`` bytes after ``prompt``, drawn from the top 10 (a fixed seed)."""
    model.eval()
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.tensor([list(prompt)], device=device)
    for _ in range(length):
        logits = model(tokens[:, -model.context :])[0, -1].float()
        top = torch.topk(logits, 10)
        choice = torch.multinomial(top.values.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, top.indices[choice].view(1, 1)], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def warmup_cosine(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="global batch, in sequences")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50, help="warmup steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm limit")
    parser.add_argument("--train-bytes", type=int, default=2_000_000)
    parser.add_argument("--val-bytes", type=int, default=200_000)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--fsdp", action="store_true", help="shard the model over the ranks (FSDP2), block by block"
    )
    parser.add_argument("--sample-bytes", type=int, default=160, help="0: no sample")
    parser.add_argument("--log-interval", type=int, default=None, help="steps between logs")
    args, overrides = parser.parse_known_args(argv)  # the rest: hpc_ddp's dotted overrides

    shape = ("batch", "context", "width", "layers", "heads", "train_bytes", "lr", "accum")
    if args.fsdp:  # the same as dist.strategy=fsdp on the command line or in a config
        overrides = ["dist.strategy=fsdp", "dist.shard_blocks=[Block]", *overrides]
    run = hpc_ddp.start(
        overrides=overrides,
        run={"name": "lm"},
        params=vars(args),
        fingerprint={key: getattr(args, key) for key in shape},
        log_interval=args.log_interval,
    )
    network = TinyGPT(args.width, args.layers, args.heads, args.context, args.dropout)
    model = run.wrap(network)
    forward = torch.compile(model) if args.compile else model
    autocast = torch.autocast(run.device.type, torch.bfloat16, enabled=run.device.type == "cuda")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    train_set = Windows(stdlib_text(False, args.train_bytes), args.context, keep_partial=False)
    val_set = Windows(stdlib_text(True, args.val_bytes), args.context, keep_partial=True)
    loader = run.train_loader(train_set, args.batch, grad_accum_steps=args.accum)
    val_loader = run.eval_loader(val_set, batch_size=args.batch, collate_fn=pad)
    total_steps = args.epochs * loader.steps_per_epoch
    schedule = warmup_cosine(min(args.warmup, total_steps // 2 or 1), total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
    if run.is_main:
        parameters = sum(p.numel() for p in network.parameters())
        print(f"model: {parameters:,} parameters; {len(train_set):,} training sequences")

    train_seconds, steps_timed = 0.0, 0
    for _epoch in run.epochs(args.epochs):
        started = time.perf_counter()
        for batch in run.steps(loader):
            tokens = batch["target"].numel()
            with run.accumulate(model):
                with autocast:
                    logits = forward(batch["input"])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["target"].flatten())
                (loss / args.accum).backward()
            run.log("loss", loss.detach() * tokens, tokens)
            if not run.accumulating:
                norm = run.clip_grad_norm_(model.parameters(), args.clip)
                run.log("grad_norm", norm.detach())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                steps_timed += 1
        val = evaluate(run, forward, val_loader, autocast)  # its reduction waits for the device
        train_seconds += time.perf_counter() - started
        val_loss = float(val.mean)
        run.log_metrics({"val_loss": val_loss, "val_perplexity": math.exp(val_loss)})

    # Every rank samples: a sharded model's forward pass needs them all (the same text).
    text = sample(network, b"def ", args.sample_bytes, run.device)
    if text and run.is_main:
        run.log_text("sample.txt", text)
    tokens_per_s = steps_timed * args.batch * args.context / max(1e-9, train_seconds)
    summary = run.finish(
        {
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "val_tokens": val.count,
            "tokens_per_s": round(tokens_per_s, 1),
            "parameters": sum(p.numel() for p in network.parameters()),
        }
    )
    if run.is_main:
        print(f"sample:\n{text}\n")
        keys = ("val_loss", "val_perplexity", "val_tokens", "tokens_per_s", "global_step")
        print("RESULT " + json.dumps({key: summary[key] for key in keys}))
    return summary


if __name__ == "__main__":
    main()
