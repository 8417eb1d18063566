//! The config overrides a command's own flags stand for (`--device cuda` is
//! `run.device="cuda"`, `--max-steps 30` is `run.max_steps=30`), remembered with the flag, so
//! that a config error names what the user typed rather than a `--set` they never wrote.

use crate::config::{ConfigError, ConfigIssue};

/// The overrides pushed for flags, each with the flag as typed.
#[derive(Debug, Default)]
pub(super) struct FlagSets(Vec<(String, String)>);

impl FlagSets {
    /// Pushes `key=value` (a TOML string) onto `overrides` for `flag value`.
    pub fn push_str(&mut self, overrides: &mut Vec<String>, flag: &str, key: &str, value: &str) {
        self.push(
            overrides,
            format!("{key}={value:?}"),
            format!("{flag} {value}"),
        );
    }

    /// Pushes the override `set` onto `overrides` for the flag text `flag`.
    pub fn push(&mut self, overrides: &mut Vec<String>, set: String, flag: String) {
        self.0.push((set.clone(), flag));
        overrides.push(set);
    }

    /// The flag that pushed override `set`, if one did.
    fn flag_of(&self, set: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(s, _)| s == set)
            .map(|(_, f)| f.as_str())
    }

    /// `e` with each problem that the loader blamed on `--set X` blamed on the flag behind X.
    pub fn blame(&self, e: ConfigError) -> ConfigError {
        match e {
            ConfigError::Invalid(issues) => {
                ConfigError::Invalid(issues.into_iter().map(|i| self.blame_issue(i)).collect())
            }
            ConfigError::Override { arg, message } => match self.flag_of(&arg) {
                Some(flag) => ConfigError::Invalid(vec![ConfigIssue {
                    origin: flag.to_string(),
                    key: String::new(),
                    value: None,
                    message,
                }]),
                None => ConfigError::Override { arg, message },
            },
            other => other,
        }
    }

    fn blame_issue(&self, mut issue: ConfigIssue) -> ConfigIssue {
        if let Some(flag) = issue
            .origin
            .strip_prefix("--set ")
            .and_then(|set| self.flag_of(set))
        {
            issue.origin = flag.to_string();
        }
        issue
    }

    /// Where the value of `key` came from: the flag or `--set` that set it last among
    /// `overrides`, else `file` (the config's name). For problems found after loading.
    pub fn origin_of(&self, overrides: &[String], key: &str, file: &str) -> String {
        match crate::config::override_of(overrides, key) {
            Some(set) => self
                .flag_of(set)
                .map_or_else(|| format!("--set {set}"), str::to_string),
            None => file.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flags_value_is_blamed_on_the_flag() {
        let mut flags = FlagSets::default();
        let mut o = vec!["optim.lr=1e-3".to_string()];
        flags.push_str(&mut o, "--device", "run.device", "foo");
        let e = crate::config::load(None, &o).unwrap_err();
        let text = flags.blame(e).to_string();
        assert!(
            text.starts_with("--device foo: run.device = \"foo\": "),
            "{text}"
        );
        // A --set of the same key after the flag wins, and is blamed as itself.
        o.push("run.device=\"bar\"".into());
        let text = flags
            .blame(crate::config::load(None, &o).unwrap_err())
            .to_string();
        assert!(text.starts_with("--set run.device=\"bar\": "), "{text}");
        assert_eq!(
            flags.origin_of(&o[..2], "run.device", "tiny.toml"),
            "--device foo"
        );
        assert_eq!(flags.origin_of(&o, "run.theme", "tiny.toml"), "tiny.toml");
    }
}
