"""Selection logic and the cost model are pure Python/numpy: no torch, Flower or Ray."""

import subprocess
import sys


def test_cost_model_and_every_strategy_load_without_torch_flower_or_ray():
    code = (
        "import sys\n"
        "import fedelastic.costmodel, fedelastic.devices, fedelastic.selector, fedelastic.fit\n"
        "from fedelastic.selection import available\n"
        "assert len(available()) >= 9\n"
        "print(sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_clock_and_fleet_dynamics_load_without_torch_flower_or_ray():
    code = (
        "import sys\n"
        "import fedelastic.fl.clock, fedelastic.fleet, fedelastic.fl.aggregate\n"
        "print(sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
