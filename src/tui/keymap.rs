//! Configurable key bindings: which key triggers which dashboard action.
//!
//! Keys are named in configuration as a single character (`"q"`, `"+"`, `"?"`) or by name
//! (`"plus"`, `"minus"`, `"tab"`, `"space"`, `"f1"`, …), optionally with a `ctrl+`/`alt+`
//! prefix. Ctrl-C is reserved: it always stops the run (see the dashboard help).

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

/// Something a key can do on the dashboard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyAction {
    /// Double the micro-batch size.
    BatchUp,
    /// Halve the micro-batch size.
    BatchDown,
    /// Raise the SCU setpoint by one step.
    SetpointUp,
    /// Lower the SCU setpoint by one step.
    SetpointDown,
    /// Write a checkpoint now.
    Checkpoint,
    /// Pause or resume training.
    Pause,
    /// Cycle the loss smoothing: raw, then a debiased EMA of 0.6, 0.9, 0.98.
    Smoothing,
    /// Toggle the charts between the full run and the recent window.
    Window,
    /// Focus the next GPU panel.
    Focus,
    /// Show or hide the help overlay.
    Help,
    /// Quit (asks first while a run is going).
    Quit,
}

impl KeyAction {
    /// Every action, in help-screen order.
    pub const ALL: [KeyAction; 11] = [
        KeyAction::BatchUp,
        KeyAction::BatchDown,
        KeyAction::SetpointUp,
        KeyAction::SetpointDown,
        KeyAction::Checkpoint,
        KeyAction::Pause,
        KeyAction::Smoothing,
        KeyAction::Window,
        KeyAction::Focus,
        KeyAction::Help,
        KeyAction::Quit,
    ];

    /// The name used in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            KeyAction::BatchUp => "batch_up",
            KeyAction::BatchDown => "batch_down",
            KeyAction::SetpointUp => "setpoint_up",
            KeyAction::SetpointDown => "setpoint_down",
            KeyAction::Checkpoint => "checkpoint",
            KeyAction::Pause => "pause",
            KeyAction::Smoothing => "smoothing",
            KeyAction::Window => "window",
            KeyAction::Focus => "focus",
            KeyAction::Help => "help",
            KeyAction::Quit => "quit",
        }
    }

    /// What the action does, for the help overlay.
    pub fn description(self) -> &'static str {
        match self {
            KeyAction::BatchUp => "double the micro-batch size",
            KeyAction::BatchDown => "halve the micro-batch size",
            KeyAction::SetpointUp => "raise the SCU setpoint S*",
            KeyAction::SetpointDown => "lower the SCU setpoint S*",
            KeyAction::Checkpoint => "write a checkpoint now",
            KeyAction::Pause => "pause / resume training",
            KeyAction::Smoothing => "loss smoothing: 0 / 0.6 / 0.9 / 0.98",
            KeyAction::Window => "charts: whole run / its last fifth",
            KeyAction::Focus => "focus the next GPU",
            KeyAction::Help => "show / hide this help",
            KeyAction::Quit => "quit (asks whether to save)",
        }
    }

    /// Whether the action only makes sense while training (not in the monitor view).
    pub fn training_only(self) -> bool {
        !matches!(self, KeyAction::Focus | KeyAction::Help | KeyAction::Quit)
    }

    fn default_key(self) -> KeyBinding {
        let c = KeyBinding::char;
        match self {
            KeyAction::BatchUp => c('+'),
            KeyAction::BatchDown => c('-'),
            KeyAction::SetpointUp => c(']'),
            KeyAction::SetpointDown => c('['),
            KeyAction::Checkpoint => c('c'),
            KeyAction::Pause => c('p'),
            KeyAction::Smoothing => c('s'),
            KeyAction::Window => c('w'),
            KeyAction::Focus => KeyBinding::new(KeyCode::Tab),
            KeyAction::Help => c('?'),
            KeyAction::Quit => c('q'),
        }
    }
}

impl FromStr for KeyAction {
    type Err = KeymapError;

    fn from_str(s: &str) -> Result<Self, KeymapError> {
        KeyAction::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| KeymapError::UnknownAction {
                action: s.to_string(),
                known: KeyAction::ALL.map(KeyAction::name).join(", "),
            })
    }
}

/// One key, with the Ctrl/Alt modifiers it needs (Shift is implied by the character).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyBinding {
    /// The key.
    pub code: KeyCode,
    /// Only `CONTROL` and `ALT` are significant.
    pub modifiers: KeyModifiers,
}

/// Names accepted for keys that are awkward to write as a single character.
const NAMED_CHARS: &[(&str, char)] = &[
    ("plus", '+'),
    ("minus", '-'),
    ("equal", '='),
    ("equals", '='),
    ("question", '?'),
    ("lbracket", '['),
    ("left_bracket", '['),
    ("rbracket", ']'),
    ("right_bracket", ']'),
    ("space", ' '),
    ("comma", ','),
    ("period", '.'),
    ("dot", '.'),
    ("slash", '/'),
    ("backslash", '\\'),
    ("semicolon", ';'),
    ("colon", ':'),
    ("star", '*'),
    ("asterisk", '*'),
    ("hash", '#'),
    ("lt", '<'),
    ("gt", '>'),
];

const NAMED_KEYS: &[(&str, KeyCode)] = &[
    ("tab", KeyCode::Tab),
    ("backtab", KeyCode::BackTab),
    ("enter", KeyCode::Enter),
    ("return", KeyCode::Enter),
    ("esc", KeyCode::Esc),
    ("escape", KeyCode::Esc),
    ("backspace", KeyCode::Backspace),
    ("delete", KeyCode::Delete),
    ("del", KeyCode::Delete),
    ("insert", KeyCode::Insert),
    ("home", KeyCode::Home),
    ("end", KeyCode::End),
    ("pageup", KeyCode::PageUp),
    ("pgup", KeyCode::PageUp),
    ("pagedown", KeyCode::PageDown),
    ("pgdn", KeyCode::PageDown),
    ("up", KeyCode::Up),
    ("down", KeyCode::Down),
    ("left", KeyCode::Left),
    ("right", KeyCode::Right),
];

impl KeyBinding {
    /// A key without modifiers.
    pub const fn new(code: KeyCode) -> KeyBinding {
        KeyBinding {
            code,
            modifiers: KeyModifiers::NONE,
        }
    }

    /// A character key without modifiers.
    pub const fn char(c: char) -> KeyBinding {
        KeyBinding::new(KeyCode::Char(c))
    }

    /// Whether a key press triggers this binding. Shift is ignored: it is part of the
    /// character (`+`, `?`, `Q`) and terminals disagree on reporting it.
    pub fn matches(&self, key: &KeyEvent) -> bool {
        let significant = KeyModifiers::CONTROL | KeyModifiers::ALT;
        if key.modifiers & significant != self.modifiers & significant {
            return false;
        }
        match (self.code, key.code) {
            (KeyCode::Char(a), KeyCode::Char(b)) => a == b,
            (KeyCode::BackTab, KeyCode::BackTab) => true,
            (a, b) => a == b,
        }
    }

    /// Parses a key name such as `"q"`, `"plus"`, `"tab"`, `"f5"` or `"ctrl+r"`.
    pub fn parse(name: &str) -> Option<KeyBinding> {
        let mut modifiers = KeyModifiers::NONE;
        let mut rest = name;
        loop {
            let lower = rest.to_ascii_lowercase();
            let prefix = ["ctrl+", "ctrl-", "alt+", "alt-"]
                .into_iter()
                .find(|p| lower.starts_with(p) && rest.len() > p.len());
            match prefix {
                Some(p) => {
                    modifiers |= if p.starts_with("ctrl") {
                        KeyModifiers::CONTROL
                    } else {
                        KeyModifiers::ALT
                    };
                    rest = &rest[p.len()..];
                }
                None => break,
            }
        }
        let code = parse_code(rest)?;
        Some(KeyBinding { code, modifiers })
    }
}

fn parse_code(name: &str) -> Option<KeyCode> {
    let mut chars = name.chars();
    if let (Some(c), None) = (chars.next(), chars.next()) {
        return (!c.is_control()).then_some(KeyCode::Char(c));
    }
    let lower = name.to_ascii_lowercase();
    if let Some((_, c)) = NAMED_CHARS.iter().find(|(n, _)| *n == lower) {
        return Some(KeyCode::Char(*c));
    }
    if let Some((_, code)) = NAMED_KEYS.iter().find(|(n, _)| *n == lower) {
        return Some(*code);
    }
    let n = lower.strip_prefix('f')?.parse::<u8>().ok()?;
    (1..=12).contains(&n).then_some(KeyCode::F(n))
}

impl fmt::Display for KeyBinding {
    /// How the key is shown in the footer and help: `+`, `Tab`, `Ctrl+r`, `F5`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.modifiers.contains(KeyModifiers::CONTROL) {
            f.write_str("Ctrl+")?;
        }
        if self.modifiers.contains(KeyModifiers::ALT) {
            f.write_str("Alt+")?;
        }
        match self.code {
            KeyCode::Char(' ') => f.write_str("Space"),
            KeyCode::Char(c) => write!(f, "{c}"),
            KeyCode::Tab => f.write_str("Tab"),
            KeyCode::BackTab => f.write_str("Shift+Tab"),
            KeyCode::Enter => f.write_str("Enter"),
            KeyCode::Esc => f.write_str("Esc"),
            KeyCode::Backspace => f.write_str("Backspace"),
            KeyCode::Delete => f.write_str("Del"),
            KeyCode::Insert => f.write_str("Ins"),
            KeyCode::Home => f.write_str("Home"),
            KeyCode::End => f.write_str("End"),
            KeyCode::PageUp => f.write_str("PgUp"),
            KeyCode::PageDown => f.write_str("PgDn"),
            KeyCode::Up => f.write_str("↑"),
            KeyCode::Down => f.write_str("↓"),
            KeyCode::Left => f.write_str("←"),
            KeyCode::Right => f.write_str("→"),
            KeyCode::F(n) => write!(f, "F{n}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// Why a keymap could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeymapError {
    /// The action name is not one the dashboard knows.
    #[error("unknown key action {action:?} (known actions: {known})")]
    UnknownAction {
        /// The name given.
        action: String,
        /// The names accepted.
        known: String,
    },
    /// The key name could not be parsed.
    #[error(
        "unknown key {key:?} for action {action}: use a single character, a name such as \
         plus, minus, tab, space, enter, esc, up, f1, or a ctrl+/alt+ prefix"
    )]
    UnknownKey {
        /// The action being bound.
        action: String,
        /// The key name given.
        key: String,
    },
    /// The key is reserved by the dashboard.
    #[error("key {key:?} for action {action} is reserved (Ctrl+C always stops the run)")]
    Reserved {
        /// The action being bound.
        action: String,
        /// The key name given.
        key: String,
    },
    /// Two actions ended up on the same key.
    #[error("key {key} is bound to both {first} and {second}")]
    Conflict {
        /// The key, as shown in the footer.
        key: String,
        /// One action on it.
        first: &'static str,
        /// The other action on it.
        second: &'static str,
    },
}

/// The dashboard's key bindings: one key per [`KeyAction`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keymap {
    bindings: BTreeMap<KeyAction, KeyBinding>,
}

impl Default for Keymap {
    /// `+`/`-` batch, `]`/`[` setpoint, `c` checkpoint, `p` pause, `s` smoothing, `w` window,
    /// `Tab` focus, `?` help, `q` quit.
    fn default() -> Self {
        Keymap {
            bindings: KeyAction::ALL
                .into_iter()
                .map(|a| (a, a.default_key()))
                .collect(),
        }
    }
}

impl Keymap {
    /// The defaults with some actions rebound, from action name → key name pairs such as
    /// `{"quit": "x", "batch_up": "plus"}`. Unknown actions or keys, the reserved Ctrl+C and
    /// two actions on one key are errors.
    pub fn from_names(overrides: &HashMap<String, String>) -> Result<Keymap, KeymapError> {
        let mut keymap = Keymap::default();
        // sorted, so that errors do not depend on hash order
        let sorted: BTreeMap<_, _> = overrides.iter().collect();
        for (action_name, key_name) in sorted {
            let action: KeyAction = action_name.parse()?;
            let binding =
                KeyBinding::parse(key_name.trim()).ok_or_else(|| KeymapError::UnknownKey {
                    action: action_name.clone(),
                    key: key_name.clone(),
                })?;
            if binding.modifiers.contains(KeyModifiers::CONTROL)
                && matches!(binding.code, KeyCode::Char('c' | 'C'))
            {
                return Err(KeymapError::Reserved {
                    action: action_name.clone(),
                    key: key_name.clone(),
                });
            }
            keymap.bindings.insert(action, binding);
        }
        keymap.check_conflicts()?;
        Ok(keymap)
    }

    fn check_conflicts(&self) -> Result<(), KeymapError> {
        let all: Vec<_> = self.bindings.iter().collect();
        for (i, (a, ka)) in all.iter().enumerate() {
            for (b, kb) in &all[i + 1..] {
                if ka == kb {
                    return Err(KeymapError::Conflict {
                        key: ka.to_string(),
                        first: a.name(),
                        second: b.name(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The key bound to an action.
    pub fn key(&self, action: KeyAction) -> KeyBinding {
        self.bindings
            .get(&action)
            .copied()
            .unwrap_or_else(|| action.default_key())
    }

    /// The action a key press triggers, if any.
    pub fn action_for(&self, key: &KeyEvent) -> Option<KeyAction> {
        self.bindings
            .iter()
            .find(|(_, binding)| binding.matches(key))
            .map(|(action, _)| *action)
    }

    /// The quit popup's key for "quit without saving": the first of `x`, `X`, `D`, `!` that
    /// no action is bound to (and not `s`, `n` or `c`, the popup's other answers), so that
    /// pressing a binding twice can never throw the run away. None when all are taken (the
    /// choice is then reached with the arrows and Enter only).
    pub fn discard_key(&self) -> Option<char> {
        ['x', 'X', 'D', '!'].into_iter().find(|&c| {
            self.action_for(&KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE))
                .is_none()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names() {
        assert_eq!(KeyBinding::parse("plus"), Some(KeyBinding::char('+')));
        assert_eq!(KeyBinding::parse("+"), Some(KeyBinding::char('+')));
        assert_eq!(
            KeyBinding::parse("TAB"),
            Some(KeyBinding::new(KeyCode::Tab))
        );
        assert_eq!(
            KeyBinding::parse("f5"),
            Some(KeyBinding::new(KeyCode::F(5)))
        );
        assert_eq!(KeyBinding::parse("f13"), None);
        assert_eq!(
            KeyBinding::parse("ctrl+r"),
            Some(KeyBinding {
                code: KeyCode::Char('r'),
                modifiers: KeyModifiers::CONTROL
            })
        );
        assert_eq!(KeyBinding::parse("ctrl-"), None);
        assert_eq!(KeyBinding::parse("-"), Some(KeyBinding::char('-')));
        assert_eq!(KeyBinding::parse("nope"), None);
        assert_eq!(KeyBinding::parse(""), None);
    }

    #[test]
    fn display_round_trips_for_footer() {
        assert_eq!(KeyBinding::char('+').to_string(), "+");
        assert_eq!(KeyBinding::new(KeyCode::Tab).to_string(), "Tab");
        assert_eq!(
            KeyBinding::parse("alt+x").map(|k| k.to_string()),
            Some("Alt+x".into())
        );
    }
}
