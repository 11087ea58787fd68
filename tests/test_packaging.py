"""The installed wheel exposes dctchop.cli and dctchop.formats and no top-level `cli` or `formats` module."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_import(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("dctchop-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"dctchop"}
    assert "dctchop/cli/__init__.py" in names and "dctchop/formats/__init__.py" in names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "dctchop = dctchop.cli.main:run" in entry_points
    assert "[zarr.codecs]" in entry_points and "dctchop = dctchop.codec:DctChopCodec" in entry_points

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    probe = (
        "import importlib.util as u, json, dctchop, dctchop.cli, dctchop.formats\n"
        "print(json.dumps({n: (s.origin if (s := u.find_spec(n)) else None)"
        " for n in ['dctchop', 'dctchop.cli', 'dctchop.formats', 'cli', 'formats']}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         check=True, capture_output=True, text=True).stdout
    origins = json.loads(out)
    assert origins["cli"] is None and origins["formats"] is None
    for name in ("dctchop", "dctchop.cli", "dctchop.formats"):
        assert origins[name].startswith(str(target)), (name, origins[name])

    # run in the checkout's root, Python finds its dctchop/ before the installed one, without cli/ and
    # formats/ inside: `import dctchop.formats` failed there. -S, and the dependencies by PYTHONPATH: this
    # environment's editable install of the checkout (a .pth file) would find them anyway
    deps = sysconfig.get_paths()["purelib"]
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=REPO,
                         env={"PYTHONPATH": os.pathsep.join([str(target), deps])},
                         check=True, capture_output=True, text=True).stdout
    origins = json.loads(out)
    assert origins["dctchop.cli"] == str(REPO / "cli" / "__init__.py")
    assert origins["dctchop.formats"] == str(REPO / "formats" / "__init__.py")
