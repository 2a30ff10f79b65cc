"""Sparse Update's offline contribution analysis (Lin et al. 2022, section 3.3), measured for real.

Run once per (model, task), before deployment: from the pretrained weights, fine-tune

* the biases of the last ``k`` layers, for k = 1..K: ``bias[k-1]`` is the accuracy gain over
  the untouched model;
* the last K biases plus one weight layer at one input-channel ratio, for every layer in the
  bias range and every ratio: ``weight[layer][ratio]`` is the gain over the last-K-biases scheme,

each for the same number of local steps from the same weights, on ``train`` data, and evaluate on
``val`` data. The result (JSON) is what ``sparse_update``'s ``contributions`` option reads.

What data it runs on decides what it is. The paper measures the gains offline, before deployment,
on data the server has: source or proxy data (``kind = "offline proxy"``, the default). Measured
on the pooled target-task data of the clients it is a **centralised oracle** (``oracle=True``,
``kind = "centralised oracle"``): no other strategy sees the target data before training, and
``sparse_update`` uses such a file only when its ``oracle`` option says so. The JSON records the
kind, a description of the data (``data``), the device whose cost model and memory priced the
fine-tunings, and the training settings. The gains are accuracies, the same on any device; a
scheme the analysis device cannot hold trains nothing and gains nothing, and each client's own
memory decides, when it selects, which schemes it may run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..cost.costmodel import CostModel
from ..data import ArrayDataset
from ..modelinfo import ModelInfo
from ..selection.strategy import Selection, SelectionContext, SelectionStrategy
from .trainer import LocalTraining, train_local

PROXY, ORACLE = "offline proxy", "centralised oracle"  # what an analysis is, by the data it ran on


class _Fixed(SelectionStrategy):
    name = "_fixed"

    def __init__(self, selection: Selection):
        super().__init__()
        self.selection = selection

    def select(self, ctx: SelectionContext) -> Selection:
        return self.selection


def accuracy(model: nn.Module, data: ArrayDataset) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x)).argmax(1).numpy()
    return float((pred == data.y).mean())


def analyse(
    model: nn.Module,
    info: ModelInfo,
    cost: CostModel,
    train: ArrayDataset,
    val: ArrayDataset,
    *,
    bias_last_k: int = 6,
    channel_ratios: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0),
    epochs: int = 2,
    batch_size: int = 16,
    lr: float = 0.05,
    seed: int = 0,
    path: str | Path | None = None,
    data: str,
    oracle: bool = False,
    **train_options,
) -> dict:
    """Measure the gains (see module doc); write them to ``path`` as JSON when given.

    ``data`` describes where ``train`` and ``val`` come from (recorded); ``oracle``: they are the
    clients' pooled target-task data (labelled "centralised oracle"). ``train_options``
    (``momentum``, ``weight_decay``, ``optimizer``, ``lr_schedule``) go to the local trainer, as
    the run's ``[train]`` sets them.
    """
    if not data.strip():
        raise ValueError("data: describe the data the analysis runs on (source, proxy or the pooled target data)")
    from fedelastic.strategies.sparse_update import BIAS_ROLES, bias_layers, weights_in_range

    n = info.num_tensors
    start = copy.deepcopy(model.state_dict())

    local = LocalTraining(epochs=epochs, batch_size=batch_size, lr=lr, bn_mode=cost.bn_mode, **train_options)

    def gain_of(ratios: np.ndarray, input_sparse: np.ndarray) -> float:
        model.load_state_dict(start)
        train_local(model, info, _Fixed(Selection(ratios, input_sparse=input_sparse)), cost, train, local, seed=seed)
        return accuracy(model, val)

    model.load_state_dict(start)
    base = accuracy(model, val)
    layers = bias_layers(info)[:bias_last_k]
    bias, whole = [], np.zeros(n)
    for li in layers:
        for k in info.layers[li].tensors:
            if info.tensor_roles[k] in BIAS_ROLES:
                whole[k] = 1
        bias.append(gain_of(whole, np.zeros(n, bool)) - base)
    top = base + (bias[-1] if bias else 0.0)
    weight: dict[str, dict[str, float]] = {}
    for k in weights_in_range(info, set(layers)):
        name = info.layers[int(info.tensor_layer[k])].name
        sparse = np.zeros(n, bool)
        sparse[k] = True
        weight[name] = {}
        for r in channel_ratios:
            ratios = whole.copy()
            ratios[k] = r
            weight[name][str(r)] = gain_of(ratios, sparse) - top
    model.load_state_dict(start)
    out = {
        "model": info.model_name,
        "kind": ORACLE if oracle else PROXY,
        "data": data,
        "device": cost.device.name,
        "device_memory_bytes": cost.device.memory_train_bytes.value,
        "training": {"epochs": epochs, "batch_size": batch_size, "lr": lr, "seed": seed, **train_options},
        "base_accuracy": base,
        "bias": bias,
        "weight": weight,
    }
    if path is not None:
        Path(path).write_text(json.dumps(out, indent=1))
    return out
