//! One module per subcommand.

pub(crate) mod cleanup_kube_proxy;
pub(crate) mod conntrack_args;
pub(crate) mod datapath_args;
pub(crate) mod dump;
pub(crate) mod explain;
pub(crate) mod probe;
pub(crate) mod reset;
pub(crate) mod run;
pub(crate) mod serve_hostname;
