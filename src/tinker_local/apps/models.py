"""`tinker-local export` (and `tinker-local models`, from `model_catalog.py`): the engine's
command-line entry points. Export formats: "merged" (a full Hugging Face model folder),
"adapter" (the PEFT files alone), "vllm" (those, checked against vLLM's LoRA loader:
`adapter_export.py`); `--push-to-hub ORG/NAME` uploads the result with a model card
(`hub_push.py`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tinker_local.apps.model_catalog import models_main  # noqa: F401 - the command's home
from tinker_local.config import read_json_object
from tinker_local.engine.models.registry import (
    TOKENIZER_SNAPSHOT_FILES,
    load_base,
    resolve_dtype,
    resolve_model,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
CHECKPOINT_META = "tinker_local.json"  # written by save_state; names the base model
EXPORT_META = "tinker_local_export.json"
FORMATS = ("merged", "adapter", "vllm")


class ExportError(ValueError):
    """A checkpoint or output folder that `export` cannot use."""


# ---------------------------------------------------------------------------------------------
# tinker-local export


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tinker-local export",
        description="Export a LoRA checkpoint (a sampler-weights or save_state folder, or its "
        "tinker:// path): merged into its base model as a full Hugging Face model folder with "
        "the tokenizer (default), as the PEFT adapter alone, or as an adapter checked for "
        "vLLM; optionally pushed to the Hugging Face hub (docs/quantization.md, 'Adapters that "
        "travel').",
    )
    parser.add_argument("checkpoint_dir", help="PEFT adapter folder, or a tinker:// path")
    parser.add_argument("out_dir", type=Path, nargs="?",
                        help="new folder to write (must not hold files); optional with "
                        "--push-to-hub")
    parser.add_argument("--format", choices=FORMATS, default="merged",
                        help="merged (default): base + LoRA as one model; adapter: the PEFT "
                        "files; vllm: the PEFT files, checked against vLLM's LoRA loader")
    parser.add_argument("--push-to-hub", metavar="ORG/NAME",
                        help="upload the export to this hub repo (HF_TOKEN; private unless "
                        "--public) with a model card")
    parser.add_argument("--public", action="store_true", help="create the hub repo public")
    parser.add_argument("--metrics", type=Path, metavar="FILE",
                        help="a run's metrics for the model card: JSON, or a metrics.jsonl "
                        "(its last record)")
    parser.add_argument(
        "--base-model",
        help=f"base model name or folder (default: from {CHECKPOINT_META} or {ADAPTER_CONFIG})",
    )
    parser.add_argument(
        "--dtype", default="float32", help="dtype of the saved weights: float32, bfloat16, float16"
    )
    args = parser.parse_args(argv)
    if args.out_dir is None and not args.push_to_hub:
        parser.error("give OUT_DIR, --push-to-hub ORG/NAME, or both")
    try:
        return _export(args)
    except ValueError as error:  # ExportError, PushError, unknown model, bad dtype: user errors
        parser.exit(2, f"tinker-local export: error: {error}\n")


def _export(args: argparse.Namespace) -> int:
    from tinker_local.apps import adapter_export, hub_push

    checkpoint, run = checkpoint_folder(args.checkpoint_dir)
    checkpoint = _check_checkpoint(checkpoint)
    base_name = args.base_model or base_model_of(checkpoint)
    fit = None
    if args.format == "vllm":
        base_config = read_json_object(resolve_model(base_name) / "config.json", ExportError)
        fit = adapter_export.vllm_fit(checkpoint, base_config)
    metrics = adapter_export.read_metrics(args.metrics) if args.metrics else None
    temporary = args.out_dir is None
    out = Path(tempfile.mkdtemp(prefix="tinker-local-export-")) / "export" if temporary \
        else _check_out_dir(args.out_dir)
    try:
        if args.format == "merged":
            export_merged(checkpoint, out, base_name, args.dtype)
        else:
            adapter_export.copy_adapter(checkpoint, out)
        if args.push_to_hub or args.format != "merged":
            card = adapter_export.model_card(
                checkpoint, base_model=base_name, kind=args.format,
                repo_id=args.push_to_hub or out.name, run=run, metrics=metrics)
            if fit is not None:
                card += ("\n## Serve with vLLM\n\n```\n"
                         + adapter_export.vllm_command(base_name, fit, args.push_to_hub or str(out))
                         + "\n```\n")
            (out / "README.md").write_text(card)
        if not temporary:
            print(f"wrote {args.format} export to {out}")
        if fit is not None:
            print("vLLM loads it as a LoRA: "
                  + adapter_export.vllm_command(base_name, fit, args.push_to_hub or str(out)))
        if args.push_to_hub:
            url = hub_push.push_folder(out, args.push_to_hub, private=not args.public,
                                       message=f"tinker-local export ({args.format}) of {run}")
            visibility = "public" if args.public else "private"
            print(f"pushed to {args.push_to_hub} ({visibility} unless it existed): {url}")
    finally:
        if temporary:
            shutil.rmtree(out.parent, ignore_errors=True)
    return 0


def checkpoint_folder(name: str) -> tuple[Path, str]:
    """The folder of a checkpoint given as a folder or a `tinker://` path, and the training run
    it belongs to (the run id, or the folder's name)."""
    if name.startswith("tinker://"):
        from tinker_local.server.core.errors import ApiError
        from tinker_local.server.core.tinker_paths import parse_uri

        try:
            parsed = parse_uri(name)
        except ApiError as error:
            raise ExportError(str(error)) from None
        return parsed.directory(), parsed.run_id
    folder = Path(name).expanduser()
    run = folder.parent.parent.name if folder.parent.name in ("weights", "sampler_weights") \
        else folder.name
    return folder, run


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
        base = read_json_object(meta_path, ExportError).get("base_model")
        if isinstance(base, str) and base:
            return base
    base = read_json_object(checkpoint_dir / ADAPTER_CONFIG, ExportError).get("base_model_name_or_path")
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
