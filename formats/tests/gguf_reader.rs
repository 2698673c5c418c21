//! The GGUF reader on well-formed synthetic files: every metadata value type, nested arrays,
//! the typed accessors and their errors, tensor infos and raw/dequantized data.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use gguf_writer::{s, GgufBuilder, V};
use sfx_formats::gguf::{GgmlType, GgufFile, MetaArray, MetaValue};

fn open(g: &GgufBuilder) -> (tempfile::TempDir, GgufFile) {
    let d = tempfile::tempdir().unwrap();
    let f = GgufFile::open(g.write(d.path(), "r.gguf")).unwrap();
    (d, f)
}

#[test]
fn every_value_type_and_accessor() {
    let g = GgufBuilder::new()
        .kv("u8", V::U8(200))
        .kv("i8", V::I8(-5))
        .kv("u16", V::U16(60000))
        .kv("i16", V::I16(-300))
        .kv("u32", V::U32(4_000_000_000))
        .kv("i32", V::I32(-7))
        .kv("f32", V::F32(1e-5))
        .kv("bool", V::Bool(true))
        .kv("str", s("héllo"))
        .kv("u64", V::U64(1 << 40))
        .kv("i64", V::I64(-(1 << 40)))
        .kv("f64", V::F64(0.1))
        .kv("strs", V::Arr(8, vec![s("a"), s(""), s("ç")]))
        .kv("ints", V::Arr(3, vec![V::I16(-1), V::I16(2)]))
        .kv("floats", V::Arr(6, vec![V::F32(0.5)]))
        .kv("empty", V::Arr(4, vec![]))
        .kv(
            "nested",
            V::Arr(
                9,
                vec![V::Arr(8, vec![s("x")]), V::Arr(8, vec![s("y"), s("z")])],
            ),
        );
    let (_d, f) = open(&g);
    assert_eq!(f.metadata().len(), 17);
    assert_eq!(f.metadata()[0].0, "u8", "file order is kept");
    assert_eq!(f.get_u32("u8").unwrap(), 200);
    assert_eq!(f.get_u32("u16").unwrap(), 60000);
    assert_eq!(f.get_u32("u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_u64("u64").unwrap(), 1 << 40);
    assert_eq!(f.get_i64("i64").unwrap(), -(1 << 40));
    assert_eq!(f.get_i64("i8").unwrap(), -5);
    assert_eq!(f.get_f32("f32").unwrap(), 1e-5);
    assert_eq!(f.get_f64("f64").unwrap(), 0.1);
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_str("str").unwrap(), "héllo");
    assert_eq!(f.get_str_array("strs").unwrap(), ["a", "", "ç"]);
    assert!(f.get_str_array("empty").unwrap().is_empty());
    assert_eq!(f.get_int_array("ints").unwrap(), [-1, 2]);
    assert_eq!(f.get_f32_array("floats").unwrap(), [0.5]);
    assert_eq!(f.get("i16"), Some(&MetaValue::I16(-300)));
    match f.get_array("nested").unwrap() {
        MetaArray::Array(inner) => {
            assert_eq!(inner.len(), 2);
            assert_eq!(inner[1], MetaArray::String(vec!["y".into(), "z".into()]));
        }
        other => panic!("nested array read as {other:?}"),
    }
    assert_eq!(f.opt_u32("absent").unwrap(), None);

    // Errors name the key and say what was expected and found.
    let e = f.get_u32("absent").unwrap_err().to_string();
    assert_eq!(e, "metadata key 'absent' is missing");
    let e = f.get_u32("str").unwrap_err().to_string();
    assert_eq!(e, "metadata key 'str' has type string, expected u32");
    let e = f.get_u32("i32").unwrap_err().to_string();
    assert!(
        e.contains("'i32'") && e.contains("-7 does not fit in u32"),
        "{e}"
    );
    let e = f.get_u32("u64").unwrap_err().to_string();
    assert!(e.contains("does not fit in u32"), "{e}");
    let e = f.get_str_array("ints").unwrap_err().to_string();
    assert_eq!(
        e,
        "metadata key 'ints' has type array of i16, expected array of string"
    );
    let e = f.get_f32("bool").unwrap_err().to_string();
    assert!(e.contains("'bool'") && e.contains("expected f32"), "{e}");
    let e = f.get_int_array("strs").unwrap_err().to_string();
    assert!(
        e.contains("'strs'") && e.contains("array of integers"),
        "{e}"
    );
}

#[test]
fn tensor_infos_and_data() {
    let f16: Vec<u8> = [1.5f32, -2.0, 0.25]
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    let bf16: Vec<u8> = [3.0f32, -0.5]
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    // Q8_0 block: d = 0.5, q = 0, 1, ..., 31 → x = q / 2.
    let mut q8 = half::f16::from_f32(0.5).to_le_bytes().to_vec();
    q8.extend(0..32u8);
    let g = GgufBuilder::new()
        .kv("general.alignment", V::U32(16))
        .f32_tensor("m", &[3, 2], &[1., 2., 3., 4., 5., 6.])
        .tensor("h", &[3], 1, f16)
        .tensor("b", &[2], 30, bf16)
        .tensor("q", &[32], 8, q8);
    let (_d, f) = open(&g);
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 16);
    let m = f.tensor_info("m").unwrap();
    assert_eq!(m.dims, [3, 2]);
    assert_eq!(m.shape(), [2, 3], "HF shape is the GGUF dims reversed");
    assert_eq!(m.ggml_type, GgmlType::F32);
    assert_eq!((m.n_elements, m.n_bytes), (6, 24));
    assert_eq!(f.tensor_bytes(m).unwrap().len(), 24);
    assert_eq!(f.dequantize("m").unwrap(), [1., 2., 3., 4., 5., 6.]);
    assert_eq!(f.dequantize("h").unwrap(), [1.5, -2.0, 0.25]);
    assert_eq!(f.dequantize("b").unwrap(), [3.0, -0.5]);
    let q = f.dequantize("q").unwrap();
    assert_eq!(q, (0..32).map(|i| i as f32 / 2.0).collect::<Vec<_>>());
    assert_eq!(f.tensor_info("q").unwrap().offset % 16, 0);
    assert_eq!(
        f.tensors()
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["m", "h", "b", "q"]
    );
    // A hand-made info pointing outside the file is an error, not a panic.
    let mut fake = m.clone();
    fake.offset = 1 << 40;
    assert!(f.tensor_bytes(&fake).is_err());
}
