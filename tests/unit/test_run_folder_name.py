"""`output.name`: the run folder a second command finds again (the continuation itself runs in
tests/integration/test_checkpoint_resume.py)."""

from __future__ import annotations

import pytest

from yatt_ray.config import ConfigError, load_config
from yatt_ray.fit import _output_dir


def test_unnamed_runs_get_a_fresh_folder_each(tmp_path):
    config = load_config(None, [f"output.dir={tmp_path}"])
    first, second = _output_dir(config), _output_dir(config)
    assert first != second and first.parent == second.parent == tmp_path


def test_a_named_run_finds_its_folder_again_and_keeps_the_earlier_curve(tmp_path):
    config = load_config(None, [f"output.dir={tmp_path}", "output.name=qwen7b-gsm8k"])
    folder = _output_dir(config)
    assert folder == tmp_path / "qwen7b-gsm8k"
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "checkpoints").mkdir()
    assert _output_dir(config) == folder  # the same folder, its checkpoints where they were
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


def test_a_url_run_folder_is_refused_with_the_fix_not_made_a_local_folder():
    with pytest.raises(ConfigError, match=r"output.dir='s3://bucket/runs'.*checkpoint.dir=s3://"):
        load_config(None, ["output.dir=s3://bucket/runs"])
