//! Helpers for proxy-agent's privileged integration tests, its demo and its
//! benchmark, kept out of the agent's library: proxy-agent takes this crate
//! as a dev-dependency, so none of it is built into the product.
//!
//! One job per module:
//!
//! - [`sandbox`]: throwaway network namespaces, cgroups, pin directories and
//!   processes, isolated from the host and removed on drop;
//! - [`apiserver`]: a stand-in Kubernetes API server speaking the real
//!   list/watch protocol over HTTP, for the agent's kube-rs watchers;
//! - [`prog_test_run`]: `BPF_PROG_TEST_RUN`, running a loaded packet program
//!   on a frame without attaching it;
//! - [`checksum`]: the Internet checksum, for frames handed to it;
//! - [`wait`]: polling until the agent has caught up, with a deadline the
//!   emulated-kernel runs can raise;
//! - [`http`]: plain HTTP GETs and Prometheus samples, for the agent's
//!   health and metrics endpoints.
//! - [`kube_proxy`]: kube-proxy's iptables and nftables rulesets for given
//!   Services (and rules of other components), their packet counters and
//!   the NAT bindings in conntrack, for the migration tests.
//! - [`scenario`]: the demo's cluster read from manifests, and its table of
//!   the backends each node's clients reached (the demo and the container
//!   image test print it).
//! - [`traffic`]: steady traffic (long-lived and new TCP connections, UDP
//!   over long-lived and new sockets) checked line by line while a test
//!   breaks things, and the table of attempts and failures per fault.
//! - [`workloads`]: real software as pods (Debian's nginx as a backend,
//!   curl and wrk as clients), for what an application sees while its
//!   backends drain, quit and leave.
//! - [`real_cluster`]: a real control plane on loopback (etcd,
//!   kube-apiserver, kube-controller-manager from `cargo xtask k8s`) with
//!   Nodes and Pods written as a kubelet would, for the agent against the
//!   real EndpointSlice controller and API server.
//! - [`real_kube_proxy`]: real kube-proxies (nftables mode), one per
//!   simulated node namespace, against that control plane, and what each
//!   programmed read back as per-Service-port endpoint sets, for the
//!   differential test against the agent (issue #45);
//! - [`relay`]: a TCP relay from inside a namespace to the API server on
//!   the host's loopback, for processes in namespaces with no link out.
//!
//! What needs the agent binary itself (`CARGO_BIN_EXE_proxy-agent`, which
//! cargo sets only for proxy-agent's own tests) stays in
//! `proxy-agent/tests/support`.

pub mod apiserver;
pub mod checksum;
pub mod http;
pub mod kube_proxy;
pub mod prog_test_run;
pub mod real_cluster;
pub mod real_kube_proxy;
pub mod relay;
pub mod rng;
pub mod sandbox;
pub mod scenario;
pub mod traffic;
pub mod wait;
pub mod workloads;
