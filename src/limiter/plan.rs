//! Plans (capacity per window) and how a caller's key maps to one.
//!
//! Invalid limits are unrepresentable: capacity and window are `NonZero*`, and a [`PlanBook`] can
//! only be built with a default plan that exists and prefixes that name existing plans.

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;

use thiserror::Error;

use super::caller::{CallerKey, KeyKind};

/// A named limit: `capacity` units of credit, each held for `window_seconds` after it is spent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    name: Arc<str>,
    capacity: NonZeroU64,
    window_seconds: NonZeroU32,
    /// Lease mode (opt-in): hot callers are admitted from leased credit in memory.
    lease: Option<LeaseTerms>,
}

/// A plan's lease mode: an instance may lease up to `units_max` units of a caller's credit at a
/// time and admit from them in memory for `seconds` (L), see [`crate::limiter::lease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTerms {
    pub units_max: NonZeroU64,
    pub seconds: NonZeroU32,
}

/// Bound on a plan's capacity: the largest integer a structured field carries (RFC 9651: 15
/// digits). Why: a larger `q` or `r` made a strict parser reject the whole `RateLimit-Policy`
/// list, every policy in it lost.
pub const CAPACITY_MAX: u64 = 999_999_999_999_999;

/// Bound on a lease's time L: unused leased units return within it, so it stays short.
pub const LEASE_SECONDS_MAX: u32 = 60;

impl Plan {
    /// Builds a plan. Names are metric label values, so they are short and plain.
    pub fn new(
        name: &str,
        capacity: NonZeroU64,
        window_seconds: NonZeroU32,
    ) -> Result<Self, PlanError> {
        let name_valid = !name.is_empty()
            && name.len() <= PLAN_NAME_LENGTH_MAX
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_valid {
            return Err(PlanError::InvalidName(name.to_owned()));
        }
        if capacity.get() > CAPACITY_MAX {
            return Err(PlanError::Capacity(name.to_owned()));
        }
        Ok(Plan {
            name: name.into(),
            capacity,
            window_seconds,
            lease: None,
        })
    }

    /// Turns lease mode on. A lease takes at most half of the capacity, so that a second
    /// instance can always lease too (fairness), and lasts at most [`LEASE_SECONDS_MAX`].
    pub fn with_lease(mut self, terms: LeaseTerms) -> Result<Self, PlanError> {
        // The settlement records the units it used in `user_data_32` (the audit trail).
        let units_max = (self.capacity.get() / 2).min(u64::from(u32::MAX));
        if terms.units_max.get() > units_max {
            return Err(PlanError::LeaseUnits(units_max));
        }
        if terms.seconds.get() > LEASE_SECONDS_MAX {
            return Err(PlanError::LeaseSeconds);
        }
        // A lease's timeout is the window and L: one past `u32` was cut short (saturated), and
        // units admitted late in L were released before a window had passed.
        let window_seconds = self.window_seconds.get();
        if window_seconds.checked_add(terms.seconds.get()).is_none() {
            return Err(PlanError::LeaseWindow(self.name.to_string()));
        }
        self.lease = Some(terms);
        Ok(self)
    }

    pub fn lease(&self) -> Option<LeaseTerms> {
        self.lease
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn capacity(&self) -> NonZeroU64 {
        self.capacity
    }

    pub fn window_seconds(&self) -> NonZeroU32 {
        self.window_seconds
    }
}

/// Plan names become metric labels and header tokens: keep them short (bounded label values).
pub const PLAN_NAME_LENGTH_MAX: usize = 32;
/// A bound on the number of plans, so the `plan` metric label stays a small set.
pub const PLAN_COUNT_MAX: usize = 64;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("plan name {0:?} must be 1-{PLAN_NAME_LENGTH_MAX} characters of [A-Za-z0-9_-]")]
    InvalidName(String),
    #[error("plan {0:?}: a capacity is at most {CAPACITY_MAX} (15 digits, what a rate-limit field carries)")]
    Capacity(String),
    #[error("plan {0:?} is defined twice")]
    Duplicate(String),
    #[error("there must be between 1 and {PLAN_COUNT_MAX} plans")]
    Count,
    #[error("plan {0:?} is referenced but not defined")]
    Unknown(String),
    #[error("key prefix must not be empty")]
    EmptyPrefix,
    #[error("a lease may take at most half of the capacity, and 2^32 - 1 units ({0} here)")]
    LeaseUnits(u64),
    #[error("a lease lasts 1-{LEASE_SECONDS_MAX} seconds")]
    LeaseSeconds,
    #[error("plan {0:?}: a lease's timeout (the window and the lease's seconds) is at most 2^32 - 1 seconds")]
    LeaseWindow(String),
}

/// What to do with a key that neither the keys file nor a prefix assigns to a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownKeys {
    /// Any key gets its own account on the default plan (an open API with per-key limits).
    DefaultPlan,
    /// Only listed keys are served; others get 401.
    Reject,
}

/// Index of a plan inside its [`PlanBook`]. Only a book makes them; [`PlanBook::get`] answers
/// `None` for an index it does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanId(u16);

impl PlanId {
    /// The plan's position in its book (0-based).
    pub fn index(self) -> usize {
        self.0.into()
    }

    #[cfg(test)]
    pub(crate) fn from_index(index: usize) -> PlanId {
        PlanId(u16::try_from(index).expect("few plans"))
    }
}

/// Every plan, and the rules that map a key to one. Its `Debug` shows how many keys are listed
/// and each key prefix's plan, never the keys nor the prefixes.
#[derive(Clone)]
pub struct PlanBook {
    plans: Vec<Plan>,
    default_plan: PlanId,
    /// Exact keys (from the keys file). Looked up first.
    keys: HashMap<String, PlanId>,
    /// Prefixes, longest first, so `pro_eu_` wins over `pro_`.
    prefixes: Vec<(String, PlanId)>,
    unknown_keys: UnknownKeys,
    /// The plan of callers known by their address (no key): the default plan unless set.
    address_plan: PlanId,
    /// Kept from construction: read on every decision.
    capacity_min: NonZeroU64,
    window_seconds_max: NonZeroU32,
}

impl std::fmt::Debug for PlanBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanBook")
            .field("plans", &self.plans)
            .field(
                "default_plan",
                &self.plans[self.default_plan.index()].name(),
            )
            .field("listed_keys", &self.keys.len())
            // Each prefix's plan, never its text: under `unknown_keys = "reject"` a prefix is
            // a shared credential (any key that starts with it is admitted on its plan).
            .field(
                "prefixes",
                &(self.prefixes.iter())
                    .map(|(_, plan)| self.plans[plan.index()].name())
                    .collect::<Vec<_>>(),
            )
            .field("unknown_keys", &self.unknown_keys)
            .finish()
    }
}

impl PlanBook {
    pub fn new(
        plans: Vec<Plan>,
        default_plan: &str,
        prefixes: impl IntoIterator<Item = (String, String)>,
        keys: impl IntoIterator<Item = (String, String)>,
        unknown_keys: UnknownKeys,
    ) -> Result<Self, PlanError> {
        if plans.is_empty() || plans.len() > PLAN_COUNT_MAX {
            return Err(PlanError::Count);
        }
        for (i, plan) in plans.iter().enumerate() {
            if plans[..i].iter().any(|p| p.name == plan.name) {
                return Err(PlanError::Duplicate(plan.name().to_owned()));
            }
        }
        let find = |name: &str| -> Result<PlanId, PlanError> {
            plans
                .iter()
                .position(|p| p.name() == name)
                .map(|i| PlanId(i as u16))
                .ok_or_else(|| PlanError::Unknown(name.to_owned()))
        };
        let default_plan = find(default_plan)?;
        let mut prefix_list = Vec::new();
        for (prefix, plan) in prefixes {
            if prefix.is_empty() {
                return Err(PlanError::EmptyPrefix);
            }
            prefix_list.push((prefix, find(&plan)?));
        }
        prefix_list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        let mut key_map = HashMap::new();
        for (key, plan) in keys {
            key_map.insert(key, find(&plan)?);
        }
        let capacity_min = plans.iter().map(Plan::capacity).min();
        let window_seconds_max = plans.iter().map(Plan::window_seconds).max();
        let (Some(capacity_min), Some(window_seconds_max)) = (capacity_min, window_seconds_max)
        else {
            return Err(PlanError::Count);
        };
        Ok(PlanBook {
            plans,
            default_plan,
            keys: key_map,
            prefixes: prefix_list,
            unknown_keys,
            address_plan: default_plan,
            capacity_min,
            window_seconds_max,
        })
    }

    /// Callers known by their address (no key) get `plan` (an anonymous tier).
    pub fn with_address_plan(mut self, plan: &str) -> Result<Self, PlanError> {
        let index = self.plans.iter().position(|p| p.name() == plan);
        let index = index.ok_or_else(|| PlanError::Unknown(plan.to_owned()))?;
        self.address_plan = PlanId(index as u16);
        Ok(self)
    }

    /// The one rule that maps a caller to its plan: callers known by address get the address
    /// plan (the default plan unless set); API keys are looked up by [`PlanBook::plan_for_key`].
    pub fn plan_for(&self, key: &CallerKey) -> Option<PlanId> {
        match key.kind() {
            KeyKind::Address => Some(self.address_plan),
            KeyKind::ApiKey => self.plan_for_key(key.expose_secret()),
        }
    }

    /// The plan for an API key, or `None` when unknown keys are rejected and this key is unknown.
    pub fn plan_for_key(&self, key: &str) -> Option<PlanId> {
        if let Some(id) = self.keys.get(key) {
            return Some(*id);
        }
        if let Some((_, id)) = self.prefixes.iter().find(|(p, _)| key.starts_with(p)) {
            return Some(*id);
        }
        match self.unknown_keys {
            UnknownKeys::DefaultPlan => Some(self.default_plan),
            UnknownKeys::Reject => None,
        }
    }

    /// The plan for callers identified by address rather than key.
    pub fn default_plan(&self) -> PlanId {
        self.default_plan
    }

    pub fn get(&self, id: PlanId) -> Option<&Plan> {
        self.plans.get(id.index())
    }

    /// The one plan with this capacity and window, if exactly one has them.
    pub fn plan_with(&self, capacity: u64, window_seconds: u32) -> Option<&Plan> {
        let mut matching = self.plans.iter().filter(|plan| {
            plan.capacity().get() == capacity && plan.window_seconds().get() == window_seconds
        });
        let found = matching.next()?;
        matching.next().is_none().then_some(found)
    }

    /// The id of the plan at `index` in [`PlanBook::plans`].
    pub fn id_at(&self, index: usize) -> Option<PlanId> {
        (index < self.plans.len()).then(|| PlanId(u16::try_from(index).expect("few plans")))
    }

    /// The plan named `name`.
    pub fn by_name(&self, name: &str) -> Option<PlanId> {
        let index = self.plans.iter().position(|plan| plan.name() == name)?;
        self.id_at(index)
    }

    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// The smallest capacity of any plan: no route may cost more than this.
    pub fn capacity_min(&self) -> NonZeroU64 {
        self.capacity_min
    }

    /// The longest window of any plan: every request's hold is released within it (a lease
    /// may last longer: [`PlanBook::hold_seconds_max`]).
    pub fn window_seconds_max(&self) -> NonZeroU32 {
        self.window_seconds_max
    }

    /// The longest any hold of these plans lasts: a window, or a lease's window + L.
    pub fn hold_seconds_max(&self) -> NonZeroU32 {
        let seconds = (self.plans.iter())
            .map(|plan| hold_seconds(plan.window_seconds(), plan.lease()))
            .max();
        // Every plan's window is at least 1 s, and a book has a plan.
        seconds
            .and_then(NonZeroU32::new)
            .unwrap_or(self.window_seconds_max)
    }
}

/// How long a hold of a plan of `window_seconds` lasts at most: its window, and L on a lease
/// plan (a lease's timeout).
pub(crate) fn hold_seconds(window_seconds: NonZeroU32, lease: Option<LeaseTerms>) -> u32 {
    let lease_seconds = lease.map_or(0, |terms| terms.seconds.get());
    window_seconds.get().saturating_add(lease_seconds)
}

/// A plan with a 30-second window, for tests.
#[cfg(test)]
pub(crate) fn test_plan(name: &str, capacity: u64) -> Plan {
    Plan::new(
        name,
        NonZeroU64::new(capacity).unwrap(),
        NonZeroU32::new(30).unwrap(),
    )
    .unwrap()
}

#[cfg(test)]
mod tests {
    use super::test_plan as plan;
    use super::*;

    fn book(unknown: UnknownKeys) -> PlanBook {
        PlanBook::new(
            vec![plan("free", 5), plan("basic", 50), plan("pro", 500)],
            "free",
            [
                ("pro_".to_owned(), "pro".to_owned()),
                ("pro_basic_".to_owned(), "basic".to_owned()),
            ],
            [("special".to_owned(), "pro".to_owned())],
            unknown,
        )
        .unwrap()
    }

    #[test]
    fn keys_then_longest_prefix_then_default() {
        let book = book(UnknownKeys::DefaultPlan);
        let name = |k: &str| {
            let id = book.plan_for_key(k).unwrap();
            book.get(id).unwrap().name().to_owned()
        };
        assert_eq!(name("special"), "pro");
        assert_eq!(name("pro_1"), "pro");
        assert_eq!(name("pro_basic_1"), "basic");
        assert_eq!(name("anything"), "free");
    }

    #[test]
    fn a_capacity_fits_a_structured_fields_integer() {
        let plan = |capacity: u64| {
            let window = NonZeroU32::new(60).unwrap();
            Plan::new("p", NonZeroU64::new(capacity).unwrap(), window)
        };
        assert!(plan(CAPACITY_MAX).is_ok());
        assert_eq!(CAPACITY_MAX.to_string().len(), 15);
        let err = plan(CAPACITY_MAX + 1).unwrap_err();
        assert_eq!(err, PlanError::Capacity("p".to_owned()));
        assert!(err.to_string().contains("999999999999999"), "{err}");
    }

    #[test]
    fn a_lease_is_at_most_half_the_capacity_and_32_bits_of_units() {
        let plan = |capacity: u64| {
            let window = NonZeroU32::new(60).unwrap();
            Plan::new("p", NonZeroU64::new(capacity).unwrap(), window).unwrap()
        };
        let terms = |units: u64| LeaseTerms {
            units_max: NonZeroU64::new(units).unwrap(),
            seconds: NonZeroU32::new(5).unwrap(),
        };
        assert!(plan(100).with_lease(terms(50)).is_ok());
        assert_eq!(
            plan(100).with_lease(terms(51)).unwrap_err(),
            PlanError::LeaseUnits(50)
        );
        let tokens = plan(1 << 40);
        let most = u64::from(u32::MAX);
        assert!(tokens.clone().with_lease(terms(most)).is_ok());
        let err = tokens.with_lease(terms(most + 1)).unwrap_err();
        assert_eq!(err, PlanError::LeaseUnits(most));
    }

    #[test]
    fn a_lease_holds_longer_than_its_window() {
        let plan = |name: &str, window: u32| {
            let window = NonZeroU32::new(window).unwrap();
            Plan::new(name, NonZeroU64::new(100).unwrap(), window).unwrap()
        };
        let terms = LeaseTerms {
            units_max: NonZeroU64::new(10).unwrap(),
            seconds: NonZeroU32::new(30).unwrap(),
        };
        let book = |plans| PlanBook::new(plans, "a", [], [], UnknownKeys::DefaultPlan).unwrap();
        let plain = book(vec![plan("a", 10), plan("b", 60)]);
        assert_eq!(plain.hold_seconds_max().get(), 60);
        let leased = plan("a", 10).with_lease(terms).unwrap();
        let book = book(vec![leased, plan("b", 20)]);
        assert_eq!(book.window_seconds_max().get(), 20);
        assert_eq!(book.hold_seconds_max().get(), 40, "10 + 30");
        // A timeout of the window and L past `u32` is refused (it was cut short).
        let longest = plan("c", u32::MAX - 30).with_lease(terms).unwrap();
        assert_eq!(longest.lease(), Some(terms));
        let err = plan("d", u32::MAX - 29).with_lease(terms).unwrap_err();
        assert_eq!(err, PlanError::LeaseWindow("d".into()));
    }

    #[test]
    fn debug_never_shows_listed_keys() {
        let shown = format!("{:?}", book(UnknownKeys::Reject));
        assert!(!shown.contains("special"), "{shown}");
        assert!(shown.contains("listed_keys: 1"), "{shown}");
        // Under `unknown_keys = "reject"` a prefix admits whoever knows it: its plan only.
        assert!(!shown.contains("pro_"), "{shown}");
        assert!(shown.contains("prefixes: [\"basic\", \"pro\"]"), "{shown}");
    }

    #[test]
    fn unknown_keys_rejected_when_configured() {
        let book = book(UnknownKeys::Reject);
        assert!(book.plan_for_key("anything").is_none());
        assert!(book.plan_for_key("pro_1").is_some());
    }

    #[test]
    fn addresses_get_the_default_plan_and_keys_their_rule() {
        let book = book(UnknownKeys::Reject);
        let address = CallerKey::from_ip("10.1.2.3".parse().unwrap());
        assert_eq!(book.plan_for(&address), Some(book.default_plan()));
        let listed = CallerKey::from_header_value("h", b"special", 64).unwrap();
        assert_eq!(book.plan_for(&listed), book.plan_for_key("special"));
        let unknown = CallerKey::from_header_value("h", b"nobody", 64).unwrap();
        assert_eq!(book.plan_for(&unknown), None);
    }

    #[test]
    fn ids_from_a_larger_book_are_not_found() {
        let small = PlanBook::new(vec![plan("one", 1)], "one", [], [], UnknownKeys::Reject);
        let large = book(UnknownKeys::DefaultPlan);
        let pro = large.plan_for_key("pro_1").unwrap();
        assert!(small.unwrap().get(pro).is_none());
        assert_eq!(large.capacity_min().get(), 5);
        assert_eq!(large.window_seconds_max().get(), 30);
    }

    #[test]
    fn invalid_books_are_errors() {
        let err = PlanBook::new(vec![plan("free", 5)], "gold", [], [], UnknownKeys::Reject);
        assert_eq!(err.unwrap_err(), PlanError::Unknown("gold".into()));
        let err = PlanBook::new(
            vec![plan("free", 5), plan("free", 6)],
            "free",
            [],
            [],
            UnknownKeys::Reject,
        );
        assert_eq!(err.unwrap_err(), PlanError::Duplicate("free".into()));
        assert!(Plan::new("has space", NonZeroU64::MIN, NonZeroU32::MIN).is_err());
        assert!(Plan::new("", NonZeroU64::MIN, NonZeroU32::MIN).is_err());
    }
}
