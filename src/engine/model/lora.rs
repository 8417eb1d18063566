//! LoRA adapters on the linear layers, merging them into the base, an NF4 base.

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
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let mut targets: Vec<(&str, &str, &mut Linear)> = vec![
                ("q", "self_attn.q_proj", &mut b.q),
                ("k", "self_attn.k_proj", &mut b.k),
                ("v", "self_attn.v_proj", &mut b.v),
                ("o", "self_attn.o_proj", &mut b.o),
                ("up", "mlp.up_proj", &mut b.up),
                ("down", "mlp.down_proj", &mut b.down),
            ];
            if let Some(g) = b.gate.as_mut() {
                targets.push(("gate", "mlp.gate_proj", g));
            }
            for (short, path, lin) in targets {
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
                let target = LORA_TARGETS.iter().position(|t| *t == short).unwrap_or(0);
                lin.lora = Some(Lora {
                    a,
                    b: bb,
                    scale,
                    p: spec.dropout.max(0.0),
                    site: dropout::site_lora(i, LORA_TARGET_GROUP[target]),
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
            v.push((format!("{p}.self_attn.q_proj"), &b.q));
            v.push((format!("{p}.self_attn.k_proj"), &b.k));
            v.push((format!("{p}.self_attn.v_proj"), &b.v));
            v.push((format!("{p}.self_attn.o_proj"), &b.o));
            if let Some(g) = &b.gate {
                v.push((format!("{p}.mlp.gate_proj"), g));
            }
            v.push((format!("{p}.mlp.up_proj"), &b.up));
            v.push((format!("{p}.mlp.down_proj"), &b.down));
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
    /// 4-bit base comes out dequantized (f32), after the other weights.
    pub fn merged_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut merged: std::collections::HashMap<String, Tensor> =
            std::collections::HashMap::new();
        let mut nf4 = Vec::new();
        for (name, lin) in self.linears() {
            let name = format!("{name}.weight");
            let quantized = matches!(lin.w, Weight::Nf4(_));
            if lin.lora.is_none() && !quantized {
                continue;
            }
            let mut w = self.weight_as(&lin.w, DType::F32)?;
            if let Some(l) = &lin.lora {
                let delta = (l.b.as_tensor().matmul(l.a.as_tensor())? * l.scale)?;
                w = (w + delta)?;
            }
            if quantized {
                nf4.push((name, w));
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
        out.extend(nf4);
        Ok(out)
    }

    /// Store the frozen base's linear layers in NF4 (`lora.base_dtype = "nf4"`; before
    /// [`Self::add_lora`]): each matrix is quantized where it lives and its parameter dropped
    /// (embeddings, norms and biases stay as they are). Returns the bytes the matrices took
    /// before and take now.
    pub fn quantize_base_nf4(&mut self) -> Result<(u64, u64)> {
        let (mut before, mut after) = (0u64, 0u64);
        let mut dropped = std::collections::HashSet::new();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            let mut lins: Vec<(String, &mut Linear)> = vec![
                (format!("{p}.self_attn.q_proj"), &mut b.q),
                (format!("{p}.self_attn.k_proj"), &mut b.k),
                (format!("{p}.self_attn.v_proj"), &mut b.v),
                (format!("{p}.self_attn.o_proj"), &mut b.o),
                (format!("{p}.mlp.up_proj"), &mut b.up),
                (format!("{p}.mlp.down_proj"), &mut b.down),
            ];
            if let Some(g) = b.gate.as_mut() {
                lins.push((format!("{p}.mlp.gate_proj"), g));
            }
            for (name, lin) in lins {
                let Weight::Dense(v) = &lin.w else { continue };
                let t = v.as_tensor();
                before += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
                let q = Nf4::quantize(t)?;
                after += q.bytes() as u64;
                lin.w = Weight::Nf4(std::sync::Arc::new(q));
                dropped.insert(format!("{name}.weight"));
            }
        }
        self.params.retain(|p| !dropped.contains(&p.name));
        Ok((before, after))
    }
}
