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
        // The interface this host reaches the store by is the one the others reach it by.
        let ip = store
            .local_ip()
            .filter(|ip| !ip.is_unspecified())
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let addr = SocketAddr::new(ip, port).to_string();
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
        let sa: SocketAddr = p.addr.parse().map_err(|_| {
            RendezvousError::Refused(format!(
                "rank {}: rank 0 published {:?}, not an address",
                t.rank, p.addr
            ))
        })?;
        let at = Topology {
            master_addr: sa.ip().to_string(),
            master_port: sa.port(),
            ..t.clone()
        };
        join(&at, &p.addr, deadline, timeout)
    }
}
