"""Group selection (`rollart.algorithms.selection`): the has-signal rule and the anchor groups."""

from __future__ import annotations

import random

from rollart.algorithms.selection import groups_with_signal, has_signal, select_groups


def test_a_group_has_signal_when_its_rewards_differ() -> None:
    assert has_signal([0.0, 1.0])
    assert has_signal([0.3, 0.3, 0.2])
    assert not has_signal([1.0, 1.0, 1.0])
    assert not has_signal([0.25])
    assert groups_with_signal([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.5]]) == [1, 3]


def test_without_anchors_only_groups_with_signal_are_trained() -> None:
    chosen = select_groups([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.5]], anchors=0)
    assert chosen.signal == chosen.trained == [1, 3]
    assert chosen.without_signal == 2


def test_anchors_add_up_to_that_many_groups_without_signal_in_batch_order() -> None:
    rewards = [[1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0], [0.2, 0.2]]
    chosen = select_groups(rewards, anchors=2, rng=random.Random(0))
    assert chosen.signal == [1]
    assert len(chosen.trained) == 3 and 1 in chosen.trained and chosen.trained == sorted(chosen.trained)
    assert set(chosen.trained) - {1} <= {0, 2, 3, 4}
    everything = select_groups(rewards, anchors=10, rng=random.Random(0))
    assert everything.trained == [0, 1, 2, 3, 4]


def test_a_batch_without_signal_trains_on_nothing_even_with_anchors() -> None:
    chosen = select_groups([[1.0, 1.0], [0.0, 0.0]], anchors=2)
    assert chosen.signal == chosen.trained == []
    assert chosen.without_signal == 2


def test_anchors_draw_from_the_random_module_when_no_generator_is_given() -> None:
    rewards = [[0.0, 1.0]] + [[1.0, 1.0]] * 6
    random.seed(7)
    first = select_groups(rewards, anchors=2).trained
    random.seed(7)
    assert select_groups(rewards, anchors=2).trained == first
