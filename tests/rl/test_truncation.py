import pytest

from tinker_local.rl.truncation import keep_head_and_tail


def test_short_sequences_are_untouched():
    assert keep_head_and_tail([1, 2, 3], 3, 2) == [1, 2, 3]


def test_keeps_first_k_and_most_recent_not_the_symmetric_middle_cut():
    tokens = list(range(100))
    out = keep_head_and_tail(tokens, max_tokens=20, keep_first=5)
    assert len(out) == 20
    assert out[:5] == [0, 1, 2, 3, 4]  # system prompt + task
    assert out[5:] == list(range(85, 100))  # the 15 most recent tokens
    # a middle-symmetric cut would have kept 0..9 and 90..99
    assert out != list(range(10)) + list(range(90, 100))


def test_head_larger_than_budget_and_zero_head():
    assert keep_head_and_tail(list(range(10)), 4, 100) == [0, 1, 2, 3]
    assert keep_head_and_tail(list(range(10)), 4, 0) == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        keep_head_and_tail([1, 2], 0, 1)
