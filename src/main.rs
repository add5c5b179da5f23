//! The `ledger-limiter` service: `/greeting` behind the limiter, health, readiness and metrics.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ledger_limiter::config::{
    AdminFile, CallerFile, EmbeddedFile, FileConfig, LedgerFile, MetricsFile, RlsFile, Settings,
};
use ledger_limiter::http::request_metrics::HttpMetrics;
use ledger_limiter::startup::{Application, Exporters};

// mimalloc rather than glibc's allocator: a request allocates a few dozen small blocks (the
// request head, header values, futures, the ledger call's channels), and glibc's malloc and
// free were about 6 % of the service's CPU per admitted request (BENCHMARKS.md). The library
// leaves the choice to its user; this is the binary's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod commands;
mod probe;

/// Every flag also reads the environment variable named beside it, and overrides the config file.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "An exact, distributed rate limiter backed by TigerBeetle"
)]
struct Cli {
    /// A TOML file overriding the built-in configuration (see config/default.toml).
    #[arg(long, env = "LEDGER_LIMITER_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve HTTP on, e.g. 0.0.0.0:8080 (port 0 picks a free port).
    #[arg(long, env = "LEDGER_LIMITER_LISTEN")]
    listen: Option<String>,
    /// HTTP worker threads.
    #[arg(long, env = "LEDGER_LIMITER_WORKERS")]
    workers: Option<usize>,
    /// Seconds /readyz answers 503 at a stop before the server stops taking connections.
    #[arg(long, env = "LEDGER_LIMITER_DRAIN_DELAY_SECONDS")]
    drain_delay_seconds: Option<u64>,
    /// TigerBeetle replica addresses (host:port, comma separated). None: run an embedded one.
    #[arg(long, env = "LEDGER_LIMITER_LEDGER_ADDRESSES", value_delimiter = ',')]
    ledger_addresses: Option<Vec<String>>,
    /// TigerBeetle cluster id (up to 2^128 - 1).
    #[arg(long, env = "LEDGER_LIMITER_CLUSTER_ID")]
    cluster_id: Option<u128>,
    /// Deadline of one decision, in milliseconds.
    #[arg(long, env = "LEDGER_LIMITER_LEDGER_TIMEOUT_MS")]
    ledger_timeout_ms: Option<u64>,
    /// What to do when the ledger cannot decide in time: "open" (admit) or "closed" (503).
    #[arg(long, env = "LEDGER_LIMITER_FAILURE_POLICY")]
    failure_policy: Option<String>,
    /// Data directory of the embedded TigerBeetle.
    #[arg(long, env = "LEDGER_LIMITER_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The tigerbeetle binary for the embedded ledger.
    #[arg(long, env = "LEDGER_LIMITER_TIGERBEETLE_BIN")]
    tigerbeetle_bin: Option<PathBuf>,
    /// Where callers' identity comes from: "header" (an API key), "peer-ip", or
    /// "header-or-peer-ip" (the key if sent, else the address).
    #[arg(long, env = "LEDGER_LIMITER_KEY_SOURCE")]
    key_source: Option<String>,
    /// The API key header (default X-Api-Key).
    #[arg(long, env = "LEDGER_LIMITER_KEY_HEADER")]
    key_header: Option<String>,
    /// A file of "<key> <plan>" lines.
    #[arg(long, env = "LEDGER_LIMITER_KEYS_FILE")]
    keys_file: Option<PathBuf>,
    /// Keys not in the keys file nor matching a prefix: "default-plan" or "reject" (401).
    #[arg(long, env = "LEDGER_LIMITER_UNKNOWN_KEYS")]
    unknown_keys: Option<String>,
    /// Run the embedded TigerBeetle without --development (needs direct I/O and ~1 GiB data file).
    /// `--embedded-production=false` (or the variable set to false) asks for development mode
    /// over a config file's `embedded.development = false`.
    #[arg(
        long,
        env = "LEDGER_LIMITER_EMBEDDED_PRODUCTION",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    embedded_production: Option<bool>,
    /// Where the admin API listens, e.g. 127.0.0.1:9091. It is on only if a secret is also given,
    /// in LEDGER_LIMITER_ADMIN_SECRETS (comma-separated, for rotation; never a flag, which other
    /// users of the machine could read).
    #[arg(long, env = "LEDGER_LIMITER_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Where Envoy's rate-limit service (gRPC, RateLimitService v3) listens, e.g. 0.0.0.0:8081.
    /// Off unless given; needs --rls-config.
    #[arg(long, env = "LEDGER_LIMITER_RLS_LISTEN")]
    rls_listen: Option<String>,
    /// envoyproxy/ratelimit YAML rules: a file, or a directory of *.yaml or *.yml files.
    #[arg(long, env = "LEDGER_LIMITER_RLS_CONFIG")]
    rls_config: Option<PathBuf>,
    /// Serve /metrics and /metrics/exemplars on a listener of their own, e.g. 127.0.0.1:9464,
    /// instead of on --listen (where every caller can read them).
    #[arg(long, env = "LEDGER_LIMITER_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Validate the configuration, print it, and exit.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Read one caller's account back from a running ledger and print it as JSON: its grants
    /// (one for a caller credited once), the holds its requests placed, the voids, the balances.
    /// The flags before `audit` (--config, --ledger-addresses, ...) say where the ledger is and
    /// which plans derive the account.
    Audit(commands::Caller),
    /// An operator's action on one caller, straight on the ledger (the admin API's, for whoever
    /// can reach the ledger): recorded with admin secret number 0, "the command line".
    #[command(subcommand)]
    Admin(commands::AdminCommand),
    /// Ask the service running on this machine (at --listen, a wildcard address on loopback)
    /// whether it is ready: exit 0 on a 2xx from --path, else 1 saying why. For a container's
    /// health check, in an image without curl.
    Probe(probe::Probe),
}

impl Cli {
    fn overrides(&self) -> anyhow::Result<FileConfig> {
        Ok(FileConfig {
            listen: self.listen.clone(),
            workers: self.workers,
            drain_delay_seconds: self.drain_delay_seconds,
            ledger: LedgerFile {
                addresses: self.ledger_addresses.clone(),
                cluster_id: self.cluster_id,
                timeout_ms: self.ledger_timeout_ms,
                failure_policy: self.failure_policy.clone(),
                ..LedgerFile::default()
            },
            embedded: EmbeddedFile {
                data_dir: self.data_dir.clone(),
                tigerbeetle_bin: self.tigerbeetle_bin.clone(),
                development: self.embedded_production.map(|production| !production),
            },
            caller: CallerFile {
                source: self.key_source.clone(),
                header: self.key_header.clone(),
                keys_file: self.keys_file.clone(),
                unknown_keys: self.unknown_keys.clone(),
                ..CallerFile::default()
            },
            admin: AdminFile {
                listen: self.admin_listen.clone(),
                secrets: admin_secrets_from_env()?,
            },
            rls: RlsFile {
                listen: self.rls_listen.clone(),
                config: self.rls_config.clone(),
                ..RlsFile::default()
            },
            metrics: MetricsFile {
                listen: self.metrics_listen.clone(),
            },
            ..FileConfig::default()
        })
    }
}

/// `LEDGER_LIMITER_ADMIN_SECRETS`, comma-separated ("a, b" is two secrets, not one with a
/// space in front). Empty entries are kept, so that an error's "secret #N" counts every entry
/// as written; a variable with nothing in it names no secret. Not UTF-8: an error, not unset
/// (the file's secrets would have been used, though the variable wins).
fn admin_secrets_from_env() -> anyhow::Result<Option<Vec<String>>> {
    match std::env::var("LEDGER_LIMITER_ADMIN_SECRETS") {
        Ok(value) if value.trim().is_empty() => Ok(Some(Vec::new())),
        Ok(value) => Ok(Some(
            value.split(',').map(|s| s.trim().to_owned()).collect(),
        )),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("LEDGER_LIMITER_ADMIN_SECRETS is not UTF-8")
        }
    }
}

/// The config file (if any) with the flags and environment over it: what overrides the
/// built-in defaults.
fn overrides(cli: &Cli) -> anyhow::Result<FileConfig> {
    let file = match &cli.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    Ok(file.merge(cli.overrides()?))
}

fn load_settings(cli: &Cli) -> anyhow::Result<Settings> {
    let mut file = overrides(cli)?;
    // `audit` and `admin` talk to the ledger alone. The admin API's listener and secrets are the
    // service's: with `[admin] listen` in the shared file and the secrets in the service's
    // environment only, the operator's commands were refused for want of a secret they never use.
    if matches!(cli.command, Some(Command::Audit(_) | Command::Admin(_))) {
        file.admin = AdminFile::default();
        file.rls = RlsFile::default(); // likewise the Envoy front end's rules file
        file.metrics = MetricsFile::default();
    }
    Ok(Settings::with_overrides(file)?)
}

/// `ledger-limiter probe`, knowing only the listen address (of the file and the flags). The file
/// is read for `listen` alone: a setting added to it since the service started (a typo, one of
/// a newer release) failed the health check of every instance serving well.
async fn run_probe(cli: &Cli, probe: &probe::Probe) -> anyhow::Result<()> {
    let file = match &cli.config {
        Some(path) => FileConfig::load_listen(path)?,
        None => FileConfig::default(),
    };
    let listen = Settings::listen_with_overrides(file.merge(cli.overrides()?))?;
    probe::probe(&listen, probe).await
}

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::try_parse().unwrap_or_else(|error| {
        // A health check's failure is 1, never 2 (reserved by Docker), bad flags included.
        let probing = std::env::args_os().any(|arg| arg == "probe");
        if probing && error.use_stderr() {
            eprint!("{error}");
            std::process::exit(1);
        }
        error.exit()
    });
    if let Some(Command::Probe(probe)) = &cli.command {
        // Before the settings are checked: a health check must not fail a running service over
        // a keys file or rule edited since it started. One line, never a backtrace: the runtime
        // keeps health-check output and shows it; and 1, never 2 (reserved by Docker).
        if let Err(error) = run_probe(&cli, probe).await {
            eprintln!("ledger-limiter probe: {error:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    let settings = match load_settings(&cli) {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("ledger-limiter: {error:#}");
            std::process::exit(2);
        }
    };
    if cli.check_config {
        if let Some(refused) = ledger_limiter::telemetry::otlp_refused() {
            eprintln!("ledger-limiter: {refused}");
            std::process::exit(2);
        }
        // What the service would warn of at its start: a check that said "valid" alone let an
        // operator ship a variable no setting reads.
        for ignored in ignored_settings(&settings) {
            eprintln!("ledger-limiter: warning: {ignored}");
        }
        println!("configuration is valid:\n{settings:#?}");
        return Ok(());
    }
    if matches!(cli.command, Some(Command::Audit(_) | Command::Admin(_))) {
        ledger_limiter::telemetry::init_log_only()?;
    }
    match &cli.command {
        Some(Command::Audit(caller)) => return commands::audit(&settings, caller).await,
        Some(Command::Admin(command)) => return commands::admin(&settings, command).await,
        Some(Command::Probe(_)) => unreachable!("probed before the settings were read"),
        None => {}
    }

    // Before anything starts: a signal during start-up must stop us cleanly, not kill us.
    let signals = StopSignals::install()?;
    exit_now(serve(settings, signals).await)
}

/// Exits with the service's outcome (as `main` returning it would: 1 and the error), here rather
/// than through the runtime's end, which waits for every blocking task: one stuck for good (a
/// DNS lookup of the ledger's past its deadline, a file on a hung mount) held the exit as long.
/// What has to end first has: the server drained, the leases settled, the companions and the
/// embedded ledger stopped, the telemetry flushed.
fn exit_now(served: anyhow::Result<()>) -> ! {
    if let Err(error) = served {
        eprintln!("Error: {error:?}");
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// SIGINT and SIGTERM, listened for from the start to the end, and the only handlers (the
/// server's own are off, `startup.rs`). actix installs its handlers only once its server first
/// runs, after the ledger answers; until then either signal killed the process (exit by signal 15
/// in a CI run) while the Envoy front end was already answering. Once running, actix's stopped at
/// once on SIGINT, with no drain.
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// What the configuration sets that nothing reads: `LEDGER_LIMITER_*` variables no setting
/// reads, and embedded-ledger settings beside `ledger.addresses`. Said at the start and by
/// `--check-config`.
fn ignored_settings(settings: &Settings) -> Vec<String> {
    let names = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    let variables = unread_variables(names).into_iter().map(|variable| {
        format!("no setting reads {variable}: it is ignored (file-only settings are read from the --config file)")
    });
    let embedded = settings.unread.iter().map(|setting| {
        format!("{setting} is ignored: ledger.addresses names the ledger, so none is embedded")
    });
    variables.chain(embedded).collect()
}

/// The `LEDGER_LIMITER_*` names among `names` that no setting reads: a misspelling, or a
/// file-only setting (`LEDGER_LIMITER_IN_FLIGHT_MAX`), which was ignored without a word. Not
/// the scripts' own: `LEDGER_LIMITER_CACHE` (`scripts/setup`), `_BIN` and `_CLUSTER_DIR`
/// (`scripts/cluster`).
fn unread_variables(names: impl Iterator<Item = String>) -> Vec<String> {
    use clap::CommandFactory;
    let command = Cli::command();
    let flags = command.get_arguments().filter_map(|arg| arg.get_env());
    let mut read: Vec<String> = flags
        .map(|env| env.to_string_lossy().into_owned())
        .collect();
    let others = ["ADMIN_SECRETS", "CACHE", "BIN", "CLUSTER_DIR"];
    read.extend(others.map(|name| format!("LEDGER_LIMITER_{name}")));
    let mut unread: Vec<String> = names
        .filter(|name| name.starts_with("LEDGER_LIMITER_") && !read.contains(name))
        .collect();
    unread.sort();
    unread
}

/// Starts the service and serves until stopped. A stop signal while the application is built
/// drops what was built (an embedded ledger is killed with it); one while the ledger is awaited
/// stops the built servers gracefully.
async fn serve(settings: Settings, signals: StopSignals) -> anyhow::Result<()> {
    if let Some(refused) = ledger_limiter::telemetry::otlp_refused() {
        anyhow::bail!(refused);
    }
    let telemetry = ledger_limiter::telemetry::init("ledger-limiter")?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        "ledger-limiter starting"
    );
    for ignored in ignored_settings(&settings) {
        tracing::warn!("{ignored}");
    }
    let exporting_traces = telemetry.exporting();
    let served = match raise_open_files_limit() {
        Some(open_files_max) if open_files_max < OPEN_FILES_MIN => Err(anyhow::anyhow!(
            "the limit on open files is {open_files_max} (`ulimit -n`), and the service needs at \
             least {OPEN_FILES_MIN} to start (its workers, listeners, ledger client and \
             telemetry) and thousands to serve connections: raise it"
        )),
        _ => serve_exporting(settings, signals, exporting_traces).await,
    };
    if let Err(error) = &served {
        tracing::error!(
            error = format!("{error:#}"),
            "ledger-limiter stopped on an error"
        );
    }
    // On an error too: the spans that led up to it are the ones worth having.
    flush_telemetry(telemetry).await?;
    served
}

/// The fewest open files the service starts with. Why: below about 30, a worker's runtime
/// failed to start (`EMFILE`) and the process panicked inside actix, after its log said it
/// listened; 128 leaves room for the workers of a larger machine and a few connections.
const OPEN_FILES_MIN: libc::rlim_t = 128;

/// Raises the soft limit on open files to the hard one, as Go's runtime does for its servers.
/// Why: each connection is a file descriptor, and a systemd unit's soft limit is 1,024 unless
/// set, so the service ran out (`EMFILE`) at about a thousand connections, far below its own
/// bounds (25,000 per HTTP worker, `rls.connections_max`), whatever the hard limit allowed.
/// Best effort: a limit that cannot be raised stays, said in the log. The soft limit now (`None`
/// if it cannot be read).
fn raise_open_files_limit() -> Option<libc::rlim_t> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        let error = std::io::Error::last_os_error();
        tracing::warn!(%error, "cannot read the limit on open files");
        return None;
    }
    let (soft, hard) = (limit.rlim_cur, limit.rlim_max);
    // A hard limit above what the kernel lets a process open (fs.nr_open; "unlimited" is) is
    // refused whatever the soft one asked: both are lowered to the kernel's, which a process may.
    let kernels = std::fs::read_to_string("/proc/sys/fs/nr_open").ok();
    let kernels = kernels.and_then(|text| text.trim().parse::<libc::rlim_t>().ok());
    let most = kernels.map_or(hard, |most| hard.min(most));
    if soft >= most {
        tracing::info!(
            open_files_max = soft,
            "open files: the soft limit is at its most (the hard one, or the kernel's)"
        );
        return Some(soft);
    }
    let raised = libc::rlimit {
        rlim_cur: most,
        rlim_max: most,
    };
    // SAFETY: setrlimit only reads the struct it is given.
    match unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } {
        0 => {
            tracing::info!(
                open_files_max = most,
                was = soft,
                hard,
                "open files: soft limit raised to the hard one (or the kernel's most)"
            );
            Some(most)
        }
        _ => {
            let error = std::io::Error::last_os_error();
            tracing::warn!(%error, open_files_max = soft, hard, "open files: the soft limit stays");
            Some(soft)
        }
    }
}

/// [`serve`], with telemetry set up (and flushed by it, however this ends).
async fn serve_exporting(
    settings: Settings,
    mut signals: StopSignals,
    exporting_traces: bool,
) -> anyhow::Result<()> {
    let exporters = Exporters {
        prometheus: Some(prometheus_recorder()?),
        http_metrics: Some(Arc::new(HttpMetrics::new())),
        trace_requests: exporting_traces,
    };
    let application = tokio::select! {
        built = Application::build(settings, exporters) => built.context("starting ledger-limiter")?,
        () = signals.recv() => {
            tracing::info!("stop signal during start-up: stopped before serving");
            return Ok(());
        }
    };
    let waited = tokio::select! {
        ready = application.wait_for_ledger(Duration::from_secs(30)) => Some(ready),
        () = signals.recv() => None,
    };
    match waited {
        Some(ready) => {
            if ready {
                tracing::info!("ledger ready");
            }
            tracing::info!(
                port = application.port(),
                otlp = exporting_traces,
                "ledger-limiter listening on port {}",
                application.port()
            );
        }
        // The server serves already (from the build on): it stops as on any signal, below.
        None => tracing::info!("stop signal while waiting for the ledger"),
    }
    let signalled = waited.is_none();
    let stopper = tokio::spawn(stop_on_signals(
        signals,
        application.stop_handle(),
        signalled,
    ));
    let ran = application.run_until_stopped().await;
    // Not aborted: the stop goes on past the server, through the trace flush (up to 5 s with a
    // collector that does not answer), and a second signal then must still exit at once. It
    // ends with the runtime.
    drop(stopper);
    Ok(ran?)
}

/// Stops the server gracefully at the first stop signal (`signalled`: it came already, while
/// the binary waited for the ledger). Why not leave that to actix: it installs its handlers as
/// its server first runs, and a signal just before that was lost, the process serving on (a CI
/// run: "still running after SIGTERM", the log ending at actix's "starting service"). A second
/// signal during the stop exits at once, as an operator's second Ctrl-C means: it was
/// swallowed, and the stop went on through its drain, settling and companions' stop (up to
/// about 32 s, minutes with a long ledger timeout). An embedded ledger stops with the process
/// (its standard input closes).
async fn stop_on_signals(
    mut signals: StopSignals,
    stop: ledger_limiter::startup::StopHandle,
    signalled: bool,
) {
    if !signalled {
        signals.recv().await;
    }
    tracing::info!("stop signal: stopping gracefully (a second one stops at once)");
    // The drain delay included: a second signal during it exits at once too.
    tokio::select! {
        () = stop.stop() => signals.recv().await,
        () = signals.recv() => {}
    }
    tracing::warn!("a second stop signal: exiting now, requests in flight cut off");
    std::process::exit(SECOND_SIGNAL_EXIT_CODE);
}

/// The exit status of a stop cut short by a second signal: 128 + SIGINT, as a shell reports an
/// interrupted command.
const SECOND_SIGNAL_EXIT_CODE: i32 = 130;

/// The Prometheus recorder, installed, with its upkeep task.
fn prometheus_recorder() -> anyhow::Result<metrics_exporter_prometheus::PrometheusHandle> {
    let prometheus = ledger_limiter::telemetry::prometheus_builder()?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    // install_recorder() does not spawn the upkeep task that drains histogram buffers.
    let upkeep = prometheus.clone();
    actix_web::rt::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(prometheus)
}

/// Flushes spans off the runtime: the OTLP exporter needs this runtime to make progress, so a
/// blocking shutdown on it would wait for itself and drop the last batch.
async fn flush_telemetry(
    mut telemetry: ledger_limiter::telemetry::TelemetryGuard,
) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || telemetry.shutdown())
        .await
        .context("flushing traces")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn variables_no_setting_reads_are_named() {
        let names = [
            "LEDGER_LIMITER_LISTEN",
            "LEDGER_LIMITER_IN_FLIGHT_MAX",
            "LEDGER_LIMITER_ADMIN_SECRETS",
            "LEDGER_LIMITER_CACHE",
            "LEDGER_LIMITER_LEDGER_TIMEOUT",
            "LEDGER_LIMITER_METRICS_LISTEN",
            "RUST_LOG",
        ];
        let unread = super::unread_variables(names.into_iter().map(str::to_owned));
        assert_eq!(
            unread,
            [
                "LEDGER_LIMITER_IN_FLIGHT_MAX",
                "LEDGER_LIMITER_LEDGER_TIMEOUT"
            ]
        );
    }
}
