//! KVarN decode attention on the CPU backend: each KV head's stored positions viewed as the
//! quantized cache views them, through the cache's own attention ([`attend_head`], with its
//! eq. 7/8 refinement when the shape asks for it), so the device kernels are checked against
//! exactly what the CPU cache computes.

use super::{CpuBackend, CpuBuffer, CpuKvStore, SimdLevel};
use crate::backend::kvarn::{KvarnLayer, KvarnLens, KvarnShape};
use crate::error::Result;
use crate::kv::attend::{attend_head, HeadView, RefineStep};
use crate::kv::KvBase;
use half::f16;

pub(super) fn kvarn_attention(
    level: SimdLevel,
    q: &CpuBuffer,
    layer: &KvarnLayer<'_, CpuBackend>,
    s: &KvarnShape,
    out: &mut CpuBuffer,
) -> Result<()> {
    let base = s.validate(KvarnLens {
        q: q.len(),
        out: out.len(),
        sink_k: layer.sink_k.data.len(),
        sink_v: layer.sink_v.data.len(),
        tile_bytes: layer.tiles.len(),
        tail_k: layer.tail_k.data.len(),
        tail_v: layer.tail_v.data.len(),
        row_dtypes: [layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v].map(|st| st.dtype),
        units: layer.units.map(|u| u.len()),
    })?;
    let record = base.tile_bytes();
    let d = s.head_dim;
    let group = s.n_heads / s.kv_heads;
    // As the host cache scales its rotated queries (`QuantKvCache`'s decode).
    let scale = 1.0 / (d as f32).sqrt();
    // The (f16) stores hold f16-rounded values widened to f32: narrowing them back is exact.
    let rows = |store: &CpuKvStore, h: usize, cap: usize, n: usize| -> Vec<f16> {
        store.data[h * cap * d..][..n * d]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect()
    };
    // One task per KV head on the decode pool (as decode attention): a rayon worker woken
    // here would compete with the pool's spinning worker for the cores.
    super::spin_pool::pool().for_each_chunk_mut(&mut out.0, group * d, |h, o| {
        let (sink_k, sink_v) = (
            rows(layer.sink_k, h, s.sink_capacity, s.sinks),
            rows(layer.sink_v, h, s.sink_capacity, s.sinks),
        );
        let (tail_k, tail_v) = (
            rows(layer.tail_k, h, s.tail_capacity, s.tail),
            rows(layer.tail_v, h, s.tail_capacity, s.tail),
        );
        let view = HeadView {
            head_dim: d,
            sink_k: &sink_k,
            sink_v: &sink_v,
            tiles: &layer.tiles[h * s.tile_capacity * record..][..s.tiles * record],
            tail_k: &tail_k,
            tail_v: &tail_v,
            base: Some(&base),
        };
        let q: Vec<f32> = q.0[h * group * d..][..group * d]
            .iter()
            .map(|&x| x * scale)
            .collect();
        let (Some(r), Some(units)) = (s.refine, layer.units) else {
            attend_head(level, &view, &q, o, None);
            return;
        };
        // The head's units, `[tile_capacity, groups per tile, unit]`: a fetch is a copy.
        let (unit, per_tile) = (r.unit_bytes(d), s.tile_tokens / r.group);
        let head_units = &units[h * s.tile_capacity * per_tile * unit..];
        let fetch = |tile: usize, group: usize, buf: &mut Vec<u8>| {
            buf.clear();
            buf.extend_from_slice(&head_units[(tile * per_tile + group) * unit..][..unit]);
            crate::refine::store::Fetched::Hit
        };
        let step = RefineStep {
            bits: r.bits,
            group: r.group,
            fraction: r.fraction,
            fetch: &fetch,
        };
        attend_head(level, &view, &q, o, Some(&step));
    });
    Ok(())
}
