//! `--device cpu|cuda[:N]|auto`: which backend a command runs on. One binary serves both; the
//! CUDA driver is probed at run time.

use anyhow::{bail, Result};
use sfx_runtime::backend::cpu::DecodeActivations;
use sfx_runtime::backend::cuda::CudaBackend;
use sfx_runtime::resident::ResidentKernels;
use sfx_runtime::CpuBackend;

/// A parsed `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    /// CUDA device 0 when a GPU and embedded kernels are present, else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            "auto" => Ok(DeviceChoice::Auto),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!(
                    "{other:?}: expected cpu, cuda, cuda:N (device ordinal) or auto"
                )),
            },
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    /// As `--device` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceChoice::Auto => f.write_str("auto"),
        }
    }
}

/// A device choice with `auto` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    Cpu,
    Cuda(usize),
}

impl DeviceChoice {
    /// Auto resolved against this machine.
    pub fn resolve(self) -> Resolved {
        match self {
            DeviceChoice::Cpu => Resolved::Cpu,
            DeviceChoice::Cuda(n) => Resolved::Cuda(n),
            DeviceChoice::Auto if CudaBackend::available() => Resolved::Cuda(0),
            DeviceChoice::Auto => Resolved::Cpu,
        }
    }
}

/// Work that runs on whichever backend was chosen (a generic closure, spelled as a trait).
pub trait OnBackend {
    type Output;
    fn run<B: ResidentKernels>(self, backend: B) -> Result<Self::Output>;
}

/// How the tools' CPU decode feeds coded projections: int8 activation blocks (as llama.cpp
/// does; several times faster), or f32 with `SFX_CPU_ACTIVATIONS=f32` (the reference numerics
/// the GPU kernels are checked against).
pub fn cpu_decode_activations() -> Result<DecodeActivations> {
    match std::env::var("SFX_CPU_ACTIVATIONS") {
        Ok(v) => {
            DecodeActivations::parse(&v).map_err(|e| anyhow::anyhow!("SFX_CPU_ACTIVATIONS: {e}"))
        }
        Err(_) => Ok(DecodeActivations::Int8),
    }
}

/// Opens the chosen backend and runs `task` on it (the CPU with [`cpu_decode_activations`];
/// a task that needs the reference numerics asks for `Backend::with_reference_numerics`).
pub fn with_backend<T: OnBackend>(choice: DeviceChoice, task: T) -> Result<T::Output> {
    let cpu_activations = cpu_decode_activations()?;
    match choice.resolve() {
        Resolved::Cpu => task.run(CpuBackend::new().with_decode_activations(cpu_activations)),
        Resolved::Cuda(n) => {
            let b = match CudaBackend::new(n) {
                Ok(b) => b,
                Err(e) => bail!("--device cuda: {e}"),
            };
            task.run(b)
        }
    }
}
