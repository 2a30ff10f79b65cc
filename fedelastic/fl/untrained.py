"""A partial strategy on an untrained model: say at start-up why such a run learns nothing.

A strategy that trains a share of the parameters (the head, the biases, a time budget's worth of
tensors) assumes the rest already computes useful features. From the factory's random
initialisation it does not: the run ends near chance, and nothing else would say why.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..train.trainer import LocalTraining, train_local

if TYPE_CHECKING:
    from ..environment import RunEnvironment

SMALL_SHARE = 0.5  # below it, most of an untrained model keeps its random weights: the run learns little


class UntrainedModelWarning(UserWarning):
    """A strategy that trains part of the model starts from an untrained model."""


def trained_shares(env: RunEnvironment, state: dict) -> dict[str, float]:
    """Share of the model's parameters the strategy's first selection trains, per device of the fleet.

    One step of the real trainer (probe and selection included) on a copy of the starting weights,
    with the first client of each device's first-round data; torch's random state is restored.
    A device whose selection does not fit is left out.
    """
    sc, info = env.scenario, env.info
    model = env.new_model()
    shares: dict[str, float] = {}
    rng_state = torch.get_rng_state()
    try:
        for device in dict.fromkeys(env.devices):
            pid = env.devices.index(device)
            data = env.client_data(pid, 1)
            if not len(data):
                continue
            model.load_state_dict(state)
            local = LocalTraining(
                epochs=1, batch_size=sc.train.batch_size, lr=sc.train.lr, momentum=sc.train.momentum, max_steps=1,
                bn_mode=env.bn_mode, optimizer=sc.train.optimizer,
            )  # fmt: skip
            res = train_local(model, info, env.strategy(), env.cost(device), data, local, seed=[sc.seed, pid])
            if res.fits and res.ratios is not None:
                shares[device] = float(np.dot(res.ratios, info.tensor_numel) / info.num_params)
    finally:
        torch.set_rng_state(rng_state)
    return shares


def warn_if_untrained_partial(env: RunEnvironment, state: dict) -> None:
    """Warn (:class:`UntrainedModelWarning`, once) when the run starts from the factory's weights (no
    ``model.pretrain``, no ``model.weights``) and its strategy trains less than :data:`SMALL_SHARE`
    of the parameters on every device."""
    sc = env.scenario
    if sc.model.pretrain is not None or sc.model.weights or sc.train.strategy == "full":
        return
    try:
        shares = trained_shares(env, state)
    except Exception:  # noqa: BLE001 (the clients hit the same error and report it; this is only advice)
        return
    if not shares or max(shares.values()) >= SMALL_SHARE:
        return
    low, high = min(shares.values()), max(shares.values())
    figure = f"{low:.0%}" if round(low * 100) == round(high * 100) else f"{low:.0%} to {high:.0%} (by device)"
    warnings.warn(
        f"{sc.train.strategy} trains {figure} of the parameters of an untrained model (no model.pretrain, "
        f"no model.weights): expect accuracy near chance ({1 / env.num_classes:.2f})",
        UntrainedModelWarning,
        stacklevel=2,
    )
