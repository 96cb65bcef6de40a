//! Loading the eBPF object and attaching its programs: what the running
//! kernel offers (`kernel_features`, `kernel_btf`), the bpffs and cgroup
//! mounts (`mounts`), the pin directory's layout (`pins`), the object with its maps at their pins (`object`),
//! the socket, TC and XDP attach loaders, and the guard that puts removed
//! pins back under a running agent (`pin_guard`).

pub mod kernel_btf;
pub mod kernel_features;
pub mod mounts;
pub mod object;
pub mod pin_guard;
pub mod pins;
pub mod socket_loader;
pub mod tc_loader;
pub mod xdp_loader;
