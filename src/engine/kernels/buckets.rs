//! Gradient buckets for data-parallel sums overlapped with the backward (the CUDA side is
//! `reduce.rs`): which ranges of the whole-model step's flat gradient buffer are summed
//! after which layer's backward.

/// One bucket: summed once the backward of `after` (a layer index) is queued, or (None)
/// after the whole backward; `ranges` are (offset, length) in f32 elements of the buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    pub after: Option<usize>,
    pub ranges: Vec<(usize, usize)>,
}

/// Plan the buckets over a buffer of `total` f32: `layers[l]` holds layer l's runs
/// (`(start, end)` element offsets, empty runs skipped); consecutive layers from the top are
/// joined until a bucket holds at least `min_len` elements; the last bucket is everything
/// the others leave, so every element is summed exactly once.
pub fn plan(layers: &[Vec<(usize, usize)>], total: usize, min_len: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut open: Vec<(usize, usize)> = Vec::new();
    let mut len = 0;
    for (l, runs) in layers.iter().enumerate().rev() {
        for &(s, e) in runs.iter().filter(|(s, e)| e > s) {
            len += e - s;
            open.push((s, e));
        }
        if len >= min_len {
            out.push(Bucket {
                after: Some(l),
                ranges: merge(std::mem::take(&mut open)),
            });
            len = 0;
        }
    }
    // (start, end) of every element the buckets so far sum
    let mut taken: Vec<(usize, usize)> = out
        .iter()
        .flat_map(|b| b.ranges.iter().map(|&(off, len)| (off, off + len)))
        .collect();
    taken.sort_unstable();
    let mut rest = Vec::new();
    let mut at = 0;
    for (s, e) in taken {
        if s > at {
            rest.push((at, s - at));
        }
        at = at.max(e);
    }
    if total > at {
        rest.push((at, total - at));
    }
    out.push(Bucket {
        after: None,
        ranges: rest,
    });
    out
}

/// Sorted runs joined where they touch, as (offset, length).
fn merge(mut runs: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    runs.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (s, e) in runs {
        match out.last_mut() {
            Some((ls, ll)) if *ls + *ll >= s => *ll = (*ll).max(e - *ls),
            _ => out.push((s, e - s)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_buffer_once_from_the_top_layer_down() {
        // Three layers: matrices in [0, 300), norms in the tail [400, 460); the head and
        // embeddings around them.
        let layers = vec![
            vec![(10, 110), (400, 420)],
            vec![(110, 210), (420, 440)],
            vec![(210, 310), (440, 460)],
        ];
        let b = plan(&layers, 500, 100);
        assert_eq!(b.len(), 4);
        assert_eq!(b[0].after, Some(2));
        assert_eq!(b[0].ranges, vec![(210, 100), (440, 20)]);
        assert_eq!(b[1].after, Some(1));
        assert_eq!(b[2].after, Some(0));
        assert_eq!(b[3].after, None);
        assert_eq!(b[3].ranges, vec![(0, 10), (310, 90), (460, 40)]);
        // Every element exactly once.
        let mut seen = vec![0u8; 500];
        for r in b.iter().flat_map(|b| &b.ranges) {
            for x in &mut seen[r.0..r.0 + r.1] {
                *x += 1;
            }
        }
        assert!(seen.iter().all(|&x| x == 1));
        // Large buckets join layers; a bucket too large for any layer leaves one bucket.
        let joined = plan(&layers, 500, 200);
        assert_eq!(joined[0].after, Some(1));
        assert_eq!(joined[0].ranges, vec![(110, 200), (420, 40)]);
        let one = plan(&layers, 500, 10_000);
        assert_eq!(
            one,
            vec![Bucket {
                after: None,
                ranges: vec![(0, 500)]
            }]
        );
    }
}
