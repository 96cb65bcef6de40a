//go:build tools

// Package tools pins the container runtime of the e2e node (`cargo xtask
// e2e`, issue #36): containerd and its runc shim, built by `cargo xtask k8s
// --node` (xtask/src/k8s.rs) into target/k8s/<version>/. Debian 12's
// containerd is 1.6, and kubelet 1.36 and newer need containerd 2 (the
// RuntimeConfig CRI call that reports the cgroup driver). runc itself and
// the CNI plugins come from Debian.
//
// A module apart from tools/k8s and tools/k8s-node: containerd's
// dependencies are resolved against its own go.mod, not Kubernetes'.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
