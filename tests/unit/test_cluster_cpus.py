"""`cluster.cpus_per_worker` None: the node's CPUs shared among its training workers (no Ray cluster: the
node list is faked); a local node's environment."""

from __future__ import annotations

import os

import pytest

from yatt_ray import cluster, load_config
from yatt_ray.cluster import resolve_cpus_per_worker
from yatt_ray.placement import shared_cpus


def cfg(*over):
    return load_config(None, ["train.prompts_per_step=8", *over])


@pytest.mark.parametrize(
    ("cores", "dp", "expected"), [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 8), (7, 2, 3)]
)
def test_a_local_cluster_shares_this_machines_cores(monkeypatch, cores, dp, expected):
    monkeypatch.setattr(cluster, "local_cores", lambda: cores)
    config = cfg(f"train.dp_size={dp}")
    resolve_cpus_per_worker(config, local=True)
    assert config.cluster.cpus_per_worker == expected


def test_a_value_that_is_set_stays(monkeypatch):
    monkeypatch.setattr(cluster, "local_cores", lambda: 64)
    config = cfg("cluster.cpus_per_worker=3")
    resolve_cpus_per_worker(config, local=True)
    assert config.cluster.cpus_per_worker == 3


def test_the_local_cluster_declares_cpus_for_the_resolved_plan(monkeypatch):
    monkeypatch.setattr(cluster, "local_cores", lambda: 2)
    config = cfg("train.dp_size=1", "reward.mode=genrm")
    resolve_cpus_per_worker(config, local=True)
    # 2 CPUs for the worker, 2 for the GenRM replica, 1 for data tasks, 1 spare
    assert cluster._logical_cpus_needed(config) == 6


def fake_cluster(monkeypatch, nodes, ip="10.0.0.1"):
    import ray

    totals: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            totals[k] = totals.get(k, 0.0) + v
    rows = [
        {"Alive": True, "Resources": n, "NodeManagerAddress": f"10.0.0.{i + 1}"} for i, n in enumerate(nodes)
    ]
    monkeypatch.setattr(ray, "nodes", lambda: rows)
    monkeypatch.setattr(ray, "cluster_resources", lambda: totals)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ip)


def test_a_gpu_node_shares_its_cpus_among_one_worker_per_gpu(monkeypatch):
    fake_cluster(monkeypatch, [{"CPU": 8.0}, {"CPU": 96.0, "GPU": 8.0}], ip="10.0.0.9")  # driver elsewhere
    config = cfg("train.dp_size=8")
    resolve_cpus_per_worker(config, local=False)
    assert config.cluster.cpus_per_worker == (96 - 1) // 8


def test_a_node_on_this_machine_is_capped_by_its_cores(monkeypatch):
    # a test cluster declares 8 logical CPUs on a 2-core machine
    fake_cluster(monkeypatch, [{"CPU": 8.0, "GPU": 4.0}], ip="10.0.0.1")
    monkeypatch.setattr(cluster, "local_cores", lambda: 2)
    config = cfg("train.dp_size=1")
    resolve_cpus_per_worker(config, local=False)
    assert config.cluster.cpus_per_worker == 2


def test_spread_over_cpu_nodes_and_genrm_replicas_take_their_share(monkeypatch):
    fake_cluster(monkeypatch, [{"CPU": 17.0}, {"CPU": 17.0}], ip="10.0.0.9")
    spread = cfg("train.dp_size=4", "cluster.placement_strategy=SPREAD")
    resolve_cpus_per_worker(spread, local=False)
    assert spread.cluster.cpus_per_worker == 16 // 2  # two workers per node
    judged = cfg("train.dp_size=2", "reward.mode=genrm", "reward.genrm.replicas=2")
    resolve_cpus_per_worker(judged, local=False)
    assert judged.cluster.cpus_per_worker == 16 // 4  # PACK: two workers and two replicas on one node


def test_shared_cpus_is_at_least_one():
    assert shared_cpus(1, 8) == 1 and shared_cpus(9, 2) == 4 and shared_cpus(0, 0) == 1


def test_a_local_node_starts_with_the_job_variables_in_its_environment(monkeypatch):
    """A local cluster's processes inherit the variables (so the job needs no runtime env, whose processes
    Ray's worker pool cannot serve); a variable already set wins; the driver's environment is left as it was."""
    from yatt_ray.cluster import _environ

    monkeypatch.setenv("YATT_TEST_SET", "user")
    monkeypatch.delenv("YATT_TEST_NEW", raising=False)
    with _environ({"YATT_TEST_SET": "job", "YATT_TEST_NEW": "job"}):
        assert os.environ["YATT_TEST_SET"] == "user" and os.environ["YATT_TEST_NEW"] == "job"
    assert os.environ["YATT_TEST_SET"] == "user" and "YATT_TEST_NEW" not in os.environ
