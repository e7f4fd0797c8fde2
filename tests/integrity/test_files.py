"""Artifact checks: a damaged file is one line naming it and what to run, before any loader reads it."""

import hashlib
import json
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mmcse.errors import CorruptArtifact
from mmcse.integrity import files as integrity
from mmcse.integrity.files import (
    HashingWriter,
    check_model_folder,
    check_npy,
    check_safetensors,
    file_sha256,
    load_torch,
    verify_images,
)

FIX = "rerun the stage"


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _npy(path, array):
    with open(path, "wb") as handle:
        np.save(handle, array)
    return path


def test_npy_header_size_and_shape(tmp_path):
    path = _npy(tmp_path / "features.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    header = check_npy(path, FIX, shape=[4, 3])
    assert header.shape == (4, 3) and header.dtype == np.float32 and header.offset + 48 == path.stat().st_size

    with pytest.raises(CorruptArtifact) as err:
        check_npy(path, FIX, shape=[5, 3])
    assert _one_line(err) == f"{path}: holds shape (4, 3), its index records (5, 3); {FIX}"

    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(CorruptArtifact) as err:
        check_npy(path, FIX)
    assert _one_line(err) == (f"{path}: truncated: {len(data) - 5} bytes, its header ((4, 3) float32) needs "
                              f"{len(data)}; {FIX}")
    path.write_bytes(data + b"\0")
    with pytest.raises(CorruptArtifact, match="longer than its header says"):
        check_npy(path, FIX)
    path.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(CorruptArtifact) as err:
        check_npy(path, FIX)
    assert _one_line(err).startswith(f"{path}: not a readable .npy file (EOF") and err.value.path == str(path)
    path.unlink()
    with pytest.raises(CorruptArtifact, match="features.npy: missing; rerun the stage"):
        check_npy(path, FIX)


def test_npy_digest_catches_a_flipped_byte_and_is_hashed_once_per_unchanged_file(tmp_path, monkeypatch):
    path = _npy(tmp_path / "f.npy", np.ones((8, 2), np.float32))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(integrity.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    check_npy(path, FIX, sha256=digest)
    check_npy(path, FIX, sha256=digest)
    assert file_sha256(path) == digest and len(calls) == 1  # memoised: one hash for three checks

    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only the digest sees it
    path.write_bytes(bytes(data))
    monkeypatch.setattr(integrity, "_DIGESTS", {})  # a later process: nothing remembered
    check_npy(path, FIX)  # no digest recorded (an old index): the size check alone passes
    with pytest.raises(CorruptArtifact) as err:
        check_npy(path, FIX, sha256=digest)
    assert _one_line(err) == f"{path}: content does not match the SHA-256 recorded when it was written; {FIX}"


def test_hashing_writer_digest_is_the_file_digest(tmp_path):
    with open(tmp_path / "a.npy", "wb") as handle:
        writer = HashingWriter(handle)
        np.save(writer, np.arange(100_000, dtype=np.float32).reshape(1000, 100))
    data = (tmp_path / "a.npy").read_bytes()
    assert writer.hexdigest() == hashlib.sha256(data).hexdigest() and writer.bytes == len(data)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy")[3], np.arange(300, 400))


def test_safetensors_offsets_and_size(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3, 4), "b": torch.ones(4, dtype=torch.float16)}, str(path))
    header = check_safetensors(path, FIX)
    assert header["w"]["shape"] == [3, 4] and header["b"]["dtype"] == "F16"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert len(data) == 8 + n + 3 * 4 * 4 + 4 * 2

    path.write_bytes(data[:-1])
    with pytest.raises(CorruptArtifact) as err:
        check_safetensors(path, FIX)
    assert _one_line(err) == f"{path}: truncated: {len(data) - 1} bytes, its header describes {len(data)}; {FIX}"
    path.write_bytes(data[:4])
    with pytest.raises(CorruptArtifact, match="shorter than the 8-byte header length"):
        check_safetensors(path, FIX)
    path.write_bytes(data[: 8 + n // 2])
    with pytest.raises(CorruptArtifact, match=f"its header alone claims {8 + n}"):
        check_safetensors(path, FIX)
    path.write_bytes(data + b"xx")
    with pytest.raises(CorruptArtifact, match="longer than its header says"):
        check_safetensors(path, FIX)
    bad = json.dumps({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 40]}}).encode()
    path.write_bytes(len(bad).to_bytes(8, "little") + bad + bytes(40))
    with pytest.raises(CorruptArtifact, match=r"tensor 'w' \(F32 \[3, 4\]\) spans 40 bytes"):
        check_safetensors(path, FIX)
    path.write_bytes(len(bad).to_bytes(8, "little") + b"{" * len(bad))
    with pytest.raises(CorruptArtifact, match="unreadable safetensors header"):
        check_safetensors(path, FIX)


def test_torch_file_that_does_not_load_is_named(tmp_path):
    path = tmp_path / "trainer.pt"
    torch.save({"step": torch.tensor(3)}, path)
    assert int(load_torch(path, FIX, weights_only=True)["step"]) == 3
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CorruptArtifact) as err:
        load_torch(path, FIX, weights_only=True)
    text = _one_line(err)
    assert text.startswith(f"{path}: unreadable (") and text.endswith(f"; {FIX}")


def test_model_folder_checks_weights_json_and_required_files(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    check_model_folder(tmp_path, FIX, required=["config.json", "model.safetensors"])
    with pytest.raises(CorruptArtifact, match="heads.json: missing"):
        check_model_folder(tmp_path, FIX, required=["heads.json"])
    (tmp_path / "tokenizer.json").write_text('{"truncated": ')
    with pytest.raises(CorruptArtifact, match=r"tokenizer.json: corrupt JSON \(.*\); rerun the stage"):
        check_model_folder(tmp_path, FIX)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:-2])
    with pytest.raises(CorruptArtifact, match="model.safetensors: truncated"):
        check_model_folder(tmp_path, FIX)


def _image_table(raw, images):
    import hashlib
    import json

    (raw / "images").mkdir(parents=True)
    rows = []
    for name, data in images.items():
        (raw / "images" / name).write_bytes(data)
        rows.append({"image_id": name, "file": f"images/{name}", "sha256": hashlib.sha256(data).hexdigest(),
                     "bytes": len(data)})
    (raw / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_images_are_verified_against_their_recorded_digests_hashing_only_what_moved(tmp_path):
    """Issue 33.5: a same-size swap is named whenever a stage reads the images (cached sets or not),
    and an unchanged image is not hashed again on the next run (stat first)."""
    import os

    raw = tmp_path / "raw"
    _image_table(raw, {"a.png": b"12345", "b.png": b"abcdef"})
    assert verify_images(raw) == 2
    assert verify_images(raw) == 0  # nothing moved: no file read
    image = raw / "images/a.png"
    stat = image.stat()
    image.write_bytes(b"54321")  # same size, then the old mtime put back (as cp -p or touch -r do)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CorruptArtifact, match=r"images/a.png: SHA-256 \w+… differs from the \w+… images.jsonl "
                                              r"records \(changed since the download stage\); rerun the download"):
        verify_images(raw)
    image.write_bytes(b"1234")
    with pytest.raises(CorruptArtifact, match="a.png: 4 bytes, images.jsonl records 5"):
        verify_images(raw)
    image.unlink()
    with pytest.raises(CorruptArtifact, match="a.png: missing"):
        verify_images(raw)
    image.write_bytes(b"12345")  # put back as recorded: verified again, then remembered
    assert verify_images(raw) == 1 and verify_images(raw) == 0


def test_the_error_is_a_value_error_that_pickles():
    err = CorruptArtifact("data/x.npy", "truncated", "rerun it")
    assert isinstance(err, ValueError) and str(err) == "data/x.npy: truncated; rerun it"
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.path == "data/x.npy" and back.problem == "truncated"
