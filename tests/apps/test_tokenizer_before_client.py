"""A script written for hosted Tinker loads the tokenizer by name before it asks the server for
anything (tinker-cookbook's rl_loop.py does); on a fresh machine, offline, that must work as soon
as the server is up: `tinker-local run`, and the embedded `tinker_local.ServiceClient()` (issue 22).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from support import processes

from tinker_local import config
from tinker_local.engine.models import builtin

CLI = [sys.executable, "-m", "tinker_local.cli"]

# The tokenizer first, then one training step; unchanged from what runs against hosted Tinker.
TOKENIZER_FIRST = textwrap.dedent(
    """
    import sys
    import transformers

    model = sys.argv[1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)

    from tinker_local.engine.models import builtin
    assert not builtin.is_built(model), "the weights were built before the script asked"

    import tinker
    from tinker import types

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 23 + 58?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    ids = list(prompt) + tokenizer.encode("81<|im_end|>")
    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=model, rank=4).result()
    assert trainer.get_tokenizer().encode("23 + 58 = 81") == tokenizer.encode("23 + 58 = 81")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    loss = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    print("TRAINED", round(loss, 2), flush=True)
    """
)


@pytest.fixture
def fresh_machine(tmp_path: Path, home_with_the_runs_tokenizers) -> dict[str, str]:
    """The environment of a fresh machine, offline: an empty HF cache and a tinker-local home
    with no model built (its tokenizer folders are the run's: see tests/conftest.py)."""
    env = dict(os.environ)
    env["TINKER_LOCAL_HOME"] = str(home_with_the_runs_tokenizers(tmp_path / "home"))
    env["HF_HOME"] = str(tmp_path / "hf")
    env.pop("HF_HUB_CACHE", None)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_run_serves_a_script_that_loads_the_builtin_tokenizer_first(
    tmp_path: Path, fresh_machine: dict[str, str]
) -> None:
    """On the tiny built-in (SmolLM2's tokenizer, read from the same GGUF): publishing works the
    same for every built-in, and converting SmolLM2's weights on a fresh home would add nothing."""
    script = tmp_path / "script.py"
    script.write_text(TOKENIZER_FIRST)
    done = processes.run(
        [*CLI, "run", "--", sys.executable, str(script), config.TINY_TEST_MODEL],
        env=fresh_machine,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        fork_descendants=True,  # `run`'s script too
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TRAINED" in done.stdout
    # published into the child's (empty) HF cache, as a snapshot with refs/main
    repo = tmp_path / "hf" / "hub" / "models--tinker-local--tiny-llama"
    assert (repo / "refs" / "main").is_file()


EMBEDDED = textwrap.dedent(
    """
    import tinker_local
    import transformers
    from tinker_local.engine.models import builtin
    from tinker_local.engine.models import registry

    tinker_local.ServiceClient()
    for name in registry.available_models():
        assert transformers.AutoTokenizer.from_pretrained(name).chat_template, name
    assert not any(builtin.is_built(name) for name in builtin.builtin_names())
    print("ALL", len(registry.available_models()), flush=True)
    """
)


def test_embedded_server_publishes_every_listed_tokenizer_at_start(
    tmp_path: Path, fresh_machine: dict[str, str]
) -> None:
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED)
    done = processes.run(
        [sys.executable, str(script)],
        env=fresh_machine,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"ALL {len(builtin.builtin_names())}", done.stdout
