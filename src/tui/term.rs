//! Terminal setup and teardown in one guard, a panic hook and SIGINT/SIGTERM handling that
//! always give the terminal back (raw mode off, alternate screen left, cursor shown).
//!
//! While the guard lives, SIGINT/SIGTERM only set a flag the run loop checks every frame (a
//! second one, if the loop is stuck, ends the process with status 130). Once it is dropped,
//! both signals terminate the process as by default.

use crossterm::cursor::{Hide, Show};
use crossterm::execute;
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::SigId;
use std::io::{self, Stdout};
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl TerminalGuard {
    /// Takes over the terminal.
    pub fn enter() -> io::Result<TerminalGuard> {
        install_panic_hook();
        let signalled = Arc::new(AtomicBool::new(false));
        let mut signals = Vec::new();
        let result = Self::setup(&signalled, &mut signals);
        match result {
            Ok(terminal) => Ok(TerminalGuard {
                terminal,
                signals,
                signalled,
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
        signals: &mut Vec<SigId>,
    ) -> io::Result<Terminal<CrosstermBackend<Stdout>>> {
        disarm_default_action()?;
        for signal in [SIGINT, SIGTERM] {
            // a second signal while the first is still unhandled ends the process (the
            // dashboard would be hung); the first only sets the flag
            signals.push(signal_hook::flag::register_conditional_shutdown(
                signal,
                130,
                Arc::clone(signalled),
            )?);
            signals.push(signal_hook::flag::register(signal, Arc::clone(signalled))?);
        }
        if let Ok(mut t) = UI_THREAD.lock() {
            *t = Some(std::thread::current().id());
        }
        ACTIVE.store(true, Ordering::SeqCst);
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

    /// Whether SIGINT or SIGTERM arrived.
    pub fn signalled(&self) -> bool {
        self.signalled.load(Ordering::SeqCst)
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
            for signal in [SIGINT, SIGTERM] {
                signal_hook::flag::register_conditional_default(signal, Arc::clone(&armed))?;
            }
            *slot = Some(armed);
        }
    }
    Ok(())
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
