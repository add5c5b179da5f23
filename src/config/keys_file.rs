//! The keys file: one `<key> <plan>` pair per line; blank lines and `#` comments are skipped.
//! Errors name the file and line, never the key (it is a secret).

use std::collections::HashMap;
use std::path::Path;

use super::{invalid, ConfigError};
use crate::limiter::caller::is_valid_key;

/// A larger keys file is refused: it is read whole at start.
pub const KEYS_FILE_BYTES_MAX: u64 = 64 * 1024 * 1024;

const SETTING: &str = "caller.keys_file";

/// The keys of the file at `path`, each with a plan `is_plan` knows; a key listed twice, or a
/// plan not configured, is an error naming the line.
pub(super) fn load(
    path: &Path,
    key_length_max: usize,
    is_plan: &dyn Fn(&str) -> bool,
) -> Result<Vec<(String, String)>, ConfigError> {
    let text = super::read_bounded(path, KEYS_FILE_BYTES_MAX)
        .map_err(|message| invalid(SETTING, message))?;
    parse(&text, path, key_length_max, is_plan)
}

fn parse(
    text: &str,
    path: &Path,
    key_length_max: usize,
    is_plan: &dyn Fn(&str) -> bool,
) -> Result<Vec<(String, String)>, ConfigError> {
    let mut keys = Vec::new();
    // Where each key was first listed: a second line for it gave it that line's plan, silently.
    let mut lines: HashMap<&str, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("{}:{}", path.display(), index + 1);
        let mut fields = line.split_whitespace();
        let (Some(key), Some(plan), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(invalid(SETTING, format!("{at}: expected `<key> <plan>`")));
        };
        if !is_valid_key(key.as_bytes(), key_length_max) {
            return Err(invalid(
                SETTING,
                format!("{at}: the key is not 1-{key_length_max} printable ASCII characters"),
            ));
        }
        if !is_plan(plan) {
            // Not quoted: in a line written `<plan> <key>`, the second field is the key.
            return Err(invalid(
                SETTING,
                format!("{at}: the line's second field names no configured plan (`<key> <plan>`)"),
            ));
        }
        if let Some(first) = lines.insert(key, index + 1) {
            let message = format!("{at}: the key is listed already, on line {first}");
            return Err(invalid(SETTING, message));
        }
        keys.push((key.to_owned(), plan.to_owned()));
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Any bytes as a keys file: keys that pass are exactly the visible-ASCII ones within the
        /// bound, an error never echoes the line, and nothing panics.
        #[test]
        fn any_keys_file_is_parsed_or_refused_without_echo(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            length_max in 1usize..16,
        ) {
            let text = String::from_utf8_lossy(&bytes);
            // Plans of even length: a refused plan's branch is reached too.
            match parse(&text, Path::new("k"), length_max, &|plan| plan.len() % 2 == 0) {
                Ok(keys) => {
                    for (key, _) in keys {
                        prop_assert!(is_valid_key(key.as_bytes(), length_max));
                    }
                }
                Err(err) => {
                    let after = err.message.split_once(": ").map_or("", |(_, m)| m);
                    prop_assert!(
                        after == "expected `<key> <plan>`"
                            || after.starts_with("the key is not")
                            || after.starts_with("the key is listed already")
                            || after.starts_with("the line's second field names no"),
                        "{}", err.message
                    );
                }
            }
        }
    }

    /// One line of a structured keys file: a pair (its key visible ASCII or not, of a length
    /// around the bound), a comment, a blank, or a line of one or three fields.
    fn line() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            "[!-~&&[^#]]{1,18}",
            "[!-~&&[^#]]{0,6}[\u{80}-\u{ff}\u{7f}][!-~]{0,4}",
        ];
        let plan = prop_oneof![Just("aa"), Just("bb"), Just("c")];
        let separator = prop_oneof![Just(" "), Just("\t"), Just("   ")];
        prop_oneof![
            6 => (key.clone(), separator, plan.clone()).prop_map(|(k, s, p)| format!("{k}{s}{p}")),
            1 => "# [ -~]{0,10}",
            1 => Just(String::new()),
            1 => key.clone(),
            1 => (key, plan).prop_map(|(k, p)| format!("{k} {p} extra")),
        ]
    }

    /// The parser's rules written out again, apart from it: the keys it keeps, or the line
    /// (1-based) and kind of its first error.
    fn expected(
        lines: &[String],
        length_max: usize,
    ) -> Result<Vec<(String, String)>, (usize, &'static str)> {
        let mut keys: Vec<(String, String)> = Vec::new();
        for (index, line) in lines.iter().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [key, plan] = fields[..] else {
                return Err((index + 1, "expected"));
            };
            let visible = key.bytes().all(|b| (0x21..=0x7e).contains(&b));
            if !visible || key.len() > length_max {
                return Err((index + 1, "the key is not"));
            }
            if plan.len() % 2 != 0 {
                return Err((index + 1, "the line's second field"));
            }
            if keys.iter().any(|(listed, _)| listed == key) {
                return Err((index + 1, "the key is listed already"));
            }
            keys.push((key.to_owned(), plan.to_owned()));
        }
        Ok(keys)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Files of pairs, comments and mistakes (keys around the bound, listed twice, of bytes
        /// that are not visible ASCII): the parser keeps exactly the keys a model of its rules
        /// keeps, or fails on the model's first bad line, never echoing it.
        #[test]
        fn a_keys_file_is_parsed_as_its_rules_say(
            lines in proptest::collection::vec(line(), 0..12),
            repeat in proptest::option::of(0usize..12),
            length_max in 4usize..12,
        ) {
            let mut lines = lines;
            // A key listed twice, on purpose, now and then.
            if let Some(at) = repeat.filter(|at| *at < lines.len()) {
                let again = lines[at].clone();
                lines.push(again);
            }
            let text = lines.join("\n");
            let parsed = parse(&text, Path::new("k"), length_max, &|plan| plan.len() % 2 == 0);
            match (parsed, expected(&lines, length_max)) {
                (Ok(keys), Ok(model)) => prop_assert_eq!(keys, model),
                (Err(err), Err((line, kind))) => {
                    let (at, message) = err.message.split_once(": ").expect("k:N: why");
                    prop_assert_eq!(at, format!("k:{line}"));
                    prop_assert!(message.starts_with(kind), "{} against {}", message, kind);
                    // Nothing of the line: each message is fixed text, a bound and line numbers.
                    let listed = message
                        .strip_prefix("the key is listed already, on line ")
                        .is_some_and(|line| line.bytes().all(|b| b.is_ascii_digit()));
                    let fixed = [
                        "expected `<key> <plan>`".to_owned(),
                        format!("the key is not 1-{length_max} printable ASCII characters"),
                        "the line's second field names no configured plan (`<key> <plan>`)".to_owned(),
                    ];
                    prop_assert!(listed || fixed.iter().any(|f| f == message), "{}", message);
                }
                (parsed, model) => prop_assert!(false, "{:?} against {:?}", parsed, model),
            }
        }
    }

    fn plans(name: &str) -> bool {
        ["free", "basic", "pro"].contains(&name)
    }

    /// A file whose size says nothing (a device, a pipe) is read through the bound, not whole.
    #[test]
    fn a_keys_file_without_a_size_is_read_only_up_to_the_bound() {
        let err = load(Path::new("/dev/zero"), 64, &|_| true).unwrap_err();
        assert!(err.message.contains("larger than"), "{err}");
    }

    #[test]
    fn errors_name_file_and_line_and_never_the_key() {
        let path = Path::new("keys.txt");
        let parse = |text: &str, path: &Path, length_max| parse(text, path, length_max, &plans);
        let keys = parse("# c\n\nk1 pro\n  k2   basic  \n", path, 8).unwrap();
        assert_eq!(
            keys,
            [("k1".into(), "pro".into()), ("k2".into(), "basic".into())]
        );
        let err = parse("ok free\nsecret-key-123 pro extra\n", path, 64).unwrap_err();
        assert!(err.message.starts_with("keys.txt:2:"), "{}", err.message);
        assert!(!err.message.contains("secret-key-123"), "{}", err.message);
        let err = parse("secret-key-123 pro\n", path, 4).unwrap_err();
        assert!(err.message.starts_with("keys.txt:1:"), "{}", err.message);
        assert!(!err.message.contains("secret-key-123"), "{}", err.message);
        // A plan nobody configured, on its line; a key listed twice, both lines.
        let err = parse("ok free\nsecret-key-123 gold\n", path, 64).unwrap_err();
        assert_eq!(
            err.message,
            "keys.txt:2: the line's second field names no configured plan (`<key> <plan>`)"
        );
        // Its fields the wrong way round: the key is the second field, and is not quoted.
        let err = parse("pro secret-key-123\n", path, 64).unwrap_err();
        assert!(err.message.starts_with("keys.txt:1:"), "{}", err.message);
        assert!(!err.message.contains("secret-key-123"), "{}", err.message);
        let err = parse("secret-key-123 free\n\nsecret-key-123 pro\n", path, 64).unwrap_err();
        assert_eq!(
            err.message,
            "keys.txt:3: the key is listed already, on line 1"
        );
    }
}
