//! Test helpers: a real TigerBeetle process per test binary, and `spawn_app()` on port 0.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use ledger_limiter::config::{FileConfig, LedgerFile, PlanFile, RoutesFile, Settings};
use ledger_limiter::limiter::caller::CallerKey;
use ledger_limiter::limiter::Limiter;
use ledger_limiter::startup::{Application, Exporters};

/// A child process (the binary, Prometheus, ...), killed when dropped: a failing test leaves
/// nothing running.
pub struct Guard(pub Option<Child>);

impl Guard {
    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }

    /// Sends the process SIGTERM (a graceful stop), leaving it guarded.
    pub fn send_term(&self) {
        self.send_signal("-TERM");
    }

    /// Sends the process `signal` (as `kill` spells it: `-INT`), leaving it guarded.
    pub fn send_signal(&self, signal: &str) {
        let pid = self.pid().to_string();
        let sent = Command::new("kill").args([signal, &pid]).status();
        assert!(sent.expect("kill runs").success(), "kill {signal} {pid}");
    }

    /// SIGTERM, then its exit status once it exits within `timeout`; `None` while it still runs.
    /// It stays guarded until it exits, so a test that fails on a hung process kills it.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.send_term();
        self.wait_exit(timeout)
    }

    /// Its exit status once it exits within `timeout`; `None` while it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.0.as_mut().expect("running");
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.0 = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a running binary has logged so far, kept by a reader thread.
pub type Log = Arc<Mutex<String>>;

/// Starts `command` and returns once it logs a line with `marker`: the text after the marker on
/// that line, and everything it logs (to check what it logs, or never logs).
pub fn start_binary_until(mut command: Command, marker: &str) -> (Guard, String, Log) {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let stderr = child.stderr.take().expect("piped");
    let guard = Guard(Some(child));
    let log = Arc::new(Mutex::new(String::new()));
    let (found, rest) = std::sync::mpsc::channel();
    let (sink, wanted) = (log.clone(), marker.to_owned());
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(after) = line.split(wanted.as_str()).nth(1) {
                let _ = found.send(after.to_owned());
            }
            let mut log = sink.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
        sink.lock().unwrap().push_str(LOG_ENDED);
    });
    let rest = rest
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("no line with {marker:?}"));
    (guard, rest, log)
}

/// Appended to a [`start_binary_until`] log when the process' standard error closes: after it,
/// the log is whole (wait for it with [`wait_logged`] before checking what is *not* in it).
pub const LOG_ENDED: &str = "---- the process' log ended\n";

/// Like [`start_binary`], keeping everything the binary logs; the port follows `marker`.
pub fn start_binary_logged(command: Command, marker: &str) -> (Guard, u16, Log) {
    let (guard, rest, log) = start_binary_until(command, marker);
    let port = rest
        .split_whitespace()
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no port after {marker:?}: {rest:?}"));
    (guard, port, log)
}

/// Whether `log` has `text` within `timeout`: once a process has exited, its reader thread may
/// still be taking in its last lines.
pub fn wait_logged(log: &Log, text: &str, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if log.lock().unwrap().contains(text) {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts the `ledger-limiter` binary as `command` describes (with `--listen 127.0.0.1:0` among
/// its arguments) and reads its port from its log line.
pub fn start_binary(command: Command) -> (Guard, u16) {
    let (guard, port, _log) = start_binary_logged(command, "ledger-limiter listening on port ");
    (guard, port)
}

/// Starts `command` with its limit on open files at `soft` and `hard` (at most this process's hard
/// limit, which a child cannot raise).
pub fn limit_open_files(command: &mut Command, soft: libc::rlim_t, hard: libc::rlim_t) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe, and nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
}

/// The binary under test, with a clean environment (PATH and RUST_LOG=info only).
pub fn binary_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ledger-limiter"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info");
    command
}

pub fn tigerbeetle_bin() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/tigerbeetle");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/setup (scripts/test does it for you)",
        bin.display()
    );
    bin
}

/// A folder for test ledgers' data files (about 1.1 GB each): in RAM under `/dev/shm` where there
/// is one, so that a stall of the machine's disk cannot push a request past a test's deadline. The
/// tests prove the logic against a real server; `scripts/bench` and `scripts/sustain` measure a
/// real disk. `--development` needs no direct I/O, so any folder works. Only with room for the
/// ledgers the tests run at once: TigerBeetle reserves its whole data file as it formats, and a
/// container's /dev/shm (64 MiB by default) failed every one of them.
pub fn ledger_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let in_ram = (shm.is_dir() && free_bytes(shm) >= SHM_BYTES_MIN).then(|| {
        tempfile::Builder::new()
            .prefix("ledger-limiter-test")
            .tempdir_in(shm)
    });
    match in_ram {
        Some(Ok(dir)) => dir,
        _ => tempfile::tempdir().expect("tempdir"),
    }
}

/// Room for a few ledgers at once (about 1.1 GB each), and what else the machine keeps there.
const SHM_BYTES_MIN: u64 = 6 << 30;

/// The bytes free at `path` (as `df` reads them), 0 if unknown.
fn free_bytes(path: &std::path::Path) -> u64 {
    let output = std::process::Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(path)
        .output();
    let text = output.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let last = text.ok().and_then(|t| t.lines().last().map(str::to_owned));
    last.and_then(|line| line.trim().parse().ok()).unwrap_or(0)
}

/// A TigerBeetle server in --development mode on a free port. It exits when this test binary
/// does: its stdin is a pipe held here, and TigerBeetle stops when its stdin closes.
pub struct TestLedger {
    pub address: SocketAddr,
    child: Mutex<Child>,
}

impl TestLedger {
    pub fn start() -> TestLedger {
        let dir = ledger_dir();
        let file = dir.path().join("0_0.tigerbeetle");
        let status = Command::new(tigerbeetle_bin())
            .args([
                "format",
                "--cluster=0",
                "--replica=0",
                "--replica-count=1",
                "--development",
            ])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run tigerbeetle format");
        assert!(status.success(), "tigerbeetle format failed");
        let mut child = Command::new(tigerbeetle_bin())
            .args(["start", "--addresses=0", "--development"])
            .arg(&file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run tigerbeetle start");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let port: u16 = lines
            .next()
            .expect("tigerbeetle printed its port")
            .unwrap()
            .trim()
            .parse()
            .expect("a port number");
        std::thread::spawn(move || for _ in lines {});
        // TigerBeetle has its data file open by now: remove it at once, so its ~1 GiB is freed
        // when the server exits, even though the shared server lives in a static that is never
        // dropped (keeping the folder leaked one data file per test binary run).
        drop(dir);
        TestLedger {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            child: Mutex::new(child),
        }
    }

    /// Kills the server (for failure tests that need a ledger that went away).
    pub fn kill(&self) {
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops (`true`) or continues the server's process: a ledger that takes calls and answers
    /// them only once continued, whatever the deadlines.
    pub fn pause(&self, stopped: bool) {
        let pid = self.child.lock().unwrap().id().to_string();
        let signal = if stopped { "-STOP" } else { "-CONT" };
        let status = Command::new("kill").args([signal, &pid]).status();
        assert!(status.expect("run kill").success(), "kill {signal} {pid}");
    }
}

/// A test's own server is killed with it, paused or not: a test that panicked while the server
/// was stopped (SIGSTOP) left it holding its memory, unable to see its stdin close, until the
/// whole run ended.
impl Drop for TestLedger {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

const RESTART_MARK: &str = "---- restarted by the test\n";
/// How long replicas may take to recover their logs and listen: several times what was seen.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(90);

/// A TigerBeetle cluster of `replicas` on loopback ports (`--development`), each replica its own
/// data file; replicas can be killed and restarted on the same port and file.
pub struct TestCluster {
    pub addresses: Vec<SocketAddr>,
    dir: tempfile::TempDir,
    replicas: Vec<Option<Child>>,
}

impl TestCluster {
    pub fn start(replicas: usize) -> TestCluster {
        let dir = ledger_dir();
        // Outside the kernel's ephemeral range: a killed replica's port stays free for its
        // restart, where a port of that range could be taken meanwhile as the local end of a
        // client's reconnection (the clients reconnect to a down replica over and over).
        let addresses = (0..replicas)
            .map(|_| SocketAddr::from(([127, 0, 0, 1], port_outside_ephemeral_range())))
            .collect();
        let mut cluster = TestCluster {
            addresses,
            dir,
            replicas: (0..replicas).map(|_| None).collect(),
        };
        for replica in 0..replicas {
            let status = Command::new(tigerbeetle_bin())
                .arg("format")
                .arg("--cluster=0")
                .arg(format!("--replica={replica}"))
                .arg(format!("--replica-count={replicas}"))
                .arg("--development")
                .arg(cluster.file(replica))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("run tigerbeetle format");
            assert!(status.success(), "tigerbeetle format failed");
        }
        for replica in 0..replicas {
            cluster.restart(replica);
        }
        cluster.wait_listening(LISTEN_TIMEOUT);
        cluster
    }

    fn file(&self, replica: usize) -> PathBuf {
        self.dir.path().join(format!("0_{replica}.tigerbeetle"))
    }

    fn log(&self, replica: usize) -> PathBuf {
        self.dir.path().join(format!("replica-{replica}.log"))
    }

    /// The view `replica` last moved to, from its log.
    pub fn view(&self, replica: usize) -> Option<u64> {
        self.status(replica).map(|(_, view, _)| view)
    }

    /// What a replica last logged of its VSR status since it (re)started: `(normal, view,
    /// primary)`. TigerBeetle logs every transition at info level, e.g.
    /// `info(replica): 2N: transition_to_normal_from_view_change_status: view=1..2 primary`.
    fn status(&self, replica: usize) -> Option<(bool, u64, bool)> {
        let log = self.log_since_restart(replica)?;
        let line = log.lines().rfind(|l| l.contains(" transition_to_"))?;
        let view = line.split(" view=").nth(1)?;
        let view = view
            .split(|c: char| !c.is_ascii_digit() && c != '.')
            .next()?;
        let view = view.rsplit("..").next()?.parse().ok()?;
        let normal = line.contains("transition_to_normal_from_");
        Some((
            normal,
            view,
            normal && line.trim_end().ends_with(" primary"),
        ))
    }

    /// What a replica logged since it was last (re)started.
    fn log_since_restart(&self, replica: usize) -> Option<String> {
        let log = std::fs::read_to_string(self.log(replica)).ok()?;
        let start = log.rfind(RESTART_MARK).unwrap_or(0);
        Some(log[start..].to_owned())
    }

    /// Until every running replica listens. Before it does, a replica allocates 1.5 GiB
    /// (--development) and reads its write-ahead log; on a VM whose host has taken its free
    /// memory back, touching that memory took 4.5 to 32 s for three replicas at once here, nearly
    /// all of it in the kernel. A test's deadline for the service must not include the ledger's
    /// own start: a CI run once failed "ledger not ready" 20 s after the cluster started, with no
    /// replica listening yet.
    pub fn wait_listening(&self, timeout: Duration) {
        let started = std::time::Instant::now();
        for replica in (0..self.replicas.len()).filter(|r| self.replicas[*r].is_some()) {
            while !self
                .log_since_restart(replica)
                .is_some_and(|log| log.contains(": listening on "))
            {
                assert!(
                    started.elapsed() < timeout,
                    "replica {replica} not listening after {timeout:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        eprintln!(
            "cluster: listening {:?} after the wait began",
            started.elapsed()
        );
    }

    /// The running replica that is primary of the highest view, if one is now.
    pub fn primary(&self) -> Option<usize> {
        let states: Vec<_> = (0..self.replicas.len())
            .filter(|r| self.replicas[*r].is_some())
            .filter_map(|r| self.status(r).map(|s| (r, s)))
            .collect();
        let top = states.iter().map(|(_, (_, view, _))| *view).max();
        states
            .iter()
            .find(|(_, (_, view, primary))| *primary && Some(*view) == top)
            .map(|(replica, _)| *replica)
    }

    /// The running replica that is primary of the highest view, once one is.
    pub fn wait_for_primary(&self, timeout: Duration) -> usize {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(replica) = self.primary() {
                return replica;
            }
            assert!(std::time::Instant::now() < deadline, "no primary");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Until `replica` is back to normal status (caught up after a restart).
    pub fn wait_normal(&self, replica: usize, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        while !self.status(replica).is_some_and(|(normal, _, _)| normal) {
            assert!(
                std::time::Instant::now() < deadline,
                "replica {replica} not normal"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn address_list(&self) -> Vec<String> {
        self.addresses.iter().map(|a| a.to_string()).collect()
    }

    /// Starts (or starts again) one replica on its port and data file. The kernel kills it when
    /// the thread that started it ends (the test's own, which outlives the cluster), however the
    /// test process died: a SIGKILL runs no `Drop`. (TigerBeetle watches its stdin only when
    /// started with `--addresses=0`: a pipe held here stopped nothing, and three replicas of
    /// 1.5 GiB each outlived a killed test.)
    pub fn restart(&mut self, replica: usize) {
        assert!(self.replicas[replica].is_none(), "replica {replica} runs");
        let addresses = self.address_list().join(",");
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(replica))
            .expect("replica log");
        std::io::Write::write_all(&mut log, RESTART_MARK.as_bytes()).unwrap();
        let mut command = Command::new(tigerbeetle_bin());
        command
            .arg("start")
            .arg(format!("--addresses={addresses}"))
            .arg("--development")
            .arg(self.file(replica))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: between fork and exec, only `prctl`, which is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) {
                    -1 => Err(std::io::Error::last_os_error()),
                    _ => Ok(()),
                }
            });
        }
        let child = command.spawn().expect("run tigerbeetle start");
        self.replicas[replica] = Some(child);
    }

    /// SIGKILL: a crash, not a clean stop.
    pub fn kill(&mut self, replica: usize) {
        if let Some(mut child) = self.replicas[replica].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for replica in 0..self.replicas.len() {
            self.kill(replica);
        }
    }
}

/// A ledger handle of the library's own (one client) on `addresses`, for reading the ledger back.
pub fn ledger_client(addresses: Vec<SocketAddr>) -> ledger_limiter::ledger::Ledger {
    ledger_client_bounded(addresses, 8192)
}

/// A ledger client of its own, with `in_flight_max` places under its in-flight bound.
pub fn ledger_client_bounded(
    addresses: Vec<SocketAddr>,
    in_flight_max: usize,
) -> ledger_limiter::ledger::Ledger {
    ledger_client_with(addresses, in_flight_max, Duration::ZERO)
}

/// A ledger client of its own whose batches wait `batch_linger` for more transfers.
pub fn ledger_client_with(
    addresses: Vec<SocketAddr>,
    in_flight_max: usize,
    batch_linger: Duration,
) -> ledger_limiter::ledger::Ledger {
    let settings = ledger_settings(addresses, in_flight_max, batch_linger);
    ledger_limiter::ledger::Ledger::connect(&settings).expect("a ledger client")
}

/// What a test's ledger handle is made from: cluster 0, the request-rate ledger.
pub fn ledger_settings(
    addresses: Vec<SocketAddr>,
    in_flight_max: usize,
    batch_linger: Duration,
) -> ledger_limiter::ledger::LedgerSettings {
    use ledger_limiter::ledger::{model, LedgerSettings};
    LedgerSettings {
        cluster_id: 0,
        addresses,
        ledger_id: model::LEDGER_REQUEST_RATE,
        in_flight_max: std::num::NonZeroUsize::new(in_flight_max).expect("non-zero"),
        batch_linger,
    }
}

/// One TigerBeetle shared by the tests of a binary; tests keep apart by using fresh keys.
pub fn shared_ledger() -> &'static TestLedger {
    static LEDGER: OnceLock<TestLedger> = OnceLock::new();
    LEDGER.get_or_init(TestLedger::start)
}

/// Ledger calls a request could cost (holds, provisioning, listings), not counting the account
/// reads the operator-epoch follower makes once a second in every application.
pub fn request_calls(ledger: &ledger_limiter::ledger::Ledger) -> u64 {
    use ledger_limiter::ledger::metrics::Operation;
    [
        Operation::CreateTransfers,
        Operation::CreateAccounts,
        Operation::GetAccountTransfers,
    ]
    .into_iter()
    .map(|operation| ledger.calls_started_of(operation))
    .sum()
}

/// A key no other test uses.
pub fn fresh_key(prefix: &str) -> String {
    format!("{prefix}{:032x}", rand::random::<u128>())
}

/// A port free just now, below the kernel's ephemeral range (`ip_local_port_range`), for a
/// process that binds it later: no outgoing connection takes such a port as its local end, and
/// no other test is handed it (each is handed out once per test binary). A bound-and-let-go
/// port of the ephemeral range could be taken by any connection meanwhile.
pub fn port_outside_ephemeral_range() -> u16 {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let range =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let ephemeral_low: u16 = (range.split_whitespace().next())
        .and_then(|low| low.parse().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.max(20_000));
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1_000 {
        let port = rand::random_range(low..high);
        if handed_out.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.push(port);
            return port;
        }
    }
    panic!("no free port in {low}..{high} after 1,000 tries");
}

/// An address where nothing listens: a ledger that is down.
pub fn dead_address() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

pub struct TestApp {
    pub address: String,
    pub port: u16,
    /// The admin API's port, when the configuration turns it on.
    pub admin_port: Option<u16>,
    /// The metrics' own port, when `metrics.listen` is set.
    pub metrics_port: Option<u16>,
    /// The Envoy front end's port, when `rls.listen` is set.
    pub rls_port: Option<u16>,
    pub http: reqwest::Client,
    pub limiter: Arc<Limiter>,
    handle: actix_web::dev::ServerHandle,
    /// The application's run, when this serves one ([`run`]): [`TestApp::ended`] waits for it.
    running: Mutex<Option<tokio::task::JoinHandle<std::io::Result<()>>>>,
}

impl TestApp {
    pub fn new(port: u16, limiter: Arc<Limiter>, handle: actix_web::dev::ServerHandle) -> Self {
        TestApp {
            address: format!("http://127.0.0.1:{port}"),
            port,
            admin_port: None,
            metrics_port: None,
            rls_port: None,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .unwrap(),
            limiter,
            handle,
            running: Mutex::new(None),
        }
    }

    pub async fn get(&self, path: &str, key: Option<&str>) -> reqwest::Response {
        let mut request = self.http.get(format!("{}{path}", self.address));
        if let Some(key) = key {
            request = request.header("X-Api-Key", key);
        }
        request.send().await.expect("request sent")
    }

    pub async fn stop(&self) {
        self.handle.stop(true).await;
    }

    /// Waits for the application's run to end (after [`TestApp::stop`]): what a stop does
    /// after its server ended (settling leases, giving slots back) is done by then.
    pub async fn ended(&self) {
        let running = self.running.lock().unwrap().take();
        let running = running.expect("an application run, once");
        running
            .await
            .expect("the run did not panic")
            .expect("the run ended well");
    }
}

pub fn plan(capacity: u64, window_seconds: u32) -> PlanFile {
    PlanFile {
        capacity,
        window_seconds,
        lease_units_max: None,
        lease_seconds: None,
    }
}

/// Test defaults: the shared ledger, port 0, a small free plan with a short window.
pub fn test_config(ledger: SocketAddr) -> FileConfig {
    FileConfig {
        listen: Some("127.0.0.1:0".into()),
        workers: Some(2),
        ledger: LedgerFile {
            addresses: Some(vec![ledger.to_string()]),
            // Generous: the shared machine is slow at times, and only the failure tests need
            // a short deadline (they set their own).
            timeout_ms: Some(5_000),
            ..LedgerFile::default()
        },
        plans: Some(
            [
                ("free".to_owned(), plan(5, 30)),
                ("basic".to_owned(), plan(50, 30)),
                ("pro".to_owned(), plan(500, 30)),
            ]
            .into(),
        ),
        key_prefixes: Some(Default::default()),
        routes: RoutesFile {
            exempt: Some(vec![
                "/healthz".into(),
                "/readyz".into(),
                "/metrics".into(),
                "/metrics/*".into(),
            ]),
            costs: None,
            shadow: None,
            refund_server_errors: None,
            concurrency: None,
            concurrency_timeout_seconds: None,
            limits: None,
            cost_header: None,
        },
        ..FileConfig::default()
    }
}

pub async fn spawn_app(config: FileConfig) -> TestApp {
    let settings = Settings::with_overrides(config).expect("valid test configuration");
    let application = Application::build(settings, Exporters::default())
        .await
        .expect("application builds");
    assert!(
        application.wait_for_ledger(Duration::from_secs(20)).await,
        "ledger not ready"
    );
    run(application)
}

/// Serves a built application in the background.
pub fn run(application: Application) -> TestApp {
    let port = application.port();
    let admin_port = application.admin_port();
    let metrics_port = application.metrics_port();
    let rls_port = application.rls_port();
    let limiter = application.limiter();
    let handle = application.server_handle();
    let running = tokio::spawn(application.run_until_stopped());
    TestApp {
        admin_port,
        metrics_port,
        rls_port,
        running: Mutex::new(Some(running)),
        ..TestApp::new(port, limiter, handle)
    }
}

/// Builds an app whose ledger never answers (no wait for readiness).
pub async fn spawn_app_without_ledger(config: FileConfig) -> TestApp {
    let settings = Settings::with_overrides(config).expect("valid test configuration");
    let application = Application::build(settings, Exporters::default())
        .await
        .expect("application builds");
    run(application)
}

/// The ledger account of an API key on the app's plans (as the limiter derives it).
pub fn account_id(app: &TestApp, key: &str) -> u128 {
    app.limiter
        .account_of(&caller(key))
        .expect("the key has a plan")
}

/// A test's key as the limiter knows it.
pub fn caller(key: &str) -> CallerKey {
    CallerKey::from_header_value("x-api-key", key.as_bytes(), 128).expect("valid key")
}

/// Limiter settings as a library user's test sets them: a generous deadline (the machine is
/// shared; no decision here should fail), fail closed, a local view, the usual expiry margin.
pub fn library_settings() -> ledger_limiter::limiter::LimiterSettings {
    ledger_limiter::limiter::LimiterSettings {
        ledger_timeout: Duration::from_secs(5),
        failure_policy: ledger_limiter::limiter::FailurePolicy::Closed,
        local_callers_max: 1000,
        expiry_margin: Duration::from_millis(250),
    }
}

/// A limiter as a user of the library wires one: `plan` the default for every key, the tests'
/// settings ([`library_settings`]).
pub fn one_plan_limiter(
    ledger: ledger_limiter::ledger::Ledger,
    plan: ledger_limiter::limiter::plan::Plan,
) -> Limiter {
    use ledger_limiter::limiter::plan::{PlanBook, UnknownKeys};
    let default_plan = plan.name().to_owned();
    let plans = PlanBook::new(vec![plan], &default_plan, [], [], UnknownKeys::DefaultPlan);
    Limiter::new(ledger, Arc::new(plans.unwrap()), library_settings())
}

/// Reads a response's `RateLimit` remaining (`r=`) parameter.
pub fn remaining(response: &reqwest::Response) -> u64 {
    let value = response
        .headers()
        .get("ratelimit")
        .expect("RateLimit header")
        .to_str()
        .unwrap();
    value
        .split(';')
        .find_map(|p| p.strip_prefix("r="))
        .expect("r= parameter")
        .parse()
        .unwrap()
}

/// A real OTLP/gRPC receiver on the current runtime: its endpoint, and the spans it got, drained
/// as they arrive (its channel is small, and a full one stalls the exporter).
pub async fn otlp_receiver() -> (String, Arc<Mutex<Vec<ExportedSpan>>>) {
    let mut receiver = FakeCollectorServer::start().await.unwrap();
    let endpoint = receiver.endpoint();
    let spans: Arc<Mutex<Vec<ExportedSpan>>> = Arc::default();
    let sink = spans.clone();
    tokio::spawn(async move {
        loop {
            let batch = receiver.exported_spans(1, Duration::from_millis(200)).await;
            sink.lock().unwrap().extend(batch);
        }
    });
    (endpoint, spans)
}

/// A span attribute as the receiver shows it, `Some(AnyValue { value: Some(StringValue("x")) })`,
/// unwrapped to `x`.
pub fn span_attribute(span: &ExportedSpan, key: &str) -> Option<String> {
    let raw = span.attributes.get(key)?;
    let inner = raw.split_once("Value(")?.1;
    let inner = inner.split_once(')')?.0;
    Some(inner.trim_matches('"').to_owned())
}

/// A bound of one place, taken by a hold the stopped ledger keeps unanswered, on an account
/// of 5 that holds 1 (`transfer_id`) besides.
pub struct FullBound {
    pub ledger: Arc<ledger_limiter::ledger::Ledger>,
    pub account: ledger_limiter::ledger::model::UserAccount,
    pub transfer_id: u128,
    pub other: tokio::task::JoinHandle<
        Result<ledger_limiter::ledger::HoldReply, ledger_limiter::ledger::LedgerError>,
    >,
}

pub async fn full_bound(process: &TestLedger) -> FullBound {
    let ledger = Arc::new(ledger_client_bounded(vec![process.address], 1));
    let account = ledger_limiter::ledger::model::UserAccount {
        id: rand::random::<u128>() | 1 << 127,
        capacity: std::num::NonZeroU64::new(5).unwrap(),
        window_seconds: std::num::NonZeroU32::new(60).unwrap(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    // Two calls one after the other under a bound of 1: each gives its place back before its
    // answer (else the grant found the accounts' place still taken, `Overloaded`).
    ledger.provision(&account, deadline).await.unwrap();
    let first = ledger.hold(account.id, 1, 60, deadline, false).await;
    let ledger_limiter::ledger::HoldReply::Held { transfer_id, .. } = first.unwrap() else {
        panic!("held");
    };
    let other = take_the_only_place(process, &ledger, account.id).await;
    FullBound {
        ledger,
        account,
        transfer_id,
        other,
    }
}

/// Stops the ledger, and a hold of 1 on `account_id` takes `ledger`'s only place and keeps it
/// while the ledger is stopped ([`full_bound`], and again after [`resume_after`]).
pub async fn take_the_only_place(
    process: &TestLedger,
    ledger: &Arc<ledger_limiter::ledger::Ledger>,
    account_id: u128,
) -> tokio::task::JoinHandle<
    Result<ledger_limiter::ledger::HoldReply, ledger_limiter::ledger::LedgerError>,
> {
    process.pause(true);
    let busy = ledger.clone();
    let other = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(5);
        busy.hold(account_id, 1, 60, deadline, false).await
    });
    // Until the task has run, however late on a loaded machine (within its hold's deadline).
    let by = Instant::now() + Duration::from_secs(4);
    while ledger.calls_in_flight() == 0 && Instant::now() < by {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ledger.calls_in_flight(), 1, "the place is taken");
    other
}

/// Lets the stopped ledger answer again, `after` from now.
pub async fn resume_after(process: &TestLedger, after: Duration) {
    tokio::time::sleep(after).await;
    process.pause(false);
}

/// A TCP proxy in front of a TigerBeetle that loses one answer on purpose: the first request
/// creating a transfer of a given code is held until the test lets it go (so that the test can
/// act on the ledger in between), and its reply until a given instant, past its caller's
/// deadline. Why not stop the process, as other tests do: that cannot aim at one call of many.
/// Messages are framed by TigerBeetle's 256-byte header (`vsr/message_header.zig`, 0.16).
pub struct LedgerProxy {
    pub address: SocketAddr,
    trap: Arc<Mutex<Option<Trap>>>,
}

/// What the proxy is to catch, and what it caught.
struct Trap {
    code: u16,
    caught: Option<tokio::sync::oneshot::Sender<()>>,
    go: Option<tokio::sync::oneshot::Receiver<()>>,
    answer_at: tokio::time::Instant,
    /// The caught request's client and number, which its replies (resent ones too) carry.
    request: Option<(u128, u32)>,
    /// When set, that client's later requests (a follow-up to the caught one) go on no sooner.
    later_requests_at: Option<tokio::time::Instant>,
}

/// TigerBeetle's message header: its size, and the fields the proxy reads.
const HEADER_SIZE: usize = 256;
const COMMAND_REQUEST: u8 = 5;
const COMMAND_REPLY: u8 = 8;
const OPERATION_CREATE_TRANSFERS: u8 = 139;

impl LedgerProxy {
    /// A proxy on a free loopback port in front of `ledger`.
    pub async fn start(ledger: SocketAddr) -> LedgerProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let trap: Arc<Mutex<Option<Trap>>> = Arc::default();
        let traps = trap.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(ledger).await.unwrap();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, traps.clone(), true));
                tokio::spawn(pump(server_read, client_write, traps.clone(), false));
            }
        });
        LedgerProxy { address, trap }
    }

    /// Arms the trap for the next request creating a transfer of `code`: the first receiver
    /// hears when it is caught, and it goes on to the ledger once the sender is used (or
    /// dropped); its reply is held until `answer_at`.
    pub fn lose_answer_to(
        &self,
        code: u16,
        answer_at: Instant,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (caught, caught_heard) = tokio::sync::oneshot::channel();
        let (go, go_heard) = tokio::sync::oneshot::channel();
        *self.trap.lock().unwrap() = Some(Trap {
            code,
            caught: Some(caught),
            go: Some(go_heard),
            answer_at: answer_at.into(),
            request: None,
            later_requests_at: None,
        });
        (caught_heard, go)
    }

    /// With the trap armed ([`LedgerProxy::lose_answer_to`]): the caught request's client's
    /// later requests go on to the ledger no sooner than `at`.
    pub fn hold_later_requests_until(&self, at: Instant) {
        let mut trap = self.trap.lock().unwrap();
        trap.as_mut().expect("armed").later_requests_at = Some(at.into());
    }
}

/// Copies whole messages from `from` to `to` until either end closes, holding back what the
/// trap says: requests going to the ledger, replies coming from it.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    trap: Arc<Mutex<Option<Trap>>>,
    to_ledger: bool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let mut message = vec![0_u8; HEADER_SIZE];
        if from.read_exact(&mut message).await.is_err() {
            return;
        }
        let size = u32::from_le_bytes(message[96..100].try_into().unwrap()) as usize;
        assert!(
            (HEADER_SIZE..=2 << 20).contains(&size),
            "a message of {size} bytes"
        );
        message.resize(size, 0);
        if from.read_exact(&mut message[HEADER_SIZE..]).await.is_err() {
            return;
        }
        if to_ledger {
            hold_request(&message, &trap).await;
        } else {
            hold_reply(&message, &trap).await;
        }
        if to.write_all(&message).await.is_err() {
            return;
        }
    }
}

/// Holds `message` if it is the request the trap is armed for, until the test says go; or a
/// later request of its client, until the trap's instant for those.
async fn hold_request(message: &[u8], trap: &Mutex<Option<Trap>>) {
    let is_request = message[114] == COMMAND_REQUEST;
    let is_create_transfers = is_request && message[196] == OPERATION_CREATE_TRANSFERS;
    let client = u128::from_le_bytes(message[160..176].try_into().unwrap());
    let request = u32::from_le_bytes(message[192..196].try_into().unwrap());
    let later_at = (trap.lock().unwrap().as_ref()).and_then(|trap| match trap.request {
        Some((of, number)) if is_request && of == client && request > number => {
            trap.later_requests_at
        }
        _ => None,
    });
    if let Some(at) = later_at {
        tokio::time::sleep_until(at).await;
        return;
    }
    let (caught, go) = {
        let mut trap = trap.lock().unwrap();
        let Some(trap) = trap.as_mut().filter(|trap| trap.caught.is_some()) else {
            return;
        };
        // A transfer's code is at byte 116 of its 128; the multi-batch trailer (the body's end)
        // is padded with 0xFFFF and holds event counts where a code would be.
        let of_code = (message[HEADER_SIZE..].chunks_exact(128))
            .any(|transfer| u16::from_le_bytes([transfer[116], transfer[117]]) == trap.code);
        if !(is_create_transfers && of_code) {
            return;
        }
        trap.request = Some((client, request));
        (trap.caught.take().unwrap(), trap.go.take().unwrap())
    };
    let _ = caught.send(());
    let _ = go.await;
}

/// Holds `message` if it is a reply to the caught request, until the trap's instant.
async fn hold_reply(message: &[u8], trap: &Mutex<Option<Trap>>) {
    if message[114] != COMMAND_REPLY {
        return;
    }
    let client = u128::from_le_bytes(message[192..208].try_into().unwrap());
    let request = u32::from_le_bytes(message[232..236].try_into().unwrap());
    let answer_at = {
        let trap = trap.lock().unwrap();
        match trap.as_ref() {
            Some(trap) if trap.request == Some((client, request)) => trap.answer_at,
            _ => return,
        }
    };
    tokio::time::sleep_until(answer_at).await;
}
