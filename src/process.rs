//! What the whole process shares, whichever front end runs in it: the exit codes, the flags
//! the signal handlers set, and the gate that lets a second Ctrl+C end the process only
//! between checkpoint writes (a checkpoint being written is committed whole first).
//!
//! Signals: SIGINT, SIGTERM and SIGQUIT save a checkpoint and stop (a second one leaves at
//! once, after any checkpoint write in flight); SIGUSR1 writes a checkpoint; SIGHUP (the
//! terminal went away) leaves the run going, headless, its output in `RUN_DIR/cockpit.out`.

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1};
use signal_hook::SigId;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::Arc;

pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILURE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
/// A rank of a data-parallel job that ended because another rank failed (the launcher
/// names the rank that failed first on its own).
pub const EXIT_PEER_FAILED: i32 = 3;
pub const EXIT_INTERRUPTED: i32 = 130;

/// The signals that save and stop (twice: leave now).
pub const TERMINATE: [i32; 3] = [SIGINT, SIGTERM, SIGQUIT];

/// Flags set by the signal handlers, read by the front end's loop.
#[derive(Clone, Default)]
pub struct SignalFlags {
    /// SIGINT/SIGTERM/SIGQUIT: save a checkpoint and stop.
    pub terminate: Arc<AtomicBool>,
    /// The number of the signal that set `terminate` (0: none yet).
    pub terminate_signal: Arc<AtomicI32>,
    /// SIGUSR1: write a checkpoint now.
    pub checkpoint: Arc<AtomicBool>,
    /// SIGHUP: the controlling terminal went away.
    pub hangup: Arc<AtomicBool>,
}

impl SignalFlags {
    /// "SIGINT", "SIGTERM", … for the signal that set `terminate`.
    pub fn terminate_name(&self) -> &'static str {
        signal_name(self.terminate_signal.load(Ordering::SeqCst))
    }
}

/// A signal's name, for logs.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGQUIT => "SIGQUIT",
        SIGHUP => "SIGHUP",
        SIGUSR1 => "SIGUSR1",
        _ => "a signal",
    }
}

/// Route the signals into `flags` (the headless front end, or the run after the dashboard's
/// terminal hung up).
pub fn register(flags: &SignalFlags) -> std::io::Result<Vec<SigId>> {
    let mut ids = Vec::new();
    for sig in TERMINATE {
        ids.push(register_terminate(
            sig,
            flags.terminate.clone(),
            flags.terminate_signal.clone(),
        )?);
    }
    ids.push(signal_hook::flag::register(
        SIGUSR1,
        flags.checkpoint.clone(),
    )?);
    ids.push(signal_hook::flag::register(SIGHUP, flags.hangup.clone())?);
    Ok(ids)
}

/// The first `sig` sets `flag` (and records which signal in `which`); a second one, while
/// the flag stands, ends the process with [`EXIT_INTERRUPTED`] — once any checkpoint being
/// written has been committed ([`exit_after_commit`]).
pub fn register_terminate(
    sig: i32,
    flag: Arc<AtomicBool>,
    which: Arc<AtomicI32>,
) -> std::io::Result<SigId> {
    let action = move || {
        if flag.swap(true, Ordering::SeqCst) {
            exit_after_commit(EXIT_INTERRUPTED);
        } else {
            which.store(sig, Ordering::SeqCst);
        }
    };
    // SAFETY: the action only touches atomics and may call _exit, both async-signal-safe.
    unsafe { signal_hook::low_level::register(sig, action) }
}

const IDLE: u8 = 0;
const WRITING: u8 = 1;
const EXIT_PENDING: u8 = 2;
static COMMIT: AtomicU8 = AtomicU8::new(IDLE);
static EXIT_CODE: AtomicI32 = AtomicI32::new(EXIT_INTERRUPTED);

/// Held while a checkpoint is written: a request to leave (a second Ctrl+C) waits for it to
/// be dropped, i.e. for the checkpoint to be committed (or given up) whole.
pub struct CommitGuard(());

impl CommitGuard {
    pub fn begin() -> CommitGuard {
        let _ = COMMIT.compare_exchange(IDLE, WRITING, Ordering::SeqCst, Ordering::SeqCst);
        CommitGuard(())
    }
}

impl Drop for CommitGuard {
    fn drop(&mut self) {
        if COMMIT.swap(IDLE, Ordering::SeqCst) == EXIT_PENDING {
            // SAFETY: _exit ends the process; nothing runs after it.
            unsafe { libc::_exit(EXIT_CODE.load(Ordering::SeqCst)) }
        }
    }
}

/// End the process with `code` now, or, while a checkpoint is being written, as soon as it
/// is committed. Async-signal-safe (atomics and `_exit` only).
pub fn exit_after_commit(code: i32) {
    EXIT_CODE.store(code, Ordering::SeqCst);
    if COMMIT
        .compare_exchange(WRITING, EXIT_PENDING, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        // SAFETY: _exit ends the process; nothing runs after it.
        unsafe { libc::_exit(code) }
    }
}

/// The terminal is gone: send this process's stdout and stderr to `path` (appended), so
/// that what the run prints from now on is kept and writing it cannot fail.
pub fn redirect_output(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: dup2 onto the standard descriptors with a file we hold open.
        if unsafe { libc::dup2(file.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
