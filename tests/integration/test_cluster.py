"""Clusters these tests start themselves: the local cluster of `yatt_ray.fit()` listens on loopback only
while it trains, and `cluster.placement_strategy` decides how Ray Train puts the training workers
on two raylets.

Each runs in a fresh Python subprocess with its own Ray temp dir (RAY_TMPDIR) and no RAY_ADDRESS, so it
neither joins nor disturbs the session's shared cluster, and stops only the processes it started
(`ray.shutdown()` / `Cluster.shutdown()` in that subprocess).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import yatt_ray
from yatt_ray.cluster import loopback_interface
from yatt_ray.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _run_isolated(script: str, args: list[str], timeout_s: float) -> dict:
    """Run `script args` in a fresh interpreter on its own Ray temp dir; it prints one JSON line last."""
    # Short: Ray puts Unix sockets under the temp dir (paths are limited to ~107 bytes). Cleanup errors are
    # ignored: a Ray log writer still closing after the script exits made rmtree fail ("Directory not empty")
    # on a run whose result was fine.
    with tempfile.TemporaryDirectory(prefix="yr-", dir="/tmp", ignore_cleanup_errors=True) as tmp:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        }
        # Token auth off: a local ray.init() would otherwise write ~/.ray/auth_token into the user's home.
        env.update(
            RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO)
        )
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # "::ffff:127.0.0.1": an IPv6 socket bound to 127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def test_loopback_predicate():
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("::ffff:127.0.0.1")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("192.0.2.2")
    from yatt_ray.rendezvous import is_loopback  # decides where the training world's store listens

    for ip in ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1", "0.0.0.0", "::", "192.0.2.2", "node-1"):
        assert is_loopback(ip) == (ip != "node-1" and _loopback(ip)), ip


TRAINING_LISTENERS = """
    import json, os, sys, threading

    import psutil

    import yatt_ray
    from yatt_ray.config import Config
    from yatt_ray.tasks.demo import prepare_demo

    demo = prepare_demo(Config())
    config = yatt_ray.load_config(
        "examples/configs/grpo.yaml",
        [f"model.path={demo.model.path}", f"data.train_files=[{demo.data.train_files[0]}]",
         "data.eval_files=[]", f"output.dir={sys.argv[1]}", "output.progress=false",
         "output.tensorboard=false", "output.plot=false",
         "train.steps=2", "train.prompts_per_step=4", "rollout.n=2", "train.dp_size=2"],
    )
    me = psutil.Process()
    seen = {}  # (pid, ip, port) -> the process's command line, for every LISTEN socket while fit() runs
    gloo_ifname = {}  # pid -> GLOO_SOCKET_IFNAME in each training worker's environment
    mkl_fast_mm = {}  # pid -> MKL_DISABLE_FAST_MM in each training worker's environment
    done = threading.Event()

    def poll():
        while not done.is_set():
            for proc in [me, *me.children(recursive=True)]:
                try:
                    conns = proc.net_connections(kind="inet")
                    cmd = proc.name() + " " + " ".join(proc.cmdline())[:60]
                    if "RayTrainWorker" in cmd:
                        gloo_ifname[proc.pid] = proc.environ().get("GLOO_SOCKET_IFNAME")
                        mkl_fast_mm[proc.pid] = proc.environ().get("MKL_DISABLE_FAST_MM")
                except psutil.Error:
                    continue
                for c in conns:
                    if c.status == psutil.CONN_LISTEN:
                        seen[(proc.pid, c.laddr.ip, c.laddr.port)] = cmd
            done.wait(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = yatt_ray.fit(config)
    finally:
        done.set()
        poller.join()
    steps = [r["step"] for r in result.history if "reward_mean" in r]
    rows = [[pid, cmd, ip, port] for (pid, ip, port), cmd in seen.items()]

    import ray
    from ray._private import ray_constants

    @ray.remote(num_cpus=1)
    def task():
        return ray.util.get_node_ip_address(), os.environ.get("MKL_DISABLE_FAST_MM")

    @ray.remote(num_cpus=0)
    class Actor:
        def ip(self):
            return ray.util.get_node_ip_address(), os.environ.get("MKL_DISABLE_FAST_MM")

    ips, mkl_other = zip(*ray.get([task.remote(), Actor.remote().ip.remote()], timeout=120))
    nodes = [n["NodeManagerAddress"] for n in ray.nodes()]
    print(json.dumps({"listen": rows, "steps": steps, "gloo_ifname": sorted(set(gloo_ifname.values())),
                      "mkl_fast_mm": sorted(set(map(str, mkl_fast_mm.values()))), "mkl_other": list(mkl_other),
                      "ips": list(ips), "nodes": nodes, "flag_restored": ray_constants.ENABLE_RAY_CLUSTER}))
"""


def test_local_fit_listens_on_loopback_only(demo_cache, tmp_path):
    """While fit() trains (2 steps) on the cluster it starts, with 2 data-parallel workers (a gloo world and
    its rendezvous store, Megatron's and vLLM's groups, Ray Data and Ray Train actors), every socket any
    process of the run listens on is on loopback: GCS, raylet / object manager, dashboard and its agents,
    and every worker. Tasks and actors run on a node whose address is 127.0.0.1."""
    out = _run_isolated(TRAINING_LISTENERS, [str(tmp_path)], timeout_s=600)
    assert out["steps"] == [1, 2], out["steps"]
    names = " ".join(cmd for _, cmd, _, _ in out["listen"])
    assert "gcs_server" in names and "raylet" in names, out["listen"]  # the check saw the whole cluster
    assert out["nodes"] == ["127.0.0.1"] and out["ips"] == ["127.0.0.1", "127.0.0.1"]
    assert out["flag_restored"] is True  # a later ray.init(address=...) registers under the routable IP
    per_worker: dict[int, int] = {}
    for pid, cmd, _, _ in out["listen"]:
        if "RayTrainWorker" in cmd:
            per_worker[pid] = per_worker.get(pid, 0) + 1
    # The polls saw both training workers with their world up: besides its Ray gRPC server, a worker
    # listens only for its process groups (gloo devices; rank 0 also the store).
    assert len(per_worker) == 2 and min(per_worker.values()) >= 3, out["listen"]
    exposed = [row for row in out["listen"] if not _loopback(row[2])]
    assert exposed == [], f"processes of a local fit() run listening beyond loopback: {exposed}"
    # gloo binds this interface's address, not the one the hostname resolves to (127.0.0.1 on some machines
    # only, this one included: the check above alone would pass there without it)
    assert out["gloo_ifname"] == [loopback_interface()], out["gloo_ifname"]
    # the training workers start with MKL's memory manager off (`host_memory.CPU_ENV`), and so do a task and an
    # actor of the job (read inside them: Ray's agents rewrite the memory /proc/<pid>/environ shows)
    assert out["mkl_fast_mm"] == ["1"] and out["mkl_other"] == ["1", "1"], out


PLACEMENT = """
    import importlib, json, os, sys, tempfile
    from pathlib import Path

    import ray
    from ray.cluster_utils import Cluster

    import yatt_ray.controller
    import yatt_ray.data
    from yatt_ray.config import load_config
    from yatt_ray.placement import plan_placement

    fit_module = importlib.import_module("yatt_ray.fit")  # the module (yatt_ray.fit is also the function)
    out_dir = Path(tempfile.mkdtemp(dir=os.environ["RAY_TMPDIR"]))

    def probe(loop_config):
        # stands in for the real train loop: where did this rank land?
        import ray.train

        ctx = ray.train.get_context()
        node = ray.get_runtime_context().get_node_id()
        (out_dir / f"rank{ctx.get_world_rank()}").write_text(node)

    yatt_ray.controller.train_loop_per_worker = probe  # _trainer imports it at call time
    yatt_ray.data.build_dataset = lambda data, files, pixels=None: None  # no prompts needed for placement

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    seen = {}
    try:
        for strategy in sys.argv[1:]:
            config = load_config(None, ["train.dp_size=2", f"cluster.placement_strategy={strategy}"])
            plan = plan_placement(config, ray.cluster_resources())
            trainer = fit_module._trainer(
                config, plan, {"train": []}, False, out_dir / strategy, {"hub": None, "control": None}
            )
            assert trainer.scaling_config.placement_strategy == strategy
            trainer.fit()
            seen[strategy] = sorted((out_dir / f"rank{r}").read_text() for r in range(plan.num_workers))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(seen))
"""


def test_placement_strategy_pack_and_spread_on_two_raylets():
    """Through yatt_ray's own TorchTrainer (fit._trainer): PACK puts both workers on one of two 2-CPU nodes,
    SPREAD one on each."""
    seen = _run_isolated(PLACEMENT, ["PACK", "SPREAD"], timeout_s=300)
    assert len(seen["PACK"]) == 2 and len(set(seen["PACK"])) == 1, seen
    assert len(set(seen["SPREAD"])) == 2, seen


def test_placement_strategy_is_checked():
    with pytest.raises(
        ConfigError, match=r"cluster.placement_strategy='STRICT' is unknown; valid: PACK, SPREAD"
    ):
        yatt_ray.load_config(None, ["cluster.placement_strategy=STRICT"])
    assert yatt_ray.load_config(None).cluster.placement_strategy == "PACK"


TWO_NODES = """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path

    import fsspec
    import ray

    import yatt_ray
    from yatt_ray.config import Config
    from yatt_ray.errors import ConfigError
    from yatt_ray.shared_storage import check_shared
    from yatt_ray.tasks.demo import prepare_demo
    from yatt_ray.testing.drills import committed_steps, prompt_audit, when

    endpoint, bucket = sys.argv[1], sys.argv[2]
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")  # the standard variables only, in every process
    root = Path(os.environ["RAY_TMPDIR"])
    os.environ["YATT_RAY_RUN_CACHE"] = str(root / "run_cache")
    private, shared = root / "node_local", root / "shared"
    private.mkdir()
    shared.mkdir()
    demo = prepare_demo(Config())
    s3 = fsspec.filesystem("s3")
    s3.put(demo.model.path + "/", f"{bucket}/models/demo", recursive=True)
    s3.put_file(demo.data.train_files[0], f"{bucket}/data/train.parquet")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    gcs = ray.get_runtime_context().gcs_address
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # a second node whose `private` is a folder of its own (a tmpfs in a mount namespace of its own): a node
    # whose disk the first one does not share, on one machine
    node = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs none {private} && exec {ray_cli} start --address={gcs} --num-cpus=2 --block"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    out = {}
    try:
        deadline = time.time() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.time() < deadline and node.poll() is None, "the second node did not join"
            time.sleep(0.5)
        # (a) a node-local path: refused by the check and by fit() before any work; a shared one passes
        out["shared"] = check_shared({"checkpoint.dir": str(shared)}, 120)
        try:
            check_shared({"checkpoint.dir": str(private)}, 120)
        except ConfigError as e:
            out["refused"] = str(e)
        config = yatt_ray.load_config(
            "examples/configs/grpo.yaml",
            [f"output.dir={root / 'runs'}", "output.progress=false", f"checkpoint.dir={private / 'ckpt'}"],
        )
        try:
            yatt_ray.fit(config)
        except ConfigError as e:
            out["fit_refused"] = str(e)
        out["marks_left"] = [p.name for p in root.rglob(".yatt-shared-*")]
        out["run_folders"] = [p.name for p in (root / "runs").iterdir()] if (root / "runs").exists() else []
        # (b) everything on S3: a worker killed after the first commit, then the same command continues
        ckpt = f"s3://{bucket}/runs/two/checkpoints"
        command = [
            f"model.path=s3://{bucket}/models/demo", f"data.train_files=[s3://{bucket}/data/train.parquet]",
            "data.eval_files=[]", "train.prompts_per_step=8", "rollout.n=2", "rollout.engine=hf",
            "train.dp_size=2", "cluster.cpus_per_worker=1", "cluster.placement_strategy=SPREAD",
            f"output.dir=s3://{bucket}/runs", "output.name=two", "output.progress=false",
            "output.tensorboard=false", "output.plot=false", "checkpoint.every_steps=2",
            "checkpoint.log_prompt_ids=true"]
        killed = []

        def kill_a_worker():  # the newest training worker process, by pid
            pids = subprocess.run(["pgrep", "-f", "ray::RayTrainWorker"], capture_output=True, text=True)
            os.kill(max(int(p) for p in pids.stdout.split()), signal.SIGKILL)
            killed.append(committed_steps(ckpt))

        when(lambda: bool(committed_steps(ckpt)), kill_a_worker)
        first = yatt_ray.fit(yatt_ray.load_config("examples/configs/grpo.yaml", [*command, "train.steps=4"]))
        again = yatt_ray.fit(yatt_ray.load_config("examples/configs/grpo.yaml", [*command, "train.steps=6"]))
        out.update(
            killed=killed, first_resumed=first.metric("checkpoint/resumed_from"),
            again_resumed=again.metric("checkpoint/resumed_from"),
            steps=[int(r["step"]) for r in again.history if "reward_mean" in r],
            committed=committed_steps(ckpt), audit=prompt_audit(ckpt).__dict__, checkpoint_dir=again.checkpoint_dir,
            uploaded=sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{bucket}/runs/two")),
            final=(Path(again.checkpoint_path) / "model.safetensors").is_file(),
            nodes=len([n for n in ray.nodes() if n["Alive"]]),
        )  # fmt: skip
    finally:
        ray.shutdown()
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
    print(json.dumps(out))
"""


def _can_unshare_mounts() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(
    not _can_unshare_mounts(), reason="needs `unshare --mount` (root) for a node of its own disk"
)
def test_two_nodes_that_share_no_disk(demo_cache, s3_options):
    """Two nodes on one machine, the second with a folder of its own where the first has `node_local`.
    (a) A checkpoint.dir there is refused naming the key, the path, the node and the fix, by the check and by
    fit() before any training worker starts; a folder both see passes; no marker is left behind.
    (b) Everything on a local S3 server (model, data, checkpoints, the run folder): a training worker is
    killed after the first commit and the run resumes from it; then the same command with the same
    output.name and more steps continues the run; each prompt trained once over the whole (nothing lost,
    nothing repeated)."""
    import uuid

    bucket = f"ckpt/{uuid.uuid4().hex}"
    out = _run_isolated(TWO_NODES, [s3_options["endpoint_url"], bucket], timeout_s=700)
    assert out["shared"] and "shared by the 2 nodes" in out["shared"], out
    refused = out.get("refused", "")
    assert "checkpoint.dir=" in refused and "node_local" in refused and "not seen from" in refused, out
    assert "s3://" in refused  # the fix
    assert "checkpoint.dir=" in out.get("fit_refused", ""), out
    assert out["marks_left"] == [] and out["run_folders"] == [], out  # refused before it wrote anything
    assert out["killed"] and out["killed"][0], out  # killed once a checkpoint was committed
    assert len(out["first_resumed"]) == 1 and out["first_resumed"][0] >= min(out["killed"][0]), out
    assert out["again_resumed"] == [4.0] and out["steps"] == [1, 2, 3, 4, 5, 6], out
    assert out["committed"][-1] == 6 and out["checkpoint_dir"].startswith("s3://"), out
    audit = out["audit"]
    assert audit["steps"] == 6 and audit["prompts"] == 6 * 8, audit
    assert audit["duplicated"] == 0 and audit["lost"] == 0 and audit["forgotten"] == 0, audit
    assert {"config.yaml", "metrics.jsonl", "final_hf", "checkpoints"} <= set(out["uploaded"]), out
    assert out["final"] and out["nodes"] == 2, out
