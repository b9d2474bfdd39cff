"""`tinker-local` command line: a thin dispatcher over the commands in `tinker_local.apps`."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tinker_local.apps.startup import freeze_heap_at_exit

Main = Callable[[list[str]], "int | None"]

# Each loader imports its command only when it runs, so `--help` stays instant; the imports sit
# in functions rather than strings so that import-linter sees every edge.


def _serve() -> Main:
    from tinker_local.apps.serve import serve_main

    return serve_main


def _run() -> Main:
    from tinker_local.apps.serve import run_main

    return run_main


def _models() -> Main:
    from tinker_local.apps.models import models_main

    return models_main


def _export() -> Main:
    from tinker_local.apps.models import export_main

    return export_main


def _rl() -> Main:
    from tinker_local.apps.rl import main

    return main


def _tasks() -> Main:
    from tinker_local.apps.tasks import main

    return main


def _sft() -> Main:
    from tinker_local.apps.sft import main

    return main


def _collect() -> Main:
    from tinker_local.apps.collect import main

    return main


def _pipeline() -> Main:
    from tinker_local.apps.pipeline import main

    return main


def _sandbox_serve() -> Main:
    from tinker_local.apps.sandbox_serve import main

    return main


def _eval() -> Main:
    from tinker_local.apps.eval import main

    return main


# subcommand -> (loader of its main, one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[], Main], str]] = {
    "serve": (_serve, "run the tinker-local HTTP server"),
    "run": (_run, "run an unmodified hosted-Tinker script against an embedded server"),
    "models": (_models, "list the models this machine can serve; `models pull ORG/NAME` fetches one"),
    "export": (_export, ("merge a LoRA checkpoint into a full model, or export the adapter for "
               "vLLM; --push-to-hub ORG/NAME uploads it")),
    "rl": (_rl, "RL training (GRPO/PPO) on a task"),
    "tasks": (_tasks, "list the built-in tasks"),
    "sft": (_sft, "supervised fine-tuning on chat or prompt/completion JSONL"),
    "collect": (_collect, "write SFT data from the task suite"),
    "pipeline": (
        _pipeline,
        "SFT, then RL from the SFT checkpoint, then eval of base/SFT/RL side by side",
    ),
    "eval": (_eval, "evaluate checkpoints on tasks with Jeffreys intervals"),
    "sandbox-serve": (
        _sandbox_serve,
        "SandboxFusion's run_code API on the local sandbox (for the cookbook's code_rl)",
    ),
}


# Commands that start an engine and so accept `--sampler {builtin,vllm}`.
SAMPLER_COMMANDS = ("serve", "run")
SAMPLER_HELP = (
    "  --sampler {builtin,vllm}  sampling backend (default builtin; env TINKER_LOCAL_SAMPLER);\n"
    "                            vllm needs vLLM installed, see the README"
)


def apply_sampler_option(argv: list[str], options_need_separator: bool = False) -> list[str]:
    """Take `--sampler NAME` / `--sampler=NAME` out of `argv` into TINKER_LOCAL_SAMPLER (which
    `engine.factory.engine_factory` reads), so the subcommand's own parser never sees it. Only options before
    a "--" are looked at (for `run`, whose options all precede "--", none without one). For
    "vllm", check now that vLLM is installed (RuntimeError with the install hint); ValueError
    for a bad value."""
    import os

    from tinker_local import config

    end = argv.index("--") if "--" in argv else (0 if options_need_separator else len(argv))
    rest: list[str] = []
    chosen: str | None = None
    args = iter(argv[:end])
    for arg in args:
        if arg == "--sampler":
            chosen = next(args, None)
            if chosen is None:
                raise ValueError("--sampler needs a value: builtin or vllm")
        elif arg.startswith("--sampler="):
            chosen = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        if arg in ("-h", "--help"):
            print(f"tinker-local option (before the command's own):\n{SAMPLER_HELP}\n")
    rest += argv[end:]
    backend = config.sampler_backend(chosen)
    if backend == "vllm":
        from tinker_local.engine.sampling.vllm_backend import check_installed

        check_installed()
    os.environ[config.SAMPLER_ENV] = backend
    return rest


def _usage() -> str:
    lines = ["usage: tinker-local COMMAND [ARGS...]", "", "commands:"]
    width = max(len(name) for name in SUBCOMMANDS)
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    freeze_heap_at_exit()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tinker-local: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in SAMPLER_COMMANDS:
        try:
            rest = apply_sampler_option(rest, options_need_separator=name == "run")
        except (ValueError, RuntimeError) as error:
            print(f"tinker-local {name}: error: {error}", file=sys.stderr)
            return 2
    if _uses_models_by_name(name, rest):
        from tinker_local.apps.offline import go_offline_if_hub_unreachable

        go_offline_if_hub_unreachable()
    return int(SUBCOMMANDS[name][0]()(rest) or 0)


def _uses_models_by_name(name: str, rest: list[str]) -> bool:
    """Whether the command loads models or tokenizers by hub name without needing the hub, so
    an unreachable hub should mean offline mode (apps/offline.py) rather than minutes of
    retries. Downloads (`models pull`, `--allow-download`) report a missing hub themselves."""
    if {"-h", "--help", "--allow-download"} & set(rest):
        return False
    if name == "export" and any(arg.startswith("--push-to-hub") for arg in rest):
        return False  # a push needs the hub: an unreachable one is its own clear error
    return not (name == "models" and rest[:1] == ["pull"])


if __name__ == "__main__":
    sys.exit(main())
