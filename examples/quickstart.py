import tinker
from tinker import types
import tinker_local

service = tinker_local.ServiceClient()          # the official tinker.ServiceClient, served locally
trainer = service.create_lora_training_client(
    base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=16
).result()
tok = trainer.get_tokenizer()

tokens = tok.encode("The capital of France is Paris.")
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
for _ in range(5):
    out = trainer.forward_backward([datum], loss_fn="cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    print(out.metrics["loss:sum"])

sampler = trainer.save_weights_and_get_sampling_client(name="quickstart").result()
prompt = types.ModelInput.from_ints(tok.encode("The capital of France is"))
result = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8)).result()
print(tok.decode(result.sequences[0].tokens))
