//! The rendezvous under torchrun: its agent already serves a TCPStore at
//! MASTER_ADDR:MASTER_PORT, so rank 0 cannot listen there. Rank 0 listens on a port the OS
//! chooses instead and publishes that address in the store (under a key of this run and
//! attempt); the workers wait for the key and connect to it. From there it is the plain
//! rendezvous: the hello checks (world, duplicate ranks, versions), rank 0's payload, and
//! the open sockets as the control plane that notices a peer going away.

use super::rendezvous::{join, serve_on, Peers, RendezvousError};
use super::store::Store;
use super::Topology;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

/// What rank 0 publishes: where it listens, and which cockpit it is.
#[derive(serde::Serialize, serde::Deserialize)]
struct Published {
    addr: String,
    version: String,
}

/// The key rank 0 publishes its address under, below `prefix` (the run's and attempt's).
pub fn address_key(prefix: &str) -> String {
    format!("{prefix}/rank0")
}

/// The address rank 0 publishes: the interface this host reaches the store by (the others
/// reach the store's host the same way). Where that is a loopback address but the job spans
/// several hosts (LOCAL_WORLD_SIZE below the world: the store runs on this host, reached by
/// a name that resolves to loopback here), this host's name instead.
fn advertised(store: &Store, world: usize, port: u16) -> String {
    let ip = store
        .local_ip()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let several_hosts = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|local| local < world);
    if ip.is_loopback() && several_hosts {
        if let Some(host) = hostname() {
            return format!("{host}:{port}");
        }
    }
    SocketAddr::new(ip, port).to_string()
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let h = String::from_utf8_lossy(&buf[..end]).into_owned();
    (!h.is_empty()).then_some(h)
}

/// Meet the other ranks through `store`: as [`super::rendezvous`], with rank 0 on a free
/// port it publishes under `prefix`.
pub fn rendezvous_via_store(
    t: &Topology,
    store: &mut Store,
    prefix: &str,
    payload: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(Vec<u8>, Peers), RendezvousError> {
    let deadline = Instant::now() + timeout;
    let store_err = |source| RendezvousError::Store {
        rank: t.rank,
        source,
    };
    let key = address_key(prefix);
    if t.rank == 0 {
        let payload = payload.unwrap_or_default();
        let listener = TcpListener::bind(("0.0.0.0", 0)).map_err(|e| RendezvousError::Bind {
            addr: "0.0.0.0:0".into(),
            cause: e.to_string(),
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| RendezvousError::Bind {
                addr: "0.0.0.0:0".into(),
                cause: e.to_string(),
            })?
            .port();
        let addr = advertised(store, t.world, port);
        let published = serde_json::to_vec(&Published {
            addr: addr.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
        })
        .map_err(|e| RendezvousError::Refused(e.to_string()))?;
        store.set(&key, &published).map_err(store_err)?;
        let conns = serve_on(t, listener, &addr, &payload, deadline, timeout)?;
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
        let bytes = store.wait_get(&key, timeout).map_err(store_err)?;
        let p: Published = serde_json::from_slice(&bytes).map_err(|e| {
            RendezvousError::Refused(format!(
                "rank {}: {key} in torchrun's store is not rank 0's address ({e})",
                t.rank
            ))
        })?;
        if p.version != env!("CARGO_PKG_VERSION") {
            return Err(RendezvousError::Refused(format!(
                "rank {} runs cockpit {}, rank 0 runs {}",
                t.rank,
                env!("CARGO_PKG_VERSION"),
                p.version
            )));
        }
        let (host, port) = p
            .addr
            .rsplit_once(':')
            .and_then(|(h, port)| Some((h, port.parse::<u16>().ok()?)))
            .ok_or_else(|| {
                RendezvousError::Refused(format!(
                    "rank {}: rank 0 published {:?}, not HOST:PORT",
                    t.rank, p.addr
                ))
            })?;
        let at = Topology {
            master_addr: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            master_port: port,
            ..t.clone()
        };
        join(&at, &p.addr, deadline, timeout)
    }
}
