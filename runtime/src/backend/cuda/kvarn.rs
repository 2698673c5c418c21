//! KVarN decode attention on the device (kernels/kvarn.cu): the layer's FP16 sink and tail
//! stores and its encoded tile records read in place, one block per KV head.

use super::{Arg, CudaBackend, CudaBuffer, DeviceMem};
use crate::backend::kvarn::{
    hadamard_rows_check, KvarnLayer, KvarnLens, KvarnShape, KVARN_MAX_GROUP,
};
use crate::error::{Result, RuntimeError};

/// Tokens a block scores at once (`KV_CHUNK`): the most a tile may hold.
const CHUNK: usize = 128;
/// Largest head size (`KV_MAX_D`): one thread per output channel.
const MAX_D: usize = 128;

/// Encoded KV tile records in device memory.
pub struct CudaKvTiles {
    pub(super) mem: DeviceMem,
    pub(super) len: usize,
}

/// The kernel's `KvarnParams`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct KvarnParams {
    q: u64,
    sink_k: u64,
    sink_v: u64,
    tiles: u64,
    tail_k: u64,
    tail_v: u64,
    out: u64,
    group: i32,
    d: i32,
    sinks: i32,
    sink_cap: i32,
    n_tiles: i32,
    tile_cap: i32,
    tail: i32,
    tail_cap: i32,
    tile_tokens: i32,
    kb: i32,
    vb: i32,
    record: i32,
    k_codes: i32,
    k_a: i32,
    k_z: i32,
    k_b: i32,
    v_codes: i32,
    v_a: i32,
    v_z: i32,
    v_b: i32,
}

fn i32_field(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| RuntimeError::Shape {
        op: "kvarn_attention",
        msg: format!("{what} = {v} does not fit the kernel's 32-bit index"),
    })
}

impl CudaBackend {
    pub(super) fn upload_tiles(&self, bytes: &[u8]) -> Result<CudaKvTiles> {
        let mem = self.dev().alloc(bytes.len())?;
        if !bytes.is_empty() {
            self.dev().upload_bytes(mem.ptr, bytes)?;
        }
        Ok(CudaKvTiles {
            mem,
            len: bytes.len(),
        })
    }

    pub(super) fn hadamard_rows_kernel(&self, x: &mut CudaBuffer, row_len: usize) -> Result<()> {
        let (rows, scale) = hadamard_rows_check(x.len, row_len)?;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            &self.k().kvarn_hadamard_rows,
            (i32_field("rows", rows)? as u32, 1, 1),
            ((row_len / 2).max(1) as u32, 1, 1),
            0,
            &mut [
                Arg::Ptr(x.mem.ptr),
                Arg::I32(i32_field("row length", row_len)?),
                Arg::F32(scale),
            ],
        )
    }

    pub(super) fn kvarn_attention_kernel(
        &self,
        q: &CudaBuffer,
        layer: &KvarnLayer<'_, Self>,
        s: &KvarnShape,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let base = s.validate(KvarnLens {
            q: q.len,
            out: out.len,
            sink_k: layer.sink_k.len,
            sink_v: layer.sink_v.len,
            tile_bytes: layer.tiles.len,
            tail_k: layer.tail_k.len,
            tail_v: layer.tail_v.len,
            row_dtypes: [layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v].map(|st| st.dtype),
        })?;
        let group = s.n_heads / s.kv_heads;
        if group > KVARN_MAX_GROUP || s.head_dim > MAX_D || s.tile_tokens > CHUNK {
            return Err(RuntimeError::Unsupported(format!(
                "kvarn_attention on CUDA takes up to {KVARN_MAX_GROUP} query heads per KV head, \
                 head_dim ≤ {MAX_D} and tiles of ≤ {CHUNK} tokens (got {group}, {}, {})",
                s.head_dim, s.tile_tokens
            )));
        }
        let r = base.record_layout();
        let f = i32_field;
        let params = KvarnParams {
            q: q.mem.ptr,
            sink_k: layer.sink_k.mem.ptr,
            sink_v: layer.sink_v.mem.ptr,
            tiles: layer.tiles.mem.ptr,
            tail_k: layer.tail_k.mem.ptr,
            tail_v: layer.tail_v.mem.ptr,
            out: out.mem.ptr,
            group: f("group", group)?,
            d: f("head_dim", s.head_dim)?,
            sinks: f("sinks", s.sinks)?,
            sink_cap: f("sink capacity", s.sink_capacity)?,
            n_tiles: f("tiles", s.tiles)?,
            tile_cap: f("tile capacity", s.tile_capacity)?,
            tail: f("tail", s.tail)?,
            tail_cap: f("tail capacity", s.tail_capacity)?,
            tile_tokens: f("tile tokens", s.tile_tokens)?,
            kb: f("key bits", s.bits.key as usize)?,
            vb: f("value bits", s.bits.value as usize)?,
            record: f("record bytes", r.total)?,
            k_codes: f("record offset", r.k_codes)?,
            k_a: f("record offset", r.k_a)?,
            k_z: f("record offset", r.k_z)?,
            k_b: f("record offset", r.k_b)?,
            v_codes: f("record offset", r.v_codes)?,
            v_a: f("record offset", r.v_a)?,
            v_z: f("record offset", r.v_z)?,
            v_b: f("record offset", r.v_b)?,
        };
        self.launch(
            &self.k().kvarn_attn_decode,
            (s.kv_heads as u32, 1, 1),
            (CHUNK as u32, 1, 1),
            0,
            &mut [Arg::Kvarn(params)],
        )
    }
}
