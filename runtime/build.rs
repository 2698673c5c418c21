//! Compiles the CUDA kernels (`src/backend/cuda/kernels/*.cu`) into fat binaries embedded in
//! the crate: machine code for the common GPU generations plus PTX for newer ones, so a user
//! with only an NVIDIA driver runs them (no toolkit, no NVRTC at run time).
//!
//! nvcc is looked up in `SFX_NVCC`, then `PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin`, and
//! the project's tool cache (`.cache/cuda-tools`, filled by `scripts/fetch_cuda_tools.sh`).
//! Without nvcc the crate builds with no kernels and the CUDA backend says so at start; with
//! `SFX_NVCC` set (as `make` and CI do), a kernel that fails to compile fails the build.
//! `SFX_CUDA_ARCHS` (default `75,80,86,89,90,120`) lists the real architectures.
//!
//! Compiled fat binaries are kept in `<target>/<profile>/sfx-kernels/`, keyed by a hash of
//! every file of the kernel folder, nvcc's version and the command line: clippy and the test
//! build run this script apart (each its own OUT_DIR), and `make test` used to compile every
//! kernel twice. `SFX_KERNEL_CACHE=0` turns the cache off.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
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
    "coded",
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
    for header in [
        "common.cuh",
        "refine_epilogue.cuh",
        "packed_codes.cuh",
        "row_matvec.cuh",
    ] {
        println!("cargo:rerun-if-changed={}", src.join(header).display());
    }
    for var in [
        "SFX_NVCC",
        "SFX_CUDA_ARCHS",
        "SFX_NVCC_LINEINFO",
        "SFX_KERNEL_CACHE",
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

    let cache = kernel_cache(&out, &nvcc, &src);
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
        let cached = cache.as_ref().map(|c| c.entry(k, &cmd));
        if let Some(hit) = cached.as_ref().filter(|p| p.is_file()) {
            if std::fs::copy(hit, &output).is_ok() {
                built.push((k.to_string(), output));
                continue;
            }
        }
        match cmd.output() {
            Ok(o) if o.status.success() => {
                let log = String::from_utf8_lossy(&o.stderr);
                for line in log.lines().filter(|l| l.contains("warning")) {
                    println!("cargo:warning={k}.cu: {line}");
                }
                if let Some(entry) = &cached {
                    store(&output, entry, k);
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

/// Where compiled kernels are kept between this script's runs of one profile, with the part of
/// their key every kernel shares (the kernel folder's files by name and contents, nvcc's
/// version); `None` when turned off or nvcc cannot say its version.
struct KernelCache {
    dir: PathBuf,
    key: u64,
}

impl KernelCache {
    /// The cache file of kernel `name` compiled by `cmd`: its flags are in the key, its paths
    /// are not (the output lies in OUT_DIR, which differs between runs; the source and include
    /// folder's contents are in the shared key, so another checkout of the same sources hits).
    fn entry(&self, name: &str, cmd: &Command) -> PathBuf {
        let mut h = DefaultHasher::new();
        self.key.hash(&mut h);
        name.hash(&mut h);
        let args: Vec<_> = cmd.get_args().collect();
        for (i, a) in args.iter().enumerate() {
            let is_path =
                i + 1 == args.len() || (i > 0 && (args[i - 1] == "-o" || args[i - 1] == "-I"));
            if !is_path {
                a.hash(&mut h);
            }
        }
        self.dir.join(format!("{name}-{:016x}.fatbin", h.finish()))
    }
}

fn kernel_cache(out: &Path, nvcc: &Path, src: &Path) -> Option<KernelCache> {
    if std::env::var("SFX_KERNEL_CACHE").is_ok_and(|v| v == "0") {
        return None;
    }
    // OUT_DIR is <target>/<profile>/build/<unit>/out.
    let dir = out.ancestors().nth(3)?.join("sfx-kernels");
    let version = Command::new(nvcc).arg("--version").output().ok()?;
    if !version.status.success() {
        return None;
    }
    let mut h = DefaultHasher::new();
    version.stdout.hash(&mut h);
    // Every file of the folder (sources and headers), in name order.
    let mut files: Vec<PathBuf> = std::fs::read_dir(src)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    for f in files {
        f.file_name().hash(&mut h);
        std::fs::read(&f).ok()?.hash(&mut h);
    }
    std::fs::create_dir_all(&dir).ok()?;
    Some(KernelCache {
        dir,
        key: h.finish(),
    })
}

/// Copies a freshly compiled kernel `name` into the cache, whole or not at all (a temporary
/// name, then a rename), and drops its older entries so edits do not pile up; a failure only
/// costs the next run a compile.
fn store(compiled: &Path, entry: &Path, name: &str) {
    let Some(dir) = entry.parent() else {
        return;
    };
    let prefix = format!("{name}-");
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let file = e.file_name();
            let file = file.to_string_lossy();
            let hash = file
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".fatbin"));
            // `{name}-{16 hex digits}.fatbin` only: other kernels' names may share a prefix.
            if hash.is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit())) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::copy(compiled, &tmp).is_ok() && std::fs::rename(&tmp, entry).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
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
