"""Selection logic and the cost model are pure Python/numpy: no torch, Flower or Ray."""

import subprocess
import sys


def test_cost_model_and_every_strategy_load_without_torch_flower_or_ray():
    code = (
        "import sys\n"
        "import fedelastic.cost.costmodel, fedelastic.cost.kernels, fedelastic.devices.profile, fedelastic.selection.budgeted, fedelastic.profiling.roofline_fit\n"
        "from fedelastic.selection.strategy import available\n"
        "assert len(available()) >= 9\n"
        "print(sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_central_pretraining_and_the_data_layer_load_without_flower_or_ray():
    # layering: evaluation lives with training, partitioning with the data
    code = (
        "import sys\n"
        "import fedelastic.train.pretrain, fedelastic.train.trainer, fedelastic.data, fedelastic.results.continual\n"
        "from fedelastic.train.trainer import evaluate_model\n"
        "from fedelastic.data import partition\n"
        "import numpy as np, torch\n"
        "m = torch.nn.Linear(2, 2); m.weight.data = torch.eye(2); m.bias.data.zero_()\n"
        "x = np.array([[1, 0], [0, 1], [1, 0]], np.float32); y = np.array([0, 1, 1])\n"
        "assert evaluate_model(m, x, y)[0] == 2 / 3  # by hand: rows 0, 1 right, row 2 wrong\n"
        "from fedelastic.train.trainer import evaluate_predictions\n"
        "assert evaluate_predictions(m, x, y)[2].tolist() == [2, 1]  # predicted: class 0 twice, class 1 once\n"
        "assert sorted(map(len, partition(np.arange(10) % 2, 2, 'iid', 0))) == [5, 5]\n"
        "print(sorted(m for m in ('flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_round_engine_and_fleet_dynamics_load_without_torch_flower_or_ray():
    code = (
        "import sys\n"
        "import fedelastic.sim.divergence, pkgutil, importlib, fedelastic.sim as sim\n"
        "for m in pkgutil.iter_modules(sim.__path__): importlib.import_module('fedelastic.sim.' + m.name)\n"
        "print(sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
