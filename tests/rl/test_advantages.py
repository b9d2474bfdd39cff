import math

import pytest

from tinker_local.rl.advantages import group_advantages, is_constant, remove_constant_groups


def test_mean_baseline_without_std_is_dr_grpo():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0], normalize_std=False)
    assert adv == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    assert sum(adv) == pytest.approx(0.0)


def test_std_normalisation_uses_population_std_plus_eps():
    rewards = [1.0, 0.0, 0.0, 0.0]  # mean .25, population std sqrt(3)/4
    std = math.sqrt(3) / 4
    adv = group_advantages(rewards, normalize_std=True, eps=0.01)
    assert adv == pytest.approx(
        [0.75 / (std + 0.01), -0.25 / (std + 0.01)] + [-0.25 / (std + 0.01)] * 2
    )
    # scale invariance: multiplying rewards by 10 gives (almost) the same advantages
    adv10 = group_advantages([10 * r for r in rewards], normalize_std=True, eps=1e-9)
    assert adv10 == pytest.approx(group_advantages(rewards, normalize_std=True, eps=1e-9))


def test_constant_group_has_zero_advantage_even_with_std():
    assert group_advantages([0.3, 0.3, 0.3], normalize_std=True) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]


def test_bad_rewards_raise():
    assert group_advantages([]) == []  # every rollout excluded (masked rewards): nothing to train
    assert is_constant([])
    with pytest.raises(ValueError, match="reward 1 is not finite"):
        group_advantages([0.0, float("nan")])


def test_remove_constant_groups_reports_fraction():
    groups = ["a", "b", "c", "d"]
    rewards = [[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.2, 0.2 + 1e-12, 0.2]]
    result = remove_constant_groups(groups, rewards)
    assert result.kept == ["b"]
    assert result.removed_fraction == pytest.approx(0.75)
    assert not result.all_removed
    assert is_constant([0.5, 0.5]) and not is_constant([0.5, 0.6])


def test_all_constant_batch_is_flagged():
    result = remove_constant_groups(["a", "b"], [[1.0, 1.0], [0.0, 0.0]])
    assert result.kept == [] and result.all_removed and result.removed_fraction == 1.0
    with pytest.raises(ValueError, match="2 groups but 1 reward lists"):
        remove_constant_groups(["a", "b"], [[1.0]])
