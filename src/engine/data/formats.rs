//! Instruction and chat datasets: records from JSON Lines, JSON arrays or Parquet files (the
//! on-disk format of Hugging Face datasets), their shape (`data.format`, or detected from the
//! first record), and each record as a [`Sample`]: a conversation, or a prompt and its
//! completion. A record that does not fit its format is an error naming the file, the
//! line (or row) and the field.

use super::DataError;
use serde_json::Value;
use std::path::Path;

/// The shape of a dataset's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `text`: every token trains.
    Text,
    /// `messages`: a list of `{role, content}` (OpenAI / TRL conversational).
    Messages,
    /// `prompt` + `completion`: strings, or message lists.
    PromptCompletion,
    /// Alpaca: `instruction`, optional `input`, `output`.
    Alpaca,
}

impl Format {
    /// `data.format` (None: "auto").
    pub fn parse(s: &str) -> Option<Option<Format>> {
        Some(match s {
            "auto" => None,
            "text" => Some(Format::Text),
            "messages" => Some(Format::Messages),
            "prompt_completion" => Some(Format::PromptCompletion),
            "alpaca" => Some(Format::Alpaca),
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Messages => "messages",
            Format::PromptCompletion => "prompt_completion",
            Format::Alpaca => "alpaca",
        }
    }

    /// The shape of `record` (an object), from the fields it has.
    pub fn detect(record: &Value) -> Option<Format> {
        let has = |k: &str| record.get(k).is_some();
        if has("messages") {
            Some(Format::Messages)
        } else if has("prompt") && has("completion") {
            Some(Format::PromptCompletion)
        } else if has("instruction") && has("output") {
            Some(Format::Alpaca)
        } else if has("text") {
            Some(Format::Text)
        } else {
            None
        }
    }
}

/// One record and where it is (`file:line`, `file: record N`, `file: row N`).
#[derive(Clone, Debug)]
pub struct Record {
    pub at: String,
    pub value: Value,
}

/// A training sample, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Sample {
    /// A conversation rendered through the chat template; `prompt` messages (the first ones,
    /// for a conversational prompt/completion) never train, nor do non-assistant turns.
    Chat { messages: Vec<Value>, prompt: usize },
    /// A prompt (never trains) and its completion (trains), tokenized apart and joined.
    Plain { prompt: String, completion: String },
}

/// Whether `path` holds records (rather than plain text).
pub fn is_records(path: &Path) -> bool {
    matches!(ext(path).as_str(), "jsonl" | "ndjson" | "json" | "parquet")
}

fn ext(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase()
}

/// Every record of a JSONL, JSON (an array of objects) or Parquet file.
pub fn read_records(path: &Path) -> Result<Vec<Record>, DataError> {
    let name = path.display().to_string();
    let bad = |at: String, message: String| DataError::Input { path: at, message };
    match ext(path).as_str() {
        "parquet" => {
            let file = std::fs::File::open(path).map_err(super::io_err(path))?;
            let reader = parquet::file::reader::SerializedFileReader::new(file)
                .map_err(|e| bad(name.clone(), format!("not a Parquet file: {e}")))?;
            reader
                .into_iter()
                .enumerate()
                .map(|(i, row)| {
                    let at = format!("{name}: row {}", i + 1);
                    let row = row.map_err(|e| bad(at.clone(), e.to_string()))?;
                    Ok(Record {
                        at,
                        value: row.to_json_value(),
                    })
                })
                .collect()
        }
        "json" => {
            let text = std::fs::read_to_string(path).map_err(super::io_err(path))?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Array(items)) => Ok(items
                    .into_iter()
                    .enumerate()
                    .map(|(i, value)| Record {
                        at: format!("{name}: record {}", i + 1),
                        value,
                    })
                    .collect()),
                Ok(_) => Err(bad(name, "not a JSON array of records".into())),
                Err(e) => Err(bad(name, format!("not JSON: {e}"))),
            }
        }
        _ => {
            let text = std::fs::read_to_string(path).map_err(super::io_err(path))?;
            text.lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, line)| {
                    let at = format!("{name}:{}", i + 1);
                    serde_json::from_str(line)
                        .map(|value| Record {
                            at: at.clone(),
                            value,
                        })
                        .map_err(|e| bad(at, format!("not a JSON object: {e}")))
                })
                .collect()
        }
    }
}

/// The roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

impl Record {
    fn bad(&self, field: &str, message: impl std::fmt::Display) -> DataError {
        DataError::Input {
            path: self.at.clone(),
            message: format!("field \"{field}\": {message}"),
        }
    }

    fn string(&self, field: &str, required: bool) -> Result<String, DataError> {
        match self.value.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) if !required => Ok(String::new()),
            None | Some(Value::Null) => Err(self.bad(field, "missing")),
            Some(_) => Err(self.bad(field, "not a string")),
        }
    }

    /// A list of messages under `field`, each checked (`{role, content}`, a known role, a
    /// non-empty assistant turn).
    fn messages(&self, field: &str) -> Result<Vec<Value>, DataError> {
        let list = match self.value.get(field) {
            Some(Value::Array(list)) if !list.is_empty() => list,
            Some(Value::Array(_)) => return Err(self.bad(field, "an empty list")),
            None | Some(Value::Null) => return Err(self.bad(field, "missing")),
            Some(_) => return Err(self.bad(field, "not a list of messages")),
        };
        for (i, m) in list.iter().enumerate() {
            let f = |k: &str| format!("{field}[{i}].{k}");
            let role = match m.get("role") {
                Some(Value::String(r)) => r.as_str(),
                Some(_) => return Err(self.bad(&f("role"), "not a string")),
                None => return Err(self.bad(&f("role"), "missing")),
            };
            if !ROLES.contains(&role) {
                return Err(self.bad(
                    &f("role"),
                    format!("unknown role {role:?} (allowed: {})", ROLES.join(", ")),
                ));
            }
            let content = m.get("content");
            let text = match content {
                Some(Value::String(s)) => Some(s.as_str()),
                None | Some(Value::Null) => None,
                Some(Value::Array(_)) => Some("parts"),
                Some(_) => return Err(self.bad(&f("content"), "not a string or a list of parts")),
            };
            let tool_calls = m.get("tool_calls").is_some_and(|t| !t.is_null());
            if role == "assistant" && text.is_none_or(|t| t.trim().is_empty()) && !tool_calls {
                return Err(self.bad(&f("content"), "an empty assistant turn"));
            }
            if role != "assistant" && text.is_none() {
                return Err(self.bad(&f("content"), "missing"));
            }
        }
        Ok(list.clone())
    }

    /// The record as a sample of `format`.
    pub fn sample(&self, format: Format) -> Result<Sample, DataError> {
        if !self.value.is_object() {
            return Err(DataError::Input {
                path: self.at.clone(),
                message: "not a JSON object".into(),
            });
        }
        Ok(match format {
            Format::Text => Sample::Plain {
                prompt: String::new(),
                completion: self.string("text", true)?,
            },
            Format::Messages => {
                let messages = self.messages("messages")?;
                if !messages.iter().any(|m| m["role"] == "assistant") {
                    return Err(self.bad("messages", "no assistant turn"));
                }
                Sample::Chat {
                    messages,
                    prompt: 0,
                }
            }
            Format::PromptCompletion => {
                match (self.value.get("prompt"), self.value.get("completion")) {
                    (Some(Value::Array(_)), _) | (_, Some(Value::Array(_))) => {
                        let mut messages = self.messages("prompt")?;
                        let prompt = messages.len();
                        let completion = self.messages("completion")?;
                        if let Some((i, m)) = completion
                            .iter()
                            .enumerate()
                            .find(|(_, m)| m["role"] != "assistant")
                        {
                            return Err(self.bad(
                                &format!("completion[{i}].role"),
                                format!("{} (a completion holds assistant turns)", m["role"]),
                            ));
                        }
                        messages.extend(completion);
                        Sample::Chat { messages, prompt }
                    }
                    _ => {
                        let completion = self.string("completion", true)?;
                        if completion.trim().is_empty() {
                            return Err(self.bad("completion", "empty"));
                        }
                        Sample::Plain {
                            prompt: self.string("prompt", true)?,
                            completion,
                        }
                    }
                }
            }
            Format::Alpaca => {
                let instruction = self.string("instruction", true)?;
                let input = self.string("input", false)?;
                let output = self.string("output", true)?;
                if output.trim().is_empty() {
                    return Err(self.bad("output", "empty"));
                }
                let user = if input.trim().is_empty() {
                    instruction
                } else {
                    format!("{instruction}\n\n{input}")
                };
                Sample::Chat {
                    messages: vec![
                        serde_json::json!({"role": "user", "content": user}),
                        serde_json::json!({"role": "assistant", "content": output}),
                    ],
                    prompt: 0,
                }
            }
        })
    }
}

/// The Alpaca prompt, for an alpaca dataset on a base without a chat template.
pub fn alpaca_prompt(user: &str) -> String {
    format!("### Instruction:\n{user}\n\n### Response:\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(v: Value) -> Record {
        Record {
            at: "d.jsonl:3".into(),
            value: v,
        }
    }

    #[test]
    fn shapes_are_detected_from_the_fields() {
        let f = |v: Value| Format::detect(&v);
        assert_eq!(f(json!({"messages": []})), Some(Format::Messages));
        assert_eq!(
            f(json!({"prompt": "a", "completion": "b"})),
            Some(Format::PromptCompletion)
        );
        assert_eq!(
            f(json!({"instruction": "a", "input": "", "output": "b"})),
            Some(Format::Alpaca)
        );
        assert_eq!(f(json!({"text": "a"})), Some(Format::Text));
        assert_eq!(f(json!({"foo": 1})), None);
    }

    #[test]
    fn records_become_samples_or_errors_naming_line_and_field() {
        let s = rec(json!({"instruction": "Add", "input": "2 and 2", "output": "4"}))
            .sample(Format::Alpaca)
            .unwrap();
        assert_eq!(
            s,
            Sample::Chat {
                messages: vec![
                    json!({"role": "user", "content": "Add\n\n2 and 2"}),
                    json!({"role": "assistant", "content": "4"})
                ],
                prompt: 0
            }
        );
        let s = rec(json!({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}))
            .sample(Format::PromptCompletion)
            .unwrap();
        assert!(matches!(s, Sample::Chat { prompt: 1, ref messages } if messages.len() == 2));
        let err = |v: Value, f: Format| rec(v).sample(f).unwrap_err().to_string();
        let e = err(
            json!({"messages": [{"role": "bot", "content": "x"}]}),
            Format::Messages,
        );
        assert_eq!(
            e,
            "d.jsonl:3: field \"messages[0].role\": unknown role \"bot\" (allowed: system, user, assistant, tool)"
        );
        let e = err(
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}),
            Format::Messages,
        );
        assert!(
            e.contains("messages[1].content") && e.contains("empty assistant turn"),
            "{e}"
        );
        let e = err(json!({"instruction": "x"}), Format::Alpaca);
        assert_eq!(e, "d.jsonl:3: field \"output\": missing");
        let e = err(json!({"prompt": "x"}), Format::PromptCompletion);
        assert_eq!(e, "d.jsonl:3: field \"completion\": missing");
    }
}
