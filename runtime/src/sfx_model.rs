//! Loading a model from a `.sfx` container written by `sfx-convert` (section names and layouts:
//! `docs/format.md`, "Model sections written by `sfx-convert`"): the resident base only —
//! float embedding / norms / biases / head plus group-quantized projections. Refinement
//! sections (`P.refine`, MLP bundles) are read by [`crate::refine`] (plan, tiers, engine).
//!
//! Two pieces plug into the generic loader ([`Model::load_with`]):
//! - [`SfxTensors`]: a [`TensorSource`] over the container's `dense` sections (borrowed from
//!   the memory map when a section is stored raw, so the float tables are not copied before
//!   the backend uploads them);
//! - [`SfxLinearFactory`]: builds each projection `P` from `P.weight` (packed codes),
//!   `P.weight.scales` and `P.weight.zeros`, validating every section against the config
//!   first so a damaged or mismatched file is an error naming the section, never a panic.

use crate::backend::cpu::CpuBackend;
use crate::backend::WeightPrecision;
use crate::error::{Result, RuntimeError};
use crate::linear::{load_bias, FloatLinear, Linear, LinearFactory, LinearRole, LinearSpec};
use crate::model::{Model, ModelOptions};
use crate::resident::gguf_blocks::block_linear;
use crate::resident::{lut_or_dequantized, ResidentKernels};
use half::f16;
use sfx_formats::gguf::BlockTensor;
use sfx_formats::resident::{
    GroupQuantized, LutQuantized, SmallHadamard, TrellisParts, TrellisQuantized, TrellisScheme,
    SUPPORTED_BITS,
};
use sfx_formats::sfx::{Layout, SectionView, SfxFile, MAGIC};
use sfx_formats::{DType, FormatError, ModelConfig, TensorSource, TensorView};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Code packings this loader implements (`params["quant"]["packing"]`): group-wise integer
/// codes, and trellis tiles (whose layout carries its own scheme).
pub const PACKING_GROUP_ASYM_V1: &str = "group-asym-v1";
pub const PACKING_TRELLIS_V1: &str = "trellis-v1";
/// llama.cpp's own blocks, kept from a GGUF (`gguf_blocks` sections name their type).
pub const PACKING_GGUF_BLOCKS_V1: &str = "gguf-blocks-v1";
/// Look-up-table codes (SqueezeLLM): `P.weight` packed codes, `P.weight.table` levels,
/// `P.weight.scales` one per row (docs/format.md).
pub const PACKING_LUT_V1: &str = "lut-v1";

/// True when `path` is a regular file starting with the `.sfx` magic `SFX\0`. Detection by
/// content rather than extension, so a renamed container still loads as one (and a folder or
/// a `.gguf` never does). Any I/O error means "not a container": the caller's normal open
/// path then reports the real problem.
pub fn is_sfx_file(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == MAGIC
}

/// `tokenizer.json` text stored in the container's metadata, if the converter embedded one.
pub fn sfx_tokenizer_json(file: &SfxFile) -> Option<&str> {
    file.metadata().tokenizer_json.as_deref()
}

/// The chat template from the embedded `tokenizer_config.json`, if any.
pub fn sfx_chat_template(file: &SfxFile) -> Option<&str> {
    file.metadata()
        .tokenizer_config
        .as_ref()?
        .get("chat_template")?
        .as_str()
}

/// The model config stored in the metadata; an error naming the file when it is absent (a
/// container without one is not a model, e.g. a bare refinement file).
pub fn sfx_config(file: &SfxFile) -> Result<&ModelConfig> {
    file.metadata().config.as_ref().ok_or_else(|| {
        RuntimeError::Format(FormatError::invalid(
            file.path(),
            "metadata has no model config (\"config\": null); not a model container",
        ))
    })
}

/// Loads the resident base model of a converter-written container onto the CPU backend:
/// config from the metadata, float tables from `dense` sections (stored per
/// `options.precision`), group-quantized projections. Refinement sections are not used.
pub fn load_sfx_model(file: &SfxFile, options: &ModelOptions) -> Result<Model<CpuBackend>> {
    load_sfx_model_on(CpuBackend::new(), file, options)
}

/// [`load_sfx_model`] onto any backend; a resident format the backend has no kernel for is
/// an error naming the format and the projection.
pub fn load_sfx_model_on<B: ResidentKernels>(
    backend: B,
    file: &SfxFile,
    options: &ModelOptions,
) -> Result<Model<B>> {
    let config = sfx_config(file)?;
    check_packing(file)?;
    let tensors = SfxTensors::new(file)?;
    let factory = SfxLinearFactory::new(file, options.precision);
    Model::load_with(backend, config, &tensors, &factory, options)
}

/// Rejects a container whose metadata names a code packing other than `group-asym-v1`: its
/// bytes would decode to wrong weights without any size mismatch to catch it. A missing
/// `quant` entry or `packing` field is accepted (v1 writers know only this packing).
fn check_packing(file: &SfxFile) -> Result<()> {
    let Some(quant) = file.metadata().params.get("quant") else {
        return Ok(());
    };
    match quant.get("packing") {
        None => Ok(()),
        Some(serde_json::Value::String(p))
            if p == PACKING_GROUP_ASYM_V1
                || p == PACKING_TRELLIS_V1
                || p == PACKING_GGUF_BLOCKS_V1
                || p == PACKING_LUT_V1 =>
        {
            Ok(())
        }
        Some(other) => Err(RuntimeError::Unsupported(format!(
            "{}: params.quant.packing is {other}; this runtime reads \
             \"{PACKING_GROUP_ASYM_V1}\", \"{PACKING_TRELLIS_V1}\" and \
             \"{PACKING_GGUF_BLOCKS_V1}\", \"{PACKING_LUT_V1}\"",
            file.path().display()
        ))),
    }
}

/// Short name of a layout for messages (the spec's names).
fn layout_name(l: &Layout) -> &'static str {
    match l {
        Layout::Bytes => "bytes",
        Layout::Dense { .. } => "dense",
        Layout::PackedCodes { .. } => "packed_codes",
        Layout::ColumnNibbles { .. } => "column_nibbles",
        Layout::NeuronBundles { .. } => "neuron_bundles",
        Layout::TrellisTiles { .. } => "trellis_tiles",
        Layout::GgufBlocks { .. } => "gguf_blocks",
    }
}

/// An error about one section of `file`.
fn section_err(file: &SfxFile, section: &str, msg: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Format(FormatError::invalid(
        file.path(),
        format!("section '{section}': {msg}"),
    ))
}

/// A section that must exist; the error says what it is needed for.
fn required_section<'f>(file: &'f SfxFile, name: &str, why: &str) -> Result<SectionView<'f>> {
    file.section(name)
        .map_err(|_| section_err(file, name, format!("missing ({why})")))
}

/// Decoded bytes of a section whose decoded length must be `want` (checked even for zstd
/// sections, whose decoder bounds but does not promise the length).
fn decoded_exact<'f>(file: &'f SfxFile, s: &SectionView<'f>, want: usize) -> Result<Cow<'f, [u8]>> {
    let bytes = s.decode().map_err(RuntimeError::Format)?;
    if bytes.len() != want {
        return Err(section_err(
            file,
            s.name,
            format!("{} bytes, expected {want}", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// A stored weight's `[rows, cols]`, which must be the `[out, in]` the model config gives.
fn config_dims(
    file: &SfxFile,
    name: &str,
    noun: &str,
    (rows, cols): (u64, u64),
    spec: &LinearSpec<'_>,
) -> Result<(usize, usize)> {
    let (rows, cols) = (to_usize(file, name, rows)?, to_usize(file, name, cols)?);
    if (rows, cols) != (spec.out_dim, spec.in_dim) {
        return Err(section_err(
            file,
            name,
            format!(
                "{noun} of a [{rows}, {cols}] weight, the model config needs [{}, {}]",
                spec.out_dim, spec.in_dim
            ),
        ));
    }
    Ok((rows, cols))
}

fn to_usize(file: &SfxFile, section: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        section_err(
            file,
            section,
            format!("dimension {v} exceeds the address space"),
        )
    })
}

/// One `dense` section as a tensor.
struct DenseTensor<'f> {
    dtype: DType,
    shape: Vec<usize>,
    data: Cow<'f, [u8]>,
}

/// The `dense` sections of a container as a [`TensorSource`] (Hugging Face names, as the
/// converter writes them). Raw sections are borrowed from the file's memory map; zstd ones
/// are decoded once here. Asking for a section of another layout is an error saying which
/// layout it has, so e.g. a quantized `lm_head.weight` is not reported as "missing".
pub struct SfxTensors<'f> {
    file: &'f SfxFile,
    dense: BTreeMap<String, DenseTensor<'f>>,
}

impl<'f> SfxTensors<'f> {
    pub fn new(file: &'f SfxFile) -> Result<Self> {
        let mut dense = BTreeMap::new();
        for s in file.sections() {
            let Layout::Dense { dtype, shape } = s.layout else {
                continue;
            };
            let shape = shape
                .iter()
                .map(|&d| to_usize(file, s.name, d))
                .collect::<Result<Vec<_>>>()?;
            let data = s.decode().map_err(RuntimeError::Format)?;
            // The reader checked the layout-implied length against the recorded decoded
            // length; this re-checks the bytes actually decoded (zstd) and the usize product.
            TensorView::new(s.name, *dtype, &shape, &data)
                .map_err(|e| section_err(file, s.name, e))?;
            dense.insert(
                s.name.to_string(),
                DenseTensor {
                    dtype: *dtype,
                    shape,
                    data,
                },
            );
        }
        Ok(Self { file, dense })
    }
}

impl TensorSource for SfxTensors<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.dense.keys().cloned().collect()
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        if let Some(t) = self.dense.get(name) {
            return Ok(TensorView {
                dtype: t.dtype,
                shape: &t.shape,
                data: &t.data,
            });
        }
        match self.file.section(name) {
            Ok(s) => Err(FormatError::invalid(
                self.file.path(),
                format!(
                    "section '{name}' has layout {}, not a dense float tensor",
                    layout_name(s.layout)
                ),
            )),
            Err(_) => Err(FormatError::MissingTensor(name.to_string())),
        }
    }

    /// Any section of that name, dense or coded (a quantized head exists even though
    /// [`TensorSource::tensor`] cannot hand it out as floats).
    fn contains(&self, name: &str) -> bool {
        self.dense.contains_key(name) || self.file.section(name).is_ok()
    }
}

/// Builds projections from a container's resident sections: `P.weight` (packed codes
/// `[out, in, bits, group]`), `P.weight.scales` (dense F16 `[out, groups]`), `P.weight.zeros`
/// (bytes, `out × groups`) and, where the config has biases, `P.bias` (dense, through the
/// tensor source); trellis tiles and GGUF blocks likewise. The embedding and an untied head
/// (`lm_head.weight`) are either dense (float, the head at `float_precision`) or packed codes
/// like a projection (`sfx-convert --head q4|q6|q8`); a tied head is the embedding (the trait's
/// default).
pub struct SfxLinearFactory<'f> {
    file: &'f SfxFile,
    /// Storage of float weights: a float head, and GGUF blocks dequantized at load on a
    /// backend without kernels for them.
    pub float_precision: WeightPrecision,
}

impl<'f> SfxLinearFactory<'f> {
    pub fn new(file: &'f SfxFile, float_precision: WeightPrecision) -> Self {
        Self {
            file,
            float_precision,
        }
    }

    /// The group-quantized weight of one projection, every section checked against `spec`.
    pub fn group_quantized(&self, spec: &LinearSpec<'_>) -> Result<GroupQuantized> {
        let file = self.file;
        let name = spec.weight_name;
        let what = spec.role.describe();
        let layer = spec
            .layer
            .map_or(String::new(), |l| format!(" of layer {l}"));

        let (codes, [rows, cols, bits, group]) =
            self.packed_codes(name, &format!("resident codes of the {what}{layer}"))?;
        let (rows, cols) = config_dims(file, name, "codes", (rows, cols), spec)?;
        // The layout allows 1–8 bits; kernels exist for SUPPORTED_BITS.
        let bits = match u8::try_from(bits) {
            Ok(b) if SUPPORTED_BITS.contains(&b) => b,
            _ => {
                return Err(section_err(
                    file,
                    name,
                    format!("{bits}-bit codes (this runtime supports {SUPPORTED_BITS:?})"),
                ))
            }
        };
        let group = to_usize(file, name, group)?;
        if group == 0 || !group.is_multiple_of(8) {
            return Err(section_err(
                file,
                name,
                format!("group size {group} is not a positive multiple of 8"),
            ));
        }
        let groups = cols.div_ceil(group);
        let overflow = || section_err(file, name, format!("[{rows}, {cols}] overflows"));
        let row_bytes = cols
            .checked_mul(usize::from(bits))
            .ok_or_else(overflow)?
            .div_ceil(8);
        let code_bytes = row_bytes.checked_mul(rows).ok_or_else(overflow)?;
        let n_groups = groups.checked_mul(rows).ok_or_else(overflow)?;
        let code_data = decoded_exact(file, &codes, code_bytes)?;

        let scales_name = format!("{name}.scales");
        let scale_bytes = self.dense_exact(
            &scales_name,
            DType::F16,
            &[rows as u64, groups as u64],
            &format!(
                "per-group scales of the {what}{layer}: {rows} rows × ceil({cols}/{group}) groups"
            ),
        )?;
        let scales: Vec<f16> = scale_bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();

        let zeros_name = format!("{name}.zeros");
        let zeros = self.bytes_exact(
            &zeros_name,
            n_groups,
            &format!("per-group zero points of the {what}{layer}"),
        )?;
        let qmax = (1u16 << bits) - 1;
        if let Some(bad) = zeros.iter().find(|&&v| u16::from(v) > qmax) {
            return Err(section_err(
                file,
                &zeros_name,
                format!("zero point {bad} exceeds the {bits}-bit code range"),
            ));
        }
        if let Some(bad) = scales.iter().find(|v| !v.is_finite() || v.to_f32() < 0.0) {
            return Err(section_err(
                file,
                &scales_name,
                format!("scale {bad} is not a finite non-negative number"),
            ));
        }
        // Everything from_parts checks was checked above with section names; a failure here
        // would be a check this loader is missing, so it still names the weight.
        GroupQuantized::from_parts(
            bits,
            group,
            rows,
            cols,
            code_data.into_owned(),
            scales,
            zeros,
        )
        .map_err(|e| section_err(file, name, e))
    }
}

impl<'f> SfxLinearFactory<'f> {
    /// A `packed_codes` section and its `[rows, cols, bits, group]`; the error names the
    /// section and what it is for.
    fn packed_codes(&self, name: &str, why: &str) -> Result<(SectionView<'f>, [u64; 4])> {
        let codes = required_section(self.file, name, why)?;
        let Layout::PackedCodes {
            rows,
            cols,
            bits,
            group,
        } = *codes.layout
        else {
            return Err(section_err(
                self.file,
                name,
                format!(
                    "layout {}, expected packed_codes ({why})",
                    layout_name(codes.layout)
                ),
            ));
        };
        Ok((codes, [rows, cols, bits, group]))
    }

    /// A `bytes` section of exactly `len` bytes, decoded; the error names the section and what
    /// it is for.
    fn bytes_exact(&self, name: &str, len: usize, why: &str) -> Result<Vec<u8>> {
        let s = required_section(self.file, name, why)?;
        if *s.layout != Layout::Bytes {
            return Err(section_err(
                self.file,
                name,
                format!("{}, expected bytes ({why})", describe_layout(s.layout)),
            ));
        }
        Ok(decoded_exact(self.file, &s, len)?.into_owned())
    }

    /// A dense section of exactly `shape` in `dtype`, decoded; the error names the section and
    /// what it is for.
    fn dense_exact(&self, name: &str, dtype: DType, shape: &[u64], why: &str) -> Result<Vec<u8>> {
        let file = self.file;
        let s = required_section(file, name, why)?;
        match s.layout {
            Layout::Dense {
                dtype: d,
                shape: got,
            } if *d == dtype && got[..] == *shape => {}
            other => {
                return Err(section_err(
                    file,
                    name,
                    format!(
                        "{}, expected dense {} {shape:?} ({why})",
                        describe_layout(other),
                        dtype.as_str()
                    ),
                ))
            }
        }
        let n = shape
            .iter()
            .try_fold(dtype.size_in_bytes(), |a, &d| {
                usize::try_from(d).ok().and_then(|d| a.checked_mul(d))
            })
            .ok_or_else(|| section_err(file, name, "shape overflows"))?;
        Ok(decoded_exact(file, &s, n)?.into_owned())
    }

    /// The look-up-table-coded weight of one projection (`P.weight` packed codes with one
    /// group a row, `P.weight.table` levels, `P.weight.scales`), every section checked
    /// against `spec`.
    pub fn lut_quantized(&self, spec: &LinearSpec<'_>) -> Result<LutQuantized> {
        let file = self.file;
        let name = spec.weight_name;
        let what = spec.role.describe();
        let (codes, [rows, cols, bits, group]) =
            self.packed_codes(name, &format!("look-up-table codes of the {what}"))?;
        let (rows, cols) = config_dims(file, name, "codes", (rows, cols), spec)?;
        if group != cols as u64 {
            return Err(section_err(
                file,
                name,
                format!("group {group}: look-up-table codes have one group a row ({cols})"),
            ));
        }
        let bits = u8::try_from(bits).unwrap_or(0);
        let (code_bytes, levels) =
            LutQuantized::sizes(bits, rows, cols).map_err(|e| section_err(file, name, e))?;
        let code_data = decoded_exact(file, &codes, code_bytes)?.into_owned();
        let tables = self
            .bytes_exact(
                &format!("{name}.table"),
                levels,
                &format!("per-row look-up tables of the {what}"),
            )?
            .iter()
            .map(|&b| b as i8)
            .collect();
        let scales_name = format!("{name}.scales");
        let scales = self
            .dense_exact(
                &scales_name,
                DType::F16,
                &[rows as u64],
                &format!("per-row scales of the {what}"),
            )?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        LutQuantized::from_parts(bits, rows, cols, code_data, tables, scales)
            .map_err(|e| section_err(file, &scales_name, e))
    }

    /// A projection kept in llama.cpp's blocks (`P.weight`, layout `gguf_blocks`), checked
    /// against `spec`.
    pub fn gguf_blocks(&self, spec: &LinearSpec<'_>) -> Result<BlockTensor> {
        let file = self.file;
        let name = spec.weight_name;
        let what = spec.role.describe();
        let codes = required_section(file, name, &format!("GGUF blocks of the {what}"))?;
        let Layout::GgufBlocks {
            rows,
            cols,
            ggml_type,
        } = *codes.layout
        else {
            return Err(section_err(
                file,
                name,
                format!("layout {}, expected gguf_blocks", layout_name(codes.layout)),
            ));
        };
        let (rows, cols) = config_dims(file, name, "blocks", (rows, cols), spec)?;
        // The layout was checked when the table was read: the type is a known block type.
        let ty =
            sfx_formats::sfx::gguf_block_type(ggml_type).map_err(|e| section_err(file, name, e))?;
        let len = (rows as u64)
            .checked_mul(cols as u64)
            .and_then(|n| ty.bytes_for(n))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| section_err(file, name, "block count overflows"))?;
        let bytes = decoded_exact(file, &codes, len)?.into_owned();
        Ok(BlockTensor {
            ty,
            rows,
            cols,
            bytes,
        })
    }

    /// The trellis-coded weight of one projection (`P.weight` trellis tiles, `P.weight.su`,
    /// `P.weight.sv`, the HYB table `P.weight.tlut` or `resident.tlut`, and the Hadamard
    /// factors `resident.hadamard.{m}`), every section checked against `spec`.
    pub fn trellis_quantized(&self, spec: &LinearSpec<'_>) -> Result<TrellisQuantized> {
        let file = self.file;
        let name = spec.weight_name;
        let what = spec.role.describe();
        let codes = required_section(file, name, &format!("trellis tiles of the {what}"))?;
        let Layout::TrellisTiles {
            rows,
            cols,
            k,
            scheme,
        } = *codes.layout
        else {
            return Err(section_err(
                file,
                name,
                format!(
                    "layout {}, expected trellis_tiles",
                    layout_name(codes.layout)
                ),
            ));
        };
        let (rows, cols) = config_dims(file, name, "tiles", (rows, cols), spec)?;
        let scheme = TrellisScheme::decode(scheme, k).map_err(|e| section_err(file, name, e))?;
        let n_tiles = TrellisQuantized::tile_stream_len(&scheme, rows, cols)
            .ok_or_else(|| section_err(file, name, "tile count overflows"))?;
        let tiles = decoded_exact(file, &codes, n_tiles)?.into_owned();
        let su_name = format!("{name}.su");
        let su = self.dense_exact(&su_name, DType::F16, &[cols as u64], "input signs")?;
        let sv_name = format!("{name}.sv");
        let sv = self.dense_exact(&sv_name, DType::F32, &[rows as u64], "output signs × scale")?;
        let lut_rows = scheme.code.table_rows() as u64;
        let tlut = if lut_rows == 0 {
            Vec::new()
        } else {
            let own = format!("{name}.tlut");
            let lut_name = if file.section(&own).is_ok() {
                own
            } else {
                "resident.tlut".to_string()
            };
            self.dense_exact(&lut_name, DType::F16, &[lut_rows, 2], "HYB lookup table")?
        };
        let factor = |n: usize| -> Result<SmallHadamard> {
            let m = n >> n.trailing_zeros();
            // A block rotation takes no dense factor.
            if m == 1 || scheme.rotation != sfx_formats::resident::Rotation::Full {
                return Ok(SmallHadamard::unit());
            }
            // The dense factor's order is the odd part times the smallest power of two with a
            // stored section (our converter and QTIP both use m = odd·2^j, small j).
            let mut order = m;
            while order <= n {
                let sec = format!("resident.hadamard.{order}");
                if file.section(&sec).is_ok() {
                    let o = order as u64;
                    let b = self.dense_exact(&sec, DType::F32, &[o, o], "Hadamard factor")?;
                    let e: Vec<i8> = b
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i8)
                        .collect();
                    return SmallHadamard::new(order, e).map_err(|e| section_err(file, &sec, e));
                }
                order *= 2;
            }
            Err(section_err(
                file,
                name,
                format!("no resident.hadamard.{{m}} section for a transform of order {n}"),
            ))
        };
        TrellisQuantized::from_parts(TrellisParts {
            scheme,
            rows,
            cols,
            tiles,
            su: su
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            sv: sv
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            tlut: tlut
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            had_in: factor(cols)?,
            had_out: factor(rows)?,
        })
        .map_err(|e| section_err(file, name, e))
    }
}

/// Layout with its dtype/shape, for "found X, expected Y" messages.
fn describe_layout(l: &Layout) -> String {
    match l {
        Layout::Dense { dtype, shape } => format!("dense {} {shape:?}", dtype.as_str()),
        other => layout_name(other).to_string(),
    }
}

impl<B: ResidentKernels> LinearFactory<B> for SfxLinearFactory<'_> {
    fn load(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
    ) -> Result<Box<dyn Linear<B>>> {
        if spec.role == LinearRole::LmHead && !self.is_packed(spec.weight_name) {
            // docs/format.md: a float head (`lm_head.weight`, dense).
            return Ok(Box::new(FloatLinear::load(
                backend,
                tensors,
                spec,
                self.float_precision,
            )?));
        }
        let bias = load_bias(tensors, spec)?;
        let trellis = matches!(
            self.section_layout(spec.weight_name),
            Some(Layout::TrellisTiles { .. })
        );
        let what = format!(
            "{}{}",
            spec.weight_name,
            spec.layer
                .map_or(String::new(), |l| format!(" (layer {l})"))
        );
        if trellis {
            let q = self.trellis_quantized(spec)?;
            return backend.trellis_linear(q, bias, &what);
        }
        if let Some(Layout::GgufBlocks { .. }) = self.section_layout(spec.weight_name) {
            // A backend without kernels for these blocks runs them dequantized, at the
            // precision of the file's float weights.
            let t = self.gguf_blocks(spec)?;
            return block_linear(backend, &t, bias, self.float_precision, &what);
        }
        if self.is_lut(spec.weight_name) {
            let q = self.lut_quantized(spec)?;
            return lut_or_dequantized(backend, &q, bias, self.float_precision, &what);
        }
        let q = self.group_quantized(spec)?;
        backend.group_linear(q, bias, &what)
    }

    fn load_embedding(
        &self,
        backend: &B,
        tensors: &dyn TensorSource,
        spec: &LinearSpec<'_>,
        precision: WeightPrecision,
    ) -> Result<Arc<dyn Linear<B>>> {
        if !self.is_packed(spec.weight_name) {
            return Ok(Arc::new(FloatLinear::load(
                backend, tensors, spec, precision,
            )?));
        }
        let q = self.group_quantized(spec)?;
        Ok(Arc::from(backend.group_linear(
            q,
            None,
            spec.weight_name,
        )?))
    }
}

impl SfxLinearFactory<'_> {
    /// The layout of section `name`, if the file has that section.
    fn section_layout(&self, name: &str) -> Option<&Layout> {
        self.file.section(name).ok().map(|s| s.layout)
    }

    /// Whether weight `name` is look-up-table coded (it has a `.table` section).
    pub fn is_lut(&self, name: &str) -> bool {
        self.file.section(&format!("{name}.table")).is_ok()
    }

    /// Whether section `name` holds packed codes (a quantized embedding or head).
    fn is_packed(&self, name: &str) -> bool {
        matches!(self.section_layout(name), Some(Layout::PackedCodes { .. }))
    }
}
