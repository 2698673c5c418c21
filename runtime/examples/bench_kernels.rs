//! Per-op timings of the CPU backend at a model's shapes (default SmolLM2-135M), best of
//! several repetitions, to see which op a change moves.
//!
//! cargo run --release -p sfx-runtime --example bench_kernels -- [--tokens 512] [--context 2048]
//!     [--hidden 576 --ffn 1536 --heads 9 --kv-heads 3 --head-dim 64 --vocab 49152]

use faer::{Accum, MatMut, MatRef, Par};
use sfx_runtime::backend::cpu::{
    CpuBackend, CpuBuffer, CpuIndex, CpuKvStore, CpuMatrix, CpuWeights,
};
use sfx_runtime::backend::{AttentionShape, Backend, KvDtype, KvLayout, MatmulOut};
use std::time::Instant;

fn best_of<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = [
        ("--tokens", 512usize),
        ("--context", 2048),
        ("--hidden", 576),
        ("--ffn", 1536),
        ("--heads", 9),
        ("--kv-heads", 3),
        ("--head-dim", 64),
        ("--vocab", 49152),
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let slot = cfg
            .iter_mut()
            .find(|(k, _)| *k == pair[0])
            .ok_or(format!("unknown option {}", pair[0]))?;
        slot.1 = pair.get(1).ok_or("missing value")?.parse()?;
    }
    let [m, ctx, hidden, ffn, heads, kv_heads, hd, vocab] = cfg.map(|(_, v)| v);
    let b = CpuBackend::new();
    println!("backend {}; m = {m} tokens, context {ctx}", b.name());

    let shapes = [
        ("q/o 576x576", hidden, heads * hd),
        ("k/v", kv_heads * hd, hidden),
        ("gate/up", ffn, hidden),
        ("down", hidden, ffn),
        ("lm_head", vocab, hidden),
    ];
    for (name, rows, cols) in shapes {
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-3)
            .collect();
        let wb: Vec<u16> = wf
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let mb = CpuMatrix::new(rows, cols, CpuWeights::Bf16(wb))?;
        let mf = CpuMatrix::new(rows, cols, CpuWeights::F32(wf.clone()))?;
        let x1 = CpuBuffer(vec![0.5; cols]);
        let mut y1 = CpuBuffer(vec![0.0; rows]);
        let t_bf = best_of(20, || {
            b.matmul_t(&x1, 1, &mb, None, &mut y1, MatmulOut::Store)
                .unwrap()
        });
        let t_f = best_of(20, || {
            b.matmul_t(&x1, 1, &mf, None, &mut y1, MatmulOut::Store)
                .unwrap()
        });
        let xm = CpuBuffer(vec![0.5; m * cols]);
        let mut ym = CpuBuffer(vec![0.0; m * rows]);
        let g_bf = best_of(3, || {
            b.matmul_t(&xm, m, &mb, None, &mut ym, MatmulOut::Store)
                .unwrap()
        });
        let g_f = best_of(3, || {
            b.matmul_t(&xm, m, &mf, None, &mut ym, MatmulOut::Store)
                .unwrap()
        });
        // faer alone, one parallel GEMM on the f32 weights: the ceiling for the prefill path.
        let g_faer = best_of(3, || {
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut ym.0, m, rows),
                Accum::Replace,
                MatRef::from_row_major_slice(&xm.0, m, cols),
                MatRef::from_row_major_slice(&wf, rows, cols).transpose(),
                1.0f32,
                Par::rayon(0),
            )
        });
        let flops = 2.0 * (m * rows * cols) as f64;
        println!(
            "{name:12} {rows:5}x{cols:5}  matvec bf16 {:7.1} us {:5.1} GB/s | f32 {:7.1} us {:5.1} GB/s || \
             gemm m={m} bf16 {:6.1} GF/s, f32 {:6.1} GF/s, faer f32 alone {:6.1} GF/s",
            t_bf * 1e6,
            (rows * cols * 2) as f64 / t_bf / 1e9,
            t_f * 1e6,
            (rows * cols * 4) as f64 / t_f / 1e9,
            flops / g_bf / 1e9,
            flops / g_f / 1e9,
            flops / g_faer / 1e9
        );
    }

    // Attention: a prefill chunk of m queries at the end of a ctx-token window, and decode.
    let kv = KvLayout {
        kv_heads,
        head_dim: hd,
        capacity: ctx,
    };
    let kc = CpuKvStore {
        data: (0..kv.buffer_len())
            .map(|i| ((i % 13) as f32 - 6.0) * 0.05)
            .collect(),
        dtype: KvDtype::F32,
    };
    let vc = CpuKvStore {
        data: (0..kv.buffer_len())
            .map(|i| ((i % 7) as f32 - 3.0) * 0.1)
            .collect(),
        dtype: KvDtype::F32,
    };
    for (label, past, nq) in [
        ("prefill chunk", ctx - m, m),
        ("prefill first chunk", 0, m),
        ("decode", ctx - 1, 1),
    ] {
        let s = AttentionShape {
            n_heads: heads,
            kv,
            past,
            n_queries: nq,
        };
        let q = CpuBuffer(vec![0.1; nq * heads * hd]);
        let mut out = CpuBuffer(vec![0.0; nq * heads * hd]);
        let pos = CpuIndex((past..past + nq).map(|p| p as u32).collect());
        let mut scratch = CpuBuffer(vec![0.0; 1]);
        let t = best_of(5, || {
            b.attention(&q, &kc, &vc, &s, &pos, &mut scratch, &mut out)
                .unwrap()
        });
        // Causal work: each query attends to past + its index + 1 keys; QKᵀ and PV.
        let pairs: f64 = (0..nq).map(|i| (past + i + 1) as f64).sum();
        let flops = 4.0 * pairs * (heads * hd) as f64;
        println!(
            "attention {label:20} past {past:5} queries {nq:4}: {:8.1} us, {:6.1} GF/s, {:5.1} GB/s of KV",
            t * 1e6,
            flops / t / 1e9,
            (2 * (past + nq) * kv_heads * hd * 4) as f64 / t / 1e9
        );
    }
    Ok(())
}
