"""The store and the writer against S3 (a local moto server on 127.0.0.1: the `s3_options` fixture in
tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import logging
import uuid

import pytest
import torch

from yatt_ray.checkpoint import AsyncCheckpointWriter, CheckpointStore, load

if (
    importlib.util.find_spec("moto") is None
):  # never imported here: moto.server pulls in Flask (see tests/conftest.py)
    pytest.skip("moto[server] is not installed (pip install 'moto[server]')", allow_module_level=True)
pytest.importorskip("s3fs", reason="s3fs is not installed: fsspec needs it for s3:// URLs")


@pytest.fixture
def store(s3_options) -> CheckpointStore:
    return CheckpointStore(f"s3://ckpt/{uuid.uuid4().hex}/run", keep_last=2, storage_options=s3_options)


def test_s3_async_round_trip_retention_and_invisible_partial(store, s3_options):
    state = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4)}, "progress": {"epoch": 1}}
    with AsyncCheckpointWriter(store) as writer:
        for step in (1, 2, 3):
            writer.save(step, state, {"step": step})
    assert store.list_committed() == [2, 3]
    pending = store.begin(4)  # object stores write into the final directory; the manifest commits it
    pending.write("model.pt", b"half written")
    reader = CheckpointStore(store.root_url, storage_options=s3_options)
    assert reader.list_committed() == [2, 3]
    latest = reader.latest_valid()
    assert latest is not None and latest.step == 3 and latest.metadata == {"step": 3}
    loaded = load(reader, latest)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["progress"] == {"epoch": 1}


def test_s3_corruption_falls_back(store, caplog):
    with AsyncCheckpointWriter(store) as writer:
        writer.save(1, {"m": torch.ones(8)})
        writer.save(2, {"m": torch.full((8,), 2.0)})
    path = f"{store.step_path(2)}/m.pt"
    data = bytearray(store.fs.cat_file(path))
    data[-40] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    with caplog.at_level(logging.WARNING, logger="yatt_ray.checkpoint"):
        ref = store.latest_valid()
    assert ref is not None and ref.step == 1
    assert "step 2" in caplog.text and "'m.pt'" in caplog.text
