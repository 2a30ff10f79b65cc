"""What fedelastic's own SGD (fedelastic/train/optim.py) saves against torch.optim: start-up and per step.

One command, two parts (``--parts``):

* ``step``: the optimizer's own cost per training step, ``zero_grad(set_to_none=True)`` plus
  ``step()`` on real gradients of the peers workload's CNN (6,218 parameters, 8 tensors) and of
  ``small_cnn(width=8)``, momentum 0 and 0.9: fedelastic's SGD against ``torch.optim.SGD``
  (single-tensor, as torch picks on CPU), in interleaved blocks, median microseconds per step.
  One thread; the gradients are set, not recomputed, so only the optimizer is timed.
* ``count``: one forward (batch 1) counted by ``describe()``'s FLOP counter
  (``modelinfo.flop_count_mode``) and by ``FlopCounterMode`` (``torch._dynamo`` already
  imported), and uncounted, interleaved, median milliseconds; the two counts must agree.
* ``fresh``: fresh processes, alternating a checkout of the code before (``--before DIR``, the
  same tree before fedelastic.train.optim) and this one, each timing (CPU and wall, by phase)
  (1) a Ray worker's start: imports, the cohort warm-up (data, model, model description) and the
  first optimizer step on the client model, as one cohort call starts it; (2) the peers
  workload run in-process (``fedelastic.run``, 200 clients, 10 rounds of 50), the whole process.
  Each child reports whether ``torch._dynamo`` was imported. A third arm, this checkout with
  ``import torch._dynamo`` right after ``import torch``, tells the import's share from the rest.

    python benchmarks/optim_cost.py --before /tmp/before --runs 5 --out benchmarks/results/optim_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

WORKER = r"""
import json, sys, tempfile, time
from types import SimpleNamespace
t = [(time.perf_counter(), time.process_time())]
import torch
torch.set_num_threads(1)
from fedelastic.api import load
from fedelastic.fl.cohort import warm_up
from fedelastic.environment import environment
from fedelastic.train.trainer import make_optimizer, ordered_params
sys.path.insert(0, {root!r})
from benchmarks.peers import Workload
t.append((time.perf_counter(), time.process_time()))
shape = SimpleNamespace(clients=200, rounds=10, per_round=50)
scenario = load(Workload.scenario(shape, "ray", tempfile.mkdtemp()))
warm_up(scenario)
t.append((time.perf_counter(), time.process_time()))
env = environment(scenario)
model, info = env.client_model, env.info
params = ordered_params(model, info)
opt = make_optimizer(params, "sgd", 0.05, 0.0, 0.0)
x = torch.randn(16, 1, 8, 8)  # the peers workload's sample shape
y = torch.zeros(16, dtype=torch.long)
opt.zero_grad(set_to_none=True)
torch.nn.functional.cross_entropy(model(x), y).backward()
opt.step()
t.append((time.perf_counter(), time.process_time()))
print(json.dumps({{"t": t, "dynamo": "torch._dynamo" in sys.modules}}))
"""

RUN = r"""
import json, sys, tempfile, time
t0 = (time.perf_counter(), time.process_time())
import torch
import fedelastic
sys.path.insert(0, {root!r})
from benchmarks.peers import Workload
from types import SimpleNamespace
shape = SimpleNamespace(clients=200, rounds=10, per_round=50)
result = fedelastic.run(Workload.scenario(shape, "inprocess", tempfile.mkdtemp()))
t1 = (time.perf_counter(), time.process_time())
print(json.dumps({{"t": [t0, t1], "dynamo": "torch._dynamo" in sys.modules, "status": result.status.get("status")}}))
"""


def child(code: str, tree: Path, dynamo: bool = False) -> dict:
    if dynamo:  # the control: this tree with torch._dynamo imported first, as torch.optim did
        code = code.replace("import torch\n", "import torch\nimport torch._dynamo\n", 1)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree, env=env, check=True)
    wall = time.perf_counter() - start
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["process_wall_s"] = wall
    return got


def fresh(before: Path, runs: int) -> dict:
    trees = {"before": before, "after": ROOT, "after + import torch._dynamo": ROOT}
    rows: dict[str, dict[str, list]] = {k: {"worker": [], "run": []} for k in trees}
    for i in range(runs):
        for name in trees if i % 2 == 0 else reversed(list(trees)):  # alternate who goes first
            tree, dynamo = trees[name], name.endswith("_dynamo")
            w = child(WORKER.format(root=str(tree)), tree, dynamo)
            t = w["t"]
            rows[name]["worker"].append({
                "imports_wall_s": t[1][0] - t[0][0], "imports_cpu_s": t[1][1] - t[0][1],
                "warm_up_wall_s": t[2][0] - t[1][0], "warm_up_cpu_s": t[2][1] - t[1][1],
                "first_step_wall_s": t[3][0] - t[2][0], "first_step_cpu_s": t[3][1] - t[2][1],
                "total_wall_s": t[3][0] - t[0][0], "total_cpu_s": t[3][1] - t[0][1],
                "process_wall_s": w["process_wall_s"], "dynamo": w["dynamo"],
            })  # fmt: skip
            r = child(RUN.format(root=str(tree)), tree, dynamo)
            t = r["t"]
            rows[name]["run"].append({
                "run_wall_s": t[1][0] - t[0][0], "run_cpu_s": t[1][1] - t[0][1],
                "process_wall_s": r["process_wall_s"], "dynamo": r["dynamo"], "status": r["status"],
            })  # fmt: skip
            print(f"run {i + 1} {name}: worker {rows[name]['worker'][-1]['total_cpu_s']:.2f} s CPU, "
                  f"in-process run {rows[name]['run'][-1]['process_wall_s']:.2f} s wall", flush=True)  # fmt: skip
    med = {
        name: {part: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
               for part, rs in parts.items()}
        for name, parts in rows.items()
    }  # fmt: skip
    for name, parts in rows.items():
        for part, rs in parts.items():
            med[name][part]["dynamo_imported"] = sorted({r["dynamo"] for r in rs})
    return {"runs": rows, "medians": med}


def step_costs(repeats: int, block: int) -> dict:
    import torch
    from torch import nn

    from fedelastic.models.small import small_cnn
    from fedelastic.train.optim import SGD

    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import cnn

    torch.set_num_threads(1)
    out: dict = {}
    for model_name, factory in (("peers cnn", cnn), ("small_cnn(width=8)", lambda: small_cnn(width=8))):
        for momentum in (0.0, 0.9):
            torch.manual_seed(0)
            model = factory()
            nn.functional.cross_entropy(model(torch.randn(16, 1, 8, 8)), torch.zeros(16, dtype=torch.long)).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            params = list(model.parameters())
            opts = {
                "fedelastic": SGD(params, lr=1e-6, momentum=momentum),
                "torch": torch.optim.SGD(params, lr=1e-6, momentum=momentum),
            }
            times: dict[str, list[float]] = {k: [] for k in opts}
            for _ in range(repeats):
                for name, opt in opts.items():
                    start = time.perf_counter()
                    for _ in range(block):
                        opt.zero_grad(set_to_none=True)
                        for p, g in zip(params, grads):
                            p.grad = g
                        opt.step()
                    times[name].append((time.perf_counter() - start) / block * 1e6)
            # the grad assignment alone, subtracted
            start = time.perf_counter()
            for _ in range(block):
                for p, g in zip(params, grads):
                    p.grad = g
            base = (time.perf_counter() - start) / block * 1e6
            key = f"{model_name}, momentum {momentum}"
            out[key] = {name: statistics.median(ts) - base for name, ts in times.items()}
            out[key]["tensors"] = len(params)
            print(f"{key}: fedelastic {out[key]['fedelastic']:.1f} us, torch {out[key]['torch']:.1f} us a step",
                  flush=True)  # fmt: skip
    return out


def count_costs(repeats: int) -> dict:
    """Milliseconds of one counted forward (batch 1): fedelastic's flop_count_mode against FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fedelastic.modelinfo import flop_count_mode
    from fedelastic.models import build_with_input

    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import cnn

    torch.set_num_threads(1)
    out: dict = {}
    models = {"peers cnn": (cnn(), (1, 8, 8))}
    for name, size in (("mobilenetv2", 32), ("vit_tiny", 32)):
        models[name] = build_with_input(name, num_classes=10, input_size=size)
    for name, (model, shape) in models.items():
        model.eval()
        sample = torch.zeros(1, *shape)
        times: dict[str, list[float]] = {"fedelastic": [], "FlopCounterMode": [], "no counter": []}
        flops = {}
        for _ in range(repeats):
            for kind in times:
                counter = {"fedelastic": flop_count_mode, "FlopCounterMode": lambda: FlopCounterMode(display=False)}
                mode = counter[kind]() if kind in counter else None
                start = time.perf_counter()
                with torch.no_grad():
                    if mode is None:
                        model(sample)
                    else:
                        with mode:
                            model(sample)
                times[kind].append((time.perf_counter() - start) * 1e3)
                if mode is not None:
                    flops[kind] = mode.flops if kind == "fedelastic" else mode.get_total_flops()
        out[name] = {k: statistics.median(v) for k, v in times.items()} | {"flops": flops}
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out[name].items() if k != "flops") + f"; {flops}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("step", "count", "fresh"), default=["step", "count", "fresh"])
    p.add_argument("--before", type=Path, help="a checkout of the code before fedelastic.train.optim (for 'fresh')")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per checkout and kind (alternating)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved blocks per optimizer (step)")
    p.add_argument("--block", type=int, default=400, help="steps per block (step)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()}
    if "step" in args.parts:
        result["step_us"] = step_costs(args.repeats, args.block)
    if "count" in args.parts:
        result["count_ms"] = count_costs(args.repeats)
    if "fresh" in args.parts:
        if args.before is None:
            p.error("--before DIR is needed for the 'fresh' part")
        result["fresh"] = fresh(args.before.resolve(), args.runs)
        print(json.dumps(result["fresh"]["medians"], indent=1))
    result["load_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
