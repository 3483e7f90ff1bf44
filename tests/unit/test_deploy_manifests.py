"""The Kubernetes manifests stay true to the server: every `serve` flag parses with the real CLI and passes
its start-up checks, the parallel degrees resolve with the real deployment plan, probe paths exist, the GPU
limit covers --num-gpus, the node rank comes from the pod index, --dist-init-addr names pod 0 through the
headless Service, HTTP reaches node 0 only, the drain grace covers --shutdown-timeout-s, and replicas behind one
Service share PostgreSQL + S3 with their credentials from a Secret; and the pods run the Containerfile's image: its
command, its non-root user, its volumes (the image's own flags parse with the real CLI too)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diffuserve import cli
from diffuserve.config.deployment import resolve_plan
from diffuserve.config.model_profiles import family_profile
from diffuserve.config.server_args import ServerArgs
from diffuserve.hardware import describe_hardware
from diffuserve.launch.ranks import is_serving_process, launch_info
from diffuserve.server import health
from diffuserve.server.middleware import PUBLIC_PATHS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CONTAINERFILE = DEPLOY.parents[1] / "Containerfile"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
GPU = "nvidia.com/gpu"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_PATHS = {"startupProbe": "/health", "readinessProbe": "/health", "livenessProbe": "/liveness"}

SECRETS = {
    ("diffuserve", "api-key"): "an-api-key",
    ("diffuserve-stores", "results-db"): "postgresql://diffuserve:secret@postgres:5432/diffuserve",
    ("diffuserve-stores", "aws-access-key-id"): "AKIAEXAMPLE",
    ("diffuserve-stores", "aws-secret-access-key"): "secret",
}
"""Stand-ins for the Secrets the manifests read (what `kubectl create secret` would hold)."""

# The checkpoints the manifests name, with the facts the plan needs: family and the DiT's attention heads
# (num_attention_heads of each model's transformer/config.json).
CHECKPOINTS = {"FLUX.1-dev": ("flux", 24), "Qwen-Image": ("qwen_image", 24), "Wan2.1-T2V-14B-Diffusers": ("wan", 40)}


@dataclasses.dataclass
class Manifest:
    path: Path
    docs: list[dict[str, Any]]

    @property
    def workload(self) -> dict[str, Any]:
        (workload,) = [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
        return workload

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        return next(c for c in self.pod["containers"] if c["name"] == "diffuserve")

    @property
    def pods(self) -> int:
        """Pods that run together (one per host for a multi-host manifest)."""
        return int(self.workload["spec"].get("replicas", 1))

    def services(self, headless: bool) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == "Service" and (d["spec"].get("clusterIP") == "None") == headless]

    def pod_labels(self, index: int) -> dict[str, str]:
        """The labels Kubernetes gives pod `index` (a StatefulSet adds its pod name and index)."""
        labels = dict(self.workload["spec"]["template"]["metadata"]["labels"])
        if self.workload["kind"] == "StatefulSet":
            labels |= {POD_NAME_LABEL: f"{self.workload['metadata']['name']}-{index}", POD_INDEX_LABEL: str(index)}
        return labels

    def env(self, index: int) -> dict[str, str]:
        """The container's environment in pod `index`, resolving the downward API's pod-index fields."""
        env = {}
        for var in self.container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = _downward(var["valueFrom"]["fieldRef"]["fieldPath"], self.pod_labels(index))
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        return env

    def argv(self, index: int) -> list[str]:
        """`command + args` as Kubernetes runs them in pod `index` ($(VAR) expanded from the env)."""
        env = self.env(index)

        def expand(arg: str) -> str:
            def one(match: re.Match[str]) -> str:
                assert match.group(1) in env, (
                    f"{self.path.name}: {arg!r} names $({match.group(1)}), which no env entry sets"
                )
                return env[match.group(1)]

            return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

        return [expand(a) for a in self.container["command"] + self.container.get("args", [])]

    def server_args(self, index: int = 0) -> ServerArgs:
        argv = self.argv(index)
        assert argv[:2] == ["diffuserve", "serve"], argv
        ns = cli._build_parser().parse_args(argv[1:])
        args = cli._server_args(cli._merge_config_file(ns), None)
        # Every start-up check of ServerArgs; the checkpoint folder exists only in the cluster.
        dataclasses.replace(args, model_path=None).validate()
        return args


def _downward(field: str, labels: dict[str, str]) -> str:
    match = re.fullmatch(r"metadata\.labels\['(.+)'\]", field)
    assert match, f"unexpected downward API field {field!r}"
    return labels[match.group(1)]


def _load(path: Path) -> Manifest:
    return Manifest(path, [d for d in yaml.safe_load_all(path.read_text()) if d])


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def manifest(request: pytest.FixtureRequest) -> Manifest:
    return _load(request.param)


def test_the_three_deployments_are_here():
    assert {p.name for p in MANIFESTS} >= {
        "diffuserve.yaml",
        "diffuserve-multigpu.yaml",
        "diffuserve-multinode.yaml",
        "diffuserve-replicas.yaml",
    }


def _plan(manifest: Manifest, index: int, gpus: int) -> Any:
    """The real resolver for pod `index` on `gpus` described GPUs: degrees that do not fill --num-gpus, or that
    do not divide the DiT's heads, fail here as at start-up."""
    args = manifest.server_args(index)
    family, heads = CHECKPOINTS[Path(args.model.model_path).name]
    profile = dataclasses.replace(family_profile(family), dit_attention_heads=heads)
    plan = resolve_plan(args.deployment, describe_hardware(gpus, 80.0), profile, hosts=args.dist.nnodes)
    assert plan.num_gpus == (args.deployment.num_gpus or 1)
    return plan


def test_flags_parse_on_every_pod_and_the_plan_resolves(manifest: Manifest):
    for index in range(manifest.pods):
        args = manifest.server_args(index)
        assert args.http.port == _container_port(manifest, "http")
        _plan(manifest, index, (args.deployment.num_gpus or 1) // args.dist.nnodes)  # this host's share of the ranks


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_the_plan_resolves_on_the_gpus_of_one_pod(path: Path):
    manifest = _load(path)
    limit = int(manifest.container["resources"]["limits"][GPU])
    for index in range(manifest.pods):
        _plan(manifest, index, limit)


def test_gpu_limit_times_hosts_is_num_gpus(manifest: Manifest):
    args = manifest.server_args()
    limit = int(manifest.container["resources"]["limits"][GPU])
    num_gpus = args.deployment.num_gpus or 1
    assert num_gpus == limit * args.dist.nnodes
    if args.dist.nnodes > 1:
        assert manifest.workload["kind"] == "StatefulSet" and manifest.pods == args.dist.nnodes
    for index in range(manifest.pods):  # the real launch: each pod starts as many ranks as it has GPUs
        info = launch_info(manifest.server_args(index), num_gpus)
        assert (info.local_world_size if info else 1) == limit


def test_several_gpus_get_a_memory_backed_dev_shm(manifest: Manifest):
    if int(manifest.container["resources"]["limits"][GPU]) < 2:
        return
    (mount,) = [m for m in manifest.container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in manifest.pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"].get("sizeLimit")


def test_output_dir_is_on_a_writable_volume(manifest: Manifest):
    args = manifest.server_args()
    if args.store.results_db and args.store.media_store:
        return  # every result is in the shared stores: nothing is kept on the pod
    output_dir = Path(args.http.output_dir)
    mounts = [m for m in manifest.container["volumeMounts"] if output_dir.is_relative_to(m["mountPath"])]
    assert mounts and not mounts[0].get("readOnly"), f"--output-dir {output_dir} is on no writable volume"
    claims = {v["name"] for v in manifest.pod["volumes"] if "persistentVolumeClaim" in v}
    claims |= {t["metadata"]["name"] for t in manifest.workload["spec"].get("volumeClaimTemplates", [])}
    assert mounts[0]["name"] in claims, "the results store must survive a pod restart (a persistent volume)"


def test_replicas_share_the_stores_with_credentials_from_a_secret(manifest: Manifest):
    """Several single-host replicas behind one Service must share PostgreSQL + S3 (a local --output-dir
    would answer a job only on the pod that made it); the database URL and keys come from a Secret."""
    args = manifest.server_args()
    if manifest.workload["kind"] != "Deployment" or manifest.pods < 2:
        return
    assert args.dist.nnodes == 1 and args.store.results_db and args.store.media_store
    env = {v["name"]: v for v in manifest.container["env"]}
    assert any(a == "--results-db=$(RESULTS_DB)" for a in manifest.container["args"]), "the URL holds a password"
    for name in ("RESULTS_DB", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} must come from a Secret"
    (service,) = manifest.services(headless=False)
    assert all(_selects(service, manifest.pod_labels(i)) for i in range(manifest.pods)), "every replica serves"


def test_node_rank_is_the_pod_index(manifest: Manifest):
    args = manifest.server_args()
    if args.dist.nnodes == 1:
        return
    assert any("$(" in a and a.startswith("--node-rank") for a in manifest.container["args"]), (
        "--node-rank is hard-coded"
    )
    assert manifest.workload["spec"]["podManagementPolicy"] == "Parallel"  # pod 0 is never ready alone
    assert [manifest.server_args(i).dist.node_rank for i in range(manifest.pods)] == list(range(args.dist.nnodes))
    per_pod = args.deployment.num_gpus // args.dist.nnodes
    first_ranks = [launch_info(manifest.server_args(i), args.deployment.num_gpus).rank for i in range(manifest.pods)]
    assert first_ranks == [i * per_pod for i in range(manifest.pods)]


def test_dist_init_addr_is_pod_0_through_the_headless_service(manifest: Manifest):
    args = manifest.server_args()
    if args.dist.nnodes == 1:
        return
    (headless,) = manifest.services(headless=True)
    workload = manifest.workload
    assert workload["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["publishNotReadyAddresses"] is True  # the others resolve pod 0 before it is ready
    assert _selects(headless, manifest.pod_labels(0))
    host, port = args.dist.dist_init_addr.rsplit(":", 1)
    pod0 = f"{workload['metadata']['name']}-0.{headless['metadata']['name']}"
    assert host == pod0 or host.startswith(pod0 + "."), f"--dist-init-addr {host} is not pod 0 ({pod0})"
    service_port = next(p for p in headless["spec"]["ports"] if p["port"] == int(port))
    assert _container_port(manifest, service_port["targetPort"]) == int(port)
    assert all(manifest.server_args(i).dist.dist_init_addr == args.dist.dist_init_addr for i in range(manifest.pods))
    info = launch_info(args, args.deployment.num_gpus)  # where the real launch meets
    assert (info.store_host, info.store_port) == (host, int(port))


def test_http_service_routes_to_node_0_only(manifest: Manifest):
    args = manifest.server_args()
    (service,) = manifest.services(headless=False)
    serving = [is_serving_process(manifest.server_args(i)) for i in range(manifest.pods)]
    if args.dist.nnodes > 1:
        assert serving == [True] + [False] * (manifest.pods - 1)
    assert [_selects(service, manifest.pod_labels(i)) for i in range(manifest.pods)] == serving
    (port,) = service["spec"]["ports"]
    assert _container_port(manifest, port["targetPort"]) == args.http.port


def test_probes_point_at_the_health_routes(manifest: Manifest):
    routes = {route.path for route in health.router.routes}
    args = manifest.server_args()
    for name in PROBES:
        probe = manifest.container[name]
        if "httpGet" in probe:
            assert args.dist.nnodes == 1, "with several hosts only node 0 has an HTTP port: use an exec probe"
            path, port = probe["httpGet"]["path"], _container_port(manifest, probe["httpGet"]["port"])
        else:
            path, port = _exec_probe_url(probe)
        assert path == PROBE_PATHS[name] and path in routes and path in PUBLIC_PATHS  # works with --api-key
        assert port == args.http.port


def test_multi_gpu_pod_keeps_the_single_gpu_probes_and_grace():
    single, multi = _load(DEPLOY / "diffuserve.yaml"), _load(DEPLOY / "diffuserve-multigpu.yaml")
    assert all(multi.container[p] == single.container[p] for p in PROBES)
    assert multi.pod["terminationGracePeriodSeconds"] == single.pod["terminationGracePeriodSeconds"]


def test_grace_period_covers_the_drain(manifest: Manifest):
    assert manifest.pod["terminationGracePeriodSeconds"] > manifest.server_args().http.shutdown_timeout_s


def test_exec_probes_ask_node_0_and_pass_elsewhere(manifest: Manifest):
    """Run each exec probe as the kubelet would, against a local stand-in for node 0's /health."""
    execs = {tuple(manifest.container[n]["exec"]["command"]): n for n in PROBES if "exec" in manifest.container[n]}
    if not execs:
        return
    with _status_server() as (base, code):
        for command, name in execs.items():
            local = [re.sub(r"http://127\.0\.0\.1:\d+", base, part) for part in command]
            assert local[0] == "python"
            local[0] = sys.executable
            for index in range(manifest.pods):
                env = manifest.env(index)
                for status in (200, 503) if index == 0 else (503,):  # another node passes whatever pod 0 says
                    code[0] = status
                    rc = subprocess.run(local, env=env, capture_output=True, timeout=60).returncode
                    expected = 0 if env["NODE_RANK"] != "0" or status == 200 else 1
                    assert rc == expected, f"{name} on pod {index} with {status}: exit {rc}"


def test_the_containerfile_entrypoint_parses_and_listens_beyond_the_container():
    image = _containerfile()
    argv = image["entrypoint"]
    assert argv[:2] == ["diffuserve", "serve"]
    args = cli._server_args(cli._merge_config_file(cli._build_parser().parse_args(argv[1:])), None)
    args.validate()
    assert args.http.host == "0.0.0.0" and args.http.port == image["port"]
    assert Path(args.http.output_dir).is_relative_to(image["volumes"]["results"]), "the results store is on no VOLUME"


def test_pods_run_the_image_as_its_user_with_its_volumes(manifest: Manifest):
    """The manifests run what `make image` builds: its command, its non-root user (fsGroup makes the volumes
    writable by it), its cache volume, and its results volume wherever results are kept on the pod."""
    image = _containerfile()
    assert manifest.container["image"].split(":")[0].rsplit("/", 1)[-1] == "diffuserve"
    assert manifest.container["command"] == image["entrypoint"][:2]
    security = manifest.pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == security["fsGroup"] == image["uid"]
    mounts = {m["mountPath"]: m for m in manifest.container["volumeMounts"]}
    args = manifest.server_args()
    wanted = ["cache"] if args.store.results_db and args.store.media_store else ["cache", "results"]
    for volume in wanted:
        path = image["volumes"][volume]
        assert path in mounts and not mounts[path].get("readOnly"), f"{manifest.path.name}: nothing writable on {path}"
    assert _container_port(manifest, "http") == image["port"]


# --- helpers ----------------------------------------------------------------------------------------------
def _container_port(manifest: Manifest, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in manifest.container["ports"] if p["name"] == port)


def _containerfile() -> dict[str, Any]:
    """The runtime contract of the Containerfile: ENTRYPOINT, the VOLUMEs (cache = $DIFFUSERVE_CACHE, results),
    the EXPOSEd port and the user id (ARG UID)."""
    text = CONTAINERFILE.read_text()
    lines = text.replace("\\\n", " ").splitlines()  # continuation lines joined

    def last(instruction: str) -> str:
        return [line.split(None, 1)[1] for line in lines if line.startswith(instruction + " ")][-1]

    volumes = json.loads(last("VOLUME"))
    (cache,) = [v for v in volumes if re.search(rf"DIFFUSERVE_CACHE={re.escape(v)}\b", text)]
    (results,) = [v for v in volumes if v != cache]
    uid = re.search(r"^ARG UID=(\d+)$", text, re.M)
    assert uid, "the Containerfile names its user's id as ARG UID=N"
    return {
        "entrypoint": json.loads(last("ENTRYPOINT")),
        "volumes": {"cache": cache, "results": results},
        "port": int(last("EXPOSE")),
        "uid": int(uid.group(1)),
    }


def _selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def _exec_probe_url(probe: dict[str, Any]) -> tuple[str, int]:
    (match,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", " ".join(probe["exec"]["command"]))
    return match[1], int(match[0])


class _Status(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the status in `code[0]` (what node 0's /health would say)."""

    code = [200]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.code[0])
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _status_server() -> Iterator[tuple[str, list[int]]]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Status.code
    finally:
        server.shutdown()
        server.server_close()
