//! Waiting for the agent to catch up: polls with a deadline, asserting
//! nothing about speed.

use std::time::{Duration, Instant};

/// How long the tests wait for the agent to catch up: 30 s, or
/// `TOPOPROXY_TEST_WAIT_SECS` (`cargo xtask vmtest` raises it, since under
/// CPU emulation the agent needs tens of seconds to verify its programs).
pub fn wait_limit() -> Duration {
    let secs = std::env::var("TOPOPROXY_TEST_WAIT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    Duration::from_secs(secs)
}

/// Polls `check` until it returns `Ok`, or panics with `what` and the last
/// observation after [`wait_limit`]. This waits for the agent to catch up;
/// it asserts nothing about speed.
pub fn eventually<T, D: std::fmt::Debug>(what: &str, check: impl FnMut() -> Result<T, D>) -> T {
    eventually_within(wait_limit(), what, check)
}

/// [`eventually`] with a limit of the caller's, for a wait whose bound
/// comes from what it models (e.g. a pod's probes), never below
/// [`wait_limit`].
pub fn eventually_within<T, D: std::fmt::Debug>(limit: Duration, what: &str, mut check: impl FnMut() -> Result<T, D>) -> T {
    let deadline = Instant::now() + limit.max(wait_limit());
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => panic!("timed out waiting for {what}; last saw {last:?}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
