//! Where a model source's chat template is, for `generate --chat`, `--prompts` with
//! conversations and `chat`: the renderer is the training data's ([`ChatTemplate`]).

use crate::engine::data::template::ChatTemplate;
use crate::engine::source::Source;
use crate::engine::EngineError;
use std::path::Path;

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

/// The chat template of a model source: the one beside its tokenizer (a Hugging Face
/// directory's, or the copy a run keeps of its base's), else the run's `data.chat_template`.
pub fn template_of(s: &Source, src: &Path) -> Result<ChatTemplate, EngineError> {
    let tokenizer = s.tokenizer.as_deref().unwrap_or("byte");
    if let Some(t) = ChatTemplate::find("", tokenizer).map_err(usage)? {
        return Ok(t);
    }
    let spec = s.run.as_ref().map_or("", |c| c.data.chat_template.as_str());
    if !spec.is_empty() {
        if let Some(t) = ChatTemplate::find(spec, tokenizer).map_err(usage)? {
            return Ok(t);
        }
    }
    Err(usage(format!(
        "{}: no chat template (chat_template.jinja or \"chat_template\" in tokenizer_config.json beside the tokenizer, or the run's data.chat_template)",
        src.display()
    )))
}
