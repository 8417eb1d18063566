//! With the `cuda` feature: compile the fused kernels in src/engine/kernels/*.cu to PTX with
//! nvcc, for compute_80 (the driver JIT-compiles it for sm80 and newer), compute_90a (Hopper:
//! flash attention's backward on warpgroup tensor-core instructions) and compute_75 (T4), plus an
//! fp16 build of each, and check each with ptxas for the GPUs it serves. Without the feature
//! this does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/engine/kernels/kernels.cu");
    println!("cargo:rerun-if-changed=src/engine/kernels/flash.cu");
    println!("cargo:rerun-if-changed=src/engine/kernels/flash_sm90.cu");
    // The kernel families that kernels.cu includes: the per-op kernels beside their launchers
    // in cuda/, the whole-model step's beside its code in step/.
    for family_dir in ["src/engine/kernels/cuda", "src/engine/kernels/step"] {
        for entry in std::fs::read_dir(family_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = entry.path();
            if path.extension().is_some_and(|x| x == "cuh") {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    println!("cargo:rerun-if-changed=src/engine/kernels/flash_smem.h");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=COCKPIT_PTX_ARCH");
    println!("cargo:rustc-check-cfg=cfg(cublas_grouped)");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    flash_smem_consts(&out);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    // cuBLAS's grouped matmul (cublasGemmGroupedBatchedEx, step/moe_mm.rs) came with CUDA 12.5:
    // cudarc binds it only for a toolkit that has it.
    if nvcc_release(&nvcc).is_some_and(|v| v >= (12, 5)) {
        println!("cargo:rustc-cfg=cublas_grouped");
    }
    let arch = std::env::var("COCKPIT_PTX_ARCH").unwrap_or_else(|_| "compute_80".to_string());
    // Two builds: compute_80 (bf16 tensor cores, cp.async; the driver JIT-compiles it for
    // sm_80 and newer) and compute_75 for T4-class GPUs (the sm_80 instructions left out).
    // The GPU's compute capability picks one at load (src/engine/kernels/cuda.rs).
    // Two more, the fp16 builds of both (COCKPIT_F16: the step's 16-bit type is fp16), for
    // `precision.dtype = "f16"` on the whole-model step (on compute_75 flash attention's
    // products run as m16n8k8 and its copies without cp.async). And compute_90a for Hopper
    // (its arch-specific PTX JIT-compiles for compute capability 9.0 only): the same kernels
    // plus flash_sm90.cu's backward on wgmma.
    // The six builds are independent: they run on as many threads as the machine has cores
    // (each an nvcc and its ptxas check, 40–60 s of one core; the longest first).
    let jobs: [(&str, &str, &[&str], &[&str]); 6] = [
        ("cockpit_kernels_sm75.ptx", "compute_75", &["sm_75"], &[]),
        (
            "cockpit_kernels_sm75_f16.ptx",
            "compute_75",
            &["sm_75"],
            &["-DCOCKPIT_F16"],
        ),
        ("cockpit_kernels.ptx", arch.as_str(), &["sm_80"], &[]),
        (
            "cockpit_kernels_f16.ptx",
            arch.as_str(),
            &["sm_80"],
            &["-DCOCKPIT_F16"],
        ),
        ("cockpit_kernels_sm90.ptx", "compute_90a", &["sm_90a"], &[]),
        (
            "cockpit_kernels_sm90_f16.ptx",
            "compute_90a",
            &["sm_90a"],
            &["-DCOCKPIT_F16"],
        ),
    ];
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let warnings = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(file, arch, check, defines)) = jobs.get(i) else {
                        return;
                    };
                    let w = ptx_build(&nvcc, &out, file, arch, check, defines);
                    if let Ok(mut all) = warnings.lock() {
                        all.extend(w);
                    }
                })
            })
            .collect();
        for h in handles {
            if let Err(panic) = h.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    for w in warnings.into_inner().unwrap_or_default() {
        println!("cargo:warning={w}");
    }
}

/// The toolkit's release (major, minor) from `nvcc --version` ("… release 12.4, V12.4.131").
fn nvcc_release(nvcc: &str) -> Option<(u32, u32)> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rest = text.split("release ").nth(1)?;
    let ver = rest.split(|c: char| c == ',' || c.is_whitespace()).next()?;
    let (major, minor) = ver.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// One PTX build of kernels.cu (`arch`, `defines`) into OUT_DIR/`file`, assembled with ptxas
/// for each GPU generation in `check` it is meant for (compute_80's PTX is not checked for
/// sm_90: a compute-capability-9.0 GPU loads the compute_90a build); the warnings to print —
/// among them ptxas's "Potential Performance Loss" remarks, such as wgmma products it
/// serializes for want of registers (C7512; the kernel then runs, slowly: a Hopper forward that
/// ran 17% below the one it meant to replace had one, unseen).
fn ptx_build(
    nvcc: &str,
    out: &std::path::Path,
    file: &str,
    arch: &str,
    check: &[&str],
    defines: &[&str],
) -> Vec<String> {
    let mut warnings = Vec::new();
    let ptx = out.join(file);
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "--use_fast_math", "-std=c++17"])
        .args(defines)
        .arg(format!("-arch={arch}"))
        .arg("src/engine/kernels/kernels.cu")
        .arg("-o")
        .arg(&ptx)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            panic!("{nvcc} failed ({s}) compiling src/engine/kernels/kernels.cu for {arch}")
        }
        Err(e) => panic!(
            "the cuda feature needs nvcc to compile the fused kernels: running `{nvcc}`: {e} \
             (put the CUDA toolkit's bin on PATH or set NVCC)"
        ),
    }
    // PTX is only text until a driver compiles it: assemble it for each GPU generation
    // it is meant for, so an instruction a generation lacks fails the build, not a user's
    // first launch. (Skipped where the toolkit has no ptxas.)
    let ptxas = PathBuf::from(nvcc).with_file_name("ptxas");
    for sm in check {
        let cubin = out.join(format!("{file}.{sm}.cubin"));
        match Command::new(&ptxas)
            .arg(format!("-arch={sm}"))
            .arg(&ptx)
            .arg("-o")
            .arg(&cubin)
            .output()
        {
            Ok(o) if o.status.success() => {
                let _ = std::fs::remove_file(&cubin);
                let text = String::from_utf8_lossy(&o.stderr);
                for line in text.lines() {
                    if !line.contains("Potential Performance Loss") {
                        continue;
                    }
                    // ("ptxas info    : (C7512) Potential Performance Loss: …")
                    let remark = line.split_once(" : ").map_or(line, |(_, r)| r).trim();
                    let w = format!("ptxas ({file}, {sm}): {remark}");
                    if !warnings.contains(&w) {
                        warnings.push(w);
                    }
                }
            }
            Ok(o) => panic!(
                "ptxas failed ({}): the {arch} kernels do not assemble for {sm}:\n{}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => warnings.push(format!(
                "not checking the kernels for {sm}: running {}: {e}",
                ptxas.display()
            )),
        }
    }
    warnings
}

/// flash_smem.h's `#define NAME (expression)` lines as Rust constants (OUT_DIR/flash_smem.rs,
/// included by src/engine/kernels/spec.rs): one definition of the flash kernels' shared memory
/// for the CUDA source and its launcher.
fn flash_smem_consts(out: &std::path::Path) {
    let path = "src/engine/kernels/flash_smem.h";
    let header = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let mut rust = String::from("// Generated by build.rs from src/engine/kernels/flash_smem.h.\n");
    for line in header.lines() {
        let Some(def) = line.strip_prefix("#define ") else {
            continue;
        };
        let (name, expr) = def.split_once(' ').unwrap_or((def, ""));
        if !name.ends_with("_SMEM") {
            continue;
        }
        let ok = !expr.trim().is_empty()
            && expr
                .chars()
                .all(|c| c.is_ascii_digit() || " *+()".contains(c));
        assert!(
            ok,
            "{path}: `{line}`: the value must be integers, `*`, `+` and parentheses"
        );
        rust.push_str(&format!(
            "#[allow(unused_parens)]\npub const {name}: u32 = {};\n",
            expr.trim()
        ));
    }
    std::fs::write(out.join("flash_smem.rs"), rust)
        .unwrap_or_else(|e| panic!("writing flash_smem.rs: {e}"));
}
