"""A DDP trainer in the shape of PyTorch's DDP tutorial: a Trainer class, its own snapshot
save and load, a regression loss. plain_ddp.py is the torchrun script, with_hpc_ddp.py the
same script as an hpc_ddp run; README.md shows the change and how to run each.
"""

import argparse
import gc
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


class LinearPairs(torch.utils.data.Dataset):
    """y = x . w + a little noise, for a fixed w."""

    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        weights = torch.randn(20, 1, generator=generator)
        self.x = torch.rand(size, 20, generator=generator)
        self.y = self.x @ weights + 0.01 * torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets)
        print(f"[rank {self.global_rank}] epoch {epoch} | last batch loss {loss.item():.6f}")

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    dataset = LinearPairs(4096)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return dataset, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every, total_epochs, batch_size, snapshot_path):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    # The DDP model goes before its process group: DDP sits in a reference cycle that only the
    # garbage collector breaks, and a process group still held at exit keeps gloo's worker
    # threads going while Python shuts down, which can abort the process after the last line
    # ("terminate called without an active exception", pytorch/pytorch#190489).
    del trainer
    gc.collect()
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="total epochs to train the model")
    parser.add_argument("save_every", type=int, help="how often to save a snapshot")
    parser.add_argument(
        "--batch_size", default=32, type=int, help="input batch size on each device"
    )
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="where the snapshot goes")
    args, _ = parser.parse_known_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
