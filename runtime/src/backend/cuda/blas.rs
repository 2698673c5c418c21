//! cuBLAS for the prefill GEMMs, found at run time: a user with only the driver has no
//! libcublas, and then the backend's own GEMM kernel serves instead (docs/decisions.md).
//!
//! Besides the loader's search path (`LD_LIBRARY_PATH`), the library is looked for where pip
//! puts it (`nvidia-cublas` wheels: `site-packages/nvidia/cu13/lib`), or at `SFX_CUBLAS`.
//! Loading it by absolute path first makes cudarc's later `dlopen("libcublas.so.13")` find
//! the already-loaded library by its soname.

use super::device::Device;
use crate::error::{Result, RuntimeError};
use cudarc::cublas::sys as cb;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The element type of a GEMM operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmType {
    Bf16,
    F32,
    /// F32 operands on tensor cores with 10-bit mantissas (dequantized group panels).
    Tf32,
}

pub(crate) struct Blas {
    handle: Mutex<cb::cublasHandle_t>,
    pub version: i32,
    _device: Arc<Device>,
}

// SAFETY: the handle is used only under its mutex, bound to the backend's one stream.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

fn blas_err(op: &'static str, s: cb::cublasStatus_t) -> RuntimeError {
    RuntimeError::Cuda {
        op,
        msg: format!("cuBLAS status {s:?}"),
    }
}

/// Places pip and the CUDA toolkit put libcublas.
fn candidate_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("SFX_CUBLAS") {
        out.push(PathBuf::from(p));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    for base in ["/usr/lib", "/usr/local/lib", "/opt"] {
        roots.push(PathBuf::from(base));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    // <root>/python3.X/{site,dist}-packages/nvidia/cu13/lib and one level of venvs under /opt.
    let mut lib_dirs = Vec::new();
    let mut push_python_dirs = |dir: &std::path::Path| {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with("python3") {
                    for pkgs in ["site-packages", "dist-packages"] {
                        lib_dirs.push(e.path().join(pkgs).join("nvidia/cu13/lib"));
                        lib_dirs.push(e.path().join(pkgs).join("nvidia/cublas/lib"));
                    }
                }
            }
        }
    };
    for r in &roots {
        push_python_dirs(r);
        if r.ends_with("opt") {
            if let Ok(entries) = std::fs::read_dir(r) {
                for e in entries.flatten() {
                    push_python_dirs(&e.path().join(".venv/lib"));
                    push_python_dirs(&e.path().join("lib"));
                }
            }
        }
    }
    lib_dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for d in lib_dirs {
        out.push(d.join("libcublas.so.13"));
    }
    out
}

/// Loads libcublas if it can be found; `None` otherwise (or when `SFX_CUDA_GEMM=own`).
pub(crate) fn open(device: &Arc<Device>) -> Result<Option<Blas>> {
    if std::env::var("SFX_CUDA_GEMM").is_ok_and(|v| v == "own") {
        return Ok(None);
    }
    for p in candidate_paths() {
        if p.is_file() {
            // SAFETY: loading a shared library runs its initialisers; libcublas's are benign.
            if let Ok(lib) = unsafe { libloading::Library::new(&p) } {
                // Kept loaded for the life of the process.
                std::mem::forget(lib);
                break;
            }
        }
    }
    // SAFETY: only probes with dlopen.
    if !unsafe { cb::is_culib_present() } {
        return Ok(None);
    }
    device.bind()?;
    let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
    // SAFETY: out-pointer to a handle; the library is present.
    let s = unsafe { cb::cublasCreate_v2(&mut handle) };
    if s != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(blas_err("creating the cuBLAS handle", s));
    }
    // SAFETY: valid handle and stream.
    let s = unsafe { cb::cublasSetStream_v2(handle, device.stream as cb::cudaStream_t) };
    if s != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(blas_err("binding cuBLAS to the stream", s));
    }
    let mut version = 0;
    // SAFETY: valid handle.
    unsafe { cb::cublasGetVersion_v2(handle, &mut version) };
    Ok(Some(Blas {
        handle: Mutex::new(handle),
        version,
        _device: device.clone(),
    }))
}

impl Blas {
    /// `y[m, n] = x[m, k] · w[n, k]ᵀ (+ y when beta = 1)`, row-major, f32 output. Column-major
    /// cuBLAS sees yᵀ = w · xᵀ: op(A) = wᵀ-as-stored (transposed), op(B) = xᵀ-as-stored.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_xwt(
        &self,
        ty: GemmType,
        x: u64,
        w: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
    ) -> Result<()> {
        let dims = |v: usize| {
            i32::try_from(v).map_err(|_| RuntimeError::Shape {
                op: "gemm",
                msg: format!("dimension {v} exceeds cuBLAS's i32"),
            })
        };
        let (m, n, k) = (dims(m)?, dims(n)?, dims(k)?);
        let t = match ty {
            GemmType::Bf16 => cb::cudaDataType::CUDA_R_16BF,
            GemmType::F32 | GemmType::Tf32 => cb::cudaDataType::CUDA_R_32F,
        };
        let compute = match ty {
            GemmType::Tf32 => cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let alpha = 1.0f32;
        let handle = self
            .handle
            .lock()
            .map_err(|_| RuntimeError::Unsupported("cuBLAS handle poisoned".into()))?;
        // SAFETY: the pointers address device buffers of the stated sizes (checked by the
        // caller); alpha/beta are host scalars (the default pointer mode).
        let s = unsafe {
            cb::cublasGemmEx(
                *handle,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                t,
                k,
                x as *const c_void,
                t,
                k,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                cb::cudaDataType::CUDA_R_32F,
                n,
                compute,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        };
        if s != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_err("GEMM", s));
        }
        Ok(())
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(h) = self.handle.lock() {
            // SAFETY: created in `open`, destroyed once.
            unsafe { cb::cublasDestroy_v2(*h) };
        }
    }
}
