//! A client of torch's c10d TCPStore, the key-value store torchrun's agent serves at
//! MASTER_ADDR:MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`). Under torchrun the ranks
//! must not listen on that port; they meet through this store instead.
//!
//! The wire format, as the store's server reads it: a request is one command byte, then its
//! arguments; every integer is little-endian (the machine order of the hosts torch runs on),
//! every key and value a `u64` length followed by its bytes. A new connection first sends
//! `VALIDATE` with the store's magic number (no reply). The commands used here:
//!
//! | command | request | reply |
//! | --- | --- | --- |
//! | SET (1) | key, value | none |
//! | COMPARE_SET (2) | key, expected, desired | the value now stored |
//! | GET (3) | key | value |
//! | ADD (4) | key, `i64` | the sum (`i64`); the value is stored as decimal text |
//! | CHECK (5) | `u64` count, keys | `u8`: 0 all present, 1 not yet |
//! | WAIT (6) | `u64` count, keys | `u8` 0 once all are present |
//! | CANCEL_WAIT (12) | — | `u8` 1 (a pending WAIT's 0 may come first) |
//!
//! torch's own clients put `/` before every key (a store's keys are `/KEY`); this one does
//! the same, so both see the same keys.
//!
//! COMPARE_SET with an empty `expected` sets a key that does not exist yet and leaves an
//! existing one alone; either way it answers the value stored, which makes it a
//! "first writer wins".

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x3C85_F7CE;
const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
const READY: u8 = 0;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// The longest value this client accepts (a reply claiming more is not a store's).
const MAX_VALUE: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("could not reach torchrun's store at {addr} within {secs:.0} s ({cause}); is torchrun's agent running, and are MASTER_ADDR/MASTER_PORT its?")]
    Connect {
        addr: String,
        secs: f64,
        cause: String,
    },
    #[error("torchrun's store at {addr}: {op}: {cause}")]
    Io {
        addr: String,
        op: String,
        cause: String,
    },
    #[error("torchrun's store at {addr}: no {keys} within {secs:.0} s")]
    Timeout {
        addr: String,
        keys: String,
        secs: f64,
    },
}

/// One connection to a TCPStore.
pub struct Store {
    stream: TcpStream,
    addr: String,
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

/// A key as torch's clients write it: `/` first.
fn put_key(buf: &mut Vec<u8>, key: &str) {
    buf.extend_from_slice(&(key.len() as u64 + 1).to_le_bytes());
    buf.push(b'/');
    buf.extend_from_slice(key.as_bytes());
}

impl Store {
    /// Connect (retrying until `timeout`: the agent may not be listening yet) and validate.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, StoreError> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let attempt = (host, port)
                .to_socket_addrs()
                .and_then(|mut a| {
                    a.next().ok_or_else(|| {
                        std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
                    })
                })
                .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(StoreError::Connect {
                        addr,
                        secs: timeout.as_secs_f64(),
                        cause: e.to_string(),
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut s = Self { stream, addr };
        let mut req = vec![VALIDATE];
        req.extend_from_slice(&MAGIC.to_le_bytes());
        s.send(&req, "validate")?;
        Ok(s)
    }

    /// This end's address on the connection: the interface the other hosts reach this one
    /// by (they reach the store's host the same way).
    pub fn local_ip(&self) -> Option<IpAddr> {
        self.stream.local_addr().ok().map(|a| a.ip())
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn io(&self, op: &str, e: std::io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            op: op.to_string(),
            cause: e.to_string(),
        }
    }

    fn send(&mut self, req: &[u8], op: &str) -> Result<(), StoreError> {
        let r = self.stream.write_all(req).and_then(|_| self.stream.flush());
        r.map_err(|e| self.io(op, e))
    }

    fn read_exact(&mut self, buf: &mut [u8], op: &str) -> Result<(), StoreError> {
        let r = self.stream.read_exact(buf);
        r.map_err(|e| self.io(op, e))
    }

    fn read_u8(&mut self, op: &str) -> Result<u8, StoreError> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b, op)?;
        Ok(b[0])
    }

    fn read_value(&mut self, op: &str) -> Result<Vec<u8>, StoreError> {
        let mut len = [0u8; 8];
        self.read_exact(&mut len, op)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE {
            return Err(self.io(
                op,
                std::io::Error::other(format!("a reply of {len} bytes: not a TCPStore")),
            ));
        }
        let mut v = vec![0u8; len as usize];
        self.read_exact(&mut v, op)?;
        Ok(v)
    }

    /// Replies come within this long (WAIT sets its own).
    fn reply_timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut req = vec![SET];
        put_key(&mut req, key);
        put_bytes(&mut req, value);
        self.send(&req, &format!("set {key}"))
    }

    /// The value of a key that exists (after [`Store::wait`]); a missing key's is empty on
    /// torch's libuv server and an error on its older one.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        let op = format!("get {key}");
        let mut req = vec![GET];
        put_key(&mut req, key);
        self.send(&req, &op)?;
        let _ = self.stream.set_read_timeout(Some(self.reply_timeout()));
        self.read_value(&op)
    }

    /// Add `delta` to a counter (a missing key counts as 0); the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let op = format!("add {key}");
        let mut req = vec![ADD];
        put_key(&mut req, key);
        req.extend_from_slice(&delta.to_le_bytes());
        self.send(&req, &op)?;
        let _ = self.stream.set_read_timeout(Some(self.reply_timeout()));
        let mut b = [0u8; 8];
        self.read_exact(&mut b, &op)?;
        Ok(i64::from_le_bytes(b))
    }

    /// Whether every key exists now.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreError> {
        let op = format!("check {}", keys.join(", "));
        let mut req = vec![CHECK];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_key(&mut req, k);
        }
        self.send(&req, &op)?;
        let _ = self.stream.set_read_timeout(Some(self.reply_timeout()));
        Ok(self.read_u8(&op)? == READY)
    }

    /// Block until every key exists, at most `timeout`.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let op = format!("wait for {}", keys.join(", "));
        let mut req = vec![WAIT];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_key(&mut req, k);
        }
        self.send(&req, &op)?;
        let _ = self
            .stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))));
        let mut b = [0u8; 1];
        match self.stream.read_exact(&mut b) {
            Ok(()) if b[0] == STOP_WAITING => return Ok(()),
            Ok(()) => {
                return Err(self.io(
                    &op,
                    std::io::Error::other(format!("unexpected reply {}", b[0])),
                ))
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => return Err(self.io(&op, e)),
        }
        // Timed out: withdraw the wait, so the connection stays usable.
        self.send(&[CANCEL_WAIT], "cancel wait")?;
        let _ = self.stream.set_read_timeout(Some(self.reply_timeout()));
        loop {
            match self.read_u8("cancel wait")? {
                // The keys came as the wait was withdrawn.
                STOP_WAITING => continue,
                WAIT_CANCELED => break,
                other => {
                    return Err(self.io(
                        "cancel wait",
                        std::io::Error::other(format!("unexpected reply {other}")),
                    ))
                }
            }
        }
        Err(StoreError::Timeout {
            addr: self.addr.clone(),
            keys: keys.join(", "),
            secs: timeout.as_secs_f64(),
        })
    }

    /// Set `key` to `desired` if it holds `expected` (empty: if it does not exist); the
    /// value stored afterwards either way.
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let op = format!("compare-set {key}");
        let mut req = vec![COMPARE_SET];
        put_key(&mut req, key);
        put_bytes(&mut req, expected);
        put_bytes(&mut req, desired);
        self.send(&req, &op)?;
        let _ = self.stream.set_read_timeout(Some(self.reply_timeout()));
        self.read_value(&op)
    }

    /// [`Store::wait`] for one key, then its value.
    pub fn wait_get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        self.get(key)
    }
}
