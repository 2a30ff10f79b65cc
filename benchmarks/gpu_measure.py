"""Measure the project models on a CUDA GPU: per-layer tables, real selection steps, elastic_layer vs elastic_tensor.

    python benchmarks/gpu_measure.py --out DIR [--models resnet50 mobilenetv2 vit_b16]
        [--batches 1 2 4 8 16 32 64] [--selections 30] [--budget-s 540]

Runs on a machine with a CUDA GPU (``--device cpu`` runs the same code on the CPU, for testing).
Writes one JSON file per model, ``DIR/gpu_<model>.json``, rewritten after every batch size so
that nothing finished is lost, and ``DIR/gpu_env.json`` (GPU, torch, TF32 flags, measured peak
and copy bandwidth). ``benchmarks/fidelity.py`` reads these files (kept under
``benchmarks/data/h100/``) to fit and test the cost model without a GPU.

Per model (224x224 input, 200 classes, as the TX2 traces) and batch size:

1. ``table``: :func:`fedelastic.profiling.measure.measure_layers` with the ``cuda`` clock (every time
   stamp is a device synchronisation, so per-layer times include each layer's launch gaps);
2. ``full``: the real step time of full training without hooks (median of timed steps, one
   synchronisation per step), the training forward and the inference forward;
3. ``selections``: ``--selections`` random 0/1 tensor masks (full training first), each applied as
   the trainer applies it (``requires_grad`` per tensor, untrained batch norms in eval mode),
   real step time = forward + cross-entropy + backward + SGD-momentum step;
4. ``elastic``: importance ``sum(g^2)`` per tensor from one full backward (the importance probe's
   ``-g . dw`` for an SGD step, up to the learning rate); for several ``rho`` the selections of
   ``elastic_tensor`` and ``elastic_layer`` (exact solver) priced by the cost model with this
   batch's measured table, i.e. at equal predicted time, then both timed for real. With
   ``--elastic-kernels``, only this experiment runs, priced instead by the given kernel classes
   (e.g. those fitted on the other two models: what a model without a table gets).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fidelity import random_selections  # noqa: E402  (the same selections as the host benchmark)

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import Quantity, load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input  # noqa: E402
from fedelastic.profiling.measure import measure_layers  # noqa: E402
from fedelastic.selection.strategy import SelectionContext  # noqa: E402

MODELS = ("resnet50", "mobilenetv2", "vit_b16")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
RHOS = (0.4, 0.6, 0.8)
_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def apply_selection(model, info, ratios) -> list[torch.nn.Parameter]:
    """What the trainer does: requires_grad per tensor; untrained batch norms in eval mode."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    model.train()
    for name, r in zip(info.tensor_names, ratios):
        params[name].requires_grad_(bool(r > 0))
    for layer in info.layers:
        if isinstance(modules[layer.name], _NORMS):
            modules[layer.name].train(any(ratios[k] > 0 for k in layer.tensors))
    return [params[n] for n, r in zip(info.tensor_names, ratios) if r > 0]


def timed_steps(model, info, x, y, ratios, timed: int, warmup: int) -> dict[str, float]:
    """Median real step (and its forward + loss) of a selection; one synchronisation per stamp."""
    trained = apply_selection(model, info, ratios)
    opt = torch.optim.SGD(trained, lr=1e-12, momentum=0.9)
    steps, fwds = [], []
    for i in range(warmup + timed):
        sync(x.device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        sync(x.device)
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        sync(x.device)
        t2 = time.perf_counter()
        if i >= warmup:
            steps.append(t2 - t0)
            fwds.append(t1 - t0)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    return {"step_s": float(np.median(steps)), "forward_s": float(np.median(fwds)), "spread": float(np.std(steps))}


def inference_forward(model, x, repeats: int) -> float:
    model.eval()
    out = []
    with torch.no_grad():
        model(x)
        for _ in range(repeats):
            sync(x.device)
            t0 = time.perf_counter()
            model(x)
            sync(x.device)
            out.append(time.perf_counter() - t0)
    model.train()
    return float(np.median(out))


def importance(model, info, x, y) -> np.ndarray:
    """``sum(g^2)`` per tensor from one full backward (the importance probe of an SGD step, up to lr)."""
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    torch.nn.functional.cross_entropy(model(x), y).backward()
    params = dict(model.named_parameters())
    out = np.array([float((params[n].grad.double() ** 2).sum()) for n in info.tensor_names])
    for p in model.parameters():
        p.grad = None
    return out


def gpu_device_profile(env: dict, table=None, model: str = "", kernels: dict | None = None):
    """The TX2 profile's schema with this machine's peak and bandwidth (memory unbounded), and either
    ``table`` as the measured table of ``model`` or ``kernels`` (class -> P, B, overhead, width) as its kernel classes."""
    from fedelastic.profiling.roofline_fit import kernel_device

    base = dataclasses.replace(
        load_profile(ROOT / "device_profiles" / "jetson_tx2.toml"),
        name="gpu",
        memory_train_bytes=Quantity(1e12, "unbounded for this experiment"),
        peak_flops=Quantity(env["peak_fp32_flops"], env["peak_fp32_how"]),
        mem_bandwidth_bytes_per_s=Quantity(env["copy_bandwidth_bytes_per_s"], "measured copy bandwidth"),
        launch_overhead_s=Quantity(5e-6, "typical CUDA launch"),
        measured={},
        kernels={},
        uncertainty=None,
    )
    if kernels is not None:
        return kernel_device(base, {c: tuple(v) for c, v in kernels.items()})
    return dataclasses.replace(base, measured={model: table})


def elastic(model, info, x, y, device, timed: int, warmup: int) -> list[dict]:
    import strategies  # noqa: F401  (registers the strategies)
    from fedelastic.strategies.budget import ElasticConfig
    from strategies.elastic_layer import ElasticLayer
    from strategies.elastic_tensor import ElasticTensor

    imp = importance(model, info, x, y)
    cost = CostModel(info, device, int(x.shape[0]))
    rows = []
    for rho in RHOS:
        ctx = SelectionContext(info=info, cost=cost, step=0, rng=np.random.default_rng(0), importance=imp)
        for cls in (ElasticTensor, ElasticLayer):
            sel = cls(ElasticConfig(rho=rho)).select(ctx)
            ratios = sel.ratios
            real = timed_steps(model, info, x, y, ratios, timed, warmup) if ratios.any() else None
            rows.append(
                {
                    "strategy": cls.name,
                    "rho": rho,
                    "selected": [int(k) for k in np.flatnonzero(ratios)],
                    "layers": len({int(info.tensor_layer[k]) for k in np.flatnonzero(ratios)}),
                    "importance": float(imp @ (ratios > 0)),
                    "pred_step_s": cost.step_time_s(ratios),
                    "pred_full_s": cost.full_step_time_s(),
                    "real": real,
                }
            )
    return rows


def table_json(table) -> dict:
    return {
        "batch_size": table.batch_size,
        "source": table.source,
        "step_s": table.step_s,
        "forward_s": table.forward_s,
        "backward_s": table.backward_s,
        "other_s": table.other_s,
        "unattributed_fwd_s": table.unattributed_fwd_s,
        "unattributed_bwd_s": table.unattributed_bwd_s,
        "layers": {n: [t.fwd_s, t.dx_s, t.dw_s] for n, t in table.layers.items()},
    }


def environment(device: torch.device) -> dict:
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "torch": torch.__version__,
        "device": str(device),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_bytes=p.total_memory)
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t0)
    env["peak_fp32_flops"] = 2.0 * n**3 / float(np.median(times))
    env["peak_fp32_how"] = f"torch.mm {n}x{n} fp32 (allow_tf32 as above), median of 10"
    big = torch.empty(int(2.5e8 if device.type == "cuda" else 2.5e6), device=device)
    dst = torch.empty_like(big)
    dst.copy_(big)
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(big)
        sync(device)
        times.append(time.perf_counter() - t0)
    env["copy_bandwidth_bytes_per_s"] = 2.0 * big.numel() * 4 / float(np.median(times))
    del a, b, big, dst
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    parser.add_argument(
        "--elastic-batches", nargs="*", type=int, help="batch sizes of the elastic experiment (default: all)"
    )
    parser.add_argument("--selections", type=int, default=30)
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip what is left after this many seconds")
    parser.add_argument(
        "--no-tf32", action="store_true", help="cuDNN convolutions in full fp32 (torch's default is TF32)"
    )
    parser.add_argument("--tag", default="", help="suffix of the output files: gpu_<model>_<tag>.json")
    parser.add_argument(
        "--elastic-kernels",
        type=Path,
        help="JSON {model: {class: [P, B, overhead, width]}}: only the elastic experiment, priced by these kernel classes",
    )
    args = parser.parse_args()
    kernels = json.loads(args.elastic_kernels.read_text()) if args.elastic_kernels else None
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    suffix = f"_{args.tag}" if args.tag else ""
    (args.out / f"gpu_env{suffix}.json").write_text(json.dumps(env, indent=1))
    log(f"env: {env}")
    clock = "cuda" if device.type == "cuda" else "wall"
    for name in args.models:
        torch.manual_seed(0)
        model, shape = build_with_input(name, num_classes=args.num_classes, input_size=args.input_size)
        model.to(device)
        info = describe(model, torch.zeros(1, *shape, device=device), model_name=name)
        rng = np.random.default_rng(0)
        sels = random_selections(info.num_tensors, args.selections, rng)
        res: dict = {
            "model": name,
            "input": list(shape),
            "num_classes": args.num_classes,
            "env": env,
            "selections": [[int(k) for k in np.flatnonzero(s)] for s in sels],
            "batches": {},
        }
        path = args.out / f"gpu_{name}{suffix}.json"
        for b in args.batches:
            if time.perf_counter() - start > args.budget_s:
                log(f"budget spent: {name} batch {b} and later skipped")
                res.setdefault("skipped", []).append(b)
                continue
            x = torch.randn(b, *shape, device=device)
            y = torch.randint(0, args.num_classes, (b,), device=device)
            row: dict = {}
            if kernels is not None:  # only the elastic experiment, priced by the given kernel classes
                dev = gpu_device_profile(env, kernels=kernels[name])
                row["elastic"] = elastic(model, info, x, y, dev, 7, 2)
                row["full"] = timed_steps(model, info, x, y, np.ones(info.num_tensors), timed=10, warmup=3)
                res["batches"][str(b)] = row
                path.write_text(json.dumps(res, indent=1))
                log(f"{name} batch {b}: elastic (kernel classes) done")
                continue
            table = measure_layers(
                model, x, target=y, model_name=name, repeats=args.repeats, warmup=2, clock=clock, source="gpu"
            )
            row["table"] = table_json(table)
            full = timed_steps(model, info, x, y, np.ones(info.num_tensors), timed=10, warmup=3)
            row["full"] = {**full, "inference_forward_s": inference_forward(model, x, 10)}
            row["selection_real_s"] = [timed_steps(model, info, x, y, s, timed=3, warmup=1)["step_s"] for s in sels]
            if args.elastic_batches is None or b in args.elastic_batches:
                row["elastic"] = elastic(model, info, x, y, gpu_device_profile(env, table, name), 7, 2)
            res["batches"][str(b)] = row
            path.write_text(json.dumps(res, indent=1))
            log(
                f"{name} batch {b}: table step {table.step_s * 1e3:.2f} ms, real full step "
                f"{full['step_s'] * 1e3:.2f} ms, fwd {full['forward_s'] * 1e3:.2f} ms"
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
