"""AsyncCheckpointWriter: exact round trips, snapshot isolation, failures that keep the previous checkpoint."""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections import OrderedDict

import pytest
import torch

from yatt_ray.checkpoint import AsyncCheckpointWriter, CheckpointError, CheckpointStore, load
from yatt_ray.checkpoint import writer as writer_module


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> CheckpointStore:
    root = str(tmp_path / "ckpt") if request.param == "local" else f"memory://w-{uuid.uuid4().hex}/ckpt"
    return CheckpointStore(root, keep_last=3)


def training_state(seed: int = 0):
    """A tiny model + AdamW after one step + RNG states: what a training loop checkpoints."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    random.seed(seed)
    payload = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "progress": {"epoch": 3, "prompt_offset": 1280, "seen_ids": [1, 5, 9]},
        "tied": OrderedDict(a=model[0].bias, b=model[0].bias, nested=[(model[0].bias,)]),
    }
    return model, opt, payload


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach().cpu(), b), (a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_exact(store):
    _, _, payload = training_state()
    with AsyncCheckpointWriter(store) as writer:
        handle = writer.save(10, payload, metadata={"epoch": 3})
        ref = handle.result(timeout=30)
    assert handle.error is None and handle.done() and handle.bytes_written > 0
    assert ref.step == 10 and ref.metadata == {"epoch": 3}
    loaded = load(store, store.latest_valid())
    assert_same(payload, loaded)
    assert loaded["model"]._metadata == payload["model"]._metadata  # load_state_dict's version info
    assert loaded["tied"]["a"] is loaded["tied"]["b"]  # one tensor saved once, still shared
    assert loaded["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0
    # the RNG states restore the same streams
    torch.set_rng_state(loaded["rng"]["torch"])
    random.setstate(loaded["rng"]["python"])
    after_restore = (torch.rand(3), random.random())
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    assert torch.equal(after_restore[0], torch.rand(3)) and after_restore[1] == random.random()


def test_snapshot_is_isolated_from_later_in_place_changes(store, monkeypatch):
    release = threading.Event()
    real_save = torch.save

    def gated_save(obj, f):  # hold the background write until the caller has changed everything
        release.wait(10)
        real_save(obj, f)

    monkeypatch.setattr(writer_module.torch, "save", gated_save)
    model, opt, payload = training_state()
    expected = load_free_copy(payload)
    writer = AsyncCheckpointWriter(store)
    handle = writer.save(1, payload)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    opt.state_dict()["state"][0]["exp_avg"].mul_(-1)
    payload["progress"]["seen_ids"].append(99)
    payload["progress"]["epoch"] = 4
    assert not handle.done()
    release.set()
    writer.close()
    assert handle.error is None
    assert_same(expected, load(store, handle.ref))


def load_free_copy(payload):
    return writer_module._walk(payload, lambda t: t.detach().clone(), copy_leaf=True, memo={})


def test_staging_buffers_are_reused_without_mixing_checkpoints(store):
    t = torch.zeros(64)
    with AsyncCheckpointWriter(store) as writer:
        first = writer.save(1, {"t": t})
        first.wait(30)
        buffers = [b for bufs in writer._staging._free.values() for b in bufs]
        t.fill_(1.0)
        second = writer.save(2, {"t": t})
        second.wait(30)
        assert any(
            b.data_ptr() == buffers[0].data_ptr() for bufs in writer._staging._free.values() for b in bufs
        )
    assert torch.equal(load(store, first.ref)["t"], torch.zeros(64))
    assert torch.equal(load(store, second.ref)["t"], torch.ones(64))


def test_background_failure_keeps_previous_checkpoint(store, monkeypatch, caplog):
    writer = AsyncCheckpointWriter(store)
    writer.save(1, {"model": torch.ones(3), "optimizer": torch.zeros(3)}).wait(30)
    calls = {"n": 0}
    real_save = torch.save

    def crash_on_second_file(obj, f):
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"half a file")
            raise OSError("disk full (simulated)")
        real_save(obj, f)

    monkeypatch.setattr(writer_module.torch, "save", crash_on_second_file)
    with caplog.at_level(logging.ERROR, logger="yatt_ray.checkpoint"):
        handle = writer.save(2, {"model": torch.full((3,), 2.0), "optimizer": torch.zeros(3)})
        assert handle.wait(30)
    assert isinstance(handle.error, OSError) and handle.ref is None
    assert writer.failures == 1
    assert "step 2 FAILED" in caplog.text
    with pytest.raises(CheckpointError, match="step 2 was not written"):
        handle.result()
    assert store.list_committed() == [1]
    latest = store.latest_valid()
    assert latest.step == 1 and torch.equal(load(store, latest)["model"], torch.ones(3))
    monkeypatch.setattr(writer_module.torch, "save", real_save)
    assert writer.save(2, {"model": torch.full((3,), 2.0)}).result(30).step == 2  # the step can be retried
    writer.close()


def test_save_sync_same_format_and_retention(store):
    writer = AsyncCheckpointWriter(store)
    _, _, payload = training_state()
    for step in (1, 2, 3):
        writer.save(step, payload)
    ref = writer.save_sync(4, payload, {"reason": "SIGTERM"})
    assert writer.last_handle.done()
    assert store.list_committed() == [2, 3, 4]  # keep_last=3 applied after each commit
    sync_loaded, async_loaded = load(store, ref), load(store, store.ref(3))
    assert_same(payload, sync_loaded)
    assert_same(sync_loaded, async_loaded)
    assert sorted(f.name for f in ref.manifest.files) == sorted(f.name for f in store.ref(3).manifest.files)
    writer.close()


def test_one_write_in_flight_and_the_wait_is_reported(store, monkeypatch):
    release = threading.Event()
    real_save = torch.save
    monkeypatch.setattr(writer_module.torch, "save", lambda o, f: (release.wait(10), real_save(o, f)))
    writer = AsyncCheckpointWriter(store)
    first = writer.save(1, {"x": torch.ones(2)})
    threading.Timer(0.2, release.set).start()
    second = writer.save(2, {"x": torch.ones(2)})
    assert first.done() and second.waited_s >= 0.1 and second.blocking_s >= second.waited_s
    writer.close()
    assert store.list_committed() == [1, 2]


def test_caller_errors_are_clear(store):
    writer = AsyncCheckpointWriter(store)
    writer.save(5, {"m": torch.ones(1)}).wait(30)
    with pytest.raises(CheckpointError, match=r"step 5 is already committed"):
        writer.save(5, {"m": torch.ones(1)})
    with pytest.raises(CheckpointError, match="payload key 'a/b'"):
        writer.save(6, {"a/b": 1})
    with pytest.raises(CheckpointError, match="non-empty dict"):
        writer.save(6, {})
    with pytest.raises(CheckpointError, match="step must be an integer >= 0, got -1"):
        writer.save(-1, {"m": 1})
    with pytest.raises(CheckpointError, match=r"metadata\['bad'\]"):
        writer.save(6, {"m": 1}, {"bad": {1, 2}})
    with pytest.raises(CheckpointError, match=r"no entries \['nope'\]"):
        load(store, store.ref(5), names=["nope"])
    writer.close()
    with pytest.raises(CheckpointError, match="after AsyncCheckpointWriter.close"):
        writer.save(7, {"m": 1})


def test_load_detects_damage(store):
    with AsyncCheckpointWriter(store) as writer:
        ref = writer.save(1, {"m": torch.arange(100.0)}).result(30)
    path = f"{ref.path}/m.pt"
    data = bytearray(store.fs.cat_file(path))
    data[-30] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load(store, ref)
