//! A TensorBoard event file: `RUN_DIR/tb/events.out.tfevents.<secs>.<host>.<pid>.<n>`, one
//! per process start (a resumed run appends a new file; TensorBoard merges them by step).

use super::proto::{self, EventBody, Msg};
use super::tfrecord;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

static FILE_SEQ: AtomicU32 = AtomicU32::new(0);

/// This machine's name, as TensorBoard puts it in event file names.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length; gethostname NUL-terminates or
    // truncates within it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if rc != 0 || name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub struct EventFile {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventFile {
    /// Create a new event file in `dir` (created if missing) and write its version record.
    pub fn create(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let wall = now_secs();
        let name = format!(
            "events.out.tfevents.{}.{}.{}.{}",
            wall as u64,
            hostname(),
            std::process::id(),
            FILE_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::options().create_new(true).write(true).open(&path)?;
        let mut me = Self {
            path,
            out: BufWriter::new(file),
        };
        me.record(&proto::event(wall, 0, EventBody::FileVersion))?;
        me.flush()?;
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> io::Result<()> {
        tfrecord::write_record(&mut self.out, data)
    }

    /// One `Event` holding `values` at `step`.
    pub fn summary(&mut self, wall: f64, step: u64, values: Vec<Msg>) -> io::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.record(&proto::event(wall, step, EventBody::Summary(values)))
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}
