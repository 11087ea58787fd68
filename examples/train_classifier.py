"""Train a small CNN on the bundled image sample, reading batches straight from a dctchop store.

First compress the sample (1280 RGB 32x32 images in 10 classes, with labels)::

    dctchop compress sample_data/images.h5 images.zarr

then train (CPU is fine; ``--device cuda`` decodes on the GPU)::

    python examples/train_classifier.py images.zarr --epochs 5

The loader reads each compressed chunk once per epoch in a shuffled order, decodes in background threads
while the model trains, and hands over float32 NCHW batches normalised per channel.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import dctchop


def small_cnn(num_classes: int = 10) -> nn.Module:
    """Three conv blocks and a linear head: enough to learn the sample's 10 scene classes."""
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, num_classes))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", nargs="?", default="images.zarr", help="store made by dctchop compress")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default=None, help="e.g. cuda; default: the host (CPU)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.max_steps is not None and args.max_steps < 1:
        parser.error("--epochs and --max-steps must be at least 1")
    torch.manual_seed(0)

    # Per-channel statistics from the first 512 decoded images (the dataset view decodes lazily).
    images = dctchop.open(args.store)["images"][:512].astype("float32")
    mean, std = images.mean(axis=(0, 1, 2)), images.std(axis=(0, 1, 2))

    loader = dctchop.Loader(args.store, batch_size=args.batch_size, shuffle=True, seed=0,
                            output="torch", mean=mean, std=std, device=args.device)
    device = loader.device or torch.device("cpu")
    model = small_cnn().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)  # a new shuffled order each epoch
        model.train()
        seen = correct = 0
        total_loss = 0.0
        started = time.perf_counter()
        for step, (x, y) in enumerate(loader):  # x: float32 (B, 3, 32, 32), y: int64 (B,)
            if args.max_steps is not None and step >= args.max_steps:
                break
            y = y.to(device)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += y.numel()
            total_loss += loss.item() * y.numel()
            correct += (logits.argmax(1) == y).sum().item()
        seconds = time.perf_counter() - started
        print(f"epoch {epoch}: loss {total_loss / seen:.3f}  train accuracy {correct / seen:.1%}  "
              f"{seen / seconds:.0f} images/s")
    return {"loss": total_loss / seen, "accuracy": correct / seen, "samples": seen}


if __name__ == "__main__":
    main()
