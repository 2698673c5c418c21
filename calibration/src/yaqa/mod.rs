//! YAQA "Sketch B" Kronecker factors of the Hessian of the full-model KL (Tseng, Sun, De Sa
//! 2025), implemented from the paper's formulas only.
//!
//! For a float model p and a quantized model q, the Hessian of KL(p‖q) with respect to a
//! weight W, at q = p, is the Fisher information of the model's own predictive distribution.
//! Sketch B estimates it per decoder linear as H_out ⊗ H_in from per-sequence gradients:
//!
//! * sequence b: forward x_1..x_T through the float model, draw y_t ~ p(· | x_≤t) at
//!   temperature 1 (labels sampled from the model itself, which is what makes the squared
//!   gradient a Fisher, not an empirical-Fisher, estimate), loss = Σ_t −log p(y_t | x_≤t);
//! * G_b = ∂loss/∂W = Σ_t g_t x_tᵀ (`out × in`), g_t the loss gradient at the linear's output;
//! * H_in += G_bᵀ G_b (`in × in`), H_out += G_b G_bᵀ (`out × out`).
//!
//! The factors are the plain sums: no power iterations (YAQA refines each factor against the
//! other afterwards), no normalisation (YAQA's rounding divides each factor by its mean
//! diagonal anyway; [`KroneckerFactors::sequences`] and [`KroneckerFactors::tokens`] let a
//! caller average). Sums are additive, so a calibration run may be split into shards
//! ([`SketchOptions::first_sequence`]) and merged with [`KroneckerFactors::merge`].
//!
//! The forward/backward runs on candle-core's CPU autograd (see [`graph`] and
//! docs/decisions.md, "YAQA Hessians"); the factor products run on faer.

mod graph;

use faer::linalg::matmul::triangular::{matmul as tri_matmul, BlockStructure};
use faer::{Accum, MatMut, MatRef, Par};
use graph::{Ctx, Graph};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sfx_formats::{ModelConfig, TensorSource};
use std::collections::BTreeMap;
use std::time::Instant;

#[derive(thiserror::Error, Debug)]
pub enum YaqaError {
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("tensor '{name}': {source}")]
    Tensor {
        name: String,
        #[source]
        source: Box<sfx_formats::FormatError>,
    },
    #[error("tensor '{name}' has shape {actual:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("invalid option {option}: {msg}")]
    InvalidOption { option: &'static str, msg: String },
    #[error("no calibration sequences given")]
    NoSequences,
    #[error("sequence {sequence} is empty")]
    EmptySequence { sequence: usize },
    #[error(
        "sequence {sequence} has {len} token(s): the Fisher diagonal needs at least two (the \
         text's own next tokens are the labels)"
    )]
    ShortSequence { sequence: usize, len: usize },
    #[error(
        "sequence {sequence} has {len} tokens, more than SketchOptions::max_len = {max} \
         (attention memory grows with the square of the length)"
    )]
    SequenceTooLong {
        sequence: usize,
        len: usize,
        max: usize,
    },
    #[error(
        "sequence {sequence}: token {token} at position {position} is outside the vocabulary \
         (vocab_size {vocab})"
    )]
    TokenOutOfRange {
        sequence: usize,
        position: usize,
        token: u32,
        vocab: usize,
    },
    #[error("label {label} at position {position} is outside the vocabulary (vocab_size {vocab})")]
    LabelOutOfRange {
        position: usize,
        label: u32,
        vocab: usize,
    },
    #[error("{labels} labels for {tokens} tokens: need exactly one label per token")]
    LabelCount { tokens: usize, labels: usize },
    #[error("sequence {sequence}: non-finite {what}")]
    NonFinite { sequence: usize, what: String },
    #[error(
        "gradient for a {rows}×{cols} factor pair has {actual} elements, expected {}",
        rows * cols
    )]
    GradientSize {
        rows: usize,
        cols: usize,
        actual: usize,
    },
    #[error("cannot merge factors of shape {a:?} and {b:?}")]
    MergeShape {
        a: (usize, usize),
        b: (usize, usize),
    },
    #[error("{context}: {source}")]
    Candle {
        context: String,
        #[source]
        source: Box<candle_core::Error>,
    },
}

/// Sketch B factors of one linear with weight `[rows = out, cols = in]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KroneckerFactors {
    pub rows: usize,
    pub cols: usize,
    /// Σ_b G_bᵀ G_b, `cols × cols` row-major, symmetric.
    pub h_in: Vec<f32>,
    /// Σ_b G_b G_bᵀ, `rows × rows` row-major, symmetric.
    pub h_out: Vec<f32>,
    /// Sequences accumulated.
    pub sequences: u64,
    /// Token positions accumulated (Σ_b T_b).
    pub tokens: u64,
}

impl KroneckerFactors {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            h_in: vec![0.0; cols * cols],
            h_out: vec![0.0; rows * rows],
            sequences: 0,
            tokens: 0,
        }
    }

    /// Adds one sequence's `g_b` (`rows × cols` row-major) covering `tokens` positions.
    ///
    /// Only the lower triangles are computed (the products are symmetric, and they are the
    /// dominant cost of a sketch: Σ in²·out + out²·in per sequence), then mirrored.
    pub fn accumulate(&mut self, g_b: &[f32], tokens: u64) -> Result<(), YaqaError> {
        let (rows, cols) = (self.rows, self.cols);
        if g_b.len() != rows * cols {
            return Err(YaqaError::GradientSize {
                rows,
                cols,
                actual: g_b.len(),
            });
        }
        let g = MatRef::from_row_major_slice(g_b, rows, cols);
        tri_matmul(
            MatMut::from_row_major_slice_mut(&mut self.h_in, cols, cols),
            BlockStructure::TriangularLower,
            Accum::Add,
            g.transpose(),
            BlockStructure::Rectangular,
            g,
            BlockStructure::Rectangular,
            1.0f32,
            Par::rayon(0),
        );
        tri_matmul(
            MatMut::from_row_major_slice_mut(&mut self.h_out, rows, rows),
            BlockStructure::TriangularLower,
            Accum::Add,
            g,
            BlockStructure::Rectangular,
            g.transpose(),
            BlockStructure::Rectangular,
            1.0f32,
            Par::rayon(0),
        );
        mirror_lower(&mut self.h_in, cols);
        mirror_lower(&mut self.h_out, rows);
        self.sequences += 1;
        self.tokens += tokens;
        Ok(())
    }

    /// Adds another shard's sums (same linear, disjoint sequences).
    pub fn merge(&mut self, other: &KroneckerFactors) -> Result<(), YaqaError> {
        if (self.rows, self.cols) != (other.rows, other.cols) {
            return Err(YaqaError::MergeShape {
                a: (self.rows, self.cols),
                b: (other.rows, other.cols),
            });
        }
        for (a, b) in self.h_in.iter_mut().zip(&other.h_in) {
            *a += b;
        }
        for (a, b) in self.h_out.iter_mut().zip(&other.h_out) {
            *a += b;
        }
        self.sequences += other.sequences;
        self.tokens += other.tokens;
        Ok(())
    }
}

/// The output channels of group `g` of `groups` over `rows`: `[g·rows/groups, (g+1)·rows/groups)`.
pub fn group_rows(rows: usize, groups: usize, g: usize) -> std::ops::Range<usize> {
    g * rows / groups..(g + 1) * rows / groups
}

/// GuidedQuant's saliency of one linear's outputs (Kim et al. 2025): the `rows` output
/// channels split into `groups` contiguous groups ([`group_rows`]), and for every token t of
/// every sequence `s_{t,g}` = the mean over group g's channels c of `(∂loss/∂z_{t,c})²`.
///
/// A row of group g is then quantized against `(ŵ − w)ᵀ H_g (ŵ − w)` with
/// `H_g = Σ_t s_{t,g} x_t x_tᵀ` ([`GuidedHessian`], x_t the linear's input at t): a
/// block-diagonal Fisher approximation in which each token counts as much as the loss cares
/// about the group's outputs there. Only the saliencies are kept — a few floats a token —
/// so the Hessians can be formed one layer at a time from the inputs the converter's
/// calibration stream holds, instead of `groups` input-sized matrices per linear for the
/// whole model at once (150 GB for an 8B model at four groups).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GuidedSaliency {
    pub rows: usize,
    pub groups: usize,
    /// Per sequence, `tokens × groups` row-major.
    pub sequences: Vec<Vec<f32>>,
}

impl GuidedSaliency {
    /// `groups` must be between 1 and `rows` (every group holds at least one channel).
    pub fn new(rows: usize, groups: usize) -> Result<Self, YaqaError> {
        if groups == 0 || groups > rows {
            return Err(YaqaError::InvalidOption {
                option: "guided groups",
                msg: format!("{groups} groups of {rows} output channels: expected 1..={rows}"),
            });
        }
        Ok(Self {
            rows,
            groups,
            sequences: Vec::new(),
        })
    }

    /// Appends one sequence from the loss gradients at the outputs, `g` (`t × rows`).
    pub fn push(&mut self, g: &[f32], t: usize) -> Result<(), YaqaError> {
        let rows = self.rows;
        if g.len() != t * rows {
            return Err(YaqaError::GradientSize {
                rows: t,
                cols: rows,
                actual: g.len(),
            });
        }
        let mut s = vec![0.0f32; t * self.groups];
        for (tok, out) in s.chunks_exact_mut(self.groups).enumerate() {
            let row = &g[tok * rows..(tok + 1) * rows];
            for (group, v) in out.iter_mut().enumerate() {
                let range = group_rows(rows, self.groups, group);
                let width = range.len() as f32;
                *v = row[range].iter().map(|x| x * x).sum::<f32>() / width;
            }
        }
        self.sequences.push(s);
        Ok(())
    }
}

/// GuidedQuant's Hessians of one linear with `cols` inputs: `groups` blocks
/// `H_g = Σ_t s_{t,g} x_t x_tᵀ` ([`GuidedSaliency`]). Plain sums over tokens, like
/// [`KroneckerFactors`]; the objectives that use them are invariant to their scale.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GuidedHessian {
    pub cols: usize,
    pub groups: usize,
    /// `groups` symmetric `cols × cols` blocks, row-major, one after another.
    pub sums: Vec<f32>,
    /// Token positions accumulated.
    pub tokens: u64,
}

impl GuidedHessian {
    pub fn zeros(cols: usize, groups: usize) -> Self {
        Self {
            cols,
            groups,
            sums: vec![0.0; groups * cols * cols],
            tokens: 0,
        }
    }

    /// Group `g`'s `cols × cols` block.
    pub fn block(&self, g: usize) -> &[f32] {
        let n = self.cols * self.cols;
        &self.sums[g * n..(g + 1) * n]
    }

    /// Adds `t` tokens: inputs `x` (`t × cols`) and their saliencies `s` (`t × groups`), both
    /// row-major. Lower triangles by product, then mirrored.
    pub fn accumulate(&mut self, x: &[f32], s: &[f32], t: usize) -> Result<(), YaqaError> {
        let (cols, groups) = (self.cols, self.groups);
        if x.len() != t * cols || s.len() != t * groups {
            return Err(YaqaError::GradientSize {
                rows: t,
                cols,
                actual: x.len().min(s.len()),
            });
        }
        let n = cols * cols;
        let mut scaled = vec![0.0f32; t * cols];
        for group in 0..groups {
            for (tok, dst) in scaled.chunks_exact_mut(cols).enumerate() {
                let root = s[tok * groups + group].max(0.0).sqrt();
                for (d, &xv) in dst.iter_mut().zip(&x[tok * cols..(tok + 1) * cols]) {
                    *d = xv * root;
                }
            }
            let xs = MatRef::from_row_major_slice(&scaled, t, cols);
            let block = &mut self.sums[group * n..(group + 1) * n];
            tri_matmul(
                MatMut::from_row_major_slice_mut(block, cols, cols),
                BlockStructure::TriangularLower,
                Accum::Add,
                xs.transpose(),
                BlockStructure::Rectangular,
                xs,
                BlockStructure::Rectangular,
                1.0f32,
                Par::rayon(0),
            );
            mirror_lower(block, cols);
        }
        self.tokens += t as u64;
        Ok(())
    }
}

/// The gradient statistics LNQ starts from and refines with: SqueezeLLM's Fisher diagonal
/// (its initialisation) and GuidedQuant's saliencies, from one pass over the same sequences.
#[derive(Debug, Clone, Default)]
pub struct GuidedStats {
    pub fisher: Gradients,
    pub saliency: BTreeMap<String, GuidedSaliency>,
}

/// Copies the lower triangle of the row-major `n × n` matrix `m` over its upper triangle.
fn mirror_lower(m: &mut [f32], n: usize) {
    for i in 0..n {
        for j in 0..i {
            m[j * n + i] = m[i * n + j];
        }
    }
}

/// Options of [`sketch_b`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SketchOptions {
    /// Seed of the label sampling; sequence b draws from a stream keyed by (seed, b).
    pub seed: u64,
    /// Index b of `seqs[0]` in the label streams: a run split into shards over consecutive
    /// slices of one sequence list reproduces the unsplit run's labels (and, merged, its sums).
    pub first_sequence: u64,
    /// Longest accepted sequence. The autograd graph keeps every activation until the
    /// backward pass: measured peak RSS for SmolLM2-135M 4.2 GB at T = 256, 6.3 GB at 512,
    /// 14.7 GB at 1024 (attention scores grow as T²), hence the default of 1024.
    pub max_len: usize,
}

impl Default for SketchOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            first_sequence: 0,
            max_len: 1024,
        }
    }
}

/// Weight name → (rows, cols, G_b row-major).
pub type Gradients = BTreeMap<String, (usize, usize, Vec<f32>)>;

/// One sequence's loss and per-linear gradients.
#[derive(Debug, Clone)]
pub struct SequenceGradients {
    /// Σ_t −log p(labels_t | tokens_≤t), accumulated by candle in f32.
    pub loss: f64,
    /// Weight name → (rows, cols, G_b row-major).
    pub gradients: Gradients,
    /// Wall-clock seconds of each step, for benchmarks.
    pub timings: Timings,
}

/// Wall-clock seconds of the steps of one [`sequence_loss_and_gradients`] call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Checkpoint tensors to f32 weights.
    pub load_s: f64,
    /// Forward graph up to the logits, plus the loss.
    pub forward_s: f64,
    /// `backward()` and the copies of every G_b to the host.
    pub backward_s: f64,
}

/// Sketch B factors of every decoder linear, keyed by the weight tensor name, e.g.
/// `"model.layers.0.self_attn.q_proj.weight"`, `"model.layers.3.mlp.down_proj.weight"`.
///
/// `progress(done, total)` is called with 0 first and after every sequence.
pub fn sketch_b(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    seqs: &[Vec<u32>],
    opts: &SketchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<String, KroneckerFactors>, YaqaError> {
    if opts.max_len == 0 {
        return Err(YaqaError::InvalidOption {
            option: "SketchOptions::max_len",
            msg: "must be at least 1".into(),
        });
    }
    if seqs.is_empty() {
        return Err(YaqaError::NoSequences);
    }
    // Every sequence is checked before the (long) run starts.
    for (i, s) in seqs.iter().enumerate() {
        check_tokens(config, s, i, opts.max_len)?;
    }
    let graph = Graph::load(config, tensors)?;
    let mut factors: BTreeMap<String, KroneckerFactors> = graph
        .projections()
        .map(|p| (p.name.clone(), KroneckerFactors::zeros(p.rows(), p.cols())))
        .collect();
    progress(0, seqs.len());
    for (i, tokens) in seqs.iter().enumerate() {
        let b = opts.first_sequence.wrapping_add(i as u64);
        let mut rng = label_rng(opts.seed, b);
        backward(&graph, tokens, i, &mut Timings::default(), |logits| {
            sample_labels(logits, config.vocab_size, &mut rng, i)
        })?;
        for p in graph.projections() {
            let g = weight_gradient(p)?;
            if let Some(f) = factors.get_mut(&p.name) {
                f.accumulate(&g, tokens.len() as u64)?;
            }
        }
        progress(i + 1, seqs.len());
    }
    Ok(factors)
}

/// Elementwise sums of squared per-sequence gradients of every decoder linear: the diagonal of
/// the empirical Fisher information `Σ_b G_b ⊙ G_b` (SqueezeLLM's sensitivity of each weight),
/// keyed like [`sketch_b`]'s factors, `rows × cols` row-major. The labels are the text's own
/// next tokens (sequence `s` predicts `s[1..]` from `s[..len − 1]`), so each sequence needs at
/// least two tokens.
///
/// `progress(done, total)` is called with 0 first and after every sequence.
pub fn fisher_diagonal(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    seqs: &[Vec<u32>],
    opts: &SketchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Gradients, YaqaError> {
    Ok(next_token_pass(config, tensors, seqs, opts, None, progress)?.fisher)
}

/// [`fisher_diagonal`] and, from the same backward passes, every decoder linear's
/// [`GuidedSaliency`] over `groups` output-channel groups (GuidedQuant's default: 4), one
/// entry per sequence with one row per predicted position (`len − 1` of them).
pub fn guided_statistics(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    seqs: &[Vec<u32>],
    groups: usize,
    opts: &SketchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<GuidedStats, YaqaError> {
    next_token_pass(config, tensors, seqs, opts, Some(groups), progress)
}

/// Backward passes with the text's own next tokens as labels, summing the Fisher diagonal and,
/// with `guided_groups`, the GuidedQuant saliencies.
fn next_token_pass(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    seqs: &[Vec<u32>],
    opts: &SketchOptions,
    guided_groups: Option<usize>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<GuidedStats, YaqaError> {
    if seqs.is_empty() {
        return Err(YaqaError::NoSequences);
    }
    for (i, s) in seqs.iter().enumerate() {
        if s.len() < 2 {
            return Err(YaqaError::ShortSequence {
                sequence: i,
                len: s.len(),
            });
        }
        check_tokens(config, &s[..s.len() - 1], i, opts.max_len)?;
        check_tokens(config, &s[1..], i, opts.max_len)?;
    }
    let mut graph = Graph::load(config, tensors)?;
    if let Some(groups) = guided_groups {
        graph.collect_saliency(groups)?;
    }
    let mut fisher: Gradients = graph
        .projections()
        .map(|p| {
            (
                p.name.clone(),
                (p.rows(), p.cols(), vec![0.0; p.rows() * p.cols()]),
            )
        })
        .collect();
    progress(0, seqs.len());
    for (i, s) in seqs.iter().enumerate() {
        let (tokens, labels) = (&s[..s.len() - 1], s[1..].to_vec());
        backward(&graph, tokens, i, &mut Timings::default(), |_| Ok(labels))?;
        for p in graph.projections() {
            let g = weight_gradient(p)?;
            if let Some((rows, cols, f)) = fisher.get_mut(&p.name) {
                if g.len() != f.len() {
                    return Err(YaqaError::GradientSize {
                        rows: *rows,
                        cols: *cols,
                        actual: g.len(),
                    });
                }
                for (fi, gi) in f.iter_mut().zip(&g) {
                    *fi += gi * gi;
                }
            }
        }
        progress(i + 1, seqs.len());
    }
    let saliency = graph
        .projections()
        .filter_map(|p| Some((p.name.clone(), p.take_saliency()?)))
        .collect();
    Ok(GuidedStats { fisher, saliency })
}

/// The per-sequence G_b of every decoder linear for given `labels` (one per token; label t is
/// the target of the prediction made after `tokens[..=t]`), for sequences of at most
/// `SketchOptions::default().max_len` tokens.
pub fn sequence_gradients(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    tokens: &[u32],
    labels: &[u32],
) -> Result<Gradients, YaqaError> {
    Ok(sequence_loss_and_gradients(config, tensors, tokens, labels)?.gradients)
}

/// [`sequence_gradients`] together with the loss Σ_t −log p(labels_t | tokens_≤t).
pub fn sequence_loss_and_gradients(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    tokens: &[u32],
    labels: &[u32],
) -> Result<SequenceGradients, YaqaError> {
    check_tokens(config, tokens, 0, SketchOptions::default().max_len)?;
    if labels.len() != tokens.len() {
        return Err(YaqaError::LabelCount {
            tokens: tokens.len(),
            labels: labels.len(),
        });
    }
    if let Some(position) = labels.iter().position(|&l| l as usize >= config.vocab_size) {
        return Err(YaqaError::LabelOutOfRange {
            position,
            label: labels[position],
            vocab: config.vocab_size,
        });
    }
    let start = Instant::now();
    let graph = Graph::load(config, tensors)?;
    let mut timings = Timings {
        load_s: start.elapsed().as_secs_f64(),
        ..Timings::default()
    };
    let loss = backward(&graph, tokens, 0, &mut timings, |_| Ok(labels.to_vec()))?;
    let start = Instant::now();
    let mut gradients = BTreeMap::new();
    for p in graph.projections() {
        let g = weight_gradient(p)?;
        gradients.insert(p.name.clone(), (p.rows(), p.cols(), g));
    }
    timings.backward_s += start.elapsed().as_secs_f64();
    Ok(SequenceGradients {
        loss,
        gradients,
        timings,
    })
}

/// Forward, labels from `labels_for(host logits)`, loss, backward; returns the loss and leaves
/// every G_b in its projection's capture slot.
fn backward(
    graph: &Graph,
    tokens: &[u32],
    sequence: usize,
    timings: &mut Timings,
    labels_for: impl FnOnce(&[f32]) -> Result<Vec<u32>, YaqaError>,
) -> Result<f64, YaqaError> {
    let start = Instant::now();
    let fwd = graph.forward(tokens)?;
    let labels = {
        let host = fwd
            .logits
            .flatten_all()
            .and_then(|l| l.to_vec1::<f32>())
            .ctx("logits to host")?;
        labels_for(&host)?
    };
    let loss_t = graph::nll_sum(&fwd.logits, &labels).ctx("loss")?;
    let loss = loss_t.to_scalar::<f32>().ctx("loss")? as f64;
    if !loss.is_finite() {
        return Err(YaqaError::NonFinite {
            sequence,
            what: format!("loss {loss}"),
        });
    }
    timings.forward_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    // The store holds only the embedding's gradient; G_b went to the capture slots.
    drop(loss_t.backward().ctx("backward")?);
    timings.backward_s = start.elapsed().as_secs_f64();
    Ok(loss)
}

/// The G_b the backward pass left in `p`'s capture slot.
fn weight_gradient(p: &graph::Projection) -> Result<Vec<f32>, YaqaError> {
    p.take_gradient().ok_or_else(|| YaqaError::Candle {
        context: format!("no gradient reached {}", p.name),
        source: Box::new(candle_core::Error::Msg(
            "the linear is not on the loss's graph".into(),
        )),
    })
}

fn check_tokens(
    config: &ModelConfig,
    tokens: &[u32],
    sequence: usize,
    max_len: usize,
) -> Result<(), YaqaError> {
    if tokens.is_empty() {
        return Err(YaqaError::EmptySequence { sequence });
    }
    if tokens.len() > max_len {
        return Err(YaqaError::SequenceTooLong {
            sequence,
            len: tokens.len(),
            max: max_len,
        });
    }
    if let Some(position) = tokens.iter().position(|&t| t as usize >= config.vocab_size) {
        return Err(YaqaError::TokenOutOfRange {
            sequence,
            position,
            token: tokens[position],
            vocab: config.vocab_size,
        });
    }
    Ok(())
}

/// ChaCha stream keyed by (seed, b): independent of how many draws other sequences made and
/// of the order or sharding of the run.
fn label_rng(seed: u64, b: u64) -> StdRng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&b.to_le_bytes());
    // A fixed tag keeps these streams apart from any other use of the same (seed, b).
    key[16..].copy_from_slice(b"sfx-yaqa-labels\0");
    StdRng::from_seed(key)
}

/// One label per row of `logits` (`[T, vocab]` row-major), y_t ~ softmax(logits_t) at
/// temperature 1, by inverse CDF in f64.
fn sample_labels(
    logits: &[f32],
    vocab: usize,
    rng: &mut StdRng,
    sequence: usize,
) -> Result<Vec<u32>, YaqaError> {
    let mut weights = vec![0.0f64; vocab];
    logits
        .chunks_exact(vocab)
        .enumerate()
        .map(|(t, row)| {
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            if !m.is_finite() || row.iter().any(|v| v.is_nan()) {
                return Err(YaqaError::NonFinite {
                    sequence,
                    what: format!("logits at position {t}"),
                });
            }
            let mut total = 0.0f64;
            for (w, &z) in weights.iter_mut().zip(row) {
                total += ((z - m) as f64).exp();
                *w = total;
            }
            let u = rng.random::<f64>() * total;
            // First index whose cumulative weight exceeds u; u < total, so one exists unless
            // rounding leaves u == total, where the last token with weight is the answer.
            let idx = weights.partition_point(|&c| c <= u);
            let idx = if idx < vocab {
                idx
            } else {
                row.iter()
                    .rposition(|&z| z > f32::NEG_INFINITY)
                    .unwrap_or(0)
            };
            Ok(idx as u32)
        })
        .collect()
}

#[cfg(test)]
mod tests;
