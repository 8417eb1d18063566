//! `metrics.jsonl` as an append-only file of whole records: each record goes out in one
//! `write` of its full line, a write that fails part-way (a full disk) is cut back off, and
//! a torn last line left by a crash is cut off before a resumed run appends to the file.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

/// An append-only JSON-lines file whose records are whole or absent.
pub struct RecordFile {
    file: File,
    /// The length of the whole records written so far (where a failed write is cut back to).
    len: u64,
}

/// What opening found at the end of an existing file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Repair {
    /// Bytes of a torn last line (no newline) cut off the end.
    pub cut_bytes: u64,
}

impl Repair {
    /// The warning to record, when something was cut.
    pub fn message(&self, path: &Path) -> Option<String> {
        (self.cut_bytes > 0).then(|| {
            format!(
                "{}: cut a torn last record ({} bytes, written when the last run ended mid-write) before appending",
                path.display(),
                self.cut_bytes
            )
        })
    }
}

impl RecordFile {
    /// Open `path` for appending (created if missing). A last line without its newline (a
    /// process killed, or a disk filled, mid-write) is cut off first, so the next record
    /// starts on a line of its own; what was cut is reported.
    pub fn open(path: &Path) -> io::Result<(RecordFile, Repair)> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        let total = file.metadata()?.len();
        let whole = whole_len(&mut file, total)?;
        let repair = Repair {
            cut_bytes: total - whole,
        };
        if whole < total {
            file.set_len(whole)?;
            file.sync_data()?;
        }
        Ok((RecordFile { file, len: whole }, repair))
    }

    /// Append one record (`line` without its newline) in a single write. On failure the file
    /// is cut back to its last whole record, so a reader never sees half a line.
    pub fn append(&mut self, line: &[u8]) -> io::Result<()> {
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line);
        buf.push(b'\n');
        match self.file.write(&buf) {
            Ok(n) if n == buf.len() => {
                self.len += n as u64;
                Ok(())
            }
            Ok(n) => {
                self.cut_back();
                Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("short write: {n} of {} bytes (disk full?)", buf.len()),
                ))
            }
            Err(e) => {
                self.cut_back();
                Err(e)
            }
        }
    }

    /// Serialize `record` as one JSON line and [`append`](Self::append) it.
    pub fn append_json<T: serde::Serialize>(&mut self, record: &T) -> io::Result<()> {
        let line = serde_json::to_vec(record).map_err(io::Error::other)?;
        self.append(&line)
    }

    fn cut_back(&mut self) {
        let _ = self.file.set_len(self.len);
    }
}

/// The length of `file` up to and including its last newline (0 when it has none).
fn whole_len(file: &mut File, total: u64) -> io::Result<u64> {
    const CHUNK: u64 = 64 * 1024;
    let mut end = total;
    let mut buf = vec![0u8; CHUNK as usize];
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_tail_is_cut_before_appending() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, b"{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        let (mut f, repair) = RecordFile::open(&p).unwrap();
        assert_eq!(repair.cut_bytes, 5);
        f.append(b"{\"a\":3}").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n"
        );
    }

    #[test]
    fn a_whole_file_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, b"{\"a\":1}\n").unwrap();
        let (_f, repair) = RecordFile::open(&p).unwrap();
        assert_eq!(repair, Repair::default());
        assert_eq!(std::fs::read(&p).unwrap(), b"{\"a\":1}\n");
    }

    #[test]
    fn a_failed_write_leaves_no_partial_line() {
        // /dev/full takes no byte: the record is absent, never half there
        let Ok(full) = OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let mut f = RecordFile { file: full, len: 0 };
        assert!(f.append(b"{\"a\":1}").is_err());
    }
}
