"""The GenRM service's life on the driver: deploy the Serve application per the placement plan, tear it down.

Partial coexistence deploys before training starts. Full coexistence deploys after the training workers
hold their accelerators: each replica claims the `genrm_share` left on a trainer's GPU. GPUs the trainers do
not use are fenced (a placement group holds them) while the replicas are placed, so that a replica can only
land next to a trainer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from yatt_ray.config import Config, GenRMConfig
from yatt_ray.errors import PlacementError
from yatt_ray.placement import GenRMSlice, PlacementPlan
from yatt_ray.reward.genrm import APP_NAME
from yatt_ray.reward.judge_replica import GenRMJudge

log = logging.getLogger(__name__)


def deploy_genrm(config: Config, plan: PlacementPlan, hub: Any) -> None:
    """Start the GenRM Serve application (`APP_NAME`) and wait until its replicas are running."""
    from ray import serve

    assert plan.genrm is not None, "deploy_genrm needs a plan with a GenRM slice"
    g, settings = plan.genrm, config.reward.genrm
    http = settings.http_port
    serve.start(
        proxy_location="HeadOnly" if http else "Disabled",
        http_options={"host": "127.0.0.1", "port": int(http)} if http else None,
    )
    options = deployment_options(g, settings)
    app = (
        serve.deployment(name="judge")(GenRMJudge).options(**options).bind(settings, g.release_when_idle, hub)
    )
    started = time.time()
    serve.run(app, name=APP_NAME, route_prefix="/judge" if http else None, blocking=False)
    _wait_running(config.cluster.timeout_s)
    log.info("GenRM deployed in %.1fs: %d replica(s)", time.time() - started, g.replicas)


def deployment_options(g: GenRMSlice, settings: GenRMConfig) -> dict[str, Any]:
    """Serve options of the judge deployment: one placement-group bundle per accelerator of a replica, and
    autoscaling between `replicas` and `max_replicas` on ongoing requests when they differ."""
    options: dict[str, Any] = {
        "placement_group_bundles": g.bundles(),
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {
            "num_cpus": g.bundles()[0]["CPU"],
            "num_gpus": g.gpus_per_accelerator,
            "runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
        },
        "max_ongoing_requests": 4 * settings.batch_size,
        "logging_config": {"log_level": "WARNING", "enable_access_log": False},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
    }
    if g.max_replicas > g.replicas:  # the number of replicas follows the load
        options["autoscaling_config"] = {
            "min_replicas": g.replicas,
            "max_replicas": g.max_replicas,
            "target_ongoing_requests": settings.batch_size,
            "upscale_delay_s": 2.0,
            "downscale_delay_s": 30.0,
        }
    else:
        options["num_replicas"] = g.replicas
    return options


def _wait_running(timeout_s: float) -> None:
    from ray import serve

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise PlacementError(f"the GenRM deployment failed to start: {status.message}")
        time.sleep(0.5)
    raise PlacementError(
        f"the GenRM deployment did not start within cluster.timeout_s={timeout_s:g}s (status: "
        f"{serve.status().applications.get(APP_NAME)}); check that the cluster has the resources of the "
        "printed placement plan free"
    )


def wait_for_trainers(plan: PlacementPlan, timeout_s: float) -> None:
    """Full coexistence: return once the training workers hold their GPUs (their placement group exists)."""
    import ray

    total = ray.cluster_resources().get("GPU", 0.0)
    claimed = plan.num_workers * plan.gpus_per_worker
    deadline = time.time() + timeout_s
    while ray.available_resources().get("GPU", 0.0) > total - claimed + 1e-6:
        if time.time() > deadline:
            raise PlacementError(
                f"the {plan.num_workers} training workers did not claim their GPUs within {timeout_s:g}s"
            )
        time.sleep(0.2)


def fence_free_gpus(plan: PlacementPlan):
    """A placement group over every whole GPU the trainers left free (None when there is none).

    After `wait_for_trainers`, the free GPU total is the whole free GPUs plus one `genrm_share` beside each
    trainer; the fence takes the whole ones so each replica can only land beside a trainer. Remove it
    (`ray.util.remove_placement_group`) once the replicas run.
    """
    import ray
    from ray.util.placement_group import placement_group

    share = 1.0 - plan.gpus_per_worker
    whole = int(ray.available_resources().get("GPU", 0.0) - plan.num_workers * share + 1e-6)
    if whole < 1:
        return None
    fence = placement_group([{"GPU": 1.0}] * whole, strategy="SPREAD")
    if not fence.wait(timeout_seconds=30):
        ray.util.remove_placement_group(fence)
        log.warning("could not fence the %d free GPU(s); GenRM replicas may land beside no trainer", whole)
        return None
    return fence


def shutdown_genrm() -> None:
    """Delete the GenRM application (its replicas free their accelerators); quiet when none is running."""
    from ray import serve

    try:
        serve.delete(APP_NAME)
    except Exception as exc:  # the cluster may already be gone at the end of a failed run
        log.warning("could not delete the GenRM application: %s", exc)
