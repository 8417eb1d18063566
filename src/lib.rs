//! cockpit: a terminal training cockpit.
//!
//! Data flows one way: [`config`] → [`engine`] (its own thread, `Command`s in, `Event`s out) →
//! front ends ([`tui`], [`headless`], [`report`]), with [`telemetry`] samplers and the
//! [`advisor`] beside them. The engine imports nothing from the front ends; the front ends
//! import nothing from candle.

pub mod advisor;
pub mod attach;
pub mod cli;
pub mod config;
pub mod distributed;
pub mod engine;
pub mod headless;
pub mod monitor;
pub mod process;
pub mod report;
pub mod stdio;
pub mod telemetry;
pub mod tracking;
pub mod tui;
pub mod util;
