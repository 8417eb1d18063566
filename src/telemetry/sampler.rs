//! [`Sampler`]: a thread that produces [`Snapshot`]s (live, or replayed from a trace) and the
//! receiver-shaped handle through which they are read.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryIter};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::collector::Collector;
use super::trace::TraceWriter;
use super::{Snapshot, TelemetryError};

/// How the live sampler runs.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerOptions {
    /// Time between snapshots (default 1 s).
    pub interval: Duration,
    /// Append every snapshot, as one JSON line, to this trace file (created or truncated).
    pub record: Option<PathBuf>,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            record: None,
        }
    }
}

/// Where the snapshots of a [`Sampler`] come from.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceKind {
    /// Sampled from this machine, every `interval`.
    Live { interval: Duration },
    /// Played back from a trace file.
    Replay { path: PathBuf, speed: f64 },
}

/// Receives the snapshots a source thread produces.
pub(crate) trait SnapshotSink: Send + 'static {
    /// Hand over one snapshot; `false` when nobody listens any more (the source then stops).
    fn deliver(&mut self, snapshot: Snapshot) -> bool;
    /// The source ran out on its own (a replay reached the end of its trace).
    fn finish(&mut self) {}
}

impl SnapshotSink for Sender<Snapshot> {
    fn deliver(&mut self, snapshot: Snapshot) -> bool {
        self.send(snapshot).is_ok()
    }
}

/// Lets a source thread sleep until a deadline while staying stoppable.
///
/// A stop request is an explicit message. A source that was [detached](SourceThread::detach)
/// can no longer be asked to stop: it runs until its consumer goes away.
pub(crate) struct StopSignal(Receiver<()>);

impl StopSignal {
    /// Wait until `deadline`; `true` when the source was asked to stop meanwhile.
    pub(crate) fn wait_until(&self, deadline: Instant) -> bool {
        let timeout = deadline.saturating_duration_since(Instant::now());
        match self.0.recv_timeout(timeout) {
            Ok(()) => true,
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => {
                std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                false
            }
        }
    }

    /// Block until the source is asked to stop (or can no longer be); always `true`.
    pub(crate) fn wait_forever(&self) -> bool {
        let _ = self.0.recv();
        true
    }

    /// `true` when the source was asked to stop.
    pub(crate) fn stopped(&self) -> bool {
        self.0.try_recv().is_ok()
    }
}

/// A running source thread; dropping it stops the thread and waits for it.
pub(crate) struct SourceThread {
    stop: Option<Sender<()>>,
    handle: Option<JoinHandle<()>>,
    kind: SourceKind,
    notice: Option<String>,
}

impl SourceThread {
    /// The source's kind.
    pub(crate) fn kind(&self) -> &SourceKind {
        &self.kind
    }

    /// Why GPU metrics are missing, when they are.
    pub(crate) fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// Let the thread run on its own: it stops when its sink refuses a snapshot (the
    /// consumer went away) or its source runs out.
    pub(crate) fn detach(mut self) {
        self.stop.take();
        self.handle.take();
    }
}

impl Drop for SourceThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The thread may have ended already; then there is nobody to tell.
            let _ = stop.send(());
        }
        if let Some(handle) = self.handle.take() {
            if handle.join().is_err() {
                tracing::error!("the telemetry source thread panicked");
            }
        }
    }
}

/// A source body: produces snapshots into the sink until it runs out or is stopped.
pub(crate) type SourceBody = Box<dyn FnOnce(&StopSignal, &mut dyn SnapshotSink) + Send>;

/// Start a source thread that feeds `sink`.
pub(crate) fn spawn_source(
    kind: SourceKind,
    notice: Option<String>,
    body: SourceBody,
    mut sink: impl SnapshotSink,
) -> Result<SourceThread, TelemetryError> {
    let (stop_tx, stop_rx) = mpsc::channel();
    let name = match kind {
        SourceKind::Live { .. } => "telemetry-sampler",
        SourceKind::Replay { .. } => "telemetry-replay",
    };
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let stop = StopSignal(stop_rx);
            body(&stop, &mut sink);
            sink.finish();
        })
        .map_err(|source| TelemetryError::Spawn { name, source })?;
    Ok(SourceThread {
        stop: Some(stop_tx),
        handle: Some(handle),
        kind,
        notice,
    })
}

/// The body of the live sampler: one snapshot every `interval`, optionally recorded.
pub(crate) fn live_body(
    mut collector: Collector,
    interval: Duration,
    mut recorder: Option<TraceWriter>,
) -> SourceBody {
    Box::new(move |stop, sink| {
        // The first CPU (and GPM) figures need a short interval behind them.
        let mut next = Instant::now() + sysinfo::MINIMUM_CPU_UPDATE_INTERVAL.min(interval);
        loop {
            if stop.wait_until(next) {
                return;
            }
            let snapshot = collector.sample();
            if let Some(writer) = recorder.as_mut() {
                if let Err(err) = writer.write(&snapshot) {
                    tracing::warn!(%err, "recording stopped");
                    recorder = None;
                }
            }
            if !sink.deliver(snapshot) {
                return;
            }
            // Keep a steady cadence; after a stall, resume from now rather than bursting.
            next += interval;
            let now = Instant::now();
            if next < now {
                next = now;
            }
        }
    })
}

/// Open the live sources: the collector (NVML opened once) and the recorder, if any.
pub(crate) fn live_parts(
    opts: &SamplerOptions,
) -> Result<(SourceKind, Option<String>, SourceBody), TelemetryError> {
    if opts.interval.is_zero() {
        return Err(TelemetryError::ZeroInterval);
    }
    let recorder = opts
        .record
        .as_deref()
        .map(TraceWriter::create)
        .transpose()?;
    let collector = Collector::new();
    let notice = collector.notice().map(str::to_owned);
    let kind = SourceKind::Live {
        interval: opts.interval,
    };
    Ok((kind, notice, live_body(collector, opts.interval, recorder)))
}

/// A running source of [`Snapshot`]s — the live sampler or a trace replay — read like a
/// channel receiver. Dropping it stops the thread behind it.
pub struct Sampler {
    rx: Receiver<Snapshot>,
    thread: SourceThread,
}

impl Sampler {
    pub(crate) fn from_parts(
        kind: SourceKind,
        notice: Option<String>,
        body: SourceBody,
    ) -> Result<Self, TelemetryError> {
        let (tx, rx) = mpsc::channel();
        let thread = spawn_source(kind, notice, body, tx)?;
        Ok(Self { rx, thread })
    }

    /// The channel the snapshots arrive on. It disconnects when a replay reaches its end.
    pub fn receiver(&self) -> &Receiver<Snapshot> {
        &self.rx
    }

    /// Wait for the next snapshot; `None` once the source has ended.
    pub fn recv(&self) -> Option<Snapshot> {
        self.rx.recv().ok()
    }

    /// Wait at most `timeout` for the next snapshot.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Snapshot, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    /// Every snapshot already waiting, without blocking.
    pub fn try_iter(&self) -> TryIter<'_, Snapshot> {
        self.rx.try_iter()
    }

    /// Why GPU metrics are missing (e.g. "NVML not available (...): GPU metrics off, host
    /// metrics only"), when they are.
    pub fn notice(&self) -> Option<String> {
        self.thread.notice().map(str::to_owned)
    }

    /// Where the snapshots come from.
    pub fn source(&self) -> &SourceKind {
        self.thread.kind()
    }
}

/// Start the live sampler thread.
///
/// Fails only when the interval is zero, the trace file cannot be created, or the thread
/// cannot start; a machine without NVIDIA driver still samples the host (see
/// [`Sampler::notice`]).
pub fn spawn_sampler(opts: SamplerOptions) -> Result<Sampler, TelemetryError> {
    let (kind, notice, body) = live_parts(&opts)?;
    Sampler::from_parts(kind, notice, body)
}
