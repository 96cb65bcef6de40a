//go:build tools

// Package tools pins the e2e node's cluster DNS (`cargo xtask e2e`, issue
// #36): CoreDNS, built by `cargo xtask k8s --node` (xtask/src/k8s.rs)
// into target/k8s/<version>/ and run as a Pod in kube-system, as kubeadm
// and kind deploy it. A module apart: CoreDNS's dependencies are resolved
// against its own go.mod.
package tools

import (
	_ "github.com/coredns/coredns"
)
