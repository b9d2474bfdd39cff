"""Training rows with images (engine/training/vision_rows.py): never packed, even when their
token ids agree (different images have the same placeholders); text rows pack as before; and
image positions carry no target."""

from __future__ import annotations

import torch

from tinker_local.engine.contract.image_chunks import ImageSlot
from tinker_local.engine.training.packing import plan_packed_rows
from tinker_local.engine.training.vision_rows import plan_rows, text_logprobs


def test_datums_with_images_get_rows_of_their_own() -> None:
    prefix = list(range(100, 140))  # 40 shared tokens: text datums pack on it
    tokens = [torch.tensor(prefix + [1, 2]), torch.tensor(prefix + [3]),
              torch.tensor(prefix + [4, 5]), torch.tensor(prefix + [6])]
    cat, dog = ImageSlot(5, 10, b"cat", "png"), ImageSlot(5, 10, b"dog", "png")
    images = [(), (), (cat,), (dog,)]
    rows = plan_rows(tokens, images, [1] * 4, max_row_tokens=4096)
    assert sorted(m for r in rows for m in r.members) == [0, 1, 2, 3]
    packed = [r for r in rows if len(r.members) > 1]
    assert [(r.members, r.prefix) for r in packed] == [((0, 1), 40)]
    assert {r.members for r in rows if len(r.members) == 1} == {(2,), (3,)}
    # Without the images, the planner would have packed the image datums too.
    assert any(set(r.members) >= {2, 3} for r in plan_packed_rows(tokens, max_row_tokens=4096))


def test_logprobs_are_zero_where_the_target_is_an_image_token() -> None:
    logprobs = torch.arange(1.0, 11.0, requires_grad=True)
    masked = text_logprobs(logprobs, (ImageSlot(3, 4, b"x", "png"),))
    assert masked.tolist() == [1, 2, 0, 0, 0, 0, 7, 8, 9, 10]  # positions 2..5 predict 3..6
    masked.sum().backward()
    assert logprobs.grad.tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    top_k = torch.ones(10, 3)
    assert text_logprobs(top_k, (ImageSlot(0, 2, b"x", "png"),))[:2].tolist() == [[0] * 3,
                                                                                  [1] * 3]
