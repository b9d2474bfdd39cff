"""Building blocks of the sampler (`tinker_local.engine.sampler`): request validation, KV cache,
prefill, token selection, stop conditions, the decode batch and its scheduler; and the engine's
sampling backends on top of them (`service.py`: the one prepare step and the built-in backend;
the vLLM backend is `engine/vllm_sampler.py`)."""
