//! LoRA adapters on the linear layers, merging them into the base, a quantized base.

use super::*;

impl Model {
    /// Add LoRA adapters (rank r) on the target layers and freeze everything else.
    pub fn add_lora(&mut self, spec: &LoraSpec, seed: u64) -> Result<()> {
        let mut init = Init {
            rng: StdRng::seed_from_u64(seed ^ 0x10CA),
            device: &self.device,
            params: Vec::new(),
            // Adapters are trained: fp32 masters, drawn as on every device.
            store: BaseStore::default(),
        };
        let scale = spec.alpha / spec.r as f64;
        let hybrid = self.spec.hybrid.is_some();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (short, path, lin) in block_linears_mut(b, hybrid) {
                if !spec.targets.iter().any(|t| t == short) {
                    continue;
                }
                let (out, inp) = lin.w.dims2()?;
                let name = format!("model.layers.{i}.{path}");
                // Kaiming-uniform-like A (scaled normal here), zero B: the adapter starts as a no-op.
                let a = init.normal(
                    format!("{name}.lora_A.weight"),
                    (spec.r, inp),
                    1.0 / (inp as f64).sqrt(),
                    ParamKind::LoraA,
                )?;
                let bb = init.zeros2(
                    format!("{name}.lora_B.weight"),
                    (out, spec.r),
                    ParamKind::LoraB,
                )?;
                // Adapters that read the same input share a dropout mask: in_proj reads the
                // normed block input (as q, k, v), out_proj the scan's output (as o).
                let group = match short {
                    "in_proj" => 0,
                    "out_proj" => 1,
                    _ => LORA_TARGETS
                        .iter()
                        .position(|t| *t == short)
                        .map_or(0, |t| LORA_TARGET_GROUP[t]),
                };
                lin.lora = Some(Lora {
                    a,
                    b: bb,
                    scale,
                    p: spec.dropout.max(0.0),
                    site: dropout::site_lora(i, group),
                });
            }
        }
        for p in &mut self.params {
            p.trainable = false;
        }
        self.params.extend(init.params);
        Ok(())
    }

    pub(super) fn linears(&self) -> Vec<(String, &Linear)> {
        let mut v = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            match &b.mixer {
                Mixer::Attention(a) => {
                    v.push((format!("{p}.self_attn.q_proj"), &a.q));
                    v.push((format!("{p}.self_attn.k_proj"), &a.k));
                    v.push((format!("{p}.self_attn.v_proj"), &a.v));
                    v.push((format!("{p}.self_attn.o_proj"), &a.o));
                }
                Mixer::Mamba(m) => {
                    v.push((format!("{p}.mamba.in_proj"), &m.in_proj));
                    v.push((format!("{p}.mamba.out_proj"), &m.out_proj));
                }
            }
            if let Some(g) = &b.gate {
                v.push((format!("{p}.mlp.gate_proj"), g));
            }
            let (up, down) = mlp_paths(self.spec.hybrid.is_some());
            v.push((format!("{p}.{up}"), &b.up));
            v.push((format!("{p}.{down}"), &b.down));
        }
        v
    }

    /// Adapter weights with PEFT names (`base_model.model.<layer>.lora_A.weight`).
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .filter(|p| p.kind.is_lora())
            .map(|p| {
                (
                    format!("base_model.model.{}", p.name),
                    p.var.as_tensor().clone(),
                )
            })
            .collect()
    }

    /// Base weights with every adapter folded in: `W + (alpha/r)·B·A`; no LoRA tensors. A
    /// quantized base comes out dequantized (f32), after the other weights.
    pub fn merged_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut merged: std::collections::HashMap<String, Tensor> =
            std::collections::HashMap::new();
        let mut quantized_base = Vec::new();
        for (name, lin) in self.linears() {
            let name = format!("{name}.weight");
            let quantized = matches!(lin.w, Weight::Quantized(_));
            if lin.lora.is_none() && !quantized {
                continue;
            }
            let mut w = self.weight_as(&lin.w, DType::F32)?;
            if let Some(l) = &lin.lora {
                let delta = (l.b.as_tensor().matmul(l.a.as_tensor())? * l.scale)?;
                w = (w + delta)?;
            }
            if quantized {
                quantized_base.push((name, w));
            } else {
                merged.insert(name, w);
            }
        }
        let mut out: Vec<(String, Tensor)> = self
            .params
            .iter()
            .filter(|p| !p.kind.is_lora())
            .map(|p| {
                (
                    p.name.clone(),
                    merged
                        .remove(&p.name)
                        .unwrap_or_else(|| p.var.as_tensor().clone()),
                )
            })
            .collect();
        out.extend(quantized_base);
        Ok(out)
    }

    /// Store the frozen base's linear layers quantized (`lora.base_dtype = "nf4"`; before
    /// [`Self::add_lora`]): a matrix `kept` holds (a GGUF base's 4–6-bit blocks, under the
    /// weight's name) keeps those blocks, every other one is quantized to NF4 where it lives;
    /// either parameter is dropped (embeddings, norms and biases stay as they are). On the CPU,
    /// which reads no quantized matrix, a kept one stays dense, rounded to bf16 as the GPU's
    /// dequantization rounds it.
    pub fn quantize_base(
        &mut self,
        kept: &HashMap<String, GgmlBlocks>,
    ) -> Result<BaseQuantization> {
        let mut report = BaseQuantization::default();
        let mut dropped = std::collections::HashSet::new();
        let hybrid = self.spec.hybrid.is_some();
        let device = self.device.clone();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (_, path, lin) in block_linears_mut(b, hybrid) {
                let name = format!("model.layers.{i}.{path}.weight");
                let Weight::Dense(v) = &lin.w else { continue };
                let t = v.as_tensor();
                let (out, inp) = t.dims2()?;
                report.before += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
                let q = match kept.get(&name) {
                    Some(k) if (k.out, k.inp) != (out, inp) => {
                        return Err(candle_core::Error::Msg(format!(
                            "{name}: kept {} blocks of [{}, {}] for a [{out}, {inp}] matrix",
                            k.name(),
                            k.out,
                            k.inp
                        )))
                    }
                    Some(k) if !device.is_cuda() => {
                        v.set(&t.to_dtype(DType::BF16)?.to_dtype(t.dtype())?)?;
                        report.count(k.name(), t.elem_count() * t.dtype().size_in_bytes());
                        continue;
                    }
                    Some(k) => Quantized::Ggml(k.to_device(&device)?),
                    None => Quantized::Nf4(Nf4::quantize(t)?),
                };
                report.count(q.name(), q.bytes());
                lin.w = Weight::Quantized(std::sync::Arc::new(q));
                dropped.insert(name);
            }
        }
        self.params.retain(|p| !dropped.contains(&p.name));
        Ok(report)
    }
}

/// What [`Model::quantize_base`] did.
#[derive(Clone, Debug, Default)]
pub struct BaseQuantization {
    /// Bytes the base's matrices took before and take now.
    pub before: u64,
    pub after: u64,
    /// Matrices by format (NF4, Q4_K, …).
    pub formats: std::collections::BTreeMap<&'static str, usize>,
}

impl BaseQuantization {
    fn count(&mut self, format: &'static str, bytes: usize) {
        *self.formats.entry(format).or_default() += 1;
        self.after += bytes as u64;
    }

    /// For the run header: "LoRA base linear layers in NF4: …", or with the formats counted
    /// where a GGUF file's blocks were kept.
    pub fn describe(&self) -> String {
        let formats = if self.formats.keys().all(|f| *f == "NF4") {
            "in NF4".to_string()
        } else {
            let parts: Vec<String> = self
                .formats
                .iter()
                .map(|(f, n)| format!("{n} {f}"))
                .collect();
            format!(
                "{} (the GGUF's own blocks kept; NF4 where wider)",
                parts.join(", ")
            )
        };
        format!(
            "LoRA base linear layers {formats}: {:.2} GB instead of {:.2} GB",
            self.after as f64 / 1e9,
            self.before as f64 / 1e9
        )
    }
}

/// The paths of the MLP's input and output projections: a hybrid's shared MLP, or the Llama
/// block's up and down.
fn mlp_paths(hybrid: bool) -> (&'static str, &'static str) {
    if hybrid {
        ("shared_mlp.input_linear", "shared_mlp.output_linear")
    } else {
        ("mlp.up_proj", "mlp.down_proj")
    }
}

/// A block's linear layers as LoRA names them: `(target, path under the layer, layer)`.
fn block_linears_mut(
    b: &mut Block,
    hybrid: bool,
) -> Vec<(&'static str, &'static str, &mut Linear)> {
    let Block {
        mixer,
        up,
        gate,
        down,
        ..
    } = b;
    let mut v: Vec<(&'static str, &'static str, &mut Linear)> = match mixer {
        Mixer::Attention(a) => vec![
            ("q", "self_attn.q_proj", &mut a.q),
            ("k", "self_attn.k_proj", &mut a.k),
            ("v", "self_attn.v_proj", &mut a.v),
            ("o", "self_attn.o_proj", &mut a.o),
        ],
        Mixer::Mamba(m) => vec![
            ("in_proj", "mamba.in_proj", &mut m.in_proj),
            ("out_proj", "mamba.out_proj", &mut m.out_proj),
        ],
    };
    let (up_path, down_path) = mlp_paths(hybrid);
    v.push(("up", up_path, up));
    v.push(("down", down_path, down));
    if let Some(g) = gate.as_mut() {
        v.push(("gate", "mlp.gate_proj", g));
    }
    v
}
