"""What every dctchop command shares: click settings, the PSNR definition, number formatting."""

from __future__ import annotations

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
PSNR_HELP = ("PSNR = 20 log10(peak) - 10 log10(MSE); peak = the dtype's range for integer data (255 for uint8), "
             "max - min of the original array for floating-point data (1 for a constant array).")


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def fmt_db(v: float | str) -> str:
    """A PSNR for people: 'inf' for an exact reconstruction (also when stored as the string "inf")."""
    v = float(v)
    return "inf" if v == float("inf") else f"{v:.2f}"
