//! A conversation with a model: the messages so far (an optional system turn, then user and
//! assistant turns) rendered whole through the model's chat template — the renderer the
//! training data and `generate --chat` use — for each reply, which is decoded token by token
//! and streamed as text, and kept in the history. A conversation that outgrows the model's
//! context (less the room kept for the reply) drops its oldest turns; a reply that reaches the
//! end of the context ends there. `cockpit chat` is its command line.

use super::run::load;
use super::stream::TextStream;
use super::template::template_of;
use super::Sampling;
use crate::engine::data::template::ChatTemplate;
use crate::engine::data::Tok;
use crate::engine::source::Source;
use crate::engine::EngineError;
use crate::util::DeviceSpec;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

/// How to chat.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// A system turn before the conversation.
    pub system: Option<String>,
    /// New tokens at most, per reply.
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub device: DeviceSpec,
}

/// One reply and its figures.
#[derive(Clone, Debug)]
pub struct Reply {
    pub text: String,
    pub ids: Vec<u32>,
    /// Tokens of the rendered conversation it continued.
    pub prompt_tokens: usize,
    /// Whether it ended at an end-of-turn / end-of-sequence token (else at the most tokens).
    pub ended: bool,
    pub tokens_per_s: f64,
}

/// A model, its tokenizer and template, and the conversation so far.
pub struct Chat {
    source: Source,
    tok: Tok,
    template: ChatTemplate,
    stop: Vec<u32>,
    /// The most tokens a rendered conversation and its reply may take.
    limit: usize,
    options: ChatOptions,
    /// User and assistant turns, oldest first.
    history: Vec<Value>,
    /// Replies since the start (or the last reset): each draws from its own seed.
    replies: u64,
    pub load_s: f64,
}

impl Chat {
    /// Open `src` (a run dir, checkpoint or Hugging Face directory) for a conversation.
    pub fn open(src: &Path, options: ChatOptions) -> Result<Self, EngineError> {
        if let Some(e) = options.sampling.problem() {
            return Err(usage(e));
        }
        if options.max_tokens == 0 {
            return Err(usage("--max-tokens 0: give at least 1".into()));
        }
        let (source, load_s) = load(src, options.device)?;
        let Some(spec) = source.tokenizer.as_deref() else {
            return Err(usage(format!(
                "{}: the model has no tokenizer (trained on the built-in corpus of token ids); chat needs text",
                src.display()
            )));
        };
        let tok = Tok::open(spec)?;
        let template = template_of(&source, src)?;
        let mut stop: Vec<u32> = source
            .hf
            .as_ref()
            .map(|h| h.eos.clone())
            .unwrap_or_default();
        stop.extend(template.eos_id(&tok).filter(|e| !stop.contains(e)));
        let mut limit = source.max_positions;
        if let Some(w) = source.hf.as_ref().and_then(|h| h.sliding_window) {
            limit = limit.min(w);
        }
        Ok(Self {
            source,
            tok,
            template,
            stop,
            limit,
            options,
            history: Vec::new(),
            replies: 0,
            load_s,
        })
    }

    /// Where the template came from.
    pub fn template_source(&self) -> &str {
        &self.template.source
    }

    /// The most tokens a conversation and its reply may take.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The conversation as the template sees it (the system turn first).
    pub fn messages(&self) -> Vec<Value> {
        let system = self
            .options
            .system
            .as_ref()
            .map(|s| json!({"role": "system", "content": s}));
        system.into_iter().chain(self.history.clone()).collect()
    }

    /// Forget the conversation (the system turn stays).
    pub fn reset(&mut self) {
        self.history.clear();
        self.replies = 0;
    }

    /// The conversation rendered with the assistant's generation prompt, as ids.
    fn prompt_ids(&self) -> Result<Vec<u32>, EngineError> {
        let text = self.template.render(&self.messages(), true).map_err(|e| {
            usage(format!(
                "the chat template ({}) fails to render: {e}",
                self.template.source
            ))
        })?;
        Ok(self.tok.encode_offsets(&text, "the conversation")?.0)
    }

    /// Drop the oldest user turn and the replies after it; false when there is none before
    /// the newest.
    fn drop_oldest(&mut self) -> bool {
        let users = self.history.iter().filter(|m| m["role"] == "user").count();
        if users < 2 {
            return false;
        }
        let next = self
            .history
            .iter()
            .skip(1)
            .position(|m| m["role"] == "user")
            .map_or(self.history.len(), |i| i + 1);
        self.history.drain(..next);
        true
    }

    /// Answer `user`: `on_note` hears of turns dropped to fit the context, `on_text` gets the
    /// reply's text as it is generated. The reply joins the history. A message that does
    /// not fit the context even alone is an error and leaves the history as it was.
    pub fn reply(
        &mut self,
        user: &str,
        mut on_note: impl FnMut(&str),
        mut on_text: impl FnMut(&str),
    ) -> Result<Reply, EngineError> {
        // A message that does not fit even alone is refused before any turn is dropped.
        let kept = std::mem::replace(
            &mut self.history,
            vec![json!({"role": "user", "content": user})],
        );
        let alone = self.prompt_ids();
        self.history = kept;
        let alone = alone?.len();
        if alone >= self.limit {
            return Err(usage(format!(
                "this message makes {alone} tokens with the template, and the model has {} positions: it was not sent",
                self.limit
            )));
        }
        self.history.push(json!({"role": "user", "content": user}));
        let max = self.options.max_tokens;
        // Room kept for the reply: --max-tokens, but never more than a quarter of the
        // context (a --max-tokens as long as the context would leave no room for history).
        let room = max.min(self.limit / 4).max(1);
        let mut dropped = 0;
        let ids = loop {
            let ids = match self.prompt_ids() {
                Ok(ids) => ids,
                Err(e) => {
                    self.history.pop();
                    return Err(e);
                }
            };
            if ids.len() + room <= self.limit || !self.drop_oldest() {
                break ids;
            }
            dropped += 1;
        };
        if dropped > 0 {
            on_note(&format!(
                "the conversation outgrew the model's {} positions: dropped the oldest {} turn{}",
                self.limit,
                dropped,
                if dropped == 1 { "" } else { "s" }
            ));
        }
        if ids.is_empty() {
            self.history.pop();
            return Err(usage("the chat template renders nothing".into()));
        }
        let vocab = self.source.model.spec.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            self.history.pop();
            return Err(usage(format!(
                "token {bad} of the rendered conversation is outside the model's vocabulary ({vocab})"
            )));
        }
        let max_new = max.min(self.limit - ids.len());
        let mut sampling = self.options.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(self.replies);
        let start = Instant::now();
        let mut stream = TextStream::new();
        let tok = &self.tok;
        let out = super::generate(
            &self.source.model,
            &ids,
            max_new,
            &sampling,
            &self.stop,
            |t| {
                if let Some(piece) = stream.push(tok, t) {
                    on_text(&piece);
                }
            },
        );
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.history.pop();
                return Err(e.into());
            }
        };
        if let Some(rest) = stream.finish(tok) {
            on_text(&rest);
        }
        let secs = start.elapsed().as_secs_f64();
        let text = tok.decode(&out);
        self.history
            .push(json!({"role": "assistant", "content": text}));
        self.replies += 1;
        Ok(Reply {
            ended: out.last().is_some_and(|t| self.stop.contains(t)),
            text,
            prompt_tokens: ids.len(),
            tokens_per_s: out.len() as f64 / secs.max(1e-9),
            ids: out,
        })
    }
}
