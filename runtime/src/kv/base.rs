//! The resident KV format interface: how one full tile of tokens of one KV head is stored in
//! fast memory, read back by attention, and refined by nested sub-interval indices.
//!
//! Why a trait: the cache (sinks, FP16 tail, tiles, refinement tier, selection, eq. 8) is the
//! same for every base; only the tile codec differs. KVarN is the first base; a KVQuant-style
//! non-uniform base slots in as one more implementation whose bins are its own centroid
//! intervals (docs/method.md §5: "refinement levels must subdivide the base's own bins").

use std::fmt;
use std::str::FromStr;

/// Resident bits per key and per value element, e.g. `2/2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvBits {
    pub key: u32,
    pub value: u32,
}

impl fmt::Display for KvBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.key, self.value)
    }
}

impl FromStr for KvBits {
    type Err = String;
    /// `K/V` with 1 ≤ K, V ≤ 8, e.g. `2/2`, `3/2`, `2/1`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (k, v) = s
            .split_once('/')
            .ok_or_else(|| format!("'{s}': expected K/V bits such as 2/2"))?;
        let parse = |x: &str, what: &str| -> Result<u32, String> {
            let b: u32 = x
                .trim()
                .parse()
                .map_err(|_| format!("'{s}': {what} bits '{x}' is not a number"))?;
            if (1..=8).contains(&b) {
                Ok(b)
            } else {
                Err(format!("'{s}': {what} bits must be 1..=8, got {b}"))
            }
        };
        Ok(KvBits {
            key: parse(k, "key")?,
            value: parse(v, "value")?,
        })
    }
}

/// Refinement bits per key and per value element (`+4/+4`; `+0/+1` refines only values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RefineBits {
    pub key: u32,
    pub value: u32,
}

impl RefineBits {
    pub const NONE: RefineBits = RefineBits { key: 0, value: 0 };

    pub fn is_none(self) -> bool {
        self.key == 0 && self.value == 0
    }
}

impl fmt::Display for RefineBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{}/+{}", self.key, self.value)
    }
}

impl FromStr for RefineBits {
    type Err = String;
    /// `+K/+V` (the plus signs are optional) with 0 ≤ K, V ≤ 8.
    fn from_str(s: &str) -> Result<Self, String> {
        let (k, v) = s
            .split_once('/')
            .ok_or_else(|| format!("'{s}': expected +K/+V refinement bits such as +4/+4"))?;
        let parse = |x: &str, what: &str| -> Result<u32, String> {
            let t = x.trim();
            let t = t.strip_prefix('+').unwrap_or(t);
            let b: u32 = t
                .parse()
                .map_err(|_| format!("'{s}': {what} refinement bits '{x}' is not a number"))?;
            if b <= 8 {
                Ok(b)
            } else {
                Err(format!(
                    "'{s}': {what} refinement bits must be 0..=8, got {b}"
                ))
            }
        };
        Ok(RefineBits {
            key: parse(k, "key")?,
            value: parse(v, "value")?,
        })
    }
}

/// One resident KV tile codec. All vectors are one KV head's `head_dim` values per token, in
/// the base's *code frame* (see [`KvBase::to_code_frame`]).
///
/// Refinement contract: every resident element lies in a bin of its code; a refinement of `b`
/// bits splits that bin into `2^b` equal sub-intervals and stores the index of the one
/// holding the exact value. [`KvBase::encode_tile`] computes the indices from the exact
/// values; `refined_*` reconstruct the sub-interval centre. With `b = 0` the refined value is
/// the resident value.
pub trait KvBase: Send + Sync {
    /// Human-readable name, e.g. `kvarn 2/2`.
    fn name(&self) -> String;
    fn bits(&self) -> KvBits;
    fn head_dim(&self) -> usize;
    /// Tokens per tile (KVarN: 128).
    fn tile_tokens(&self) -> usize;
    /// Bytes of one encoded tile of one KV head: codes and metadata of keys and values.
    fn tile_bytes(&self) -> usize;

    /// Maps one head vector (key, value or query) into the frame the codes live in, in place.
    /// The map must be orthogonal so that query·key dot products are unchanged.
    fn to_code_frame(&self, x: &mut [f32]);
    /// Inverse of [`KvBase::to_code_frame`] (applied to attention outputs).
    fn to_model_frame(&self, x: &mut [f32]);

    /// Encodes one full tile. `keys` and `values` are `[tile_tokens, head_dim]` row-major in
    /// the code frame. Writes `tile_bytes()` bytes into `out`, and, for a nonzero `refine`
    /// width, the sub-interval index of every element (`[tile_tokens, head_dim]`, one byte
    /// each, `< 2^bits`) into `key_sub` / `value_sub` (untouched when that width is 0).
    fn encode_tile(
        &self,
        keys: &[f32],
        values: &[f32],
        refine: RefineBits,
        out: &mut [u8],
        key_sub: &mut [u8],
        value_sub: &mut [u8],
    );

    /// Resident keys of a tile, channel-major `[head_dim, tile_tokens]` (so a score loop runs
    /// over contiguous tokens).
    fn decode_keys(&self, tile: &[u8], out: &mut [f32]);
    /// Resident values of a tile, token-major `[tile_tokens, head_dim]`.
    fn decode_values(&self, tile: &[u8], out: &mut [f32]);

    /// Refined key of token `t` of the tile from its `head_dim` sub-interval indices of
    /// `bits` bits, into `out` (`head_dim`).
    fn refined_key(&self, tile: &[u8], t: usize, sub: &[u8], bits: u32, out: &mut [f32]);
    /// Refined value of token `t`, as [`KvBase::refined_key`].
    fn refined_value(&self, tile: &[u8], t: usize, sub: &[u8], bits: u32, out: &mut [f32]);
}
