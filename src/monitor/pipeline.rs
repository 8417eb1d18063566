//! The monitor pipeline: a snapshot source (live sampler or trace replay) feeding an
//! [`Advisor`] on its own thread, emitting one [`MonitorUpdate`] per snapshot.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryIter};
use std::thread::JoinHandle;
use std::time::Duration;

use super::procstat::ProcSampler;
use crate::advisor::{Advisor, AdvisorOptions, MonitorUpdate};
use crate::engine::events::Event;
use crate::telemetry::{
    live_parts, replay_parts, spawn_source, SamplerOptions, Snapshot, SnapshotSink, SourceKind,
    SourceThread, TelemetryError,
};

use super::MonitorOptions;

/// What the advisor thread is fed.
enum Input {
    Snapshot(Snapshot),
    Event(Box<Event>),
    /// The source ran out (end of a replayed trace).
    SourceEnded,
}

/// Forwards a source's snapshots to the advisor thread.
struct ToAdvisor(Sender<Input>);

impl SnapshotSink for ToAdvisor {
    fn deliver(&mut self, snapshot: Snapshot) -> bool {
        self.0.send(Input::Snapshot(snapshot)).is_ok()
    }

    fn finish(&mut self) {
        // The advisor thread may already be gone; nothing to do then.
        let _ = self.0.send(Input::SourceEnded);
    }
}

/// Passes a training run's events to a pipeline's advisor, so its advice can use step
/// timings. Cheap to clone and to send to another thread; never blocks.
#[derive(Clone)]
pub struct PipelineFeed(Sender<Input>);

impl PipelineFeed {
    /// Pass one engine event on (`RunStarted`, `Step`, `Scu` and `Finished` are used; other
    /// events are ignored). A stopped pipeline drops it.
    pub fn feed(&self, event: &Event) {
        if matches!(
            event,
            Event::RunStarted(_) | Event::Step(_) | Event::Scu(_) | Event::Finished { .. }
        ) {
            let _ = self.0.send(Input::Event(Box::new(event.clone())));
        }
    }
}

/// A running monitor pipeline: a snapshot source and an advisor, each on its own thread.
/// Read [`MonitorUpdate`]s from it; hand a [`PipelineFeed`] to whoever sees the training
/// run's events. Dropping it stops both threads and waits for them.
pub struct Pipeline {
    updates: Receiver<MonitorUpdate>,
    feed: PipelineFeed,
    source: Option<SourceThread>,
    source_kind: SourceKind,
    notice: Option<String>,
    worker: Option<JoinHandle<()>>,
}

impl Pipeline {
    /// The channel updates arrive on; it disconnects after a replay's last snapshot.
    pub fn receiver(&self) -> &Receiver<MonitorUpdate> {
        &self.updates
    }

    /// Wait at most `timeout` for the next update.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<MonitorUpdate, RecvTimeoutError> {
        self.updates.recv_timeout(timeout)
    }

    /// Every update already waiting, without blocking.
    pub fn try_iter(&self) -> TryIter<'_, MonitorUpdate> {
        self.updates.try_iter()
    }

    /// Why GPU metrics are missing, when they are.
    pub fn notice(&self) -> Option<String> {
        self.notice.clone()
    }

    /// Where the snapshots come from.
    pub fn source(&self) -> &SourceKind {
        &self.source_kind
    }

    /// A handle that passes training events to the advisor.
    pub fn feeder(&self) -> PipelineFeed {
        self.feed.clone()
    }

    /// Pass one training event to the advisor (see [`PipelineFeed::feed`]).
    pub fn feed(&self, event: &Event) {
        self.feed.feed(event);
    }

    /// Keep only the update channel. The threads then run on their own and stop by
    /// themselves once the receiver is dropped (at the next snapshot) or a replay ends.
    pub fn into_receiver(mut self) -> Receiver<MonitorUpdate> {
        if let Some(source) = self.source.take() {
            source.detach();
        }
        self.worker.take();
        // Leave a disconnected stand-in behind for the (now no-op) drop.
        std::mem::replace(&mut self.updates, mpsc::channel().1)
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        if self.worker.is_none() {
            return; // detached by into_receiver
        }
        // Stop the source (it says SourceEnded as it goes); say it too, in case it had
        // already ended, since feeds held elsewhere keep the advisor's channel open.
        self.source.take();
        let _ = self.feed.0.send(Input::SourceEnded);
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                tracing::error!("the advisor thread panicked");
            }
        }
    }
}

/// Start the monitor pipeline with the default advisor options: the live sampler (every
/// `opts.interval`, recording to `opts.record`) or, with `opts.replay`, a replay of that
/// trace at `opts.replay_speed`.
pub fn spawn_pipeline(opts: &MonitorOptions) -> Result<Pipeline, TelemetryError> {
    spawn_pipeline_with(opts, AdvisorOptions::default())
}

/// [`spawn_pipeline`] with explicit advisor options.
pub fn spawn_pipeline_with(
    opts: &MonitorOptions,
    advisor: AdvisorOptions,
) -> Result<Pipeline, TelemetryError> {
    // a replay's processes ran on another machine: /proc here knows nothing of them
    let procs = opts.replay.is_none().then(ProcSampler::default);
    let (kind, notice, body) = match &opts.replay {
        Some(path) => replay_parts(path, opts.replay_speed)?,
        None => live_parts(&SamplerOptions {
            interval: opts.interval,
            record: opts.record.clone(),
        })?,
    };
    let (input_tx, input_rx) = mpsc::channel();
    let (update_tx, update_rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("advisor".to_string())
        .spawn(move || advise(Advisor::new(advisor), &input_rx, &update_tx, procs))
        .map_err(|source| TelemetryError::Spawn {
            name: "advisor",
            source,
        })?;
    let source = spawn_source(
        kind.clone(),
        notice.clone(),
        body,
        ToAdvisor(input_tx.clone()),
    )?;
    Ok(Pipeline {
        updates: update_rx,
        feed: PipelineFeed(input_tx),
        source: Some(source),
        source_kind: kind,
        notice,
        worker: Some(worker),
    })
}

/// The advisor thread: judge each snapshot and pass the update on, with the host's view of
/// the GPU processes when `procs` samples them.
fn advise(
    mut advisor: Advisor,
    input: &Receiver<Input>,
    updates: &Sender<MonitorUpdate>,
    mut procs: Option<ProcSampler>,
) {
    while let Ok(item) = input.recv() {
        match item {
            Input::Snapshot(snapshot) => {
                advisor.observe_snapshot(&snapshot);
                let processes = procs
                    .as_mut()
                    .map(|p| p.sample(&snapshot))
                    .unwrap_or_default();
                let update = MonitorUpdate {
                    snapshot,
                    advice: advisor.recommendations(),
                    processes,
                };
                if updates.send(update).is_err() {
                    return;
                }
            }
            Input::Event(event) => advisor.observe_event(&event),
            Input::SourceEnded => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advisor::ids;
    use crate::engine::events::RunInfo;
    use crate::telemetry::{GpuSample, Snapshot};

    fn snapshot(t: u64) -> Snapshot {
        Snapshot {
            timestamp_ms: t,
            gpus: vec![GpuSample {
                name: "GPU".into(),
                util_gpu: Some(95),
                mem_used_bytes: 50,
                mem_total_bytes: 100,
                compute_capability: Some((9, 0)),
                ..GpuSample::default()
            }],
            ..Snapshot::default()
        }
    }

    fn run(dtype: &str) -> Event {
        Event::RunStarted(RunInfo {
            device: "cuda:0".into(),
            dtype: dtype.into(),
            max_steps: 10,
            ..crate::headless::fixtures::run_info()
        })
    }

    #[test]
    fn fed_events_reach_the_advisor_in_order() {
        let (input_tx, input_rx) = mpsc::channel();
        let (update_tx, update_rx) = mpsc::channel();
        let feed = PipelineFeed(input_tx.clone());
        let mut sink = ToAdvisor(input_tx);
        assert!(sink.deliver(snapshot(0)));
        feed.feed(&run("f32"));
        feed.feed(&Event::Paused { step: 0 }); // ignored
        assert!(sink.deliver(snapshot(1000)));
        feed.feed(&Event::Finished {
            step: 1,
            reason: crate::engine::events::FinishReason::Completed,
            message: String::new(),
            elapsed_s: 1.0,
        });
        assert!(sink.deliver(snapshot(2000)));
        sink.finish();
        advise(
            Advisor::new(AdvisorOptions::instant()),
            &input_rx,
            &update_tx,
            None,
        );
        let fp32: Vec<bool> = update_rx
            .try_iter()
            .map(|u| u.advice.iter().any(|r| r.id == ids::FP32_ON_TENSOR_CORES))
            .collect();
        assert_eq!(fp32, vec![false, true, false]);
    }
}
