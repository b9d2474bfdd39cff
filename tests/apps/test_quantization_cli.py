"""The command line of quantised bases: `tinker-local models` shows the weights' memory with
each choice (none / int8 / nf4; "-" where a model cannot be quantised), and `serve` refuses a
bad `--base-quantization` (or one it cannot combine) in one line naming what to do."""

from __future__ import annotations

import re

import pytest

from tinker_local import config
from tinker_local.apps.cli import main
from tinker_local.engine.models import builtin
from tinker_local.engine.models.registry import resolve_model

SIZE = r"([\d.]+) (B|KiB|MiB|GiB)"
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(number: str, unit: str) -> float:
    return float(number) * UNITS[unit]


def test_models_lists_the_memory_of_each_quantisation(capsys):
    resolve_model(config.TINY_TEST_MODEL)
    resolve_model(builtin.TINY_QWEN3_MOE)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "weights served none / int8 / nf4" in out
    row = next(line for line in out.splitlines() if line.startswith(config.TINY_TEST_MODEL + " "))
    sizes = re.search(f"{SIZE} / {SIZE} / {SIZE}", row)
    assert sizes, row
    none, int8, nf4 = (_bytes(*sizes.groups()[i:i + 2]) for i in (0, 2, 4))
    assert none > int8 > nf4  # the embeddings stay float32, so the tiny model saves little
    moe = next(line for line in out.splitlines() if line.startswith(builtin.TINY_QWEN3_MOE + " "))
    assert re.search(f"{SIZE} / - / -", moe), moe
    assert "--base-quantization" in out


@pytest.mark.parametrize("argv,expect", [
    (["serve", "--base-quantization", "int4"], "invalid choice: 'int4' (choose from 'none', 'int8', 'nf4')"),
    (["serve", "--base-quantization", "nf4", "--nproc-per-node", "2", "--shard-base"],
     "--base-quantization does not combine with --shard-base"),
])
def test_serve_refuses_bad_quantisation_in_one_line(argv, expect, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert expect in err
