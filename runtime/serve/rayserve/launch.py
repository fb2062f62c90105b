"""`mlcc serve MODEL --ray`: the same OpenAI server, scaled out over Ray Serve replicas (runtime.serve.rayserve).

It joins a running Ray cluster (`--ray-address auto`, the default, or an address) or starts a local one, deploys
the application and serves until SIGTERM or SIGINT, when it deletes the application (Ray Serve drains each replica
for --shutdown-grace-seconds). KubeRay deploys the same application from `app_builder` (deploy/ray/).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from mlcc.errors import EngineConfigError
from mlcc.options import CompileOptions, EngineConfig

if TYPE_CHECKING:   # Ray is optional: imported where --ray is used
    from ray.serve.deployment import Application

log = logging.getLogger(__name__)

APP_NAME = "mlcc"


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `mlcc serve --ray` (declared without importing Ray)."""
    g = parser.add_argument_group("Ray Serve (scale-out)", "needs `pip install 'mlcc[ray]'`")
    g.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: an HTTP ingress routing to --replicas engine replicas")
    g.add_argument("--replicas", type=int, default=1, metavar="N", help="engine replicas (one per GPU)")
    g.add_argument("--ray-address", default="auto", metavar="ADDR",
                   help="the Ray cluster to join: 'auto' (a running one, else start a local one), 'local' (always "
                        "start one), or an address such as ray://head:10001 (default: %(default)s)")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0, metavar="C",
                   help="CPUs Ray reserves for each replica; a CPU replica runs this many threads (default: "
                        "%(default)s)")
    g.add_argument("--num-gpus-per-replica", type=float, default=None, metavar="G",
                   help="GPUs Ray reserves for each replica (default: --tensor-parallel, or 1, for GPU targets; 0 "
                        "for the CPU)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: fewest replicas (default: --replicas); autoscaling is on with --max-replicas")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N", help="autoscaling: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="R",
                   help="autoscaling: ongoing requests per replica it aims for (default: --max-batch)")
    g.add_argument("--max-ongoing-requests", type=int, default=None, metavar="R",
                   help="requests one replica takes at once before the router looks elsewhere (default: 4x "
                        "--max-batch)")


def settings_from_cli(args: argparse.Namespace, config: EngineConfig):
    """The RayServeSettings of parsed `add_ray_arguments` flags, checked."""
    from mlcc.runtime.serve.rayserve.deployments import RayServeSettings

    if args.replicas < 1:
        raise EngineConfigError(f"--replicas must be at least 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < max(args.replicas, args.min_replicas or 1):
        raise EngineConfigError(f"--max-replicas {args.max_replicas} is below --replicas / --min-replicas; raise it")
    if (args.min_replicas is not None or args.target_ongoing_requests is not None) and args.max_replicas is None:
        raise EngineConfigError("--min-replicas and --target-ongoing-requests configure autoscaling: give "
                                "--max-replicas too")
    gpus = args.num_gpus_per_replica
    if gpus is None:
        on_gpu = config.target not in ("llvm", "auto") or _local_gpu(config.target)
        gpus = float(config.tensor_parallel or 1) if on_gpu else 0.0   # a tensor-parallel replica spans its GPUs
    return RayServeSettings(replicas=args.replicas, num_cpus=args.num_cpus_per_replica, num_gpus=gpus,
                            min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                            target_ongoing_requests=args.target_ongoing_requests,
                            max_ongoing_requests=args.max_ongoing_requests,
                            shutdown_grace_seconds=args.shutdown_grace_seconds)


def _local_gpu(target: str) -> bool:
    """Whether "auto" means a GPU here (replicas then each take one)."""
    if target != "auto":
        return False
    from mlcc.targets import detect_local

    return detect_local() != "llvm"


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise EngineConfigError("--ray needs Ray Serve: pip install 'mlcc[ray]' (or 'ray[serve]')") from None


def connect(address: str) -> bool:
    """Joins the cluster `address` names, or starts a local one; whether it started one."""
    import ray

    if address == "local":
        ray.init(include_dashboard=False)
        return True
    if address != "auto":
        ray.init(address=address)
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        log.info("no running Ray cluster found: starting a local one")
        ray.init(include_dashboard=False)
        return True


def run_ray_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Deploys the application and serves until SIGTERM / SIGINT."""
    require_ray()
    import ray
    from ray import serve

    from mlcc.runtime.serve.rayserve.deployments import build_application

    settings = settings_from_cli(args, config)
    started = connect(args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_application(args.model, config, settings, api_key=args.api_key,
                                served_name=args.served_model_name)
        serve.run(app, name=APP_NAME, route_prefix="/")
        log.info("serving %s on http://%s:%d through Ray Serve (%s)", args.model or "the default model", args.host,
                 args.port, f"{settings.replicas} replica(s)" if settings.max_replicas is None else
                 f"{settings.min_replicas or settings.replicas}-{settings.max_replicas} replicas, autoscaled")
        stop.wait()
        log.info("stopping: draining the replicas (up to %.0f s)", settings.shutdown_grace_seconds)
        serve.delete(APP_NAME)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
    return 0


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (`import_path: mlcc.runtime.serve.rayserve.launch:app_builder` in a
    RayService's serveConfigV2): args has `model`, `engine` (EngineConfig fields), `ray` (RayServeSettings fields)
    and optionally `api_key` and `served_model_name`."""
    from mlcc.runtime.serve.rayserve.deployments import RayServeSettings, build_application

    unknown = sorted(set(args) - {"model", "engine", "ray", "api_key", "served_model_name"})
    if unknown:
        raise EngineConfigError(f"unknown application argument(s) {', '.join(unknown)}; known: model, engine, ray, "
                                "api_key, served_model_name")
    engine = dict(args.get("engine") or {})
    if isinstance(engine.get("options"), dict):   # YAML gives the compile options as a mapping
        engine["options"] = CompileOptions.from_dict(engine["options"])
    config = EngineConfig.of(None, **engine)
    settings = RayServeSettings(**dict(args.get("ray") or {}))
    return build_application(args.get("model"), config, settings, api_key=args.get("api_key"),
                              served_name=args.get("served_model_name"))
