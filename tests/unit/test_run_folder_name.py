"""`output.name`: the run folder a second command finds again (the continuation itself runs in
tests/integration/test_checkpoint_resume.py)."""

from __future__ import annotations

import pytest

from yatt_ray.config import ConfigError, load_config
from yatt_ray.fit import _output_dir


def test_unnamed_runs_get_a_fresh_folder_each(tmp_path):
    config = load_config(None, [f"output.dir={tmp_path}"])
    (first, _), (second, _) = _output_dir(config), _output_dir(config)
    assert first != second and first.parent == second.parent == tmp_path


def test_a_named_run_finds_its_folder_again_and_keeps_the_earlier_curve(tmp_path):
    config = load_config(None, [f"output.dir={tmp_path}", "output.name=qwen7b-gsm8k"])
    folder, remote = _output_dir(config)
    assert remote is None
    assert folder == tmp_path / "qwen7b-gsm8k"
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "checkpoints").mkdir()
    assert _output_dir(config)[0] == folder  # the same folder, its checkpoints where they were
    kept = list(folder.glob("metrics-*.jsonl"))
    assert (folder / "checkpoints").is_dir() and not (folder / "metrics.jsonl").exists()
    assert len(kept) == 1 and kept[0].read_text() == '{"step": 1}\n'
    (folder / "metrics.jsonl").write_text('{"step": 2}\n')
    _output_dir(config)  # a third run: both earlier files kept, under names of their own
    assert sorted(p.read_text() for p in folder.glob("metrics-*.jsonl")) == ['{"step": 1}\n', '{"step": 2}\n']


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "-x", "two words", "runs/"])
def test_a_name_that_is_not_one_folder_is_refused_naming_the_key(name):
    with pytest.raises(ConfigError, match=r"output.name=.* must be one folder name"):
        load_config(None, [f"output.name={name}"])


def test_a_url_run_folder_is_written_locally_and_uploaded_there(tmp_path, monkeypatch):
    """output.dir an fsspec URL: a local mirror of `<url>/<name>` is written (its checkpoints go to the URL
    directly); a second run of the name keeps the earlier curve there as metrics-<stamp>.jsonl."""
    import fsspec

    from yatt_ray.shared_storage import upload_tree

    monkeypatch.setenv("YATT_RAY_RUN_CACHE", str(tmp_path / "cache"))
    config = load_config(None, ["output.dir=memory://bucket/runs", "output.name=r1"])
    local, remote = _output_dir(config)
    assert remote == "memory://bucket/runs/r1" and local == tmp_path / "cache/memory/bucket/runs/r1"
    assert config.checkpoint.dir == "memory://bucket/runs/r1/checkpoints"
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    (local / "tensorboard").mkdir()
    (local / "tensorboard" / "events").write_text("e")
    assert upload_tree(local, remote) == 2
    fs = fsspec.filesystem("memory")
    assert fs.cat("/bucket/runs/r1/tensorboard/events") == b"e"
    again = load_config(None, ["output.dir=memory://bucket/runs", "output.name=r1"])
    assert _output_dir(again)[0] == local and not (local / "metrics.jsonl").exists()
    (kept,) = fs.glob("/bucket/runs/r1/metrics-*.jsonl")
    assert fs.cat(kept) == b'{"step": 1}\n' and not fs.exists("/bucket/runs/r1/metrics.jsonl")
