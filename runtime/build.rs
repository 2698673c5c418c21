//! Compiles the CUDA kernels (`src/backend/cuda/kernels/*.cu`) into fat binaries embedded in
//! the crate: machine code for the common GPU generations plus PTX for newer ones, so a user
//! with only an NVIDIA driver runs them (no toolkit, no NVRTC at run time).
//!
//! nvcc is looked up in `SFX_NVCC`, then `PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin`, and
//! the project's tool cache (`.cache/cuda-tools`, filled by `scripts/fetch_cuda_tools.sh`).
//! Without nvcc the crate builds with no kernels and the CUDA backend says so at start; with
//! `SFX_NVCC` set (as `make` and CI do), a kernel that fails to compile fails the build.
//! `SFX_CUDA_ARCHS` (default `75,80,86,89,90,120`) lists the real architectures.

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &[
    "elementwise",
    "matvec",
    "attention",
    "attention_mma",
    "gemm",
    "group",
    "group_mma",
    "trellis",
    "kvarn",
    "refine",
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    let src = manifest.join("src/backend/cuda/kernels");
    println!("cargo:rerun-if-changed={}", src.display());
    for k in KERNELS {
        println!(
            "cargo:rerun-if-changed={}",
            src.join(format!("{k}.cu")).display()
        );
    }
    for header in ["common.cuh", "refine_epilogue.cuh"] {
        println!("cargo:rerun-if-changed={}", src.join(header).display());
    }
    for var in [
        "SFX_NVCC",
        "SFX_CUDA_ARCHS",
        "SFX_NVCC_LINEINFO",
        "CUDA_HOME",
        "PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo::rustc-check-cfg=cfg(sfx_cuda_kernels)");

    let required = std::env::var_os("SFX_NVCC").is_some();
    let Some(nvcc) = find_nvcc(&manifest) else {
        println!(
            "cargo:warning=nvcc not found: building without CUDA kernels (the CUDA backend \
             will refuse to start). Run scripts/fetch_cuda_tools.sh or set SFX_NVCC."
        );
        write_table(&out, &[]);
        return;
    };
    let archs = std::env::var("SFX_CUDA_ARCHS").unwrap_or_else(|_| "75,80,86,89,90,120".into());
    let archs: Vec<&str> = archs
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect();
    let lowest = archs
        .iter()
        .copied()
        .min_by_key(|a| a.parse::<u32>().unwrap_or(u32::MAX));

    let mut built = Vec::new();
    let mut failures = Vec::new();
    for k in KERNELS {
        let input = src.join(format!("{k}.cu"));
        let output = out.join(format!("{k}.fatbin"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-fatbin")
            .args(["-O3", "-std=c++17", "--threads", "0"])
            .arg("-I")
            .arg(&src);
        // Source lines for profilers (ncu's source view); the SASS is unchanged.
        if std::env::var("SFX_NVCC_LINEINFO").is_ok_and(|v| v == "1") {
            cmd.arg("-lineinfo");
        }
        for a in &archs {
            cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
        }
        if let Some(a) = lowest {
            // PTX of the lowest target: newer GPUs JIT it at load.
            cmd.arg(format!("-gencode=arch=compute_{a},code=compute_{a}"));
        }
        cmd.arg("-o").arg(&output).arg(&input);
        match cmd.output() {
            Ok(o) if o.status.success() => {
                let log = String::from_utf8_lossy(&o.stderr);
                for line in log.lines().filter(|l| l.contains("warning")) {
                    println!("cargo:warning={k}.cu: {line}");
                }
                built.push((k.to_string(), output));
            }
            Ok(o) => failures.push(format!(
                "{k}.cu: nvcc exited with {}:\n{}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            )),
            Err(e) => failures.push(format!("{k}.cu: could not run {}: {e}", nvcc.display())),
        }
    }
    if !failures.is_empty() {
        if required {
            panic!("CUDA kernels failed to compile:\n{}", failures.join("\n"));
        }
        for f in &failures {
            println!("cargo:warning={}", f.lines().next().unwrap_or(""));
        }
        println!("cargo:warning=building without CUDA kernels");
        write_table(&out, &[]);
        return;
    }
    println!("cargo:rustc-cfg=sfx_cuda_kernels");
    write_table(&out, &built);
}

/// `kernels.rs`: the embedded fat binaries by module name.
fn write_table(out: &Path, built: &[(String, PathBuf)]) {
    let mut s = String::from("/// Compiled kernel modules: (name, fat binary).\n");
    s.push_str("pub(crate) static MODULES: &[(&str, &[u8])] = &[\n");
    for (name, path) in built {
        s.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    s.push_str("];\n");
    std::fs::write(out.join("kernels.rs"), s).expect("OUT_DIR is writable");
}

fn find_nvcc(manifest: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SFX_NVCC") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            panic!("SFX_NVCC={} is not a file", p.display());
        }
        return Some(p);
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nvcc")).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(h).join("bin/nvcc"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Some(root) = manifest.parent() {
        candidates.push(root.join(".cache/cuda-tools/nvidia/cu13/bin/nvcc"));
    }
    candidates.into_iter().find(|p| p.is_file())
}
