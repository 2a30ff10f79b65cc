"""The papers' regime path of the accuracy scripts (``benchmarks/reproduce/sources.py``) on local stand-ins:
a Hugging Face dataset saved to disk and a state dict in torchvision's key layout. Nothing downloads."""

import json

import numpy as np
import pytest
import torch

from tests.support import ROOT, load_script
from tests.unit.train.test_imagenet_weights import TVMobileNetV2

pytest.importorskip("datasets")
SCRIPT = ROOT / "benchmarks" / "reproduce" / "elastictrainer_accuracy" / "run.py"
CLASSES, TRAIN, TEST = 4, 12, 5  # per class


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    import datasets
    from PIL import Image

    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)

    def split(n):
        labels = [c for c in range(CLASSES) for _ in range(n)]
        images = [Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)) for _ in labels]  # not square
        return datasets.Dataset.from_dict({"image": images, "label": labels}).cast_column("image", datasets.Image())

    folder = tmp_path / "hf_copy"
    datasets.DatasetDict({"train": split(TRAIN), "test": split(TEST)}).save_to_disk(str(folder))
    torch.manual_seed(0)
    weights = tmp_path / "mobilenet_v2-imagenet.pth"
    torch.save(TVMobileNetV2(1000).state_dict(), weights)  # ImageNet's 1,000-way head
    return folder, weights


def test_split_sizes_follow_the_dataset(stand_ins):
    sources = load_script(ROOT / "benchmarks" / "reproduce" / "sources.py", "reproduce_sources")
    d = sources.target_splits(str(stand_ins[0]), image_size=32)
    # 20% of each class's 12 training images held out: round(2.4) = 2 per class
    assert (len(d["tr_y"]), len(d["va_y"]), len(d["te_y"])) == (CLASSES * 10, CLASSES * 2, CLASSES * TEST)
    assert d["tr_x"].shape[1:] == (3, 32, 32) and sources.num_classes(d) == CLASSES
    assert np.bincount(d["va_y"]).tolist() == [2] * CLASSES


@pytest.mark.slow  # a real fine-tuning of MobileNetV2 (about 30 s on the shared host)
def test_the_paper_regime_command_runs_on_local_copies(stand_ins, tmp_path):
    folder, weights = stand_ins
    run = load_script(SCRIPT, "elastictrainer_accuracy_sources")
    out = tmp_path / "result.json"
    run.main(["--quick", "--device", "cpu", "--models", "mobilenetv2", "--dataset", str(folder), "--image-size", "32",
              "--weights", f"torchvision:{weights}", "--strategies", "full", "elastic_0.5", "--lrs", "0.01",
              "--seeds", "1", "--threads", "1", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    entry = doc["models"]["mobilenetv2"]
    assert entry["options"]["layout"] == "torchvision" and entry["options"]["num_classes"] == CLASSES
    assert doc["sizes"] == {"tr_y": 40, "va_y": 8, "te_y": 20}
    runs = entry["shifts"]["clean"]["runs"]
    assert [r["strategy"] for r in runs] == ["full", "elastic_0.5"] and all(0 <= r["accuracy"] <= 1 for r in runs)


def test_a_failed_download_and_a_dataset_without_weights_are_refused(stand_ins, tmp_path):
    run = load_script(SCRIPT, "elastictrainer_accuracy_refusals")
    with pytest.raises(SystemExit, match="--weights too"):
        run.main(["--dataset", str(stand_ins[0]), "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="download failed"):
        run.main(["--quick", "--device", "cpu", "--models", "mobilenetv2", "--dataset", str(stand_ins[0]),
                  "--image-size", "32", "--weights", "torchvision:http://127.0.0.1:9/w.pth", "--out", str(tmp_path / "r.json")])  # fmt: skip
