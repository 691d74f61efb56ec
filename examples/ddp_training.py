# examples/ddp_training.py
# run: torchrun --nproc_per_node 2 examples/ddp_training.py
import torch
import torch.distributed as dist

import commpress


def train() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)

    # One line: PowerSGD rank 2 for every gradient, fp16 for the first 5 steps (DDP takes one
    # hook per model; other choices: "topkc", "fp16", "netzip", a policy={...} per layer, and
    # strategy="ring" / "hierarchical" for how payloads travel).
    state = commpress.ddp.register(model, "powersgd", rank=2, warmup_steps=5, warmup_codec="fp16")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    for step in range(30):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(32, 64, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 10 == 9:
            sent = state.stats[-1]  # what the step sent (commpress.StepStats)
            print(f"step {step + 1}: loss {loss.item():.3f}, "
                  f"sent {sent.wire_bytes} B {sent.codecs}")


if __name__ == "__main__":
    dist.init_process_group("gloo")  # "nccl" with one GPU per process
    train()  # returns with the model freed, before the group goes (docs/ddp.md, "Exit cleanly")
    dist.destroy_process_group()
