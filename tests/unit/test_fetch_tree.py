"""`shared_storage.fetch_tree`: the final policy copied into the run folder from where Ray Train kept it."""

import fsspec

from yatt_ray.shared_storage import fetch_tree


def test_a_remote_folder_is_copied_whole_and_replaces_the_earlier_copy(tmp_path):
    fs = fsspec.filesystem("memory")
    for name, body in {"config.json": b"{}", "model.safetensors": b"w" * 100, "sub/tok.json": b"t"}.items():
        fs.pipe(f"/ckpt/policy_hf/{name}", body)
    target = tmp_path / "run" / "final_hf"
    target.mkdir(parents=True)
    (target / "stale.safetensors").write_bytes(b"old")  # an earlier run's final policy
    assert fetch_tree("memory://ckpt/policy_hf", target) == str(target)
    got = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert got == {"config.json": b"{}", "model.safetensors": b"w" * 100, "sub/tok.json": b"t"}


def test_a_local_folder_is_linked_not_copied(tmp_path):
    src = tmp_path / "ray" / "policy_hf"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 100)
    (src / "sub" / "tok.json").write_bytes(b"t")
    target = tmp_path / "final_hf"
    fetch_tree(str(src), target)
    assert (target / "sub" / "tok.json").read_bytes() == b"t"
    assert (target / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino
