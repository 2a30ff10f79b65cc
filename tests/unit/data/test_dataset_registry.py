"""The dataset plug-in point: built-in entries, a dataset registered in-process, module and file
factories, and errors that name the file and the key."""

from __future__ import annotations

import numpy as np
import pytest

import fedelastic
from fedelastic.data import DATASETS, load_dataset, load_digits_dataset, register_dataset
from fedelastic.data.registry import user_datasets
from fedelastic.errors import ConfigError
from fedelastic.scenario import parse_scenario
from tests.support import small_scenario_dict


def two_blobs(n_per_class: int = 30):
    """Class 0: dark 6x6 images, class 1: bright ones (hand-built, (N, H, W): one channel)."""
    x = np.concatenate([np.full((n_per_class, 6, 6), 0.1), np.full((n_per_class, 6, 6), 0.9)])
    y = np.repeat([0, 1], n_per_class)
    return x, y


@pytest.fixture
def registry():
    """Leaves DATASETS as it found it."""
    before = dict(DATASETS)
    yield DATASETS
    DATASETS.clear()
    DATASETS.update(before)


def test_the_built_ins_are_registry_entries():
    assert {"digits", "synth_digits"} <= set(DATASETS)
    assert load_dataset("digits") is load_digits_dataset()  # the entry is the loader itself, no copy
    assert user_datasets() == {}


def test_a_dataset_registered_in_process_runs_a_scenario(tmp_path, registry):
    fedelastic.register_dataset("blobs", two_blobs)
    raw = small_scenario_dict(tmp_path, data={"dataset": "blobs", "partitioner": "iid"})  # 4 clients
    raw["model"] = {"name": "small_cnn", "options": {"width": 4}}
    result = fedelastic.run(raw, run_id="blobs")
    assert result.status["status"] == "completed"
    clients = result.clients
    # by hand: a stratified 20% test split keeps round(30 * 0.2) = 6 of each class, 48 samples train,
    # split iid into four partitions of 12
    assert sorted(clients[clients["round"] == 1].num_examples) == [12, 12, 12, 12]
    assert (result.rounds["round"] == [0, 1, 2]).all()


def test_register_as_a_decorator_and_the_same_factory_twice(registry):
    @register_dataset("blobs")
    def blobs():
        return two_blobs(4)

    register_dataset("blobs", blobs)  # a re-run cell: harmless
    assert load_dataset("blobs").x.shape == (8, 1, 6, 6)
    assert load_dataset("blobs").x.dtype == np.float32 and load_dataset("blobs").y.dtype == np.int64
    assert user_datasets() == {"blobs": blobs}


def test_a_taken_name_is_refused(registry):
    with pytest.raises(ConfigError, match=r"key 'name': expected a name not registered yet.*got 'digits'"):
        register_dataset("digits", two_blobs)
    with pytest.raises(ConfigError, match="a callable or 'package.module:callable'"):
        register_dataset("blobs", 42)


@pytest.mark.parametrize(
    "out, what",
    [
        ([1, 2], "an ArrayDataset or \\(x, y\\), not list"),
        ((np.zeros((4, 6)), np.zeros(4, int)), "images of shape \\(N, C, H, W\\)"),
        ((np.zeros((4, 6, 6)), np.zeros(3, int)), "one label per image"),
        ((np.zeros((4, 6, 6)), np.zeros(4)), "integer labels from 0"),
        ((np.zeros((4, 6, 6)), -np.ones(4, int)), "integer labels from 0"),
    ],
)
def test_a_factory_returning_something_else_is_an_error_naming_the_key(tmp_path, registry, out, what):
    register_dataset("bad", lambda: out)
    with pytest.raises(ConfigError, match=f"tiny.toml: key 'data.dataset': expected a factory returning {what}"):
        load_dataset("bad", src=str(tmp_path / "tiny.toml"))


def test_a_factory_file_next_to_the_scenario(tmp_path, registry):
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def blobs():\n"
        "    return np.zeros((10, 2, 3, 3)), np.arange(10) % 2\n"
    )  # fmt: skip
    src = tmp_path / "tiny.toml"
    src.write_text("")
    sc = parse_scenario(small_scenario_dict(tmp_path, data={"dataset": "mydata.py:blobs"}), src=str(src))
    assert sc.data.dataset == f"{tmp_path / 'mydata.py'}:blobs"  # absolute: Ray's workers and a resume find it
    ds = load_dataset(sc.data.dataset)
    assert ds.x.shape == (10, 2, 3, 3) and ds.y.tolist() == [0, 1] * 5
    register_dataset("viafile", "mydata.py:blobs")  # an entry naming the file: kept in-process, the path for Ray
    raw = small_scenario_dict(tmp_path, data={"dataset": "viafile"})
    assert parse_scenario(raw, src=str(src)).data.dataset == "viafile"
    raw["simulation"] = {"backend": "ray"}
    assert parse_scenario(raw, src=str(src)).data.dataset == f"{tmp_path / 'mydata.py'}:blobs"


@pytest.mark.parametrize(
    "name, what",
    [
        ("nowhere.py:blobs", "an existing Python file for 'file.py:callable'"),
        ("fedelastic.no_such_module:blobs", "an importable factory 'package.module:callable'"),
        ("numpy:pi", "a callable returning a dataset"),
    ],
)
def test_a_factory_that_cannot_be_found_is_an_error_naming_the_file_and_key(tmp_path, name, what):
    src = str(tmp_path / "tiny.toml")
    with pytest.raises(ConfigError, match=f"tiny.toml: key 'data.dataset': expected {what}"):
        parse_scenario(small_scenario_dict(tmp_path, data={"dataset": name}), src=src)


def test_a_registered_dataset_is_partitioned_like_a_built_in(tmp_path, registry):
    register_dataset("blobs", two_blobs)
    src = str(tmp_path / "tiny.toml")
    with pytest.raises(ConfigError, match="key 'data.partitioner': expected iid, dirichlet or shards"):
        parse_scenario(small_scenario_dict(tmp_path, data={"dataset": "blobs", "partitioner": "pathological"}), src=src)


def test_for_ray_a_registered_function_is_named_by_its_module_and_a_closure_by_its_name(tmp_path, registry):
    register_dataset("blobs", two_blobs)
    ray = small_scenario_dict(tmp_path, data={"dataset": "blobs"}, simulation={"backend": "ray"})
    sc = parse_scenario(ray, src=str(tmp_path / "tiny.toml"))
    assert sc.data.dataset == f"{__name__}:two_blobs"  # what Ray's workers import
    register_dataset("inner", lambda: two_blobs(3))
    ray["data"] = {"dataset": "inner"}
    assert parse_scenario(ray, src=str(tmp_path / "tiny.toml")).data.dataset == "inner"  # the run carries it
