"""Fault drills for checkpoints on this machine: does a run survive, and is each prompt trained on exactly once?

    python release/fault_injection.py                  # every scenario, ~20 minutes on 2 CPU cores
    python release/fault_injection.py --only kill,sigint

Each scenario trains the demo GRPO task (tiny model, vLLM rollouts) for 6 steps with 2 data-parallel
workers, 8 prompts a step, a checkpoint every 2 steps and `checkpoint.log_prompt_ids=true`, and injects
faults:

* baseline:      no fault (the reference row);
* kill:          SIGKILL one Ray Train worker after the first checkpoint; Ray Train restarts the workers and
                 they resume from the newest committed checkpoint by themselves;
* kill2+continue: two workers killed (after the first checkpoint, then after a checkpoint of the restarted
                 attempt), then a new run continues the finished one for 4 more steps (a chain of resumes);
* sigterm:       SIGTERM to the driver after the first checkpoint: save, exit cleanly; a second run resumes;
* sigint:        the same with Ctrl-C (SIGINT), the way a notebook user stops a run;
* corrupt:       a 4-step run, then bytes of its newest checkpoint flipped; the next run detects it by
                 checksum, warns, and resumes from the one before;
* diskfull:      checkpoints on `faulty://` whose rank files fail with ENOSPC after the first checkpoint:
                 training goes on, failures are counted, the earlier checkpoint stays valid;
* s3down:        checkpoints on S3 (moto on 127.0.0.1, behind a proxy this script cuts): the endpoint goes
                 down after the first checkpoint and comes back 15 s later; saves in between fail or wait,
                 training goes on, later checkpoints commit;
* reward:        a reward function that raises on every answer ending in 7: with reward.on_error=zero the
                 run trains on (counted in reward/errors); with reward.on_error=raise the driver gets a
                 RewardError naming the function and the sample, at once (no retry);
* genrm:         the GenRM judge as the reward, one Serve replica killed mid-run: the run goes on, every
                 sample gets a verdict;
* dpchange:      a 4-step run on 2 workers resumed on 1 worker.

The audit (`yatt_ray.testing.drills.prompt_audit`) checks both directions of exactly-once from the
per-step prompt-id log and the newest checkpoint: nothing lost (a prompt counted as consumed that no
surviving step trained on), nothing duplicated (a prompt trained twice in one epoch, or trained before the
checkpoint but missing from its data position, so that a continued run would train it again). It prints a
table and ends with one line: `faults: scenarios=<n> survived=<n> lost=<n> duplicated=<n>`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yatt_ray
from yatt_ray.checkpoint import CheckpointStore
from yatt_ray.errors import YattError
from yatt_ray.testing.drills import (
    committed_steps,
    corrupt_checkpoint,
    kill_training_worker,
    prompt_audit,
    when,
)
from yatt_ray.testing.faults import FAIL_WRITES

REPO = Path(__file__).resolve().parents[1]
STEPS, PROMPTS = 6, 8


def config(ckpt_dir: str, out: Path, *overrides: str, base: str = "grpo.yaml"):
    from yatt_ray.config import Config
    from yatt_ray.tasks.demo import prepare_demo

    wanted = Config()
    wanted.reward.mode = "genrm" if "genrm" in base else "rule"
    demo = prepare_demo(wanted)  # the demo model and data (and judge), built once into the cache
    config = yatt_ray.load_config(
        REPO / "examples/configs" / base,
        [f"model.path={demo.model.path}", f"data.train_files=[{demo.data.train_files[0]}]", "data.eval_files=[]",
         f"output.dir={out}", "output.progress=false", "output.tensorboard=false", "output.plot=false",
         f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", "rollout.n=2", "train.dp_size=2",
         f"checkpoint.dir={ckpt_dir}", "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", *overrides],
    )  # fmt: skip
    if wanted.reward.mode == "genrm":  # the demo judge, its template and prompt length (set, not parsed)
        g, d = config.reward.genrm, demo.reward.genrm
        g.path, g.template, g.max_prompt_tokens = d.path, d.template, d.max_prompt_tokens
    return config


def trained_steps(result) -> list[int]:
    return [int(r["step"]) for r in result.history if "reward_mean" in r]


def row(name: str, ckpt_dir: str, result, note: str = "", steps: int = STEPS, storage=None) -> dict:
    audit = prompt_audit(ckpt_dir, storage)
    survived = (
        trained_steps(result) == list(range(1, steps + 1))
        and audit.steps == steps
        and audit.prompts == steps * PROMPTS
        and audit.duplicated == 0
        and audit.forgotten == 0
        and audit.lost == 0
    )
    return {
        "scenario": name,
        "survived": "yes" if survived else "NO",
        "steps redone": audit.discarded_steps,
        "prompts lost": audit.lost,
        "prompts duplicated": audit.duplicated + audit.forgotten,
        "note": note,
    }


def baseline(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    return row("baseline", ckpt, yatt_ray.fit(config(ckpt, tmp)))


def worker_kill(tmp: Path) -> dict:
    ckpt, killed = str(tmp / "ckpt"), []
    when(lambda: bool(committed_steps(ckpt)), lambda: killed.append(kill_training_worker()))
    result = yatt_ray.fit(config(ckpt, tmp))
    resumed = result.metric("checkpoint/resumed_from")
    return row("kill", ckpt, result, f"killed pid {killed}, resumed from {resumed}")


def two_kills_then_continue(tmp: Path) -> dict:
    """Kill after the first checkpoint, again after a checkpoint of the restarted attempt, then continue the
    finished run for 4 more steps: three resumes in a chain."""
    ckpt, killed = str(tmp / "ckpt"), []

    def second_kill() -> None:
        when(lambda: max(committed_steps(ckpt) or [0]) >= 4, lambda: killed.append(kill_training_worker()))

    when(lambda: bool(committed_steps(ckpt)), lambda: (killed.append(kill_training_worker()), second_kill()))
    first = yatt_ray.fit(config(ckpt, tmp, "checkpoint.keep_last=10"))
    second = yatt_ray.fit(config(ckpt, tmp, f"train.steps={STEPS + 4}"))
    note = (f"killed {len(killed)} workers, run 1 resumed from {first.metric('checkpoint/resumed_from')}; "
            f"run 2 continued from {second.metric('checkpoint/resumed_from')}")  # fmt: skip
    out = row("kill2+continue", ckpt, second, note, steps=STEPS + 4)
    if len(killed) < 2:
        out["survived"] = "NO"
    return out


def stop_by_signal(tmp: Path, sig: int) -> dict:
    ckpt, name = str(tmp / "ckpt"), signal.Signals(sig).name
    when(lambda: bool(committed_steps(ckpt)), lambda: os.kill(os.getpid(), sig))
    first = yatt_ray.fit(config(ckpt, tmp))
    stopped_at = max(trained_steps(first))
    second = yatt_ray.fit(config(ckpt, tmp))
    note = f"run 1 stopped={first.stopped} after step {stopped_at}; run 2 resumed from "
    out = row(name.lower(), ckpt, second, note + str(second.metric("checkpoint/resumed_from")))
    if first.stopped != name or stopped_at >= STEPS:
        out["survived"] = "NO"
    return out


def corrupt(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    yatt_ray.fit(config(ckpt, tmp, "train.steps=4"))
    newest = committed_steps(ckpt)[-1]
    corrupt_checkpoint(ckpt, newest)
    result = yatt_ray.fit(config(ckpt, tmp))
    return row("corrupt", ckpt, result, f"corrupted step {newest}, resumed from "
               f"{result.metric('checkpoint/resumed_from')}")  # fmt: skip


def disk_full(tmp: Path) -> dict:
    ckpt = f"faulty://{tmp / 'ckpt'}"
    sentinel = tmp / "ckpt" / "ranks" / FAIL_WRITES
    when(lambda: bool(committed_steps(ckpt)), lambda: sentinel.write_text("disk full drill\n"))
    result = yatt_ray.fit(config(ckpt, tmp))
    failures = max(result.metric("checkpoint/failures"))
    newest = CheckpointStore(ckpt).latest_valid()
    note = f"{failures:.0f} failed rank writes (ENOSPC); newest valid checkpoint: step {newest.step if newest else None}"
    sentinel.unlink()
    out = row("diskfull", ckpt, result, note)
    if failures == 0 or newest is None:
        out["survived"] = "NO"
    return out


class Outage:
    """A TCP proxy on 127.0.0.1 in front of `target_port` that can be cut: while down it accepts and at once
    closes connections (and drops the open ones), like an endpoint that went away."""

    def __init__(self, target_port: int) -> None:
        self.target, self.down, self.refused = target_port, threading.Event(), 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            if self.down.is_set():
                self.refused += 1
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.down.set()
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.open = []

    def restore(self) -> None:
        self.down.clear()


def moto_server() -> tuple[subprocess.Popen, int]:
    """A moto S3 server on 127.0.0.1 with a bucket "ckpt" (what tests/conftest.py's s3_options does)."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket="ckpt")
            return server, port
        except Exception:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.2)


def s3_down(tmp: Path) -> dict:
    steps = 10
    server, port = moto_server()
    outage = Outage(port)
    direct = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    options = {**direct, "endpoint_url": f"http://127.0.0.1:{outage.port}"}
    url = "s3://ckpt/run"
    try:

        def cut_then_restore() -> None:
            outage.cut()
            threading.Timer(15.0, outage.restore).start()

        when(lambda: bool(CheckpointStore(url, storage_options=direct).list_committed()), cut_then_restore)
        overrides = [f"checkpoint.storage_options.{k}={v}" for k, v in options.items()]
        result = yatt_ray.fit(config(url, tmp, f"train.steps={steps}", *overrides))
        failures = max(result.metric("checkpoint/failures"))
        newest = CheckpointStore(url, storage_options=direct).latest_valid()
        note = (f"{outage.refused} connections refused while down; {failures:.0f} failed saves; newest "
                f"checkpoint: step {newest.step if newest else None}")  # fmt: skip
        out = row("s3down", url, result, note, steps=steps, storage=direct)
        if outage.refused == 0 or newest is None or newest.step != steps:
            out["survived"] = "NO"
        return out
    finally:
        server.terminate()


def reward_raises(tmp: Path) -> dict:
    """The user's reward raises on one answer: `zero` trains on and counts, `raise` stops at once, named."""
    fn = "drill_rewards:exact_match_but_fails_on_seven"  # release/ is on the path of the driver and workers
    ckpt = str(tmp / "ckpt")
    result = yatt_ray.fit(config(ckpt, tmp, f"reward.function={fn}", "reward.on_error=zero"))
    errors = sum(result.metric("reward/errors"))
    start, named = time.monotonic(), False
    try:
        yatt_ray.fit(config(str(tmp / "ckpt_raise"), tmp, f"reward.function={fn}", "reward.on_error=raise",
                            "train.steps=40"))  # fmt: skip
        raised = "nothing raised"
    except YattError as exc:
        raised = f"{type(exc).__name__} after {time.monotonic() - start:.0f}s"
        named = fn in str(exc) and "ValueError" in str(exc)
    out = row(
        "reward", ckpt, result, f"on_error=zero: {errors:.0f} samples scored 0; on_error=raise: {raised}"
    )
    if errors == 0 or not raised.startswith(("RewardError", "ConfigError")) or not named:
        out["survived"] = "NO"
    return out


def genrm_kill(tmp: Path) -> dict:
    import ray

    ckpt, killed = str(tmp / "ckpt"), []

    def kill_replica() -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::yatt-genrm#")]  # fmt: skip
        ray.kill(ray.get_actor(sorted(names)[0], namespace="serve"))
        killed.append(names[0])

    when(lambda: bool(committed_steps(ckpt)), kill_replica)
    result = yatt_ray.fit(config(ckpt, tmp, "placement.mode=partial", base="grpo_genrm.yaml"))
    retries = sum(result.metric("genrm/retries"))
    out = row("genrm", ckpt, result, f"killed {killed}; {retries:.0f} requests sent again")
    if not killed:
        out["survived"] = "NO"
    return out


def dp_change(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    yatt_ray.fit(config(ckpt, tmp, "train.steps=4"))
    result = yatt_ray.fit(config(ckpt, tmp, "train.dp_size=1"))
    return row("dpchange", ckpt, result, f"resumed from {result.metric('checkpoint/resumed_from')}")


SCENARIOS = {
    "baseline": baseline,
    "kill": worker_kill,
    "kill2+continue": two_kills_then_continue,
    "sigterm": lambda tmp: stop_by_signal(tmp, signal.SIGTERM),
    "sigint": lambda tmp: stop_by_signal(tmp, signal.SIGINT),
    "corrupt": corrupt,
    "diskfull": disk_full,
    "s3down": s3_down,
    "reward": reward_raises,
    "genrm": genrm_kill,
    "dpchange": dp_change,
}


def print_table(rows: list[dict]) -> None:
    keys = ["scenario", "survived", "steps redone", "prompts lost", "prompts duplicated", "note"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print(" | ".join(k.ljust(widths[k]) for k in keys))
    print("-+-".join("-" * widths[k] for k in keys))
    for r in rows:
        print(" | ".join(str(r[k]).ljust(widths[k]) for k in keys), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated of {list(SCENARIOS)}")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="yatt-faults-") as tmp:
        for name in args.only.split(","):
            folder = Path(tmp, name)
            folder.mkdir()
            try:
                rows.append(SCENARIOS[name](folder))
            except Exception as exc:  # a scenario that crashes did not survive; the others still run
                rows.append({"scenario": name, "survived": "NO", "steps redone": "-", "prompts lost": "-",
                             "prompts duplicated": "-", "note": f"{type(exc).__name__}: {exc}"[:200]})  # fmt: skip
            print(f"[{name}] {rows[-1]}", flush=True)
    print()
    print_table(rows)
    counted = [r for r in rows if isinstance(r["prompts lost"], int)]
    print(f"faults: scenarios={len(rows)} survived={sum(r['survived'] == 'yes' for r in rows)} "
          f"lost={sum(r['prompts lost'] for r in counted)} "
          f"duplicated={sum(r['prompts duplicated'] for r in counted)}")  # fmt: skip


if __name__ == "__main__":
    main()
