"""benchmarks/payload.py still runs against the codec's internals it takes apart (a smoke test: its timings
are not checked)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_payload_tables_for_the_3d_field():
    run = subprocess.run([sys.executable, "benchmarks/payload.py", "--datasets", "field3d", "--targets", "8",
                          "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 2, run.stdout
    layout, levels = rows
    assert abs(float(layout[1]) / 8 - 1) <= 0.02  # the ratio searched for
    assert layout[3].strip() == "512/512"  # bands with a non-zero level, of 8x8x8
    assert len(layout) == 12 and len(levels) == 5
    negative = float(levels[4].split("/")[0])  # zstd -1 against the store's level, bytes: literals left raw
    assert 1.0 < negative < 1.3
