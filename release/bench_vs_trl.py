"""yatt_ray against TRL 1.16.0's GRPOTrainer on the same CPU run, side by side (issue #11).

    python release/bench_vs_trl.py                                  # 25M model: TRL, dp_size=1, dp_size=2
    python release/bench_vs_trl.py --size 100m                      # the ~100M model (hidden 768, 12 layers)
    python release/bench_vs_trl.py --size 25m,34m,100m              # several shapes, one ratio line
    python release/bench_vs_trl.py --steps 6 --only trl,dp1 --trl-venv ~/trl-venv     # reuse a TRL venv
    python release/bench_vs_trl.py --engines auto,hf,vllm           # also each rollout engine explicitly
    python release/bench_vs_trl.py --verify-prompts                 # check the prompts step by step against TRL's

What it does: creates TRL's own virtual environment when absent (torch==2.13.0 pinned first, then trl==1.16.0;
never the project's environment), builds a char-level Llama with yatt_ray's tiny-model builder (sizes from
`--size` or the size flags; fp32), warms it up with a short SFT pass on two-digit addition so responses have
realistic lengths (answer digits + EOS), writes the prompts as parquet, then runs, back to back with the same
prompts (token for token, in the same order for TRL and dp_size=1), settings and seed:
- TRL: GRPOTrainer with HF generate, in one process with 2 torch threads (release/trl_grpo_run.py), without the
  CPU math settings yatt_ray gives its processes (`yatt_ray.host_memory.CPU_ENV`) unless `--trl-cpu-env`;
- yatt_ray dp_size=1 with cluster.cpus_per_worker=2, and dp_size=2 with one CPU per worker.
Settings: 32 prompts x 8 samples per step, at most 16 new tokens, temperature 1 (top_p 1), constant lr 1e-4,
no KL and no reference model, GRPO, one epoch of one mini-batch (on-policy), fp32, 25 steps.

What it measures, as medians over steps 4..steps: completion tokens/s (response tokens, EOS included, over the
step's wall time), step time, yatt_ray's phase split, mean completion length; and per run the peak RSS of the
training processes (the Ray train workers and their children; TRL's process), the time to the end of the first
step and the start-up before it, and the load average before and after. It ends with a markdown table and the
line `vs_trl: ratio_dp1=<x> ratio_dp2=<y>` (yatt_ray completion tokens/s over TRL's). Each run's figures are
also written to `<out>/<run>.json`; `--only` reruns a subset and takes the others from there (when the model
and settings match). yatt_ray runs with `checkpoint.enable=false`; `--verify-prompts` keeps the checkpoint store
instead (no save is due) for its per-step prompt-id log, and compares it with the prompts TRL trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PINS = ("torch==2.13.0", "trl==1.16.0")  # torch first: any other torch request pulls the CUDA wheels
SIZES = {  # name -> (hidden, layers, heads, kv_heads, intermediate)
    "25m": (512, 6, 8, 8, 2048),
    "34m": (
        640,
        8,
        10,
        2,
        1728,
    ),  # hidden not a power of two, 10 query heads over 2 key-value heads (Qwen-like)
    "100m": (768, 12, 12, 12, 2560),
}
FIRST_MEASURED_STEP = 4
THREADS = 2  # both cores of the reference machine
PHASES = ("rollout", "reward", "logprobs", "train", "weight_sync", "offload", "other")


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--only", default="trl,dp1,dp2", help="comma-separated runs: trl, dp1, dp2")
    p.add_argument("--engines", default="auto", help="rollout engines for the yatt_ray runs: auto,hf,vllm")
    p.add_argument("--size", default="25m", help=f"a comma-separated list of {', '.join(SIZES)}")
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate"):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the --size preset")
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="SFT steps (default: 400 for 25m, 200 else)"
    )
    p.add_argument(
        "--all-groups",
        action="store_true",
        help="also run each yatt_ray run with train.skip_zero_advantage=false (<run>-all): every group trained",
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify-prompts",
        action="store_true",
        help="yatt_ray logs each step's prompt ids (checkpointing on, no save due) to compare with TRL's",
    )
    p.add_argument(
        "--cache", type=Path, default=ROOT / "runs" / "bench_vs_trl", help="warmed models and data"
    )
    p.add_argument("--trl-venv", type=Path, default=None, help="TRL's venv (default: <cache>/trl-venv)")
    p.add_argument(
        "--trl-cpu-env",
        action="store_true",
        help="give TRL's process the CPU math settings every yatt_ray process gets (yatt_ray.host_memory.CPU_ENV); "
        "default: TRL as its users run it",
    )
    p.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "bench_vs_trl", help="the runs and their figures"
    )
    args = p.parse_args(argv)
    args.trl_venv = args.trl_venv or args.cache / "trl-venv"
    args.only = [r.strip() for r in args.only.split(",") if r.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.sizes = [x.strip() for x in args.size.split(",") if x.strip()]
    if not args.sizes or set(args.sizes) - set(SIZES):
        p.error(f"--size {args.size!r}: choose from {', '.join(SIZES)} (comma-separated)")
    unknown = set(args.only) - {"trl", "dp1", "dp2"}
    if unknown:
        p.error(f"--only: unknown run(s) {sorted(unknown)}; use trl, dp1, dp2")
    if args.steps < FIRST_MEASURED_STEP:
        p.error(
            f"--steps must be >= {FIRST_MEASURED_STEP} (medians are over steps {FIRST_MEASURED_STEP}..steps)"
        )
    return args


def model_spec(args: argparse.Namespace):
    from yatt_ray.models.tiny import TinyModelSpec

    hidden, layers, heads, kv, inter = SIZES[args.size]
    return TinyModelSpec(
        hidden_size=args.hidden or hidden,
        num_layers=args.layers or layers,
        num_heads=args.heads or heads,
        num_kv_heads=args.kv_heads or (args.heads or kv),
        intermediate_size=args.intermediate or inter,
    )


# ---------------------------------------------------------------------------------------------- TRL's venv
def ensure_trl_venv(venv: Path) -> Path:
    """TRL's own virtual environment (created when absent); returns its python."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import trl, torch; print(trl.__version__, torch.__version__)"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating TRL's virtual environment in {venv} ({', then '.join(TRL_PINS)})", flush=True)
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
    for pin in TRL_PINS:
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", pin], check=True)
    subprocess.run(check, check=True)
    return python


# ---------------------------------------------------------------------------------------------- model, data
def warm_model(args: argparse.Namespace, spec) -> tuple[Path, dict]:
    """The tiny Llama after a short SFT pass on the task, cached under `<cache>/models/` by its recipe."""
    steps = args.warmup_steps if args.warmup_steps is not None else (400 if args.size == "25m" else 200)
    recipe = {"format": 2, "spec": dataclasses.asdict(spec), "sft_steps": steps, "sft_lr": 2e-3, "batch": 64}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    name = f"h{spec.hidden_size}-l{spec.num_layers}-a{spec.num_heads}-kv{spec.num_kv_heads}-i{spec.intermediate_size}"
    model_dir = args.cache / "models" / f"{name}-sft{steps}-{key}"
    if not (model_dir / "warmup.json").exists():
        print(f"building and warming up the model in {model_dir} ({steps} SFT steps)", flush=True)
        _build_warm(model_dir, spec, recipe)
    return model_dir, json.loads((model_dir / "warmup.json").read_text())


def _build_warm(model_dir: Path, spec, recipe: dict) -> None:
    """Random model -> SFT on prompt + answer + EOS (yatt_ray.models.tiny.sft_tensors; AdamW, one-cycle lr) -> saved HF directory,
    with the warm model's sampled response length and accuracy (temperature 1) in warmup.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt_ray.models.tiny import build_tiny_model, sft_tensors
    from yatt_ray.tasks.arithmetic import make_problems

    torch.set_num_threads(THREADS)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    build_tiny_model(tmp, spec)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    steps, batch = recipe["sft_steps"], recipe["batch"]
    rows = make_problems(steps * batch, seed=1, max_operand=99, id_offset=10**9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["sft_lr"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=recipe["sft_lr"], total_steps=steps, pct_start=0.1
    )
    torch.manual_seed(0)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        chunk = rows[step * batch : (step + 1) * batch]
        input_ids, labels = sft_tensors(tokenizer, [(r["prompt"], r["ground_truth"]) for r in chunk])
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    stats = {"sft_loss": loss.item(), "sft_s": time.perf_counter() - start}
    stats.update(_sample_stats(model, tokenizer, make_problems(64, seed=2, max_operand=99)))
    stats["params"] = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(json.dumps({**stats, "recipe": recipe}, indent=1))
    tmp.rename(model_dir)  # atomic: a half-built model is never reused


def _sample_stats(model, tokenizer, rows: list[dict]) -> dict:
    """Mean response length (tokens, EOS included) and accuracy of one sample per prompt at temperature 1."""
    import torch

    from yatt_ray.models.tiny import EOS_ID

    model.eval()
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=EOS_ID)  # fmt: skip
    lengths, correct = [], 0
    for row, ids in zip(rows, out[:, enc["input_ids"].shape[1] :].tolist()):
        cut = ids.index(EOS_ID) + 1 if EOS_ID in ids else len(ids)
        lengths.append(cut)
        correct += tokenizer.decode(ids[:cut], skip_special_tokens=True).strip() == row["ground_truth"]
    return {"sample_length": statistics.mean(lengths), "sample_accuracy": correct / len(rows)}


def write_data(args: argparse.Namespace) -> tuple[dict[int, Path], list[dict]]:
    """Two-digit addition prompts ("17+8=" -> "25") as parquet, in a random order that TRL and dp_size=1 read
    as it is; returns {dp_size: file} and the rows.

    yatt_ray with dp_size=d splits the file into d contiguous shares (Ray Data `streaming_split(equal=True)`) and
    each group takes prompts_per_step/d rows per step from its own share; the file for dp_size=d is laid out so
    that step s of every run gets the same prompts as TRL's step s (the run's prompt-id log checks it)."""
    from yatt_ray.tasks.arithmetic import make_problems, write_parquet

    count = max(4096, args.steps * args.prompts) // args.prompts * args.prompts
    rows = make_problems(count, seed=args.seed + 100, max_operand=99)
    files = {}
    for dp in (1, 2):
        path = args.cache / "data" / f"add99-seed{args.seed + 100}-{count}-p{args.prompts}-dp{dp}.parquet"
        if not path.exists():
            write_parquet(_laid_out(rows, args.prompts, dp), path)
        files[dp] = path
    return files, rows


def _laid_out(rows: list[dict], prompts: int, dp: int) -> list[dict]:
    """Rows reordered so that share g (of dp contiguous shares) holds, step after step, group g's slice of each
    step's `prompts` rows."""
    per_group = prompts // dp
    steps = len(rows) // prompts
    return [
        rows[s * prompts + g * per_group + i]
        for g in range(dp)
        for s in range(steps)
        for i in range(per_group)
    ]


# ---------------------------------------------------------------------------------------------- measuring
@dataclass
class RunResult:
    """One run's per-step rows and what was measured around it."""

    name: str
    label: str
    rows: list[dict]  # step, step_s, completion_tokens, completion_tok_s, length, phases {name: s}
    wall_s: float = 0.0
    first_step_end_s: float | None = None  # from the run's launch to the end of step 1
    load_before: tuple = ()
    load_after: tuple = ()
    peak_rss_gb: float | None = None  # the largest training process (with its children)
    peak_rss_total_gb: float | None = None  # all training processes together
    extra: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)  # what must match for `--only` to reuse a saved run

    def measured(self) -> list[dict]:
        return [r for r in self.rows if r["step"] >= FIRST_MEASURED_STEP]

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.measured())

    def phase_median(self, phase: str) -> float:
        return statistics.median(r["phases"].get(phase, 0.0) for r in self.measured())

    @property
    def startup_s(self) -> float | None:
        """Launch to the start of step 1 (the run's first step's own time taken off)."""
        if self.first_step_end_s is None or not self.rows:
            return None
        return self.first_step_end_s - self.rows[0]["step_s"]


class Sampler(threading.Thread):
    """Samples, every `period` s, the RSS of the processes `select` picks (each with its children), and the
    time a file matching `first_row` first holds a line (the end of step 1). The process table is scanned for
    them every `rescan` s only: a scan reads every process's command line, and on a 2-core machine that
    sampler was the largest of the processes running beside the trainer (0.04 of a core at a 0.25 s scan)."""

    def __init__(self, select, first_row=None, period: float = 0.5, rescan: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.select, self.first_row, self.period, self.rescan = select, first_row, period, rescan
        self.start_time = time.time()
        self.peak_one = self.peak_total = 0
        self.first_row_at: float | None = None
        self.names: set[str] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        groups: list[list] = []  # per target: the process and its children
        scanned = 0.0
        while not self._halt.wait(self.period):
            if time.time() - scanned >= self.rescan:
                groups, scanned = [], time.time()
                for proc in self._targets(psutil):
                    try:
                        groups.append([proc, *proc.children(recursive=True)])
                    except psutil.Error:
                        continue
            total = 0
            for group in groups:
                rss = 0
                for proc in group:
                    try:
                        rss += proc.memory_info().rss
                    except psutil.Error:
                        continue
                self.peak_one, total = max(self.peak_one, rss), total + rss
            self.peak_total = max(self.peak_total, total)
            if self.first_row_at is None and self.first_row is not None and self.first_row():
                self.first_row_at = time.time()

    def _targets(self, psutil) -> list:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                name = self.select(proc)
            except psutil.Error:
                continue
            if name:
                self.names.add(name)
                found.append(proc)
        return found

    def stop(self) -> None:
        self._halt.set()
        self.join()


def finished(result: RunResult) -> RunResult:
    print(describe(result), flush=True)
    return result


def _gb(nbytes: float) -> float:
    return nbytes / 2**30


# ---------------------------------------------------------------------------------------------- TRL run
def trl_micro_batch(completions: int, micro_batch_size: int, max_tokens: int | None, row_tokens: int) -> int:
    """TRL's micro-batch (completions per forward / backward) matching yatt_ray's: with yatt_ray's token
    budget `max_tokens`, the most rows of TRL's padded width `row_tokens` (longest prompt + max new tokens)
    that fit it, taken as a divisor of `completions` (TRL's gradient accumulation needs one); else
    `micro_batch_size` rows (at most `completions`). Both libraries then hold about as many tokens at once."""
    if max_tokens is None:
        return min(micro_batch_size, completions)
    fits = max(1, max_tokens // max(row_tokens, 1))
    return max(d for d in range(1, completions + 1) if completions % d == 0 and d <= fits)


def run_trl(args, python: Path, model_dir: Path, data_file: Path, rows: list[dict], micro: int) -> RunResult:
    """release/trl_grpo_run.py in TRL's venv, with yatt_ray's token ids of every prompt to check against."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    work = args.out / "trl"
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_dir": str(model_dir), "data_file": str(data_file), "work_dir": str(work / "trainer"),
        "steps": args.steps, "prompts_per_step": args.prompts, "n": args.n, "micro_batch": micro,
        "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "lr": args.lr,
        "seed": args.seed, "threads": THREADS,
        "expected_ids": {r["prompt"]: tokenizer(r["prompt"])["input_ids"] for r in rows},
    }  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "result.json"
    out.unlink(missing_ok=True)
    from yatt_ray.host_memory import CPU_ENV, cpu_env

    env = {k: v for k, v in os.environ.items() if k not in CPU_ENV}  # fit() put them in this process's
    env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH="", **(cpu_env() if args.trl_cpu_env else {}))  # fmt: skip
    command = [str(python), str(ROOT / "release" / "trl_grpo_run.py"), str(work / "spec.json"), str(out)]
    load_before, launched = os.getloadavg(), time.time()
    child = subprocess.Popen(command, env=env, cwd=work)
    sampler = Sampler(lambda proc: "trl" if proc.pid == child.pid else None)
    sampler.start()
    rc = child.wait()
    sampler.stop()
    wall = time.time() - launched
    if rc != 0:
        raise SystemExit(f"the TRL run failed (exit {rc}); its output is above")
    data = json.loads(out.read_text())
    steps = []
    for r in data["rows"]:
        other = r["step_s"] - r.get("generate_s", 0.0)
        steps.append({
            "step": r["step"], "step_s": r["step_s"], "completion_tokens": r["completion_tokens"],
            "completion_tok_s": r["completion_tokens"] / r["step_s"],
            "length": r["completion_tokens"] / max(r["completions"], 1),
            "phases": {"generate": r.get("generate_s", 0.0), "rest": other},
            "prompt_ids": r.get("prompt_ids", []), "reward": r.get("trl", {}).get("reward"),
        })  # fmt: skip
    first_end = data["rows"][0]["ended"] - launched if data["rows"] else None
    return finished(RunResult(
        name="trl", label=f"TRL {data['versions']['trl']} GRPOTrainer (HF generate, one process, "
        f"{data['threads']} threads)", rows=steps, wall_s=wall, first_step_end_s=first_end,
        load_before=load_before, load_after=os.getloadavg(),
        peak_rss_gb=_gb(max(data["peak_rss_bytes"], sampler.peak_one)), peak_rss_total_gb=None,
        extra={"versions": data["versions"], "settings": data["settings"],
               "process_start_s": data["process_start"] - launched, "train_begin_s": data["train_begin"] - launched},
    ))  # fmt: skip


# ---------------------------------------------------------------------------------------------- yatt_ray runs
def yatt_overrides(args, model_dir: Path, data_file: Path, dp: int, engine: str, out_dir: Path) -> list[str]:
    """The yatt_ray config of the run: examples/configs/grpo.yaml with the benchmark's settings."""
    from yatt_ray.config import CheckpointConfig

    no_saves = ["checkpoint.every_steps=null", "checkpoint.every_minutes=null", "checkpoint.at_end=false"]
    if args.verify_prompts:  # the prompt-id log lives in the checkpoint store: keep it, with no save ever due
        checkpoints = [*no_saves, "checkpoint.log_prompt_ids=true"]
    elif "enable" in {f.name for f in dataclasses.fields(CheckpointConfig)}:
        checkpoints = ["checkpoint.enable=false"]
    else:  # before `checkpoint.enable` existed
        checkpoints = no_saves
    return [
        f"model.path={model_dir}", f"data.train_files=[{data_file}]", "data.eval_files=[]",
        "data.shuffle_seed=null",  # file order (already random): the order TRL reads it in
        f"rollout.engine={engine}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0",
        "algo.name=grpo", "algo.kl_coef=0", "algo.ppo_epochs=1", "algo.ppo_mini_batches=1",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", f"train.lr={args.lr}",
        f"train.dp_size={dp}", f"train.seed={args.seed}", f"cluster.cpus_per_worker={THREADS // dp}",
        f"output.dir={out_dir}", "output.progress=false", "output.plot=false", "output.tensorboard=false",
        "checkpoint.resume=never", *checkpoints,
    ]  # fmt: skip


def _is_train_worker(proc) -> str | None:
    """Ray Train's worker actors (process titles 'ray::RayTrainWorker...')."""
    cmd = " ".join(proc.info["cmdline"] or [])
    if cmd.startswith("ray::") and "TrainWorker" in cmd:
        return cmd.split()[0]
    return None


def run_yatt(
    args, name: str, dp: int, engine: str, model_dir: Path, data_file: Path, all_groups: bool = False
) -> RunResult:
    """yatt_ray.fit on a fresh local Ray cluster (shut down afterwards); `all_groups`: with
    train.skip_zero_advantage=false (the run's name gets "-all")."""
    import ray

    import yatt_ray

    out_dir = args.out / f"yatt-{name}"
    overrides = yatt_overrides(args, model_dir, data_file, dp, engine, out_dir)
    overrides += ["train.skip_zero_advantage=false"] if all_groups else []
    config = yatt_ray.load_config(ROOT / "examples" / "configs" / "grpo.yaml", overrides)
    launched = time.time()

    def first_row() -> bool:  # this run's metrics.jsonl (fit makes a fresh, time-stamped folder) has a row
        return any(
            p.stat().st_size > 0 and p.stat().st_mtime >= launched for p in out_dir.glob("*/metrics.jsonl")
        )

    load_before = os.getloadavg()
    sampler = Sampler(_is_train_worker, first_row)
    sampler.start()
    try:
        result = yatt_ray.fit(config)
    finally:
        sampler.stop()
        ray.shutdown()
    wall = time.time() - launched
    history = [r for r in result.history if "time/step" in r]
    resolved = engine if engine != "auto" else f"auto->{result.rollout_engine or '?'}"  # measured on CPUs
    steps = [_yatt_row(r) for r in history]
    for row, ids in zip(steps, _prompt_ids(Path(result.output_dir), result.checkpoint_dir)):
        row["prompt_ids"] = ids
    return finished(RunResult(
        name=(name if engine == "auto" else f"{name}-{engine}") + ("-all" if all_groups else ""),
        label=f"yatt_ray dp_size={dp}, cluster.cpus_per_worker={THREADS // dp}, rollout.engine={resolved}"
        + (", train.skip_zero_advantage=false" if all_groups else ""),
        rows=steps, wall_s=wall,
        first_step_end_s=(sampler.first_row_at - launched) if sampler.first_row_at else None,
        load_before=load_before, load_after=os.getloadavg(),
        peak_rss_gb=_gb(sampler.peak_one) if sampler.peak_one else None,
        peak_rss_total_gb=_gb(sampler.peak_total) if sampler.peak_total else None,
        extra={"engine": resolved, "output_dir": result.output_dir, "workers": sorted(sampler.names),
               "memory_keys": sorted({k for r in history for k in r if "memory" in k or "rss" in k})},
    ))  # fmt: skip


def _yatt_row(r: dict) -> dict:
    """One history row in the benchmark's terms (completion tokens = response_length x samples)."""
    tokens = r["response_length"] * r["samples"]
    rate = r.get("response_tokens_per_s", tokens / r["time/step"])
    phases = {
        k[5:]: v
        for k, v in r.items()
        if k.startswith("time/") and k not in ("time/step", "time/orchestration")
    }
    return {"step": int(r["step"]), "step_s": r["time/step"], "completion_tokens": tokens, "completion_tok_s": rate,
            "length": r["response_length"], "phases": phases, "reward": r.get("reward_mean"),
            "mfu_train": r.get("perf/mfu_train"), "skipped": r.get("train/skipped_fraction")}  # fmt: skip


def _prompt_ids(output_dir: Path, checkpoint_dir: str) -> list[list[int]]:
    """Per step, the prompt ids the controllers trained on (checkpoint.log_prompt_ids), dp ranks in order."""
    folder = Path(checkpoint_dir or output_dir / "checkpoints") / "prompt_ids"
    by_step: dict[int, list] = {}
    for path in sorted(folder.glob("step_*.json")) if folder.is_dir() else []:
        record = json.loads(path.read_text())
        by_step.setdefault(record["step"], []).append((record["dp_rank"], record["ids"]))
    return [[int(i) for _, ids in sorted(by_step[s]) for i in ids] for s in sorted(by_step)]


# ---------------------------------------------------------------------------------------------- report
def save(result: RunResult, out: Path) -> None:
    (out / f"{result.name}.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))


def load(name: str, out: Path, recipe: dict) -> RunResult | None:
    """A run saved by an earlier invocation with the same model and settings, else None."""
    path = out / f"{name}.json"
    result = RunResult(**json.loads(path.read_text())) if path.exists() else None
    return result if result is not None and result.recipe == recipe else None


def run_recipe(args: argparse.Namespace, model_dir: Path) -> dict:
    keys = ("steps", "prompts", "n", "max_new_tokens", "lr", "seed", "trl_cpu_env")
    return {"model": model_dir.name, **{k: getattr(args, k) for k in keys}}


def _load(values) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "?"


def describe(r: RunResult) -> str:
    """The run's figures, several lines."""
    lines = [f"{r.name}: {r.label}"]
    lines.append(f"  completion tok/s (median) {r.median('completion_tok_s'):8.1f}   step {r.median('step_s'):6.2f} s"
                 f"   mean completion length {statistics.mean(x['length'] for x in r.measured()):.2f} tokens")  # fmt: skip
    phases = [p for p in (*PHASES, "generate", "rest") if any(p in x["phases"] for x in r.measured())]
    phases += sorted({p for x in r.measured() for p in x["phases"]} - set(phases))
    lines.append("  phases (median s): " + ", ".join(f"{p} {r.phase_median(p):.2f}" for p in phases))
    mfu = [x["mfu_train"] for x in r.measured() if x.get("mfu_train") is not None]
    if mfu:
        lines.append(
            f"  train-phase FLOP efficiency (perf/mfu_train, of the measured peak) {statistics.median(mfu):.2f}"
        )
    skipped = [x["skipped"] for x in r.measured() if x.get("skipped") is not None]
    if skipped:
        lines.append(
            f"  samples left out of the train step (zero advantages, train/skipped_fraction) "
            f"{statistics.mean(skipped):.2f}"
        )
    first = f"{r.first_step_end_s:.1f} s" if r.first_step_end_s is not None else "?"
    startup = f"{r.startup_s:.1f} s" if r.startup_s is not None else "?"
    lines.append(f"  launch -> end of step 1 {first} (start-up {startup}, step 1 {r.rows[0]['step_s']:.1f} s); "
                 f"whole run {r.wall_s:.1f} s")  # fmt: skip
    rss = f"{r.peak_rss_gb:.2f} GiB" if r.peak_rss_gb else "?"
    total = f", all workers {r.peak_rss_total_gb:.2f} GiB" if r.peak_rss_total_gb else ""
    lines.append(f"  peak RSS {rss} per training process{total}")
    lines.append(f"  load average before {_load(r.load_before)}, after {_load(r.load_after)}")
    return "\n".join(lines)


def table(results: list[RunResult]) -> str:
    lines = ["| run | completion tok/s | step s | where the step goes | load avg before -> after |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        split = [p for p in (*PHASES, "generate", "rest") if any(p in x["phases"] for x in r.measured())]
        where = ", ".join(
            f"{p.replace('_', ' ')} {r.phase_median(p):.2f}" for p in split if r.phase_median(p) >= 0.005
        )
        lines.append(f"| {r.label} | {r.median('completion_tok_s'):.0f} | {r.median('step_s'):.2f} | {where} | "
                     f"{_load(r.load_before[:1])} -> {_load(r.load_after[:1])} |")  # fmt: skip
    return "\n".join(lines)


def same_prompts(trl: RunResult, other: RunResult) -> str:
    """Whether both runs trained on the same prompts, step by step (or as a set, when the order differs)."""
    a = [x.get("prompt_ids") or [] for x in trl.rows]
    b = [x.get("prompt_ids") or [] for x in other.rows]
    if not any(a) or not any(b):
        return "not recorded (--verify-prompts records yatt_ray's)"
    if a == b:
        return "identical, step by step"
    same_set = sorted(i for s in a for i in s) == sorted(i for s in b for i in s)
    return "the same set, in another order" if same_set else "DIFFERENT prompts"


def ratio(trl: RunResult | None, other: RunResult | None) -> str:
    if trl is None or other is None:
        return "n/a"
    return f"{other.median('completion_tok_s') / trl.median('completion_tok_s'):.2f}"


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> None:
    args = parse_args(argv)
    args.out, args.cache = args.out.resolve(), args.cache.resolve()
    python = ensure_trl_venv(args.trl_venv.resolve()) if "trl" in args.only else None
    ratios = {}
    for size in args.sizes:
        one = argparse.Namespace(**{**vars(args), "size": size})
        if len(args.sizes) > 1:
            one.out = args.out / size
            print(f"\n=== shape {size} ===", flush=True)
        ratios[size] = run_shape(one, python)
    if len(ratios) > 1:
        worst = {
            run: min((r.get(run, "n/a") for r in ratios.values()), key=_as_float) for run in ("dp1", "dp2")
        }
        every = " ".join(f"{size}_{run}={value}" for size, r in ratios.items() for run, value in r.items())
        print(f"vs_trl: ratio_dp1={worst['dp1']} ratio_dp2={worst['dp2']} {every}")


def _as_float(text: str) -> float:
    return float("inf") if text == "n/a" else float(text)


def run_shape(args: argparse.Namespace, python: Path | None) -> dict[str, str]:
    """One shape's runs (TRL, dp1, dp2, and each --engines run) and report; returns each run's ratio to TRL
    ({"dp1": .., "dp2": .., "dp1-hf": ..})."""
    args.out.mkdir(parents=True, exist_ok=True)
    spec = model_spec(args)
    model_dir, warm = warm_model(args, spec)
    data_files, rows = write_data(args)
    import yatt_ray

    train = yatt_ray.load_config(ROOT / "examples" / "configs" / "grpo.yaml").train
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    micro = trl_micro_batch(args.prompts * args.n, train.micro_batch_size, train.max_tokens_per_micro_batch,
                            prompt_tokens + args.max_new_tokens)  # fmt: skip
    print_setup(args, spec, model_dir, warm, micro)
    recipe = {**run_recipe(args, model_dir), "trl_micro_batch": micro}
    fresh: dict[str, RunResult] = {}
    if "trl" in args.only:
        fresh["trl"] = run_trl(args, python, model_dir, data_files[1], rows, micro)
    variants = [False, True] if args.all_groups else [False]
    for name, dp in (("dp1", 1), ("dp2", 2)):
        for engine in args.engines if name in args.only else []:
            for all_groups in variants:
                result = run_yatt(args, name, dp, engine, model_dir, data_files[dp], all_groups)
                fresh[result.name] = result
    for result in fresh.values():
        result.recipe = recipe
        save(result, args.out)
    runs = {n: fresh.get(n) or load(n, args.out, recipe) for n in ("trl", "dp1", "dp2")}
    report(fresh, runs)
    shown = {**{n: r for n, r in runs.items() if r is not None}, **fresh}
    return {n: ratio(runs["trl"], r) for n, r in shown.items() if n != "trl"}


def print_setup(args: argparse.Namespace, spec, model_dir: Path, warm: dict, micro: int) -> None:
    print(f"model {model_dir.name}: {warm['params'] / 1e6:.2f}M parameters (hidden {spec.hidden_size}, "
          f"{spec.num_layers} layers, {spec.num_heads} heads, {spec.num_kv_heads} kv heads, intermediate "
          f"{spec.intermediate_size}, fp32); after warm-up: sampled length {warm['sample_length']:.2f} tokens, "
          f"accuracy {warm['sample_accuracy']:.2f} at temperature 1", flush=True)  # fmt: skip
    print(f"settings: {args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, T=1, lr "
          f"{args.lr} constant, no KL, {args.steps} steps, seed {args.seed}, TRL micro-batch {micro} (as many "
          f"rows as yatt_ray's token budget holds); medians over steps {FIRST_MEASURED_STEP}-{args.steps}; "
          f"cores {os.cpu_count()}", flush=True)  # fmt: skip
    import torch

    from yatt_ray.machine_cache import ISA_CAPS

    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k)]  # e.g. an AVX-512 CPU run as AVX2
    print(f"instruction set: {torch.backends.cpu.get_cpu_capability()}"
          + (f", capped by {' '.join(caps)}" if caps else ""), flush=True)  # fmt: skip


def report(fresh: dict[str, RunResult], main_runs: dict[str, RunResult | None]) -> None:
    """Every run's figures, the markdown table and, last, the ratio line (runs of earlier invocations with the
    same model and settings fill in what `--only` left out)."""
    runs = {**{n: r for n, r in main_runs.items() if r is not None}, **fresh}
    order = [n for n in ("trl", "dp1", "dp2") if n in runs] + sorted(set(runs) - {"trl", "dp1", "dp2"})
    shown = [runs[n] for n in order]
    names = ", ".join(r.name + ("" if r.name in fresh else " (earlier run)") for r in shown)
    print(f"\nbench_vs_trl: {names}")
    trl = runs.get("trl")
    for r in shown:
        print(describe(r))
        if trl is not None and r is not trl:
            print(f"  prompts vs TRL: {same_prompts(trl, r)}")
    print("\n" + table(shown) + "\n")
    others = " ".join(f"{n}={ratio(trl, runs[n])}" for n in order if n not in ("trl", "dp1", "dp2"))
    print(
        f"vs_trl: ratio_dp1={ratio(trl, runs.get('dp1'))} ratio_dp2={ratio(trl, runs.get('dp2'))} {others}".rstrip()
    )


if __name__ == "__main__":
    main(sys.argv[1:])
