"""The dataset and weights sources of the accuracy scripts: the papers' regime, for anyone with a network.

Not a package module: imported by the reproduce scripts by path. Each accuracy script that uses it takes

* ``--dataset NAME``: the target task from a Hugging Face dataset through flwr-datasets
  (``Donghyun99/CUB-200-2011``, ``uoft-cs/cifar10``, a Meta-Dataset domain on the Hub ...) or a local
  copy (a ``save_to_disk`` folder, parquet files, an imagefolder tree, an ``.npz``), read by
  :func:`fedelastic.data.hf.prepare`: its train split gives the training and validation images
  (``VAL_FRACTION`` of each class held out, seed 0), its test split (or 20% of train) the test images;
* ``--weights SOURCE``: the starting weights, ``torchvision`` (torchvision's ImageNet weights for the
  model, downloaded once into ``$FEDELASTIC_CACHE/weights``) or ``torchvision:PATH_OR_URL``, mapped onto
  fedelastic's own model built with ``layout="torchvision"`` (:mod:`fedelastic.models.imagenet`); the head
  is new (the target's classes);
* ``--image-size N``: resize the dataset's images to N x N (224 for the papers' regime).

Nothing downloads unless asked: without a network, give local copies. A failed download or a file
that does not fit the model exits with one line naming the flag, the file and what was expected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedelastic.data import train_test_split  # noqa: E402
from fedelastic.errors import ConfigError  # noqa: E402

VAL_FRACTION = 0.2


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dataset", default="", help="target task: a Hugging Face dataset (e.g. Donghyun99/CUB-200-2011, "
                    "uoft-cs/cifar10) or a local copy; default: the script's generated data")  # fmt: skip
    ap.add_argument("--weights", default="", help="starting weights: 'torchvision' (ImageNet, by URL) or "
                    "'torchvision:PATH_OR_URL'; default: the script's own pretraining")  # fmt: skip
    ap.add_argument("--image-size", type=int, default=0, help="resize --dataset images to this square size (0: keep)")


def target_splits(dataset: str, image_size: int = 0) -> dict[str, np.ndarray]:
    """``tr``/``va``/``te`` images (N, 3, H, W) in [0, 1] and labels of ``dataset`` (see the module doc)."""
    from fedelastic.data import hf
    from fedelastic.scenario import DataConfig

    cfg = DataConfig(dataset=dataset, partitioner="iid", min_partition_size=1, image_size=image_size)
    try:
        data = hf.prepare(cfg, 1, seed=0, src="--dataset", base=Path.cwd())
    except ConfigError as exc:
        raise SystemExit(
            str(exc).replace("key 'data.dataset'", "--dataset").replace("key 'data.image_size'", "--image-size")
        ) from None
    train, test = data.train, data.test
    tr, va = train_test_split(train.y, VAL_FRACTION, seed=0)
    rgb = lambda x: np.repeat(x, 3, axis=1) if x.shape[1] == 1 else x  # grey images for RGB backbones  # noqa: E731
    return {"tr_x": rgb(train.x[tr]), "tr_y": train.y[tr], "va_x": rgb(train.x[va]), "va_y": train.y[va],
            "te_x": rgb(test.x), "te_y": test.y}  # fmt: skip


def num_classes(d: dict[str, np.ndarray]) -> int:
    return int(max(d["tr_y"].max(), d["va_y"].max(), d["te_y"].max())) + 1


def imagenet_start(model, weights: str) -> dict:
    """``model``'s starting state from torchvision's ImageNet weights (``--weights``); its head stays new."""
    from fedelastic.models.imagenet import imagenet_state, is_torchvision

    if not is_torchvision(weights):
        raise SystemExit(f"--weights: expected 'torchvision' or 'torchvision:PATH_OR_URL', got {weights!r}")
    try:
        state, kept = imagenet_state(model, weights, src="--weights", key="--weights")
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    print(f"ImageNet weights ({weights}) loaded; kept from the new model: {', '.join(kept) or 'nothing'}", flush=True)
    return state
