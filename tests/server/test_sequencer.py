"""Per-model seq_id ordering."""

from __future__ import annotations

import asyncio

import pytest

from tinker_local.server.core.sequencer import Late, SeqSequencer


def _offer(seq: SeqSequencer, log: list[int], seq_id: int, fwdbwd: bool = True) -> None:
    seq.offer(seq_id, is_forward_backward=fwdbwd, release=lambda: log.append(seq_id))


def test_chunks_arriving_first_chunk_last_run_in_order() -> None:
    async def scenario() -> list[int]:
        seq, log = SeqSequencer("m", gap_wait_s=30), []
        _offer(seq, log, 2)
        _offer(seq, log, 3)
        assert log == []  # waiting for seq 1
        _offer(seq, log, 1)
        _offer(seq, log, 4, fwdbwd=False)
        return log

    assert asyncio.run(scenario()) == [1, 2, 3, 4]


def test_a_non_forward_backward_request_proves_the_gap_is_final() -> None:
    async def scenario() -> list[int]:
        seq, log = SeqSequencer("m", gap_wait_s=30), []
        _offer(seq, log, 1)
        _offer(seq, log, 3)  # seq 2 was never sent; 3 might be a chunk: wait
        assert log == [1]
        _offer(seq, log, 4, fwdbwd=False)  # the SDK only sends this after 2 and 3 were sent
        return log

    assert asyncio.run(scenario()) == [1, 3, 4]


def test_forward_backward_waits_for_a_gap_only_so_long() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        seq, log = SeqSequencer("m", gap_wait_s=0.2), []
        _offer(seq, log, 2)
        await asyncio.sleep(0.05)
        early = list(log)
        await asyncio.sleep(0.4)
        return early, log

    early, late = asyncio.run(scenario())
    assert early == [] and late == [2]


def test_a_skipped_seq_id_arriving_late_is_refused() -> None:
    async def scenario() -> None:
        seq, log = SeqSequencer("m", gap_wait_s=30), []
        _offer(seq, log, 1)
        _offer(seq, log, 3, fwdbwd=False)
        with pytest.raises(Late, match="seq_id 2 .* arrived after later requests"):
            _offer(seq, log, 2)

    asyncio.run(scenario())
