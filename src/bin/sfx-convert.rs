//! `sfx-convert`: turn checkpoints into what the runtime runs.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use sfx_calibration::convert::{
    convert, ConvertError, ConvertOptions, ConvertReport, ConvertState, HeadFormat, Hooks,
    LayerReport, MlpScheme, QuantMethod, QuantSpec,
};
use sfx_calibration::quant::ggml_quant::Importance;
use sfx_calibration::refine::{FitPrior, FitSpec, Lambda};
use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::gguf::Imatrix;
use sfx_formats::package;
use sfx_formats::resident::{Rotation, TrellisCode};
use sfx_formats::sfx::{Provenance, SfxMetadata, SfxWriter, Tier};
use sfx_runtime::ProjectionSet;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;
use strataflux::bench::{parse_list, per_set};
use strataflux::device::DeviceChoice;
use strataflux::quality::{self, QualityText};
use strataflux::resume::{self, PartialDir};
use tokenizers::Tokenizer;

#[derive(Parser)]
#[command(
    name = "sfx-convert",
    version,
    about = "Convert a float checkpoint into a tiered .sfx container (low-bit resident codes + refinement)",
    long_about = "Convert a float checkpoint into a tiered .sfx container.\n\n\
        sfx-convert --quant awq3 --fit <hf-dir | hub-id | model.gguf> -o out/\n\n\
        The model is processed one decoder block at a time: calibration text (Brown by default) \
        runs through the float block, the projections are quantized to the resident base \
        (RTN or AWQ, group 128, AWQ scales folded into the preceding RMSNorm / linear; or QTIP / \
        YAQA trellis codes; or, with --base, the codes of an existing .sfx), the refinement \
        statistics M = E[zz^T], G = E[xz^T] (z = top-k-per-1024 masked input) are accumulated \
        without storing activations, and the refinement (plain residual R, or with --fit the \
        ridge solve C (M + lambda I) = R G + lambda P, P = R unless --fit-prior zero) is stored \
        as 4-bit columns in the ram/ssd tier. A held-out text (wiki by default) measures the \
        projection-output error of the base, plain and fitted refinement per layer. The output \
        is a folder (model.sfx, config.json, tokenizer files, a model card and manifest.json \
        with every file's SHA-256: `sfx verify out/` checks it) or, for a path ending in .sfx, \
        the container alone; either appears only when complete. The layouts are in \
        docs/format.md.\n\n\
        Every finished block is checkpointed beside the output (.NAME.resume/); an interrupted \
        conversion (killed, power lost) continues with --resume and ends byte-identical to an \
        uninterrupted one.\n\n\
        `sfx-convert import-gguf model.gguf -o dir/` imports a llama.cpp GGUF into a Hugging \
        Face folder instead.",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    convert: ConvertArgs,
}

#[derive(Args)]
struct ConvertArgs {
    /// Float model: a Hugging Face folder, a Hub repo id (org/name[@revision]) or a .gguf file.
    #[arg(required = true)]
    model: Option<String>,
    /// Output: a folder (any path not ending in .sfx: model.sfx beside config.json with a
    /// quantization_config block, the tokenizer files, generation_config.json, a README.md
    /// model card and manifest.json with every file's size and SHA-256, checked by `sfx verify
    /// DIR`), or a single .sfx file. Either is replaced whole only when complete; nothing
    /// appears there if conversion fails, and an existing path that is not an earlier output
    /// folder is refused.
    #[arg(short, long, required = true)]
    output: Option<PathBuf>,
    /// Output folder: the license identifier for the model card (Hugging Face vocabulary,
    /// e.g. apache-2.0). Default: the source's own (its README.md front matter, or a GGUF's
    /// general.license), else "other".
    #[arg(long)]
    license: Option<String>,
    /// Output folder: the Hub id of the float model for the card's base_model. Default: the
    /// model argument when it is a Hub id, or a GGUF's general.base_model.0.repo_url.
    #[arg(long, value_name = "ORG/NAME")]
    base_model: Option<String>,
    /// Resident base: rtn2, rtn3, rtn4 (round-to-nearest) or awq2, awq3, awq4 (activation-aware
    /// scale + clip search), both asymmetric with group 128; qtip2, qtip3, qtip4 (QTIP: random
    /// Hadamard rotation, LDLQ with the calibration Hessian E[xx^T], HYB bitshift trellis over
    /// 16×16 tiles); or yaqa2, yaqa3, yaqa4 (the same format rounded with YAQA's two-sided LDLQ
    /// on Kronecker factors of the full-model KL Hessian, see --yaqa-seqs). Trellis
    /// conversions run a Viterbi search per 256 weights: ~50 min on 2 cores for SmolLM2.
    /// Or sqllm2, sqllm3, sqllm4 (SqueezeLLM, dense part: per output row a table of 2^N
    /// levels from a k-means weighted by the Fisher diagonal, the squared gradients of the
    /// loss on the calibration text's own next tokens; see --yaqa-seqs).
    /// Or lnq2, lnq3, lnq4 (GuidedQuant's layer-wise non-uniform quantization: the same
    /// tables, started from sqllmN and refined by alternating code and table updates on each
    /// layer's output error, weighted per group of output channels by the loss gradients
    /// there, mixed with the unweighted output error; see --yaqa-seqs).
    /// Or a llama.cpp block type for every projection: q2_k, q3_k, q4_k, q5_k, q6_k (k-quants:
    /// 256-weight super-blocks; projections whose rows are not whole super-blocks take
    /// llama.cpp's fallback, q2_k/q3_k → Q4_0, q4_k → Q5_0, q5_k → Q5_1, q6_k → Q8_0), q4_0,
    /// q4_1, q5_0, q5_1, q8_0 — rounded as llama.cpp's `llama-quantize --pure` rounds them
    /// without an importance matrix (block for block the same bytes).
    /// Or gguf: keep the projections of a llama.cpp GGUF (Q2_K … Q6_K, Q4_0 … Q8_0, the
    /// i-quants; the model argument) bit for bit as the resident base and fit the refinement
    /// on W_float - dequant(W_gguf) against --float-source.
    /// Not needed with --base.
    #[arg(long, required_unless_present = "base")]
    quant: Option<String>,
    /// --quant gguf: the float model the GGUF was quantized from (a Hugging Face folder, a Hub
    /// repo id or a float .gguf), the weights the refinement is fitted against. Norms, the
    /// embedding and the head (at --head's format) come from it too; the two models must
    /// have the same shape.
    #[arg(long, value_name = "MODEL")]
    float_source: Option<String>,
    /// Keep the resident codes of this .sfx (converted from the same float model) bit for bit
    /// and fit new refinement against the float weights: another --k-ladder, --lambda,
    /// --fit-prior or calibration text in minutes instead of quantizing again (the trellis
    /// search is the slow part). The file's quantizer records are copied; its sections'
    /// checksums are verified first. AWQ files are refused: their codes act on inputs whose
    /// per-channel scales were folded into the norms. A llama.cpp .gguf here is --quant gguf
    /// with the model argument as the float source.
    #[arg(long, value_name = "FILE.sfx")]
    base: Option<PathBuf>,
    /// AWQ search grid "ALPHAS,CLIPS": number of α values (0, 1/n, …) and of clip ratios
    /// (1.0 down to 0.5; 0 or 1 disables clipping). Smaller grids convert faster.
    #[arg(long, default_value = "20,20")]
    awq_grid: String,
    /// qtipN / yaqaN only: the trellis code. hyb (QTIP's default: a 2^9-entry 2-D table, two
    /// weights per step), 1mad (one multiply-add per weight, no table: the fastest to decode on
    /// CPUs, docs/results.md), or 3inst.
    #[arg(long, default_value = "hyb")]
    trellis_code: String,
    /// qtipN / yaqaN only: the span of the random Hadamard rotation around each trellis
    /// weight. full (QTIP's: one transform over each whole dimension) or bN (N = 16 … 4096, a
    /// power of two): a transform of each block of N values, or of the largest power of two
    /// dividing the dimension if smaller (576 → 64). Blocks let the GPU transform inputs and
    /// outputs inside the matvec launches instead of in passes over whole vectors
    /// (docs/results.md has speed and quality of both).
    #[arg(long, default_value = "full")]
    rotation: String,
    /// With a llama.cpp type (--quant q2_k … q6_k, q4_0 … q5_1): round with llama.cpp's
    /// importance-matrix weighting, an input column's importance being its mean square E[x²]
    /// over the calibration text (--calib; what llama-imatrix accumulates). The same bytes
    /// llama-quantize --imatrix writes given those values. Q8_0 has no weighted rounding.
    #[arg(long)]
    imatrix: bool,
    /// With a llama.cpp type: round with the importance matrix in FILE instead, as
    /// llama-quantize --imatrix FILE does (llama-imatrix's output, GGUF or legacy .dat; every
    /// quantized weight needs an entry, its value per input column the mean of x^2).
    #[arg(long, value_name = "FILE", conflicts_with = "imatrix")]
    imatrix_file: Option<PathBuf>,
    /// Store the fitted refinement C instead of the plain residual R = W - Q(W).
    #[arg(long)]
    fit: bool,
    /// Refinement budgets k per 1024 input channels for the projection sets qkv,o,gu,d
    /// (one number applies to all four). The statistics and the fit depend on k.
    #[arg(long, default_value = "16")]
    k: String,
    /// Fit C at several budgets in one calibration pass, e.g. 4,8,16,32,64 (needs --fit):
    /// every set gets one C per rung, and a run at budget k reads the largest rung not above
    /// it. `sfx tune` searches the ladder; --k (which must be a rung) is the default run.
    /// Costs one set of statistics per rung while a block converts, and ladder-length times
    /// the refinement bytes on disk (a run maps only its rungs).
    #[arg(long)]
    k_ladder: Option<String>,
    /// Ridge lambda of the fit: a number (the same for every projection set) or a multiple of
    /// each set's mean diag(M), e.g. 0.1x. Default: 1x with the residual prior, 0.1x with
    /// the zero prior.
    #[arg(long)]
    lambda: Option<String>,
    /// What the ridge pulls C towards where the calibration statistics say little: residual
    /// (P = R, the plain correction) or zero. zero lowers the q/k/v projection error of
    /// QTIP/YAQA bases but raises down's, and ends with a higher KL than residual on
    /// SmolLM2 qtip2 (docs/method.md §2, docs/results.md).
    #[arg(long, default_value = "residual")]
    fit_prior: String,
    /// MLP refinement: channel-wise columns, neuron bundles, or both.
    #[arg(long, default_value = "channels")]
    mlp: String,
    /// Tier of the refinement sections: ram (mmapped) or ssd (read through a cache).
    #[arg(long, default_value = "ram")]
    refine_tier: String,
    /// Calibration text: brown, wiki, austen/<novel>, or a .txt / .jsonl file.
    #[arg(long, default_value = "brown")]
    calib: String,
    /// Calibration sequences (windows spread evenly over the text).
    #[arg(long, default_value_t = 32)]
    calib_seqs: usize,
    /// Tokens per calibration sequence.
    #[arg(long, default_value_t = 512)]
    calib_len: usize,
    /// Held-out text for the per-layer error report (must differ from --calib), or "none".
    #[arg(long, default_value = "wiki")]
    heldout: String,
    /// Held-out sequences (of --calib-len tokens).
    #[arg(long, default_value_t = 4)]
    heldout_seqs: usize,
    /// yaqaN, sqllmN and lnqN only: calibration sequences whose gradients build YAQA's
    /// Kronecker Hessian factors (sampled labels), SqueezeLLM's Fisher diagonal or LNQ's
    /// guided Hessians (the text's next tokens): the first N of --calib-seqs; 0 = all. Cost is linear in N (one forward and
    /// backward pass of the float model a sequence; docs/decisions.md, "YAQA Hessians").
    #[arg(long, default_value_t = 0)]
    yaqa_seqs: usize,
    /// Output head and token embedding: bf16 (the float tables as the source stores them),
    /// or group codes q4, q6, q8 (asymmetric, group 128; per group the clip ratio with the
    /// least head-output error, weighted by the calibration inputs' E[x^2]). A tied embedding
    /// is the head's table; an untied one is quantized at the same width. q8 (default) halves
    /// the head's bytes at no measurable KL cost; q4 saves more and costs KL. SmolLM2 KL vs
    /// bytes of each choice: docs/results.md, "Quantized head and embedding".
    #[arg(long, default_value = "q8")]
    head: String,
    /// Output folders: the quality receipt's held-out text, TEXT:N (N windows of
    /// --quality-ctx tokens of wiki, brown, austen/<novel> or a file), or "none". The resident
    /// base and the refined model (the file's own budgets) are scored against the float
    /// source: PPL and KL go to quality.json and the model card, with the sfx-run command
    /// that measures them again. On the GPU when there is one (--quality-device). Default
    /// wiki:2.
    #[arg(long, value_name = "TEXT:N")]
    quality: Option<String>,
    /// Tokens per window of the quality receipt.
    #[arg(long, default_value_t = 2048)]
    quality_ctx: usize,
    /// Where the quality receipt is measured: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    quality_device: DeviceChoice,
    /// Continue an interrupted conversion to the same -o from its last finished block.
    /// After every block the converter fsyncs the partial container and records a
    /// checkpoint in .NAME.resume/ beside the output; a resumed run must be given the same
    /// model, calibration text and options (it is refused, naming each difference, e.g.
    /// "--k: checkpoint 16,16,16,16, now 32,32,32,32"), runs the finished blocks again to
    /// rebuild the residual streams, and writes a file byte-identical to an uninterrupted
    /// run's. Without --resume, a conversion refuses to start over such a checkpoint: remove
    /// the .NAME.resume folder to discard it. Options used only after the container is
    /// written (--license, --base-model, --quality*) are this run's.
    #[arg(long)]
    resume: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Import a llama.cpp GGUF model into a Hugging Face folder.
    ///
    /// Writes config.json, model.safetensors (BF16, dequantized from any of F32, F16, BF16,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S,
    /// IQ3_XXS, IQ3_S; a file with any other type is refused, naming the tensor), tokenizer.json (rebuilt from the GGUF's
    /// embedded BPE vocabulary, merges and pre-tokenizer), tokenizer_config.json (with the chat
    /// template) and generation_config.json. llama.cpp's Q/K row permutation is undone, so the
    /// folder loads in transformers and in sfx-run alike. Architectures: llama, mistral, qwen2,
    /// qwen3. Every file is written atomically.
    ///
    /// Tensors are streamed a chunk of rows at a time (about 16 M values), so memory stays
    /// near 250 MB plus the vocabulary whatever the model's size; the file is hashed for
    /// provenance on a second thread meanwhile.
    ImportGguf {
        /// The .gguf file to import.
        gguf: PathBuf,
        /// Output folder (created if missing; existing files of the same names are replaced).
        #[arg(short, long)]
        output: PathBuf,
        /// Print a JSON summary instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Import a QTIP or YAQA prequantized Hugging Face checkpoint into a .sfx container.
    ///
    /// Reads config.json (with `quip_params`), the safetensors files and the tokenizer files of
    /// <HF_DIR> and writes the projections as trellis sections (packing trellis-v1: per
    /// projection the tile streams, SU and SV; the HYB table and the dense Hadamard factors once
    /// per model), the embedding, norms, biases and an untied head as dense sections, and the
    /// config, tokenizer and provenance as metadata. Only QTIP's kernel format is accepted:
    /// bitshift codebook, L = 16, 16x16 tiles, V = 2, decode_mode quantlut_sym (HYB),
    /// K = 2, 3 or 4; anything else is an error naming the quip_params field.
    ///
    /// QTIP checkpoints do not contain the small Hadamard matrices of non-power-of-two
    /// dimensions (e.g. K = 36 for SmolLM2's 576 = 36*16); pass them with --hadamard-tables.
    ///
    /// The container has no refinement sections: to add them, run
    /// `sfx-convert --fit` with the float source model separately.
    /// The output is written atomically (temp file, fsync, rename).
    ImportQtip(ImportQtipArgs),
}

#[derive(Args)]
struct ImportQtipArgs {
    /// The QTIP/YAQA Hugging Face model folder (config.json, model.safetensors or shards).
    hf_dir: PathBuf,
    /// Output .sfx file (replaced atomically; nothing appears there if the import fails).
    #[arg(short, long)]
    output: PathBuf,
    /// JSON file of the dense Hadamard matrices QTIP used for dimensions that are not powers
    /// of two: {"K": [K rows, each a list of K numbers +1/-1 or a string of K '+'/'-']}, one
    /// entry per order K (the matrix QTIP's forward transform left-multiplies by;
    /// docs/format.md, "QTIP/YAQA checkpoint import"). Not needed when every dimension is a
    /// power of two.
    #[arg(long)]
    hadamard_tables: Option<PathBuf>,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// Makes glibc serve every allocation of 4 MiB or more with its own mmap (returned to the
/// system on free) instead of letting its dynamic threshold climb to 32 MiB and carve those
/// buffers out of the heap. The converter allocates and frees tens of MB of statistics and
/// solver matrices per block; with the default, the heap fragments and peak RSS grows by
/// ~65 MB per block (SmolLM2 rtn3 --fit --mlp both: 2.0 GB peak; with this: 0.50 GB, 10 %
/// slower; docs/decisions.md).
fn bound_heap_growth() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_MMAP_THRESHOLD: std::os::raw::c_int = -3;
        extern "C" {
            fn mallopt(
                param: std::os::raw::c_int,
                value: std::os::raw::c_int,
            ) -> std::os::raw::c_int;
        }
        // SAFETY: mallopt only adjusts allocator tuning; called before any thread starts.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 4 << 20);
        }
    }
}

fn main() -> Result<()> {
    bound_heap_growth();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::ImportGguf { gguf, output, json }) => import_gguf(gguf, output, json),
        Some(Command::ImportQtip(a)) => import_qtip(a),
        None => run_convert(cli.convert),
    }
}

/// `count` windows of `len` tokens spread evenly over `text`: window i tokenizes the text
/// from character offset ≈ i·|text|/count (snapped forward to a line start) and keeps its
/// first `len` tokens. Deterministic, covers every part of the text (Brown is ordered by
/// genre), and never tokenizes the whole 6 MB text.
fn token_windows(tok: &Tokenizer, text: &str, count: usize, len: usize) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut start = (text.len() as u128 * i as u128 / count.max(1) as u128) as usize;
        if start > 0 {
            start = text[start.min(text.len())..]
                .find('\n')
                .map_or(text.len(), |p| start + p + 1);
        }
        let mut end = (start + len * 8).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        while !text.is_char_boundary(start) {
            start += 1;
        }
        let ids = tok
            .encode(&text[start..end], false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec();
        if ids.len() < len {
            bail!(
                "the text yields only {} tokens at window {i} (offset {start}); need {len}: \
                 use fewer or shorter sequences",
                ids.len()
            );
        }
        out.push(ids[..len].to_vec());
    }
    Ok(out)
}

fn sha256_file(path: &Path) -> Result<String> {
    Ok(package::sha256_file(path)?.sha256)
}

/// Hashes of the source's files: the .gguf itself, or every regular file of the folder.
fn source_hashes(spec: &str, origin_dir: Option<&Path>) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let path = Path::new(spec);
    if path.is_file() {
        let name = path
            .file_name()
            .map_or(spec.into(), |n| n.to_string_lossy().into_owned());
        out.insert(name, sha256_file(path)?);
        return Ok(out);
    }
    let dir = origin_dir.unwrap_or(path);
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    for p in entries {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.insert(name, sha256_file(&p)?);
    }
    Ok(out)
}

/// Peak resident set size of this process (Linux `VmHWM`), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn layer_line(r: &LayerReport, layers: usize) -> String {
    let mut s = format!("layer {:>3}/{layers}", r.layer + 1);
    for set in &r.sets {
        let base = set.base.max(f64::MIN_POSITIVE);
        s += &format!(
            "  {}: base {:.2e} plain {:.3} fit {:.3}",
            set.set,
            set.base / set.signal.max(f64::MIN_POSITIVE),
            set.plain / base,
            set.fitted / base
        );
    }
    s + &format!("  ({:.1} s)", r.seconds)
}

fn run_convert(a: ConvertArgs) -> Result<()> {
    let t0 = Instant::now();
    let (Some(model), Some(output)) = (a.model.clone(), a.output.clone()) else {
        bail!("usage: sfx-convert --quant <q> [--fit] <model> -o <out/ | model.sfx>");
    };
    // With --quant gguf the model argument is the base and --float-source the float model.
    let (spec, base) = match (a.quant.as_deref(), a.float_source.clone(), &a.base) {
        (Some("gguf"), Some(float), None) => {
            let gguf = PathBuf::from(&model);
            if !sfx_calibration::quant::kept_base::is_gguf(&gguf) {
                bail!("--quant gguf: {model} is not a GGUF file (no GGUF magic)");
            }
            (float, Some(gguf))
        }
        (Some("gguf"), None, None) => bail!(
            "--quant gguf keeps the blocks of the GGUF {model}: name the float model they were \
             quantized from with --float-source <hf-dir | hub-id | model.gguf> (the refinement \
             is fitted on W_float - dequant(W_gguf))"
        ),
        (Some("gguf"), _, Some(b)) => bail!(
            "--quant gguf takes the GGUF as the model argument, not --base {}",
            b.display()
        ),
        (_, Some(_), _) => bail!("--float-source goes with --quant gguf"),
        _ => (model, a.base.clone()),
    };
    let mut quant = match (&a.quant, &base) {
        (Some(q), None) => QuantSpec::parse(q)?,
        (q, Some(base)) => {
            let of_file = base_quant(base)?;
            if let Some(q) = q {
                let asked = QuantSpec::parse(q)?;
                if (asked.method, asked.bits) != (of_file.method, of_file.bits) {
                    bail!(
                        "--quant {q} but --base {} holds {} codes (leave --quant out with --base)",
                        base.display(),
                        of_file.label()
                    );
                }
            }
            of_file
        }
        (None, None) => bail!("--quant is required (or --base with an existing .sfx)"),
    };
    let grid: Vec<usize> = a
        .awq_grid
        .split(',')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| {
            anyhow!(
                "--awq-grid {:?}: expected ALPHAS,CLIPS (two integers)",
                a.awq_grid
            )
        })?;
    let [alphas, clips] = grid[..] else {
        bail!(
            "--awq-grid {:?}: expected ALPHAS,CLIPS (two integers)",
            a.awq_grid
        );
    };
    quant.awq_alpha_steps = alphas;
    quant.awq_clip_steps = clips;
    if a.imatrix || a.imatrix_file.is_some() {
        let flag = if a.imatrix {
            "--imatrix"
        } else {
            "--imatrix-file"
        };
        match &mut quant.method {
            QuantMethod::Ggml(q) if base.is_none() => {
                q.importance = if a.imatrix {
                    Importance::Calibration
                } else {
                    Importance::File
                }
            }
            _ => bail!(
                "{flag} goes with a llama.cpp type from a float model (--quant q2_k … q5_1), \
                 not --quant {}{}",
                quant.label(),
                if base.is_some() { " from --base" } else { "" }
            ),
        }
    }
    let imatrix = match &a.imatrix_file {
        Some(p) => Some(std::sync::Arc::new(
            Imatrix::read(p).with_context(|| format!("--imatrix-file {}", p.display()))?,
        )),
        None => None,
    };
    if base.is_none() {
        quant.trellis_code = TrellisCode::parse(&a.trellis_code).ok_or_else(|| {
            anyhow!(
                "--trellis-code {:?}: expected hyb, hyb-qN (N = 1..15), 1mad or 3inst",
                a.trellis_code
            )
        })?;
        quant.rotation = Rotation::parse(&a.rotation).ok_or_else(|| {
            anyhow!(
                "--rotation {:?}: expected full or bN with N a power of two from 16 to 4096 \
                 (b128)",
                a.rotation
            )
        })?;
    }
    let options = ConvertOptions {
        quant,
        fit: a.fit,
        k: per_set("k", &a.k)?,
        k_ladder: match &a.k_ladder {
            None => Vec::new(),
            Some(l) => parse_list("--k-ladder", l, true)?,
        },
        fit_spec: fit_spec(&a.fit_prior, a.lambda.as_deref())?,
        mlp: MlpScheme::parse(&a.mlp)?,
        refine_tier: match a.refine_tier.as_str() {
            "ram" => Tier::Ram,
            "ssd" => Tier::Ssd,
            other => bail!("--refine-tier {other:?}: expected ram or ssd"),
        },
        yaqa_sequences: a.yaqa_seqs,
        head: HeadFormat::parse(&a.head)?,
        base,
        imatrix,
    };
    options.validate()?;
    // Checked before the conversion's work: a bad --quality must not end an hour's run.
    let quality = match (a.quality.as_deref(), is_folder_output(&output)) {
        (Some("none"), _) => None,
        (q, true) => Some(QualityText::parse(q.unwrap_or("wiki:2"), a.quality_ctx)?),
        (Some(_), false) => bail!(
            "--quality: the receipt is written into an output folder (-o DIR), not beside a \
             single .sfx file; measure a file with sfx-run FILE --ppl wiki:2 --kl-ref SOURCE"
        ),
        (None, false) => None,
    };
    if let Some(q) = &quality {
        // The text is read again at the end; a missing one must not end an hour's run there.
        sfx_formats::corpus::load_named_text(&sfx_formats::corpus::assets_dir(), &q.text)
            .with_context(|| {
                format!(
                    "--quality {}: the receipt's held-out text (--quality none skips it)",
                    q.text
                )
            })?;
    }
    if a.calib_seqs == 0 || a.calib_len == 0 {
        bail!("--calib-seqs and --calib-len must be at least 1");
    }
    if a.heldout != "none" && a.heldout == a.calib {
        bail!(
            "--heldout {:?} is the calibration text; held-out errors need other text",
            a.heldout
        );
    }
    let abort_after = abort_after_block()?;
    let folder = is_folder_output(&output);
    if folder {
        if output.exists() && !output.is_dir() {
            bail!(
                "{}: exists and is not a folder (a single file needs a path ending in .sfx)",
                output.display()
            );
        }
        package::check_destination(&output)?;
    }
    // Before the slow part (hashing the model, tokenizing): whether there is something to
    // resume, or something a fresh start would clobber.
    let partial = PartialDir::open(&output)?;
    let recorded = partial.checkpoint()?;
    match (&recorded, a.resume) {
        (Some(cp), false) => bail!(
            "{}: an interrupted conversion to this output finished {} of {} blocks ({}); pass \
             --resume to continue it, or remove {} to start over",
            output.display(),
            cp.converter.blocks_done,
            cp.blocks,
            partial.checkpoint_path().display(),
            partial.dir.display()
        ),
        (None, true) => bail!(
            "--resume: there is no interrupted conversion to {} to continue (no {})",
            output.display(),
            partial.checkpoint_path().display()
        ),
        (None, false) => partial.clear()?,
        (Some(_), true) => {}
    }
    let ckpt = Checkpoint::open(&spec).with_context(|| format!("opening model {spec}"))?;
    let tok_json = ckpt.tokenizer_json.as_deref().ok_or_else(|| {
        anyhow!("{spec}: no tokenizer.json (needed to tokenize calibration text)")
    })?;
    let tokenizer = Tokenizer::from_bytes(tok_json.as_bytes())
        .map_err(|e| anyhow!("{spec}: tokenizer.json: {e}"))?;
    let assets = sfx_formats::corpus::assets_dir();
    let calib_text = sfx_formats::corpus::load_named_text(&assets, &a.calib)
        .with_context(|| format!("--calib {}", a.calib))?;
    let calib = token_windows(&tokenizer, &calib_text, a.calib_seqs, a.calib_len)
        .with_context(|| format!("--calib {}", a.calib))?;
    drop(calib_text);
    let heldout = if a.heldout == "none" || a.heldout_seqs == 0 {
        Vec::new()
    } else {
        let text = sfx_formats::corpus::load_named_text(&assets, &a.heldout)
            .with_context(|| format!("--heldout {}", a.heldout))?;
        token_windows(&tokenizer, &text, a.heldout_seqs, a.calib_len)
            .with_context(|| format!("--heldout {}", a.heldout))?
    };
    let tokens_sha256 = |windows: &[Vec<u32>]| {
        let mut h = Sha256::new();
        for w in windows {
            for t in w {
                h.update(t.to_le_bytes());
            }
        }
        format!("{:x}", h.finalize())
    };

    let origin_dir = if Path::new(&spec).exists() {
        None
    } else {
        sfx_formats::checkpoint::hub::resolve(&spec).ok()
    };
    let (source_id, source_revision) = match spec.split_once('@') {
        Some((id, rev)) if !Path::new(&spec).exists() => (id.to_string(), Some(rev.to_string())),
        _ => (spec.clone(), None),
    };
    let provenance = Provenance {
        tool: "sfx-convert".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        source_id,
        source_revision,
        source_files_sha256: source_hashes(&spec, origin_dir.as_deref())?,
        calibration_text_sha256: Some(tokens_sha256(&calib)),
        seed: None,
    };
    let fingerprint = fingerprint(&a, &spec, &options, &provenance, &tokens_sha256(&heldout))?;
    if let Some(cp) = &recorded {
        let diff = resume::differences(&cp.fingerprint, &fingerprint, FINGERPRINT_CATCH_ALL);
        if !diff.is_empty() {
            bail!(
                "--resume: the interrupted conversion in {} was made with other inputs or \
                 options:\n  {}\nrerun it with what it was made with, or remove {} to start \
                 over",
                partial.dir.display(),
                diff.join("\n  "),
                partial.dir.display()
            );
        }
    }

    let layers = ckpt.config.num_hidden_layers;
    let tty = std::io::stderr().is_terminal() && !a.json;
    let bar = tty.then(|| {
        let b = ProgressBar::new(layers as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} layers {elapsed_precise} ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(format!("{} {}", quant_name(&options), spec));
        b
    });
    // A folder is assembled in the partial-state folder and moved to its destination whole.
    let staging = partial.folder_path();
    let sfx_path = if folder {
        staging.join(package::MODEL_FILE)
    } else {
        output.clone()
    };
    let part = partial.part_path();
    let mut writer = match &recorded {
        None => {
            if folder {
                std::fs::create_dir_all(&staging)
                    .with_context(|| format!("creating {}", staging.display()))?;
            }
            SfxWriter::create_resumable(&sfx_path, &part)
                .with_context(|| format!("creating {}", part.display()))?
        }
        Some(cp) => {
            if folder && !part.exists() && sfx_path.exists() {
                // Killed after the container was finished but before the folder was: it
                // begins with the checkpoint's bytes, so it resumes like the partial file.
                std::fs::rename(&sfx_path, &part)
                    .with_context(|| format!("moving {} back", sfx_path.display()))?;
            }
            if folder {
                // Folder files of a run killed while writing them are written again.
                let _ = std::fs::remove_dir_all(&staging);
                std::fs::create_dir_all(&staging)
                    .with_context(|| format!("creating {}", staging.display()))?;
            }
            if !part.exists() {
                bail!(
                    "--resume: {} is missing: the interrupted conversion got as far as moving \
                     its container to {}; check that, and remove {} to start over",
                    part.display(),
                    output.display(),
                    partial.dir.display()
                );
            }
            let done = cp.converter.blocks_done;
            eprintln!(
                "resuming {} after block {done}/{} ({}); blocks 1-{done} run again to rebuild \
                 the residual streams",
                output.display(),
                cp.blocks,
                partial.checkpoint_path().display()
            );
            if let Some(b) = &bar {
                b.set_position(done as u64);
            }
            SfxWriter::resume(&sfx_path, &part, &cp.writer)
                .with_context(|| format!("--resume: {}", part.display()))?
        }
    };
    let mut on_layer = |r: &LayerReport, n: usize| {
        let line = layer_line(r, n);
        match &bar {
            Some(b) => {
                b.println(line);
                b.inc(1);
            }
            None => eprintln!("{line}"),
        }
    };
    let gradient_pass = match options.quant.method {
        QuantMethod::SqueezeLlm => "SqueezeLLM Fisher diagonal",
        QuantMethod::Lnq => "Fisher diagonal and GuidedQuant saliencies",
        _ => "YAQA Hessian sketch",
    };
    let mut on_sketch = |done: usize, total: usize| {
        let line = format!("{gradient_pass}: {done}/{total} sequences");
        match &bar {
            Some(b) => b.set_message(line),
            None => eprintln!("{line}"),
        }
    };
    let mut on_checkpoint = |w: &mut SfxWriter, state: &ConvertState| {
        let cp =
            resume::Checkpoint::new(fingerprint.clone(), layers, w.checkpoint()?, state.clone());
        partial
            .record(&cp)
            .map_err(|e| ConvertError::Checkpoint(format!("{e:#}")))?;
        if abort_after == Some(state.blocks_done) {
            // Test hook: dies like a kill -9 would, right after a durable checkpoint.
            std::process::abort();
        }
        Ok(())
    };
    let resumed = recorded.as_ref().map(|cp| cp.converter.blocks_done);
    let report = convert(
        &ckpt.config,
        &*ckpt.tensors,
        &calib,
        &heldout,
        &options,
        &mut writer,
        recorded.as_ref().map(|cp| &cp.converter),
        Hooks {
            on_layer: &mut on_layer,
            on_sketch: &mut on_sketch,
            on_checkpoint: &mut on_checkpoint,
        },
    )
    .with_context(|| format!("converting {spec}"))
    .map_err(|e| match partial.checkpoint_path().exists() {
        true => e.context(format!(
            "the finished blocks are kept in {}: fix the cause and rerun with --resume",
            partial.dir.display()
        )),
        false => e,
    })?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let mut params = report.params.clone();
    params.insert(
        "calibration".into(),
        serde_json::json!({
            "source": a.calib,
            "sequences": a.calib_seqs,
            "length": a.calib_len,
            "tokens": report.calib_tokens,
            "windows": "evenly spaced line starts",
        }),
    );
    let metadata = SfxMetadata {
        config: Some(ckpt.config.clone()),
        tokenizer_json: ckpt.tokenizer_json.clone(),
        tokenizer_config: ckpt.tokenizer_config.clone(),
        provenance,
        params,
    };
    writer
        .finish(&metadata)
        .with_context(|| format!("writing {}", output.display()))?;
    let file_bytes = std::fs::metadata(&sfx_path).map(|m| m.len()).unwrap_or(0);
    if folder {
        let (license, base_model) = source_card_fields(&spec, origin_dir.as_deref());
        let quality = match &quality {
            Some(text) => {
                let say = |m: &str| {
                    if !a.json {
                        eprintln!("{m}");
                    }
                };
                // Run from inside the published folder.
                Some(
                    quality::measure(&sfx_path, ".", &spec, text, a.quality_device, &say)
                        .context("measuring the quality receipt (--quality none skips it)")?,
                )
            }
            None => None,
        };
        let inputs = package::FolderInputs {
            // --resume changes how the output was reached, not what it is.
            command_line: std::env::args().filter(|a| a != "--resume").collect(),
            git_revision: option_env!("SFX_GIT_REVISION").map(str::to_string),
            generation_config: ckpt.generation_config.clone(),
            license: a.license.clone().or(license),
            base_model: a.base_model.clone().or(base_model),
            quality,
        };
        package::write_folder_files(&staging, &inputs)
            .with_context(|| format!("writing the folder files of {}", output.display()))?;
        package::publish_staged(&staging, &output)
            .with_context(|| format!("moving the finished folder to {}", output.display()))?;
    }
    partial.finish()?;
    let seconds = t0.elapsed().as_secs_f64();
    print_report(
        &a.heldout, &options, &report, &output, seconds, file_bytes, resumed, a.json,
    )
}

/// `SFX_CONVERT_ABORT_AFTER_BLOCK=N`, a test hook: abort (as a kill -9 would end the process)
/// right after the checkpoint of the N-th block is recorded.
fn abort_after_block() -> Result<Option<usize>> {
    match std::env::var("SFX_CONVERT_ABORT_AFTER_BLOCK") {
        Err(_) => Ok(None),
        Ok(v) => v
            .parse()
            .map(Some)
            .map_err(|_| anyhow!("SFX_CONVERT_ABORT_AFTER_BLOCK={v:?}: expected a block count")),
    }
}

/// The fingerprint field holding every conversion option at once: it catches an option no
/// named field covers.
const FINGERPRINT_CATCH_ALL: &str = "conversion options";

/// What decides the container's bytes, keyed by what a user changes: the tool build, the
/// model (as named: the name is in the file's provenance) and its files' hashes, each
/// option that reaches the file, and the calibration and held-out tokens.
fn fingerprint(
    a: &ConvertArgs,
    spec: &str,
    o: &ConvertOptions,
    provenance: &Provenance,
    heldout_sha256: &str,
) -> Result<BTreeMap<String, String>> {
    let join = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut f = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        f.insert(k.to_string(), v);
    };
    put(
        "sfx-convert",
        format!(
            "{} ({})",
            env!("CARGO_PKG_VERSION"),
            option_env!("SFX_GIT_REVISION").unwrap_or("no revision")
        ),
    );
    put("model", spec.to_string());
    put(
        "model files",
        provenance
            .source_files_sha256
            .iter()
            .map(|(n, h)| format!("{n} {h}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    put("--quant", o.quant.label());
    if let QuantMethod::Ggml(q) = o.quant.method {
        put("--imatrix", format!("{:?}", q.importance));
        if let Some(m) = &o.imatrix {
            put("--imatrix-file", m.sha256.clone());
        }
    }
    put(
        "--awq-grid",
        format!("{},{}", o.quant.awq_alpha_steps, o.quant.awq_clip_steps),
    );
    put("--trellis-code", format!("{:?}", o.quant.trellis_code));
    put("--rotation", o.quant.rotation.name());
    put(
        "--base",
        match &o.base {
            None => "none".into(),
            Some(p) => format!("{} {}", p.display(), sha256_file(p)?),
        },
    );
    put("--fit", o.fit.to_string());
    put("--k", join(&o.k));
    put("--k-ladder", join(&o.k_ladder));
    put("--lambda", o.fit_spec.lambda.describe().to_string());
    put("--fit-prior", o.fit_spec.prior.as_str().into());
    put("--mlp", o.mlp.as_str().into());
    put("--refine-tier", o.refine_tier.as_str().into());
    put("--yaqa-seqs", o.yaqa_sequences.to_string());
    put("--head", o.head.name());
    put("--calib", a.calib.clone());
    put("--calib-seqs", a.calib_seqs.to_string());
    put("--calib-len", a.calib_len.to_string());
    put(
        "calibration tokens",
        provenance
            .calibration_text_sha256
            .clone()
            .unwrap_or_default(),
    );
    put("--heldout", a.heldout.clone());
    put("--heldout-seqs", a.heldout_seqs.to_string());
    put("held-out tokens", heldout_sha256.to_string());
    put(FINGERPRINT_CATCH_ALL, format!("{o:?}"));
    Ok(f)
}

/// `-o` names a folder unless it ends in `.sfx`.
fn is_folder_output(output: &Path) -> bool {
    output.extension().is_none_or(|e| e != "sfx")
}

/// The card's license and base model as the source states them: a Hugging Face folder's
/// README.md front matter (`license:`, `base_model:`; a Hub id is its own base model), or a
/// GGUF's `general.license` and `general.base_model.0.repo_url`.
fn source_card_fields(spec: &str, origin_dir: Option<&Path>) -> (Option<String>, Option<String>) {
    let path = Path::new(spec);
    if path.is_file() {
        let Ok(gguf) = sfx_formats::gguf::GgufFile::open(path) else {
            return (None, None);
        };
        let get = |k: &str| gguf.opt_str(k).ok().flatten().map(str::to_string);
        let base = get("general.base_model.0.repo_url").map(|u| {
            u.trim_start_matches("https://huggingface.co/")
                .trim_end_matches('/')
                .to_string()
        });
        return (get("general.license"), base);
    }
    let hub_id = (!path.exists()).then(|| spec.split('@').next().unwrap_or(spec).to_string());
    let dir = origin_dir.unwrap_or(path);
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap_or_default();
    let front = readme
        .strip_prefix("---\n")
        .and_then(|r| r.split_once("\n---"))
        .map_or("", |(f, _)| f);
    let value = |key: &str| {
        front.lines().find_map(|l| {
            l.strip_prefix(key)
                .map(|v| v.trim().trim_matches('"').to_string())
                .filter(|v| !v.is_empty())
        })
    };
    (value("license:"), hub_id.or_else(|| value("base_model:")))
}

/// `--fit-prior` and `--lambda` (λ's default follows the prior).
fn fit_spec(prior: &str, lambda: Option<&str>) -> Result<FitSpec> {
    let prior = FitPrior::parse(prior)
        .ok_or_else(|| anyhow!("--fit-prior {prior:?}: expected residual or zero"))?;
    let lambda = match lambda {
        None => prior.default_lambda(),
        Some(l) => Lambda::parse(l).ok_or_else(|| {
            anyhow!(
                "--lambda {l:?}: expected a positive number or a positive multiple of mean \
                 diag(M) such as 0.1x"
            )
        })?,
    };
    Ok(FitSpec { lambda, prior })
}

/// The base a container holds, from its `params.quant` (method and bits); a GGUF's blocks.
fn base_quant(path: &Path) -> Result<QuantSpec> {
    if sfx_calibration::quant::kept_base::is_gguf(path) {
        return Ok(QuantSpec::parse("gguf")?);
    }
    let file = sfx_formats::sfx::SfxFile::open(path)
        .with_context(|| format!("--base {}", path.display()))?;
    let q = file.metadata().params.get("quant");
    let field = |f: &str| q.and_then(|q| q.get(f));
    let method = field("method").and_then(|m| m.as_str());
    // A method that names its base alone (gguf, a llama.cpp type); rtn, awq … need their bits.
    if let Some(spec) = method.and_then(|m| QuantSpec::parse(m).ok()) {
        return Ok(spec);
    }
    let bits = field("bits").and_then(|b| b.as_u64());
    let (Some(method), Some(bits)) = (method, bits) else {
        bail!(
            "--base {}: params.quant has no method and bits (not written by sfx-convert)",
            path.display()
        );
    };
    QuantSpec::parse(&format!("{method}{bits}"))
        .with_context(|| format!("--base {}: params.quant", path.display()))
}

fn quant_name(o: &ConvertOptions) -> String {
    format!(
        "{}{}{}",
        o.quant.label(),
        if o.fit { " --fit" } else { "" },
        match o.head {
            HeadFormat::Float => String::new(),
            h => format!(" --head {}", h.name()),
        }
    )
}

/// Held-out error totals per set over all layers: (set, k, base/signal, plain/base, fit/base).
fn totals(report: &ConvertReport) -> Vec<(String, usize, f64, f64, f64)> {
    ProjectionSet::ALL
        .iter()
        .filter_map(|s| {
            let rows: Vec<_> = report
                .layers
                .iter()
                .flat_map(|l| l.sets.iter().filter(|r| r.set == s.name()))
                .collect();
            let k = rows.first()?.k;
            let sum = |f: fn(&sfx_calibration::convert::SetReport) -> f64| -> f64 {
                rows.iter().map(|r| f(r)).sum()
            };
            let (sig, base) = (sum(|r| r.signal), sum(|r| r.base));
            Some((
                s.name().to_string(),
                k,
                base / sig,
                sum(|r| r.plain) / base,
                sum(|r| r.fitted) / base,
            ))
        })
        .collect()
}

#[allow(clippy::too_many_arguments)] // the report's parts, as run_convert holds them
fn print_report(
    heldout: &str,
    o: &ConvertOptions,
    r: &ConvertReport,
    output: &Path,
    seconds: f64,
    file_bytes: u64,
    resumed: Option<usize>,
    json: bool,
) -> Result<()> {
    let rss = peak_rss_bytes();
    let totals = totals(r);
    if json {
        let v = serde_json::json!({
            "output": output.display().to_string(),
            "quant": quant_name(o),
            "seconds": seconds,
            "resumed_after_blocks": resumed,
            "checkpoint_seconds": r.checkpoint_seconds,
            "replay_seconds": r.replay_seconds,
            "peak_rss_bytes": rss,
            "file_bytes": file_bytes,
            "bytes_by_tier": r.bytes_by_tier,
            "linear_bits_per_weight": r.linear_bits_per_weight,
            "head": o.head.name(),
            "head_bytes": r.head_bytes,
            "refine_bytes": r.refine_bytes,
            "refine_zstd3_bytes": r.refine_zstd_bytes,
            "calib_tokens": r.calib_tokens,
            "heldout": heldout,
            "heldout_tokens": r.heldout_tokens,
            "heldout_error": totals.iter().map(|(s, k, b, p, f)| serde_json::json!({
                "set": s, "k": k, "base_rel": b, "plain_over_base": p, "fitted_over_base": f,
            })).collect::<Vec<_>>(),
            "layers": r.layers,
            "params": r.params,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if let Some(done) = resumed {
        println!(
            "resumed after block {done} (running blocks 1-{done} again took {:.1} s); the time \
             below is this run's",
            r.replay_seconds
        );
    }
    println!(
        "wrote {} ({:.1} MiB) in {:.1} s, peak RSS {}",
        output.display(),
        file_bytes as f64 / (1 << 20) as f64,
        seconds,
        rss.map_or("?".into(), |b| format!(
            "{:.0} MiB",
            b as f64 / (1 << 20) as f64
        ))
    );
    println!(
        "  checkpoints after each block: {:.2} s in all",
        r.checkpoint_seconds
    );
    for (tier, bytes) in &r.bytes_by_tier {
        println!("  {tier:<8} {:>10.2} MiB", *bytes as f64 / (1 << 20) as f64);
    }
    println!(
        "  resident linears: {:.3} bits/weight; head/embedding ({}): {:.2} MiB; refinement \
         zstd-3 ratio {:.3}",
        r.linear_bits_per_weight,
        o.head.name(),
        r.head_bytes as f64 / (1 << 20) as f64,
        r.refine_bytes as f64 / r.refine_zstd_bytes.max(1) as f64
    );
    if !totals.is_empty() {
        println!(
            "  held-out ({heldout}, {} tokens) projection error, all layers:",
            r.heldout_tokens
        );
        for (s, k, b, p, f) in totals {
            println!(
                "    {s:<3} k={k:<4} base/signal {b:.3e}  plain/base {p:.3}  fitted/base {f:.3}"
            );
        }
    }
    Ok(())
}

fn import_gguf(gguf: PathBuf, output: PathBuf, json: bool) -> Result<()> {
    let t0 = std::time::Instant::now();
    let bar = if std::io::stderr().is_terminal() && !json {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors ({eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message("writing model.safetensors");
        Some(b)
    } else {
        None
    };
    let written = sfx_formats::gguf::import_gguf_to_folder(&gguf, &output, |done, total| {
        if let Some(b) = &bar {
            b.set_length(total as u64);
            b.set_position(done as u64);
        }
    })
    .with_context(|| format!("importing {} into {}", gguf.display(), output.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let peak_rss = peak_rss_bytes();
    if json {
        let v = serde_json::json!({
            "input": gguf.display().to_string(),
            "output": output.display().to_string(),
            "tensors": written.tensors,
            "safetensors_bytes": written.safetensors_bytes,
            "source_sha256": written.source_sha256,
            "total_seconds": elapsed,
            "peak_rss_bytes": peak_rss,
            "config": written.hf_config,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "imported {} → {} ({} tensors, {:.2} GB of BF16, {:.1} s{})",
            gguf.display(),
            output.display(),
            written.tensors,
            written.safetensors_bytes as f64 / 1e9,
            elapsed,
            peak_rss.map_or(String::new(), |b| format!(
                ", peak RSS {:.0} MB",
                b as f64 / 1e6
            )),
        );
    }
    Ok(())
}

fn import_qtip(a: ImportQtipArgs) -> Result<()> {
    use sfx_formats::qtip::{HadamardTables, QtipCheckpoint};
    let t0 = Instant::now();
    let dir = &a.hf_dir;
    if !dir.is_dir() {
        bail!(
            "{}: not a folder (expected a QTIP/YAQA Hugging Face model folder)",
            dir.display()
        );
    }
    let tables = match &a.hadamard_tables {
        Some(p) => HadamardTables::from_file(p)
            .with_context(|| format!("--hadamard-tables {}", p.display()))?,
        None => HadamardTables::new(),
    };
    let ckpt = QtipCheckpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let mut hashes = source_hashes(&dir.display().to_string(), Some(dir))?;
    if let Some(p) = &a.hadamard_tables {
        // The tables decide the decoded weights as much as the checkpoint does.
        let name = p
            .file_name()
            .map_or("tables".into(), |n| n.to_string_lossy().into_owned());
        hashes.insert(format!("hadamard-tables/{name}"), sha256_file(p)?);
    }
    let provenance = Provenance {
        tool: "sfx-convert import-qtip".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        source_id: dir.display().to_string(),
        source_revision: None,
        source_files_sha256: hashes,
        calibration_text_sha256: None,
        seed: None,
    };
    let layers = ckpt.config.num_hidden_layers;
    let bar = (std::io::stderr().is_terminal() && !a.json).then(|| {
        let b = ProgressBar::new(layers as u64);
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers {elapsed_precise}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(format!("import-qtip {}", dir.display()));
        b
    });
    let mut writer =
        SfxWriter::create(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    let report = ckpt
        .write_sfx(&tables, &mut writer, &mut |done, _| {
            if let Some(b) = &bar {
                b.set_position(done as u64);
            }
        })
        .with_context(|| format!("importing {}", dir.display()))?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let metadata = SfxMetadata {
        config: Some(ckpt.config.clone()),
        tokenizer_json: ckpt.tokenizer_json.clone(),
        tokenizer_config: ckpt.tokenizer_config.clone(),
        provenance,
        params: report.params.clone(),
    };
    writer
        .finish(&metadata)
        .with_context(|| format!("writing {}", a.output.display()))?;
    let seconds = t0.elapsed().as_secs_f64();
    let file_bytes = std::fs::metadata(&a.output).map(|m| m.len()).unwrap_or(0);
    if a.json {
        let v = serde_json::json!({
            "input": dir.display().to_string(),
            "output": a.output.display().to_string(),
            "seconds": seconds,
            "file_bytes": file_bytes,
            "section_bytes": report.bytes,
            "trellis_projections": report.linears,
            "dense_tensors": report.dense_tensors,
            "per_projection_tables": report.own_tables,
            "hadamard_orders": report.hadamard_orders,
            "linear_bits_per_weight": report.linear_bits_per_weight,
            "tokenizer": ckpt.tokenizer_json.is_some(),
            "ignored_tensors": report.ignored_tensors,
            "params": report.params,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let s = ckpt.params.scheme();
        println!(
            "imported {} → {} ({:.1} MiB, {:.1} s): {} trellis projections ({}, {:.3} bits/weight), \
             {} dense tensors{}",
            dir.display(),
            a.output.display(),
            file_bytes as f64 / (1 << 20) as f64,
            seconds,
            report.linears,
            s.name(),
            report.linear_bits_per_weight,
            report.dense_tensors,
            if ckpt.tokenizer_json.is_some() { ", tokenizer" } else { ", no tokenizer.json" }
        );
        if !report.ignored_tensors.is_empty() {
            println!(
                "  ignored {} tensors (e.g. {})",
                report.ignored_tensors.len(),
                report.ignored_tensors[0]
            );
        }
    }
    Ok(())
}
