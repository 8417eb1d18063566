//! The event log panel: checkpoints, commands, warnings, evals — bounded.

use std::collections::VecDeque;

/// Entries kept in memory.
const LOG_CAPACITY: usize = 500;

/// How an entry is coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    /// Ordinary news.
    Info,
    /// Something that went as asked (checkpoint written, command applied).
    Good,
    /// Needs attention.
    Warn,
    /// Failed.
    Error,
}

impl LogLevel {
    /// Short tag for the log file.
    pub fn tag(self) -> &'static str {
        match self {
            LogLevel::Info => "info",
            LogLevel::Good => "ok",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }
}

/// One line of the event log.
#[derive(Clone, Debug, PartialEq)]
pub struct LogEntry {
    /// Position in the whole log, from 0.
    pub seq: u64,
    /// Training step, when the entry is about one.
    pub step: Option<u64>,
    /// How the entry is coloured.
    pub level: LogLevel,
    /// What happened.
    pub text: String,
}

impl LogEntry {
    /// The entry as one line of plain text.
    pub fn to_line(&self) -> String {
        match self.step {
            Some(step) => format!("step {step} [{}] {}", self.level.tag(), self.text),
            None => format!("[{}] {}", self.level.tag(), self.text),
        }
    }
}

/// The latest 500 entries.
#[derive(Clone, Debug, Default)]
pub struct EventLog {
    entries: VecDeque<LogEntry>,
    next_seq: u64,
}

impl EventLog {
    /// Appends an entry.
    pub fn push(&mut self, step: Option<u64>, level: LogLevel, text: impl Into<String>) {
        if self.entries.len() == LOG_CAPACITY {
            self.entries.pop_front();
        }
        self.entries.push_back(LogEntry {
            seq: self.next_seq,
            step,
            level,
            text: text.into(),
        });
        self.next_seq += 1;
    }

    /// Entries held, oldest first.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = &LogEntry> + ExactSizeIterator {
        self.entries.iter()
    }

    /// Entries with `seq >= from` still held, oldest first.
    pub fn since(&self, from: u64) -> impl Iterator<Item = &LogEntry> {
        self.entries.iter().filter(move |e| e.seq >= from)
    }

    /// The sequence number the next entry will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the log is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
