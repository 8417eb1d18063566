//! Semantic validation: everything serde's types cannot say.

use super::{BaseDtype, Config, ConfigIssue, PosEncoding, RopeScaling, ScuParams, RANDOM_BASE};
use std::path::Path;

/// The LoRA target names the engine knows.
pub const LORA_TARGETS: &[&str] = &[
    "q", "k", "v", "o", "up", "down", "gate", "in_proj", "out_proj",
];

struct Check<'a> {
    origin: &'a str,
    issues: Vec<ConfigIssue>,
}

impl Check<'_> {
    fn fail(&mut self, key: &str, value: impl ToString, message: impl Into<String>) {
        self.issues.push(ConfigIssue {
            origin: self.origin.to_string(),
            key: key.to_string(),
            value: Some(value.to_string()),
            message: message.into(),
        });
    }
    fn positive(&mut self, key: &str, v: f64) {
        if !(v > 0.0 && v.is_finite()) {
            self.fail(key, v, "must be a positive number");
        }
    }
    fn at_least(&mut self, key: &str, v: u64, min: u64) {
        if v < min {
            self.fail(key, v, format!("must be at least {min}"));
        }
    }
    fn in_range(&mut self, key: &str, v: f64, lo: f64, hi: f64, what: &str) {
        if !(v >= lo && v <= hi) {
            self.fail(key, v, format!("must be {what}"));
        }
    }
}

/// The longest duration a config key may name (about 11 days).
const MAX_SECS: f64 = 1e6;

/// The largest learning rate accepted (sane runs use 1e-5 to 1e-1).
const MAX_LR: f64 = 10.0;

/// The largest λ accepted (scu.lambda_max's default is 1000).
const MAX_LAMBDA: f64 = 1e6;

/// The largest built-in corpus (tokens); larger sizes only exhaust memory.
const MAX_BUILTIN_TOKENS: u64 = 1_000_000_000;

/// The largest LoRA rank (and at most the narrowest width it adapts, checked at build).
const MAX_LORA_R: u64 = 65_536;

/// The largest micro-batch (the live `+` key is held to it too).
pub const MAX_MICRO_BATCH: usize = 4096;

fn quoted(s: &str) -> String {
    format!("{s:?}")
}

/// Whether `spec` (a path, a directory or a glob) names at least one file.
pub fn data_spec_exists(spec: &str) -> bool {
    let p = Path::new(spec);
    if p.exists() {
        return true;
    }
    glob::glob(spec)
        .map(|mut g| g.any(|e| e.is_ok()))
        .unwrap_or(false)
}

pub(super) fn validate(c: &Config, origin: &str) -> Vec<ConfigIssue> {
    let mut ck = Check {
        origin,
        issues: Vec::new(),
    };
    let ck = &mut ck;

    // [run]
    if c.run.name.is_empty()
        || !c
            .run
            .name
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
    {
        ck.fail(
            "run.name",
            quoted(&c.run.name),
            "must be non-empty and use only letters, digits, '-', '_' and '.'",
        );
    }
    ck.at_least("run.max_steps", c.run.max_steps, 1);
    if crate::util::parse_device(&c.run.device).is_none() {
        ck.fail(
            "run.device",
            quoted(&c.run.device),
            "allowed: auto, cpu, cuda, cuda:N",
        );
    }
    ck.positive("run.log_every_secs", c.run.log_every_secs);
    // Durations and sizes are bounded: a value past any use would only overflow or exhaust
    // memory later (a duration of 1e30 s, a queue of a billion batches).
    ck.in_range(
        "run.log_every_secs",
        c.run.log_every_secs,
        0.0,
        MAX_SECS,
        "at most 1e6 (seconds)",
    );

    // [model]
    let m = &c.model;
    ck.at_least("model.n_layer", m.n_layer as u64, 1);
    ck.at_least("model.n_head", m.n_head as u64, 1);
    ck.at_least("model.n_embd", m.n_embd as u64, 1);
    ck.at_least("model.seq_len", m.seq_len as u64, 2);
    if m.n_head > 0 && m.head_dim == 0 && !m.n_embd.is_multiple_of(m.n_head) {
        ck.fail(
            "model.n_head",
            m.n_head,
            format!(
                "must divide model.n_embd ({}) unless model.head_dim is set",
                m.n_embd
            ),
        );
    }
    let head_dim = m.head_size();
    let kv = c.kv_heads();
    if m.n_head > 0 && (kv == 0 || !m.n_head.is_multiple_of(kv)) {
        ck.fail(
            "model.n_kv_head",
            m.n_kv_head,
            format!("must divide model.n_head ({}); 0 means n_head", m.n_head),
        );
    }
    if m.pos == PosEncoding::Rope && m.n_head > 0 && !head_dim.is_multiple_of(2) {
        ck.fail(
            "model.pos",
            "\"rope\"",
            format!("needs an even head size; the head size is {head_dim}"),
        );
    }
    if m.n_positions != 0 && m.n_positions < m.seq_len {
        ck.fail(
            "model.n_positions",
            m.n_positions,
            format!(
                "must be 0 (= seq_len) or at least model.seq_len ({})",
                m.seq_len
            ),
        );
    }
    match &m.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => ck.positive("model.rope_scaling.factor", *factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            ck.positive("model.rope_scaling.factor", *factor);
            ck.positive("model.rope_scaling.low_freq_factor", *low_freq_factor);
            if high_freq_factor.partial_cmp(low_freq_factor) != Some(std::cmp::Ordering::Greater) {
                ck.fail(
                    "model.rope_scaling.high_freq_factor",
                    high_freq_factor,
                    "must be greater than low_freq_factor",
                );
            }
            ck.at_least(
                "model.rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings as u64,
                1,
            );
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            let rotary = match m.layout.rotary_dim {
                0 => m.head_size(),
                r => r,
            };
            for (key, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != rotary / 2 || !f.iter().all(|x| *x > 0.0 && x.is_finite()) {
                    ck.fail(
                        &format!("model.rope_scaling.{key}"),
                        format!("{f:?}"),
                        format!(
                            "needs {} positive numbers (one per rotated pair)",
                            rotary / 2
                        ),
                    );
                }
            }
            ck.positive("model.rope_scaling.attention_factor", *attention_factor);
            ck.at_least(
                "model.rope_scaling.original_max_position_embeddings",
                *original_max_position_embeddings as u64,
                1,
            );
        }
    }
    if m.layout.norm_plus_one && m.norm != crate::config::Norm::RmsNorm {
        ck.fail(
            "model.layout.norm_plus_one",
            true,
            "scales an RMSNorm by 1 + w: needs model.norm = \"rmsnorm\"",
        );
    }
    if let Some((key, value, why)) = m.layout.problem(m.n_layer) {
        ck.fail(key, value, why);
    }
    ck.positive("model.embedding_multiplier", m.embedding_multiplier);
    ck.positive("model.residual_multiplier", m.residual_multiplier);
    ck.positive("model.logits_scaling", m.logits_scaling);
    if !(m.attention_multiplier >= 0.0 && m.attention_multiplier.is_finite()) {
        ck.fail(
            "model.attention_multiplier",
            m.attention_multiplier,
            "must be 0 (1/sqrt(head size)) or positive",
        );
    }
    if let Some(h) = &m.hybrid {
        if let Some((key, value, why)) = h.problem(m.n_layer) {
            ck.fail(key, value, why);
        }
        if m.activation != crate::config::Activation::SwiGlu
            || m.norm != crate::config::Norm::RmsNorm
            || m.bias
        {
            ck.fail(
                "model.hybrid",
                "set",
                "a Granite 4.0 hybrid has RMSNorm, a SwiGLU shared MLP and no biases (model.arch = \"llama\", model.bias = false)",
            );
        }
        if !m.layout.is_plain() || m.qkv_bias {
            ck.fail(
                "model.hybrid",
                "set",
                "a Granite 4.0 hybrid's attention has no QK-norm, post-norm, partial rotary or q/k/v biases",
            );
        }
    }
    if !m.init_from.is_empty() {
        if !Path::new(&m.init_from).exists() {
            ck.fail(
                "model.init_from",
                quoted(&m.init_from),
                "no such file or directory",
            );
        }
        if c.lora.enabled {
            ck.fail(
                "model.init_from",
                quoted(&m.init_from),
                "LoRA takes its base from lora.base; set one of the two",
            );
        }
    }
    ck.positive("model.mlp_ratio", m.mlp_ratio);
    ck.in_range("model.mlp_ratio", m.mlp_ratio, 0.0, 64.0, "at most 64");
    ck.in_range(
        "model.n_layer",
        m.n_layer as f64,
        0.0,
        4096.0,
        "at most 4096",
    );
    ck.in_range(
        "model.n_embd",
        m.n_embd as f64,
        0.0,
        65536.0,
        "at most 65536",
    );
    ck.in_range(
        "model.vocab_size",
        m.vocab_size as f64,
        0.0,
        (1u64 << 24) as f64,
        "at most 16777216",
    );
    ck.in_range("model.dropout", m.dropout, 0.0, 0.9, "in [0, 0.9]");
    ck.positive("model.norm_eps", m.norm_eps);
    ck.positive("model.rope_theta", m.rope_theta);
    ck.positive("model.init_std", m.init_std);
    if m.vocab_size != 0 && c.data.source == "builtin" && m.vocab_size < c.data.builtin_vocab {
        ck.fail(
            "model.vocab_size",
            m.vocab_size,
            format!(
                "must be 0 (from the data) or at least data.builtin_vocab ({})",
                c.data.builtin_vocab
            ),
        );
    }

    // [data]
    let d = &c.data;
    match d.source.as_str() {
        "builtin" => {
            ck.in_range(
                "data.builtin_vocab",
                d.builtin_vocab as f64,
                2.0,
                65535.0,
                "in [2, 65535]",
            );
            ck.in_range(
                "data.builtin_order",
                d.builtin_order as f64,
                1.0,
                6.0,
                "in [1, 6]",
            );
            if d.builtin_branching < 1 || d.builtin_branching > d.builtin_vocab {
                ck.fail(
                    "data.builtin_branching",
                    d.builtin_branching,
                    format!("must be in [1, data.builtin_vocab ({})]", d.builtin_vocab),
                );
            }
            let contexts = (d.builtin_vocab as f64).powi(d.builtin_order as i32);
            if contexts > (1u64 << 22) as f64 {
                ck.fail(
                    "data.builtin_order",
                    d.builtin_order,
                    format!(
                        "builtin_vocab^builtin_order = {contexts:.0} contexts; at most 4194304"
                    ),
                );
            }
            if d.builtin_tokens as u64 > MAX_BUILTIN_TOKENS {
                ck.fail(
                    "data.builtin_tokens",
                    d.builtin_tokens,
                    format!("must be at most {MAX_BUILTIN_TOKENS}"),
                );
            }
            let min_tokens = 20 * (m.seq_len + 1);
            if d.builtin_tokens < min_tokens {
                ck.fail(
                    "data.builtin_tokens",
                    d.builtin_tokens,
                    format!("must be at least {min_tokens} (20 sequences of model.seq_len + 1)"),
                );
            }
        }
        "files" => {
            if d.train.is_empty() {
                ck.fail("data.train", "\"\"", "must name text files (a path, a directory or a glob) when data.source = \"files\"");
            } else if !data_spec_exists(&d.train) {
                ck.fail(
                    "data.train",
                    quoted(&d.train),
                    "no such file, directory or glob match",
                );
            }
            if !d.val.is_empty() && !data_spec_exists(&d.val) {
                ck.fail(
                    "data.val",
                    quoted(&d.val),
                    "no such file, directory or glob match",
                );
            }
        }
        other => ck.fail("data.source", quoted(other), "allowed: builtin, files"),
    }
    if d.val.is_empty() {
        ck.in_range(
            "data.val_fraction",
            d.val_fraction,
            1e-6,
            0.5,
            "in (0, 0.5] when data.val is empty",
        );
    }
    if !["byte", "auto", "base"].contains(&d.tokenizer.as_str())
        && !Path::new(&d.tokenizer).is_file()
    {
        ck.fail(
            "data.tokenizer",
            quoted(&d.tokenizer),
            "allowed: \"auto\", \"base\", \"byte\" or the path of an existing tokenizer.json",
        );
    }
    ck.at_least("data.prefetch_depth", d.prefetch_depth as u64, 1);
    ck.in_range(
        "data.prefetch_depth",
        d.prefetch_depth as f64,
        0.0,
        1024.0,
        "at most 1024 (batches prepared ahead)",
    );
    if d.doc_separator.is_empty() {
        ck.fail(
            "data.doc_separator",
            "\"\"",
            "allowed: \"auto\", \"eos\", \"none\" or a non-empty text",
        );
    }
    if !["auto", "text", "messages", "prompt_completion", "alpaca"].contains(&d.format.as_str()) {
        ck.fail(
            "data.format",
            quoted(&d.format),
            "allowed: auto, text, messages, prompt_completion, alpaca",
        );
    }
    if !["split", "drop", "error"].contains(&d.long_samples.as_str()) {
        ck.fail(
            "data.long_samples",
            quoted(&d.long_samples),
            "allowed: split, drop, error",
        );
    }

    // [optim]
    let o = &c.optim;
    let lr_ok = o.lr > 0.0 && o.lr.is_finite();
    ck.positive("optim.lr", o.lr);
    if lr_ok && o.lr > MAX_LR {
        ck.fail(
            "optim.lr",
            o.lr,
            format!("must be at most {MAX_LR}: a larger step makes every weight NaN at once"),
        );
    }
    ck.in_range(
        "optim.weight_decay",
        o.weight_decay,
        0.0,
        10.0,
        "in [0, 10]",
    );
    ck.in_range("optim.beta1", o.beta1, 0.0, 0.999_999, "in [0, 1)");
    ck.in_range("optim.beta2", o.beta2, 0.0, 0.999_999_9, "in [0, 1)");
    ck.positive("optim.eps", o.eps);
    ck.in_range(
        "optim.grad_clip",
        o.grad_clip,
        0.0,
        1e6,
        "0 (off) or positive",
    );
    ck.in_range(
        "optim.micro_batch",
        o.micro_batch as f64,
        0.0,
        MAX_MICRO_BATCH as f64,
        "at most 4096 (sequences per micro-batch; accumulate for more)",
    );
    ck.in_range("optim.accum", o.accum as f64, 0.0, 1e6, "at most 1000000");
    ck.at_least("optim.accum", o.accum as u64, 1);

    // [schedule]
    let s = &c.schedule;
    if s.warmup_steps > c.run.max_steps {
        ck.fail(
            "schedule.warmup_steps",
            s.warmup_steps,
            format!("must be at most run.max_steps ({})", c.run.max_steps),
        );
    }
    // (against a bad optim.lr, only that one is reported)
    if lr_ok && !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
        ck.fail(
            "schedule.min_lr",
            s.min_lr,
            format!("must be in [0, optim.lr ({})]", o.lr),
        );
    }
    ck.in_range(
        "schedule.pct_start",
        s.pct_start,
        1e-6,
        0.999_999,
        "in (0, 1)",
    );
    ck.in_range("schedule.div_factor", s.div_factor, 1.0, 1e6, "at least 1");

    // [precision]
    ck.positive("precision.loss_scale_init", c.precision.loss_scale_init);
    ck.at_least(
        "precision.loss_scale_growth_interval",
        c.precision.loss_scale_growth_interval,
        1,
    );

    // [scu]
    let u = &c.scu;
    ck.in_range(
        "scu.target",
        u.target,
        1e-6,
        0.999_999,
        "in (0, 1) (a fraction: 0.01 = 1%)",
    );
    let (kp, ki, deadband) = u.gains();
    ck.in_range("scu.kp", kp, 0.0, 100.0, "in [0, 100]");
    ck.in_range("scu.ki", ki, 0.0, 100.0, "in [0, 100]");
    ck.in_range("scu.deadband", deadband, 0.0, 0.5, "in [0, 0.5]");
    ck.in_range("scu.rate", u.rate, 1e-3, 1.0, "in (0, 1]");
    ck.in_range("scu.ema_alpha", u.ema_alpha, 1e-6, 1.0, "in (0, 1]");
    ck.in_range("scu.integral_leak", u.integral_leak, 1e-6, 1.0, "in (0, 1]");
    ck.in_range(
        "scu.integral_max",
        u.integral_max,
        0.0,
        100.0,
        "in [0, 100]",
    );
    ck.positive("scu.lambda_min", u.lambda_min);
    if u.lambda_max > MAX_LAMBDA {
        ck.fail(
            "scu.lambda_max",
            u.lambda_max,
            format!("must be at most {MAX_LAMBDA}"),
        );
    }
    if u.lambda_init > MAX_LAMBDA {
        ck.fail(
            "scu.lambda_init",
            u.lambda_init,
            format!("must be at most {MAX_LAMBDA}"),
        );
    }
    if u.lambda_max.is_nan() || u.lambda_max < u.lambda_min {
        ck.fail(
            "scu.lambda_max",
            u.lambda_max,
            format!("must be at least scu.lambda_min ({})", u.lambda_min),
        );
    }
    if u.enabled && !(u.lambda_init >= u.lambda_min && u.lambda_init <= u.lambda_max) {
        ck.fail(
            "scu.lambda_init",
            u.lambda_init,
            format!(
                "must be in [scu.lambda_min, scu.lambda_max] = [{}, {}]",
                u.lambda_min, u.lambda_max
            ),
        );
    }
    if !u.enabled && (u.lambda_init.is_nan() || u.lambda_init < 0.0 || u.lambda_init.is_infinite())
    {
        ck.fail(
            "scu.lambda_init",
            u.lambda_init,
            "must be ≥ 0 (0 = no regularization while scu.enabled = false)",
        );
    }
    ck.positive("scu.prior_sigma", u.prior_sigma);
    ck.at_least("scu.control_every", u.control_every, 1);
    if u.enabled && o.weight_decay > 0.0 {
        ck.fail(
            "optim.weight_decay",
            o.weight_decay,
            "must be 0 when scu.enabled = true: SCU's λ·Σw²/(2σ²) already regularizes these weights (set scu.enabled = false to use weight decay)",
        );
    }
    if u.params == ScuParams::Lora && !c.lora.enabled {
        ck.fail(
            "scu.params",
            "\"lora\"",
            "needs lora.enabled = true; use \"all\" or \"auto\" otherwise",
        );
    }

    // [lora]
    let l = &c.lora;
    ck.at_least("lora.r", l.r as u64, 1);
    if l.r as u64 > MAX_LORA_R {
        ck.fail("lora.r", l.r, format!("must be at most {MAX_LORA_R}"));
    }
    ck.positive("lora.alpha", l.alpha);
    ck.in_range("lora.dropout", l.dropout, 0.0, 0.9, "in [0, 0.9]");
    if l.base_dtype == BaseDtype::Nf4 && !l.enabled {
        ck.fail(
            "lora.base_dtype",
            "\"nf4\"",
            "quantizes a frozen LoRA base: needs lora.enabled = true",
        );
    }
    for t in &l.targets {
        if !LORA_TARGETS.contains(&t.as_str()) {
            ck.fail(
                "lora.targets",
                quoted(t),
                format!("allowed: {}", LORA_TARGETS.join(", ")),
            );
        } else if m.hybrid.is_some() && t == "gate" {
            ck.fail(
                "lora.targets",
                quoted(t),
                "a Granite 4.0 hybrid's shared MLP has gate and up in one layer (shared_mlp.input_linear): target \"up\"",
            );
        } else if m.hybrid.is_none()
            && (t == "in_proj" || t == "out_proj")
            && (l.base.is_empty() || l.base == RANDOM_BASE)
        {
            ck.fail(
                "lora.targets",
                quoted(t),
                "in_proj and out_proj are the Mamba layers' projections (a Granite 4.0 hybrid: [model.hybrid])",
            );
        } else if t == "gate"
            && !m.activation.gated()
            && (l.base.is_empty() || l.base == RANDOM_BASE)
        {
            ck.fail(
                "lora.targets",
                quoted(t),
                "\"gate\" exists only with model.activation = \"swiglu\" or \"geglu\"",
            );
        }
    }
    if l.enabled {
        if l.targets.is_empty() {
            ck.fail(
                "lora.targets",
                "[]",
                "must name at least one layer when lora.enabled = true",
            );
        }
        if l.base_dtype == BaseDtype::Nf4 && c.run.device == "cpu" {
            ck.fail(
                "lora.base_dtype",
                "\"nf4\"",
                "4-bit bases run on CUDA only (run.device = \"cpu\"); use \"bf16\"",
            );
        }
        if l.base.is_empty() {
            ck.fail("lora.base", "\"\"", "must name base weights (a cockpit run or checkpoint, or a Hugging Face model directory) when lora.enabled = true");
        } else if l.base != RANDOM_BASE && !Path::new(&l.base).exists() {
            ck.fail("lora.base", quoted(&l.base), "no such file or directory");
        }
    }

    // [checkpoint]
    ck.at_least("checkpoint.keep_last", c.checkpoint.keep_last as u64, 1);
    ck.in_range(
        "checkpoint.every_minutes",
        c.checkpoint.every_minutes,
        0.0,
        1e6,
        "0 (off) or positive",
    );

    ck.at_least(
        "checkpoint.max_nonfinite_in_a_row",
        c.checkpoint.max_nonfinite_in_a_row as u64,
        1,
    );
    ck.in_range(
        "checkpoint.restore_lr_factor",
        c.checkpoint.restore_lr_factor,
        1e-6,
        1.0,
        "in (0, 1]",
    );

    // [eval]: batches = 0 is the whole val split.
    let e = &c.eval;
    if e.sample_tokens >= c.model.seq_len && c.model.seq_len > 0 {
        // (Samples continue their prompts within the training context: a longer one would be
        // cut to what is left of it.)
        ck.fail(
            "eval.sample_tokens",
            e.sample_tokens,
            format!(
                "must be below model.seq_len = {} (a sample continues its prompt within the training context)",
                c.model.seq_len
            ),
        );
    }
    if e.samples_per_prompt > 1024 {
        ck.fail(
            "eval.samples_per_prompt",
            e.samples_per_prompt,
            "must be at most 1024",
        );
    }
    if e.samples_per_prompt > 0 {
        if e.sample_prompts.is_empty() {
            ck.fail(
                "eval.sample_prompts",
                "[]",
                format!(
                    "give at least one prompt for eval.samples_per_prompt = {}",
                    e.samples_per_prompt
                ),
            );
        }
        if e.sample_tokens == 0 {
            ck.fail(
                "eval.sample_tokens",
                0,
                format!(
                    "must be at least 1 with eval.samples_per_prompt = {} (the length of each sample)",
                    e.samples_per_prompt
                ),
            );
        }
    }
    for (i, p) in e.sample_prompts.iter().enumerate() {
        if p.trim().is_empty() {
            ck.fail(
                &format!("eval.sample_prompts[{i}]"),
                quoted(p),
                "must not be empty",
            );
        }
    }

    // [monitor]
    ck.positive("monitor.interval_secs", c.monitor.interval_secs);
    ck.in_range(
        "monitor.interval_secs",
        c.monitor.interval_secs,
        0.0,
        3600.0,
        "at most 3600 (seconds)",
    );
    ck.in_range(
        "monitor.advisor_window_secs",
        c.monitor.advisor_window_secs,
        0.0,
        MAX_SECS,
        "at most 1e6 (seconds)",
    );
    if c.monitor.advisor_window_secs.is_nan()
        || c.monitor.advisor_window_secs < c.monitor.interval_secs
    {
        ck.fail(
            "monitor.advisor_window_secs",
            c.monitor.advisor_window_secs,
            format!(
                "must be at least monitor.interval_secs ({})",
                c.monitor.interval_secs
            ),
        );
    }

    // [distributed]
    ck.at_least("distributed.gpus", c.distributed.gpus as u64, 1);
    if !matches!(c.distributed.backend.as_str(), "auto" | "nccl" | "tcp") {
        ck.fail(
            "distributed.backend",
            quoted(&c.distributed.backend),
            "allowed: auto (nccl on CUDA devices, tcp on the CPU), nccl (CUDA devices), tcp (CPU processes)",
        );
    }
    if !matches!(c.distributed.reduce_dtype.as_str(), "f32" | "bf16") {
        ck.fail(
            "distributed.reduce_dtype",
            quoted(&c.distributed.reduce_dtype),
            "allowed: f32, bf16 (gradient sums across the ranks)",
        );
    }
    ck.in_range(
        "distributed.bucket_mb",
        c.distributed.bucket_mb,
        0.001,
        1e6,
        "in [0.001, 1e6] MB",
    );
    ck.positive("distributed.timeout_secs", c.distributed.timeout_secs);
    ck.in_range(
        "distributed.timeout_secs",
        c.distributed.timeout_secs,
        0.0,
        MAX_SECS,
        "at most 1e6 (seconds)",
    );

    // [tui]
    ck.in_range("tui.fps", c.tui.fps as f64, 1.0, 60.0, "in [1, 60]");
    ck.in_range(
        "tui.setpoint_step",
        c.tui.setpoint_step,
        1e-6,
        0.1,
        "in (0, 0.1]",
    );

    // [sweep]
    ck.in_range(
        "sweep.seeds",
        c.sweep.seeds as f64,
        1.0,
        super::MAX_SWEEP_SEEDS as f64,
        "in [1, 1000]",
    );
    for g in &c.sweep.grid {
        let ok = g.split('+').all(|axis| {
            axis.split_once('=').is_some_and(|(k, v)| {
                !k.trim().is_empty() && !v.trim().is_empty() && !v.trim_end().ends_with(',')
            })
        });
        if !ok {
            ck.fail(
                "sweep.grid",
                quoted(g),
                "each entry is KEY=V1,V2,... (keys joined by + form a product)",
            );
        }
    }

    ck.issues.clone()
}
