//! Text of generated tokens as they come: each new token's text is the difference between
//! decoding a short window of the latest ids with and without it, so a character whose bytes
//! span several tokens appears once it is whole, and a tokenizer that merges or strips
//! spaces at the start of a decode prints what decoding all ids at once would.

use crate::engine::data::Tok;

/// The ids so far and how much of their text has been handed out.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Where the window that is decoded again starts.
    prefix: usize,
    /// The ids before this one have their text handed out.
    read: usize,
}

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `id`; the text it completes, if any.
    pub fn push(&mut self, tok: &Tok, id: u32) -> Option<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let now = tok.decode(&self.ids[self.prefix..]);
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let new = now.get(before.len()..).map(str::to_string);
            if new.is_some() {
                self.prefix = self.read;
                self.read = self.ids.len();
            }
            return new;
        }
        None
    }

    /// The text still held back (bytes that never made a whole character), if any.
    pub fn finish(&mut self, tok: &Tok) -> Option<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let now = tok.decode(&self.ids[self.prefix..]);
        self.prefix = self.read;
        self.read = self.ids.len();
        now.get(before.len()..)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of a multi-byte character arrive one token at a time: nothing is printed until
    /// the character is whole, and the pieces join to the whole text.
    #[test]
    fn multibyte_characters_print_when_whole() {
        let tok = Tok::Byte;
        let text = "né ✓ 🦀!";
        let mut s = TextStream::new();
        let mut pieces = Vec::new();
        for b in text.bytes() {
            if let Some(p) = s.push(&tok, u32::from(b)) {
                pieces.push(p);
            }
        }
        pieces.extend(s.finish(&tok));
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        assert!(pieces.contains(&"🦀".to_string()));
    }

    /// A stream cut inside a character hands out what is left at the end.
    #[test]
    fn finish_hands_out_an_unfinished_character() {
        let tok = Tok::Byte;
        let mut s = TextStream::new();
        assert_eq!(s.push(&tok, u32::from(b'a')).as_deref(), Some("a"));
        assert_eq!(s.push(&tok, 0xF0), None);
        assert_eq!(s.finish(&tok).as_deref(), Some("\u{FFFD}"));
    }
}
