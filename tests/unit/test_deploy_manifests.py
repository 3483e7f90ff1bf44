"""The Kubernetes manifest stays true to the server: probe paths exist, flags parse, grace > drain."""

from __future__ import annotations

from pathlib import Path

import yaml

from diffuserve import cli
from diffuserve.server import health
from diffuserve.server.middleware import PUBLIC_PATHS

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "diffuserve.yaml"


def _container() -> tuple[dict, dict]:
    deployment = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_probes_point_at_the_health_routes():
    _, container = _container()
    routes = {route.path for route in health.router.routes}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert path in routes and path in PUBLIC_PATHS  # probes work with --api-key set


def test_args_parse_and_grace_period_covers_the_drain():
    pod, container = _container()
    ns = cli._build_parser().parse_args(container["command"][1:] + container["args"])
    args = cli._server_args(cli._merge_config_file(ns), None)
    assert args.port == container["ports"][0]["containerPort"]
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout_s
