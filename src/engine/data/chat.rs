//! A [`Sample`] as token ids and which of them train.
//!
//! Conversations are rendered through the chat template, and the assistant turns are found
//! by rendering prefixes: turn `i`'s text runs from the end of the conversation before it
//! rendered with the generation prompt (`messages[..i]`, `add_generation_prompt=true`) to the
//! end of the conversation up to it (`messages[..=i]`), so it holds the answer and the
//! template's end-of-turn marker (`<|eot_id|>`, `<|im_end|>\n`, …) but not the assistant
//! header. Both prefixes must begin the whole rendering (a template that rewrites earlier turns
//! once later ones follow is refused). The whole text is then tokenized once, with byte
//! offsets: a token trains when it starts inside an assistant span (so a token is never split
//! and the ids are exactly those of tokenizing the rendering, as transformers does).
//!
//! A prompt and completion given as strings are tokenized apart and joined (BOS, prompt,
//! completion, EOS); the completion and the EOS train.

use super::formats::{alpaca_prompt, Format, Sample};
use super::template::ChatTemplate;
use super::{DataError, Special, Tok};

/// Token ids and, for each, whether predicting it counts in the loss.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub trains: Vec<bool>,
}

impl Encoded {
    /// Tokens that count as targets (the first token is never one: nothing predicts it).
    pub fn trained(&self) -> usize {
        self.trains.iter().skip(1).filter(|&&t| t).count()
    }
}

/// Turns samples into token ids and their loss mask.
pub struct Encoder<'a> {
    pub tok: &'a Tok,
    pub template: Option<&'a ChatTemplate>,
    pub format: Format,
    pub train_on_prompt: bool,
    pub special: Special,
}

impl Encoder<'_> {
    /// `sample` (of the record at `at`) as ids and mask.
    pub fn encode(&self, sample: &Sample, at: &str) -> Result<Encoded, DataError> {
        let bad = |message: String| DataError::Input {
            path: at.to_string(),
            message,
        };
        match (sample, self.template) {
            (Sample::Plain { prompt, completion }, _) => self.plain(prompt, completion, at),
            (Sample::Chat { messages, prompt }, Some(t)) => {
                let render = |m: &[serde_json::Value], gen: bool| {
                    t.render(m, gen).map_err(|e| {
                        bad(format!(
                            "field \"messages\": the chat template ({}) fails to render: {e}",
                            t.source
                        ))
                    })
                };
                let full = render(messages, false)?;
                let mut spans = Vec::new();
                for (i, m) in messages.iter().enumerate().skip(*prompt) {
                    if m["role"] != "assistant" {
                        continue;
                    }
                    let before = if i == 0 {
                        String::new()
                    } else {
                        render(&messages[..i], true)?
                    };
                    let upto = render(&messages[..=i], false)?;
                    if !full.starts_with(&before) || !full.starts_with(&upto) || upto.len() < before.len() {
                        return Err(bad(format!(
                            "field \"messages[{i}]\": the chat template ({}) renders the turns before it differently once it follows; cockpit finds the assistant turns by rendering prefixes (set data.train_on_prompt = true to train on every token)",
                            t.source
                        )));
                    }
                    spans.push((before.len(), upto.len()));
                }
                let (ids, starts) = self.tok.encode_offsets(&full, at)?;
                let trains = starts
                    .iter()
                    .map(|&s| self.train_on_prompt || spans.iter().any(|&(a, b)| a <= s && s < b))
                    .collect();
                Ok(Encoded { ids, trains })
            }
            (Sample::Chat { messages, .. }, None) if self.format == Format::Alpaca => {
                let text = |i: usize| messages[i]["content"].as_str().unwrap_or_default();
                self.plain(&alpaca_prompt(text(0)), text(1), at)
            }
            (Sample::Chat { .. }, None) => Err(bad(format!(
                "a {} dataset needs a chat template, and the tokenizer has none (no chat_template.jinja or \"chat_template\" in tokenizer_config.json beside it); set data.chat_template",
                self.format.name()
            ))),
        }
    }

    fn plain(&self, prompt: &str, completion: &str, at: &str) -> Result<Encoded, DataError> {
        let mut ids = Vec::new();
        let mut trains = Vec::new();
        let mut put = |new: &[u32], train: bool| {
            ids.extend_from_slice(new);
            trains.extend(std::iter::repeat_n(
                train || self.train_on_prompt,
                new.len(),
            ));
        };
        if let Some(b) = self.special.bos {
            put(&[b], false);
        }
        put(&self.tok.encode_bytes(prompt.as_bytes(), at)?, false);
        put(&self.tok.encode_bytes(completion.as_bytes(), at)?, true);
        if let Some(e) = self.special.eos.or_else(|| self.tok.eos_id()) {
            put(&[e], true);
        }
        Ok(Encoded { ids, trains })
    }
}

impl Tok {
    /// Ids of `text` (special tokens written in it are matched; none added) and the byte
    /// offset where each starts.
    pub fn encode_offsets(
        &self,
        text: &str,
        at: &str,
    ) -> Result<(Vec<u32>, Vec<usize>), DataError> {
        match self {
            Tok::Byte => Ok((
                text.bytes().map(u32::from).collect(),
                (0..text.len()).collect(),
            )),
            Tok::Hf(t) => {
                let e = t.encode(text, false).map_err(|e| DataError::Tokenizer {
                    path: at.to_string(),
                    message: e.to_string(),
                })?;
                Ok((
                    e.get_ids().to_vec(),
                    e.get_offsets().iter().map(|o| o.0).collect(),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use std::collections::BTreeMap;

    fn fixtures() -> Vec<Value> {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/chat/expected.json"
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn template(name: &str, specials: &Value) -> ChatTemplate {
        let p = format!(
            "{}/tests/fixtures/chat/{name}.jinja",
            env!("CARGO_MANIFEST_DIR")
        );
        let specials: BTreeMap<String, String> = serde_json::from_value(specials.clone()).unwrap();
        ChatTemplate::new(&std::fs::read_to_string(&p).unwrap(), p, specials).unwrap()
    }

    /// Every committed rendering of transformers (scripts/chat_template_fixtures.py) is
    /// cockpit's, byte for byte.
    #[test]
    fn templates_render_as_transformers_does() {
        let cases = fixtures();
        assert!(cases.len() >= 30);
        let mut names = std::collections::BTreeSet::new();
        for c in &cases {
            let name = c["template"].as_str().unwrap();
            names.insert(name.to_string());
            let t = template(name, &c["specials"]);
            let messages = c["messages"].as_array().unwrap();
            let got = t
                .render(messages, c["add_generation_prompt"].as_bool().unwrap())
                .unwrap();
            assert_eq!(got, c["text"].as_str().unwrap(), "{name}: {messages:?}");
        }
        assert_eq!(names.len(), 5, "{names:?}");
    }

    #[test]
    fn a_template_is_found_in_tokenizer_config_json() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat");
        let t = ChatTemplate::find("", &format!("{dir}/tokenizer.json"))
            .unwrap()
            .unwrap();
        assert!(t.source.ends_with("tokenizer_config.json"));
        let m = [json!({"role": "user", "content": "hi"})];
        assert!(t
            .render(&m, true)
            .unwrap()
            .starts_with("<|begin_of_text|><|start_header_id|>user"));
        assert!(ChatTemplate::find("", "byte").unwrap().is_none());
        let e = ChatTemplate::find("/nonexistent.jinja", "byte").unwrap_err();
        assert!(
            e.starts_with("data.chat_template = \"/nonexistent.jinja\""),
            "{e}"
        );
    }

    /// Only the assistant answers and their end-of-turn markers train; with
    /// train_on_prompt everything does.
    #[test]
    fn only_assistant_turns_train() {
        let cases = fixtures();
        let c = cases
            .iter()
            .find(|c| c["template"] == "qwen" && c["messages"].as_array().unwrap().len() == 5)
            .unwrap();
        let t = template("qwen", &c["specials"]);
        let messages = c["messages"].as_array().unwrap().clone();
        let enc = |train_on_prompt: bool| {
            Encoder {
                tok: &Tok::Byte,
                template: Some(&t),
                format: Format::Messages,
                train_on_prompt,
                special: Special::default(),
            }
            .encode(
                &Sample::Chat {
                    messages: messages.clone(),
                    prompt: 0,
                },
                "x:1",
            )
            .unwrap()
        };
        let e = enc(false);
        let trained: String = e
            .ids
            .iter()
            .zip(&e.trains)
            .map(|(&i, &t)| if t { i as u8 as char } else { '\u{1}' })
            .collect::<String>()
            .split('\u{1}')
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("|");
        assert_eq!(
            trained,
            "Bonjour ! Très bien, merci.\n<|im_end|>\n|Il fait beau.<|im_end|>\n"
                .replace('è', "\u{c3}\u{a8}")
        );
        assert!(enc(true).trains.iter().all(|&t| t));
    }
}
