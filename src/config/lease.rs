//! `[plans.NAME]` lease keys: `lease_units_max` and `lease_seconds`, both or neither.

use std::num::{NonZeroU32, NonZeroU64};

use super::{invalid, ConfigError, PlanFile};
use crate::limiter::plan::{LeaseTerms, Plan};

/// Turns lease mode on for `plan` when its file entry asks for it; an error names the setting.
pub(super) fn plan_with_lease(
    plan: Plan,
    name: &str,
    file: &PlanFile,
) -> Result<Plan, ConfigError> {
    let setting = |field: &str| format!("plans.{name}.{field}");
    let (units_max, seconds) = match (file.lease_units_max, file.lease_seconds) {
        (None, None) => return Ok(plan),
        (Some(units_max), Some(seconds)) => (units_max, seconds),
        (Some(_), None) => {
            return Err(invalid(
                setting("lease_seconds"),
                "is required with lease_units_max",
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                setting("lease_units_max"),
                "is required with lease_seconds",
            ))
        }
    };
    let units_max = NonZeroU64::new(units_max)
        .ok_or_else(|| invalid(setting("lease_units_max"), "must be at least 1"))?;
    let seconds = NonZeroU32::new(seconds)
        .ok_or_else(|| invalid(setting("lease_seconds"), "must be at least 1"))?;
    let terms = LeaseTerms { units_max, seconds };
    plan.with_lease(terms).map_err(|e| {
        let field = match e {
            crate::limiter::plan::PlanError::LeaseSeconds => "lease_seconds",
            // Window + L past what a transfer's timeout holds: the window is the larger part.
            crate::limiter::plan::PlanError::LeaseWindow(_) => "window_seconds",
            _ => "lease_units_max",
        };
        invalid(setting(field), e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::super::{FileConfig, Settings};

    fn with(text: &str) -> Result<Settings, super::ConfigError> {
        Settings::with_overrides(FileConfig::parse(text, "test").unwrap())
    }

    #[test]
    fn lease_keys_are_validated_and_name_the_setting() {
        let plan = |extra: &str| {
            format!("[plans.hot]\ncapacity = 100\nwindow_seconds = 30\n{extra}\n[plans.free]\ncapacity = 5\nwindow_seconds = 30\n[plans.basic]\ncapacity = 5\nwindow_seconds = 30\n[plans.pro]\ncapacity = 5\nwindow_seconds = 30")
        };
        let s = with(&plan("lease_units_max = 50\nlease_seconds = 1")).unwrap();
        let hot = s.plans.plans().iter().find(|p| p.name() == "hot").unwrap();
        assert_eq!(hot.lease().unwrap().units_max.get(), 50);
        let free = s.plans.plans().iter().find(|p| p.name() == "free").unwrap();
        assert!(
            free.lease().is_none(),
            "default plans keep one transfer per request"
        );
        let cases = [
            (
                "lease_units_max = 51\nlease_seconds = 1",
                "plans.hot.lease_units_max",
            ),
            (
                "lease_units_max = 0\nlease_seconds = 1",
                "plans.hot.lease_units_max",
            ),
            (
                "lease_units_max = 10\nlease_seconds = 0",
                "plans.hot.lease_seconds",
            ),
            (
                "lease_units_max = 10\nlease_seconds = 61",
                "plans.hot.lease_seconds",
            ),
            ("lease_units_max = 10", "plans.hot.lease_seconds"),
            ("lease_seconds = 1", "plans.hot.lease_units_max"),
        ];
        for (extra, setting) in cases {
            let error = with(&plan(extra)).unwrap_err();
            assert_eq!(error.setting, setting, "{extra}: {error}");
        }
        // Window + L past a transfer's timeout: the window is named (it was `lease_units_max`).
        let longest = plan("lease_units_max = 10\nlease_seconds = 1").replacen(
            "window_seconds = 30",
            "window_seconds = 4294967295",
            1,
        );
        let error = with(&longest).unwrap_err();
        assert_eq!(error.setting, "plans.hot.window_seconds", "{error}");
    }

    /// A reported cost replaces a request's hold, and a lease admission has none: such a
    /// request was charged its estimate, whatever its handler reported.
    #[test]
    fn a_cost_header_is_refused_beside_a_lease_plan() {
        let plans = "default_plan = \"hot\"\n[plans.hot]\ncapacity = 100\nwindow_seconds = 30\nlease_units_max = 50\nlease_seconds = 1\n";
        let costs = "[routes]\ncost_header = \"X-Cost\"\n";
        let error = with(&format!("{plans}{costs}")).unwrap_err();
        assert_eq!(error.setting, "routes.cost_header", "{error}");
        assert!(error.message.contains("\"hot\""), "{error}");
        assert!(with(plans).is_ok());
        assert!(with(costs).is_ok());
    }
}
