//! `cockpit compare`'s terminal view: whole screens on ratatui's `TestBackend` (insta
//! snapshots), the keys (selection, chart), the highlight of the selected arm, and the
//! command off a terminal. Built from the real run dirs in `tests/fixtures/compare/sweep`
//! (a short `cockpit sweep` of the small model; its README says how it was made).

use assert_cmd::Command;
use cockpit::report::compare::compare;
use cockpit::tui::state::{CompareChart, CompareState};
use cockpit::tui::views::compare::arm_color;
use cockpit::tui::Theme;
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::style::Modifier;
use ratatui::Terminal;
use std::path::{Path, PathBuf};

/// The sweep under test, as `cockpit compare` would be given it.
const SWEEP: &str = "tests/fixtures/compare/sweep";
/// Its arms, in table order.
const ARMS: [&str; 4] = [
    "scu.enabled=false scu.lambda_init=0",
    "scu.enabled=false scu.lambda_init=0.1",
    "scu.target=0.01",
    "scu.target=0.02",
];

fn sweep_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(SWEEP)
}

fn state() -> CompareState {
    let (groups, runs) = compare(&[sweep_dir()]).unwrap_or_else(|e| panic!("{e}"));
    CompareState::new(&groups, &runs, SWEEP).with_out_dir(format!("{SWEEP}/compare"))
}

fn buffer(state: &CompareState, width: u16, height: u16) -> Buffer {
    let mut terminal =
        Terminal::new(TestBackend::new(width, height)).unwrap_or_else(|e| panic!("{e}"));
    let theme = Theme::default();
    terminal
        .draw(|f| state.render(f, &theme))
        .unwrap_or_else(|e| panic!("{e}"));
    terminal.backend().buffer().clone()
}

fn render(state: &CompareState, width: u16, height: u16) -> String {
    let mut terminal =
        Terminal::new(TestBackend::new(width, height)).unwrap_or_else(|e| panic!("{e}"));
    let theme = Theme::default();
    terminal
        .draw(|f| state.render(f, &theme))
        .unwrap_or_else(|e| panic!("{e}"));
    terminal.backend().to_string()
}

fn key(c: char) -> KeyEvent {
    KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
}

fn code(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

/// The screen row (as text) that holds `needle`, if any.
fn row_with(screen: &str, needle: &str) -> Option<String> {
    screen
        .lines()
        .find(|l| l.contains(needle))
        .map(str::to_string)
}

// ------------------------------------------------------------------ snapshots

#[test]
fn snapshot_val_chart_first_arm_selected() {
    let s = state();
    insta::assert_snapshot!("compare_val_120x40", render(&s, 120, 40));
    insta::assert_snapshot!("compare_val_80x24", render(&s, 80, 24));
}

#[test]
fn snapshot_s_chart_second_arm_selected() {
    let mut s = state();
    assert!(!s.on_key(code(KeyCode::Down)));
    assert!(!s.on_key(key('2')));
    insta::assert_snapshot!("compare_s_120x40", render(&s, 120, 40));
}

#[test]
fn snapshot_lambda_chart_last_arm_selected() {
    let mut s = state();
    assert!(!s.on_key(code(KeyCode::End)));
    assert!(!s.on_key(key('3')));
    insta::assert_snapshot!("compare_lambda_120x40", render(&s, 120, 40));
    insta::assert_snapshot!("compare_lambda_80x24", render(&s, 80, 24));
}

/// A short terminal: the table scrolls to keep the selection in view and says which rows
/// it shows; columns that do not fit are left out, the run column is elided.
#[test]
fn snapshot_small_terminal_scrolls_the_table() {
    let mut s = state();
    assert!(!s.on_key(code(KeyCode::End)));
    insta::assert_snapshot!("compare_scrolled_60x16", render(&s, 60, 16));
    insta::assert_snapshot!("compare_too_small_40x10", render(&s, 40, 10));
}

// ------------------------------------------------------------------ the table

#[test]
fn the_table_has_one_row_per_arm_with_compare_md_cells() {
    let s = state();
    assert_eq!(
        s.arms.iter().map(|a| a.label()).collect::<Vec<_>>(),
        ARMS.to_vec()
    );
    let (groups, _) = compare(&[sweep_dir()]).unwrap_or_else(|e| panic!("{e}"));
    let md = cockpit::report::compare::table_markdown(&groups);
    let screen = render(&s, 160, 40);
    for (arm, group) in s.arms.iter().zip(&groups) {
        assert_eq!(arm.runs.len(), 2, "{}: two seeds", arm.label());
        assert_eq!(arm.runs.len(), group.runs.len());
        // each cell of the view is a cell of compare.md, and is on the arm's screen row
        let row = row_with(&screen, arm.label()).unwrap_or_else(|| panic!("{screen}"));
        for cell in &arm.cells {
            assert!(md.contains(&format!("| {cell} |")), "{cell} in\n{md}");
            assert!(row.contains(cell.as_str()), "{cell} in {row}");
        }
    }
}

// ------------------------------------------------------------------ keys

#[test]
fn keys_move_the_selection_and_switch_the_chart() {
    let mut s = state();
    assert_eq!((s.selected(), s.chart()), (0, CompareChart::ValBpt));

    // up at the top stays; down, j move; down at the bottom stays
    assert!(!s.on_key(code(KeyCode::Up)));
    assert_eq!(s.selected(), 0);
    assert!(!s.on_key(code(KeyCode::Down)));
    assert!(!s.on_key(key('j')));
    assert_eq!(s.selected(), 2);
    for _ in 0..5 {
        s.on_key(code(KeyCode::Down));
    }
    assert_eq!(s.selected(), ARMS.len() - 1);
    assert!(!s.on_key(key('k')));
    assert_eq!(s.selected(), ARMS.len() - 2);
    s.on_key(code(KeyCode::Home));
    assert_eq!(s.selected(), 0);
    s.on_key(code(KeyCode::End));
    assert_eq!(s.selected(), ARMS.len() - 1);
    s.on_key(code(KeyCode::PageUp));
    assert_eq!(s.selected(), 0);

    // tab cycles forward, shift+tab back, 1-3 pick
    let tabs: Vec<CompareChart> = (0..4)
        .map(|_| {
            s.on_key(code(KeyCode::Tab));
            s.chart()
        })
        .collect();
    assert_eq!(
        tabs,
        [
            CompareChart::SRatio,
            CompareChart::Lambda,
            CompareChart::ValBpt,
            CompareChart::SRatio
        ]
    );
    s.on_key(code(KeyCode::BackTab));
    s.on_key(code(KeyCode::BackTab));
    assert_eq!(s.chart(), CompareChart::Lambda);
    for (c, chart) in ['1', '2', '3'].into_iter().zip(CompareChart::ALL) {
        s.on_key(key(c));
        assert_eq!(s.chart(), chart);
    }
    // other keys and key releases change nothing
    let before = s.clone();
    assert!(!s.on_key(key('x')));
    assert!(!s.on_key(key('4')));
    let mut release = key('q');
    release.kind = KeyEventKind::Release;
    assert!(!s.on_key(release));
    assert_eq!(s, before);

    // q, Esc and Ctrl+C leave
    assert!(s.clone().on_key(key('q')));
    assert!(s.clone().on_key(code(KeyCode::Esc)));
    assert!(s
        .clone()
        .on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)));
}

/// The selected arm's row is marked and its line is drawn bold on top; the other arms'
/// lines are dimmed. The tab of the chart shown is bracketed.
#[test]
fn the_selected_arm_is_highlighted_in_the_table_and_the_chart() {
    let theme = Theme::default();
    let mut s = state();
    s.on_key(key('2')); // S: every arm has a line
    for (selected, arm) in ARMS.iter().enumerate() {
        let buf = buffer(&s, 160, 40);
        let screen = render(&s, 160, 40);
        let marked: Vec<&str> = screen.lines().filter(|l| l.contains('▶')).collect();
        assert_eq!(marked.len(), 1, "{screen}");
        assert!(marked[0].contains(&format!("━ {arm}")), "{}", marked[0]);
        assert!(screen.contains("[2 S]"), "{screen}");
        // braille cells of the chart, by the arm whose colour they carry
        let mut bold = vec![0usize; ARMS.len()];
        let mut dim = vec![0usize; ARMS.len()];
        for cell in buf.content() {
            let is_braille = cell
                .symbol()
                .chars()
                .next()
                .is_some_and(|c| ('\u{2801}'..='\u{28ff}').contains(&c));
            if !is_braille {
                continue;
            }
            for (i, (b, d)) in bold.iter_mut().zip(dim.iter_mut()).enumerate() {
                if cell.fg == arm_color(&theme, i) {
                    if cell.modifier.contains(Modifier::BOLD) {
                        *b += 1;
                    }
                    if cell.modifier.contains(Modifier::DIM) {
                        *d += 1;
                    }
                }
            }
        }
        for i in 0..ARMS.len() {
            if i == selected {
                assert!(bold[i] > 0 && dim[i] == 0, "arm {i}: {bold:?} {dim:?}");
            } else {
                assert!(bold[i] == 0, "arm {i}: {bold:?} {dim:?}");
            }
        }
        assert!(dim.iter().sum::<usize>() > 0, "{dim:?}");
        s.on_key(code(KeyCode::Down));
    }
}

// ------------------------------------------------------------------ the command

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap_or_else(|e| panic!("{e}"));
    c.env("NO_COLOR", "1");
    c
}

/// Off a terminal (and with --no-tui) compare prints the table and writes the files as
/// before; a bad theme only matters where the view would open.
#[test]
fn off_a_terminal_compare_prints_the_table() {
    for extra in [
        &[][..],
        &["--no-tui"][..],
        &["--theme", "no-such-theme"][..],
    ] {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let out = dir.path().join("cmp");
        let o = cockpit()
            .arg("compare")
            .arg(sweep_dir())
            .arg("--out")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let table = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{extra:?}: {table}{err}");
        assert!(table.starts_with("| run | seeds |"), "{table}");
        assert_eq!(table.lines().count(), 2 + ARMS.len(), "{table}");
        let md = std::fs::read_to_string(out.join("compare.md")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(md, table);
        assert!(out.join("compare.json").is_file());
        assert!(!table.contains('\u{1b}'), "no escape codes off a terminal");
    }
}

/// compare on a directory without runs: exit 2 naming it, with or without --no-tui.
#[test]
fn compare_without_runs_still_exits_2_naming_the_dir() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for extra in [&[][..], &["--no-tui"][..]] {
        let o = cockpit()
            .arg("compare")
            .arg(dir.path())
            .args(extra)
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}

/// Two runs of one configuration and one seed (a run repeated) are one seed, not two: the
/// table says so rather than showing a spread of 0 over "2" seeds.
#[test]
fn repeated_runs_of_one_seed_count_as_one_seed() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let run = sweep_dir().join("target-0.01-s1337");
    for copy in ["a", "b"] {
        let to = dir.path().join(copy);
        std::fs::create_dir(&to).unwrap_or_else(|e| panic!("{e}"));
        for f in ["metrics.jsonl", "training_config.json"] {
            std::fs::copy(run.join(f), to.join(f)).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let (groups, _) = compare(&[dir.path().to_path_buf()]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(groups.len(), 1);
    let cells = cockpit::report::compare::table_cells(&groups[0]);
    assert_eq!(cells[1], "1 (2 runs)");
    // The sweep's arms: two seeds each, counted as before.
    let (groups, _) = compare(&[sweep_dir()]).unwrap_or_else(|e| panic!("{e}"));
    assert!(groups
        .iter()
        .all(|g| cockpit::report::compare::table_cells(g)[1] == "2"));
}
