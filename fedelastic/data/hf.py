"""Datasets from the ecosystem: Hugging Face names through flwr-datasets, and local copies.

``data.dataset`` may name

* a Hugging Face dataset (``"uoft-cs/cifar10"``, ``"flwrlabs/femnist"``): loaded by
  flwr-datasets' :class:`~flwr_datasets.FederatedDataset` and split by its partitioners;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* a ``.parquet`` file (or a folder of them), or an ``imagefolder`` tree (``class_name/*.png``,
  optionally under ``train/`` and ``test/``);
* an ``.npz`` of arrays (read with numpy alone; see :func:`load_npz`).

Partitioning runs once, on the driver: the images, labels and every partition's indices are
written to one ``.npz`` under ``$FEDELASTIC_CACHE/datasets``, and every Ray actor reads that file
with numpy, without importing ``datasets`` or flwr-datasets (about 2 s per process). The
partitioners are flwr-datasets' own: ``iid`` (IidPartitioner), ``dirichlet``
(DirichletPartitioner), ``shards`` (ShardPartitioner), ``pathological``
(PathologicalPartitioner) and ``natural_id`` (NaturalIdPartitioner, e.g. FEMNIST's writers).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import ArrayDataset, FederatedData, train_test_split
from .registry import check_finite, is_plugin

CACHE_VERSION = 1
INDEX, IMAGE, LABEL = "__fedelastic_index__", "__fedelastic_image__", "__fedelastic_label__"
IMAGE_NAMES = ("image", "img", "pixels", "x", "images")
LABEL_NAMES = ("label", "labels", "fine_label", "character", "y", "target", "class")


def is_external(name: str) -> bool:
    """Whether ``data.dataset`` is a Hugging Face dataset or a local copy: no entry of the dataset registry."""
    return not is_plugin(name)


def _cache_root() -> Path:
    return Path(os.environ.get("FEDELASTIC_CACHE", Path.home() / ".cache" / "fedelastic")) / "datasets"


def _local_kind(path: Path) -> str | None:
    """``save_to_disk``, ``parquet``, ``imagefolder``, ``npz``, or None when ``path`` does not exist."""
    if path.is_file():
        if path.suffix == ".npz":
            return "npz"
        if path.suffix == ".parquet":
            return "parquet"
        return None
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            return "save_to_disk"
        if any(path.rglob("*.parquet")):
            return "parquet"
        return "imagefolder"
    return None


def _source_stamp(name: str, base: Path) -> dict:
    path = base / Path(name).expanduser()
    if _local_kind(path) is None:
        return {"hub": name}
    # datasets writes its own cache-*.arrow files beside a save_to_disk copy: they are not the source
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("cache-"))
    )
    return {
        "local": str(path.resolve()),
        "files": [
            (str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files
        ],
    }


def _require_extra(src: str):
    try:
        import datasets  # noqa: F401
        import flwr_datasets  # noqa: F401
    except ImportError:
        raise ConfigError(
            src, "data.dataset", "the optional extra for Hugging Face datasets: pip install 'fedelastic[hf]'"
        ) from None


def _pick(
    columns: list[str], wanted: str, names: tuple[str, ...], features: dict, kind: str, src: str, key: str
) -> str:
    if wanted:
        if wanted not in columns:
            raise ConfigError(src, key, f"a column of the dataset ({', '.join(columns)})", wanted)
        return wanted
    import datasets

    typed = [
        c for c in columns if isinstance(features.get(c), datasets.Image if kind == "image" else datasets.ClassLabel)
    ]
    for c in typed + [c for c in names if c in columns]:
        return c
    raise ConfigError(src, key, f"the {kind} column's name (none of {', '.join(columns)} looks like one)")


def _partitioner(d, num_partitions: int, label: str, seed: int, src: str):
    from flwr_datasets import partitioner as P

    if d.partitioner == "iid":
        return P.IidPartitioner(num_partitions)
    if d.partitioner == "dirichlet":
        return P.DirichletPartitioner(
            num_partitions,
            label,
            alpha=d.alpha,
            min_partition_size=d.min_partition_size,
            self_balancing=False,
            seed=seed,
        )
    if d.partitioner == "shards":
        return P.ShardPartitioner(num_partitions, label, num_shards_per_partition=d.shards_per_partition, seed=seed)
    if d.partitioner == "pathological":
        return P.PathologicalPartitioner(num_partitions, label, d.classes_per_partition, "random", seed=seed)
    if d.partitioner == "natural_id":
        if not d.partition_by:
            raise ConfigError(src, "data.partition_by", "the column of natural ids (e.g. 'writer_id') for natural_id")
        return P.NaturalIdPartitioner(partition_by=d.partition_by)
    raise ConfigError(src, "data.partitioner", "iid, dirichlet, shards, pathological or natural_id", d.partitioner)


def _to_images(column: list[Any], is_image: bool, size: int) -> np.ndarray:
    """Images as (N, C, H, W) float32 in [0, 1]."""
    if is_image:
        mode = "L" if column and column[0].mode in ("L", "1", "I", "I;16", "F") else "RGB"
        arrays = []
        for img in column:
            img = img.convert(mode)
            if size and img.size != (size, size):
                img = img.resize((size, size))
            arrays.append(np.asarray(img))
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"images of different sizes {sorted(shapes)[:3]}...: set data.image_size to resize them")
        x = np.stack(arrays)
    else:
        x = np.asarray(column)
    return _layout(x)


def _layout(x: np.ndarray) -> np.ndarray:
    if x.ndim == 2:  # flat vectors of square images
        side = int(round(np.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise ValueError(f"cannot read images of shape {x.shape[1:]}")
        x = x.reshape(-1, side, side)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)[:, :3]
    if x.ndim != 4:
        raise ValueError(f"cannot read images of shape {x.shape[1:]}")
    scale = 255.0 if x.dtype == np.uint8 or float(np.max(x, initial=0)) > 1.0 else 1.0
    return np.ascontiguousarray(x, dtype=np.float32) / np.float32(scale)


def _labels(*columns: list[Any]):
    """Integer labels of each column; names become ids in sorted order, the same for every column."""
    arrays = [np.asarray(c) for c in columns]
    if all(a.dtype.kind in "iu" for a in arrays):
        out = [a.astype(np.int64) for a in arrays]
    else:
        names = np.unique(np.concatenate([a.astype(str) for a in arrays]))
        out = [np.searchsorted(names, a.astype(str)).astype(np.int64) for a in arrays]
    return out[0] if len(out) == 1 else out


def _load_and_partition(name: str, base: Path, preprocess, partitioner, count: int, src: str):
    """(train split, test split, indices of partitions 0..count-1) through flwr-datasets."""
    from flwr_datasets import FederatedDataset

    path = base / Path(name).expanduser()
    kind = _local_kind(path)
    if kind == "save_to_disk":
        import datasets

        loaded = datasets.load_from_disk(str(path))
        dd = preprocess(loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded}))
        partitioner.dataset = dd["train"]  # what FederatedDataset does with the split it partitions
        _check_count(partitioner, count, src)
        return dd["train"], dd["test"], [partitioner.load_partition(i)[INDEX] for i in range(count)]
    if kind == "parquet":
        files = [str(path)] if path.is_file() else sorted(str(p) for p in path.rglob("*.parquet"))
        kwargs: dict = {"dataset": "parquet", "data_files": files}
    elif kind == "imagefolder":
        kwargs = {"dataset": "imagefolder", "data_dir": str(path)}
    else:
        _check_hub(name, src)
        kwargs = {"dataset": name}
    fds = FederatedDataset(partitioners={"train": partitioner}, preprocessor=preprocess, shuffle=False, **kwargs)
    try:
        train = fds.load_split("train")
    except ConfigError:
        raise
    except Exception as exc:  # network, hub or builder failures: one line, with the cause
        if kind is not None:
            raise
        lines = str(exc).strip().splitlines()
        offline = " with HF_HUB_OFFLINE set: it must be in the Hugging Face cache" if _offline() else ""
        raise ConfigError(
            src,
            "data.dataset",
            f"a Hugging Face dataset that can be downloaded from here, or a local copy{offline} "
            f"(loading failed: {type(exc).__name__}: {lines[0][:200] if lines else ''})",
            name,
        ) from None
    fds.load_partition(0, "train")  # binds the split to the partitioner
    _check_count(partitioner, count, src)
    return train, fds.load_split("test"), [fds.load_partition(i, "train")[INDEX] for i in range(count)]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _check_hub(name: str, src: str, timeout_s: float = 3.0) -> None:
    """Fail at once when the Hub cannot be reached (Hugging Face would retry for about a minute).

    With ``HF_HUB_OFFLINE=1`` nothing is checked: the dataset comes from the Hugging Face cache."""
    import socket
    from urllib.parse import urlparse

    if _offline():
        return
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            src,
            "data.dataset",
            f"a Hugging Face dataset reachable from here: {host}:{port} cannot be reached "
            f"({exc.strerror or type(exc).__name__}); offline, set HF_HUB_OFFLINE=1 to load it from the Hugging "
            "Face cache, or give a local copy (a save_to_disk folder, parquet files, an imagefolder or an .npz)",
            name,
        ) from None


def _check_count(partitioner, count: int, src: str) -> None:
    available = partitioner.num_partitions
    if available < count:
        raise ConfigError(src, "fleet", f"at most {available} clients (the partitioner's partitions)", count)


def load_npz(path: Path, d, src: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of an ``.npz``: arrays named by ``data.image_column``/``label_column`` or auto-detected."""
    import zipfile

    if not zipfile.is_zipfile(path):  # np.load would read it as a pickle (refused) or a bare array
        raise ConfigError(src, "data.dataset", "an .npz file (a zip of arrays, as numpy.savez writes)", str(path))
    with np.load(path) as f:
        keys = list(f.keys())
        img = d.image_column or next((k for k in IMAGE_NAMES if k in keys), "")
        lab = d.label_column or next((k for k in LABEL_NAMES if k in keys), "")
        for key, name in (("data.image_column", img), ("data.label_column", lab)):
            if name not in keys:
                raise ConfigError(src, key, f"an array of {path} ({', '.join(keys)})", name or "<none found>")
        x, y = _layout(f[img]), _labels(f[lab])
    check_finite(x, src, f"{path} ('{img}')", str(path))
    if len(x) != len(y):
        raise ConfigError(src, "data.label_column", f"one label per image in {path} ({len(x)} images in '{img}')", f"{len(y)} labels in '{lab}'")
    return x, y


def prepare(
    d, num_partitions: int, seed: int, src: str = "<scenario>", base: Path | None = None, split_seed: int | None = None
) -> FederatedData:
    """Load and partition an external dataset once; cached, so other processes read one ``.npz``.

    ``split_seed`` (default ``seed``): the seed of an ``.npz`` file's train/test split (a shared
    pretrain fixes it, see ``model.pretrain.seed``); the Hub's and local copies' splits are their own."""
    split_seed = seed if split_seed is None else split_seed
    base = base if base is not None else (Path(src).parent if src and not src.startswith("<") else Path("."))
    doc = {
        "v": CACHE_VERSION,
        "source": _source_stamp(d.dataset, base),
        "data": {k: v for k, v in vars(d).items() if k not in ("transform", "shift", "dataset")},
        "num_partitions": num_partitions,
        "seed": seed,
        **({"split_seed": split_seed} if split_seed != seed else {}),  # older keys unchanged
    }
    key = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache = _cache_root() / f"external-{key}.npz"
    if cache.exists():
        with np.load(cache) as f:
            bounds = f["bounds"]
            parts = [f["parts"][bounds[i] : bounds[i + 1]] for i in range(num_partitions)]
            return FederatedData(
                ArrayDataset(f["train_x"], f["train_y"]), ArrayDataset(f["test_x"], f["test_y"]), parts
            )
    try:
        data = _prepare_uncached(d, num_partitions, seed, src, base, split_seed)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (a local copy that cannot be read: bad input, in one line)
        path = base / Path(d.dataset).expanduser()
        kind = _local_kind(path)
        if kind is None:
            raise
        text = " ".join(str(exc).split())[:200]
        key = "data.image_size" if "data.image_size" in text else "data.dataset"
        raise ConfigError(src, key, f"a readable {kind} dataset at {path} ({type(exc).__name__}: {text})", d.dataset) from None
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp.npz")
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in data.partitions])])
    np.savez(
        tmp,
        train_x=data.train.x,
        train_y=data.train.y,
        test_x=data.test.x,
        test_y=data.test.y,
        parts=np.concatenate(data.partitions).astype(np.int64) if data.partitions else np.zeros(0, np.int64),
        bounds=bounds,
    )
    os.replace(tmp, cache)
    return data


def _prepare_uncached(d, num_partitions: int, seed: int, src: str, base: Path, split_seed: int) -> FederatedData:
    from . import partition

    path = base / Path(d.dataset).expanduser()
    if _local_kind(path) == "npz":  # numpy only: the hand-written partitioners
        x, y = load_npz(path, d, src)
        if d.classes:
            keep = np.isin(y, d.classes)
            x, y = x[keep], y[keep]
        if d.partitioner not in ("iid", "shards", "dirichlet"):
            raise ConfigError(src, "data.partitioner", "iid, dirichlet or shards for an .npz", d.partitioner)
        train_idx, test_idx = train_test_split(y, d.test_fraction, split_seed)
        train, test = ArrayDataset(x[train_idx], y[train_idx]), ArrayDataset(x[test_idx], y[test_idx])
        if len(test) == 0:
            raise ConfigError(src, "data.test_fraction", f"a fraction that leaves the server test samples of {path} ({len(y)} images)", d.test_fraction)
        parts = partition(
            train.y, num_partitions, d.partitioner, seed, alpha=d.alpha,
            shards_per_partition=d.shards_per_partition, min_size=d.min_partition_size, src=src,
        )  # fmt: skip
        return FederatedData(train, test, parts)

    _require_extra(src)
    import datasets

    datasets.disable_progress_bars()

    def preprocess(dd):
        import datasets

        first = dd[next(iter(dd))]
        names, features = list(first.column_names), dict(first.features)
        image = _pick(names, d.image_column, IMAGE_NAMES, features, "image", src, "data.image_column")
        label = _pick(names, d.label_column, LABEL_NAMES, features, "label", src, "data.label_column")
        if d.partition_by and d.partition_by not in names:
            raise ConfigError(src, "data.partition_by", f"a column of the dataset ({', '.join(names)})", d.partition_by)
        dd = dd.rename_columns({image: IMAGE, label: LABEL})
        if d.classes:
            keep = set(d.classes)
            dd = dd.filter(lambda ys: [y in keep for y in ys], batched=True, input_columns=[LABEL])
        if "test" not in dd:
            train_idx, test_idx = train_test_split(_labels(dd["train"][LABEL]), d.test_fraction, seed)
            dd = datasets.DatasetDict({"train": dd["train"].select(train_idx), "test": dd["train"].select(test_idx)})
        train = dd["train"]
        return datasets.DatasetDict({"train": train.add_column(INDEX, list(range(len(train)))), "test": dd["test"]})

    partitioner = _partitioner(d, num_partitions, LABEL, seed, src)
    train_ds, test_ds, parts = _load_and_partition(d.dataset, base, preprocess, partitioner, num_partitions, src)
    is_image = isinstance(train_ds.features[IMAGE], datasets.Image)
    train_y, test_y = _labels(train_ds[LABEL], test_ds[LABEL])
    train = ArrayDataset(_to_images(train_ds[IMAGE], is_image, d.image_size), train_y)
    test = ArrayDataset(_to_images(test_ds[IMAGE], is_image, d.image_size), test_y)
    return FederatedData(train, test, [np.sort(np.asarray(p, dtype=np.int64)) for p in parts])
