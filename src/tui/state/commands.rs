//! Commands sent to the engine and what became of them.

use crate::engine::events::Command;
use std::collections::BTreeMap;

/// Commands grouped by what they change: at most one of each kind is pending at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CommandKind {
    /// `SetBatchSize`.
    BatchSize,
    /// `SetScuSetpoint`.
    Setpoint,
    /// `CheckpointNow`.
    Checkpoint,
    /// `Pause` and `Resume`.
    PauseResume,
    /// `Stop`.
    Stop,
}

impl CommandKind {
    /// The kind of a command.
    pub fn of(command: &Command) -> CommandKind {
        match command {
            Command::SetBatchSize { .. } => CommandKind::BatchSize,
            Command::SetScuSetpoint { .. } => CommandKind::Setpoint,
            Command::CheckpointNow => CommandKind::Checkpoint,
            Command::Pause | Command::Resume => CommandKind::PauseResume,
            Command::Stop { .. } | Command::Interrupt { .. } => CommandKind::Stop,
        }
    }
}

/// Where a command stands.
#[derive(Clone, Debug, PartialEq)]
pub enum CommandStatus {
    /// Sent; the engine has not answered yet.
    Pending {
        /// The command.
        command: Command,
    },
    /// The engine applied it.
    Applied {
        /// The command.
        command: Command,
        /// The step it took effect at.
        step: u64,
        /// The engine's note on it.
        detail: String,
    },
    /// The engine refused it.
    Rejected {
        /// The command.
        command: Command,
        /// The step it was refused at.
        step: u64,
        /// Why.
        reason: String,
    },
    /// It could not be sent (the engine is gone).
    NotSent {
        /// The command.
        command: Command,
    },
}

impl CommandStatus {
    /// The command this status is about.
    pub fn command(&self) -> &Command {
        match self {
            CommandStatus::Pending { command }
            | CommandStatus::Applied { command, .. }
            | CommandStatus::Rejected { command, .. }
            | CommandStatus::NotSent { command } => command,
        }
    }
}

/// The latest status of each kind of command.
#[derive(Clone, Debug, Default)]
pub struct CommandState {
    latest: BTreeMap<CommandKind, CommandStatus>,
    last_changed: Option<CommandKind>,
}

impl CommandState {
    fn set(&mut self, status: CommandStatus) {
        let kind = CommandKind::of(status.command());
        self.latest.insert(kind, status);
        self.last_changed = Some(kind);
    }

    /// A command was sent.
    pub fn sent(&mut self, command: Command) {
        self.set(CommandStatus::Pending { command });
    }

    /// A command could not be sent.
    pub fn not_sent(&mut self, command: Command) {
        self.set(CommandStatus::NotSent { command });
    }

    /// The engine applied a command.
    pub fn applied(&mut self, step: u64, command: &Command, detail: &str) {
        self.set(CommandStatus::Applied {
            command: command.clone(),
            step,
            detail: detail.to_string(),
        });
    }

    /// The engine refused a command.
    pub fn rejected(&mut self, step: u64, command: &Command, reason: &str) {
        self.set(CommandStatus::Rejected {
            command: command.clone(),
            step,
            reason: reason.to_string(),
        });
    }

    /// An event showed that the pending command of `kind` took effect (e.g. `Paused`,
    /// `CheckpointSaved`), whether or not a `CommandApplied` follows.
    pub fn confirm(&mut self, kind: CommandKind, step: u64, detail: &str) {
        if let Some(CommandStatus::Pending { command }) = self.latest.get(&kind).cloned() {
            self.applied(step, &command, detail);
        }
    }

    /// The pending command of a kind, if any.
    pub fn pending(&self, kind: CommandKind) -> Option<&Command> {
        match self.latest.get(&kind) {
            Some(CommandStatus::Pending { command }) => Some(command),
            _ => None,
        }
    }

    /// The latest status of a kind.
    pub fn status(&self, kind: CommandKind) -> Option<&CommandStatus> {
        self.latest.get(&kind)
    }

    /// The status that changed last, for the footer.
    pub fn latest(&self) -> Option<&CommandStatus> {
        self.last_changed.and_then(|k| self.latest.get(&k))
    }
}
