//! Terminal setup and teardown in one guard, a panic hook and SIGINT/SIGTERM handling that
//! always give the terminal back (raw mode off, alternate screen left, cursor shown).
//!
//! While the guard lives, SIGINT/SIGTERM/SIGQUIT only set a flag the run loop checks every
//! frame (a second one, if the loop is stuck, ends the process with status 130 — after a
//! checkpoint being written is committed), and SIGHUP sets another (the terminal is gone:
//! the run goes on headless). Once it is dropped, SIGINT/SIGTERM/SIGQUIT terminate the
//! process as by default.

use crate::process::TERMINATE;
use crossterm::cursor::{Hide, Show};
use crossterm::execute;
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;
use signal_hook::consts::SIGHUP;
use signal_hook::SigId;
use std::io::{self, Stdout};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::ThreadId;

/// Whether the terminal is in dashboard mode right now.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The thread that drives the dashboard: only its panics tear the terminal down (another
/// thread, such as the engine, may panic and be recovered while the dashboard goes on).
static UI_THREAD: Mutex<Option<ThreadId>> = Mutex::new(None);
static PANIC_HOOK: Once = Once::new();
/// Armed while no dashboard is up: SIGINT/SIGTERM then act as by default (terminate).
/// signal-hook cannot give back the handler it replaced, so this stands in for it once the
/// dashboard's own handling is unregistered.
static DEFAULT_AFTER: Mutex<Option<Arc<AtomicBool>>> = Mutex::new(None);

/// Puts the terminal back the way the shell expects it. Safe to call more than once.
pub fn restore_terminal() {
    if ACTIVE.swap(false, Ordering::SeqCst) {
        // raw mode first: it has more side effects than the alternate screen
        let _ = disable_raw_mode();
        let _ = execute!(io::stdout(), LeaveAlternateScreen, Show);
    }
}

fn on_ui_thread() -> bool {
    let current = std::thread::current().id();
    UI_THREAD
        .lock()
        .map(|t| *t == Some(current))
        .unwrap_or(true)
}

/// Chains a hook in front of the existing panic hook that restores the terminal before the
/// panic message is printed, when the dashboard thread panics. Installed once per process.
fn install_panic_hook() {
    PANIC_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if ACTIVE.load(Ordering::SeqCst) && on_ui_thread() {
                restore_terminal();
            }
            previous(info);
        }));
    });
}

/// The dashboard's hold on the terminal: raw mode, alternate screen, hidden cursor, and
/// SIGINT/SIGTERM caught into a flag. Dropping it restores everything.
pub struct TerminalGuard {
    terminal: Terminal<CrosstermBackend<Stdout>>,
    signals: Vec<SigId>,
    signalled: Arc<AtomicBool>,
    /// Which of SIGINT/SIGTERM/SIGQUIT set `signalled`.
    which: Arc<AtomicI32>,
    hangup: Arc<AtomicBool>,
}

impl TerminalGuard {
    /// Takes over the terminal.
    pub fn enter() -> io::Result<TerminalGuard> {
        install_panic_hook();
        let signalled = Arc::new(AtomicBool::new(false));
        let which = Arc::new(AtomicI32::new(0));
        let hangup = Arc::new(AtomicBool::new(false));
        let mut signals = Vec::new();
        let result = Self::setup(&signalled, &which, &hangup, &mut signals);
        match result {
            Ok(terminal) => Ok(TerminalGuard {
                terminal,
                signals,
                signalled,
                which,
                hangup,
            }),
            Err(e) => {
                restore_terminal();
                unregister(&signals);
                arm_default_action();
                Err(e)
            }
        }
    }

    fn setup(
        signalled: &Arc<AtomicBool>,
        which: &Arc<AtomicI32>,
        hangup: &Arc<AtomicBool>,
        signals: &mut Vec<SigId>,
    ) -> io::Result<Terminal<CrosstermBackend<Stdout>>> {
        disarm_default_action()?;
        for signal in TERMINATE {
            // a second signal while the first is still unhandled ends the process (the
            // dashboard would be hung); the first only sets the flag
            signals.push(crate::process::register_terminate(
                signal,
                Arc::clone(signalled),
                Arc::clone(which),
            )?);
        }
        signals.push(signal_hook::flag::register(SIGHUP, Arc::clone(hangup))?);
        if let Ok(mut t) = UI_THREAD.lock() {
            *t = Some(std::thread::current().id());
        }
        ACTIVE.store(true, Ordering::SeqCst);
        watch_hangup(Arc::clone(hangup));
        enable_raw_mode()?;
        execute!(io::stdout(), EnterAlternateScreen, Hide)?;
        let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;
        terminal.clear()?;
        Ok(terminal)
    }

    /// The terminal to draw on.
    pub fn terminal(&mut self) -> &mut Terminal<CrosstermBackend<Stdout>> {
        &mut self.terminal
    }

    /// Whether SIGINT, SIGTERM or SIGQUIT arrived.
    pub fn signalled(&self) -> bool {
        self.signalled.load(Ordering::SeqCst)
    }

    /// The name of the signal that arrived ("SIGINT", …).
    pub fn signal_name(&self) -> &'static str {
        crate::process::signal_name(self.which.load(Ordering::SeqCst))
    }

    /// Whether SIGHUP arrived (the terminal is gone).
    pub fn hung_up(&self) -> bool {
        self.hangup.load(Ordering::SeqCst)
    }
}

/// crossterm's input reader spins forever once the terminal is gone (a hung-up tty reads
/// as end-of-file, which it retries): on SIGHUP, put an empty non-blocking pipe holding one
/// harmless event (focus gained) in place of standard input, so its read returns and the
/// run loop sees the hang-up. The thread ends with the dashboard.
fn watch_hangup(hangup: Arc<AtomicBool>) {
    // SAFETY: isatty has no preconditions.
    if unsafe { libc::isatty(libc::STDIN_FILENO) } != 1 {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("cockpit-hangup".into())
        .spawn(move || {
            while ACTIVE.load(Ordering::SeqCst) {
                if hangup.load(Ordering::SeqCst) {
                    unblock_input();
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
}

fn unblock_input() {
    let mut fds = [0i32; 2];
    // SAFETY: plain fd calls on a pipe this function creates; the write end stays open (and
    // is never closed) so that the reader sees "no data yet" rather than end-of-file.
    unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            return;
        }
        let flags = libc::fcntl(fds[0], libc::F_GETFL);
        libc::fcntl(fds[0], libc::F_SETFL, flags | libc::O_NONBLOCK);
        let focus = b"\x1b[I";
        libc::write(fds[1], focus.as_ptr().cast(), focus.len());
        libc::dup2(fds[0], libc::STDIN_FILENO);
        libc::close(fds[0]);
    }
}

fn unregister(signals: &[SigId]) {
    for id in signals {
        signal_hook::low_level::unregister(*id);
    }
}

/// Registers (once per process) the default-action stand-in and disarms it for the time
/// the dashboard is up.
fn disarm_default_action() -> io::Result<()> {
    let mut slot = DEFAULT_AFTER
        .lock()
        .map_err(|_| io::Error::other("signal state poisoned"))?;
    match slot.as_ref() {
        Some(armed) => armed.store(false, Ordering::SeqCst),
        None => {
            let armed = Arc::new(AtomicBool::new(false));
            for signal in TERMINATE {
                signal_hook::flag::register_conditional_default(signal, Arc::clone(&armed))?;
            }
            *slot = Some(armed);
        }
    }
    Ok(())
}

/// After the dashboard hands the run over (its terminal hung up): SIGINT/SIGTERM/SIGQUIT
/// must not take their default action, the caller registers its own handling.
pub(crate) fn keep_signals_caught() -> io::Result<()> {
    disarm_default_action()
}

fn arm_default_action() {
    if let Ok(slot) = DEFAULT_AFTER.lock() {
        if let Some(armed) = slot.as_ref() {
            armed.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
        unregister(&self.signals);
        arm_default_action();
        if let Ok(mut t) = UI_THREAD.lock() {
            *t = None;
        }
    }
}
