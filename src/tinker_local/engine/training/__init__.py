"""Training: one forward/backward pass over several models' data, chunked logprobs,
shared-prefix packing, optimizers (AdamW, Dimuon), value heads, checkpoints."""
