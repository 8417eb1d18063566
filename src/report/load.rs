//! Reading `metrics.jsonl` and `telemetry.jsonl` into series.

use std::io::{BufRead, BufReader};
use std::path::Path;

use super::{io_error, ReportError};
use crate::engine::events::{EvalStats, Event, RunInfo, ScuStats, StepStats};

use crate::telemetry::Snapshot;

/// A run's metrics, split by kind, in file order.
///
/// When the log holds a resumed run (a second `run_started` whose `start_step` is behind
/// steps already logged), the abandoned points after `start_step` are dropped, so every
/// series stays ordered by step and shows the timeline that continued. The points at
/// `start_step` stay: they are the checkpoint's own step, where the resumed run begins (its
/// first step is `start_step + 1`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunMetrics {
    /// The latest `run_started` event.
    pub info: Option<RunInfo>,
    pub steps: Vec<StepStats>,
    pub evals: Vec<EvalStats>,
    pub scu: Vec<ScuStats>,
    /// Every other event (run starts, checkpoints, commands, warnings, finish), in file order.
    pub events: Vec<Event>,
    /// Problems that did not stop loading (e.g. a truncated last line), one line each.
    pub warnings: Vec<String>,
}

impl RunMetrics {
    /// Build from events in the order the engine sent them.
    pub fn from_events(events: impl IntoIterator<Item = Event>) -> Self {
        let mut m = RunMetrics::default();
        for ev in events {
            m.push(ev);
        }
        m
    }

    /// Add one event (what a live consumer calls for each event it receives).
    pub fn push(&mut self, event: Event) {
        match event {
            Event::Step(s) => self.steps.push(s),
            Event::Eval(e) => self.evals.push(e),
            Event::Scu(s) => self.scu.push(s),
            Event::RunStarted(info) => {
                let start = info.start_step;
                self.steps.retain(|s| s.step <= start);
                self.evals.retain(|e| e.step <= start);
                self.scu.retain(|s| s.step <= start);
                self.info = Some(info.clone());
                self.events.push(Event::RunStarted(info));
            }
            other => self.events.push(other),
        }
    }

    /// `(step, train loss)`.
    pub fn train_loss(&self) -> Vec<(f64, f64)> {
        self.steps.iter().map(|s| (s.step as f64, s.loss)).collect()
    }

    /// `(step, validation loss)`.
    pub fn val_loss(&self) -> Vec<(f64, f64)> {
        self.evals
            .iter()
            .map(|e| (e.step as f64, e.val_loss))
            .collect()
    }

    /// `(step, learning rate)`.
    pub fn lr(&self) -> Vec<(f64, f64)> {
        self.steps.iter().map(|s| (s.step as f64, s.lr)).collect()
    }

    /// `(step, tokens per second)`.
    pub fn tokens_per_sec(&self) -> Vec<(f64, f64)> {
        self.steps
            .iter()
            .map(|s| (s.step as f64, s.tokens_per_sec))
            .collect()
    }

    /// `(step, S)`, S as a fraction (0.01 = 1%).
    pub fn s_ratio(&self) -> Vec<(f64, f64)> {
        self.scu
            .iter()
            .map(|s| (s.step as f64, s.s_ratio))
            .collect()
    }

    /// `(step, Ŝ)`, the controller's estimate of S, as a fraction.
    pub fn s_hat(&self) -> Vec<(f64, f64)> {
        self.scu.iter().map(|s| (s.step as f64, s.s_hat)).collect()
    }

    /// `(step, setpoint S*)` as a fraction; it can change during the run.
    pub fn setpoint(&self) -> Vec<(f64, f64)> {
        self.scu.iter().map(|s| (s.step as f64, s.target)).collect()
    }

    /// `(step, λ)`.
    pub fn lambda(&self) -> Vec<(f64, f64)> {
        self.scu.iter().map(|s| (s.step as f64, s.lambda)).collect()
    }
}

/// The snapshots of a `telemetry.jsonl`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Telemetry {
    pub snapshots: Vec<Snapshot>,
    /// Problems that did not stop loading (e.g. a truncated last line), one line each.
    pub warnings: Vec<String>,
}

/// Read a `metrics.jsonl` (one [`Event`] per line).
///
/// Blank lines are ignored. A last line that does not parse (a run killed mid-write) is
/// skipped with a warning in [`RunMetrics::warnings`], and so is a torn record that a later
/// write was glued onto (files written before resumes cut torn tails); any other bad line is
/// an error naming the file and line.
pub fn load_metrics(path: &Path) -> Result<RunMetrics, ReportError> {
    let (events, warnings) = read_jsonl(path, parse_event)?;
    let mut metrics = RunMetrics::from_events(events);
    metrics.warnings = warnings;
    Ok(metrics)
}

/// Read a `telemetry.jsonl` (one [`Snapshot`] per line), with the same rules as
/// [`load_metrics`].
pub fn load_telemetry(path: &Path) -> Result<Telemetry, ReportError> {
    let (snapshots, warnings) = read_jsonl(path, |line| serde_json::from_slice::<Snapshot>(line))?;
    Ok(Telemetry {
        snapshots,
        warnings,
    })
}

/// Parse a JSON-lines file; a bad line is only forgiven when no non-blank line follows it.
fn read_jsonl<T>(
    path: &Path,
    parse: impl Fn(&[u8]) -> Result<T, serde_json::Error>,
) -> Result<(Vec<T>, Vec<String>), ReportError> {
    let file = crate::util::open_regular(path).map_err(io_error(path))?;
    let mut reader = BufReader::new(file);
    let mut records = Vec::new();
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    let mut pending: Option<(usize, serde_json::Error)> = None;
    let mut warnings = Vec::new();
    loop {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        let line = buf.trim_ascii();
        if line.is_empty() {
            continue;
        }
        if let Some((line, source)) = pending.take() {
            return Err(ReportError::Parse {
                path: path.to_path_buf(),
                line,
                source,
            });
        }
        match parse(line) {
            Ok(record) => records.push(record),
            Err(e) => match glued(line, &parse) {
                // a torn record (a crash mid-write) with the next run's first record after it
                Some(record) => {
                    records.push(record);
                    warnings.push(format!(
                        "{}: line {line_no}: skipped a torn record joined to the next one",
                        path.display()
                    ));
                }
                None => pending = Some((line_no, e)),
            },
        }
    }
    warnings.extend(pending.map(|(line, e)| {
        format!(
            "{}: skipped an incomplete last line {line} ({e})",
            path.display()
        )
    }));
    Ok((records, warnings))
}

/// The whole record at the end of a line that starts with a torn one (`{"event":"st{"event":…}`).
fn glued<T>(line: &[u8], parse: impl Fn(&[u8]) -> Result<T, serde_json::Error>) -> Option<T> {
    (1..line.len())
        .filter(|&i| line[i..].starts_with(b"{\""))
        .find_map(|i| parse(&line[i..]).ok())
}

/// Decode one event line (non-finite numbers, written as `null`, read back as NaN: see
/// [`crate::engine::events::nan_f64`]).
fn parse_event(line: &[u8]) -> Result<Event, serde_json::Error> {
    serde_json::from_slice::<Event>(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_record_glued_to_the_next_is_skipped_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        let eval = r#"{"event":"eval","step":5,"val_loss":1.0,"val_bpt":1.0,"val_ppl":2.0}"#;
        std::fs::write(&p, format!("{eval}\n{{\"event\":\"eval\",\"st{eval}\n")).unwrap();
        let m = load_metrics(&p).unwrap();
        assert_eq!(m.evals.len(), 2);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].contains("line 2"), "{:?}", m.warnings);
    }

    #[test]
    fn nan_written_as_null_reads_back_as_nan() {
        let line = r#"{"event":"eval","step":5,"val_loss":null,"val_bpt":null,"val_ppl":2.0}"#;
        match parse_event(line.as_bytes()).unwrap() {
            Event::Eval(e) => {
                assert!(e.val_loss.is_nan() && e.val_bpt.is_nan());
                assert_eq!(e.val_ppl, 2.0);
            }
            other => panic!("{other:?}"),
        }
        // Other events stay strict, and so do nulls where a non-float is expected.
        assert!(parse_event(br#"{"event":"paused","step":null}"#).is_err());
        assert!(parse_event(
            br#"{"event":"eval","step":null,"val_loss":1,"val_bpt":1,"val_ppl":1}"#
        )
        .is_err());
    }
}
