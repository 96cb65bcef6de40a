//! One module per subcommand.

pub mod conntrack_args;
pub mod datapath_args;
pub mod dump;
pub mod explain;
pub mod probe;
pub mod reset;
pub mod run;
pub mod serve_hostname;
