//! A GGUF model written out as a Hugging Face checkpoint folder (`config.json`,
//! `model.safetensors` in BF16, the tokenizer files), streamed: the header decides every name,
//! shape and offset up front ([`super::import`]'s plan), then each tensor is read from the file
//! a bounded chunk of rows at a time, dequantized, un-permuted, rounded to BF16 and appended.
//! Memory stays near one chunk whatever the model's size (an 8B model dequantized whole is
//! 32 GB of f32); the bytes written are the same as dequantizing everything first.

use super::import::{in_file, plan_import, unpermute_rows, ImportPlan, PlannedTensor};
use super::{dequantize, GgufError, GgufFile};
use crate::atomic::{write_atomic, AtomicFile};
use rayon::prelude::*;
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// f32 values dequantized at once: 64 MiB of f32 plus its 32 MiB of BF16 and the chunk's
/// source blocks. Large enough that reads and the BF16 rounding's parallel loop stay efficient.
const CHUNK_ELEMENTS: usize = 1 << 24;

/// What [`import_gguf_to_folder`] wrote.
#[derive(Debug, Clone)]
pub struct FolderImport {
    /// `config.json`'s contents.
    pub hf_config: Value,
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub safetensors_bytes: u64,
    /// sha256 (lowercase hex) of the GGUF file, for provenance.
    pub source_sha256: String,
}

/// Converts the GGUF file at `path` into a Hugging Face folder `dir` (created if needed):
/// `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, `model.safetensors`
/// (BF16, tensors in sorted name order) and `config.json`. Every file is written atomically and
/// `config.json` goes last, so a folder with a config is complete. `progress(done, total)` is
/// called after each tensor. The file is hashed on a second thread while the tensors stream.
pub fn import_gguf_to_folder(
    path: impl AsRef<Path>,
    dir: impl AsRef<Path>,
    progress: impl Fn(usize, usize),
) -> Result<FolderImport, GgufError> {
    import_gguf_to_folder_in_chunks(path, dir, CHUNK_ELEMENTS, progress)
}

/// [`import_gguf_to_folder`] with chunks of about `chunk_elements` values (at least one row,
/// or one head's rows of Q and K): tests use tiny chunks to cross every chunk boundary.
#[doc(hidden)]
pub fn import_gguf_to_folder_in_chunks(
    path: impl AsRef<Path>,
    dir: impl AsRef<Path>,
    chunk_elements: usize,
    progress: impl Fn(usize, usize),
) -> Result<FolderImport, GgufError> {
    let (path, dir) = (path.as_ref(), dir.as_ref());
    let gguf = GgufFile::open(path)?;
    let in_file = |e| in_file(path, e);
    let plan = plan_import(&gguf).map_err(in_file)?;
    std::fs::create_dir_all(dir).map_err(|e| GgufError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    write_atomic(
        dir.join("tokenizer.json"),
        plan.tokenizer.tokenizer_json.as_bytes(),
    )?;
    write_atomic(
        dir.join("tokenizer_config.json"),
        pretty(&plan.tokenizer.tokenizer_config).as_bytes(),
    )?;
    write_atomic(
        dir.join("generation_config.json"),
        pretty(&plan.tokenizer.generation_config).as_bytes(),
    )?;
    let (sha, written) = std::thread::scope(|s| {
        let hasher = s.spawn(|| sha256_of_file(path));
        let written = write_safetensors(
            &gguf,
            &plan,
            &dir.join("model.safetensors"),
            chunk_elements,
            &progress,
        );
        let sha = hasher.join().unwrap_or_else(|_| {
            Err(GgufError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("the hashing thread panicked"),
            })
        });
        (sha, written)
    });
    let safetensors_bytes = written.map_err(in_file)?;
    let source_sha256 = sha?;
    write_atomic(dir.join("config.json"), pretty(&plan.hf_config).as_bytes())?;
    Ok(FolderImport {
        hf_config: plan.hf_config,
        tensors: plan.tensors.len(),
        safetensors_bytes,
        source_sha256,
    })
}

fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialize");
    s.push('\n');
    s
}

/// sha256 of a file read in 8 MiB pieces (page cache, not this process's memory, holds it).
fn sha256_of_file(path: &Path) -> Result<String, GgufError> {
    use sha2::{Digest, Sha256};
    let io = |e| GgufError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Metadata-only safetensors view: the header is computed from shape and byte length, and
/// the data is streamed separately.
struct HeaderOnly {
    shape: Vec<usize>,
    len: usize,
}

impl safetensors::View for &HeaderOnly {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// Writes `model.safetensors`; returns its size in bytes.
fn write_safetensors(
    gguf: &GgufFile,
    plan: &ImportPlan<'_>,
    dest: &Path,
    chunk_elements: usize,
    progress: &dyn Fn(usize, usize),
) -> Result<u64, GgufError> {
    let views: Vec<(&String, HeaderOnly)> = plan
        .tensors
        .iter()
        .map(|(name, t)| {
            let len = t.info.n_elements.checked_mul(2).ok_or_else(|| {
                GgufError::tensor(&t.info.name, "BF16 size overflows".to_string())
            })?;
            Ok((
                name,
                HeaderOnly {
                    shape: t.info.shape(),
                    len,
                },
            ))
        })
        .collect::<Result<_, GgufError>>()?;
    let mut metadata = std::collections::HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    // With empty data the serializer emits exactly the 8-byte length and the header; the
    // header's offsets then say in which order to stream the tensors.
    let header = safetensors::serialize(views.iter().map(|(n, v)| (*n, v)), Some(metadata))
        .map_err(|e| GgufError::Import(format!("safetensors header: {e}")))?;
    let order = data_order(&header)?;
    let mut source = File::open(gguf.path()).map_err(|e| GgufError::Io {
        path: gguf.path().to_path_buf(),
        source: e,
    })?;
    let mut out = AtomicFile::create(dest)?;
    out.write_all(&header)?;
    let mut written = header.len() as u64;
    let mut chunk = ChunkBuffers::default();
    let total = order.len();
    for (done, name) in order.iter().enumerate() {
        let planned = plan
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::Import(format!("safetensors header: unknown {name}")))?;
        written += stream_tensor(
            gguf,
            &mut source,
            planned,
            chunk_elements,
            &mut out,
            &mut chunk,
        )?;
        progress(done + 1, total);
    }
    out.commit()?;
    Ok(written)
}

/// Buffers reused from chunk to chunk and tensor to tensor.
#[derive(Default)]
struct ChunkBuffers {
    blocks: Vec<u8>,
    values: Vec<f32>,
    bf16: Vec<u8>,
}

/// Streams one tensor into `out` as BF16; returns the bytes written.
fn stream_tensor(
    gguf: &GgufFile,
    source: &mut File,
    planned: &PlannedTensor<'_>,
    chunk_elements: usize,
    out: &mut AtomicFile,
    buf: &mut ChunkBuffers,
) -> Result<u64, GgufError> {
    let info = planned.info;
    let ty = info.ggml_type;
    let err = |m: String| GgufError::tensor(&info.name, m);
    let shape = info.shape();
    // A matrix goes a chunk of rows at a time (GGUF rows are whole blocks); a vector, which
    // is small, in one piece (a Q/K bias's "rows" are its elements).
    let (rows, row_len) = match (shape.as_slice(), planned.qk_heads) {
        ([r, c], _) => (*r, *c),
        (_, Some(_)) => (info.n_elements, 1),
        _ => (1, info.n_elements),
    };
    // Un-permuting moves rows within a head, so a chunk holds whole heads.
    let head_rows = match planned.qk_heads {
        Some(h) if h > 0 && rows.is_multiple_of(2 * h) => rows / h,
        Some(h) => {
            return Err(err(format!(
                "{rows} rows cannot be split into {h} heads of an even number of rows"
            )))
        }
        None => 1,
    };
    let chunk_rows = if shape.len() == 2 {
        ((chunk_elements / row_len.max(1)) / head_rows).max(1) * head_rows
    } else {
        rows
    }
    .min(rows.max(1));
    let bytes_of = |elements: usize| {
        ty.bytes_for(elements as u64).ok_or_else(|| {
            err(format!(
                "{elements} values is not a whole number of {ty} blocks of {}",
                ty.block_size()
            ))
        })
    };
    let tensor_start = gguf
        .data_start()
        .checked_add(info.offset)
        .ok_or_else(|| err("data offset overflows".into()))?;
    let mut written = 0u64;
    let mut row = 0;
    while row < rows {
        let n_rows = chunk_rows.min(rows - row);
        let n = n_rows * row_len;
        let start = tensor_start + bytes_of(row * row_len)?;
        let len = usize::try_from(bytes_of(n)?).map_err(|_| err("chunk too large".into()))?;
        buf.blocks.resize(len, 0);
        source
            .seek(SeekFrom::Start(start))
            .and_then(|_| source.read_exact(&mut buf.blocks))
            .map_err(|e| GgufError::Io {
                path: gguf.path().to_path_buf(),
                source: e,
            })?;
        buf.values.resize(n, 0.0);
        dequantize(ty, &buf.blocks, n, &mut buf.values).map_err(|e| err(e.to_string()))?;
        match planned.qk_heads {
            Some(_) => {
                let rows_in_order =
                    unpermute_rows(&buf.values, n_rows, row_len, n_rows / head_rows)
                        .map_err(err)?;
                to_bf16_le(&rows_in_order, &mut buf.bf16);
            }
            None => to_bf16_le(&buf.values, &mut buf.bf16),
        }
        out.write_all(&buf.bf16)?;
        written += buf.bf16.len() as u64;
        row += n_rows;
    }
    Ok(written)
}

/// Tensor names in data order, from a serialized safetensors header, checking that the
/// data regions are contiguous from 0.
fn data_order(header: &[u8]) -> Result<Vec<String>, GgufError> {
    let bad = |m: &str| GgufError::Import(format!("safetensors header: {m}"));
    let len_bytes: [u8; 8] = header
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| bad("short"))?;
    let n = u64::from_le_bytes(len_bytes) as usize;
    if header.len() != 8 + n {
        return Err(bad("unexpected length"));
    }
    let json: Map<String, Value> =
        serde_json::from_slice(&header[8..]).map_err(|e| bad(&e.to_string()))?;
    let mut entries = Vec::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let off = v["data_offsets"]
            .as_array()
            .and_then(|a| Some((a.first()?.as_u64()?, a.get(1)?.as_u64()?)))
            .ok_or_else(|| bad("missing data_offsets"))?;
        entries.push((off, name));
    }
    entries.sort();
    let mut pos = 0;
    for ((start, end), name) in &entries {
        if *start != pos {
            return Err(bad(&format!(
                "{name} does not start where the previous ends"
            )));
        }
        pos = *end;
    }
    Ok(entries.into_iter().map(|(_, n)| n).collect())
}

/// f32 → bf16 little-endian bytes, round to nearest even (as PyTorch's `.to(bfloat16)`).
fn to_bf16_le(values: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.resize(values.len() * 2, 0);
    out.par_chunks_mut(1 << 16)
        .zip(values.par_chunks(1 << 15))
        .for_each(|(dst, src)| {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_across_parallel_pieces() {
        // 0x3F80_8000 is exactly halfway between bf16 0x3F80 and 0x3F81: even wins; one ulp
        // above rounds up. Enough values that several parallel pieces are involved.
        let mut values = vec![f32::from_bits(0x3F80_8000); (1 << 15) + 3];
        values[1 << 15] = f32::from_bits(0x3F80_8001);
        let mut out = Vec::new();
        to_bf16_le(&values, &mut out);
        assert_eq!(out.len(), values.len() * 2);
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3F80);
        let i = 2 << 15;
        assert_eq!(u16::from_le_bytes([out[i], out[i + 1]]), 0x3F81);
    }

    #[test]
    fn data_order_refuses_a_gap() {
        let json = br#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}}"#;
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(json);
        let e = data_order(&header).unwrap_err().to_string();
        assert!(e.contains("a does not start"), "{e}");
    }
}
