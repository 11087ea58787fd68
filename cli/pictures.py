"""``dctchop preview`` and ``dctchop sweep``: pictures of a store, and a rate-distortion sweep of an input.

Both draw with matplotlib, the optional ``plot`` extra (``pip install 'dctchop[plot]'``); ``sweep``
without ``--plot`` does not need it.
"""

from __future__ import annotations

import json

import click

from dctchop.cli.common import (
    CONTEXT,
    PSNR_HELP,
    Path,
    check_axes,
    check_target_psnr,
    check_target_ratio,
    fmt_db,
)
from dctchop.errors import DctchopError


@click.command(context_settings=CONTEXT, epilog=PSNR_HELP)
@click.argument("store", type=Path())
@click.option("--out", "out", required=True, type=Path(dir_okay=False), metavar="PNG",
              help="The picture to write (PNG).")
@click.option("--source", type=Path(dir_okay=False), metavar="INPUT",
              help="The input the store was made from (default: the path recorded in the store).")
@click.option("--index", "indices", type=int, multiple=True, metavar="I",
              help="Sample to show (repeatable; negative counts from the end). Default: 4 spread over the array.")
@click.option("--array", metavar="NAME",
              help="Which compressed array of the store (default: the one with most values per sample).")
def preview(store, out, source, indices, array):
    """Draw original | decoded | absolute error for a few samples of STORE into a PNG.

    \b
    Images (NHW, NHWC, NCHW): whole samples, RGB for 3 channels, grey otherwise.
    Fields (ZYX, NZYX, ...): the middle slice along the first transformed axis.
    The PNG is 1024 px wide and 72 + 256 px per sample high; titles give each sample's PSNR.
    """
    from dctchop.preview import preview as draw_preview

    result = draw_preview(store, out, source=source, indices=list(indices) or None, array=array)
    for s in result["samples"]:  # a field transformed along axis 0 is one picture of the whole array
        label = f"{result['array']} (whole array)" if result["whole_array"] else f"{result['array']}[{s['index']}]"
        click.echo(f"{label}: PSNR {fmt_db(s['psnr'])} dB, "
                   f"max abs error {s['max_abs_error']:.4g}")
    click.echo(f"wrote {result['out']} ({result['width']}x{result['height']} px)")


@click.command(context_settings=CONTEXT, epilog=PSNR_HELP)
@click.argument("input_path", metavar="INPUT", type=Path(dir_okay=False))
@click.option("--dataset", metavar="PATH", help="HDF5 dataset to sweep (default: the first lossy one).")
@click.option("--follow-external", is_flag=True, help="Follow HDF5 external links and virtual datasets.")
@click.option("--axes", metavar="A,B[,C]", callback=check_axes,
              help="Axes to transform (default: inferred from the layout).")
@click.option("--sample", type=int, metavar="N",
              help="Samples to compress: evenly spaced along axis 0, or N contiguous planes when axis 0 is "
                   "transformed. Default 256 (at most 32 MB), all when fewer.")
@click.option("--target-ratio", type=float, metavar="R", callback=check_target_ratio,
              help="Recommend the best-PSNR setting with ratio >= R (within 5%) on the sample's chunk bytes; "
                   "the store adds about 4 KB of metadata per array, which shows on arrays of a few MB or less.")
@click.option("--target-psnr", type=float, metavar="DB", callback=check_target_psnr,
              help="Recommend the highest-ratio setting with PSNR >= DB.")
@click.option("--plot", "plot_path", type=Path(dir_okay=False), metavar="PNG",
              help="Draw the rate-distortion curve into this PNG (1024x768 px; needs the plot extra).")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON on stdout.")
def sweep(input_path, dataset, follow_external, axes, sample, target_ratio, target_psnr, plot_path, as_json):
    """Compress a sample of INPUT at a grid of settings; print ratio, PSNR and decode speed of each.

    \b
    Grid: --keep 2,4,6,8 x --mask square,triangle x --precision float16,bfloat16 (block 8);
          --psnr 30..50 (integer data) or 40..80 (float data) x --precision int8,int16 (block 8);
          --block 4 and 16 at the middle PSNR target (int16).
    '*' marks the Pareto front. The recommended `dctchop compress` line is for --target-ratio or
    --target-psnr (default: the PSNR `dctchop compress` defaults to, 40 dB integer / 60 dB float).
    """
    from dctchop.store import json_safe
    from dctchop.sweep import plot, recommend
    from dctchop.sweep import sweep as run_sweep

    if target_ratio is not None and target_psnr is not None:
        raise click.UsageError("give at most one of --target-ratio and --target-psnr")
    if plot_path is not None:
        from dctchop.preview import check_png_path, require_matplotlib

        check_png_path(plot_path)
        require_matplotlib("dctchop sweep --plot")
    result = run_sweep(input_path, dataset=dataset, sample=sample, axes=axes, follow_external=follow_external)
    rec = recommend(result, target_ratio=target_ratio, target_psnr=target_psnr, axes_text=axes, dataset=dataset)
    result["recommendation"] = rec
    if plot_path is not None:
        width, height = plot(result, rec, plot_path)
        result["plot"] = {"path": plot_path, "width": width, "height": height}
    if as_json:
        click.echo(json.dumps(json_safe(result), indent=2))
    else:
        _print_sweep(result)
    if rec["command"] is None:
        raise DctchopError(rec["reason"])


def _print_sweep(result: dict) -> None:
    s = result["sample"]
    shape = "x".join(map(str, result["shape"]))
    more = ""
    if len(result["arrays"]) > 1 and result["array"] == result["arrays"][0]:
        more = f" (first of {len(result['arrays'])} arrays; pick another with --dataset)"
    click.echo(f"{result['input']} {result['array']}: {shape} {result['dtype']}, layout {result['layout']}, "
               f"transformed axes {result['axes']}{more}")
    where = (f"planes {s['start']}..{s['stop'] - 1}" if s["mode"] == "contiguous" else s["mode"])
    click.echo(f"sample: {s['count']} of {s['of']} ({where}), {s['bytes'] / 1e6:.2f} MB; "
               f"PSNR peak {result['peak']:.6g}")
    width = max(len(p["name"]) for p in result["settings"]) if result["settings"] else 20
    click.echo(f"\n  {'setting':<{width}}  {'ratio':>7}  {'PSNR dB':>8}  {'max err':>9}  {'decode MB/s':>11}")
    for p in result["settings"]:
        mark = "*" if p["pareto"] else (" (PSNR target missed)" if not p["reachable"] else "")
        click.echo(f"  {p['name']:<{width}}  {p['ratio']:>7.2f}  {fmt_db(p['psnr']):>8}  {p['max_abs_error']:>9.4g}  "
                   f"{p['decode_mb_per_s']:>11.0f} {mark}".rstrip())
    for k in result["skipped"]:
        click.echo(f"  {k['name']:<{width}}  skipped: {k['reason']}")
    click.echo("\n* Pareto front: no other setting is as good on both ratio and PSNR and better on one.")
    rec = result["recommendation"]
    t = rec["target"]
    goal = f"ratio >= {t['value']:g}" if t["kind"] == "ratio" else f"PSNR >= {t['value']:g} dB"
    if not t["given"]:
        goal += " (the compress default; set --target-ratio or --target-psnr)"
    if rec["command"] is not None:
        psnr = fmt_db(rec["psnr"])
        click.echo(f"recommended for {goal}: ratio {rec['ratio']:.2f}, PSNR {psnr} dB on the sample")
        click.echo(f"  {rec['command']}")
        for r in rec["copied_bit_exactly"]:
            click.echo(f"  (copies {r['array']} bit-exactly; compress cannot transform it: {r['reason']})")
    if "plot" in result:
        click.echo(f"wrote {result['plot']['path']} ({result['plot']['width']}x{result['plot']['height']} px)")
