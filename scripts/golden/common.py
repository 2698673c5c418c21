"""Shared loading helpers for the independent PyTorch/transformers reference (scripts/golden)."""
import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.environ.get("SFX_ASSETS", os.path.join(REPO, "assets"))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = os.path.join(ASSETS, GGUF_NAME)
FIXTURES = os.path.join(REPO, "tests", "fixtures")

# Sanity string for the "smollm" pre-tokenizer. Every digit must be its own token, and a space or
# newline run in front of a digit must be a pre-token of its own ("\n\n2001" -> "ĊĊ", "2", ...).
DIGIT_CHECK = "In 2024 there were 12345 cats.\n\n2001"


def smollm_pre_tokenizer():
    """llama.cpp's "smollm" pre-tokenizer as a `tokenizers` pipeline: first isolate every \\p{N}
    character, then apply the GPT-2 byte-level regex to each piece (same as the Hugging Face
    SmolLM2 tokenizer.json: Digits(individual_digits=True) + ByteLevel(use_regex=True))."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def load_tokenizer(fix=True):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS, gguf_file=GGUF_NAME)
    if fix:
        tok.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
        ids = tok(DIGIT_CHECK, add_special_tokens=False).input_ids
        pieces = tok.convert_ids_to_tokens(ids)
        assert pieces == ["In", "Ġ", "2", "0", "2", "4", "Ġthere", "Ġwere", "Ġ", "1", "2", "3", "4",
                          "5", "Ġcats", ".", "ĊĊ", "2", "0", "0", "1"], pieces
    return tok


def load_model(dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    model = AutoModelForCausalLM.from_pretrained(ASSETS, gguf_file=GGUF_NAME, dtype=dtype)
    model.eval()
    return model


def f32(x):
    """Shortest decimal string that round-trips the float32 value, as a Python float for JSON."""
    return float(str(np.float32(x)))


def f64(x, digits=12):
    return float("%.*g" % (digits, float(x)))


def versions():
    import platform

    import gguf
    import tokenizers
    import torch
    import transformers

    try:
        from importlib.metadata import version
        gguf_v = version("gguf")
    except Exception:  # pragma: no cover
        gguf_v = getattr(gguf, "__version__", "?")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": gguf_v,
        "numpy": np.__version__,
    }
