"""A DDP trainer in the shape of PyTorch's DDP tutorial: a Trainer class, its own snapshot
save and load, a regression loss. plain_ddp.py is the torchrun script, with_hpc_ddp.py the
same script as an hpc_ddp run; README.md shows the change and how to run each.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import hpc_ddp


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


class Trainer:
    def __init__(self, run, model, train_data, optimizer, save_every, snapshot_path):
        self.run = run
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
        self.model = run.wrap(self.model)
        run.register(model=self.model, optimizer=self.optimizer)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.run.log("mse", loss.detach() * len(source), len(source))
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.run.steps(self.train_data):
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets)
        print(f"[rank {self.global_rank}] epoch {epoch} | last batch loss {loss.item():.6f}")

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in self.run.epochs(max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    dataset = LinearPairs(4096)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return dataset, model, optimizer


def main(save_every, total_epochs, batch_size, snapshot_path):
    run = hpc_ddp.start(run={"name": "tutorial"})
    dataset, model, optimizer = load_train_objs()
    train_data = run.train_loader(dataset, batch_size * run.world_size)
    trainer = Trainer(run, model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    run.finish()


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
