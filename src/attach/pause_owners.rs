//! Who asked for the run's pause. The engine has one pause; viewers and the local front end
//! may each ask for it. A viewer that leaves releases its pause only when nobody else (another
//! viewer, or the dashboard of the training process) still wants the run paused.
//!
//! Viewers' requests are seen as they go through the server; the local front end's go to the
//! engine directly, so they are inferred from the engine's answers: every `pause` command is
//! answered with `Paused` or a refusal, in order, and an answer for which no viewer's request
//! is in flight is the local front end's. Any `Resumed` ends every request (the engine has one
//! pause: whoever resumes it resumes it for all).

use crate::engine::events::{Command, Event};
use std::collections::BTreeSet;

#[derive(Debug, Default)]
pub(super) struct PauseOwners {
    /// Viewers (by id) whose pause stands.
    viewers: BTreeSet<u64>,
    /// Viewers' `pause` commands sent and not yet answered by the engine.
    in_flight: usize,
    /// The local front end asked for the pause.
    local: bool,
}

impl PauseOwners {
    /// Viewer `id` sends a `pause` to the engine (called before it is sent, so the answer
    /// cannot come first). Returns what [`Self::unsent`] needs if the send fails.
    pub(super) fn viewer_paused(&mut self, id: u64) -> bool {
        self.in_flight += 1;
        self.viewers.insert(id)
    }

    /// The `pause` announced by [`Self::viewer_paused`] (which returned `new`) was not sent.
    pub(super) fn unsent(&mut self, id: u64, new: bool) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if new {
            self.viewers.remove(&id);
        }
    }

    /// Viewer `id` left: whether its pause must be released (it held one, and nobody else
    /// wants the run paused).
    pub(super) fn viewer_left(&mut self, id: u64) -> bool {
        self.viewers.remove(&id) && self.viewers.is_empty() && !self.local
    }

    /// The engine's answers.
    pub(super) fn saw(&mut self, event: &Event) {
        let answer = match event {
            Event::Paused { .. } => true,
            Event::CommandRejected {
                command: Command::Pause,
                ..
            } => true,
            Event::Resumed { .. } => {
                *self = Self::default();
                false
            }
            _ => false,
        };
        if answer {
            if self.in_flight > 0 {
                self.in_flight -= 1;
            } else {
                self.local = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAUSED: Event = Event::Paused { step: 3 };
    const RESUMED: Event = Event::Resumed { step: 3 };

    fn already() -> Event {
        Event::CommandRejected {
            step: 3,
            command: Command::Pause,
            reason: "already paused".into(),
        }
    }

    #[test]
    fn a_leaving_viewer_releases_only_a_pause_nobody_else_wants() {
        // alone: released
        let mut p = PauseOwners::default();
        p.viewer_paused(1);
        p.saw(&PAUSED);
        assert!(p.viewer_left(1));
        // two viewers: the first to leave keeps it, the last releases it
        let mut p = PauseOwners::default();
        p.viewer_paused(1);
        p.saw(&PAUSED);
        p.viewer_paused(2);
        p.saw(&already());
        assert!(!p.viewer_left(1));
        assert!(p.viewer_left(2));
        // the local dashboard paused first, or after: kept
        for local_first in [true, false] {
            let mut p = PauseOwners::default();
            if local_first {
                p.saw(&PAUSED);
                p.viewer_paused(1);
                p.saw(&already());
            } else {
                p.viewer_paused(1);
                p.saw(&PAUSED);
                p.saw(&already());
            }
            assert!(!p.viewer_left(1), "local first: {local_first}");
        }
        // a resume ends every request; a viewer that never paused releases nothing
        let mut p = PauseOwners::default();
        p.saw(&PAUSED);
        p.viewer_paused(1);
        p.saw(&already());
        p.saw(&RESUMED);
        assert!(!p.viewer_left(1));
        assert!(!p.viewer_left(2));
    }
}
