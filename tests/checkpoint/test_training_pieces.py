"""The pieces of training checkpoints that need no cluster: one metrics curve, the data-position filter,
resume URLs, the drill filesystem and the config section."""

import numpy as np
import pytest

from yatt_ray.checkpoint import CheckpointStore
from yatt_ray.checkpoint.training import _split_step, optimizer_ranks
from yatt_ray.config import load_config
from yatt_ray.data.feed import SKIP, MarkConsumed
from yatt_ray.errors import ConfigError
from yatt_ray.metrics.history import RESUME_KEY, MetricRow, rewind_history
from yatt_ray.testing.faults import FAIL_WRITES


def test_rewind_keeps_the_redone_steps_last_version():
    rows = [
        MetricRow("eval", {"step": 0, "eval/accuracy": 0.1}),
        *(MetricRow("train", {"step": s, "reward_mean": s / 10}) for s in (1, 2, 3, 4)),  # died after step 4
        MetricRow("checkpoint", {"step": 2, RESUME_KEY: 2}),
        MetricRow("train", {"step": 3, "reward_mean": 0.33}),
        MetricRow("train", {"step": 4, "reward_mean": 0.44}),
        MetricRow("train", {"step": 5, "reward_mean": 0.55}),
        MetricRow("eval", {"step": 5, "eval/accuracy": 0.5}),
    ]
    kept, dropped = rewind_history(rows)
    train = [(r.step, r.values["reward_mean"]) for r in kept if r.kind == "train"]
    assert train == [(1, 0.1), (2, 0.2), (3, 0.33), (4, 0.44), (5, 0.55)]
    assert dropped == 2
    assert [r.step for r in kept if r.kind == "eval"] == [0, 5]
    assert any(r.kind == "checkpoint" for r in kept)


def test_mark_consumed_flags_the_consumed_rows_and_keeps_every_row():
    batch = {"id": np.array([5, 1, 9, 3]), "prompt": np.array(["a", "b", "c", "d"])}
    out = MarkConsumed([9, 5, 100])(batch)
    assert out[SKIP].tolist() == [True, False, True, False] and out["prompt"].tolist() == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("url", "root", "step"),
    [
        ("/runs/a/checkpoints", "/runs/a/checkpoints", None),
        ("/runs/a/checkpoints/step_00000040", "/runs/a/checkpoints", 40),
        ("s3://b/run/step_00000002/", "s3://b/run", 2),
    ],
)
def test_resume_url_names_a_run_or_one_step(url, root, step):
    assert _split_step(url) == (root, step)


def test_faulty_filesystem_fails_writes_like_a_full_disk(tmp_path):
    store = CheckpointStore(f"faulty://{tmp_path}")
    pending = store.begin(1)
    pending.write("a.bin", b"ok")
    store.commit(pending)
    (tmp_path / FAIL_WRITES).write_text("")
    pending = store.begin(2)
    with pytest.raises(OSError, match="No space left"):
        pending.write("a.bin", b"no")
    pending.abort()
    assert store.latest_valid().step == 1  # the earlier checkpoint is untouched


def test_checkpoint_config_errors_name_key_value_and_fix():
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["checkpoint.every_steps=0", "checkpoint.keep_last=0", "checkpoint.export_hf_steps=[0]"]
        )
    text = str(err.value)
    assert "checkpoint.every_steps=0 must be >= 1" in text
    assert "checkpoint.keep_last=0" in text and "checkpoint.export_hf_steps=[0]" in text
    c = load_config(None, ["checkpoint.storage_options.endpoint_url=http://127.0.0.1:9000"]).checkpoint
    assert c.storage_options == {"endpoint_url": "http://127.0.0.1:9000"} and c.resume == "auto"


def test_resume_on_another_tensor_parallel_size_says_both_sizes(tmp_path):
    from yatt_ray.checkpoint import CheckpointError
    from yatt_ray.checkpoint.training import TrainingCheckpoints
    from yatt_ray.controller import Layout

    config = load_config(None, [f"checkpoint.dir={tmp_path}", "train.tp_size=2", "train.dp_size=1"])
    layout = Layout(rank=0, dp_rank=0, dp_size=1, tp_rank=0, tp_size=2)
    checkpoints = TrainingCheckpoints(config, layout, control=None, hub=None)
    with pytest.raises(CheckpointError, match=r"train.tp_size=1, this run has train.tp_size=2.*resume with"):
        checkpoints._check_layout({"tp_size": 1, "dp_size": 2, "world_size": 2}, str(tmp_path), 4)
    checkpoints._check_layout(
        {"tp_size": 2, "dp_size": 4, "world_size": 8}, str(tmp_path), 4
    )  # dp may differ


def test_idle_rows_that_trail_their_step_are_not_redone_steps():
    """The driver writes a step's idle row once the next step's spans arrive: after that step's training row."""
    rows = [
        MetricRow("train", {"step": 1, "reward_mean": 0.1}),
        MetricRow("train", {"step": 2, "reward_mean": 0.2}),
        MetricRow("idle", {"step": 1, "idle/mean": 0.3, "idle/max": 0.4}),
        MetricRow("train", {"step": 3, "reward_mean": 0.3}),
        MetricRow("idle", {"step": 2, "idle/mean": 0.3, "idle/max": 0.4}),
    ]
    kept, dropped = rewind_history(rows)
    assert dropped == 0 and kept == rows


def _layout(dp_rank: int, dp_size: int, tp_rank: int = 0, tp_size: int = 1):
    from yatt_ray.roles import Layout

    return Layout(dp_rank * tp_size + tp_rank, dp_rank, dp_size, tp_rank, tp_size)


@pytest.mark.parametrize(
    "saved, layout, sharded, ranks",
    [
        ({"dp_size": 2}, _layout(1, 2), False, [0]),  # replicated: DP rank 0 holds it (old markers too)
        (
            {"dp_size": 2, "distributed_optimizer": False},
            _layout(1, 2, 1, 2),
            True,
            [1],
        ),  # its TP rank's DP 0
        ({"dp_size": 2, "distributed_optimizer": True}, _layout(1, 2), True, [1]),  # unchanged: its own file
        ({"dp_size": 2, "distributed_optimizer": True}, _layout(1, 2, 1, 2), True, [3]),
        ({"dp_size": 2, "distributed_optimizer": True}, _layout(0, 1), False, [0, 1]),  # cut 2 shards to 1
        ({"dp_size": 2, "distributed_optimizer": True}, _layout(2, 4, 1, 2), True, [1, 3]),  # 2 -> 4, TP 1
        ({"dp_size": 1, "distributed_optimizer": True}, _layout(1, 2), True, [0]),  # dp 1 never shards
    ],
)
def test_a_rank_reads_the_optimizer_files_that_hold_its_part(saved, layout, sharded, ranks):
    assert optimizer_ranks(saved, layout, sharded) == ranks
