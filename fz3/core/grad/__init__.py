"""The gradient half of the control plane: grads (bucket_add, flush, the reduce paths and the
accumulation window), epilogue (the boundary: norm, clip, skip or step), invariants (I3)."""
