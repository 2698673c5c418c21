//! llama.cpp importance-matrix files (`llama-imatrix` output, what `llama-quantize --imatrix`
//! reads): per weight tensor, one importance value per input column — the mean of x² over the
//! calibration tokens that reached the tensor.
//!
//! Two layouts, told apart by the first four bytes:
//! - **GGUF** (llama.cpp since mid-2025): for a weight `W`, an F32 tensor `W.in_sum2`
//!   `[n_per_row, n_mat]` of summed squares and an F32 tensor `W.counts` `[1, n_mat]` of token
//!   counts; the importance is `in_sum2 / counts`, and 1 for a matrix no token reached
//!   (`counts` = 0), as llama-quantize does.
//! - **Legacy** `.dat`: little-endian `i32 n_entries`, then per entry `i32 name_len`, the
//!   name, `i32 ncall`, `i32 n_values`, `n_values` f32 values; the importance is
//!   `value / ncall` (`ncall` > 0), as llama-quantize does. What follows the entries (the last
//!   chunk count, the dataset name) is not needed.
//!
//! Entries are keyed by the Hugging Face name of their weight (`blk.0.attn_q.weight` →
//! `model.layers.0.self_attn.q_proj.weight`); entries without one (expert tensors, unknown
//! modules) are left out. Mixtures of experts (`n_mat` > 1) are refused.

use super::{hf_tensor_name, GgufFile, GGUF_MAGIC};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A file larger than this is not an importance matrix (a 70B model's is ~100 MB).
const MAX_FILE_BYTES: u64 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum ImatrixError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Gguf {
        path: PathBuf,
        #[source]
        source: Box<super::GgufError>,
    },
    #[error("{path}: not an importance matrix: {msg}")]
    Invalid { path: PathBuf, msg: String },
}

/// An importance matrix: HF weight name → one value per input column.
#[derive(Debug, Clone, PartialEq)]
pub struct Imatrix {
    pub entries: BTreeMap<String, Vec<f32>>,
    /// `gguf` or `legacy`.
    pub layout: &'static str,
    /// SHA-256 of the file, lowercase hex (provenance).
    pub sha256: String,
}

impl Imatrix {
    /// Reads a GGUF or legacy importance-matrix file.
    pub fn read(path: &Path) -> Result<Self, ImatrixError> {
        let io = |source| ImatrixError::Io {
            path: path.to_path_buf(),
            source,
        };
        // An importance matrix is one vector per weight: even a 70B model's is ~100 MB, so the
        // file is read once, for its layout, its digest and (legacy) its entries.
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_FILE_BYTES {
            return Err(invalid(
                path,
                format!("{len} bytes, far more than any model's importance matrix"),
            ));
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let mut m = match bytes.get(..4) {
            None => return Err(invalid(path, format!("{} bytes", bytes.len()))),
            Some(magic) if magic == GGUF_MAGIC => Self::read_gguf(path)?,
            Some(_) => parse_legacy(path, &bytes)?,
        };
        m.sha256 = {
            use sha2::{Digest, Sha256};
            format!("{:x}", Sha256::digest(&bytes))
        };
        Ok(m)
    }

    fn read_gguf(path: &Path) -> Result<Self, ImatrixError> {
        let gguf_err = |e| ImatrixError::Gguf {
            path: path.to_path_buf(),
            source: Box::new(e),
        };
        let file = GgufFile::open(path).map_err(gguf_err)?;
        let mut entries = BTreeMap::new();
        for info in file.tensors() {
            let Some(weight) = info.name.strip_suffix(".in_sum2") else {
                continue;
            };
            let counts_name = format!("{weight}.counts");
            let counts_info = file
                .tensor_info(&counts_name)
                .ok_or_else(|| invalid(path, format!("{} has no {counts_name}", info.name)))?;
            let n_per_row = info.dims.first().copied().unwrap_or(0) as usize;
            let n_mat: u64 = info.dims.iter().skip(1).product();
            if n_mat != 1 {
                return Err(invalid(
                    path,
                    format!(
                        "{}: {n_mat} matrices (experts) per tensor; only dense weights are read",
                        info.name
                    ),
                ));
            }
            let sums = file.dequantize_info(info).map_err(gguf_err)?;
            let counts = file.dequantize_info(counts_info).map_err(gguf_err)?;
            let (Some(&count), true) = (counts.first(), counts.len() == 1) else {
                return Err(invalid(
                    path,
                    format!("{counts_name} holds {} values, expected 1", counts.len()),
                ));
            };
            if sums.len() != n_per_row {
                return Err(invalid(
                    path,
                    format!("{}: shape {:?}", info.name, info.dims),
                ));
            }
            let values = if count > 0.0 {
                sums.iter().map(|s| s / count).collect()
            } else {
                vec![1.0; n_per_row]
            };
            insert(path, &mut entries, weight, values)?;
        }
        if entries.is_empty() {
            return Err(invalid(path, "a GGUF without any `.in_sum2` tensor".into()));
        }
        Ok(Self {
            entries,
            layout: "gguf",
            sha256: String::new(),
        })
    }

    /// The importance of weight `name` (its HF name), if the file has it.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.entries.get(name).map(Vec::as_slice)
    }
}

fn invalid(path: &Path, msg: String) -> ImatrixError {
    ImatrixError::Invalid {
        path: path.to_path_buf(),
        msg,
    }
}

/// Adds an entry under its HF name (skipping names without one); non-finite or negative
/// values and duplicates are errors.
fn insert(
    path: &Path,
    entries: &mut BTreeMap<String, Vec<f32>>,
    gguf_weight: &str,
    values: Vec<f32>,
) -> Result<(), ImatrixError> {
    let Some(hf) = hf_tensor_name(gguf_weight) else {
        return Ok(());
    };
    if let Some(i) = values.iter().position(|v| !v.is_finite() || *v < 0.0) {
        return Err(invalid(
            path,
            format!("{gguf_weight}: value {i} is {}", values[i]),
        ));
    }
    if entries.insert(hf, values).is_some() {
        return Err(invalid(path, format!("{gguf_weight} appears twice")));
    }
    Ok(())
}

/// A reading position in a legacy file; every read is bounds-checked.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], ImatrixError> {
        let b = self
            .at
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.at..end))
            .ok_or_else(|| {
                invalid(
                    self.path,
                    format!("truncated at byte {} reading {what}", self.at),
                )
            })?;
        self.at += n;
        Ok(b)
    }

    fn i32(&mut self, what: &str) -> Result<i32, ImatrixError> {
        let b = self.take(4, what)?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

fn parse_legacy(path: &Path, bytes: &[u8]) -> Result<Imatrix, ImatrixError> {
    let mut c = Cursor { path, bytes, at: 0 };
    let n = c.i32("the entry count")?;
    // Every entry takes at least 12 bytes: a count beyond that is not this format.
    if n <= 0 || n as usize > bytes.len() / 12 {
        return Err(invalid(
            path,
            format!("entry count {n} for a {}-byte file", bytes.len()),
        ));
    }
    let mut entries = BTreeMap::new();
    for e in 0..n as usize {
        let len = c.i32("a name length")?;
        if !(1..=4096).contains(&len) {
            return Err(invalid(path, format!("entry {e}: name length {len}")));
        }
        let name = std::str::from_utf8(c.take(len as usize, "a name")?)
            .map_err(|_| invalid(path, format!("entry {e}: the name is not UTF-8")))?
            .to_string();
        let ncall = c.i32("ncall")?;
        let nval = c.i32("the value count")?;
        let nval =
            usize::try_from(nval).map_err(|_| invalid(path, format!("{name}: {nval} values")))?;
        let values = c.take(nval.saturating_mul(4), "the values")?;
        let mut v: Vec<f32> = values
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if ncall > 0 {
            let d = ncall as f32;
            v.iter_mut().for_each(|x| *x /= d);
        }
        insert(path, &mut entries, &name, v)?;
    }
    Ok(Imatrix {
        entries,
        layout: "legacy",
        sha256: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(entries: &[(&str, i32, &[f32])]) -> Vec<u8> {
        let mut b = (entries.len() as i32).to_le_bytes().to_vec();
        for (name, ncall, values) in entries {
            b.extend((name.len() as i32).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(ncall.to_le_bytes());
            b.extend((values.len() as i32).to_le_bytes());
            for v in *values {
                b.extend(v.to_le_bytes());
            }
        }
        // llama-imatrix appends the chunk count and the dataset name.
        b.extend(10i32.to_le_bytes());
        b.extend(4i32.to_le_bytes());
        b.extend(b"wiki");
        b
    }

    #[test]
    fn legacy_entries_are_divided_by_their_call_count_and_renamed() {
        let p = Path::new("m.dat");
        let bytes = legacy(&[
            ("blk.0.attn_q.weight", 4, &[4.0, 8.0]),
            ("blk.11.ffn_down.weight", 0, &[3.0]),
            ("blk.0.ffn_gate_exps.weight", 1, &[1.0]),
        ]);
        let m = parse_legacy(p, &bytes).unwrap();
        assert_eq!(
            m.get("model.layers.0.self_attn.q_proj.weight"),
            Some(&[1.0, 2.0][..])
        );
        assert_eq!(
            m.get("model.layers.11.mlp.down_proj.weight"),
            Some(&[3.0][..])
        );
        assert_eq!(m.entries.len(), 2);
    }

    #[test]
    fn broken_legacy_files_are_named_not_panics() {
        let p = Path::new("m.dat");
        let good = legacy(&[("blk.0.attn_q.weight", 1, &[1.0, 2.0])]);
        for cut in 0..good.len() - 12 {
            let e = parse_legacy(p, &good[..cut]);
            assert!(e.is_err(), "cut at {cut}");
        }
        let mut neg = good.clone();
        neg[good.len() - 16..good.len() - 12].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(parse_legacy(p, &neg)
            .unwrap_err()
            .to_string()
            .contains("-1"));
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&i32::MAX.to_le_bytes());
        assert!(parse_legacy(p, &huge)
            .unwrap_err()
            .to_string()
            .contains("entry count"));
        let twice = legacy(&[
            ("blk.0.attn_q.weight", 1, &[1.0]),
            ("blk.0.attn_q.weight", 1, &[2.0]),
        ]);
        assert!(parse_legacy(p, &twice)
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }
}
