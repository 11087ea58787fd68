"""The bundled 32x32 RGB sample grown to any number of distinct images, for the benchmarks.

Repeating the 1,280 images put exact copies into every chunk, which zstd finds: a tiled set of 16,384 stored
at ratio 6.02 where the 1,280 images themselves store at 5.65, and decoded faster than real data would. Each
copy after the first is instead augmented as CIFAR training is (4-pixel reflect padding, a crop, a horizontal
flip), every copy of an image with a crop and flip of its own, so no two images are the same.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAD = 4
VIEWS = (2 * PAD + 1) ** 2 * 2  # crops x flips; view 0 is the image itself


def image_stack(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct uint8 (32, 32, 3) images and their labels: the bundled ones, then augmented copies."""
    with h5py.File(ROOT / "sample_data/images.h5") as f:
        images, labels = f["images"][:], f["labels"][:]
    m = len(images)
    copies = -(-n // m)
    if copies > VIEWS:
        raise SystemExit(f"at most {VIEWS * m} distinct images from the sample, asked for {n}")
    rng = np.random.default_rng(seed)
    views = np.argsort(rng.random((m, VIEWS - 1)), axis=1) + 1  # per image, its copies' views: no repeats
    padded = np.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)), mode="reflect")
    out = [images]
    for copy in range(1, copies):
        view = views[:, copy - 1]
        flip, crop = view % 2, (view // 2 + PAD * (2 * PAD + 2)) % (2 * PAD + 1) ** 2  # crop 0: the centre
        dy, dx = crop // (2 * PAD + 1), crop % (2 * PAD + 1)
        rows = dy[:, None] + np.arange(32)
        cols = dx[:, None] + np.arange(32)
        cols = np.where(flip[:, None] == 1, cols[:, ::-1], cols)
        out.append(padded[np.arange(m)[:, None, None], rows[:, :, None], cols[:, None, :]])
    return np.concatenate(out)[:n], np.tile(labels, copies)[:n]
