//! Best-effort terminal output. The run dir's records are the source of truth; stdout and
//! stderr are a courtesy. A write that fails (a closed pipe: Rust ignores SIGPIPE, so the
//! write returns EPIPE; a full device; a vanished terminal) never panics and never stops
//! the work: it is dropped, and the first failure of each stream is said once in the log
//! (the run dir's `cockpit.log` during a run).
//!
//! Use [`outln!`](crate::outln) / [`errln!`](crate::errln) (and [`out!`](crate::out) /
//! [`err!`](crate::err)) instead of `println!`/`eprintln!`, which panic when the write fails,
//! and [`BestEffort`] where a `dyn Write` is wanted.

use std::fmt::Arguments;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

/// Which standard stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn flag(self) -> &'static AtomicBool {
        match self {
            Stream::Stdout => &STDOUT_GONE,
            Stream::Stderr => &STDERR_GONE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }

    /// Whether a write to this stream has failed (the terminal or the reader went away).
    pub fn gone(self) -> bool {
        self.flag().load(Ordering::Relaxed)
    }
}

/// Note a failed write: said once per stream, in the log.
fn note_gone(stream: Stream, e: &io::Error) {
    if !stream.flag().swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "{} went away ({e}): terminal output from here on is dropped; the run goes on and its records stay in the run dir",
            stream.name()
        );
    }
}

fn write_to(stream: Stream, args: Arguments<'_>) -> bool {
    let r = match stream {
        Stream::Stdout => {
            let mut o = io::stdout().lock();
            o.write_fmt(args).and_then(|()| o.flush())
        }
        Stream::Stderr => io::stderr().lock().write_fmt(args),
    };
    match r {
        Ok(()) => true,
        Err(e) => {
            note_gone(stream, &e);
            false
        }
    }
}

/// Write to stdout; false (and noted once) when the write failed.
pub fn out(args: Arguments<'_>) -> bool {
    write_to(Stream::Stdout, args)
}

/// Write to stderr; false (and noted once) when the write failed.
pub fn err(args: Arguments<'_>) -> bool {
    write_to(Stream::Stderr, args)
}

/// Write raw bytes to stdout and flush; false when the write failed (the reader is gone).
pub fn out_bytes(bytes: &[u8]) -> bool {
    let mut o = io::stdout().lock();
    match o.write_all(bytes).and_then(|()| o.flush()) {
        Ok(()) => true,
        Err(e) => {
            note_gone(Stream::Stdout, &e);
            false
        }
    }
}

/// A writer over stdout or stderr whose failures are dropped (and noted once): for code that
/// takes a `dyn Write` (the headless progress lines, the monitor).
pub struct BestEffort(pub Stream);

impl BestEffort {
    pub fn stdout() -> Self {
        BestEffort(Stream::Stdout)
    }
    pub fn stderr() -> Self {
        BestEffort(Stream::Stderr)
    }
}

impl Write for BestEffort {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let r = match self.0 {
            Stream::Stdout => io::stdout().lock().write_all(buf),
            Stream::Stderr => io::stderr().lock().write_all(buf),
        };
        if let Err(e) = r {
            note_gone(self.0, &e);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let r = match self.0 {
            Stream::Stdout => io::stdout().lock().flush(),
            Stream::Stderr => io::stderr().lock().flush(),
        };
        if let Err(e) = r {
            note_gone(self.0, &e);
        }
        Ok(())
    }
}

/// `println!` that never panics: a failed write is dropped (see the module docs).
#[macro_export]
macro_rules! outln {
    () => {
        {
            let _ = $crate::stdio::out(format_args!("\n"));
        }
    };
    ($($arg:tt)*) => {
        {
            let _ = $crate::stdio::out(format_args!("{}\n", format_args!($($arg)*)));
        }
    };
}

/// `print!` that never panics.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        {
            let _ = $crate::stdio::out(format_args!($($arg)*));
        }
    };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => {
        {
            let _ = $crate::stdio::err(format_args!("\n"));
        }
    };
    ($($arg:tt)*) => {
        {
            let _ = $crate::stdio::err(format_args!("{}\n", format_args!($($arg)*)));
        }
    };
}

/// `eprint!` that never panics.
#[macro_export]
macro_rules! err {
    ($($arg:tt)*) => {
        {
            let _ = $crate::stdio::err(format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_effort_reports_full_length() {
        let mut w = BestEffort::stderr();
        assert_eq!(w.write(b"x").ok(), Some(1));
        assert!(w.flush().is_ok());
    }
}
