"""The model families beyond Llama, end to end through the official SDK and a real server.

For each tiny built-in (Qwen3, Qwen3-MoE, Gemma 3, gpt-oss, and the hybrid Qwen3.5 and
Qwen3.5-MoE; engine/models/builtin.py): LoRA training
with cross_entropy and ppo, optimizer steps, sampling in one batch of mixed-length prompts whose
logprobs equal a teacher-forced forward, and both checkpoint kinds loading in plain `peft` with
the engine's logits. Then a Qwen3-named model in the local hub cache, for which tinker-cookbook
picks its own renderer by name and uses Qwen3's real tokenizer.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from support.served import sdk_on_a_server_of_its_own
from tinker import types

from tinker_local.engine.models import builtin

FAMILIES = list(builtin.TINY_FAMILY_MODELS)
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the dark "
        "green forest where nobody can find it again.")
TOL = 1e-4
ADAM = types.AdamParams(learning_rate=1e-2)
QWEN3_NAMED = "Qwen/Qwen3-8B"
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private hub cache for this module (the Qwen3-named model goes there, and the tokenizer
    snapshots the engine publishes); huggingface_hub and transformers read it at call time."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hub")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def service(hub_cache: Path, checkpoints_root: Path) -> Iterator[tinker.ServiceClient]:
    """A server of its own (every family plus the two hub-named models at once, above the
    default limit of base models), stopped at the end so its models leave memory."""
    with sdk_on_a_server_of_its_own(checkpoints_root=checkpoints_root, long_poll_s=2.0,
                                    max_base_models=len(FAMILIES) + 2) as client:  # fmt: skip
        yield client
    if MEASURED:
        print("\nSDK: max |sampler - teacher-forced| logprob:",
              {k.split("/")[1]: f"{v:.1e}" for k, v in MEASURED.items()})


def _datum(tokens: list[int], **extra: object) -> types.Datum:
    inputs: dict[str, object] = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _logprobs(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


def _checkpoint_folder(root: Path, tinker_path: str) -> Path:
    """Where a checkpoint lives: {checkpoints root}/{run}/{kind}/{name} (README)."""
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return root / run / kind / name


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings.*:UserWarning")  # peft, tied lm_head
@pytest.mark.parametrize("name", FAMILIES, ids=lambda n: n.split("/")[1])
def test_family_trains_samples_and_saves_peft_checkpoints(
    service: tinker.ServiceClient, checkpoints_root: Path, name: str
) -> None:
    trainer = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    tokens = trainer.get_tokenizer().encode(TEXT)[:26]
    assert len(tokens) == 26
    data = [_datum(tokens), _datum(tokens[:11])]

    # Training: cross_entropy steps lower the loss; a ppo step runs on the same rows.
    loss0 = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
    current = _logprobs(trainer.forward(data, "cross_entropy").result())
    ppo_data = [
        _datum(tokens, logprobs=(lp - 0.05).tolist(), advantages=[1.0] * len(lp))
        for tokens, lp in ((tokens, current[0]), (tokens[:11], current[1]))
    ]
    ppo = trainer.forward_backward(ppo_data, "ppo").result()
    assert all(math.isfinite(v) for v in ppo.metrics.values()), ppo.metrics
    trainer.optim_step(ADAM).result()
    after = trainer.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < loss0

    # Sampling: prompts of 3, 14 and 23 tokens submitted together (one batch; the sliding
    # families' windows are 8), two samples each; logprobs equal a teacher-forced forward.
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompts = [tokens[:3], tokens[:14], tokens[:23]]
    futures = [
        sampler.sample(types.ModelInput.from_ints(p), 2,
                       types.SamplingParams(max_tokens=10, seed=i, stop=[]))
        for i, p in enumerate(prompts)
    ]
    sampled = [(p, s.tokens, s.logprobs) for p, f in zip(prompts, futures, strict=True)
               for s in f.result().sequences]
    assert len(sampled) == 6 and all(len(t) == 10 for _, t, _ in sampled)
    teacher = _logprobs(trainer.forward([_datum(p + t) for p, t, _ in sampled],
                                        "cross_entropy").result())
    errors = [np.abs(np.array(lps) - expected[len(p) - 1 :]).max()
              for (p, _, lps), expected in zip(sampled, teacher, strict=True)]
    MEASURED[name] = float(max(errors))
    assert max(errors) < TOL, errors

    # Checkpoints: both kinds are PEFT folders that plain peft loads on the same base, built
    # with the class its config names (a vision-language checkpoint keeps its vision tower, so
    # the adapter's module names are the full model's).
    import transformers
    from peft import PeftModel

    engine_logprobs = _logprobs(after)[0]
    ids = torch.tensor([tokens[:-1]])
    targets = torch.tensor(tokens[1:])
    architecture = json.loads((builtin.folder_for(name) / "config.json").read_text())[
        "architectures"][0]
    for saved in (trainer.save_weights_for_sampler("sampler").result(),
                  trainer.save_state("state").result()):
        folder = _checkpoint_folder(checkpoints_root, saved.path)
        base = getattr(transformers, architecture).from_pretrained(
            builtin.folder_for(name), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(folder)).eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        got = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy()
        assert np.abs(got - engine_logprobs).max() < 1e-5, saved.path


def test_cookbook_picks_its_qwen3_renderer_for_a_qwen3_named_local_model(
    service: tinker.ServiceClient, hub_cache: Path
) -> None:
    """A Qwen3 model in the local hub cache as `Qwen/Qwen3-8B` (the tiny Qwen3 stands in for the
    real weights; its tokenizer is Qwen3's own): the cookbook chooses its `qwen3` renderer from
    the name alone, and that renderer's tokens are the tokenizer's chat template."""
    model_info = pytest.importorskip("tinker_cookbook.model_info")
    from tinker_cookbook import renderers

    snapshot = hub_cache / "models--Qwen--Qwen3-8B" / "snapshots" / ("0" * 40)
    shutil.copytree(builtin.ensure_built(builtin.TINY_QWEN3), snapshot,
                    ignore=shutil.ignore_patterns(builtin.MARKER_FILE))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "qwen3"

    renderer_name = model_info.get_recommended_renderer_name(QWEN3_NAMED)
    assert renderer_name == "qwen3"
    trainer = service.create_lora_training_client(base_model=QWEN3_NAMED, rank=4).result()
    tokenizer = trainer.get_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [
        151644, 151645, 151667]
    renderer = renderers.get_renderer(renderer_name, tokenizer)
    conversation = [{"role": "user", "content": "What is 4 + 5?"}]
    prompt = renderer.build_generation_prompt(conversation)
    template = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    assert prompt.to_ints() == tokenizer.encode(template, add_special_tokens=False)
    assert renderer.get_stop_sequences() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    # The renderer's examples train, and its prompt samples with its stop sequences.
    example, weights = renderer.build_supervised_example(
        conversation + [{"role": "assistant", "content": "9"}])
    tokens = example.to_ints()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": weights[1:].tolist()})
    fb = trainer.forward_backward([datum], "cross_entropy").result()
    assert math.isfinite(fb.metrics["loss:sum"]) and fb.metrics["loss:sum"] > 0
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, seed=0, stop=renderer.get_stop_sequences())
    sequence = sampler.sample(prompt, 1, params).result().sequences[0]
    message, _ = renderer.parse_response(sequence.tokens)
    assert message["role"] == "assistant"


def test_a_qwen3_6_named_local_model_is_served_by_the_qwen3_5_code(
    service: tinker.ServiceClient, hub_cache: Path
) -> None:
    """Qwen3.6 checkpoints are `qwen3_5_moe` / `qwen3_5` ones with the same tokenizer: the tiny
    Qwen3.5-MoE in the local hub cache as `Qwen/Qwen3.6-35B-A3B` is served as it is, and the
    cookbook picks its `qwen3_5` renderer for the name; a rendered example trains and the
    renderer's prompt samples and parses."""
    model_info = pytest.importorskip("tinker_cookbook.model_info")
    from tinker_cookbook import renderers

    name = "Qwen/Qwen3.6-35B-A3B"
    snapshot = hub_cache / "models--Qwen--Qwen3.6-35B-A3B" / "snapshots" / ("0" * 40)
    shutil.copytree(builtin.ensure_built(builtin.TINY_QWEN3_5_MOE), snapshot,
                    ignore=shutil.ignore_patterns(builtin.MARKER_FILE))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "qwen3_5_moe"

    renderer_name = model_info.get_recommended_renderer_name(name)
    assert renderer_name == "qwen3_5"
    trainer = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [
        248045, 248046, 248068]
    renderer = renderers.get_renderer(renderer_name, tokenizer)
    conversation = [{"role": "user", "content": "What is 4 + 5?"}]
    example, weights = renderer.build_supervised_example(
        conversation + [{"role": "assistant", "content": "9"}])
    tokens = example.to_ints()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": weights[1:].tolist()})
    losses = []
    for _ in range(3):
        losses.append(trainer.forward_backward([datum], "cross_entropy").result()
                      .metrics["loss:sum"])
        trainer.optim_step(ADAM).result()
    assert losses[-1] < losses[0]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = renderer.build_generation_prompt(conversation)
    assert prompt.to_ints()[-2:] == tokenizer.encode("<think>\n", add_special_tokens=False)[-2:]
    params = types.SamplingParams(max_tokens=8, seed=0, stop=renderer.get_stop_sequences())
    sequence = sampler.sample(prompt, 1, params).result().sequences[0]
    message, _ = renderer.parse_response(sequence.tokens)
    assert message["role"] == "assistant"
