//! The CUDA backend: every op of [`Backend`] as our own kernels (`kernels/*.cu`, compiled by
//! `build.rs` into embedded fat binaries) on one stream, cuBLAS for prefill GEMMs when the
//! library is on the machine.
//!
//! The driver is loaded at run time ([`CudaBackend::available`] never panics without it), so
//! the same binary runs on CPU-only machines. Design and measurements: docs/decisions.md,
//! "CUDA backend".

mod blas;
mod coded;
mod device;
mod group;
mod kernels;
mod kvarn;
mod refine;
mod resident;
mod trellis;
mod trellis_layout;

use crate::backend::refine::FusedColumns;
use crate::backend::{
    rope_write_kv_attention_unfused, AttentionShape, Backend, BranchLane, BranchMark, GroupItem,
    KvDtype, KvLayout, KvarnLayer, KvarnLayerMut, KvarnShape, MatmulOut, RopeTable,
    WeightPrecision,
};
use crate::error::{check_len, check_rows, Result, RuntimeError};
use blas::{Blas, GemmType};
use device::{Device, DeviceMem, PinnedMem};
use group::RefineOperand;
use kernels::Kernels;
pub use kvarn::CudaByteStore;
use sfx_formats::{DType, TensorView};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

pub use resident::CudaResidentLinear;

/// Up to this many token rows a projection runs as matrix–vector products (weights streamed
/// once per row); beyond it, a GEMM.
const MATVEC_MAX_TOKENS: usize = 4;
/// CUDA's limit on a grid's y and z extents.
const MAX_GRID_YZ: u32 = 65_535;
/// Threads of a matvec block (the kernels' `MV_THREADS`).
const MV_THREADS: u32 = 256;
/// Keys per decode attention chunk at least (one 32-key tile per warp of a 4-warp block).
const ATT_MIN_CHUNK: i32 = 128;
/// Query heads per decode block (`ATT_GROUP`); queries per prefill block (`PF_QUERIES`).
const ATT_GROUP: usize = 8;
const PF_QUERIES: usize = 16;
/// Queries per block and keys per tile of the tensor-core prefill (attention_mma.cu).
const MMA_QUERIES: usize = 64;
const MMA_KEYS: usize = 64;
/// Shared memory the attention kernels declare statically (a ticket word), kept out of what
/// their dynamic allocations may use.
const ATT_STATIC_SMEM: usize = 1024;
/// Decode attention handles this many query rows at once (the model's decode path: 1); the
/// kernel's ticket counters assume it (attention.cu).
const ATT_MAX_QUERIES: usize = 4;
/// Below this context a decode block takes one query head (short context: per-key latency
/// bound), from it the whole GQA group (long context: keys read once per group).
const ATT_SHORT_CONTEXT: usize = 1024;

/// An f32 activation buffer in device memory.
pub struct CudaBuffer {
    mem: DeviceMem,
    len: usize,
}

/// A resident weight matrix in device memory, shared by reference count: float weights
/// (BF16 bits or F32), group codes (RTN / AWQ) or trellis tiles (QTIP / YAQA), which every
/// projection op of the backend takes, so the graph's fused paths (q/k/v in one launch,
/// gate/up with SwiGLU, norms folded in) serve every format.
#[derive(Clone)]
pub struct CudaMatrix {
    inner: Arc<MatrixData>,
}

struct MatrixData {
    /// Float weights, the group codes' bit streams, or the trellis tiles (unit layout).
    mem: DeviceMem,
    rows: usize,
    cols: usize,
    /// The float weights' type; F32 for coded weights (the precision their kernels compute in).
    dtype: DType,
    codes: Codes,
}

/// What a resident matrix holds beside its main buffer.
enum Codes {
    /// Float weights (BF16 bits or F32).
    Float,
    /// Group codes (RTN / AWQ): code width, scales and zero points, layout.
    Group(group::GroupCodes),
    /// Trellis tiles (QTIP / YAQA): code, signs, transforms, table and decode scratch.
    Trellis(trellis::TrellisCodes),
    /// Look-up-table codes (SqueezeLLM) or GGUF blocks: their tables or scale planes.
    Coded(coded::CodedCodes),
}

impl MatrixData {
    /// Whether one fused launch can take both matrices: the same input width and format.
    fn same_format(&self, other: &MatrixData) -> bool {
        self.cols == other.cols
            && self.dtype == other.dtype
            && match (&self.codes, &other.codes) {
                (Codes::Float, Codes::Float) => true,
                (Codes::Group(a), Codes::Group(b)) => a.same_format(b),
                (Codes::Trellis(a), Codes::Trellis(b)) => a.same_format(b),
                (Codes::Coded(a), Codes::Coded(b)) => a.same_format(b),
                _ => false,
            }
    }

    fn weight_ref(&self) -> WeightRef {
        WeightRef {
            ptr: self.mem.ptr,
            rows: self.rows,
            cols: self.cols,
            dtype: self.dtype,
            tf32: false,
        }
    }
}

impl WeightRef {
    /// A transient f32 panel of dequantized weights, which cuBLAS may multiply in TF32.
    fn tf32_panel(panel: &DeviceMem, rows: usize, cols: usize) -> WeightRef {
        WeightRef {
            ptr: panel.ptr,
            rows,
            cols,
            dtype: DType::F32,
            tf32: true,
        }
    }
}

/// A row-major weight operand of a GEMM: a resident matrix, or a transient dequantized panel
/// (`tf32`: an F32 panel cuBLAS may multiply in TF32).
#[derive(Clone, Copy)]
struct WeightRef {
    ptr: u64,
    rows: usize,
    cols: usize,
    dtype: DType,
    tf32: bool,
}

/// u32 values on the device with a pinned host staging area.
pub struct CudaIndex {
    mem: DeviceMem,
    staging: PinnedMem,
    len: usize,
}

impl CudaIndex {
    /// The ids as an embedding gather's grid dimension (one block row per token).
    fn grid_rows(&self) -> Result<u32> {
        u32::try_from(self.len).map_err(|_| {
            RuntimeError::Unsupported(format!("embedding: {} tokens in one call", self.len))
        })
    }
}

/// One layer's K or V cache in device memory.
pub struct CudaKvStore {
    mem: DeviceMem,
    len: usize,
    dtype: KvDtype,
}

/// A captured decode step.
pub struct CudaGraph(device::Graph);

/// The kernels' `MatvecItem` / `MatvecGroup` (kernels/matvec.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecItem {
    w: u64,
    bias: u64,
    y: u64,
    rows: i32,
    block_end: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecGroup {
    item: [MatvecItem; 3],
    count: i32,
}

/// A kernel argument; the launch passes a pointer to the value.
enum Arg {
    Ptr(u64),
    I32(i32),
    U64(u64),
    F32(f32),
    Group(MatvecGroup),
    GroupCodes(group::GqGroup),
    GroupTiles(group::GtGroup),
    Coded(coded::CdGroup),
    CodedItem(coded::CdItem),
    Trellis(trellis::TrGroup),
    TrellisPrep(trellis::TrPrep),
    TrellisFinish(trellis::TrFinish),
    FreshKv(FreshKv),
    Kvarn(kvarn::KvarnParams),
    Columns(refine::ColumnParams),
    Stage(refine::StageParams),
}

/// The new keys and values a decode attention launch rotates and stores itself (the kernels'
/// `FreshKv`); all zero for plain attention.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FreshKv {
    k: u64,
    v: u64,
    cos: u64,
    sin: u64,
    n_new: i32,
    table_positions: i32,
}

impl Arg {
    fn as_ptr(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => v as *mut u64 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::Group(g) => g as *mut MatvecGroup as *mut c_void,
            Arg::GroupCodes(g) => g as *mut group::GqGroup as *mut c_void,
            Arg::GroupTiles(g) => g as *mut group::GtGroup as *mut c_void,
            Arg::Coded(g) => g as *mut coded::CdGroup as *mut c_void,
            Arg::CodedItem(g) => g as *mut coded::CdItem as *mut c_void,
            Arg::Trellis(g) => g as *mut trellis::TrGroup as *mut c_void,
            Arg::TrellisPrep(g) => g as *mut trellis::TrPrep as *mut c_void,
            Arg::TrellisFinish(g) => g as *mut trellis::TrFinish as *mut c_void,
            Arg::FreshKv(f) => f as *mut FreshKv as *mut c_void,
            Arg::Kvarn(p) => p as *mut kvarn::KvarnParams as *mut c_void,
            Arg::Columns(p) => p as *mut refine::ColumnParams as *mut c_void,
            Arg::Stage(p) => p as *mut refine::StageParams as *mut c_void,
        }
    }
}

/// Which kernels launch with programmatic dependent launch. Measured on the H200 (tg128,
/// Llama-3.1-8B shape, one call each): the trellis chain (matvec, transforms) gains — qtip2 HYB
/// 298.3 → 321.7 tok/s, since each matvec block copies its 128 KB table and loads its first
/// codes while the previous transform finishes — while group-coded and float projections do not
/// (rtn2 518 → 515; earlier 220 → 201 and 240 → 224: early blocks wait on SMs the running
/// kernel needs). `SFX_PDL=1` turns it on for every projection, `SFX_PDL=0` off for all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PdlPolicy {
    trellis: bool,
    projections: bool,
}

impl PdlPolicy {
    fn new(device_has_pdl: bool, setting: Option<&str>) -> Self {
        let (trellis, projections) = match setting {
            Some("1") => (true, true),
            Some("0") => (false, false),
            _ => (true, false),
        };
        Self {
            trellis: trellis && device_has_pdl,
            projections: projections && device_has_pdl,
        }
    }
}

struct Inner {
    dev: Arc<Device>,
    k: Kernels,
    blas: Option<Blas>,
    /// The BF16 copy of a GEMM's activations (tensor cores take both operands in BF16).
    gemm_scratch: Mutex<Option<DeviceMem>>,
    /// `SFX_MATVEC_ROWS`: force rows per matvec block or warp (1, 2, 4) for tuning runs.
    matvec_rows: Option<usize>,
    /// Partial results of the two-step argmax: [ARGMAX_ROWS × 64] (value, index) pairs.
    argmax_scratch: DeviceMem,
    /// Which projections launch with programmatic dependent launch (sm_90+): their weight
    /// loads and table copies may start during the previous kernel.
    pdl: PdlPolicy,
    /// RMSNorm fused into the following projections (`SFX_FUSE_NORM=0` runs it separately).
    fuse_norm: bool,
    /// Prefill attention over f16 caches on tensor cores (sm_80+; `SFX_PREFILL_ATTN=simt`
    /// keeps the CUDA-core kernel, for comparison).
    mma_prefill: bool,
    /// Decode steps rotate, store and attend in one launch (sm_80+; `SFX_FUSED_ATTN=0` runs
    /// RoPE, the cache write and attention as three, for comparison).
    fused_attention: bool,
    /// `SFX_KV_SELECT_L2=1`: the KV refinement's selection makes every pass over the score
    /// bits in L2 instead of gathering the few near the threshold into shared memory, for
    /// comparison and to exercise that path.
    kv_select_l2: bool,
    /// Branches run on the side stream (`SFX_BRANCHES=0`, or kernel profiling, which times
    /// launches on the main stream: in order).
    branches: bool,
    /// The refinement engine may hand a decode row's refinement to the coded projections'
    /// launches (on by default; `SFX_FUSED_REFINE=0` keeps the engine's branches for every
    /// set). The engine takes it only for sets fetch lead staged, at k ≤ 16
    /// (`Refiner::fuses_set`: measured on an H100, docs/results.md). The ops apply
    /// refinements handed to them in their launches either way (the conformance suite checks
    /// those kernels).
    fused_refinement: bool,
    /// `SFX_GROUP_ROWS`: force rows per thread of the file-layout group-code matvecs (1, 2,
    /// 4) for tuning runs.
    group_rows: Option<usize>,
    /// `SFX_GROUP_TPR`: force threads per row set of those matvecs (8, 16, …, 256) for tuning
    /// runs.
    group_tpr: Option<usize>,
    /// `SFX_GROUP_WIDE`: blocks per SM those matvecs keep while their row sets narrow (1–64),
    /// for tuning runs.
    group_wide: Option<usize>,
    /// `SFX_GT_PLAN`: force the plan of the tile-layout matvecs, for tuning runs.
    tile_plan: Option<group::TilePlan>,
    /// `SFX_GT_ONE_WAVE=1`: every tile launch takes enough tile sets a block to run in one
    /// wave (by default only launches of which at most two blocks fit an SM do), for
    /// comparison.
    tile_one_wave: bool,
    /// Tile launches whose 8-warp blocks fill an SM run 16-warp blocks (`SFX_GT_WIDE=0` keeps
    /// 8, for comparison).
    tile_wide: bool,
    /// 2- and 4-bit group codes in the tensor-core tile layout (sm_80+; `SFX_GROUP_TILES=0`
    /// keeps the file layout and the CUDA-core kernels, for comparison).
    group_tiles: bool,
    /// `SFX_TR_ROWS`: tile rows per row group of the trellis matvecs (1, 2), for tuning runs.
    trellis_rows: Option<usize>,
    /// Trellis matvecs over power-of-two inputs run the input transform in their prologue
    /// (`SFX_TR_PROLOGUE=0` launches tr_prepare before them, for comparison).
    trellis_prologue: bool,
    /// Trellis prefill transforms run one block per token with the vector in shared memory
    /// (`SFX_TR_TOKEN_TRANSFORMS=0` keeps the decode kernels' row blocks, for comparison).
    trellis_token_transforms: bool,
    /// `SFX_TR_GEMM_TOKENS` (64, 128): tokens per block of the trellis prefill GEMM, for
    /// tuning runs.
    trellis_gemm_tokens: Option<usize>,
}

/// Rows one argmax launch covers (its scratch is sized once, so a captured step never sees it
/// move); more rows run in several launches.
const ARGMAX_ROWS: usize = 4096;
/// The kernels' AM_PARTS.
const ARGMAX_PARTS: usize = 64;

/// The CUDA backend. Cheap to clone (shares the device).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

fn i32_of(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| RuntimeError::Shape {
        op,
        msg: format!("{v} exceeds the kernels' 32-bit sizes"),
    })
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).min(u32::MAX as usize) as u32
}

impl CudaBackend {
    /// Whether a CUDA driver with at least one device is present and this build embeds
    /// kernels. Never panics (the driver library is probed before it is used).
    /// This backend with the refinement engine's fused path on or off (`SFX_FUSED_REFINE`
    /// sets the default); only a backend not yet shared (no clone, nothing built on it) can
    /// change it.
    pub fn with_fused_refinement(mut self, on: bool) -> Result<Self> {
        let inner = Arc::get_mut(&mut self.inner).ok_or_else(|| {
            RuntimeError::Unsupported("a shared CUDA backend keeps its settings".into())
        })?;
        inner.fused_refinement = on;
        Ok(self)
    }

    pub fn available() -> bool {
        Self::device_count() > 0 && kernels::embedded()
    }

    /// Devices the driver reports (0 when there is no driver).
    pub fn device_count() -> usize {
        // SAFETY: only probes whether libcuda can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        if cudarc::driver::result::init().is_err() {
            return 0;
        }
        cudarc::driver::result::device::get_count().map_or(0, |n| n.max(0) as usize)
    }

    /// Opens device `ordinal`, loads the kernels and, if present, cuBLAS.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !kernels::embedded() {
            return Err(RuntimeError::Unsupported(
                "this binary was built without CUDA kernels (nvcc was not found at build time); \
                 rebuild after `bash scripts/fetch_cuda_tools.sh` (or with SFX_NVCC=/path/to/nvcc)"
                    .into(),
            ));
        }
        // SAFETY: only probes whether libcuda can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(RuntimeError::Unsupported(
                "no CUDA driver (libcuda.so) on this machine; use --device cpu".into(),
            ));
        }
        let count = Self::device_count();
        if ordinal >= count {
            return Err(RuntimeError::Unsupported(format!(
                "CUDA device {ordinal} requested, the driver reports {count}"
            )));
        }
        let dev = Device::open(ordinal)?;
        let k = Kernels::load(&dev)?;
        let blas = blas::open(&dev)?;
        let matvec_rows = std::env::var("SFX_MATVEC_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|r| matches!(r, 1 | 2 | 4));
        let argmax_scratch = dev.alloc(ARGMAX_ROWS * ARGMAX_PARTS * 8)?;
        let pdl = PdlPolicy::new(dev.compute.0 >= 9, std::env::var("SFX_PDL").ok().as_deref());
        let dev_has_mma = dev.compute.0 >= 8;
        Ok(Self {
            inner: Arc::new(Inner {
                dev,
                k,
                blas,
                gemm_scratch: Mutex::new(None),
                matvec_rows,
                argmax_scratch,
                pdl,
                fuse_norm: std::env::var("SFX_FUSE_NORM").map_or(true, |v| v != "0"),
                group_rows: std::env::var("SFX_GROUP_ROWS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|r| matches!(r, 1 | 2 | 4)),
                group_tpr: std::env::var("SFX_GROUP_TPR")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|t| t.is_power_of_two() && (8..=256).contains(t)),
                group_wide: std::env::var("SFX_GROUP_WIDE")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|b| (1..=64).contains(b)),
                tile_plan: group::TilePlan::from_env(),
                tile_one_wave: std::env::var("SFX_GT_ONE_WAVE").is_ok_and(|v| v == "1"),
                tile_wide: std::env::var("SFX_GT_WIDE").map_or(true, |v| v != "0"),
                trellis_rows: std::env::var("SFX_TR_ROWS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|r| matches!(r, 1 | 2)),
                trellis_prologue: std::env::var("SFX_TR_PROLOGUE").map_or(true, |v| v != "0"),
                trellis_token_transforms: std::env::var("SFX_TR_TOKEN_TRANSFORMS")
                    .map_or(true, |v| v != "0"),
                trellis_gemm_tokens: std::env::var("SFX_TR_GEMM_TOKENS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|t| [64, 128].contains(t)),
                group_tiles: dev_has_mma
                    && std::env::var("SFX_GROUP_TILES").map_or(true, |v| v != "0"),
                mma_prefill: dev_has_mma
                    && std::env::var("SFX_PREFILL_ATTN").map_or(true, |v| v != "simt"),
                fused_attention: dev_has_mma
                    && std::env::var("SFX_FUSED_ATTN").map_or(true, |v| v != "0"),
                kv_select_l2: std::env::var("SFX_KV_SELECT_L2").is_ok_and(|v| v == "1"),
                branches: std::env::var("SFX_BRANCHES").map_or(true, |v| v != "0")
                    && std::env::var("SFX_PROFILE_KERNELS").map_or(true, |v| v != "1"),
                fused_refinement: std::env::var("SFX_FUSED_REFINE").map_or(true, |v| v != "0"),
            }),
        })
    }

    fn dev(&self) -> &Arc<Device> {
        &self.inner.dev
    }

    fn k(&self) -> &Kernels {
        &self.inner.k
    }

    /// A float or group-coded projection kernel: with PDL where [`PdlPolicy`] says so.
    fn launch_projection(
        &self,
        k: &device::Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: usize,
        args: &mut [Arg],
    ) -> Result<()> {
        self.launch_dependent(self.inner.pdl.projections, k, grid, block, smem, args)
    }

    /// A kernel launched with programmatic dependent launch when `pdl`, plainly otherwise.
    fn launch_dependent(
        &self,
        pdl: bool,
        k: &device::Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: usize,
        args: &mut [Arg],
    ) -> Result<()> {
        let mut ptrs = [std::ptr::null_mut::<c_void>(); 16];
        if args.len() > ptrs.len() {
            return Err(RuntimeError::Unsupported(format!(
                "{}: too many kernel arguments",
                k.name
            )));
        }
        for (p, a) in ptrs.iter_mut().zip(args.iter_mut()) {
            *p = a.as_ptr();
        }
        let ptrs = &mut ptrs[..args.len()];
        if pdl {
            self.dev().launch_pdl(k, grid, block, smem as u32, ptrs)
        } else {
            self.dev().launch(k, grid, block, smem as u32, ptrs)
        }
    }

    fn launch(
        &self,
        k: &device::Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: usize,
        args: &mut [Arg],
    ) -> Result<()> {
        self.launch_dependent(false, k, grid, block, smem, args)
    }

    /// Rows per matvec block for a group whose smallest matrix has `rows` rows: enough
    /// blocks to give every SM several (k/v of an 8B model: 1024 rows → 2 per block).
    fn matvec_rows_per_block(&self, rows: usize) -> usize {
        if let Some(r) = self.inner.matvec_rows {
            return r;
        }
        let sm = self.dev().sm_count as usize;
        if rows >= 8 * sm {
            4
        } else if rows >= 4 * sm {
            2
        } else {
            1
        }
    }

    /// The matvec entry point for weights of `dtype`: 16-byte chunks or element-wise, `r`
    /// rows per block, the input norm fused or not, single/grouped or SwiGLU.
    fn matvec_kernel(
        &self,
        dtype: DType,
        vector: bool,
        r: usize,
        norm: bool,
        swiglu: bool,
    ) -> &device::Kernel {
        let mk = if dtype == DType::BF16 {
            &self.k().matvec_bf16
        } else {
            &self.k().matvec_f32
        };
        let ri = match r {
            1 => 0,
            2 => 1,
            _ => 2,
        };
        match (swiglu, vector, norm) {
            (false, false, false) => &mk.group_scalar,
            (false, false, true) => &mk.group_norm_scalar,
            (false, true, false) => &mk.group[ri],
            (false, true, true) => &mk.group_norm[ri],
            (true, false, false) => &mk.swiglu_scalar,
            (true, false, true) => &mk.swiglu_norm_scalar,
            (true, true, false) => &mk.swiglu[ri],
            (true, true, true) => &mk.swiglu_norm[ri],
        }
    }

    /// One launch of `y_i[t] = W_i · x[t] (+ b_i) (+ y_i)` for every item, t < m ≤ 4; with
    /// `norm`, x[t] is first RMS-normalised (weight, eps) inside the same pass.
    fn matvec_group(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &[(&CudaMatrix, Option<&CudaBuffer>, u64)],
        accumulate: bool,
        norm: Option<(&CudaBuffer, f32)>,
        refine: &[Option<RefineOperand>],
    ) -> Result<()> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        match first.0.inner.codes {
            Codes::Float => {}
            Codes::Group(_) => return self.group_matvec(x, m, items, accumulate, norm, refine),
            Codes::Coded(_) => return self.coded_matvec(x, m, items, accumulate, norm),
            Codes::Trellis(_) => {
                return self.trellis_matvec(x, m, items, accumulate, norm, refine);
            }
        }
        if refine.iter().any(Option::is_some) {
            return Err(RuntimeError::Unsupported(
                "a fused refinement reached a matvec of float weights".into(),
            ));
        }
        let (cols, dtype) = (first.0.inner.cols, first.0.inner.dtype);
        let elems = if dtype == DType::BF16 { 8 } else { 4 };
        let vector = cols.is_multiple_of(elems);
        let min_rows = items.iter().map(|it| it.0.inner.rows).min().unwrap_or(1);
        let r = if vector {
            self.matvec_rows_per_block(min_rows)
        } else {
            1
        };
        let kernel = self.matvec_kernel(dtype, vector, r, norm.is_some(), false);
        let mut group = MatvecGroup::default();
        let mut end = 0usize;
        for (slot, (w, bias, y)) in group.item.iter_mut().zip(items) {
            end += w.inner.rows.div_ceil(r);
            *slot = MatvecItem {
                w: w.inner.mem.ptr,
                bias: bias.map_or(0, |b| b.mem.ptr),
                y: *y,
                rows: i32_of("matvec", w.inner.rows)?,
                block_end: i32_of("matvec", end)?,
            };
        }
        group.count = items.len() as i32;
        let cols = i32_of("matvec", cols)?;
        let mut args = match norm {
            None => vec![
                Arg::Group(group),
                Arg::Ptr(x.mem.ptr),
                Arg::I32(cols),
                Arg::I32(accumulate as i32),
            ],
            Some((w, eps)) => vec![
                Arg::Group(group),
                Arg::Ptr(x.mem.ptr),
                Arg::Ptr(w.mem.ptr),
                Arg::F32(eps),
                Arg::I32(cols),
            ],
        };
        self.launch_projection(
            kernel,
            (end as u32, m as u32, 1),
            (MV_THREADS, 1, 1),
            0,
            &mut args,
        )
    }

    /// The fused-SwiGLU matvec (m ≤ 4), optionally with the input norm fused too.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_launch(
        &self,
        x: &CudaBuffer,
        m: usize,
        g: &MatrixData,
        u: &MatrixData,
        gate: &mut CudaBuffer,
        norm: Option<(&CudaBuffer, f32)>,
    ) -> Result<()> {
        match g.codes {
            Codes::Float => {}
            Codes::Group(_) => return self.group_swiglu(x, m, g, u, gate, norm, None),
            Codes::Trellis(_) => return self.trellis_swiglu(x, m, g, u, gate, norm, None),
            Codes::Coded(_) => return self.coded_swiglu(x, m, g, u, gate, norm),
        }
        let elems = if g.dtype == DType::BF16 { 8 } else { 4 };
        let vector = g.cols.is_multiple_of(elems);
        // A block reads R gate and R up rows in one pass: R = 2 keeps 8 loads in flight per
        // thread, as R = 4 does for single projections.
        let r = if vector {
            self.inner
                .matvec_rows
                .unwrap_or_else(|| self.matvec_rows_per_block(g.rows).min(2))
        } else {
            1
        };
        let kernel = self.matvec_kernel(g.dtype, vector, r, norm.is_some(), true);
        let (rows, cols) = (i32_of("swiglu", g.rows)?, i32_of("swiglu", g.cols)?);
        let mut args = vec![
            Arg::Ptr(g.mem.ptr),
            Arg::Ptr(u.mem.ptr),
            Arg::Ptr(x.mem.ptr),
        ];
        if let Some((w, eps)) = norm {
            args.push(Arg::Ptr(w.mem.ptr));
            args.push(Arg::F32(eps));
        }
        args.extend([Arg::Ptr(gate.mem.ptr), Arg::I32(rows), Arg::I32(cols)]);
        self.launch_projection(
            kernel,
            (blocks(g.rows, r), m as u32, 1),
            (MV_THREADS, 1, 1),
            0,
            &mut args,
        )
    }

    /// The kernels' refinement operands of `items` (one decode row, group codes: the launch
    /// applies them); none otherwise.
    fn refine_operands(
        &self,
        m: usize,
        items: &[GroupItem<'_, Self>],
    ) -> Result<Vec<Option<RefineOperand>>> {
        items
            .iter()
            .map(|it| match &it.refine {
                Some(r) if m == 1 && kernels_take_refinement(it.weight) => {
                    let w = &it.weight.inner;
                    RefineOperand::of(r, w.rows, w.cols).map(Some)
                }
                _ => Ok(None),
            })
            .collect()
    }

    /// Adds the refinements a launch of `items` could not apply itself (other formats, or
    /// more than one row) by separate ops.
    fn apply_unfused_refinements(
        &self,
        x: &CudaBuffer,
        m: usize,
        norm: Option<(&CudaBuffer, f32)>,
        items: &mut [GroupItem<'_, Self>],
    ) -> Result<()> {
        for it in items.iter_mut() {
            if let Some(r) = &it.refine {
                if m != 1 || !kernels_take_refinement(it.weight) {
                    let row_len = it.weight.inner.cols;
                    crate::backend::refine::apply_fused_columns(self, x, row_len, norm, r, it.out)?;
                }
            }
        }
        Ok(())
    }

    /// Whether the fused matvec path takes these items at m rows.
    fn fusable(&self, m: usize, items: &[GroupItem<'_, Self>]) -> bool {
        (1..=MATVEC_MAX_TOKENS).contains(&m)
            && items.len() <= 3
            && !items.is_empty()
            && items
                .windows(2)
                .all(|p| p[0].weight.inner.same_format(&p[1].weight.inner))
    }

    /// `y[m, n] = x[m, k] · wᵀ (+ bias) (+ y)` for m > 4: cuBLAS on tensor cores (BF16
    /// operands, activations rounded to BF16; F32 weights in exact FP32), else our kernel.
    fn gemm(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: WeightRef,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let Some(blas) = &self.inner.blas else {
            let kernel = if w.dtype == DType::BF16 {
                &self.k().gemm_bf16
            } else {
                &self.k().gemm_f32
            };
            return self.launch(
                kernel,
                (blocks(n, 64), blocks(m, 64), 1),
                (16, 16, 1),
                0,
                &mut [
                    Arg::Ptr(x.mem.ptr),
                    Arg::Ptr(w.ptr),
                    Arg::Ptr(bias.map_or(0, |b| b.mem.ptr)),
                    Arg::Ptr(y.mem.ptr),
                    Arg::I32(i32_of("gemm", m)?),
                    Arg::I32(i32_of("gemm", n)?),
                    Arg::I32(i32_of("gemm", k)?),
                    Arg::I32(accumulate as i32),
                ],
            );
        };
        let beta = if accumulate { 1.0 } else { 0.0 };
        if w.dtype == DType::BF16 {
            let len = m * k;
            let mut scratch = self
                .inner
                .gemm_scratch
                .lock()
                .map_err(|_| RuntimeError::Unsupported("GEMM scratch poisoned".into()))?;
            if scratch.as_ref().is_none_or(|s| s.bytes < 2 * len) {
                *scratch = Some(self.dev().alloc(2 * len)?);
            }
            let xb = scratch.as_ref().map_or(0, |s| s.ptr);
            self.launch(
                &self.k().f32_to_bf16,
                (blocks(len, 256), 1, 1),
                (256, 1, 1),
                0,
                &mut [Arg::Ptr(x.mem.ptr), Arg::Ptr(xb), Arg::U64(len as u64)],
            )?;
            blas.gemm_xwt(GemmType::Bf16, xb, w.ptr, y.mem.ptr, m, n, k, beta)?;
        } else {
            let ty = if w.tf32 {
                GemmType::Tf32
            } else {
                GemmType::F32
            };
            blas.gemm_xwt(ty, x.mem.ptr, w.ptr, y.mem.ptr, m, n, k, beta)?;
        }
        if let Some(b) = bias {
            let total = m * n;
            self.launch(
                &self.k().add_bias_rows,
                (blocks(total, 256), 1, 1),
                (256, 1, 1),
                0,
                &mut [
                    Arg::Ptr(y.mem.ptr),
                    Arg::Ptr(b.mem.ptr),
                    Arg::U64(total as u64),
                    Arg::I32(i32_of("gemm", n)?),
                ],
            )?;
        }
        Ok(())
    }

    fn check_matmul(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &CudaMatrix,
        bias: Option<&CudaBuffer>,
        y: &CudaBuffer,
    ) -> Result<()> {
        let (rows, cols) = (w.inner.rows, w.inner.cols);
        check_len("matmul_t", "input", x.len, m * cols)?;
        check_len("matmul_t", "output", y.len, m * rows)?;
        if let Some(b) = bias {
            check_len("matmul_t", "bias", b.len, rows)?;
        }
        Ok(())
    }

    /// Warps per decode-attention block whose shared memory fits, and the bytes it takes.
    fn decode_smem(&self, d: usize, elem: usize) -> Result<(u32, usize)> {
        // Queries, per warp one K and one V tile of 32 padded rows, then the step's new rows
        // (a rotated key and a value per query) as the cache stores them.
        let bytes = |warps: usize| {
            ATT_GROUP * d * 4
                + warps * 2 * 32 * (d + 16 / elem) * elem
                + ATT_MAX_QUERIES * 2 * d * elem
        };
        // Four warps measured fastest (tg128 on the 8B shape: 4 → 200, 2 → 187, 1 → 166 tok/s);
        // fewer only when a head size's key tiles do not fit.
        for warps in [4usize, 2, 1] {
            if bytes(warps) + ATT_STATIC_SMEM <= self.dev().smem_optin {
                return Ok((warps as u32, bytes(warps)));
            }
        }
        Err(RuntimeError::Unsupported(format!(
            "attention: head_dim {d} needs {} B of shared memory, this GPU allows {}",
            bytes(1),
            self.dev().smem_optin
        )))
    }

    /// Split-K decode attention (≤ ATT_MAX_QUERIES queries; shapes checked by the caller),
    /// rotating and storing `fresh` keys and values itself where given.
    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaKvStore,
        v_cache: &CudaKvStore,
        s: &AttentionShape,
        positions: &CudaIndex,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
        fresh: FreshKv,
    ) -> Result<()> {
        let d = s.kv.head_dim;
        let dpl = dpl_index(d)?;
        let ks = self.kv_dtype_kernels(k_cache.dtype);
        let elem = k_cache.dtype.size_in_bytes();
        let splits = self.decode_splits(s.kv);
        let need = self.attention_scratch_len(s.kv, s.n_heads);
        if scratch.len < need {
            return Err(RuntimeError::Shape {
                op: "attention",
                msg: format!(
                    "scratch of {} floats, the split-K decode needs {need} \
                     (attention_scratch_len)",
                    scratch.len
                ),
            });
        }
        let (warps, smem) = self.decode_smem(d, elem)?;
        let group = s.n_heads / s.kv.kv_heads;
        let per_block = if self.step_schedule(s.past) == 0 {
            1
        } else {
            group.min(ATT_GROUP)
        };
        let head_batches = group.div_ceil(per_block);
        let kernel = if per_block == 1 {
            &ks.decode_single[dpl]
        } else {
            &ks.decode[dpl]
        };
        self.launch(
            kernel,
            (
                splits as u32,
                s.kv.kv_heads as u32,
                (s.n_queries * head_batches) as u32,
            ),
            (warps * 32, 1, 1),
            smem,
            &mut [
                Arg::Ptr(q.mem.ptr),
                Arg::Ptr(k_cache.mem.ptr),
                Arg::Ptr(v_cache.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::Ptr(scratch.mem.ptr),
                Arg::Ptr(out.mem.ptr),
                Arg::I32(i32_of("attention", s.n_heads)?),
                Arg::I32(i32_of("attention", s.kv.kv_heads)?),
                Arg::I32(d as i32),
                Arg::I32(i32_of("attention", s.kv.capacity)?),
                Arg::I32(splits as i32),
                Arg::I32(ATT_MIN_CHUNK),
                Arg::I32(per_block as i32),
                Arg::FreshKv(fresh),
            ],
        )
    }

    /// Chunks of the split-K decode per (query, head): enough blocks to cover every SM about
    /// four times over the KV heads, never more than 128-key chunks of the capacity.
    fn decode_splits(&self, layout: KvLayout) -> usize {
        let target = (4 * self.dev().sm_count as usize).div_ceil(layout.kv_heads.max(1));
        target.clamp(1, layout.capacity.div_ceil(ATT_MIN_CHUNK as usize).max(1))
    }

    fn kv_dtype_kernels(&self, dtype: KvDtype) -> &kernels::AttentionKernels {
        match dtype {
            KvDtype::F32 => &self.k().attn_f32,
            KvDtype::F16 => &self.k().attn_f16,
        }
    }
}

/// Dims per lane index (kernels' DPL 2, 4, 8) for a head size.
fn dpl_index(d: usize) -> Result<usize> {
    if d == 0 || !d.is_multiple_of(8) || d > 256 {
        return Err(RuntimeError::Unsupported(format!(
            "attention: head_dim {d} (the CUDA kernels take multiples of 8 up to 256)"
        )));
    }
    Ok(match d {
        0..=64 => 0,
        65..=128 => 1,
        _ => 2,
    })
}

/// Whether `w`'s decode launches apply a [`FusedColumns`] themselves: group codes (the
/// matvec's epilogue) and trellis codes (the output transform's launch), not float weights,
/// look-up-table codes or GGUF blocks (their refinement runs in launches of its own).
fn kernels_take_refinement(w: &CudaMatrix) -> bool {
    matches!(w.inner.codes, Codes::Group(_) | Codes::Trellis(_))
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Matrix = CudaMatrix;
    type Index = CudaIndex;
    type KvStore = CudaKvStore;
    type ByteStore = CudaByteStore;
    type Graph = CudaGraph;

    fn name(&self) -> String {
        let d = self.dev();
        format!(
            "cuda ({}, sm_{}{}, {} SMs, {})",
            d.name,
            d.compute.0,
            d.compute.1,
            d.sm_count,
            match &self.inner.blas {
                Some(b) => format!("cuBLAS {}", b.version),
                None => "own GEMM".into(),
            }
        )
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // Binding fails only for a destroyed context; the ops report that themselves.
        let _ = self.dev().bind();
        f()
    }

    fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        Ok(CudaBuffer {
            mem: self.dev().alloc_zeroed(len * 4)?,
            len,
        })
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuffer> {
        let mem = self.dev().upload_new(bytemuck::cast_slice(host))?;
        Ok(CudaBuffer {
            mem,
            len: host.len(),
        })
    }

    fn download(&self, buf: &CudaBuffer, out: &mut [f32]) -> Result<()> {
        check_len("download", "destination", out.len(), buf.len)?;
        self.dev()
            .download_bytes(bytemuck::cast_slice_mut(out), buf.mem.ptr)
    }

    fn buffer_len(&self, buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn upload_into(&self, buf: &mut CudaBuffer, host: &[f32]) -> Result<()> {
        check_len("upload_into", "source", host.len(), buf.len)?;
        self.dev()
            .upload_bytes(buf.mem.ptr, bytemuck::cast_slice(host))
    }

    fn alloc_index(&self, len: usize) -> Result<CudaIndex> {
        Ok(CudaIndex {
            mem: self.dev().alloc_zeroed(len * 4)?,
            staging: PinnedMem::new(self.dev(), len * 4)?,
            len,
        })
    }

    fn write_index(&self, idx: &mut CudaIndex, values: &[u32]) -> Result<()> {
        check_len("write_index", "values", values.len(), idx.len)?;
        // From pageable memory: the driver copies it out before returning, so consecutive
        // writes never race the way a reused staging area would.
        self.dev()
            .upload_bytes(idx.mem.ptr, bytemuck::cast_slice(values))
    }

    fn stage_index(&self, idx: &mut CudaIndex, values: &[u32]) -> Result<()> {
        check_len("stage_index", "values", values.len(), idx.len)?;
        self.dev().before_staging_write()?;
        idx.staging.as_mut_slice()[..values.len() * 4]
            .copy_from_slice(bytemuck::cast_slice(values));
        Ok(())
    }

    fn upload_staged_index(&self, idx: &CudaIndex) -> Result<()> {
        idx.staging.copy_to_device(idx.mem.ptr, idx.len * 4)
    }

    fn download_index(&self, idx: &CudaIndex, out: &mut [u32]) -> Result<()> {
        check_len("download_index", "destination", out.len(), idx.len)?;
        self.dev()
            .download_bytes(bytemuck::cast_slice_mut(out), idx.mem.ptr)
    }

    fn upload_matrix(
        &self,
        name: &str,
        view: &TensorView<'_>,
        precision: WeightPrecision,
    ) -> Result<CudaMatrix> {
        let &[rows, cols] = view.shape else {
            return Err(RuntimeError::Shape {
                op: "upload_matrix",
                msg: format!(
                    "tensor '{name}' has shape {:?}, expected 2 dimensions",
                    view.shape
                ),
            });
        };
        let dtype = precision.resident_dtype(view.dtype);
        let mem = match dtype {
            DType::BF16 => {
                let bits: Vec<u16> = view
                    .to_bf16_vec()
                    .into_iter()
                    .map(|v| v.to_bits())
                    .collect();
                self.dev().upload_new(bytemuck::cast_slice(&bits))?
            }
            _ => self
                .dev()
                .upload_new(bytemuck::cast_slice(&view.to_f32_vec()))?,
        };
        Ok(CudaMatrix {
            inner: Arc::new(MatrixData {
                mem,
                rows,
                cols,
                dtype: if dtype == DType::BF16 {
                    DType::BF16
                } else {
                    DType::F32
                },
                codes: Codes::Float,
            }),
        })
    }

    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        dtype: DType,
        seed: u64,
        scale: f32,
    ) -> Result<CudaMatrix> {
        let n = rows.checked_mul(cols).ok_or_else(|| RuntimeError::Shape {
            op: "random_matrix",
            msg: format!("{rows} × {cols} overflows"),
        })?;
        let (kernel, elem) = match dtype {
            DType::BF16 => (&self.k().fill_random_bf16, 2),
            DType::F32 => (&self.k().fill_random_f32, 4),
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "random_matrix: {} weights (BF16 and F32 only)",
                    other.as_str()
                )))
            }
        };
        let mem = self.dev().alloc(n * elem)?;
        let grid = blocks(n, 256).min(self.dev().sm_count * 64).max(1);
        self.launch(
            kernel,
            (grid, 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(mem.ptr),
                Arg::U64(n as u64),
                Arg::U64(seed),
                Arg::F32(scale),
            ],
        )?;
        Ok(CudaMatrix {
            inner: Arc::new(MatrixData {
                mem,
                rows,
                cols,
                dtype,
                codes: Codes::Float,
            }),
        })
    }

    fn matrix_dims(&self, w: &CudaMatrix) -> (usize, usize) {
        (w.inner.rows, w.inner.cols)
    }

    fn matrix_dtype(&self, w: &CudaMatrix) -> DType {
        w.inner.dtype
    }

    fn alloc_kv(&self, len: usize, dtype: KvDtype) -> Result<CudaKvStore> {
        Ok(CudaKvStore {
            mem: self.dev().alloc_zeroed(len * dtype.size_in_bytes())?,
            len,
            dtype,
        })
    }

    fn upload_kv(&self, host: &[f32], dtype: KvDtype) -> Result<CudaKvStore> {
        let mem = self.dev().alloc(host.len() * dtype.size_in_bytes())?;
        match dtype {
            KvDtype::F32 => self
                .dev()
                .upload_bytes(mem.ptr, bytemuck::cast_slice(host))?,
            KvDtype::F16 => {
                let h: Vec<u16> = host
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                self.dev().upload_bytes(mem.ptr, bytemuck::cast_slice(&h))?;
            }
        }
        Ok(CudaKvStore {
            mem,
            len: host.len(),
            dtype,
        })
    }

    fn upload_byte_store(&self, bytes: &[u8]) -> Result<CudaByteStore> {
        self.upload_tiles(bytes)
    }

    fn alloc_byte_store(&self, len: usize) -> Result<CudaByteStore> {
        Ok(CudaByteStore {
            mem: kvarn::TileMem::Device(self.dev().alloc_zeroed(len)?),
            len,
        })
    }

    fn alloc_host_byte_store(&self, len: usize) -> Result<CudaByteStore> {
        Ok(CudaByteStore {
            mem: kvarn::TileMem::Mapped(device::MappedMem::new(self.dev(), len)?),
            len,
        })
    }

    fn write_byte_store(
        &self,
        tiles: &mut CudaByteStore,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        crate::backend::kvarn::tile_range_check(
            "write_byte_store",
            tiles.len,
            offset,
            bytes.len(),
        )?;
        match &mut tiles.mem {
            kvarn::TileMem::Device(m) => self.dev().upload_bytes(m.ptr + offset as u64, bytes),
            kvarn::TileMem::Mapped(m) => {
                m.settled_mut()?[offset..offset + bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
        }
    }

    fn read_byte_store(&self, tiles: &CudaByteStore, offset: usize, out: &mut [u8]) -> Result<()> {
        crate::backend::kvarn::tile_range_check("read_byte_store", tiles.len, offset, out.len())?;
        match &tiles.mem {
            kvarn::TileMem::Device(m) => self.dev().download_bytes(out, m.ptr + offset as u64),
            kvarn::TileMem::Mapped(m) => {
                out.copy_from_slice(&m.settled()?[offset..offset + out.len()]);
                Ok(())
            }
        }
    }

    fn hadamard_rows(&self, x: &mut CudaBuffer, row_len: usize) -> Result<()> {
        self.hadamard_rows_kernel(x, row_len)
    }

    fn kvarn_attention(
        &self,
        q: &CudaBuffer,
        layer: &KvarnLayer<'_, Self>,
        shape: &KvarnShape,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.kvarn_attention_kernel(q, layer, shape, scratch, out)
    }

    fn kvarn_scratch_len(&self, shape: &KvarnShape) -> usize {
        self.kvarn_scratch(shape)
    }

    fn kvarn_decode(
        &self,
        q: &CudaBuffer,
        k: &CudaBuffer,
        v: &CudaBuffer,
        layer: KvarnLayerMut<'_, Self>,
        shape: &KvarnShape,
        positions: &CudaIndex,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.kvarn_decode_kernels(q, k, v, layer, shape, positions, scratch, out)
    }

    fn download_kv(&self, kv: &CudaKvStore, out: &mut [f32]) -> Result<()> {
        check_len("download_kv", "destination", out.len(), kv.len)?;
        match kv.dtype {
            KvDtype::F32 => self
                .dev()
                .download_bytes(bytemuck::cast_slice_mut(out), kv.mem.ptr),
            KvDtype::F16 => {
                let mut h = vec![0u16; kv.len];
                self.dev()
                    .download_bytes(bytemuck::cast_slice_mut(&mut h), kv.mem.ptr)?;
                for (o, b) in out.iter_mut().zip(h) {
                    *o = half::f16::from_bits(b).to_f32();
                }
                Ok(())
            }
        }
    }

    fn embedding(
        &self,
        table: &CudaMatrix,
        tokens: &CudaIndex,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let cols = table.inner.cols;
        check_len("embedding", "output", out.len, tokens.len * cols)?;
        if cols == 0 || tokens.len == 0 {
            return Ok(());
        }
        match table.inner.codes {
            Codes::Float => {}
            Codes::Group(_) => return self.group_gather(&table.inner, tokens, out),
            Codes::Coded(_) => return self.coded_gather(&table.inner, tokens, out),
            Codes::Trellis(_) => {
                return Err(RuntimeError::Unsupported(
                    "embedding: trellis-coded tables have no row gather (the converter keeps \
                     embeddings float or group-coded)"
                        .into(),
                ))
            }
        }
        let kernel = if table.inner.dtype == DType::BF16 {
            &self.k().embedding_bf16
        } else {
            &self.k().embedding_f32
        };
        self.launch(
            kernel,
            (blocks(cols, 256), tokens.len as u32, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(table.inner.mem.ptr),
                Arg::Ptr(tokens.mem.ptr),
                Arg::Ptr(out.mem.ptr),
                Arg::I32(i32_of("embedding", cols)?),
                Arg::I32(i32_of("embedding", table.inner.rows)?),
            ],
        )
    }

    fn matmul_t(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &CudaMatrix,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        out: MatmulOut,
    ) -> Result<()> {
        self.check_matmul(x, m, w, bias, y)?;
        if m == 0 || w.inner.rows == 0 {
            return Ok(());
        }
        let accumulate = out == MatmulOut::Accumulate;
        if m <= MATVEC_MAX_TOKENS {
            self.matvec_group(x, m, &[(w, bias, y.mem.ptr)], accumulate, None, &[])
        } else {
            match &w.inner.codes {
                Codes::Group(_) => self.group_gemm(x, m, &w.inner, bias, y, accumulate),
                Codes::Trellis(_) => self.trellis_gemm(x, m, &w.inner, bias, y, accumulate),
                Codes::Coded(_) => self.coded_gemm(x, m, &w.inner, bias, y, accumulate),
                Codes::Float => self.gemm(x, m, w.inner.weight_ref(), bias, y, accumulate),
            }
        }
    }

    fn matmul_t_group(
        &self,
        x: &CudaBuffer,
        m: usize,
        items: &mut [GroupItem<'_, Self>],
    ) -> Result<()> {
        for it in items.iter() {
            self.check_matmul(x, m, it.weight, it.bias, it.out)?;
        }
        if m == 0 {
            return Ok(());
        }
        if self.fusable(m, items) {
            let list: Vec<(&CudaMatrix, Option<&CudaBuffer>, u64)> = items
                .iter()
                .map(|it| (it.weight, it.bias, it.out.mem.ptr))
                .collect();
            let refine = self.refine_operands(m, items)?;
            self.matvec_group(x, m, &list, false, None, &refine)?;
            return self.apply_unfused_refinements(x, m, None, items);
        }
        for it in items.iter_mut() {
            self.matmul_t(x, m, it.weight, it.bias, it.out, MatmulOut::Store)?;
            if let Some(r) = &it.refine {
                let row_len = it.weight.inner.cols;
                crate::backend::refine::apply_fused_columns(self, x, row_len, None, r, it.out)?;
            }
        }
        Ok(())
    }

    fn matmul_t_swiglu(
        &self,
        x: &CudaBuffer,
        m: usize,
        w_gate: &CudaMatrix,
        w_up: &CudaMatrix,
        gate: &mut CudaBuffer,
        up: &mut CudaBuffer,
    ) -> Result<()> {
        self.check_matmul(x, m, w_gate, None, gate)?;
        self.check_matmul(x, m, w_up, None, up)?;
        let (g, u) = (&w_gate.inner, &w_up.inner);
        let fused = m <= MATVEC_MAX_TOKENS && g.rows == u.rows && g.same_format(u) && g.cols > 0;
        if !fused {
            self.matmul_t(x, m, w_gate, None, gate, MatmulOut::Store)?;
            self.matmul_t(x, m, w_up, None, up, MatmulOut::Store)?;
            return self.silu_mul(gate, up);
        }
        if m == 0 || g.rows == 0 {
            return Ok(());
        }
        self.swiglu_launch(x, m, g, u, gate, None)
    }

    fn rms_norm_matmul_group(
        &self,
        x: &CudaBuffer,
        norm: &CudaBuffer,
        eps: f32,
        normed: &mut CudaBuffer,
        m: usize,
        items: &mut [GroupItem<'_, Self>],
    ) -> Result<()> {
        let rows = check_rows("rms_norm_matmul_group", "input", x.len, norm.len)?;
        check_len("rms_norm_matmul_group", "normed", normed.len, x.len)?;
        let vector_norm = norm.len.is_multiple_of(8);
        if self.inner.fuse_norm && rows == m && vector_norm && self.fusable(m, items) {
            for it in items.iter() {
                self.check_matmul(x, m, it.weight, it.bias, it.out)?;
            }
            let list: Vec<(&CudaMatrix, Option<&CudaBuffer>, u64)> = items
                .iter()
                .map(|it| (it.weight, it.bias, it.out.mem.ptr))
                .collect();
            let refine = self.refine_operands(m, items)?;
            self.matvec_group(x, m, &list, false, Some((norm, eps)), &refine)?;
            return self.apply_unfused_refinements(x, m, Some((norm, eps)), items);
        }
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul_t_group(normed, m, items)
    }

    fn rms_norm_swiglu(
        &self,
        x: &CudaBuffer,
        norm: &CudaBuffer,
        eps: f32,
        normed: &mut CudaBuffer,
        m: usize,
        w_gate: &CudaMatrix,
        w_up: &CudaMatrix,
        gate: &mut CudaBuffer,
        up: &mut CudaBuffer,
    ) -> Result<()> {
        let rows = check_rows("rms_norm_swiglu", "input", x.len, norm.len)?;
        check_len("rms_norm_swiglu", "normed", normed.len, x.len)?;
        self.check_matmul(x, m, w_gate, None, gate)?;
        self.check_matmul(x, m, w_up, None, up)?;
        let (g, u) = (&w_gate.inner, &w_up.inner);
        let fused = self.inner.fuse_norm
            && rows == m
            && (1..=MATVEC_MAX_TOKENS).contains(&m)
            && norm.len.is_multiple_of(8)
            && g.rows == u.rows
            && g.same_format(u)
            && g.rows > 0;
        if fused {
            return self.swiglu_launch(x, m, g, u, gate, Some((norm, eps)));
        }
        self.rms_norm(x, norm, eps, normed)?;
        self.matmul_t_swiglu(normed, m, w_gate, w_up, gate, up)
    }

    fn fuses_refinement(&self, w: &CudaMatrix) -> bool {
        self.inner.fused_refinement && kernels_take_refinement(w)
    }

    fn matmul_t_refined(
        &self,
        x: &CudaBuffer,
        m: usize,
        w: &CudaMatrix,
        bias: Option<&CudaBuffer>,
        y: &mut CudaBuffer,
        out: MatmulOut,
        refine: Option<&FusedColumns<'_, Self>>,
        lagged: &[&CudaBuffer],
    ) -> Result<()> {
        self.check_matmul(x, m, w, bias, y)?;
        if m != 1 || !kernels_take_refinement(w) || lagged.len() > 2 {
            self.matmul_t(x, m, w, bias, y, out)?;
            if let Some(r) = refine {
                let row_len = w.inner.cols;
                crate::backend::refine::apply_fused_columns(self, x, row_len, None, r, y)?;
            }
            for l in lagged {
                self.add_assign(y, l)?;
            }
            return Ok(());
        }
        let (rows, cols) = (w.inner.rows, w.inner.cols);
        let op = match refine {
            Some(r) => RefineOperand::of(r, rows, cols)?,
            None => RefineOperand::default(),
        }
        .with_lagged(lagged, rows)?;
        let accumulate = out == MatmulOut::Accumulate;
        self.matvec_group(x, m, &[(w, bias, y.mem.ptr)], accumulate, None, &[Some(op)])
    }

    fn rms_norm_swiglu_refined(
        &self,
        x: &CudaBuffer,
        norm: &CudaBuffer,
        eps: f32,
        normed: &mut CudaBuffer,
        m: usize,
        w_gate: &CudaMatrix,
        w_up: &CudaMatrix,
        gate: &mut CudaBuffer,
        up: &mut CudaBuffer,
        refine: [&FusedColumns<'_, Self>; 2],
    ) -> Result<()> {
        let rows = check_rows("rms_norm_swiglu_refined", "input", x.len, norm.len)?;
        check_len("rms_norm_swiglu_refined", "normed", normed.len, x.len)?;
        self.check_matmul(x, m, w_gate, None, gate)?;
        self.check_matmul(x, m, w_up, None, up)?;
        let (g, u) = (&w_gate.inner, &w_up.inner);
        let fused = m == 1
            && rows == 1
            && kernels_take_refinement(w_gate)
            && g.rows == u.rows
            && g.same_format(u)
            && g.rows > 0;
        if !fused {
            return crate::backend::refine::swiglu_refined_by_ops(
                self, x, norm, eps, normed, m, w_gate, w_up, gate, up, refine,
            );
        }
        let ops = [
            RefineOperand::of(refine[0], g.rows, g.cols)?,
            RefineOperand::of(refine[1], u.rows, u.cols)?,
        ];
        // The norm fuses into the launch where the kernels take it, as rms_norm_swiglu does.
        let (input, fused_norm) = if self.inner.fuse_norm && norm.len.is_multiple_of(8) {
            (x, Some((norm, eps)))
        } else {
            self.rms_norm(x, norm, eps, normed)?;
            (&*normed, None)
        };
        match g.codes {
            Codes::Trellis(_) => self.trellis_swiglu(input, m, g, u, gate, fused_norm, Some(ops)),
            _ => self.group_swiglu(input, m, g, u, gate, fused_norm, Some(ops)),
        }
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let rows = check_rows("rms_norm", "input", x.len, weight.len)?;
        check_len("rms_norm", "output", out.len, x.len)?;
        self.rms_norm_launch(x.mem.ptr, weight, eps, out.mem.ptr, rows)
    }

    fn rms_norm_in_place(&self, x: &mut CudaBuffer, weight: &CudaBuffer, eps: f32) -> Result<()> {
        let rows = check_rows("rms_norm_in_place", "input", x.len, weight.len)?;
        self.rms_norm_launch(x.mem.ptr, weight, eps, x.mem.ptr, rows)
    }

    fn rope(
        &self,
        x: &mut CudaBuffer,
        n_heads: usize,
        head_dim: usize,
        table: &RopeTable<Self>,
        positions: &CudaIndex,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || table.half != head_dim / 2 {
            return Err(RuntimeError::Shape {
                op: "rope",
                msg: format!("head_dim {head_dim} with a table of {} pairs", table.half),
            });
        }
        let n = check_rows("rope", "input", x.len, n_heads * head_dim)?;
        check_len("rope", "positions", positions.len, n)?;
        let half = table.half;
        let threads = half.div_ceil(32).clamp(1, 8) as u32 * 32;
        self.launch(
            &self.k().rope,
            (n_heads as u32, n as u32, 1),
            (threads, 1, 1),
            0,
            &mut [
                Arg::Ptr(x.mem.ptr),
                Arg::Ptr(table.cos.mem.ptr),
                Arg::Ptr(table.sin.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::I32(i32_of("rope", n_heads)?),
                Arg::I32(i32_of("rope", half)?),
                Arg::I32(i32_of("rope", table.positions)?),
            ],
        )
    }

    fn rope_qk(
        &self,
        q: &mut CudaBuffer,
        n_heads: usize,
        k: &mut CudaBuffer,
        kv_heads: usize,
        head_dim: usize,
        table: &RopeTable<Self>,
        positions: &CudaIndex,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || table.half != head_dim / 2 {
            return Err(RuntimeError::Shape {
                op: "rope_qk",
                msg: format!("head_dim {head_dim} with a table of {} pairs", table.half),
            });
        }
        let n = check_rows("rope_qk", "queries", q.len, n_heads * head_dim)?;
        check_len("rope_qk", "keys", k.len, n * kv_heads * head_dim)?;
        check_len("rope_qk", "positions", positions.len, n)?;
        let half = table.half;
        let threads = half.div_ceil(32).clamp(1, 8) as u32 * 32;
        self.launch(
            &self.k().rope_qk,
            ((n_heads + kv_heads) as u32, n as u32, 1),
            (threads, 1, 1),
            0,
            &mut [
                Arg::Ptr(q.mem.ptr),
                Arg::Ptr(k.mem.ptr),
                Arg::Ptr(table.cos.mem.ptr),
                Arg::Ptr(table.sin.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::I32(i32_of("rope_qk", n_heads)?),
                Arg::I32(i32_of("rope_qk", kv_heads)?),
                Arg::I32(i32_of("rope_qk", half)?),
                Arg::I32(i32_of("rope_qk", table.positions)?),
            ],
        )
    }

    fn write_kv(
        &self,
        k: &CudaBuffer,
        v: &CudaBuffer,
        k_cache: &mut CudaKvStore,
        v_cache: &mut CudaKvStore,
        layout: KvLayout,
        positions: &CudaIndex,
    ) -> Result<()> {
        let row = layout.kv_heads * layout.head_dim;
        let n = check_rows("write_kv", "keys", k.len, row)?;
        check_len("write_kv", "values", v.len, k.len)?;
        check_len("write_kv", "key cache", k_cache.len, layout.buffer_len())?;
        check_len("write_kv", "value cache", v_cache.len, layout.buffer_len())?;
        check_len("write_kv", "positions", positions.len, n)?;
        if k_cache.dtype != v_cache.dtype {
            return Err(RuntimeError::Shape {
                op: "write_kv",
                msg: "key and value caches of different dtypes".into(),
            });
        }
        let kernel = match k_cache.dtype {
            KvDtype::F32 => &self.k().write_kv_f32,
            KvDtype::F16 => &self.k().write_kv_f16,
        };
        let threads = layout.head_dim.div_ceil(32).clamp(1, 8) as u32 * 32;
        self.launch(
            kernel,
            (layout.kv_heads as u32, n as u32, 1),
            (threads, 1, 1),
            0,
            &mut [
                Arg::Ptr(k.mem.ptr),
                Arg::Ptr(v.mem.ptr),
                Arg::Ptr(k_cache.mem.ptr),
                Arg::Ptr(v_cache.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::I32(i32_of("write_kv", layout.kv_heads)?),
                Arg::I32(i32_of("write_kv", layout.head_dim)?),
                Arg::I32(i32_of("write_kv", layout.capacity)?),
            ],
        )
    }

    fn attention_scratch_len(&self, layout: KvLayout, n_heads: usize) -> usize {
        // Partials, then one ticket counter per (query, head).
        ATT_MAX_QUERIES * n_heads * self.decode_splits(layout) * (layout.head_dim + 2)
            + ATT_MAX_QUERIES * n_heads
    }

    fn step_schedule(&self, past: usize) -> u32 {
        u32::from(past >= ATT_SHORT_CONTEXT)
    }

    fn rope_write_kv_attention(
        &self,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: &CudaBuffer,
        table: &RopeTable<Self>,
        k_cache: &mut CudaKvStore,
        v_cache: &mut CudaKvStore,
        shape: &AttentionShape,
        positions: &CudaIndex,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let s = shape;
        let d = s.kv.head_dim;
        // One launch for decode steps on sm_80+ (the kernels copy rows they just wrote with
        // cp.async); prefill and the rest run the three ops.
        if !self.inner.fused_attention
            || s.n_queries == 0
            || s.n_queries > ATT_MAX_QUERIES
            || k_cache.dtype != v_cache.dtype
        {
            return rope_write_kv_attention_unfused(
                self, q, k, v, table, k_cache, v_cache, s, positions, scratch, out,
            );
        }
        s.check(q.len, out.len, k_cache.len, v_cache.len)?;
        if !d.is_multiple_of(2) || table.half != d / 2 {
            return Err(RuntimeError::Shape {
                op: "rope_write_kv_attention",
                msg: format!("head_dim {d} with a table of {} pairs", table.half),
            });
        }
        check_len(
            "rope_write_kv_attention",
            "positions",
            positions.len,
            s.n_queries,
        )?;
        let row = s.kv.kv_heads * d;
        check_len("rope_write_kv_attention", "keys", k.len, s.n_queries * row)?;
        check_len(
            "rope_write_kv_attention",
            "values",
            v.len,
            s.n_queries * row,
        )?;
        let fresh = FreshKv {
            k: k.mem.ptr,
            v: v.mem.ptr,
            cos: table.cos.mem.ptr,
            sin: table.sin.mem.ptr,
            n_new: s.n_queries as i32,
            table_positions: i32_of("rope_write_kv_attention", table.positions)?,
        };
        self.decode_attention(q, k_cache, v_cache, s, positions, scratch, out, fresh)
    }

    fn attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaKvStore,
        v_cache: &CudaKvStore,
        shape: &AttentionShape,
        positions: &CudaIndex,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let s = shape;
        s.check(q.len, out.len, k_cache.len, v_cache.len)?;
        let d = s.kv.head_dim;
        let dpl = dpl_index(d)?;
        check_len("attention", "positions", positions.len, s.n_queries)?;
        if s.n_queries == 0 {
            return Ok(());
        }
        let ks = self.kv_dtype_kernels(k_cache.dtype);
        let (cap, heads, kvh) = (
            i32_of("attention", s.kv.capacity)?,
            i32_of("attention", s.n_heads)?,
            i32_of("attention", s.kv.kv_heads)?,
        );
        if s.n_queries <= ATT_MAX_QUERIES {
            return self.decode_attention(
                q,
                k_cache,
                v_cache,
                s,
                positions,
                scratch,
                out,
                FreshKv::default(),
            );
        }
        if let (true, KvDtype::F16, Some(which)) = (
            self.inner.mma_prefill,
            k_cache.dtype,
            [64, 128].iter().position(|&h| h == d),
        ) {
            // Double-buffered K and V tiles of MMA_KEYS padded f16 rows.
            let smem = 2 * 2 * MMA_KEYS * (d + 8) * 2;
            return self.launch(
                &self.k().prefill_mma_f16[which],
                (blocks(s.n_queries, MMA_QUERIES), s.n_heads as u32, 1),
                (128, 1, 1),
                smem,
                &mut [
                    Arg::Ptr(q.mem.ptr),
                    Arg::Ptr(k_cache.mem.ptr),
                    Arg::Ptr(v_cache.mem.ptr),
                    Arg::Ptr(positions.mem.ptr),
                    Arg::Ptr(out.mem.ptr),
                    Arg::I32(i32_of("attention", s.n_queries)?),
                    Arg::I32(heads),
                    Arg::I32(kvh),
                    Arg::I32(cap),
                ],
            );
        }
        let smem = (PF_QUERIES * d + 32 * (d + 1) + 32 * d) * 4;
        if smem + ATT_STATIC_SMEM > self.dev().smem_optin {
            return Err(RuntimeError::Unsupported(format!(
                "attention: head_dim {d} needs {smem} B of shared memory for prefill, this GPU \
                 allows {}",
                self.dev().smem_optin
            )));
        }
        self.launch(
            &ks.prefill[dpl],
            (blocks(s.n_queries, PF_QUERIES), s.n_heads as u32, 1),
            (128, 1, 1),
            smem,
            &mut [
                Arg::Ptr(q.mem.ptr),
                Arg::Ptr(k_cache.mem.ptr),
                Arg::Ptr(v_cache.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::Ptr(out.mem.ptr),
                Arg::I32(i32_of("attention", s.n_queries)?),
                Arg::I32(heads),
                Arg::I32(kvh),
                Arg::I32(d as i32),
                Arg::I32(cap),
            ],
        )
    }

    fn silu_mul(&self, gate: &mut CudaBuffer, up: &CudaBuffer) -> Result<()> {
        check_len("silu_mul", "up", up.len, gate.len)?;
        self.launch(
            &self.k().silu_mul,
            (blocks(gate.len, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(gate.mem.ptr),
                Arg::Ptr(up.mem.ptr),
                Arg::U64(gate.len as u64),
            ],
        )
    }

    fn add_assign(&self, acc: &mut CudaBuffer, x: &CudaBuffer) -> Result<()> {
        check_len("add_assign", "addend", x.len, acc.len)?;
        self.launch(
            &self.k().add_assign,
            (blocks(acc.len, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(acc.mem.ptr),
                Arg::Ptr(x.mem.ptr),
                Arg::U64(acc.len as u64),
            ],
        )
    }

    fn argmax_rows(&self, x: &CudaBuffer, cols: usize, out: &mut CudaIndex) -> Result<()> {
        let rows = check_rows("argmax_rows", "input", x.len, cols)?;
        check_len("argmax_rows", "output", out.len, rows)?;
        let pv = self.inner.argmax_scratch.ptr;
        let pi = pv + (ARGMAX_ROWS * ARGMAX_PARTS * 4) as u64;
        let cols_i = i32_of("argmax_rows", cols)?;
        for r0 in (0..rows).step_by(ARGMAX_ROWS) {
            let n = (rows - r0).min(ARGMAX_ROWS);
            self.launch(
                &self.k().argmax_partial,
                (ARGMAX_PARTS as u32, n as u32, 1),
                (256, 1, 1),
                0,
                &mut [
                    Arg::Ptr(x.mem.ptr + (r0 * cols * 4) as u64),
                    Arg::Ptr(pv),
                    Arg::Ptr(pi),
                    Arg::I32(cols_i),
                ],
            )?;
            self.launch(
                &self.k().argmax_final,
                (n as u32, 1, 1),
                (32, 1, 1),
                0,
                &mut [
                    Arg::Ptr(pv),
                    Arg::Ptr(pi),
                    Arg::Ptr(out.mem.ptr + (r0 * 4) as u64),
                ],
            )?;
        }
        Ok(())
    }

    fn read_rows(
        &self,
        src: &CudaBuffer,
        row_len: usize,
        first: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let n = check_rows("read_rows", "destination", out.len(), row_len)?;
        if (first + n) * row_len > src.len {
            return Err(RuntimeError::Shape {
                op: "read_rows",
                msg: format!("rows {first}..{} exceed the source", first + n),
            });
        }
        self.dev().download_bytes(
            bytemuck::cast_slice_mut(out),
            src.mem.ptr + (first * row_len * 4) as u64,
        )
    }

    fn add_nibble_units(
        &self,
        y: &mut CudaBuffer,
        row_len: usize,
        row: usize,
        units: &[u8],
        unit_bytes: usize,
        weights: &[f32],
        scales: &[f32],
    ) -> Result<()> {
        crate::backend::check_nibble_units(
            y.len,
            row_len,
            row,
            units.len(),
            unit_bytes,
            weights.len(),
            scales.len(),
        )?;
        if weights.is_empty() || row_len == 0 {
            return Ok(());
        }
        // Host-staged operands: the device-side gather from pinned memory replaces this
        // (docs/decisions.md, "CUDA backend").
        let dev = self.dev();
        let u = dev.alloc(units.len())?;
        dev.upload_bytes(u.ptr, units)?;
        let w = dev.alloc(weights.len() * 4)?;
        dev.upload_bytes(w.ptr, bytemuck::cast_slice(weights))?;
        let sc = dev.alloc(scales.len() * 4)?;
        dev.upload_bytes(sc.ptr, bytemuck::cast_slice(scales))?;
        self.launch(
            &self.k().add_nibble_units,
            (blocks(row_len, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                Arg::Ptr(y.mem.ptr + (row * row_len * 4) as u64),
                Arg::Ptr(u.ptr),
                Arg::Ptr(w.ptr),
                Arg::Ptr(sc.ptr),
                Arg::I32(i32_of("add_nibble_units", weights.len())?),
                Arg::I32(i32_of("add_nibble_units", unit_bytes)?),
                Arg::I32(i32_of("add_nibble_units", row_len)?),
            ],
        )
    }

    fn refinement_in_backend(&self) -> bool {
        true
    }

    fn begin_branch(&self, lane: BranchLane) -> Result<()> {
        if self.inner.branches {
            self.dev().begin_branch(match lane {
                BranchLane::Near => 0,
                BranchLane::Far => 1,
                BranchLane::Lag => 2,
            })?;
        }
        Ok(())
    }

    fn branch_wait(&self, mark: BranchMark) -> Result<()> {
        if self.inner.branches {
            self.dev().branch_wait(mark.0)?;
        }
        Ok(())
    }

    fn end_branch(&self) -> Result<BranchMark> {
        if self.inner.branches {
            return self.dev().end_branch().map(BranchMark);
        }
        Ok(BranchMark(0))
    }

    fn join_branch(&self, mark: BranchMark) -> Result<()> {
        if self.inner.branches {
            self.dev().join_branch(mark.0)?;
        }
        Ok(())
    }

    fn stage_selected_units(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CudaIndex,
        selected: usize,
        targets: &mut [crate::backend::refine::StageTarget<'_, Self>],
    ) -> Result<()> {
        self.stage_selected_units_kernel(rows, row_len, sel, selected, targets)
    }

    fn gather_selected_values(
        &self,
        x: &CudaBuffer,
        row_len: usize,
        norm: Option<(&CudaBuffer, f32)>,
        sel: &CudaIndex,
        selected: usize,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        self.gather_selected_values_kernel(x, row_len, norm, sel, selected, values)
    }

    fn select_channels(
        &self,
        x: &CudaBuffer,
        row_len: usize,
        norm: Option<(&CudaBuffer, f32)>,
        k_per_1024: usize,
        sel: &mut CudaIndex,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        self.select_channels_kernel(x, row_len, norm, k_per_1024, sel, values)
    }

    fn selected_columns_scratch_len(
        &self,
        rows: usize,
        selected: usize,
        out_dims: &[usize],
    ) -> usize {
        refine::scratch_len(rows, selected, out_dims)
    }

    fn add_selected_columns(
        &self,
        rows: usize,
        row_len: usize,
        sel: &CudaIndex,
        values: &CudaBuffer,
        selected: usize,
        targets: &mut [crate::backend::refine::ColumnTarget<'_, Self>],
        scratch: &mut CudaBuffer,
    ) -> Result<()> {
        self.add_selected_columns_kernel(rows, row_len, sel, values, selected, targets, scratch)
    }

    fn copy_rows(
        &self,
        src: &CudaBuffer,
        row_len: usize,
        first: usize,
        dst: &mut CudaBuffer,
    ) -> Result<()> {
        let n = check_rows("copy_rows", "destination", dst.len, row_len)?;
        if (first + n) * row_len > src.len {
            return Err(RuntimeError::Shape {
                op: "copy_rows",
                msg: format!(
                    "rows {first}..{} exceed the source's {} rows",
                    first + n,
                    src.len / row_len
                ),
            });
        }
        self.dev().copy_device(
            dst.mem.ptr,
            src.mem.ptr + (first * row_len * 4) as u64,
            n * row_len * 4,
        )
    }

    fn synchronize(&self) -> Result<()> {
        self.dev().synchronize()
    }

    fn supports_graphs(&self) -> bool {
        true
    }

    fn begin_capture(&self) -> Result<()> {
        self.dev().begin_capture()
    }

    fn end_capture(&self) -> Result<CudaGraph> {
        Ok(CudaGraph(self.dev().end_capture()?))
    }

    fn take_kernel_times(&self) -> Result<Vec<crate::backend::KernelTime>> {
        self.dev().take_kernel_times()
    }

    fn device_memory_in_use(&self) -> Result<Option<u64>> {
        self.dev().memory_in_use().map(Some)
    }

    fn launch_graph(&self, graph: &CudaGraph) -> Result<()> {
        self.dev().launch_graph(&graph.0)
    }
}

impl CudaBackend {
    fn rms_norm_launch(
        &self,
        x: u64,
        weight: &CudaBuffer,
        eps: f32,
        out: u64,
        rows: usize,
    ) -> Result<()> {
        let cols = weight.len;
        let threads = if cols >= 2048 {
            1024
        } else if cols >= 512 {
            256
        } else {
            128
        };
        self.launch(
            &self.k().rms_norm,
            (rows as u32, 1, 1),
            (threads, 1, 1),
            0,
            &mut [
                Arg::Ptr(x),
                Arg::Ptr(weight.mem.ptr),
                Arg::Ptr(out),
                Arg::I32(i32_of("rms_norm", cols)?),
                Arg::F32(eps),
            ],
        )
    }
}

#[cfg(test)]
mod pdl_tests {
    use super::PdlPolicy;

    #[test]
    fn pdl_defaults_to_the_trellis_chain_and_follows_the_setting() {
        let on = |trellis, projections| PdlPolicy {
            trellis,
            projections,
        };
        assert_eq!(PdlPolicy::new(true, None), on(true, false));
        assert_eq!(PdlPolicy::new(true, Some("1")), on(true, true));
        assert_eq!(PdlPolicy::new(true, Some("0")), on(false, false));
        assert_eq!(PdlPolicy::new(true, Some("yes")), on(true, false));
        // Below sm_90 nothing launches with PDL, whatever the setting.
        assert_eq!(PdlPolicy::new(false, Some("1")), on(false, false));
        assert_eq!(PdlPolicy::new(false, None), on(false, false));
    }
}
