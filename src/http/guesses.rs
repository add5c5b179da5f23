//! A budget of wrong admin secrets per peer: past it, the peer's requests are refused before any
//! secret is compared, so a secret cannot be guessed online at the rate a worker hashes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Wrong secrets a peer may present in one window before it is refused outright.
pub const WRONG_SECRETS_PER_WINDOW_MAX: u32 = 10;
/// The window of that budget.
pub const GUESS_WINDOW: Duration = Duration::from_secs(60);
/// Peers followed at once; past it, every other peer shares one budget (memory stays bounded,
/// and guesses from many addresses are throttled all the same).
pub const PEERS_MAX: usize = 1024;

/// Wrong secrets by peer (an IPv6 peer by its /64, the block one host is given), per window.
#[derive(Debug, Default)]
pub struct SecretGuesses {
    peers: Mutex<Guesses>,
}

#[derive(Debug, Default)]
struct Guesses {
    by_peer: HashMap<Option<IpAddr>, Window>,
    /// The shared budget of peers not followed (the map was full).
    others: Window,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    wrong: u32,
}

impl Default for Window {
    fn default() -> Self {
        Window::new(Instant::now())
    }
}

impl Window {
    fn new(started: Instant) -> Window {
        Window { started, wrong: 0 }
    }

    /// The window as of `now`: a new one once this one ended.
    fn current(self, now: Instant) -> Window {
        if now.duration_since(self.started) >= GUESS_WINDOW {
            Window::new(now)
        } else {
            self
        }
    }

    /// How long until the window ends, when its budget is spent.
    fn refused_for(&self, now: Instant) -> Option<Duration> {
        let spent = self.wrong >= WRONG_SECRETS_PER_WINDOW_MAX;
        spent.then(|| GUESS_WINDOW.saturating_sub(now.duration_since(self.started)))
    }
}

impl SecretGuesses {
    /// `Some(wait)` when `peer` spent its budget: refuse it, without comparing its secret.
    pub fn refused_for(&self, peer: Option<IpAddr>, now: Instant) -> Option<Duration> {
        let guesses = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let peer = peer.map(network);
        let window = match guesses.by_peer.get(&peer) {
            Some(window) => *window,
            // Not followed: the shared budget while the map is full, else a fresh one.
            None if guesses.by_peer.len() >= PEERS_MAX => guesses.others,
            None => return None,
        };
        window.current(now).refused_for(now)
    }

    /// Counts a wrong secret `peer` presented.
    pub fn wrong(&self, peer: Option<IpAddr>, now: Instant) {
        let mut guesses = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let peer = peer.map(network);
        if !guesses.by_peer.contains_key(&peer) && guesses.by_peer.len() >= PEERS_MAX {
            guesses
                .by_peer
                .retain(|_, window| window.current(now).wrong > 0);
        }
        let guesses = &mut *guesses;
        let window = match guesses.by_peer.len() < PEERS_MAX {
            true => guesses.by_peer.entry(peer).or_insert(Window::new(now)),
            false => guesses
                .by_peer
                .get_mut(&peer)
                .unwrap_or(&mut guesses.others),
        };
        *window = window.current(now);
        window.wrong = window.wrong.saturating_add(1);
    }
}

/// The address a budget is kept for: IPv4 as is, IPv6 by its /64.
fn network(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().unwrap())
    }

    #[test]
    fn a_peer_past_its_budget_is_refused_until_its_window_ends() {
        let guesses = SecretGuesses::default();
        let start = Instant::now();
        for _ in 0..WRONG_SECRETS_PER_WINDOW_MAX {
            assert_eq!(guesses.refused_for(ip("10.0.0.1"), start), None);
            guesses.wrong(ip("10.0.0.1"), start);
        }
        let later = start + Duration::from_secs(20);
        let wait = guesses.refused_for(ip("10.0.0.1"), later);
        assert_eq!(wait, Some(Duration::from_secs(40)));
        // Another peer, and the same host by its IPv4-mapped name, each as they are.
        assert_eq!(guesses.refused_for(ip("10.0.0.2"), later), None);
        assert!(guesses.refused_for(ip("::ffff:10.0.0.1"), later).is_some());
        let next_window = start + GUESS_WINDOW;
        assert_eq!(guesses.refused_for(ip("10.0.0.1"), next_window), None);
        guesses.wrong(ip("10.0.0.1"), next_window);
        assert_eq!(guesses.refused_for(ip("10.0.0.1"), next_window), None);
    }

    #[test]
    fn an_ipv6_host_is_one_peer_across_its_64() {
        let guesses = SecretGuesses::default();
        let now = Instant::now();
        for i in 0..WRONG_SECRETS_PER_WINDOW_MAX {
            guesses.wrong(ip(&format!("2001:db8::{i:x}")), now);
        }
        assert!(guesses.refused_for(ip("2001:db8::ffff"), now).is_some());
        assert_eq!(guesses.refused_for(ip("2001:db8:0:1::1"), now), None);
    }

    #[test]
    fn peers_past_the_bound_share_one_budget() {
        let guesses = SecretGuesses::default();
        let now = Instant::now();
        let peer = |i: usize| ip(&format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255));
        for i in 0..PEERS_MAX {
            guesses.wrong(peer(i), now);
        }
        assert_eq!(guesses.peers.lock().unwrap().by_peer.len(), PEERS_MAX);
        let extra = PEERS_MAX..PEERS_MAX + WRONG_SECRETS_PER_WINDOW_MAX as usize;
        for i in extra.clone() {
            assert_eq!(guesses.refused_for(peer(i), now), None);
            guesses.wrong(peer(i), now);
        }
        assert_eq!(guesses.peers.lock().unwrap().by_peer.len(), PEERS_MAX);
        assert!(
            guesses.refused_for(peer(extra.end), now).is_some(),
            "shared and spent"
        );
        assert_eq!(
            guesses.refused_for(peer(0), now),
            None,
            "followed on its own"
        );
        // Once their windows ended, followed peers make room.
        let later = now + GUESS_WINDOW;
        guesses.wrong(peer(extra.end + 1), later);
        assert_eq!(guesses.peers.lock().unwrap().by_peer.len(), 1);
    }
}
