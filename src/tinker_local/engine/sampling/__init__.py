"""Sampling. The engine's sampling backends (`builtin_backend.py`: the one prepare step every
backend uses and the built-in continuous-batching backend; `vllm_backend.py`: vLLM), the
built-in sampler (`sampler.py`) and its parts: request validation (`params.py`), the KV cache,
prefill, one model forward (`model_forward.py`), token selection, stop conditions, the decode
batch and its scheduler, and the CPU fast paths (`llama_decode.py`, `packed_linear.py`,
`fused_lora.py`)."""
