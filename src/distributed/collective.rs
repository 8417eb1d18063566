//! The collectives data-parallel training needs: a sum all-reduce of the flattened
//! gradients, broadcasts from rank 0 (weights at start, the step's commands) and small
//! host-side reductions (loss, per-rank timings). Two backends:
//!
//! - **NCCL** (`--features nccl`, CUDA devices): cudarc's communicator on candle's own
//!   stream, so a collective is ordered with the kernels around it. Rank 0's unique id
//!   travels in the TCP rendezvous.
//! - **TCP** (CPU processes): a star through rank 0 over the rendezvous sockets, summed in
//!   rank order so every rank gets bit-identical results. It exists so the whole multi-process
//!   path (launcher, sharding, rank-0 writes, failures, resume at another world size) runs on
//!   machines without GPUs, e.g. in CI; it is not meant to be fast.

use super::{Peers, RendezvousError, Topology};
use candle_core::{Device, Tensor};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error("rank {rank}: {op}: {cause}")]
    Op {
        rank: usize,
        op: &'static str,
        cause: String,
    },
    /// Another rank failed and said why.
    #[error("rank {rank} failed: {cause}")]
    Peer { rank: usize, cause: String },
    #[error("{0}")]
    Setup(String),
}

/// What the trainer needs from a process group.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// "nccl" or "tcp".
    fn backend(&self) -> &'static str;
    /// Element-wise sum over the ranks of an f32 tensor. May reduce in place: pass a tensor
    /// no one else reads (e.g. a fresh concatenation).
    fn all_reduce_sum(&mut self, t: Tensor) -> Result<Tensor, CommError>;
    /// Element-wise sum over the ranks into `t` itself (contiguous). The default sums into a
    /// new tensor and copies it back; NCCL reduces in place.
    fn all_reduce_sum_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
        let rank = self.rank();
        let sum = self.all_reduce_sum(t.clone())?;
        t.slice_set(&sum, 0, 0)
            .map_err(tensor_err(rank, "all-reduce"))
    }
    /// Reduce-scatter: `t` (1-D, contiguous, `world · s` elements) is summed over the ranks,
    /// and this rank's part `[rank·s, (rank+1)·s)` of the sum is left in place; the rest of
    /// `t` is undefined afterwards. The default sums the whole tensor (correct, twice the
    /// traffic); NCCL sends each rank only its part.
    fn reduce_scatter_sum_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
        shard_len(t, self.world(), self.rank(), "reduce-scatter")?;
        self.all_reduce_sum_in_place(t)
    }
    /// All-gather: every rank's part `[r·s, (r+1)·s)` of `t` (1-D, contiguous, `world · s`
    /// elements) from rank r, on every rank. The default zeroes the other parts and sums
    /// (exact: x + 0 = x); NCCL gathers in place.
    fn all_gather_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
        let rank = self.rank();
        let s = shard_len(t, self.world(), rank, "all-gather")?;
        let err = tensor_err(rank, "all-gather");
        let own = t
            .narrow(0, rank * s, s)
            .and_then(|p| p.copy())
            .map_err(&err)?;
        let zeros = t.zeros_like().map_err(&err)?;
        t.slice_set(&zeros, 0, 0).map_err(&err)?;
        t.slice_set(&own, 0, rank * s).map_err(&err)?;
        self.all_reduce_sum_in_place(t)
    }
    /// Rank 0's value of `t`, on every rank.
    fn broadcast(&mut self, t: &Tensor) -> Result<Tensor, CommError>;
    /// Element-wise sum over the ranks of a few host values.
    fn all_reduce_host(&mut self, v: &mut [f64]) -> Result<(), CommError>;
    /// Rank 0's bytes, on every rank (what the others pass is ignored).
    fn broadcast_bytes(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, CommError>;
    /// Tell the other ranks this one is failing, and why (best effort).
    fn abort(&mut self, cause: &str);
    /// Orderly end: the peers will not take this rank's closing connection for a crash.
    fn finish(&mut self);
    /// A second communicator on a stream of its own, for summing gradient buckets while the
    /// backward still runs (the whole-model step's overlap); None where the backend has none
    /// (TCP). Every rank must call it at the same point (it is a collective).
    #[cfg(feature = "cuda")]
    fn grad_sum(&mut self) -> Result<Option<Box<dyn GradSum>>, CommError> {
        Ok(None)
    }
}

/// Sums of f32 gradient ranges across the ranks on a communication stream of their own.
#[cfg(feature = "cuda")]
pub trait GradSum: Send {
    /// The stream the sums are enqueued on (the caller orders it after the work that writes
    /// the gradients, and the optimizer after it).
    fn stream(&self) -> &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>;
    /// Sum `len` f32 at device address `ptr` over the ranks, in place, on [`Self::stream`].
    fn sum_f32(&self, ptr: u64, len: usize) -> Result<(), CommError>;
    /// [`Self::sum_f32`] for `len` bf16 values.
    fn sum_bf16(&self, ptr: u64, len: usize) -> Result<(), CommError>;
}

/// What rank 0 hands every rank at the rendezvous.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct Handshake {
    /// The run directory every rank agrees on (rank 0's).
    pub run_dir: String,
    /// NCCL's unique id, when the backend is NCCL.
    pub nccl_id: Option<Vec<u8>>,
    /// The checkpoint every rank resumes from when rank 0 chose one (a launcher's restart).
    #[serde(default)]
    pub resume: Option<String>,
}

/// Where the ranks meet.
pub enum Meet {
    /// Rank 0 listens at MASTER_ADDR:MASTER_PORT.
    Listen,
    /// Through torchrun's store (at MASTER_ADDR:MASTER_PORT): rank 0 publishes a port of its
    /// own under `prefix`.
    Store {
        store: super::store::Store,
        prefix: String,
    },
}

/// A rank after the rendezvous, before its communicator exists (that needs the device).
pub struct Joined {
    pub topology: Topology,
    pub backend: Backend,
    pub handshake: Handshake,
    pub peers: Peers,
    pub timeout: Duration,
    /// Which launcher started the job and what was taken from it, for the run header.
    pub launcher: Option<String>,
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joined")
            .field("topology", &self.topology)
            .field("backend", &self.backend)
            .field("handshake", &self.handshake)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Nccl,
    Tcp,
}

impl Backend {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "nccl" => Some(Backend::Nccl),
            "tcp" => Some(Backend::Tcp),
            _ => None,
        }
    }
}

/// Meet the other ranks: rank 0 makes the NCCL id (for NCCL) and hands it out with its run
/// dir (and the checkpoint to resume from, if it chose one). Blocks until all ranks joined
/// or `timeout` passed.
pub fn join(
    topology: Topology,
    backend: Backend,
    run_dir: &str,
    resume: Option<String>,
    meet: Meet,
    timeout: Duration,
) -> Result<Joined, CommError> {
    let payload = if topology.rank == 0 {
        let nccl_id = match backend {
            Backend::Nccl => Some(new_nccl_id()?),
            Backend::Tcp => None,
        };
        let h = Handshake {
            run_dir: run_dir.to_string(),
            nccl_id,
            resume,
        };
        Some(serde_json::to_vec(&h).map_err(|e| CommError::Setup(e.to_string()))?)
    } else {
        None
    };
    let (bytes, peers) = match meet {
        Meet::Listen => super::rendezvous(&topology, payload, timeout)?,
        Meet::Store { mut store, prefix } => super::via_store::rendezvous_via_store(
            &topology, &mut store, &prefix, payload, timeout,
        )?,
    };
    let handshake: Handshake = serde_json::from_slice(&bytes)
        .map_err(|e| CommError::Setup(format!("rendezvous: rank 0 sent a bad handshake: {e}")))?;
    Ok(Joined {
        topology,
        backend,
        handshake,
        peers,
        timeout,
        launcher: None,
    })
}

#[cfg(feature = "nccl")]
fn new_nccl_id() -> Result<Vec<u8>, CommError> {
    let id = candle_core::cuda_backend::cudarc::nccl::safe::Id::new()
        .map_err(|e| CommError::Setup(format!("NCCL: could not make a unique id: {e:?}")))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

#[cfg(not(feature = "nccl"))]
fn new_nccl_id() -> Result<Vec<u8>, CommError> {
    Err(no_nccl())
}

#[cfg(not(feature = "nccl"))]
fn no_nccl() -> CommError {
    CommError::Setup(
        "distributed.backend = \"nccl\": this build has no NCCL (build with --features nccl); \
         \"tcp\" runs CPU processes"
            .into(),
    )
}

impl Joined {
    /// The communicator for `device` (NCCL needs this rank's CUDA device).
    pub fn connect(self, device: &Device) -> Result<Box<dyn Collective>, CommError> {
        match self.backend {
            Backend::Tcp => Ok(Box::new(TcpCollective::new(
                self.topology.rank,
                self.topology.world,
                self.peers,
                self.timeout,
            ))),
            Backend::Nccl => nccl_connect(self, device),
        }
    }
}

#[cfg(feature = "nccl")]
fn nccl_connect(j: Joined, device: &Device) -> Result<Box<dyn Collective>, CommError> {
    Ok(Box::new(nccl::NcclCollective::new(j, device)?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_connect(_: Joined, _: &Device) -> Result<Box<dyn Collective>, CommError> {
    Err(no_nccl())
}

// ---------------------------------------------------------------------------------------
// TCP: frames of [kind u8][len u64 LE][bytes]; kind 0 = data, 1 = "I am failing: <cause>".

const DATA: u8 = 0;
const FAILED: u8 = 1;

struct TcpCollective {
    rank: usize,
    world: usize,
    /// Rank 0: one per worker, by rank; a worker: rank 0's.
    streams: Vec<(usize, TcpStream)>,
    timeout: Duration,
}

impl TcpCollective {
    fn new(rank: usize, world: usize, peers: Peers, timeout: Duration) -> Self {
        let streams = peers.into_streams();
        for (_, s) in &streams {
            let _ = s.set_read_timeout(Some(timeout));
            let _ = s.set_nodelay(true);
        }
        Self {
            rank,
            world,
            streams,
            timeout,
        }
    }

    fn io(&self, op: &'static str, peer: usize, e: std::io::Error) -> CommError {
        let me = self.rank;
        match e.kind() {
            // The peer's doing, not this rank's: it is stuck or gone.
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Peer {
                rank: peer,
                cause: format!(
                    "rank {me} heard nothing from it within {:.0} s (distributed.timeout_secs) during {op}: it is stuck",
                    self.timeout.as_secs_f64()
                ),
            },
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => CommError::Peer {
                rank: peer,
                cause: format!("it went away during {op} (it exited or crashed)"),
            },
            _ => CommError::Op {
                rank: me,
                op,
                cause: format!("with rank {peer}: {e}"),
            },
        }
    }

    fn send(
        &mut self,
        i: usize,
        kind: u8,
        bytes: &[u8],
        op: &'static str,
    ) -> Result<(), CommError> {
        let (peer, s) = &mut self.streams[i];
        let peer = *peer;
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        let r = s.write_all(&head).and_then(|_| s.write_all(bytes));
        match r {
            Ok(()) => Ok(()),
            // The peer is gone; it may have said why before it went.
            Err(e) => Err(self.last_words(i).unwrap_or_else(|| self.io(op, peer, e))),
        }
    }

    /// A failure notice the peer of stream `i` left before closing, if any.
    fn last_words(&mut self, i: usize) -> Option<CommError> {
        let (peer, s) = &mut self.streams[i];
        let peer = *peer;
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut head = [0u8; 9];
        let got = s.read_exact(&mut head).ok().and_then(|_| {
            let mut len = [0u8; 8];
            len.copy_from_slice(&head[1..]);
            let n = u64::from_le_bytes(len) as usize;
            // A failure notice is short; anything else is not one.
            if head[0] != FAILED || n > 1 << 16 {
                return None;
            }
            let mut buf = vec![0u8; n];
            s.read_exact(&mut buf).ok().map(|_| buf)
        });
        let _ = s.set_read_timeout(Some(self.timeout));
        got.map(|b| parse_failure(&String::from_utf8_lossy(&b), peer))
    }

    fn recv(&mut self, i: usize, op: &'static str) -> Result<Vec<u8>, CommError> {
        let (peer, s) = &mut self.streams[i];
        let peer = *peer;
        let mut head = [0u8; 9];
        let r = s.read_exact(&mut head).and_then(|_| {
            let mut len = [0u8; 8];
            len.copy_from_slice(&head[1..]);
            // A length no allocation can hold is a stream out of step, not a reason to abort.
            let n = u64::from_le_bytes(len) as usize;
            let mut buf = Vec::new();
            buf.try_reserve_exact(n).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a frame of {n} bytes: the stream is out of step"),
                )
            })?;
            buf.resize(n, 0);
            s.read_exact(&mut buf).map(|_| buf)
        });
        let buf = r.map_err(|e| self.io(op, peer, e))?;
        if head[0] == FAILED {
            // Rank 0 passes a worker's failure on, so every rank can name it.
            if self.rank == 0 {
                self.relay_failure(peer, &buf);
            }
            return Err(parse_failure(&String::from_utf8_lossy(&buf), peer));
        }
        Ok(buf)
    }

    /// `msg` as received: "RANK\u{1f}CAUSE".
    fn relay_failure(&mut self, from: usize, msg: &[u8]) {
        for i in 0..self.streams.len() {
            if self.streams[i].0 != from {
                let _ = self.send(i, FAILED, msg, "relay");
            }
        }
    }

    /// Sum-combine `mine` with every rank's bytes (rank 0 adds in rank order, then sends
    /// the result back), so the result is bit-identical everywhere.
    fn reduce(
        &mut self,
        mine: Vec<u8>,
        op: &'static str,
        add: fn(&mut [u8], &[u8]),
    ) -> Result<Vec<u8>, CommError> {
        if self.rank == 0 {
            let mut acc = mine;
            for i in 0..self.streams.len() {
                let other = self.recv(i, op)?;
                if other.len() != acc.len() {
                    let peer = self.streams[i].0;
                    return Err(CommError::Op {
                        rank: 0,
                        op,
                        cause: format!(
                            "rank {peer} sent {} bytes, expected {} (ranks disagree on the model?)",
                            other.len(),
                            acc.len()
                        ),
                    });
                }
                add(&mut acc, &other);
            }
            for i in 0..self.streams.len() {
                self.send(i, DATA, &acc, op)?;
            }
            Ok(acc)
        } else {
            self.send(0, DATA, &mine, op)?;
            self.recv(0, op)
        }
    }
}

fn parse_failure(msg: &str, from: usize) -> CommError {
    match msg.split_once('\u{1f}') {
        Some((r, cause)) => CommError::Peer {
            rank: r.parse().unwrap_or(from),
            cause: cause.to_string(),
        },
        None => CommError::Peer {
            rank: from,
            cause: msg.to_string(),
        },
    }
}

fn add_f32(acc: &mut [u8], other: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(4).zip(other.chunks_exact(4)) {
        let x = f32::from_le_bytes([a[0], a[1], a[2], a[3]])
            + f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        a.copy_from_slice(&x.to_le_bytes());
    }
}

fn add_bf16(acc: &mut [u8], other: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(2).zip(other.chunks_exact(2)) {
        let x = half::bf16::from_le_bytes([a[0], a[1]]).to_f32()
            + half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
        a.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
}

fn add_f64(acc: &mut [u8], other: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(8).zip(other.chunks_exact(8)) {
        let mut x = [0u8; 8];
        let mut y = [0u8; 8];
        x.copy_from_slice(a);
        y.copy_from_slice(b);
        a.copy_from_slice(&(f64::from_le_bytes(x) + f64::from_le_bytes(y)).to_le_bytes());
    }
}

/// The part of a reduce-scatter / all-gather buffer each rank owns.
fn shard_len(t: &Tensor, world: usize, rank: usize, op: &'static str) -> Result<usize, CommError> {
    let n = t.elem_count();
    if t.rank() != 1 || !t.is_contiguous() || world == 0 || !n.is_multiple_of(world) {
        return Err(CommError::Op {
            rank,
            op,
            cause: format!(
                "needs a contiguous 1-D buffer whose length is a multiple of the world ({n} elements, {world} ranks)"
            ),
        });
    }
    Ok(n / world)
}

fn tensor_err(rank: usize, op: &'static str) -> impl Fn(candle_core::Error) -> CommError {
    move |e| CommError::Op {
        rank,
        op,
        cause: e.to_string(),
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn all_reduce_sum(&mut self, t: Tensor) -> Result<Tensor, CommError> {
        let err = tensor_err(self.rank, "all-reduce");
        if t.dtype() == candle_core::DType::BF16 {
            // bf16 on the wire, each partial sum rounded to bf16 (as NCCL sums bf16).
            let v = t
                .flatten_all()
                .and_then(|f| f.to_vec1::<half::bf16>())
                .map_err(&err)?;
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let out = self.reduce(bytes, "all-reduce", add_bf16)?;
            let v: Vec<half::bf16> = out
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect();
            return Tensor::from_vec(v, t.shape(), t.device()).map_err(&err);
        }
        let v = t
            .flatten_all()
            .and_then(|f| f.to_dtype(candle_core::DType::F32))
            .and_then(|f| f.to_vec1::<f32>())
            .map_err(&err)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let out = self.reduce(bytes, "all-reduce", add_f32)?;
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Tensor::from_vec(v, t.shape(), t.device()).map_err(&err)
    }

    fn broadcast(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let err = tensor_err(self.rank, "broadcast");
        let v = t
            .flatten_all()
            .and_then(|f| f.to_dtype(candle_core::DType::F32))
            .and_then(|f| f.to_vec1::<f32>())
            .map_err(&err)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let out = self.broadcast_bytes(bytes)?;
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Tensor::from_vec(v, t.shape(), t.device())
            .and_then(|x| x.to_dtype(t.dtype()))
            .map_err(&err)
    }

    fn all_reduce_host(&mut self, v: &mut [f64]) -> Result<(), CommError> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let out = self.reduce(bytes, "all-reduce", add_f64)?;
        for (x, c) in v.iter_mut().zip(out.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            *x = f64::from_le_bytes(b);
        }
        Ok(())
    }

    fn broadcast_bytes(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, CommError> {
        if self.rank == 0 {
            for i in 0..self.streams.len() {
                self.send(i, DATA, &bytes, "broadcast")?;
            }
            Ok(bytes)
        } else {
            self.recv(0, "broadcast")
        }
    }

    fn abort(&mut self, cause: &str) {
        let msg = format!("{}\u{1f}{cause}", self.rank);
        for i in 0..self.streams.len() {
            let _ = self.send(i, FAILED, msg.as_bytes(), "abort");
        }
    }

    fn finish(&mut self) {
        for (_, s) in &mut self.streams {
            let _ = s.flush();
        }
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::{Collective, CommError, GradSum, Joined};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::CudaStream;
    use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{DType, Device, InplaceOp1, Layout, Tensor};
    use std::rc::Rc;
    use std::sync::Arc;

    /// The communicator is used from the engine thread only (it is created before the
    /// thread starts and moved into it once).
    struct SendComm(Rc<Comm>);
    // SAFETY: an NCCL communicator may be used from any one thread at a time; the trainer
    // owns it and never shares it between threads.
    unsafe impl Send for SendComm {}
    unsafe impl Sync for SendComm {}

    pub struct NcclCollective {
        comm: SendComm,
        device: Device,
        rank: usize,
        world: usize,
        peers: super::Peers,
    }

    impl NcclCollective {
        pub fn new(j: Joined, device: &Device) -> Result<Self, CommError> {
            let Device::Cuda(cuda) = device else {
                return Err(CommError::Setup(
                    "distributed.backend = \"nccl\" needs CUDA devices; this rank runs on the CPU \
                     (use \"tcp\" for CPU processes)"
                        .into(),
                ));
            };
            let raw = j.handshake.nccl_id.clone().ok_or_else(|| {
                CommError::Setup("rendezvous: rank 0 sent no NCCL id (backends differ?)".into())
            })?;
            if raw.len() != 128 {
                return Err(CommError::Setup(format!(
                    "rendezvous: the NCCL id has {} bytes, expected 128",
                    raw.len()
                )));
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, s) in internal.iter_mut().zip(&raw) {
                *d = *s as std::ffi::c_char;
            }
            let (rank, world) = (j.topology.rank, j.topology.world);
            let comm = Comm::from_rank(cuda.cuda_stream(), rank, world, Id::uninit(internal))
                .map_err(|e| CommError::Op {
                    rank,
                    op: "NCCL init",
                    cause: format!("{e:?}"),
                })?;
            Ok(Self {
                comm: SendComm(Rc::new(comm)),
                device: device.clone(),
                rank,
                world,
                peers: j.peers,
            })
        }

        fn err(&self, op: &'static str) -> impl Fn(candle_core::Error) -> CommError {
            super::tensor_err(self.rank, op)
        }
    }

    enum Op {
        Sum,
        Broadcast,
        /// This rank's part of the sum, in place (`ncclReduceScatter` with the receive
        /// buffer inside the send buffer at rank · count).
        ReduceScatter {
            rank: usize,
            world: usize,
        },
        /// Every rank's part, in place (`ncclAllGather` with the send buffer inside the
        /// receive buffer at rank · count).
        AllGather {
            rank: usize,
            world: usize,
        },
    }

    struct InPlace {
        comm: Rc<Comm>,
        op: Op,
    }
    // SAFETY: see SendComm; the op lives only for one call on the engine thread.
    unsafe impl Send for InPlace {}
    unsafe impl Sync for InPlace {}

    fn nccl_err(
        e: candle_core::cuda_backend::cudarc::nccl::result::NcclError,
    ) -> candle_core::Error {
        candle_core::Error::Msg(format!("NCCL: {e:?}"))
    }

    impl InplaceOp1 for InPlace {
        fn name(&self) -> &'static str {
            "nccl-collective"
        }
        fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("NCCL collectives need CUDA tensors")
        }
        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("NCCL collectives need contiguous tensors")
            };
            macro_rules! run {
                ($t:ty) => {{
                    let stream = s.device().cuda_stream();
                    let slice = s.as_cuda_slice_mut::<$t>()?;
                    let mut view = slice.slice_mut(a..b);
                    match self.op {
                        Op::Sum => self
                            .comm
                            .all_reduce_in_place(&mut view, &ReduceOp::Sum)
                            .map(|_| ())
                            .map_err(nccl_err),
                        Op::Broadcast => self
                            .comm
                            .broadcast_in_place(&mut view, 0)
                            .map(|_| ())
                            .map_err(nccl_err),
                        Op::ReduceScatter { rank, world } | Op::AllGather { rank, world } => {
                            let n = view.len() / world;
                            let (p, _sync) =
                                candle_core::cuda_backend::cudarc::driver::DevicePtrMut::device_ptr_mut(
                                    &mut view, &stream,
                                );
                            let part = p + (rank * n * std::mem::size_of::<$t>()) as u64;
                            // SAFETY: both views lie inside the live, contiguous `view`
                            // (world · n elements, part at rank · n); NCCL allows these
                            // in-place layouts; both are leaked (not freed) after the call.
                            let (mut whole, mut mine) = unsafe {
                                (
                                    stream.upgrade_device_ptr::<$t>(p, world * n),
                                    stream.upgrade_device_ptr::<$t>(part, n),
                                )
                            };
                            let r = if matches!(self.op, Op::AllGather { .. }) {
                                self.comm.all_gather(&mine, &mut whole)
                            } else {
                                self.comm.reduce_scatter(&whole, &mut mine, &ReduceOp::Sum)
                            };
                            whole.leak();
                            mine.leak();
                            r.map(|_| ()).map_err(nccl_err)
                        }
                    }
                }};
            }
            match s.dtype() {
                DType::F32 => run!(f32),
                DType::BF16 => run!(half::bf16),
                DType::F64 => run!(f64),
                DType::U8 => run!(u8),
                DType::U32 => run!(u32),
                d => candle_core::bail!("NCCL collective: unsupported dtype {d:?}"),
            }
        }
    }

    impl NcclCollective {
        fn in_place(&self, t: &Tensor, op: Op, name: &'static str) -> Result<(), CommError> {
            t.inplace_op1(&InPlace {
                comm: self.comm.0.clone(),
                op,
            })
            .map_err(self.err(name))
        }
    }

    impl Collective for NcclCollective {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            self.world
        }
        fn backend(&self) -> &'static str {
            "nccl"
        }

        fn all_reduce_sum(&mut self, t: Tensor) -> Result<Tensor, CommError> {
            let t = if t.is_contiguous() {
                t
            } else {
                t.contiguous().map_err(self.err("all-reduce"))?
            };
            self.in_place(&t, Op::Sum, "all-reduce")?;
            Ok(t)
        }

        fn all_reduce_sum_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
            if !t.is_contiguous() {
                return Err(self.err("all-reduce")(candle_core::Error::Msg(
                    "in-place all-reduce of a non-contiguous tensor".into(),
                )));
            }
            self.in_place(t, Op::Sum, "all-reduce")
        }

        fn reduce_scatter_sum_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
            let (rank, world) = (self.rank, self.world);
            super::shard_len(t, world, rank, "reduce-scatter")?;
            self.in_place(t, Op::ReduceScatter { rank, world }, "reduce-scatter")
        }

        fn all_gather_in_place(&mut self, t: &Tensor) -> Result<(), CommError> {
            let (rank, world) = (self.rank, self.world);
            super::shard_len(t, world, rank, "all-gather")?;
            self.in_place(t, Op::AllGather { rank, world }, "all-gather")
        }

        fn broadcast(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
            // A private copy: the caller's tensor may be shared (a Var's storage).
            let out = t.copy().map_err(self.err("broadcast"))?;
            self.in_place(&out, Op::Broadcast, "broadcast")?;
            Ok(out)
        }

        fn all_reduce_host(&mut self, v: &mut [f64]) -> Result<(), CommError> {
            let err = self.err("all-reduce");
            let t = Tensor::from_slice(v, v.len(), &self.device).map_err(&err)?;
            self.in_place(&t, Op::Sum, "all-reduce")?;
            let out = t.to_vec1::<f64>().map_err(&err)?;
            v.copy_from_slice(&out);
            Ok(())
        }

        fn broadcast_bytes(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, CommError> {
            let err = self.err("broadcast");
            let len = Tensor::from_slice(&[bytes.len() as u32], 1, &self.device).map_err(&err)?;
            self.in_place(&len, Op::Broadcast, "broadcast")?;
            let n = len.to_vec1::<u32>().map_err(&err)?[0] as usize;
            if n == 0 {
                return Ok(Vec::new());
            }
            let mut buf = bytes;
            buf.resize(n, 0);
            let t = Tensor::from_vec(buf, n, &self.device).map_err(&err)?;
            self.in_place(&t, Op::Broadcast, "broadcast")?;
            t.to_vec1::<u8>().map_err(&err)
        }

        fn abort(&mut self, cause: &str) {
            self.peers.fail(self.rank, cause);
        }

        fn finish(&mut self) {
            let _ = self.device.synchronize();
            self.peers.goodbye();
        }

        fn grad_sum(&mut self) -> Result<Option<Box<dyn GradSum>>, CommError> {
            let Device::Cuda(cuda) = self.device.clone() else {
                return Ok(None);
            };
            // Rank 0's new unique id reaches every rank over the first communicator.
            let id = if self.rank == 0 {
                super::new_nccl_id()?
            } else {
                Vec::new()
            };
            let raw = self.broadcast_bytes(id)?;
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, s) in internal.iter_mut().zip(&raw) {
                *d = *s as std::ffi::c_char;
            }
            let setup = |cause: String| CommError::Op {
                rank: self.rank,
                op: "NCCL gradient communicator",
                cause,
            };
            let stream = priority_stream(&cuda).map_err(|e| setup(format!("{e:?}")))?;
            let comm = Comm::from_rank(stream.clone(), self.rank, self.world, Id::uninit(internal))
                .map_err(|e| setup(format!("{e:?}")))?;
            Ok(Some(Box::new(NcclGradSum {
                comm,
                stream,
                rank: self.rank,
            })))
        }
    }

    /// A non-blocking stream of the device's highest priority: the sums' kernels take SMs as
    /// the backward's blocks free them instead of queueing behind them. It lives as long as
    /// the process (one per run).
    fn priority_stream(
        cuda: &candle_core::CudaDevice,
    ) -> Result<Arc<CudaStream>, candle_core::cuda_backend::cudarc::driver::DriverError> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let ctx = cuda.cuda_stream().context().clone();
        ctx.bind_to_thread()?;
        let (mut least, mut greatest) = (0, 0);
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: plain driver calls on the bound context, with valid out-pointers.
        unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest).result()?;
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            sys::cuStreamCreateWithPriority(&mut raw, flags, greatest).result()?;
            Ok(ctx.wrap_borrowed_stream(raw))
        }
    }

    /// [`GradSum`] over NCCL: a communicator of its own on its own stream.
    struct NcclGradSum {
        comm: Comm,
        stream: Arc<CudaStream>,
        rank: usize,
    }
    // SAFETY: as SendComm: used from the engine thread only, one call at a time.
    unsafe impl Send for NcclGradSum {}

    impl GradSum for NcclGradSum {
        fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        fn sum_f32(&self, ptr: u64, len: usize) -> Result<(), CommError> {
            self.sum::<f32>(ptr, len)
        }

        fn sum_bf16(&self, ptr: u64, len: usize) -> Result<(), CommError> {
            self.sum::<half::bf16>(ptr, len)
        }
    }

    impl NcclGradSum {
        fn sum<T: candle_core::cuda_backend::cudarc::nccl::safe::NcclType>(
            &self,
            ptr: u64,
            len: usize,
        ) -> Result<(), CommError> {
            // SAFETY: the caller passes a range of a live gradient buffer of element type T;
            // the view is leaked again (not freed) once the sum is enqueued.
            let mut view = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) };
            let r = self.comm.all_reduce_in_place(&mut view, &ReduceOp::Sum);
            view.leak();
            r.map(|_| ()).map_err(|e| CommError::Op {
                rank: self.rank,
                op: "all-reduce (gradient bucket)",
                cause: format!("{e:?}"),
            })
        }
    }
}
