"""CheckpointStore: commit by manifest, checksums and fallback, retention, on a local disk and memory://."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

import pytest

from yatt_ray.checkpoint import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointFormatError,
    CheckpointStore,
)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://test-{uuid.uuid4().hex}/ckpt"


def commit(store: CheckpointStore, step: int, files: dict[str, bytes] | None = None, metadata=None):
    pending = store.begin(step)
    for name, data in (files or {"a.bin": f"step {step}".encode()}).items():
        pending.write(name, data)
    return store.commit(pending, metadata)


def flip_byte(store: CheckpointStore, step: int, name: str) -> None:
    path = f"{store.step_path(step)}/{name}"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))


def test_round_trip_and_manifest(root):
    store = CheckpointStore(root)
    files = {"weights.bin": b"\x00\x01" * 1000, "extra.json": b'{"x": 1}'}
    ref = commit(store, 7, files, metadata={"epoch": 2, "prompts_seen": 1234})
    assert store.list_committed() == [7]
    assert ref.path.endswith("step_00000007")
    for name, data in files.items():
        assert store.read(ref, name) == data
        with store.open(ref, name) as f:
            assert f.read() == data
    raw = json.loads(store.fs.cat_file(f"{ref.path}/{MANIFEST_NAME}"))
    assert raw["step"] == 7 and raw["format_version"] == FORMAT_VERSION
    assert raw["metadata"] == {"epoch": 2, "prompts_seen": 1234}
    assert {f["name"]: (f["size"], f["sha256"]) for f in raw["files"]} == {
        n: (len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()
    }
    again = CheckpointStore(root).latest_valid()  # a fresh reader sees the same
    assert again is not None and again.step == 7 and again.metadata["prompts_seen"] == 1234


def test_uncommitted_write_is_invisible(root):
    store = CheckpointStore(root)
    commit(store, 1)
    pending = store.begin(2)
    pending.write("a.bin", b"half")
    assert store.fs.exists(f"{pending.path}/a.bin")
    if store.is_local:
        assert pending.path.endswith("step_00000002.partial")
    assert store.list_committed() == [1]
    assert store.latest_valid().step == 1
    assert not store.exists(2)
    # retention never touches a write in progress (newer than the newest commit)
    assert store.apply_retention() == []
    store.commit(pending)
    assert store.list_committed() == [1, 2]
    assert not store.fs.exists(store.step_path(2) + ".partial")


def test_corrupted_checkpoint_falls_back_with_warning(root, caplog):
    store = CheckpointStore(root)
    commit(store, 1, {"w.bin": b"one" * 100})
    commit(store, 2, {"w.bin": b"two" * 100, "o.bin": b"opt" * 100})
    flip_byte(store, 2, "o.bin")
    with caplog.at_level(logging.WARNING, logger="yatt_ray.checkpoint"):
        ref = store.latest_valid()
    assert ref is not None and ref.step == 1
    assert any("step 2" in r.getMessage() and "'o.bin'" in r.getMessage() for r in caplog.records)


def test_missing_or_truncated_file_falls_back(root, caplog):
    store = CheckpointStore(root)
    commit(store, 1)
    commit(store, 2, {"w.bin": b"x" * 50})
    commit(store, 3, {"w.bin": b"y" * 50})
    store.fs.pipe_file(f"{store.step_path(3)}/w.bin", b"y" * 10)
    store.fs.rm(f"{store.step_path(2)}/w.bin")
    with caplog.at_level(logging.WARNING, logger="yatt_ray.checkpoint"):
        assert store.latest_valid().step == 1
    text = caplog.text
    assert "step 3" in text and "10 bytes" in text and "step 2" in text and "missing" in text


def test_unreadable_manifest_is_skipped_but_newer_format_raises(root):
    store = CheckpointStore(root)
    commit(store, 1)
    commit(store, 2)
    store.fs.pipe_file(f"{store.step_path(2)}/{MANIFEST_NAME}", b"{not json")
    assert store.latest_valid().step == 1
    raw = json.loads(store.fs.cat_file(f"{store.step_path(1)}/{MANIFEST_NAME}"))
    raw["format_version"] = FORMAT_VERSION + 1
    store.fs.pipe_file(f"{store.step_path(1)}/{MANIFEST_NAME}", json.dumps(raw).encode())
    with pytest.raises(CheckpointFormatError, match="upgrade yatt_ray"):
        store.latest_valid()  # falls back from the unreadable step 2, but never past a newer format


def test_retention_keep_last_and_keep_every(root):
    store = CheckpointStore(root, keep_last=2, keep_every=5)
    for step in range(1, 13):
        commit(store, step)
        store.apply_retention(known_valid=step)
    assert store.list_committed() == [5, 10, 11, 12]


def test_retention_never_deletes_newest_valid(root, caplog):
    store = CheckpointStore(root, keep_last=1)
    commit(store, 1)
    commit(store, 2)
    flip_byte(store, 2, "a.bin")
    with caplog.at_level(logging.WARNING, logger="yatt_ray.checkpoint"):
        deleted = store.apply_retention()
    assert deleted == []
    assert store.list_committed() == [1, 2]
    commit(store, 3)
    assert store.apply_retention(known_valid=3) == [1, 2]
    assert store.list_committed() == [3]


def test_retention_removes_only_stale_unfinished_dirs(root):
    store = CheckpointStore(root, keep_last=5)
    commit(store, 1)
    crashed = CheckpointStore(root)  # another writer that died mid-write of step 2
    crashed.begin(2).write("a.bin", b"partial")
    commit(store, 3)
    in_progress = store.begin(4)
    in_progress.write("a.bin", b"writing")
    assert store.apply_retention(known_valid=3) == [2]
    assert not store.fs.exists(crashed.partial_path(2))
    assert store.fs.exists(f"{in_progress.path}/a.bin")
    store.commit(in_progress)
    assert store.list_committed() == [1, 3, 4]


def test_delete_removes_manifest_first_and_all_files(root):
    store = CheckpointStore(root)
    commit(store, 1)
    commit(store, 2)
    store.delete(2)
    assert store.list_committed() == [1]
    assert not store.fs.exists(store.step_path(2))


def test_clear_errors(root):
    with pytest.raises(CheckpointError, match="keep_last=0"):
        CheckpointStore(root, keep_last=0)
    with pytest.raises(CheckpointError, match="keep_every=-2"):
        CheckpointStore(root, keep_every=-2)
    store = CheckpointStore(root)
    ref = commit(store, 4)
    with pytest.raises(CheckpointError, match=r"step 4 is already committed.*store.delete\(4\)"):
        store.begin(4)
    with pytest.raises(CheckpointError, match="invalid checkpoint file name 'a/b'"):
        store.begin(5).write("a/b", b"")
    with pytest.raises(CheckpointError, match="reserved for the commit marker"):
        store.begin(6).write(MANIFEST_NAME, b"")
    with pytest.raises(CheckpointError, match=r"no file 'nope'.*\['a.bin'\]"):
        store.read(ref, "nope")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*committed steps are \[4\]"):
        store.ref(9)
    with pytest.raises(CheckpointError, match="metadata\\['when'\\]"):
        store.commit(store.begin(7), {"when": object()})


def test_empty_store(root):
    store = CheckpointStore(root)
    assert store.list_committed() == []
    assert store.latest_valid() is None
    assert store.apply_retention() == []
