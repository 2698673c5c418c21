//! Cost of YAQA Sketch B factors on the real SmolLM2-135M: seconds per sequence and peak RSS.
//!
//! Sequences are `n` consecutive `len`-token windows of the wiki text. Reported:
//! 1. one `sequence_gradients` call (weights to candle, forward, backward, G_b to the host);
//! 2. the factor products H_in += G_bᵀG_b, H_out += G_bG_bᵀ of all 210 linears for those G_b,
//!    with the faer lower-triangle update `KroneckerFactors::accumulate` uses, and for
//!    comparison a full faer GEMM and candle's matmul;
//! 3. `sketch_b` over all `n` sequences: seconds per sequence from the progress callback;
//!    peak RSS (VmHWM) after each stage.
//!
//! ```text
//! CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 \
//!     cargo run --release -p sfx-calibration --example yaqa_bench -- [n=2] [len=512]
//! ```
//!
//! `RAYON_NUM_THREADS` sets faer's threads (the linears and the factor products),
//! `CANDLE_NUM_THREADS` candle's (everything else; defaults to `RAYON_NUM_THREADS`). Both
//! libraries wait for their workers by spinning, so on cores shared with other work one
//! thread each is fastest (docs/decisions.md, "YAQA Hessians").

mod common;

use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor};
use faer::{Accum, MatMut, MatRef, Par};
use sfx_calibration::yaqa::{
    sequence_loss_and_gradients, sketch_b, KroneckerFactors, SketchOptions,
};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::corpus;
use std::time::Instant;
use tokenizers::Tokenizer;

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// User + system CPU seconds of the whole process (all threads): unlike wall time, barely
/// affected by other processes sharing the cores.
fn cpu_s() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the parenthesised command name; utime and stime are fields 14, 15.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(f64::NAN)
}

fn arg(i: usize, default: usize) -> Result<usize> {
    std::env::args().nth(i).map_or(Ok(default), |s| {
        s.parse().with_context(|| format!("argument {i}: {s}"))
    })
}

/// `dst += a · b` on faer's full (rectangular) GEMM.
fn faer_full(dst: &mut [f32], n: usize, a: MatRef<'_, f32>, b: MatRef<'_, f32>) {
    faer::linalg::matmul::matmul(
        MatMut::from_row_major_slice_mut(dst, n, n),
        Accum::Add,
        a,
        b,
        1.0f32,
        Par::rayon(0),
    );
}

fn main() -> Result<()> {
    let n = arg(1, 2)?;
    let len = arg(2, 512)?;
    let assets = corpus::assets_dir();
    let gguf = assets.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let ckpt = Checkpoint::open(gguf.to_str().context("asset path is not UTF-8")?)?;
    let tok_json = ckpt
        .tokenizer_json
        .as_ref()
        .context("GGUF has no tokenizer")?;
    let tok = Tokenizer::from_bytes(tok_json.as_bytes()).map_err(|e| anyhow!("tokenizer: {e}"))?;
    let text = corpus::wiki_text(&assets)?;
    let ids = common::prefix_tokens(&tok, &text, n * len)?;
    let seqs: Vec<Vec<u32>> = ids.chunks_exact(len).map(<[u32]>::to_vec).collect();
    println!(
        "threads: rayon/faer {}, candle {}; {n} × {len} tokens; after load: peak RSS {:.0} MiB",
        rayon::current_num_threads(),
        candle_core::utils::get_num_threads(),
        peak_rss_mib()
    );

    // 1. forward + backward of one sequence (labels: the next tokens, any labels cost the same).
    let labels: Vec<u32> = seqs[0][1..].iter().chain(&seqs[0][..1]).copied().collect();
    let (t, c) = (Instant::now(), cpu_s());
    let sg = sequence_loss_and_gradients(&ckpt.config, &*ckpt.tensors, &seqs[0], &labels)?;
    let tm = sg.timings;
    println!(
        "sequence_gradients: {:.2} s wall ({:.1} CPU-s): load {:.2} s, forward + loss {:.2} s, \
         backward + G_b to host {:.2} s; peak RSS {:.0} MiB",
        t.elapsed().as_secs_f64(),
        cpu_s() - c,
        tm.load_s,
        tm.forward_s,
        tm.backward_s,
        peak_rss_mib()
    );
    let grads = sg.gradients;

    // 2. factor products for those G_b.
    let (t, c) = (Instant::now(), cpu_s());
    for (rows, cols, g) in grads.values() {
        let mut f = KroneckerFactors::zeros(*rows, *cols);
        f.accumulate(g, len as u64)?;
    }
    println!(
        "H accumulation, faer lower triangle (used): {:.2} s ({:.1} CPU-s)",
        t.elapsed().as_secs_f64(),
        cpu_s() - c
    );
    let (t, c0) = (Instant::now(), cpu_s());
    for (rows, cols, g) in grads.values() {
        let (r, c) = (*rows, *cols);
        let gm = MatRef::from_row_major_slice(g, r, c);
        let (mut h_in, mut h_out) = (vec![0f32; c * c], vec![0f32; r * r]);
        faer_full(&mut h_in, c, gm.transpose(), gm);
        faer_full(&mut h_out, r, gm, gm.transpose());
    }
    println!(
        "H accumulation, faer full GEMM:             {:.2} s ({:.1} CPU-s)",
        t.elapsed().as_secs_f64(),
        cpu_s() - c0
    );
    let (t, c) = (Instant::now(), cpu_s());
    for (rows, cols, g) in grads.values() {
        let gt = Tensor::from_slice(g, (*rows, *cols), &Device::Cpu)?;
        let h_in = gt.t()?.matmul(&gt)?;
        let h_out = gt.matmul(&gt.t()?)?;
        // Host copies, as the accumulated sums live on the host.
        let _ = (
            h_in.flatten_all()?.to_vec1::<f32>()?,
            h_out.flatten_all()?.to_vec1::<f32>()?,
        );
    }
    println!(
        "H accumulation, candle matmul:              {:.2} s ({:.1} CPU-s)",
        t.elapsed().as_secs_f64(),
        cpu_s() - c
    );
    drop(grads);

    // 3. the whole sketch.
    let (t, c) = (Instant::now(), cpu_s());
    let mut marks = Vec::new();
    let factors = sketch_b(
        &ckpt.config,
        &*ckpt.tensors,
        &seqs,
        &SketchOptions::default(),
        &mut |done, total| {
            marks.push(t.elapsed().as_secs_f64());
            eprintln!("  {done}/{total} at {:.1} s", t.elapsed().as_secs_f64());
        },
    )?;
    let per_seq = (marks[marks.len() - 1] - marks[0]) / n as f64;
    println!(
        "sketch_b: {} linears, load {:.2} s, {per_seq:.2} s per {len}-token sequence \
         (fwd + bwd + H; {:.1} CPU-s per sequence incl. load); peak RSS {:.0} MiB",
        factors.len(),
        marks[0],
        (cpu_s() - c) / n as f64,
        peak_rss_mib()
    );
    Ok(())
}
