//! The dashboard end to end, in a real terminal: the `cockpit` binary runs in a detached tmux
//! session, and the test reads the screen the way a user would, presses keys, and checks what the
//! run leaves behind (a checkpoint on disk, exit status 0, a terminal back in its normal state).
//!
//! tmux runs on a private socket (`tmux -L <unique name>`, no user config), so the test never
//! touches a tmux server the user has running; a guard kills that server however the test ends.
//! Without tmux on `PATH` the test says so and passes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Terminal size for the session: large enough for every panel of the training view.
const COLS: u16 = 140;
const ROWS: u16 = 42;
/// The tmux session (one window, one pane) that runs cockpit.
const SESSION: &str = "cockpit-e2e";
/// Printed into the pane by the wrapper shell once cockpit has exited.
const EXITED: &str = "COCKPIT-EXITED";
/// Longest wait for any one thing to appear on screen (startup includes building the corpus).
const WAIT: Duration = Duration::from_secs(30);
/// How often the screen is read while waiting.
const POLL: Duration = Duration::from_millis(100);

/// A tmux server on a socket of its own; killed on drop, whatever happened in the test.
struct Tmux {
    socket: String,
    /// The socket file, once the server runs; tmux leaves it behind after `kill-server`.
    socket_path: Option<PathBuf>,
}

impl Tmux {
    fn new() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Tmux {
            socket: format!("cockpit-e2e-{}-{nanos}", std::process::id()),
            socket_path: None,
        }
    }

    /// Runs `tmux -L <socket> -f /dev/null ARGS`; panics with tmux's stderr when it fails.
    fn run(&self, args: &[&str]) -> Output {
        let out = Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .env_remove("TMUX")
            .output()
            .expect("running tmux");
        assert!(
            out.status.success(),
            "tmux {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// The visible screen of the pane, one string per row.
    fn screen(&self) -> String {
        let out = self.run(&["capture-pane", "-p", "-t", SESSION]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A tmux format (`#{...}`) evaluated for the pane.
    fn display(&self, format: &str) -> String {
        let out = self.run(&["display-message", "-p", "-t", SESSION, format]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Types `keys` literally into the pane.
    fn type_keys(&self, keys: &str) {
        self.run(&["send-keys", "-t", SESSION, "-l", keys]);
    }

    /// A server running `sh -c script` in the one session, at [`COLS`]×[`ROWS`].
    fn start(script: &str) -> Self {
        let mut tmux = Tmux::new();
        tmux.run(&[
            "new-session",
            "-d",
            "-s",
            SESSION,
            "-x",
            &COLS.to_string(),
            "-y",
            &ROWS.to_string(),
            "sh",
            "-c",
            script,
        ]);
        tmux.socket_path = Some(PathBuf::from(tmux.display("#{socket_path}")));
        tmux
    }

    /// The exit status the wrapper shell wrote to `exit_file`; panics with the screen when
    /// cockpit has not exited within [`WAIT`] of `after`.
    fn wait_exit(&self, exit_file: &Path, after: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = read_exit_file(exit_file) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "cockpit did not exit after {after}; the screen was:\n{}",
                self.screen()
            );
            thread::sleep(POLL);
        }
    }

    /// Reads the screen until `ready` accepts it; panics with the last screen after [`WAIT`].
    fn wait_for(&self, what: &str, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let screen = self.screen();
            if ready(&screen) {
                return screen;
            }
            if Instant::now() >= deadline {
                panic!("timed out waiting for {what}; the screen was:\n{screen}");
            }
            thread::sleep(POLL);
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        // Best effort: the server may already be gone.
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .env_remove("TMUX")
            .output();
        if let Some(path) = &self.socket_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn tmux_available() -> bool {
    Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// True (and says so) where tmux is missing: the test then skips itself.
fn skip_without_tmux() -> bool {
    let missing = !tmux_available();
    if missing {
        eprintln!("SKIPPED tui_e2e: tmux is not on PATH; install tmux to run this test");
    }
    missing
}

/// A pane script: run `cockpit`, record its exit status in `exit_file`, print the EXITED
/// marker, run `after` (e.g. a look at the terminal's modes) and stay for inspection.
fn recording_exit(cockpit: &str, exit_file: &Path, after: &str) -> String {
    format!(
        "{cockpit}; status=$?; echo \"$status\" > {exit}; echo {EXITED}; {after}exec sleep 600",
        exit = sh_quote(exit_file.to_str().expect("utf-8 temp path")),
    )
}

/// `'…'` for `sh`, with embedded single quotes escaped.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The step counter from the header line `step N/M · …`.
fn header_step(screen: &str) -> Option<u64> {
    let rest = &screen[screen.find("step ")? + "step ".len()..];
    let digits: String = rest
        .chars()
        .take_while(|c| *c != '/')
        .filter(|c| *c != ',')
        .collect();
    digits.parse().ok()
}

/// Whether the loss panel has a value in its title and a drawn curve (braille dots).
fn loss_panel_has_data(screen: &str) -> bool {
    let titled = screen.lines().any(|l| {
        l.find("loss ━ train ")
            .map(|i| &l[i + "loss ━ train ".len()..])
            .and_then(|rest| rest.chars().next())
            .is_some_and(|c| c.is_ascii_digit())
    });
    let plotted = screen
        .chars()
        .filter(|c| ('\u{2801}'..='\u{28ff}').contains(c))
        .count()
        > 20;
    titled && plotted && !screen.contains("waiting for the first step")
}

/// The rows of the events panel (the right-hand column under `╭ events`).
fn events_panel(screen: &str) -> String {
    let rows: Vec<&str> = screen.lines().collect();
    let Some((top, col)) = rows.iter().enumerate().find_map(|(i, l)| {
        l.find("╭ events")
            .map(|byte| (i, l[..byte].chars().count()))
    }) else {
        return String::new();
    };
    let mut panel = String::new();
    for row in &rows[top + 1..] {
        let cells: String = row.chars().skip(col).collect();
        if cells.starts_with('╰') {
            break;
        }
        let _ = writeln!(panel, "{cells}");
    }
    panel
}

fn read_exit_file(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|s| s.ends_with('\n'))
        .map(|s| s.trim().to_string())
}

#[test]
fn dashboard_steers_a_real_run_and_restores_the_terminal() {
    if skip_without_tmux() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir: PathBuf = dir.path().join("run");
    let exit_file = dir.path().join("exit-status");

    // cockpit runs under sh; after it exits, sh records its status, prints a marker and the
    // terminal modes that raw mode would have changed, then stays so the pane can be inspected.
    let cockpit = [
        env!("CARGO_BIN_EXE_cockpit"),
        "train",
        "--run-dir",
        run_dir.to_str().expect("utf-8 temp path"),
        "--set",
        "model.n_embd=32",
        "--set",
        "model.seq_len=32",
        "--set",
        "run.max_steps=100000",
        "--set",
        "data.builtin_tokens=200000",
        "--set",
        "optim.micro_batch=32",
    ]
    .map(sh_quote)
    .join(" ");
    let script = recording_exit(
        &cockpit,
        &exit_file,
        "stty -a | tr ' ;' '\\n\\n' | grep -E -x -- '-?(icanon|echo)'; ",
    );

    let tmux = Tmux::start(&script);

    // The charts fill: a few steps in the header, a loss value and a curve.
    tmux.wait_for("the run to reach step 5 with a loss curve", |s| {
        header_step(s).is_some_and(|n| n >= 5) && loss_panel_has_data(s)
    });
    assert_eq!(
        tmux.display("#{alternate_on}"),
        "1",
        "the dashboard uses the alternate screen"
    );
    assert!(
        tmux.screen().contains("micro-batch 32×"),
        "the run starts at micro-batch 32"
    );

    // `+` doubles the micro-batch; the header and the events panel show it applied.
    tmux.type_keys("+");
    tmux.wait_for("the larger batch to be applied", |s| {
        let header = s.lines().take(3).collect::<String>();
        header.contains("micro-batch 64×")
            && !header.contains("pending")
            && events_panel(s).contains("applied: batch size")
    });

    // `c` writes a checkpoint now: the events panel says so and it is on disk.
    tmux.type_keys("c");
    tmux.wait_for("the checkpoint to be reported", |s| {
        events_panel(s).contains("checkpoint saved")
    });
    let latest = run_dir.join("checkpoints").join("latest");
    let first_checkpoint = std::fs::read_to_string(&latest)
        .unwrap_or_else(|e| panic!("{} after `c`: {e}", latest.display()));
    assert!(
        run_dir
            .join("checkpoints")
            .join(first_checkpoint.trim())
            .is_dir(),
        "`latest` names a checkpoint directory, got {first_checkpoint:?}"
    );

    // `q` asks first; `s` saves and quits.
    tmux.type_keys("q");
    tmux.wait_for("the quit confirmation", |s| {
        s.contains("Stop it?") && s.contains("save a checkpoint, then quit")
    });
    tmux.type_keys("s");
    let status = tmux.wait_exit(&exit_file, "save-and-quit");
    assert_eq!(status, "0", "exit status after save-and-quit");

    // The save on quit wrote a second checkpoint (the run's event log lists both).
    let events_log = std::fs::read_to_string(run_dir.join("events.log")).expect("events.log");
    let saved = events_log
        .lines()
        .filter(|l| l.contains("checkpoint saved"))
        .count();
    assert_eq!(
        saved, 2,
        "`c` and save-and-quit each save once:\n{events_log}"
    );
    let last_checkpoint = std::fs::read_to_string(&latest).expect("checkpoints/latest");
    assert!(
        last_checkpoint.trim() >= first_checkpoint.trim(),
        "`latest` moves forward: {first_checkpoint:?} then {last_checkpoint:?}"
    );

    // The terminal is back: normal screen, cursor shown, cooked mode with echo.
    let screen = tmux.wait_for("the shell's lines after exit", |s| {
        s.contains(EXITED)
            && s.lines()
                .any(|l| l.trim().trim_start_matches('-') == "echo")
    });
    assert_eq!(
        tmux.display("#{alternate_on}"),
        "0",
        "left the alternate screen"
    );
    assert_eq!(tmux.display("#{cursor_flag}"), "1", "the cursor is visible");
    let modes: Vec<&str> = screen
        .lines()
        .skip_while(|l| !l.contains(EXITED))
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert!(
        modes.contains(&"icanon") && modes.contains(&"echo"),
        "raw mode is off after exit (stty shows {modes:?})"
    );
    assert!(
        !screen.contains("╭ loss"),
        "the dashboard is gone from the screen:\n{screen}"
    );
}

/// `cockpit train --gpus 2` in a real terminal (CPU ranks over the `tcp` backend): the
/// launcher shows rank 0's dashboard with both ranks' step times, and `q` then `s` stops the
/// whole job with a checkpoint, as in a single-process run.
#[test]
fn the_launcher_dashboard_shows_every_rank_and_stops_the_job() {
    if skip_without_tmux() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir: PathBuf = dir.path().join("run");
    let exit_file = dir.path().join("exit-status");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let port_set = format!("distributed.master_port={port}");
    let cockpit = [
        env!("CARGO_BIN_EXE_cockpit"),
        "train",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--run-dir",
        run_dir.to_str().expect("utf-8 temp path"),
        "--set",
        "distributed.backend=\"tcp\"",
        "--set",
        &port_set,
        "--set",
        "model.n_embd=32",
        "--set",
        "model.seq_len=32",
        "--set",
        "run.max_steps=100000",
        "--set",
        "data.builtin_tokens=200000",
        "--set",
        "optim.micro_batch=16",
    ]
    .map(sh_quote)
    .join(" ");
    let script = recording_exit(&cockpit, &exit_file, "");
    let tmux = Tmux::start(&script);
    let screen = tmux.wait_for("rank 0's dashboard with both ranks' step times", |s| {
        header_step(s).is_some_and(|n| n >= 3) && s.contains("2 ranks r0 ") && s.contains(" r1 ")
    });
    assert!(screen.contains("rank 0 of 2 (tcp)"), "{screen}");
    tmux.type_keys("q");
    tmux.wait_for("the quit confirmation", |s| {
        s.contains("Stop it?") && s.contains("save a checkpoint, then quit")
    });
    tmux.type_keys("s");
    let status = tmux.wait_exit(&exit_file, "save-and-quit");
    assert_eq!(status, "0", "exit status after save-and-quit");
    assert!(run_dir.join("checkpoints").join("latest").is_file());
    for r in [0, 1] {
        let log = std::fs::read_to_string(run_dir.join(format!("ranks/rank-{r}.log")))
            .expect("the worker's log");
        assert!(log.contains("stopped by command"), "rank {r}:\n{log}");
    }
}

/// The README's `keys = { quit = "x" }`: the popup shows its own key for quitting without
/// saving, and `x` twice saves. Then the terminal goes away under the dashboard (the tmux
/// server is killed: SIGHUP): the run goes on headless, its output in `cockpit.out`, until
/// SIGTERM saves and ends it.
#[test]
fn a_rebound_quit_key_and_a_terminal_that_hangs_up_lose_nothing() {
    if skip_without_tmux() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir: PathBuf = dir.path().join("run");
    let pid_file = dir.path().join("pid");
    let config = dir.path().join("x.toml");
    std::fs::write(&config, "[tui]\nkeys = { quit = \"x\" }\n").expect("config");
    let cockpit = [
        env!("CARGO_BIN_EXE_cockpit"),
        "train",
        config.to_str().expect("utf-8 temp path"),
        "--run-dir",
        run_dir.to_str().expect("utf-8 temp path"),
        "--set",
        "model.n_embd=32",
        "--set",
        "model.seq_len=32",
        "--set",
        "run.max_steps=100000",
        "--set",
        "data.builtin_tokens=200000",
        "--set",
        "run.log_every_secs=0.2",
    ]
    .map(sh_quote)
    .join(" ");
    // `exec`: the pane's process is cockpit itself, so its pid is the shell's.
    let script = format!(
        "echo $$ > {pid}; exec {cockpit}",
        pid = sh_quote(pid_file.to_str().expect("utf-8 temp path")),
    );
    let tmux = Tmux::start(&script);
    tmux.wait_for("the run to reach step 3", |s| {
        header_step(s).is_some_and(|n| n >= 3)
    });
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    // A failed assertion below must not leave the run going on headless (it would, by design).
    let mut reap = Reap(pid);
    tmux.type_keys("x");
    // (Until its last line: a capture can land while the terminal is still painting it.)
    let popup = tmux.wait_for("the whole quit confirmation", |s| {
        s.contains("Stop it?") && s.contains("Enter: the highlighted one")
    });
    assert!(popup.contains("[X] quit WITHOUT saving"), "{popup}");
    tmux.run(&["send-keys", "-t", SESSION, "Escape"]);
    tmux.wait_for("the popup to close", |s| !s.contains("Stop it?"));

    drop(tmux); // kill-server: the pane's terminal hangs up
    let out = run_dir.join("cockpit.out");
    let deadline = Instant::now() + WAIT;
    while !std::fs::read_to_string(&out).is_ok_and(|t| t.contains("step ")) {
        assert!(Instant::now() < deadline, "the run did not go on headless");
        thread::sleep(POLL);
    }
    // SAFETY: signal 0 only checks that the process exists; SIGTERM asks it to save and stop.
    assert_eq!(
        unsafe { libc::kill(pid, 0) },
        0,
        "still running after SIGHUP"
    );
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + WAIT;
    while !std::fs::read_to_string(&out).is_ok_and(|t| t.contains("cockpit: run ended")) {
        assert!(Instant::now() < deadline, "no summary after SIGTERM");
        thread::sleep(POLL);
    }
    reap.0 = 0; // (it has ended)
    let text = std::fs::read_to_string(&out).expect("cockpit.out");
    assert!(text.contains("interrupted by SIGTERM"), "{text}");
    assert!(
        run_dir.join("checkpoints").join("latest").is_file(),
        "{text}"
    );
}

/// Kills process `.0` (not 0) when dropped: a test's training run that a failed assertion
/// would otherwise leave running.
struct Reap(i32);

impl Drop for Reap {
    fn drop(&mut self) {
        if self.0 > 0 {
            // SAFETY: SIGKILL to the run this test started; a process already gone is ESRCH.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

/// `cockpit compare` on a terminal opens its view over a real sweep's run dirs (the
/// fixtures): keys move the selection and switch the chart; `q` leaves with status 0, the
/// terminal restored, the table printed and the files written as off a terminal.
#[test]
fn compare_opens_a_view_on_a_terminal_and_prints_the_table_after() {
    if skip_without_tmux() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("cmp");
    let exit_file = dir.path().join("exit-status");
    let sweep = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compare/sweep");
    let cockpit = [
        env!("CARGO_BIN_EXE_cockpit"),
        "compare",
        sweep.to_str().expect("utf-8 path"),
        "--out",
        out.to_str().expect("utf-8 temp path"),
    ]
    .map(sh_quote)
    .join(" ");
    let script = recording_exit(&cockpit, &exit_file, "");
    let tmux = Tmux::start(&script);

    let marked = |s: &str, arm: &str| {
        s.lines()
            .any(|l| l.contains('▶') && l.contains(&format!("━ {arm}")))
    };
    tmux.wait_for("the compare view", |s| {
        s.contains("cockpit ▸ compare · 4 arm(s) · 8 run(s)")
            && s.contains("[1 val bits/token]")
            && marked(s, "scu.enabled=false scu.lambda_init=0 ")
    });
    assert_eq!(
        tmux.display("#{alternate_on}"),
        "1",
        "the view uses the alternate screen"
    );

    // down twice, then the S chart
    tmux.type_keys("jj2");
    tmux.wait_for("the third arm selected and the S chart", |s| {
        marked(s, "scu.target=0.01") && s.contains("[2 S]") && s.contains("runs: target-0.01-s1337")
    });

    tmux.type_keys("q");
    let status = tmux.wait_exit(&exit_file, "q");
    assert_eq!(status, "0", "exit status after q");
    let screen = tmux.wait_for("the table after the view", |s| s.contains(EXITED));
    assert_eq!(
        tmux.display("#{alternate_on}"),
        "0",
        "left the alternate screen"
    );
    assert!(
        screen.contains("| run | seeds | final val bits/token"),
        "{screen}"
    );
    assert!(screen.contains("| scu.target=0.02 | 2 |"), "{screen}");
    assert!(!screen.contains("[2 S]"), "the view is gone:\n{screen}");
    let md = std::fs::read_to_string(out.join("compare.md")).expect("compare.md");
    assert!(md.starts_with("| run | seeds |"), "{md}");
    assert!(out.join("compare.json").is_file() && out.join("compare_val_bpt.svg").is_file());
}
