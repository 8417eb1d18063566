//! A prompts file: one prompt per line, or JSON Lines whose objects carry a "prompt" string
//! (or "prompt_ids", a list of token ids, or "messages", a conversation for `--chat`). JSON
//! Lines when the file's first line that is not blank starts with `{`; blank lines are
//! skipped either way.

use std::path::Path;

/// A prompt as the file gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    /// A conversation (objects with "role" and "content"), answered through the chat template.
    Messages(Vec<serde_json::Value>),
}

/// A prompt and the line it is on (from 1).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLine {
    pub line: usize,
    pub prompt: Prompt,
}

/// The prompts of `path`; an error (one line, naming the file and the line) otherwise.
pub fn read(path: &Path) -> Result<Vec<PromptLine>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`read`] of a file's bytes.
pub fn parse(bytes: &[u8]) -> Result<Vec<PromptLine>, String> {
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    let blank = |l: &[u8]| l.iter().all(u8::is_ascii_whitespace);
    let jsonl = lines
        .iter()
        .find(|l| !blank(l))
        .is_some_and(|l| l.trim_ascii_start().starts_with(b"{"));
    let mut out = Vec::new();
    for (i, raw) in lines.iter().enumerate() {
        let line = i + 1;
        if blank(raw) {
            continue;
        }
        let text = std::str::from_utf8(raw.strip_suffix(b"\r").unwrap_or(raw))
            .map_err(|_| format!("line {line}: not UTF-8 text"))?;
        let prompt = if jsonl {
            json_prompt(text).map_err(|e| format!("line {line}: {e}"))?
        } else {
            Prompt::Text(text.to_string())
        };
        out.push(PromptLine { line, prompt });
    }
    if out.is_empty() {
        return Err("no prompts (one a line, or JSON Lines with a \"prompt\" field)".into());
    }
    Ok(out)
}

fn json_prompt(text: &str) -> Result<Prompt, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a JSON object: {e}"))?;
    let Some(obj) = v.as_object() else {
        return Err(format!("{}: not a JSON object", clip(text)));
    };
    if let Some(m) = obj.get("messages") {
        return match m.as_array() {
            Some(list) if !list.is_empty() && list.iter().all(|x| x.get("role").is_some()) => {
                Ok(Prompt::Messages(list.clone()))
            }
            _ => Err(format!(
                "\"messages\": {} is not a list of messages with a \"role\"",
                clip(&m.to_string())
            )),
        };
    }
    match (obj.get("prompt"), obj.get("prompt_ids")) {
        (Some(serde_json::Value::String(s)), None) => Ok(Prompt::Text(s.clone())),
        (None, Some(serde_json::Value::Array(ids))) => ids
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| format!("\"prompt_ids\": {x} is not a token id"))
            })
            .collect::<Result<Vec<u32>, String>>()
            .map(Prompt::Ids),
        (Some(p), None) => Err(format!(
            "\"prompt\": {} is not a string",
            clip(&p.to_string())
        )),
        (Some(_), Some(_)) => Err("give \"prompt\" or \"prompt_ids\", not both".into()),
        (None, Some(p)) => Err(format!(
            "\"prompt_ids\": {} is not a list of token ids",
            clip(&p.to_string())
        )),
        (None, None) => Err(format!("{}: no \"prompt\" field", clip(text))),
    }
}

/// At most 60 characters of `s`.
fn clip(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_or_json_lines() {
        let p = parse(b"hello\n\n  world \r\n").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].line, 3);
        assert_eq!(p[1].prompt, Prompt::Text("  world ".into()));
        let j = parse(b"{\"prompt\": \"a\"}\n{\"prompt_ids\": [1, 2]}\n").unwrap();
        assert_eq!(j[0].prompt, Prompt::Text("a".into()));
        assert_eq!(j[1].prompt, Prompt::Ids(vec![1, 2]));
        let m = parse(b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}").unwrap();
        assert!(matches!(&m[0].prompt, Prompt::Messages(v) if v.len() == 1));
        for (bad, want) in [
            (&b"{\"prompt\": \"a\"}\n{\"text\": 1}\n"[..], "line 2: "),
            (
                b"{\"prompt\": \"a\"}\n\n{oops\n",
                "line 3: not a JSON object",
            ),
            (b"{\"prompt\": 5}", "line 1: \"prompt\": 5 is not a string"),
            (b"{\"prompt_ids\": [1, -2]}", "-2 is not a token id"),
            (b"ok\n\xff\xfe\n", "line 2: not UTF-8"),
            (b"\n \n", "no prompts"),
            (
                b"{\"messages\": []}",
                "line 1: \"messages\": [] is not a list",
            ),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
