//! Chat templates: a base model's Jinja `chat_template` rendered with minijinja the way
//! transformers' `apply_chat_template` renders it (`trim_blocks` and `lstrip_blocks` on,
//! loop controls, Python string methods such as `.strip()` and `.startswith()`,
//! `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps` does,
//! and the tokenizer's special tokens — `bos_token`, `eos_token`, … — as variables).
//!
//! Where the template comes from: `data.chat_template` (a `.jinja` file, a
//! `tokenizer_config.json`, or the template text itself), else `chat_template.jinja` or the
//! `chat_template` key of `tokenizer_config.json` beside the tokenizer.

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use std::collections::BTreeMap;
use std::path::Path;

/// A loaded chat template and the special tokens it may name.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from (for the run header and errors).
    pub source: String,
    /// The template itself.
    pub text: String,
    /// `bos_token`, `eos_token`, … as transformers passes them.
    specials: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({})", self.source)
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// A template from its text; `specials` maps `bos_token` etc. to their text.
    pub fn new(
        text: &str,
        source: String,
        specials: BTreeMap<String, String>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, text.to_string())
            .map_err(|e| format!("{source}: the chat template does not parse: {e}"))?;
        Ok(Self {
            env,
            source,
            text: text.to_string(),
            specials,
        })
    }

    /// Render `messages` (JSON objects with `role` and `content`, …) as transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=…)` does.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut ctx: BTreeMap<String, Value> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert(
            "messages".into(),
            Value::from_iter(messages.iter().map(from_json)),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        tmpl.render(Value::from(ctx)).map_err(|e| {
            // The message of raise_exception, or the error and where in the template.
            match e.detail() {
                Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
                _ => e.to_string(),
            }
        })
    }

    /// The id of the template's `eos_token` in `tok`, when it has one.
    pub fn eos_id(&self, tok: &super::Tok) -> Option<u32> {
        match tok {
            super::Tok::Hf(t) => t.token_to_id(self.specials.get("eos_token")?),
            super::Tok::Byte => None,
        }
    }

    /// The template `spec` names (`data.chat_template`), else the one beside `tokenizer` (a
    /// tokenizer.json path), else None.
    pub fn find(spec: &str, tokenizer: &str) -> Result<Option<Self>, String> {
        let beside = Path::new(tokenizer)
            .parent()
            .filter(|_| tokenizer != "byte" && tokenizer != "auto");
        let specials = beside
            .map(|d| specials(&d.join("tokenizer_config.json")))
            .unwrap_or_default();
        if !spec.is_empty() {
            let key = format!("data.chat_template = {spec:?}");
            if spec.contains("{{") || spec.contains("{%") {
                return Self::new(spec, "data.chat_template (inline)".into(), specials).map(Some);
            }
            let path = Path::new(spec);
            let text = std::fs::read_to_string(path).map_err(|e| format!("{key}: {e}"))?;
            if path.extension().is_some_and(|e| e == "json") {
                let specials = self::specials(path);
                let t = config_template(&text).ok_or_else(|| {
                    format!("{key}: no \"chat_template\" in this tokenizer_config.json")
                })?;
                return Self::new(&t, spec.to_string(), specials).map(Some);
            }
            return Self::new(&text, spec.to_string(), specials).map(Some);
        }
        let Some(dir) = beside else {
            return Ok(None);
        };
        let jinja = dir.join("chat_template.jinja");
        if let Ok(text) = std::fs::read_to_string(&jinja) {
            return Self::new(&text, jinja.display().to_string(), specials).map(Some);
        }
        let config = dir.join("tokenizer_config.json");
        if let Some(t) = std::fs::read_to_string(&config)
            .ok()
            .and_then(|text| config_template(&text))
        {
            return Self::new(&t, config.display().to_string(), specials).map(Some);
        }
        Ok(None)
    }
}

/// The `chat_template` of a tokenizer_config.json: a string, or a list of named templates
/// (the one named "default").
fn config_template(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    match v.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// `bos_token`, `eos_token`, `unk_token`, `pad_token` of a tokenizer_config.json (strings, or
/// `{"content": …}` objects), as transformers hands them to the template.
pub fn specials(config: &Path) -> BTreeMap<String, String> {
    let Some(v) = std::fs::read_to_string(config)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return BTreeMap::new();
    };
    ["bos_token", "eos_token", "unk_token", "pad_token"]
        .iter()
        .filter_map(|k| {
            let t = match v.get(*k)? {
                serde_json::Value::String(s) => s.clone(),
                o => o.get("content")?.as_str()?.to_string(),
            };
            Some((k.to_string(), t))
        })
        .collect()
}

/// A JSON value as a template value (objects keep their keys' order as parsed).
fn from_json(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from_iter(a.iter().map(from_json)),
        J::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), from_json(v)))),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, args: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = args.get("indent")?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                let s = format!("{f:?}");
                out.push_str(&s);
            }
        }
        ValueKind::String => write_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(x, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_str(&k.to_string(), out);
                out.push_str(": ");
                write_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => write_str(&v.to_string(), out),
    }
    Ok(())
}

fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}",
            "t".into(),
            BTreeMap::new(),
        )
        .unwrap();
        let env = &t.env;
        let v = serde_json::json!({"a": [1, 2.5, "é\n"], "b": null, "c": true});
        let out = env
            .get_template(NAME)
            .unwrap()
            .render(minijinja::context! { x => from_json(&v) })
            .unwrap();
        assert_eq!(
            out,
            "{\"a\": [1, 2.5, \"é\\n\"], \"b\": null, \"c\": true}|{\n  \"a\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"b\": null,\n  \"c\": true\n}"
        );
    }

    #[test]
    fn raise_exception_is_the_error() {
        let t = ChatTemplate::new(
            "{% if messages[0].role == 'tool' %}{{ raise_exception('no tools first') }}{% endif %}ok",
            "t".into(),
            BTreeMap::new(),
        )
        .unwrap();
        let m = [serde_json::json!({"role": "tool", "content": "x"})];
        assert_eq!(t.render(&m, false).unwrap_err(), "no tools first");
    }
}
