//go:build tools

// Package tools pins what a one-node cluster adds to the control plane of
// tools/k8s, for the upstream e2e Service tests (`cargo xtask e2e`, issue
// #36): kubelet, kube-scheduler and agnhost (the test images' one binary),
// built by `cargo xtask k8s --node` (xtask/src/k8s.rs) into
// target/k8s/<version>/. The e2e test binary is the package in e2e/.
//
// This is a module apart from tools/k8s so that changing it does not make
// the control plane's binaries (and every real-API-server test) rebuild.
// Its replace lines are tools/k8s's (see tools/k8s/tools.go for how they
// were made): both must name the same k8s.io/kubernetes release, so that
// Go's build cache shares the packages they have in common.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/test/images/agnhost"
)
