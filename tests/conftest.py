"""Test configuration: deterministic torch, few threads (CI machines have 2 cores)."""

import torch

torch.manual_seed(0)
torch.set_num_threads(min(2, torch.get_num_threads()))
