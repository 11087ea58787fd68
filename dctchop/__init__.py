"""dctchop: blockwise-DCT compression of tensors into Zarr stores."""

import importlib
import importlib.util
import os
import threading

from dctchop._version import __version__
from dctchop.errors import DctchopError

# Imported on first use, so `import dctchop` stays cheap (no zarr, numba or torch until needed). One thread at
# a time: zarr's modules import one another in a cycle, and two threads importing two of them at once (a first
# Loader in one, a first TorchDataset in the other) failed with Python's _DeadlockError.
_LAZY = {"open": "dctchop.dataset", "Loader": "dctchop.loader", "TorchDataset": "dctchop.torch_decode"}
_LAZY_IMPORT = threading.RLock()


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


# `open` is left out of __all__ so that `from dctchop import *` never shadows the builtin open(); TorchDataset
# is left out without torch, so that `*`, dir(), help() and inspect.getmembers() work there.
__all__ = ["Loader", "__version__"]
if _has_torch():
    __all__.append("TorchDataset")


class TorchMissing(DctchopError, AttributeError):
    """``dctchop.TorchDataset`` without torch: an AttributeError too, so ``hasattr`` says False."""


def __getattr__(name: str):
    if name == "TorchDataset" and not _has_torch():
        raise TorchMissing("dctchop.TorchDataset needs torch: pip install 'dctchop[torch]'")
    if name in _LAZY:
        with _LAZY_IMPORT:
            return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dctchop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "open", "DctchopError"])


# Run from a checkout whose package is installed, not linked (`pip install .`, then python in the checkout's
# root), Python finds this folder before the installed package; cli/ and formats/, which the wheel installs
# as dctchop.cli and dctchop.formats, lie beside it: let those names be found there.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "cli")) and all(
        os.path.isfile(os.path.join(_CHECKOUT, sub, "__init__.py")) for sub in ("cli", "formats")):
    __path__.append(_CHECKOUT)
