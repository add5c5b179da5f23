//! The embedded ledger: a local single-replica TigerBeetle that this process supervises. It formats
//! the data file on first run, reuses it after, restarts the server if it dies, and stops it on
//! shutdown. Every server it starts is started with `--addresses=0`, the one mode in which
//! TigerBeetle exits when its stdin closes, so even a crash of this process stops it. That mode
//! picks a free port each time: a restarted server is at a new address, which
//! [`EmbeddedLedger::addresses`] publishes for the ledger client to follow. (A restart on the old,
//! fixed port had no such watchdog: after this process was killed it ran on, orphaned, holding
//! the data file, so the next start of the service could not open it.)

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long the server may take to print its port. A production-mode server allocates about
/// 3 GiB before it listens: 25 s on a VM whose host had taken that memory back (touching such
/// memory cost 8–14 s per GiB here), more with the cores busy; 60 s left too little margin.
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// TigerBeetle exits at once when its stdin closes; one that does not is killed after this.
/// Either way is safe: TigerBeetle is built for sudden stops.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);
const RESTART_BACKOFF: Duration = Duration::from_secs(1);
/// Restarts in a row (each less than [`RESTART_STABLE`] after the last) before giving up.
const RESTARTS_MAX: u32 = 10;
/// A server that ran this long was well: its next exit starts the count of restarts anew (a
/// crash a day must not add up, over a month, to giving up for good).
const RESTART_STABLE: Duration = Duration::from_secs(60);

#[derive(Debug, Error)]
pub enum EmbeddedError {
    #[error("TigerBeetle server not found at {0}: run `scripts/setup` (it builds one), or set embedded.tigerbeetle_bin / --tigerbeetle-bin, or give ledger addresses")]
    BinaryMissing(PathBuf),
    #[error("cannot create the data directory {path}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`tigerbeetle format` failed ({status}); see its output above")]
    Format { status: String },
    #[error("cannot run {bin}")]
    Spawn {
        bin: PathBuf,
        source: std::io::Error,
    },
    #[error("TigerBeetle did not report a port within {0:?}: {1}")]
    NoPort(Duration, String),
}

#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    pub bin: PathBuf,
    pub data_dir: PathBuf,
    pub cluster_id: u128,
    /// `--development`: any filesystem, small caches, 32 KiB requests. Not for benchmarks.
    pub development: bool,
}

/// A supervised TigerBeetle process. Stop it with [`EmbeddedLedger::stop`].
pub struct EmbeddedLedger {
    /// The running server's address: a new one after each restart.
    address: watch::Receiver<SocketAddr>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    gave_up: GaveUp,
}

/// Set when the supervisor gave up restarting the server: the process lives on without a
/// ledger, and says so where an orchestrator looks (`/healthz`), so that it is restarted whole.
#[derive(Clone, Debug, Default)]
pub struct GaveUp(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl GaveUp {
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    #[cfg(test)]
    pub(crate) fn set_for_tests(&self) {
        self.set();
    }
}

impl EmbeddedLedger {
    pub async fn start(mut options: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        if !options.bin.is_file() {
            return Err(EmbeddedError::BinaryMissing(options.bin.clone()));
        }
        options.bin = runnable(&options.bin);
        std::fs::create_dir_all(&options.data_dir).map_err(|source| EmbeddedError::DataDir {
            path: options.data_dir.clone(),
            source,
        })?;
        let file = options
            .data_dir
            .join(format!("{}_0.tigerbeetle", options.cluster_id));
        // Said before each wait: a slow disk kept the service silent between "starting" and
        // "started", for as long as the format and the start took.
        if !file.exists() {
            tracing::info!(file = %file.display(), "formatting the embedded TigerBeetle's data file");
            format(&options, &file).await?;
        }
        tracing::info!(file = %file.display(), "starting the embedded TigerBeetle");
        let (child, stdin, port, stderr) = spawn(&options, &file).await?;
        let (moved, address) = watch::channel(loopback(port));
        tracing::info!(address = %loopback(port), file = %file.display(), "embedded TigerBeetle started");
        let (stop, stopped) = watch::channel(false);
        let gave_up = GaveUp::default();
        let server = (child, stdin, stderr);
        let task = tokio::spawn(supervise(
            options,
            file,
            server,
            moved,
            (stopped, gave_up.clone()),
        ));
        Ok(EmbeddedLedger {
            address,
            stop,
            task,
            gave_up,
        })
    }

    /// Whether the supervisor gave up restarting the server (it kept exiting).
    pub fn gave_up(&self) -> GaveUp {
        self.gave_up.clone()
    }

    /// The running server's address.
    pub fn address(&self) -> SocketAddr {
        *self.address.borrow()
    }

    /// The running server's address, as it changes: each restart is on a new port.
    pub fn addresses(&self) -> watch::Receiver<SocketAddr> {
        self.address.clone()
    }

    /// Closes the server's stdin (it exits cleanly) and waits for it.
    pub async fn stop(self) {
        // A send fails only when the supervisor already returned (it gave up restarting).
        let _ = self.stop.send(true);
        if let Err(error) = self.task.await {
            tracing::error!(%error, "the embedded TigerBeetle's supervisor panicked");
        }
    }
}

async fn format(options: &EmbeddedOptions, file: &Path) -> Result<(), EmbeddedError> {
    // Format into a temporary name, then rename: a format interrupted half-way never leaves a
    // file that a later start would try to use.
    let partial = file.with_extension("tigerbeetle.partial");
    let _ = std::fs::remove_file(&partial);
    let mut command = Command::new(&options.bin);
    command
        .arg("format")
        .arg(format!("--cluster={}", options.cluster_id))
        .arg("--replica=0")
        .arg("--replica-count=1");
    if options.development {
        command.arg("--development");
    }
    let status = command
        .arg(&partial)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // A stop during start-up drops this future: the format must not outlive the service.
        // So does the deadline: a format is seconds, and one that hangs (a stalled disk) must
        // end the start with an error, not keep the service waiting without a word.
        .kill_on_drop(true)
        .status();
    let status = tokio::time::timeout(START_TIMEOUT, status)
        .await
        .map_err(|_| EmbeddedError::Format {
            status: format!("not done within {START_TIMEOUT:?}"),
        })?
        .map_err(|source| EmbeddedError::Spawn {
            bin: options.bin.clone(),
            source,
        })?;
    if !status.success() {
        return Err(EmbeddedError::Format {
            status: status.to_string(),
        });
    }
    std::fs::rename(&partial, file).map_err(|source| EmbeddedError::DataDir {
        path: file.to_owned(),
        source,
    })
}

/// `bin` as a path that runs the file `is_file` found: a bare name (`tigerbeetle`) is that file
/// in the working directory, and run as given, a name without a `/` is looked up on `PATH`
/// (not found, or another TigerBeetle formatting and serving the data file).
fn runnable(bin: &Path) -> PathBuf {
    match bin.parent() {
        Some(parent) if parent.as_os_str().is_empty() => Path::new(".").join(bin),
        _ => bin.to_owned(),
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Starts the server on a free port, which it prints (`--addresses=0`; in that mode alone it
/// also exits when its stdin closes).
async fn spawn(
    options: &EmbeddedOptions,
    file: &Path,
) -> Result<(Child, std::io::PipeWriter, u16, Stderr), EmbeddedError> {
    // TigerBeetle's watchdog treats any failed read of stdin as "closed", and a pipe made by
    // tokio is non-blocking (reads fail with EAGAIN at once): hand it a blocking pipe of our own.
    let (stdin_reader, stdin_writer) = std::io::pipe().map_err(|source| EmbeddedError::Spawn {
        bin: options.bin.clone(),
        source,
    })?;
    let mut command = Command::new(&options.bin);
    command.arg("start").arg("--addresses=0");
    if options.development {
        command.arg("--development");
    }
    let mut child = command
        .arg(file)
        .stdin(stdin_reader)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        // Its own process group: a Ctrl-C meant for us must not kill it before we stop it.
        .process_group(0)
        .spawn()
        .map_err(|source| EmbeddedError::Spawn {
            bin: options.bin.clone(),
            source,
        })?;
    let stderr = child.stderr.take().expect("piped");
    let tail = StderrTail::default();
    let forwarding = tokio::spawn(forward_stderr(stderr, tail.clone()));
    let mut stderr = Stderr {
        tail,
        forwarding: Some(forwarding),
    };
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let port = read_port(&mut child, &mut lines, &mut stderr).await?;
    // Keep draining stdout so the server never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, stdin_writer, port, stderr))
}

/// The server's stderr: its last lines, and the task that reads them (it ends as the server
/// exits).
struct Stderr {
    tail: StderrTail,
    forwarding: Option<JoinHandle<()>>,
}

impl Stderr {
    /// What the server said last, once its stderr was read to the end (it exited), a second at
    /// most: read at once, its last lines (a panic's, most often) were still in the pipe.
    async fn said(&mut self) -> String {
        if let Some(forwarding) = self.forwarding.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), forwarding).await;
        }
        self.tail.joined()
    }
}

/// The last lines the server wrote to stderr (at most [`STDERR_TAIL_LINES`], each cut at
/// [`STDERR_LINE_BYTES_MAX`]): why it exited, said with its exit. Its log went out at debug
/// alone, which the default `info` drops, and a crash at run time cannot be run again to see.
#[derive(Clone, Default)]
struct StderrTail(std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>);

const STDERR_TAIL_LINES: usize = 10;
const STDERR_LINE_BYTES_MAX: usize = 512;

impl StderrTail {
    fn push(&self, mut line: String) {
        if line.len() > STDERR_LINE_BYTES_MAX {
            let end = (0..=STDERR_LINE_BYTES_MAX)
                .rev()
                .find(|at| line.is_char_boundary(*at));
            line.truncate(end.unwrap_or(0));
        }
        let mut tail = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }

    /// The lines kept, oldest first, joined by ` | `; empty when none.
    fn joined(&self) -> String {
        let tail = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Vec::from_iter(tail.iter().map(String::as_str)).join(" | ")
    }
}

/// Forwards the server's stderr to the log at its lines' levels ([`level_of`]); keeps its last
/// lines in `tail`.
async fn forward_stderr(stderr: tokio::process::ChildStderr, tail: StderrTail) {
    use tracing::Level;
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let level = level_of(&line);
        if level == Level::ERROR {
            tracing::error!(target: "tigerbeetle", "{line}");
        } else if level == Level::WARN {
            tracing::warn!(target: "tigerbeetle", "{line}");
        } else {
            tracing::debug!(target: "tigerbeetle", "{line}");
        }
        tail.push(line);
    }
}

/// The level of a line of the server's stderr: its errors and panics `error`, its warnings
/// `warn`, the rest `debug`. TigerBeetle 0.16 writes `<date> <time>Z warning(main): …`, the
/// level after a timestamp.
fn level_of(line: &str) -> tracing::Level {
    let is = |level: &str| {
        let scope = format!("{level}(");
        line.starts_with(&scope) || line.contains(&format!(" {scope}"))
    };
    if is("error") || line.contains("panic") {
        tracing::Level::ERROR
    } else if is("warning") {
        tracing::Level::WARN
    } else {
        tracing::Level::DEBUG
    }
}

/// The port a server started with `--addresses=0` prints as its first line.
async fn read_port(
    child: &mut Child,
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    stderr: &mut Stderr,
) -> Result<u16, EmbeddedError> {
    let first = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
    match first {
        Ok(Ok(Some(line))) => line.trim().parse::<u16>().map_err(|_| {
            EmbeddedError::NoPort(START_TIMEOUT, format!("unexpected first line {line:?}"))
        }),
        Ok(Ok(None)) => {
            let status = child
                .wait()
                .await
                .map(|s| s.to_string())
                .unwrap_or_default();
            let said = match stderr.said().await {
                said if said.is_empty() => "it said nothing on stderr".to_owned(),
                said => format!("it said: {said}"),
            };
            Err(EmbeddedError::NoPort(
                START_TIMEOUT,
                format!("it exited ({status}); {said}"),
            ))
        }
        Ok(Err(e)) => Err(EmbeddedError::NoPort(START_TIMEOUT, e.to_string())),
        Err(_) => Err(EmbeddedError::NoPort(START_TIMEOUT, "timed out".into())),
    }
}

/// Restarts the server when it exits (publishing its new address on `moved`), until stopped or
/// it kept exiting. A stop is heeded during a restart too: its backoff and start (up to
/// [`START_TIMEOUT`]) would otherwise hold up shutdown, only to start a server and stop it.
async fn supervise(
    options: EmbeddedOptions,
    file: PathBuf,
    (mut child, mut stdin, mut stderr): (Child, std::io::PipeWriter, Stderr),
    moved: watch::Sender<SocketAddr>,
    (mut stopped, gave_up): (watch::Receiver<bool>, GaveUp),
) {
    let mut restarts = 0;
    let mut started_at = tokio::time::Instant::now();
    loop {
        let status = tokio::select! {
            status = child.wait() => status,
            _ = stopped.changed() => {
                // Closing stdin asks TigerBeetle to exit.
                drop(stdin);
                if tokio::time::timeout(STOP_TIMEOUT, child.wait()).await.is_err() {
                    tracing::warn!("embedded TigerBeetle did not exit in time; killing it");
                    let _ = child.kill().await;
                }
                return;
            }
        };
        if *stopped.borrow() {
            return;
        }
        if started_at.elapsed() >= RESTART_STABLE {
            restarts = 0;
        }
        restarts += 1;
        let said = stderr.said().await;
        tracing::error!(status = ?status.ok(), restarts, last_stderr = %said, "embedded TigerBeetle exited; restarting");
        if restarts > RESTARTS_MAX {
            tracing::error!("embedded TigerBeetle keeps exiting; giving up (requests follow the failure policy, /healthz answers 503)");
            gave_up.set();
            return;
        }
        let restart = async {
            tokio::time::sleep(RESTART_BACKOFF).await;
            spawn(&options, &file).await
        };
        let restarted = tokio::select! {
            restarted = restart => restarted,
            // A server being started is killed as its `spawn` is dropped (`kill_on_drop`).
            _ = stopped.changed() => return,
        };
        started_at = tokio::time::Instant::now();
        match restarted {
            Ok((next, next_stdin, port, next_stderr)) => {
                child = next;
                stdin = next_stdin;
                stderr = next_stderr;
                tracing::info!(address = %loopback(port), "embedded TigerBeetle restarted");
                moved.send_replace(loopback(port));
            }
            Err(error) => tracing::error!(%error, "cannot restart embedded TigerBeetle"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_name_runs_the_file_in_the_working_directory() {
        let run = |bin: &str| runnable(Path::new(bin));
        assert_eq!(run("tigerbeetle"), Path::new("./tigerbeetle"));
        assert_eq!(run("./tigerbeetle"), Path::new("./tigerbeetle"));
        assert_eq!(run(".tools/tigerbeetle"), Path::new(".tools/tigerbeetle"));
        assert_eq!(
            run("/usr/bin/tigerbeetle"),
            Path::new("/usr/bin/tigerbeetle")
        );
    }

    /// Lines as TigerBeetle 0.16 writes them, a timestamp before the level.
    #[test]
    fn the_servers_lines_are_logged_at_their_levels() {
        use tracing::Level;
        let cases = [
            (
                "2026-12-08 02:36:10.875Z warning(main): Grid cache size of 32MiB is small",
                Level::WARN,
            ),
            (
                "2026-12-08 02:36:10.875Z error(io): could not lock the data file",
                Level::ERROR,
            ),
            ("thread 4242 panic: reached unreachable code", Level::ERROR),
            (
                "2026-12-08 02:36:06.135Z info(io): opening \"0_0.tigerbeetle\"...",
                Level::DEBUG,
            ),
            ("error(main): no timestamp", Level::ERROR),
        ];
        for (line, level) in cases {
            assert_eq!(level_of(line), level, "{line}");
        }
    }

    /// The tail keeps the last lines, each cut at its bound on a character's edge.
    #[test]
    fn the_stderr_tail_keeps_the_last_lines_bounded() {
        let tail = StderrTail::default();
        for n in 0..STDERR_TAIL_LINES + 3 {
            tail.push(format!("line {n}"));
        }
        let joined = tail.joined();
        assert!(joined.starts_with("line 3 | "), "{joined}");
        assert!(joined.ends_with(&format!("line {}", STDERR_TAIL_LINES + 2)));
        let long = StderrTail::default();
        long.push("é".repeat(STDERR_LINE_BYTES_MAX));
        assert_eq!(long.joined().len(), STDERR_LINE_BYTES_MAX);
    }
}
