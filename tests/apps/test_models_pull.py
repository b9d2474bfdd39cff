"""`tinker-local models pull` and `serve --allow-download` against a local HTTP server posing as
the Hugging Face hub (HF_ENDPOINT), serving the tiny random Llama; the real hub is never
contacted. The pull shows the cost first, resumes an interrupted download, refuses bad names,
missing repos and a full disk, and never leaves a half-written model that would be served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tinker
from fake_hub import COMMIT, FakeHub
from support import processes

from tinker_local import config
from tinker_local.apps.embedded import add_loopback_to_no_proxy

REPO = "tiny-org/tiny-llama"  # sharded
SINGLE = "tiny-org/tiny-llama-one-file"  # model.safetensors, 12.9 MB


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def repo_files(tiny_model_folder, tmp_path_factory) -> dict[str, bytes]:
    """The tiny Llama as a hub repo would hold a bigger model: weights in two shards + index."""
    from safetensors.torch import load_file, save_file

    files = {p.name: p.read_bytes() for p in tiny_model_folder.iterdir() if p.is_file()}
    del files["model.safetensors"]
    tensors = load_file(tiny_model_folder / "model.safetensors")
    largest = max(tensors, key=lambda k: tensors[k].numel())  # the embedding: ~12.6 MB
    halves = {SHARDS[0]: sorted(set(tensors) - {largest}), SHARDS[1]: [largest]}
    out = tmp_path_factory.mktemp("shards")
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k].contiguous() for k in keys}, out / shard, {"format": "pt"})
        files[shard] = (out / shard).read_bytes()
        weight_map.update({k: shard for k in keys})
    index = {"metadata": {"total_size": sum(len(files[s]) for s in SHARDS)}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


@pytest.fixture
def hub(repo_files, tiny_model_folder):
    with FakeHub() as fake:
        fake.repos[REPO] = dict(repo_files)
        fake.repos[SINGLE] = {
            p.name: p.read_bytes() for p in tiny_model_folder.iterdir() if p.is_file()
        }
        yield fake


def _env(hub: FakeHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), **extra)
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return processes.run(
        [sys.executable, "-m", "tinker_local.cli", *args],
        env=env, timeout=300, capture_output=True, text=True, check=False,
    )  # fmt: skip


def _repo_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--"))


def test_pull_shows_the_cost_then_downloads_and_models_lists_it(hub, tmp_path):
    env = _env(hub, tmp_path)
    done = _cli(env, "models", "pull", REPO, "--dtype", "bfloat16", "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # The cost comes before any weights are fetched: 3,219,776 parameters x 2 bytes, counted
    # from each shard's safetensors header, read with a bounded byte range.
    assert lines[0].startswith(f"{REPO}: 3.22M parameters, 6.14 MiB in bfloat16; ")
    assert lines[0].endswith(": fits")
    gets = [(p, r) for m, p, r in hub.requests if m == "GET" and "/resolve/" in p]
    header_reads = [i for i, (p, r) in enumerate(gets) if r and not r.endswith("-")]
    assert sorted(gets[i][0].rsplit("/", 1)[1] for i in header_reads) == sorted(SHARDS)
    weights = [i for i, (p, r) in enumerate(gets) if p.endswith(SHARDS) and i not in header_reads]
    assert max(header_reads) < min(weights)
    assert "Fetching" in done.stderr  # huggingface_hub's own progress bar
    snapshot = _repo_cache(tmp_path) / "snapshots" / COMMIT
    for name, data in hub.repos[REPO].items():
        assert (snapshot / name).read_bytes() == data
    assert (_repo_cache(tmp_path) / "refs" / "main").read_text() == COMMIT
    assert not any(path.startswith("/api/") and "tiny" not in path for _, path, _ in hub.requests
                   if path != "/api/agent-harnesses")  # fmt: skip

    listed = _cli(env, "models")
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(REPO)]
    assert row.split()[1:3] == ["3.22M", "float32"] and row.split()[4] == "MiB"
    assert f"Hugging Face cache, at {snapshot}" in row

    again = _cli(env, "models", "pull", REPO)  # already complete: nothing to fetch
    assert again.returncode == 0 and "downloading 0 of" in again.stdout


def test_a_transfer_cut_off_mid_file_continues_where_it_stopped(hub, tmp_path):
    hub.drop_after["model.safetensors"] = 11_000_000
    done = _cli(_env(hub, tmp_path), "models", "pull", SINGLE)
    assert done.returncode == 0, done.stderr[-3000:]
    ranges = [r for p, r in hub.downloads() if p.endswith("/model.safetensors")]
    # huggingface_hub writes 10 MiB chunks: the first one was kept, the rest was asked for.
    assert ranges == [None, f"bytes={10 * 1024 * 1024}-"]
    assert "Trying to resume download" in done.stderr
    snapshot = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama-one-file" / "snapshots"
    data = (snapshot / COMMIT / "model.safetensors").read_bytes()
    assert data == hub.repos[SINGLE]["model.safetensors"]


def test_an_interrupted_pull_is_never_served_and_the_next_pull_fetches_the_rest(hub, tmp_path):
    hub.slow.add(SHARDS[1])
    env = _env(hub, tmp_path)
    proc = processes.Popen(
        [sys.executable, "-m", "tinker_local.cli", "models", "pull", REPO],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    snapshot = _repo_cache(tmp_path) / "snapshots" / COMMIT
    blobs = _repo_cache(tmp_path) / "blobs"
    deadline = time.monotonic() + 120
    started = None
    while time.monotonic() < deadline and proc.poll() is None:
        in_flight = any(p.endswith(SHARDS[1]) for p, _ in hub.downloads())
        if started is None and in_flight and (snapshot / SHARDS[0]).is_file():
            started = time.monotonic()
        if started is not None and time.monotonic() - started > 1.0:
            break  # one shard done, the other a second into its ~10 s transfer
        time.sleep(0.05)
    assert started is not None and proc.poll() is None, "the second shard never started"
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, _err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert f"download of {REPO} interrupted: the files that finished are kept" in out
    assert f"`tinker-local models pull {REPO}` continues it" in out
    assert not list(blobs.glob("*.incomplete"))  # no half-written file left behind
    assert not (snapshot / SHARDS[1]).exists() and (snapshot / "config.json").is_file()
    assert not (_repo_cache(tmp_path) / "refs" / "main").exists()

    # Nothing serves it: not listed as a model, not resolvable by name or by its folder.
    listed = _cli(env, "models")
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(REPO)]
    assert "incomplete download" in row
    probe = (
        "from tinker_local.engine.models import registry\n"
        f"for name in ({REPO!r}, {str(snapshot)!r}):\n"
        "    try:\n        registry.resolve_model(name)\n"
        "    except ValueError as e:\n        print(type(e).__name__, e)\n"
    )
    refused = processes.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert refused.count("Error") == 2 and f"unknown model {REPO!r}" in refused
    assert f"is incomplete: its weight index names 1 missing shard(s) ({SHARDS[1]})" in refused

    hub.slow.clear()
    hub.requests.clear()
    done = _cli(env, "models", "pull", REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "downloading 1 of " in done.stdout  # only what did not finish
    fetched = [p for p, _ in hub.downloads()]
    assert [p.rsplit("/", 1)[1] for p in fetched] == [SHARDS[1]]
    assert (snapshot / SHARDS[1]).read_bytes() == hub.repos[REPO][SHARDS[1]]
    assert (_repo_cache(tmp_path) / "refs" / "main").read_text() == COMMIT


def test_a_repo_with_bin_weights_is_priced_from_its_config(hub, tmp_path, tiny_model_folder):
    """No safetensors, so no headers to read: the cost comes from an empty model built from
    config.json (the tiny Llama's 3,219,776 parameters), and the `.bin` weights are fetched."""
    import torch
    from safetensors.torch import load_file

    state = load_file(tiny_model_folder / "model.safetensors")
    weights = tmp_path / "pytorch_model.bin"
    torch.save(state, weights)
    files = {k: v for k, v in hub.repos[SINGLE].items() if not k.endswith(".safetensors")}
    hub.repos["tiny-org/bin-weights"] = {**files, "pytorch_model.bin": weights.read_bytes()}
    done = _cli(_env(hub, tmp_path), "models", "pull", "tiny-org/bin-weights",
                "--dtype", "float32", "--device", "cpu")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("tiny-org/bin-weights: 3.22M parameters, 12.3 MiB in float32")
    assert [p.rsplit("/", 1)[1] for p, _ in hub.downloads() if "bin-weights" in p and
            p.endswith(".bin")] == ["pytorch_model.bin"]  # fmt: skip


def test_pull_refuses_bad_names_and_offline_mode(cli):
    """In this process, which is offline (HF_HUB_OFFLINE=1, tests/conftest.py): both refusals
    come before any hub request."""
    bad = cli("models", "pull", "not a name")
    assert bad.returncode == 1 and "is not a hub model id: use ORG/NAME" in bad.stderr
    offline = cli("models", "pull", REPO)
    assert offline.returncode == 1 and "HF_HUB_OFFLINE=1 is set" in offline.stderr
    serving = cli("serve", "--allow-download", "--port", "0")
    assert serving.returncode == 2 and "--allow-download needs the hub" in serving.stderr
    assert "Traceback" not in bad.stderr + offline.stderr + serving.stderr


def test_pull_refuses_missing_repos_and_a_full_disk(hub, tmp_path):
    env = _env(hub, tmp_path)
    missing = _cli(env, "models", "pull", "tiny-org/nothing-here")
    assert missing.returncode == 1 and "no model 'tiny-org/nothing-here' on " in missing.stderr

    hub.claimed_sizes[SHARDS[1]] = 10**16  # ~9 PiB: more than any test disk
    full = _cli(env, "models", "pull", REPO)
    assert full.returncode == 1 and f"not enough disk for {REPO}" in full.stderr
    assert not [p for p, _ in hub.downloads() if p.endswith(".safetensors")]
    assert not (_repo_cache(tmp_path) / "refs" / "main").exists()
    assert "Traceback" not in missing.stderr + full.stderr


def test_serve_allow_download_pulls_a_model_when_a_client_first_asks(
    hub, tmp_path, start_serve, home_with_the_runs_models
):
    home = home_with_the_runs_models(tmp_path / "home")  # the pull goes to the empty HF cache
    env = _env(hub, tmp_path, TINKER_LOCAL_HOME=str(home))
    server = start_serve("--allow-download", env=env)
    add_loopback_to_no_proxy()
    service = tinker.ServiceClient(base_url=server.base_url, api_key=config.LOCAL_API_KEY)
    trainer = service.create_lora_training_client(base_model=REPO, rank=4).result()
    tokens = [1, 520, 9531, 198, 28, 2]
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 5},
    )
    out = trainer.forward_backward([datum], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    sampler = trainer.save_weights_and_get_sampling_client().result()
    result = sampler.sample(
        tinker.ModelInput.from_ints(tokens), 1, tinker.SamplingParams(max_tokens=3)
    ).result()
    assert len(result.sequences[0].tokens) == 3
    with pytest.raises(tinker.RequestFailedError, match="no model 'tiny-org/absent' on ") as err:
        service.create_lora_training_client(base_model="tiny-org/absent", rank=4).result()
    assert err.value.category == "user"  # a RequestErrorCategory (a StrEnum)
    service.close("success").result()  # before its server stops
    server.stop(signal.SIGTERM)
    text = server.output()
    assert f"{REPO} is not on this machine; pulling it" in text
    assert f"loading {REPO}: 3.22M parameters, 12.3 MiB in float32; " in text
    assert (_repo_cache(tmp_path) / "refs" / "main").read_text() == COMMIT


def test_a_vision_language_checkpoint_is_priced_and_listed_with_both_towers(tmp_path):
    """A Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`: the hybrid language model and a
    vision tower) on the hub: the cost line before the download, from the hub's safetensors
    headers, and `tinker-local models` after it, from the local ones, both count the vision tower
    (which transformers' causal-LM class would drop)."""
    from safetensors import safe_open

    from tinker_local.engine.models import builtin
    from tinker_local.engine.models.cost import human_count, parameter_count

    folder = builtin.ensure_built(builtin.TINY_QWEN3_5)
    repo = "Qwen/Qwen3.5-4B"
    total = parameter_count(folder)

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        vision = sum(_numel(weights.get_slice(k).get_shape())
                     for k in weights.keys()  # noqa: SIM118 - safe_open is not iterable
                     if k.startswith("model.visual."))
    assert vision > 0 and human_count(total) != human_count(total - vision)
    with FakeHub() as fake:
        fake.repos[repo] = {p.name: p.read_bytes() for p in folder.iterdir()
                            if p.is_file() and p.name != builtin.MARKER_FILE}
        env = _env(fake, tmp_path)
        done = _cli(env, "models", "pull", repo, "--dtype", "float32", "--device", "cpu")
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines()[0].startswith(f"{repo}: {human_count(total)} parameters")
        listed = _cli(env, "models")
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(repo)]
    assert row.split()[1:3] == [human_count(total), "float32"]


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
