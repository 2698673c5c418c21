//! The device side of a KVarN-coded KV cache (issue 15): what one decode step's attention
//! reads of a layer, and the checks every backend runs on it before touching memory.

use super::{Backend, KvDtype};
use crate::error::{Result, RuntimeError};
use crate::kv::{KvBase, KvBits, Kvarn, RefineBits};

/// Largest query heads per KV head the device kernels take (Llama/Qwen use 1–8).
pub const KVARN_MAX_GROUP: usize = 8;

/// Longest row [`Backend::hadamard_rows`] rotates (one block's shared memory on a device).
pub const HADAMARD_MAX_ROW: usize = 1024;

/// Checks a [`Backend::hadamard_rows`] call; returns the number of rows and the scale 1/√n
/// (computed as the KVarN codec computes it).
pub fn hadamard_rows_check(len: usize, row_len: usize) -> Result<(usize, f32)> {
    if !row_len.is_power_of_two() || row_len > HADAMARD_MAX_ROW || !len.is_multiple_of(row_len) {
        return Err(RuntimeError::Shape {
            op: "hadamard_rows",
            msg: format!(
                "rows of {row_len} values (a power of two up to {HADAMARD_MAX_ROW}) over a \
                 buffer of {len}"
            ),
        });
    }
    Ok((len / row_len, 1.0 / (row_len as f32).sqrt()))
}

/// Checks a byte range `offset..offset + n` of a tile store of `len` bytes
/// ([`Backend::write_byte_store`], [`Backend::read_byte_store`]).
pub fn tile_range_check(op: &'static str, len: usize, offset: usize, n: usize) -> Result<()> {
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(RuntimeError::Shape {
            op,
            msg: format!(
                "bytes {offset}..{} of a tile store of {len}",
                offset.saturating_add(n)
            ),
        });
    }
    Ok(())
}

/// One layer of a KVarN cache as a decode step reads it. Every row is in the code frame
/// (keys and values rotated by the normalised Hadamard transform of `head_dim`). Positions
/// are, per KV head: `sinks` FP16 rows, then `tiles` encoded tiles of `tile_tokens` tokens,
/// then `tail` FP16 rows (the token being decoded is the tail's last).
pub struct KvarnLayer<'a, B: Backend> {
    /// F16 stores `[kv_heads, sink_capacity, head_dim]`.
    pub sink_k: &'a B::KvStore,
    pub sink_v: &'a B::KvStore,
    /// `[kv_heads, tile_capacity, tile_bytes]` encoded tile records.
    pub tiles: &'a B::ByteStore,
    /// F16 stores `[kv_heads, tail_capacity, head_dim]`.
    pub tail_k: &'a B::KvStore,
    pub tail_v: &'a B::KvStore,
    /// With refinement ([`KvarnShape::refine`]): the layer's refinement units,
    /// `[kv_heads, tile_capacity, groups per tile, unit bytes]` — the backing tier, in host
    /// memory the device reads directly ([`Backend::alloc_host_byte_store`]).
    pub units: Option<&'a B::ByteStore>,
}

/// Nested refinement of the tiles (method: eq. 7 selection, eq. 8 correction). A unit is one
/// group of `group` consecutive tile tokens of one KV head: the sub-interval indices of its
/// keys (`bits.key` each, token-major) then of its values (`bits.value` each), one
/// little-endian bit stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvarnRefineSpec {
    pub bits: RefineBits,
    pub group: usize,
    /// Fraction of a KV head's eligible groups (tile tokens) selected per step, rounded up,
    /// at least one.
    pub fraction: f64,
}

impl KvarnRefineSpec {
    /// Bytes of one unit for heads of `head_dim`.
    pub fn unit_bytes(&self, head_dim: usize) -> usize {
        crate::kv::bitpack::packed_len(self.group * head_dim, self.bits.key + self.bits.value)
    }

    /// Groups selected among `eligible` ([`crate::kv::attend::groups_to_select`]).
    pub fn selected(&self, eligible: usize) -> usize {
        crate::kv::attend::groups_to_select(eligible, self.fraction)
    }
}

/// Geometry of a [`KvarnLayer`] and how much of it is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvarnShape {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub bits: KvBits,
    pub tile_tokens: usize,
    pub sinks: usize,
    pub sink_capacity: usize,
    pub tiles: usize,
    pub tile_capacity: usize,
    pub tail: usize,
    pub tail_capacity: usize,
    /// Eq. 7/8 refinement of the tiles from the layer's units, or none.
    pub refine: Option<KvarnRefineSpec>,
}

/// A layer's stores as a decode step writes its rows into them ([`Backend::kvarn_decode`]).
pub struct KvarnLayerMut<'a, B: Backend> {
    pub sink_k: &'a mut B::KvStore,
    pub sink_v: &'a mut B::KvStore,
    pub tiles: &'a B::ByteStore,
    pub tail_k: &'a mut B::KvStore,
    pub tail_v: &'a mut B::KvStore,
    pub units: Option<&'a B::ByteStore>,
}

impl<'a, B: Backend> KvarnLayerMut<'a, B> {
    pub fn as_layer(&self) -> KvarnLayer<'_, B> {
        KvarnLayer {
            sink_k: self.sink_k,
            sink_v: self.sink_v,
            tiles: self.tiles,
            tail_k: self.tail_k,
            tail_v: self.tail_v,
            units: self.units,
        }
    }
}

/// Where a decode step's row goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvarnSlot {
    Sink(usize),
    Tail(usize),
}

impl KvarnShape {
    /// The layer as a decode step at `position` reads it, with every earlier position
    /// committed (each full tail encoded): `sink_capacity` sinks first, then whole tiles, then
    /// the tail holding the new row; and the new row's slot.
    pub fn decode_at(&self, position: usize) -> (KvarnShape, KvarnSlot) {
        let s = self.sink_capacity;
        let t = self.tile_tokens.max(1);
        if position < s {
            let shape = KvarnShape {
                sinks: position + 1,
                tiles: 0,
                tail: 0,
                ..*self
            };
            return (shape, KvarnSlot::Sink(position));
        }
        let rest = position - s;
        let shape = KvarnShape {
            sinks: s,
            tiles: rest / t,
            tail: rest % t + 1,
            ..*self
        };
        (shape, KvarnSlot::Tail(rest % t))
    }
}

/// Element counts of a layer's stores, as a backend sees them, and the element types of its
/// row stores (sink keys, sink values, tail keys, tail values).
#[derive(Debug, Clone, Copy)]
pub struct KvarnLens {
    pub q: usize,
    pub out: usize,
    pub sink_k: usize,
    pub sink_v: usize,
    pub tile_bytes: usize,
    pub tail_k: usize,
    pub tail_v: usize,
    pub row_dtypes: [KvDtype; 4],
    /// Bytes of the refinement units store, if one is given.
    pub units: Option<usize>,
}

impl KvarnShape {
    /// Checks the shape against the stores' lengths; returns the tiles' codec.
    pub fn validate(&self, lens: KvarnLens) -> Result<Kvarn> {
        let err = |msg: String| RuntimeError::Shape {
            op: "kvarn_attention",
            msg,
        };
        let base = Kvarn::with_tile(self.bits, self.head_dim, self.tile_tokens).map_err(err)?;
        let record = base.tile_bytes();
        if self.kv_heads == 0 || !self.n_heads.is_multiple_of(self.kv_heads) {
            return Err(err(format!(
                "{} query heads over {} KV heads",
                self.n_heads, self.kv_heads
            )));
        }
        if self.sinks > self.sink_capacity
            || self.tiles > self.tile_capacity
            || self.tail > self.tail_capacity
        {
            return Err(err(format!(
                "filled {}/{} sinks, {}/{} tiles, {}/{} tail rows",
                self.sinks,
                self.sink_capacity,
                self.tiles,
                self.tile_capacity,
                self.tail,
                self.tail_capacity
            )));
        }
        if self.sinks + self.tiles + self.tail == 0 {
            return Err(err("no stored positions to attend to".into()));
        }
        let d = self.head_dim;
        let expect = [
            ("queries", lens.q, self.n_heads * d),
            ("output", lens.out, self.n_heads * d),
            (
                "sink keys",
                lens.sink_k,
                self.kv_heads * self.sink_capacity * d,
            ),
            (
                "sink values",
                lens.sink_v,
                self.kv_heads * self.sink_capacity * d,
            ),
            (
                "tile bytes",
                lens.tile_bytes,
                self.kv_heads * self.tile_capacity * record,
            ),
            (
                "tail keys",
                lens.tail_k,
                self.kv_heads * self.tail_capacity * d,
            ),
            (
                "tail values",
                lens.tail_v,
                self.kv_heads * self.tail_capacity * d,
            ),
        ];
        for (what, got, want) in expect {
            if got != want {
                return Err(err(format!("{what}: {got} elements, expected {want}")));
            }
        }
        match (self.refine, lens.units) {
            (None, None) => {}
            (Some(r), Some(got)) => {
                if r.group == 0 || !self.tile_tokens.is_multiple_of(r.group) {
                    return Err(err(format!(
                        "refinement groups of {} tokens must divide the tile of {}",
                        r.group, self.tile_tokens
                    )));
                }
                if r.bits.key > 8 || r.bits.value > 8 || r.bits.is_none() {
                    return Err(err(format!(
                        "refinement bits {}/{}: each at most 8, not both 0",
                        r.bits.key, r.bits.value
                    )));
                }
                if !(r.fraction > 0.0 && r.fraction <= 1.0) {
                    return Err(err(format!(
                        "refinement fraction {} is not in (0, 1]",
                        r.fraction
                    )));
                }
                let want = self.kv_heads
                    * self.tile_capacity
                    * (self.tile_tokens / r.group)
                    * r.unit_bytes(d);
                if got != want {
                    return Err(err(format!(
                        "refinement units: {got} bytes, expected {want}"
                    )));
                }
            }
            (Some(_), None) => return Err(err("refinement without a units store".into())),
            (None, Some(_)) => return Err(err("a units store without refinement".into())),
        }
        let stores = ["sink keys", "sink values", "tail keys", "tail values"];
        for (what, dtype) in stores.into_iter().zip(lens.row_dtypes) {
            if dtype != KvDtype::F16 {
                return Err(err(format!(
                    "the {what} store is {}, KVarN rows are f16",
                    dtype.as_str()
                )));
            }
        }
        Ok(base)
    }
}

/// [`Backend::kvarn_decode`] as separate ops: the position read back to the host, the rows
/// copied and rotated in fresh buffers, the key and value rows written at the position's
/// slot, then attention (`scratch` as [`Backend::kvarn_attention`]'s) and the output's
/// rotation.
#[allow(clippy::too_many_arguments)]
pub fn kvarn_decode_unfused<B: Backend>(
    b: &B,
    q: &B::Buffer,
    k: &B::Buffer,
    v: &B::Buffer,
    layer: KvarnLayerMut<'_, B>,
    shape: &KvarnShape,
    positions: &B::Index,
    scratch: &mut B::Buffer,
    out: &mut B::Buffer,
) -> Result<()> {
    let mut pos = [0u32; 1];
    b.download_index(positions, &mut pos)?;
    let (at, slot) = shape.decode_at(pos[0] as usize);
    let (d, kv) = (shape.head_dim, shape.kv_heads);
    let mut qs = b.alloc(shape.n_heads * d)?;
    let mut ks = b.alloc(kv * d)?;
    let mut vs = b.alloc(kv * d)?;
    b.copy_rows(q, shape.n_heads * d, 0, &mut qs)?;
    b.copy_rows(k, kv * d, 0, &mut ks)?;
    b.copy_rows(v, kv * d, 0, &mut vs)?;
    for x in [&mut qs, &mut ks, &mut vs] {
        b.hadamard_rows(x, d)?;
    }
    let (row, rows, kc, vc) = match slot {
        KvarnSlot::Sink(r) => (
            r,
            shape.sink_capacity,
            &mut *layer.sink_k,
            &mut *layer.sink_v,
        ),
        KvarnSlot::Tail(r) => (
            r,
            shape.tail_capacity,
            &mut *layer.tail_k,
            &mut *layer.tail_v,
        ),
    };
    let mut index = b.alloc_index(1)?;
    b.write_index(&mut index, &[row as u32])?;
    let layout = super::KvLayout {
        kv_heads: kv,
        head_dim: d,
        capacity: rows,
    };
    b.write_kv(&ks, &vs, kc, vc, layout, &index)?;
    let view = layer.as_layer();
    b.kvarn_attention(&qs, &view, &at, scratch, out)?;
    b.hadamard_rows(out, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KvarnShape {
        KvarnShape {
            n_heads: 9,
            kv_heads: 3,
            head_dim: 64,
            bits: KvBits { key: 2, value: 2 },
            tile_tokens: 128,
            sinks: 4,
            sink_capacity: 4,
            tiles: 1,
            tile_capacity: 2,
            tail: 3,
            tail_capacity: 128,
            refine: None,
        }
    }

    fn lens(s: &KvarnShape) -> KvarnLens {
        let d = s.head_dim;
        KvarnLens {
            q: s.n_heads * d,
            out: s.n_heads * d,
            sink_k: s.kv_heads * s.sink_capacity * d,
            sink_v: s.kv_heads * s.sink_capacity * d,
            tile_bytes: s.kv_heads * s.tile_capacity * 5248,
            tail_k: s.kv_heads * s.tail_capacity * d,
            tail_v: s.kv_heads * s.tail_capacity * d,
            row_dtypes: [KvDtype::F16; 4],
            units: None,
        }
    }

    #[test]
    fn a_consistent_layer_passes_and_names_its_record() {
        let s = shape();
        assert_eq!(
            s.validate(lens(&s)).map(|b| b.tile_bytes()).ok(),
            Some(5248)
        );
    }

    #[test]
    fn a_decode_position_names_its_fill_and_slot() {
        let s = KvarnShape {
            sink_capacity: 4,
            tile_tokens: 128,
            ..shape()
        };
        let (a, slot) = s.decode_at(2);
        assert_eq!(
            (a.sinks, a.tiles, a.tail, slot),
            (3, 0, 0, KvarnSlot::Sink(2))
        );
        let (b, slot) = s.decode_at(4);
        assert_eq!(
            (b.sinks, b.tiles, b.tail, slot),
            (4, 0, 1, KvarnSlot::Tail(0))
        );
        // The tail's last row: its tile is encoded at the commit after this step.
        let (c, slot) = s.decode_at(4 + 2 * 128 + 127);
        assert_eq!(
            (c.sinks, c.tiles, c.tail, slot),
            (4, 2, 128, KvarnSlot::Tail(127))
        );
        let (d, _) = s.decode_at(4 + 3 * 128);
        assert_eq!((d.tiles, d.tail), (3, 1));
    }

    #[test]
    fn tile_ranges_stay_inside_the_store() {
        assert!(tile_range_check("write_byte_store", 100, 40, 60).is_ok());
        assert!(tile_range_check("write_byte_store", 100, 100, 0).is_ok());
        let e = tile_range_check("read_byte_store", 100, 41, 60)
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("bytes 41..101 of a tile store of 100")));
        assert!(tile_range_check("read_byte_store", 100, usize::MAX, 2).is_err());
    }

    #[test]
    fn hadamard_rows_take_powers_of_two_that_divide_the_buffer() {
        assert_eq!(
            hadamard_rows_check(512, 128).ok(),
            Some((4, 1.0 / 128f32.sqrt()))
        );
        for (len, row) in [(96, 48), (100, 64), (4096, 2048), (8, 0)] {
            let e = hadamard_rows_check(len, row).err().map(|e| e.to_string());
            assert!(
                e.is_some_and(|e| e.contains(&format!("rows of {row} values"))),
                "{len} {row}"
            );
        }
    }

    /// The message of a rejected layer (empty if it was accepted).
    fn rejection(s: &KvarnShape, l: KvarnLens) -> String {
        s.validate(l)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn each_bad_field_is_named() {
        let s = shape();
        let mut l = lens(&s);
        l.tile_bytes -= 1;
        let e = rejection(&s, l);
        assert!(e.contains("tile bytes"), "{e}");

        let mut l = lens(&s);
        l.row_dtypes[3] = KvDtype::F32;
        let e = rejection(&s, l);
        assert!(e.contains("tail values store is f32"), "{e}");

        let over = KvarnShape { tiles: 3, ..s };
        let e = rejection(&over, lens(&over));
        assert!(e.contains("3/2 tiles"), "{e}");

        let empty = KvarnShape {
            sinks: 0,
            tiles: 0,
            tail: 0,
            ..s
        };
        let e = rejection(&empty, lens(&empty));
        assert!(e.contains("no stored positions"), "{e}");

        let odd = KvarnShape { head_dim: 48, ..s };
        assert!(odd.validate(lens(&odd)).is_err());

        let gqa = KvarnShape { n_heads: 8, ..s };
        let e = rejection(&gqa, lens(&gqa));
        assert!(e.contains("8 query heads over 3 KV heads"), "{e}");
    }

    #[test]
    fn refinement_needs_its_units_store_and_a_dividing_group() {
        let spec = KvarnRefineSpec {
            bits: RefineBits { key: 4, value: 4 },
            group: 2,
            fraction: 1.0 / 128.0,
        };
        let s = KvarnShape {
            refine: Some(spec),
            ..shape()
        };
        // 3 heads × 2 tiles × 64 groups × (2 tokens × 64 × 8 bits / 8) bytes.
        let units = 3 * 2 * 64 * 128;
        assert_eq!(spec.unit_bytes(64), 128);
        let with = |n: Option<usize>| KvarnLens {
            units: n,
            ..lens(&s)
        };
        assert!(s.validate(with(Some(units))).is_ok());
        let e = rejection(&s, with(Some(units - 1)));
        assert!(e.contains("refinement units"), "{e}");
        let e = rejection(&s, with(None));
        assert!(e.contains("without a units store"), "{e}");
        let e = rejection(&shape(), with(Some(units)));
        assert!(e.contains("without refinement"), "{e}");
        let odd = KvarnShape {
            refine: Some(KvarnRefineSpec { group: 3, ..spec }),
            ..s
        };
        let e = rejection(&odd, with(Some(units)));
        assert!(e.contains("groups of 3 tokens"), "{e}");
        let none = KvarnShape {
            refine: Some(KvarnRefineSpec {
                fraction: 0.0,
                ..spec
            }),
            ..s
        };
        let e = rejection(&none, with(Some(units)));
        assert!(e.contains("fraction 0"), "{e}");
    }
}
