# examples/amp_guard.py
# run: torchrun --nproc_per_node 2 examples/amp_guard.py
import logging

import torch
import torch.distributed as dist

import commpress

logging.basicConfig(format="%(message)s")  # shows the guard's warning


def main() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    guard = commpress.Guard(fallback_steps=3)
    state = commpress.ddp.register(model, "topk", ratio=0.05, guard=guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # "cuda" on GPUs, with autocast

    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    for step in range(10):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 64, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
        if step == 4 and rank == 1:
            loss = loss * 3e38  # an overflow on one rank
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped when grads are inf/NaN
        scaler.update()
    if rank == 0:
        for s in list(state.stats)[3:9]:
            print(f"step {s.step}: sent {s.codecs}, non-finite {s.nonfinite}, "
                  f"undone {s.rolled_back}, guard {s.guard}, guarded {s.guarded}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()  # returns with the model freed, before the group goes (docs/ddp.md)
    dist.destroy_process_group()
