"""dctchop: blockwise-DCT compression of tensors into Zarr stores."""

from dctchop._version import __version__

# `open` is left out of __all__ so that `from dctchop import *` never shadows the builtin open().
__all__ = ["Loader", "TorchDataset", "__version__"]

# Imported on first use, so `import dctchop` stays cheap (no zarr, numba or torch until needed).
_LAZY = {"open": "dctchop.dataset", "Loader": "dctchop.loader", "TorchDataset": "dctchop.torch_decode"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        if name == "TorchDataset":
            from dctchop.loader import require_torch

            require_torch()
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dctchop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
