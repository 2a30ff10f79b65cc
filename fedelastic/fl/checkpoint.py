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
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..errors import FedelasticError
from ..results import fresh
from .arrays import record_from_numpy, record_to_numpy
from .server import PartialFedAvg

CHECKPOINT = "checkpoint.pt"
# the server's own state besides the model: add new clock/state attributes of PartialFedAvg here
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


class Resumable(PartialFedAvg):
    """PartialFedAvg that checkpoints every round and can start from a checkpoint.

    Flower's loop always counts rounds from 1; a resumed run is shifted by ``offset``.
    """

    def __init__(self, env, node_of_partition, recorder, progress, *, checkpoint: dict | None = None):
        super().__init__(env, node_of_partition, recorder, progress)
        self.offset = 0
        self.resumed = checkpoint is not None
        self.client_states: dict[int, dict[str, np.ndarray]] = {}
        self._hand_back = False
        if checkpoint is not None:
            self.offset = int(checkpoint["round"])
            for key in SERVER_STATE:
                setattr(self, key, checkpoint["server"][key])
            self.client_states = {
                int(p): {k: v.numpy() for k, v in st.items()} for p, st in checkpoint["client_states"].items()
            }
            if "rng" in checkpoint:
                _set_rng_state(checkpoint["rng"])
            if "divergence" in checkpoint:  # the detector's references (a checkpoint from before them: fresh ones)
                self.detector.load_state(checkpoint["divergence"])
            self._hand_back = True

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        messages = list(super().configure_train(server_round + self.offset, arrays, config, grid))
        if not self._hand_back:
            return messages
        self._hand_back = False  # the nodes keep their state from now on, as in an uninterrupted run
        out = []
        for m in messages:
            state = self.client_states.get(self.partition_of_node[m.metadata.dst_node_id])
            if state is None:
                out.append(m)
                continue
            content = RecordDict({k: v for k, v in m.content.items()})
            content["strategy-state"] = record_from_numpy(state)
            out.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=m.metadata.dst_node_id))
        return out

    def aggregate_train(self, server_round: int, replies):
        replies = list(replies)
        for m in replies:
            if not m.has_error() and "strategy-state" in m.content:
                pid = int(m.content["metrics"]["partition-id"])
                self.client_states[pid] = record_to_numpy(m.content["strategy-state"])
        return super().aggregate_train(server_round + self.offset, replies)

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0 and self.resumed:
            return None  # the initial row is already on disk (also when the checkpoint is round 0's)
        return super().evaluate(server_round + self.offset, arrays)

    def keep_state(self, server_round: int, arrays: ArrayRecord) -> None:
        doc = {  # taken now; written after the round's rows (never ahead of them), perhaps behind
            "round": server_round,
            "model": _tensors(record_to_numpy(arrays)),
            "server": {key: getattr(self, key) for key in SERVER_STATE},
            "client_states": {p: _tensors(st) for p, st in self.client_states.items()},
            "rng": _rng_state(),
            "divergence": self.detector.state(),
        }
        self.recorder.write(lambda: save_checkpoint(self.recorder.folder, doc), newest_only=True)
