//! Wiring: ledger (embedded or remote), limiter, HTTP server. Used by the binary and the tests.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::{Server, ServerHandle};
use actix_web::middleware::Condition;
use actix_web::{web, App, HttpResponse, HttpServer};
use metrics_exporter_prometheus::PrometheusHandle;
use thiserror::Error;
use tokio::task::{AbortHandle, JoinHandle};
use tracing_actix_web::TracingLogger;

use crate::config::{
    resolve_addresses_keeping, resolve_addresses_or_stand_ins, AdminSettings, ConfigError,
    LedgerLocation, RlsSettings, Settings,
};
use crate::envoy::metrics::RlsMetrics;
use crate::envoy::rules::{LiveRules, RULES_CHECK_INTERVAL};
use crate::envoy::RateLimitServer;
use crate::http::admin::{self, AdminState};
use crate::http::concurrency::ConcurrencyError;
use crate::http::outstanding::Outstanding;
use crate::http::request_metrics::{HttpMetrics, RecordHttpMetrics, OPENMETRICS_CONTENT_TYPE};
use crate::http::{routes, ConcurrencyLimits, RateLimit};
use crate::ledger::addresses::{follow_addresses, RESOLVE_INTERVAL};
use crate::ledger::embedded::{EmbeddedError, EmbeddedLedger, EmbeddedOptions, GaveUp};
use crate::ledger::{ConnectError, Ledger};
use crate::limiter::moves::OPERATOR_EPOCH_INTERVAL;
use crate::limiter::Limiter;
use crate::telemetry::span::LimiterRootSpan;

pub mod watch;
use watch::{Ended, Reporter, Watch};

/// A client must send its whole request head within this, or the connection is closed (a slow
/// client cannot hold a connection open by trickling headers).
pub const CLIENT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
pub const CLIENT_DISCONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// An idle keep-alive connection is closed after this.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Connections each worker serves at once; beyond, new ones wait in the listen backlog.
pub const CONNECTIONS_PER_WORKER_MAX: usize = 25_000;

#[derive(Debug, Error)]
pub enum StartupError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Embedded(#[from] EmbeddedError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("invalid concurrency limit")]
    Concurrency(#[from] ConcurrencyError),
    #[error("cannot listen on {address}")]
    Listen {
        address: String,
        source: std::io::Error,
    },
}

/// What the service exports besides its routes.
#[derive(Clone, Default)]
pub struct Exporters {
    /// Serves `GET /metrics` (Prometheus text) when set.
    pub prometheus: Option<PrometheusHandle>,
    /// Serves `GET /metrics/exemplars` (OpenMetrics with trace exemplars) when set.
    pub http_metrics: Option<Arc<HttpMetrics>>,
    /// Wraps every request in a server span (W3C parent, request id). Only worth its cost when
    /// spans go somewhere: the binary sets it when OTLP export is on.
    pub trace_requests: bool,
}

/// A built, not yet running, service.
pub struct Application {
    server: Serving,
    port: u16,
    limiter: Arc<Limiter>,
    /// The concurrency slots handed out, waited for at the end of a stop.
    slots_out: Outstanding,
    /// The lease renewals ahead of need running, waited for before a stop settles leases.
    renewals: Outstanding,
    embedded: Option<EmbeddedLedger>,
    companions: Companions,
    stop: StopHandle,
}

/// How a stop begins: `/readyz` turns 503, and after `drain_delay` (`drain_delay_seconds`) the
/// server stops taking connections and drains. Why the delay: a load balancer (a Kubernetes
/// endpoint) stops sending a few seconds after the signal, and the connections it sent meanwhile
/// were refused at once.
#[derive(Clone)]
pub struct StopHandle {
    server: ServerHandle,
    readiness: web::Data<routes::Readiness>,
    drain_delay: Duration,
}

impl StopHandle {
    /// Not ready from now on; after the drain delay, a graceful stop of the server.
    pub async fn stop(&self) {
        self.readiness.stop();
        if !self.drain_delay.is_zero() {
            tracing::info!(
                drain_delay_seconds = self.drain_delay.as_secs(),
                "not ready; the server stops taking connections after the drain delay"
            );
            tokio::time::sleep(self.drain_delay).await;
        }
        drop(self.server.stop(true));
    }

    /// Whether a stop began through this handle (a signal's, or a companion's end).
    pub fn stopping(&self) -> bool {
        self.readiness.stopping()
    }
}

/// The HTTP server, serving from the build on: while the binary waits for the ledger (up to
/// 30 s), its listener would otherwise take connections and answer none, `/healthz` included
/// (a liveness probe could kill the instance in a ledger outage), where the failure policy
/// answers. Stopped on drop, as the companions are, if never run to its end.
struct Serving {
    task: Option<JoinHandle<std::io::Result<()>>>,
    handle: ServerHandle,
}

impl Serving {
    fn start(server: Server) -> Self {
        let handle = server.handle();
        Serving {
            task: Some(tokio::spawn(server)),
            handle,
        }
    }

    /// Until the server stops (through its handle). Cancel-safe: awaited again, it waits on.
    async fn finished(&mut self) -> std::io::Result<()> {
        let task = self.task.as_mut().expect("awaited until it ends, once");
        let ended = task.await;
        self.task = None;
        ended.unwrap_or_else(|error| Err(std::io::Error::other(error)))
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // The stop is sent as it is called; its future only waits for the end.
            drop(self.handle.stop(false));
            task.abort();
        }
    }
}

/// What runs beside the HTTP server from the start. Stopped when the service stops, and on drop:
/// an application dropped unrun, or a build that fails half-way, leaves no task following the
/// ledger and no admin API serving a limiter nobody runs. Watched: one that ends before the
/// stop stops the service ([`watch`]).
#[derive(Default)]
struct Companions {
    /// Where each reports its end.
    watch: Watch,
    /// Follows the ledger's addresses (and closes replaced clients).
    follower: Option<AbortHandle>,
    /// Follows the ledger's operator epoch (see `Limiter::follow_operator_epoch`).
    epoch_follower: Option<AbortHandle>,
    /// Settles leases whose time is over, when a plan has leases.
    settler: Option<AbortHandle>,
    /// Tasks of the embedding program's, tied to the service ([`Application::watch_task`]).
    others: Vec<AbortHandle>,
    /// The admin API's server (running) and its port.
    admin: Option<(ServerHandle, u16)>,
    /// The metrics' own server (running) and its port, when `metrics.listen` is set.
    metrics: Option<(ServerHandle, u16)>,
    /// Envoy's rate-limit service (running), when configured.
    rls: Option<RlsServer>,
}

impl Drop for Companions {
    fn drop(&mut self) {
        let followers = [self.follower.take(), self.epoch_follower.take()];
        let tasks = followers.into_iter().chain([self.settler.take()]).flatten();
        for task in tasks.chain(self.others.drain(..)) {
            task.abort();
        }
        for (server, _) in [self.admin.take(), self.metrics.take()]
            .into_iter()
            .flatten()
        {
            // The stop command is sent as the future is made; nobody is left to await it.
            drop(server.stop(false));
        }
        // Dropping its stop signal stops the Envoy front end (see `rls_server`).
        self.rls.take();
    }
}

impl Companions {
    /// A companion server, running, watched.
    fn watched(
        &self,
        companion: &'static str,
        (server, port): (Server, u16),
    ) -> (ServerHandle, u16) {
        let handle = server.handle();
        self.watch.server_task(companion, tokio::spawn(server));
        (handle, port)
    }
}

/// The Envoy front end's gRPC server: its port, its thread and the signal that stops it.
struct RlsServer {
    port: u16,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl Application {
    pub async fn build(settings: Settings, exporters: Exporters) -> Result<Self, StartupError> {
        let (bound, listeners) = Listeners::bind(&settings)?; // first: see `Listeners`
        let (ledger, embedded, follower) = connect_ledger(&settings).await?;
        let (listener, port) = bound.listening()?;
        let mut companions = Companions::default();
        companions.follower = Some(companions.watch.task("ledger address follower", follower));
        let concurrency = ConcurrencyLimits::new(
            &ledger,
            &settings.concurrency,
            settings.concurrency_timeout_seconds,
            &settings.limiter,
        )?;
        let limiter = Arc::new(Limiter::new(
            ledger,
            settings.plans.clone(),
            settings.limiter.clone(),
        ));
        let settler = crate::limiter::lease::spawn_settler(&limiter);
        companions.settler = settler.map(|task| companions.watch.task("lease settler", task));
        let slots_out = concurrency.slots_out();
        let rate_limit =
            RateLimit::new(limiter.clone(), settings.rules.clone()).with_concurrency(concurrency);
        let renewals = rate_limit.renewals();
        let served = (rate_limit.clone(), exporters.clone());
        let gave_up = embedded.as_ref().map(EmbeddedLedger::gave_up);
        let app = (limiter.clone(), rate_limit, exporters, gave_up);
        let (server, readiness) = main_server(&settings, listener, app)?;
        start_listeners(&settings, (&limiter, served), (listeners, &mut companions))?;
        let epoch = limiter
            .clone()
            .follow_operator_epoch(OPERATOR_EPOCH_INTERVAL);
        let epoch = companions
            .watch
            .task("operator epoch follower", tokio::spawn(epoch));
        companions.epoch_follower = Some(epoch);
        let server = Serving::start(server);
        let stop = StopHandle {
            server: server.handle.clone(),
            readiness,
            drain_delay: settings.drain_delay,
        };
        Ok(Application {
            server,
            port,
            limiter,
            slots_out,
            renewals,
            embedded,
            companions,
            stop,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The admin API's port, when it is on.
    pub fn admin_port(&self) -> Option<u16> {
        self.companions.admin.as_ref().map(|(_, port)| *port)
    }

    /// The metrics' own port, when `metrics.listen` is set.
    pub fn metrics_port(&self) -> Option<u16> {
        self.companions.metrics.as_ref().map(|(_, port)| *port)
    }

    /// The Envoy rate-limit service's port, when it is on.
    pub fn rls_port(&self) -> Option<u16> {
        self.companions.rls.as_ref().map(|rls| rls.port)
    }

    pub fn limiter(&self) -> Arc<Limiter> {
        self.limiter.clone()
    }

    /// Waits until the ledger answers (the TigerBeetle client's first request takes ~0.6 s).
    /// The server answers meanwhile (the failure policy's answers, `/readyz` 503); the binary
    /// says it listens once this returns, so whoever waits for that line sends its first
    /// requests to a ledger that answers. False if it never answers.
    pub async fn wait_for_ledger(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = (Instant::now() + Duration::from_secs(2)).min(deadline);
            match self.limiter.ledger().ping(attempt).await {
                Ok(()) => return true,
                Err(error) if Instant::now() >= deadline => {
                    tracing::warn!(%error, "the ledger does not answer yet");
                    return false;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// A companion ended before the server did: the stop it makes (as a signal's: not ready,
    /// the drain delay, a graceful stop), and the error naming it. With a stop under way already
    /// (through the [`StopHandle`]), only said: a task that ends with the stop is no failure.
    async fn companion_ended(&mut self, ended: Ended) -> std::io::Result<()> {
        if self.stop.stopping() {
            tracing::warn!(
                companion = ended.companion,
                why = %ended.why,
                "the {} ended during the stop",
                ended.companion
            );
            return self.server.finished().await;
        }
        let failed = companion_failed(&ended);
        self.stop.stop().await;
        if let Err(error) = self.server.finished().await {
            tracing::warn!(%error, "the server ended on an error too");
        }
        Err(failed)
    }

    /// Ties a task of the embedding program's to the service, as its own companions are: if it
    /// ends before the stop (returns or panics), the service stops, and
    /// [`Application::run_until_stopped`] answers an error naming `name`. Aborted at the stop.
    pub fn watch_task(&mut self, name: &'static str, task: JoinHandle<()>) {
        let abort = self.companions.watch.task(name, task);
        self.companions.others.push(abort);
    }

    /// A handle to stop the server gracefully (what SIGINT/SIGTERM do).
    pub fn server_handle(&self) -> ServerHandle {
        self.server.handle.clone()
    }

    /// How the binary stops it at a signal: not ready first, then, after the drain delay, a
    /// graceful stop ([`StopHandle`]).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Until the server (serving since the build) is stopped through
    /// [`Application::server_handle`] (the binary does so at SIGINT/SIGTERM; the server's own
    /// signal handlers are off), or a companion ends (an error naming it, once stopped as at a
    /// signal); then settles leases, stops the companions and the embedded ledger.
    pub async fn run_until_stopped(mut self) -> std::io::Result<()> {
        let result = tokio::select! {
            served = self.server.finished() => served,
            ended = self.companions.watch.first_end() => self.companion_ended(ended).await,
        };
        // A renewal still running would take its lease after the settling below: wait for it,
        // a decision's deadline at most (its own), with room for its last settlement's task.
        let within = self.limiter.settings().ledger_timeout + RENEWALS_END_GRACE;
        let running = self.renewals.back(within).await;
        if running > 0 {
            tracing::warn!(
                running,
                "lease renewals still running; their leases will expire"
            );
        }
        // No request is decided any more: give leased units back now, not window + L later.
        let settled = self.limiter.settle_all_leases().await;
        if settled > 0 {
            tracing::info!(settled, "leases settled");
        }
        // The slots of the requests the drain cut short: their workers' runtimes are dropped
        // after the server ends, and their give-backs sent from this one.
        let out = self.slots_out.back(SLOTS_BACK_WAIT).await;
        if out > 0 {
            tracing::warn!(out, "concurrency slots not given back; their timeout will");
        }
        // At once: one after another, their drains (at most 8 s, 1 s and 10 s) added up past
        // the stop grace an orchestrator gives (compose's 30 s, with the HTTP drain before).
        let (admin, metrics) = (self.companions.admin.take(), self.companions.metrics.take());
        let admin = async {
            if let Some((admin, _)) = admin {
                admin.stop(true).await;
            }
        };
        let metrics = async {
            if let Some((metrics, _)) = metrics {
                metrics.stop(true).await;
            }
        };
        // Moves' second passes sent again in the background (on this runtime): waited for
        // beside the companions, within the Envoy front end's drain, so the stop is no longer.
        let ledger = self.limiter.ledger().clone();
        let passes = async move {
            let until = std::time::Instant::now() + RLS_DRAIN_MAX;
            if !ledger.second_passes_done(until).await {
                tracing::warn!("a move's second pass had not landed; the holds it carries count on no plan until they expire");
            }
        };
        tokio::join!(admin, metrics, stop_rls(self.companions.rls.take()), passes);
        // The address and epoch followers.
        drop(self.companions);
        if let Some(embedded) = self.embedded {
            embedded.stop().await;
            tracing::info!("embedded TigerBeetle stopped");
        }
        result
    }
}

/// Says a companion ended before the stop, and why the service stops: the error
/// [`Application::run_until_stopped`] answers.
fn companion_failed(ended: &Ended) -> std::io::Error {
    tracing::error!(
        companion = ended.companion,
        why = %ended.why,
        "the {} ended: stopping the service, so that it is restarted whole",
        ended.companion
    );
    std::io::Error::other(format!("the {} ended: {}", ended.companion, ended.why))
}

/// What the main server's app serves with: the limiter, the rate-limit middleware, the
/// exporters, and the embedded ledger's given-up flag (none: no ledger embedded).
type AppParts = (Arc<Limiter>, RateLimit, Exporters, Option<GaveUp>);

/// The main HTTP server on `listener`, running, and its readiness (which a stop turns off).
fn main_server(
    settings: &Settings,
    listener: TcpListener,
    (limiter, rate_limit, exporters, gave_up): AppParts,
) -> Result<(Server, web::Data<routes::Readiness>), StartupError> {
    let metrics_here = settings.metrics_listen.is_none();
    let readiness = web::Data::new(routes::Readiness::default());
    let app_readiness = readiness.clone();
    // A ledger given up on fails liveness; with none embedded, there is none to give up.
    let gave_up = web::Data::new(gave_up.unwrap_or_default());
    let server = HttpServer::new(move || {
        App::new()
            .app_data(web::Data::from(limiter.clone()))
            .app_data(app_readiness.clone())
            .app_data(gave_up.clone())
            .configure(|config| all_routes(config, &rate_limit, &exporters, metrics_here))
    })
    .workers(settings.workers.get())
    // The binary's own handlers stop it gracefully (main.rs); actix's stopped it at once on
    // SIGINT, and the whole system 300 ms after either signal, admin API and all.
    .disable_signals()
    .shutdown_timeout(10)
    .client_request_timeout(CLIENT_REQUEST_TIMEOUT)
    .client_disconnect_timeout(CLIENT_DISCONNECT_TIMEOUT)
    .keep_alive(KEEP_ALIVE)
    .max_connections(CONNECTIONS_PER_WORKER_MAX)
    .listen(listener)
    .map_err(|source| StartupError::Listen {
        address: settings.listen.clone(),
        source,
    })?
    .run();
    Ok((server, readiness))
}

/// Stops the Envoy front end, if it runs. Graceful: no new calls, the ones in flight finish
/// (each within the decision deadline).
async fn stop_rls(rls: Option<RlsServer>) {
    let Some(rls) = rls else {
        return;
    };
    let _ = rls.stop.send(());
    match tokio::task::spawn_blocking(move || rls.thread.join()).await {
        Ok(Ok(Ok(()))) => tracing::info!("Envoy rate-limit service stopped"),
        Ok(Ok(Err(error))) => tracing::warn!(%error, "Envoy rate-limit service failed"),
        _ => tracing::warn!("Envoy rate-limit service thread failed"),
    }
}

/// Connections a listener keeps waiting to be accepted, at most: actix-server's default (the
/// kernel caps it at `net.core.somaxconn`). Why not std's bind: it asks for 128, and a
/// burst of new connections past that (a load balancer's pool filling, k6 ramping up its users)
/// had its handshakes dropped, each client waiting a second or more before it tried again.
pub const LISTEN_BACKLOG: i32 = 2048;

/// Binds `address` (`host:port`; a host name's addresses in turn, the first that binds, as std's
/// bind does), with SO_REUSEADDR as std sets it, listening with [`LISTEN_BACKLOG`].
pub fn bind_listener(address: &str) -> std::io::Result<TcpListener> {
    use std::net::ToSocketAddrs;
    let mut failed = None;
    for address in address.to_socket_addrs()? {
        match bind_one(address) {
            Ok(listener) => return Ok(listener),
            Err(error) => failed = Some(error),
        }
    }
    Err(failed.unwrap_or_else(|| {
        let none = "the address resolves to no address";
        std::io::Error::new(std::io::ErrorKind::InvalidInput, none)
    }))
}

fn bind_one(address: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&address.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// A listener of the service before its server runs. Listening from the start, so that the
/// port stays the service's: a socket bound but not listening let another process bind the
/// same port with SO_REUSEADDR meanwhile, and the service's own listen failed late. Until its
/// server runs, a thread resets each connection at once ([`reset_while_starting`]): left in
/// the backlog, a health check or an Envoy call waited unanswered while the embedded ledger
/// formatted and started (seconds; tens of seconds in production mode).
struct Bound {
    listen: String,
    /// Taken by [`Bound::listening`].
    listener: Option<TcpListener>,
    port: u16,
    resetting: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

/// How often a listener whose server is not running yet looks for connections to reset.
const STARTING_ACCEPT_INTERVAL: Duration = Duration::from_millis(10);

impl Bound {
    /// Binds `listen` (`host:port`; a host name's addresses in turn, the first that binds) and
    /// listens, resetting connections until [`Bound::listening`].
    fn new(listen: &str) -> Result<Bound, StartupError> {
        let error = |source| StartupError::Listen {
            address: listen.to_owned(),
            source,
        };
        let listener = bind_listener(listen).map_err(error)?;
        let port = listener.local_addr().map_err(error)?.port();
        let resetter = listener.try_clone().map_err(error)?;
        // Shared with `listener` (one open file): undone in `listening`.
        resetter.set_nonblocking(true).map_err(error)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("starting".to_owned())
            .spawn(move || reset_while_starting(&resetter, &stopped))
            .map_err(error)?;
        Ok(Bound {
            listen: listen.to_owned(),
            listener: Some(listener),
            port,
            resetting: Some((stop, thread)),
        })
    }

    /// The listener, for its server to run now (no connection reset from here on), and its
    /// port.
    fn listening(mut self) -> Result<(TcpListener, u16), StartupError> {
        self.stop_resetting();
        let listener = self.listener.take().expect("taken once, here");
        match listener.set_nonblocking(false) {
            Ok(()) => Ok((listener, self.port)),
            Err(source) => Err(StartupError::Listen {
                address: std::mem::take(&mut self.listen),
                source,
            }),
        }
    }

    fn stop_resetting(&mut self) {
        if let Some((stop, thread)) = self.resetting.take() {
            stop.store(true, Ordering::Release);
            let _ = thread.join();
        }
    }
}

impl Drop for Bound {
    /// A start that fails before this listener's server runs leaves no thread resetting.
    fn drop(&mut self) {
        self.stop_resetting();
    }
}

/// Resets (RST) each connection `listener` (non-blocking) takes, until `stop`.
fn reset_while_starting(listener: &TcpListener, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            }
            // None waiting, or none can be taken now (no descriptor free): look again soon.
            Err(_) => std::thread::sleep(STARTING_ACCEPT_INTERVAL),
        }
    }
}

/// The listeners of the service beside its own, bound (each with its port), as configured.
/// Bound before anything else starts: a port taken fails the start at once, before an embedded
/// ledger is formatted and started for nothing, and before that ledger takes a free port that a
/// fixed `listen` of the ephemeral range names. Until each one's server runs, its connections
/// are reset ([`Bound`]).
struct Listeners {
    metrics: Option<Bound>,
    admin: Option<Bound>,
    rls: Option<Bound>,
}

impl Listeners {
    /// The service's own listener, and the others.
    fn bind(settings: &Settings) -> Result<(Bound, Self), StartupError> {
        let main = Bound::new(&settings.listen)?;
        let metrics = (settings.metrics_listen.as_deref()).map(Bound::new);
        let metrics = metrics.transpose()?;
        let admin = (settings.admin.as_ref()).map(|admin| Bound::new(&admin.listen));
        let rls = (settings.rls.as_ref()).map(|rls| Bound::new(&rls.listen));
        let listeners = Listeners {
            metrics,
            admin: admin.transpose()?,
            rls: rls.transpose()?,
        };
        Ok((main, listeners))
    }
}

/// The admin API, the Envoy front end and the metrics, each on its listener, where configured.
fn start_listeners(
    settings: &Settings,
    (limiter, (rate_limit, exporters)): (&Arc<Limiter>, (RateLimit, Exporters)),
    (listeners, companions): (Listeners, &mut Companions),
) -> Result<(), StartupError> {
    if let (Some(listen), Some(bound)) = (&settings.metrics_listen, listeners.metrics) {
        let bound = bound.listening()?;
        let metrics = metrics_server((listen, bound), rate_limit, exporters)?;
        companions.metrics = Some(companions.watched("metrics server", metrics));
    }
    // The Envoy rules in force, as its front end and the admin API's look-up read them.
    let envoy_rules = (settings.rls.as_ref()).map(|rls| {
        let (config, path) = (rls.config.clone(), rls.config_path.clone());
        Arc::new(LiveRules::new(config, path, rls.config_read))
    });
    if let (Some(admin), Some(bound)) = (&settings.admin, listeners.admin) {
        let envoy = envoy_rules.clone().map(|rules| {
            let accounts = EnvoyAccounts {
                rules,
                ledger_id: limiter.ledger().ledger_id(),
            };
            Arc::new(accounts) as Arc<dyn admin::DescriptorAccounts>
        });
        let admin_state = (limiter.clone(), settings.rules.clone(), envoy);
        let admin = admin_server((admin, bound.listening()?), admin_state)?;
        companions.admin = Some(companions.watched("admin API", admin));
    }
    if let (Some(rls), Some(bound), Some(rules)) = (&settings.rls, listeners.rls, envoy_rules) {
        let (workers, bound) = (settings.workers.get(), bound.listening()?);
        let reporter = companions.watch.reporter();
        let rls = rls_server((rls, bound), (limiter.clone(), rules), (workers, reporter))?;
        companions.rls = Some(rls);
    }
    Ok(())
}

/// What the admin API acts through: the limiter, how callers are named, and the Envoy front
/// end's rules when it is on.
type AdminParts = (
    Arc<Limiter>,
    Arc<crate::http::rules::RequestRules>,
    Option<Arc<dyn admin::DescriptorAccounts>>,
);

/// The Envoy front end's accounts, as the admin API looks them up: the one place that knows
/// both (the two layers know nothing of each other).
struct EnvoyAccounts {
    rules: Arc<LiveRules>,
    ledger_id: u32,
}

impl admin::DescriptorAccounts for EnvoyAccounts {
    fn find(&self, domain: &str, entries: Vec<(String, String)>) -> admin::DescriptorFound {
        use crate::envoy::service::{descriptor_account, DescriptorAccount};
        use admin::DescriptorFound;
        let config = self.rules.current();
        match descriptor_account(&config, self.ledger_id, domain, entries) {
            DescriptorAccount::Invalid(detail) => DescriptorFound::Invalid(detail),
            DescriptorAccount::NoRule => DescriptorFound::NoAccount(
                "no rule matches this descriptor: Envoy's calls with it are not limited".into(),
            ),
            DescriptorAccount::Unlimited { rule } => DescriptorFound::NoAccount(format!(
                "the rule `{rule}` is unlimited: it keeps no account"
            )),
            DescriptorAccount::Counted {
                rule,
                account,
                shadow_mode,
            } => DescriptorFound::Counted {
                rule,
                account,
                shadow_mode,
            },
        }
    }
}

/// The admin API on its own listener (one worker: it is for operators, not traffic), running.
fn admin_server(
    (admin, (listener, port)): (&AdminSettings, (TcpListener, u16)),
    (limiter, rules, envoy): AdminParts,
) -> Result<(Server, u16), StartupError> {
    let listen_error = |source| StartupError::Listen {
        address: admin.listen.clone(),
        source,
    };
    let state = web::Data::new(AdminState {
        limiter,
        secrets: admin.secrets.clone(),
        rules,
        envoy,
    });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .configure(admin::configure)
            .default_service(admin::unknown_path())
            .wrap_fn(|req, service| {
                let answer = actix_web::dev::Service::call(service, req);
                crate::ledger::as_operator_action(answer)
            })
    })
    .workers(1)
    // The main server handles SIGINT/SIGTERM and stops this one on its way out; two servers
    // listening for signals lose one that arrives during start-up.
    .disable_signals()
    // An action's deadline (5 s) and its follow-ups' (1 s each) at most, not actix's default
    // 30 s: the stop comes after the HTTP drain and the leases' settling, and a container's
    // stop grace is often 10 s in all.
    .shutdown_timeout(ADMIN_DRAIN_SECONDS)
    .listen(listener)
    .map_err(listen_error)?
    .run();
    tracing::info!(port, "admin API listening on port {port}");
    Ok((server, port))
}

/// `/metrics` and `/metrics/exemplars` on a listener of their own (one worker: a scrape renders
/// text, a few a minute), running.
fn metrics_server(
    (listen, (listener, port)): (&str, (TcpListener, u16)),
    rate_limit: RateLimit,
    exporters: Exporters,
) -> Result<(Server, u16), StartupError> {
    let server = HttpServer::new(move || {
        App::new().configure(|config| metrics_routes(config, &rate_limit, &exporters))
    })
    .workers(1)
    // As the admin API's: the main server's signal handling stops this one.
    .disable_signals()
    .shutdown_timeout(1)
    .client_request_timeout(CLIENT_REQUEST_TIMEOUT)
    .keep_alive(KEEP_ALIVE)
    .listen(listener)
    .map_err(|source| StartupError::Listen {
        address: listen.to_owned(),
        source,
    })?
    .run();
    tracing::info!(port, "metrics listening on port {port}");
    Ok((server, port))
}

/// How long a stop waits for concurrency slots to come back, at most.
const SLOTS_BACK_WAIT: Duration = Duration::from_secs(3);

/// How long past its deadline a stop waits for a lease renewal still running: the deadline
/// bounds its ledger calls, and this its scheduling on a busy machine.
const RENEWALS_END_GRACE: Duration = Duration::from_secs(1);

/// How long a stopping admin API waits for the actions in flight, at most: an action's
/// deadline (5 s) and three follow-ups of a second each (a move's lost-answer search, its
/// second pass, the operator epoch's bump), with a second to spare (at 8 s, such an answer was
/// cut off).
const ADMIN_DRAIN_SECONDS: u64 = 9;

/// Envoy's rate-limit service on its own listener and its own multi-threaded runtime (the binary's
/// main runtime is actix's single thread), on the HTTP front end's limiter.
fn rls_server(
    (rls, (listener, port)): (&RlsSettings, (TcpListener, u16)),
    (limiter, rules): (Arc<Limiter>, Arc<LiveRules>),
    (workers, reporter): (usize, Reporter),
) -> Result<RlsServer, StartupError> {
    let listen_error = |source| StartupError::Listen {
        address: rls.listen.clone(),
        source,
    };
    listener.set_nonblocking(true).map_err(listen_error)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("rls")
        .enable_all()
        .build()
        .map_err(listen_error)?;
    let server = RateLimitServer::new(limiter, rules.clone());
    let bounds = rls.bounds;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("rls".to_owned())
        .spawn(move || {
            let serving = serve_rls(server, (listener, bounds), (rules, stopped), &reporter);
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runtime.block_on(serving)
            }));
            // Not the runtime's drop, which waits for every blocking task: a rules reread stuck
            // for good (a pipe nobody writes, a hung mount) held the stop for ever.
            runtime.shutdown_timeout(BLOCKING_TASKS_GRACE);
            let served = served.unwrap_or_else(|panic| Err(watch::panic_message(panic)));
            if let Err(why) = &served {
                // After the stop too (calls cut off): nobody is listening then.
                reporter.ended(RLS_COMPANION, why.clone());
            }
            served
        })
        .map_err(listen_error)?;
    tracing::info!(
        port,
        domains = rls.config.domains(),
        rules = rls.config.rules(),
        "Envoy rate-limit service listening on port {port}"
    );
    Ok(RlsServer { port, stop, thread })
}

/// How long a runtime's end waits for its blocking tasks (a rules reread, a DNS lookup) before
/// it leaves them behind.
const BLOCKING_TASKS_GRACE: Duration = Duration::from_secs(1);

/// The Envoy front end's companion name, as its end is reported.
const RLS_COMPANION: &str = "Envoy rate-limit service";

/// The Envoy front end, on its runtime, with its rules' follower, until stopped.
async fn serve_rls(
    server: RateLimitServer,
    (listener, bounds): (TcpListener, crate::envoy::Bounds),
    (rules, stopped): (Arc<LiveRules>, tokio::sync::oneshot::Receiver<()>),
    reporter: &Reporter,
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
    // Ends with this runtime, after the server.
    let follow = tokio::spawn(rules.follow(RULES_CHECK_INTERVAL, RlsMetrics::register()));
    reporter.task("Envoy rules follower", follow);
    let stopped = futures_util::FutureExt::shared(stopped);
    let shutdown = {
        let stopped = stopped.clone();
        async move {
            let _ = stopped.await;
        }
    };
    // Calls in flight finish within their deadline; a call whose peer never ends it (no
    // grpc-timeout, a half-sent body) must not keep the service from stopping.
    let cut_off = async move {
        let _ = stopped.await;
        tokio::time::sleep(RLS_DRAIN_MAX).await;
    };
    tokio::select! {
        served = crate::envoy::serve(server, (listener, bounds), shutdown) => {
            served.map_err(|e| e.to_string())
        }
        () = cut_off => Err(format!("calls still open {RLS_DRAIN_MAX:?} after the stop; closed")),
    }
}

/// How long the Envoy front end waits for its calls in flight to finish once stopped, at most.
const RLS_DRAIN_MAX: Duration = Duration::from_secs(10);

/// How often the client looks for the embedded server's address: a restart takes a second or
/// more, and a look is a comparison of two addresses.
const EMBEDDED_FOLLOW_INTERVAL: Duration = Duration::from_millis(250);

/// The embedded ledger, started first, or the cluster's resolved addresses; then the one client.
/// The addresses are followed: host names resolved again every few seconds, the embedded
/// server's port after each restart. Each look also closes the clients an eviction replaced.
async fn connect_ledger(
    settings: &Settings,
) -> Result<(Ledger, Option<EmbeddedLedger>, JoinHandle<()>), StartupError> {
    let (addresses, embedded) = match &settings.ledger {
        LedgerLocation::Cluster { addresses } => {
            (resolve_addresses_or_stand_ins(addresses).await?, None)
        }
        LedgerLocation::Embedded {
            data_dir,
            tigerbeetle_bin,
            development,
        } => {
            let embedded = EmbeddedLedger::start(EmbeddedOptions {
                bin: tigerbeetle_bin.clone(),
                data_dir: data_dir.clone(),
                cluster_id: settings.cluster_id,
                development: *development,
            })
            .await?;
            (vec![embedded.address()], Some(embedded))
        }
    };
    let ledger = Ledger::connect(&settings.ledger_settings(addresses))?;
    let follower = match &settings.ledger {
        // IP literals too: they resolve to themselves without a lookup, and each look closes
        // the clients an eviction replaced.
        LedgerLocation::Cluster { addresses } => {
            let hosts = addresses.clone();
            let followed = ledger.clone();
            let resolve = move || {
                let hosts = hosts.clone();
                let current = followed.addresses();
                async move { resolve_addresses_keeping(&hosts, &current).await }
            };
            let follow = follow_addresses(ledger.clone(), RESOLVE_INTERVAL, resolve);
            tokio::spawn(follow)
        }
        LedgerLocation::Embedded { .. } => {
            let address = embedded.as_ref().expect("started above").addresses();
            let resolve = move || {
                let addresses = vec![*address.borrow()];
                async move { Ok::<_, std::convert::Infallible>(addresses) }
            };
            let follow = follow_addresses(ledger.clone(), EMBEDDED_FOLLOW_INTERVAL, resolve);
            tokio::spawn(follow)
        }
    };
    Ok((ledger, embedded, follower))
}

/// Health, readiness and (unless they have a listener of their own) metrics: outside the
/// limiter, the request span and the request latency histogram, so probes and scrapes never show
/// up as traffic (nor as exemplars on the dashboard).
fn operational_routes(
    config: &mut web::ServiceConfig,
    rate_limit: &RateLimit,
    (exporters, metrics_here): (&Exporters, bool),
) {
    config
        .route("/healthz", web::get().to(routes::healthz))
        .route("/readyz", web::get().to(routes::readyz));
    if metrics_here {
        metrics_routes(config, rate_limit, exporters);
    } else {
        // Served on their own listener: here a plain 404, whatever the method, outside the
        // limiter, the histogram and the traces as the scrapes were (a stale scrape config is
        // no caller's traffic, and is charged to no one).
        let elsewhere = || web::route().to(HttpResponse::NotFound);
        config
            .route("/metrics", elsewhere())
            .route("/metrics/exemplars", elsewhere());
    }
}

/// `/metrics` (Prometheus text) and `/metrics/exemplars` (OpenMetrics), for the exporters set.
fn metrics_routes(config: &mut web::ServiceConfig, rate_limit: &RateLimit, exporters: &Exporters) {
    if let Some(handle) = exporters.prometheus.clone() {
        let rate_limit = rate_limit.clone();
        config.route(
            "/metrics",
            web::get().to(move || {
                // The limiters count per thread: what was decided before this scrape is in it.
                rate_limit.drain_counts();
                let body = handle.render();
                async move {
                    HttpResponse::Ok()
                        .content_type("text/plain; version=0.0.4; charset=utf-8")
                        .body(body)
                }
            }),
        );
    }
    if let Some(metrics) = exporters.http_metrics.clone() {
        config.route(
            "/metrics/exemplars",
            web::get().to(move || {
                let body = metrics.render();
                async move {
                    HttpResponse::Ok()
                        .content_type(OPENMETRICS_CONTENT_TYPE)
                        .body(body)
                }
            }),
        );
    }
}

/// The middlewares of every limited path, innermost first: the limiter, the latency histogram,
/// the request span. (A macro: a resource and a scope each have `wrap`, through no common trait.)
macro_rules! limited {
    ($service:expr, $rate_limit:expr, $exporters:expr) => {
        $service
            .wrap($rate_limit)
            .wrap(RecordHttpMetrics::new($exporters.http_metrics.clone()))
            .wrap(Condition::new(
                $exporters.trace_requests,
                TracingLogger::<LimiterRootSpan>::new(),
            ))
    };
}

/// Every route, in the order they are matched. First the routes that carry the traffic, each a
/// resource with the limited middlewares of its own: a request is routed once and matched first.
/// (A scope around them, matched after the operational routes, cost a second routing pass and a
/// check of every operational route: 0.2–0.7 µs of CPU per request, hot callers at 256
/// connections.) Last, every other path with the same middlewares: an unknown path is charged,
/// then 404s.
fn all_routes(
    config: &mut web::ServiceConfig,
    rate_limit: &RateLimit,
    exporters: &Exporters,
    metrics_here: bool,
) {
    config.service(
        limited!(web::resource("/greeting"), rate_limit.clone(), exporters)
            .route(web::get().to(routes::greeting)),
    );
    operational_routes(config, rate_limit, (exporters, metrics_here));
    config.service(limited!(web::scope(""), rate_limit.clone(), exporters));
}
