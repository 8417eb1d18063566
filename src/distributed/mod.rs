//! Multi-process data parallelism: who this process is (rank, world, local rank — from
//! torchrun-style environment variables), and the TCP rendezvous that hands rank 0's NCCL
//! unique id to every rank at `MASTER_ADDR:MASTER_PORT`. The connections stay open as a
//! control plane: a rank that vanishes without saying goodbye is noticed by its peers.

mod collective;
pub mod launcher;
pub mod nodelist;
mod rendezvous;
pub mod store;
mod via_store;

#[cfg(feature = "cuda")]
pub use collective::GradSum;
pub use collective::{join, Backend, Collective, CommError, Handshake, Joined, Meet};
pub use rendezvous::{rendezvous, Peers, RendezvousError};
pub use via_store::{address_key, rendezvous_via_store};

use std::time::Duration;

/// This process's place in a data-parallel job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub rank: usize,
    pub world: usize,
    /// GPU index on this node.
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl Topology {
    /// A single process.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }

    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }

    /// From RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (as set by torchrun, the
    /// `--gpus N` launcher, or a Slurm/mpirun wrapper). None when WORLD_SIZE is unset.
    /// `defaults` fills MASTER_ADDR/PORT when the environment lacks them.
    pub fn from_env(
        get: impl Fn(&str) -> Option<String>,
        default_addr: &str,
        default_port: u16,
    ) -> Result<Option<Self>, String> {
        let Some(world) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let num = |key: &str, v: &str| -> Result<usize, String> {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{key} = {v:?}: must be a non-negative integer"))
        };
        let world = num("WORLD_SIZE", &world)?;
        if world == 0 {
            return Err("WORLD_SIZE = \"0\": must be at least 1".into());
        }
        let rank = match get("RANK") {
            Some(r) => num("RANK", &r)?,
            None => return Err("WORLD_SIZE is set but RANK is not".into()),
        };
        if rank >= world {
            return Err(format!("RANK = {rank}: must be below WORLD_SIZE ({world})"));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(r) => num("LOCAL_RANK", &r)?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| default_addr.to_string());
        let master_port = match get("MASTER_PORT") {
            Some(p) => p
                .trim()
                .parse::<u16>()
                .map_err(|_| format!("MASTER_PORT = {p:?}: must be a port number (0-65535)"))?,
            None => default_port,
        };
        Ok(Some(Self {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// The environment a launcher gives the worker of `rank`.
    pub fn worker_env(&self, rank: usize) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// Rows `[rank·micro, (rank+1)·micro)` of a global batch of `world·micro` sequences: every
/// rank reads the same global stream, so shards never overlap, their union is exactly the
/// batch one process with `world·micro` would see, and a checkpoint's cursor means the same
/// thing at any world size.
pub fn shard_rows(rank: usize, micro: usize) -> std::ops::Range<usize> {
    rank * micro..(rank + 1) * micro
}

/// How long a rank waits for its peers at the rendezvous.
pub fn timeout(secs: f64) -> Duration {
    Duration::from_secs_f64(secs.max(0.001))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn topology_from_torchrun_style_env() {
        assert_eq!(Topology::from_env(env(&[]), "127.0.0.1", 29500), Ok(None));
        let t = Topology::from_env(
            env(&[
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "1"),
                ("MASTER_ADDR", "node0"),
                ("MASTER_PORT", "1234"),
            ]),
            "127.0.0.1",
            29500,
        )
        .unwrap()
        .unwrap();
        assert_eq!((t.rank, t.world, t.local_rank), (3, 4, 1));
        assert_eq!((t.master_addr.as_str(), t.master_port), ("node0", 1234));
        let d = Topology::from_env(env(&[("RANK", "1"), ("WORLD_SIZE", "2")]), "h", 7)
            .unwrap()
            .unwrap();
        assert_eq!(
            (d.local_rank, d.master_addr.as_str(), d.master_port),
            (1, "h", 7)
        );
    }

    #[test]
    fn bad_env_is_named() {
        let e = |p: &[(&str, &str)]| Topology::from_env(env(p), "h", 1).unwrap_err();
        assert!(e(&[("WORLD_SIZE", "2")]).contains("RANK"));
        assert!(e(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("RANK = 2"));
        assert!(e(&[("WORLD_SIZE", "x"), ("RANK", "0")]).contains("WORLD_SIZE = \"x\""));
        assert!(
            e(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "99999")])
                .contains("MASTER_PORT")
        );
    }

    #[test]
    fn shards_are_disjoint_and_cover_the_global_batch() {
        let (world, micro) = (4, 3);
        let mut seen: Vec<usize> = (0..world).flat_map(|r| shard_rows(r, micro)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..world * micro).collect::<Vec<_>>());
    }
}
