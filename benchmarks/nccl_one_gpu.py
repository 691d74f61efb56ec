"""Does NCCL accept two ranks on one GPU? (Run by benchmarks/gpu_check.sh; prints the answer.)"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, path: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2)
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {rank}: NCCL with two ranks on one GPU worked: {t.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    store = os.path.join(tempfile.mkdtemp(), "store")
    try:
        mp.spawn(_worker, args=(store,), nprocs=2, join=True)
    except Exception as exc:  # the children's own output says more
        print(f"NCCL with two ranks on one GPU failed: {str(exc).strip()[-300:]}")
        sys.exit(1)
