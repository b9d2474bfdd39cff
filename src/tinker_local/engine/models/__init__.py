"""Base models: names to folders (registry, built-ins, hub downloads), their cost, and the
attention masks each family reads."""
