//! Group-quantized projections (RTN / AWQ codes) on the CUDA backend. Codes, f16 scales and
//! u8 zero points stay in device memory exactly as the `.sfx` file stores them (no
//! re-layout, no dequantized copy). Decode runs the group matvec (kernels/group.cu: three
//! instructions per weight); prefill dequantizes the matrix into a transient f32 panel
//! (stream-ordered allocation, freed after the GEMM) for cuBLAS's TF32 tensor-core GEMM.

use super::device::DeviceMem;
use super::{blocks, i32_of, Arg, CudaBackend, CudaBuffer, WeightRef, MATVEC_MAX_TOKENS};
use crate::backend::Backend;
use crate::error::{check_len, Result, RuntimeError};
use crate::linear::Linear;
use sfx_formats::resident::GroupQuantized;
use sfx_formats::DType;

/// Columns per thread step of the kernels (`GQ_CHUNK`), threads per block (`GQ_THREADS`).
const CHUNK: usize = 32;
const THREADS: usize = 256;

/// A group-quantized projection with an optional f32 bias, resident on a CUDA device.
pub struct CudaGroupLinear {
    codes: DeviceMem,
    scales: DeviceMem,
    zeros: DeviceMem,
    bias: Option<CudaBuffer>,
    bits: u8,
    group: usize,
    rows: usize,
    cols: usize,
    host_bytes: usize,
}

impl CudaBackend {
    /// Uploads `q` (and `bias`); `what` names the projection in errors. The kernels take
    /// 32-column chunks inside one group, so columns and the group size must be multiples of
    /// 32 (every Llama/Qwen/SmolLM size is; group 128 is the converter's default).
    pub fn upload_group_linear(
        &self,
        q: &GroupQuantized,
        bias: Option<&[f32]>,
        what: &str,
    ) -> Result<CudaGroupLinear> {
        let (rows, cols, group) = (q.rows(), q.cols(), q.group_size());
        if !cols.is_multiple_of(CHUNK) || !group.is_multiple_of(CHUNK) {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: the CUDA group kernels need columns and group size in multiples of \
                 {CHUNK} (this projection: {cols} columns, group {group}); use --device cpu"
            )));
        }
        let smem = Self::group_smem(cols);
        if smem > self.dev().smem_optin {
            return Err(RuntimeError::Unsupported(format!(
                "{what}: {cols} columns need {smem} B of shared memory for the group matvec, \
                 this GPU allows {}",
                self.dev().smem_optin
            )));
        }
        for v in [rows, cols, q.row_bytes(), q.groups_per_row(), group] {
            i32_of("group_linear", v)?;
        }
        if let Some(b) = bias {
            check_len("group_linear", "bias", b.len(), rows)?;
        }
        let upload = |bytes: &[u8]| -> Result<DeviceMem> {
            let mem = self.dev().alloc(bytes.len())?;
            self.dev().upload_bytes(mem.ptr, bytes)?;
            Ok(mem)
        };
        let scale_bytes: Vec<u8> = q
            .scales()
            .iter()
            .flat_map(|s| s.to_bits().to_le_bytes())
            .collect();
        Ok(CudaGroupLinear {
            codes: upload(q.codes())?,
            scales: upload(&scale_bytes)?,
            zeros: upload(q.zeros())?,
            bias: bias.map(|b| self.upload(b)).transpose()?,
            bits: q.bits(),
            group,
            rows,
            cols,
            host_bytes: q.size_in_bytes(),
        })
    }

    /// Dynamic shared memory of the group matvec: x padded by 4 floats per 32, then the
    /// per-chunk sums.
    fn group_smem(cols: usize) -> usize {
        4 * (cols + cols / CHUNK * 4 + cols / CHUNK)
    }
}

impl CudaGroupLinear {
    fn bits_index(&self) -> usize {
        usize::from(self.bits - 2)
    }

    /// The kernels' shared leading arguments: code, scale and zero-point pointers, then rows,
    /// columns, row bytes, groups per row and group size (checked to fit i32 at upload).
    fn operand_args(&self) -> [Arg; 8] {
        let row_bytes = (self.cols * usize::from(self.bits)).div_ceil(8);
        [
            Arg::Ptr(self.codes.ptr),
            Arg::Ptr(self.scales.ptr),
            Arg::Ptr(self.zeros.ptr),
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
            Arg::I32(row_bytes as i32),
            Arg::I32(self.cols.div_ceil(self.group) as i32),
            Arg::I32(self.group as i32),
        ]
    }

    /// Threads per row (the smallest power of two ≥ the row's chunks, halved so that a thread
    /// walks two chunks and its loads pipeline; 32..256; `SFX_GROUP_TPR_SHIFT` halves it 0–3
    /// times for tuning runs) and rows per thread (4 while that leaves two blocks per SM).
    fn schedule(&self, backend: &CudaBackend) -> (usize, usize) {
        let chunks = self.cols / CHUNK;
        let tpr = (chunks.next_power_of_two() >> backend.inner.group_tpr_shift).clamp(32, THREADS);
        let sets = THREADS / tpr;
        let sm = backend.dev().sm_count as usize;
        let r = [4, 2]
            .into_iter()
            .find(|&r| self.rows.div_ceil(sets * r) >= 2 * sm)
            .unwrap_or(1);
        (tpr, r)
    }

    fn matvec(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let (tpr, r) = self.schedule(backend);
        let sets = THREADS / tpr;
        let [codes, scales, zeros, rows, cols, row_bytes, gpr, group] = self.operand_args();
        let kernel = &backend.k().group.matvec[self.bits_index()][match r {
            4 => 2,
            2 => 1,
            _ => 0,
        }];
        backend.launch(
            kernel,
            (blocks(self.rows, sets * r), m as u32, 1),
            (THREADS as u32, 1, 1),
            CudaBackend::group_smem(self.cols),
            &mut [
                codes,
                scales,
                zeros,
                Arg::Ptr(self.bias.as_ref().map_or(0, |b| b.mem.ptr)),
                Arg::Ptr(x.mem.ptr),
                Arg::Ptr(y.mem.ptr),
                rows,
                cols,
                row_bytes,
                gpr,
                group,
                Arg::I32(tpr as i32),
                Arg::I32(accumulate as i32),
            ],
        )
    }

    /// Prefill: the f32 panel of the whole matrix, then the GEMM (which adds the bias).
    fn gemm(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let panel = backend.dev().alloc(4 * self.rows * self.cols)?;
        let chunks = self.rows * (self.cols / CHUNK);
        let [codes, scales, zeros, rows, cols, row_bytes, gpr, group] = self.operand_args();
        backend.launch(
            &backend.k().group.dequant_f32[self.bits_index()],
            (blocks(chunks, 256), 1, 1),
            (256, 1, 1),
            0,
            &mut [
                codes,
                scales,
                zeros,
                Arg::Ptr(panel.ptr),
                rows,
                cols,
                row_bytes,
                gpr,
                group,
            ],
        )?;
        let w = WeightRef {
            ptr: panel.ptr,
            rows: self.rows,
            cols: self.cols,
            dtype: DType::F32,
            tf32: true,
        };
        // The panel's stream-ordered free follows the GEMM on the same stream.
        backend.gemm(x, m, w, self.bias.as_ref(), y, accumulate)
    }

    fn run(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        y: &mut CudaBuffer,
        accumulate: bool,
    ) -> Result<()> {
        check_len("group linear", "input", x.len, m * self.cols)?;
        check_len("group linear", "output", y.len, m * self.rows)?;
        if m == 0 {
            return Ok(());
        }
        if m <= MATVEC_MAX_TOKENS {
            self.matvec(backend, x, m, y, accumulate)
        } else {
            self.gemm(backend, x, m, y, accumulate)
        }
    }
}

impl Linear<CudaBackend> for CudaGroupLinear {
    fn in_dim(&self) -> usize {
        self.cols
    }
    fn out_dim(&self) -> usize {
        self.rows
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn forward(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        self.run(backend, x, m, y, false)
    }
    fn forward_add(
        &self,
        backend: &CudaBackend,
        x: &CudaBuffer,
        m: usize,
        acc: &mut CudaBuffer,
        _scratch: &mut CudaBuffer,
    ) -> Result<()> {
        self.run(backend, x, m, acc, true)
    }
    fn resident_bytes(&self) -> usize {
        self.host_bytes + self.bias.as_ref().map_or(0, |b| 4 * b.len)
    }
    fn describe(&self) -> String {
        format!(
            "q{}g{} {}×{} (cuda){}",
            self.bits,
            self.group,
            self.cols,
            self.rows,
            if self.bias.is_some() { " +bias" } else { "" }
        )
    }
}
