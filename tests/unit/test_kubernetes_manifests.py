"""cluster=kubernetes: the rendered TrainJob / PyTorchJob and ConfigMap, checked by the Kubeflow Trainer
API models and the Kubernetes client's models (each must take the manifest and give back the same dict:
a misspelled or misplaced key is dropped by the models, so the round trip fails), by a JSON-schema check
generated from the same models, and the apply / status path against a loopback HTTP server."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from dtlaunch.cli import run
from dtlaunch.commands.common import load_job
from dtlaunch.launch import kubernetes

trainer_models = pytest.importorskip("kubeflow_trainer_api.models")
k8s_client = pytest.importorskip("kubernetes.client")

BASE = ["recipe=tiny_ddp", "cluster=kubernetes", "cluster.k8s.image=ghcr.io/acme/dtlaunch:1.0", "cluster.k8s.pvc=runs"]
GPU = ["hardware=h100_80gb", "model=llama3_8b", "strategy=fsdp", "cluster.nodes=2", "training.micro_batch=1"]
GPU += ["training.seq_len=1024", "launch.nproc_per_node=0"]


def render(*overrides: str, name: str = "llama-run") -> list[dict[str, Any]]:
    job = load_job([*BASE, *overrides])
    return kubernetes.render(job.cfg, name)


class _Response:
    """What ApiClient.deserialize reads: the body of an HTTP response."""

    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj)


def k8s_roundtrip(obj: dict, model: str) -> dict:
    api = k8s_client.ApiClient()
    return api.sanitize_for_serialization(api.deserialize(_Response(obj), model))


def test_trainjob_is_a_valid_kubeflow_trainjob() -> None:
    cm, job = render(
        *GPU,
        "cluster.k8s.namespace=team-a",
        "cluster.k8s.service_account=trainer",
        "+cluster.k8s.node_selector.gpu=h100",
        "cluster.k8s.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "+cluster.k8s.env.NCCL_DEBUG=WARN",
        "cluster.k8s.cpu=96",
        "cluster.k8s.memory=1000Gi",
    )
    parsed = trainer_models.TrainerV1alpha1TrainJob.from_dict(job)
    assert parsed.to_dict() == job
    tr = parsed.spec.trainer
    assert (parsed.api_version, parsed.kind) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert (tr.num_nodes, tr.num_proc_per_node) == (2, 8)
    assert tr.resources_per_node.limits["nvidia.com/gpu"].actual_instance == "8"
    assert tr.image == "ghcr.io/acme/dtlaunch:1.0"
    assert parsed.spec.runtime_ref.name == "torch-distributed"
    pod = parsed.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0].template.spec
    pod = pod.template.spec
    assert pod.service_account_name == "trainer" and pod.node_selector == {"gpu": "h100"}
    assert pod.tolerations[0].key == "nvidia.com/gpu"
    assert {v.name: v for v in pod.volumes}["runs"].persistent_volume_claim.claim_name == "runs"
    assert pod.termination_grace_period_seconds == 120
    # The ConfigMap it mounts, by the Kubernetes client's model.
    assert k8s_roundtrip(cm, "V1ConfigMap") == cm
    assert {v.name: v for v in pod.volumes}["job-config"].config_map.name == cm["metadata"]["name"]
    # The manifests survive YAML: what --dry-run prints is what apply sends.
    assert list(yaml.safe_load_all(kubernetes.to_yaml([cm, job]))) == [cm, job]


def _strict(schema: Any) -> None:
    """additionalProperties: false on every object with named properties (pydantic leaves extras open)."""
    if isinstance(schema, dict):
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)


def _wire_types(schema: dict) -> None:
    """The models wrap OpenAPI `oneOf` values (a Quantity: string or number) in an object holding the
    alternatives; on the wire the value is one of them."""
    names = {"str": "string", "float": "number", "int": "integer"}
    for name, definition in schema.get("$defs", {}).items():
        props = definition.get("properties", {})
        if "actual_instance" in props and "one_of_schemas" in props:
            alternatives = sorted(props["one_of_schemas"]["default"])
            schema["$defs"][name] = {"anyOf": [{"type": names[a]} for a in alternatives]}


def test_trainjob_matches_the_schema_of_the_trainer_api() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = trainer_models.TrainerV1alpha1TrainJob.model_json_schema(by_alias=True)
    _wire_types(schema)
    _strict(schema)
    _, job = render(*GPU)
    jsonschema.validate(job, schema)
    bad = json.loads(json.dumps(job))
    bad["spec"]["trainer"]["numNode"] = 2  # a typo the API server would prune (and the job would run on 1 node)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_pytorchjob_replicas_and_elastic_policy() -> None:
    cm, job = render(*GPU, "cluster.nodes=3", "cluster.k8s.api=pytorchjob", "launch.max_restarts=2")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 3, "maxReplicas": 3, "maxRestarts": 2}
    for spec in specs.values():
        # No PyTorchJob model ships with the kubeflow SDK: the pod templates go through the client's models.
        assert k8s_roundtrip(spec["template"], "V1PodTemplateSpec") == spec["template"]
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "elasticPolicy" not in render(*GPU, "cluster.k8s.api=pytorchjob")[1]["spec"]
    assert "Worker" not in render("cluster.k8s.api=pytorchjob")[1]["spec"]["pytorchReplicaSpecs"]


def test_shipped_config_composes_back_to_the_same_job(tmp_path: Path) -> None:
    """The ConfigMap's recipe, composed again as each pod does, is the submitted job with the run
    directory on the PVC and the node layout fixed."""
    from omegaconf import OmegaConf

    overrides = [*BASE, *GPU, "training.steps=7", "optim.lr=1e-4"]
    job = load_job(overrides)
    cm, tj = kubernetes.render(job.cfg, "llama-run")
    ((name, text),) = cm["data"].items()
    (tmp_path / name).write_text(text)
    again = load_job([f"recipe={tmp_path / name}"])
    a = OmegaConf.to_container(job.cfg, resolve=True)
    b = OmegaConf.to_container(again.cfg, resolve=True)
    assert b["run"]["dir"] == "/mnt/dtlaunch/llama-run"
    assert (b["launch"]["nnodes"], b["launch"]["nproc_per_node"], b["launch"]["rdzv_id"]) == (2, 8, "llama-run")
    for key in ("run", "launch"):
        a.pop(key), b.pop(key)
    assert a == b
    assert again.layout == job.layout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["cluster.k8s.image="], "cluster.k8s.image"),
        (["cluster.k8s.pvc="], "cluster.k8s.pvc"),
        (["cluster.k8s.namespace=Team_A"], "cluster.k8s.namespace='Team_A'"),
        (["cluster.k8s.pvc=runs/x"], "cluster.k8s.pvc='runs/x'"),
        (["cluster.k8s.job_name=My.Job"], "My.Job"),
        (["cluster.k8s.mount_path=data"], "cluster.k8s.mount_path"),
        ([*GPU, "launch.nproc_per_node=4"], "launch.nproc_per_node=4"),
        ([*GPU, "cluster.gpus_per_node=16"], "cluster.gpus_per_node=16"),
        (["cluster.k8s.api=mpijob"], "cluster.k8s.api"),
    ],
)
def test_bad_input_refused_before_anything_is_applied(
    args: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *BASE, *args, "run.name=r"])
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, err
    assert len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_plan_that_does_not_fit_refuses_to_submit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    args = [*BASE, "hardware=h100_80gb", "model=llama3_8b", "strategy=ddp", "launch.nproc_per_node=0", "--dry-run"]
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *args])
    with pytest.raises(SystemExit) as exc:
        run()
    out, err = capsys.readouterr()
    assert exc.value.code == 3
    assert "does not fit" in err and "try strategy.zero_stage=2" in err
    assert "TrainJob" not in out


class _FakeApiServer(BaseHTTPRequestHandler):
    """Records requests; answers as the API server does (201 with the object, 200 on GET)."""

    objects: dict[str, Any] = {}
    requests: list[tuple[str, str]] = []

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(("POST", self.path))
        key = f"{self.path}/{body['metadata']['name']}"
        if key in self.objects:
            self._reply(409, {"kind": "Status", "reason": "AlreadyExists", "message": f"{key} already exists"})
            return
        self.objects[key] = body
        self._reply(201, body)

    def do_PUT(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(("PUT", self.path))
        self.objects[self.path] = body
        self._reply(200, body)

    def do_GET(self) -> None:  # noqa: N802
        self.requests.append(("GET", self.path))
        obj = self.objects.get(self.path)
        if obj is None:
            self._reply(404, {"kind": "Status", "message": "not found"})
            return
        status = {
            "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning", "lastTransitionTime": "t"}]
        }
        self._reply(200, {**obj, "status": status})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[tuple[str, type]]:
    handler = type("Handler", (_FakeApiServer,), {"objects": {}, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    try:
        yield str(path), handler
    finally:
        server.shutdown()


def test_submit_applies_and_status_reads_back(
    api_server: tuple[str, type], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    kubeconfig, handler = api_server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "submit", *BASE, "run.name=Demo_Run", "cluster.k8s.namespace=ml"])
    with pytest.raises(SystemExit) as exc:
        run()
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    assert handler.requests == [
        ("POST", "/api/v1/namespaces/ml/configmaps"),
        ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"),
    ]
    sent = handler.objects["/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs/demo-run"]
    assert list(yaml.safe_load_all((tmp_path / "runs/Demo_Run/kubernetes.yaml").read_text()))[1] == sent
    assert trainer_models.TrainerV1alpha1TrainJob.from_dict(sent).to_dict() == sent
    assert "submitted TrainJob demo-run to namespace ml" in out
    monkeypatch.setattr(sys, "argv", ["dtlaunch", "status", "runs/Demo_Run"])
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "TrainJob demo-run: Running (PodsRunning)"


def test_pytorchjob_applied_and_a_second_submission_refused(
    api_server: tuple[str, type], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    kubeconfig, handler = api_server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    args = ["dtlaunch", "submit", *BASE, "run.name=pt", "cluster.k8s.api=pytorchjob", "cluster.nodes=2"]
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code == 0, capsys.readouterr().err
    sent = handler.objects["/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/pt"]
    assert sent["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    capsys.readouterr()
    # The same run again while the job exists: the ConfigMap is replaced, the job refused in one line.
    with pytest.raises(SystemExit) as exc:
        run()
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert [line for line in err.splitlines() if line.strip()] == [
        "dtlaunch: error: PyTorchJob pt already exists in namespace default: delete it first "
        "(kubectl delete pytorchjobs pt -n default); the new one resumes from the run's checkpoints"
    ]
    assert ("PUT", "/api/v1/namespaces/default/configmaps/pt-config") in handler.requests


def test_hf_token_secret_is_a_reference_and_bad_names_are_refused() -> None:
    from dtlaunch.errors import ConfigError

    env = render("cluster.k8s.hf_token_secret=hf-creds:token")[1]["spec"]["trainer"]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-creds", "key": "token"}}} in env
    assert trainer_models.TrainerV1alpha1TrainJob.from_dict(render("cluster.k8s.hf_token_secret=hf-creds")[1])
    for bad in ("HF_Creds", "hf-creds:bad/key"):
        with pytest.raises(ConfigError, match="cluster.k8s.hf_token_secret"):
            render(f"cluster.k8s.hf_token_secret={bad}")
    # Set in cluster.k8s.env, the explicit value wins (one HF_TOKEN entry).
    env = render("cluster.k8s.hf_token_secret=hf-creds", "+cluster.k8s.env.HF_TOKEN=x")[1]["spec"]["trainer"]["env"]
    assert [e for e in env if e["name"] == "HF_TOKEN"] == [{"name": "HF_TOKEN", "value": "x"}]
