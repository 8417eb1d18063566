//! The viewer's side: history from `metrics.jsonl`, then live events from the control
//! socket, merged into one engine-style event stream for the dashboard.
//!
//! The viewer registers with the server first and reads the file second, so nothing between
//! the two is lost; events that arrive live but were already in the file are recognised
//! (same JSON, ignoring `dropped_before`) and skipped. The engine buffers Step lines before
//! writing them, so the last few steps before the moment of attaching may be missing from
//! the charts; every other event is flushed at once and is never missed.

use super::peer::{my_uid, peer_cred};
use super::protocol::{
    encode, read_line, ClientMessage, Hello, Line, ServerMessage, PROTOCOL_VERSION,
};
use super::{socket_candidates, AttachError};
use crate::advisor::MonitorUpdate;
use crate::engine::events::{self, Command, Event, EventRx, EventTx};
use crate::report::{load_telemetry, METRICS_FILE, TELEMETRY_FILE};
use serde_json::Value;
use std::collections::VecDeque;
use std::io::{self, BufReader, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How long a server has to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Room for live Step events in the dashboard's channel, beyond the history.
const LIVE_STEP_ROOM: usize = 4096;
/// File events kept to recognise live duplicates (only the last few can overlap).
const OVERLAP_WINDOW: usize = 8192;
/// Longest line taken from the server (our own process: the limit only bounds memory; a
/// telemetry update listing many GPU processes can exceed the 64 KiB that viewers may send).
const MAX_SERVER_LINE_BYTES: usize = 4 * 1024 * 1024;
/// Longest `metrics.jsonl` line read (a run's summary line can be long; this is generous).
const MAX_FILE_LINE_BYTES: usize = 16 * 1024 * 1024;

/// A dashboard's view of a run: attached live, or a replay of a finished one.
///
/// Move the receivers and the sender into the dashboard; keep [`Attached::connection`] until
/// it closes (dropping it detaches).
pub struct Attached {
    /// History first, then live events. The channel closes when the server goes away.
    pub events: EventRx,
    /// Commands for the run (live only; Stop is dropped unless attached with `allow_stop`).
    pub commands: Sender<Command>,
    /// The training process's telemetry and advice (live), or its recorded samples (replay).
    pub telemetry: Receiver<MonitorUpdate>,
    /// The server's greeting; `None` for a replay.
    pub hello: Option<Hello>,
    /// Events read from `metrics.jsonl`.
    pub backfilled: usize,
    /// The history holds a `Finished` event for the latest run start.
    pub finished: bool,
    /// Problems with the history that did not stop it (e.g. an incomplete last line).
    pub warnings: Vec<String>,
    /// The link to the server; dropping it detaches.
    pub connection: Connection,
}

impl Attached {
    /// Whether this follows a live run (false: a read-only replay).
    pub fn is_live(&self) -> bool {
        self.hello.is_some()
    }
}

/// The socket and the threads behind an [`Attached`]. Dropping it detaches: the socket is shut
/// down (the run goes on) and the event channel closes.
pub struct Connection {
    socket: Option<UnixStream>,
    reader: Option<JoinHandle<()>>,
    /// A replay keeps the other ends open, so the dashboard neither reports a dead engine
    /// for a command nor a telemetry outage.
    _replay_ends: Option<(Receiver<Command>, Sender<MonitorUpdate>)>,
}

impl Connection {
    /// Detach now (the same as dropping it).
    pub fn detach(self) {}
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(socket) = &self.socket {
            let _ = socket.shutdown(Shutdown::Both);
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// Attach to the live run in `run_dir`: history from `metrics.jsonl`, then live events.
///
/// With `allow_stop` false, `Command::Stop` is never sent to the run (the dashboard's quit
/// popup sends one): it is dropped, logged, and a warning appears in the event stream.
/// [`AttachError::NoLiveRun`] when no socket answers.
pub fn connect(run_dir: &Path, allow_stop: bool) -> Result<Attached, AttachError> {
    let (socket, stream, reader, hello) = dial(run_dir)?;
    let history = read_history(&run_dir.join(METRICS_FILE))?;
    let write_stream = stream.try_clone().map_err(AttachError::io(&socket))?;
    let (tx, rx) = events::channel(history.steps + LIVE_STEP_ROOM);
    for ev in history.events {
        tx.send(ev);
    }
    let backfilled = history.count;
    let sink = Arc::new(Sink {
        tx: Mutex::new(Some(tx)),
        last_step: AtomicU64::new(history.last_step),
    });
    let (tel_tx, tel_rx) = mpsc::channel();
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let overlap = Overlap::new(history.tail);
    let reader_sink = sink.clone();
    let reader_handle = thread::Builder::new()
        .name("cockpit-attach-follow".into())
        .spawn(move || follow(reader, overlap, &reader_sink, &tel_tx))
        .map_err(AttachError::Thread)?;
    let connection = Connection {
        socket: Some(stream),
        reader: Some(reader_handle),
        _replay_ends: None,
    };
    // on failure, dropping `connection` ends the reader
    thread::Builder::new()
        .name("cockpit-attach-send".into())
        .spawn(move || send_commands(write_stream, &cmd_rx, allow_stop, &sink))
        .map_err(AttachError::Thread)?;
    Ok(Attached {
        events: rx,
        commands: cmd_tx,
        telemetry: tel_rx,
        hello: Some(hello),
        backfilled,
        finished: history.finished,
        warnings: history.warnings,
        connection,
    })
}

/// Replay a finished run read-only: its whole `metrics.jsonl` (and recorded telemetry), then
/// the channel closes. [`AttachError::NotFinished`] when the history does not end the run.
pub fn replay(run_dir: &Path) -> Result<Attached, AttachError> {
    let path = run_dir.join(METRICS_FILE);
    if !path.is_file() {
        return Err(AttachError::NoHistory(path));
    }
    let history = read_history(&path)?;
    if !history.finished {
        return Err(AttachError::NotFinished(run_dir.to_path_buf()));
    }
    let (tx, rx) = events::channel(history.steps + 1);
    for ev in history.events {
        tx.send(ev);
    }
    let (tel_tx, tel_rx) = mpsc::channel();
    let mut warnings = history.warnings;
    let telemetry_path = run_dir.join(TELEMETRY_FILE);
    if telemetry_path.is_file() {
        match load_telemetry(&telemetry_path) {
            Ok(t) => {
                warnings.extend(t.warnings);
                for snapshot in t.snapshots {
                    let _ = tel_tx.send(MonitorUpdate {
                        snapshot,
                        ..MonitorUpdate::default()
                    });
                }
            }
            Err(e) => warnings.push(format!("telemetry not replayed: {e}")),
        }
    }
    let (cmd_tx, cmd_rx) = mpsc::channel();
    Ok(Attached {
        events: rx,
        commands: cmd_tx,
        telemetry: tel_rx,
        hello: None,
        backfilled: history.count,
        finished: true,
        warnings,
        connection: Connection {
            socket: None,
            reader: None,
            _replay_ends: Some((cmd_rx, tel_tx)),
        },
    })
}

/// Connect to the first candidate socket that answers as our own user's cockpit.
type Dialed = (PathBuf, UnixStream, BufReader<UnixStream>, Hello);

fn dial(run_dir: &Path) -> Result<Dialed, AttachError> {
    let mut hard_error = None;
    for socket in socket_candidates(run_dir) {
        // (Permission denied is not "missing": the run may be alive and another user's.)
        let denied = |source: io::Error| denied(run_dir, &socket, source);
        match std::fs::symlink_metadata(&socket) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                hard_error.get_or_insert(denied(e));
                continue;
            }
            Err(_) => continue,
            Ok(_) => {}
        }
        let stream = match UnixStream::connect(&socket) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                hard_error = Some(denied(e));
                continue;
            }
            // stale socket of a killed run
            Err(_) => continue,
        };
        match greet(&socket, stream) {
            Ok((stream, reader, hello)) => return Ok((socket, stream, reader, hello)),
            Err(e @ AttachError::NotAnswering { .. }) => {
                tracing::info!("attach: {e}");
                hard_error.get_or_insert(e);
            }
            Err(e) => {
                hard_error = Some(e);
            }
        }
    }
    Err(hard_error.unwrap_or_else(|| AttachError::NoLiveRun(super::display_socket(run_dir))))
}

/// [`AttachError::Denied`] for `socket` of `run_dir`, naming the run dir's owner.
fn denied(run_dir: &Path, socket: &Path, source: io::Error) -> AttachError {
    use std::os::unix::fs::MetadataExt;
    let me = my_uid();
    let owner = match std::fs::metadata(run_dir) {
        Ok(m) if m.uid() != me => format!(
            "{} belongs to uid {} (we are uid {me})",
            run_dir.display(),
            m.uid()
        ),
        Ok(_) => format!(
            "{} is ours but the socket is not open to us",
            run_dir.display()
        ),
        Err(_) => format!("{} cannot be read by us (uid {me})", run_dir.display()),
    };
    AttachError::Denied {
        path: socket.to_path_buf(),
        owner,
        source,
    }
}

/// Check who serves `socket` and read its hello.
fn greet(
    socket: &Path,
    stream: UnixStream,
) -> Result<(UnixStream, BufReader<UnixStream>, Hello), AttachError> {
    let me = my_uid();
    let peer = peer_cred(&stream).map_err(AttachError::io(socket))?;
    if peer.uid != me {
        return Err(AttachError::ForeignServer {
            socket: socket.to_path_buf(),
            uid: peer.uid,
            ours: me,
        });
    }
    stream
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(AttachError::io(socket))?;
    let mut reader = BufReader::new(stream.try_clone().map_err(AttachError::io(socket))?);
    let not_answering = |detail: String| AttachError::NotAnswering {
        socket: socket.to_path_buf(),
        detail,
    };
    let line = match read_line(&mut reader, MAX_SERVER_LINE_BYTES) {
        Ok(Some(Line::Complete(l))) => l,
        Ok(Some(Line::TooLong { bytes })) => {
            return Err(AttachError::BadHello {
                socket: socket.to_path_buf(),
                detail: format!("a {bytes}-byte first line"),
            })
        }
        Ok(None) => return Err(not_answering("it closed the connection".into())),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(not_answering(format!(
                "no greeting within {}s",
                HELLO_TIMEOUT.as_secs()
            )))
        }
        Err(e) => return Err(not_answering(e.to_string())),
    };
    let hello = match serde_json::from_slice::<ServerMessage>(&line) {
        Ok(ServerMessage::Hello(h)) => h,
        Ok(ServerMessage::Error { message }) => {
            return Err(AttachError::Refused {
                socket: socket.to_path_buf(),
                message,
            })
        }
        Ok(_) => {
            return Err(AttachError::BadHello {
                socket: socket.to_path_buf(),
                detail: "the first message is not a hello".into(),
            })
        }
        Err(e) => {
            return Err(AttachError::BadHello {
                socket: socket.to_path_buf(),
                detail: e.to_string(),
            })
        }
    };
    if hello.protocol != PROTOCOL_VERSION {
        return Err(AttachError::Protocol {
            socket: socket.to_path_buf(),
            theirs: hello.protocol,
            ours: PROTOCOL_VERSION,
        });
    }
    // from now on a quiet server is fine (a paused run sends nothing)
    stream
        .set_read_timeout(None)
        .map_err(AttachError::io(socket))?;
    Ok((stream, reader, hello))
}

/// `metrics.jsonl`, in file order.
struct History {
    events: Vec<Event>,
    /// Non-blank lines decoded.
    count: usize,
    steps: usize,
    last_step: u64,
    finished: bool,
    /// The last events, normalised (see [`normalise`]), to spot live duplicates.
    tail: VecDeque<Value>,
    warnings: Vec<String>,
}

fn read_history(path: &Path) -> Result<History, AttachError> {
    let mut h = History {
        events: Vec::new(),
        count: 0,
        steps: 0,
        last_step: 0,
        finished: false,
        tail: VecDeque::new(),
        warnings: Vec::new(),
    };
    let file = match crate::util::open_regular(path) {
        Ok(f) => f,
        // a run that has not written its first event yet
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(h),
        Err(e) => return Err(AttachError::io(path)(e)),
    };
    let mut reader = BufReader::new(file);
    let mut line_no = 0usize;
    while let Some(line) =
        read_line(&mut reader, MAX_FILE_LINE_BYTES).map_err(AttachError::io(path))?
    {
        line_no += 1;
        let bytes = match line {
            Line::Complete(b) => b,
            Line::TooLong { bytes } => {
                h.warnings.push(format!(
                    "{}:{line_no}: skipped a {bytes}-byte line",
                    path.display()
                ));
                continue;
            }
        };
        if bytes.trim_ascii().is_empty() {
            continue;
        }
        let decoded = serde_json::from_slice::<Value>(&bytes).and_then(|value| {
            let event = serde_json::from_value::<Event>(value.clone())?;
            Ok((value, event))
        });
        let (value, event) = match decoded {
            Ok(d) => d,
            Err(e) => {
                // the last line of a live run is often half-written
                h.warnings.push(format!(
                    "{}:{line_no}: skipped a line that does not decode ({e})",
                    path.display()
                ));
                continue;
            }
        };
        h.count += 1;
        h.last_step = event.step();
        match &event {
            Event::Step(_) => h.steps += 1,
            Event::RunStarted(_) => h.finished = false,
            Event::Finished { .. } => h.finished = true,
            _ => {}
        }
        if h.tail.len() == OVERLAP_WINDOW {
            h.tail.pop_front();
        }
        h.tail.push_back(normalise(value));
        h.events.push(event);
    }
    Ok(h)
}

/// An event's JSON without what differs between the file and the live stream (a Step's
/// `dropped_before`, which counts drops on the way to this consumer).
fn normalise(mut event: Value) -> Value {
    if let Some(o) = event.as_object_mut() {
        if o.get("event").and_then(Value::as_str) == Some("step") {
            o.remove("dropped_before");
        }
    }
    event
}

fn is_step(event: &Value) -> bool {
    event.get("event").and_then(Value::as_str) == Some("step")
}

/// Recognises the live events that the history already holds.
///
/// The history is a prefix of the run's events; the live stream is a suffix (less any Step
/// events dropped for a slow consumer) that began before the file was read. The first live
/// event is looked up in the history's tail; from there on, live events match the history in
/// order (skipping history Steps the live stream dropped) until the history runs out.
struct Overlap {
    tail: VecDeque<Value>,
    state: OverlapState,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum OverlapState {
    /// No live event seen yet.
    Unanchored,
    /// The next live event should match `tail[i]` or a later entry.
    At(usize),
    /// Past the history: everything is new.
    Done,
}

impl Overlap {
    fn new(tail: VecDeque<Value>) -> Self {
        let state = if tail.is_empty() {
            OverlapState::Done
        } else {
            OverlapState::Unanchored
        };
        Overlap { tail, state }
    }

    /// Whether this (normalised) live event was already in the history.
    fn seen(&mut self, event: &Value) -> bool {
        let found = match self.state {
            OverlapState::Done => return false,
            OverlapState::Unanchored => self.tail.iter().rposition(|t| t == event),
            OverlapState::At(mut i) => {
                while i < self.tail.len() && is_step(&self.tail[i]) && self.tail[i] != *event {
                    i += 1;
                }
                (i < self.tail.len() && self.tail[i] == *event).then_some(i)
            }
        };
        match found {
            Some(i) => {
                self.state = OverlapState::At(i + 1);
                true
            }
            None => {
                self.state = OverlapState::Done;
                self.tail = VecDeque::new();
                false
            }
        }
    }
}

/// Where live events go: the dashboard's channel, while the server is there.
struct Sink {
    tx: Mutex<Option<EventTx>>,
    last_step: AtomicU64,
}

impl Sink {
    /// False once the channel is closed (server gone) or the dashboard left.
    fn send(&self, event: Event) -> bool {
        self.last_step.store(event.step(), Ordering::Relaxed);
        let guard = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().is_some_and(|tx| tx.send(event))
    }

    /// A warning in the dashboard's event log (not from the engine: from this viewer).
    fn warn(&self, message: String) {
        let step = self.last_step.load(Ordering::Relaxed);
        let guard = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = guard.as_ref() {
            tx.send(Event::Warning { step, message });
        }
    }

    fn close(&self) {
        self.tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

/// Read the server's messages until it goes away.
fn follow(
    mut input: BufReader<UnixStream>,
    mut overlap: Overlap,
    sink: &Sink,
    telemetry: &Sender<MonitorUpdate>,
) {
    loop {
        let bytes = match read_line(&mut input, MAX_SERVER_LINE_BYTES) {
            Ok(Some(Line::Complete(b))) => b,
            Ok(Some(Line::TooLong { bytes })) => {
                tracing::warn!("attach: skipped a {bytes}-byte message from the server");
                continue;
            }
            Ok(None) => break,
            Err(e) => {
                tracing::info!("attach: the control socket closed: {e}");
                break;
            }
        };
        if bytes.trim_ascii().is_empty() {
            continue;
        }
        let mut value = match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("attach: skipped a malformed message from the server: {e}");
                continue;
            }
        };
        match value.get("type").and_then(Value::as_str) {
            Some("event") => {
                let Some(event) = value.get_mut("event").map(Value::take) else {
                    tracing::warn!("attach: an event message without an event");
                    continue;
                };
                if overlap.seen(&normalise(event.clone())) {
                    continue;
                }
                match serde_json::from_value::<Event>(event) {
                    Ok(ev) => {
                        if !sink.send(ev) {
                            break;
                        }
                    }
                    Err(e) => tracing::warn!("attach: skipped an event that does not decode: {e}"),
                }
            }
            Some("telemetry") => match serde_json::from_value::<ServerMessage>(value) {
                Ok(ServerMessage::Telemetry { update }) => {
                    let _ = telemetry.send(update);
                }
                Ok(_) | Err(_) => tracing::warn!("attach: skipped a malformed telemetry message"),
            },
            Some("error") => {
                let message = value
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("(no message)")
                    .to_string();
                tracing::warn!("attach: the server refused a message: {message}");
                sink.warn(format!("control socket refused a message: {message}"));
            }
            Some("hello") => {}
            other => tracing::warn!("attach: skipped a message of unknown type {other:?}"),
        }
    }
    sink.close();
}

/// Write the dashboard's commands to the socket; a Stop only when allowed.
fn send_commands(stream: UnixStream, commands: &Receiver<Command>, allow_stop: bool, sink: &Sink) {
    let mut out = stream;
    if allow_stop {
        // the server enforces the right per connection: claimed once, first
        if let Err(e) = out
            .write_all(super::protocol::ALLOW_STOP_LINE.as_bytes())
            .and_then(|()| out.flush())
        {
            tracing::warn!("attach: could not claim allow_stop: {e}");
        }
    }
    for command in commands.iter() {
        if matches!(command, Command::Stop { .. } | Command::Interrupt { .. }) && !allow_stop {
            tracing::info!(
                "attach: not sending {:?}: this viewer is attached without allow_stop",
                command.label()
            );
            sink.warn(format!(
                "not sent: {} — this dashboard is attached, the run goes on (q leaves)",
                command.label()
            ));
            continue;
        }
        let written = encode(&ClientMessage::Command {
            command: command.clone(),
        })
        .map_err(io::Error::other)
        .and_then(|line| {
            out.write_all(line.as_bytes())?;
            out.flush()
        });
        if let Err(e) = written {
            tracing::warn!("attach: could not send {}: {e}", command.label());
            sink.warn(format!(
                "could not send {}: the control socket is closed",
                command.label()
            ));
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn step(n: u64, dropped: u64) -> Value {
        json!({"event": "step", "step": n, "loss": 1.0, "dropped_before": dropped})
    }

    fn ev(kind: &str, n: u64) -> Value {
        json!({"event": kind, "step": n})
    }

    fn run(history: Vec<Value>, live: Vec<Value>) -> Vec<bool> {
        let mut o = Overlap::new(history.into_iter().map(normalise).collect());
        live.into_iter().map(|v| o.seen(&normalise(v))).collect()
    }

    #[test]
    fn live_events_already_in_the_history_are_skipped_once() {
        let history = vec![
            ev("run_started", 0),
            step(1, 0),
            step(2, 0),
            ev("paused", 2),
        ];
        // the live stream began at step 2 (with a different dropped count) and goes on
        let live = vec![step(2, 5), ev("paused", 2), ev("resumed", 2), step(3, 0)];
        assert_eq!(run(history, live), vec![true, true, false, false]);
    }

    #[test]
    fn steps_the_live_stream_dropped_are_stepped_over() {
        let history = vec![
            step(1, 0),
            step(2, 0),
            step(3, 0),
            ev("eval", 3),
            step(4, 0),
        ];
        let live = vec![step(1, 0), ev("eval", 3), step(4, 0), step(5, 0)];
        assert_eq!(run(history, live), vec![true, true, true, false]);
    }

    #[test]
    fn a_live_stream_that_starts_after_the_history_is_all_new() {
        let history = vec![step(1, 0), step(2, 0)];
        let live = vec![step(4, 0), step(2, 0)];
        assert_eq!(run(history, live), vec![false, false]);
        assert_eq!(run(vec![], vec![step(1, 0)]), vec![false]);
    }
}
