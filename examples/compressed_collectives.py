# examples/compressed_collectives.py
# run: torchrun --nproc_per_node 2 examples/compressed_collectives.py
import torch
import torch.distributed as dist

import commpress


def main() -> None:
    rank = dist.get_rank()
    grad = torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))

    avg = commpress.all_reduce(grad, "topkc", op="mean")  # identical on every rank
    fut = commpress.all_reduce_async(grad, "thc", strategy="auto")
    # offload: the codec work runs on a separate worker thread
    tot = commpress.all_reduce(grad, "fp16", strategy="hierarchical", offload=True)
    thc_sum = fut.wait()

    # Pipeline activations: compressed point-to-point, lossless by default.
    if rank == 0:
        activations = torch.randn(8, 128, generator=torch.Generator().manual_seed(7))
        commpress.send(activations, dst=1)
    elif rank == 1:
        received = commpress.recv(src=0)  # shape and dtype travel along
        sent = torch.randn(8, 128, generator=torch.Generator().manual_seed(7))
        print(f"rank 1 received {tuple(received.shape)}, bit-exact: {torch.equal(received, sent)}")
    if rank == 0:
        print(f"topkc mean: {tuple(avg.shape)}, thc sum: {tuple(thc_sum.shape)}, "
              f"fp16 sum: {tuple(tot.shape)}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()  # returns with its tensors freed, before the group goes (docs/ddp.md)
    dist.destroy_process_group()
