//! `sfx-convert import-qtip`: conformance with the QTIP checkpoint format as docs/format.md
//! states it, "QTIP/YAQA checkpoint import" (no real checkpoint can be downloaded here).
//!
//! Each test writes a synthetic QTIP folder (config.json with `quip_params`, safetensors with
//! `trellis` / `SU` / `SV` / `tlut` per projection): random tile streams (any byte stream is a
//! valid tail-biting trellis stream), random ±1 `SU`, random `SV`, a random table, stored in
//! the kernel's byte swizzle computed here from the formula. After the import, every
//! projection loaded by the runtime (`SfxLinearFactory::trellis_quantized` →
//! `dequantize_trellis`) must equal a dense recomputation written in this file from the
//! formulas (bit-by-bit states, HYB, fragment order, dense Hadamard matrices in f64) — none of
//! it shares code with the decoder under test.

use half::{bf16, f16};
use serde_json::{json, Value};
use sfx_formats::qtip::{HadamardTables, QtipCheckpoint};
use sfx_formats::sfx::{Layout, SfxFile, SfxWriter};
use sfx_formats::DType;
use sfx_runtime::resident::dequantize_trellis;
use sfx_runtime::{
    load_sfx_model, LinearRole, LinearSpec, LogitsMode, ModelOptions, SfxLinearFactory,
    WeightPrecision,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Checkpoint tensors by name: dtype, shape, little-endian bytes.
type Tensors = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

const CONVERT: &str = env!("CARGO_BIN_EXE_sfx-convert");
const Q: u32 = 9;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 40) as u8
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() % 2_000_000) as f32 / 1_000_000.0 - 1.0
    }
    fn sign(&mut self) -> f32 {
        if self.next() & 1 == 0 {
            1.0
        } else {
            -1.0
        }
    }
}

/// Model shape of a synthetic checkpoint.
#[derive(Clone, Copy)]
struct Shape {
    hidden: usize,
    inter: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    vocab: usize,
    k: usize,
    tied: bool,
}

/// What the test keeps of one projection to recompute its weight.
struct Proj {
    rows: usize,
    cols: usize,
    /// Per-tile big-endian streams, row-major tile order (before the swizzle).
    tiles: Vec<u8>,
    su: Vec<f32>,
    sv: Vec<f32>,
    tlut: Vec<[f32; 2]>,
}

fn projections(s: &Shape) -> Vec<(&'static str, usize, usize)> {
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    vec![
        ("self_attn.q_proj", q, s.hidden),
        ("self_attn.k_proj", kv, s.hidden),
        ("self_attn.v_proj", kv, s.hidden),
        ("self_attn.o_proj", s.hidden, q),
        ("mlp.gate_proj", s.inter, s.hidden),
        ("mlp.up_proj", s.inter, s.hidden),
        ("mlp.down_proj", s.hidden, s.inter),
    ]
}

/// The kernel storage of per-tile streams, straight from the formula of §3: stored byte
/// `((((A·(cols/32)+B)·32 + c)·2 + b)·2 + a)·K + (K−1−r)` holds byte `c·K + r` of tile
/// `(2A+a, 2B+b)`. Written per destination byte here (the importer walks storage order).
fn qtip_swizzle(tiles: &[u8], rows: usize, cols: usize, k: usize) -> Vec<u8> {
    let mut out = vec![0u8; tiles.len()];
    let tile_bytes = 32 * k;
    for tr in 0..rows / 16 {
        for tc in 0..cols / 16 {
            let (big_a, a, big_b, b) = (tr / 2, tr % 2, tc / 2, tc % 2);
            for c in 0..32 {
                for r in 0..k {
                    let stored = ((((big_a * (cols / 32) + big_b) * 32 + c) * 2 + b) * 2 + a) * k
                        + (k - 1 - r);
                    out[stored] = tiles[(tr * (cols / 16) + tc) * tile_bytes + c * k + r];
                }
            }
        }
    }
    out
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn bytes_f16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}
fn bytes_bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
        .collect()
}

fn quip_params(k: usize) -> Value {
    json!({"codebook": "bitshift", "codebook_version": 0, "L": 16, "K": k, "V": 2,
           "tlut_bits": Q, "decode_mode": "quantlut_sym", "td_x": 16, "td_y": 16,
           "split_for_tp": false, "skip_list": null})
}

fn config_json(s: &Shape) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": s.hidden, "intermediate_size": s.inter,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "num_hidden_layers": s.layers, "vocab_size": s.vocab,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": s.tied, "bos_token_id": 1, "eos_token_id": 2,
        "quip_params": quip_params(s.k),
    })
}

/// Writes a synthetic QTIP folder; returns the projections (by `model.layers.{l}.{proj}`)
/// and the raw float tensors (name → (dtype, shape, bytes)).
fn write_checkpoint(dir: &Path, s: &Shape, seed: u64) -> (BTreeMap<String, Proj>, Tensors) {
    let mut rng = Rng(seed);
    let mut t: Tensors = BTreeMap::new();
    use safetensors::Dtype as D;
    let rand_vec = |n: usize, rng: &mut Rng| (0..n).map(|_| rng.unit()).collect::<Vec<_>>();
    let embed = rand_vec(s.vocab * s.hidden, &mut rng);
    t.insert(
        "model.embed_tokens.weight".into(),
        (D::F16, vec![s.vocab, s.hidden], bytes_f16(&embed)),
    );
    if !s.tied {
        let head = rand_vec(s.vocab * s.hidden, &mut rng);
        t.insert(
            "lm_head.weight".into(),
            (D::BF16, vec![s.vocab, s.hidden], bytes_bf16(&head)),
        );
    }
    let norm = rand_vec(s.hidden, &mut rng);
    t.insert(
        "model.norm.weight".into(),
        (D::F16, vec![s.hidden], bytes_f16(&norm)),
    );
    // One shared table, as QTIP's checkpoints have; layer 1's down_proj gets its own to
    // exercise the per-projection table.
    let shared_lut: Vec<f32> = rand_vec(2 << Q, &mut rng).iter().map(|v| 2.0 * v).collect();
    let mut projs = BTreeMap::new();
    for l in 0..s.layers {
        for n in ["input_layernorm", "post_attention_layernorm"] {
            let v: Vec<f32> = rand_vec(s.hidden, &mut rng)
                .iter()
                .map(|x| 1.0 + 0.5 * x)
                .collect();
            t.insert(
                format!("model.layers.{l}.{n}.weight"),
                (D::F16, vec![s.hidden], bytes_f16(&v)),
            );
        }
        for (proj, rows, cols) in projections(s) {
            let p = format!("model.layers.{l}.{proj}");
            let tiles: Vec<u8> = (0..rows * cols * s.k / 8).map(|_| rng.byte()).collect();
            let stored = qtip_swizzle(&tiles, rows, cols, s.k);
            let n_tiles = (rows / 16) * (cols / 16);
            t.insert(
                format!("{p}.trellis"),
                (D::I16, vec![n_tiles, 16 * s.k], stored),
            );
            let su: Vec<f32> = (0..cols).map(|_| rng.sign()).collect();
            // SU in the model dtype (BF16 here); SV fp32 = signs × Wscale.
            t.insert(format!("{p}.SU"), (D::BF16, vec![cols], bytes_bf16(&su)));
            let sv: Vec<f32> = (0..rows)
                .map(|_| rng.sign() * (0.01 + 0.05 * rng.unit().abs()))
                .collect();
            t.insert(format!("{p}.SV"), (D::F32, vec![rows], bytes_f32(&sv)));
            let lut: Vec<f32> = if l == 1 && proj == "mlp.down_proj" {
                rand_vec(2 << Q, &mut rng)
            } else {
                shared_lut.clone()
            };
            let lut16: Vec<f32> = lut.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            t.insert(
                format!("{p}.tlut"),
                (D::F16, vec![1 << Q, 2], bytes_f16(&lut16)),
            );
            // QTIP's non-persistent TP switch, saved as a buffer: 0 = no split.
            t.insert(
                format!("{p}.rcp"),
                (D::I64, vec![], 0i64.to_le_bytes().to_vec()),
            );
            t.insert(
                format!("{p}.tp_rank"),
                (D::I64, vec![], 8i64.to_le_bytes().to_vec()),
            );
            projs.insert(
                p,
                Proj {
                    rows,
                    cols,
                    tiles,
                    su,
                    sv,
                    tlut: lut16.chunks_exact(2).map(|c| [c[0], c[1]]).collect(),
                },
            );
        }
    }
    write_folder(dir, &config_json(s), &t);
    (projs, t)
}

fn write_folder(dir: &Path, config: &Value, t: &Tensors) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Natural-order Sylvester matrix entry `(−1)^popcount(i & j)`.
fn sylvester(i: usize, j: usize) -> f64 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

/// Dense `(H_m ⊗ H_{n/m}) / √n`, row-major, `h_m` the ±1 factor (`[1]` for powers of two).
fn dense_hadamard(n: usize, h_m: &[Vec<i8>]) -> Vec<f64> {
    let m = h_m.len();
    let p = n / m;
    let scale = 1.0 / (n as f64).sqrt();
    let mut h = vec![0.0; n * n];
    for i in 0..m {
        for j in 0..m {
            for a in 0..p {
                for b in 0..p {
                    h[(i * p + a) * n + j * p + b] = f64::from(h_m[i][j]) * sylvester(a, b) * scale;
                }
            }
        }
    }
    h
}

/// The decoded rotated weight Ŵ `[rows, cols]` from the formulas of §3: state `s` of a tile
/// is the 16 bits at bit `2K·s` of its stream (MSB-first, wrapping), HYB gives the value pair,
/// and value `v` of step `s` lands at row `8·d0 + d1`, column `8·d2 + 2·d3 + d4` (p = 2s + v).
fn reference_rotated(p: &Proj, k: usize) -> Vec<f64> {
    let tile_bytes = 32 * k;
    let bits = 8 * tile_bytes;
    let mut w = vec![0.0f64; p.rows * p.cols];
    for tr in 0..p.rows / 16 {
        for tc in 0..p.cols / 16 {
            let e = &p.tiles[(tr * (p.cols / 16) + tc) * tile_bytes..][..tile_bytes];
            let bit = |i: usize| u64::from((e[(i % bits) / 8] >> (7 - (i % bits) % 8)) & 1);
            for s in 0..128 {
                let x: u64 = (0..16).fold(0, |acc, i| (acc << 1) | bit(2 * k * s + i));
                let h = x * (x + 1);
                let idx = ((h >> (15 - Q)) & ((1 << Q) - 1)) as usize;
                let negate = (h >> 15) & 1 == 1;
                let first = f64::from(p.tlut[idx][0]);
                let pair = [
                    if negate { -first } else { first },
                    f64::from(p.tlut[idx][1]),
                ];
                for (v, &val) in pair.iter().enumerate() {
                    let q = 2 * s + v;
                    let (d1, d3, d2, d0, d4) =
                        (q >> 5, (q >> 3) & 3, (q >> 2) & 1, (q >> 1) & 1, q & 1);
                    let (r, c) = (8 * d0 + d1, 8 * d2 + 2 * d3 + d4);
                    w[(tr * 16 + r) * p.cols + tc * 16 + c] = val;
                }
            }
        }
    }
    w
}

/// `W = diag(SV) · H_outᵀ · Ŵ · H_in · diag(SU)`, dense f64.
fn reference_weight(p: &Proj, k: usize, tables: &BTreeMap<usize, Vec<Vec<i8>>>) -> Vec<f64> {
    let factor = |n: usize| -> Vec<Vec<i8>> {
        if n.is_power_of_two() {
            vec![vec![1]]
        } else {
            tables
                .iter()
                .find(|(&m, _)| n.is_multiple_of(m) && (n / m).is_power_of_two())
                .map(|(_, h)| h.clone())
                .expect("test table")
        }
    };
    let (rows, cols) = (p.rows, p.cols);
    let h_in = dense_hadamard(cols, &factor(cols));
    let h_out = dense_hadamard(rows, &factor(rows));
    let w_hat = reference_rotated(p, k);
    let mut t = vec![0.0; rows * cols]; // Ŵ · H_in
    for r in 0..rows {
        for c in 0..cols {
            t[r * cols + c] = (0..cols)
                .map(|j| w_hat[r * cols + j] * h_in[j * cols + c])
                .sum();
        }
    }
    let mut w = vec![0.0; rows * cols]; // H_outᵀ · t, scaled
    for r in 0..rows {
        for c in 0..cols {
            let v: f64 = (0..rows)
                .map(|i| h_out[i * rows + r] * t[i * cols + c])
                .sum();
            w[r * cols + c] = f64::from(p.sv[r]) * v * f64::from(p.su[c]);
        }
    }
    w
}

/// Paley I Hadamard matrix of order 12 (q = 11), built here from quadratic residues.
fn paley12() -> Vec<Vec<i8>> {
    let residue = |a: usize| (1..11usize).any(|x| x * x % 11 == a % 11);
    (0..12)
        .map(|i| {
            (0..12)
                .map(|j| match (i, j) {
                    _ if i == j => 1,
                    (0, _) => 1,
                    (_, 0) => -1,
                    _ if residue(11 + j - i) => 1,
                    _ => -1,
                })
                .collect()
        })
        .collect()
}

fn run_import(dir: &Path, out: &Path, tables: Option<&Path>) -> (bool, Value, String) {
    let mut args = vec![
        "import-qtip".to_string(),
        dir.display().to_string(),
        "-o".into(),
        out.display().to_string(),
        "--json".into(),
    ];
    if let Some(t) = tables {
        args.extend(["--hadamard-tables".into(), t.display().to_string()]);
    }
    let o = Command::new(CONVERT)
        .args(&args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    (o.status.success(), report, stderr)
}

/// Imports, then checks every projection, the dense sections and the metadata, and runs the
/// loaded model on a few tokens.
fn import_and_check(s: Shape, seed: u64, tables: &BTreeMap<usize, Vec<Vec<i8>>>) {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("qtip");
    let (projs, raw) = write_checkpoint(&src, &s, seed);
    let tables_path = d.path().join("had.json");
    let table_json: serde_json::Map<String, Value> = tables
        .iter()
        .map(|(m, h)| {
            // Rows as +/- strings (the format Sloane's library uses).
            let rows: Vec<String> = h
                .iter()
                .map(|r| r.iter().map(|&e| if e > 0 { '+' } else { '-' }).collect())
                .collect();
            (m.to_string(), json!(rows))
        })
        .collect();
    std::fs::write(&tables_path, Value::Object(table_json).to_string()).unwrap();
    let out = d.path().join("model.sfx");
    let (ok, report, stderr) = run_import(
        &src,
        &out,
        (!tables.is_empty()).then_some(tables_path.as_path()),
    );
    assert!(ok, "import failed: {stderr}");
    let n_proj = s.layers * 7;
    assert_eq!(report["trellis_projections"], json!(n_proj), "{report}");
    assert_eq!(report["per_projection_tables"], json!(1), "{report}");
    assert_eq!(
        report["hadamard_orders"],
        json!(tables.keys().collect::<Vec<_>>()),
        "{report}"
    );
    assert_eq!(
        report["ignored_tensors"].as_array().unwrap().len(),
        n_proj,
        "tp_rank only: {report}"
    );

    let file = SfxFile::open(&out).unwrap();
    let quant = &file.metadata().params["quant"];
    assert_eq!(quant["packing"], "trellis-v1");
    assert_eq!(quant["method"], "qtip-import");
    assert_eq!(quant["bits"], json!(s.k));
    assert_eq!(quant["code"], "hyb-q9");
    assert_eq!(quant["quip_params"], quip_params(s.k));
    let want_bpw = s.k as f64
        + projections(&s)
            .iter()
            .map(|(_, r, c)| (16 * c + 32 * r) as f64)
            .sum::<f64>()
            / projections(&s)
                .iter()
                .map(|(_, r, c)| (r * c) as f64)
                .sum::<f64>();
    assert!(
        (quant["bits_per_weight"].as_f64().unwrap() - want_bpw).abs() < 1e-9,
        "{quant}"
    );
    assert_eq!(
        file.metadata().config.as_ref().unwrap().hidden_size,
        s.hidden
    );
    assert!(file
        .section("model.layers.0.self_attn.q_proj.weight.tlut")
        .is_err());
    assert!(file
        .section("model.layers.1.mlp.down_proj.weight.tlut")
        .is_ok());
    for m in tables.keys() {
        assert!(file.section(&format!("resident.hadamard.{m}")).is_ok());
    }

    // Dense sections: embedding / head in the source dtype, byte for byte; norms as F32.
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        if let Some((_, _, bytes)) = raw.get(name) {
            assert_eq!(
                &file.section(name).unwrap().decode().unwrap()[..],
                &bytes[..],
                "{name}"
            );
        }
    }
    let norm = file
        .section("model.layers.1.input_layernorm.weight")
        .unwrap();
    assert_eq!(
        *norm.layout,
        Layout::Dense {
            dtype: DType::F32,
            shape: vec![s.hidden as u64]
        }
    );
    let want: Vec<u8> = raw["model.layers.1.input_layernorm.weight"]
        .2
        .chunks_exact(2)
        .flat_map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32().to_le_bytes())
        .collect();
    assert_eq!(&norm.decode().unwrap()[..], &want[..]);

    // Every projection as the runtime loads it against the reference.
    let factory = SfxLinearFactory::new(&file, WeightPrecision::F32);
    for (pname, p) in &projs {
        let (layer, proj) = pname["model.layers.".len()..].split_once('.').unwrap();
        let weight_name = format!("{pname}.weight");
        let spec = LinearSpec {
            layer: Some(layer.parse().unwrap()),
            role: LinearRole::of_projection(proj).expect("a decoder projection"),
            weight_name: &weight_name,
            bias_name: None,
            out_dim: p.rows,
            in_dim: p.cols,
        };
        let q = factory.trellis_quantized(&spec).unwrap();
        let got = dequantize_trellis(&q).unwrap();
        let want = reference_weight(p, s.k, tables);
        let max = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        assert!(max > 0.0);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(g) - w).abs() <= 2e-5 * max,
                "{pname} [{}, {}]: imported {g}, reference {w}",
                i / p.cols,
                i % p.cols
            );
        }
    }

    // The whole container loads and runs.
    let model = load_sfx_model(&file, &ModelOptions::default()).unwrap();
    let mut cache = model.new_cache(8).unwrap();
    let logits = model
        .forward(&[1, 5, 7], &mut cache, LogitsMode::Last)
        .unwrap();
    assert_eq!(logits.last().unwrap().len(), s.vocab);
    assert!(logits.last().unwrap().iter().all(|v| v.is_finite()));
}

#[test]
fn power_of_two_model_imports_exactly() {
    let s = Shape {
        hidden: 64,
        inter: 128,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        layers: 2,
        vocab: 64,
        k: 2,
        tied: false,
    };
    import_and_check(s, 7, &BTreeMap::new());
}

#[test]
fn non_power_of_two_model_with_supplied_table_imports_exactly() {
    // hidden = q_dim = 96 = 12·8 needs the 12×12 table; kv 32 and intermediate 128 do not.
    let s = Shape {
        hidden: 96,
        inter: 128,
        heads: 3,
        kv_heads: 1,
        head_dim: 32,
        layers: 2,
        vocab: 48,
        k: 3,
        tied: true,
    };
    import_and_check(s, 11, &BTreeMap::from([(12, paley12())]));
}

/// Library-level errors on a damaged synthetic checkpoint name the tensor or field.
#[test]
fn damaged_checkpoints_are_named() {
    let s = Shape {
        hidden: 64,
        inter: 64,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        layers: 1,
        vocab: 32,
        k: 2,
        tied: true,
    };
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("ok");
    let (_, raw) = write_checkpoint(&src, &s, 3);
    let import_err = |edit: &dyn Fn(&mut Value, &mut Tensors), tables: &HadamardTables| -> String {
        let (mut config, mut t) = (config_json(&s), raw.clone());
        edit(&mut config, &mut t);
        let dir = tempfile::tempdir().unwrap();
        write_folder(dir.path(), &config, &t);
        let ckpt = match QtipCheckpoint::open(dir.path()) {
            Ok(c) => c,
            Err(e) => return e.to_string(),
        };
        let out = dir.path().join("x.sfx");
        let mut w = SfxWriter::create(&out).unwrap();
        let e = ckpt
            .write_sfx(tables, &mut w, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        drop(w);
        assert!(!out.exists(), "a failed import leaves no file");
        e
    };
    let none = HadamardTables::new();

    let e = import_err(
        &|c, _| {
            c.as_object_mut().unwrap().remove("quip_params");
        },
        &none,
    );
    assert!(e.contains("quip_params") && e.contains("missing"), "{e}");
    let e = import_err(
        &|c, _| c["quip_params"]["decode_mode"] = json!("quantlut"),
        &none,
    );
    assert!(
        e.contains("quip_params.decode_mode") && e.contains("quantlut"),
        "{e}"
    );

    let q = "model.layers.0.self_attn.q_proj";
    // One tile fewer than a [64, 64] projection at K = 2 has (16 tiles of 16·K int16 words).
    let e = import_err(
        &|_, t| {
            let (_, shape, data) = t.get_mut(&format!("{q}.trellis")).unwrap();
            shape[0] -= 1;
            data.truncate(shape[0] * shape[1] * 2);
        },
        &none,
    );
    assert!(
        e.contains(&format!("{q}.trellis")) && e.contains("[15, 32], expected I16 [16, 32]"),
        "{e}"
    );

    let e = import_err(
        &|_, t| {
            t.get_mut(&format!("{q}.SU")).unwrap().2[10..12]
                .copy_from_slice(&bf16::from_f32(0.5).to_le_bytes());
        },
        &none,
    );
    assert!(
        e.contains(&format!("{q}.SU")) && e.contains("SU[5] = 0.5 is not ±1"),
        "{e}"
    );

    let e = import_err(
        &|_, t| {
            t.remove(&format!("{q}.tlut"));
        },
        &none,
    );
    assert!(
        e.contains(&format!("{q}.tlut")) && e.contains("not found"),
        "{e}"
    );

    let e = import_err(
        &|_, t| {
            t.insert(
                format!("{q}.rcp"),
                (safetensors::Dtype::I64, vec![], 1i64.to_le_bytes().to_vec()),
            );
        },
        &none,
    );
    assert!(
        e.contains(&format!("{q}.rcp")) && e.contains("tensor-parallel"),
        "{e}"
    );

    // hidden 96 without a table: the error names the missing order before anything is written.
    let e = import_err(
        &|c, _| {
            c["hidden_size"] = json!(96);
            c["num_attention_heads"] = json!(3);
        },
        &none,
    );
    assert!(
        e.contains("K = 12 for dimension 96") && e.contains("--hadamard-tables"),
        "{e}"
    );
}
