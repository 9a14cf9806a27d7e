import pytest

from yatt_ray.metrics import JsonlSink, plot_history, read_jsonl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def height(png: bytes) -> int:
    return int.from_bytes(png[20:24], "big")  # the IHDR chunk's height field


def _history(n=5):
    return [{"step": i, "reward_mean": i / n, "accuracy": i / (2 * n), "loss": 1.0 - i / n} for i in range(n)]


def test_plot_writes_a_png(tmp_path):
    out = plot_history(_history(), tmp_path / "plots" / "curves.png", title="GRPO on the demo task")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def test_missing_keys_skipped_and_fewer_subplots(tmp_path):
    # one subplot (only "reward_mean" present; "accuracy" missing everywhere) -> a shorter image than two
    history = [{"step": i, "reward_mean": float(i)} for i in range(4)] + [{"step": 4}]
    one = plot_history(history, tmp_path / "one.png").read_bytes()
    two = plot_history(_history(), tmp_path / "two.png").read_bytes()
    assert one[:8] == PNG_MAGIC and height(one) < height(two)


def test_from_jsonl_sink(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        for step, rec in enumerate(_history()):
            sink.write(step, {k: v for k, v in rec.items() if k != "step"})
    out = plot_history(read_jsonl(tmp_path / "m.jsonl"), tmp_path / "c.png", keys=("loss",))
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="history is empty"):
        plot_history([], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"none of the keys \['accuracy'\].*available keys: \['loss'\]"):
        plot_history([{"step": 0, "loss": 1.0}], tmp_path / "x.png", keys=("accuracy",))
    assert not (tmp_path / "x.png").exists()
