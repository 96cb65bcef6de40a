//! A blocking job run at a fixed interval from the tokio runtime: the shape
//! the conntrack GC and the `SOCK_REC` sweep share. Each run goes to the
//! blocking pool, since both walk whole maps with one bpf(2) call per batch
//! and would stall the runtime's workers (and with them the sync loop and
//! `/healthz`) for the length of a sweep.

use std::sync::Arc;
use std::time::Duration;

/// How a run ended, as [`every`] hands it to its caller.
pub(crate) enum Run<T, E> {
    /// The job returned `Ok`.
    Done(T),
    /// The job returned `Err`; `first` is true for the first failure after
    /// a success (or the start), so that a lasting failure is warned about
    /// once per streak rather than every interval.
    Failed { error: E, first: bool },
    /// The job's thread panicked.
    Panicked(tokio::task::JoinError),
}

/// Runs `job` every `interval`, the first run one interval after the call
/// (start-up goes first), each on the blocking pool, and hands each outcome
/// to `report` on the runtime. Runs do not overlap: a run longer than the
/// interval delays the next one rather than queueing a burst
/// (`MissedTickBehavior::Delay`). The task runs until it is aborted or the
/// runtime stops.
pub(crate) fn every<T, E, J, R>(interval: Duration, job: J, mut report: R) -> tokio::task::JoinHandle<()>
where
    T: Send + 'static,
    E: Send + 'static,
    J: Fn() -> Result<T, E> + Send + Sync + 'static,
    R: FnMut(Run<T, E>) + Send + 'static,
{
    let job = Arc::new(job);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick completes at once.
        tick.tick().await;
        let mut failing = false;
        loop {
            tick.tick().await;
            let job = Arc::clone(&job);
            let run = match tokio::task::spawn_blocking(move || job()).await {
                Ok(Ok(t)) => {
                    failing = false;
                    Run::Done(t)
                }
                Ok(Err(error)) => {
                    let first = !failing;
                    failing = true;
                    Run::Failed { error, first }
                }
                Err(e) => Run::Panicked(e),
            };
            report(run);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Failures are reported as the first of their streak only once; a
    /// success ends the streak.
    #[tokio::test]
    async fn a_failure_streak_is_first_once() {
        let n = Arc::new(AtomicU32::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (count, log) = (Arc::clone(&n), Arc::clone(&seen));
        // Runs 1, 2 fail; 3 succeeds; 4 fails.
        let task = every(
            Duration::from_millis(10),
            move || {
                let i = count.fetch_add(1, Ordering::SeqCst) + 1;
                if i == 3 { Ok(i) } else { Err(i) }
            },
            move |run| {
                let line = match run {
                    Run::Done(i) => format!("{i} ok"),
                    Run::Failed { error, first } => format!("{error} failed first={first}"),
                    Run::Panicked(_) => "panicked".to_string(),
                };
                log.lock().unwrap().push(line);
            },
        );
        while seen.lock().unwrap().len() < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        let got = seen.lock().unwrap().clone();
        assert_eq!(got[..4], ["1 failed first=true", "2 failed first=false", "3 ok", "4 failed first=true"]);
    }
}
