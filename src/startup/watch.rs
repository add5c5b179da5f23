//! The companions' watch. A task beside the HTTP server (the ledger's address and epoch
//! followers, the lease settler, the admin API, the metrics' server, the Envoy front end) that
//! ends before the stop, by a panic, an error or a loop that returned, stops the service: a
//! process that serves on without it (no metrics, no admin API, no Envoy front end, no ledger
//! address followed, leases never settled) looks alive to its orchestrator, and its loss was
//! noticed at the stop at best. Stopped, the process exits with an error and is restarted whole.

use std::any::Any;
use std::fmt::Display;

use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinError, JoinHandle};

/// A companion that ended before the stop, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// Which companion (a fixed name: "admin API", "lease settler", ...).
    pub companion: &'static str,
    /// Its error, its panic's message, or that it returned.
    pub why: String,
}

/// Where companions report their end; the service awaits the first report.
pub struct Watch {
    reports: Reporter,
    ended: mpsc::UnboundedReceiver<Ended>,
}

impl Default for Watch {
    fn default() -> Self {
        let (sender, ended) = mpsc::unbounded_channel();
        Watch {
            reports: Reporter { sender },
            ended,
        }
    }
}

impl Watch {
    /// A reporter for a companion that is no tokio task (the Envoy front end's thread).
    pub fn reporter(&self) -> Reporter {
        self.reports.clone()
    }

    /// Watches a task that runs until it is aborted (see [`Reporter::task`]).
    pub fn task<T: Send + 'static>(
        &self,
        companion: &'static str,
        task: JoinHandle<T>,
    ) -> AbortHandle {
        self.reports.task(companion, task)
    }

    /// Watches a server's task (see [`Reporter::server_task`]).
    pub fn server_task<E: Display + Send + 'static>(
        &self,
        companion: &'static str,
        task: JoinHandle<Result<(), E>>,
    ) -> AbortHandle {
        self.reports.server_task(companion, task)
    }

    /// The first companion to end (waits for ever if none does). Cancel-safe.
    pub async fn first_end(&mut self) -> Ended {
        match self.ended.recv().await {
            Some(ended) => ended,
            // Never: this watch holds a sender itself.
            None => std::future::pending().await,
        }
    }
}

/// How a companion reports its end.
#[derive(Clone)]
pub struct Reporter {
    sender: mpsc::UnboundedSender<Ended>,
}

impl Reporter {
    /// Watches a task that runs until it is aborted: any end of its own is reported. Returns
    /// the handle that aborts it (an abort is no end to report).
    pub fn task<T: Send + 'static>(
        &self,
        companion: &'static str,
        task: JoinHandle<T>,
    ) -> AbortHandle {
        self.result_task(companion, task, |_| Err("it returned".to_owned()))
    }

    /// Watches a task that ends well only when stopped (a server): an error or a panic is
    /// reported, a good end not (the stop made it).
    pub fn server_task<E: Display + Send + 'static>(
        &self,
        companion: &'static str,
        task: JoinHandle<Result<(), E>>,
    ) -> AbortHandle {
        self.result_task(companion, task, |ended| ended.map_err(|e| e.to_string()))
    }

    fn result_task<T: Send + 'static>(
        &self,
        companion: &'static str,
        task: JoinHandle<T>,
        judge: fn(T) -> Result<(), String>,
    ) -> AbortHandle {
        let abort = task.abort_handle();
        let reports = self.clone();
        tokio::spawn(async move {
            let why = match task.await {
                Ok(ended) => judge(ended).err(),
                Err(error) => cut_short(error),
            };
            if let Some(why) = why {
                reports.ended(companion, why);
            }
        });
        abort
    }

    /// Reports an end: a companion's own, or a thread's.
    pub fn ended(&self, companion: &'static str, why: String) {
        // Refused only once the watch is gone: the service has stopped, nobody is told.
        let _ = self.sender.send(Ended { companion, why });
    }
}

/// Why a task ended without its value: a panic (with its message), or nothing to report (it
/// was aborted, which only its owner does, at the stop).
fn cut_short(error: JoinError) -> Option<String> {
    if error.is_cancelled() {
        return None;
    }
    Some(panic_message(error.into_panic()))
}

/// A panic's message, as `panic!` carries it (a `&str` or a `String`).
pub fn panic_message(payload: Box<dyn Any + Send>) -> String {
    let message = match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(message) => (*message).to_owned(),
            Err(_) => "(no message)".to_owned(),
        },
    };
    format!("it panicked: {message}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The next report, within 5 s (a thread's start on a loaded machine included).
    async fn next(watch: &mut Watch) -> Option<Ended> {
        tokio::time::timeout(Duration::from_secs(5), watch.first_end())
            .await
            .ok()
    }

    /// Whether nothing is reported within 200 ms (a report is sent within microseconds).
    async fn nothing(watch: &mut Watch) -> bool {
        let report = tokio::time::timeout(Duration::from_millis(200), watch.first_end());
        report.await.is_err()
    }

    #[tokio::test]
    async fn a_panic_is_reported_with_its_message() {
        let mut watch = Watch::default();
        let index = 3;
        watch.task(
            "follower",
            tokio::spawn(async move { panic!("index {index}") }),
        );
        let ended = next(&mut watch).await.expect("reported");
        assert_eq!(ended.companion, "follower");
        assert_eq!(ended.why, "it panicked: index 3");
        watch.task("settler", tokio::spawn(async { panic!("static") }));
        assert_eq!(next(&mut watch).await.unwrap().why, "it panicked: static");
    }

    #[tokio::test]
    async fn a_loop_that_returns_is_reported() {
        let mut watch = Watch::default();
        watch.task("settler", tokio::spawn(async {}));
        assert_eq!(next(&mut watch).await.unwrap().why, "it returned");
    }

    #[tokio::test]
    async fn a_server_is_reported_on_an_error_not_on_a_good_end() {
        let mut watch = Watch::default();
        watch.server_task("metrics", tokio::spawn(async { Ok::<(), String>(()) }));
        assert!(nothing(&mut watch).await);
        let failed = async { Err::<(), _>(std::io::Error::other("accept failed")) };
        watch.server_task("admin API", tokio::spawn(failed));
        let ended = next(&mut watch).await.expect("reported");
        assert_eq!(
            (ended.companion, ended.why.as_str()),
            ("admin API", "accept failed")
        );
    }

    #[tokio::test]
    async fn an_aborted_task_is_not_reported() {
        let mut watch = Watch::default();
        let abort = watch.task("follower", tokio::spawn(std::future::pending::<()>()));
        abort.abort();
        assert!(nothing(&mut watch).await);
    }

    #[tokio::test]
    async fn a_thread_reports_through_a_reporter() {
        let mut watch = Watch::default();
        let reporter = watch.reporter();
        std::thread::spawn(move || reporter.ended("Envoy front end", "bind".into()));
        let ended = next(&mut watch).await.expect("reported");
        assert_eq!(ended.companion, "Envoy front end");
    }
}
