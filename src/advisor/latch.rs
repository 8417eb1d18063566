//! Hysteresis over time: a rule shows only after firing on several evaluations in a row, and
//! goes away only after clearing on as many.

use super::options::Level;
use super::Recommendation;

/// The standing of one rule on one GPU.
#[derive(Clone, Debug)]
pub(crate) struct Latch {
    active: bool,
    /// Consecutive evaluations pushing towards the other state.
    streak: u32,
    /// The latest recommendation the rule built (evidence stays fresh while it stands).
    rec: Recommendation,
}

impl Latch {
    pub(crate) fn new(rec: Recommendation) -> Self {
        Self {
            active: false,
            streak: 0,
            rec,
        }
    }

    /// Feed one evaluation; `rec` refreshes the evidence when the rule produced one.
    pub(crate) fn update(&mut self, level: Level, confirm: u32, rec: Option<Recommendation>) {
        if let Some(rec) = rec {
            self.rec = rec;
        }
        let towards_change = match level {
            Level::Fire => !self.active,
            Level::Clear => self.active,
            Level::Hold => false,
        };
        if towards_change {
            self.streak += 1;
            if self.streak >= confirm.max(1) {
                self.active = !self.active;
                self.streak = 0;
            }
        } else {
            self.streak = 0;
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.active
    }

    /// Neither standing nor on its way to standing: the latch can be forgotten.
    pub(crate) fn dormant(&self) -> bool {
        !self.active && self.streak == 0
    }

    pub(crate) fn rec(&self) -> &Recommendation {
        &self.rec
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advisor::Severity;

    fn rec() -> Recommendation {
        Recommendation {
            id: "x".into(),
            severity: Severity::Info,
            gpu: None,
            message: String::new(),
            evidence: Vec::new(),
            action: String::new(),
            key: None,
        }
    }

    #[test]
    fn needs_a_streak_to_fire_and_to_clear() {
        let mut latch = Latch::new(rec());
        latch.update(Level::Fire, 3, None);
        latch.update(Level::Fire, 3, None);
        latch.update(Level::Hold, 3, None);
        latch.update(Level::Fire, 3, None);
        assert!(!latch.active(), "an interrupted streak starts over");
        latch.update(Level::Fire, 3, None);
        latch.update(Level::Fire, 3, None);
        assert!(latch.active());
        latch.update(Level::Clear, 3, None);
        latch.update(Level::Fire, 3, None);
        assert!(latch.active());
        for _ in 0..3 {
            latch.update(Level::Clear, 3, None);
        }
        assert!(!latch.active() && latch.dormant());
    }
}
