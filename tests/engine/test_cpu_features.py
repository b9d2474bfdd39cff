"""The CPU's bf16 units (`engine/cpu_features.py`), the dtypes an engine refuses to start with,
and the start-up log line that says which units the CPU has and which dtype the engine chose."""

from __future__ import annotations

import pytest
import torch

from tinker_local.engine import cpu_features
from tinker_local.engine.cpu_features import Bf16Units, bf16_units_from, cpu_flags
from tinker_local.engine.engine import Engine
from tinker_local.engine.errors import EngineError
from tinker_local.engine.models import registry

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""
CPU = torch.device("cpu")
AMX = Bf16Units(amx_bf16=True, avx512_bf16=True, torch_kernels=True)
EMULATED = Bf16Units(amx_bf16=False, avx512_bf16=False, torch_kernels=True)  # AVX-512 only
AVX2 = Bf16Units(amx_bf16=False, avx512_bf16=False, torch_kernels=False)


def test_flags_are_the_first_processors():
    flags = cpu_flags(CPUINFO)
    assert {"amx_bf16", "avx512_bf16", "avx2"} <= flags and "bugs" not in flags
    assert cpu_flags("no flags line here") == frozenset()


def test_units_and_how_they_are_described():
    units = bf16_units_from(cpu_flags(CPUINFO), torch_kernels=True)
    assert units == AMX and units.native
    assert units.describe() == "AMX-BF16 + AVX512-BF16"
    zen4 = bf16_units_from(frozenset({"avx512f", "avx512_bf16"}), torch_kernels=True)
    assert zen4.native and zen4.describe() == "AVX512-BF16"
    assert not EMULATED.native and EMULATED.describe().startswith("none (torch emulates")
    assert not AVX2.native and "no bf16 kernels" in AVX2.describe()
    # flags without torch kernels: the silicon has them, this torch build cannot use them
    odd = Bf16Units(amx_bf16=True, avx512_bf16=False, torch_kernels=False)
    assert not odd.native and "torch has no bf16 kernels" in odd.describe()


def test_this_cpus_units_agree_with_its_flags_and_torch():
    units = cpu_features.bf16_units()
    flags = cpu_flags()
    assert units.amx_bf16 == ("amx_bf16" in flags)
    assert units.avx512_bf16 == ("avx512_bf16" in flags)
    assert units.torch_kernels == cpu_features.bf16_kernels_available()


@pytest.mark.parametrize(("units", "dtype", "message"), [
    (AMX, torch.float16, ("dtype float16 .*: use bfloat16 \\(this CPU has AMX-BF16 \\+ "
                         "AVX512-BF16\\) or float32$")),
    (AVX2, torch.float16, "dtype float16 .*: use float32$"),
    (AVX2, torch.bfloat16, "dtype bfloat16 cannot run on this CPU: .*: use float32$"),
])
def test_a_dtype_the_cpu_cannot_run_is_named_with_what_to_use(units, dtype, message):
    with pytest.raises(ValueError, match=message) as refused:
        registry.check_runnable(dtype, CPU, units)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("units", "dtype"), [
    (AMX, torch.bfloat16), (EMULATED, torch.bfloat16), (AVX2, torch.float32), (AMX, torch.float32)
])
def test_dtypes_the_cpu_runs_pass(units, dtype):
    registry.check_runnable(dtype, CPU, units)
    registry.check_runnable(torch.float16, torch.device("cuda"), AVX2)  # GPUs: not checked here


def test_an_engine_refuses_to_start_with_float16_on_the_cpu():
    with pytest.raises(EngineError, match="dtype float16 .*use .*float32"):
        Engine(device="cpu", dtype="float16")


def test_the_engine_says_which_units_and_dtype_at_start(caplog, monkeypatch):
    monkeypatch.delenv("TINKER_LOCAL_DTYPE", raising=False)
    with caplog.at_level("INFO", logger="tinker_local.engine.engine"):
        Engine(device="cpu")
    line = next(r.getMessage() for r in caplog.records if "bf16 matrix units" in r.getMessage())
    described = cpu_features.bf16_units().describe()
    assert line.startswith(f"CPU bf16 matrix units: {described}; engine dtype float32: the CPU "
                           "default"), line
    assert "docs/bf16.md" in line
