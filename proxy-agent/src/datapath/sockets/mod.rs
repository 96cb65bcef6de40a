//! Sockets on the node: terminating the ones translated to a backend that
//! has left (`sock_destroy`, through the BPF socket iterators of
//! `sock_iter` or netlink's `sock_diag`, in every network namespace of
//! `netns`), sweeping `SOCK_REC` of records whose socket is gone
//! (`sock_rec_sweep`), and keeping `SOCK_REC_COUNT` covering its records
//! (`sock_rec_count`).

pub mod netns;
pub mod sock_destroy;
pub mod sock_diag;
pub mod sock_iter;
pub mod sock_rec_count;
pub mod sock_rec_sweep;
