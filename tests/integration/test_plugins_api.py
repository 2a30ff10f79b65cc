"""The extension points share one shape: ``fedelastic.register_*`` for strategies, models, datasets,
server policies and aggregators; the same definition twice is harmless, anything else a ConfigError
naming the register function and the value; what a notebook registers reaches Ray's workers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from torch import nn

import fedelastic as fe
from fedelastic.data.registry import DATASETS
from fedelastic.errors import ConfigError
from fedelastic.models import BUILTIN, MODELS, build_model, user_entries
from fedelastic.plugins import adopt, registered, same_definition
from fedelastic.selection.strategy import REGISTRY, SelectionStrategy
from fedelastic.sim.aggregators import AGGREGATORS, Aggregator
from fedelastic.sim.policies import POLICIES, Policy


@pytest.fixture(autouse=True)
def tables():
    """Leaves every registry as it found it."""
    from fedelastic.selection.strategy import available

    available()  # the built-in strategies, loaded before the copy
    saved = [(t, dict(t)) for t in (REGISTRY, MODELS, DATASETS, POLICIES, AGGREGATORS)]
    yield
    for table, before in saved:
        table.clear()
        table.update(before)


def linear(num_classes: int = 10, in_channels: int = 1, input_size: int = 8) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size * input_size, num_classes))


def test_every_register_function_is_on_the_top_level_api_without_loading_torch():
    code = (
        "import sys, fedelastic as fe\n"
        "names = ['register_strategy', 'register_model', 'register_dataset', 'register_policy', 'register_aggregator']\n"
        "assert all(n in fe.__all__ for n in names)\n"
        "from fedelastic.sim.policies import Policy\n"
        "assert fe.Policy is Policy and fe.Aggregator.name == 'fedavg' and fe.SelectionStrategy.probe is None\n"
        "fe.register_policy, fe.register_aggregator, fe.register_strategy\n"
        "print(sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr  # server-side plug-ins need no torch


def test_register_model_takes_a_callable_a_string_or_decorates():
    fe.register_model("lin", linear)
    model = build_model("lin", num_classes=3, in_channels=1, input_size=4)
    assert model[1].weight.shape == (3, 16)  # by hand: 1 channel x 4 x 4 inputs, 3 classes

    @fe.register_model("lin2")
    def lin2(**kw):
        return linear(**kw)

    fe.register_model("lin2", lin2)  # a re-run cell: harmless
    fe.register_model("small", "fedelastic.models.small:small_cnn")
    assert user_entries() == {"lin": linear, "lin2": lin2, "small": "fedelastic.models.small:small_cnn"}
    BUILTIN["legacy"] = "fedelastic.models.small:mcu_net"  # the earlier way: the same table
    assert MODELS["legacy"] == "fedelastic.models.small:mcu_net" and "legacy" in user_entries()


@pytest.mark.parametrize(
    "register, value, key, expected",
    [
        (fe.register_model, 42, "m", "a callable or 'package.module:callable'"),
        (fe.register_model, "no_colon", "m", "a callable or 'package.module:callable'"),
        (fe.register_dataset, 42, "d", "a callable or 'package.module:callable'"),
    ],
)
def test_a_factory_that_is_not_one_is_refused_naming_the_function_and_value(register, value, key, expected):
    where = register.__name__
    with pytest.raises(ConfigError, match=rf"<{where}>: key '{key}': expected {expected}.*got {value!r}"):
        register(key, value)


def test_a_factory_name_another_factory_has_is_refused():
    fe.register_model("lin", linear)
    with pytest.raises(ConfigError, match=r"<register_model>: key 'name': expected a name not registered yet.*got 'lin'"):
        fe.register_model("lin", lambda **kw: linear(**kw))
    with pytest.raises(ConfigError, match=r"<register_model>: key 'name'.*'fedelastic.models.small:small_cnn' has.*got 'small_cnn'"):
        fe.register_model("small_cnn", linear)  # a built-in's name
    with pytest.raises(ConfigError, match=r"<register_model>: key 'name': expected a non-empty name without ':'"):
        fe.register_model("a:b", linear)
    assert MODELS["lin"] is linear and MODELS["small_cnn"] == "fedelastic.models.small:small_cnn"


class NoName(Policy):
    deadline = "optional"


class Late(Policy):
    name = "late"
    deadline = "sometimes"


class Shadow(Policy):
    name = "deadline_drop"


class NotAnAggregator:
    name = "mine"


class InheritsName(Aggregator):
    defaults = {"mu": 0.1}


class Stringly(Aggregator):
    name = "stringly"
    defaults = {"eta": "fast"}  # type: ignore[dict-item]


class Prox2(Aggregator):
    name = "fedprox"


class NoProbe(SelectionStrategy):
    name = "no_probe"
    probe = "gradients"  # type: ignore[assignment]


class Full2(SelectionStrategy):
    name = "full"


@pytest.mark.parametrize(
    "register, cls, pattern",
    [
        (fe.register_strategy, 42, r"<register_strategy>: key 'strategy': expected a subclass of .*SelectionStrategy, got 42"),
        (fe.register_strategy, NoProbe, r"<register_strategy>: key 'NoProbe.probe': expected None or one of .*got 'gradients'"),
        (fe.register_strategy, Full2, r"<register_strategy>: key 'Full2.name': expected a name not registered yet.*got 'full'"),
        (fe.register_policy, NotAnAggregator, r"<register_policy>: key 'class': expected a subclass of .*Policy, got <class"),
        (fe.register_policy, NoName, r"<register_policy>: key 'NoName.name': expected a non-empty string of its own \(the server.policy value\)$"),
        (fe.register_policy, Late, r"<register_policy>: key 'Late.deadline': expected one of .*got 'sometimes'"),
        (fe.register_policy, Shadow, r"<register_policy>: key 'Shadow.name': expected a name not registered yet \(.*DeadlineDrop has it\), got 'deadline_drop'"),
        (fe.register_aggregator, NotAnAggregator, r"<register_aggregator>: key 'class': expected a subclass of .*Aggregator, got <class"),
        (fe.register_aggregator, InheritsName, r"<register_aggregator>: key 'InheritsName.name': expected a non-empty string of its own"),
        (fe.register_aggregator, Stringly, r"<register_aggregator>: key 'Stringly.defaults': expected a dict of option name -> number, got \{'eta': 'fast'\}"),
        (fe.register_aggregator, Prox2, r"<register_aggregator>: key 'Prox2.name': expected a name not registered yet \(.*FedProx has it\), got 'fedprox'"),
    ],
)  # fmt: skip
def test_a_class_that_cannot_register_is_a_config_error_naming_the_function_and_value(register, cls, pattern):
    before = (dict(REGISTRY), dict(POLICIES), dict(AGGREGATORS))
    with pytest.raises(ConfigError, match=pattern):
        register(cls)
    assert (REGISTRY, POLICIES, AGGREGATORS) == before  # nothing half-registered


def _cell(source: str, name: str):
    """``name`` as a notebook cell defines it: run in a namespace of its own, in ``__main__``."""
    namespace: dict = {"__name__": "__main__", "Policy": Policy}
    exec(compile(source, f"<cell {len(source)}>", "exec"), namespace)  # noqa: S102 (a hand-written cell)
    return namespace[name]


def test_a_re_run_notebook_cell_re_registers_and_a_lambda_or_another_file_does_not():
    first = _cell("def blobs():\n    return 1\n", "blobs")
    edited = _cell("def blobs():\n    return 2  # edited\n", "blobs")  # Jupyter names the edited cell's file anew
    assert same_definition(first, edited)
    fe.register_dataset("nb", first)
    fe.register_dataset("nb", edited)
    assert DATASETS["nb"] is edited  # the latest definition
    assert not same_definition(_cell("f = lambda: 1\n", "f"), _cell("f = lambda: 1\n", "f"))
    assert not same_definition(linear, _cell("def linear():\n    pass\n", "linear"))  # another module

    policy = "class Mine(Policy):\n    name = 'mine'\n"
    fe.register_policy(_cell(policy, "Mine"))
    again = fe.register_policy(_cell(policy, "Mine"))
    assert POLICIES["mine"] is again


def test_registered_gathers_what_clients_use_and_adopt_keeps_names_already_known():
    class Mine(SelectionStrategy):
        name = "mine"

    fe.register_strategy(Mine)
    fe.register_model("lin", linear)
    fe.register_dataset("blobs", lambda: (np.zeros((4, 8, 8)), np.arange(4) % 2))

    @fe.register_policy
    class OnlyInDriver(Policy):
        name = "only_in_driver"

    carried = registered()
    assert set(carried) == {"strategies", "models", "datasets"}  # policies and aggregators run in the driver
    assert carried["strategies"]["mine"] is Mine and carried["models"]["lin"] is linear
    assert carried["datasets"]["blobs"] is DATASETS["blobs"] and "small_cnn" not in carried["models"]
    from ray import cloudpickle  # as Ray ships it: a test's local classes and functions by value

    shipped = cloudpickle.loads(cloudpickle.dumps(carried))
    for table, name in ((REGISTRY, "mine"), (MODELS, "lin"), (DATASETS, "blobs")):
        del table[name]
    MODELS["lin"] = "fedelastic.models.small:small_cnn"  # this process has its own 'lin'
    adopt(shipped)
    assert issubclass(REGISTRY["mine"], SelectionStrategy) and REGISTRY["mine"].name == "mine"
    assert MODELS["lin"] == "fedelastic.models.small:small_cnn"
    assert DATASETS["blobs"]()[1].tolist() == [0, 1, 0, 1]


def test_a_registered_policy_and_aggregator_run_in_process(make_scenario):
    @fe.register_policy
    class OneClient(Policy):  # one client per round
        name = "one_client"

        def sample_size(self, k, n):
            return 1

    @fe.register_aggregator
    class Keep(Aggregator):  # ignores every update: the global model stays the initial one
        name = "keep"

        def __call__(self, current, updates):
            return current

    sc = make_scenario(server={"rounds": 2, "policy": "one_client", "aggregator": "keep"}, train={"max_steps": 2})
    result = fe.run(sc, run_id="plugged")
    assert result.status["status"] == "completed"
    assert result.clients.groupby("round").size().tolist() == [1, 1]
    rounds = result.rounds
    assert rounds.test_accuracy.nunique() == 1 and rounds.test_loss.nunique() == 1  # rounds 0, 1, 2: one model


@pytest.mark.ray
def test_a_model_and_a_dataset_registered_in_a_test_reach_the_ray_workers(make_scenario):
    # both defined here, in the test's locals: the workers cannot import them, Ray ships them by value
    def two_blobs():
        x = np.concatenate([np.full((30, 6, 6), 0.1), np.full((30, 6, 6), 0.9)])
        return x, np.repeat([0, 1], 30)

    def tiny_linear(num_classes=10, in_channels=1, input_size=6):
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size * input_size, num_classes))

    fe.register_dataset("ray_blobs", two_blobs)
    fe.register_model("ray_linear", tiny_linear)
    sc = make_scenario(
        data={"dataset": "ray_blobs", "partitioner": "iid"}, model={"name": "ray_linear", "options": {}},
        server={"rounds": 1}, simulation={"backend": "ray", "num_cpus_per_client": 1},
    )  # fmt: skip
    assert sc.data.dataset == "ray_blobs"  # kept by name: the run carries the factory
    result = fe.run(sc, run_id="ray_plugged")
    assert json.loads((result.run_dir / "status.json").read_text())["status"] == "completed"
    clients = result.clients
    assert len(clients) == 4 and (clients.error.fillna("") == "").all()
    assert clients.fits.all() and (clients.steps == 1).all()  # by hand: 12 samples, batches of 16: one step an epoch
    # by hand: a stratified 20% test split keeps 6 of each class's 30; 48 training samples, iid over 4 clients
    assert sorted(clients.num_examples) == [12, 12, 12, 12]
