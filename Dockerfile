# syntax=docker/dockerfile:1
#
# The node agent's image: `proxy-agent` with the eBPF object embedded.
#
#   docker build -t topoproxy/proxy-agent:0.1.0 .
#
# The builder follows the same recipe as `cargo xtask setup` (see
# xtask/src/setup.rs): stable Rust for the agent, nightly + rust-src for the
# eBPF crate (`-Z build-std=core`), and bpf-linker 0.13 built against
# Debian's LLVM 22. proxy-agent's build.rs builds and embeds the object.

ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS builder
ARG BPF_LINKER_VERSION=0.13.0
ENV DEBIAN_FRONTEND=noninteractive
# LLVM 22 comes from bookworm-security; without LLVM_PREFIX bpf-linker's build
# finds Debian's default LLVM 14 and fails to link -lLLVM. cmake is for
# aws-lc-sys (kube's TLS provider).
RUN apt-get update \
 && apt-get install -y --no-install-recommends llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev cmake \
 && rm -rf /var/lib/apt/lists/*
RUN rustup toolchain install nightly --profile minimal --component rust-src
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    LLVM_PREFIX=/usr/lib/llvm-22 PATH=/usr/lib/llvm-22/bin:$PATH \
    cargo install bpf-linker --version ${BPF_LINKER_VERSION} --locked \
      --no-default-features --features llvm-22

WORKDIR /src
COPY . .
# target/ is a cache mount, so the binary is copied out of it in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p proxy-agent \
 && install -m 0755 target/release/proxy-agent /usr/local/bin/proxy-agent \
 && strip /usr/local/bin/proxy-agent

FROM ${RUNTIME_IMAGE}
# bpftool to inspect the pinned maps on a node (they carry BTF, so
# `bpftool map dump pinned /sys/fs/bpf/topoproxy/SERVICES` prints fields by
# name). sh, stat and mount, used by the chart's bpffs init container, are
# part of the base image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bpftool \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /usr/local/bin/proxy-agent /usr/local/bin/proxy-agent
LABEL org.opencontainers.image.title="topoproxy proxy-agent" \
      org.opencontainers.image.description="Topology-aware eBPF load balancer for Kubernetes Services" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["proxy-agent"]
CMD ["--help"]
