"""Library-level tests of the store writer: chunk files, metadata, streaming, atomic publish."""

import errno
import json
import re
import threading
import time

import h5py
import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore

from dctchop import store
from dctchop.errors import DctchopError
from dctchop.formats import open_source
from dctchop.location import Location
from dctchop.store import ZSTD_LEVEL, CompressOptions, Target, compress


def smooth_images(n=37, h=20, w=28, c=3, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.meshgrid(np.linspace(0, 3, h), np.linspace(0, 3, w), indexing="ij")
    base = np.sin(x[None, :, :, None] + rng.uniform(0, 6, (n, 1, 1, c))) * np.cos(y[None, :, :, None])
    return ((base * 100 + 128) + rng.normal(size=(n, h, w, c)) * 2).clip(0, 255).astype(np.uint8)


@pytest.fixture
def h5_images(tmp_path):
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["images"] = smooth_images()
        f["labels"] = np.arange(37) % 5
    return path


@pytest.mark.parametrize("target", [Target("psnr", 38.0), Target("keep", (4, 4)), Target("ratio", 6.0)])
def test_chunk_files_are_what_zarr_writes(tmp_path, h5_images, target):
    """The writer encodes chunks itself; the files must equal Zarr's own pipeline output byte for byte."""
    out = tmp_path / "out.zarr"
    compress(open_source(str(h5_images)), out, CompressOptions(target=target, chunk_samples=10, workers=2))
    ours = zarr.open_group(str(out), mode="r")["images"]
    x = h5py.File(h5_images)["images"][:]
    ref = zarr.open_group(str(tmp_path / "ref.zarr"), mode="w").create_array(
        "images", shape=x.shape, chunks=ours.chunks, dtype=x.dtype, serializer=ours.metadata.codecs[0],
        compressors=[ZstdCodec(level=ZSTD_LEVEL), Crc32cCodec()], fill_value=0,
        chunk_key_encoding=ours.metadata.chunk_key_encoding)
    ref[:] = x
    for i in range(4):
        key = f"images/c.{i}.0.0.0"
        assert (out / key).read_bytes() == (tmp_path / "ref.zarr" / key).read_bytes(), key
    np.testing.assert_array_equal(ours[:], ref[:])


@pytest.mark.parametrize("target", [Target("psnr", 38.0), Target("ratio", 6.0)])
def test_a_fast_zstd_level_changes_only_the_bytes_on_disk(tmp_path, h5_images, target):
    """zstd's fast levels decode about 3.5x faster: the codec's output is the same, so the same data comes
    back (from plain Zarr too) from more bytes; a --ratio search counts that level's bytes."""
    made = {}
    for level in (ZSTD_LEVEL, -5):
        out = tmp_path / f"level{level}.zarr"
        summary = compress(open_source(str(h5_images)), out,
                           CompressOptions(target=target, chunk_samples=10, zstd_level=level))
        made[level] = summary["arrays"]["images"], zarr.open_group(str(out), mode="r")["images"]
    (default, default_array), (fast, fast_array) = made[ZSTD_LEVEL], made[-5]
    assert fast_array.compressors[0].level == fast["zstd_level"] == -5
    if target.kind == "psnr":
        np.testing.assert_array_equal(fast_array[:], default_array[:])
        assert fast["stored_bytes"] > default["stored_bytes"]
    else:
        assert fast["ratio"] == pytest.approx(6.0, rel=0.05) and default["ratio"] == pytest.approx(6.0, rel=0.05)
        assert fast["codec"]["step"] > default["codec"]["step"]  # coarser, for the bytes the fast level spends


@pytest.mark.parametrize("chunks, compression", [((37, 1, 28, 3), "gzip"), ((15, 4, 4, 3), None)])
def test_hdf5_chunks_that_slabs_cut_make_the_same_store(tmp_path, chunks, compression):
    """Chunks across all samples, or longer than a slab and not dividing it, are read through spans of whole
    rows of chunks: the store is the one contiguous data makes, byte for byte."""
    x = smooth_images()
    stores = []
    for name, layout in (("plain", {}), ("chunked", {"chunks": chunks, "compression": compression})):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f.create_dataset("images", data=x, **layout)
        source = open_source(str(tmp_path / f"{name}.h5"))
        compress(source, tmp_path / f"{name}.zarr", CompressOptions(chunk_samples=10, workers=2))
        stores.append(tmp_path / f"{name}.zarr")
    files = [sorted(p.relative_to(s) for p in s.rglob("c.*")) for s in stores]
    assert files[0] == files[1] and len(files[0]) > 4
    for key in files[0]:
        assert (stores[0] / key).read_bytes() == (stores[1] / key).read_bytes(), key


def test_metadata_matches_a_zarr_decode(tmp_path, h5_images):
    out = tmp_path / "out.zarr"
    summary = compress(open_source(str(h5_images)), out, CompressOptions(target=Target("psnr", 35.0),
                                                                         chunk_samples=8))
    group = zarr.open_group(str(out), mode="r")
    x = h5py.File(h5_images)["images"][:]
    y = group["images"][:]
    psnr = group["dctchop_meta/images/psnr"][:].reshape(-1)
    assert group["dctchop_meta/images/psnr"].shape == (5, 1, 1, 1)
    for i, s in enumerate(range(0, 37, 8)):
        mse = np.mean((y[s : s + 8].astype(float) - x[s : s + 8]) ** 2)
        assert psnr[i] == pytest.approx(10 * np.log10(255**2 / mse), rel=1e-9)
        assert psnr[i] >= 35.0 - 0.01
    assert summary["arrays"]["images"]["psnr_min"] == pytest.approx(psnr.min())
    attrs = group.attrs["dctchop"]
    assert attrs["arrays"]["images"]["axes"] == [1, 2, 3] and attrs["lossless"] == ["labels"]
    json.dumps(attrs)


def test_failed_compress_leaves_nothing(tmp_path, h5_images):
    out = tmp_path / "out.zarr"
    with pytest.raises(DctchopError):
        compress(open_source(str(h5_images)), out, CompressOptions(target=Target("ratio", 1e9)))
    assert list(tmp_path.iterdir()) == [h5_images]


def test_existing_output_replaced_only_when_asked(tmp_path, h5_images):
    out = tmp_path / "out.zarr"
    compress(open_source(str(h5_images)), out, CompressOptions(target=Target("keep", (2, 2))))
    with pytest.raises(DctchopError, match="exists"):
        compress(open_source(str(h5_images)), out)
    with pytest.raises(DctchopError):
        compress(open_source(str(h5_images)), out, CompressOptions(target=Target("ratio", 1e9)), overwrite=True)
    assert zarr.open_group(str(out), mode="r").attrs["dctchop"]["arrays"]["images"]["target"]["kind"] == "keep"
    compress(open_source(str(h5_images)), out, overwrite=True)
    assert zarr.open_group(str(out), mode="r").attrs["dctchop"]["arrays"]["images"]["target"]["kind"] == "psnr"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5", "out.zarr"]


class _Stages:
    """Stand-ins for the two stages of the local compress pipeline: they record what ran, and writing takes
    a while, so the tests see how encoding and writing overlap."""

    def __init__(self, monkeypatch, bad_chunk=None):
        self.lock, self.encoding, self.most_encoding = threading.Lock(), 0, 0
        self.started, self.written, self.bad_chunk = [], [], bad_chunk
        monkeypatch.setattr(store, "_read_and_encode", self.encode)
        monkeypatch.setattr(store, "_write_encoded", self.write)

    def encode(self, plan, i, start, stop):
        if i == self.bad_chunk:
            raise DctchopError(f"chunk {i} is bad")
        with self.lock:
            self.encoding += 1
            self.most_encoding = max(self.most_encoding, self.encoding)
            self.started.append(i)
        time.sleep(0.001)
        with self.lock:
            self.encoding -= 1
        return b"x", {"chunk": i}

    def write(self, root, plan, data, result):
        time.sleep(0.002)
        self.written.append(result["chunk"])
        return result


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_encoding_and_writing_overlap_within_bounds(monkeypatch, workers):
    """Every chunk is written once and before its metadata comes back, at most ``workers`` encodes run at
    once, and at most ``3 * workers`` chunks are between the start of their encode and the end of their
    write (bounded memory)."""
    stages = _Stages(monkeypatch)
    done = []
    with store._thread_pools(workers) as pools:
        for result in store._encode_and_write(None, None, [(i, i, i + 1) for i in range(40)], workers, pools):
            assert result["chunk"] in stages.written
            assert len(stages.started) - len(done) <= 3 * workers
            done.append(result["chunk"])
    assert sorted(done) == sorted(stages.written) == list(range(40))
    assert stages.most_encoding <= workers


@pytest.mark.parametrize("datasets, options, message", [
    ({"ens": (2, 5, 6, 7, 8)}, {},
     ("ens: cannot infer which axes to transform for shape [2, 5, 6, 7, 8]; pass --axes, or copy it bit-exactly "
     "with --lossless ens")),
    ({"col": (500, 1)}, {},
     "col: transformed axis 1 has length 1; pick other --axes, or copy it bit-exactly with --lossless col"),
    ({"field": (16, 16, 16)}, {"target": Target("keep", (4, 4))},
     "field: --keep needs one value or one per transformed axis (3), got 2"),  # it named no array
    ({"field": (16, 16, 16)}, {"block": (8, 8)}, "field: --block needs one value or one per transformed axis (3)"),
])
def test_an_array_that_cannot_be_planned_is_named(tmp_path, datasets, options, message):
    """Beside an image stack that plans well, the message names the array at fault and, in an HDF5 file, the
    way to keep it anyway (--axes applies to every array)."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["images"] = np.zeros((50, 32, 32), np.uint8)
        for name, shape in datasets.items():
            f[name] = np.zeros(shape, np.float32)
    with pytest.raises(DctchopError, match=f"^{re.escape(message)}"):
        compress(open_source(str(tmp_path / "in.h5")), tmp_path / "o.zarr", CompressOptions(**options))


def test_an_encode_error_stops_the_pipeline(monkeypatch):
    stages = _Stages(monkeypatch, bad_chunk=5)
    with pytest.raises(DctchopError, match="chunk 5"), store._thread_pools(2) as pools:
        list(store._encode_and_write(None, None, [(i, i, i + 1) for i in range(100)], 2, pools))
    assert 5 not in stages.written and len(stages.written) < 100


@pytest.mark.parametrize("kind, value, message", [
    ("psnr", 0.0, "above 0 and below 400"), ("psnr", 500.0, "above 0 and below 400"), ("psnr", float("nan"), "above 0 and below"),
    ("ratio", 0.5, "at least 1"), ("ratio", float("nan"), "at least 1"), ("ratio", float("inf"), "finite"),
])
def test_targets_out_of_range_say_what_is_allowed(kind, value, message):
    with pytest.raises(DctchopError, match=f"--{kind} must be .*{message}"):
        Target(kind, value)


def test_fields_far_from_zero_reach_the_default_target_in_every_chunk(tmp_path):
    """Pressures in Pa (101325 +- 250) once stopped at 55 dB (the DC coefficient's int16 levels carried the
    offset): the default --psnr 60 failed and --ratio could not buy more than 55 dB. Chunks are now stored
    relative to their midrange, the partial last one (padded with zero samples) too."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 16, 16, 16))
    for axis in (1, 2, 3):
        x = np.cumsum(x, axis=axis)
    x = (101325 + 500 * (x - x.min()) / (x.max() - x.min()) - 250).astype(np.float32)
    np.save(tmp_path / "p.npy", x)
    for target, check in ((None, lambda psnr: psnr >= 60.0), (Target("ratio", 6.0), lambda psnr: psnr > 60.0)):
        out = tmp_path / f"{target}.zarr"
        summary = compress(open_source(str(tmp_path / "p.npy")), out,
                           CompressOptions(target=target, chunk_samples=4))
        data = summary["arrays"]["data"]
        chunk_psnr = zarr.open_group(str(out), mode="r")["dctchop_meta/data/psnr"][:]
        assert chunk_psnr.size == 3 and all(check(p) for p in chunk_psnr), chunk_psnr
        y = zarr.open_group(str(out), mode="r")["data"][:]
        peak = float(x.max()) - float(x.min())
        assert 10 * np.log10(peak**2 / np.mean((y.astype(np.float64) - x) ** 2)) == pytest.approx(data["psnr"], abs=0.01)


def test_chunks_of_a_few_samples_get_a_note_on_their_files(tmp_path, h5_images):
    """A chunk is 7 files (its own and one per metadata field), each taking whole file-system blocks: chunks of
    one 20x28 image take about 30 times their stored bytes on disk. The note says so with the numbers."""
    tiny = compress(open_source(str(h5_images)), tmp_path / "tiny.zarr",
                    CompressOptions(chunk_samples=1))["arrays"]["images"]
    n_files = 37 * (1 + len(store.META_FIELDS))
    assert len([p for p in (tmp_path / "tiny.zarr").rglob("c.*") if p.is_file()]) == n_files
    on_disk = float(re.search(r"about ([\d.]+) MB on disk", tiny["note"])[1]) * 1e6
    assert on_disk == pytest.approx(n_files * store.FILE_SYSTEM_BLOCK, rel=0.01)  # every file under a block
    assert tiny["note"].startswith(f"37 chunks of 1 sample are {n_files:,} files of ") and on_disk > 20 * tiny["stored_bytes"]
    whole = compress(open_source(str(h5_images)), tmp_path / "whole.zarr", CompressOptions())["arrays"]["images"]
    assert "note" not in whole  # one chunk: its blocks hold less than twice its bytes


def test_an_array_beyond_the_ratio_at_the_finest_step_is_stored_there_with_a_note(tmp_path):
    # an all-zero array beside noise made the whole --ratio 1.5 run fail ("lower than the finest quantization
    # gives"): no step brings it down to 1.5, and its finest step is the best it can be stored at
    rng = np.random.default_rng(1)
    with h5py.File(tmp_path / "mix.h5", "w") as f:
        f["images"] = (rng.random((64, 32, 32)) * 255).astype(np.uint8)
        f["masks"] = np.zeros((64, 32, 32), np.uint8)
    summary = compress(open_source(str(tmp_path / "mix.h5")), tmp_path / "mix.zarr",
                       CompressOptions(target=Target("ratio", 1.5)))
    images, masks = summary["arrays"]["images"], summary["arrays"]["masks"]
    assert abs(images["ratio"] / 1.5 - 1) <= 0.05 and "note" not in images
    assert masks["ratio"] > 10 and "finest int16 quantization" in masks["note"] and masks["max_abs_error"] == 0
    # a target just beyond the tolerance of the finest step's ratio is stored there too (not refused)
    np.save(tmp_path / "zeros.npy", np.zeros((64, 32, 32), np.uint8))
    finest = compress(open_source(str(tmp_path / "zeros.npy")), tmp_path / "z1.zarr",
                      CompressOptions(target=Target("ratio", 1.5)))["arrays"]["data"]["ratio"]
    zeros = compress(open_source(str(tmp_path / "zeros.npy")), tmp_path / "z2.zarr",
                     CompressOptions(target=Target("ratio", finest / 1.1)))["arrays"]["data"]
    assert zeros["ratio"] == finest and "finest int16 quantization" in zeros["note"]


def test_a_ratio_estimated_at_the_edge_of_reach_is_refused_before_writing(tmp_path):
    # noise: the coarsest step reaches about 7.6 with the metadata; --ratio 8 was accepted (7.6 is within 5%)
    # and came out at 7.598, just past it
    np.save(tmp_path / "noise.npy", (np.random.default_rng(0).random((10, 3, 32, 32)) * 255).astype(np.uint8))
    with pytest.raises(DctchopError, match="ratio 8 is unreachable"):
        compress(open_source(str(tmp_path / "noise.npy")), tmp_path / "n.zarr",
                 CompressOptions(target=Target("ratio", 8.0)))
    assert not (tmp_path / "n.zarr").exists()


def test_a_ratio_in_a_jump_of_the_ratio_is_refused_before_writing(tmp_path, monkeypatch):
    """Images of constant 8x8 blocks at two levels compress in jumps: from about 78 to 93 between two steps a
    hair apart. --ratio 85 was written whole, then refused as "the data is not like the chunks the search
    sampled", although the search had sampled every chunk."""
    rng = np.random.default_rng(21)
    blocks = (rng.integers(0, 2, (400, 4, 4)) * 200 + 20).astype(np.uint8)
    np.save(tmp_path / "blocks.npy", np.kron(blocks, np.ones((1, 8, 8), np.uint8)))
    written = []
    monkeypatch.setattr(store, "_write_lossy", lambda *args: written.append(args) or {})
    with pytest.raises(DctchopError, match=r"data: no step gives ratio 85 within 5%: between two steps a hair apart "
                                           r"it jumps from 7\d\.\d+ to 9\d\.\d+"):
        compress(open_source(str(tmp_path / "blocks.npy")), tmp_path / "b.zarr",
                 CompressOptions(target=Target("ratio", 85.0)))
    assert written == [] and not (tmp_path / "b.zarr").exists()
    monkeypatch.undo()
    near = compress(open_source(str(tmp_path / "blocks.npy")), tmp_path / "b.zarr",
                    CompressOptions(target=Target("ratio", 80.0)))  # the side of the jump within 5% is taken
    assert abs(near["arrays"]["data"]["ratio"] / 80 - 1) <= 0.05


def test_a_ratio_sample_holding_a_short_last_chunk_is_scaled_by_samples(tmp_path, monkeypatch):
    """The sample of chunks always holds the last one; scaled as if it were full, its 1 sample (whose padding
    costs next to nothing) made the estimate low by about 1/len(sample): --ratio 8 came out at 6 on 67 MB."""
    monkeypatch.setattr(store, "RATIO_SAMPLE_BYTES", 4 * 40 * 32 * 32)  # 4 of the 13 chunks, as for 260 MB
    rng = np.random.default_rng(19)
    z, y, x = np.meshgrid(np.arange(12 * 40 + 1), np.linspace(0, 3, 32), np.linspace(0, 3, 32), indexing="ij")
    images = 128 + 80 * np.sin(y * (1 + z % 7) + x) + rng.normal(0, 4, z.shape)
    np.save(tmp_path / "x.npy", np.clip(images, 0, 255).astype(np.uint8))
    summary = compress(open_source(str(tmp_path / "x.npy")), tmp_path / "x.zarr",
                       CompressOptions(target=Target("ratio", 8.0), chunk_samples=40))
    assert abs(summary["arrays"]["data"]["ratio"] / 8 - 1) <= 0.05
    assert "searched again" not in summary["arrays"]["data"].get("note", "")  # met by the first write


def test_a_ratio_missed_for_unsampled_chunks_is_searched_again_on_chunks_picked_by_size(tmp_path, monkeypatch):
    """Arrays over RATIO_SAMPLE_BYTES are searched on chunks spread along axis 0; with noise in chunks the
    sample missed, --ratio 10 came out at 3.4 and the run failed after the whole encode. The sizes of the
    first write pick a sample that stands for every chunk, and the array is written again."""
    monkeypatch.setattr(store, "RATIO_SAMPLE_BYTES", 16 * 64 * 32 * 32)  # 16 of the 20 chunks
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:32, 0:32]
    phase = rng.uniform(0, 6, (20 * 64, 1, 1))
    images = np.clip(128 + 60 * np.sin(x / 9 + phase) + 50 * np.cos(y / 11 + phase), 0, 255).astype(np.uint8)
    for k in (2, 7, 12, 17):  # the chunks the even spread leaves out
        images[k * 64 : (k + 1) * 64] = rng.integers(0, 256, (64, 32, 32), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    writes = []
    write_lossy = store._write_lossy
    monkeypatch.setattr(store, "_write_lossy", lambda *args: writes.append(1) or write_lossy(*args))
    summary = compress(open_source(str(tmp_path / "x.npy")), tmp_path / "x.zarr",
                       CompressOptions(target=Target("ratio", 10.0), chunk_samples=64))
    data = summary["arrays"]["data"]
    assert len(writes) == 2 and abs(data["ratio"] / 10 - 1) <= 0.05
    assert re.search(r"gave ratio \d\.\d+: searched again on chunks picked by their stored size", data["note"])
    stored = sum(f.stat().st_size for f in (tmp_path / "x.zarr").rglob("*") if f.is_file()
                 and "data" in f.relative_to(tmp_path / "x.zarr").parts)
    assert data["stored_bytes"] <= stored and abs(images.nbytes / stored / 10 - 1) <= 0.05  # as on disk


def test_a_sample_that_exceeds_the_ratio_at_the_finest_step_does_not_excuse_the_array(tmp_path, monkeypatch):
    """Zeros in every chunk the search sampled, noise in the others: the sample exceeded --ratio 4 at the finest
    step, the array was stored at it with ratio 1.44, exit 0, and a note of the sample's 1.49e+04. Below the
    target as written, it is searched again on chunks picked by their stored size."""
    monkeypatch.setattr(store, "RATIO_SAMPLE_BYTES", 16 * 64 * 32 * 32)  # 16 of the 20 chunks
    rng = np.random.default_rng(5)
    images = np.zeros((20 * 64, 32, 32), np.uint8)
    for k in (2, 7, 12, 17):  # the chunks the even spread leaves out
        images[k * 64 : (k + 1) * 64] = rng.integers(0, 256, (64, 32, 32), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    summary = compress(open_source(str(tmp_path / "x.npy")), tmp_path / "x.zarr",
                       CompressOptions(target=Target("ratio", 4.0), chunk_samples=64))
    data = summary["arrays"]["data"]
    assert abs(data["ratio"] / 4 - 1) <= 0.05
    assert re.search(r"gave ratio \d\.\d+: searched again on chunks picked by their stored size", data["note"])


def test_a_psnr_target_just_above_what_the_data_allows_is_refused(tmp_path, h5_images):
    """No slack: a chunk 0.005 dB short of --psnr was accepted (a 0.01 dB tolerance) against the promise."""
    def at(psnr: float):
        options = CompressOptions(target=Target("psnr", psnr), precision="int8")
        return compress(open_source(str(h5_images)), tmp_path / f"{psnr}.zarr", options)

    with pytest.raises(DctchopError, match=r"chunk \d+ reaches (\d+\.\d\d) dB") as e:
        at(90.0)  # int8's finest steps fall short: the message says how far they go, to 0.01 dB
    reach = float(re.search(r"reaches (\d+\.\d\d) dB", str(e.value)).group(1))
    with pytest.raises(DctchopError, match="is above what this data allows"):
        at(reach + 0.005)  # the real reach is below it
    assert at(reach - 0.005)["arrays"]["images"]["psnr_min"] >= reach - 0.005


@pytest.mark.parametrize("target", [Target("psnr", 60.0), Target("ratio", 4.0), Target("keep", 4)])
def test_float64_data_spanning_too_little_for_the_error_arithmetic_is_refused(tmp_path, target):
    """Squared errors underflow below about 1e-154: data at 1e-160 reported PSNR inf while reaching 111 dB,
    and in float16 steps at 1e-290 wrote chunks of NaN."""
    field = np.sin(np.linspace(0, 9, 16 * 24 * 24)).reshape(16, 24, 24)
    np.save(tmp_path / "tiny.npy", field * 1e-160)
    with pytest.raises(DctchopError, match=r"values span only 2e-160, too little .* scale the data up"):
        compress(open_source(str(tmp_path / "tiny.npy")), tmp_path / "t.zarr", CompressOptions(target=target))
    assert not (tmp_path / "t.zarr").exists()
    np.save(tmp_path / "small.npy", field * 1e-120)  # still far from the floor: as the data at 1
    small = compress(open_source(str(tmp_path / "small.npy")), tmp_path / "s.zarr", CompressOptions())
    np.save(tmp_path / "one.npy", field)
    one = compress(open_source(str(tmp_path / "one.npy")), tmp_path / "o.zarr", CompressOptions())
    assert small["arrays"]["data"]["psnr"] == pytest.approx(one["arrays"]["data"]["psnr"], abs=0.5)


def test_the_ratio_is_checked_on_the_store_as_written(tmp_path, h5_images, monkeypatch):
    # the search works on a sample of chunks: data unlike the sample could miss the target, which is promised
    monkeypatch.setattr(store, "search_ratio_step", lambda plan, ratio, threads, overhead, sample: 1.0)
    with pytest.raises(DctchopError, match=r"--ratio 6 came out at .*more than 5% off"):
        compress(open_source(str(h5_images)), tmp_path / "r.zarr", CompressOptions(target=Target("ratio", 6.0)))
    assert not (tmp_path / "r.zarr").exists() and list(tmp_path.iterdir()) == [h5_images]


def test_a_small_npy_out_of_reach_of_a_ratio_is_not_told_to_copy_it_losslessly(tmp_path):
    """A .npy holds one array: --lossless would leave nothing to compress."""
    np.save(tmp_path / "small.npy", np.random.default_rng(1).integers(0, 256, (10, 8, 8), np.uint8))
    with pytest.raises(DctchopError, match=r"metadata alone \(about \d+ bytes\) rules that out\)?$"):
        compress(open_source(str(tmp_path / "small.npy")), tmp_path / "s.zarr",
                 CompressOptions(target=Target("ratio", 8.0)))


def test_a_ratio_out_of_reach_for_any_array_fails_before_a_chunk_is_written(tmp_path, monkeypatch):
    # the arrays before it used to be encoded whole first; a tiny one's metadata outweighs any budget
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "tiny.h5", "w") as f:
        f["a_images"] = (rng.random((300, 32, 32, 3)) * 255).astype(np.uint8)
        f["g/const"] = np.full((10, 8, 8), 7, np.uint8)
    written = []
    monkeypatch.setattr(store, "_write_lossy", lambda *args: written.append(args) or {})
    with pytest.raises(DctchopError, match="g/const: ratio 4 is unreachable.*copy it with --lossless /g/const to compress the "
                       "file's other arrays$"):
        compress(open_source(str(tmp_path / "tiny.h5")), tmp_path / "t.zarr",
                 CompressOptions(target=Target("ratio", 4.0)))
    assert written == [] and not (tmp_path / "t.zarr").exists()


def test_the_array_error_does_not_depend_on_the_order_the_chunks_finish(monkeypatch):
    # Chunks finish in any order on several workers; their squared errors were summed in that order, so the
    # array's rmse (in the root zarr.json) changed in the last bit from run to run (review: 7 runs of 8 one way)
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    results = [{"chunk": i, "nbytes": 0, "sse": float(v), **{k: 0 for k in store.META_FIELDS}}
               for i, v in enumerate(rng.lognormal(0, 8, 200))]
    plan = SimpleNamespace(source=SimpleNamespace(shape=(200,)), chunks=(1,))
    totals = set()
    for seed in range(10):
        order = np.random.default_rng(seed).permutation(200)
        monkeypatch.setattr(store, "_encode_and_write", lambda *args, order=order: (results[i] for i in order))
        totals.add(store._write_lossy(None, plan, 2, None, None, lambda n: None)["sse"])
    assert len(totals) == 1


def test_checking_a_store_opens_its_root_once_whatever_its_number_of_arrays(tmp_path, monkeypatch):
    # inspect, decompress and verify opened the root group once or twice per array to check it for damage;
    # each opening parses the root zarr.json, which records every array, so a store of 2000 groups took
    # minutes (time growing with the square of its number of arrays). The openings must not grow with it.
    from dctchop.export import decompress
    from dctchop.inspect import inspect_store

    real_open_group, opened = zarr.open_group, {}
    for n in (1, 4):
        source, out = tmp_path / f"in{n}.h5", tmp_path / f"s{n}.zarr"
        with h5py.File(source, "w") as f:
            for i in range(n):
                f[f"g{i}/img"] = smooth_images(n=4, h=16, w=16, c=1, seed=i)[..., 0]
                f[f"g{i}/lab"] = np.arange(4) + i
        compress(open_source(str(source)), out, CompressOptions(workers=1))
        calls = []
        monkeypatch.setattr(zarr, "open_group", lambda *a, calls=calls, **k: calls.append(a) or real_open_group(*a, **k))
        report = inspect_store(out)
        assert decompress(out, tmp_path / f"out{n}.h5") and inspect_store(out, verify=source)["verify"]
        monkeypatch.setattr(zarr, "open_group", real_open_group)
        assert len(report["arrays"]) == len(report["lossless"]) == n
        opened[n] = len(calls)
    assert opened[4] == opened[1], opened


def _zarr_store_calls(monkeypatch) -> list[tuple[str, str]]:
    """(method, key) of every call to Zarr's local store from now on: each is a round trip through Zarr's event
    loop, and for ``get``/``set`` a file."""
    calls = []
    for method in ("get", "set", "set_if_not_exists", "exists", "delete", "delete_dir"):
        real = getattr(LocalStore, method)

        async def counted(self, key, *args, real=real, method=method, **kwargs):
            calls.append((method, key))
            return await real(self, key, *args, **kwargs)

        monkeypatch.setattr(LocalStore, method, counted)
    return calls


def _written_files(monkeypatch) -> list[str]:
    """The keys of every file the store writer writes itself from now on (:meth:`Location.write_files`)."""
    written, real = [], Location.write_files
    monkeypatch.setattr(Location, "write_files", lambda self, files: written.extend(files) or real(self, files))
    return written


def _small_arrays(path, n: int):
    """An HDF5 file of ``n`` small image stacks in two groups, with attributes."""
    with h5py.File(path, "w") as f:
        for i in range(n):
            f[f"g{i % 2}/img{i}"] = smooth_images(n=4, h=16, w=16, c=1, seed=i)[..., 0]
            f[f"g{i % 2}/img{i}"].attrs["units"] = "K"
    return path


def _files_read(monkeypatch) -> list[str]:
    """The keys of every file read from a store as a file from now on (:meth:`Location.read`)."""
    read, real = [], Location.read
    monkeypatch.setattr(Location, "read", lambda self, key: read.append(key) or real(self, key))
    return read


def test_compress_makes_as_many_zarr_calls_for_six_arrays_as_for_one(tmp_path, monkeypatch):
    # Zarr created each lossy array and its six metadata arrays in calls of 3.4 ms each: a file of 1500 small
    # datasets took 35 s of its 46 there. Their zarr.json files are written with the chunks now, in one pass.
    calls = {}
    for n in (1, 6):
        source, out = _small_arrays(tmp_path / f"in{n}.h5", n), tmp_path / f"s{n}.zarr"
        made = _zarr_store_calls(monkeypatch)
        compress(open_source(str(source)), out, CompressOptions(workers=1))
        monkeypatch.undo()
        calls[n] = len(made)
        assert len(zarr.open_group(str(out), mode="r")["g0"].attrs) == 0
        assert zarr.open_group(str(out), mode="r")[f"g{(n - 1) % 2}/img{n - 1}"].attrs["units"] == "K"
    assert calls[6] == calls[1], calls


def _threads_started(monkeypatch) -> list[str]:
    """The names of the threads started from now on."""
    names, real = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: names.append(self.name) or real(self))
    return names


def test_compress_starts_as_many_threads_for_six_arrays_as_for_one(tmp_path, monkeypatch):
    # Each lossy array had pools of its own, a float one a third to scan it: 3,750 thread starts for 1,500 small
    # arrays, a third of the run (each start waits for the new thread to take the GIL).
    started = {}
    for n in (1, 6):
        source = _small_arrays(tmp_path / f"in{n}.h5", n)
        with h5py.File(source, "a") as f:
            f["field"] = np.random.default_rng(n).normal(size=(4, 16, 16)).astype(np.float32)
        names = _threads_started(monkeypatch)
        compress(open_source(str(source)), tmp_path / f"s{n}.zarr", CompressOptions(workers=2))
        monkeypatch.undo()
        started[n] = len([name for name in names if name.startswith("dctchop-")])
    assert started[6] == started[1], started


@pytest.mark.parametrize("target", [Target("psnr", 38.0), Target("ratio", 6.0)])
def test_nested_groups_are_made_once_each_however_deep(tmp_path, monkeypatch, target):
    # Each group was made with Zarr's require_group, which walks every group above it again: compressing a chain
    # of 200 nested groups took 12 s for 256 KB. Every group's zarr.json is written once, and Zarr is not asked
    # about any of them.
    calls = {}
    for depth in (3, 12):
        source, out = tmp_path / f"in{depth}.h5", tmp_path / f"s{depth}.zarr"
        path = "/".join(f"g{i}" for i in range(depth))
        with h5py.File(source, "w") as f:
            f[f"{path}/images"] = smooth_images(n=40, h=32, w=32)
            f[path].attrs["depth"] = depth
        made, written = _zarr_store_calls(monkeypatch), _written_files(monkeypatch)
        compress(open_source(str(source)), out, CompressOptions(target=target, workers=1))
        monkeypatch.undo()
        calls[depth] = len(made)
        groups = [f"{prefix}{'/'.join(f'g{i}' for i in range(d + 1))}" for prefix in ("", f"{store.META_GROUP}/")
                  for d in range(depth)] + [store.META_GROUP, f"{store.META_GROUP}/{path}/images"]
        group_files = [key for key in written if key.removesuffix("/zarr.json") in groups]
        assert sorted(group_files) == sorted(f"{g}/zarr.json" for g in groups)
        assert zarr.open_group(str(out), mode="r")[path].attrs["depth"] == depth
    assert calls[12] == calls[3], calls


def test_inspect_and_open_make_as_many_zarr_calls_for_six_arrays_as_for_one(tmp_path, monkeypatch):
    # inspect asked Zarr 23 times per lossy array (its data and metadata arrays opened, the per-chunk tables read
    # through them, two of them twice), dctchop.open 3 times: 21-40 s and 7 s for a store of 1500 small arrays.
    # Their zarr.json files and each table's element files are read as files now, each once.
    import dctchop
    from dctchop.inspect import inspect_store

    calls = {}
    for n in (1, 6):
        out = tmp_path / f"s{n}.zarr"
        compress(open_source(str(_small_arrays(tmp_path / f"in{n}.h5", n))), out,
                 CompressOptions(workers=1, chunk_samples=2))
        read, made = _files_read(monkeypatch), _zarr_store_calls(monkeypatch)
        report = inspect_store(out, chunks=True)
        inspected = len(made)
        elements = [key for key in read if key.startswith(f"{store.META_GROUP}/")
                    and not key.endswith("zarr.json")]
        dataset = dctchop.open(out)
        monkeypatch.undo()
        calls[n] = inspected, len(made) - inspected
        assert sorted(elements) == sorted(set(elements)) and len(elements) == n * 2 * len(store.META_FIELDS)
        assert all(a["damaged_chunks"] == [] and len(a["chunk_table"]["psnr"]) == 2 for a in report["arrays"].values())
        assert dataset[f"g{(n - 1) % 2}/img{n - 1}"].shape == (4, 16, 16)
    assert calls[6] == calls[1], calls


def test_an_output_on_a_read_only_file_system_is_a_user_error(tmp_path, monkeypatch):
    """There even unlinking a missing file fails (EROFS): the removal of a stale temporary store before the
    write, and the clean-up after it, gave an internal error instead of the failed write's message."""
    np.save(tmp_path / "x.npy", smooth_images(4))

    def read_only(self, check=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Location, "remove", read_only)
    with pytest.raises(DctchopError, match=r"compress failed: Read-only file system \(.*dctchop-tmp.*\); .* not written"):
        compress(open_source(str(tmp_path / "x.npy")), tmp_path / "x.zarr", CompressOptions())


@pytest.mark.parametrize("kind, value, message", [
    ("quality", 4, "the target kind must be one of keep, ratio, psnr, got 'quality'"),  # stored, then "damaged"
    ("keep", 4.5, "--keep must be whole numbers of coefficients, at least 1, got 4.5"),  # was kept as 4
    ("keep", "4", "--keep must be whole numbers"), ("keep", (4, 0), "at least 1"), ("keep", (), "whole numbers")])
def test_targets_the_store_could_not_record_are_refused(kind, value, message):
    with pytest.raises(DctchopError, match=re.escape(message)):
        Target(kind, value)


def test_a_keep_target_records_plain_ints():
    assert Target("keep", np.int64(4)).value == 4 and type(Target("keep", np.int64(4)).value) is int
    assert Target("keep", [4, np.int32(2)]).value == (4, 2)


def test_compress_refuses_what_is_not_a_source_or_options(tmp_path):
    np.save(tmp_path / "x.npy", smooth_images(4))
    with pytest.raises(DctchopError, match="compress takes a dctchop.formats.open_source.* got str and"):
        compress(str(tmp_path / "x.npy"), tmp_path / "a.zarr")
    with pytest.raises(DctchopError, match="got Source and dict"):
        compress(open_source(str(tmp_path / "x.npy")), tmp_path / "a.zarr", {"chunk_samples": 2})
    with pytest.raises(DctchopError, match="--chunk-samples must be a whole number, at least 1, got 2.5"):
        compress(open_source(str(tmp_path / "x.npy")), tmp_path / "a.zarr", CompressOptions(chunk_samples=2.5))
    assert not (tmp_path / "a.zarr").exists()
