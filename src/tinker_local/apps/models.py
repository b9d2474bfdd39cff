"""`tinker-local export` (and `tinker-local models`, from `model_catalog.py`): the engine's
command-line entry points."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tinker_local.apps.model_catalog import models_main  # noqa: F401 - the command's home
from tinker_local.engine.models.registry import TOKENIZER_SNAPSHOT_FILES, load_base, resolve_dtype

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
CHECKPOINT_META = "tinker_local.json"  # written by save_state; names the base model
EXPORT_META = "tinker_local_export.json"


class ExportError(ValueError):
    """A checkpoint or output folder that `export` cannot use."""


# ---------------------------------------------------------------------------------------------
# tinker-local export


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local export",
        description="Merge a LoRA checkpoint (a sampler-weights or save_state folder) into its "
        "base model and save a full Hugging Face model folder with the tokenizer.",
    )
    parser.add_argument("checkpoint_dir", type=Path, help="PEFT adapter folder to merge")
    parser.add_argument("out_dir", type=Path, help="new folder to write (must not hold files)")
    parser.add_argument(
        "--base-model",
        help=f"base model name or folder (default: from {CHECKPOINT_META} or {ADAPTER_CONFIG})",
    )
    parser.add_argument(
        "--dtype", default="float32", help="dtype of the saved weights: float32, bfloat16, float16"
    )
    args = parser.parse_args(argv)
    try:
        out = export_merged(args.checkpoint_dir, args.out_dir, args.base_model, args.dtype)
    except ValueError as error:  # ExportError, unknown model, bad dtype: all user errors
        parser.exit(2, f"tinker-local export: error: {error}\n")
    print(f"wrote merged model to {out}")
    return 0


def export_merged(
    checkpoint_dir: Path,
    out_dir: Path,
    base_model: str | None = None,
    dtype: str = "float32",
) -> Path:
    """Merge the adapter in `checkpoint_dir` into its base model; write it to `out_dir`."""
    import torch
    from peft import PeftModel

    checkpoint_dir = _check_checkpoint(Path(checkpoint_dir))
    out_dir = _check_out_dir(Path(out_dir))
    save_dtype = resolve_dtype(dtype, torch.device("cpu"))
    base_name = base_model or base_model_of(checkpoint_dir)
    # Merge in float32 on CPU so the sum base + B@A is not rounded before the final cast.
    base = load_base(base_name, device="cpu", dtype="float32")
    peft_model = PeftModel.from_pretrained(base.model, checkpoint_dir)
    if _adapter_touches_tied_output(peft_model):
        _untie_output_embeddings(peft_model.get_base_model())
    merged = peft_model.merge_and_unload().to(save_dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        merged.save_pretrained(tmp)
        _copy_tokenizer_files(base.folder, tmp)
        meta = {"base_model": base_name, "checkpoint": str(checkpoint_dir.resolve())}
        (tmp / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above; rename needs it gone or empty
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def base_model_of(checkpoint_dir: Path) -> str:
    """The base model a checkpoint was trained on: tinker_local.json first, then adapter_config."""
    meta_path = checkpoint_dir / CHECKPOINT_META
    if meta_path.is_file():
        base = _read_json(meta_path).get("base_model")
        if isinstance(base, str) and base:
            return base
    base = _read_json(checkpoint_dir / ADAPTER_CONFIG).get("base_model_name_or_path")
    if isinstance(base, str) and base:
        return base
    raise ExportError(
        f"{checkpoint_dir} does not say which base model it belongs to (no base_model in "
        f"{CHECKPOINT_META}, no base_model_name_or_path in {ADAPTER_CONFIG}); pass --base-model"
    )


def _check_checkpoint(checkpoint_dir: Path) -> Path:
    if not checkpoint_dir.is_dir():
        raise ExportError(f"checkpoint folder {checkpoint_dir} does not exist")
    if not (checkpoint_dir / ADAPTER_CONFIG).is_file():
        raise ExportError(
            f"{checkpoint_dir} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG}"
        )
    if not any((checkpoint_dir / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ExportError(
            f"{checkpoint_dir} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})"
        )
    return checkpoint_dir


def _check_out_dir(out_dir: Path) -> Path:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output {out_dir} already exists and is not an empty folder")
    return out_dir


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} does not hold a JSON object")
    return data


def _adapter_touches_tied_output(peft_model) -> bool:
    base = peft_model.get_base_model()
    output = base.get_output_embeddings()
    if output is None or not getattr(base.config.get_text_config(), "tie_word_embeddings", False):
        return False
    output_names = {name for name, module in base.named_modules() if module is output}
    touched = [
        name
        for name, module in base.named_modules()
        if hasattr(module, "lora_A") or hasattr(module, "modules_to_save")
    ]
    # peft wraps the output layer in place, so its wrapper sits at the same name or its parent
    return any(
        name in output_names or any(o.startswith(name + ".") for o in output_names)
        for name in touched
    )


def _untie_output_embeddings(model) -> None:
    """Give the output layer its own copy of the embedding matrix before merging into it.

    With tied embeddings, merging a LoRA on lm_head would also change the input embeddings.
    """
    import torch

    output = model.get_output_embeddings()
    target = getattr(output, "base_layer", output)  # the Linear under a peft LoRA wrapper
    target.weight = torch.nn.Parameter(target.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False  # the same object for plain LMs


def _copy_tokenizer_files(base_folder: Path, out: Path) -> None:
    # The model's own save wrote config/generation config; copy the tokenizer byte for byte.
    for name in TOKENIZER_SNAPSHOT_FILES:
        source = base_folder / name
        if source.is_file() and not (out / name).exists():
            shutil.copyfile(source, out / name)


if __name__ == "__main__":
    sys.exit(export_main(sys.argv[1:]))
