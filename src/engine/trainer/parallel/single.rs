//! One process: the step's loss and gradients are the job's.

use super::{DataParallel, Local, Parts, Penalty, Reduced};
use crate::distributed::Collective;
use crate::engine::EngineError;

pub(super) struct Single;

impl DataParallel for Single {
    fn group(&mut self) -> Option<&mut dyn Collective> {
        None
    }

    fn backend(&self) -> Option<&'static str> {
        None
    }

    fn reduce(
        &mut self,
        _parts: Parts<'_>,
        local: Local,
        _penalty: Penalty<'_>,
    ) -> Result<Reduced, EngineError> {
        Ok(Reduced::local(local))
    }
}
