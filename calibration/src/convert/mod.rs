//! The converter pipeline: float checkpoint → resident codes + refinement in a `.sfx`.
//!
//! Block by block (GPTQ/AWQ style), with only one block's weights and the statistics in
//! memory: the calibration sequences' residual streams are held on the host and pushed
//! through the *float* block, so every statistic describes the float model's activations.
//! Per block:
//! 1. input statistics per projection set (`E[xxᵀ]`, `E|x|`) when the quantizer needs them;
//! 2. resident quantization per set in the order o, down, qkv, gate/up — AWQ scales of o fold
//!    into v's rows and those of down into up's rows, so those sets must be settled before
//!    the sets that contain v and up are quantized;
//! 3. a second pass collects the refinement statistics M = E[zzᵀ], G = E[xzᵀ] on the inputs
//!    the quantized weights will actually see (`x / s` under AWQ), measures the held-out
//!    inputs, and advances the residual streams to the next block;
//! 4. refinement R = W' − Ŵ (W' = W·diag(s)), fitted C if asked, 4-bit columns, neuron
//!    bundles, and the block's sections are streamed to the writer.

mod layer;
mod state;

use crate::quant::{Awq, QuantError, ResidentQuantizer, Rtn};
use crate::refine::RefineError;
use sfx_formats::resident::TrellisCode;
use sfx_formats::sfx::{Codec, Layout, SectionSpec, SfxWriter, Tier};
use sfx_formats::{DType, FormatError, ModelConfig, TensorSource};
use sfx_runtime::refine::bundle_budget;
use sfx_runtime::{CpuBackend, LayerwiseRunner, ProjectionSet, RuntimeError};
use std::collections::BTreeMap;

pub use layer::{LayerReport, SetReport};
pub use state::{streams_sha256, ConvertState, LayerRecord};

/// Errors of a conversion; each names the tensor, option or stage at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{0}")]
    Options(String),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("YAQA Hessians: {0}")]
    Yaqa(#[from] crate::yaqa::YaqaError),
    #[error("refinement of layer {layer} set {set}: {source}")]
    Refine {
        layer: usize,
        set: &'static str,
        #[source]
        source: RefineError,
    },
    /// Recording a block's checkpoint failed, or a checkpoint cannot be continued.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}

/// Resident quantization methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMethod {
    Rtn,
    Awq,
    /// QTIP trellis (HYB, L = 16) with LDLQ on the layer-input Hessian.
    Qtip,
    /// QTIP's format with YAQA's two-sided LDLQ on Kronecker factors of the full-model KL.
    Yaqa,
    /// A llama.cpp GGUF's own blocks, kept (the base file is the GGUF).
    Gguf,
    /// llama.cpp's block types, rounded here as `llama-quantize` rounds them.
    Ggml(crate::quant::GgmlQuant),
    /// SqueezeLLM: per-row look-up tables from a Fisher-weighted k-means.
    SqueezeLlm,
    /// LNQ: SqueezeLLM's tables refined on GuidedQuant's gradient-weighted layer objective.
    Lnq,
}

/// Output-channel groups of LNQ's GuidedQuant Hessians (the paper's default).
pub const LNQ_GROUPS: usize = 4;

/// `rtn{2,3,4}` or `awq{2,3,4}` at a group size, or `qtip{2,3,4}` (trellis; no groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub method: QuantMethod,
    pub bits: u8,
    pub group: usize,
    /// AWQ search grid: α values (AWQ: 20, i.e. 0, 0.05, …, 0.95) and clip ratios (AWQ: 20,
    /// 1.0 → 0.5). Ignored by RTN.
    pub awq_alpha_steps: usize,
    pub awq_clip_steps: usize,
    /// Trellis code of qtipN / yaqaN (QTIP's default: HYB with a 2^9-entry table). Ignored by
    /// the group quantizers.
    pub trellis_code: TrellisCode,
    /// The trellis weights' Hadamard rotation (whole dimensions, or blocks). Ignored by the
    /// other quantizers.
    pub rotation: sfx_formats::resident::Rotation,
}

impl QuantSpec {
    /// Parses `rtn2`…`rtn4`, `awq2`…`awq4` (group 128), `qtip2`…, `yaqa2`…, `gguf` (the
    /// codes of a GGUF base; `bits` is then 0: a GGUF mixes block types), or a llama.cpp type
    /// `q2_k`…`q6_k`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q8_0` (`bits`: the type's code bits).
    pub fn parse(s: &str) -> Result<Self, ConvertError> {
        let bad = || {
            ConvertError::Options(format!(
                "--quant {s:?}: expected rtnN, awqN, qtipN, yaqaN, sqllmN or lnqN with N = 2, 3 or 4, a \
                 llama.cpp type (q2_k, q3_k, q4_k, q5_k, q6_k, q4_0, q4_1, q5_0, q5_1, q8_0), \
                 or gguf"
            ))
        };
        if s == "gguf" {
            return Ok(Self {
                method: QuantMethod::Gguf,
                bits: 0,
                ..Self::parse("rtn4")?
            });
        }
        if let Some(q) = crate::quant::GgmlQuant::parse(s) {
            let bits = s[1..2].parse().map_err(|_| bad())?;
            return Ok(Self {
                method: QuantMethod::Ggml(q),
                bits,
                ..Self::parse("rtn4")?
            });
        }
        let (method, bits) = if let Some(b) = s.strip_prefix("rtn") {
            (QuantMethod::Rtn, b)
        } else if let Some(b) = s.strip_prefix("awq") {
            (QuantMethod::Awq, b)
        } else if let Some(b) = s.strip_prefix("qtip") {
            (QuantMethod::Qtip, b)
        } else if let Some(b) = s.strip_prefix("yaqa") {
            (QuantMethod::Yaqa, b)
        } else if let Some(b) = s.strip_prefix("sqllm") {
            (QuantMethod::SqueezeLlm, b)
        } else if let Some(b) = s.strip_prefix("lnq") {
            (QuantMethod::Lnq, b)
        } else {
            return Err(bad());
        };
        let bits = match bits {
            "2" => 2,
            "3" => 3,
            "4" => 4,
            _ => return Err(bad()),
        };
        Ok(Self {
            method,
            bits,
            group: crate::quant::DEFAULT_GROUP_SIZE,
            awq_alpha_steps: 20,
            awq_clip_steps: 20,
            trellis_code: TrellisCode::Hyb { q: 9 },
            rotation: sfx_formats::resident::Rotation::Full,
        })
    }

    /// The quantizer of a method that quantizes; a GGUF's blocks come from its base file.
    pub fn quantizer(&self) -> Result<Box<dyn ResidentQuantizer>, ConvertError> {
        Ok(match self.method {
            QuantMethod::Rtn => Box::new(Rtn {
                bits: self.bits,
                group_size: self.group,
            }),
            QuantMethod::Awq => Box::new(Awq {
                group_size: self.group,
                alpha_steps: self.awq_alpha_steps,
                clip_steps: self.awq_clip_steps,
                ..Awq::new(self.bits)
            }),
            QuantMethod::Qtip => Box::new(crate::quant::Qtip {
                code: self.trellis_code,
                rotation: self.rotation,
                ..crate::quant::Qtip::new(self.bits)
            }),
            QuantMethod::Yaqa => {
                let mut yaqa = crate::quant::Yaqa::new(self.bits);
                yaqa.qtip.code = self.trellis_code;
                yaqa.qtip.rotation = self.rotation;
                Box::new(yaqa)
            }
            QuantMethod::Ggml(q) => Box::new(q),
            QuantMethod::SqueezeLlm => Box::new(crate::quant::SqueezeLlm { bits: self.bits }),
            QuantMethod::Lnq => Box::new(crate::quant::Lnq::new(self.bits)),
            QuantMethod::Gguf => {
                return Err(ConvertError::Options(
                    "--quant gguf keeps the blocks of a GGUF base: give the GGUF as the model \
                     and the float model with --float-source"
                        .into(),
                ))
            }
        })
    }

    /// The base's name in messages: `awq3`, `qtip2`, `gguf`, `q4_k`.
    pub fn label(&self) -> String {
        match self.method {
            QuantMethod::Gguf | QuantMethod::Ggml(_) => self.method_name().to_string(),
            _ => format!("{}{}", self.method_name(), self.bits),
        }
    }

    pub fn method_name(&self) -> &'static str {
        match self.method {
            QuantMethod::Rtn => "rtn",
            QuantMethod::Awq => "awq",
            QuantMethod::Qtip => "qtip",
            QuantMethod::Yaqa => "yaqa",
            QuantMethod::SqueezeLlm => "sqllm",
            QuantMethod::Lnq => "lnq",
            QuantMethod::Gguf => "gguf",
            QuantMethod::Ggml(q) => q.quant_name(),
        }
    }

    /// The code packing named in the container's `params.quant.packing`.
    pub fn packing(&self) -> &'static str {
        match self.method {
            QuantMethod::Rtn | QuantMethod::Awq => "group-asym-v1",
            QuantMethod::Qtip | QuantMethod::Yaqa => "trellis-v1",
            QuantMethod::SqueezeLlm | QuantMethod::Lnq => sfx_runtime::sfx_model::PACKING_LUT_V1,
            QuantMethod::Gguf | QuantMethod::Ggml(_) => {
                sfx_runtime::sfx_model::PACKING_GGUF_BLOCKS_V1
            }
        }
    }
}

/// How the MLP's refinement is stored (docs/method.md §2: neither wins everywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpScheme {
    /// Channel-wise columns for gate/up and down.
    Channels,
    /// Neuron bundles only.
    Bundles,
    /// Both; the runtime (or tuner) picks.
    Both,
}

impl MlpScheme {
    pub fn parse(s: &str) -> Result<Self, ConvertError> {
        match s {
            "channels" => Ok(Self::Channels),
            "bundles" => Ok(Self::Bundles),
            "both" => Ok(Self::Both),
            _ => Err(ConvertError::Options(format!(
                "--mlp {s:?}: expected channels, bundles or both"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Channels => "channels",
            Self::Bundles => "bundles",
            Self::Both => "both",
        }
    }

    fn channels(self) -> bool {
        self != Self::Bundles
    }

    fn bundles(self) -> bool {
        self != Self::Channels
    }
}

/// How the output head and the token embedding are stored (`--head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadFormat {
    /// The float tables as the source stores them (BF16 from a GGUF).
    Float,
    /// Group codes of 4, 6 or 8 bits (group 128), head error weighted by its inputs'
    /// second moments ([`crate::quant::TableQuant`]).
    Group { bits: u8 },
}

impl HeadFormat {
    pub fn parse(s: &str) -> Result<Self, ConvertError> {
        match s {
            "bf16" | "float" => Ok(Self::Float),
            "q4" => Ok(Self::Group { bits: 4 }),
            "q6" => Ok(Self::Group { bits: 6 }),
            "q8" => Ok(Self::Group { bits: 8 }),
            _ => Err(ConvertError::Options(format!(
                "--head {s:?}: expected bf16 (the float table), q4, q6 or q8"
            ))),
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::Float => "bf16".into(),
            Self::Group { bits } => format!("q{bits}"),
        }
    }
}

/// Everything that changes the converter's output bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertOptions {
    pub quant: QuantSpec,
    /// Fitted refinement C (true) or the plain residual R (false, DecDEC).
    pub fit: bool,
    /// Refinement budgets k per 1024 input channels, indexed by [`ProjectionSet::index`]:
    /// what the file runs at by default (each on the ladder when there is one).
    pub k: [usize; 4],
    /// Budgets to fit C at in the same calibration pass (`--k-ladder`), every set at every
    /// rung; empty: one C per set at its `k`.
    pub k_ladder: Vec<usize>,
    /// Ridge λ and prior of the fitted C.
    pub fit_spec: crate::refine::FitSpec,
    pub mlp: MlpScheme,
    /// Tier of the refinement sections (`ram` or `ssd`).
    pub refine_tier: Tier,
    /// YAQA and SqueezeLLM: calibration sequences (from the start of the calibration set)
    /// whose gradients build YAQA's Kronecker factors (sampled labels) or SqueezeLLM's Fisher
    /// diagonal (the text's next tokens); 0 = all.
    pub yaqa_sequences: usize,
    /// The output head and embedding tables.
    pub head: HeadFormat,
    /// Keep the resident codes of this container instead of quantizing (`--base`); `quant`
    /// then describes the file's base.
    pub base: Option<std::path::PathBuf>,
    /// A llama.cpp importance matrix read from a file (`--imatrix-file`), for the weighted
    /// rounding of llama.cpp's block types.
    pub imatrix: Option<std::sync::Arc<sfx_formats::gguf::Imatrix>>,
}

impl ConvertOptions {
    /// Neurons per 1024 selected by bundles: k_n = round(3·k_d / 4), the method's pairing of
    /// bundle and channel budgets (docs/method.md §6).
    pub fn bundle_k(&self) -> usize {
        bundle_budget(self.k[ProjectionSet::Down.index()])
    }

    /// The budgets `set` is fitted at: the ladder, or its one k.
    pub fn rungs(&self, set: ProjectionSet) -> Vec<usize> {
        if self.k_ladder.is_empty() {
            vec![self.k[set.index()]]
        } else {
            self.k_ladder.clone()
        }
    }

    /// The rung a section name carries (`None` without a ladder: the one-k names).
    pub fn section_rung(&self, k: usize) -> Option<usize> {
        (!self.k_ladder.is_empty()).then_some(k)
    }

    /// Checks the options against each other (also done by [`convert`]); a caller calls it
    /// first to refuse bad options before any work.
    pub fn validate(&self) -> Result<(), ConvertError> {
        if self.quant.awq_alpha_steps == 0 {
            return Err(ConvertError::Options(
                "--awq-grid: at least one α value".into(),
            ));
        }
        if let Some(&k) = self.k.iter().find(|&&k| k == 0 || k > 1024) {
            // k = 0 used to reach the fit and fail there, minutes in, as a λ error.
            return Err(ConvertError::Options(format!(
                "--k {k}: a budget is 1 to 1024 channels per 1024 inputs (the file's default \
                 and what the statistics are gathered for; a run without refinement is \
                 `sfx-run --k 0`)"
            )));
        }
        if !self.k_ladder.is_empty() {
            if !self.fit {
                return Err(ConvertError::Options(
                    "--k-ladder needs --fit: the plain residual R does not depend on k".into(),
                ));
            }
            if let Some(&k) = self.k_ladder.iter().find(|&&k| k == 0 || k > 1024) {
                return Err(ConvertError::Options(format!(
                    "--k-ladder: rung {k} is not a budget between 1 and 1024 per 1024 channels"
                )));
            }
            if !self.k_ladder.windows(2).all(|w| w[0] < w[1]) {
                return Err(ConvertError::Options(format!(
                    "--k-ladder {:?}: rungs must increase",
                    self.k_ladder
                )));
            }
            if let Some(&k) = self.k.iter().find(|k| !self.k_ladder.contains(k)) {
                return Err(ConvertError::Options(format!(
                    "--k {k}: the file's default budget must be a rung of --k-ladder {:?}",
                    self.k_ladder
                )));
            }
        }
        let l = match self.fit_spec.lambda {
            crate::refine::Lambda::Absolute(l) | crate::refine::Lambda::MeanDiag(l) => l,
        };
        if !(l.is_finite() && l > 0.0) {
            return Err(ConvertError::Options(format!(
                "--lambda {l}: must be a positive finite number"
            )));
        }
        if self.refine_tier == Tier::Resident {
            return Err(ConvertError::Options(
                "--refine-tier: refinement lives in the ram or ssd tier".into(),
            ));
        }
        Ok(())
    }
}

/// What a conversion produced, for logs, `--json` and docs/results.md.
#[derive(Debug, Clone, Default)]
pub struct ConvertReport {
    pub layers: Vec<LayerReport>,
    /// Container metadata `params` entries written by the converter (`quant`, `refine`,
    /// `awq`); the caller adds `calibration`.
    pub params: BTreeMap<String, serde_json::Value>,
    /// Decoded bytes per tier name.
    pub bytes_by_tier: BTreeMap<String, u64>,
    /// Resident bits per weight of the quantized linears, scales and zeros included.
    pub linear_bits_per_weight: f64,
    /// Refinement bytes (columns + bundles) and their zstd level-3 compressed size.
    pub refine_bytes: u64,
    pub refine_zstd_bytes: u64,
    pub calib_tokens: u64,
    /// Calibration sequences YAQA's Hessian sketch or SqueezeLLM's Fisher diagonal used
    /// (`None` for other methods).
    pub yaqa_sequences: Option<usize>,
    pub heldout_tokens: u64,
    /// Bytes of the output head and embedding tables (one table when tied).
    pub head_bytes: u64,
    /// Time spent recording checkpoints (hashing the streams, the writer's fsync, the
    /// `on_checkpoint` hook), this run.
    pub checkpoint_seconds: f64,
    /// Time a resumed run spent running the finished blocks again.
    pub replay_seconds: f64,
}

/// Section accounting shared by the pipeline's writers.
struct Sink<'w> {
    writer: &'w mut SfxWriter,
    /// Model-wide sections written once (HYB table, Hadamard factors) and their bytes, so a
    /// projection that needs different contents gets its own section instead.
    shared: BTreeMap<String, Vec<u8>>,
    bytes_by_tier: BTreeMap<String, u64>,
    refine_bytes: u64,
    refine_zstd_bytes: u64,
}

impl Sink<'_> {
    fn put(
        &mut self,
        name: String,
        tier: Tier,
        layout: Layout,
        bytes: &[u8],
    ) -> Result<(), ConvertError> {
        *self
            .bytes_by_tier
            .entry(tier.as_str().to_string())
            .or_default() += bytes.len() as u64;
        if tier != Tier::Resident {
            self.refine_bytes += bytes.len() as u64;
            let z = zstd::bulk::compress(bytes, Codec::ZSTD_LEVEL)
                .map_err(|e| FormatError::invalid(std::path::Path::new(&name), e.to_string()))?;
            self.refine_zstd_bytes += z.len() as u64;
        }
        self.writer
            .add_section(SectionSpec::new(name, tier, Codec::Raw, layout), bytes)?;
        Ok(())
    }

    fn put_f32(&mut self, name: String, shape: Vec<u64>, v: &[f32]) -> Result<(), ConvertError> {
        let layout = Layout::Dense {
            dtype: DType::F32,
            shape,
        };
        self.put(name, Tier::Resident, layout, bytemuck::cast_slice(v))
    }

    fn put_f16(
        &mut self,
        name: String,
        shape: Vec<u64>,
        v: &[half::f16],
    ) -> Result<(), ConvertError> {
        let layout = Layout::Dense {
            dtype: DType::F16,
            shape,
        };
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(name, Tier::Resident, layout, &bytes)
    }

    /// A model-wide section: written on first use; `Ok(true)` when `bytes` equal what the
    /// section holds (the caller writes a per-projection copy otherwise).
    fn put_shared(
        &mut self,
        name: &str,
        layout: Layout,
        bytes: Vec<u8>,
    ) -> Result<bool, ConvertError> {
        match self.shared.get(name) {
            Some(b) => Ok(*b == bytes),
            None => {
                self.put(name.to_string(), Tier::Resident, layout, &bytes)?;
                self.shared.insert(name.to_string(), bytes);
                Ok(true)
            }
        }
    }

    /// Sections of a trellis-coded projection `name`: its own, then the model-wide table and
    /// Hadamard factors on first use (a differing table gets a per-projection copy).
    fn put_trellis(
        &mut self,
        name: &str,
        t: &sfx_formats::resident::TrellisQuantized,
    ) -> Result<(), ConvertError> {
        let (own, shared) = sfx_formats::resident::trellis_sections(name, t);
        for (sec, layout, bytes) in own {
            self.put(sec, Tier::Resident, layout, &bytes)?;
        }
        for (sec, layout, bytes) in shared {
            if self.put_shared(&sec, layout.clone(), bytes.clone())? {
                continue;
            }
            if sec == sfx_formats::resident::TLUT_SECTION {
                self.put(
                    format!("{name}.weight.tlut"),
                    Tier::Resident,
                    layout,
                    &bytes,
                )?;
            } else {
                return Err(ConvertError::Options(format!(
                    "{sec}: two different Hadamard factors of one order in one model"
                )));
            }
        }
        Ok(())
    }

    /// A group-coded weight `name`: codes, `.scales`, `.zeros` (docs/format.md).
    fn put_group(
        &mut self,
        name: &str,
        q: &sfx_formats::resident::GroupQuantized,
    ) -> Result<(), ConvertError> {
        let (rows, cols) = (q.rows() as u64, q.cols() as u64);
        let layout = Layout::PackedCodes {
            rows,
            cols,
            bits: q.bits() as u64,
            group: q.group_size() as u64,
        };
        self.put(name.to_string(), Tier::Resident, layout, q.codes())?;
        self.put_f16(
            format!("{name}.scales"),
            vec![rows, q.groups_per_row() as u64],
            q.scales(),
        )?;
        self.put(
            format!("{name}.zeros"),
            Tier::Resident,
            Layout::Bytes,
            q.zeros(),
        )
    }

    /// A look-up-table-coded weight `name`: codes (one group a row), `.table`, `.scales`
    /// (docs/format.md).
    fn put_lut(
        &mut self,
        name: &str,
        q: &sfx_formats::resident::LutQuantized,
    ) -> Result<(), ConvertError> {
        let (rows, cols) = (q.rows() as u64, q.cols() as u64);
        let layout = Layout::PackedCodes {
            rows,
            cols,
            bits: u64::from(q.bits()),
            group: cols,
        };
        self.put(name.to_string(), Tier::Resident, layout, q.codes())?;
        let table: Vec<u8> = q.tables().iter().map(|&t| t as u8).collect();
        self.put(
            format!("{name}.table"),
            Tier::Resident,
            Layout::Bytes,
            &table,
        )?;
        self.put_f16(format!("{name}.scales"), vec![rows], q.scales())
    }

    /// A weight kept in llama.cpp's blocks: the GGUF's bytes as they are (docs/format.md).
    fn put_gguf(
        &mut self,
        name: &str,
        t: &sfx_formats::gguf::BlockTensor,
    ) -> Result<(), ConvertError> {
        let layout = Layout::GgufBlocks {
            rows: t.rows as u64,
            cols: t.cols as u64,
            ggml_type: u64::from(t.ty.id()),
        };
        self.put(name.to_string(), Tier::Resident, layout, &t.bytes)
    }

    /// A float tensor copied in its source dtype.
    fn put_source(&mut self, tensors: &dyn TensorSource, name: &str) -> Result<(), ConvertError> {
        let view = tensors.tensor(name)?;
        let layout = Layout::Dense {
            dtype: view.dtype,
            shape: view.shape.iter().map(|&d| d as u64).collect(),
        };
        self.put(name.to_string(), Tier::Resident, layout, view.data)
    }
}

/// Progress hooks of [`convert`].
pub struct Hooks<'h> {
    /// After every block, once its checkpoint is recorded: its report and the block count.
    pub on_layer: &'h mut dyn FnMut(&LayerReport, usize),
    /// YAQA's Hessian sketch: sequences done, total.
    pub on_sketch: &'h mut dyn FnMut(usize, usize),
    /// After every block's sections are written: make them durable and record `state`
    /// (the writer's own checkpoint comes from [`SfxWriter::checkpoint`]), so a later run can
    /// resume from here. An error ends the conversion.
    pub on_checkpoint: &'h mut dyn FnMut(&mut SfxWriter, &ConvertState) -> Result<(), ConvertError>,
}

/// Converts the float model in `tensors` into sections of `writer` (the caller writes the
/// metadata and finishes the file). `calib` and `heldout` are token sequences (each run from
/// position 0).
///
/// With `resume`, the state a checkpoint recorded, `writer` holds the sections of its
/// finished blocks ([`SfxWriter::resume`]) and the conversion goes on after them; the inputs
/// and options must be those of the interrupted run (the caller checks; the replayed residual
/// streams are checked against the state's hash here).
#[allow(clippy::too_many_arguments)] // inputs, options, output, resume point and hooks
pub fn convert(
    config: &ModelConfig,
    tensors: &dyn TensorSource,
    calib: &[Vec<u32>],
    heldout: &[Vec<u32>],
    options: &ConvertOptions,
    writer: &mut SfxWriter,
    resume: Option<&ConvertState>,
    hooks: Hooks<'_>,
) -> Result<ConvertReport, ConvertError> {
    options.validate()?;
    if calib.is_empty() || calib.iter().any(|s| s.is_empty()) {
        return Err(ConvertError::Options(
            "no calibration tokens (empty calibration sequence)".into(),
        ));
    }
    let runner = LayerwiseRunner::new(CpuBackend::new(), config)?;
    let base = match &options.base {
        Some(path) => Some(crate::quant::KeptBase::open(path, config)?),
        None => None,
    };
    let own_quantizer;
    let quantizer: &dyn ResidentQuantizer = match &base {
        Some(b) => b.quantizer(),
        None => {
            own_quantizer = options.quant.quantizer()?;
            &*own_quantizer
        }
    };
    let mut sink = Sink {
        writer,
        shared: BTreeMap::new(),
        bytes_by_tier: BTreeMap::new(),
        refine_bytes: 0,
        refine_zstd_bytes: 0,
    };
    let mut report = ConvertReport::default();
    let (mut code_bits, mut weights) = (0u64, 0u64);
    let blocks_done = match resume {
        Some(st) => {
            if st.blocks_done == 0 || st.blocks_done > config.num_hidden_layers {
                return Err(ConvertError::Checkpoint(format!(
                    "it records {} finished blocks of a {}-block model",
                    st.blocks_done, config.num_hidden_layers
                )));
            }
            for name in &st.shared {
                let bytes = sink.writer.read_section(name)?;
                sink.shared.insert(name.clone(), bytes);
            }
            sink.bytes_by_tier = st.bytes_by_tier.clone();
            sink.refine_bytes = st.refine_bytes;
            sink.refine_zstd_bytes = st.refine_zstd_bytes;
            report.layers = st.layers.iter().map(LayerReport::from).collect();
            (code_bits, weights) = (st.code_bits, st.weights);
            st.blocks_done
        }
        None => 0,
    };

    const EMBED: &str = "model.embed_tokens.weight";
    // A checkpoint comes after a block, so a resumed file already holds the embedding.
    if options.head == HeadFormat::Float && resume.is_none() {
        sink.put_source(tensors, EMBED)?;
    }
    let mut calib_h = calib
        .iter()
        .map(|s| runner.embed(tensors, s))
        .collect::<Result<Vec<_>, _>>()?;
    let mut held_h = heldout
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| runner.embed(tensors, s))
        .collect::<Result<Vec<_>, _>>()?;

    // YAQA's Kronecker factors and SqueezeLLM's Fisher diagonal need gradients through the
    // whole float model, so they are computed before the block-by-block pass (crate::yaqa).
    let gradient_method = matches!(
        options.quant.method,
        QuantMethod::Yaqa | QuantMethod::SqueezeLlm | QuantMethod::Lnq
    );
    let yaqa_sequences =
        (gradient_method && base.is_none()).then(|| match options.yaqa_sequences {
            0 => calib.len(),
            n => n.min(calib.len()),
        });
    let opts = crate::yaqa::SketchOptions::default();
    let (kron, fisher, guided) = match (yaqa_sequences, options.quant.method) {
        (None, _) => (None, None, None),
        (Some(n), QuantMethod::SqueezeLlm) => {
            let f =
                crate::yaqa::fisher_diagonal(config, tensors, &calib[..n], &opts, hooks.on_sketch)?;
            (None, Some(f), None)
        }
        (Some(n), QuantMethod::Lnq) => {
            let g = crate::yaqa::guided_statistics(
                config,
                tensors,
                &calib[..n],
                LNQ_GROUPS,
                &opts,
                hooks.on_sketch,
            )?;
            (None, Some(g.fisher), Some(g.saliency))
        }
        (Some(n), _) => {
            let k = crate::yaqa::sketch_b(config, tensors, &calib[..n], &opts, hooks.on_sketch)?;
            (Some(k), None, None)
        }
    };
    let ctx = layer::LayerContext {
        runner: &runner,
        tensors,
        quantizer,
        options,
        kron: kron.as_ref(),
        fisher: fisher.as_ref(),
        guided: guided.as_ref(),
    };
    if let Some(st) = resume {
        let t = std::time::Instant::now();
        for l in 0..blocks_done {
            ctx.replay(l, &mut calib_h, &mut held_h)?;
        }
        if streams_sha256(&calib_h, &held_h) != st.streams_sha256 {
            return Err(ConvertError::Checkpoint(format!(
                "running blocks 0..{blocks_done} again did not give the residual streams the \
                 interrupted run recorded (different calibration tokens or a different build)"
            )));
        }
        report.replay_seconds = t.elapsed().as_secs_f64();
    }
    for l in blocks_done..config.num_hidden_layers {
        let (lr, bits, n) = ctx.process(l, &mut calib_h, &mut held_h, &mut sink)?;
        code_bits += bits;
        weights += n;
        report.layers.push(lr);
        let t = std::time::Instant::now();
        let state = ConvertState {
            blocks_done: l + 1,
            layers: report.layers.iter().map(LayerRecord::from).collect(),
            code_bits,
            weights,
            bytes_by_tier: sink.bytes_by_tier.clone(),
            refine_bytes: sink.refine_bytes,
            refine_zstd_bytes: sink.refine_zstd_bytes,
            shared: sink.shared.keys().cloned().collect(),
            streams_sha256: streams_sha256(&calib_h, &held_h),
        };
        (hooks.on_checkpoint)(sink.writer, &state)?;
        report.checkpoint_seconds += t.elapsed().as_secs_f64();
        // Reported once durable: a block the progress shows is one a resume starts after.
        if let Some(lr) = report.layers.last() {
            (hooks.on_layer)(lr, config.num_hidden_layers);
        }
    }

    let final_norm = layer::load_vector(tensors, "model.norm.weight", config.hidden_size)?;
    sink.put_f32(
        "model.norm.weight".into(),
        vec![config.hidden_size as u64],
        &final_norm,
    )?;
    let before_head = sink.bytes_by_tier.get("resident").copied().unwrap_or(0);
    match options.head {
        HeadFormat::Float => {
            if !config.tie_word_embeddings {
                sink.put_source(tensors, "lm_head.weight")?;
            }
        }
        HeadFormat::Group { bits } => {
            let table = crate::quant::TableQuant::new(bits);
            let importance = head_importance(&calib_h, &final_norm, config.rms_norm_eps);
            let (vocab, hidden) = (config.vocab_size, config.hidden_size);
            let head_name = if config.tie_word_embeddings {
                EMBED
            } else {
                "lm_head.weight"
            };
            let w = tensors.tensor(head_name)?.to_f32_vec();
            let q = table.quantize(head_name, &w, vocab, hidden, Some(&importance))?;
            sink.put_group(head_name, &q)?;
            if !config.tie_word_embeddings {
                // The untied embedding is only gathered: its rows are inputs, so plain MSE.
                let w = tensors.tensor(EMBED)?.to_f32_vec();
                let q = table.quantize(EMBED, &w, vocab, hidden, None)?;
                sink.put_group(EMBED, &q)?;
            }
        }
    }

    report.head_bytes = sink.bytes_by_tier.get("resident").copied().unwrap_or(0) - before_head;
    if options.head == HeadFormat::Float {
        let embed = tensors.tensor(EMBED)?.data.len() as u64;
        report.head_bytes += embed;
    }
    report.linear_bits_per_weight = code_bits as f64 / weights.max(1) as f64;
    report.calib_tokens = calib.iter().map(|s| s.len() as u64).sum();
    report.yaqa_sequences = yaqa_sequences;
    report.heldout_tokens = heldout.iter().map(|s| s.len() as u64).sum();
    report.params = params(options, quantizer, &report);
    if let QuantMethod::Ggml(q) = options.quant.method {
        let types = ggml_type_counts(q, config, tensors)?;
        if let Some(p) = report
            .params
            .get_mut("quant")
            .and_then(|v| v.as_object_mut())
        {
            p.insert("types".into(), serde_json::json!(types));
            // llama.cpp's weighted rounding: the calibration text's E[x²] per column, or a
            // user's importance matrix.
            let importance = match (q.importance, &options.imatrix) {
                (crate::quant::ggml_quant::Importance::Calibration, _) => {
                    serde_json::json!("calibration-e-x2")
                }
                (crate::quant::ggml_quant::Importance::File, Some(m)) => serde_json::json!({
                    "file": "llama.cpp imatrix",
                    "layout": m.layout,
                    "entries": m.entries.len(),
                    "sha256": m.sha256,
                }),
                _ => serde_json::Value::Null,
            };
            p.insert("importance".into(), importance);
        }
    }
    if let Some(b) = &base {
        // The codes are the file's: so are their description and their quantizer's records.
        report.params.insert("quant".into(), b.quant_params());
        report.params.extend(b.extra_params());
    }
    report.bytes_by_tier = sink.bytes_by_tier;
    report.refine_bytes = sink.refine_bytes;
    report.refine_zstd_bytes = sink.refine_zstd_bytes;
    Ok(report)
}

/// Projections per stored block type (`{"Q4_K": 30, "Q5_0": 180}`): with `--quant q4_k` the
/// narrow rows took llama.cpp's fallback type, and the file says so.
fn ggml_type_counts(
    q: crate::quant::GgmlQuant,
    config: &ModelConfig,
    tensors: &dyn TensorSource,
) -> Result<BTreeMap<&'static str, usize>, ConvertError> {
    let mut counts = BTreeMap::new();
    for l in 0..config.num_hidden_layers {
        for proj in ProjectionSet::ALL.iter().flat_map(|s| s.projections()) {
            let t = tensors.tensor(&format!("model.layers.{l}.{proj}.weight"))?;
            if let Some(ty) = t.shape.get(1).and_then(|&cols| q.type_for(cols)) {
                *counts.entry(ty.name()).or_insert(0) += 1;
            }
        }
    }
    Ok(counts)
}

/// E[xᵢ²] of the head's input (RMSNorm of the final residual streams, `[tokens, hidden]`
/// each), over every calibration token.
fn head_importance(streams: &[Vec<f32>], norm: &[f32], eps: f64) -> Vec<f32> {
    let hidden = norm.len();
    let mut acc = vec![0.0f64; hidden];
    let mut n = 0usize;
    for h in streams {
        for row in h.chunks_exact(hidden) {
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / hidden as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((a, &v), &w) in acc.iter_mut().zip(row).zip(norm) {
                let x = f64::from(v) * inv * f64::from(w);
                *a += x * x;
            }
            n += 1;
        }
    }
    acc.iter().map(|a| (a / n.max(1) as f64) as f32).collect()
}

fn params(
    o: &ConvertOptions,
    quantizer: &dyn ResidentQuantizer,
    report: &ConvertReport,
) -> BTreeMap<String, serde_json::Value> {
    use serde_json::json;
    let k: BTreeMap<&str, usize> = ProjectionSet::ALL
        .iter()
        .map(|s| (s.name(), o.k[s.index()]))
        .collect();
    let mut p = BTreeMap::new();
    p.insert(
        "quant".into(),
        json!({
            "name": quantizer.name(),
            "method": o.quant.method_name(),
            "bits": o.quant.bits,
            "group": if o.quant.packing() == "group-asym-v1" { json!(o.quant.group) } else { json!(null) },
            "packing": o.quant.packing(),
            "rotation": if o.quant.packing() == "trellis-v1" { json!(o.quant.rotation.name()) } else { json!(null) },
            "bits_per_weight": report.linear_bits_per_weight,
        }),
    );
    p.insert(
        "head".into(),
        match o.head {
            HeadFormat::Float => json!({ "format": "float" }),
            HeadFormat::Group { bits } => json!({
                "format": o.head.name(),
                "bits": bits,
                "group": crate::quant::DEFAULT_GROUP_SIZE,
                "packing": "group-asym-v1",
                "grid": "clip-search-16-weighted-final-norm-e-x2",
            }),
        },
    );
    match report.yaqa_sequences {
        Some(n) if o.quant.method == QuantMethod::SqueezeLlm => {
            p.insert(
                "sqllm".into(),
                json!({
                    "sensitivity": "fisher-diagonal",
                    "labels": "next-token",
                    "sequences": n,
                    "kmeans": "weighted-exact-1d-dp",
                    "levels": "int8-row-scale",
                    "outliers": null,
                }),
            );
        }
        Some(n) if o.quant.method == QuantMethod::Lnq => {
            let lnq = crate::quant::Lnq::new(o.quant.bits);
            p.insert(
                "lnq".into(),
                json!({
                    "start": "sqllm (fisher-diagonal, next-token labels, weighted-exact-1d-dp)",
                    "objective": "guidedquant-output-groups",
                    "groups": LNQ_GROUPS,
                    "labels": "next-token",
                    "sequences": n,
                    "rounds": lnq.rounds,
                    "sweeps": lnq.sweeps,
                    "plain_weight": lnq.plain_weight,
                    "damping": lnq.damping,
                    "levels": "int8-row-scale",
                }),
            );
        }
        Some(n) => {
            let seed = crate::yaqa::SketchOptions::default().seed;
            p.insert(
                "yaqa".into(),
                json!({ "sketch": "B", "sequences": n, "power_iterations": 0, "label_seed": seed }),
            );
        }
        None => {}
    }
    if o.quant.method == QuantMethod::Awq {
        p.insert(
            "awq".into(),
            json!({
                "alpha_steps": o.quant.awq_alpha_steps,
                "clip_steps": o.quant.awq_clip_steps,
            }),
        );
    }
    p.insert(
        "refine".into(),
        json!({
            "fit": o.fit,
            "lambda": o.fit_spec.lambda.describe(),
            "prior": o.fit_spec.prior.as_str(),
            "k": k,
            "mlp": o.mlp.as_str(),
            "bundle_k": if o.mlp.bundles() { json!(o.bundle_k()) } else { json!(null) },
            "tier": o.refine_tier.as_str(),
            "levels": "signed4-rowscale-grid32",
        }),
    );
    if !o.k_ladder.is_empty() {
        if let Some(r) = p.get_mut("refine").and_then(|v| v.as_object_mut()) {
            r.insert("ladder".into(), json!(o.k_ladder));
        }
    }
    // Only discrete choices go into the file (objective values are float sums that belong
    // in the report, not in bytes that must be reproducible).
    let alphas: Vec<BTreeMap<&str, f64>> = report
        .layers
        .iter()
        .map(|l| {
            l.quant_info
                .iter()
                .filter_map(|(set, info)| Some((set.as_str(), *info.get("alpha")?)))
                .collect()
        })
        .collect();
    if let Some(awq) = p.get_mut("awq").and_then(|v| v.as_object_mut()) {
        awq.insert("alpha".into(), json!(alphas));
    }
    p
}
