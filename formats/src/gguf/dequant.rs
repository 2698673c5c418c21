//! ggml tensor types and their dequantization to f32.
//!
//! Block layouts follow ggml's `ggml-common.h` (the block structs, one per type, each
//! documented below; the i-quants' in [`super::iq`]). Each formula is evaluated in f32 in the same order
//! as ggml's reference `dequantize_row_*` and the Python `gguf` package: the scale products
//! (f16 scale × small integer) are exact in f32, so the only rounding is the final
//! multiply/add, and results are bit-identical to both. No fused multiply-add is used (Rust
//! never contracts `a * b + c`).

use super::{iq, GgufError};
use half::{bf16, f16};
use rayon::prelude::*;

/// Super-block size of the k-quants.
pub const QK_K: usize = 256;

/// A ggml tensor type, by its GGUF type id. All ids of current ggml are known (so their byte
/// sizes can be validated); [`GgmlType::can_dequantize`] says which ones this module decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// The types [`dequantize`] supports, for error messages.
pub const DEQUANTIZABLE: &str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, \
     Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S";

impl GgmlType {
    /// The type with GGUF id `id`, or `None` for ids ggml does not define (or has retired).
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => IQ2XXS,
            17 => IQ2XS,
            18 => IQ3XXS,
            19 => IQ1S,
            20 => IQ4NL,
            21 => IQ3S,
            22 => IQ2S,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ2XXS => 16,
            IQ2XS => 17,
            IQ3XXS => 18,
            IQ1S => 19,
            IQ4NL => 20,
            IQ3S => 21,
            IQ2S => 22,
            IQ4XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// ggml's name for the type ("Q4_K", "BF16", ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ2XXS => "IQ2_XXS",
            IQ2XS => "IQ2_XS",
            IQ3XXS => "IQ3_XXS",
            IQ1S => "IQ1_S",
            IQ4NL => "IQ4_NL",
            IQ3S => "IQ3_S",
            IQ2S => "IQ2_S",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4NL | MXFP4 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | IQ2XXS | IQ2XS | IQ3XXS | IQ1S | IQ3S | IQ2S
            | IQ4XS | IQ1M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block (gguf-py's `GGML_QUANT_SIZES`).
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 40,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            IQ2XXS => 66,
            IQ2XS => 74,
            IQ3XXS => 98,
            IQ1S => 50,
            IQ4NL => 18,
            IQ3S => 110,
            IQ2S => 82,
            IQ4XS => 136,
            IQ1M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Blocks of several weights that [`dequantize`] reads: a quantized type, not a float or
    /// integer one (what an `.sfx` `gguf_blocks` section may hold).
    pub fn is_decodable_block_type(self) -> bool {
        self.block_size() > 1 && self.can_dequantize()
    }

    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q2K
                | Q3K
                | Q4K
                | Q5K
                | Q6K
                | IQ4NL
                | IQ4XS
                | IQ2XXS
                | IQ2XS
                | IQ2S
                | IQ3XXS
                | IQ3S
        )
    }

    /// Bytes needed for `n_elements` elements, or `None` when `n_elements` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Below this many elements a tensor is decoded on the calling thread (rayon's task overhead
/// would dominate).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;
/// Elements per rayon task: big enough to amortise scheduling, small enough to balance 2–128
/// cores on the largest tensors. A multiple of every block size.
const TASK_ELEMENTS: usize = 1 << 14;

/// Dequantizes `n_elements` values of type `ty` from `bytes` (exactly the tensor's bytes) into
/// `out` (exactly `n_elements` long), in storage order.
pub fn dequantize(
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
    out: &mut [f32],
) -> Result<(), GgufError> {
    if !ty.can_dequantize() {
        return Err(GgufError::Dequant(format!(
            "type {ty} is not supported (supported: {DEQUANTIZABLE})"
        )));
    }
    let expected = ty.bytes_for(n_elements as u64).ok_or_else(|| {
        GgufError::Dequant(format!(
            "{n_elements} elements is not a whole number of {ty} blocks of {}",
            ty.block_size()
        ))
    })?;
    if bytes.len() as u64 != expected {
        return Err(GgufError::Dequant(format!(
            "{n_elements} {ty} elements need {expected} bytes, got {}",
            bytes.len()
        )));
    }
    if out.len() != n_elements {
        return Err(GgufError::Dequant(format!(
            "output buffer holds {} values, expected {n_elements}",
            out.len()
        )));
    }
    let bs = ty.block_size();
    let ts = ty.type_size();
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => decode_f32,
        GgmlType::F16 => decode_f16,
        GgmlType::BF16 => decode_bf16,
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q2K => block_q2_k,
        GgmlType::Q3K => block_q3_k,
        GgmlType::Q4K => block_q4_k,
        GgmlType::Q5K => block_q5_k,
        GgmlType::Q6K => block_q6_k,
        GgmlType::IQ4NL => iq::block_iq4_nl,
        GgmlType::IQ4XS => iq::block_iq4_xs,
        GgmlType::IQ2XXS => iq::block_iq2_xxs,
        GgmlType::IQ2XS => iq::block_iq2_xs,
        GgmlType::IQ2S => iq::block_iq2_s,
        GgmlType::IQ3XXS => iq::block_iq3_xxs,
        GgmlType::IQ3S => iq::block_iq3_s,
        _ => unreachable!("checked by can_dequantize"),
    };
    // Plain types decode a whole run at once; block types one block at a time.
    let run = |src: &[u8], dst: &mut [f32]| {
        if bs == 1 {
            decode(src, dst);
        } else {
            for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
                decode(b, y);
            }
        }
    };
    if n_elements < PARALLEL_MIN_ELEMENTS {
        run(bytes, out);
    } else {
        let task_bytes = TASK_ELEMENTS / bs * ts;
        out.par_chunks_mut(TASK_ELEMENTS)
            .zip(bytes.par_chunks(task_bytes))
            .for_each(|(dst, src)| run(src, dst));
    }
    Ok(())
}

/// [`dequantize`] into a new vector.
pub fn dequantize_to_vec(
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
) -> Result<Vec<f32>, GgufError> {
    let mut out = vec![0f32; n_elements];
    dequantize(ty, bytes, n_elements, &mut out)?;
    Ok(out)
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn decode_f32(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn decode_f16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

fn decode_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Q4_0 (18 B): f16 d; qs[16]. Element j < 16 = low nibble of qs[j], j + 16 = high nibble;
/// x = (q − 8)·d.
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1 (20 B): f16 d; f16 m; qs[16]; x = q·d + m.
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_0 (22 B): f16 d; qh (u32 LE: bit j = 5th bit of element j); qs[16] as Q4_0;
/// x = (q − 16)·d.
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        y[j] = (((qs[j] & 0x0F) | (h0 << 4)) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | (h1 << 4)) as i32 - 16) as f32 * d;
    }
}

/// Q5_1 (24 B): f16 d; f16 m; qh; qs[16]; x = q·d + m.
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        y[j] = ((qs[j] & 0x0F) | (h0 << 4)) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | (h1 << 4)) as f32 * d + m;
    }
}

/// Q8_0 (34 B): f16 d; i8 qs[32]; x = q·d.
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = (q as i8) as f32 * d;
    }
}

/// Q2_K (84 B): scales[16] (low nibble scale, high nibble min); qs[64]; f16 d; f16 dmin.
/// Half h (128 elements, qs[32h..32h+32]), shift j: elements 128h+32j+l (l < 16) use
/// (qs[32h+l] >> 2j) & 3 with scales[8h+2j]; the next 16 use qs[32h+16+l] with scales[8h+2j+1].
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for h in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let sc = scales[8 * h + 2 * j + half];
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                let base = 128 * h + 32 * j + 16 * half;
                let q = &qs[32 * h + 16 * half..32 * h + 16 * half + 16];
                for l in 0..16 {
                    y[base + l] = dl * ((q[l] >> (2 * j)) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K (110 B): hmask[32]; qs[64]; scales[12] (16 six-bit signed scales); f16 d.
/// Element order as Q2_K; its high bit is bit (4h+j) of hmask[l] (hmask[16+l] for the second
/// 16); q = low2 − (hbit ? 0 : 4); x = d·(scale − 32)·q.
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let scales = q3k_scales(sc);
    for h in 0..2 {
        for j in 0..4 {
            let bit = 4 * h + j;
            for half in 0..2 {
                let dl = d * scales[8 * h + 2 * j + half] as f32;
                let base = 128 * h + 32 * j + 16 * half;
                for l in 0..16 {
                    let low = ((qs[32 * h + 16 * half + l] >> (2 * j)) & 3) as i32;
                    let hbit = (hmask[16 * half + l] >> bit) & 1;
                    let q = low - if hbit != 0 { 0 } else { 4 };
                    y[base + l] = dl * q as f32;
                }
            }
        }
    }
}

/// Q3_K's 16 signed 6-bit scales (one per 16 weights) from their packed 12 bytes.
#[inline]
pub fn q3k_scales(sc: &[u8]) -> [i32; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

/// The 6-bit (scale, min) pair of sub-block `j` of Q4_K/Q5_K's packed 12 bytes.
#[inline]
pub fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K (144 B): f16 d; f16 dmin; scales[12]; qs[128]. Chunk c (64 elements, qs[32c..32c+32]):
/// sub-block 2c = low nibbles, 2c+1 = high nibbles; x = d·sc·q − dmin·m.
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let s = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc0, m0) = k_scale_min(s, 2 * c);
        let (sc1, m1) = k_scale_min(s, 2 * c + 1);
        let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
        for l in 0..32 {
            y[64 * c + l] = d0 * (q[l] & 0x0F) as f32 - dm0;
            y[64 * c + 32 + l] = d1 * (q[l] >> 4) as f32 - dm1;
        }
    }
}

/// Q5_K (176 B): f16 d; f16 dmin; scales[12]; qh[32]; qs[128]. As Q4_K plus a 5th bit: bit 2c
/// of qh[l] for element 64c+l, bit 2c+1 for element 64c+32+l.
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let s = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc0, m0) = k_scale_min(s, 2 * c);
        let (sc1, m1) = k_scale_min(s, 2 * c + 1);
        let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
        for l in 0..32 {
            let h0 = (qh[l] >> (2 * c)) & 1;
            let h1 = (qh[l] >> (2 * c + 1)) & 1;
            y[64 * c + l] = d0 * ((q[l] & 0x0F) | (h0 << 4)) as f32 - dm0;
            y[64 * c + 32 + l] = d1 * ((q[l] >> 4) | (h1 << 4)) as f32 - dm1;
        }
    }
}

/// Q6_K (210 B): ql[128]; qh[64]; i8 scales[16]; f16 d. Half n (128 elements; ql[64n..],
/// qh[32n..]), l < 32: element l = ql[l] low | qh bits 0–1, l+32 = ql[l+32] low | bits 2–3,
/// l+64 = ql[l] high | bits 4–5, l+96 = ql[l+32] high | bits 6–7; q − 32; scale = element/16.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &qk) in q.iter().enumerate() {
                let idx = l + 32 * k;
                let dl = d * (sc[idx / 16] as i8) as f32;
                y[idx] = dl * (qk as i32 - 32) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Every block is built byte by byte from chosen fields; the expected values come from a
    //! direct per-element reading of the reference formula, written separately from the
    //! implementation above (element index → which byte/bit holds it).
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn deq(ty: GgmlType, block: &[u8], n: usize) -> Vec<f32> {
        assert_eq!(block.len(), ty.type_size() * n / ty.block_size());
        dequantize_to_vec(ty, block, n).unwrap()
    }

    /// Pseudo-random but deterministic bytes.
    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as u8
            })
            .collect()
    }

    #[test]
    fn type_ids_round_trip_and_sizes() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
        assert_eq!(GgmlType::from_id(4), None); // retired Q4_2
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(GgmlType::Q4K.type_size(), 144);
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(GgmlType::Q4_1.bytes_for(48), None);
    }

    #[test]
    fn plain_types() {
        let v = [1.5f32, -2.25, 0.0, 65504.0];
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(deq(GgmlType::F32, &b, 4), v);
        let b: Vec<u8> = v.iter().flat_map(|&x| h(x)).collect();
        assert_eq!(deq(GgmlType::F16, &b, 4), v);
        // bf16 1.0 = 0x3F80, -2.25 = 0xC010
        assert_eq!(
            deq(GgmlType::BF16, &[0x80, 0x3F, 0x10, 0xC0], 2),
            [1.0, -2.25]
        );
    }

    #[test]
    fn q4_0_explicit() {
        // d = 0.5; qs[0] = 0x9F: element 0 = 15 → (15−8)·0.5 = 3.5, element 16 = 9 → 0.5.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&h(0.5));
        b[2] = 0x9F;
        b[17] = 0x10; // element 15 = 0 → −4, element 31 = 1 → −3.5
        let y = deq(GgmlType::Q4_0, &b, 32);
        assert_eq!(y[0], 3.5);
        assert_eq!(y[16], 0.5);
        assert_eq!(y[15], -4.0);
        assert_eq!(y[31], -3.5);
        assert_eq!(y[1], -4.0); // qs[1] = 0 → (0−8)·0.5
    }

    #[test]
    fn q4_1_explicit_and_loop() {
        let mut b = bytes(20, 1);
        b[..2].copy_from_slice(&h(0.25));
        b[2..4].copy_from_slice(&h(-1.0));
        b[4] = 0x3C; // element 0: 12 → 12·0.25 − 1 = 2; element 16: 3 → −0.25
        let y = deq(GgmlType::Q4_1, &b, 32);
        assert_eq!(y[0], 2.0);
        assert_eq!(y[16], -0.25);
        for i in 0..32 {
            let byte = b[4 + i % 16];
            let q = if i < 16 { byte & 15 } else { byte >> 4 };
            assert_eq!(y[i], q as f32 * 0.25 - 1.0, "element {i}");
        }
    }

    #[test]
    fn q5_0_and_q5_1() {
        let mut b = bytes(22, 2);
        b[..2].copy_from_slice(&h(0.125));
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let y = deq(GgmlType::Q5_0, &b, 32);
        for i in 0..32 {
            let byte = b[6 + i % 16];
            let low = if i < 16 { byte & 15 } else { byte >> 4 } as i32;
            let high = ((qh >> i) & 1) as i32;
            assert_eq!(
                y[i],
                (low + 16 * high - 16) as f32 * 0.125,
                "Q5_0 element {i}"
            );
        }
        // Explicit: all-ones qh and qs → q = 31 → 15·d.
        let mut b = vec![0xFFu8; 22];
        b[..2].copy_from_slice(&h(2.0));
        assert!(deq(GgmlType::Q5_0, &b, 32).iter().all(|&v| v == 30.0));

        let mut b = bytes(24, 3);
        b[..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(-3.0));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let y = deq(GgmlType::Q5_1, &b, 32);
        for i in 0..32 {
            let byte = b[8 + i % 16];
            let low = if i < 16 { byte & 15 } else { byte >> 4 } as u32;
            let q = low + 16 * ((qh >> i) & 1);
            assert_eq!(y[i], q as f32 * 0.5 - 3.0, "Q5_1 element {i}");
        }
    }

    #[test]
    fn q8_0_explicit() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&h(0.5));
        b[2] = 0x80; // −128
        b[3] = 127;
        b[33] = 0xFF; // −1
        let y = deq(GgmlType::Q8_0, &b, 32);
        assert_eq!(y[0], -64.0);
        assert_eq!(y[1], 63.5);
        assert_eq!(y[31], -0.5);
        assert_eq!(y[2], 0.0);
    }

    /// Q2_K/Q3_K element position → (qs byte, shift, scale index, hmask byte).
    fn k16_position(i: usize) -> (usize, usize, usize, usize) {
        let h = i / 128;
        let j = (i % 128) / 32;
        let half = (i % 32) / 16;
        let l = i % 16;
        (
            32 * h + 16 * half + l,
            2 * j,
            8 * h + 2 * j + half,
            16 * half + l,
        )
    }

    #[test]
    fn q2_k_formula() {
        let mut b = bytes(84, 4);
        b[80..82].copy_from_slice(&h(0.5));
        b[82..84].copy_from_slice(&h(0.25));
        let y = deq(GgmlType::Q2K, &b, 256);
        for (i, &yi) in y.iter().enumerate() {
            let (qb, shift, si, _) = k16_position(i);
            let q = (b[16 + qb] >> shift) & 3;
            let sc = b[si];
            let want = 0.5 * (sc & 15) as f32 * q as f32 - 0.25 * (sc >> 4) as f32;
            assert_eq!(yi, want, "element {i}");
        }
        // Explicit: element 0 ↔ qs[0] bits 0–1, scales[0]; element 48 ↔ qs[16] bits 2–3, scales[3];
        // element 200 ↔ h=1, j=2, half=0, l=8 → qs[40] bits 4–5, scales[12].
        let mut b = vec![0u8; 84];
        b[80..82].copy_from_slice(&h(1.0));
        b[82..84].copy_from_slice(&h(1.0));
        b[0] = 0x23; // scale 3, min 2
        b[16] = 0b10; // q = 2
        b[3] = 0x15; // scale 5, min 1
        b[16 + 16] = 0b1100; // q = 3 at shift 2
        b[12] = 0x07;
        b[16 + 40] = 0b01_0000; // q = 1 at shift 4
        let y = deq(GgmlType::Q2K, &b, 256);
        assert_eq!(y[0], 3.0 * 2.0 - 2.0);
        assert_eq!(y[48], 5.0 * 3.0 - 1.0);
        assert_eq!(y[200], 7.0);
    }

    #[test]
    fn q3_k_formula() {
        let mut b = bytes(110, 5);
        b[108..110].copy_from_slice(&h(0.125));
        let y = deq(GgmlType::Q3K, &b, 256);
        let sc = &b[96..108];
        for (i, &yi) in y.iter().enumerate() {
            let (qb, shift, si, hb) = k16_position(i);
            let bit = 4 * (i / 128) + (i % 128) / 32;
            let low = ((b[32 + qb] >> shift) & 3) as i32;
            let hi = (b[hb] >> bit) & 1;
            let q = if hi == 1 { low } else { low - 4 };
            let s_low = if si < 8 { sc[si] & 15 } else { sc[si - 8] >> 4 };
            let s_high = (sc[8 + si % 4] >> (2 * (si / 4))) & 3;
            let s = (s_low as i32 + 16 * s_high as i32) - 32;
            assert_eq!(yi, 0.125 * s as f32 * q as f32, "element {i}");
        }
        // Explicit: all zero except d = 1 → every scale −32, every q = −4 → 128.
        let mut b = vec![0u8; 110];
        b[108..110].copy_from_slice(&h(1.0));
        assert!(deq(GgmlType::Q3K, &b, 256).iter().all(|&v| v == 128.0));
        // Set hmask[0] bit 0 and qs[0] = 1, scales[0] low nibble 1, scales[8] bits 0–1 = 2:
        // scale = 1 + 32 − 32 = 1, element 0: q = 1 → 1.
        b[0] = 1;
        b[32] = 1;
        b[96] = 1;
        b[104] = 2;
        assert_eq!(deq(GgmlType::Q3K, &b, 256)[0], 1.0);
    }

    fn scale_min_6bit(s: &[u8], j: usize) -> (u8, u8) {
        // Written from the reference text: j<4: sc = scales[j]&63, m = scales[j+4]&63;
        // j≥4: sc = (scales[j+4]&15) | ((scales[j−4]>>6)<<4), m = (scales[j+4]>>4) | ((scales[j]>>6)<<4).
        if j < 4 {
            (s[j] % 64, s[j + 4] % 64)
        } else {
            (
                s[j + 4] % 16 + 16 * (s[j - 4] / 64),
                s[j + 4] / 16 + 16 * (s[j] / 64),
            )
        }
    }

    #[test]
    fn q4_k_formula() {
        let mut b = bytes(144, 6);
        b[..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(0.0625));
        let y = deq(GgmlType::Q4K, &b, 256);
        for (i, &yi) in y.iter().enumerate() {
            let sub = i / 32;
            let byte = b[16 + 32 * (i / 64) + i % 32];
            let q = if sub % 2 == 0 { byte % 16 } else { byte / 16 };
            let (sc, m) = scale_min_6bit(&b[4..16], sub);
            assert_eq!(
                yi,
                0.5 * sc as f32 * q as f32 - 0.0625 * m as f32,
                "element {i}"
            );
        }
        // Explicit: sub-block 5 scale from scales[9] low nibble + scales[1] top bits.
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(1.0));
        b[4 + 9] = 0x32; // sc5 low = 2, m5 low = 3
        b[4 + 1] = 0b0100_0000; // sc5 high bits = 1 → sc5 = 18
        b[4 + 5] = 0b1000_0000; // m5 high bits = 2 → m5 = 35
        b[16 + 64 + 3] = 0x70; // element 5*32+3 = 163: high nibble 7
        let y = deq(GgmlType::Q4K, &b, 256);
        assert_eq!(y[163], 18.0 * 7.0 - 35.0);
    }

    #[test]
    fn q5_k_formula() {
        let mut b = bytes(176, 7);
        b[..2].copy_from_slice(&h(0.25));
        b[2..4].copy_from_slice(&h(0.5));
        let y = deq(GgmlType::Q5K, &b, 256);
        for (i, &yi) in y.iter().enumerate() {
            let sub = i / 32;
            let l = i % 32;
            let byte = b[48 + 32 * (i / 64) + l];
            let low = if sub % 2 == 0 { byte % 16 } else { byte / 16 };
            let high = (b[16 + l] >> sub) & 1;
            let (sc, m) = scale_min_6bit(&b[4..16], sub);
            let q = low as f32 + 16.0 * high as f32;
            assert_eq!(yi, 0.25 * sc as f32 * q - 0.5 * m as f32, "element {i}");
        }
    }

    #[test]
    fn q6_k_formula() {
        let mut b = bytes(210, 8);
        b[208..210].copy_from_slice(&h(0.03125));
        let y = deq(GgmlType::Q6K, &b, 256);
        for (i, &yi) in y.iter().enumerate() {
            let n = i / 128;
            let r = i % 128;
            let quarter = r / 32;
            let l = r % 32;
            let ql = b[64 * n + l + if quarter % 2 == 1 { 32 } else { 0 }];
            let low = if quarter < 2 { ql % 16 } else { ql / 16 };
            let high = (b[128 + 32 * n + l] >> (2 * quarter)) & 3;
            let q = (low as i32 + 16 * high as i32) - 32;
            let sc = b[192 + i / 16] as i8;
            assert_eq!(yi, 0.03125 * sc as f32 * q as f32, "element {i}");
        }
        // Explicit: element 0 with ql=0, qh=0 → q = −32, scale[0] = −2, d = 1 → 64.
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&h(1.0));
        b[192] = (-2i8) as u8;
        assert_eq!(deq(GgmlType::Q6K, &b, 256)[0], 64.0);
    }

    #[test]
    fn parallel_path_matches_sequential() {
        let n_blocks = (PARALLEL_MIN_ELEMENTS * 2) / 256 + 3;
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q6K,
            GgmlType::F16,
            GgmlType::IQ4NL,
            GgmlType::IQ2S,
        ] {
            let n = n_blocks * 256;
            let mut b = bytes(ty.bytes_for(n as u64).unwrap() as usize, 9);
            if ty == GgmlType::F16 {
                // Keep values finite so equality is meaningful.
                for c in b.chunks_exact_mut(2) {
                    c[1] &= 0x3F;
                }
            }
            let par = dequantize_to_vec(ty, &b, n).unwrap();
            let bs = ty.block_size();
            let ts = ty.type_size();
            let mut seq = vec![0f32; n];
            for (k, (src, dst)) in b.chunks(ts * 256 / bs).zip(seq.chunks_mut(256)).enumerate() {
                dequantize(ty, src, 256, dst).unwrap_or_else(|e| panic!("chunk {k}: {e}"));
            }
            assert!(par
                .iter()
                .zip(&seq)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn rejects_bad_sizes_and_types() {
        let e = dequantize_to_vec(GgmlType::Q4_1, &[0u8; 19], 32).unwrap_err();
        assert!(e.to_string().contains("need 20 bytes"), "{e}");
        let e = dequantize_to_vec(GgmlType::Q4_1, &[0u8; 20], 31).unwrap_err();
        assert!(e.to_string().contains("whole number"), "{e}");
        let e = dequantize_to_vec(GgmlType::IQ1S, &[0u8; 50], 256).unwrap_err();
        assert!(e.to_string().contains("IQ1_S is not supported"), "{e}");
    }
}
