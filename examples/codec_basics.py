# examples/codec_basics.py
# run: python examples/codec_basics.py
import torch

import commpress

codec = commpress.get_codec("topk", ratio=0.01)          # or get_codec({"id": "topk", ...})
payload = codec.encode(torch.randn(1_000_000))
print(payload.nbytes, payload.bits_per_coordinate)       # exact wire size: 48 K / d bits
approx = codec.decode(payload)                           # same shape, dtype and device
print(codec.feedback_fit)                                # "needed": use error feedback

# Aggregation across workers is a protocol of exchange requests (codecs never communicate);
# the in-process simulator drives it for N workers exactly as the real collectives do:
sim = commpress.simulate(commpress.get_codec("topkc", chunk_ratio=0.05), [torch.randn(4096)] * 4)
print(sim.rounds, sim.wire_bytes, sim.total.shape)      # ['allreduce', 'allreduce'] ...
