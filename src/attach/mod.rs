//! Attach a dashboard to a run that trains without one (`cockpit train --no-tui` under
//! nohup, then `cockpit attach RUN_DIR` over SSH), and steer it safely.
//!
//! The training process runs a [`Server`]: an owner-only Unix socket, `RUN_DIR/control.sock`
//! (or `RUN_DIR/.control/control.sock` when the run dir is not mode 0700), that fans the
//! engine's events out to any number of viewers without ever blocking the engine, and passes
//! their commands on after checking them like key presses. A viewer ([`connect`]) replays the
//! history from `metrics.jsonl`, then follows the live events; leaving it never stops the run.
//! A finished run, with no socket left, is replayed read-only ([`replay`]).
//! [`run_attach`] is the whole `cockpit attach` command. The wire format is in [`protocol`].

mod client;
mod pause_owners;
mod peer;
pub mod protocol;
mod server;

pub use client::{connect, replay, Attached, Connection};
pub use peer::{my_uid, peer_cred, PeerCred};
pub use server::{RelayGuard, Relayed, Server, ServerOptions, ServerStats, StatsHandle};

use crate::engine::events::FinishReason;
use crate::headless;
use crate::process::SignalFlags;
use crate::process::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
use crate::tui::{self, TuiExit, TuiOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The socket's file name.
pub const SOCKET_FILE: &str = "control.sock";
/// The private directory the socket goes into when the run dir is not mode 0700.
pub const PRIVATE_DIR: &str = ".control";

/// Why attaching or serving failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// No socket, or only a stale one: the training process is gone (or never served).
    #[error("no live run here: {} is missing or nobody answers; the run may have been killed", .0.display())]
    NoLiveRun(PathBuf),
    /// Something accepted the connection but did not greet in time.
    #[error("no live run here: {} accepted the connection but does not answer ({detail}); the run may be stuck or stopped", socket.display())]
    NotAnswering {
        /// The socket tried.
        socket: PathBuf,
        /// What happened.
        detail: String,
    },
    /// The socket is served by another user: never trusted.
    #[error("{}: served by uid {uid}, not by us (uid {ours}); refusing to attach", socket.display())]
    ForeignServer {
        /// The socket tried.
        socket: PathBuf,
        /// The server's uid.
        uid: u32,
        /// Ours.
        ours: u32,
    },
    /// The server turned us away.
    #[error("{}: the server refused us: {message}", socket.display())]
    Refused {
        /// The socket tried.
        socket: PathBuf,
        /// What it said.
        message: String,
    },
    /// The first line was not a hello.
    #[error("{}: not a cockpit control socket ({detail})", socket.display())]
    BadHello {
        /// The socket tried.
        socket: PathBuf,
        /// What was wrong.
        detail: String,
    },
    /// A cockpit of another version.
    #[error("{}: the run speaks attach protocol {theirs}, this cockpit speaks {ours}; attach with the cockpit that started it", socket.display())]
    Protocol {
        /// The socket tried.
        socket: PathBuf,
        /// The server's version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// Replay asked for, but there is no `metrics.jsonl`.
    #[error("{}: no such file; is this a run directory?", .0.display())]
    NoHistory(PathBuf),
    /// Replay asked for, but the history does not end with the run finishing.
    #[error("{}: the run has not finished (metrics.jsonl does not end with a finished event)", .0.display())]
    NotFinished(PathBuf),
    /// Another process already serves this run dir.
    #[error("{}: another cockpit process is serving this run dir", .0.display())]
    InUse(PathBuf),
    /// Something other than a socket sits where the socket goes.
    #[error("{}: exists and is not a socket; refusing to replace it", .0.display())]
    NotASocket(PathBuf),
    /// Not a directory.
    #[error("{}: not a directory", .0.display())]
    NotADirectory(PathBuf),
    /// The socket (or the directory it is in) may not be opened by us: the run belongs to
    /// another user, or its directory is private.
    #[error("{}: {source}; {owner}: attach as the user who started the run", path.display())]
    Denied {
        /// The socket or directory we may not open.
        path: PathBuf,
        /// Who owns the run dir, as far as we can tell.
        owner: String,
        /// The error.
        source: io::Error,
    },
    /// The run dir (or its private dir) belongs to another user.
    #[error("{}: owned by uid {owner}, not by us (uid {ours})", path.display())]
    NotOwner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Us.
        ours: u32,
    },
    /// A file system or socket error.
    #[error("{}: {source}", path.display())]
    Io {
        /// What it was about.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A thread could not be started.
    #[error("cannot start a thread: {0}")]
    Thread(io::Error),
}

impl AttachError {
    fn io(path: &Path) -> impl FnOnce(io::Error) -> AttachError + '_ {
        move |source| AttachError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Whether this means "no live run in this dir" (then a finished run can be replayed).
    pub fn is_no_live_run(&self) -> bool {
        matches!(
            self,
            AttachError::NoLiveRun(_) | AttachError::NotAnswering { .. }
        )
    }
}

/// Where a viewer looks for the socket, in order.
pub fn socket_candidates(run_dir: &Path) -> [PathBuf; 2] {
    [
        run_dir.join(SOCKET_FILE),
        run_dir.join(PRIVATE_DIR).join(SOCKET_FILE),
    ]
}

/// The socket path to name in messages: the private one if it exists, else the usual one.
fn display_socket(run_dir: &Path) -> PathBuf {
    let [plain, private] = socket_candidates(run_dir);
    if std::fs::symlink_metadata(&private).is_ok() && std::fs::symlink_metadata(&plain).is_err() {
        private
    } else {
        plain
    }
}

/// The live run in `run_dir` if a server answers, else a replay if the run finished.
/// Without either, the error from trying the socket ([`AttachError::is_no_live_run`]).
pub fn open(run_dir: &Path, allow_stop: bool) -> Result<Attached, AttachError> {
    match connect(run_dir, allow_stop) {
        Ok(a) => Ok(a),
        Err(live) if live.is_no_live_run() => match replay(run_dir) {
            Ok(a) => Ok(a),
            Err(AttachError::NotFinished(_) | AttachError::NoHistory(_)) => Err(live),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// How `cockpit attach` shows the run.
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// The dashboard's settings; `None` prints progress lines on stderr instead (like
    /// `--no-tui`). The event log file (`log_path`) is never written by a viewer: the training
    /// process owns `events.log`.
    pub tui: Option<TuiOptions>,
    /// Let this viewer stop the run (the dashboard's quit popup sends Stop). Off, quitting
    /// only detaches.
    pub allow_stop: bool,
    /// Progress line interval without the dashboard.
    pub log_every: Duration,
    /// This viewer owns the run (the `--gpus N` launcher showing rank 0): the dashboard
    /// behaves as in `cockpit train` — `q` asks whether to save and stop — instead of
    /// detaching.
    pub owner: bool,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            tui: Some(TuiOptions::default()),
            allow_stop: false,
            log_every: Duration::from_secs(10),
            owner: false,
        }
    }
}

/// `cockpit attach RUN_DIR`: follow the live run, or replay a finished one read-only.
///
/// Exit codes: 0 after detaching or once the run finished; 2 when there is no live run and
/// no finished history ("no live run here: …"); 1 when the connection failed otherwise or the
/// run went away without finishing.
pub fn run_attach(run_dir: &Path, opts: AttachOptions) -> anyhow::Result<i32> {
    match std::fs::metadata(run_dir) {
        Ok(m) if m.is_dir() => {}
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            crate::errln!(
                "cockpit attach: {}: permission denied ({e}); attach as the user who started the run",
                run_dir.display()
            );
            return Ok(EXIT_USAGE);
        }
        _ => {
            crate::errln!("cockpit attach: {}: not a directory", run_dir.display());
            return Ok(EXIT_USAGE);
        }
    }
    let attached = match open(run_dir, opts.allow_stop) {
        Ok(a) => a,
        Err(e) if e.is_no_live_run() => {
            crate::errln!("cockpit attach: {e}");
            if !run_dir.join(crate::report::METRICS_FILE).is_file() {
                crate::errln!(
                    "  (there is no {} either: is {} a run directory?)",
                    crate::report::METRICS_FILE,
                    run_dir.display()
                );
            }
            return Ok(EXIT_USAGE);
        }
        Err(e @ AttachError::Denied { .. }) => {
            crate::errln!("cockpit attach: {e}");
            return Ok(EXIT_USAGE);
        }
        Err(e) => {
            crate::errln!("cockpit attach: {e}");
            return Ok(EXIT_FAILURE);
        }
    };
    for w in &attached.warnings {
        tracing::warn!("attach: {w}");
    }
    let live = attached.hello.clone();
    match &live {
        Some(h) => crate::errln!(
            "attached to {} (pid {}): {} events of history{}",
            h.run_dir,
            h.pid,
            attached.backfilled,
            if opts.allow_stop {
                ""
            } else {
                "; leaving never stops the run"
            }
        ),
        None => crate::errln!(
            "{}: the run has finished; replaying it read-only",
            run_dir.display()
        ),
    }
    let Attached {
        events,
        commands,
        telemetry,
        connection,
        ..
    } = attached;
    let finished: Option<Option<FinishReason>> = match opts.tui {
        Some(tui_opts) => {
            let tui_opts = TuiOptions {
                log_path: None,
                attached: !opts.owner,
                allow_stop: opts.allow_stop,
                // a finished run's history: nothing can be steered, and the header says so
                source: live
                    .is_none()
                    .then(|| "replay of a finished run · read-only".to_string())
                    .or(tui_opts.source),
                ..tui_opts
            };
            let exit = tui::run_training(events, commands, telemetry, tui_opts);
            connection.detach();
            match exit? {
                TuiExit::Finished { reason } => Some(Some(reason)),
                TuiExit::EngineGone => None,
                TuiExit::StopRequested { .. }
                | TuiExit::Interrupted
                | TuiExit::Closed
                | TuiExit::HangUp
                | TuiExit::Detached => Some(None),
            }
        }
        None => {
            // no signal handlers: Ctrl+C ends this viewer (which detaches), never the run
            let outcome = headless::run(
                events,
                commands,
                Some(telemetry),
                &SignalFlags::default(),
                opts.log_every,
                headless::Output {
                    out: &mut crate::stdio::BestEffort::stderr(),
                    hangup_log: None,
                    run: None,
                },
            );
            connection.detach();
            outcome.finished.map(Some)
        }
    };
    Ok(match (finished, live) {
        (Some(Some(_)), _) => EXIT_OK,
        (Some(None), Some(h)) => {
            crate::errln!(
                "detached from {}; the run goes on (pid {})",
                run_dir.display(),
                h.pid
            );
            EXIT_OK
        }
        (Some(None), None) => EXIT_OK,
        (None, _) => {
            crate::errln!(
                "cockpit attach: {}: the control socket closed before the run finished; the run may have been killed",
                run_dir.display()
            );
            EXIT_FAILURE
        }
    })
}
