//go:build tools

// Package tools pins the Kubernetes control plane that the real-API-server
// tests (proxy-agent/tests/real_apiserver.rs) run against: etcd,
// kube-apiserver, kube-controller-manager and kubectl, built from Go modules
// by `cargo xtask k8s` (xtask/src/k8s.rs) into target/k8s/<version>/; and
// kube-proxy, the differential tests' oracle and the benchmarks' peer
// (issue #45). Its blank import added only indirect requirements (nftables,
// knftables, netlink, netns, ipvs, hnslib) and changed no existing version.
//
// The version is pinned here, in go.mod: k8s.io/kubernetes v1.37.2 and the
// etcd server its go.mod requires (go.etcd.io/etcd/server/v3 v3.7.0).
// k8s.io/kubernetes is not meant to be used as a module: its go.mod requires
// each k8s.io staging module (k8s.io/api, k8s.io/client-go, ...) at v0.0.0
// and replaces it with a directory of its own repository, and replace lines
// only apply in the main module. So go.mod carries one replace line per
// staging module, v0.0.0 => the matching published v0.N.M (v1.37.2 =>
// v0.37.2), generated from k8s.io/kubernetes' go.mod as described in
// https://github.com/kubernetes/kubernetes/issues/79384; then `go mod tidy`
// filled in the indirect requirements and go.sum. To move to another
// release: regenerate the require and replace lines for it the same way,
// run `go mod tidy` (it keeps these blank imports, which only build with the
// `tools` tag), and commit go.mod and go.sum.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
