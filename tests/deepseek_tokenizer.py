"""The real DeepSeek-LLM tokenizer (deepseek-ai/deepseek-llm-7b-base's tokenizer.json and tokenizer_config.json),
rebuilt from the vocabulary file llama.cpp keeps for its tokenizer tests, which the pinned llama-cpp-python source
archive carries (`vendor/llama.cpp/models/ggml-vocab-deepseek-llm.gguf`, with `.inp` / `.out`: strings and the ids
the Hugging Face tokenizer gave them). `make` downloads that archive into .venv/src for the export stage, so the tests
need no network and nothing outside the repository and its pinned packages.

The GGUF file holds the vocabulary (102,400 entries: the embedding's rows), the merges, bos / eos and the token types;
llama.cpp's converter wrote it from the hub repository. What it does not hold is the Hugging Face pre-tokenizer:
it names it (`tokenizer.ggml.pre = deepseek-llm`), and PRE_TOKENIZER below is that one, as the hub's tokenizer.json
writes it. llama.cpp's regexes for `deepseek-llm` (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM) are the
same but for digits, which it keeps together (`\\p{N}+`) and the hub's splits one by one (the `.out` ids of "3333"
are four tokens). The vocabulary is part of the DeepSeek LLM model (DeepSeek License Agreement); llama.cpp's test
files are MIT. The rebuilt files were checked once by hand against the hub's (equal encodings of the test strings
and of the oasst samples in tests/data/oasst)."""

from __future__ import annotations

import json
import struct
import sys
import tarfile
from pathlib import Path

from snaketune.export.llama_cpp import VERSION

VOCAB = "ggml-vocab-deepseek-llm.gguf"
MEMBER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/{VOCAB}"
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
CONTROL = 3  # gguf.TokenType.CONTROL: a special token (bos, eos); NORMAL (1) is the BPE vocabulary

# Written as escapes: several of these characters have canonical equivalents (U+1F7D and U+03CE, U+212A and K), and
# an editor or a copy that normalizes them changes the ranges.
LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        _split("[\r\n]"),
        _split(f"\\s?[{LETTERS}]+"),
        _split("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"),
        _split("\\s+$"),
        _split("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"),
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
"""deepseek-llm-7b-base's pre-tokenizer, as its tokenizer.json on the hub writes it."""

TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": None,
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
    "legacy": True,
    "model_max_length": 4096,
    "tokenizer_class": "LlamaTokenizerFast",
}
"""deepseek-llm-7b-base's tokenizer_config.json, less its chat template (the base model ships none)."""


def sdist() -> Path:
    """llama-cpp-python's source archive where `make` puts it (.venv/src); a clear failure where it is missing."""
    path = Path(sys.prefix) / "src" / f"llama_cpp_python-{VERSION}.tar.gz"
    assert path.is_file(), (
        f"{path} is missing: `make` downloads it (the export stage's llama.cpp; requirements-export.txt pins "
        f"llama-cpp-python=={VERSION}); the tests rebuild the real DeepSeek tokenizer from its {VOCAB}"
    )
    return path


def extract(dest: Path) -> Path:
    """The vocabulary file and its test strings out of the archive, into `dest`; returns the GGUF file."""
    names = {MEMBER, f"{MEMBER}.inp", f"{MEMBER}.out"}
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist()) as tar:
        for member in tar:  # streamed: the archive is 77 MB of gzip, and these lie in its middle
            if member.name in names:
                with tar.extractfile(member) as f:
                    (dest / Path(member.name).name).write_bytes(f.read())
                names.discard(member.name)
                if not names:
                    break
    assert not names, f"{sdist()} lacks {sorted(names)}"
    return dest / VOCAB


SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF's value types (ggml's docs/gguf.md, gguf_metadata_value_type) as struct formats; 8 is a string, 9 an array."""


def read_metadata(gguf_file: Path) -> dict:
    """A GGUF file's key-value metadata (version 2 or 3, little-endian: ggml's docs/gguf.md), read directly: the
    gguf package's GGUFReader maps every element of the 200,000-string arrays on its own (6 s here, against 0.3)."""
    data = Path(gguf_file).read_bytes()
    magic, version, _tensors, count = struct.unpack_from("<4sIQQ", data)
    assert magic == b"GGUF" and version in (2, 3), (gguf_file, magic, version)
    pos = 24

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n : pos].decode()

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            inner, n = take("I"), take("Q")
            return [value(inner) for _ in range(n)]
        return take(SCALARS[kind])

    out = {}
    for _ in range(count):
        key = string()
        out[key] = value(take("I"))
    return out


def rebuild(gguf_file: Path, out_dir: Path) -> Path:
    """tokenizer.json and tokenizer_config.json of deepseek-llm-7b-base from llama.cpp's vocabulary file."""
    meta = read_metadata(gguf_file)
    assert meta["tokenizer.ggml.model"] == "gpt2", "not a byte-level BPE vocabulary"
    assert meta["tokenizer.ggml.pre"] == "deepseek-llm", "not deepseek-llm's pre-tokenizer"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    assert (tokens[bos], tokens[eos]) == (BOS, EOS)
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    assert list(vocab.values()) == list(range(len(vocab))), "the BPE vocabulary is not ids 0..n-1"
    # Beyond the vocabulary: bos, eos and the characters of bytes UTF-8 never holds (added tokens), then the
    # embedding's padding rows, which llama.cpp's converter names [PAD<id>] (conversion/base.py): not tokens.
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
         "special": types[i] == CONTROL}
        for i, t in enumerate(tokens)
        if i >= len(vocab) and t != f"[PAD{i}]"
    ]  # fmt: skip
    bos_only = [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": PRE_TOKENIZER,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": bos_only,
            "pair": [*bos_only, {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
            "merges": meta["tokenizer.ggml.merges"],
        },
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, ensure_ascii=False, indent=2))
    return out_dir


def vocab_test_strings(gguf_file: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings for this vocabulary and the ids the Hugging Face tokenizer gave each (without bos),
    read as llama.cpp's tests/test-tokenizer-0.cpp reads them: the `.inp` file split at each
    "\n__ggml_vocab_test__\n" (nothing after the last), the `.out` file's lines of space-separated ids."""
    raw = Path(f"{gguf_file}.inp").read_text()
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in Path(f"{gguf_file}.out").read_text().split("\n")]
    if ids[-1] == [] and len(ids) == len(texts) + 1:
        ids.pop()  # the file's final newline
    assert len(texts) == len(ids), (len(texts), len(ids))
    return list(zip(texts, ids, strict=True))
