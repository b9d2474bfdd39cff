"""`tinker-local tasks [NAME]`: the task suite, or one task's prompt format, reward and defaults."""

from __future__ import annotations

import sys

from tinker_local.tasks.registry import PARADIGMS, TASKS, describe, task_kind


def main(argv: list[str] | None = None) -> int:
    """`tinker-local tasks` lists every task; `tinker-local tasks NAME` shows its details."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(
            "usage: tinker-local tasks [NAME]\n\nLists the built-in tasks, or shows one task's "
            "prompt format, reward and defaults."
        )
        return 0
    if args:
        if args[0] not in TASKS:
            print(
                f"tinker-local tasks: unknown task {args[0]!r}; known: {', '.join(TASKS)}",
                file=sys.stderr,
            )
            return 2
        print(f"{args[0]} ({task_kind(args[0])})\n\n{describe(args[0])}")
        return 0
    width = max(map(len, TASKS))
    print(f"{'task':<{width}}  {'kind':<8}  description")
    for name, (description, _) in TASKS.items():
        print(f"{name:<{width}}  {task_kind(name):<8}  {description}")
    print("\nparadigms:")
    for name, description in PARADIGMS.items():
        print(f"  {name}: {description}")
    print("\n`tinker-local tasks NAME` shows a task's prompt format, reward and defaults.")
    return 0
