"""One client of `test_many_clients.py`, run as its own process with the official SDK:

    python many_clients_worker.py BASE_URL API_KEY SEED OUT_JSON [BARRIER_DIR]

With BARRIER_DIR it writes `ready-SEED` there once its model exists and waits for `go` before
training, so that clients started together really train at the same time. Trains its own LoRA on the tiny model for two steps (data and LoRA init depend on SEED only),
samples from it, saves a checkpoint, and writes what it saw to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

TINY = "tinker-local/tiny-llama"


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(3):
        tokens = rng.integers(5, 2000, size=12).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11},
            )
        )
    return data


def _wait_for_the_others(barrier: Path, seed: int) -> None:
    (barrier / f"ready-{seed}").touch()
    deadline = time.monotonic() + 240
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no 'go' in {barrier} after 240 s")
        time.sleep(0.005)


def main(base_url: str, api_key: str, seed: int, out: str, barrier: str | None) -> None:
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=seed).result()
    data = _data(seed)
    if barrier is not None:
        _wait_for_the_others(Path(barrier), seed)
    losses = []
    started = time.time()
    for _ in range(2):
        fb = trainer.forward_backward(data, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    trained = time.time()
    logprobs = trainer.forward(data[:1], "cross_entropy").result()
    after = logprobs.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:5])
    params = types.SamplingParams(max_tokens=6, seed=seed, temperature=1.0, stop=[])
    samples = sampler.sample(prompt, 2, params).result().sequences
    checkpoint = trainer.save_state("mine").result().path
    result = {
        "model_id": trainer.model_id,
        "losses": losses,
        "logprobs_after": after,
        "sample_tokens": [s.tokens for s in samples],
        "sample_logprobs": [s.logprobs for s in samples],
        "checkpoint": checkpoint,
        "sampler_id": sampler._sampling_session_id,  # the SDK keeps it privately
        "started": started,
        "trained": trained,
    }
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], (sys.argv[5:] or [None])[0])
