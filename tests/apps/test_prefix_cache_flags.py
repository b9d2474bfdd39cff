"""The prefix cache's budget from `serve --prefix-cache-mib` / `--no-prefix-cache`, the embedded
server's `prefix_cache_mib` / `prefix_cache`, and `engine_factory(prefix_cache_bytes=)`: a
budget that is not positive is refused at start, naming the flag and how to turn it off."""

from __future__ import annotations

import pytest

from tinker_local import config
from tinker_local.apps import embedded
from tinker_local.apps.serve import prefix_cache_bytes, serve_main, serve_parser
from tinker_local.engine.factory import engine_factory


def test_serve_flags_give_the_engine_its_budget() -> None:
    parse = serve_parser().parse_args
    assert prefix_cache_bytes(parse([])) == config.DEFAULT_PREFIX_CACHE_MIB * 2**20  # on
    mib = str(config.DEFAULT_PREFIX_CACHE_MIB)
    assert prefix_cache_bytes(parse(["--prefix-cache-mib", mib])) == config.DEFAULT_PREFIX_CACHE_MIB * 2**20
    assert prefix_cache_bytes(parse(["--prefix-cache-mib", "1.5"])) == 3 * 2**19
    assert prefix_cache_bytes(parse(["--no-prefix-cache"])) is None


@pytest.mark.parametrize("mib", ["0", "-3"])
def test_serve_refuses_a_budget_that_is_not_positive(mib, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        serve_main(["--prefix-cache-mib", mib])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--prefix-cache-mib must be positive" in err and "--no-prefix-cache" in err


@pytest.mark.parametrize("mib", [0, -1, True, "64"])
def test_the_embedded_server_refuses_a_budget_that_is_not_positive(mib) -> None:
    with pytest.raises(ValueError, match="prefix_cache_mib must be a positive number of MiB"):
        embedded._prefix_cache_bytes(mib, None)
    assert embedded._prefix_cache_bytes(mib, False) is None  # off: the budget is not read
    assert embedded._prefix_cache_bytes(None, None) == config.DEFAULT_PREFIX_CACHE_MIB * 2**20
    assert embedded._prefix_cache_bytes(None, True) == config.DEFAULT_PREFIX_CACHE_MIB * 2**20


@pytest.mark.parametrize("budget", [0, -5, 1.5])
def test_engine_factory_refuses_a_budget_that_is_not_positive_bytes(budget) -> None:
    with pytest.raises(ValueError, match="positive number of bytes"):
        engine_factory(prefix_cache_bytes=budget)
