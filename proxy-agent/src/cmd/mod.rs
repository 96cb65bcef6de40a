//! One module per subcommand.

pub mod datapath_args;
pub mod explain;
pub mod probe;
pub mod reset;
pub mod run;
pub mod serve_hostname;
