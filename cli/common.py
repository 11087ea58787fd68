"""What every dctchop command shares: click settings, the PSNR definition, formatting, option checks."""

from __future__ import annotations

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
PSNR_HELP = ("PSNR = 20 log10(peak) - 10 log10(MSE); peak = 255 for uint8, max - min of the original array for "
             "other data (1 for a constant array).")


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def fmt_db(v: float | str) -> str:
    """A PSNR for people: 'inf' for an exact reconstruction (also when stored as the string "inf")."""
    v = float(v)
    return "inf" if v == float("inf") else f"{v:.2f}"


class Path(click.Path):
    """``click.Path`` that refuses an empty name: click passes ``""`` on, and it then reads as the current
    directory (``dctchop compress x.npy ""`` said the output must not contain the input).

    It does not check that the path is readable (click's default): an unreadable input is a problem with the
    input, which the library reports as one line and exit 1 ("permission denied"), not a usage error (exit 2)
    with click's three lines."""

    def __init__(self, *args, readable: bool = False, **kwargs):
        super().__init__(*args, readable=readable, **kwargs)

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("empty path", param, ctx)
        return super().convert(value, param, ctx)


def int_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """``"4,2"`` -> (4, 2); a malformed value (``"8,"`` included) or an empty one is a usage error (exit 2),
    as click's own types."""
    if text is None:
        return None
    if not text.strip():
        raise click.BadParameter("empty value", param_hint=option)
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected an integer or comma-separated integers, got {text!r}",
                                 param_hint=option) from None


def check_axes(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Option callback for --axes: malformed text is a usage error like a malformed --keep; whether the axes
    exist depends on the array, so that is checked later (a user error)."""
    int_list(value, param.opts[0])
    return value


def check_target_ratio(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Option callback: a ratio target takes what compress's --ratio takes."""
    from dctchop.store import check_target  # late, as every command's imports: --help stays quick

    if value is not None:
        check_target("ratio", value, param.opts[0])
    return value


def check_target_psnr(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Option callback: a PSNR target takes what compress's --psnr takes."""
    from dctchop.store import check_target

    if value is not None:
        check_target("psnr", value, param.opts[0])
    return value
