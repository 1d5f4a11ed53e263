"""torch.distributed plumbing: process groups, tensor-parallel layers, expert all-to-all.
Moves bytes and runs collectives; holds no scheduling policy."""
