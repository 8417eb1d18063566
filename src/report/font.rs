//! Finding a TrueType font at run time for plotters' `ab_glyph` text renderer.
//!
//! Nothing is bundled and nothing is fetched: the first call looks for a sans-serif font in the
//! usual system and user font directories (or the file named by [`FONT_ENV`]) and registers it
//! with plotters as `sans-serif`. The result is kept for the life of the process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::style::{register_font, FontStyle};

/// Environment variable naming a `.ttf`/`.otf` file to use instead of searching.
pub const FONT_ENV: &str = "COCKPIT_FONT";

/// The plotters font family every chart uses.
pub(crate) const FAMILY: &str = "sans-serif";

/// Font files larger than this are not considered (they are kept in memory for good).
const MAX_FONT_BYTES: u64 = 32 * 1024 * 1024;
/// How many candidate files to try before giving up.
const MAX_ATTEMPTS: usize = 6;
/// Bounds on the directory walk, so a huge font tree cannot stall a report.
const MAX_DEPTH: usize = 6;
const MAX_ENTRIES: usize = 20_000;

/// Well-known regular sans-serif faces, best first (lower-case file names).
const PREFERRED: &[&str] = &[
    "dejavusans.ttf",
    "liberationsans-regular.ttf",
    "notosans-regular.ttf",
    "notosans-regular.otf",
    "freesans.ttf",
    "freesans.otf",
    "arial.ttf",
    "roboto-regular.ttf",
    "opensans-regular.ttf",
    "ubuntu-r.ttf",
    "cantarell-regular.otf",
    "verdana.ttf",
    "segoeui.ttf",
    "vera.ttf",
    "helvetica.ttc",
];

/// Name fragments of faces that cannot label a chart (no Latin letters or digits).
const UNUSABLE: &[&str] = &[
    "symbol", "emoji", "math", "icon", "awesome", "wingding", "dingbat", "webding", "braille",
];
/// Name fragments of faces that work but look worse than a regular sans.
const DISFAVOURED: &[&str] = &[
    "bold",
    "italic",
    "oblique",
    "light",
    "thin",
    "black",
    "heavy",
    "condensed",
    "narrow",
    "mono",
    "serif",
    "extra",
    "semi",
    "medium",
];

/// Whether chart text can be rendered, and with which font.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FontStatus {
    /// This font file is registered; PNG and SVG charts carry all their text.
    Loaded(PathBuf),
    /// No usable font was found. PNG charts are drawn without text; SVG charts still carry
    /// their text (the viewer supplies the font). The string is a one-line notice saying so.
    Missing(String),
}

impl FontStatus {
    /// The one-line notice to show a user, if any.
    pub fn notice(&self) -> Option<&str> {
        match self {
            FontStatus::Loaded(_) => None,
            FontStatus::Missing(notice) => Some(notice),
        }
    }

    pub(crate) fn is_loaded(&self) -> bool {
        matches!(self, FontStatus::Loaded(_))
    }
}

/// Find and register a chart font on the first call; later calls return the same answer.
pub fn font_status() -> &'static FontStatus {
    static STATUS: OnceLock<FontStatus> = OnceLock::new();
    STATUS.get_or_init(find_and_register)
}

fn find_and_register() -> FontStatus {
    let mut problems = Vec::new();
    if let Some(path) = std::env::var_os(FONT_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        match register(&path) {
            Ok(()) => return FontStatus::Loaded(path),
            Err(e) => {
                let problem = format!("{FONT_ENV}={}: {e}", path.display());
                tracing::warn!("chart font not usable, searching the system instead: {problem}");
                problems.push(problem);
            }
        }
    }
    let mut candidates = Vec::new();
    let mut budget = MAX_ENTRIES;
    for dir in font_dirs() {
        collect_fonts(&dir, 0, &mut budget, &mut candidates);
    }
    candidates.sort();
    candidates.dedup_by(|a, b| a.1 == b.1);
    for (_, path) in candidates.into_iter().take(MAX_ATTEMPTS) {
        match register(&path) {
            Ok(()) => return FontStatus::Loaded(path),
            Err(e) => problems.push(format!("{}: {e}", path.display())),
        }
    }
    let mut notice = format!(
        "no usable TrueType font found, so PNG charts have no text (SVG charts do): \
         install one (e.g. the Debian package fonts-dejavu-core) or set {FONT_ENV}=/path/to/font.ttf"
    );
    if !problems.is_empty() {
        notice.push_str(&format!(" [tried {}]", problems.join("; ")));
    }
    FontStatus::Missing(notice)
}

/// Register `path` as the normal face and, when a bold sibling exists, as the bold face.
fn register(path: &Path) -> Result<(), String> {
    register_face(path, FontStyle::Normal)?;
    if let Some(bold) = bold_sibling(path) {
        // A missing or broken bold face is fine: plotters falls back to the normal one.
        let _ = register_face(&bold, FontStyle::Bold);
    }
    Ok(())
}

fn register_face(path: &Path, style: FontStyle) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a file".into());
    }
    if meta.len() > MAX_FONT_BYTES {
        return Err(format!("larger than {} MiB", MAX_FONT_BYTES >> 20));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if !has_font_magic(&bytes) {
        return Err("not a TrueType/OpenType font".into());
    }
    // plotters keeps registered fonts for the life of the process and wants `'static` data;
    // this runs at most a handful of times per process (see `font_status`).
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font(FAMILY, style, bytes).map_err(|_| "not a TrueType/OpenType font".to_string())
}

/// sfnt version tags of TrueType, OpenType (CFF) and collection files. Checked before the
/// bytes are handed to plotters, which keeps them forever.
fn has_font_magic(bytes: &[u8]) -> bool {
    matches!(
        bytes.get(..4),
        Some([0, 1, 0, 0] | b"true" | b"OTTO" | b"ttcf")
    )
}

fn bold_sibling(path: &Path) -> Option<PathBuf> {
    let stem = path.file_stem()?.to_str()?;
    let ext = path.extension()?.to_str()?;
    let names = if stem.contains("Regular") {
        vec![stem.replace("Regular", "Bold")]
    } else {
        vec![
            format!("{stem}-Bold"),
            format!("{stem}Bold"),
            format!("{stem}bd"),
        ]
    };
    names
        .into_iter()
        .map(|name| path.with_file_name(format!("{name}.{ext}")))
        .find(|p| p.is_file())
}

/// Font directories in search order: user directories first, then system ones.
fn font_dirs() -> Vec<PathBuf> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let mut dirs = Vec::new();
    match std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        Some(data) => dirs.push(PathBuf::from(data).join("fonts")),
        None => {
            if let Some(h) = &home {
                dirs.push(h.join(".local/share/fonts"));
            }
        }
    }
    if let Some(h) = &home {
        dirs.push(h.join(".fonts"));
        dirs.push(h.join("Library/Fonts"));
    }
    let data_dirs = std::env::var("XDG_DATA_DIRS")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "/usr/local/share:/usr/share".to_string());
    for d in data_dirs.split(':').filter(|d| !d.is_empty()) {
        dirs.push(Path::new(d).join("fonts"));
    }
    for d in [
        "/usr/share/fonts",
        "/usr/local/share/fonts",
        "/usr/X11R6/lib/X11/fonts",
        "/Library/Fonts",
        "/System/Library/Fonts",
    ] {
        dirs.push(PathBuf::from(d));
    }
    if let Some(windir) = std::env::var_os("WINDIR") {
        dirs.push(PathBuf::from(windir).join("Fonts"));
    }
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let new = !seen.contains(d);
        seen.push(d.clone());
        new
    });
    dirs
}

/// Walk `dir` (bounded in depth and entries) and collect `(rank, path)` of font files.
fn collect_fonts(dir: &Path, depth: usize, budget: &mut usize, out: &mut Vec<(u32, PathBuf)>) {
    if depth > MAX_DEPTH || *budget == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            collect_fonts(&path, depth + 1, budget, out);
        } else if let Some(rank) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| rank(&n.to_ascii_lowercase()))
        {
            out.push((rank, path));
        }
    }
}

/// Lower is better; `None` for files that are not fonts or cannot label a chart.
fn rank(name: &str) -> Option<u32> {
    let is_font = [".ttf", ".otf", ".ttc"]
        .iter()
        .any(|ext| name.ends_with(ext));
    if !is_font || UNUSABLE.iter().any(|u| name.contains(u)) {
        return None;
    }
    if let Some(i) = PREFERRED.iter().position(|p| *p == name) {
        return Some(i as u32);
    }
    let mut rank = 100;
    if !name.contains("sans") {
        rank += 100;
    }
    rank += 50 * DISFAVOURED.iter().filter(|d| name.contains(*d)).count() as u32;
    Some(rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranking_prefers_regular_sans_faces() {
        assert_eq!(rank("dejavusans.ttf"), Some(0));
        assert!(rank("liberationsans-regular.ttf") < rank("somesans-regular.ttf"));
        assert!(rank("somesans-regular.ttf") < rank("somesans-bold.ttf"));
        assert!(rank("somesans-bold.ttf") < rank("someserif-bold.ttf"));
        assert_eq!(rank("opensymbol.ttf"), None);
        assert_eq!(rank("notocoloremoji.ttf"), None);
        assert_eq!(rank("readme.txt"), None);
    }

    #[test]
    fn only_font_files_are_registered() {
        assert!(has_font_magic(&[0, 1, 0, 0, 9]));
        assert!(has_font_magic(b"OTTO...."));
        assert!(!has_font_magic(b"<html>"));
        assert!(!has_font_magic(b""));
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("FakeSans.ttf");
        std::fs::write(&fake, b"not a font at all").unwrap();
        assert!(register_face(&fake, FontStyle::Normal).is_err());
    }

    #[test]
    fn the_walk_finds_fonts_in_subfolders_best_first() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("truetype/dejavu");
        std::fs::create_dir_all(&sub).unwrap();
        for name in ["OpenSymbol.ttf", "FooSerif-Bold.ttf", "notes.txt"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        std::fs::write(sub.join("DejaVuSans.ttf"), b"x").unwrap();
        let mut found = Vec::new();
        let mut budget = MAX_ENTRIES;
        collect_fonts(dir.path(), 0, &mut budget, &mut found);
        found.sort();
        let names: Vec<_> = found
            .iter()
            .map(|(_, p)| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["DejaVuSans.ttf", "FooSerif-Bold.ttf"]);
    }

    #[test]
    fn bold_sibling_naming() {
        let dir = tempfile::tempdir().unwrap();
        let regular = dir.path().join("FooSans-Regular.ttf");
        std::fs::write(&regular, b"x").unwrap();
        assert_eq!(bold_sibling(&regular), None);
        let bold = dir.path().join("FooSans-Bold.ttf");
        std::fs::write(&bold, b"x").unwrap();
        assert_eq!(bold_sibling(&regular), Some(bold));
    }
}
