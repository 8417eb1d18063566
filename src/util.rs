//! Small shared helpers.

use std::fs::File;
use std::io::Write;
use std::path::Path;

/// A device request: CPU, or a CUDA ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Cuda(usize),
}

/// Parse `auto | cpu | cuda | cuda:N`.
pub fn parse_device(s: &str) -> Option<DeviceSpec> {
    match s {
        "auto" => Some(DeviceSpec::Auto),
        "cpu" => Some(DeviceSpec::Cpu),
        "cuda" | "gpu" => Some(DeviceSpec::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(DeviceSpec::Cuda),
    }
}

/// "1.2k", "3.4M" style counts.
pub fn human_count(x: f64) -> String {
    let a = x.abs();
    if a >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// "1h02m", "3m05s", "42s".
pub fn human_duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "?".into();
    }
    let s = secs.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// `1.234 ± 0.012` with `decimals` decimals, or the value alone when `se` is not finite.
pub fn plus_minus(v: f64, se: f64, decimals: usize) -> String {
    if se.is_finite() {
        format!("{v:.decimals$} ± {se:.decimals$}")
    } else {
        format!("{v:.decimals$}")
    }
}

/// Bytes as GB with one decimal.
pub fn gb(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1e9)
}

/// Lower-case hex of `bytes` (digests in manifests and cache keys).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Write a file atomically: temp file in the same dir, fsync, rename over, fsync the dir.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        // no leftover holding the last free bytes
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

/// Read a small text file that must be a regular file of at most `max` bytes: a FIFO, a
/// device or a directory is refused at once instead of blocking (or reading forever).
pub fn read_regular_file(path: &Path, max: u64) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, a device or a directory?)",
        ));
    }
    if meta.len() > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} bytes: larger than the {max} bytes allowed here",
                meta.len()
            ),
        ));
    }
    std::fs::read_to_string(path)
}

/// Open `path` for reading if it is a regular file: a FIFO, a device or a directory is an
/// error (opening a FIFO would block until a writer comes; reading a device may never end).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, a device or a directory?)",
        ));
    }
    File::open(path)
}

/// fsync a directory (after a rename in it, so that the rename survives a crash).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}
