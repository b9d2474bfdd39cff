"""Sampling calls: sampling sessions, asample, prompt-logprob targets, samplers restored
after a restart."""
