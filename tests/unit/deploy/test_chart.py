"""The Helm chart (deploy/helm/agl-stream), rendered by helm and validated without a cluster.

For each set of values (external endpoints with SASL/TLS and a shared checkpoint volume;
Strimzi and CloudNativePG with an object store; plain values): `helm lint`, `helm template`,
kubeconform --strict against the Kubernetes JSON schemas that PyPI's kubernetes-validate
carries (the oldest and newest versions there that the chart supports), and what the chart
promises, read off the rendered objects: one image for every role, non-root and read-only,
no secret as a plain value, runners autoscaled on their group's lag and never above the
tasks partitions, GPUs for the trainer and serve, the checkpoint location, Strimzi's user
and CA and CloudNativePG's uri. KEDA's and Strimzi's kinds have no schema in a registry
package: they are checked here field by field. Settings that cannot work are refused.

helm and kubeconform come from the Go module proxy (`make chart-tools`, into .tools/bin)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT

CHART = ROOT / "deploy" / "helm" / "agl-stream"
TOOLS = ROOT / ".tools" / "bin"
HELM, KUBECONFORM = TOOLS / "helm", TOOLS / "kubeconform"
CRD_KINDS = ("ScaledObject", "TriggerAuthentication", "KafkaUser")
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest schemas the package has

pytestmark = pytest.mark.skipif(
    not (HELM.is_file() and KUBECONFORM.is_file()),
    reason="helm and kubeconform are not built: run `make chart-tools` (Go module proxy)",
)

EXTERNAL = {
    "kafka": {
        "bootstrapServers": "kafka-0.kafka:9093,kafka-1.kafka:9093",
        "securityProtocol": "SASL_SSL",
        "saslMechanism": "SCRAM-SHA-512",
        "username": "agl",
        "passwordSecret": {"name": "kafka-creds", "key": "password"},
        "caSecret": {"name": "kafka-ca", "key": "ca.crt"},
    },
    "postgres": {"uriSecret": {"name": "pg-creds", "key": "uri"}},
    "auth": {"tokenSecret": {"name": "agl-token", "key": "token"}},
    "redaction": {"patterns": ["email", "api_key"]},
    "trainer": {"checkpoints": {"persistence": {"accessMode": "ReadWriteMany"}}},
}
OPERATORS = {
    "kafka": {"strimzi": {"enabled": True, "cluster": "prod", "namespace": "kafka"}},
    "postgres": {"cloudnativepg": {"enabled": True, "cluster": "pg"}},
    "taskPartitions": 16,
    "runner": {"autoscaling": {"maxReplicas": 16}},
    "trainer": {
        "checkpoints": {
            "s3": {
                "enabled": True,
                "location": "s3://ckpt/run-1",
                "endpoint": "http://minio.minio:9000",
                "credentialsSecret": "s3-creds",
            }
        }
    },
}
PLAIN = {
    "kafka": {"bootstrapServers": "kafka:9092"},
    "postgres": {"uri": "postgresql://agl:pw@pg:5432/agl_stream"},
    "auth": {"token": "a-token-of-thirty-two-characters!"},
    "runner": {"replicas": 4, "autoscaling": {"enabled": False}},
    "trainer": {"gpus": 0},
    "serve": {"enabled": False},
}


def render(tmp_path: Path, values: dict[str, Any], name: str = "agl") -> list[dict[str, Any]]:
    file = tmp_path / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
    file.write_text(yaml.safe_dump(values))
    done = subprocess.run(
        [str(HELM), "template", name, str(CHART), "--namespace", "ml", "--kube-version",
         KUBE_VERSIONS[-1], "-f", str(file)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (tmp_path / "rendered.yaml").write_text(done.stdout)
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def refused(tmp_path: Path, values: dict[str, Any]) -> str:
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(values))
    done = subprocess.run(
        [str(HELM), "template", "agl", str(CHART), "--kube-version", KUBE_VERSIONS[-1],
         "-f", str(file)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode != 0, "rendered what cannot work"
    return done.stderr


def kind(docs: list[dict[str, Any]], kind_name: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind_name and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind_name, suffix, [d["metadata"]["name"] for d in found])
    return found[0]


def pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def env(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def schema_file(doc: dict[str, Any]) -> str:
    """The file kubeconform looks for: kind, then the API group's first word and version."""
    group, _, version = doc["apiVersion"].rpartition("/")
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{doc['kind'].lower()}{suffix}.json"


def standalone_schemas(target: Path, version: str, files: set[str]) -> None:
    """kubernetes-validate's schemas refer to one definitions file by an absolute path that
    kubeconform cannot resolve; each kind's schema gets the definitions inside it instead
    (the form of kubeconform's own 'standalone' schemas)."""
    import kubernetes_validate

    source = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    source = source / f"v{version}-local-strict"
    out = target / f"v{version}-local-strict"
    out.mkdir(parents=True, exist_ok=True)
    prefix = "/api/_definitions.json#/$defs/"
    definitions: str | None = None
    for name in files:
        if (out / name).exists() or not (source / name).exists():
            continue  # made already, or not a kind of this version (kubeconform says so)
        if definitions is None:
            raw = json.loads((source / "_definitions.json").read_text())["$defs"]
            definitions = json.dumps(raw).replace(prefix, "#/$defs/")
        schema = json.loads((source / name).read_text().replace(prefix, "#/$defs/"))
        schema["$defs"] = json.loads(definitions)
        (out / name).write_text(json.dumps(schema))


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("schemas")


@pytest.mark.parametrize(
    "values", [EXTERNAL, OPERATORS, PLAIN], ids=["external", "operators", "plain"]
)
def test_lint_and_kubeconform(values: dict[str, Any], tmp_path: Path, schemas: Path) -> None:
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    lint = subprocess.run(
        [str(HELM), "lint", "--strict", str(CHART), "-f", str(file), "--kube-version",
         KUBE_VERSIONS[-1]],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(tmp_path, values)
    rendered = tmp_path / "rendered.yaml"
    for version in KUBE_VERSIONS:
        standalone_schemas(schemas, version, {schema_file(d) for d in docs})
    location = str(schemas) + "/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/"
    location += "{{ .ResourceKind }}{{ .KindSuffix }}.json"
    for version in KUBE_VERSIONS:
        done = subprocess.run(
            [str(KUBECONFORM), "-strict", "-summary", "-kubernetes-version", version,
             "-schema-location", location, "-skip", ",".join(CRD_KINDS), str(rendered)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        core = [d for d in docs if d["kind"] not in CRD_KINDS]
        assert f"Valid: {len(core)}, Invalid: 0, Errors: 0" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "values", [EXTERNAL, OPERATORS, PLAIN], ids=["external", "operators", "plain"]
)
def test_every_role_runs_the_one_image_as_a_user(values: dict[str, Any], tmp_path: Path) -> None:
    docs = render(tmp_path, values)
    images = set()
    for name, pod in pods(docs):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == 10001, name
        for container in pod["containers"]:
            images.add(container["image"])
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            for variable in container["env"]:
                secret = any(
                    w in variable["name"] for w in ("PASSWORD", "TOKEN", "DATABASE_URL", "SECRET")
                )
                if secret:  # from a Secret, never a value in the manifest
                    assert "valueFrom" in variable and "value" not in variable, (name, variable)
    assert images == {"agl-stream:0.1.0"}


def test_external_endpoints_with_sasl_tls_and_a_shared_volume(tmp_path: Path) -> None:
    docs = render(tmp_path, EXTERNAL)
    runner = kind(docs, "Deployment", "-runner")["spec"]
    assert "replicas" not in runner  # KEDA's
    pod = runner["template"]["spec"]
    variables = env(pod)
    assert variables["AGL_STREAM_BOOTSTRAP_SERVERS"] == "kafka-0.kafka:9093,kafka-1.kafka:9093"
    assert variables["AGL_STREAM_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert variables["AGL_STREAM_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert variables["AGL_STREAM_SASL_PASSWORD"] == {
        "secretKeyRef": {"name": "kafka-creds", "key": "password"}
    }
    assert variables["AGL_STREAM_SSL_CAFILE"] == "/etc/agl-stream/kafka-ca/ca.crt"
    assert json.loads(variables["AGL_STREAM_REDACT_PATTERNS"]) == ["email", "api_key"]
    assert variables["AGL_STREAM_UPSTREAM_TOKEN"] == {
        "secretKeyRef": {"name": "agl-token", "key": "token"}
    }
    assert "AGL_STREAM_DATABASE_URL" not in variables  # a runner never touches PostgreSQL
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kafka-ca"]["secret"]["secretName"] == "kafka-ca"
    assert (
        volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "agl-agl-stream-checkpoints"
    )

    scaled = kind(docs, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "agl-agl-stream-runner"
    assert scaled["maxReplicaCount"] == 8  # the tasks topic's partitions
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == "agl-runners"
    assert trigger["metadata"]["topic"] == "agl.tasks"
    assert trigger["metadata"]["allowIdleConsumers"] == "false"
    auth = kind(docs, "TriggerAuthentication")["spec"]["secretTargetRef"]
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth}
    assert refs["password"] == ("kafka-creds", "password")
    assert refs["ca"] == ("kafka-ca", "ca.crt")
    keda = kind(docs, "Secret", "-keda-kafka")["stringData"]
    assert keda == {"sasl": "scram_sha512", "tls": "enable", "username": "agl"}

    trainer = kind(docs, "Deployment", "-trainer")["spec"]
    assert trainer["replicas"] == 1 and trainer["strategy"] == {"type": "Recreate"}
    (container,) = trainer["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["args"][container["args"].index("--checkpoint-dir") + 1] == "/checkpoints"
    claim = kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    serve = kind(docs, "Deployment", "-serve")["spec"]["template"]["spec"]
    assert serve["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env(serve)["AGL_STREAM_API_TOKEN"] == {
        "secretKeyRef": {"name": "agl-token", "key": "token"}
    }
    dashboard = kind(docs, "Deployment", "-dashboard")["spec"]["template"]["spec"]
    assert env(dashboard)["AGL_STREAM_DATABASE_URL"] == {
        "secretKeyRef": {"name": "pg-creds", "key": "uri"}
    }
    job = kind(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == (
        "agl-stream topics apply && agl-stream db upgrade"
    )


def test_strimzi_cloudnativepg_and_an_object_store(tmp_path: Path) -> None:
    docs = render(tmp_path, OPERATORS)
    user = kind(docs, "KafkaUser")
    assert user["apiVersion"] == "kafka.strimzi.io/v1beta2"
    assert user["metadata"]["namespace"] == "kafka"
    assert user["metadata"]["labels"]["strimzi.io/cluster"] == "prod"
    assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
    acls = {a["resource"]["type"]: a for a in user["spec"]["authorization"]["acls"]}
    for resource in ("topic", "group", "transactionalId"):
        assert acls[resource]["resource"]["name"] == "agl"
        assert acls[resource]["resource"]["patternType"] == "prefix"
    assert "Write" in acls["transactionalId"]["operations"]
    assert "IdempotentWrite" in acls["cluster"]["operations"]

    pod = kind(docs, "Deployment", "-projector")["spec"]["template"]["spec"]
    variables = env(pod)
    assert variables["AGL_STREAM_BOOTSTRAP_SERVERS"] == "prod-kafka-bootstrap.kafka.svc:9093"
    assert variables["AGL_STREAM_SASL_USERNAME"] == "agl-stream"
    assert variables["AGL_STREAM_SASL_PASSWORD"] == {
        "secretKeyRef": {"name": "agl-stream", "key": "password"}
    }
    assert variables["AGL_STREAM_DATABASE_URL"] == {
        "secretKeyRef": {"name": "pg-app", "key": "uri"}
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kafka-ca"]["secret"]["secretName"] == "prod-cluster-ca-cert"
    assert kind(docs, "ScaledObject")["spec"]["maxReplicaCount"] == 16

    trainer = kind(docs, "Deployment", "-trainer")["spec"]["template"]["spec"]
    (container,) = trainer["containers"]
    assert container["args"][container["args"].index("--checkpoint-dir") + 1] == "s3://ckpt/run-1"
    variables = env(trainer)
    assert variables["AWS_ENDPOINT_URL"] == "http://minio.minio:9000"
    assert variables["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    runner = kind(docs, "Deployment", "-runner")["spec"]["template"]["spec"]
    assert env(runner)["AWS_ENDPOINT_URL"] == "http://minio.minio:9000"  # it loads policies


def test_plain_values_go_into_the_charts_secret(tmp_path: Path) -> None:
    docs = render(tmp_path, PLAIN)
    assert kind(docs, "Deployment", "-runner")["spec"]["replicas"] == 4
    assert not [d for d in docs if d["kind"] in CRD_KINDS]
    secret = kind(docs, "Secret", "-secrets")
    assert secret["stringData"] == {
        "postgres-uri": "postgresql://agl:pw@pg:5432/agl_stream",
        "api-token": "a-token-of-thirty-two-characters!",
    }
    trainer = kind(docs, "Deployment", "-trainer")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in trainer["containers"][0]["resources"].get("limits", {})
    assert not [d for d in docs if d["metadata"]["name"].endswith("-serve")]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**PLAIN, "runner": {"replicas": 9, "autoscaling": {"enabled": False}}},
            "runner.replicas 9 exceeds taskPartitions 8",
        ),
        (
            {**EXTERNAL, "runner": {"autoscaling": {"maxReplicas": 12}}},
            "runner.autoscaling.maxReplicas 12 exceeds taskPartitions 8",
        ),
        (
            {**EXTERNAL, "kafka": {**EXTERNAL["kafka"], "passwordSecret": {"name": ""}}},
            "a SASL security protocol needs kafka.passwordSecret.name or kafka.password",
        ),
        ({"postgres": {"uri": "postgresql://a@b/c"}}, "kafka.bootstrapServers"),
        ({"kafka": {"bootstrapServers": "k:9092"}}, "postgres.uriSecret.name, postgres.uri"),
    ],
    ids=["replicas", "max-replicas", "sasl-password", "no-kafka", "no-postgres"],
)
def test_settings_that_cannot_work_are_refused(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    assert message in refused(tmp_path, values)


def test_the_default_partition_count_is_the_tasks_topics() -> None:
    import tomllib

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    tasks = tomllib.loads((ROOT / "topics" / "tasks.toml").read_text())
    assert values["taskPartitions"] == tasks["partitions"]
