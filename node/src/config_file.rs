//! The mill's config file (`millrace mill --config FILE`, issue 13 item 5): TOML, for what
//! does not fit in a flag. Today that is the quota limits (DESIGN §6, Q1–Q3, M15):
//!
//! ```toml
//! [quota.defaults.owner]   # limits for every owner
//! jobs = 10
//! cpu_millis = 8000
//! [quota.defaults.repo]    # limits for every repo
//! jobs = 50
//! [quota.owner."alice"]    # one owner: a resource named here replaces its default
//! jobs = 100
//! [quota.repo."org/big"]
//! jobs = 200
//! ```
//!
//! Resource names are any the executors charge (`jobs` is charged once per job, the rest are
//! what the job asks for); a resource limited nowhere is unlimited. Unknown keys are errors,
//! and every error names the file, the line, the key path and the value, so a bad file stops
//! the mill before it listens:
//! `--config /etc/millrace.toml:7: quota.owner."alice".jobs: must be a positive integer (at
//! most 2^53), got -3`.
//!
//! *Decided:* a limit of 0 is refused. The ledger would deny every job that charges the
//! resource at once (Q1: a charge above the limit can never fit), never make it wait, which
//! a typo should not do to a whole owner; there is no "unlimited" value either — leave the
//! resource out. Amounts are checked by the core's own `validate_resources` (M14), so a limit
//! is exactly what a charge may be: 1 to 2^53.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use millrace_core::job::MAX_SCOPE_NAME;
use millrace_core::quota::QuotaConfig;
use millrace_core::types::{valid_name, validate_resources, ResourceError, MAX_RESOURCE_AMOUNT};
use millrace_core::Resources;
use serde::Deserialize;
use toml::Spanned;

/// Largest config file read: far above any real quota table, small enough to read at once.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
/// Most per-owner (and, apart, per-repo) overrides.
pub const MAX_OVERRIDES: usize = 100_000;

/// A config file that cannot be used: where, which key, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigFileError {
    /// The file, as given.
    pub file: PathBuf,
    /// The 1-based line of the offending value (0: not known).
    pub line: usize,
    /// The key path, TOML-quoted where needed: `quota.owner."alice".jobs` (empty: the file).
    pub key: String,
    /// What is wrong, with the value.
    pub message: String,
}

impl fmt::Display for ConfigFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--config {}", self.file.display())?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// What the file holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MillFile {
    /// The quota limits (no `[quota]`: no limits).
    pub quota: QuotaConfig,
}

/// A resource table as written: names to values of any type, checked after parsing so that
/// an error can name the value (`got -3`, `got "ten"`).
type RawResources = BTreeMap<String, Spanned<toml::Value>>;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Doc {
    #[serde(default)]
    quota: Option<QuotaDoc>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaDoc {
    #[serde(default)]
    defaults: DefaultsDoc,
    #[serde(default)]
    owner: BTreeMap<String, Spanned<RawResources>>,
    #[serde(default)]
    repo: BTreeMap<String, Spanned<RawResources>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultsDoc {
    #[serde(default)]
    owner: RawResources,
    #[serde(default)]
    repo: RawResources,
}

/// Reads and checks the file at `path`.
pub fn load(path: &Path) -> Result<MillFile, ConfigFileError> {
    let fail = |message: String| ConfigFileError {
        file: path.to_path_buf(),
        line: 0,
        key: String::new(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read: {e}")))?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_CONFIG_BYTES {
        return Err(fail(format!(
            "larger than {} MiB; is this the config file?",
            MAX_CONFIG_BYTES >> 20
        )));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        fail(format!(
            "not UTF-8 (at byte {}); TOML files are UTF-8",
            e.utf8_error().valid_up_to()
        ))
    })?;
    parse(path, &text)
}

/// Parses and checks `text`; `path` names it in errors.
pub fn parse(path: &Path, text: &str) -> Result<MillFile, ConfigFileError> {
    let cx = Ctx { path, text };
    let doc = cx.deserialize()?;
    let Some(q) = doc.quota else {
        return Ok(MillFile::default());
    };
    let quota = QuotaConfig {
        owner_defaults: cx.resources(&["quota", "defaults", "owner"], &q.defaults.owner)?,
        repo_defaults: cx.resources(&["quota", "defaults", "repo"], &q.defaults.repo)?,
        owner_overrides: cx.overrides("owner", &q.owner)?,
        repo_overrides: cx.overrides("repo", &q.repo)?,
    };
    Ok(MillFile { quota })
}

struct Ctx<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Ctx<'_> {
    fn err(&self, span: Option<Range<usize>>, key: String, message: String) -> ConfigFileError {
        ConfigFileError {
            file: self.path.to_path_buf(),
            line: span.map_or(0, |s| line_of(self.text, s.start)),
            key,
            message,
        }
    }

    fn deserialize(&self) -> Result<Doc, ConfigFileError> {
        let de = toml::Deserializer::parse(self.text)
            .map_err(|e| self.err(e.span(), String::new(), e.message().to_string()))?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let segments: Vec<String> = e
                .path()
                .iter()
                .filter_map(|s| match s {
                    serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                    serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                    serde_path_to_error::Segment::Enum { variant } => Some(variant.clone()),
                    serde_path_to_error::Segment::Unknown => None,
                })
                // `Spanned` wraps values in a private struct; its field is no part of the
                // schema.
                .filter(|s| !s.starts_with("$__serde_spanned_private"))
                .collect();
            let refs: Vec<&str> = segments.iter().map(String::as_str).collect();
            let inner = e.into_inner();
            self.err(inner.span(), key_path(&refs), inner.message().to_string())
        })
    }

    /// The `[quota.owner."…"]` or `[quota.repo."…"]` tables.
    fn overrides(
        &self,
        kind: &str,
        tables: &BTreeMap<String, Spanned<RawResources>>,
    ) -> Result<BTreeMap<String, Resources>, ConfigFileError> {
        if tables.len() > MAX_OVERRIDES {
            return Err(self.err(
                None,
                key_path(&["quota", kind]),
                format!("{} {kind} overrides; at most {MAX_OVERRIDES}", tables.len()),
            ));
        }
        let mut out = BTreeMap::new();
        for (scope, table) in tables {
            let bad = scope.is_empty()
                || scope.len() > MAX_SCOPE_NAME
                || scope.chars().any(char::is_control);
            if bad {
                return Err(self.err(
                    Some(table.span()),
                    key_path(&["quota", kind, scope]),
                    format!(
                        "{kind} name must be 1-{MAX_SCOPE_NAME} bytes without control characters \
                         (as jobs give it), got {} bytes",
                        scope.len()
                    ),
                ));
            }
            let limits = self.resources(&["quota", kind, scope], table.get_ref())?;
            out.insert(scope.clone(), limits);
        }
        Ok(out)
    }

    /// One resource table, each amount checked as the core checks charges (M14).
    fn resources(&self, at: &[&str], raw: &RawResources) -> Result<Resources, ConfigFileError> {
        let mut limits = Resources::new();
        let mut spans = BTreeMap::new();
        for (name, value) in raw {
            let key = || {
                let mut path = at.to_vec();
                path.push(name);
                key_path(&path)
            };
            let amount = match value.get_ref() {
                toml::Value::Integer(i) => u64::try_from(*i).ok(),
                _ => None,
            };
            let Some(amount) = amount.filter(|a| *a > 0) else {
                return Err(self.err(
                    Some(value.span()),
                    key(),
                    amount_message(&shown(value.get_ref())),
                ));
            };
            limits.insert(name.clone(), amount);
            spans.insert(name.clone(), value.span());
        }
        validate_resources(&limits).map_err(|e| match &e {
            ResourceError::TooMany { count, max } => self.err(
                None,
                key_path(at),
                format!("{count} resources; at most {max}"),
            ),
            ResourceError::BadName { .. } => {
                // The error cuts the name: name the entry by the same check instead.
                let full = limits
                    .keys()
                    .find(|k| !valid_name(k))
                    .map_or_else(String::new, Clone::clone);
                let span = spans.get(&full).cloned();
                let mut path = at.to_vec();
                path.push(&full);
                self.err(
                    span,
                    key_path(&path),
                    "resource name must be 1-64 printable ASCII characters without spaces"
                        .to_string(),
                )
            }
            ResourceError::BadAmount { name, amount } => {
                let span = spans.get(name).cloned();
                let mut path = at.to_vec();
                path.push(name);
                self.err(span, key_path(&path), amount_message(&amount.to_string()))
            }
        })?;
        Ok(limits)
    }
}

/// The message for an amount that is not a limit, naming what was given.
fn amount_message(got: &str) -> String {
    let hint = if got == "0" {
        "; 0 would deny every job that charges it — leave the resource out for no limit"
    } else {
        ""
    };
    format!("must be a positive integer (at most 2^53 = {MAX_RESOURCE_AMOUNT}), got {got}{hint}")
}

/// A value as the error shows it: numbers and short strings as written, tables and arrays
/// by kind (they may be long).
fn shown(v: &toml::Value) -> String {
    const MAX: usize = 64;
    match v {
        toml::Value::String(s) => {
            let cut: String = s.chars().take(MAX).collect();
            format!("{cut:?}{}", if cut.len() < s.len() { "…" } else { "" })
        }
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Datetime(d) => d.to_string(),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

/// A key path as TOML writes it: segments joined by `.`, each quoted unless it is a bare
/// key; the scope name under `quota.owner` / `quota.repo` is always quoted, since it is a
/// name from outside (`quota.owner."alice".jobs`).
pub fn key_path(segments: &[&str]) -> String {
    segments
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let scope_name = i == 2
                && segments.first() == Some(&"quota")
                && matches!(segments.get(1), Some(&"owner" | &"repo"));
            let bare = !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if bare && !scope_name {
                (*s).to_string()
            } else {
                quoted(s)
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// `s` as a TOML basic string.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The 1-based line of byte `at` of `text`.
fn line_of(text: &str, at: usize) -> usize {
    let at = at.min(text.len());
    text.as_bytes()[..at]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn parse_str(text: &str) -> Result<MillFile, ConfigFileError> {
        parse(Path::new("/x.toml"), text)
    }

    fn res(pairs: &[(&str, u64)]) -> Resources {
        pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
    }

    fn error(text: &str) -> ConfigFileError {
        match parse_str(text) {
            Ok(f) => panic!("expected an error, parsed {f:?}"),
            Err(e) => e,
        }
    }

    const EXAMPLE: &str = r#"
[quota.defaults.owner]   # limits for every owner
jobs = 10
cpu_millis = 8000
[quota.defaults.repo]
jobs = 50
[quota.owner."alice"]    # overrides for one owner
jobs = 100
[quota.repo."org/big"]
jobs = 200
"#;

    #[test]
    fn the_readme_example_parses_into_defaults_and_overrides() {
        let f = parse_str(EXAMPLE).unwrap();
        assert_eq!(
            f.quota,
            QuotaConfig {
                owner_defaults: res(&[("cpu_millis", 8000), ("jobs", 10)]),
                repo_defaults: res(&[("jobs", 50)]),
                owner_overrides: [("alice".to_string(), res(&[("jobs", 100)]))].into(),
                repo_overrides: [("org/big".to_string(), res(&[("jobs", 200)]))].into(),
            }
        );
        // An override replaces the default only for the resources it names.
        let alice = millrace_core::quota::Scope::Owner("alice".into());
        assert_eq!(f.quota.limit(&alice, "jobs"), Some(100));
        assert_eq!(f.quota.limit(&alice, "cpu_millis"), Some(8000));
    }

    #[test]
    fn an_empty_file_or_no_quota_table_means_no_limits() {
        assert_eq!(parse_str("").unwrap(), MillFile::default());
        assert_eq!(parse_str("# nothing\n").unwrap(), MillFile::default());
        assert_eq!(parse_str("[quota]\n").unwrap(), MillFile::default());
    }

    #[test]
    fn a_negative_amount_names_the_key_path_the_line_and_the_value() {
        let e = error("[quota.owner.\"alice\"]\njobs = -3\n");
        assert_eq!(e.key, "quota.owner.\"alice\".jobs");
        assert_eq!(e.line, 2);
        assert_eq!(
            e.to_string(),
            "--config /x.toml:2: quota.owner.\"alice\".jobs: must be a positive integer \
             (at most 2^53 = 9007199254740992), got -3"
        );
    }

    #[test]
    fn zero_too_large_and_non_integer_amounts_are_refused_with_the_value() {
        let e = error("[quota.defaults.owner]\njobs = 0\n");
        assert_eq!(e.key, "quota.defaults.owner.jobs");
        assert!(e.message.contains("got 0;"), "{e}");
        assert!(e.message.contains("leave the resource out"), "{e}");
        let e = error("[quota.defaults.repo]\ncpu = 9007199254740993\n");
        assert_eq!(e.key, "quota.defaults.repo.cpu");
        assert!(e.message.ends_with("got 9007199254740993"), "{e}");
        let e = error("[quota.repo.\"org/big\"]\njobs = \"ten\"\n");
        assert_eq!(e.key, "quota.repo.\"org/big\".jobs");
        assert!(e.message.ends_with("got \"ten\""), "{e}");
        let e = error("[quota.defaults.owner]\njobs = 1.5\n");
        assert!(e.message.ends_with("got 1.5"), "{e}");
        let e = error("[quota.defaults.owner.jobs]\nx = 1\n");
        assert_eq!(e.key, "quota.defaults.owner.jobs");
        assert!(e.message.ends_with("got a table"), "{e}");
    }

    #[test]
    fn a_bad_resource_name_is_refused_naming_it() {
        let e = error("[quota.defaults.owner]\n\"cpu millis\" = 4\n");
        assert_eq!(e.key, "quota.defaults.owner.\"cpu millis\"");
        assert_eq!(e.line, 2);
        assert!(e.message.contains("resource name"), "{e}");
        let long = "r".repeat(65);
        let e = error(&format!("[quota.owner.\"a\"]\n{long} = 4\n"));
        assert_eq!(e.key, format!("quota.owner.\"a\".{long}"));
        let e = error("[quota.owner.\"a\"]\n\"\" = 4\n");
        assert_eq!(e.key, "quota.owner.\"a\".\"\"");
    }

    #[test]
    fn a_bad_scope_name_is_refused_naming_it() {
        let e = error("# limits\n[quota.owner.\"\"]\njobs = 1\n");
        assert_eq!(e.key, "quota.owner.\"\"");
        assert!(e.message.contains("owner name"), "{e}");
        assert_eq!(e.line, 2, "the table's header");
        let e = error(&format!("[quota.repo.\"{}\"]\njobs = 1\n", "r".repeat(257)));
        assert!(e.message.contains("got 257 bytes"), "{e}");
        let e = error("[quota.repo.\"a\\tb\"]\njobs = 1\n");
        assert_eq!(e.key, "quota.repo.\"a\\tb\"");
    }

    #[test]
    fn unknown_keys_are_refused_naming_them() {
        let e = error("[quota.owners.\"alice\"]\njobs = 1\n");
        assert_eq!(e.key, "quota.owners");
        assert!(e.message.contains("unknown field `owners`"), "{e}");
        let e = error("[quota.defaults.team]\njobs = 1\n");
        assert_eq!(e.key, "quota.defaults.team");
        let e = error("bid_timeout = \"5s\"\n");
        assert_eq!(e.key, "bid_timeout");
        assert_eq!(e.line, 1);
        let e = error("[quota.owner]\nalice = 5\n");
        assert_eq!(e.key, "quota.owner.\"alice\"");
    }

    #[test]
    fn a_syntax_error_names_the_line() {
        let e = error("[quota.defaults.owner]\njobs = = 3\n");
        assert_eq!(e.line, 2, "{e}");
        assert!(e.to_string().starts_with("--config /x.toml:2: "), "{e}");
    }

    #[test]
    fn too_many_resources_in_one_table_is_refused() {
        let body: String = (0..33).map(|i| format!("r{i} = 1\n")).collect();
        let e = error(&format!("[quota.defaults.owner]\n{body}"));
        assert_eq!(e.key, "quota.defaults.owner");
        assert!(e.message.contains("33 resources; at most 32"), "{e}");
    }

    #[test]
    fn load_refuses_a_missing_or_oversized_file_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.toml");
        let e = load(&missing).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("--config {}: cannot open", missing.display())),
            "{e}"
        );
        let big = dir.path().join("big.toml");
        let pad = "#".repeat(usize::try_from(MAX_CONFIG_BYTES).unwrap() + 1);
        std::fs::write(&big, pad).unwrap();
        assert!(load(&big)
            .unwrap_err()
            .message
            .contains("larger than 4 MiB"));
        let good = dir.path().join("good.toml");
        std::fs::write(&good, EXAMPLE).unwrap();
        assert_eq!(
            load(&good).unwrap().quota.repo_defaults,
            res(&[("jobs", 50)])
        );
    }
}
