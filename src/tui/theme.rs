//! Colour themes: named "#rrggbb" colours loaded from TOML, with fallback to the 256-colour
//! palette or the 16 basic colours when the terminal lacks truecolor.
//!
//! The shipped themes (`themes/*.toml`) are embedded in the binary, so a bare name such as
//! `"dark"` works anywhere; anything that looks like a path is read from disk.

use crate::advisor::Severity;
use ratatui::style::{Color, Modifier, Style};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The themes compiled into the binary, by name.
const BUILTIN: &[(&str, &str)] = &[
    ("dark", include_str!("../../themes/dark.toml")),
    ("light", include_str!("../../themes/light.toml")),
    (
        "high-contrast",
        include_str!("../../themes/high-contrast.toml"),
    ),
];

/// Environment variable that forces the colour depth (`truecolor`, `256` or `16`).
pub const COLOR_ENV: &str = "COCKPIT_COLOR";

macro_rules! palette {
    ($( $(#[$doc:meta])* $field:ident ),+ $(,)?) => {
        /// One colour per UI role. `C` is the colour representation: the TOML string, the
        /// parsed [`Rgb`] or the terminal [`Color`] after fallback.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct Palette<C> {
            $( $(#[$doc])* pub $field: C, )+
        }

        impl<C> Palette<C> {
            /// The names of every colour key, as written in a theme file.
            pub const KEYS: &'static [&'static str] = &[$(stringify!($field)),+];

            fn try_map<D, E>(
                self,
                mut f: impl FnMut(&'static str, C) -> Result<D, E>,
            ) -> Result<Palette<D>, E> {
                Ok(Palette { $( $field: f(stringify!($field), self.$field)?, )+ })
            }

            fn map<D>(&self, mut f: impl FnMut(&C) -> D) -> Palette<D> {
                Palette { $( $field: f(&self.$field), )+ }
            }
        }

        /// A theme file as written on disk.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ThemeFile {
            name: Option<String>,
            $( $field: String, )+
        }

        impl ThemeFile {
            fn split(self) -> (Option<String>, Palette<String>) {
                (self.name, Palette { $( $field: self.$field, )+ })
            }
        }
    };
}

palette! {
    /// Whole-screen background.
    background,
    /// Ordinary text.
    text,
    /// Secondary text: labels, hints, axes.
    muted,
    /// Titles, focus and highlights.
    accent,
    /// Panel borders.
    border,
    /// Training loss series.
    train_loss,
    /// Validation loss series.
    val_loss,
    /// SCU S-ratio series.
    s_ratio,
    /// SCU setpoint S* line.
    setpoint,
    /// SCU λ series.
    lambda,
    /// Learning-rate series.
    lr,
    /// Gradient-norm series.
    grad_norm,
    /// Gauge fill in the healthy range.
    gauge_ok,
    /// Gauge fill in the warning range.
    gauge_warn,
    /// Gauge fill in the critical range.
    gauge_critical,
    /// Informational advice and log entries.
    severity_info,
    /// Warnings.
    severity_warn,
    /// Critical advice and errors.
    severity_critical,
}

/// A 24-bit colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl FromStr for Rgb {
    type Err = ();

    /// Parses `"#rrggbb"` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, ()> {
        let hex = s.strip_prefix('#').ok_or(())?;
        if hex.len() != 6 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(());
        }
        let channel = |i: usize| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|_| ());
        Ok(Rgb(channel(0)?, channel(2)?, channel(4)?))
    }
}

impl fmt::Display for Rgb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
    }
}

/// How many colours the terminal can show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColorSupport {
    /// 24-bit colour: theme colours are used as they are.
    TrueColor,
    /// The xterm 256-colour palette.
    Ansi256,
    /// The 16 basic ANSI colours.
    Ansi16,
}

impl ColorSupport {
    /// Detects colour support from the environment: [`COLOR_ENV`] when set to a valid value
    /// forces it, otherwise `COLORTERM` and `TERM` decide.
    pub fn detect() -> ColorSupport {
        if let Some(forced) = std::env::var(COLOR_ENV).ok().and_then(|v| v.parse().ok()) {
            return forced;
        }
        Self::detect_from(
            std::env::var("COLORTERM").ok().as_deref(),
            std::env::var("TERM").ok().as_deref(),
        )
    }

    /// Detection from explicit `COLORTERM` and `TERM` values (pure, for tests).
    pub fn detect_from(colorterm: Option<&str>, term: Option<&str>) -> ColorSupport {
        let colorterm = colorterm.unwrap_or("").to_ascii_lowercase();
        if colorterm == "truecolor" || colorterm == "24bit" {
            return ColorSupport::TrueColor;
        }
        let term = term.unwrap_or("").to_ascii_lowercase();
        if term.contains("truecolor") || term.contains("24bit") || term.contains("direct") {
            ColorSupport::TrueColor
        } else if term.contains("256") {
            ColorSupport::Ansi256
        } else {
            ColorSupport::Ansi16
        }
    }

    /// Maps a theme colour to what this terminal can show.
    pub fn convert(self, rgb: Rgb) -> Color {
        match self {
            ColorSupport::TrueColor => Color::Rgb(rgb.0, rgb.1, rgb.2),
            ColorSupport::Ansi256 => Color::Indexed(nearest_xterm256(rgb)),
            ColorSupport::Ansi16 => nearest_ansi16(rgb),
        }
    }
}

impl FromStr for ColorSupport {
    type Err = String;

    /// Accepts `truecolor`/`24bit`, `256` and `16`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "truecolor" | "24bit" | "24-bit" => Ok(ColorSupport::TrueColor),
            "256" | "ansi256" => Ok(ColorSupport::Ansi256),
            "16" | "ansi16" | "basic" => Ok(ColorSupport::Ansi16),
            other => Err(format!(
                "unknown colour depth {other:?} (expected truecolor, 256 or 16)"
            )),
        }
    }
}

/// Squared distance between two colours, weighted roughly by perceived brightness.
fn distance(a: Rgb, b: Rgb) -> u32 {
    let d = |x: u8, y: u8| (i32::from(x) - i32::from(y)).unsigned_abs();
    let (dr, dg, db) = (d(a.0, b.0), d(a.1, b.1), d(a.2, b.2));
    2 * dr * dr + 4 * dg * dg + 3 * db * db
}

/// The nearest entry of the xterm 256-colour palette (the 6×6×6 cube or the grey ramp).
pub fn nearest_xterm256(rgb: Rgb) -> u8 {
    const LEVELS: [u8; 6] = [0, 95, 135, 175, 215, 255];
    let level_index = |v: u8| -> usize {
        LEVELS
            .iter()
            .enumerate()
            .min_by_key(|(_, &l)| (i32::from(l) - i32::from(v)).unsigned_abs())
            .map_or(0, |(i, _)| i)
    };
    let (ri, gi, bi) = (level_index(rgb.0), level_index(rgb.1), level_index(rgb.2));
    let cube = Rgb(LEVELS[ri], LEVELS[gi], LEVELS[bi]);
    let cube_index = 16 + 36 * ri + 6 * gi + bi;

    let mean = (u32::from(rgb.0) + u32::from(rgb.1) + u32::from(rgb.2)) / 3;
    // grey ramp 232..=255 is 8, 18, ..., 238
    let step = (mean.saturating_sub(3) / 10).min(23);
    let grey_value = (8 + 10 * step) as u8;
    let grey = Rgb(grey_value, grey_value, grey_value);
    let grey_index = 232 + step as usize;

    let best = if distance(rgb, grey) < distance(rgb, cube) {
        grey_index
    } else {
        cube_index
    };
    u8::try_from(best).unwrap_or(15)
}

/// The nearest of the 16 basic ANSI colours (xterm's default values).
pub fn nearest_ansi16(rgb: Rgb) -> Color {
    const BASIC: [(Color, Rgb); 16] = [
        (Color::Black, Rgb(0, 0, 0)),
        (Color::Red, Rgb(205, 0, 0)),
        (Color::Green, Rgb(0, 205, 0)),
        (Color::Yellow, Rgb(205, 205, 0)),
        (Color::Blue, Rgb(0, 0, 238)),
        (Color::Magenta, Rgb(205, 0, 205)),
        (Color::Cyan, Rgb(0, 205, 205)),
        (Color::Gray, Rgb(229, 229, 229)),
        (Color::DarkGray, Rgb(127, 127, 127)),
        (Color::LightRed, Rgb(255, 0, 0)),
        (Color::LightGreen, Rgb(0, 255, 0)),
        (Color::LightYellow, Rgb(255, 255, 0)),
        (Color::LightBlue, Rgb(92, 92, 255)),
        (Color::LightMagenta, Rgb(255, 0, 255)),
        (Color::LightCyan, Rgb(0, 255, 255)),
        (Color::White, Rgb(255, 255, 255)),
    ];
    BASIC
        .iter()
        .min_by_key(|(_, c)| distance(rgb, *c))
        .map_or(Color::Reset, |(color, _)| *color)
}

/// Why a theme could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ThemeError {
    /// A bare name that is not one of the shipped themes.
    #[error(
        "unknown theme {name:?}: built-in themes are {available}; or give a path to a .toml file"
    )]
    UnknownTheme {
        /// The name given.
        name: String,
        /// The shipped themes.
        available: String,
    },
    /// The theme file could not be read.
    #[error("cannot read theme file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The theme file is not valid TOML, has an unknown key or misses one.
    #[error("invalid theme {origin}: {source}")]
    Parse {
        /// The file or built-in theme.
        origin: String,
        /// What TOML or the schema objected to.
        #[source]
        source: toml::de::Error,
    },
    /// A colour is not written as "#rrggbb".
    #[error("invalid theme {origin}: {key} = {value:?} is not a colour (expected \"#rrggbb\")")]
    InvalidColor {
        /// The file or built-in theme.
        origin: String,
        /// The colour key.
        key: &'static str,
        /// The value given.
        value: String,
    },
}

/// A loaded theme: named colours resolved for the terminal's colour depth.
#[derive(Clone, Debug, PartialEq)]
pub struct Theme {
    name: String,
    rgb: Palette<Rgb>,
    support: ColorSupport,
    colors: Palette<Color>,
}

impl Default for Theme {
    /// The shipped dark theme in truecolor.
    fn default() -> Self {
        Theme::load("dark").unwrap_or_else(|_| Theme::basic())
    }
}

impl Theme {
    /// Names of the themes compiled into the binary.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|(name, _)| *name).collect()
    }

    /// Loads a theme: a bare name (e.g. `"light"`) picks a shipped theme, anything that looks
    /// like a path (has a separator or a `.toml` suffix, or names an existing file) is read
    /// from disk. The result uses truecolor; see [`Theme::with_color_support`].
    pub fn load(name_or_path: &str) -> Result<Theme, ThemeError> {
        let path = Path::new(name_or_path);
        let looks_like_path = name_or_path.contains(std::path::MAIN_SEPARATOR)
            || name_or_path.contains('/')
            || path.extension().is_some_and(|e| e == "toml")
            || path.is_file();
        if looks_like_path {
            let text = std::fs::read_to_string(path).map_err(|source| ThemeError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| name_or_path.to_string());
            return Theme::from_toml(&text, &path.display().to_string(), &stem);
        }
        let (name, text) = BUILTIN
            .iter()
            .find(|(name, _)| *name == name_or_path)
            .ok_or_else(|| ThemeError::UnknownTheme {
                name: name_or_path.to_string(),
                available: Theme::builtin_names().join(", "),
            })?;
        Theme::from_toml(text, &format!("\"{name}\""), name)
    }

    /// Parses a theme from TOML text. `origin` names the source in errors; `default_name` is
    /// used when the file has no `name` key.
    pub fn from_toml(text: &str, origin: &str, default_name: &str) -> Result<Theme, ThemeError> {
        let file: ThemeFile = toml::from_str(text).map_err(|source| ThemeError::Parse {
            origin: origin.to_string(),
            source,
        })?;
        let (name, strings) = file.split();
        let rgb = strings.try_map(|key, value| {
            value.parse::<Rgb>().map_err(|()| ThemeError::InvalidColor {
                origin: origin.to_string(),
                key,
                value,
            })
        })?;
        Ok(Theme::from_palette(
            name.unwrap_or_else(|| default_name.to_string()),
            rgb,
        ))
    }

    /// A theme from an explicit palette, in truecolor.
    pub fn from_palette(name: String, rgb: Palette<Rgb>) -> Theme {
        let support = ColorSupport::TrueColor;
        let colors = rgb.map(|c| support.convert(*c));
        Theme {
            name,
            rgb,
            support,
            colors,
        }
    }

    /// Last-resort palette of basic colours, used only if the embedded dark theme were broken.
    fn basic() -> Theme {
        let c = |r, g, b| Rgb(r, g, b);
        Theme::from_palette(
            "basic".into(),
            Palette {
                background: c(0, 0, 0),
                text: c(229, 229, 229),
                muted: c(127, 127, 127),
                accent: c(0, 205, 205),
                border: c(127, 127, 127),
                train_loss: c(0, 205, 205),
                val_loss: c(205, 205, 0),
                s_ratio: c(205, 0, 205),
                setpoint: c(255, 255, 0),
                lambda: c(0, 205, 0),
                lr: c(92, 92, 255),
                grad_norm: c(205, 0, 0),
                gauge_ok: c(0, 205, 0),
                gauge_warn: c(205, 205, 0),
                gauge_critical: c(255, 0, 0),
                severity_info: c(0, 205, 205),
                severity_warn: c(205, 205, 0),
                severity_critical: c(255, 0, 0),
            },
        )
    }

    /// The same theme resolved for another colour depth.
    #[must_use]
    pub fn with_color_support(mut self, support: ColorSupport) -> Theme {
        self.support = support;
        self.colors = self.rgb.map(|c| support.convert(*c));
        self
    }

    /// The theme's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The colour depth the colours are resolved for.
    pub fn color_support(&self) -> ColorSupport {
        self.support
    }

    /// The colours as written in the theme.
    pub fn rgb(&self) -> &Palette<Rgb> {
        &self.rgb
    }

    /// The colours as the terminal will show them.
    pub fn colors(&self) -> &Palette<Color> {
        &self.colors
    }

    /// Text on the theme background: the base style of every view.
    pub fn base(&self) -> Style {
        Style::new().fg(self.colors.text).bg(self.colors.background)
    }

    /// Foreground-only style in one of the theme colours.
    pub fn fg(&self, color: Color) -> Style {
        Style::new().fg(color)
    }

    /// Secondary text.
    pub fn muted(&self) -> Style {
        self.fg(self.colors.muted)
    }

    /// Highlighted text.
    pub fn accent(&self) -> Style {
        self.fg(self.colors.accent)
    }

    /// Panel border; `focused` panels use the accent colour.
    pub fn border(&self, focused: bool) -> Style {
        if focused {
            self.fg(self.colors.accent)
        } else {
            self.fg(self.colors.border)
        }
    }

    /// Panel title.
    pub fn title(&self) -> Style {
        self.accent().add_modifier(Modifier::BOLD)
    }

    /// Colour of an advice severity.
    pub fn severity(&self, severity: Severity) -> Style {
        match severity {
            Severity::Info => self.fg(self.colors.severity_info),
            Severity::Warn => self.fg(self.colors.severity_warn),
            Severity::Critical => self
                .fg(self.colors.severity_critical)
                .add_modifier(Modifier::BOLD),
        }
    }

    /// Gauge fill for a level.
    pub fn level(&self, level: Level) -> Style {
        match level {
            Level::Ok => self.fg(self.colors.gauge_ok),
            Level::Warn => self.fg(self.colors.gauge_warn),
            Level::Critical => self.fg(self.colors.gauge_critical),
        }
    }
}

/// How healthy a reading is, for gauge colours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Healthy.
    Ok,
    /// Worth a look.
    Warn,
    /// Needs action.
    Critical,
}

impl Level {
    /// `Ok` below `warn`, `Warn` below `critical`, else `Critical`.
    pub fn from_thresholds(value: f64, warn: f64, critical: f64) -> Level {
        if value >= critical {
            Level::Critical
        } else if value >= warn {
            Level::Warn
        } else {
            Level::Ok
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hex() {
        assert_eq!("#0a0B0c".parse::<Rgb>(), Ok(Rgb(10, 11, 12)));
        assert!("0a0b0c".parse::<Rgb>().is_err());
        assert!("#0a0b0".parse::<Rgb>().is_err());
        assert!("#0a0b0g".parse::<Rgb>().is_err());
        assert!("#0a0b0é".parse::<Rgb>().is_err());
    }

    #[test]
    fn xterm256_cube_and_grey() {
        assert_eq!(nearest_xterm256(Rgb(0, 0, 0)), 16);
        assert_eq!(nearest_xterm256(Rgb(255, 255, 255)), 231);
        assert_eq!(nearest_xterm256(Rgb(255, 0, 0)), 196);
        assert_eq!(nearest_xterm256(Rgb(128, 128, 128)), 244);
    }
}
