//! The GGUF container, read: header, metadata (every value type), tensor infos, and each
//! tensor's bytes decoded to f32 (the encodings [`super::quant`] knows). A truncated or
//! inconsistent file is an error naming what is wrong.

use super::quant::{self, GgmlType};
use super::writer::{vt, ALIGNMENT, MAGIC};
use std::collections::BTreeMap;

/// A metadata value as read.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

impl Meta {
    pub fn as_usize(&self) -> Option<usize> {
        match self {
            Meta::Int(i) => usize::try_from(*i).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Meta::Float(f) => Some(*f),
            Meta::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// A tensor's place in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Torch order (outermost first).
    pub shape: Vec<usize>,
    pub code: u32,
    /// Absolute byte offset in the file.
    pub start: usize,
}

/// A parsed GGUF file (its bytes kept for the tensors).
pub struct Gguf {
    pub meta: BTreeMap<String, Meta>,
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len());
        let Some(end) = end else {
            return Err(format!(
                "truncated: {what} at byte {} needs {n} bytes, the file has {}",
                self.at,
                self.b.len()
            ));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)? as usize;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| format!("{what}: not UTF-8"))
    }
    fn value(&mut self, ty: u32, what: &str) -> Result<Meta, String> {
        let int = |s: &[u8], signed: bool| -> i128 {
            let mut a = [0u8; 16];
            a[..s.len()].copy_from_slice(s);
            let v = u128::from_le_bytes(a);
            let bits = s.len() * 8;
            if signed && s[s.len() - 1] & 0x80 != 0 {
                (v as i128) - (1i128 << bits)
            } else {
                v as i128
            }
        };
        Ok(match ty {
            vt::U8 | vt::I8 => Meta::Int(int(self.take(1, what)?, ty == vt::I8)),
            vt::U16 | vt::I16 => Meta::Int(int(self.take(2, what)?, ty == vt::I16)),
            vt::U32 | vt::I32 => Meta::Int(int(self.take(4, what)?, ty == vt::I32)),
            vt::U64 | vt::I64 => Meta::Int(int(self.take(8, what)?, ty == vt::I64)),
            vt::F32 => {
                let s = self.take(4, what)?;
                Meta::Float(f32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64)
            }
            vt::F64 => {
                let s = self.take(8, what)?;
                let mut a = [0u8; 8];
                a.copy_from_slice(s);
                Meta::Float(f64::from_le_bytes(a))
            }
            vt::BOOL => Meta::Bool(self.take(1, what)?[0] != 0),
            vt::STRING => Meta::Str(self.string(what)?),
            vt::ARRAY => {
                let sub = self.u32(what)?;
                let n = self.u64(what)? as usize;
                if n > self.b.len() {
                    return Err(format!(
                        "{what}: an array of {n} values is longer than the file"
                    ));
                }
                let mut a = Vec::with_capacity(n);
                for _ in 0..n {
                    a.push(self.value(sub, what)?);
                }
                Meta::Array(a)
            }
            other => return Err(format!("{what}: unknown value type {other}")),
        })
    }
}

impl Gguf {
    /// Parse `bytes` (a whole GGUF file, version 2 or 3).
    pub fn parse(bytes: Vec<u8>) -> Result<Gguf, String> {
        let mut c = Cursor { b: &bytes, at: 0 };
        if c.u32("the magic")? != MAGIC {
            return Err("not a GGUF file (no GGUF magic)".into());
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version}: supported: 2, 3"));
        }
        let n_tensors = c.u64("the tensor count")? as usize;
        let n_kv = c.u64("the key count")? as usize;
        let mut meta = BTreeMap::new();
        for i in 0..n_kv {
            let k = c.string(&format!("key {i}"))?;
            let ty = c.u32(&k)?;
            let v = c.value(ty, &k)?;
            meta.insert(k, v);
        }
        let align = meta
            .get("general.alignment")
            .and_then(Meta::as_usize)
            .unwrap_or(ALIGNMENT as usize)
            .max(1);
        let mut infos = Vec::new();
        for i in 0..n_tensors.min(bytes.len()) {
            let name = c.string(&format!("tensor info {i}"))?;
            let nd = c.u32(&name)? as usize;
            if nd > 8 {
                return Err(format!("{name}: {nd} dimensions"));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(c.u64(&name)? as usize);
            }
            dims.reverse();
            let code = c.u32(&name)?;
            let offset = c.u64(&name)? as usize;
            infos.push(TensorInfo {
                name,
                shape: dims,
                code,
                start: offset,
            });
        }
        let data = c.at.div_ceil(align) * align;
        for t in &mut infos {
            t.start = t.start.saturating_add(data);
        }
        Ok(Gguf {
            meta,
            tensors: infos,
            bytes,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Meta> {
        self.meta.get(key)
    }

    /// A tensor's values as f32 (its type one [`quant`] decodes).
    pub fn decode(&self, t: &TensorInfo) -> Result<Vec<f32>, String> {
        let (ty, bytes) = self.raw(t)?;
        Ok(quant::decode(bytes, ty))
    }

    /// A tensor's type and bytes as stored (its type one [`quant`] decodes).
    pub fn raw(&self, t: &TensorInfo) -> Result<(GgmlType, &[u8]), String> {
        let Some(ty) = GgmlType::from_code(t.code) else {
            return Err(format!(
                "{}: tensor type {} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)",
                t.name,
                quant::code_name(t.code)
            ));
        };
        let n: usize = t.shape.iter().product();
        let len = ty.bytes_of(n).ok_or_else(|| {
            format!(
                "{}: {n} elements are no whole number of {} blocks",
                t.name,
                ty.name()
            )
        })?;
        let end = t.start.checked_add(len).filter(|e| *e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!(
                "truncated: {} needs bytes {}..{}, the file has {}",
                t.name,
                t.start,
                t.start + len,
                self.bytes.len()
            ));
        };
        Ok((ty, &self.bytes[t.start..end]))
    }
}

#[cfg(test)]
mod tests {
    use super::super::writer::{write_to, TensorData, Value};
    use super::*;

    fn file() -> Vec<u8> {
        let kv = vec![
            (
                "general.architecture".to_string(),
                Value::Str("llama".into()),
            ),
            ("llama.block_count".into(), Value::U32(2)),
            ("llama.rope.freq_base".into(), Value::F32(10000.0)),
            ("t.ids".into(), Value::I32s(vec![-1, 3])),
        ];
        let x: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
        let tensors = vec![
            TensorData {
                name: "a.weight".into(),
                shape: vec![3],
                ty: GgmlType::F32,
                bytes: quant::encode(&[1.0, 2.0, 3.0], GgmlType::F32),
            },
            TensorData {
                name: "b.weight".into(),
                shape: vec![2, 32],
                ty: GgmlType::Q8_0,
                bytes: quant::encode(&x, GgmlType::Q8_0),
            },
        ];
        let mut b = Vec::new();
        write_to(&mut b, &kv, &tensors).unwrap();
        b
    }

    #[test]
    fn what_the_writer_writes_reads_back() {
        let g = Gguf::parse(file()).unwrap();
        assert_eq!(
            g.get("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(g.get("llama.block_count").unwrap().as_usize(), Some(2));
        assert_eq!(
            g.get("t.ids"),
            Some(&Meta::Array(vec![Meta::Int(-1), Meta::Int(3)]))
        );
        assert_eq!(g.tensors[1].shape, vec![2, 32]);
        assert_eq!(g.tensors[1].start % 32, 0);
        assert_eq!(g.decode(&g.tensors[0]).unwrap(), vec![1.0, 2.0, 3.0]);
        let b = g.decode(&g.tensors[1]).unwrap();
        assert!((b[63] - 63.0 / 8.0).abs() < 0.05);
    }

    #[test]
    fn a_truncated_file_says_so() {
        let f = file();
        for cut in [3, 40, f.len() - 40] {
            let e = match Gguf::parse(f[..cut].to_vec()) {
                Err(e) => e,
                Ok(g) => g.decode(&g.tensors[1]).unwrap_err(),
            };
            assert!(e.contains("truncated") || e.contains("magic"), "{cut}: {e}");
        }
    }
}
