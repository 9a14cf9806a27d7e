"""`model.path` as a local directory, an fsspec URL or a Hugging Face hub id: what is fetched, where, and once
(a whole run from an S3 model: tests/integration/test_checkpoint_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from yatt_ray.errors import ConfigError
from yatt_ray.model_source import COMPLETE, ModelSource, fetch, model_source


def test_the_kind_is_read_from_the_path(tmp_path):
    assert model_source("s3://bucket/models/qwen").kind == "url"
    assert model_source("gs://bucket/qwen/").kind == "url"
    assert model_source("Qwen/Qwen2.5-7B-Instruct").kind == "hub"
    assert model_source(str(tmp_path)).kind == "local"
    (tmp_path / "Qwen" / "local").mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a relative folder that exists wins over the hub id it looks like
        assert model_source("Qwen/local").kind == "local"
    finally:
        os.chdir(cwd)
    assert model_source("/no/such/dir").kind == "local"  # reported missing by the model checks


@pytest.fixture
def s3_env(s3_options, monkeypatch, tmp_path):
    """The standard AWS variables pointing at the test's S3 server (no yatt_ray key), and a model cache."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("YATT_RAY_MODEL_CACHE", str(tmp_path / "cache"))
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3_options["endpoint_url"], key="testing", secret="testing")


def test_a_model_on_s3_is_fetched_once_with_the_standard_credentials(s3_env, tmp_path):
    import uuid

    prefix = f"ckpt/{uuid.uuid4().hex}/qwen"
    s3_env.pipe({f"{prefix}/config.json": b'{"model_type": "qwen2"}', f"{prefix}/sub/tokenizer.json": b"{}"})
    source = ModelSource(f"s3://{prefix}", "url")
    local, revision = fetch(source)
    assert revision is None and local.startswith(str(tmp_path / "cache"))
    copy = Path(local)
    assert json.loads((copy / "config.json").read_text()) == {"model_type": "qwen2"}
    assert (copy / "sub" / "tokenizer.json").read_text() == "{}"
    assert (copy / COMPLETE).read_text() == source.given
    s3_env.rm(prefix, recursive=True)  # gone from S3: the cached copy serves, nothing is fetched again
    assert fetch(source)[0] == local


def test_a_url_without_a_model_names_the_key(s3_env):
    with pytest.raises(ConfigError, match=r"model.path='s3://ckpt/nothing-here' holds no config.json"):
        fetch(ModelSource("s3://ckpt/nothing-here", "url"))


def test_a_hub_id_resolves_from_a_prefilled_cache_offline(tmp_path):
    """No download is possible here: the Hugging Face cache is filled as `snapshot_download` leaves it, and the
    hub is offline (HF_HUB_OFFLINE=1, as on a cluster without internet)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    script = textwrap.dedent("""
        import json
        from yatt_ray.model_source import fetch, model_source
        source = model_source("acme/tiny")
        print(json.dumps([source.kind, *fetch(source)]))
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    kind, local, revision = json.loads(out.stdout.strip().splitlines()[-1])
    assert kind == "hub" and revision == commit and local == str(repo / "snapshots" / commit)
