"""Train the lookup model of torch_model.py on several processes: DDP, FSDP2 or tensor parallelism.

    torchrun --nproc-per-node 2 examples/distributed_torch.py [--mode ddp|fsdp2|tp] [--steps 1500] [--seed 0]

- ddp: each rank trains on its own batches; DistributedDataParallel averages the gradients.
- fsdp2: the same, with the parameters sharded across the ranks (`fully_shard`).
- tp: every rank sees the same batches and holds its share of the attention heads:
  `ColwiseParallel` on query/key/value and `RowwiseParallel` on output (`num_heads` and
  `num_kv_heads` must be divisible by the ranks; a per-head (B, N, T, S) mask cannot be split).

On CPU the ranks talk over gloo; with one GPU per rank (torchrun on a GPU machine) over NCCL.
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from task import IGNORE, VALUES, make_batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch_model import BATCH, LookupModel, accuracy

TP_PLAN = {
    "query": ColwiseParallel(),
    "key": ColwiseParallel(),
    "value": ColwiseParallel(),
    "output": RowwiseParallel(),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ddp", "fsdp2", "tp"], default="ddp")
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def wrap(model, mode, device):
    """The model as the chosen engine runs it."""
    if mode == "ddp":
        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    if mode == "fsdp2":
        fully_shard(model.attention)
        return fully_shard(model)
    parallelize_module(model.attention, init_device_mesh(device.type, (dist.get_world_size(),)), TP_PLAN)
    return model


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = wrap(LookupModel().to(device), args.mode, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    # Data parallel: each rank draws its own batches. Tensor parallel: all ranks the same ones.
    rng = np.random.default_rng([args.seed, 0 if args.mode == "tp" else rank])
    for step in range(1, args.steps + 1):
        tokens, labels = (torch.from_numpy(a).to(device) for a in make_batch(rng, BATCH))
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VALUES), labels.reshape(-1), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 100 == 0 or step == args.steps):
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    tokens, labels = (torch.from_numpy(a).to(device) for a in make_batch(np.random.default_rng(args.seed + 1000), 256))
    with torch.no_grad():
        score = accuracy(model(tokens), labels)
    if rank == 0:
        print(f"{args.mode} on {world} ranks: held-out token accuracy {score:.1%}")
    dist.barrier()  # no rank tears down while another still talks to it (gloo aborts the other)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
