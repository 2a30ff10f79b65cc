"""Datasets and partitioners.

Built in, with no download: scikit-learn's ``digits`` (1,797 8x8 images, shipped inside
scikit-learn) and ``synth_digits`` (:mod:`.synth`: 60,000 generated 32x32 RGB digits with
clutter, the cluttered domain to digits' clean one), entries of the dataset plug-in point
(:mod:`.registry`, where a user's own dataset is registered). Their partitioners here are pure
numpy and deterministic from a seed; Hugging Face datasets and local copies go through :mod:`.hf` and
flwr-datasets' partitioners. Domain shifts are in :mod:`.shifts`, continual streams in
:mod:`.stream`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .arrays import ArrayDataset as ArrayDataset
from .registry import DATASETS as DATASETS  # re-exported: the plug-in point
from .registry import build_dataset
from .registry import register_dataset as register_dataset


@lru_cache(maxsize=4)
def load_digits_dataset() -> ArrayDataset:
    """scikit-learn's digits, scaled to [0, 1], shape (1797, 1, 8, 8).

    The CSV that scikit-learn ships is read directly: importing ``sklearn.datasets`` costs
    seconds in every Ray actor. ``load_digits`` is the fallback if the file moves.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.exists():
        table = np.loadtxt(path, delimiter=",")
        images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, target = bunch.images, bunch.target
    return ArrayDataset((images / 16.0).astype(np.float32)[:, None], target.astype(np.int64))


def transform(ds: ArrayDataset, kind: str, seed: int) -> ArrayDataset:
    """A domain shift of the images: ``none``, ``rotate90``, ``noise`` or ``invert``."""
    if kind == "none":
        return ds
    if kind == "rotate90":
        return ArrayDataset(np.ascontiguousarray(np.rot90(ds.x, 1, axes=(2, 3))), ds.y)
    if kind == "noise":
        rng = np.random.default_rng([seed, 7])
        return ArrayDataset(np.clip(ds.x + rng.normal(0, 0.2, ds.x.shape), 0, 1).astype(np.float32), ds.y)
    if kind == "invert":
        return ArrayDataset(1.0 - ds.x, ds.y)
    raise ValueError(f"unknown transform {kind!r}")


def train_test_split(n_labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of indices into (train, test)."""
    rng = np.random.default_rng([seed, 1])
    train, test = [], []
    for c in np.unique(n_labels):
        idx = rng.permutation(np.flatnonzero(n_labels == c))
        cut = int(round(len(idx) * test_fraction))
        test.append(idx[:cut])
        train.append(idx[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def check_partition_sizes(
    num_samples: int,
    num_clients: int,
    partitioner: str,
    *,
    min_size: int,
    shards_per_partition: int = 1,
    alpha: float = 0.5,
    src: str = "<scenario>",
) -> None:
    """Refuse, before anything starts, a split that would leave a client with too little data.

    The message names the scenario keys that fix it.
    """
    if partitioner == "shards":
        need, what = num_clients * shards_per_partition, f"{shards_per_partition} non-empty shards each"
        fixes = "lower data.shards_per_partition, use fewer clients, or a larger dataset"
    else:
        need, what = num_clients * min_size, f"{min_size} samples each"
        fixes = (
            'lower data.min_partition_size, raise data.alpha, use partitioner = "iid", or a larger dataset'
            if partitioner == "dirichlet"
            else "lower data.min_partition_size, use fewer clients, or a larger dataset"
        )
    how = f"dirichlet(alpha={alpha:g})" if partitioner == "dirichlet" else partitioner
    if num_samples < need:
        raise ConfigError(
            src, "data", f"a split that gives every client data: {num_samples:,} training samples cannot give "
            f"{num_clients:,} clients {what} under {how}; {fixes}",
        )  # fmt: skip


def partition_iid(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng([seed, 2]).permutation(len(labels))
    return [np.sort(p) for p in np.array_split(order, num_partitions)]


def partition_dirichlet(
    labels: np.ndarray, num_partitions: int, alpha: float, seed: int, min_size: int = 2, max_tries: int = 1000
) -> list[np.ndarray]:
    """Split over labels with per-class proportions drawn from Dirichlet(alpha).

    Draws again until every partition holds at least ``min_size`` samples.
    """
    if len(labels) < num_partitions * min_size:
        raise ValueError(f"{len(labels)} samples cannot give {num_partitions} partitions of {min_size}")
    rng = np.random.default_rng([seed, 3])
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_partitions, alpha))) * len(idx)).astype(int)[:-1]
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"no Dirichlet({alpha}) draw gave every partition {min_size} samples in {max_tries} tries")


def partition_shards(labels: np.ndarray, num_partitions: int, shards_per_partition: int, seed: int) -> list[np.ndarray]:
    """Sort by label, cut into shards, deal ``shards_per_partition`` shards to each partition."""
    rng = np.random.default_rng([seed, 4])
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, num_partitions * shards_per_partition)
    deal = rng.permutation(len(shards)).reshape(num_partitions, shards_per_partition)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in deal]


@dataclass(frozen=True)
class FederatedData:
    """Client partitions (indices into ``train``), the server's held-out test set, and the
    validation indices into ``train`` carved from the clients' partitions (none by default)."""

    train: ArrayDataset
    test: ArrayDataset
    partitions: list[np.ndarray]
    validation: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def client(self, partition_id: int) -> ArrayDataset:
        return self.train.subset(self.partitions[partition_id])

    @property
    def validation_set(self) -> ArrayDataset:
        return self.train.subset(self.validation)


def carve_validation(partitions: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Hold out ``round(fraction * size)`` random samples of each partition (each keeps at least one).

    Returns the partitions without them and the sorted union of what was held out, which no client
    trains on. Client ``i``'s draw depends on ``seed`` and ``i`` alone, so the carve is deterministic.
    """
    kept, held = [], []
    for i, part in enumerate(partitions):
        part = np.asarray(part, dtype=np.int64)
        cut = min(int(round(len(part) * fraction)), max(len(part) - 1, 0))
        chosen = np.random.default_rng([seed, 8, i]).permutation(len(part))[:cut]
        mask = np.zeros(len(part), bool)
        mask[chosen] = True
        kept.append(np.sort(part[~mask]))
        held.append(part[mask])
    return kept, np.sort(np.concatenate(held)) if held else np.zeros(0, np.int64)


def partition(
    labels: np.ndarray,
    num_partitions: int,
    partitioner: str,
    seed: int,
    *,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    min_size: int = 1,
    src: str = "<scenario>",
) -> list[np.ndarray]:
    """Split ``labels``' indices into ``num_partitions`` client partitions by ``partitioner``
    (``iid``, ``shards`` or ``dirichlet``); sizes are checked first, with errors naming the keys."""
    check_partition_sizes(
        len(labels), num_partitions, partitioner, min_size=min_size,
        shards_per_partition=shards_per_partition, alpha=alpha, src=src,
    )  # fmt: skip
    if partitioner == "iid":
        return partition_iid(labels, num_partitions, seed)
    if partitioner == "shards":
        return partition_shards(labels, num_partitions, shards_per_partition, seed)
    try:
        return partition_dirichlet(labels, num_partitions, alpha, seed, min_size=min_size)
    except ValueError:
        raise ConfigError(
            src, "data", f"a split that gives every client data: no dirichlet(alpha={alpha:g}) draw gave "
            f"{num_partitions:,} clients {min_size} samples each from {len(labels):,} training samples; lower "
            'data.min_partition_size, raise data.alpha, use partitioner = "iid", or a larger dataset',
        ) from None


def load_dataset(name: str, *, src: str = "<scenario>", size: int = 0) -> ArrayDataset:
    """A dataset by name (:mod:`.registry`): ``digits`` (scikit-learn), ``synth_digits`` (``size``
    samples, 0: 60,000), a registered one, or a ``module:callable`` / ``file.py:callable``."""
    return build_dataset(name, context=src, size=size)
