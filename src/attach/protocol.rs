//! The wire format between a run's control socket and its viewers: newline-delimited JSON,
//! one message per line, at most [`MAX_LINE_BYTES`] per line in either direction.
//!
//! Server → viewer:
//! * `{"type":"hello","protocol":1,"run_dir":"…","live":true,"pid":1234,"max_line_bytes":65536}`
//!   first, once;
//! * `{"type":"event","event":{"event":"step",…}}`, one per engine [`Event`];
//! * `{"type":"telemetry","update":{…}}`, one per [`MonitorUpdate`] of the run's own monitor;
//! * `{"type":"error","message":"…"}` when the viewer sent something the server refused.
//!
//! Viewer → server: `{"type":"command","command":{"command":"set_batch_size","micro_batch":16}}`
//! (the engine's [`Command`], serialized as the engine defines it), and `{"type":"allow_stop"}`
//! first from a viewer started with the right to stop the run (`stop` and `interrupt` are
//! refused, by the server, on a connection that did not send it). Nothing else is accepted.

use crate::advisor::MonitorUpdate;
use crate::engine::events::{Command, Event};
use crate::engine::trainer::MAX_MICRO_BATCH;
use crate::tui::MIN_SETPOINT;
use serde::{Deserialize, Serialize};
use std::io::{self, BufRead};

/// Protocol version, in the hello; a viewer refuses a server that speaks another one.
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest line either side accepts, newline excluded (64 KiB).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// The first message a viewer gets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the server.
    pub protocol: u32,
    /// The run directory the server belongs to.
    pub run_dir: String,
    /// Whether the run is still going (false once the engine sent `Finished`).
    pub live: bool,
    /// Process id of the training process.
    pub pid: u32,
    /// Longest line the server accepts from a viewer.
    pub max_line_bytes: usize,
}

/// What the server sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    /// Sent once, first.
    Hello(Hello),
    /// One engine event.
    Event {
        /// The event, as the engine emitted it (a Step's `dropped_before` also counts the steps
        /// this viewer missed because it read too slowly).
        event: Event,
    },
    /// One tick of the training process's telemetry and advisor.
    Telemetry {
        /// The sample and the advice standing after it.
        update: MonitorUpdate,
    },
    /// The server refused a message from this viewer.
    Error {
        /// Why, in words.
        message: String,
    },
}

/// What a viewer may send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMessage {
    /// Ask the engine for a change, exactly as a key press of the dashboard would.
    Command {
        /// The request.
        command: Command,
    },
}

/// A server message that borrows what it carries, so the server encodes an event once for
/// every viewer without cloning it. Encodes exactly like [`ServerMessage`].
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Outbound<'a> {
    Hello(&'a Hello),
    Event { event: &'a Event },
    Telemetry { update: &'a MonitorUpdate },
    Error { message: &'a str },
}

/// Serialize a message as one line, newline included.
pub fn encode<T: Serialize>(message: &T) -> Result<String, serde_json::Error> {
    let mut line = serde_json::to_string(message)?;
    line.push('\n');
    Ok(line)
}

/// One line read by [`read_line`].
#[derive(Clone, Debug, PartialEq)]
pub enum Line {
    /// A line within the limit, without its newline.
    Complete(Vec<u8>),
    /// A line over the limit; it was read to its end and thrown away.
    TooLong {
        /// Its length in bytes, newline excluded.
        bytes: usize,
    },
}

/// Reads one `\n`-terminated line, keeping at most `max` bytes in memory: a longer line is
/// consumed to its end and reported as [`Line::TooLong`]. A last line without a newline counts
/// as a line. `Ok(None)` at end of input.
pub fn read_line<R: BufRead>(reader: &mut R, max: usize) -> io::Result<Option<Line>> {
    let mut buf = Vec::new();
    let mut total = 0usize;
    let mut seen_any = false;
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            if !seen_any {
                return Ok(None);
            }
            break;
        }
        seen_any = true;
        let (chunk, consumed, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], i + 1, true),
            None => (available, available.len(), false),
        };
        total = total.saturating_add(chunk.len());
        if total <= max {
            buf.extend_from_slice(chunk);
        } else if !buf.is_empty() {
            // over the limit: stop keeping bytes, only count them
            buf = Vec::new();
        }
        reader.consume(consumed);
        if done {
            break;
        }
    }
    Ok(Some(if total > max {
        Line::TooLong { bytes: total }
    } else {
        Line::Complete(buf)
    }))
}

/// The line a viewer started with the right to stop the run sends first:
/// `{"type":"allow_stop"}`. Without it the server refuses `stop` and `interrupt`.
pub const ALLOW_STOP_LINE: &str = "{\"type\":\"allow_stop\"}\n";

/// Whether `line` is [`ALLOW_STOP_LINE`] (exactly that object).
pub fn is_allow_stop(line: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(line).is_ok_and(|v| {
        v.as_object().is_some_and(|o| {
            o.len() == 1 && o.get("type").and_then(|t| t.as_str()) == Some("allow_stop")
        })
    })
}

/// Decode and validate one line from a viewer into a [`Command`], or say why not.
///
/// The command must be one the dashboard's keys could send: exactly the fields the engine's
/// [`Command`] has, a micro-batch in `1..=MAX_MICRO_BATCH`, a finite setpoint in
/// `[MIN_SETPOINT, 1)`.
pub fn parse_client_line(line: &[u8]) -> Result<Command, String> {
    let value: serde_json::Value = serde_json::from_slice(line)
        .map_err(|e| format!("malformed message (not a JSON value): {e}"))?;
    let Some(object) = value.as_object() else {
        return Err("malformed message: expected a JSON object with a \"type\"".into());
    };
    match object.get("type").and_then(|t| t.as_str()) {
        Some("command") => {}
        Some(other) => return Err(format!("unknown message type {other:?}")),
        None => return Err("malformed message: no \"type\" field".into()),
    }
    let raw_command = object.get("command").cloned();
    let ClientMessage::Command { command } =
        serde_json::from_value::<ClientMessage>(value).map_err(|e| format!("bad command: {e}"))?;
    // serde ignores unknown fields inside the command; a key press never sends any
    if let (Some(serde_json::Value::Object(sent)), Ok(serde_json::Value::Object(known))) =
        (raw_command, serde_json::to_value(&command))
    {
        let extra: Vec<&str> = sent
            .keys()
            .filter(|k| !known.contains_key(*k))
            .map(String::as_str)
            .collect();
        if !extra.is_empty() {
            return Err(format!(
                "bad command: unknown field(s) {} for {:?}",
                extra.join(", "),
                command.label()
            ));
        }
    }
    validate_command(&command)?;
    Ok(command)
}

/// The range checks a key press implies (the engine checks again when it applies a command).
pub fn validate_command(command: &Command) -> Result<(), String> {
    match command {
        Command::SetBatchSize { micro_batch } => {
            if !(1..=MAX_MICRO_BATCH).contains(micro_batch) {
                return Err(format!(
                    "bad command: micro_batch {micro_batch} is not in [1, {MAX_MICRO_BATCH}]"
                ));
            }
        }
        Command::SetScuSetpoint { target } => {
            if !(target.is_finite() && *target >= MIN_SETPOINT && *target < 1.0) {
                return Err(format!(
                    "bad command: setpoint {target} is not in [{MIN_SETPOINT}, 1) (a fraction, 0.01 = 1%)"
                ));
            }
        }
        Command::CheckpointNow
        | Command::Pause
        | Command::Resume
        | Command::Stop { .. }
        | Command::Interrupt { .. } => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    fn lines(input: &[u8], max: usize) -> Vec<Line> {
        // a tiny buffer makes lines straddle refills
        let mut r = BufReader::with_capacity(3, input);
        std::iter::from_fn(|| read_line(&mut r, max).unwrap()).collect()
    }

    #[test]
    fn lines_are_split_capped_and_the_rest_survives() {
        let got = lines(b"ab\n0123456789\n\nxyz", 5);
        assert_eq!(
            got,
            vec![
                Line::Complete(b"ab".to_vec()),
                Line::TooLong { bytes: 10 },
                Line::Complete(vec![]),
                Line::Complete(b"xyz".to_vec()),
            ]
        );
        assert_eq!(lines(b"", 5), vec![]);
        assert_eq!(
            lines(b"12345\n", 5),
            vec![Line::Complete(b"12345".to_vec())]
        );
    }

    #[test]
    fn commands_parse_like_keys() {
        let ok = br#"{"type":"command","command":{"command":"set_batch_size","micro_batch":16}}"#;
        assert_eq!(
            parse_client_line(ok),
            Ok(Command::SetBatchSize { micro_batch: 16 })
        );
        let stop = br#"{"type":"command","command":{"command":"stop","save":true}}"#;
        assert_eq!(parse_client_line(stop), Ok(Command::Stop { save: true }));
        let round = encode(&ClientMessage::Command {
            command: Command::SetScuSetpoint { target: 0.015 },
        })
        .unwrap();
        assert_eq!(
            parse_client_line(round.trim_end().as_bytes()),
            Ok(Command::SetScuSetpoint { target: 0.015 })
        );

        let bad: &[&[u8]] = &[
            b"not json",
            b"[1,2]",
            br#"{"command":{"command":"pause"}}"#,
            br#"{"type":"event","event":{}}"#,
            br#"{"type":"command"}"#,
            br#"{"type":"command","command":{"command":"rm_rf"}}"#,
            br#"{"type":"command","command":{"command":"pause"},"extra":1}"#,
            br#"{"type":"command","command":{"command":"pause","now":true}}"#,
            br#"{"type":"command","command":{"command":"set_batch_size","micro_batch":0}}"#,
            br#"{"type":"command","command":{"command":"set_batch_size","micro_batch":-3}}"#,
            br#"{"type":"command","command":{"command":"set_batch_size","micro_batch":1e9}}"#,
            br#"{"type":"command","command":{"command":"set_scu_setpoint","target":1.5}}"#,
            br#"{"type":"command","command":{"command":"set_scu_setpoint","target":null}}"#,
            br#"{"type":"command","command":{"command":"set_scu_setpoint","target":0.0}}"#,
        ];
        for line in bad {
            let r = parse_client_line(line);
            assert!(r.is_err(), "{} -> {r:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn server_messages_round_trip() {
        let hello = ServerMessage::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            run_dir: "runs/x".into(),
            live: true,
            pid: 7,
            max_line_bytes: MAX_LINE_BYTES,
        });
        let line = encode(&hello).unwrap();
        assert!(
            line.starts_with(r#"{"type":"hello","protocol":1,"#),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<ServerMessage>(&line).unwrap(), hello);
        let ev = ServerMessage::Event {
            event: Event::Paused { step: 3 },
        };
        let line = encode(&ev).unwrap();
        assert_eq!(
            line,
            "{\"type\":\"event\",\"event\":{\"event\":\"paused\",\"step\":3}}\n"
        );
        // the borrowing form the server writes encodes the same
        let ServerMessage::Hello(h) = &hello else {
            unreachable!()
        };
        assert_eq!(
            encode(&Outbound::Hello(h)).unwrap(),
            encode(&hello).unwrap()
        );
        assert_eq!(
            encode(&Outbound::Event {
                event: &Event::Paused { step: 3 }
            })
            .unwrap(),
            line
        );
        let err = ServerMessage::Error {
            message: "no".into(),
        };
        assert_eq!(
            encode(&Outbound::Error { message: "no" }).unwrap(),
            encode(&err).unwrap()
        );
    }
}
