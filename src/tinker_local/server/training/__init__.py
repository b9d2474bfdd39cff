"""Training calls: create_model, forward_backward, optim_step, weights (save/load/external),
custom losses, and the sampler records `stable_reinforce` trains on."""
