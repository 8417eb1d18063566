//! What the whole-model step takes a micro-batch as: rows of token ids and targets, the targets
//! that do not train marked, and for packed rows the samples they hold.

/// A target that does not train (a prompt or padding slot of instruction data): no loss, no
/// gradient (the data's packing writes it: [`crate::engine::data::packing`]).
pub const IGNORE: u32 = u32::MAX;

/// One micro-batch for the step: `b` rows of `T` token ids and their targets ([`IGNORE`]
/// where a slot does not train), and for packed rows a sample id per slot.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub inputs: &'a [u32],
    pub targets: &'a [u32],
    pub segments: Option<&'a [u32]>,
    pub b: usize,
}

/// Each slot's sample start within its row of `t` (a new sample begins where the id changes).
pub fn sample_starts(segments: &[u32], t: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(segments.len());
    for row in segments.chunks(t.max(1)) {
        let mut start = 0usize;
        for (j, s) in row.iter().enumerate() {
            if j > 0 && *s != row[j - 1] {
                start = j;
            }
            out.push(start as i32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_restart_at_each_sample_and_each_row() {
        let seg = [0, 0, 0, 1, 1, 2, 7, 7, 8, 8];
        assert_eq!(sample_starts(&seg, 5), vec![0, 0, 0, 3, 3, 0, 1, 1, 3, 3]);
    }
}
