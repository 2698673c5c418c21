//! KVarN decode attention on the device (kernels/kvarn.cu): the layer's FP16 sink and tail
//! stores and its encoded tile records read in place: per KV head, blocks of consecutive
//! 128-token chunks (split-K) whose partial softmax sums a second launch merges. With
//! refinement that launch is the scoring launch (eq. 7): several blocks per KV head merge the
//! splits and score the groups, and the last of them selects; a correction launch (eq. 8)
//! reads the selected groups' units — host memory mapped into the device, or device memory —
//! and writes the output.

use super::device::MappedMem;
use super::{Arg, CudaBackend, CudaBuffer, CudaIndex, DeviceMem};
use crate::backend::kvarn::{
    hadamard_rows_check, KvarnLayer, KvarnLayerMut, KvarnLens, KvarnShape, KVARN_MAX_GROUP,
};
use crate::error::{Result, RuntimeError};

/// Tokens a block scores at once (`KV_CHUNK`): the most a tile may hold.
const CHUNK: usize = 128;
/// Blocks per SM a split launch aims for: a block waits on its tile's staging and barriers,
/// so several per SM keep the memory system busy (about 22 KB of shared memory each).
const SPLIT_BLOCKS_PER_SM: usize = 6;

/// Chunks of a layer: sink rows and tail rows in runs of `CHUNK`, one per tile.
fn chunks(sinks: usize, tiles: usize, tail: usize) -> usize {
    sinks.div_ceil(CHUNK) + tiles + tail.div_ceil(CHUNK)
}
/// Largest head size (`KV_MAX_D`): one thread per output channel.
const MAX_D: usize = 128;
/// Most split-K blocks per KV head the merges take (`KV_MAX_SPLITS`).
const MAX_SPLITS: usize = 2048;

/// Encoded KV tile records (device memory), or refinement units (mapped host memory).
pub struct CudaByteStore {
    pub(super) mem: TileMem,
    pub(super) len: usize,
}

pub(super) enum TileMem {
    Device(DeviceMem),
    Mapped(MappedMem),
}

impl CudaByteStore {
    /// The address kernels read.
    pub(super) fn device_ptr(&self) -> u64 {
        match &self.mem {
            TileMem::Device(m) => m.ptr,
            TileMem::Mapped(m) => m.dptr,
        }
    }
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
    part: u64,
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
    q_scale: f32,
    splits: i32,
    pos: u64,
    units: u64,
    glog: u64,
    stat: u64,
    keys: u64,
    sel: u64,
    sel_count: u64,
    cpart: u64,
    done: u64,
    hist: u64,
    score_done: u64,
    fraction: f64,
    rgroup: i32,
    per_tile: i32,
    rkb: i32,
    rvb: i32,
    unit_bytes: i32,
    max_sel: i32,
    sel_blocks: i32,
    rotate_out: i32,
    corr_groups: i32,
    cand_cap: i32,
}

/// Most selected groups one correction block applies (at most the kernel's `CORR_MAX_GROUPS`):
/// its eight warps take two tokens each in groups of 2, and the last block of a KV head adds
/// one partial per block.
const CORR_GROUPS: usize = 8;
/// Threads of a scoring block (`SEL_THREADS`) and of a correction block (`CORR_THREADS`).
const SEL_THREADS: usize = 1024;
const CORR_THREADS: usize = 256;
/// Radix bins of the scores' first digit per KV head (`SEL_BINS`).
const SEL_BINS: usize = 2 * SEL_THREADS;
/// Score bits (with their groups) the selection gathers in shared memory: those in the first
/// digit's bin and above — about the selection plus one bin's share, an eighth of an octave of
/// scores.
const SEL_CANDIDATES: usize = 4096;
/// Shared memory a correction block may use for its staged units (`CORR_UNIT_WORDS` words):
/// the kernel's static arrays take about 37 KB of the 48 KB a block gets without opting in.
const CORR_UNIT_SMEM: usize = 8 * 1024;

/// Where the refinement arrays of one step sit in the scratch, after the split partials (f32
/// elements from the partials' start; 32-bit words each).
struct RefineLayout {
    stat: usize,
    glog: usize,
    keys: usize,
    sel: usize,
    sel_count: usize,
    cpart: usize,
    done: usize,
    hist: usize,
    score_done: usize,
    end: usize,
    max_sel: usize,
    /// Bytes of one unit; selected groups per correction block, and the blocks per KV head at
    /// capacity.
    unit_bytes: usize,
    corr_groups: usize,
    sel_blocks: usize,
    per_tile: usize,
}

impl RefineLayout {
    /// For a layer of `s`'s capacities with `splits` partials per KV head; none without
    /// refinement. Fewer groups share a correction block where units are too large to stage
    /// `CORR_GROUPS` of them.
    fn new(s: &KvarnShape, splits: usize) -> Option<Self> {
        let r = s.refine?;
        let (kv, d) = (s.kv_heads, s.head_dim);
        let group = s.n_heads / kv.max(1);
        let per_tile = s.tile_tokens / r.group.max(1);
        let groups = s.tile_capacity * per_tile;
        let max_sel = r.selected(groups);
        let unit_bytes = r.unit_bytes(d);
        let unit_stride = unit_bytes.next_multiple_of(4);
        let corr_groups =
            (CORR_UNIT_SMEM.saturating_sub(4) / unit_stride.max(1)).clamp(1, CORR_GROUPS);
        let sel_blocks = max_sel.div_ceil(corr_groups).max(1);
        let stat = kv * splits * group * (d + 2);
        let glog = stat + s.n_heads * (d + 2);
        let keys = glog + kv * groups * group;
        let sel = keys + kv * groups;
        let sel_count = sel + kv * max_sel;
        let cpart = sel_count + kv;
        let done = cpart + kv * sel_blocks * group * (d + 1);
        let hist = done + kv;
        let score_done = hist + kv * SEL_BINS;
        Some(Self {
            stat,
            glog,
            keys,
            sel,
            sel_count,
            cpart,
            done,
            hist,
            score_done,
            end: score_done + kv,
            max_sel,
            unit_bytes,
            corr_groups,
            sel_blocks,
            per_tile,
        })
    }
}

fn i32_field(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| RuntimeError::Shape {
        op: "kvarn_attention",
        msg: format!("{what} = {v} does not fit the kernel's 32-bit index"),
    })
}

impl CudaBackend {
    pub(super) fn upload_tiles(&self, bytes: &[u8]) -> Result<CudaByteStore> {
        let mem = self.dev().alloc(bytes.len())?;
        if !bytes.is_empty() {
            self.dev().upload_bytes(mem.ptr, bytes)?;
        }
        Ok(CudaByteStore {
            mem: TileMem::Device(mem),
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

    /// Blocks per KV head for `chunks` chunks: enough for `SPLIT_BLOCKS_PER_SM` blocks an SM,
    /// each with at least two chunks.
    fn kvarn_splits(&self, kv_heads: usize, chunks: usize) -> usize {
        let target = (SPLIT_BLOCKS_PER_SM * self.dev().sm_count as usize).div_ceil(kv_heads.max(1));
        target.min(chunks.div_ceil(2)).max(1)
    }

    /// Scratch of the split-K partials for a layer of `s`'s capacities.
    pub(super) fn kvarn_scratch(&self, s: &KvarnShape) -> usize {
        let most = chunks(s.sink_capacity, s.tile_capacity, s.tail_capacity);
        let group = s.n_heads / s.kv_heads.max(1);
        let splits = self.kvarn_splits(s.kv_heads, most);
        let partials = s.kv_heads * splits * group * (s.head_dim + 2);
        RefineLayout::new(s, splits)
            .map_or(partials, |r| r.end)
            .max(1)
    }

    pub(super) fn kvarn_attention_kernel(
        &self,
        q: &CudaBuffer,
        layer: &KvarnLayer<'_, Self>,
        s: &KvarnShape,
        scratch: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let splits = self.kvarn_splits(s.kv_heads, chunks(s.sinks, s.tiles, s.tail));
        let launch = KvarnLaunch {
            q: q.mem.ptr,
            q_len: q.len,
            part: scratch.mem.ptr,
            part_len: scratch.len,
            splits,
            position: 0,
            rotate_out: false,
        };
        self.launch_kvarn(layer, s, &launch, out)
    }

    /// [`crate::Backend::kvarn_decode`] in three launches: the rows (rotated; keys and values
    /// written at the position's slot, the queries into the scratch), attention with its fill
    /// read from the position and a split count fixed by the capacities (so a captured step
    /// replays at any position), and the merge, which rotates the output back.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kvarn_decode_kernels(
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
        let (d, kv, nh) = (shape.head_dim, shape.kv_heads, shape.n_heads);
        let err = |msg: String| RuntimeError::Shape {
            op: "kvarn_decode",
            msg,
        };
        if k.len != kv * d || v.len != kv * d || q.len != nh * d || positions.len < 1 {
            return Err(err(format!(
                "q {}, k {}, v {}, positions {} for {nh} heads, {kv} KV heads of {d}",
                q.len, k.len, v.len, positions.len
            )));
        }
        if shape.tail_capacity != shape.tile_tokens || d > MAX_D || !d.is_power_of_two() {
            return Err(err(format!(
                "the tail holds one tile ({} rows for tiles of {}); head_dim {d} a power of two                  up to {MAX_D}",
                shape.tail_capacity, shape.tile_tokens
            )));
        }
        let need = nh * d + self.kvarn_scratch(shape);
        if scratch.len < need {
            return Err(err(format!(
                "scratch of {} elements, need {need}",
                scratch.len
            )));
        }
        let row_scale = 1.0 / (d as f32).sqrt();
        let f = i32_field;
        self.launch(
            &self.k().kvarn_decode_rows,
            ((nh + 2 * kv) as u32, 1, 1),
            ((d / 2).max(1) as u32, 1, 1),
            0,
            &mut [
                Arg::Ptr(q.mem.ptr),
                Arg::Ptr(k.mem.ptr),
                Arg::Ptr(v.mem.ptr),
                Arg::Ptr(scratch.mem.ptr),
                Arg::Ptr(layer.sink_k.mem.ptr),
                Arg::Ptr(layer.sink_v.mem.ptr),
                Arg::Ptr(layer.tail_k.mem.ptr),
                Arg::Ptr(layer.tail_v.mem.ptr),
                Arg::Ptr(positions.mem.ptr),
                Arg::I32(f("heads", nh)?),
                Arg::I32(f("KV heads", kv)?),
                Arg::I32(f("head_dim", d)?),
                Arg::I32(f("sink capacity", shape.sink_capacity)?),
                Arg::I32(f("tile tokens", shape.tile_tokens)?),
                Arg::F32(row_scale),
            ],
        )?;
        let most = chunks(
            shape.sink_capacity,
            shape.tile_capacity,
            shape.tail_capacity,
        );
        let q_bytes = (nh * d * 4) as u64;
        let launch = KvarnLaunch {
            q: scratch.mem.ptr,
            q_len: nh * d,
            part: scratch.mem.ptr + q_bytes,
            part_len: scratch.len - nh * d,
            splits: self.kvarn_splits(kv, most),
            position: positions.mem.ptr,
            rotate_out: true,
        };
        // Validated as a full layer: the kernel reads the actual fill from the position.
        let full = KvarnShape {
            sinks: shape.sink_capacity,
            tiles: shape.tile_capacity,
            tail: shape.tail_capacity,
            ..*shape
        };
        self.launch_kvarn(&layer.as_layer(), &full, &launch, out)
    }

    fn launch_kvarn(
        &self,
        layer: &KvarnLayer<'_, Self>,
        s: &KvarnShape,
        l: &KvarnLaunch,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let base = s.validate(KvarnLens {
            q: l.q_len,
            out: out.len,
            sink_k: layer.sink_k.len,
            sink_v: layer.sink_v.len,
            tile_bytes: layer.tiles.len,
            tail_k: layer.tail_k.len,
            tail_v: layer.tail_v.len,
            row_dtypes: [layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v].map(|st| st.dtype),
            units: layer.units.map(|u| u.len),
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
        let splits = l.splits;
        // The merges keep one weight per split (and query head) in shared memory.
        if splits > MAX_SPLITS || group * splits * 4 > 48 * 1024 {
            return Err(RuntimeError::Unsupported(format!(
                "kvarn_attention on CUDA: {splits} splits of {group} query heads (at most \
                 {MAX_SPLITS}, and 12,288 split weights per KV head)"
            )));
        }
        let refine = RefineLayout::new(s, splits);
        let need = refine
            .as_ref()
            .map_or(s.kv_heads * splits * group * (s.head_dim + 2), |r| r.end);
        let split = splits > 1 || l.rotate_out || refine.is_some();
        if split && l.part_len < need {
            return Err(RuntimeError::Shape {
                op: "kvarn_attention",
                msg: format!(
                    "scratch of {} elements, {splits} splits need {need}",
                    l.part_len
                ),
            });
        }
        let mut params = KvarnParams {
            q: l.q,
            sink_k: layer.sink_k.mem.ptr,
            sink_v: layer.sink_v.mem.ptr,
            tiles: layer.tiles.device_ptr(),
            tail_k: layer.tail_k.mem.ptr,
            tail_v: layer.tail_v.mem.ptr,
            out: out.mem.ptr,
            part: if split { l.part } else { 0 },
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
            // The host cache's query scale, computed the same way.
            q_scale: 1.0 / (s.head_dim as f32).sqrt(),
            splits: f("splits", splits)?,
            pos: l.position,
            rotate_out: i32::from(l.rotate_out),
            ..KvarnParams::default()
        };
        // The correction block's staged units (and a padding word its bit reads may touch).
        let mut unit_smem = 0;
        if let (Some(lay), Some(spec), Some(units)) = (&refine, s.refine, layer.units) {
            let unit_bytes = lay.unit_bytes;
            unit_smem = lay.corr_groups * unit_bytes.next_multiple_of(4) + 4;
            if unit_smem > CORR_UNIT_SMEM {
                return Err(RuntimeError::Unsupported(format!(
                    "KV refinement on CUDA: units of {unit_bytes} bytes (groups of {} tokens, \
                     {}/{} bits) exceed the correction kernel's {} bytes of staging",
                    spec.group, spec.bits.key, spec.bits.value, CORR_UNIT_SMEM
                )));
            }
            let at = |i: usize| l.part + 4 * i as u64;
            params.units = units.device_ptr();
            params.stat = at(lay.stat);
            params.glog = at(lay.glog);
            params.keys = at(lay.keys);
            params.sel = at(lay.sel);
            params.sel_count = at(lay.sel_count);
            params.cpart = at(lay.cpart);
            params.done = at(lay.done);
            params.hist = at(lay.hist);
            params.score_done = at(lay.score_done);
            params.fraction = spec.fraction;
            params.rgroup = f("refinement group", spec.group)?;
            params.per_tile = f("groups per tile", lay.per_tile)?;
            params.rkb = f("refinement key bits", spec.bits.key as usize)?;
            params.rvb = f("refinement value bits", spec.bits.value as usize)?;
            params.unit_bytes = f("unit bytes", unit_bytes)?;
            params.max_sel = f("selected groups", lay.max_sel)?;
            params.sel_blocks = f("correction blocks", lay.sel_blocks)?;
            params.corr_groups = f("groups per correction block", lay.corr_groups)?;
        }
        // The staged record (and a padding word), then f32 scales: value A, Z per token, key B
        // per token, value B per channel.
        let smem = (r.total / 4 + 2) * 4 + s.tile_tokens * 12 + s.head_dim * 4;
        // Codes read a word each where none straddles a word: power-of-two widths, code rows
        // of whole words, sections starting on a word.
        let (kb, vb) = (s.bits.key as usize, s.bits.value as usize);
        let aligned = kb.is_power_of_two()
            && vb.is_power_of_two()
            && (s.tile_tokens * kb).is_multiple_of(32)
            && (s.head_dim * vb).is_multiple_of(32)
            && r.k_codes.is_multiple_of(4)
            && r.v_codes.is_multiple_of(4);
        let k = self.k();
        let kernel = match (group <= 4, aligned) {
            (true, false) => &k.kvarn_attn_decode_g4,
            (false, false) => &k.kvarn_attn_decode_g8,
            (true, true) => &k.kvarn_attn_decode_g4_w,
            (false, true) => &k.kvarn_attn_decode_g8_w,
        };
        self.launch(
            kernel,
            (s.kv_heads as u32, splits as u32, 1),
            (CHUNK as u32, 1, 1),
            smem,
            &mut [Arg::Kvarn(params)],
        )?;
        if !split {
            return Ok(());
        }
        if let Some(lay) = &refine {
            // Scoring blocks per KV head: one per SEL_THREADS groups at capacity, at most one
            // wave of one block an SM. Each keeps its query heads' split weights.
            let per_head = (self.dev().sm_count as usize / s.kv_heads).max(1);
            let score_blocks = (s.tile_capacity * lay.per_tile)
                .div_ceil(SEL_THREADS)
                .clamp(1, per_head);
            // The selection's gathered keys and groups (none with `SFX_KV_SELECT_L2=1`, which
            // keeps every pass in L2, for comparison and to test that path).
            let cand_cap = if self.inner.kv_select_l2 {
                0
            } else {
                SEL_CANDIDATES
            };
            params.cand_cap = f("selection candidates", cand_cap)?;
            self.launch(
                &self.k().kvarn_refine_score,
                (s.kv_heads as u32, score_blocks as u32, 1),
                (SEL_THREADS as u32, 1, 1),
                group * splits * 4 + cand_cap * 8,
                &mut [Arg::Kvarn(params)],
            )?;
            return self.launch(
                &self.k().kvarn_refine_correct,
                (s.kv_heads as u32, lay.sel_blocks as u32, 1),
                (CORR_THREADS as u32, 1, 1),
                unit_smem,
                &mut [Arg::Kvarn(params)],
            );
        }
        self.launch(
            &self.k().kvarn_attn_merge,
            (s.n_heads as u32, 1, 1),
            (s.head_dim as u32, 1, 1),
            0,
            &mut [
                Arg::Ptr(l.part),
                Arg::Ptr(out.mem.ptr),
                Arg::I32(params.splits),
                Arg::I32(params.group),
                Arg::I32(params.d),
                Arg::I32(i32::from(l.rotate_out)),
                Arg::F32(params.q_scale),
            ],
        )
    }
}

/// Where one attention launch reads its queries and keeps its partials.
struct KvarnLaunch {
    q: u64,
    q_len: usize,
    part: u64,
    part_len: usize,
    splits: usize,
    /// Device address of the decode position (the fill follows from it), or 0.
    position: u64,
    /// Merge always, and rotate the output back to the model frame.
    rotate_out: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::kvarn::KvarnRefineSpec;
    use crate::kv::{KvBits, RefineBits};

    fn shape(group: usize, key: u32, value: u32) -> KvarnShape {
        KvarnShape {
            n_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            bits: KvBits { key: 2, value: 2 },
            tile_tokens: 128,
            sinks: 0,
            sink_capacity: 128,
            tiles: 0,
            tile_capacity: 300,
            tail: 0,
            tail_capacity: 128,
            refine: Some(KvarnRefineSpec {
                bits: RefineBits { key, value },
                group,
                fraction: 1.0 / 128.0,
            }),
        }
    }

    /// A correction block stages `corr_groups` units in the kernel's fixed space
    /// (`CORR_UNIT_WORDS` words, plus the padding word its bit reads may touch) and keeps one
    /// selection per group in an array of `CORR_MAX_GROUPS` = 16: the host's count must fit
    /// both, take as many as fit up to `CORR_GROUPS`, and give every selection a block.
    #[test]
    fn correction_blocks_fit_the_kernels_staging() {
        for (group, key, value, want) in [
            (2, 4, 4, 8),  // 256-byte units: the default count
            (4, 0, 1, 8),  // 64-byte units
            (8, 4, 4, 7),  // 1 KiB units: as many as fit
            (32, 4, 4, 1), // 4 KiB units: one a block
            (16, 3, 2, 6), // 1,280-byte units
        ] {
            let s = shape(group, key, value);
            let lay = RefineLayout::new(&s, 99).expect("refining shape");
            let spec = s.refine.expect("refining shape");
            let stride = spec.unit_bytes(s.head_dim).next_multiple_of(4);
            assert_eq!(lay.corr_groups, want, "groups {group}, +{key}/+{value}");
            assert!(lay.corr_groups * stride + 4 <= CORR_UNIT_SMEM);
            assert!(lay.corr_groups <= 16);
            assert!(lay.sel_blocks * lay.corr_groups >= lay.max_sel);
            // The selection's arrays follow each other without overlap, histogram last.
            assert!(lay.stat < lay.glog && lay.glog < lay.keys && lay.keys < lay.sel);
            assert!(lay.sel < lay.sel_count && lay.sel_count < lay.cpart && lay.cpart < lay.done);
            assert_eq!(lay.hist, lay.done + s.kv_heads);
            assert_eq!(lay.score_done, lay.hist + s.kv_heads * SEL_BINS);
            assert_eq!(lay.end, lay.score_done + s.kv_heads);
        }
    }
}
