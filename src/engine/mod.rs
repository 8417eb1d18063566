//! The training engine: model, data, optimiser, precision, SCU and checkpoints, on its own
//! thread. It takes [`Command`]s only at optimizer-step boundaries, emits [`Event`]s and never
//! blocks on a consumer. Nothing here imports a front end.

pub mod base;
pub mod checkpoint;
pub mod data;
pub mod device;
pub mod dropout;
pub mod events;
pub mod export;
pub mod export_gguf;
pub mod faults;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod kernels;
pub mod locate;
pub mod lora;
pub mod model;
pub mod optim;
pub mod precision;
pub mod records;
pub mod scu;
pub mod source;
pub mod spec;
pub mod trainer;
pub mod zero;

pub use events::{Command, Event, EventRx, EventTx};
pub use trainer::{Engine, EngineOptions, EngineThread, RunSummary};

/// Why the engine could not start or continue.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A configuration problem found at setup (exit code 2).
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Device(#[from] device::DeviceError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("step {step}: {count} non-finite steps in a row; lower optim.lr or check the data")]
    NonFinite { step: u64, count: u32 },
    #[error("step {step}: training diverged: {message}")]
    Diverged { step: u64, message: String },
    #[error("the engine thread panicked")]
    Panicked,
    #[error(transparent)]
    Distributed(#[from] crate::distributed::CommError),
}

impl EngineError {
    /// Data parallelism: this rank stopped because another rank failed (which named itself).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            EngineError::Distributed(crate::distributed::CommError::Peer { .. })
        )
    }

    /// Usage/config errors exit with 2, everything else with 1.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            EngineError::Config(_)
                | EngineError::Device(_)
                | EngineError::Distributed(crate::distributed::CommError::Setup(_))
                | EngineError::Data(
                    data::DataError::NoFiles(_)
                        | data::DataError::Tokenizer { .. }
                        | data::DataError::Input { .. }
                        | data::DataError::Template(_)
                        | data::DataError::TooSmall(_)
                        | data::DataError::Cache { .. }
                )
        ) || matches!(
            self,
            EngineError::Checkpoint(
                checkpoint::CheckpointError::Mismatch { .. }
                    | checkpoint::CheckpointError::Corrupt { .. }
            )
        )
    }
}
