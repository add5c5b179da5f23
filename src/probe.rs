//! `ledger-limiter probe`: asks a running service on this machine whether it is ready, for a
//! container's health check. The service image has no `curl` (nor should it need one), so the
//! binary probes itself: one HTTP/1.1 GET on the configured listen address, exit 0 on a 2xx.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most of an answer read: the status line and a short reason are all a probe reports.
const ANSWER_BYTES_MAX: u64 = 4096;

#[derive(Debug, clap::Args)]
pub struct Probe {
    /// The path asked: /readyz (the ledger answers) or /healthz (the process serves).
    #[arg(long, default_value = "/readyz")]
    path: String,
    /// How long the whole probe may take, in milliseconds (1 to 60,000).
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
}

/// Probes the service listening on `listen` (its `--listen`): an error says why it is not ready.
pub async fn probe(listen: &str, probe: &Probe) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=60_000).contains(&probe.timeout_ms),
        "--timeout-ms must be between 1 and 60000"
    );
    anyhow::ensure!(
        probe.path.starts_with('/') && probe.path.bytes().all(|b| b.is_ascii_graphic()),
        "--path must be an absolute path of visible ASCII, like /readyz"
    );
    // One time limit for the whole probe, the name's lookup included (a stalled resolver).
    let timeout = Duration::from_millis(probe.timeout_ms);
    let whole = async {
        let address = target(listen).await?;
        let answer = get(address, &probe.path).await?;
        anyhow::Ok((address, answer))
    };
    let (address, answer) = tokio::time::timeout(timeout, whole)
        .await
        .with_context(|| format!("no answer from {listen} within {timeout:?}"))??;
    let status_line = answer.lines().next().unwrap_or_default();
    let status = status_line.split(' ').nth(1).unwrap_or_default();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default().trim();
    anyhow::ensure!(
        status.len() == 3 && status.starts_with('2'),
        "{} {}: {status_line:?} {body:?}",
        address,
        probe.path
    );
    println!("{status_line} {body}");
    Ok(())
}

/// Where to connect for `listen` (the first address a host name resolves to, as the service
/// binds it): a wildcard address (every interface) is probed on loopback; a port of 0 cannot be
/// probed (the service picked one at start).
async fn target(listen: &str) -> anyhow::Result<SocketAddr> {
    let mut address = tokio::net::lookup_host(listen)
        .await
        .ok()
        .and_then(|mut addresses| addresses.next())
        .with_context(|| format!("the listen address {listen:?} is not a host and port"))?;
    anyhow::ensure!(
        address.port() != 0,
        "the listen address {listen} has port 0 (picked at start): give the port with --listen"
    );
    if address.ip().is_unspecified() {
        address.set_ip(match address.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    Ok(address)
}

/// One GET, the connection closed after it; the start of the answer, as text.
async fn get(address: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .with_context(|| format!("connecting to {address}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .with_context(|| format!("asking {address}"))?;
    let mut answer = Vec::new();
    stream
        .take(ANSWER_BYTES_MAX)
        .read_to_end(&mut answer)
        .await
        .with_context(|| format!("reading {address}'s answer"))?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wildcards_are_probed_on_loopback_and_port_0_is_refused() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(target("0.0.0.0:8080").await.unwrap(), at("127.0.0.1:8080"));
        assert_eq!(target("[::]:8080").await.unwrap(), at("[::1]:8080"));
        assert_eq!(target("10.1.2.3:80").await.unwrap(), at("10.1.2.3:80"));
        assert!(target("localhost:8080").await.unwrap().ip().is_loopback());
        let err = target("127.0.0.1:0").await.unwrap_err().to_string();
        assert!(err.contains("port 0"), "{err}");
        let err = target("8080").await.unwrap_err().to_string();
        assert!(err.contains("not a host and port"), "{err}");
    }
}
