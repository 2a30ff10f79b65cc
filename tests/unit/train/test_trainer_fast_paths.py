"""The trainer's per-client shortcuts give exactly what the plain calls give (fedelastic/train/trainer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.modelinfo import describe
from fedelastic.train.trainer import Prepared, seed_everything


@pytest.mark.parametrize("seed", [[0, 1, 7], [2**32 - 1, 0, 199], [12345, 10, 2**32], [3, -1], 42])
def test_seed_everything_makes_numpys_own_generator_and_torch_seed(seed):
    if isinstance(seed, list) and min(seed) < 0:
        with pytest.raises(ValueError):  # numpy's own error for a negative entry, as before
            seed_everything(seed)
        return
    rng = seed_everything(seed)
    torch_draw = torch.rand(3)
    ref = np.random.default_rng(seed)  # numpy's coercion of the list, the reference
    torch.default_generator.manual_seed(int(ref.integers(2**62)))
    assert rng.bit_generator.state == ref.bit_generator.state
    assert torch.equal(torch_draw, torch.rand(3))


def test_copy_out_is_a_copy_of_the_tensor_now_and_follows_in_place_writes_and_moved_storage():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    prepared = Prepared(model, describe(model, torch.zeros(1, 3)))
    weight = model[0].weight
    first = prepared.copy_out("0.weight")
    assert np.array_equal(first, weight.detach().numpy()) and first.base is None
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step: in place
    second = prepared.copy_out("0.weight")
    assert np.array_equal(second, first + np.float32(1.0))
    assert not np.shares_memory(first, second)
    with torch.no_grad():
        weight.set_(torch.full((4, 3), 5.0))  # new storage under the same parameter
    assert np.array_equal(prepared.copy_out("0.weight"), np.full((4, 3), 5.0, np.float32))
