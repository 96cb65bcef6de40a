"""Tests of the Helm chart in charts/topoproxy.

The chart is rendered by Helm's real template engine (helm-python-sdk wraps
Helm's Go code as a shared library, so `helm template` semantics, sprig
functions and values.schema.json validation are the genuine ones), and every
rendered object is validated against the Kubernetes OpenAPI schemas of
several Kubernetes versions with kubernetes-validate in strict mode, which
also rejects misspelt fields.

Run through `cargo test` (proxy-agent/tests/chart.rs) or directly:
    target/chart-venv/bin/python -m pytest charts/tests -q
Set PROXY_AGENT_BIN to an agent binary to also check the rendered arguments
against its `run --help`.
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import re
import subprocess
import threading

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = pathlib.Path(__file__).resolve().parent.parent / "topoproxy"
RELEASE = "tp"
NAMESPACE = "kube-system"
# Schemas to validate against: the oldest kubernetes-validate ships (1.25)
# and today's. Chart.yaml's kubeVersion goes down to 1.17 (the first
# release with EndpointSlices, which the agent negotiates down to
# v1beta1); for the releases without a schema here,
# test_objects_use_only_apis_served_since_1_17 checks the API versions.
KUBE_VERSIONS = ["1.25.0", "1.37.0"]
# (apiVersion, kind) of every object the chart may render, each served by
# every API server since 1.17 (ServiceMonitor is the Prometheus operator's).
SERVED_SINCE_1_17 = {
    ("v1", "ServiceAccount"),
    ("v1", "Service"),
    ("apps/v1", "DaemonSet"),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("v1", "ConfigMap"),
}
# Objects of CRDs have no schema in kubernetes-validate; they are checked by
# hand below.
CRD_KINDS = {"ServiceMonitor"}

NON_DEFAULT = {
    "image": {"repository": "registry.example/topoproxy/agent", "tag": "1.2.3", "pullPolicy": "Always"},
    "logLevel": "proxy_agent=debug,info",
    "kubernetes": {"apiServerHost": "192.0.2.10", "apiServerPort": 6443},
    "cgroup": {"hostRoot": "/sys/fs/cgroup/unified"},
    "bpf": {"root": "/run/bpf", "pinDir": "tp-test", "mountIfMissing": False},
    "maps": {"maxServices": 1024, "maxSlots": 8192, "maxBackends": 4096, "maxSockRevnat": 2048, "maxNpConntrack": 16384, "maxAffinity": 4096},
    "conntrack": {
        "gcIntervalSeconds": 5,
        "tcpTimeoutSeconds": 3600,
        "tcpClosingTimeoutSeconds": 20,
        "tcpSynTimeoutSeconds": 30,
        "otherTimeoutSeconds": 120,
    },
    "devices": ["eth0", "bond0"],
    "nodeIPs": ["192.0.2.21", "2001:db8::21"],
    "snatPortRange": "40000-45000",
    "tcMode": "netlink",
    "tcFastPath": "off",
    "terminateTcp": "never",
    "serviceMetrics": "all",
    "xdp": "native",
    "maglev": {"tableSize": 65521},
    "healthz": {"port": 10266, "bindAddress": "::"},
    "metrics": {
        "port": 9962,
        "bindAddress": "192.0.2.21",
        "service": {"enabled": True, "annotations": {"example.com/scrape": "true"}},
        "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
        "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "Network"}},
    },
    "resources": {"requests": {"cpu": "50m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
    "terminationGracePeriodSeconds": 5,
    "nodeSelector": {"node-role.example/proxy": "yes"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                ]
            }
        }
    },
    "podAnnotations": {"example.com/owner": "net"},
    "extraArgs": ["--poll-interval-ms=500"],
    "extraEnv": [{"name": "RUST_BACKTRACE", "value": "1"}],
}


def render(values: dict | None = None) -> list[dict]:
    """Renders the chart as `helm template` would and returns its objects."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def notes(values: dict | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def agent_container(ds: dict) -> dict:
    containers = ds["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["agent"]
    return containers[0]


def args_of(ds: dict) -> dict[str, str]:
    """`--flag=value` arguments after the `run` subcommand, as a dict."""
    args = agent_container(ds)["args"]
    assert args[0] == "run"
    out = {}
    for a in args[1:]:
        m = re.fullmatch(r"(--[a-z0-9-]+)=(.*)", a)
        assert m, f"argument {a!r} is not --flag=value"
        out[m.group(1)] = m.group(2)
    return out


@pytest.fixture(scope="module")
def default_objects() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def custom_objects() -> list[dict]:
    return render(NON_DEFAULT)


# --- schema validation -------------------------------------------------------


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default-values", "non-default-values"])
def test_objects_use_only_apis_served_since_1_17(values):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.17.0-0"
    for obj in render(values):
        assert (obj["apiVersion"], obj["kind"]) in SERVED_SINCE_1_17, f"{obj['apiVersion']} {obj['kind']} is not served by 1.17"
    # The RBAC rules name API groups whose versions the agent negotiates:
    # events.k8s.io and discovery.k8s.io hold v1beta1 and v1 alike.
    rules = [r for o in render(values) if o["kind"] == "ClusterRole" for r in o["rules"]]
    groups = {g for r in rules for g in r.get("apiGroups", [])}
    assert {"discovery.k8s.io", "events.k8s.io"} <= groups, groups


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default-values", "non-default-values"])
def test_every_object_is_valid_for_kubernetes(values, kube_version):
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {kube_version} at {path}: {e.message}")


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default-values", "non-default-values"])
def test_bidirectional_mounts_only_in_privileged_containers(values):
    # The API server rejects Bidirectional propagation in unprivileged
    # containers (pkg/apis/core/validation); the OpenAPI schema cannot say so.
    ds = one(render(values), "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m.get("mountPropagation") == "Bidirectional":
                assert c.get("securityContext", {}).get("privileged") is True, c["name"]
        # Nor may allowPrivilegeEscalation be false next to CAP_SYS_ADMIN.
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is False:
            assert "SYS_ADMIN" not in sc.get("capabilities", {}).get("add", [])
            assert not sc.get("privileged")


def test_helm_lint_is_clean():
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error; 1 ("icon is recommended") is info.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- the default install -----------------------------------------------------


def test_default_objects(default_objects):
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]


def test_labels_follow_helm_conventions(default_objects, custom_objects):
    for objects, version in [(default_objects, "0.1.0"), (custom_objects, "1.2.3")]:
        for o in objects:
            labels = o["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == "topoproxy", o["kind"]
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/version"] == version
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["helm.sh/chart"] == "topoproxy-0.1.0"
        ds = one(objects, "DaemonSet")
        selector = ds["spec"]["selector"]["matchLabels"]
        # The selector is immutable: it must not carry the version.
        assert selector == {"app.kubernetes.io/name": "topoproxy", "app.kubernetes.io/instance": RELEASE}
        pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()


def test_daemonset_runs_on_every_node_on_the_host_network(default_objects):
    ds = one(default_objects, "DaemonSet")
    assert ds["metadata"]["namespace"] == NAMESPACE
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["terminationGracePeriodSeconds"] == 30
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert pod["serviceAccountName"] == "tp-topoproxy"
    assert one(default_objects, "ServiceAccount")["metadata"]["name"] == "tp-topoproxy"


def test_agent_gets_only_the_capabilities_it_needs(default_objects):
    ds = one(default_objects, "DaemonSet")
    c = agent_container(ds)
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "NET_ADMIN", "PERFMON"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert c["image"] == "topoproxy/proxy-agent:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    # The only privileged piece is the init container that mounts bpffs.
    init = ds["spec"]["template"]["spec"]["initContainers"]
    assert [i["name"] for i in init] == ["mount-bpffs"]
    assert init[0]["securityContext"] == {"privileged": True}
    assert init[0]["volumeMounts"] == [{"name": "bpffs", "mountPath": "/sys/fs/bpf", "mountPropagation": "Bidirectional"}]
    assert "mount -t bpf bpf /sys/fs/bpf" in init[0]["command"][-1]


def test_agent_arguments_environment_and_probes(default_objects):
    ds = one(default_objects, "DaemonSet")
    c = agent_container(ds)
    assert args_of(ds) == {
        "--node": "$(NODE_NAME)",
        "--cgroup": "/run/topoproxy/cgroup",
        "--bpffs": "/sys/fs/bpf/topoproxy",
        # No --max-*: the agent sizes its maps within the budget.
        "--map-memory-budget": "64",
        "--conntrack-gc-interval-secs": "15",
        "--conntrack-tcp-timeout-secs": "21600",
        "--conntrack-tcp-closing-timeout-secs": "10",
        "--conntrack-tcp-syn-timeout-secs": "60",
        "--conntrack-other-timeout-secs": "60",
        "--log-level": "info",
        # kube-proxy's defaults: health for load balancers on every
        # address, the metrics (Service names) on loopback.
        "--healthz-bind-address": "0.0.0.0:10256",
        "--metrics-bind-address": "127.0.0.1:10249",
        "--devices": "auto",
        "--tc-mode": "auto",
        "--tc-fast-path": "auto",
        "--terminate-tcp": "gone",
        "--service-metrics": "topology",
        "--xdp": "off",
        "--maglev-table-size": "16381",
    }
    assert c["env"] == [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    assert c["ports"] == [
        {"name": "healthz", "containerPort": 10256, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 10249, "protocol": "TCP"},
    ]
    # Liveness is staleness only: /healthz also fails while the node is
    # being deleted, which must drain load balancers, not restart the agent.
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "healthz"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    # Map memory is charged to the agent: no memory limit, a request that
    # covers the default maps.
    assert "limits" not in c["resources"] or not c["resources"]["limits"].get("memory")
    assert c["resources"]["requests"]["memory"] == "384Mi"


def test_host_mounts(default_objects):
    ds = one(default_objects, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["bpffs"]["hostPath"] == {"path": "/sys/fs/bpf", "type": "DirectoryOrCreate"}
    assert volumes["cgroup"]["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"}
    mounts = {m["name"]: m for m in agent_container(ds)["volumeMounts"]}
    assert mounts["bpffs"] == {"name": "bpffs", "mountPath": "/sys/fs/bpf", "mountPropagation": "HostToContainer"}
    assert mounts["cgroup"] == {"name": "cgroup", "mountPath": "/run/topoproxy/cgroup", "readOnly": True}


def test_rbac_is_read_only_except_events(default_objects):
    role = one(default_objects, "ClusterRole")
    rules = [(tuple(r["apiGroups"]), tuple(sorted(r["resources"])), tuple(sorted(r["verbs"]))) for r in role["rules"]]
    read = ("get", "list", "watch")
    assert sorted(rules) == sorted([
        (("",), ("nodes", "services"), read),
        (("discovery.k8s.io",), ("endpointslices",), read),
        (("",), ("events",), ("create", "patch")),
        (("events.k8s.io",), ("events",), ("create", "patch")),
    ])
    for r in role["rules"]:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
    binding = one(default_objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tp-topoproxy", "namespace": NAMESPACE}]


# The only writes the agent's identity may make: Events about the objects
# it reads (core/v1 before 1.19, events.k8s.io/v1 after). Verbs that act on
# RBAC itself or on other identities are never granted, not even with read.
EVENT_VERBS = {"create", "patch"}
READ_VERBS = {"get", "list", "watch"}
ESCALATING_VERBS = {"escalate", "bind", "impersonate", "approve", "sign", "*"}


@pytest.mark.parametrize(
    "values",
    [
        None,
        NON_DEFAULT,
        {"privileged": True},
        {"kubeProxyCleanup": {"enabled": True}},
        {"metrics": {"service": {"enabled": True}, "serviceMonitor": {"enabled": True}}},
    ],
    ids=["default-values", "non-default-values", "privileged", "kube-proxy-cleanup", "monitoring"],
)
def test_rbac_stays_read_only_apart_from_events_whatever_the_values(values):
    objects = render(values)
    roles = [o for o in objects if o["kind"] in ("ClusterRole", "Role")]
    assert [r["kind"] for r in roles] == ["ClusterRole"], "one ClusterRole, no namespaced Role"
    for rule in roles[0]["rules"]:
        assert not rule.get("nonResourceURLs") and not rule.get("resourceNames"), rule
        verbs, resources, groups = set(rule["verbs"]), set(rule["resources"]), set(rule["apiGroups"])
        assert not verbs & ESCALATING_VERBS and "*" not in resources and "*" not in groups, rule
        if verbs <= READ_VERBS:
            # Read access only to what the agent turns into map entries:
            # no Secrets, ConfigMaps or Pods.
            assert resources <= {"services", "nodes", "endpointslices"}, rule
            assert groups <= {"", "discovery.k8s.io"}, rule
        else:
            assert verbs <= EVENT_VERBS and resources == {"events"} and groups <= {"", "events.k8s.io"}, rule
    # Bound to the chart's own ServiceAccount only, and to nothing else.
    bindings = [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert [b["kind"] for b in bindings] == ["ClusterRoleBinding"]
    assert bindings[0]["roleRef"]["name"] == roles[0]["metadata"]["name"]
    assert [(s["kind"], s["namespace"]) for s in bindings[0]["subjects"]] == [("ServiceAccount", NAMESPACE)]


def test_notes_say_how_to_inspect_and_warn_about_the_api_server():
    text = notes()
    assert "rollout status daemonset/tp-topoproxy" in text
    assert "proxy-agent dump --bpffs /sys/fs/bpf/topoproxy" in text
    assert "kubernetes.apiServerHost is not set" in text
    assert "kubernetes.apiServerHost is not set" not in notes(NON_DEFAULT)


# --- non-default values ------------------------------------------------------


def test_values_reach_the_agent(custom_objects):
    ds = one(custom_objects, "DaemonSet")
    c = agent_container(ds)
    pod = ds["spec"]["template"]["spec"]
    assert args_of(ds) == {
        "--node": "$(NODE_NAME)",
        "--cgroup": "/run/topoproxy/cgroup",
        "--bpffs": "/run/bpf/tp-test",
        "--map-memory-budget": "64",
        "--max-services": "1024",
        "--max-slots": "8192",
        "--max-backends": "4096",
        "--max-sock-revnat": "2048",
        "--max-np-conntrack": "16384",
        "--max-affinity": "4096",
        "--conntrack-gc-interval-secs": "5",
        "--conntrack-tcp-timeout-secs": "3600",
        "--conntrack-tcp-closing-timeout-secs": "20",
        "--conntrack-tcp-syn-timeout-secs": "30",
        "--conntrack-other-timeout-secs": "120",
        "--log-level": "proxy_agent=debug,info",
        "--healthz-bind-address": "[::]:10266",
        "--metrics-bind-address": "192.0.2.21:9962",
        "--devices": "eth0,bond0",
        "--node-ip": "192.0.2.21,2001:db8::21",
        "--snat-port-range": "40000-45000",
        "--tc-mode": "netlink",
        "--tc-fast-path": "off",
        "--terminate-tcp": "never",
        "--service-metrics": "all",
        "--xdp": "native",
        "--maglev-table-size": "65521",
        "--poll-interval-ms": "500",
    }
    assert c["image"] == "registry.example/topoproxy/agent:1.2.3"
    assert c["imagePullPolicy"] == "Always"
    assert c["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "KUBERNETES_SERVICE_HOST", "value": "192.0.2.10"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"},
        {"name": "RUST_BACKTRACE", "value": "1"},
    ]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"healthz": 10266, "metrics": 9962}
    assert c["resources"] == NON_DEFAULT["resources"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cgroup"]["hostPath"]["path"] == "/sys/fs/cgroup/unified"
    assert volumes["bpffs"]["hostPath"]["path"] == "/run/bpf"
    assert "initContainers" not in pod, "bpf.mountIfMissing=false drops the privileged init container"
    assert pod["terminationGracePeriodSeconds"] == 5
    # Helm merges maps with the defaults (a `null` value would remove one).
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", **NON_DEFAULT["nodeSelector"]}
    assert pod["tolerations"] == NON_DEFAULT["tolerations"]
    assert pod["affinity"] == NON_DEFAULT["affinity"]
    assert ds["spec"]["template"]["metadata"]["annotations"] == NON_DEFAULT["podAnnotations"]


def test_probe_settings_keep_the_probe_paths():
    values = {"livenessProbe": {"periodSeconds": 20, "failureThreshold": 3}, "readinessProbe": {"periodSeconds": 2}}
    c = agent_container(one(render(values), "DaemonSet"))
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "healthz"}
    assert (c["livenessProbe"]["periodSeconds"], c["livenessProbe"]["failureThreshold"]) == (20, 3)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    assert c["readinessProbe"]["periodSeconds"] == 2


def test_devices_default_to_auto_and_take_a_list_or_none(default_objects, custom_objects):
    # The agent's own default is auto too; the chart says it explicitly so
    # that the DaemonSet shows where the TC programs go.
    args = args_of(one(default_objects, "DaemonSet"))
    assert args["--devices"] == "auto"
    assert not {"--node-ip", "--snat-port-range"} & set(args)
    assert args_of(one(custom_objects, "DaemonSet"))["--devices"] == "eth0,bond0"
    assert args_of(one(render({"devices": "none"}), "DaemonSet"))["--devices"] == "none"
    assert args_of(one(render({"devices": ["eth1"]}), "DaemonSet"))["--devices"] == "eth1"


def test_xdp_is_off_and_maglev_tables_on_by_default(default_objects):
    # Passed explicitly, as `devices` is, so that the DaemonSet shows them.
    args = args_of(one(default_objects, "DaemonSet"))
    assert (args["--tc-mode"], args["--xdp"], args["--maglev-table-size"]) == ("auto", "off", "16381")
    # Capacities the chart does not set are the agent's to size.
    assert "--max-affinity" not in args


# A null deletes the key from the merged values (Helm's coalescing), so
# the template's own default applies.
@pytest.mark.parametrize("mode, flag", [("auto", "auto"), ("tcx", "tcx"), ("netlink", "netlink"), (None, "auto")])
def test_tc_mode_value_becomes_the_flag(mode, flag):
    assert args_of(one(render({"tcMode": mode}), "DaemonSet"))["--tc-mode"] == flag


# The TC fast path is on unless told off; a bare off in YAML is false.
@pytest.mark.parametrize("value, flag", [("auto", "auto"), ("all", "all"), ("off", "off"), (False, "off"), (None, "auto")])
def test_tc_fast_path_value_becomes_the_flag(value, flag):
    assert args_of(one(render({"tcFastPath": value}), "DaemonSet"))["--tc-fast-path"] == flag


# Connections to departed backends: TCP ends only once its endpoint is
# gone after terminating, unless told never to.
@pytest.mark.parametrize("value, flag", [("gone", "gone"), ("never", "never"), (None, "gone")])
def test_terminate_tcp_value_becomes_the_flag(value, flag):
    assert args_of(one(render({"terminateTcp": value}), "DaemonSet"))["--terminate-tcp"] == flag


# Per-Service connection counts: Services with topology one by one unless
# told otherwise.
@pytest.mark.parametrize("value, flag", [("topology", "topology"), ("all", "all"), ("none", "none"), (None, "topology")])
def test_service_metrics_value_becomes_the_flag(value, flag):
    assert args_of(one(render({"serviceMetrics": value}), "DaemonSet"))["--service-metrics"] == flag


# `false` is what YAML makes of a bare `off` in a values file (YAML 1.1
# booleans, which Helm's parser follows); the chart takes it as off.
@pytest.mark.parametrize(
    "xdp, flag",
    [("off", "off"), ("auto", "auto"), ("native", "native"), (False, "off")],
)
def test_xdp_value_becomes_the_flag(xdp, flag):
    assert args_of(one(render({"xdp": xdp}), "DaemonSet"))["--xdp"] == flag


@pytest.mark.parametrize(
    "size, flag",
    [
        ("off", "off"),
        (16381, "16381"),
        (65521, "65521"),
        # --set-string and quoted YAML give strings.
        ("16381", "16381"),
        ("65521", "65521"),
        (False, "off"),
        # A null deletes the key (Helm's coalescing): the default size.
        (None, "16381"),
    ],
)
def test_maglev_table_size_value_becomes_the_flag(size, flag):
    args = args_of(one(render({"maglev": {"tableSize": size}}), "DaemonSet"))
    assert args["--maglev-table-size"] == flag


@pytest.mark.parametrize(
    "values, flags",
    [
        # A values file (-f), through Helm's own YAML parser: bare off is false.
        (helm.values_from_yaml("xdp: off\nmaglev:\n  tableSize: off\n"), ("off", "off")),
        (helm.values_from_yaml("xdp: auto\nmaglev:\n  tableSize: 16381\n"), ("auto", "16381")),
        # --set and --set-string, through Helm's strvals parser.
        (helm.parse_set_string("xdp=native,maglev.tableSize=65521"), ("native", "65521")),
        (helm.parse_set_string("xdp=off,maglev.tableSize=off"), ("off", "off")),
        (helm.parse_set_string_values("maglev.tableSize=65521"), ("off", "65521")),
    ],
    ids=["file-bare-off", "file-auto-16381", "set-native-65521", "set-off", "set-string-65521"],
)
def test_xdp_and_maglev_as_users_write_them(values, flags):
    args = args_of(one(render(values), "DaemonSet"))
    assert (args["--xdp"], args["--maglev-table-size"]) == flags


@pytest.mark.parametrize(
    "values, path, allowed",
    [
        ({"xdp": "fast"}, "/xdp", "'off', 'auto', 'native'"),
        ({"xdp": "Native"}, "/xdp", "'off', 'auto', 'native'"),
        ({"xdp": True}, "/xdp", "'off', 'auto', 'native'"),
        ({"xdp": ""}, "/xdp", "'off', 'auto', 'native'"),
        ({"tcMode": "clsact"}, "/tcMode", "'auto', 'tcx', 'netlink'"),
        ({"terminateTcp": "always"}, "/terminateTcp", "'gone', 'never'"),
        ({"serviceMetrics": "some"}, "/serviceMetrics", "'topology', 'all', 'none'"),
        ({"maglev": {"tableSize": 1234}}, "/maglev/tableSize", "16381, 65521"),
        ({"maglev": {"tableSize": "1234"}}, "/maglev/tableSize", "16381, 65521"),
        ({"maglev": {"tableSize": 16383}}, "/maglev/tableSize", "16381, 65521"),
        ({"maglev": {"tableSize": True}}, "/maglev/tableSize", "16381, 65521"),
    ],
)
def test_bad_tc_mode_xdp_or_maglev_values_are_refused_naming_the_value(values, path, allowed):
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    message = str(e.value)
    assert f"at '{path}'" in message and allowed in message, message


# A null in the user's values deletes the chart's default (Helm's
# coalescing); a group the templates read must then be named as missing,
# not fail deep in a template on a nil pointer.
@pytest.mark.parametrize(
    "group",
    [
        "image", "kubernetes", "cgroup", "bpf", "maps", "conntrack", "maglev", "healthz", "metrics",
        "livenessProbe", "readinessProbe", "kubeProxyCleanup", "serviceAccount", "rbac",
    ],
)
def test_a_group_set_to_null_is_refused_by_name(group):
    with pytest.raises(helm.HelmValuesError) as e:
        render({group: None})
    assert f"missing property '{group}'" in str(e.value), str(e.value)


def test_misspelt_maglev_key_is_refused():
    with pytest.raises(helm.HelmValuesError) as e:
        render({"maglev": {"tablesize": 16381}})
    assert "tablesize" in str(e.value)


def test_privileged_mode_replaces_capabilities():
    ds = one(render({"privileged": True}), "DaemonSet")
    assert agent_container(ds)["securityContext"]["privileged"] is True
    assert "capabilities" not in agent_container(ds)["securityContext"]


def test_service_monitor_only_when_enabled(default_objects, custom_objects):
    assert by_kind(default_objects, "ServiceMonitor") == []
    assert by_kind(default_objects, "Service") == []
    # The headless Service alone.
    only_service = render({"metrics": {"service": {"enabled": True}}})
    assert len(by_kind(only_service, "Service")) == 1
    assert by_kind(only_service, "ServiceMonitor") == []
    # The ServiceMonitor brings its Service along.
    sm_only = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert len(by_kind(sm_only, "Service")) == 1 and len(by_kind(sm_only, "ServiceMonitor")) == 1

    svc = one(custom_objects, "Service")
    sm = one(custom_objects, "ServiceMonitor")
    ds = one(custom_objects, "DaemonSet")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9962, "targetPort": "metrics", "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert svc["metadata"]["annotations"] == {"example.com/scrape": "true"}
    # prometheus-operator's ServiceMonitor: no schema here, so check its shape.
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == NAMESPACE
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    # The connection counts' own namespace/service labels survive the scrape.
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize(
    "metrics, address",
    [
        ({}, "127.0.0.1:10249"),
        ({"service": {"enabled": True}}, "0.0.0.0:10249"),
        ({"serviceMonitor": {"enabled": True}}, "0.0.0.0:10249"),
        # Offline "auto" renders no ServiceMonitor, so nothing scrapes.
        ({"serviceMonitor": {"enabled": "auto"}}, "127.0.0.1:10249"),
        ({"bindAddress": "::", "port": 9000, "serviceMonitor": {"enabled": True}}, "[::]:9000"),
        ({"bindAddress": "::1"}, "[::1]:10249"),
    ],
    ids=["default", "service", "service-monitor", "auto-offline", "ipv6-any", "ipv6-loopback"],
)
def test_metrics_stay_on_loopback_unless_scraped(metrics, address):
    objects = render({"metrics": metrics})
    assert args_of(one(objects, "DaemonSet"))["--metrics-bind-address"] == address
    # The health endpoints do not move with the metrics.
    assert args_of(one(objects, "DaemonSet"))["--healthz-bind-address"] == "0.0.0.0:10256"
    for svc in by_kind(objects, "Service"):
        port = address.rsplit(":", 1)[1]
        assert svc["spec"]["ports"] == [{"name": "metrics", "port": int(port), "targetPort": "metrics", "protocol": "TCP"}]
    assert ("on the node only" in notes({"metrics": metrics})) == address.startswith("127.0.0.1:")


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"metrics": {"bindAddress": "127.0.0.1", "serviceMonitor": {"enabled": True}}}, "metrics.bindAddress 127.0.0.1 is loopback"),
        ({"metrics": {"bindAddress": "::1", "service": {"enabled": True}}}, "metrics.bindAddress ::1 is loopback"),
        ({"healthz": {"port": 10249}}, "healthz.port and metrics.port are both 10249"),
    ],
    ids=["loopback-service-monitor", "loopback-service", "one-port"],
)
def test_unscrapable_or_clashing_addresses_are_refused(values, complaint):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert complaint in str(e.value), str(e.value)


def test_service_monitor_auto_follows_the_clusters_apis():
    # Offline, Helm's capabilities hold only the built-in APIs: "auto"
    # renders nothing (the real API server test installs the CRD).
    auto = render({"metrics": {"serviceMonitor": {"enabled": "auto"}}})
    assert by_kind(auto, "ServiceMonitor") == [] and by_kind(auto, "Service") == []


DASHBOARD = CHART / "dashboards" / "topoproxy.json"


def test_grafana_dashboard_only_when_enabled(default_objects, custom_objects):
    assert by_kind(default_objects, "ConfigMap") == []
    cm = one(custom_objects, "ConfigMap")
    # The sidecar convention: the label, in the namespace it watches.
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Network"}
    # The file, unchanged, as the ConfigMap's one key.
    assert json.loads(cm["data"]["topoproxy.json"]) == json.loads(DASHBOARD.read_text())
    own = one(render({"metrics": {"grafanaDashboard": {"enabled": True, "label": "dash", "labelValue": "yes"}}}), "ConfigMap")
    assert own["metadata"]["labels"]["dash"] == "yes" and "grafana_dashboard" not in own["metadata"]["labels"]
    assert own["metadata"]["namespace"] == NAMESPACE


def test_dashboard_has_the_panels_an_operator_needs():
    dash = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dash["panels"]]
    for want in ["tier", "kept in zone", "Programming latency", "terminated", "Map occupancy", "drops"]:
        assert any(want.lower() in t.lower() for t in titles), f"no panel about {want!r} in {titles}"
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["expr"].strip() and t["refId"], panel["title"]
    # Panels do not overlap on Grafana's 24-column grid.
    cells = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_rbac_and_service_account_can_be_turned_off():
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}})
    assert sorted(o["kind"] for o in objects) == ["DaemonSet"]
    assert one(objects, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"maps": {"maxSlots": 0}}, "/maps/maxSlots"),
        ({"maps": {"memoryBudgetMiB": 0}}, "/maps/memoryBudgetMiB"),
        ({"maps": {"maxServices": "many"}}, "/maps/maxServices"),
        ({"devices": ["eth0,eth1"]}, "/devices"),
        ({"devices": ["eth0", "none"]}, "/devices"),
        ({"devices": []}, "/devices"),
        ({"devices": "eth0"}, "/devices"),
        ({"snatPortRange": "40000"}, "/snatPortRange"),
        ({"conntrack": {"tcpTimeoutSeconds": 0}}, "/conntrack/tcpTimeoutSeconds"),
        ({"conntrack": {"gcIntervalSeconds": -1}}, "/conntrack/gcIntervalSeconds"),
        ({"metrics": {"port": 70000}}, "/metrics/port"),
        ({"healthz": {"port": 0}}, "/healthz/port"),
        ({"healthz": {"bindAddress": ""}}, "/healthz/bindAddress"),
        ({"logLevl": "debug"}, "logLevl"),
        ({"bpf": {"root": "relative/path"}}, "/bpf/root"),
        ({"kubeProxyCleanup": {"nodePortRange": "30000"}}, "/kubeProxyCleanup/nodePortRange"),
        ({"kubeProxyCleanup": {"enable": True}}, "enable"),
    ],
)
def test_bad_values_are_rejected_by_the_schema(values, complaint):
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert complaint in str(e.value)


# --- moving from kube-proxy -------------------------------------------------


def test_kube_proxy_cleanup_is_off_by_default(default_objects):
    pod = one(default_objects, "DaemonSet")["spec"]["template"]["spec"]
    assert [i["name"] for i in pod["initContainers"]] == ["mount-bpffs"]
    assert "host-root" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("mount_bpffs", [True, False])
def test_kube_proxy_cleanup_runs_the_agent_with_the_nodes_tools(mount_bpffs):
    values = {"kubeProxyCleanup": {"enabled": True, "nodePortRange": "30000-31000"}, "bpf": {"mountIfMissing": mount_bpffs}}
    objects = render(values)
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert [i["name"] for i in pod["initContainers"]] == (["mount-bpffs"] if mount_bpffs else []) + ["cleanup-kube-proxy"]
    step = pod["initContainers"][-1]
    assert step["image"] == agent_container(one(objects, "DaemonSet"))["image"]
    assert step["securityContext"] == {"privileged": True}
    assert step["volumeMounts"] == [{"name": "host-root", "mountPath": "/host"}]
    assert step["command"][:2] == ["sh", "-c"]
    script = " ".join(step["command"][2].split())
    # The node's tools (chrooted into its root), and a failure never keeps
    # the agent from starting.
    assert script.startswith("proxy-agent cleanup-kube-proxy --host-root=/host --node-port-range=30000-31000 || echo ")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-root"]["hostPath"] == {"path": "/", "type": "Directory"}
    for kube_version in KUBE_VERSIONS:
        for obj in objects:
            if obj["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(obj, kube_version, strict=True)


def test_the_cleanup_steps_flags_exist_in_the_agent():
    binary = os.environ.get("PROXY_AGENT_BIN")
    if not binary:
        pytest.skip("PROXY_AGENT_BIN is not set (cargo test sets it)")
    assert {"--host-root", "--node-port-range", "--dry-run"} <= agent_flags(binary, "cleanup-kube-proxy")


def readme_guide_commands() -> list[str]:
    """The commands of the migration guide (docs/src/user-guide/migration.md:
    the ```sh blocks after `<!-- migration-guide -->`), continuation lines
    joined."""
    lines = (CHART.parent.parent / "docs/src/user-guide/migration.md").read_text().splitlines()
    out, cmd, inside = [], "", False
    for prev, line in zip([""] + lines, lines):
        if line.strip() == "```sh" and prev.strip() == "<!-- migration-guide -->":
            inside = True
        elif inside and line.strip() == "```":
            inside = False
        elif inside and line.strip() and not line.strip().startswith("#"):
            if line.rstrip().endswith("\\"):
                cmd += line.rstrip()[:-1].strip() + " "
            else:
                out.append(cmd + line.strip())
                cmd = ""
    return out


def test_the_migration_guides_helm_commands_name_real_values():
    helm_commands = [c for c in readme_guide_commands() if c.startswith("helm install") or c.startswith("helm upgrade")]
    assert len(helm_commands) == 2, readme_guide_commands()
    for command in helm_commands:
        assert " charts/topoproxy " in command, command
        values: dict = {}
        for key, value in re.findall(r"--set ([A-Za-z0-9_.]+)=(\S+)", command):
            node = values
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = {"true": True, "false": False}.get(value, value)
        assert values, command
        # Unknown keys fail the schema (additionalProperties: false).
        objects = render(values)
        if values.get("kubeProxyCleanup", {}).get("enabled"):
            pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
            assert "cleanup-kube-proxy" in [i["name"] for i in pod["initContainers"]]


class _StandInApiServer(http.server.BaseHTTPRequestHandler):
    """Just enough of the API server for Helm's `lookup`: discovery of
    apps/v1 and a GET of one DaemonSet (kube-system/kube-proxy when the
    server's `kube_proxy` is set), answered as the API server answers."""

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        path = self.path.split("?")[0]
        self.server.requests.append(path)
        not_found = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                     "message": f"{path} not found"}
        if path == "/version":
            self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
        elif path == "/api":
            self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        elif path == "/api/v1":
            self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": []})
        elif path == "/apis":
            group = {"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
                     "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"}}
            self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]})
        elif path == "/apis/apps/v1":
            resource = {"name": "daemonsets", "singularName": "daemonset", "namespaced": True, "kind": "DaemonSet",
                        "verbs": ["get", "list", "watch"], "shortNames": ["ds"]}
            self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1", "resources": [resource]})
        elif path == "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy" and self.server.kube_proxy:
            self._send(200, {"apiVersion": "apps/v1", "kind": "DaemonSet",
                             "metadata": {"name": "kube-proxy", "namespace": "kube-system", "uid": "1"},
                             "spec": {"selector": {"matchLabels": {"k8s-app": "kube-proxy"}}}})
        else:
            self._send(404, not_found)


def render_against_cluster(kube_proxy: bool) -> tuple[str, list[str]]:
    """NOTES.txt as `helm install` renders it against a cluster with (or
    without) a kube-proxy DaemonSet, and the paths Helm asked for."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandInApiServer)
    server.kube_proxy = kube_proxy
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        "users": [{"name": "t", "user": {}}],
    })
    try:
        with helm.Config(kubeconfig_content=kubeconfig, namespace=NAMESPACE) as cfg, helm.Chart.load(CHART) as chart:
            manifests = cfg.render(chart, None, name=RELEASE, namespace=NAMESPACE, is_install=True)
    finally:
        server.shutdown()
    return next(t for p, t in manifests.items() if p.endswith("NOTES.txt")), server.requests


def test_notes_say_how_to_move_from_a_kube_proxy_found_at_install():
    text, requests = render_against_cluster(kube_proxy=True)
    assert "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy" in requests, requests
    assert "kubeProxyCoexistence: kube-system/kube-proxy is a DaemonSet of this cluster." in text
    assert f"helm upgrade {RELEASE} CHART -n {NAMESPACE} --reuse-values --set kubeProxyCleanup.enabled=true" in text
    assert "kubeProxyCoexistence" not in render_against_cluster(kube_proxy=False)[0]
    # Offline (helm template, --dry-run=client) the cluster cannot be seen.
    assert "kubeProxyCoexistence" not in notes()


# --- the chart and the agent binary agree -----------------------------------


def agent_flags(binary: str, subcommand: str) -> set[str]:
    out = subprocess.run([binary, subcommand, "--help"], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"(?m)^\s+(?:-\w, )?(--[a-z0-9-]+)", out))


def test_rendered_flags_exist_in_the_agent(default_objects, custom_objects):
    binary = os.environ.get("PROXY_AGENT_BIN")
    if not binary:
        pytest.skip("PROXY_AGENT_BIN is not set (cargo test sets it)")
    flags = agent_flags(binary, "run")
    if "--metrics-bind-address" not in flags:
        # An agent built before health and metrics listened apart.
        pytest.skip("this agent build has no --metrics-bind-address yet")
    wanted = set(args_of(one(default_objects, "DaemonSet")))
    wanted |= set(args_of(one(custom_objects, "DaemonSet")))
    assert wanted - flags == set(), f"the chart passes flags `proxy-agent run` does not know: {sorted(wanted - flags)}"
