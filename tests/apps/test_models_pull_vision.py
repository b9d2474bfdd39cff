"""`tinker-local models pull` of a vision-language model (a local server posing as the hub):
the cost line counts both towers before any weights come, the image processor configuration is
fetched with the rest, and `tinker-local models` lists the model with its vision tower."""

from __future__ import annotations

from pathlib import Path

from fake_hub import COMMIT, FakeHub
from test_models_pull import _cli, _env

from tinker_local.engine.models import builtin
from tinker_local.engine.models.cost import parameter_counts
from tinker_local.engine.models.tiny_vision import IMAGE_PROCESSOR_FILE, TINY_QWEN3_VL

REPO = "tiny-org/tiny-qwen3-vl"


def test_pull_of_a_vision_model_counts_both_towers_and_fetches_its_processor(tmp_path: Path):
    folder = builtin.ensure_built(TINY_QWEN3_VL)
    total, vision = parameter_counts(folder)
    assert 0 < vision < total
    with FakeHub() as hub:
        hub.repos[REPO] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()
                           and p.name != builtin.MARKER_FILE}
        env = _env(hub, tmp_path)
        done = _cli(env, "models", "pull", REPO, "--dtype", "float32", "--device", "cpu")
        assert done.returncode == 0, done.stderr[-3000:]
        first = done.stdout.splitlines()[0]
        # From the safetensors header, before the weights: both towers, the vision one named.
        assert first.startswith(f"{REPO}: 9.92M parameters (118K in the vision tower), "), first
        snapshot = (tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--"))
                    / "snapshots" / COMMIT)
        assert (snapshot / IMAGE_PROCESSOR_FILE).read_bytes() == \
            (folder / IMAGE_PROCESSOR_FILE).read_bytes()
        listed = _cli(env, "models")
        assert listed.returncode == 0, listed.stderr
        (row,) = [line for line in listed.stdout.splitlines() if line.startswith(REPO)]
        assert row.split()[1] == "9.92M"
        assert "vision-language (118K in the vision tower), Hugging Face cache" in row
