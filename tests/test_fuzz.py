"""A sample of the decoder fuzzer (benchmarks/fuzz_decoder.py runs 10,000+ cases)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_decoder.py"


def test_decoder_survives_random_and_mutated_chunks():
    spec = importlib.util.spec_from_file_location("fuzz_decoder", SCRIPT)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    result = fuzz.run(cases=600, seed=20261122, max_seconds=2.0)
    assert result["failures"] == []
    outcomes = result["outcomes"]
    assert sum(n for k, n in outcomes.items() if k.endswith("CorruptChunkError")) > 200
    assert sum(n for k, n in outcomes.items() if k.endswith("decoded")) > 50
