"""Adapters that travel: `tinker-local export --format adapter|vllm` and the model card a push
writes (`hub_push.py` uploads).

A sampler-weights folder already is a PEFT adapter a stock vLLM loads (`--enable-lora`); what
`--format vllm` adds is the check, before anyone starts a GPU, against the rules vLLM's LoRA
loader applies (read in its source: the `vllm.lora` package's LoRA model and PEFT helper, its
LoRA config, and each model class's `embedding_modules`), and a folder holding only the two
files it reads:
- `adapter_config.json`: no DoRA, no `modules_to_save` (a value head is never in the adapter:
  it does not travel), `bias` "none"; the rank at most 512, and vLLM must be started with
  `--max-lora-rank` at least the rank, from its fixed list (1, 8, 16, 32, 64, 128, 256, 320, 512);
- `adapter_model.safetensors`: every key `base_model.model.<module>.lora_A|lora_B.weight`, each
  module's last name one vLLM can replace: a Linear layer (q/k/v/o, gate/up/down: vLLM packs
  them itself), or `lm_head`/`embed_tokens` only for the families whose vLLM class declares them
  in `embedding_modules` (Llama's does, Qwen3's and Gemma's do not), and nothing in a vision
  tower (vLLM adapts the language model only).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_local.config import read_json_object

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# model_type -> the modules beyond Linear layers vLLM's class takes LoRA on (`embedding_modules`)
VLLM_EMBEDDING_MODULES = {"llama": ("embed_tokens", "lm_head")}  # only those read in its source
_VISION_PARTS = ("visual", "vision_tower", "vision_model")


class AdapterExportError(ValueError):
    """An adapter that cannot be exported in the asked format (the message says why and what
    to do instead)."""


@dataclass(frozen=True)
class VllmFit:
    rank: int
    max_lora_rank: int  # the smallest value vLLM's --max-lora-rank accepts that fits `rank`
    modules: tuple[str, ...]  # the adapted modules' last names


def vllm_fit(checkpoint: Path, base_config: dict[str, Any]) -> VllmFit:
    """Check the adapter in `checkpoint` against vLLM's LoRA loader; AdapterExportError naming
    every rule it breaks."""
    from safetensors import safe_open

    config = read_json_object(checkpoint / "adapter_config.json", AdapterExportError)
    problems = []
    if config.get("use_dora"):
        problems.append("it is a DoRA adapter (vLLM loads plain LoRA only)")
    if config.get("modules_to_save"):
        problems.append(f"it saves whole modules {config['modules_to_save']} (vLLM requires "
                        "modules_to_save to be empty)")
    if config.get("bias", "none") != "none":
        problems.append(f"it trains biases (bias={config['bias']!r}; vLLM needs 'none')")
    ranks = [int(config.get("r", 0)), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    rank = max(ranks)
    fitting = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if not fitting:
        problems.append(f"its rank {rank} exceeds vLLM's largest --max-lora-rank "
                        f"({VLLM_MAX_LORA_RANKS[-1]})")
    model_type = str(base_config.get("model_type"))
    extra = VLLM_EMBEDDING_MODULES.get(model_type, ())
    modules: set[str] = set()
    with safe_open(checkpoint / "adapter_model.safetensors", framework="pt") as weights:
        keys = list(weights.keys())
    for key in keys:
        parts = key.split(".")
        if parts[-2:] not in (["lora_A", "weight"], ["lora_B", "weight"]) and \
                parts[-1] not in ("lora_embedding_A", "lora_embedding_B"):
            problems.append(f"tensor {key} is not a LoRA A/B matrix")
            continue
        module = parts[:-2] if parts[-1] == "weight" else parts[:-1]
        if any(part in _VISION_PARTS for part in module):
            problems.append("it adapts the vision tower (vLLM applies LoRA to the language "
                            "model only; train without tinker_local.lora_vision)")
            break
        leaf = module[-1]
        if leaf in ("lm_head", "embed_tokens") and leaf not in extra:
            problems.append(
                f"it adapts {leaf}, which vLLM's {model_type} model does not take LoRA on "
                "(train with train_unembed=False, or export --format merged)")
            break
        modules.add(leaf)
    if problems:
        raise AdapterExportError(f"{checkpoint} will not load in vLLM as a LoRA: "
                                 + "; ".join(dict.fromkeys(problems)))
    return VllmFit(rank, fitting[0], tuple(sorted(modules)))


def copy_adapter(checkpoint: Path, out_dir: Path) -> Path:
    """The adapter's two PEFT files (no optimizer state, value head or tinker-local record)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        if not (checkpoint / name).is_file():
            raise AdapterExportError(f"{checkpoint} has no {name}: not a PEFT adapter folder")
        shutil.copyfile(checkpoint / name, out_dir / name)
    return out_dir


def vllm_command(base_model: str, fit: VllmFit, adapter: str) -> str:
    return (f"vllm serve {base_model} --enable-lora --max-lora-rank {fit.max_lora_rank} "
            f"--lora-modules adapter={adapter}")


# ---------------------------------------------------------------------------------------------
# the model card


def model_card(checkpoint: Path, *, base_model: str, kind: str, repo_id: str,
               run: str | None, metrics: dict[str, Any] | None) -> str:
    """README.md for the hub: YAML metadata the hub reads (base model, library, tags), then what
    the adapter is (rank, alpha, coverage, step, quantised base), the run and its metrics."""
    config = read_json_object(checkpoint / "adapter_config.json", AdapterExportError)
    record = read_json_object(checkpoint / "tinker_local.json", AdapterExportError) if (
        checkpoint / "tinker_local.json").is_file() else {}
    lora = record.get("lora") or {}
    alpha = config.get("lora_alpha", lora.get("alpha"))
    targets = config.get("target_modules")
    targets = ", ".join(targets) if isinstance(targets, list) else str(targets)
    library = "peft" if kind != "merged" else "transformers"
    lines = ["---", f"base_model: {base_model}", f"library_name: {library}",
             "tags:", "- tinker-local", "- lora"]
    lines += ["---", "", f"# {repo_id}", ""]
    what = "A LoRA adapter" if kind != "merged" else "A LoRA adapter merged into its base model"
    lines += [(f"{what}, trained with [tinker-local](https://pypi.org/project/tinker-local/) "
              "(the Tinker training API on your own hardware)."), ""]
    rows = [("base model", base_model), ("format", kind),
            ("LoRA rank", config.get("r")), ("LoRA alpha", alpha),
            ("adapted modules", targets), ("training steps", record.get("step")),
            ("trained on a quantised base", record.get("base_quantization")),
            ("training run", run)]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows if value not in (None, "")]
    if metrics:
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_number(v)} |" for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if kind != "merged":
        lines += ["", "## Use", "", "```python",
                  "from peft import PeftModel",
                  "from transformers import AutoModelForCausalLM", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
                  f'model = PeftModel.from_pretrained(base, "{repo_id}")', "```"]
    return "\n".join(lines) + "\n"


def read_metrics(path: Path) -> dict[str, Any]:
    """A run's metrics for the card: a JSON object, or the last record of a metrics.jsonl (what
    `tinker-local rl`/`sft` write in their log directory)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise AdapterExportError(f"cannot read metrics {path}: {error}") from None
    records = [line for line in text.splitlines() if line.strip()]
    try:
        data = json.loads(text) if path.suffix == ".json" else json.loads(records[-1])
    except (ValueError, IndexError) as error:
        raise AdapterExportError(f"{path} holds no JSON metrics ({error})") from None
    if not isinstance(data, dict):
        raise AdapterExportError(f"{path}: metrics must be a JSON object")
    return data


def _number(value: float) -> str:
    return f"{value:.6g}"
