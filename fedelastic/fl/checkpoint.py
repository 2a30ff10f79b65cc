"""Per-round checkpoints, and resuming a killed run from its last finished round.

After every round (and after the initial evaluation) a checkpoint is taken: the round number,
the global model, the server's clock and energy totals, every node's strategy state (e.g.
static_elastic's fixed selection) and the process's RNG states. It replaces the run folder's
``checkpoint.pt`` atomically, after that round's rows are written (of the rounds written together,
``simulation.write_every_s``, the newest). It holds only tensors, numbers and strings, and is
read with ``torch.load(weights_only=True)``.

Every client is seeded by (seed, round, partition) and sampling by (seed, round), so a resumed
run from the checkpoint of round k reproduces rounds k+1.. exactly.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from ..errors import FedelasticError
from ..results.recorder import fresh
from ..sim.callbacks import Callback, RoundEnd

CHECKPOINT = "checkpoint.pt"
# the server's own state besides the model: add new clock/state attributes of the server strategy here
SERVER_STATE = ("sim_time_s", "total_energy_j")


def _tensors(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (the legacy global RNG a user model may use)
    return {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": [list(part) if isinstance(part, tuple) else part for part in random.getstate()],
    }


def _set_rng_state(doc: dict) -> None:
    torch.set_rng_state(doc["torch"])
    kind, keys, pos, has_gauss, cached = doc["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    version, internal, gauss = doc["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(folder: Path, doc: dict) -> None:
    path = folder / CHECKPOINT
    tmp = fresh(folder / (CHECKPOINT + ".tmp"))  # a link planted there is removed, not written through
    try:
        with tmp.open("wb") as fh:
            torch.save(doc, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(folder: Path) -> dict:
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise FedelasticError(f"{path}: no checkpoint to resume from (the run died before its first evaluation)")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many kinds; all mean 'unusable')
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FedelasticError(f"{path}: not a readable checkpoint ({first})") from None
    if not isinstance(doc, dict) or {"round", "model", "server", "client_states"} - set(doc):
        raise FedelasticError(f"{path}: not a fedelastic checkpoint")
    return doc


def restore(run, checkpoint: dict) -> None:
    """Put the server strategy ``run`` where ``checkpoint`` left it: rounds shifted by its round, the
    clock and totals, every node's strategy state (handed back with the next round), the RNGs and
    the divergence detector."""
    run.offset = int(checkpoint["round"])
    run.resumed = True
    for key in SERVER_STATE:
        setattr(run, key, checkpoint["server"][key])
    run.client_states = {int(p): {k: v.numpy() for k, v in st.items()} for p, st in checkpoint["client_states"].items()}
    if "rng" in checkpoint:
        _set_rng_state(checkpoint["rng"])
    if "divergence" in checkpoint:  # the detector's references (a checkpoint from before them: fresh ones)
        run.detector.load_state(checkpoint["divergence"])
    if "aggregator" in checkpoint:  # a server optimizer's moments
        run.aggregator.load_state({k: v.numpy() for k, v in checkpoint["aggregator"].items()})
    run.hand_back = True


class Checkpointer(Callback):
    """Takes a checkpoint after every round (written after the round's rows, perhaps behind);
    resumes from ``checkpoint`` (a loaded one) at the run's start."""

    def __init__(self, recorder, checkpoint: dict | None = None):
        self.recorder, self.checkpoint = recorder, checkpoint

    def on_run_start(self, run) -> None:
        if self.checkpoint is not None:
            restore(run, self.checkpoint)

    def on_round_end(self, end: RoundEnd) -> bool:
        run = end.run
        doc = {  # taken now; written after the round's rows (never ahead of them), perhaps behind
            "round": end.round,
            "model": _tensors(end.weights()),
            "server": {key: getattr(run, key) for key in SERVER_STATE},
            "client_states": {p: _tensors(st) for p, st in run.client_states.items()},
            "rng": _rng_state(),
            "divergence": run.detector.state(),
        }
        aggregator = run.aggregator.state()
        if aggregator:
            doc["aggregator"] = _tensors(aggregator)
        self.recorder.write(lambda: save_checkpoint(self.recorder.folder, doc), newest_only=True)
        return False
