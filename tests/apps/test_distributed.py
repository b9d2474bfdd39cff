"""`tinker-local serve --nproc-per-node 2` (gloo on the CPU, world size 2), driven by the SDK.

The same script runs against one process (an in-process server) and against two ranks, data
parallel and with `--shard-base` (FSDP2), on text, on a hybrid model and on a batch with images
(tests/apps/vision_batches.py); losses, logprobs, adapter weights and seeded samples must agree.
Checkpoints cross between world sizes; two clients' models stay apart; a rank killed with
SIGKILL fails the work in flight with an error naming it, while rank 0 keeps answering; a
restarted group resumes from the store.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from safetensors.torch import load_file
from support import processes
from tinker import types
from vision_batches import vision_script

from tinker_local import config

CLI = [sys.executable, "-m", "tinker_local.cli"]
TINY = config.TINY_TEST_MODEL
KEY = config.LOCAL_API_KEY
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tinker: a longer sentence, so that the ranks get unequal datums.",
    "short one",
    "Another example of a datum with several tokens in it, and a few more.",
    "The quick brown fox jumps over the lazy cat.",
]

pytestmark = pytest.mark.timeout(600)


# ---- servers ------------------------------------------------------------------------------------


@contextmanager
def _group(tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
           ) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """`tinker-local serve --nproc-per-node 2` on a free port: (the launcher, its URL, the log
    of its stderr, where the ranks write theirs).

    The elastic agent's ranks are forked from the suite's fork server (tests/support/processes.py),
    so they are not the launcher's children: a test finds a rank's pid in the log."""
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    proc = processes.Popen(
        [*CLI, "serve", "--port", "0", "--nproc-per-node", "2", *extra],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True,
        fork_descendants=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving at" in line, line + log.read_text()[-3000:]
        yield proc, line.split(" at ", 1)[1].strip(), log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _rank_pid(log: Path, rank: int) -> int:
    """The pid rank `rank` logged when it joined the group (apps/distributed.py)."""
    said = re.findall(rf"rank {rank} of \d+: pid (\d+) on ", log.read_text())
    assert len(said) == 1, log.read_text()[-3000:]
    return int(said[0])


# ---- the script ---------------------------------------------------------------------------------


def _data(tokenizer: Any) -> list[types.Datum]:
    data = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        ))
    return data


def _logprobs(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


def _script(url: str, base_model: str = TINY) -> dict[str, Any]:
    """Three steps of training, a forward, a checkpoint, seeded samples."""
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        return _steps(service, base_model)


def _steps(service: tinker.ServiceClient, base_model: str = TINY) -> dict[str, Any]:
    trainer = service.create_lora_training_client(base_model=base_model, rank=8, seed=3).result()
    tokenizer = trainer.get_tokenizer()
    data = _data(tokenizer)
    losses, logprobs = [], []
    for _ in range(3):
        out = trainer.forward_backward(data, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        logprobs.append(_logprobs(out))
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = _logprobs(trainer.forward(data, "cross_entropy").result())
    path = trainer.save_state("three-steps").result().path
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    futures = [sampler.sample(types.ModelInput.from_ints(tokenizer.encode(t)[:5]), 2, params)
               for t in TEXTS]
    tokens = [[s.tokens for s in f.result().sequences] for f in futures]
    return {"losses": losses, "logprobs": logprobs, "after": after, "path": path,
            "tokens": tokens, "weights": _adapter_weights(path)}


def _value_model(url: str) -> list[list[np.ndarray]]:
    """A value model (LoRA + value head, tinker-local extension): the values after each of
    two `value_mse` steps, so the head's gradients must be summed over the ranks too."""
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        critic = service.create_lora_training_client(
            base_model=TINY, rank=4, seed=5, user_metadata={"tinker_local.value_head": "mlp"}
        ).result()
        data = []
        for text in TEXTS:
            ids = critic.get_tokenizer().encode(text)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(ids),
                loss_fn_inputs={"target_tokens": ids[1:] + ids[:1],
                                "returns": np.linspace(-1, 1, len(ids), dtype=np.float32)},
            ))
        values = []
        for _ in range(2):
            critic.forward_backward(data, "value_mse").result()
            critic.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            out = critic.forward(data, "value_mse").result()
            values.append([o["values"].to_numpy() for o in out.loss_fn_outputs])
        return values


def _sampled_and_dimuon(url: str) -> dict[str, Any]:
    """The cookbook's default RL loss (`stable_reinforce` on records of seeded samples, with
    provenance) and the Dimuon optimizer: a call's per-datum records must be split with its
    datums, and Dimuon must step on the summed gradients."""
    prompt = [5, 17, 42, 99, 7, 3]
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        trainer = service.create_lora_training_client(
            base_model=TINY, rank=4, seed=2, optimizer=types.DimuonOptimizerConfig()
        ).result()
        sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True)
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=4, stop=[])
        sequences = sampler.result().sample(
            types.ModelInput.from_ints(prompt), 4, params
        ).result().sequences
        data = []
        for sequence, advantage in zip(sequences, [1.0, -0.5, 0.25, 0.75], strict=True):
            sampled, sid = list(sequence.tokens), sequence.sequence_id
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
                loss_fn_inputs={
                    "target_tokens": prompt[1:] + sampled,
                    "logprobs": [0.0] * (len(prompt) - 1 + len(sampled)),
                    "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(sampled),
                },
            )
            data.append(datum.with_provenance(
                model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                             types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                    types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled)),
                ],
            ))
        losses = []
        for _ in range(2):
            out = trainer.forward_backward(data, "stable_reinforce").result()
            losses.append(out.metrics["loss:sum"])
            trainer.optim_step(types.DimuonParams(learning_rate=2e-3)).result()
        after = _logprobs(trainer.forward(data, "stable_reinforce").result())
        return {"tokens": [list(s.tokens) for s in sequences], "losses": losses, "after": after}


def _adapter_weights(path: str) -> dict[str, Any]:
    model_id, rest = path.removeprefix("tinker://").split("/", 1)
    return load_file(str(config.checkpoints_dir() / model_id / rest / "adapter_model.safetensors"))


def _forward_from(url: str, path: str) -> list[np.ndarray]:
    """Logprobs of the script's data under the checkpoint `path`, loaded on the server at url."""
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        trainer = service.create_training_client_from_state(path).result()
        return _logprobs(trainer.forward(_data(trainer.get_tokenizer()), "cross_entropy").result())


def _assert_same(got: dict[str, Any], want: dict[str, Any], *, weights_atol: float = 1e-5
                 ) -> None:
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6, atol=1e-5)
    for step_got, step_want in zip(got["logprobs"], want["logprobs"], strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(got["after"], want["after"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert got["weights"].keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():
        np.testing.assert_allclose(got["weights"][name].numpy(), tensor.numpy(),
                                   atol=weights_atol, err_msg=name)
    assert got["tokens"] == want["tokens"]


@pytest.fixture(scope="module")
def one_process() -> Iterator[str]:
    """The reference: one engine in this process, on the same checkpoint folders."""
    from tinker_local.engine.factory import engine_factory
    from tinker_local.server.http.start import LocalServer

    server = LocalServer(engine_factory(device="cpu", dtype="float32")).start()
    yield server.base_url
    server.stop()


@pytest.fixture(scope="module")
def reference(one_process: str) -> dict[str, Any]:
    return _script(one_process)


# ---- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def joint_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Joint training on: two clients' passes are joined over the ranks."""
    folder = tmp_path_factory.mktemp("group")
    with _group(folder, env={config.JOINT_TRAINING_ENV: "1"}) as (_, url, _log):
        yield url


class TestOneGroupWithJointTraining:
    """Three tests on one group (a group start is three processes). The group holds the test
    home, where the one-process reference keeps its checkpoints too, so it is this class's and
    is stopped when the class ends: the tests after it start groups of their own there."""

    def test_two_ranks_data_parallel_match_one_process(self, joint_group, one_process,
                                                         reference) -> None:
        url = joint_group  # the group and the one process share the test home's checkpoints
        got = _script(url)
        _assert_same(got, reference)
        # Checkpoints cross world sizes: 2 ranks -> 1 process, and 1 process -> 2 ranks.
        for a, b in zip(_forward_from(one_process, got["path"]), got["after"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        for a, b in zip(_forward_from(url, reference["path"]), reference["after"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        _two_clients_stay_apart(url)
        for got_step, want_step in zip(_value_model(url), _value_model(one_process), strict=True):
            for a, b in zip(got_step, want_step, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
        got_rl, want_rl = _sampled_and_dimuon(url), _sampled_and_dimuon(one_process)
        assert got_rl["tokens"] == want_rl["tokens"]
        np.testing.assert_allclose(got_rl["losses"], want_rl["losses"], rtol=1e-5, atol=1e-5)
        for a, b in zip(got_rl["after"], want_rl["after"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)

    def test_two_ranks_match_one_process_on_a_hybrid_model(self, joint_group, one_process
                                                               ) -> None:
        """Qwen3.5's hybrid decoder (linear-attention layers with a recurrent state per row)
        trained and sampled over two ranks gives one process's losses, logprobs, weights and
        seeded samples."""
        from tinker_local.engine.models import builtin

        want = _script(one_process, builtin.TINY_QWEN3_5)
        url = joint_group
        # The outputs agree to 1e-5 before and after training, and the seeded samples exactly.
        # The weights agree to 1e-3 (three Adam steps of 1e-2 move a weight up to 3e-2): Adam's
        # normalised step turns rounding in near-zero gradients (the ranks sum in another
        # order, over other padded shapes) into differences in a few entries, measured up to
        # 3e-5 in the output layer's LoRA and 1.7e-4 in the linear-attention layers' in_proj_a
        # LoRA (4 outputs, where the gradients are smallest).
        _assert_same(_script(url, builtin.TINY_QWEN3_5), want, weights_atol=1e-3)

    def test_two_ranks_match_one_process_on_a_vision_batch(self, joint_group, one_process
                                                            ) -> None:
        """Images in training datums and in prompts (tiny Qwen3-VL): the ranks give one
        process's losses, logprobs, adapter weights and seeded samples."""
        want, got = vision_script(one_process), vision_script(joint_group)
        for result in (want, got):
            result["weights"] = _adapter_weights(result["path"])
        _assert_same(got, want)
        assert want["losses"][1] < want["losses"][0]


def _two_clients_stay_apart(url: str) -> None:
    """Two clients train their own models at the same time (a joint pass over both, split
    over the ranks): each one's updates stay in its own model."""
    first = tinker.ServiceClient(base_url=url, api_key=KEY)
    second = tinker.ServiceClient(base_url=url, api_key=KEY)
    a = first.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    b = second.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    data = _data(a.get_tokenizer())
    b_before = _logprobs(b.forward(data, "cross_entropy").result())
    with ThreadPoolExecutor(2) as pool:
        pool.map(lambda t: t.forward_backward(data[:3], "cross_entropy").result(), [a, b])
    a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    a_after = _logprobs(a.forward(data, "cross_entropy").result())
    b_after = _logprobs(b.forward(data, "cross_entropy").result())
    first.close("success").result()
    second.close("success").result()
    for before, unchanged, trained in zip(b_before, b_after, a_after, strict=True):
        np.testing.assert_allclose(unchanged, before, atol=1e-6)  # b never stepped
        assert np.abs(trained - before).max() > 1e-3  # a did


def test_shard_base_matches_one_process(tmp_path, reference) -> None:
    # Folder staging on (what ranks on other machines get): loading a checkpoint ships its files.
    stage = {"TINKER_LOCAL_STAGE_FOLDERS": "1"}
    with _group(tmp_path, "--shard-base", env=stage) as (_, url, _log):
        _assert_same(_script(url), reference)
        for a, b in zip(_forward_from(url, reference["path"]), reference["after"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_killed_rank_fails_work_in_flight_and_a_restart_resumes(tmp_path) -> None:
    with _group(tmp_path, "--rank-timeout", "10") as (launcher, url, log):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = service.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
        data = _data(trainer.get_tokenizer())
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = trainer.save_state("before-the-kill").result().path
        expected = _logprobs(trainer.forward(data, "cross_entropy").result())
        sampler = trainer.save_weights_and_get_sampling_client().result()
        long = types.SamplingParams(max_tokens=6000, stop=[], seed=5)
        in_flight = [sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, long)
                     for _ in range(2)]  # one per rank
        time.sleep(2)
        os.kill(_rank_pid(log, 1), signal.SIGKILL)
        killed = time.monotonic()
        for future in in_flight:
            with pytest.raises(tinker.RequestFailedError) as failed:
                future.result(timeout=60)
            assert "rank 1" in str(failed.value), str(failed.value)
        assert time.monotonic() - killed < 30
        # Rank 0 still answers: unhealthy, and new work fails at once with the same reason.
        health = httpx.get(f"{url}/api/v1/healthz", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.json()["reason"]
        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="rank 1"):
            trainer.forward(data, "cross_entropy").result()
        assert time.monotonic() - started < 10
        service.close("success").result()
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)

    # The group again, on the same store: the run, its checkpoint and its weights are back.
    with _group(tmp_path) as (_, url, _log):
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
        assert [c.tinker_path for c in listed] == [saved]
        for a, b in zip(_forward_from(url, saved), expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_run_starts_a_group_for_an_unmodified_script(tmp_path) -> None:
    from test_serve_command import TINY_SCRIPT

    # As a script written for hosted Tinker may: the tokenizer by name first, from an empty HF
    # cache, offline (rank 0 publishes it before the server answers, as one process does).
    script = tmp_path / "tiny_script.py"
    script.write_text(f"import transformers\ntransformers.AutoTokenizer.from_pretrained({TINY!r})\n"
                      f"print('TOKENIZER-OK', flush=True)\n{TINY_SCRIPT}")
    temporary = tmp_path / "tmp"  # what the launcher and the elastic agent put in the TMPDIR
    temporary.mkdir()
    done = processes.run(
        [*CLI, "run", "--nproc-per-node", "2", "--", sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=300, fork_descendants=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"),
             "TMPDIR": str(temporary)},
    )
    assert "TOKENIZER-OK" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "SCRIPT-OK" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 3  # the child's exit code
    # No folder of the launcher's or the elastic agent's is left; torch's compile cache
    # (torchinductor_<user>, made when bitsandbytes is importable) is kept on purpose.
    left = [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []
