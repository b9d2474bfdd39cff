"""LoRA adapters on a shared frozen base: the adapter pool (peft) and per-row routing."""
