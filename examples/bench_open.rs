//! An open-model load generator: `GET /greeting` at a fixed arrival rate, whatever the server's
//! latency, so that two servers compared at one rate do the same work per second.
//!
//!     cargo run --release --example bench_open -- ADDR RATE SECONDS CONNECTIONS PREFIX KEYS
//!
//! Why: wrk keeps each connection busy (a closed model), so a server with a longer round trip
//! (a durable write) serves fewer requests per second, and each request then pays more of the
//! fixed cost of waking idle threads. CPU per request from wrk compares two servers at two
//! different rates; this compares them at one (`scripts/bench`'s equal-rate rows).
//!
//! Request `i` is due at `i / RATE` seconds and goes out on the first free connection of
//! CONNECTIONS keep-alive connections, with the key `PREFIX` + `i % KEYS` (five digits, as
//! `scripts/bench`'s wrk script does). Latency counts from the send; a request sent more than
//! 2 ms after it was due (no free connection, or the generator behind) counts as `late`, and a
//! run with late requests did not hold its rate. One thread, few
//! allocations: the generator's own CPU stays small beside the servers'. A request unanswered
//! after 5 s (wrk's `--timeout` in `scripts/bench`) is a timeout, and its connection is dropped.
//! Prints one line, `OPEN_JSON {...}`, with the keys of `scripts/bench`'s `WRK_JSON` (requests
//! answered, duration, latency percentiles in µs, errors by kind, statuses) and `offered_per_s`
//! and `late`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An answer later than this is a timeout.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// A response's head larger than this is not one of the bench servers'.
const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Sent more than this after its due time: the generator (or the server) fell behind. Tokio's
/// timer ticks every millisecond, so up to one is the timer's, not lateness.
const LATE_AFTER: Duration = Duration::from_millis(2);

struct Plan {
    addr: SocketAddr,
    rate_per_second: u64,
    total: u64,
    prefix: String,
    keys: u64,
    start: Instant,
    next: AtomicU64,
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    statuses: BTreeMap<u16, u64>,
    late: u64,
    /// Connections that could not be made, exchanges that failed, answers that timed out.
    connect_errors: u64,
    read_errors: u64,
    timeouts: u64,
}

/// Bounds on the arguments: a bench run, not a stress tool.
const RATE_PER_SECOND_MAX: u64 = 1_000_000;
const SECONDS_MAX: u64 = 3_600;
const CONNECTIONS_MAX: u64 = 10_000;

fn usage(problem: &str) -> ! {
    eprintln!("bench_open: {problem}");
    eprintln!("usage: bench_open ADDR RATE SECONDS CONNECTIONS PREFIX KEYS");
    std::process::exit(2)
}

fn arg<T: std::str::FromStr>(args: &[String], index: usize, name: &str) -> T {
    args.get(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| usage(&format!("{name} is missing or not valid")))
}

/// A whole number in 1..=max.
fn count(args: &[String], index: usize, name: &str, max: u64) -> u64 {
    let n: u64 = arg(args, index, name);
    if n == 0 || n > max {
        usage(&format!("{name} must be 1..={max}, got {n}"));
    }
    n
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rate_per_second = count(&args, 2, "RATE", RATE_PER_SECOND_MAX);
    let seconds = count(&args, 3, "SECONDS", SECONDS_MAX);
    let connections = count(&args, 4, "CONNECTIONS", CONNECTIONS_MAX);
    let plan = Arc::new(Plan {
        addr: arg(&args, 1, "ADDR"),
        rate_per_second,
        total: rate_per_second * seconds,
        prefix: arg(&args, 5, "PREFIX"),
        keys: count(&args, 6, "KEYS", u64::from(u32::MAX)),
        start: Instant::now() + Duration::from_millis(200),
        next: AtomicU64::new(0),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let tallies = runtime.block_on(async {
        let tasks: Vec<_> = (0..connections)
            .map(|_| tokio::spawn(connection(plan.clone())))
            .collect();
        let mut tallies = Vec::new();
        for task in tasks {
            tallies.push(task.await.expect("a connection task"));
        }
        tallies
    });
    report(&plan, tallies);
}

/// One keep-alive connection: takes the next due request until all are taken.
async fn connection(plan: Arc<Plan>) -> Tally {
    let mut tally = Tally::default();
    let mut stream: Option<TcpStream> = None;
    let mut request = Vec::with_capacity(128);
    let mut buffer = vec![0u8; HEAD_BYTES_MAX];
    loop {
        let i = plan.next.fetch_add(1, Ordering::Relaxed);
        if i >= plan.total {
            return tally;
        }
        let due = plan.start + Duration::from_nanos(i * 1_000_000_000 / plan.rate_per_second);
        tokio::time::sleep_until(due.into()).await;
        let sent = Instant::now();
        if sent - due > LATE_AFTER {
            tally.late += 1;
        }
        request.clear();
        let key = i % plan.keys;
        write!(
            request,
            "GET /greeting HTTP/1.1\r\nHost: bench\r\nX-Api-Key: {}{key:05}\r\n\r\n",
            plan.prefix
        )
        .expect("writing to a Vec");
        if stream.is_none() {
            stream = TcpStream::connect(plan.addr).await.ok();
            if let Some(s) = &stream {
                s.set_nodelay(true).expect("TCP_NODELAY");
            }
        }
        let Some(open) = stream.as_mut() else {
            tally.connect_errors += 1;
            continue;
        };
        match tokio::time::timeout(ANSWER_TIMEOUT, exchange(open, &request, &mut buffer)).await {
            Ok(Some(status)) => {
                *tally.statuses.entry(status).or_default() += 1;
                tally.latencies_us.push(sent.elapsed().as_micros() as u64);
            }
            Ok(None) => {
                tally.read_errors += 1;
                stream = None;
            }
            Err(_) => {
                tally.timeouts += 1;
                stream = None;
            }
        }
    }
}

/// Sends `request` and reads one response; its status, or `None` if the connection failed.
async fn exchange(stream: &mut TcpStream, request: &[u8], buffer: &mut [u8]) -> Option<u16> {
    stream.write_all(request).await.ok()?;
    let mut filled = 0;
    let head_end = loop {
        if filled == buffer.len() {
            return None;
        }
        let n = stream.read(&mut buffer[filled..]).await.ok()?;
        if n == 0 {
            return None;
        }
        filled += n;
        if let Some(at) = find(&buffer[..filled], b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = std::str::from_utf8(&buffer[..head_end]).ok()?;
    let status: u16 = head.get(9..12)?.parse().ok()?;
    let body_bytes = content_length(head)?;
    let mut have = filled - head_end;
    while have < body_bytes {
        let n = stream.read(buffer).await.ok()?;
        if n == 0 {
            return None;
        }
        have += n;
    }
    // Keep-alive, one request at a time: nothing may follow the body.
    (have == body_bytes).then_some(status)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn content_length(head: &str) -> Option<usize> {
    head.split("\r\n").find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse().ok())?
    })
}

fn report(plan: &Plan, tallies: Vec<Tally>) {
    let duration_us = plan.start.elapsed().as_micros();
    let mut all = Tally::default();
    for t in tallies {
        all.latencies_us.extend(t.latencies_us);
        for (status, n) in t.statuses {
            *all.statuses.entry(status).or_default() += n;
        }
        all.late += t.late;
        all.connect_errors += t.connect_errors;
        all.read_errors += t.read_errors;
        all.timeouts += t.timeouts;
    }
    all.latencies_us.sort_unstable();
    let at = |q: f64| -> u64 {
        let n = all.latencies_us.len();
        if n == 0 {
            return 0;
        }
        all.latencies_us[((n as f64 * q) as usize).min(n - 1)]
    };
    let statuses: Vec<String> = all
        .statuses
        .iter()
        .map(|(s, n)| format!("\"{s}\":{n}"))
        .collect();
    println!(
        "OPEN_JSON {{\"requests\":{},\"duration_us\":{duration_us},\"bytes\":0,\"p50_us\":{},\
         \"p90_us\":{},\"p99_us\":{},\"max_us\":{},\"errors\":{{\"connect\":{},\"read\":{},\
         \"write\":0,\"timeout\":{}}},\"statuses\":{{{}}},\"offered_per_s\":{},\"late\":{}}}",
        all.latencies_us.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        all.latencies_us.last().copied().unwrap_or(0),
        all.connect_errors,
        all.read_errors,
        all.timeouts,
        statuses.join(","),
        plan.rate_per_second,
        all.late,
    );
}
