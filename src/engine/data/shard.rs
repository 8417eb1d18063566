//! A packed token shard on disk, trusted only as far as it is checked.
//!
//! At open, a shard's size must be its manifest's token count × width, and its fingerprint
//! (CRC32C of the whole file up to [`WHOLE`] bytes, else of [`SAMPLES`] blocks of [`BLOCK`]
//! bytes spread evenly over it, the first and last included) must be the one written at
//! prepare time: a truncated or overwritten cache is caught before training, at the cost of
//! reading at most 64 MiB.
//!
//! Windows are then read with positional reads (`pread`), not through a memory map: a file
//! that shrinks under a mapping kills the process with SIGBUS at the first touch of a lost
//! page, and no check before the touch closes that race. A short read is an ordinary error
//! naming the cache. Every token read is checked against the vocabulary, so bytes changed
//! after the open (or in the blocks a large shard's fingerprint does not cover) are an error
//! naming the cache too, never an id the model's embedding cannot index.

use super::DataError;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Shards up to this size are fingerprinted whole.
const WHOLE: u64 = 64 << 20;
/// Bytes per sampled block of a larger shard.
const BLOCK: u64 = 1 << 20;
/// Sampled blocks of a larger shard.
const SAMPLES: u64 = 32;

/// The fingerprint of the open file `file` of `len` bytes (see the module's doc).
pub(super) fn fingerprint(file: &File, len: u64) -> std::io::Result<u32> {
    let mut crc = crc32c::crc32c(&len.to_le_bytes());
    if len <= WHOLE {
        let mut buf = vec![0u8; 1 << 20];
        let mut r = std::io::BufReader::new(file).take(len);
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            crc = crc32c::crc32c_append(crc, &buf[..n]);
        }
        return Ok(crc);
    }
    let mut buf = vec![0u8; BLOCK as usize];
    for i in 0..SAMPLES {
        let at = i * (len - BLOCK) / (SAMPLES - 1);
        file.read_exact_at(&mut buf, at)?;
        crc = crc32c::crc32c_append(crc, &buf);
    }
    Ok(crc)
}

/// The fingerprint of the shard at `path` (its size, and what [`fingerprint`] returns).
pub(super) fn fingerprint_path(path: &Path) -> Result<(u64, u32), DataError> {
    let io = |source| DataError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = crate::util::open_regular(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    Ok((len, fingerprint(&file, len).map_err(io)?))
}

/// Why the shard at `path` is not the one its manifest describes (`tokens` of `width` bytes,
/// fingerprint `crc`), or None when it is.
pub(super) fn mismatch(path: &Path, tokens: u64, width: usize, crc: Option<u32>) -> Option<String> {
    let Some(crc) = crc else {
        return Some("the manifest has no fingerprint (written by an older cockpit)".into());
    };
    let want = tokens.saturating_mul(width as u64);
    match fingerprint_path(path) {
        Err(e) => Some(e.to_string()),
        Ok((len, _)) if len != want => Some(format!(
            "{} is {len} bytes; its manifest says {tokens} tokens × {width} = {want}",
            path.display()
        )),
        Ok((_, got)) if got != crc => Some(format!(
            "{}: its content changed since it was written (CRC32C {got:08x}, manifest {crc:08x})",
            path.display()
        )),
        Ok(_) => None,
    }
}

/// An open shard: windows read by position, every token checked against the vocabulary.
#[derive(Debug)]
pub(super) struct Shard {
    file: File,
    path: String,
    width: usize,
    vocab: u64,
    /// Tokens the shard held when opened.
    pub(super) len: usize,
}

impl Shard {
    /// Open `path`, which must hold exactly `tokens` tokens of `width` bytes.
    pub(super) fn open(
        path: &Path,
        width: usize,
        tokens: u64,
        vocab: usize,
    ) -> Result<Self, DataError> {
        let name = path.display().to_string();
        let io = |source| DataError::Io {
            path: name.clone(),
            source,
        };
        let file = crate::util::open_regular(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(corrupt(&name, "not a regular file".into()));
        }
        let want = tokens.saturating_mul(width as u64);
        if meta.len() != want {
            return Err(corrupt(
                &name,
                format!(
                    "{} bytes; its manifest says {tokens} tokens × {width} = {want}",
                    meta.len()
                ),
            ));
        }
        Ok(Self {
            file,
            path: name,
            width,
            vocab: vocab as u64,
            len: tokens as usize,
        })
    }

    /// Append tokens `[start, start + n)` to `out`.
    pub(super) fn read(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let w = self.width;
        let mut buf = vec![0u8; n * w];
        let at = (start * w) as u64;
        self.file.read_exact_at(&mut buf, at).map_err(|e| {
            let now = self
                .file
                .metadata()
                .map(|m| format!("{} bytes now", m.len()))
                .unwrap_or_else(|_| "its size unknown".into());
            corrupt(
                &self.path,
                format!(
                    "changed while in use: {} bytes at offset {at} cannot be read ({e}; {now}, {} at the start)",
                    buf.len(),
                    self.len * w
                ),
            )
        })?;
        let first = out.len();
        if w == 2 {
            out.extend(
                buf.chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            );
        } else {
            out.extend(
                buf.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        if let Some(i) = out[first..]
            .iter()
            .position(|&t| u64::from(t) >= self.vocab)
        {
            let t = out[first + i];
            out.truncate(first);
            return Err(corrupt(
                &self.path,
                format!(
                    "token {t} at position {} is outside the vocabulary (size {})",
                    start + i,
                    self.vocab
                ),
            ));
        }
        Ok(())
    }
}

fn corrupt(path: &str, what: String) -> DataError {
    DataError::Cache {
        path: path.to_string(),
        message: format!(
            "{what}: not the cache cockpit wrote; delete it (or its directory) and run again to rebuild it"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard_of(dir: &Path, tokens: &[u16]) -> std::path::PathBuf {
        let p = dir.join("train.bin");
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn a_changed_or_resized_shard_is_a_mismatch() {
        let tmp = tempfile::tempdir().unwrap();
        let p = shard_of(tmp.path(), &[1, 2, 3, 4]);
        let (len, crc) = fingerprint_path(&p).unwrap();
        assert_eq!(len, 8);
        assert_eq!(mismatch(&p, 4, 2, Some(crc)), None);
        assert!(mismatch(&p, 4, 2, None).unwrap().contains("no fingerprint"));
        assert!(mismatch(&p, 5, 2, Some(crc)).unwrap().contains("8 bytes"));
        shard_of(tmp.path(), &[1, 2, 3, 5]);
        assert!(mismatch(&p, 4, 2, Some(crc)).unwrap().contains("changed"));
    }

    #[test]
    fn large_shards_are_sampled_and_still_catch_a_changed_block() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("big.bin");
        let len = WHOLE + 3 * BLOCK + 17;
        let f = File::create(&p).unwrap();
        f.set_len(len).unwrap();
        let (_, crc) = fingerprint_path(&p).unwrap();
        // the last block is always sampled
        f.write_all_at(b"x", len - 1).unwrap();
        assert_ne!(fingerprint_path(&p).unwrap().1, crc);
    }

    #[test]
    fn reads_stop_at_a_shrunk_file_or_a_token_outside_the_vocabulary() {
        let tmp = tempfile::tempdir().unwrap();
        let p = shard_of(tmp.path(), &[1, 2, 3, 4, 5, 6]);
        let s = Shard::open(&p, 2, 6, 256).unwrap();
        let mut out = Vec::new();
        s.read(1, 3, &mut out).unwrap();
        assert_eq!(out, [2, 3, 4]);
        assert!(Shard::open(&p, 2, 7, 256).is_err(), "size checked at open");
        // shrinks under the open shard: an error naming it, not SIGBUS
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4)
            .unwrap();
        let e = s.read(2, 3, &mut out).unwrap_err().to_string();
        assert!(
            e.contains("train.bin") && e.contains("changed while in use"),
            "{e}"
        );
        // random bytes: an id outside the vocabulary is named, and nothing is appended
        shard_of(tmp.path(), &[1, 2, 40771, 4, 5, 6]);
        let s = Shard::open(&p, 2, 6, 256).unwrap();
        let mut out = vec![9];
        let e = s.read(0, 4, &mut out).unwrap_err().to_string();
        assert!(
            e.contains("train.bin") && e.contains("token 40771 at position 2"),
            "{e}"
        );
        assert_eq!(out, [9]);
    }
}
