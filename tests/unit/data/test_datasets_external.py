"""Hugging Face datasets and local copies, loaded offline through the code path a user runs.

Small ``datasets.Dataset`` objects are built here, saved (save_to_disk, Parquet, imagefolder,
.npz), and loaded by naming them in a scenario, exactly as a user names ``uoft-cs/cifar10``.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedelastic.environment import RunEnvironment
from fedelastic.errors import ConfigError
from fedelastic.scenario import parse_scenario

datasets = pytest.importorskip("datasets", reason="the optional 'hf' extra is not installed")
pytest.importorskip("flwr_datasets", reason="the optional 'hf' extra is not installed")
from PIL import Image  # noqa: E402  (installed with the extra)

N, WRITERS, CLASSES = 120, 7, 4


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (N, 10, 10, 3), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, N)
    writers = np.array([f"w{i % WRITERS}" for i in range(N)])
    return images, labels, writers


@pytest.fixture(scope="module")
def hf_dataset(arrays):
    images, labels, writers = arrays
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "fine": datasets.ClassLabel(num_classes=CLASSES),
            "writer_id": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {"img": [Image.fromarray(a) for a in images], "fine": labels, "writer_id": list(writers)}, features=features
    )


def _env(tmp_path, fleet=5, **data):
    raw = {
        "name": "ext",
        "seed": 1,
        "fleet": {"raspberry_pi_4": fleet},
        "data": data,
        "simulation": {"backend": "inprocess"},
    }
    return RunEnvironment(parse_scenario(raw, src=str(tmp_path / "scenario.toml")))


def _match_rows(arrays, x, y):
    """Row of the original set each loaded image came from (images are random, so unique)."""
    images, labels, _ = arrays
    flat = {a.tobytes(): i for i, a in enumerate(images)}
    rows = np.array([flat[np.round(img.transpose(1, 2, 0) * 255).astype(np.uint8).tobytes()] for img in x])
    np.testing.assert_array_equal(labels[rows], y)  # every image kept its own label
    return rows


def _check_partitions(env, arrays, min_size=1):
    data = env.data
    rows = np.concatenate(
        [_match_rows(arrays, data.train.x, data.train.y), _match_rows(arrays, data.test.x, data.test.y)]
    )
    assert sorted(rows) == list(range(N))  # train + test is the whole set, once
    cover = np.concatenate(data.partitions)
    assert sorted(cover) == list(range(len(data.train)))  # every training sample in exactly one partition
    assert len(data.partitions) == env.scenario.num_clients and min(map(len, data.partitions)) >= min_size
    return data


def test_save_to_disk_folder_with_auto_detected_columns_and_dirichlet(tmp_path, hf_dataset, arrays):
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    env = _env(
        tmp_path, dataset="saved", partitioner="dirichlet", alpha=0.5, min_partition_size=3
    )  # relative to the scenario
    data = _check_partitions(env, arrays, min_size=3)
    assert env.input_shape == (3, 10, 10) and env.num_classes == CLASSES
    per_class = np.bincount(arrays[1], minlength=CLASSES)
    assert len(data.test) == sum(round(0.2 * c) for c in per_class)  # no test split: a stratified 20% is held out


def test_parquet_file_with_named_columns_iid(tmp_path, hf_dataset, arrays):
    hf_dataset.to_parquet(str(tmp_path / "set.parquet"))
    env = _env(
        tmp_path, dataset=str(tmp_path / "set.parquet"), partitioner="iid", image_column="img", label_column="fine"
    )
    data = _check_partitions(env, arrays)
    assert max(map(len, data.partitions)) - min(map(len, data.partitions)) <= 1


def test_dataset_dict_test_split_is_the_server_test_set(tmp_path, hf_dataset, arrays):
    dd = datasets.DatasetDict({"train": hf_dataset.select(range(100)), "test": hf_dataset.select(range(100, N))})
    dd.save_to_disk(str(tmp_path / "dd"))
    env = _env(tmp_path, dataset=str(tmp_path / "dd"), partitioner="shards", shards_per_partition=2)
    data = env.data
    assert sorted(_match_rows(arrays, data.test.x, data.test.y)) == list(range(100, N))
    assert sorted(np.concatenate(data.partitions)) == list(range(100))


def test_natural_id_gives_each_client_one_writer(tmp_path, hf_dataset, arrays):
    hf_dataset.save_to_disk(str(tmp_path / "femnist_like"))
    env = _env(
        tmp_path,
        fleet=WRITERS,
        dataset=str(tmp_path / "femnist_like"),
        partitioner="natural_id",
        partition_by="writer_id",
    )
    data = _check_partitions(env, arrays)
    writers = arrays[2]
    train_rows = _match_rows(arrays, data.train.x, data.train.y)
    seen = [set(writers[train_rows[p]]) for p in data.partitions]
    assert all(len(s) == 1 for s in seen) and set.union(*seen) == {f"w{i}" for i in range(WRITERS)}
    # a smaller fleet takes the first writers; a larger one is an error naming the limit
    assert (
        len(
            _env(
                tmp_path,
                fleet=3,
                dataset=str(tmp_path / "femnist_like"),
                partitioner="natural_id",
                partition_by="writer_id",
            ).data.partitions
        )
        == 3
    )
    with pytest.raises(ConfigError, match=f"at most {WRITERS} clients"):
        _ = _env(
            tmp_path,
            fleet=WRITERS + 1,
            dataset=str(tmp_path / "femnist_like"),
            partitioner="natural_id",
            partition_by="writer_id",
        ).external


def test_pathological_partitions_hold_the_asked_number_of_labels(tmp_path, hf_dataset, arrays):
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    env = _env(tmp_path, dataset=str(tmp_path / "saved"), partitioner="pathological", classes_per_partition=2)
    data = env.data
    assert all(len(np.unique(data.train.y[p])) <= 2 for p in data.partitions)


def test_imagefolder_tree_labels_from_folder_names(tmp_path, arrays):
    images, labels, _ = arrays
    for i, (img, lab) in enumerate(zip(images, labels)):
        folder = tmp_path / "tree" / f"class_{lab}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i}.png")
    env = _env(tmp_path, dataset=str(tmp_path / "tree"), partitioner="iid")
    _check_partitions(env, arrays)  # folder class_k got label k (sorted names)


def test_npz_arrays_need_no_extra(tmp_path, arrays):
    images, labels, _ = arrays
    np.savez(tmp_path / "set.npz", pixels=images, target=labels)
    env = _env(tmp_path, dataset=str(tmp_path / "set.npz"), partitioner="dirichlet")
    _check_partitions(env, arrays)
    with pytest.raises(ConfigError, match="data.label_column"):
        _ = _env(tmp_path, dataset=str(tmp_path / "set.npz"), label_column="nope").external


def test_a_bad_column_name_is_a_one_line_error(tmp_path, hf_dataset):
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match="data.label_column") as err:
        _ = _env(tmp_path, dataset=str(tmp_path / "saved"), label_column="nope").external
    assert "\n" not in str(err.value) and "fine" in str(err.value)


def test_no_network_gives_a_one_line_error(tmp_path):
    # a fresh process, as a user's: datasets reads its offline switches when it is imported
    code = (
        "from fedelastic.environment import RunEnvironment\n"
        "from fedelastic.scenario import parse_scenario\n"
        "raw = {'name': 'n', 'fleet': {'raspberry_pi_4': 2}, 'data': {'dataset': 'uoft-cs/cifar10', 'partitioner': 'iid'}}\n"
        "RunEnvironment(parse_scenario(raw, src='hub.toml')).data\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and last.startswith("fedelastic.errors.ConfigError: hub.toml: key 'data.dataset'")
    assert "uoft-cs/cifar10" in last and "local copy" in last and "HF_HUB_OFFLINE" in last


def test_an_unreachable_hub_fails_at_once_naming_hf_hub_offline(tmp_path, monkeypatch):
    import socket

    import flwr_datasets

    with socket.socket() as s:  # a local port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    built = []
    real = flwr_datasets.FederatedDataset
    monkeypatch.setattr(flwr_datasets, "FederatedDataset", lambda *a, **kw: built.append(1) or real(*a, **kw))
    with pytest.raises(ConfigError) as err:
        _ = _env(tmp_path, dataset="uoft-cs/cifar10", partitioner="iid").external
    assert err.value.key == "data.dataset" and "HF_HUB_OFFLINE=1" in str(err.value)
    assert f"127.0.0.1:{port} cannot be reached" in str(err.value) and "\n" not in str(err.value)
    assert built == []  # failed before Hugging Face's retries began


def test_other_processes_read_the_cached_partition_without_importing_datasets(tmp_path, hf_dataset):
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    env = _env(tmp_path, dataset=str(tmp_path / "saved"), partitioner="dirichlet")
    parts = env.data.partitions  # the driver partitions once
    code = (
        "import json, sys\n"
        "from fedelastic.environment import RunEnvironment\n"
        "from fedelastic.scenario import parse_scenario\n"
        f"raw = json.loads({json.dumps(json.dumps(env.scenario.to_dict()))})\n"
        "raw.pop('source')\n"
        f"env = RunEnvironment(parse_scenario(raw, src={str(tmp_path / 'scenario.toml')!r}))\n"
        "print(json.dumps([p.tolist() for p in env.data.partitions]))\n"
        "print(sorted(m for m in ('datasets', 'flwr_datasets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got, modules = out.stdout.strip().splitlines()[-2:]
    assert json.loads(got) == [p.tolist() for p in parts] and modules == "[]"
