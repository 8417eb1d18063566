//! The TCP rendezvous: rank 0 listens at MASTER_ADDR:MASTER_PORT, every other rank connects
//! (retrying until the timeout), says who it is, and receives rank 0's payload (the NCCL
//! unique id). Mismatched world sizes, duplicate ranks and other versions are refused with
//! a message naming the rank. The sockets stay open afterwards (see [`Peers::watch`]).

use super::Topology;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank}: could not reach rank 0 at {addr} within {secs:.0} s ({cause}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?")]
    Unreachable {
        rank: usize,
        addr: String,
        secs: f64,
        cause: String,
    },
    #[error("rank 0: cannot listen on {addr}: {cause} (another job on this port? set MASTER_PORT or distributed.master_port)")]
    Bind { addr: String, cause: String },
    #[error(
        "rank 0: only {joined} of {world} ranks joined within {secs:.0} s (missing: {missing})"
    )]
    Incomplete {
        joined: usize,
        world: usize,
        secs: f64,
        missing: String,
    },
    #[error("rendezvous refused: {0}")]
    Refused(String),
    #[error("rendezvous I/O with {who}: {cause}")]
    Io { who: String, cause: String },
    #[error("rank {rank}: {source}")]
    Store {
        rank: usize,
        source: super::store::StoreError,
    },
}

#[derive(Serialize, Deserialize)]
struct Hello {
    rank: usize,
    world: usize,
    host: String,
    version: String,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    Payload(Vec<u8>),
    Error(String),
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Control {
    Bye,
    /// The sender is failing; `cause` says why (rank 0 relays a worker's to the others).
    Failed {
        rank: usize,
        cause: String,
    },
}

/// The open connections after a rendezvous: rank 0 holds one per worker, a worker holds one
/// to rank 0.
pub struct Peers {
    pub rank: usize,
    pub world: usize,
    pub(super) conns: Vec<(usize, String, TcpStream)>,
    /// Set once this rank finishes or fails on its own: from then on a peer closing its
    /// connection is expected, not news.
    pub(super) leaving: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

fn host() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line)?;
    s.flush()
}

fn read_line<T: for<'de> Deserialize<'de>>(s: &TcpStream, deadline: Instant) -> std::io::Result<T> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    // Byte by byte, not through a BufReader: the peer's next frames (the first broadcast)
    // may already sit behind the line, and a buffer dropped here would take them with it.
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    let mut s = s;
    loop {
        match s.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    serde_json::from_slice(&line).map_err(std::io::Error::other)
}

/// Meet the other ranks. Rank 0 passes the payload every rank receives (`Some`); the others
/// pass `None` and get rank 0's. Returns the payload and the open connections.
pub fn rendezvous(
    t: &Topology,
    payload: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(Vec<u8>, Peers), RendezvousError> {
    let deadline = Instant::now() + timeout;
    let addr = format!("{}:{}", t.master_addr, t.master_port);
    if t.rank == 0 {
        let payload = payload.unwrap_or_default();
        let conns = serve(t, &addr, &payload, deadline, timeout)?;
        Ok((
            payload,
            Peers {
                rank: 0,
                world: t.world,
                conns,
                leaving: Default::default(),
            },
        ))
    } else {
        join(t, &addr, deadline, timeout)
    }
}

fn serve(
    t: &Topology,
    addr: &str,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<(usize, String, TcpStream)>, RendezvousError> {
    let bind_err = |e: std::io::Error| RendezvousError::Bind {
        addr: addr.to_string(),
        cause: e.to_string(),
    };
    // Listen on every interface at the port: MASTER_ADDR names this host for the others.
    let listener = TcpListener::bind(("0.0.0.0", t.master_port)).map_err(bind_err)?;
    serve_on(t, listener, addr, payload, deadline, timeout)
}

/// Rank 0's side on a bound listener: take every worker's hello, then send the payload.
pub(super) fn serve_on(
    t: &Topology,
    listener: TcpListener,
    addr: &str,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<(usize, String, TcpStream)>, RendezvousError> {
    let bind_err = |e: std::io::Error| RendezvousError::Bind {
        addr: addr.to_string(),
        cause: e.to_string(),
    };
    listener.set_nonblocking(true).map_err(bind_err)?;
    let mut joined: Vec<(usize, String, TcpStream)> = Vec::new();
    while joined.len() + 1 < t.world {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..t.world)
                        .filter(|r| !joined.iter().any(|(j, _, _)| j == r))
                        .map(|r| r.to_string())
                        .collect();
                    return Err(RendezvousError::Incomplete {
                        joined: joined.len() + 1,
                        world: t.world,
                        secs: timeout.as_secs_f64(),
                        missing: missing.join(", "),
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(bind_err(e)),
        };
        let io = |e: std::io::Error| RendezvousError::Io {
            who: peer.to_string(),
            cause: e.to_string(),
        };
        stream.set_nonblocking(false).map_err(io)?;
        let mut stream = stream;
        let hello: Hello = match read_line(&stream, deadline) {
            Ok(h) => h,
            // Something that is not a cockpit rank (a port scanner): ignore it.
            Err(_) => continue,
        };
        let refuse = if hello.world != t.world {
            Some(format!(
                "rank {} on {} has WORLD_SIZE {}, rank 0 has {}",
                hello.rank, hello.host, hello.world, t.world
            ))
        } else if hello.rank == 0 || hello.rank >= t.world {
            Some(format!(
                "a process on {} claims rank {} (valid: 1..{})",
                hello.host,
                hello.rank,
                t.world - 1
            ))
        } else if joined.iter().any(|(r, _, _)| *r == hello.rank) {
            Some(format!(
                "rank {} joined twice (again from {})",
                hello.rank, hello.host
            ))
        } else if hello.version != env!("CARGO_PKG_VERSION") {
            Some(format!(
                "rank {} runs cockpit {}, rank 0 runs {}",
                hello.rank,
                hello.version,
                env!("CARGO_PKG_VERSION")
            ))
        } else {
            None
        };
        if let Some(msg) = refuse {
            let _ = send_line(&mut stream, &Reply::Error(msg.clone()));
            for (_, _, s) in &mut joined {
                let _ = send_line(s, &Reply::Error(msg.clone()));
            }
            return Err(RendezvousError::Refused(msg));
        }
        joined.push((hello.rank, hello.host, stream));
    }
    for (rank, h, s) in &mut joined {
        send_line(s, &Reply::Payload(payload.to_vec())).map_err(|e| RendezvousError::Io {
            who: format!("rank {rank} ({h})"),
            cause: e.to_string(),
        })?;
    }
    joined.sort_by_key(|(r, _, _)| *r);
    Ok(joined)
}

pub(super) fn join(
    t: &Topology,
    addr: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<(Vec<u8>, Peers), RendezvousError> {
    let unreachable = |cause: String| RendezvousError::Unreachable {
        rank: t.rank,
        addr: addr.to_string(),
        secs: timeout.as_secs_f64(),
        cause,
    };
    let mut stream = loop {
        let attempt = addr
            .to_socket_addrs()
            .and_then(|mut a| {
                a.next()
                    .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))
            })
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
        match attempt {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => return Err(unreachable(e.to_string())),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    let io = |e: std::io::Error| RendezvousError::Io {
        who: "rank 0".into(),
        cause: e.to_string(),
    };
    send_line(
        &mut stream,
        &Hello {
            rank: t.rank,
            world: t.world,
            host: host(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
    )
    .map_err(io)?;
    match read_line::<Reply>(&stream, deadline) {
        Ok(Reply::Payload(p)) => Ok((
            p,
            Peers {
                rank: t.rank,
                world: t.world,
                conns: vec![(0, t.master_addr.clone(), stream)],
                leaving: Default::default(),
            },
        )),
        Ok(Reply::Error(m)) => Err(RendezvousError::Refused(m)),
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            Err(unreachable(
                "rank 0 accepted but the other ranks did not all join in time".into(),
            ))
        }
        Err(e) => Err(io(e)),
    }
}

impl Peers {
    /// Watch every connection on its own thread: a peer that closes its socket without
    /// [`Peers::goodbye`] has exited or crashed, and `on_lost` gets a message naming it.
    pub fn watch(&self, on_lost: impl Fn(String) + Send + Sync + Clone + 'static) {
        // Rank 0 relays what it learns to every other worker, so each names the real cause
        // rather than only "rank 0 went away".
        let relay: std::sync::Arc<Vec<(usize, std::sync::Mutex<TcpStream>)>> = std::sync::Arc::new(
            self.conns
                .iter()
                .filter_map(|(r, _, s)| s.try_clone().ok().map(|s| (*r, std::sync::Mutex::new(s))))
                .collect(),
        );
        for (rank, host, s) in &self.conns {
            let Ok(s) = s.try_clone() else { continue };
            let (rank, host, me, on_lost) = (*rank, host.clone(), self.rank, on_lost.clone());
            let relay = relay.clone();
            let leaving = self.leaving.clone();
            let on_lost = move |msg: String| {
                if !leaving.load(std::sync::atomic::Ordering::SeqCst) {
                    on_lost(msg);
                }
            };
            let tell_others = move |who: usize, cause: &str| {
                for (r, s) in relay.iter() {
                    if *r != who {
                        if let Ok(mut s) = s.lock() {
                            let _ = send_line(
                                &mut s,
                                &Control::Failed {
                                    rank: who,
                                    cause: cause.to_string(),
                                },
                            );
                        }
                    }
                }
            };
            let _ = std::thread::Builder::new()
                .name(format!("cockpit-watch-rank{rank}"))
                .spawn(move || {
                    let _ = s.set_read_timeout(None);
                    let mut r = BufReader::new(s);
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match r.read_line(&mut line) {
                            Ok(0) | Err(_) => {
                                let cause = format!("went away without finishing ({host}): it exited, crashed or lost the network");
                                if me == 0 {
                                    tell_others(rank, &cause);
                                }
                                on_lost(format!("rank {me}: rank {rank} {cause}"));
                                return;
                            }
                            Ok(_) => match serde_json::from_str(&line) {
                                Ok(Control::Bye) => return,
                                Ok(Control::Failed { rank: who, cause }) => {
                                    if me == 0 {
                                        tell_others(who, &cause);
                                    }
                                    on_lost(format!("rank {me}: rank {who} failed: {cause}"));
                                    return;
                                }
                                Err(_) => {}
                            },
                        }
                    }
                });
        }
    }

    /// Tell the peers this rank is finishing normally (so its closing socket is no alarm).
    pub fn goodbye(&mut self) {
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for (_, _, s) in &mut self.conns {
            let _ = send_line(s, &Control::Bye);
        }
    }

    /// Tell the peers this rank is failing and why (best effort: the sockets may be gone).
    /// Rank 0 also uses it to relay a worker's failure to the others.
    pub fn fail(&mut self, rank: usize, cause: &str) {
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for (_, _, s) in &mut self.conns {
            let _ = send_line(
                s,
                &Control::Failed {
                    rank,
                    cause: cause.to_string(),
                },
            );
        }
    }

    /// The connections themselves, by rank (for a data plane over TCP; no watcher then).
    pub fn into_streams(self) -> Vec<(usize, TcpStream)> {
        self.conns.into_iter().map(|(r, _, s)| (r, s)).collect()
    }

    /// The ranks this process is connected to.
    pub fn connected(&self) -> Vec<usize> {
        self.conns.iter().map(|(r, _, _)| *r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0 may send the payload and its first frame before a worker reads either: the
    /// worker's reading of the payload line must leave the frame in the socket.
    #[test]
    fn the_bytes_after_the_payload_line_stay_in_the_stream() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let t = Topology {
            rank: 0,
            world: 2,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let (sent, wait) = std::sync::mpsc::channel();
        let rank0 = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut conns = serve_on(
                &t,
                listener,
                "rank 0",
                b"payload",
                deadline,
                Duration::from_secs(30),
            )
            .unwrap();
            conns[0].2.write_all(b"FRAME").unwrap();
            sent.send(()).unwrap();
            conns
        });
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let hello = Hello {
            rank: 1,
            world: 2,
            host: "test".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        };
        send_line(&mut s, &hello).unwrap();
        // Both the payload line and the frame are in this socket before it is read.
        wait.recv().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        match read_line::<Reply>(&s, deadline).unwrap() {
            Reply::Payload(p) => assert_eq!(p, b"payload"),
            Reply::Error(m) => panic!("refused: {m}"),
        }
        let mut frame = [0u8; 5];
        s.read_exact(&mut frame).unwrap();
        assert_eq!(&frame, b"FRAME");
        drop(rank0.join().unwrap());
    }
}
