//! A tiny GGUF writer for tests, written from the format description (ggml `docs/gguf.md`):
//! "GGUF", u32 version, u64 tensor count, u64 metadata count, key/value pairs (gguf_string =
//! u64 length + bytes; u32 value type; value), tensor infos (name, u32 n_dims, u64 dims,
//! u32 ggml type, u64 offset), zero padding to the alignment, tensor data.
//!
//! Shared by the `gguf_*` integration tests through `#[path]`; on its own it has no tests.
#![allow(dead_code)]

/// A metadata value. Arrays carry their element type so empty and nested arrays can be
/// written.
#[derive(Clone, Debug)]
pub enum V {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Arr(u32, Vec<V>),
    U64(u64),
    I64(i64),
    F64(f64),
}

pub fn s(x: &str) -> V {
    V::Str(x.to_string())
}

pub fn str_arr<S: AsRef<str>>(items: &[S]) -> V {
    V::Arr(8, items.iter().map(|x| s(x.as_ref())).collect())
}

pub fn i32_arr(items: &[i32]) -> V {
    V::Arr(5, items.iter().map(|&x| V::I32(x)).collect())
}

impl V {
    pub fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
        }
    }

    /// The value's bytes, without its type tag.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            V::U8(x) => out.push(*x),
            V::I8(x) => out.push(*x as u8),
            V::U16(x) => out.extend(x.to_le_bytes()),
            V::I16(x) => out.extend(x.to_le_bytes()),
            V::U32(x) => out.extend(x.to_le_bytes()),
            V::I32(x) => out.extend(x.to_le_bytes()),
            V::F32(x) => out.extend(x.to_le_bytes()),
            V::Bool(x) => out.push(*x as u8),
            V::Str(x) => put_str(out, x),
            V::Arr(elem, items) => {
                out.extend(elem.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for it in items {
                    assert_eq!(it.type_id(), *elem, "array elements must share a type");
                    it.encode(out);
                }
            }
            V::U64(x) => out.extend(x.to_le_bytes()),
            V::I64(x) => out.extend(x.to_le_bytes()),
            V::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
}

pub fn put_str(out: &mut Vec<u8>, x: &str) {
    out.extend((x.len() as u64).to_le_bytes());
    out.extend(x.as_bytes());
}

#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    /// GGUF order (innermost first).
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
    /// Offset to write instead of the computed one (for overlap / range tests); no data is
    /// written for such a tensor.
    pub offset: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct GgufBuilder {
    pub version: u32,
    pub kvs: Vec<(String, V)>,
    pub tensors: Vec<TensorSpec>,
    pub alignment: u64,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn kv(mut self, key: &str, v: V) -> Self {
        if key == "general.alignment" {
            if let V::U32(a) = v {
                self.alignment = a as u64;
            }
        }
        self.kvs.push((key.to_string(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
            offset: None,
        });
        self
    }

    /// An f32 tensor with the given values.
    pub fn f32_tensor(self, name: &str, dims: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, 0, data)
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            v.encode(&mut out);
        }
        let mut offsets = Vec::new();
        let mut pos = 0u64;
        for t in &self.tensors {
            offsets.push(t.offset.unwrap_or(pos));
            pos = (pos + t.data.len() as u64).next_multiple_of(self.alignment);
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(off.to_le_bytes());
        }
        if !self.tensors.is_empty() {
            out.resize(
                (out.len() as u64).next_multiple_of(self.alignment) as usize,
                0,
            );
            let data_start = out.len();
            // Data goes at the computed offsets; a tensor with an overridden offset gets no
            // data written (its header lies about where it is).
            for (t, off) in self.tensors.iter().zip(&offsets) {
                if t.offset.is_some() {
                    continue;
                }
                let at = data_start + *off as usize;
                if out.len() < at + t.data.len() {
                    out.resize(at + t.data.len(), 0);
                }
                out[at..at + t.data.len()].copy_from_slice(&t.data);
            }
            let end = (out.len() as u64).next_multiple_of(self.alignment) as usize;
            out.resize(end, 0);
        }
        out
    }

    pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.build()).unwrap();
        p
    }
}

/// 256 byte-level symbols (GPT-2's bytes_to_unicode), in byte order: printable Latin-1 bytes
/// map to themselves, the others to U+0100 upwards.
pub fn byte_level_alphabet() -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

/// A small but complete gpt2-style tokenizer: the 256 byte symbols, two control tokens
/// (`<s>` id 256, `</s>` id 257), one user-defined token `<tool>` (258), and merged tokens.
pub fn tiny_tokenizer(pre: Option<&str>, merges: &[(&str, &str)]) -> GgufBuilder {
    let mut tokens = byte_level_alphabet();
    let mut types = vec![1i32; 256];
    for (t, ty) in [("<s>", 3), ("</s>", 3), ("<tool>", 4)] {
        tokens.push(t.to_string());
        types.push(ty);
    }
    for (a, b) in merges {
        tokens.push(format!("{a}{b}"));
        types.push(1);
    }
    let merge_strs: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let mut g = GgufBuilder::new()
        .kv("general.architecture", s("llama"))
        .kv("tokenizer.ggml.model", s("gpt2"));
    if let Some(p) = pre {
        g = g.kv("tokenizer.ggml.pre", s(p));
    }
    g.kv("tokenizer.ggml.tokens", str_arr(&tokens))
        .kv("tokenizer.ggml.token_type", i32_arr(&types))
        .kv("tokenizer.ggml.merges", str_arr(&merge_strs))
        .kv("tokenizer.ggml.bos_token_id", V::U32(256))
        .kv("tokenizer.ggml.eos_token_id", V::U32(257))
}
