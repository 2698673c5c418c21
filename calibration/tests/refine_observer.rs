//! `Model::forward_observed` on the real SmolLM2: same logits as `forward`, and every
//! projection set's input observed once per layer and prefill chunk with the right shape.

use sfx_formats::checkpoint::Checkpoint;
use sfx_formats::corpus;
use sfx_runtime::{LogitsMode, Model, ModelOptions, ProjectionSet};

#[test]
fn observer_sees_every_projection_input() {
    let path = corpus::assets_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let ckpt = Checkpoint::open(path.to_str().unwrap()).unwrap();
    let options = ModelOptions {
        prefill_chunk: 5,
        ..ModelOptions::default()
    };
    let model = Model::load_cpu(&ckpt.config, ckpt.tensors.as_ref(), &options).unwrap();
    let c = &ckpt.config;
    let tokens: Vec<u32> = (0..12).map(|i| 100 + 37 * i).collect();

    let mut cache = model.new_cache(16).unwrap();
    let plain = model
        .forward(&tokens, &mut cache, LogitsMode::Last)
        .unwrap();

    let mut seen = Vec::new();
    let mut obs = |layer: usize, set: ProjectionSet, x: &[f32], rows: usize| {
        assert!(x.iter().all(|v| v.is_finite()));
        seen.push((layer, set, x.len() / rows, rows, x.len() % rows));
    };
    let mut cache = model.new_cache(16).unwrap();
    let observed = model
        .forward_observed(&tokens, &mut cache, LogitsMode::Last, &mut obs)
        .unwrap();
    assert_eq!(plain.as_slice(), observed.as_slice());

    // Chunks of 5, 5, 2 tokens; per chunk every layer in order, sets in graph order.
    let mut want = Vec::new();
    for rows in [5, 5, 2] {
        for layer in 0..c.num_hidden_layers {
            for (set, d) in [
                (ProjectionSet::Qkv, c.hidden_size),
                (ProjectionSet::O, c.q_dim()),
                (ProjectionSet::GateUp, c.hidden_size),
                (ProjectionSet::Down, c.intermediate_size),
            ] {
                want.push((layer, set, d, rows, 0));
            }
        }
    }
    assert_eq!(seen, want);
}
