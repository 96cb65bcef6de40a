# syntax=docker/dockerfile:1
#
# The node agent's image: a statically linked `proxy-agent` (the eBPF object
# is embedded in it) on a scratch base with Debian's busybox-static, which
# provides the `sh`, `stat` and `mount` of the chart's bpffs init container,
# and Debian's CA certificates, which a `--kubeconfig` without its own CA
# needs (kube's rustls client loads the system roots then).
#
# Two ways to build the same recipe:
#
#   # where an image registry is reachable: everything is built here
#   docker build -t topoproxy/proxy-agent:0.1.0 .
#   # podman/buildah (1.28) takes a stage name in FROM only from a given
#   # build argument, not from an ARG default, so name both:
#   podman build --build-arg AGENT_SOURCE=build --build-arg PACKAGES=debian-packages \
#     -t topoproxy/proxy-agent:0.1.0 .
#
#   # without a registry: `cargo xtask image` builds the agent on the host,
#   # extracts the Debian packages with mmdebstrap, imports them as an image
#   # and builds this file with podman, passing
#   #   --build-arg AGENT_SOURCE=context --build-arg AGENT_BINARY=proxy-agent
#   #   --build-arg PACKAGES=localhost/topoproxy/packages:bookworm
#
# Build arguments:
#   AGENT_SOURCE  build (default): compile the agent in the agent-build stage;
#                 context: take the binary AGENT_BINARY from the build context
#                 (it must be statically linked, as the build stage makes it).
#   PACKAGES      an image whose filesystem holds the Debian packages
#                 busybox-static and ca-certificates, installed or merely
#                 extracted; default: the debian-packages stage below.
#   RUST_IMAGE, DEBIAN_IMAGE  the registry images the default path starts from;
#   RUST_NIGHTLY  the nightly of the eBPF build (its LLVM must be bpf-linker's).
#
# Size goal: 25 MB uncompressed (`cargo xtask image` prints the size). The
# agent is about 18 MB, busybox 2 MB, the certificates 0.2 MB. A Debian
# slim base would add some 75 MB for a shell, a libc the static agent does
# not use, and apt; bpftool is left out (`proxy-agent dump` decodes the
# pinned maps).

ARG AGENT_SOURCE=build
ARG PACKAGES=debian-packages
ARG RUST_IMAGE=docker.io/library/rust:1.95-bookworm
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim

# --- The agent, compiled (AGENT_SOURCE=build) --------------------------------
# The same recipe as `cargo xtask setup` and `cargo xtask image` (see
# xtask/src/setup.rs and xtask/src/image.rs): stable Rust for the agent,
# nightly + rust-src for the eBPF crate (`-Z build-std=core`), bpf-linker 0.13
# built against Debian's LLVM 22; proxy-agent's build.rs builds and embeds
# the object.
FROM ${RUST_IMAGE} AS agent-build
ARG BPF_LINKER_VERSION=0.13.0
# The nightly whose LLVM (22) is bpf-linker's: a newer nightly's bitcode
# fails in bpf-linker with "Invalid record". The same channel as
# proxy-ebpf/rust-toolchain.toml, which proxy-agent's build.rs runs.
ARG RUST_NIGHTLY=nightly-2026-05-20
ENV DEBIAN_FRONTEND=noninteractive
# LLVM 22 comes from bookworm-security; without LLVM_PREFIX bpf-linker's build
# finds Debian's default LLVM 14 and fails to link -lLLVM. cmake is for
# aws-lc-sys (kube's TLS provider).
RUN apt-get update \
 && apt-get install -y --no-install-recommends llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev cmake \
 && rm -rf /var/lib/apt/lists/*
RUN rustup toolchain install ${RUST_NIGHTLY} --profile minimal --component rust-src \
 && rustup run ${RUST_NIGHTLY} rustc --version
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    LLVM_PREFIX=/usr/lib/llvm-22 PATH=/usr/lib/llvm-22/bin:$PATH \
    cargo install bpf-linker --version ${BPF_LINKER_VERSION} --locked \
      --no-default-features --features llvm-22
WORKDIR /src
COPY . .
# Statically linked (glibc's static libc, crt-static) so that the runtime
# needs no libc; an explicit --target keeps the flag away from build scripts
# and proc macros. target/ is a cache mount, so the binary is copied out of
# it in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    RUSTFLAGS="-C target-feature=+crt-static" CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked -p proxy-agent --bin proxy-agent --target x86_64-unknown-linux-gnu \
 && install -D -m 0755 target/x86_64-unknown-linux-gnu/release/proxy-agent /out/proxy-agent

# --- The Debian packages of the runtime (PACKAGES=debian-packages) -----------
FROM ${DEBIAN_IMAGE} AS debian-packages
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends busybox-static ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# --- The runtime's files, laid out from those packages ----------------------
# Exec form with busybox's own shell: an image of merely extracted packages
# has no /bin/sh. The applets are relative links: `busybox --install` would
# point them at the path busybox runs from, /usr/bin/busybox where /bin is a
# link to usr/bin (an installed bookworm), which the runtime does not have.
# The CA bundle is made as update-ca-certificates would
# (every Mozilla certificate, the default of /etc/ca-certificates.conf),
# because extracted packages never ran its trigger.
FROM ${PACKAGES} AS runtime-files
RUN ["/bin/busybox", "sh", "-ec", "mkdir -p /rootfs/bin /rootfs/usr/local/bin /rootfs/etc/ssl/certs /rootfs/tmp \
 && cp /bin/busybox /rootfs/bin/busybox \
 && for a in $(/bin/busybox --list); do [ -e /rootfs/bin/$a ] || ln -s busybox /rootfs/bin/$a; done \
 && cat /usr/share/ca-certificates/mozilla/*.crt > /rootfs/etc/ssl/certs/ca-certificates.crt \
 && echo 'root:x:0:0:root:/root:/bin/sh' > /rootfs/etc/passwd \
 && echo 'root:x:0:' > /rootfs/etc/group \
 && chmod 1777 /rootfs/tmp"]

FROM scratch AS runtime
COPY --from=runtime-files /rootfs/ /
ENV PATH=/usr/local/bin:/bin

# --- The agent on the runtime ------------------------------------------------
FROM runtime AS image-from-build
COPY --from=agent-build /out/proxy-agent /usr/local/bin/proxy-agent

FROM runtime AS image-from-context
ARG AGENT_BINARY=proxy-agent
COPY ${AGENT_BINARY} /usr/local/bin/proxy-agent

FROM image-from-${AGENT_SOURCE}
LABEL org.opencontainers.image.title="topoproxy proxy-agent" \
      org.opencontainers.image.description="Topology-aware eBPF load balancer for Kubernetes Services" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["/usr/local/bin/proxy-agent"]
CMD ["--help"]
