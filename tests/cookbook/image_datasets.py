"""What the cookbook's vlm_classifier recipe downloads, in place the way an earlier (online) run
leaves it: a small synthetic image-classification dataset in caltech101's layout, written as
the prepared `datasets` cache entry of `dpdl-benchmark/caltech101`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from support import processes

CALTECH101 = "dpdl-benchmark/caltech101"

# Builds the dataset with datasets' own parquet builder (caltech101's features: an `image`
# column of PIL images, a `label` ClassLabel), in the folder an online load_dataset leaves:
# <cache>/dpdl-benchmark___caltech101/default/0.0.0/<revision>/. Offline, load_dataset then
# reads it ("Using the latest cached version of the dataset").
_SCRIPT = """
import json, shutil, sys
from pathlib import Path
import numpy as np
from PIL import Image
import datasets
from datasets import ClassLabel, Dataset, Features, config
from datasets.packaged_modules.parquet.parquet import Parquet
classes, per_class, test_rows, work = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
features = Features({"image": datasets.Image(), "label": ClassLabel(names=classes)})
rng = np.random.RandomState(0)
def rows(count):
    images, labels = [], []
    for i in range(count):
        label = i % len(classes)
        base = np.zeros((48, 64, 3), dtype=np.uint8)
        base[..., label % 3] = 80 + 60 * label  # each class its own colour, plus noise
        noisy = np.clip(base + rng.randint(0, 60, base.shape), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(noisy))
        labels.append(label)
    return Dataset.from_dict({"image": images, "label": labels}, features=features)
files = {}
for split, count in (("train", per_class * len(classes)), ("test", test_rows)):
    files[split] = str(work / f"{split}.parquet")
    rows(count).to_parquet(files[split])
builder = Parquet(dataset_name="caltech101", config_name="default", data_files=files,
                  features=features)
builder.download_and_prepare()
target = Path(config.HF_DATASETS_CACHE) / "dpdl-benchmark___caltech101" / "default" / "0.0.0" / ("0" * 40)
target.parent.mkdir(parents=True)
shutil.move(builder.cache_dir, target)
shutil.rmtree(Path(config.HF_DATASETS_CACHE) / "caltech101")
"""


def prefill_caltech101_cache(datasets_cache: Path, work: Path, classes: list[str],
                             per_class: int, test_rows: int) -> None:
    """The entry of `dpdl-benchmark/caltech101` in the datasets cache `datasets_cache` (a
    recipe's HF_DATASETS_CACHE) with `per_class` train images of each of `classes` and
    `test_rows` test images (in a child process: this process's `datasets` settings stay as
    they are)."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(datasets_cache), "HF_DATASETS_OFFLINE": "1"}
    processes.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(classes), str(per_class), str(test_rows),
         str(work)],
        check=True, env=env, capture_output=True,
    )
