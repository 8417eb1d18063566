//! The comparison view's state: the table rows and curves of each arm (a configuration, its
//! seeds averaged), which row is selected and which chart is shown. Keys in, quit out; it
//! never draws or touches the terminal.

use crate::report::compare::{table_cells, ComparedRun, Curves, Group};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

/// The chart the view shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareChart {
    /// Held-out bits/token at each evaluation.
    ValBpt,
    /// S (with the selected arm's setpoint).
    SRatio,
    /// λ on a log scale.
    Lambda,
}

impl CompareChart {
    /// Every chart, in tab order (keys 1, 2, 3).
    pub const ALL: [CompareChart; 3] = [
        CompareChart::ValBpt,
        CompareChart::SRatio,
        CompareChart::Lambda,
    ];

    /// The tab label.
    pub fn name(self) -> &'static str {
        match self {
            CompareChart::ValBpt => "val bits/token",
            CompareChart::SRatio => "S",
            CompareChart::Lambda => "λ",
        }
    }

    fn index(self) -> usize {
        match self {
            CompareChart::ValBpt => 0,
            CompareChart::SRatio => 1,
            CompareChart::Lambda => 2,
        }
    }

    /// The chart `by` tabs further on, wrapping around.
    fn cycle(self, by: isize) -> CompareChart {
        let n = Self::ALL.len() as isize;
        Self::ALL[(self.index() as isize + by).rem_euclid(n) as usize]
    }
}

/// One row of the table and its lines in the charts.
#[derive(Clone, Debug, PartialEq)]
pub struct CompareArm {
    /// Table cells, in the order of [`crate::report::compare::TABLE_HEADERS`] (the same text
    /// as compare.md).
    pub cells: [String; 7],
    /// The run dirs' names (the last path component of each).
    pub runs: Vec<String>,
    /// Mean curves over the arm's runs.
    pub curves: Curves,
    /// `log10 λ` where λ > 0 (the λ chart is on a log scale).
    pub lambda_log10: Vec<(f64, f64)>,
}

impl CompareArm {
    /// What sets this arm apart (`target=0.01`), or its run name.
    pub fn label(&self) -> &str {
        &self.cells[0]
    }
}

/// What `cockpit compare` shows on a terminal. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct CompareState {
    /// The arms, in table order.
    pub arms: Vec<CompareArm>,
    /// What was compared (the paths given), for the header.
    pub source: String,
    /// Where compare.md, compare.json and the charts were written, when they were.
    pub out_dir: Option<String>,
    selected: usize,
    chart: CompareChart,
}

impl CompareState {
    /// The view of `groups` (the table) and `runs` (each group's runs, in the same order),
    /// as [`crate::report::compare::compare`] returns them.
    pub fn new(groups: &[Group], runs: &[Vec<ComparedRun>], source: impl Into<String>) -> Self {
        let arms = groups
            .iter()
            .zip(runs)
            .map(|(g, r)| {
                let curves = Curves::of(r);
                let lambda_log10 = curves
                    .lambda
                    .iter()
                    .filter(|(_, y)| *y > 0.0 && y.is_finite())
                    .map(|&(x, y)| (x, y.log10()))
                    .collect();
                CompareArm {
                    cells: table_cells(g),
                    runs: g
                        .runs
                        .iter()
                        .map(|d| {
                            d.file_name().map_or_else(
                                || d.display().to_string(),
                                |n| n.to_string_lossy().into_owned(),
                            )
                        })
                        .collect(),
                    curves,
                    lambda_log10,
                }
            })
            .collect();
        CompareState {
            arms,
            source: source.into(),
            out_dir: None,
            selected: 0,
            chart: CompareChart::ValBpt,
        }
    }

    /// Says where the files went (shown in the header).
    pub fn with_out_dir(mut self, dir: impl Into<String>) -> Self {
        self.out_dir = Some(dir.into());
        self
    }

    /// The selected row (its lines are drawn on top, the others dimmed).
    pub fn selected(&self) -> usize {
        self.selected
    }

    /// The chart shown.
    pub fn chart(&self) -> CompareChart {
        self.chart
    }

    /// Moves the selection by `by` rows, stopping at the first and last.
    pub fn select_by(&mut self, by: isize) {
        let last = self.arms.len().saturating_sub(1) as isize;
        self.selected = (self.selected as isize + by).clamp(0, last) as usize;
    }

    /// Shows `chart`.
    pub fn show(&mut self, chart: CompareChart) {
        self.chart = chart;
    }

    /// Handles a key press; `true` means leave the view. ↑/↓ (k/j), PgUp/PgDn, Home/End
    /// move the selection; Tab/Shift+Tab (→/←, l/h) cycle the chart, 1–3 pick one; q, Esc
    /// or Ctrl+C quit.
    pub fn on_key(&mut self, key: KeyEvent) -> bool {
        if key.kind == KeyEventKind::Release {
            return false;
        }
        let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
        match key.code {
            KeyCode::Char('c') if ctrl => return true,
            KeyCode::Char('q') | KeyCode::Esc => return true,
            KeyCode::Down | KeyCode::Char('j') => self.select_by(1),
            KeyCode::Up | KeyCode::Char('k') => self.select_by(-1),
            KeyCode::PageDown => self.select_by(10),
            KeyCode::PageUp => self.select_by(-10),
            KeyCode::Home | KeyCode::Char('g') => self.selected = 0,
            KeyCode::End | KeyCode::Char('G') => self.select_by(isize::MAX / 2),
            KeyCode::Tab | KeyCode::Right | KeyCode::Char('l') => self.chart = self.chart.cycle(1),
            KeyCode::BackTab | KeyCode::Left | KeyCode::Char('h') => {
                self.chart = self.chart.cycle(-1)
            }
            KeyCode::Char(c @ '1'..='3') => {
                let i = usize::from(c as u8 - b'1');
                self.chart = CompareChart::ALL[i];
            }
            _ => {}
        }
        false
    }
}
