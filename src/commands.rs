//! The binary's subcommands that work on a running ledger: `audit` one caller, and the operator's
//! `admin` actions (the admin API's, for whoever can reach the ledger).

use std::time::{Duration, Instant};

use anyhow::Context;
use ledger_limiter::config::{resolve_addresses, LedgerLocation, Settings};
use ledger_limiter::http::admin::MOVED;
use ledger_limiter::ledger::model::{self, Actor, IdempotencyKey};
use ledger_limiter::ledger::{Adjusted, Blocking, Ledger, LedgerError, Unblocking};
use ledger_limiter::limiter::caller::{CallerKey, KEY_LENGTH_MAX_LIMIT};
use ledger_limiter::limiter::Limiter;

/// Operators' command-line actions are recorded as admin secret number 0.
const COMMAND_LINE: u64 = 0;
const DEADLINE: Duration = Duration::from_secs(30);

/// Which caller: by account id, or by key read from standard input.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Caller {
    /// The account id (hex, as `user.id` in traces).
    #[arg(long)]
    account_id: Option<String>,
    /// Read the caller's API key from standard input (one line): never from the command line,
    /// where other users of the machine could see it.
    #[arg(long)]
    key_stdin: bool,
}

#[derive(Debug, clap::Subcommand)]
pub enum AdminCommand {
    /// Give the caller more credit for good (a higher limit per window).
    Credit(Change),
    /// Take credit from the caller for good (only credit not held).
    Debit(Change),
    /// Refuse every request of the caller, on every instance, for a while.
    Block {
        #[command(flatten)]
        caller: Caller,
        /// How long, in seconds (at most a week).
        #[arg(long)]
        seconds: u32,
        /// Why (its hash goes to the ledger, the text nowhere).
        #[arg(long)]
        reason: String,
    },
    /// End the caller's block now.
    Unblock {
        #[command(flatten)]
        caller: Caller,
        /// Why (its hash goes to the ledger, the text nowhere).
        #[arg(long, default_value = model::UNBLOCK_REASON_DEFAULT)]
        reason: String,
    },
    /// Move the caller whose key is read from standard input to another plan, carrying what it
    /// holds (every instance follows the move).
    Move {
        /// The plan to move to.
        #[arg(long)]
        plan: String,
        /// Why (its hash goes to the ledger, the text nowhere).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct Change {
    #[command(flatten)]
    caller: Caller,
    /// Units of credit (1 to 2^40).
    #[arg(long)]
    amount: u64,
    /// Why (its hash goes to the ledger, the text nowhere).
    #[arg(long)]
    reason: String,
    /// Your name for this adjustment (1-255 visible ASCII characters): run again with the same
    /// one after an error or a timeout, and it is applied once.
    #[arg(long)]
    idempotency_key: Option<String>,
}

/// `ledger-limiter audit`: one account, as the ledger records it.
pub async fn audit(settings: &Settings, caller: &Caller) -> anyhow::Result<()> {
    let ledger = connect(settings).await?;
    let account_id = account_id(settings, &ledger, caller).await?;
    print_audit(settings, &ledger, account_id).await
}

/// How long a move waits for its second pass still running in the background before the
/// command ends (and the pass with it).
const SECOND_PASS_WAIT: Duration = Duration::from_secs(15);

const SECOND_PASS_PENDING: &str = "warning: the move's second pass (carrying the holds of \
requests in flight at the move) had not finished when this command ended: those requests count \
on no plan until their holds expire";

/// `ledger-limiter admin ...`: one operator action, then the account's audit.
pub async fn admin(settings: &Settings, command: &AdminCommand) -> anyhow::Result<()> {
    let ledger = connect(settings).await?;
    // Each action's deadline starts once its input is read: a key typed on standard input may
    // take longer than the deadline.
    let deadline = || Instant::now() + DEADLINE;
    let id = match command {
        AdminCommand::Credit(change) => adjust(settings, &ledger, change, false).await?,
        AdminCommand::Debit(change) => adjust(settings, &ledger, change, true).await?,
        AdminCommand::Block {
            caller,
            seconds,
            reason,
        } => {
            use ledger_limiter::http::admin::BLOCK_SECONDS_MAX;
            anyhow::ensure!(
                (1..=BLOCK_SECONDS_MAX).contains(seconds),
                "--seconds must be between 1 and {BLOCK_SECONDS_MAX}"
            );
            let id = account_id(settings, &ledger, caller).await?;
            match ledger
                .block(id, *seconds, actor(reason)?, deadline())
                .await?
            {
                Blocking::Done { .. } => id,
                Blocking::AlreadyBlocked => anyhow::bail!("the caller is blocked already"),
                Blocking::Moved => anyhow::bail!("{MOVED}"),
                Blocking::NoSuchAccount => anyhow::bail!("no account {id:032x}"),
            }
        }
        AdminCommand::Move { plan, reason } => {
            let key = read_key(settings)?;
            let limiter = Limiter::new(
                ledger.clone(),
                settings.plans.clone(),
                settings.limiter.clone(),
            );
            let moved = limiter.move_caller(&key, plan, actor(reason)?, deadline());
            let moved = moved.await;
            // A second pass sent again, or a lost move's waiting for its late answer, ends with
            // this process: waited for, a while.
            if !ledger
                .second_passes_done(Instant::now() + SECOND_PASS_WAIT)
                .await
            {
                eprintln!("{SECOND_PASS_PENDING}");
            }
            let report = moved?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            u128::from_str_radix(&report.to_account_id, 16)?
        }
        AdminCommand::Unblock { caller, reason } => {
            let actor = actor(reason)?;
            let id = account_id(settings, &ledger, caller).await?;
            match ledger.unblock(id, actor, deadline()).await? {
                Unblocking::Done => id,
                Unblocking::NotBlocked => anyhow::bail!("the caller is not blocked"),
                Unblocking::Moved => anyhow::bail!("{MOVED}"),
                Unblocking::NoSuchAccount => anyhow::bail!("no account {id:032x}"),
            }
        }
    };
    // Done in the ledger by now: an audit that cannot be read is no failure of the action (a
    // non-zero exit would invite a retry that repeats it).
    if let Err(error) = print_audit(settings, &ledger, id).await {
        eprintln!("done; the account's audit could not be read: {error:#}");
    }
    Ok(())
}

async fn adjust(
    settings: &Settings,
    ledger: &Ledger,
    change: &Change,
    reduce: bool,
) -> anyhow::Result<u128> {
    use ledger_limiter::http::admin::AMOUNT_MAX;
    anyhow::ensure!(
        (1..=AMOUNT_MAX).contains(&change.amount),
        "--amount must be between 1 and 2^40"
    );
    let id = account_id(settings, ledger, &change.caller).await?;
    let actor = actor(&change.reason)?;
    // Always a key: without one given, a fresh one, named on an error whose outcome is unknown,
    // so that running the command again with it applies the adjustment once.
    let given = change.idempotency_key.clone();
    let key = given.unwrap_or_else(|| {
        let key = format!("cli-{:032x}", rand::random::<u128>());
        // Before it is sent: a run cut short (Ctrl-C, a lost session) said nothing, and the
        // same command run again, under a key of its own, could apply it twice.
        eprintln!("idempotency key: {key} (if this run is cut short, run it again with --idempotency-key {key}: it is applied once)");
        key
    });
    let once = IdempotencyKey::new(key.as_bytes()).with_context(|| {
        let max = model::IDEMPOTENCY_KEY_LENGTH_MAX;
        format!("--idempotency-key must be 1-{max} visible ASCII characters")
    })?;
    let who = (actor, Some(&once));
    let deadline = Instant::now() + DEADLINE;
    let adjusted = if reduce {
        ledger.reduce_credit(id, change.amount, who, deadline).await
    } else {
        ledger.top_up(id, change.amount, who, deadline).await
    };
    // Only where the outcome is unknown: an answer the ledger should never give would be met
    // again, and a failed read after a known refusal would answer "refused before".
    let unknown = matches!(
        &adjusted,
        Err(LedgerError::Timeout { .. } | LedgerError::Client { .. })
    );
    let adjusted = adjusted.map_err(anyhow::Error::from);
    let adjusted = match unknown {
        true => adjusted.with_context(|| {
            format!("it may have been applied: run the command again with --idempotency-key {key}, and it is applied once")
        })?,
        false => adjusted?,
    };
    match adjusted {
        Adjusted::Done | Adjusted::AlreadyDone => Ok(id),
        Adjusted::NotEnoughCredit => anyhow::bail!("the caller has less credit not held"),
        Adjusted::NoSuchAccount => anyhow::bail!("no account {id:032x}"),
        Adjusted::Blocked => anyhow::bail!("the caller is blocked; unblock it first"),
        Adjusted::Moved => anyhow::bail!("{MOVED}"),
        Adjusted::KeyReused => {
            anyhow::bail!("--idempotency-key names a different adjustment of this caller")
        }
        Adjusted::KeyFailed => anyhow::bail!(
            "--idempotency-key's adjustment was refused before; run it with a new key"
        ),
    }
}

fn actor(reason: &str) -> anyhow::Result<Actor> {
    Actor::from_reason(COMMAND_LINE, reason).with_context(|| {
        let max = model::REASON_LENGTH_MAX;
        format!("--reason must be 1-{max} bytes, no control characters")
    })
}

async fn connect(settings: &Settings) -> anyhow::Result<Ledger> {
    let LedgerLocation::Cluster { addresses } = &settings.ledger else {
        anyhow::bail!("this command works on a running ledger: give --ledger-addresses");
    };
    let addresses = resolve_addresses(addresses).await?;
    Ok(Ledger::connect(&settings.ledger_settings(addresses))?)
}

async fn print_audit(settings: &Settings, ledger: &Ledger, account_id: u128) -> anyhow::Result<()> {
    // A caller's account only, as the admin API's audit: a concurrency limit's slots (another
    // ledger, an id of a caller's kind) were printed as a caller's.
    match ledger
        .audit_caller(account_id, Instant::now() + DEADLINE)
        .await?
    {
        Some(mut audit) => {
            let plan = settings
                .plans
                .plan_with(audit.capacity, audit.window_seconds);
            audit.plan = plan.map(|plan| plan.name().to_owned());
            println!("{}", serde_json::to_string_pretty(&audit)?)
        }
        None => anyhow::bail!("no caller's account {account_id:032x} in the ledger"),
    }
    Ok(())
}

/// A caller's key, from one line of standard input (never an argument), held to what the
/// service holds a request's key to (`caller.key_length_max`, the key source).
fn read_key(settings: &Settings) -> anyhow::Result<CallerKey> {
    use std::io::{BufRead, Read};
    let mut key = String::new();
    // Bounded: a longer line is refused below all the same, and need not be read whole.
    let bytes_max = KEY_LENGTH_MAX_LIMIT as u64 + 1;
    std::io::stdin()
        .lock()
        .take(bytes_max)
        .read_line(&mut key)?;
    Ok(settings.rules.operator_key(key.trim_end().as_bytes())?)
}

/// The caller's account: the one given, or the one its key is charged to now (every move
/// followed in the ledger: the account its plan derives is closed once it moved).
async fn account_id(settings: &Settings, ledger: &Ledger, caller: &Caller) -> anyhow::Result<u128> {
    if let Some(hex) = &caller.account_id {
        let id = model::parse_account_id(hex).context("--account-id is 32 hex digits")?;
        anyhow::ensure!(
            model::is_caller_account_id(id),
            "--account-id is the operator's own account, not a caller's"
        );
        return Ok(id);
    }
    let key = read_key(settings)?;
    let limiter = Limiter::new(
        ledger.clone(),
        settings.plans.clone(),
        settings.limiter.clone(),
    );
    let deadline = Instant::now() + DEADLINE;
    let found = limiter.current_account(&key, deadline).await?;
    let (id, _) = found.context("the key has no plan")?;
    Ok(id)
}
