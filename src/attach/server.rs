//! The training process's side: an owner-only Unix socket in the run dir that fans engine
//! events out to viewers and takes their commands.
//!
//! Threads: one accepts connections; each viewer gets a writer (drains that viewer's queue
//! into its socket) and a reader (decodes and validates its commands). [`Server::publish`]
//! only pushes onto in-memory queues, so a viewer that reads slowly, or not at all, costs the
//! engine nothing: its Step events are dropped (and counted), and if even its non-step events
//! pile up past [`ServerOptions::event_queue`] it is disconnected.

use super::peer::{my_uid, peer_cred, PeerCred};
use super::protocol::{encode, is_allow_stop, parse_client_line, read_line, Hello, Line, Outbound};
use super::protocol::{MAX_LINE_BYTES, PROTOCOL_VERSION};
use super::{AttachError, PRIVATE_DIR, SOCKET_FILE};
use crate::advisor::MonitorUpdate;
use crate::engine::events::{self, Command, Event, EventRx, StepStats};
use std::collections::VecDeque;
use std::fs;
use std::io::{self, BufReader, BufWriter, Write};
use std::net::Shutdown;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often the accept loop looks for new viewers and for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(50);
/// How long a closing server lets viewers' writers flush what is queued (e.g. `Finished`).
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Limits of a [`Server`]. The defaults suit a dashboard; tests shrink them.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Step events queued per viewer before further ones are dropped for it.
    pub step_queue: usize,
    /// Non-step events (and error replies) queued per viewer before it is disconnected.
    pub event_queue: usize,
    /// Telemetry updates queued per viewer before further ones are dropped for it.
    pub telemetry_queue: usize,
    /// Commands waiting for the engine before viewers are told to wait.
    pub command_queue: usize,
    /// Longest line accepted from a viewer.
    pub max_line_bytes: usize,
    /// A write to a viewer blocked this long disconnects it.
    pub write_timeout: Duration,
    /// Viewers connected at once; more are turned away with an error line.
    pub max_viewers: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            step_queue: 1024,
            event_queue: 4096,
            telemetry_queue: 16,
            command_queue: 64,
            max_line_bytes: MAX_LINE_BYTES,
            write_timeout: Duration::from_secs(30),
            max_viewers: 64,
        }
    }
}

/// What a [`Server`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Viewers connected now.
    pub viewers: usize,
    /// Viewers accepted since the start.
    pub accepted: u64,
    /// Connections refused: another user, or credentials that could not be read.
    pub refused_peers: u64,
    /// Step events dropped for viewers that read too slowly (summed over viewers).
    pub dropped_steps: u64,
    /// Telemetry updates dropped for viewers that read too slowly.
    pub dropped_telemetry: u64,
    /// Viewers disconnected because their non-step events piled up.
    pub slow_disconnects: u64,
    /// Lines from viewers refused: malformed, oversized, invalid or unknown.
    pub rejected_messages: u64,
    /// Commands passed on toward the engine.
    pub commands: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    refused_peers: AtomicU64,
    dropped_steps: AtomicU64,
    dropped_telemetry: AtomicU64,
    slow_disconnects: AtomicU64,
    rejected_messages: AtomicU64,
    commands: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One line waiting for a viewer.
#[derive(Clone)]
enum Outgoing {
    /// Hello, a non-step event or an error reply: never dropped.
    Message(Arc<str>),
    /// A Step event: dropped when the viewer is behind.
    Step {
        stats: Arc<StepStats>,
        line: Arc<str>,
        /// Steps dropped for this viewer just before this one (added to `dropped_before`).
        missed: u64,
    },
    /// A telemetry update: dropped when the viewer is behind.
    Telemetry(Arc<str>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QueueState {
    Open,
    /// The server is closing: write what is queued, then leave.
    Draining,
    Closed,
}

struct Queue {
    items: VecDeque<Outgoing>,
    steps: usize,
    messages: usize,
    telemetry: usize,
    /// Steps dropped since the last one queued.
    missed: u64,
    state: QueueState,
}

/// One connected viewer.
struct Viewer {
    id: u64,
    peer: PeerCred,
    /// For shutdown; the reader and writer threads own their own handles.
    stream: UnixStream,
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Viewer {
    fn is_open(&self) -> bool {
        lock(&self.queue).state == QueueState::Open
    }

    /// Queue a line for this viewer; never waits for its socket.
    fn push(&self, item: Outgoing, shared: &Shared) {
        let mut q = lock(&self.queue);
        if q.state != QueueState::Open {
            return;
        }
        let item = match item {
            Outgoing::Step { stats, line, .. } => {
                if q.steps >= shared.opts.step_queue {
                    q.missed += 1;
                    bump(&shared.counters.dropped_steps);
                    return;
                }
                q.steps += 1;
                let missed = std::mem::take(&mut q.missed);
                Outgoing::Step {
                    stats,
                    line,
                    missed,
                }
            }
            Outgoing::Telemetry(line) => {
                if q.telemetry >= shared.opts.telemetry_queue {
                    bump(&shared.counters.dropped_telemetry);
                    return;
                }
                q.telemetry += 1;
                Outgoing::Telemetry(line)
            }
            Outgoing::Message(line) => {
                if q.messages >= shared.opts.event_queue {
                    q.state = QueueState::Closed;
                    q.items.clear();
                    drop(q);
                    self.ready.notify_all();
                    let _ = self.stream.shutdown(Shutdown::Both);
                    bump(&shared.counters.slow_disconnects);
                    tracing::warn!(
                        viewer = self.id,
                        pid = ?self.peer.pid,
                        "attach: disconnected a viewer that stopped reading ({} events queued)",
                        shared.opts.event_queue
                    );
                    return;
                }
                q.messages += 1;
                Outgoing::Message(line)
            }
        };
        q.items.push_back(item);
        drop(q);
        self.ready.notify_one();
    }

    /// Next line to write; `None` when the viewer is closed, or drained while closing.
    /// The flag says whether the queue is empty after it (time to flush).
    fn next(&self) -> Option<(Outgoing, bool)> {
        let mut q = lock(&self.queue);
        loop {
            if q.state == QueueState::Closed {
                return None;
            }
            if let Some(item) = q.items.pop_front() {
                match &item {
                    Outgoing::Message(_) => q.messages -= 1,
                    Outgoing::Step { .. } => q.steps -= 1,
                    Outgoing::Telemetry(_) => q.telemetry -= 1,
                }
                let empty = q.items.is_empty();
                return Some((item, empty));
            }
            if q.state == QueueState::Draining {
                return None;
            }
            q = self.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn set_state(&self, state: QueueState) {
        let mut q = lock(&self.queue);
        if q.state != QueueState::Closed {
            q.state = state;
        }
        drop(q);
        self.ready.notify_all();
    }

    fn close(&self) {
        self.set_state(QueueState::Closed);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

struct Registry {
    viewers: Vec<Arc<Viewer>>,
    /// False once `Finished` was published.
    live: bool,
}

struct ViewerThreads {
    viewer: Arc<Viewer>,
    writer: JoinHandle<()>,
    reader: JoinHandle<()>,
}

/// State shared by the server handle, the accept thread and the viewer threads.
struct Shared {
    opts: ServerOptions,
    run_dir: String,
    registry: Mutex<Registry>,
    /// Viewers in the registry (read without the lock, to skip encoding when nobody looks).
    viewer_count: AtomicUsize,
    threads: Mutex<Vec<ViewerThreads>>,
    counters: Counters,
    /// Taken when the server closes, so the command channel ends with the server even if a
    /// [`StatsHandle`] keeps this alive.
    commands: Mutex<Option<SyncSender<Command>>>,
    next_id: AtomicU64,
    shutdown: AtomicBool,
    /// Who asked for the run's pause (a leaving viewer releases only its own).
    pause: Mutex<super::pause_owners::PauseOwners>,
}

impl Shared {
    fn stats(&self) -> ServerStats {
        let viewers = {
            let mut reg = lock(&self.registry);
            self.prune(&mut reg);
            reg.viewers.len()
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            viewers,
            accepted: get(&c.accepted),
            refused_peers: get(&c.refused_peers),
            dropped_steps: get(&c.dropped_steps),
            dropped_telemetry: get(&c.dropped_telemetry),
            slow_disconnects: get(&c.slow_disconnects),
            rejected_messages: get(&c.rejected_messages),
            commands: get(&c.commands),
        }
    }

    /// Remove viewers that left; caller holds the registry.
    fn prune(&self, reg: &mut Registry) {
        reg.viewers.retain(|v| v.is_open());
        self.viewer_count
            .store(reg.viewers.len(), Ordering::Relaxed);
    }

    fn reject(&self, viewer: &Viewer, reason: &str) {
        bump(&self.counters.rejected_messages);
        tracing::warn!(viewer = viewer.id, pid = ?viewer.peer.pid, "attach: refused a message: {reason}");
        match encode(&Outbound::Error { message: reason }) {
            Ok(line) => viewer.push(Outgoing::Message(line.into()), self),
            Err(e) => tracing::warn!("attach: cannot encode an error reply: {e}"),
        }
    }
}

/// Reads a server's [`ServerStats`], wherever the server went (see [`Server::stats_handle`]).
#[derive(Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    /// The counters now (after the server closed: its last counts, with no viewers).
    pub fn get(&self) -> ServerStats {
        self.0.stats()
    }
}

/// The control socket of a training run. See the [module docs](self).
pub struct Server {
    shared: Arc<Shared>,
    socket: PathBuf,
    /// (device, inode) of the socket we bound, so we never remove someone else's.
    socket_id: (u64, u64),
    /// `RUN_DIR/.control` when the socket lives there.
    private_dir: Option<PathBuf>,
    accept: Option<JoinHandle<()>>,
    commands: Mutex<Option<Receiver<Command>>>,
}

impl Server {
    /// Start serving `run_dir` with the default limits; see [`Server::start_with`].
    pub fn start(run_dir: &Path) -> Result<Server, AttachError> {
        Server::start_with(run_dir, ServerOptions::default())
    }

    /// Create `RUN_DIR/control.sock` (mode 0600) and start accepting viewers.
    ///
    /// The run dir must belong to us. When it is not mode 0700 the socket goes into
    /// `RUN_DIR/.control/` (created or tightened to 0700) instead, so that only the owner can
    /// reach it; every connection is also checked with the kernel's peer credentials, and a
    /// viewer of another uid is turned away. A stale socket left by a killed run is replaced;
    /// a socket that still answers means another process serves this run dir
    /// ([`AttachError::InUse`]).
    pub fn start_with(run_dir: &Path, opts: ServerOptions) -> Result<Server, AttachError> {
        let me = my_uid();
        let meta = fs::metadata(run_dir).map_err(AttachError::io(run_dir))?;
        if !meta.is_dir() {
            return Err(AttachError::NotADirectory(run_dir.to_path_buf()));
        }
        if meta.uid() != me {
            return Err(AttachError::NotOwner {
                path: run_dir.to_path_buf(),
                owner: meta.uid(),
                ours: me,
            });
        }
        let (dir, private_dir) = if meta.mode() & 0o777 == 0o700 {
            (run_dir.to_path_buf(), None)
        } else {
            let private = private_dir(run_dir, me)?;
            (private.clone(), Some(private))
        };
        let socket = dir.join(SOCKET_FILE);
        remove_stale(&socket)?;
        let listener = UnixListener::bind(&socket).map_err(AttachError::io(&socket))?;
        let socket_id = match secure_socket(&socket) {
            Ok(id) => id,
            Err(e) => {
                let _ = fs::remove_file(&socket);
                return Err(e);
            }
        };
        if let Err(e) = listener.set_nonblocking(true) {
            let _ = fs::remove_file(&socket);
            return Err(AttachError::io(&socket)(e));
        }
        let (commands_tx, commands_rx) = mpsc::sync_channel(opts.command_queue.max(1));
        let shared = Arc::new(Shared {
            opts,
            run_dir: run_dir.display().to_string(),
            registry: Mutex::new(Registry {
                viewers: Vec::new(),
                live: true,
            }),
            viewer_count: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
            counters: Counters::default(),
            commands: Mutex::new(Some(commands_tx)),
            next_id: AtomicU64::new(1),
            shutdown: AtomicBool::new(false),
            pause: Mutex::default(),
        });
        let accept_shared = shared.clone();
        let accept = thread::Builder::new()
            .name("cockpit-attach-accept".into())
            .spawn(move || accept_loop(&listener, &accept_shared));
        let accept = match accept {
            Ok(h) => h,
            Err(e) => {
                let _ = fs::remove_file(&socket);
                return Err(AttachError::Thread(e));
            }
        };
        tracing::info!(socket = %socket.display(), "attach: serving the run to viewers");
        Ok(Server {
            shared,
            socket,
            socket_id,
            private_dir,
            accept: Some(accept),
            commands: Mutex::new(Some(commands_rx)),
        })
    }

    /// Where the socket is.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Send an engine event to every viewer. Never blocks on a viewer: a slow one loses Step
    /// events (counted, and reported in its next Step's `dropped_before`); one whose other
    /// events pile up is disconnected. Publishing `Finished` marks the run as no longer live
    /// for viewers that connect later.
    pub fn publish(&self, event: &Event) {
        lock(&self.shared.pause).saw(event);
        if let Event::Finished { .. } = event {
            lock(&self.shared.registry).live = false;
        }
        if self.shared.viewer_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let line: Arc<str> = match encode(&Outbound::Event { event }) {
            Ok(l) => l.into(),
            Err(e) => {
                tracing::warn!("attach: cannot encode an event: {e}");
                return;
            }
        };
        let item = match event {
            Event::Step(s) => Outgoing::Step {
                stats: Arc::new(s.clone()),
                line,
                missed: 0,
            },
            _ => Outgoing::Message(line),
        };
        self.fan_out(item);
    }

    /// Send a telemetry update to every viewer (dropped for viewers that are behind).
    pub fn publish_telemetry(&self, update: &MonitorUpdate) {
        if self.shared.viewer_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        match encode(&Outbound::Telemetry { update }) {
            Ok(line) => self.fan_out(Outgoing::Telemetry(line.into())),
            Err(e) => tracing::warn!("attach: cannot encode a telemetry update: {e}"),
        }
    }

    fn fan_out(&self, item: Outgoing) {
        let mut reg = lock(&self.shared.registry);
        self.shared.prune(&mut reg);
        for viewer in &reg.viewers {
            viewer.push(item.clone(), &self.shared);
        }
    }

    /// The commands viewers sent, decoded and validated like key presses. The first call
    /// takes the receiver; later calls return `None`.
    pub fn commands(&self) -> Option<Receiver<Command>> {
        lock(&self.commands).take()
    }

    /// Counters and the number of viewers connected now.
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// A handle that reads [`Server::stats`] after the server moved into [`Server::relay`].
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.shared.clone())
    }

    /// Put the server between the engine and a front end: every event from `events` is
    /// published and passed on, as is every telemetry update, and viewers' commands go to
    /// `commands` (the engine's). The front end reads the returned receivers instead of the
    /// originals. The server closes (and its socket is removed) when the engine's event
    /// channel closes, i.e. when the engine thread has ended.
    ///
    /// Never fails: if a relay thread cannot be started, the inputs are passed through
    /// untouched and nobody can attach (logged). If [`Server::commands`] was already taken,
    /// the caller forwards viewers' commands itself.
    pub fn relay(
        self,
        events: EventRx,
        commands: Sender<Command>,
        telemetry: Option<Receiver<MonitorUpdate>>,
    ) -> Relayed {
        let mut guard = RelayGuard {
            threads: Vec::new(),
        };
        // Commands first: they need only the receiver, not the server.
        if let Some(rx) = self.commands() {
            let spawned = spawn_with("cockpit-attach-cmds", (rx, commands), |(rx, engine)| {
                for command in rx.iter() {
                    if engine.send(command).is_err() {
                        break;
                    }
                }
            });
            match spawned {
                Ok(h) => guard.threads.push(h),
                Err((e, _)) => tracing::warn!("attach: viewers' commands will be ignored: {e}"),
            }
        }
        let server = Arc::new(self);
        let weak = Arc::downgrade(&server);
        let (down_tx, down_rx) = events::channel(RELAY_QUEUED_STEPS);
        let events = match spawn_with(
            "cockpit-attach-events",
            (events, down_tx, server),
            |(up, down, server)| {
                while let Some(ev) = up.recv() {
                    server.publish(&ev);
                    // the front end may have left; viewers still want the rest of the run
                    let _ = down.send(ev);
                }
            },
        ) {
            Ok(h) => {
                guard.threads.push(h);
                down_rx
            }
            Err((e, (up, _, _server))) => {
                tracing::warn!("attach: cannot relay events, nobody can attach: {e}");
                up
            }
        };
        let telemetry = telemetry.map(|up| {
            let (tx, rx) = mpsc::channel();
            match spawn_with("cockpit-attach-telemetry", (up, tx, weak), relay_telemetry) {
                // not joined: the monitor may outlive the run
                Ok(_) => rx,
                Err((e, (up, _, _))) => {
                    tracing::warn!("attach: viewers get no telemetry: {e}");
                    up
                }
            }
        });
        Relayed {
            events,
            telemetry,
            guard,
        }
    }
}

/// Step events the relay holds for a front end that falls behind (like the CLI's tee).
const RELAY_QUEUED_STEPS: usize = 256;

fn relay_telemetry(
    (up, down, server): (Receiver<MonitorUpdate>, Sender<MonitorUpdate>, Weak<Server>),
) {
    while let Ok(update) = up.recv() {
        if let Some(server) = server.upgrade() {
            server.publish_telemetry(&update);
        }
        if down.send(update).is_err() && server.strong_count() == 0 {
            break;
        }
    }
}

/// The receivers a front end reads once a [`Server`] relays the engine (see
/// [`Server::relay`]).
pub struct Relayed {
    /// The engine's events, after viewers got them.
    pub events: EventRx,
    /// The telemetry updates, after viewers got them.
    pub telemetry: Option<Receiver<MonitorUpdate>>,
    /// Joins the relay; see [`RelayGuard::wait`].
    pub guard: RelayGuard,
}

/// The relay's threads. Dropping it leaves them to finish on their own.
pub struct RelayGuard {
    threads: Vec<JoinHandle<()>>,
}

impl RelayGuard {
    /// Wait until the relay has ended and the socket is gone. Call it after the engine
    /// thread has been joined (before that, it waits for the engine).
    pub fn wait(self) {
        for t in self.threads {
            if t.join().is_err() {
                tracing::warn!("attach: a relay thread panicked");
            }
        }
    }
}

/// Spawn a named thread that gets `input`; if the thread cannot start, `input` comes back.
fn spawn_with<T: Send + 'static>(
    name: &str,
    input: T,
    f: impl FnOnce(T) + Send + 'static,
) -> Result<JoinHandle<()>, (io::Error, T)> {
    let (tx, rx) = mpsc::sync_channel::<T>(1);
    match thread::Builder::new().name(name.into()).spawn(move || {
        if let Ok(input) = rx.recv() {
            f(input);
        }
    }) {
        Ok(handle) => match tx.send(input) {
            Ok(()) => Ok(handle),
            Err(mpsc::SendError(input)) => Err((io::Error::other("the thread ended"), input)),
        },
        Err(e) => Err((e, input)),
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        // let writers flush what is queued (the Finished event, typically), briefly
        for t in &threads {
            t.viewer.set_state(QueueState::Draining);
        }
        let deadline = Instant::now() + DRAIN_GRACE;
        while Instant::now() < deadline && threads.iter().any(|t| !t.writer.is_finished()) {
            thread::sleep(Duration::from_millis(10));
        }
        for t in &threads {
            t.viewer.close();
        }
        for t in threads {
            let _ = t.writer.join();
            let _ = t.reader.join();
        }
        lock(&self.shared.commands).take();
        {
            let mut reg = lock(&self.shared.registry);
            reg.viewers.clear();
            self.shared.viewer_count.store(0, Ordering::Relaxed);
        }
        // only our own socket: a new server may have replaced it
        let ours = fs::symlink_metadata(&self.socket)
            .map(|m| (m.dev(), m.ino()) == self.socket_id)
            .unwrap_or(false);
        if ours {
            if let Err(e) = fs::remove_file(&self.socket) {
                tracing::warn!(socket = %self.socket.display(), "attach: cannot remove the socket: {e}");
            }
        }
        if let Some(dir) = &self.private_dir {
            // fails (and stays) if anything else is in it
            let _ = fs::remove_dir(dir);
        }
        tracing::info!("attach: stopped serving the run");
    }
}

/// `RUN_DIR/.control`, created or tightened to 0700; it must be our own real directory.
fn private_dir(run_dir: &Path, me: u32) -> Result<PathBuf, AttachError> {
    let dir = run_dir.join(PRIVATE_DIR);
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(AttachError::io(&dir)(e)),
    }
    let meta = fs::symlink_metadata(&dir).map_err(AttachError::io(&dir))?;
    if !meta.file_type().is_dir() {
        return Err(AttachError::NotADirectory(dir));
    }
    if meta.uid() != me {
        return Err(AttachError::NotOwner {
            path: dir,
            owner: meta.uid(),
            ours: me,
        });
    }
    // the umask may have taken bits away, or an old dir may be looser
    if meta.mode() & 0o777 != 0o700 {
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(AttachError::io(&dir))?;
    }
    Ok(dir)
}

/// Remove a socket left by a run that is gone; refuse to touch anything else.
fn remove_stale(socket: &Path) -> Result<(), AttachError> {
    let meta = match fs::symlink_metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(AttachError::io(socket)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(AttachError::NotASocket(socket.to_path_buf()));
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(AttachError::InUse(socket.to_path_buf()));
    }
    tracing::info!(socket = %socket.display(), "attach: replacing a stale socket");
    fs::remove_file(socket).map_err(AttachError::io(socket))
}

/// chmod 0600 the socket just bound; returns its (device, inode).
fn secure_socket(socket: &Path) -> Result<(u64, u64), AttachError> {
    fs::set_permissions(socket, fs::Permissions::from_mode(0o600))
        .map_err(AttachError::io(socket))?;
    let meta = fs::symlink_metadata(socket).map_err(AttachError::io(socket))?;
    Ok((meta.dev(), meta.ino()))
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => admit(stream, shared),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // e.g. out of file descriptors: do not spin
                tracing::warn!("attach: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Check a new connection's credentials and set the viewer up.
fn admit(stream: UnixStream, shared: &Arc<Shared>) {
    let me = my_uid();
    let peer = match peer_cred(&stream) {
        Ok(p) => p,
        Err(e) => {
            bump(&shared.counters.refused_peers);
            tracing::warn!("attach: refused a viewer whose credentials cannot be read: {e}");
            return;
        }
    };
    if peer.uid != me {
        bump(&shared.counters.refused_peers);
        tracing::warn!(uid = peer.uid, pid = ?peer.pid, "attach: refused a viewer of another user");
        turn_away(
            &stream,
            &format!("permission denied: this run belongs to uid {me}"),
        );
        return;
    }
    if let Err(e) = setup_stream(&stream, shared.opts.write_timeout) {
        tracing::warn!("attach: cannot set up a viewer's socket: {e}");
        return;
    }
    let (reader_stream, writer_stream) = match (stream.try_clone(), stream.try_clone()) {
        (Ok(r), Ok(w)) => (r, w),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!("attach: cannot set up a viewer's socket: {e}");
            return;
        }
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let viewer = Arc::new(Viewer {
        id,
        peer,
        stream,
        queue: Mutex::new(Queue {
            items: VecDeque::new(),
            steps: 0,
            messages: 0,
            telemetry: 0,
            missed: 0,
            state: QueueState::Open,
        }),
        ready: Condvar::new(),
    });
    // hello first, and registered under the same lock, so no event can come before it
    {
        let mut reg = lock(&shared.registry);
        shared.prune(&mut reg);
        if reg.viewers.len() >= shared.opts.max_viewers {
            drop(reg);
            tracing::warn!(pid = ?peer.pid, "attach: refused a viewer: too many viewers");
            let message = format!(
                "too many viewers (at most {} at once)",
                shared.opts.max_viewers
            );
            turn_away(&viewer.stream, &message);
            return;
        }
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            run_dir: shared.run_dir.clone(),
            live: reg.live,
            pid: std::process::id(),
            max_line_bytes: shared.opts.max_line_bytes,
        };
        match encode(&Outbound::Hello(&hello)) {
            Ok(line) => viewer.push(Outgoing::Message(line.into()), shared),
            Err(e) => {
                tracing::warn!("attach: cannot encode the hello: {e}");
                return;
            }
        }
        reg.viewers.push(viewer.clone());
        shared
            .viewer_count
            .store(reg.viewers.len(), Ordering::Relaxed);
    }
    let writer = {
        let viewer = viewer.clone();
        thread::Builder::new()
            .name(format!("cockpit-attach-w{id}"))
            .spawn(move || write_loop(&viewer, writer_stream))
    };
    let reader = {
        let viewer = viewer.clone();
        let shared = shared.clone();
        thread::Builder::new()
            .name(format!("cockpit-attach-r{id}"))
            .spawn(move || read_loop(&viewer, reader_stream, &shared))
    };
    match (writer, reader) {
        (Ok(writer), Ok(reader)) => {
            bump(&shared.counters.accepted);
            tracing::info!(viewer = id, pid = ?peer.pid, "attach: a viewer connected");
            let mut threads = lock(&shared.threads);
            // forget viewers that are long gone (their threads have ended)
            threads.retain(|t| !(t.writer.is_finished() && t.reader.is_finished()));
            threads.push(ViewerThreads {
                viewer,
                writer,
                reader,
            });
        }
        (w, r) => {
            tracing::warn!(viewer = id, "attach: cannot start a viewer's threads");
            viewer.close();
            // whichever started ends now that the viewer is closed
            for h in [w.ok(), r.ok()].into_iter().flatten() {
                let _ = h.join();
            }
        }
    }
}

/// A courtesy error line to a connection we refuse, never waited on.
fn turn_away(stream: &UnixStream, message: &str) {
    if stream
        .set_write_timeout(Some(Duration::from_millis(100)))
        .is_ok()
    {
        if let Ok(line) = encode(&Outbound::Error { message }) {
            let mut s = stream;
            let _ = s.write_all(line.as_bytes());
        }
    }
}

fn setup_stream(stream: &UnixStream, write_timeout: Duration) -> io::Result<()> {
    // accepted sockets do not inherit the listener's non-blocking mode everywhere; be explicit
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1))))?;
    stream.set_read_timeout(None)
}

fn write_loop(viewer: &Viewer, stream: UnixStream) {
    let mut out = BufWriter::new(stream);
    while let Some((item, flush)) = viewer.next() {
        let result = match &item {
            Outgoing::Message(line) | Outgoing::Telemetry(line) => out.write_all(line.as_bytes()),
            Outgoing::Step {
                line, missed: 0, ..
            } => out.write_all(line.as_bytes()),
            Outgoing::Step { stats, missed, .. } => {
                let mut stats = StepStats::clone(stats);
                stats.dropped_before = stats.dropped_before.saturating_add(*missed);
                let event = Event::Step(stats);
                match encode(&Outbound::Event { event: &event }) {
                    Ok(line) => out.write_all(line.as_bytes()),
                    Err(e) => Err(io::Error::other(e)),
                }
            }
        };
        let result = result.and_then(|()| if flush { out.flush() } else { Ok(()) });
        if let Err(e) = result {
            tracing::info!(viewer = viewer.id, "attach: a viewer left ({e})");
            break;
        }
    }
    // flush what is buffered when draining; harmless after an error
    let _ = out.flush();
    viewer.close();
}

fn read_loop(viewer: &Viewer, stream: UnixStream, shared: &Shared) {
    let mut input = BufReader::new(stream);
    // the right to stop the run: claimed by a viewer started with it (`--allow-stop`)
    let mut allow_stop = false;
    loop {
        let line = match read_line(&mut input, shared.opts.max_line_bytes) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(viewer = viewer.id, "attach: reading from a viewer: {e}");
                break;
            }
        };
        let bytes = match line {
            Line::TooLong { bytes } => {
                shared.reject(
                    viewer,
                    &format!(
                        "message too long: {bytes} bytes (at most {} per line)",
                        shared.opts.max_line_bytes
                    ),
                );
                continue;
            }
            Line::Complete(bytes) => bytes,
        };
        if bytes.trim_ascii().is_empty() {
            continue;
        }
        if is_allow_stop(&bytes) {
            allow_stop = true;
            continue;
        }
        let command = match parse_client_line(&bytes) {
            Ok(c) => c,
            Err(reason) => {
                shared.reject(viewer, &reason);
                continue;
            }
        };
        let label = command.label();
        if matches!(command, Command::Stop { .. } | Command::Interrupt { .. }) && !allow_stop {
            shared.reject(
                viewer,
                &format!("{label} refused: this viewer was not attached with --allow-stop"),
            );
            continue;
        }
        let pause =
            matches!(command, Command::Pause).then(|| lock(&shared.pause).viewer_paused(viewer.id));
        let sent = match lock(&shared.commands).as_ref() {
            Some(tx) => tx.try_send(command),
            None => Err(TrySendError::Disconnected(command)),
        };
        if let (Some(new), Err(_)) = (pause, &sent) {
            lock(&shared.pause).unsent(viewer.id, new);
        }
        match sent {
            Ok(()) => {
                bump(&shared.counters.commands);
                tracing::info!(viewer = viewer.id, pid = ?viewer.peer.pid, "attach: command from a viewer: {label}");
            }
            Err(TrySendError::Full(_)) => shared.reject(
                viewer,
                &format!("too many commands waiting for the engine; {label} was not sent"),
            ),
            Err(TrySendError::Disconnected(_)) => shared.reject(
                viewer,
                &format!("the run no longer takes commands; {label} was not sent"),
            ),
        }
    }
    tracing::info!(viewer = viewer.id, "attach: a viewer disconnected");
    // a viewer that paused the run and left does not leave it paused (unless another viewer,
    // or the local dashboard, asked for the pause too)
    let release = lock(&shared.pause).viewer_left(viewer.id);
    if release {
        if let Some(tx) = lock(&shared.commands).as_ref() {
            if tx.try_send(Command::Resume).is_ok() {
                tracing::info!(
                    viewer = viewer.id,
                    "attach: the viewer that paused the run left; resumed"
                );
            }
        }
    }
    viewer.close();
}
