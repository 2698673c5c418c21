//! Drivers that run a model over the protocol's token windows and collect NLL and KL.
//! They see a model only through [`Scorer`], so any backend, resident format or refinement
//! setting is evaluated by the same code.

use super::kl::{KlAccumulator, ReferenceRow, KL_TOP_K};
use super::ppl::{log_softmax_at, NllAccumulator, PplSummary};
use super::KlSummary;
use std::borrow::Cow;

/// The two ways the protocol runs a model: a whole window at once (prefill, logits for every
/// position) and token-by-token through the decode path after a prefill.
pub trait Scorer {
    type Error: std::error::Error + Send + Sync + 'static;
    fn vocab_size(&self) -> usize;
    /// Starts from an empty cache and returns logits for every position, row-major
    /// `[tokens.len(), vocab]`.
    fn score_window(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Self::Error>;
    /// Starts from an empty cache, prefills `tokens` and returns the last position's logits.
    fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Self::Error>;
    /// Appends one token through the decode path and returns its logits.
    fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, Self::Error>;
}

/// One unit of evaluation work with its own NLL/KL, reported separately (a window, a novel).
#[derive(Debug, Clone, serde::Serialize)]
pub struct PartResult {
    pub name: String,
    pub ppl: PplSummary,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<KlSummary>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalResult {
    pub ppl: PplSummary,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<KlSummary>,
    pub parts: Vec<PartResult>,
}

/// A scored span: `tokens` is the model input; positions `first_scored..tokens.len()` are
/// predicted (each from the logits of the position before it).
#[derive(Debug, Clone)]
pub struct EvalPart {
    pub name: String,
    pub tokens: Vec<u32>,
    pub first_scored: usize,
    /// Score the span by prefilling up to `first_scored` and then decoding one token at a time
    /// (long-context protocol), instead of a single all-logits prefill.
    pub through_decode: bool,
}

/// Errors from either model, or a malformed part.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("model: {0}")]
    Model(Box<dyn std::error::Error + Send + Sync>),
    #[error("reference model: {0}")]
    Reference(Box<dyn std::error::Error + Send + Sync>),
    #[error("part '{0}': nothing to score")]
    Empty(String),
    #[error("models disagree on vocabulary size: {0} vs reference {1}")]
    Vocab(usize, usize),
}

/// Splits a token stream into the first `count` non-overlapping windows of `window` tokens
/// (a final partial window is dropped); every position after the first is scored.
pub fn window_parts(tokens: &[u32], window: usize, count: usize) -> Vec<EvalPart> {
    tokens
        .chunks_exact(window)
        .take(count)
        .enumerate()
        .map(|(i, w)| EvalPart {
            name: format!("window {i}"),
            tokens: w.to_vec(),
            first_scored: 1,
            through_decode: false,
        })
        .collect()
}

/// The last `context` tokens of a text, scoring its final `scored` tokens through decode.
pub fn long_context_part(name: &str, tokens: &[u32], context: usize, scored: usize) -> EvalPart {
    let start = tokens.len().saturating_sub(context);
    let span = &tokens[start..];
    EvalPart {
        name: name.to_string(),
        tokens: span.to_vec(),
        first_scored: span.len().saturating_sub(scored).max(1),
        through_decode: true,
    }
}

fn model_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> RunError {
    RunError::Model(Box::new(e))
}

fn ref_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> RunError {
    RunError::Reference(Box::new(e))
}

/// Calls `f(position, logits)` for every scored position of `part`, where `logits` predicts
/// `part.tokens[position]`.
fn for_each_prediction<S: Scorer>(
    scorer: &mut S,
    part: &EvalPart,
    mut f: impl FnMut(usize, &[f32]),
) -> Result<(), S::Error> {
    let vocab = scorer.vocab_size();
    let n = part.tokens.len();
    if part.through_decode {
        let mut logits = scorer.prefill_last(&part.tokens[..part.first_scored])?;
        for pos in part.first_scored..n {
            f(pos, &logits);
            if pos + 1 < n {
                logits = scorer.decode_step(part.tokens[pos])?;
            }
        }
    } else {
        let all = scorer.score_window(&part.tokens)?;
        for pos in part.first_scored..n {
            f(pos, &all[(pos - 1) * vocab..pos * vocab]);
        }
    }
    Ok(())
}

/// The reference's side of the KL for every scored position of `part`, in order.
fn reference_part<R: Scorer>(r: &mut R, part: &EvalPart) -> Result<Vec<ReferenceRow>, RunError> {
    let mut rows = Vec::with_capacity(part.tokens.len() - part.first_scored);
    for_each_prediction(r, part, |_, l| rows.push(ReferenceRow::new(l, KL_TOP_K)))
        .map_err(ref_err)?;
    Ok(rows)
}

/// Runs `reference` over every part once, keeping only what the KL needs per position
/// ([`ReferenceRow`]): for scoring many models against one reference
/// ([`evaluate_against`]).
pub fn reference_rows<R: Scorer>(
    parts: &[EvalPart],
    reference: &mut R,
) -> Result<Vec<Vec<ReferenceRow>>, RunError> {
    parts
        .iter()
        .map(|part| {
            if part.first_scored >= part.tokens.len() {
                return Err(RunError::Empty(part.name.clone()));
            }
            reference_part(reference, part)
        })
        .collect()
}

/// Runs every part through `model` (and `reference`, when given, on the same positions) and
/// summarises NLL and KL per part and overall. `progress(done_parts, total_parts)` is called
/// after each part.
pub fn evaluate<S: Scorer, R: Scorer>(
    parts: &[EvalPart],
    model: &mut S,
    mut reference: Option<&mut R>,
    progress: impl FnMut(usize, usize, &PartResult),
) -> Result<EvalResult, RunError> {
    if let Some(r) = reference.as_deref() {
        if r.vocab_size() != model.vocab_size() {
            return Err(RunError::Vocab(model.vocab_size(), r.vocab_size()));
        }
    }
    // The reference's predictions of a part are reduced before the model runs it, so both
    // models' full logit matrices are never held at once.
    let mut rows = |_: usize, part: &EvalPart| -> PartReference<'static> {
        Ok(match reference.as_deref_mut() {
            Some(r) => Some(Cow::Owned(reference_part(r, part)?)),
            None => None,
        })
    };
    score_parts(parts, model, &mut rows, progress)
}

/// [`evaluate`] against reference rows made once by [`reference_rows`] for the same parts.
pub fn evaluate_against<S: Scorer>(
    parts: &[EvalPart],
    model: &mut S,
    reference: &[Vec<ReferenceRow>],
    progress: impl FnMut(usize, usize, &PartResult),
) -> Result<EvalResult, RunError> {
    let mut rows = |i: usize, part: &EvalPart| -> PartReference<'_> {
        match reference.get(i) {
            Some(r) => Ok(Some(Cow::Borrowed(r.as_slice()))),
            None => Err(RunError::Empty(part.name.clone())),
        }
    };
    score_parts(parts, model, &mut rows, progress)
}

/// A part's reference rows (`None`: no reference), made for it or kept from before.
type PartReference<'r> = Result<Option<Cow<'r, [ReferenceRow]>>, RunError>;

fn score_parts<'r, S: Scorer>(
    parts: &[EvalPart],
    model: &mut S,
    reference: &mut dyn FnMut(usize, &EvalPart) -> PartReference<'r>,
    mut progress: impl FnMut(usize, usize, &PartResult),
) -> Result<EvalResult, RunError> {
    let mut total_nll = NllAccumulator::default();
    let mut total_kl = KlAccumulator::default();
    let mut results = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        if part.first_scored >= part.tokens.len() {
            return Err(RunError::Empty(part.name.clone()));
        }
        let ref_rows = reference(i, part)?;
        let mut nll = NllAccumulator::default();
        let mut kl = KlAccumulator::default();
        for_each_prediction(model, part, |pos, logits| {
            let target = part.tokens[pos] as usize;
            nll.push(-log_softmax_at(logits, target));
            if let Some(r) = ref_rows
                .as_ref()
                .and_then(|r| r.get(pos - part.first_scored))
            {
                kl.push(r, logits);
            }
        })
        .map_err(model_err)?;
        total_nll.merge(&nll);
        total_kl.merge(&kl);
        let result = PartResult {
            name: part.name.clone(),
            ppl: nll
                .summary()
                .ok_or_else(|| RunError::Empty(part.name.clone()))?,
            kl: kl.summary(),
        };
        progress(i + 1, parts.len(), &result);
        results.push(result);
    }
    Ok(EvalResult {
        ppl: total_nll
            .summary()
            .ok_or_else(|| RunError::Empty("all parts".into()))?,
        kl: total_kl.summary(),
        parts: results,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bigram "model" with a fixed logit table: logits for the next token depend only on
    /// the current one, so window and decode paths must agree exactly.
    struct Bigram {
        vocab: usize,
        last: Option<u32>,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("never")]
    struct Never;

    impl Bigram {
        fn row(&self, t: u32) -> Vec<f32> {
            (0..self.vocab)
                .map(|j| ((t as usize * 7 + j * 3) % 5) as f32)
                .collect()
        }
    }

    impl Scorer for Bigram {
        type Error = Never;
        fn vocab_size(&self) -> usize {
            self.vocab
        }
        fn score_window(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Never> {
            Ok(tokens.iter().flat_map(|&t| self.row(t)).collect())
        }
        fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Never> {
            self.last = tokens.last().copied();
            Ok(self.row(self.last.unwrap_or(0)))
        }
        fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, Never> {
            self.last = Some(token);
            Ok(self.row(token))
        }
    }

    #[test]
    fn window_and_decode_paths_score_the_same_predictions() {
        let tokens: Vec<u32> = (0..40).map(|i| (i * 5 % 11) as u32).collect();
        let mut m = Bigram {
            vocab: 11,
            last: None,
        };
        let win = EvalPart {
            name: "w".into(),
            tokens: tokens.clone(),
            first_scored: 30,
            through_decode: false,
        };
        let dec = EvalPart {
            through_decode: true,
            ..win.clone()
        };
        let a = evaluate::<_, Bigram>(&[win], &mut m, None, |_, _, _| {}).unwrap();
        let b = evaluate::<_, Bigram>(&[dec], &mut m, None, |_, _, _| {}).unwrap();
        assert_eq!(a.ppl.tokens, 10);
        assert!((a.ppl.mean_nll - b.ppl.mean_nll).abs() < 1e-12);
        // The NLL equals the direct sum over the scored positions.
        let direct: f64 = (30..40)
            .map(|p| -log_softmax_at(&m.row(tokens[p - 1]), tokens[p] as usize))
            .sum::<f64>()
            / 10.0;
        assert!((a.ppl.mean_nll - direct).abs() < 1e-12);
    }

    #[test]
    fn self_reference_has_zero_kl_and_full_agreement() {
        let tokens: Vec<u32> = (0..64).map(|i| (i % 9) as u32).collect();
        let parts = window_parts(&tokens, 16, 3);
        assert_eq!(parts.len(), 3);
        let mut m = Bigram {
            vocab: 9,
            last: None,
        };
        let mut r = Bigram {
            vocab: 9,
            last: None,
        };
        let res = evaluate(&parts, &mut m, Some(&mut r), |_, _, _| {}).unwrap();
        let kl = res.kl.unwrap();
        assert_eq!(kl.tokens, 45);
        assert!(kl.mean.abs() < 1e-12 && kl.same_top1_pct == 100.0);
    }

    #[test]
    fn kept_reference_rows_score_as_the_reference_model_does() {
        let tokens: Vec<u32> = (0..64).map(|i| (i * 5 % 9) as u32).collect();
        let parts = window_parts(&tokens, 16, 3);
        let mut m = Bigram {
            vocab: 9,
            last: None,
        };
        // A reference that differs from the model: a shifted bigram table.
        struct Shifted(Bigram);
        impl Scorer for Shifted {
            type Error = Never;
            fn vocab_size(&self) -> usize {
                self.0.vocab
            }
            fn score_window(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Never> {
                Ok(tokens.iter().flat_map(|&t| self.0.row(t + 1)).collect())
            }
            fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Never> {
                self.0.prefill_last(tokens)
            }
            fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, Never> {
                self.0.decode_step(token)
            }
        }
        let mut r = Shifted(Bigram {
            vocab: 9,
            last: None,
        });
        let direct = evaluate(&parts, &mut m, Some(&mut r), |_, _, _| {}).unwrap();
        let rows = reference_rows(&parts, &mut r).unwrap();
        let kept = evaluate_against(&parts, &mut m, &rows, |_, _, _| {}).unwrap();
        let (a, b) = (direct.kl.unwrap(), kept.kl.unwrap());
        assert!(a.mean > 0.01, "the reference differs from the model");
        assert_eq!(
            (a.mean, a.same_top1_pct, a.tokens),
            (b.mean, b.same_top1_pct, b.tokens)
        );
        assert_eq!(direct.ppl.mean_nll, kept.ppl.mean_nll);
    }

    #[test]
    fn windows_drop_the_partial_tail_and_long_part_takes_the_end() {
        let tokens: Vec<u32> = (0..100).collect();
        assert_eq!(window_parts(&tokens, 30, 10).len(), 3);
        let p = long_context_part("n", &tokens, 40, 8);
        assert_eq!(p.tokens.first(), Some(&60));
        assert_eq!(p.first_scored, 32);
    }
}
