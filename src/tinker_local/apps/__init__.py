"""The top layer: every command-line entry point and demo, and the one place that connects to a
server. The libraries below (rl, sl, eval, tasks, sandbox, rendering) take a client from their
caller and never start a server or import from here; `pyproject.toml`'s import-linter contracts
hold that.

One module per command: `rl`, `sft`, `collect`, `pipeline`, `eval`, `tasks`, `demo` (`make
run`); `cli` dispatches `tinker-local COMMAND`; `connect` gives every command its client.
"""
