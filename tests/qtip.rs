//! QTIP / YAQA rounding on a real SmolLM2 projection (layer 0 `k_proj`, 192 × 576): the
//! quality claims of the trellis quantizers, measured against full-precision recomputation in
//! the test (f64), not against values the quantizer reports about itself.
//!
//! - QTIP 2-bit (trellis + LDLQ with the input Hessian) beats RTN 2-bit g128 by a wide margin
//!   on the Hessian-weighted error `tr(E H Eᵀ) / tr(W H Wᵀ)`;
//! - LDLQ beats plain trellis rounding of the same rotated weight (QTIP with `H = I`);
//! - the 1MAD and 3INST codes (V = 1, other Viterbi kernels, other decoders) round it about
//!   as well as HYB;
//! - YAQA's two-sided LDLQ beats QTIP on YAQA's own objective `tr(E H_in Eᵀ H_out)`.

use crate::common;

use sfx_calibration::quant::{
    InputStats, Kron, Qtip, QuantizedSet, ResidentQuantizer, Rtn, SetContext, WeightView, Yaqa,
};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::resident::TrellisCode;
use sfx_runtime::ProjectionSet;

const NAME: &str = "model.layers.0.self_attn.k_proj.weight";

struct Setup {
    w: Vec<f32>,
    rows: usize,
    cols: usize,
    /// E[x xᵀ] of the projection's input on 256 wiki tokens.
    gram: Vec<f32>,
}

fn setup(ckpt: &Checkpoint) -> Setup {
    let c = &ckpt.config;
    let t = ckpt.tensors.tensor(NAME).unwrap();
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let w = t.to_f32_vec();
    // Layer 0's q/k/v input, recomputed here: RMSNorm(embedding) ⊙ input_layernorm weight.
    let emb = ckpt
        .tensors
        .tensor("model.embed_tokens.weight")
        .unwrap()
        .to_f32_vec();
    let ln = ckpt
        .tensors
        .tensor("model.layers.0.input_layernorm.weight")
        .unwrap()
        .to_f32_vec();
    let tokens = common::wiki_tokens(256);
    let mut gram = vec![0.0f64; cols * cols];
    for &tok in &tokens {
        let e = &emb[tok as usize * cols..(tok as usize + 1) * cols];
        let ms = e.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + c.rms_norm_eps).sqrt();
        let x: Vec<f64> = e
            .iter()
            .zip(&ln)
            .map(|(&v, &g)| f64::from(v) * inv * f64::from(g))
            .collect();
        for i in 0..cols {
            for j in 0..cols {
                gram[i * cols + j] += x[i] * x[j] / tokens.len() as f64;
            }
        }
    }
    Setup {
        w,
        rows,
        cols,
        gram: gram.iter().map(|&v| v as f32).collect(),
    }
}

fn view<'a>(s: &'a Setup, kron: Option<Kron<'a>>) -> WeightView<'a> {
    WeightView {
        name: NAME,
        data: &s.w,
        rows: s.rows,
        cols: s.cols,
        kron,
        fisher: None,
        imatrix: None,
        guided: None,
    }
}

fn stats(s: &Setup, gram: Vec<f32>) -> InputStats {
    InputStats {
        cols: s.cols,
        tokens: 256,
        gram,
        abs_mean: vec![1.0; s.cols],
    }
}

const CTX: SetContext = SetContext {
    set: ProjectionSet::Qkv,
    scales_foldable: false,
};

fn dequantized(q: &QuantizedSet) -> Vec<f32> {
    q.weights[0].dequantize(NAME).unwrap()
}

/// `tr(E A Eᵀ B)` with `E = W − Ŵ` (`B = I` when `b` is None), f64.
fn kron_error(s: &Setup, deq: &[f32], a: &[f32], b: Option<&[f32]>) -> f64 {
    let (rows, cols) = (s.rows, s.cols);
    let e: Vec<f64> = s.w.iter().zip(deq).map(|(w, q)| f64::from(w - q)).collect();
    // EA (rows × cols).
    let mut ea = vec![0.0f64; rows * cols];
    for r in 0..rows {
        for k in 0..cols {
            let v = e[r * cols + k];
            if v != 0.0 {
                for j in 0..cols {
                    ea[r * cols + j] += v * f64::from(a[k * cols + j]);
                }
            }
        }
    }
    // (E A Eᵀ)[r][r'] weighted by B[r'][r].
    let mut tot = 0.0;
    for r in 0..rows {
        for r2 in 0..rows {
            let bw = match b {
                Some(b) => f64::from(b[r2 * rows + r]),
                None if r == r2 => 1.0,
                None => continue,
            };
            if bw == 0.0 {
                continue;
            }
            let dot: f64 = (0..cols).map(|j| ea[r * cols + j] * e[r2 * cols + j]).sum();
            tot += bw * dot;
        }
    }
    tot
}

fn relative(s: &Setup, deq: &[f32], gram: &[f32]) -> f64 {
    let zero = vec![0.0f32; s.w.len()];
    kron_error(s, deq, gram, None) / kron_error(s, &zero, gram, None)
}

#[test]
fn qtip2_with_ldlq_beats_rtn2_and_plain_trellis_rounding() {
    let ckpt = Checkpoint::open(common::gguf().to_str().unwrap()).unwrap();
    let s = setup(&ckpt);
    let qtip = Qtip::new(2);
    let q = qtip
        .quantize_set(&[view(&s, None)], Some(&stats(&s, s.gram.clone())), CTX)
        .unwrap();
    let bits = q.weights[0].bits_per_weight();
    let e_qtip = relative(&s, &dequantized(&q), &s.gram);

    let rtn = Rtn::new(2)
        .quantize_set(&[view(&s, None)], None, CTX)
        .unwrap();
    let e_rtn = relative(&s, &dequantized(&rtn), &s.gram);

    let eye: Vec<f32> = (0..s.cols * s.cols)
        .map(|t| if t / s.cols == t % s.cols { 1.0 } else { 0.0 })
        .collect();
    let plain = qtip
        .quantize_set(&[view(&s, None)], Some(&stats(&s, eye)), CTX)
        .unwrap();
    let e_plain = relative(&s, &dequantized(&plain), &s.gram);
    eprintln!(
        "{NAME}: H-weighted relative error qtip2 {e_qtip:.4} ({bits:.3} bits/weight), \
         trellis without LDLQ {e_plain:.4}, rtn2-g128 {e_rtn:.4}"
    );
    assert!((2.0..2.2).contains(&bits), "{bits}");
    assert!(e_qtip < 0.5 * e_rtn, "qtip2 {e_qtip} vs rtn2 {e_rtn}");
    assert!(e_qtip < e_plain, "LDLQ {e_qtip} vs plain trellis {e_plain}");
}

#[test]
fn every_trellis_code_rounds_the_real_projection() {
    let ckpt = Checkpoint::open(common::gguf().to_str().unwrap()).unwrap();
    let s = setup(&ckpt);
    let st = stats(&s, s.gram.clone());
    let rtn = Rtn::new(2)
        .quantize_set(&[view(&s, None)], None, CTX)
        .unwrap();
    let e_rtn = relative(&s, &dequantized(&rtn), &s.gram);
    let mut errors = Vec::new();
    for code in [
        TrellisCode::Hyb { q: 9 },
        TrellisCode::OneMad,
        TrellisCode::ThreeInst,
    ] {
        let q = Qtip {
            code,
            ..Qtip::new(2)
        }
        .quantize_set(&[view(&s, None)], Some(&st), CTX)
        .unwrap();
        errors.push((code.name(), relative(&s, &dequantized(&q), &s.gram)));
    }
    eprintln!("{NAME}: H-weighted relative error per code {errors:?}, rtn2-g128 {e_rtn:.4}");
    let hyb = errors[0].1;
    for (name, e) in &errors {
        assert!(*e < 0.5 * e_rtn, "{name} {e} vs rtn2 {e_rtn}");
        assert!(*e < 2.0 * hyb, "{name} {e} vs hyb {hyb}");
    }
}

#[test]
fn yaqa2_beats_qtip2_on_the_kronecker_objective() {
    let ckpt = Checkpoint::open(common::gguf().to_str().unwrap()).unwrap();
    let s = setup(&ckpt);
    // Sketch B on two 64-token wiki sequences: the factors of this projection only.
    let toks = common::wiki_tokens(128);
    let seqs = vec![toks[..64].to_vec(), toks[64..].to_vec()];
    let factors = sfx_calibration::yaqa::sketch_b(
        &ckpt.config,
        &*ckpt.tensors,
        &seqs,
        &sfx_calibration::yaqa::SketchOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let f = &factors[NAME];
    let kron = Kron {
        h_in: &f.h_in,
        h_out: &f.h_out,
    };
    let y = Yaqa::new(2)
        .quantize_set(&[view(&s, Some(kron))], None, CTX)
        .unwrap();
    let q = Qtip::new(2)
        .quantize_set(&[view(&s, None)], Some(&stats(&s, f.h_in.clone())), CTX)
        .unwrap();
    let obj = |set: &QuantizedSet| kron_error(&s, &dequantized(set), &f.h_in, Some(&f.h_out));
    let (oy, oq) = (obj(&y), obj(&q));
    eprintln!("{NAME}: tr(E H_in Eᵀ H_out) yaqa2 {oy:.4e}, qtip2 on H_in {oq:.4e}");
    assert!(
        oy < oq,
        "yaqa2 {oy} should beat qtip2 {oq} on its own objective"
    );
}

/// Does YAQA's advantage on its objective survive factors from other text? Factors A (rounding)
/// and B (evaluation) from disjoint wiki sequences; prints both objectives for yaqa2 and qtip2
/// (QTIP rounded with A's H_in). A measurement for docs/results.md, not a pass/fail claim.
#[test]
#[ignore = "measurement: cargo test --release --test integration qtip:: -- --ignored --nocapture"]
fn yaqa_factors_on_held_out_text() {
    let ckpt = Checkpoint::open(common::gguf().to_str().unwrap()).unwrap();
    let s = setup(&ckpt);
    let toks = common::wiki_tokens(1024);
    let seqs: Vec<Vec<u32>> = toks.chunks(128).map(|c| c.to_vec()).collect();
    let sketch = |part: &[Vec<u32>]| {
        sfx_calibration::yaqa::sketch_b(
            &ckpt.config,
            &*ckpt.tensors,
            part,
            &sfx_calibration::yaqa::SketchOptions::default(),
            &mut |_, _| {},
        )
        .unwrap()
        .remove(NAME)
        .unwrap()
    };
    let (a, b) = (sketch(&seqs[..4]), sketch(&seqs[4..]));
    let y = Yaqa::new(2)
        .quantize_set(
            &[view(
                &s,
                Some(Kron {
                    h_in: &a.h_in,
                    h_out: &a.h_out,
                }),
            )],
            None,
            CTX,
        )
        .unwrap();
    let q = Qtip::new(2)
        .quantize_set(&[view(&s, None)], Some(&stats(&s, a.h_in.clone())), CTX)
        .unwrap();
    for (name, f) in [("A (in-sample)", &a), ("B (held out)", &b)] {
        let oy = kron_error(&s, &dequantized(&y), &f.h_in, Some(&f.h_out));
        let oq = kron_error(&s, &dequantized(&q), &f.h_in, Some(&f.h_out));
        eprintln!(
            "factors {name}: yaqa2 {oy:.4e}, qtip2 {oq:.4e}, ratio {:.3}",
            oy / oq
        );
    }
}
