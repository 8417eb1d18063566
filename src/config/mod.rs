//! Configuration: TOML with `deny_unknown_fields`, `--set section.key=value` overrides typed and
//! validated like the file, and semantic validation whose errors name the file, the key path,
//! the bad value and what is allowed.

mod hybrid;
mod layout;
mod schema;
mod validate;

pub use hybrid::{HybridConfig, MixerKind};
pub use layout::{BlockLayout, LayerKind, QkNorm};
pub use schema::*;
pub use validate::MAX_MICRO_BATCH;

use std::fmt;
use std::path::{Path, PathBuf};

/// The embedded default configuration (the same text as `configs/tiny.toml`).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/tiny.toml");

/// Where a config came from, for error messages.
const DEFAULT_ORIGIN: &str = "<default tiny.toml>";

/// One problem with a configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigIssue {
    /// File name, `--set`, or the default's name.
    pub origin: String,
    /// Dotted key path, e.g. `model.n_head` (empty for file-level problems).
    pub key: String,
    /// The offending value as written, when there is one.
    pub value: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.origin)?;
        if !self.key.is_empty() {
            write!(f, "{}", self.key)?;
            if let Some(v) = &self.value {
                write!(f, " = {v}")?;
            }
            write!(f, ": ")?;
        }
        write!(f, "{}", self.message)
    }
}

/// Why a configuration could not be loaded. Every variant is a usage error (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the config file: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{origin}: line {line}, column {column}: {message}")]
    Syntax {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("--set {arg}: {message}")]
    Override { arg: String, message: String },
    #[error("{}", join_issues(.0))]
    Invalid(Vec<ConfigIssue>),
}

fn join_issues(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A loaded, validated configuration and where it came from.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub config: Config,
    /// File name (or the default's name) for messages.
    pub origin: String,
    /// Directory relative paths in the config are resolved against.
    pub base_dir: PathBuf,
}

/// Load a config file (or the embedded default when `path` is None), apply `--set`
/// overrides, resolve relative paths and validate.
pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<LoadedConfig, ConfigError> {
    let (text, origin, base_dir) = match path {
        Some(p) => {
            let text = crate::util::read_regular_file(p, 16 << 20).map_err(|source| {
                ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                }
            })?;
            let origin = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string());
            let base = p.parent().map(Path::to_path_buf).unwrap_or_default();
            (text, origin, base)
        }
        None => (
            DEFAULT_CONFIG_TOML.to_string(),
            DEFAULT_ORIGIN.to_string(),
            PathBuf::from("."),
        ),
    };
    from_str(&text, &origin, &base_dir, overrides)
}

/// Parse, override and validate config text.
pub fn from_str(
    text: &str,
    origin: &str,
    base_dir: &Path,
    overrides: &[String],
) -> Result<LoadedConfig, ConfigError> {
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| syntax_error(origin, text, &e))?;
    let mut overridden = Vec::new();
    for arg in overrides {
        overridden.push(apply_override(&mut table, arg)?);
    }
    let value = toml::Value::Table(table.clone());
    let config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().to_string();
        let origin = overridden
            .iter()
            .rev()
            .find(|(k, _)| same_key(&key, k))
            .map(|(_, arg)| format!("--set {arg}"))
            .unwrap_or_else(|| origin.to_string());
        let value = lookup(&table, &key).map(render_value);
        ConfigError::Invalid(vec![ConfigIssue {
            origin,
            key: key.clone(),
            value,
            message: humanize_serde(&e.inner().to_string()),
        }])
    })?;
    let mut config = config;
    apply_arch_defaults(&mut config, &table);
    resolve_paths(&mut config, base_dir);
    let mut issues = validate::validate(&config, origin);
    // A value set by `--set` is blamed on the flag that set it, not on the file.
    for issue in &mut issues {
        if let Some((_, arg)) = overridden
            .iter()
            .rev()
            .find(|(k, _)| !issue.key.is_empty() && same_key(&issue.key, k))
        {
            issue.origin = format!("--set {arg}");
        }
    }
    if !issues.is_empty() {
        return Err(ConfigError::Invalid(issues));
    }
    Ok(LoadedConfig {
        config,
        origin: origin.to_string(),
        base_dir: base_dir.to_path_buf(),
    })
}

/// The last of `overrides` (`section.key=value`) that sets `key` (or a table holding it).
pub fn override_of<'a>(overrides: &'a [String], key: &str) -> Option<&'a str> {
    overrides
        .iter()
        .rev()
        .find(|o| {
            o.split_once('=')
                .is_some_and(|(k, _)| same_key(key, k.trim()))
        })
        .map(String::as_str)
}

/// Whether a problem with key path `key` is one with the value `--set` gave `set`: the same
/// key, one inside it (`model` set as a table), or one it created (`nosuch` of `nosuch.key`).
fn same_key(key: &str, set: &str) -> bool {
    let inside = |a: &str, b: &str| a.strip_prefix(b).is_some_and(|r| r.starts_with('.'));
    key == set || inside(key, set) || inside(set, key)
}

fn syntax_error(origin: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let (line, column) = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before
                .rsplit('\n')
                .next()
                .map(|s| s.chars().count())
                .unwrap_or(0)
                + 1;
            (line, column)
        }
        None => (0, 0),
    };
    ConfigError::Syntax {
        origin: origin.to_string(),
        line,
        column,
        message: e.message().trim().to_string(),
    }
}

/// Apply one `section.key=value` to the raw table. Returns (key path, original arg).
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(String, String), ConfigError> {
    let bad = |message: &str| ConfigError::Override {
        arg: arg.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| bad("expected section.key=value (no '=' found)"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2
        || parts.iter().any(|p| {
            p.is_empty()
                || !p
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
    {
        return Err(bad("expected section.key=value, e.g. --set optim.lr=1e-3"));
    }
    let raw = raw.trim();
    // A TOML value when it parses as one (numbers, booleans, arrays, quoted strings); else a bare string.
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut cur = table;
    for part in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(bad(&format!("`{part}` is not a section"))),
        };
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok((key.to_string(), arg.to_string()))
}

/// The value at a key path as serde names it: `section.key`, with `[i]` for an array's
/// entries (`model.hybrid.layers[1]`).
fn lookup<'a>(table: &'a toml::Table, path: &str) -> Option<&'a toml::Value> {
    let mut cur: Option<&'a toml::Value> = None;
    for part in path.split('.') {
        let (name, indices) = part.split_once('[').map_or((part, ""), |(n, r)| (n, r));
        let mut v = match cur {
            None => table.get(name)?,
            Some(c) => c.as_table()?.get(name)?,
        };
        for i in indices.split('[').filter(|i| !i.is_empty()) {
            let i: usize = i.trim_end_matches(']').parse().ok()?;
            v = v.as_array()?.get(i)?;
        }
        cur = Some(v);
    }
    cur
}

fn render_value(v: &toml::Value) -> String {
    match v {
        toml::Value::Table(_) => "{…}".to_string(),
        other => other.to_string(),
    }
}

/// Turn serde's wording into ours: say what is allowed, without backticks and Rust type names.
fn humanize_serde(msg: &str) -> String {
    // serde/toml may break a message over lines around an "in `key`" note (the key is named
    // already): keep one line.
    let mut one = String::new();
    for l in msg.lines().map(str::trim) {
        if l.is_empty() || l.starts_with("in ") {
            continue;
        }
        if !one.is_empty() && !l.starts_with(',') {
            one.push(' ');
        }
        one.push_str(l);
    }
    let msg = one.as_str();
    let clean = |s: &str| s.replace('`', "");
    let rust_types = |s: &str| {
        s.replace("usize", "a non-negative integer")
            .replace("u64", "a non-negative integer")
            .replace("u32", "a non-negative integer")
            .replace("u16", "an integer 0..65535")
            .replace("f64", "a number")
            .replace("a boolean", "true or false")
    };
    if let Some(rest) = msg.strip_prefix("unknown field ") {
        let (_, allowed) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let allowed = allowed.trim_start_matches("one of ");
        return format!("unknown key; allowed keys: {}", clean(allowed));
    }
    if let Some(rest) = msg.strip_prefix("unknown variant ") {
        let (_, allowed) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let allowed = allowed.trim_start_matches("one of ");
        return format!("unknown value; allowed: {}", clean(allowed));
    }
    if let Some(rest) = msg.strip_prefix("invalid type: ") {
        if let Some((found, expected)) = rest.split_once(", expected ") {
            return format!(
                "wrong type: expected {}, found {}",
                rust_types(&clean(expected)),
                clean(found)
            );
        }
    }
    if let Some(rest) = msg.strip_prefix("invalid value: ") {
        if let Some((found, expected)) = rest.split_once(", expected ") {
            return format!(
                "out of range: expected {}, found {}",
                rust_types(&clean(expected)),
                clean(found)
            );
        }
    }
    rust_types(&clean(msg))
}

/// `model.arch` sets its family's defaults for the keys the config (file or `--set`) leaves
/// out; a key given explicitly wins, and `model.arch_notes` records where it differs from the
/// family's default (the run header shows it).
fn apply_arch_defaults(c: &mut Config, table: &toml::Table) {
    let m = &mut c.model;
    m.arch_notes.clear();
    let family = match m.arch {
        Arch::Gpt => return,
        Arch::Llama => ModelConfig::llama_family(),
    };
    let given = |key: &str| lookup(table, &format!("model.{key}")).is_some();
    let mut notes = Vec::new();
    family_key(given("norm"), "norm", &mut m.norm, family.norm, &mut notes);
    family_key(given("pos"), "pos", &mut m.pos, family.pos, &mut notes);
    let act = family.activation;
    family_key(
        given("activation"),
        "activation",
        &mut m.activation,
        act,
        &mut notes,
    );
    family_key(given("bias"), "bias", &mut m.bias, family.bias, &mut notes);
    let tie = family.tie_embeddings;
    family_key(
        given("tie_embeddings"),
        "tie_embeddings",
        &mut m.tie_embeddings,
        tie,
        &mut notes,
    );
    m.arch_notes = notes;
}

/// One family default: taken when the key was not given, else noted where the given value
/// differs from it.
fn family_key<T: PartialEq + Copy + fmt::Debug>(
    given: bool,
    key: &str,
    value: &mut T,
    default: T,
    notes: &mut Vec<String>,
) {
    if !given {
        *value = default;
    } else if *value != default {
        let show = |v: &T| format!("{v:?}").to_lowercase();
        notes.push(format!(
            "{key} = {} (family default {})",
            show(value),
            show(&default)
        ));
    }
}

/// Make data and model paths absolute against the config file's directory.
fn resolve_paths(c: &mut Config, base: &Path) {
    let fix = |s: &mut String| {
        if !s.is_empty() && Path::new(s.as_str()).is_relative() {
            *s = base.join(s.as_str()).to_string_lossy().into_owned();
        }
    };
    if c.data.source == "files" {
        fix(&mut c.data.train);
        fix(&mut c.data.val);
    }
    if !["byte", "auto", "base"].contains(&c.data.tokenizer.as_str()) {
        fix(&mut c.data.tokenizer);
    }
    // A chat template's path (not the template text itself).
    if !c.data.chat_template.contains("{{") && !c.data.chat_template.contains("{%") {
        fix(&mut c.data.chat_template);
    }
    if c.lora.base != RANDOM_BASE {
        fix(&mut c.lora.base);
    }
    fix(&mut c.model.init_from);
    let theme_path = base.join(&c.run.theme);
    if c.run.theme.ends_with(".toml") && theme_path.exists() {
        c.run.theme = theme_path.to_string_lossy().into_owned();
    }
}

impl Config {
    /// Effective key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.model.kv_heads()
    }
}

impl ModelConfig {
    /// Effective key/value heads (0 = n_head).
    pub fn kv_heads(&self) -> usize {
        if self.n_kv_head == 0 {
            self.n_head
        } else {
            self.n_kv_head
        }
    }
    /// Effective head width (0 = n_embd / n_head).
    pub fn head_size(&self) -> usize {
        if self.head_dim == 0 {
            self.n_embd / self.n_head.max(1)
        } else {
            self.head_dim
        }
    }
}
