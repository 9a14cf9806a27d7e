"""A checkpoint written by a newer yatt_ray (a newer manifest format_version, or a newer run format) is not
damage: the resume stops with an error naming the versions and the fix (upgrade yatt_ray), before any work,
and the checkpoint stays where it is, never skipped for an older one nor moved aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint.test_resume_safety import config_for, write_run_checkpoint
from yatt_ray.checkpoint.driver import check_checkpoints
from yatt_ray.checkpoint.store import FORMAT_VERSION, MANIFEST_NAME, CheckpointFormatError, step_dir_name
from yatt_ray.checkpoint.training import RUN_FORMAT, choose_resume, rank_url


def rewrite_manifest(folder: str, step: int, change) -> None:
    path = Path(folder, step_dir_name(step), MANIFEST_NAME)
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def newer_run_format(manifest: dict) -> None:
    manifest["metadata"]["format"] = "yatt_ray.run/3"


def newer_manifest(manifest: dict) -> None:
    manifest["format_version"] = FORMAT_VERSION + 1


@pytest.mark.parametrize(
    "where, change, names",
    [
        ("run", newer_run_format, ["'yatt_ray.run/3'", repr(RUN_FORMAT)]),
        ("run", newer_manifest, [f"format_version {FORMAT_VERSION + 1}", f"reads up to {FORMAT_VERSION}"]),
        ("rank", newer_manifest, [f"format_version {FORMAT_VERSION + 1}", f"reads up to {FORMAT_VERSION}"]),
    ],
)
def test_a_newer_format_is_refused_with_the_fix_and_left_in_place(tmp_path, where, change, names):
    """Step 4 in a newer format over a valid step 2: the resume (on the driver, and at a restart) refuses with
    the versions and `upgrade yatt_ray`, instead of falling back to step 2, which would set step 4 aside."""
    own = str(tmp_path / "ckpt")
    for step in (2, 4):
        write_run_checkpoint(own, step)
    rewrite_manifest(own if where == "run" else rank_url(own, 0), 4, change)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    config = config_for(own)
    for restart in (False, True):
        with pytest.raises(CheckpointFormatError, match="upgrade yatt_ray") as err:
            choose_resume(config.checkpoint, restart=restart)
        assert all(name in str(err.value) for name in names), str(err.value)
    with pytest.raises(CheckpointFormatError, match="upgrade yatt_ray"):
        check_checkpoints(config)  # the driver, before any cluster work
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing moved


def test_an_older_run_format_is_still_skipped_as_unreadable(tmp_path):
    """The other direction is unchanged: a run marker in an older run format (pickled run state) is skipped
    with a warning, and the resume takes the newest readable step."""
    own = str(tmp_path / "ckpt")
    for step in (2, 4):
        write_run_checkpoint(own, step)
    rewrite_manifest(own, 4, lambda m: m["metadata"].update(format="yatt_ray.run/1"))
    assert choose_resume(config_for(own).checkpoint)[:2] == (own, 2)
