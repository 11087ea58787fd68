"""The installed wheel exposes dctchop.cli and dctchop.formats and no top-level `cli` or `formats` module."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

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
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)  # the MIT text pyproject declares
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


def test_the_sdist_carries_what_its_tests_read(tmp_path):
    # it shipped tests/test_*.py without their fixtures, the sample data or conftest.py: its tests failed
    if not (REPO / ".git").exists():
        pytest.skip("builds the sdist from a git checkout's files")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    source = tmp_path / "source"  # as a fresh clone has it: no egg-info left by earlier builds to list files
    for f in files:
        if (REPO / f).is_file():
            (source / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, source / f)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=source, check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    needed = {"tests/conftest.py", "sample_data/images.h5", "sample_data/field.npy", "benchmarks/fuzz_decoder.py",
              "benchmarks/payload.py", "benchmarks/peers.py", "examples/train_classifier.py"}
    needed |= {str(p.relative_to(REPO)) for p in (REPO / "tests" / "fixtures").rglob("*") if p.is_file()
               and "__pycache__" not in p.parts}
    assert needed <= names, sorted(needed - names)


FIRST_USE_IN_TWO_THREADS = """
import importlib, threading, time
import dctchop

real, inside, overlaps = importlib.import_module, [], []

def watched(name, *args):  # each of dctchop's first-use imports, slowed so that two would overlap
    if not name.startswith("dctchop."):
        return real(name, *args)
    inside.append(name)
    overlaps.extend([tuple(inside)] if len(inside) > 1 else [])
    time.sleep(0.2)
    try:
        return real(name, *args)
    finally:
        inside.remove(name)

importlib.import_module = watched
thread = threading.Thread(target=lambda: dctchop.Loader)
thread.start()
dctchop.open
thread.join()
print(overlaps)
"""


def test_first_uses_in_two_threads_import_one_at_a_time():
    """A first Loader in one thread and a first TorchDataset in another imported zarr's modules at once, and
    zarr's circular imports failed one of them with Python's _DeadlockError (3 runs in 12)."""
    run = subprocess.run([sys.executable, "-c", FIRST_USE_IN_TWO_THREADS], capture_output=True, text=True,
                         timeout=120, check=True)
    assert run.stdout.strip() == "[]"
