"""Where the roles run: a placement plan computed from the config and the cluster's resources.

Full coexistence (this module's only mode so far): every training worker hosts the policy, the reference
model and, on the controller rank of each data-parallel group, the rollout engine; the phases share the
worker's accelerator in series. Workers = dp_size x tp_size, one accelerator each when the cluster has them.
"""

from __future__ import annotations

from dataclasses import dataclass

from yatt_ray.config import Config
from yatt_ray.errors import PlacementError

DATA_CPUS = 1  # kept free for Ray Data's read tasks; without one the prompt streams would stall


@dataclass(frozen=True)
class PlacementPlan:
    mode: str
    dp_size: int
    tp_size: int
    cpus_per_worker: int
    gpus_per_worker: int

    @property
    def num_workers(self) -> int:
        return self.dp_size * self.tp_size

    def describe(self) -> str:
        device = f"{self.gpus_per_worker} GPU" if self.gpus_per_worker else "CPU only"
        lines = [
            f"placement: {self.mode} coexistence, {self.num_workers} worker(s) = dp {self.dp_size} x tp {self.tp_size}",
            f"  each worker: {self.cpus_per_worker} CPU, {device}; policy + reference + optimizer",
            f"  controllers: {self.dp_size} (tp rank 0 of each group), each with a colocated rollout engine",
        ]
        return "\n".join(lines)

    def check(self, cluster: dict[str, float]) -> None:
        """Raise PlacementError when the cluster's total resources cannot hold the plan."""
        cpus_needed = self.num_workers * self.cpus_per_worker + DATA_CPUS
        gpus_needed = self.num_workers * self.gpus_per_worker
        have_cpu, have_gpu = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
        if have_cpu < cpus_needed:
            raise PlacementError(
                f"the plan needs {cpus_needed} CPUs ({self.num_workers} workers x {self.cpus_per_worker} "
                f"+ {DATA_CPUS} for data) but the cluster has {have_cpu:g}. Lower train.dp_size / train.tp_size "
                "or cluster.cpus_per_worker, or add nodes."
            )
        if have_gpu < gpus_needed:
            raise PlacementError(
                f"the plan needs {gpus_needed} GPUs ({self.num_workers} workers) but the cluster has {have_gpu:g}. "
                "Lower train.dp_size x train.tp_size, or set cluster.use_gpu=false to train on CPUs."
            )


def plan_placement(config: Config, cluster: dict[str, float]) -> PlacementPlan:
    """The full-coexistence plan for `config` on a cluster with `cluster` total resources (checked)."""
    use_gpu = config.cluster.use_gpu
    if use_gpu is None:
        use_gpu = cluster.get("GPU", 0.0) >= 1
    plan = PlacementPlan(
        mode="full",
        dp_size=config.train.dp_size,
        tp_size=config.train.tp_size,
        cpus_per_worker=config.cluster.cpus_per_worker,
        gpus_per_worker=1 if use_gpu else 0,
    )
    plan.check(cluster)
    return plan
