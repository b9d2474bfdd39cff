"""The OpenAI- and Anthropic-compatible inference APIs (docs/inference_apis.md).

`openai_routes.py` (`/oai/api/v1`: chat completions, completions, models) and
`anthropic_routes.py` (`/anthropic/api/v1`: messages, count_tokens, models) parse their API's
requests (`openai_requests.py`, `bodies.py`, `chat_messages.py`), name the model
(`targets.py`, `model_list.py`), render chat with the model's own template (the engine's
`contract.TextCodec`), and sample through `generation.py`: the SDK's own path (the engine
worker, continuous batching), on engine samplers kept in `samplers.py`, with tokens streamed
(`sse.py`) and turned into text by `text_stream.py` / `answers.py`. Refusals take each API's
own error shape (`errors.py`).
"""
