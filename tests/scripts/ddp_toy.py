"""The seed's toy model: Linear 784->128->10 on synthetic data with DDP and a
DistributedSampler, a few steps. Prints ``RESULT rank=<r> world=<w> loss=<l>``."""

import gc
import os

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 784), torch.randint(0, 10, (512,)))
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss()
for step, (x, y) in enumerate(loader):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    if step == 4:
        break
# DDP keeps replicas identical: every rank must hold the same weights
w = model.module[0].weight.detach().clone()
gathered = [torch.zeros_like(w) for _ in range(world)]
dist.all_gather(gathered, w)
assert all(torch.equal(g, w) for g in gathered), "replicas diverged"
say(f"RESULT rank={rank} world={world} loss={loss.item():.4f} local_rank={os.environ['LOCAL_RANK']}")
# DDP (and the autograd graph behind `loss`, through cycles only the collector
# frees) holds the process group: drop them so destroy_process_group() really
# destroys it and joins Gloo's worker threads while Python is alive. A Gloo thread
# left running into interpreter shutdown can abort the process as it releases its
# last tensor ("terminate called without an active exception"): torch 2.13, 1 run
# in 4 on 2 cores, with torchrun as with tierrun.
del model, opt, loss
gc.collect()
dist.destroy_process_group()
