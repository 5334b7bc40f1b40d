//! Where the node's long-lived loops run. In the production build each driver (the mill's,
//! the executor's, the mill's committer and log writer) owns an OS thread, and an async
//! driver a current-thread runtime on it: one thread owns each state machine (STYLE habit
//! 10). Under `--cfg madsim` (issue 16) a simulation may not start system threads, so the
//! same loops run as tasks on the simulated node, where a node's kill drops them with it.
//! The loops themselves are the same code either way; only where they are started differs.

use std::future::Future;

/// A started loop, to wait for.
pub struct Joiner<T> {
    #[cfg(not(madsim))]
    inner: std::thread::JoinHandle<T>,
    #[cfg(madsim)]
    inner: tokio::task::JoinHandle<T>,
}

/// The loop panicked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Panicked;

impl<T: Send + 'static> Joiner<T> {
    /// Waits for the loop's end without blocking the caller's runtime.
    pub async fn wait(self) -> Result<T, Panicked> {
        #[cfg(not(madsim))]
        {
            let inner = self.inner;
            match tokio::task::spawn_blocking(move || inner.join()).await {
                Ok(Ok(t)) => Ok(t),
                _ => Err(Panicked),
            }
        }
        #[cfg(madsim)]
        {
            self.inner.await.map_err(|_| Panicked)
        }
    }

    /// Whether the loop has ended.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }

    /// Blocks until the loop ends (from a thread that is not a runtime's, e.g. a test's).
    #[cfg(all(test, not(madsim)))]
    pub fn join(self) -> std::thread::Result<T> {
        self.inner.join()
    }
}

/// Runs the async loop `make()` builds on a thread of its own named `name`, on a
/// current-thread runtime with a timer (`runtime_failed` says what a runtime that cannot
/// start means); under madsim, as a task of the current simulated node.
pub fn spawn_async<F, M>(
    name: String,
    make: M,
    runtime_failed: impl FnOnce(std::io::Error) -> F::Output + Send + 'static,
) -> std::io::Result<Joiner<F::Output>>
where
    M: FnOnce() -> F + Send + 'static,
    F: Future + 'static,
    F::Output: Send + 'static,
{
    #[cfg(not(madsim))]
    {
        let inner = std::thread::Builder::new().name(name).spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
            {
                Ok(rt) => rt.block_on(make()),
                Err(e) => runtime_failed(e),
            }
        })?;
        Ok(Joiner { inner })
    }
    #[cfg(madsim)]
    {
        let _ = (name, runtime_failed);
        Ok(Joiner {
            inner: tokio::task::spawn_local(make()),
        })
    }
}

/// Runs the blocking loop `f` on a thread of its own named `name` (production build).
#[cfg(not(madsim))]
pub fn spawn_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<Joiner<T>> {
    let inner = std::thread::Builder::new().name(name.into()).spawn(f)?;
    Ok(Joiner { inner })
}

/// Runs the loop `f` as a task of the current simulated node (madsim build).
#[cfg(madsim)]
pub fn spawn_task<F>(f: F) -> Joiner<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    Joiner {
        inner: tokio::task::spawn_local(f),
    }
}
