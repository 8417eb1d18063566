//! AdamW with decoupled weight decay over per-parameter groups, global-norm clipping, and the
//! learning-rate schedules.

use crate::config::{ScheduleConfig, ScheduleKind};
use crate::engine::kernels;
use candle_core::{DType, Result, Tensor, Var};

/// One optimised parameter and its moments.
pub struct Slot {
    pub name: String,
    pub var: Var,
    pub m: Tensor,
    pub v: Tensor,
    pub decay: bool,
}

/// AdamW (Loshchilov & Hutter): `w ← w − lr·(m̂/(√v̂+ε) + wd·w)`, wd only on `decay` slots.
pub struct AdamW {
    pub slots: Vec<Slot>,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimizer steps taken (for bias correction).
    pub t: u64,
    /// Use the fused in-place CUDA kernel where every slot is an fp32 CUDA tensor (config
    /// `kernels.adamw`); the plain composition otherwise and always on the CPU.
    pub fused: bool,
}

impl AdamW {
    pub fn new(
        params: Vec<(String, Var, bool)>,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> Result<Self> {
        let slots = params
            .into_iter()
            .map(|(name, var, decay)| {
                // Separate buffers: the fused update writes m and v in place.
                Ok(Slot {
                    name,
                    m: var.as_tensor().zeros_like()?,
                    v: var.as_tensor().zeros_like()?,
                    var,
                    decay,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            slots,
            beta1,
            beta2,
            eps,
            weight_decay,
            t: 0,
            fused: true,
        })
    }

    /// Apply one update with gradients aligned to `slots`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.step_scaled(grads, lr, 1.0)
    }

    /// [`AdamW::step`] with every gradient multiplied by `grad_scale` first (global-norm
    /// clipping without a separate pass over the gradients: the fused kernel applies it).
    pub fn step_scaled(&mut self, grads: &[Tensor], lr: f64, grad_scale: f64) -> Result<()> {
        self.step_with_copies(grads, lr, grad_scale, None)
            .map(|_| ())
    }

    /// [`AdamW::step_scaled`] that also writes the updated weights into the bf16 copies of a
    /// whole-model step, where it has one. True when the fused update did so for every weight
    /// the step computes with (the step may then skip its cast); false on the plain path.
    pub fn step_with_copies(
        &mut self,
        grads: &[Tensor],
        lr: f64,
        grad_scale: f64,
        copies: Option<&kernels::ModelStep>,
    ) -> Result<bool> {
        self.t += 1;
        let bc1 = 1.0 - self.beta1.powi(self.t as i32);
        let bc2 = 1.0 - self.beta2.powi(self.t as i32);
        if self.fused && self.fusable(grads) {
            let items: Vec<kernels::AdamItem> = self
                .slots
                .iter()
                .zip(grads)
                .map(|(slot, g)| kernels::AdamItem {
                    w: slot.var.as_tensor(),
                    g,
                    m: &slot.m,
                    v: &slot.v,
                    decay: slot.decay && self.weight_decay > 0.0,
                    copy: copies.and_then(|s| s.weight_copy(&slot.var)),
                })
                .collect();
            let args = kernels::AdamWArgs {
                lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                decay: 1.0 - lr * self.weight_decay,
                bc1,
                bc2,
                grad_scale,
            };
            let copied = items.iter().filter(|it| it.copy.is_some()).count();
            kernels::adamw_multi(&items, &args)?;
            return Ok(copies.is_some_and(|s| copied == s.weight_count()));
        }
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let scaled;
            let g = if grad_scale != 1.0 {
                scaled = (g * grad_scale)?;
                &scaled
            } else {
                g
            };
            let m = ((&slot.m * self.beta1)? + (g * (1.0 - self.beta1))?)?;
            let v = ((&slot.v * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + self.eps)?)?;
            let w = slot.var.as_tensor();
            let w = if slot.decay && self.weight_decay > 0.0 {
                (w * (1.0 - lr * self.weight_decay))?
            } else {
                w.clone()
            };
            slot.var.set(&(w - (update * lr)?)?)?;
            // Detached: a variable's gradient from `backward()` still carries its op graph
            // (candle detaches only the intermediate nodes' gradients), so moments built from
            // it would hold this step's whole forward and backward, and the next step's
            // moments this one's: a chain that grew by every step's activations (issue 26).
            slot.m = m.detach();
            slot.v = v.detach();
        }
        Ok(false)
    }
}

impl AdamW {
    /// Drop every slot's moments (ZeRO-1 keeps them in a [`super::zero::Shard`] instead):
    /// each becomes an empty tensor on its device.
    pub fn release_moments(&mut self) -> Result<()> {
        for s in &mut self.slots {
            let dev = s.var.as_tensor().device().clone();
            s.m = Tensor::zeros(0, DType::F32, &dev)?;
            s.v = Tensor::zeros(0, DType::F32, &dev)?;
        }
        Ok(())
    }

    /// Whether the slots hold their moments (not released to a shard).
    pub fn holds_moments(&self) -> bool {
        self.slots
            .iter()
            .all(|s| s.m.elem_count() == s.var.elem_count())
    }
}

impl AdamW {
    /// What an L2 penalty in the loss does to these slots' weights through Adam, for SCU's
    /// plant model: (Σw², Σ w²/(√v̂+ε)). A penalty gradient k·w moves Σw² by
    /// −2·lr·k·Σ w²/(√v̂+ε) per step (to first order, the momentum's lag aside), so the second
    /// sum over the first is the penalty's authority over ln Σw².
    pub fn penalty_stats(&self, slots: &[usize]) -> Result<(f64, f64)> {
        let bc2 = 1.0 - self.beta2.powi(self.t.max(1) as i32);
        let (mut sumsq, mut weighted) = (0.0, 0.0);
        for &i in slots {
            let Some(s) = self.slots.get(i) else {
                continue;
            };
            let w = s.var.as_tensor().to_dtype(DType::F32)?;
            let v = s.v.to_dtype(DType::F32)?;
            let w2 = w.sqr()?;
            let denom = ((v / bc2)?.sqrt()? + self.eps)?;
            sumsq += w2.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            weighted += (w2 / denom)?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        Ok((sumsq, weighted))
    }
}

impl AdamW {
    /// The fused kernel updates w, m, v in place: all must be contiguous fp32 CUDA tensors.
    fn fusable(&self, grads: &[Tensor]) -> bool {
        let Some(first) = self.slots.first() else {
            return false;
        };
        let dev = first.var.as_tensor().device();
        grads.len() == self.slots.len()
            && grads.iter().all(|g| g.device().same_device(dev))
            && self.slots.iter().all(|s| {
                [s.var.as_tensor(), &s.m, &s.v].iter().all(|t| {
                    kernels::usable(t)
                        && t.dtype() == DType::F32
                        && t.is_contiguous()
                        && t.device().same_device(dev)
                })
            })
    }
}

/// √(Σ‖g‖²) over all gradients, on the host (one kernel per tensor and a single read-back
/// on CUDA).
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    if !grads.is_empty()
        && grads.iter().all(|g| {
            kernels::usable(g)
                && g.dtype() == DType::F32
                && g.device().same_device(grads[0].device())
        })
    {
        return Ok(kernels::sumsq(grads)?.sqrt());
    }
    let mut total: Option<Tensor> = None;
    for g in grads {
        let s = g.sqr()?.sum_all()?;
        total = Some(match total {
            Some(t) => (t + s)?,
            None => s,
        });
    }
    match total {
        Some(t) => Ok((t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?).sqrt()),
        None => Ok(0.0),
    }
}

/// Learning rate at optimizer step `step` (0-based) of `max_steps`.
pub fn lr_at(s: &ScheduleConfig, base_lr: f64, step: u64, max_steps: u64) -> f64 {
    let max = max_steps.max(1) as f64;
    let x = step as f64;
    match s.kind {
        ScheduleKind::Constant => {
            if step < s.warmup_steps {
                base_lr * (x + 1.0) / s.warmup_steps as f64
            } else {
                base_lr
            }
        }
        ScheduleKind::Cosine => {
            if step < s.warmup_steps {
                return base_lr * (x + 1.0) / s.warmup_steps as f64;
            }
            let span = (max - s.warmup_steps as f64).max(1.0);
            let p = ((x - s.warmup_steps as f64) / span).clamp(0.0, 1.0);
            s.min_lr + 0.5 * (base_lr - s.min_lr) * (1.0 + (std::f64::consts::PI * p).cos())
        }
        ScheduleKind::OneCycle => {
            let start = base_lr / s.div_factor;
            let peak_at = (s.pct_start * max).max(1.0);
            let cos = |a: f64, b: f64, p: f64| {
                b + 0.5 * (a - b) * (1.0 + (std::f64::consts::PI * p.clamp(0.0, 1.0)).cos())
            };
            if x < peak_at {
                cos(start, base_lr, x / peak_at)
            } else {
                cos(base_lr, s.min_lr, (x - peak_at) / (max - peak_at).max(1.0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn sched(kind: ScheduleKind) -> ScheduleConfig {
        ScheduleConfig {
            kind,
            warmup_steps: 10,
            min_lr: 1e-4,
            pct_start: 0.25,
            div_factor: 10.0,
        }
    }

    #[test]
    fn schedules_at_known_steps() {
        let c = sched(ScheduleKind::Cosine);
        assert!((lr_at(&c, 1e-3, 0, 110) - 1e-4).abs() < 1e-12); // warm-up 1/10
        assert!((lr_at(&c, 1e-3, 9, 110) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&c, 1e-3, 10, 110) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&c, 1e-3, 60, 110) - 5.5e-4).abs() < 1e-12); // halfway: mean of lr and min
        assert!((lr_at(&c, 1e-3, 110, 110) - 1e-4).abs() < 1e-12);
        let k = sched(ScheduleKind::Constant);
        assert!((lr_at(&k, 1e-3, 4, 100) - 5e-4).abs() < 1e-12);
        assert_eq!(lr_at(&k, 1e-3, 50, 100), 1e-3);
        let o = sched(ScheduleKind::OneCycle);
        assert!((lr_at(&o, 1e-3, 0, 100) - 1e-4).abs() < 1e-12);
        assert!((lr_at(&o, 1e-3, 25, 100) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&o, 1e-3, 100, 100) - 1e-4).abs() < 1e-12);
    }

    /// A variable's gradient from `backward()` keeps its op graph; the moments must not, or
    /// each step's moments hold the last step's and its activations (issue 26's leak).
    #[test]
    fn adamw_moments_hold_no_graph_from_the_gradients() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0, 3.0], &dev).unwrap()).unwrap();
        let x = Tensor::new(&[0.5f32, 0.25, 2.0], &dev).unwrap();
        let mut opt =
            AdamW::new(vec![("w".into(), w.clone(), false)], 0.9, 0.95, 1e-8, 0.0).unwrap();
        for _ in 0..3 {
            // Σ w·(w·x): as in a matmul with activations, the op on w has another input that
            // depends on w, so w's gradient is built from it.
            let wx = (w.as_tensor() * &x).unwrap();
            let y = (w.as_tensor() * &wx).unwrap().sum_all().unwrap();
            let grads = y.backward().unwrap();
            let g = grads.get(w.as_tensor()).unwrap().clone();
            assert!(
                g.track_op(),
                "candle returns leaf gradients with their graph"
            );
            opt.step(&[g], 1e-2).unwrap();
            assert!(!opt.slots[0].m.track_op() && !opt.slots[0].v.track_op());
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr_and_decays_only_decay_slots() {
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::new(&[1.0f32, -1.0], &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[1.0f32, -1.0], &dev).unwrap()).unwrap();
        let mut opt = AdamW::new(
            vec![
                ("a".into(), a.clone(), true),
                ("b".into(), b.clone(), false),
            ],
            0.9,
            0.999,
            1e-12,
            0.5,
        )
        .unwrap();
        let g = Tensor::new(&[2.0f32, -3.0], &dev).unwrap();
        opt.step(&[g.clone(), g], 0.1).unwrap();
        // Bias-corrected first step is lr·sign(g); decay shrinks `a` by (1 − lr·wd) first.
        let a: Vec<f32> = a.as_tensor().to_vec1().unwrap();
        let b: Vec<f32> = b.as_tensor().to_vec1().unwrap();
        assert!(
            (a[0] - (0.95 - 0.1)).abs() < 1e-5 && (a[1] - (-0.95 + 0.1)).abs() < 1e-5,
            "{a:?}"
        );
        assert!(
            (b[0] - 0.9).abs() < 1e-5 && (b[1] + 0.9).abs() < 1e-5,
            "{b:?}"
        );
    }

    #[test]
    fn step_scaled_equals_step_on_scaled_gradients() {
        let dev = Device::Cpu;
        let mk = || {
            let w = Var::from_tensor(&Tensor::new(&[0.5f32, -2.0, 3.0], &dev).unwrap()).unwrap();
            let o = AdamW::new(vec![("w".into(), w.clone(), true)], 0.9, 0.95, 1e-8, 0.1).unwrap();
            (w, o)
        };
        let g = Tensor::new(&[0.3f32, -1.0, 4.0], &dev).unwrap();
        let (wa, mut a) = mk();
        let (wb, mut b) = mk();
        for _ in 0..3 {
            a.step_scaled(std::slice::from_ref(&g), 1e-2, 0.25).unwrap();
            b.step(&[(&g * 0.25).unwrap()], 1e-2).unwrap();
        }
        let (x, y): (Vec<f32>, Vec<f32>) = (
            wa.as_tensor().to_vec1().unwrap(),
            wb.as_tensor().to_vec1().unwrap(),
        );
        assert_eq!(x, y);
    }

    #[test]
    fn global_norm_is_euclidean() {
        let dev = Device::Cpu;
        let g = [
            Tensor::new(&[3.0f32], &dev).unwrap(),
            Tensor::new(&[4.0f32], &dev).unwrap(),
        ];
        assert!((global_norm(&g).unwrap() - 5.0).abs() < 1e-9);
    }
}
