//! With the `cuda` feature: compile the fused kernels in src/engine/kernels/*.cu to PTX with
//! nvcc (compute_80, so the driver JIT-compiles it for sm80 and newer). Without the feature
//! this does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/engine/kernels/kernels.cu");
    println!("cargo:rerun-if-changed=src/engine/kernels/flash.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=COCKPIT_PTX_ARCH");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx = out.join("cockpit_kernels.ptx");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let arch = std::env::var("COCKPIT_PTX_ARCH").unwrap_or_else(|_| "compute_80".to_string());
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "--use_fast_math", "-std=c++17"])
        .arg(format!("-arch={arch}"))
        .arg("src/engine/kernels/kernels.cu")
        .arg("-o")
        .arg(&ptx)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling src/engine/kernels/kernels.cu"),
        Err(e) => panic!(
            "the cuda feature needs nvcc to compile the fused kernels: running `{nvcc}`: {e} \
             (put the CUDA toolkit's bin on PATH or set NVCC)"
        ),
    }
}
