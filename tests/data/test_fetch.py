"""Downloads from an HTTP server on 127.0.0.1 serving archives built here (good, resumed,
corrupt, truncated, path-escaping), and the hub path offline against a hub-layout cache."""

import hashlib
import io
import os
import tarfile

import pytest

from mmcse.data.fetch import DownloadError, http_download, hub_file, safe_extract
from tests.data.served import RangeHandler, make_zip, tar_gz

GOOD = {"flickr/dataset.json": b'{"images": []}', "flickr/images/1.jpg": os.urandom(300_000)}


def test_download_verifies_and_extracts(server, tmp_path):
    files, url = server
    blob = tar_gz(GOOD)
    (files / "good.tar.gz").write_bytes(blob)
    got = http_download(f"{url}/good.tar.gz", tmp_path / "dl/good.tar.gz", hashlib.sha256(blob).hexdigest(),
                        progress=False)
    assert got.read_bytes() == blob and not (tmp_path / "dl/good.tar.gz.part").exists()
    out = safe_extract(got, tmp_path / "data/flickr30k")
    assert (out / "flickr/images/1.jpg").read_bytes() == GOOD["flickr/images/1.jpg"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["flickr30k"]  # no temp folder left
    # a verified file is not fetched again (the server is not even asked)
    (files / "good.tar.gz").unlink()
    assert http_download(f"{url}/good.tar.gz", got, hashlib.sha256(blob).hexdigest(), progress=False) == got


def test_interrupted_download_resumes_with_a_range_request(server, tmp_path):
    files, url = server
    blob = make_zip(GOOD)
    (files / "a.zip").write_bytes(blob)
    dest = tmp_path / "a.zip"
    with pytest.raises(DownloadError, match="rerun to resume"):
        http_download(f"{url}/cut/a.zip", dest, progress=False)
    part = tmp_path / "a.zip.part"
    assert not dest.exists() and 0 < part.stat().st_size < len(blob)
    http_download(f"{url}/a.zip", dest, hashlib.sha256(blob).hexdigest(), progress=False)
    assert dest.read_bytes() == blob and RangeHandler.ranges == [f"bytes={len(blob) // 2}-"]


def test_corrupt_download_is_deleted_with_a_clear_error(server, tmp_path):
    files, url = server
    (files / "c.tar.gz").write_bytes(b"garbage" * 100)
    with pytest.raises(DownloadError, match="c.tar.gz: SHA-256 mismatch"):
        http_download(f"{url}/c.tar.gz", tmp_path / "c.tar.gz", "0" * 64, progress=False)
    assert list(tmp_path.iterdir()) == [files]
    with pytest.raises(DownloadError, match="HTTP 404"):
        http_download(f"{url}/missing.zip", tmp_path / "m.zip", progress=False)


def test_truncated_archive_leaves_no_output(server, tmp_path):
    files, url = server
    blob = tar_gz(GOOD)
    (files / "t.tar.gz").write_bytes(blob[: len(blob) * 2 // 3])
    got = http_download(f"{url}/t.tar.gz", tmp_path / "t.tar.gz", progress=False)  # no digest known
    with pytest.raises(DownloadError, match="t.tar.gz: not a complete zip or tar archive"):
        safe_extract(got, tmp_path / "data/flickr30k")
    assert list((tmp_path / "data").iterdir()) == []


@pytest.mark.parametrize("make", [make_zip, tar_gz], ids=["zip", "tar.gz"])
def test_member_escaping_the_folder_is_refused(tmp_path, make):
    archive = tmp_path / "evil.bin"
    archive.write_bytes(make({"ok.txt": b"fine", "../escaped.txt": b"pwned"}))
    with pytest.raises(DownloadError, match=r"'\.\./escaped\.txt' would be written outside"):
        safe_extract(archive, tmp_path / "data/x")
    assert not (tmp_path / "data/escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()
    assert list((tmp_path / "data").iterdir()) == []


def test_tar_symlink_out_of_the_folder_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("data/link")
        link.type, link.linkname = tarfile.SYMTYPE, "../../etc/passwd"
        tar.addfile(link)
    (tmp_path / "l.tar").write_bytes(buf.getvalue())
    with pytest.raises(DownloadError, match="outside"):
        safe_extract(tmp_path / "l.tar", tmp_path / "out")


def test_offline_http_download_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("MMCSE_OFFLINE", "1")
    with pytest.raises(DownloadError, match="offline"):
        http_download("http://127.0.0.1:9/never", tmp_path / "x.zip", progress=False)


def test_hub_file_offline_from_a_hub_layout_cache(tmp_path, monkeypatch):
    """The cache as the hub client lays it out: refs/main names a snapshot holding the file."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "datasets--nlphuji--flickr30k" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "flickr_annotations_30k.csv").write_text("raw,sentids,split,filename,img_id\n")
    (cache / "datasets--nlphuji--flickr30k" / "refs").mkdir()
    (cache / "datasets--nlphuji--flickr30k" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    got = hub_file("nlphuji/flickr30k", "flickr_annotations_30k.csv")
    assert got == snapshot / "flickr_annotations_30k.csv"
    with pytest.raises(DownloadError, match="not in the local Hugging Face cache.*offline"):
        hub_file("nlphuji/flickr30k", "flickr30k-images.zip")


def test_without_network_the_hub_fails_once_in_seconds_with_a_command_that_exists(tmp_path, monkeypatch):
    """Issue 33.9: no HF_HUB_OFFLINE, no network: one connection attempt (no client retries), then
    the `hf download` command to run elsewhere, which the environment installs."""
    import shutil
    import socket
    import sys
    import time

    import huggingface_hub
    import huggingface_hub.constants as constants

    from mmcse import hub

    attempts = []

    def refused(address, *args, **kwargs):
        attempts.append(address)
        raise OSError("Network is unreachable")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("MMCSE_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(hub, "_REACHABLE", {})
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, local_files_only=False, **k:
                        (_ for _ in ()).throw(FileNotFoundError()) if local_files_only else pytest.fail("fetched"))
    started = time.monotonic()
    for _ in range(2):  # the second call asks no host again
        with pytest.raises(DownloadError) as err:
            hub_file("princeton-nlp/datasets-for-simcse", "senteval.tar")
    assert time.monotonic() - started < 5 and len(attempts) == 1
    assert "huggingface.co:443 cannot be reached (OSError: Network is unreachable)" in str(err.value)
    assert "run `hf download --repo-type dataset princeton-nlp/datasets-for-simcse senteval.tar`" in str(err.value)
    assert shutil.which("hf", path=os.path.dirname(sys.executable)) is not None  # the command it names is installed
