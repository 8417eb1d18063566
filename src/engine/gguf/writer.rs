//! The GGUF v3 container, written: header, typed key/value metadata, tensor infos, then the
//! tensor data, each aligned to `general.alignment` (32 bytes).

use super::quant::GgmlType;
use std::io::{self, Write};
use std::path::Path;

/// The file's magic ("GGUF", little-endian) and the version written.
pub const MAGIC: u32 = 0x4655_4747;
pub const VERSION: u32 = 3;
pub const ALIGNMENT: u64 = 32;

/// A metadata value, typed as GGUF types it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
    Bools(Vec<bool>),
}

/// GGUF's value type codes.
pub mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One tensor as stored: its name, its shape in torch order (outermost first; GGUF stores it
/// reversed) and its encoded bytes.
pub struct TensorData {
    pub name: String,
    pub shape: Vec<usize>,
    pub ty: GgmlType,
    pub bytes: Vec<u8>,
}

fn string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn value(w: &mut impl Write, v: &Value) -> io::Result<()> {
    let array = |w: &mut dyn Write, ty: u32, n: usize| -> io::Result<()> {
        w.write_all(&vt::ARRAY.to_le_bytes())?;
        w.write_all(&ty.to_le_bytes())?;
        w.write_all(&(n as u64).to_le_bytes())
    };
    match v {
        Value::U32(x) => {
            w.write_all(&vt::U32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        Value::I32(x) => {
            w.write_all(&vt::I32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        Value::U64(x) => {
            w.write_all(&vt::U64.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        Value::F32(x) => {
            w.write_all(&vt::F32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        Value::Bool(x) => {
            w.write_all(&vt::BOOL.to_le_bytes())?;
            w.write_all(&[*x as u8])
        }
        Value::Str(s) => {
            w.write_all(&vt::STRING.to_le_bytes())?;
            string(w, s)
        }
        Value::Strs(a) => {
            array(w, vt::STRING, a.len())?;
            a.iter().try_for_each(|s| string(w, s))
        }
        Value::I32s(a) => {
            array(w, vt::I32, a.len())?;
            a.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        Value::F32s(a) => {
            array(w, vt::F32, a.len())?;
            a.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        Value::Bools(a) => {
            array(w, vt::BOOL, a.len())?;
            a.iter().try_for_each(|x| w.write_all(&[*x as u8]))
        }
    }
}

fn pad(w: &mut impl Write, at: u64) -> io::Result<u64> {
    let n = (ALIGNMENT - at % ALIGNMENT) % ALIGNMENT;
    w.write_all(&vec![0u8; n as usize])?;
    Ok(at + n)
}

/// Counts what passes through, so padding can be computed without seeking.
struct Counted<W> {
    inner: W,
    at: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.at += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Write a GGUF v3 stream: `kv` in order, then `tensors` (infos, then data).
pub fn write_to(w: impl Write, kv: &[(String, Value)], tensors: &[TensorData]) -> io::Result<()> {
    let mut w = Counted { inner: w, at: 0 };
    w.write_all(&MAGIC.to_le_bytes())?;
    w.write_all(&VERSION.to_le_bytes())?;
    w.write_all(&(tensors.len() as u64).to_le_bytes())?;
    w.write_all(&(kv.len() as u64).to_le_bytes())?;
    for (k, v) in kv {
        string(&mut w, k)?;
        value(&mut w, v)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        string(&mut w, &t.name)?;
        w.write_all(&(t.shape.len() as u32).to_le_bytes())?;
        for d in t.shape.iter().rev() {
            w.write_all(&(*d as u64).to_le_bytes())?;
        }
        w.write_all(&(t.ty as u32).to_le_bytes())?;
        w.write_all(&offset.to_le_bytes())?;
        offset += t.bytes.len() as u64;
        offset += (ALIGNMENT - offset % ALIGNMENT) % ALIGNMENT;
    }
    let mut at = w.at;
    at = pad(&mut w, at)?;
    for t in tensors {
        w.write_all(&t.bytes)?;
        at = pad(&mut w, at + t.bytes.len() as u64)?;
    }
    w.flush()
}

/// Write a GGUF v3 file at `path`.
pub fn write(path: &Path, kv: &[(String, Value)], tensors: &[TensorData]) -> io::Result<()> {
    let f = std::fs::File::create(path)?;
    write_to(io::BufWriter::new(f), kv, tensors)
}
