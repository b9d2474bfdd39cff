"""Building blocks of the sampler (`tinker_local.engine.sampler`): request validation, KV cache,
prefill, token selection, stop conditions, the decode batch and its scheduler."""
