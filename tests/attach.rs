//! Attaching viewers to a run through its control socket: a real engine on the CPU, a real
//! server relaying it, real viewers on the Unix socket.

mod common;

use cockpit::attach::protocol::ServerMessage;
use cockpit::attach::{
    self, AttachError, AttachOptions, RelayGuard, Server, ServerOptions, StatsHandle,
};
use cockpit::config::Config;
use cockpit::engine::events::{Command, Event, EventRx, FinishReason};
use cockpit::engine::{Engine, EngineOptions, EngineThread, RunSummary};
use cockpit::util::DeviceSpec;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc::Sender;
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Guards against a hang; never a timing assertion.
const PATIENCE: Duration = Duration::from_secs(120);

/// [`common::SMALL`] without a final checkpoint or GPU monitoring.
fn small(overrides: &[&str]) -> Config {
    common::small(
        &[
            &["checkpoint.at_end=false", "monitor.enabled=false"],
            overrides,
        ]
        .concat(),
    )
}

fn spawn(overrides: &[&str], dir: &Path) -> Engine {
    Engine::spawn(EngineOptions {
        max_queued_steps: 100_000,
        ..EngineOptions::new(small(overrides), dir.to_path_buf(), DeviceSpec::Cpu)
    })
    .unwrap()
}

/// A headless-style run: engine → server relay → a front end that records every event.
struct Run {
    front: JoinHandle<Vec<Event>>,
    engine: EngineThread,
    /// The engine's own command sender (the front end's).
    commands: Sender<Command>,
    stats: StatsHandle,
    guard: RelayGuard,
    /// Where the server put its socket.
    socket: std::path::PathBuf,
}

/// Start a run held paused before its first step, served on its control socket.
fn start_run(dir: &Path, overrides: &[&str], opts: ServerOptions) -> Run {
    let e = spawn(overrides, dir);
    e.commands.send(Command::Pause).unwrap();
    let server = Server::start_with(dir, opts).unwrap();
    let stats = server.stats_handle();
    let socket = server.socket_path().to_path_buf();
    let relayed = server.relay(e.events, e.commands.clone(), None);
    let events = relayed.events;
    let front = thread::spawn(move || {
        let mut all = Vec::new();
        while let Some(ev) = events.recv() {
            let done = matches!(ev, Event::Finished { .. });
            all.push(ev);
            if done {
                break;
            }
        }
        all
    });
    Run {
        front,
        engine: e.thread,
        commands: e.commands,
        stats,
        guard: relayed.guard,
        socket,
    }
}

/// Wait for the run to end; returns what the front end saw and the engine's summary.
fn finish(run: Run, dir: &Path) -> (Vec<Event>, RunSummary) {
    let events = run.front.join().unwrap();
    let summary = run.engine.wait().unwrap();
    drop(run.commands);
    run.guard.wait();
    assert!(
        !dir.join("control.sock").exists() && !dir.join(".control").exists(),
        "the socket is removed when the run ends"
    );
    (events, summary)
}

fn next(rx: &EventRx) -> Event {
    rx.recv_timeout(PATIENCE)
        .expect("an event within the patience window")
}

/// Read events until `stop` holds for one (included).
fn until(rx: &EventRx, stop: impl Fn(&Event) -> bool) -> Vec<Event> {
    let mut out = Vec::new();
    loop {
        let ev = next(rx);
        let done = stop(&ev);
        out.push(ev);
        if done {
            return out;
        }
    }
}

fn step_numbers(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s.step),
            _ => None,
        })
        .collect()
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// Socket 0600 in a 0700 dir; a private `.control` dir when the run dir is looser; stale
/// sockets replaced, live ones and non-sockets left alone; the socket removed on drop.
#[test]
fn the_socket_is_owner_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).unwrap();
    let server = Server::start(dir).unwrap();
    let sock = dir.join("control.sock");
    assert_eq!(server.socket_path(), sock);
    assert_eq!(mode(&sock), 0o600);
    assert!(matches!(Server::start(dir), Err(AttachError::InUse(_))));
    drop(server);
    assert!(!sock.exists());

    // a run dir others can read: the socket goes into a private dir
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::start(dir).unwrap();
    let private = dir.join(".control");
    assert_eq!(server.socket_path(), private.join("control.sock"));
    assert_eq!(mode(&private), 0o700);
    assert_eq!(mode(&private.join("control.sock")), 0o600);
    // and a viewer finds it there
    let a = attach::connect(dir, false).unwrap();
    assert!(a.is_live());
    drop(a);
    drop(server);
    assert!(!private.exists(), "the private dir goes with the socket");

    // a stale socket (its process is gone) is replaced; a regular file is not touched
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).unwrap();
    drop(UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let server = Server::start(dir).unwrap();
    assert_eq!(mode(&sock), 0o600);
    drop(server);
    fs::write(&sock, "not a socket").unwrap();
    assert!(matches!(
        Server::start(dir),
        Err(AttachError::NotASocket(_))
    ));
    assert_eq!(fs::read_to_string(&sock).unwrap(), "not a socket");
}

/// A viewer attaches mid-run, steers it, detaches while it is paused; a second viewer gets
/// the whole history, resumes it, and the run completes: leaving never stopped it, and a
/// quit popup's Stop from a viewer attached without allow_stop never reached the engine.
#[test]
fn attach_and_detach_while_training_keeps_the_run_going() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=30"], ServerOptions::default());

    let a = attach::connect(dir, false).unwrap();
    let hello = a.hello.clone().unwrap();
    assert!(hello.live);
    assert_eq!(hello.pid, std::process::id());
    let mut seen_a = until(&a.events, |e| matches!(e, Event::Paused { .. }));
    a.commands.send(Command::Resume).unwrap();
    seen_a.extend(until(
        &a.events,
        |e| matches!(e, Event::Step(s) if s.step >= 5),
    ));
    // what the quit popup sends: dropped, and said so in the stream
    a.commands.send(Command::Stop { save: false }).unwrap();
    let note = until(
        &a.events,
        |e| matches!(e, Event::Warning { message, .. } if message.contains("not sent")),
    );
    seen_a.extend(note);
    a.commands.send(Command::Pause).unwrap();
    seen_a.extend(until(
        &a.events,
        |e| matches!(e, Event::Paused { step } if *step > 0),
    ));
    let paused_at = seen_a.last().unwrap().step();
    let steps_a = step_numbers(&seen_a);
    assert_eq!(
        steps_a,
        (1..=paused_at).collect::<Vec<_>>(),
        "history then live, nothing twice, nothing missing"
    );
    drop(a);
    wait_for("the server to notice the viewer left", || {
        run.stats.get().viewers == 0
    });

    let b = attach::connect(dir, false).unwrap();
    assert!(b.backfilled > 0);
    b.commands.send(Command::Resume).unwrap();
    let seen_b = until(&b.events, |e| matches!(e, Event::Finished { .. }));
    match seen_b.last().unwrap() {
        Event::Finished { reason, step, .. } => {
            assert_eq!(*reason, FinishReason::Completed);
            assert_eq!(*step, 30);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(step_numbers(&seen_b), (1..=30).collect::<Vec<_>>());
    assert!(
        !seen_b.iter().any(|e| matches!(
            e,
            Event::CommandApplied {
                command: Command::Stop { .. },
                ..
            } | Event::CommandRejected {
                command: Command::Stop { .. },
                ..
            }
        )),
        "the engine never got the Stop"
    );
    drop(b);

    let stats = run.stats.get();
    let (front, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Completed);
    assert_eq!(step_numbers(&front), (1..=30).collect::<Vec<_>>());
    assert_eq!(stats.accepted, 2);
    assert_eq!(stats.commands, 3, "resume, pause, resume");
}

/// `cockpit attach RUN_DIR` without the dashboard follows a live run to its end, exit 0.
#[test]
fn headless_attach_follows_a_live_run_to_its_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let run = start_run(&dir, &["run.max_steps=10"], ServerOptions::default());
    let viewer_dir = dir.clone();
    let viewer = thread::spawn(move || {
        attach::run_attach(
            &viewer_dir,
            AttachOptions {
                tui: None,
                ..AttachOptions::default()
            },
        )
        .unwrap()
    });
    wait_for("the viewer", || run.stats.get().accepted == 1);
    run.commands.send(Command::Resume).unwrap();
    let (_, summary) = finish(run, &dir);
    assert_eq!(summary.reason, FinishReason::Completed);
    assert_eq!(viewer.join().unwrap(), 0);
}

/// The dashboard as it is today, fed by an attached viewer: its quit popup's "save and stop"
/// is not forwarded (the run goes on), the dashboard says so, and `q` then leaves.
#[test]
fn the_dashboards_quit_popup_only_detaches() {
    use cockpit::tui::{Action, App, TuiExit, TuiOptions};
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let key = |c| KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE);

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=20"], ServerOptions::default());
    let a = attach::connect(dir, false).unwrap();
    let mut app = App::training(&TuiOptions::default());
    for ev in until(&a.events, |e| matches!(e, Event::Paused { .. })) {
        app.on_event(ev);
    }
    assert_eq!(app.on_key(key('q')), None, "the quit popup opens");
    let stop = app.on_key(key('s'));
    assert_eq!(stop, Some(Action::Send(Command::Stop { save: true })));
    a.commands.send(Command::Stop { save: true }).unwrap();
    for ev in until(
        &a.events,
        |e| matches!(e, Event::Warning { message, .. } if message.contains("not sent")),
    ) {
        app.on_event(ev);
    }
    assert!(app
        .log()
        .entries()
        .any(|e| e.to_line().contains("the run goes on")));
    assert_eq!(app.on_key(key('q')), Some(Action::Quit));
    assert_eq!(app.exit(), Some(&TuiExit::StopRequested { save: true }));
    drop(a);

    run.commands.send(Command::Resume).unwrap();
    let (front, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Completed);
    assert_eq!(step_numbers(&front).len(), 20);
}

/// In the attached dashboard `q`, Ctrl+C and signals detach at once and send nothing.
#[test]
fn the_attached_dashboard_detaches_without_stopping() {
    use cockpit::tui::{Action, App, TuiExit, TuiOptions};
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let opts = TuiOptions {
        attached: true,
        ..TuiOptions::default()
    };
    let mut app = App::training(&opts);
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Char('q'), KeyModifiers::NONE)),
        Some(Action::Quit)
    );
    assert_eq!(app.exit(), Some(&TuiExit::Detached));
    let mut app = App::training(&opts);
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)),
        Some(Action::Quit)
    );
    assert_eq!(app.exit(), Some(&TuiExit::Detached));
    let mut app = App::training(&opts);
    assert_eq!(app.on_signal("SIGINT"), None, "a signal sends no Stop");
    assert_eq!(app.exit(), Some(&TuiExit::Detached));
    // Stopping needs --allow-stop and its own confirmed key: Q, then s or x.
    let shift_q = KeyEvent::new(KeyCode::Char('Q'), KeyModifiers::SHIFT);
    let mut app = App::training(&opts);
    assert_eq!(app.on_key(shift_q), None);
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Char('s'), KeyModifiers::NONE)),
        None,
        "read-only: no popup, nothing sent"
    );
    let mut app = App::training(&TuiOptions {
        allow_stop: true,
        ..opts
    });
    assert_eq!(app.on_key(shift_q), None, "the confirm popup opens");
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE)),
        None,
        "Enter on the default (cancel) sends nothing"
    );
    assert_eq!(app.on_key(shift_q), None);
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Char('s'), KeyModifiers::NONE)),
        Some(Action::Send(Command::Stop { save: true }))
    );
}

/// More viewers than allowed are turned away with a reason.
#[test]
fn too_many_viewers_are_turned_away() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        tmp.path(),
        ServerOptions {
            max_viewers: 1,
            ..ServerOptions::default()
        },
    )
    .unwrap();
    let first = attach::connect(tmp.path(), false).unwrap();
    match attach::connect(tmp.path(), false) {
        Err(AttachError::Refused { message, .. }) => {
            assert!(message.contains("too many viewers"), "{message}")
        }
        other => panic!("{:?}", other.err()),
    }
    drop(first);
    wait_for("the first viewer to leave", || server.stats().viewers == 0);
    assert!(attach::connect(tmp.path(), false).is_ok());
}

/// Two viewers at once both get the whole run.
#[test]
fn two_viewers_at_once_both_receive_every_event() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=40"], ServerOptions::default());
    let a = attach::connect(dir, false).unwrap();
    let b = attach::connect(dir, false).unwrap();
    run.commands.send(Command::Resume).unwrap();
    let finished = |e: &Event| matches!(e, Event::Finished { .. });
    let seen_a = until(&a.events, finished);
    let seen_b = until(&b.events, finished);
    assert_eq!(step_numbers(&seen_a), (1..=40).collect::<Vec<_>>());
    assert_eq!(step_numbers(&seen_b), (1..=40).collect::<Vec<_>>());
    let kinds = |v: &[Event]| {
        v.iter()
            .map(|e| serde_json::to_value(e).unwrap()["event"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&seen_a), kinds(&seen_b));
    // after Finished the server closes and the viewers' streams end
    let (_, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Completed);
    assert!(a.events.recv_timeout(PATIENCE).is_err());
    assert!(b.events.recv_timeout(PATIENCE).is_err());
}

/// A viewer that connects and never reads costs the run nothing: it loses steps, then is cut
/// off, while the other viewer keeps getting every step and the run goes on to the end.
#[test]
fn a_stalled_viewer_never_slows_or_stops_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let opts = ServerOptions {
        step_queue: 8,
        event_queue: 32,
        ..ServerOptions::default()
    };
    // SCU every step: a non-step event per step, so the stalled queue overflows for sure
    let run = start_run(dir, &["run.max_steps=100000", "scu.control_every=1"], opts);
    let stalled = UnixStream::connect(&run.socket).unwrap();
    let good = attach::connect(dir, true).unwrap();
    wait_for("both viewers", || run.stats.get().accepted == 2);
    good.commands.send(Command::Resume).unwrap();

    let mut steps = Vec::new();
    let mut cut_at = None;
    while cut_at.is_none_or(|at| steps.len() < at + 20) {
        if let Event::Step(s) = next(&good.events) {
            steps.push(s.step);
        }
        if cut_at.is_none() && run.stats.get().slow_disconnects == 1 {
            cut_at = Some(steps.len());
        }
        assert!(steps.len() < 50_000, "the stalled viewer was never cut off");
    }
    let stats = run.stats.get();
    good.commands.send(Command::Stop { save: false }).unwrap();
    let end = until(&good.events, |e| matches!(e, Event::Finished { .. }));
    steps.extend(step_numbers(&end));
    eprintln!(
        "stalled viewer cut off after the good viewer saw {} steps; {} steps dropped for it; \
         the good viewer saw {} steps in all",
        cut_at.unwrap_or(0),
        stats.dropped_steps,
        steps.len()
    );
    assert_eq!(stats.slow_disconnects, 1);
    assert!(stats.dropped_steps > 0);
    assert_eq!(stats.viewers, 1, "only the good viewer is left");
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "in order");
    drop(stalled);

    let (front, summary) = finish(run, dir);
    assert_eq!(
        summary.reason,
        FinishReason::Stopped,
        "allow_stop let Stop through"
    );
    let front_steps = step_numbers(&front);
    assert_eq!(front_steps.last().copied(), Some(summary.step));
    assert_eq!(steps.last().copied(), Some(summary.step));
}

fn read_message(r: &mut impl BufRead) -> serde_json::Value {
    let mut line = String::new();
    assert!(r.read_line(&mut line).unwrap() > 0, "the server closed");
    serde_json::from_str(&line).unwrap()
}

/// Read raw messages until an error; return its text.
fn next_error(r: &mut impl BufRead) -> String {
    loop {
        let m = read_message(r);
        if m["type"] == "error" {
            return m["message"].as_str().unwrap().to_string();
        }
    }
}

/// Garbage and oversized lines get an error reply and change nothing; a valid command from a
/// viewer reaches the engine; other viewers never notice.
#[test]
fn bad_lines_are_refused_and_commands_reach_the_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=100000"], ServerOptions::default());
    let watcher = attach::connect(dir, false).unwrap();

    let mut raw = UnixStream::connect(&run.socket).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut input = BufReader::new(raw.try_clone().unwrap());
    let hello: ServerMessage = serde_json::from_value(read_message(&mut input)).unwrap();
    assert!(matches!(hello, ServerMessage::Hello(h) if h.live));

    raw.write_all(b"this is not json\n").unwrap();
    assert!(next_error(&mut input).contains("malformed"));
    let mut huge = vec![b'x'; 70_000];
    huge.push(b'\n');
    raw.write_all(&huge).unwrap();
    assert!(next_error(&mut input).contains("too long"));
    raw.write_all(
        b"{\"type\":\"command\",\"command\":{\"command\":\"set_batch_size\",\"micro_batch\":0}}\n",
    )
    .unwrap();
    assert!(next_error(&mut input).contains("micro_batch 0"));
    raw.write_all(b"{\"type\":\"command\",\"command\":{\"command\":\"delete_everything\"}}\n")
        .unwrap();
    assert!(next_error(&mut input).contains("bad command"));

    // still serving this viewer: a valid command reaches the engine (applied while paused)
    raw.write_all(
        b"{\"type\":\"command\",\"command\":{\"command\":\"set_batch_size\",\"micro_batch\":4}}\n",
    )
    .unwrap();
    loop {
        // (Under load the start's own pause may be applied, and reported, only now.)
        let m = read_message(&mut input);
        if m["type"] == "event"
            && m["event"]["event"] == "command_applied"
            && m["event"]["command"]["command"] == "set_batch_size"
        {
            assert_eq!(m["event"]["command"]["micro_batch"], 4);
            break;
        }
    }
    // and the other viewer saw it too, then the run goes on with it
    until(&watcher.events, |e| {
        matches!(
            e,
            Event::CommandApplied {
                command: Command::SetBatchSize { micro_batch: 4 },
                ..
            }
        )
    });
    run.commands.send(Command::Resume).unwrap();
    let first = until(&watcher.events, |e| matches!(e, Event::Step(_)));
    match first.last().unwrap() {
        Event::Step(s) => assert_eq!(s.micro_batch, 4),
        other => panic!("{other:?}"),
    }
    let stats = run.stats.get();
    assert_eq!(stats.rejected_messages, 4);
    assert_eq!(stats.commands, 1);
    assert_eq!(stats.viewers, 2);

    run.commands.send(Command::Stop { save: false }).unwrap();
    drop(raw);
    let (_, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Stopped);
}

/// Run to the end without a server, as a finished `--no-tui` run leaves its dir.
fn finished_run(dir: &Path, steps: u64) {
    let e = spawn(&[&format!("run.max_steps={steps}")], dir);
    while let Some(ev) = e.events.recv() {
        if matches!(ev, Event::Finished { .. }) {
            break;
        }
    }
    e.thread.wait().unwrap();
}

/// A finished run with no socket replays read-only, start to finish.
#[test]
fn attaching_to_a_finished_run_replays_it_read_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    finished_run(dir, 5);
    let err = attach::connect(dir, false).err().unwrap();
    assert!(err.is_no_live_run(), "{err}");

    let r = attach::open(dir, false).unwrap();
    assert!(!r.is_live() && r.finished);
    let events: Vec<Event> = std::iter::from_fn(|| r.events.recv()).collect();
    assert!(matches!(events.first(), Some(Event::RunStarted(_))));
    assert!(matches!(
        events.last(),
        Some(Event::Finished {
            reason: FinishReason::Completed,
            ..
        })
    ));
    assert_eq!(step_numbers(&events), (1..=5).collect::<Vec<_>>());
    assert_eq!(r.backfilled, events.len());
    // nothing to steer, and trying does not fail
    assert!(r.commands.send(Command::Pause).is_ok());

    let code = attach::run_attach(
        dir,
        AttachOptions {
            tui: None,
            ..AttachOptions::default()
        },
    )
    .unwrap();
    assert_eq!(code, 0);
}

/// No live socket and no finished history: the clear message, exit code 2.
#[test]
fn a_dir_without_a_live_run_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    finished_run(dir, 3);
    // as if killed: the finished line never made it
    let metrics = dir.join("metrics.jsonl");
    let text = fs::read_to_string(&metrics).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("\"event\":\"finished\""))
        .collect();
    fs::write(&metrics, kept.join("\n") + "\n").unwrap();
    // and its socket left behind, with nobody listening
    drop(UnixListener::bind(dir.join("control.sock")).unwrap());

    let expected = format!(
        "no live run here: {} is missing or nobody answers; the run may have been killed",
        dir.join("control.sock").display()
    );
    let err = attach::connect(dir, false).err().unwrap();
    assert_eq!(err.to_string(), expected);
    let err = attach::open(dir, false).err().unwrap();
    assert_eq!(err.to_string(), expected);
    let opts = || AttachOptions {
        tui: None,
        ..AttachOptions::default()
    };
    assert_eq!(attach::run_attach(dir, opts()).unwrap(), 2);

    let empty = tempfile::tempdir().unwrap();
    assert!(attach::open(empty.path(), false)
        .err()
        .unwrap()
        .is_no_live_run());
    assert_eq!(attach::run_attach(empty.path(), opts()).unwrap(), 2);
    assert_eq!(
        attach::run_attach(&empty.path().join("nope"), opts()).unwrap(),
        2
    );
}

/// The server enforces what the client does: a raw `stop` or `interrupt` from a connection
/// that did not claim `allow_stop` is refused; one that did is obeyed. A viewer that paused
/// the run and disconnects releases its pause.
#[test]
fn stop_needs_the_right_server_side_and_a_leaving_pauser_releases_its_pause() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=100000"], ServerOptions::default());
    let watcher = attach::connect(dir, false).unwrap();
    let dial = || {
        let raw = UnixStream::connect(&run.socket).unwrap();
        raw.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut input = BufReader::new(raw.try_clone().unwrap());
        let _hello = read_message(&mut input);
        (raw, input)
    };
    let (mut raw, mut input) = dial();
    for c in ["stop\",\"save\":false", "interrupt\",\"signal\":\"x\""] {
        let line = format!("{{\"type\":\"command\",\"command\":{{\"command\":\"{c}}}}}\n");
        raw.write_all(line.as_bytes()).unwrap();
        assert!(next_error(&mut input).contains("allow-stop"));
    }
    // a pausing viewer that leaves: the run goes on (the start's own pause released first —
    // and seen released, so that the viewer's pause cannot reach the engine before it)
    run.commands.send(Command::Resume).unwrap();
    until(&watcher.events, |e| matches!(e, Event::Resumed { .. }));
    raw.write_all(b"{\"type\":\"command\",\"command\":{\"command\":\"pause\"}}\n")
        .unwrap();
    until(&watcher.events, |e| matches!(e, Event::Paused { .. }));
    drop(input);
    drop(raw);
    until(&watcher.events, |e| matches!(e, Event::Resumed { .. }));
    until(&watcher.events, |e| matches!(e, Event::Step(_)));
    // with the right claimed, stop is obeyed
    let (mut raw, _input) = dial();
    raw.write_all(b"{\"type\":\"allow_stop\"}\n").unwrap();
    raw.write_all(b"{\"type\":\"command\",\"command\":{\"command\":\"stop\",\"save\":false}}\n")
        .unwrap();
    let (_, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Stopped);
}

/// A leaving viewer releases the pause only when nobody else wants it: with two pausing
/// viewers the run stays paused until the second leaves; when the local dashboard paused it,
/// a pausing viewer that leaves does not resume it.
#[test]
fn a_leaving_pauser_keeps_a_pause_someone_else_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = start_run(dir, &["run.max_steps=100000"], ServerOptions::default());
    let watcher = attach::connect(dir, false).unwrap();
    // the start's own (local) pause released: nobody pauses now
    run.commands.send(Command::Resume).unwrap();
    until(&watcher.events, |e| matches!(e, Event::Resumed { .. }));
    let dial = || {
        let raw = UnixStream::connect(&run.socket).unwrap();
        raw.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut input = BufReader::new(raw.try_clone().unwrap());
        let _hello = read_message(&mut input);
        (raw, input)
    };
    const PAUSE: &[u8] = b"{\"type\":\"command\",\"command\":{\"command\":\"pause\"}}\n";
    let viewers = |n: usize| {
        wait_for("the viewer count", || run.stats.get().viewers == n);
    };
    // Whether a resume was sent before the marker: the engine answers in order, so a
    // `Resumed` would come before the marker's `CommandApplied`.
    let mark = |micro_batch: usize| {
        run.commands
            .send(Command::SetBatchSize { micro_batch })
            .unwrap();
        let seen = until(
            &watcher.events,
            |e| matches!(e, Event::CommandApplied { command: Command::SetBatchSize { micro_batch: m }, .. } if *m == micro_batch),
        );
        seen.iter().any(|e| matches!(e, Event::Resumed { .. }))
    };
    // two pausing viewers
    let (mut a, a_in) = dial();
    let (mut b, b_in) = dial();
    viewers(3);
    a.write_all(PAUSE).unwrap();
    until(&watcher.events, |e| matches!(e, Event::Paused { .. }));
    b.write_all(PAUSE).unwrap();
    until(&watcher.events, |e| {
        matches!(
            e,
            Event::CommandRejected {
                command: Command::Pause,
                ..
            }
        )
    });
    drop((a, a_in));
    viewers(2);
    assert!(
        !mark(3),
        "the first pauser to leave keeps the second's pause"
    );
    drop((b, b_in));
    viewers(1);
    until(&watcher.events, |e| matches!(e, Event::Resumed { .. }));
    // the local dashboard's pause outlives a pausing viewer
    run.commands.send(Command::Pause).unwrap();
    until(&watcher.events, |e| matches!(e, Event::Paused { .. }));
    let (mut c, c_in) = dial();
    viewers(2);
    c.write_all(PAUSE).unwrap();
    until(&watcher.events, |e| {
        matches!(
            e,
            Event::CommandRejected {
                command: Command::Pause,
                ..
            }
        )
    });
    drop((c, c_in));
    viewers(1);
    assert!(!mark(2), "the dashboard's pause stands");
    run.commands.send(Command::Stop { save: false }).unwrap();
    let (_, summary) = finish(run, dir);
    assert_eq!(summary.reason, FinishReason::Stopped);
}
