"""The RestClient's calls: training runs and checkpoints (list, publish, TTL, delete, copy),
session queries, usage."""
