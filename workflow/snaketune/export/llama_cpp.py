"""llama.cpp's own tools for the export stage: its converter (convert_hf_to_gguf.py) and quantizer, pinned.

Both come from one package registry release, `llama-cpp-python` (requirements-export.txt): PyPI has it only as a
source distribution, which vendors llama.cpp. Installing it builds libllama (the quantizer is its C API,
`llama_model_quantize`, and the runtime that measures the files); its wheel does not ship the converter, so
`install_converter` copies `convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/` packages out of the same
source archive into the environment (`python -m snaketune.export.llama_cpp install <sdist>`; the Makefile does it).
Nothing is downloaded when the stage runs.

The converter runs in the export's process with its own vendored gguf-py first on the path (PyPI's gguf 0.19.0,
which transformers reads GGUF files with, is older than the converter needs), dropped again once it has run. It
names the tokenizer's pre-tokenizer (the regex that splits text before BPE) by hashing what the tokenizer makes of
a test text, and refuses one it does not know. A tokenizer trained here (the builtin one) splits exactly as GPT-2
does (a byte-level pre-tokenizer with GPT-2's regex): for that one, and only that one, the name llama.cpp gives
GPT-2's split ("gpt-2") is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import runpy
import sys
import tarfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from snaketune.config.choices import EXPORT_QUANTS, EXPORT_TYPES

VERSION = "0.3.36"
"""llama-cpp-python, the release whose vendored llama.cpp converts and quantizes (requirements-export.txt)."""

OUTTYPES = EXPORT_TYPES
"""The unquantized file's types (`auto` in the config: the type the weights were saved in, `saved_type`)."""

QUANTS = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}
"""Quant types this stage makes (llama.cpp's names, lower case) and the ftype each is in llama.cpp's C API."""
assert set(QUANTS) == set(EXPORT_QUANTS)

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")

GPT2_SPLIT = "gpt-2"


class ToolchainError(RuntimeError):
    """llama.cpp's tools are missing or failed; the message says how to install or what went wrong."""


def converter_dir() -> Path:
    """Where `install_converter` put the converter: $SNAKETUNE_LLAMA_CPP_CONVERTER, else in this environment."""
    given = os.environ.get("SNAKETUNE_LLAMA_CPP_CONVERTER")
    return Path(given) if given else Path(sys.prefix) / "share" / f"llama.cpp-{VERSION}"


def check_toolchain() -> dict:
    """The installed versions, or a ToolchainError that says what to install."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ToolchainError(
            f"the export stage needs llama-cpp-python=={VERSION} (requirements-export.txt; `make` installs it): {e}"
        ) from None
    if llama_cpp.__version__ != VERSION:
        raise ToolchainError(
            f"llama-cpp-python {llama_cpp.__version__} is installed; the export stage is pinned to "
            f"{VERSION} (requirements-export.txt)"
        )
    conv = converter_dir()
    if not (conv / "convert_hf_to_gguf.py").is_file():
        raise ToolchainError(
            f"llama.cpp's converter is not in {conv}: run `python -m snaketune.export.llama_cpp install "
            f"llama_cpp_python-{VERSION}.tar.gz` (the source archive `pip download --no-deps --no-binary :all: "
            f"llama-cpp-python=={VERSION}` fetches), or set SNAKETUNE_LLAMA_CPP_CONVERTER to a llama.cpp checkout "
            "of the same release"
        )
    return {"llama_cpp_python": llama_cpp.__version__, "converter": str(conv)}


def install_converter(sdist: str | Path, dest: str | Path | None = None) -> Path:
    """Copy the converter, its packages and the licence out of llama-cpp-python's source archive."""
    dest = Path(dest) if dest else converter_dir()
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix)
            and m.name[len(prefix) :].split("/")[0] in CONVERTER_PARTS
            and (m.isfile() or m.isdir())
        ]
        if not any(m.name == prefix + "convert_hf_to_gguf.py" for m in members):
            raise ToolchainError(
                f"{sdist}: no {prefix}convert_hf_to_gguf.py (not llama-cpp-python {VERSION}?)"
            )
        for m in members:
            m.name = m.name[len(prefix) :]
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    return dest


SAFETENSORS_TYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}


def saved_type(model_dir: str | Path) -> str:
    """The type the model's safetensors hold its floating-point weights in (f32, bf16 or f16): what `outtype:
    auto` writes, so that the unquantized file is the model exactly."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ToolchainError(
            f"{model_dir}: no *.safetensors (export reads the train or dpo stage's model directory)"
        )
    with open(files[0], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    found = {v["dtype"] for k, v in header.items() if k != "__metadata__"} & set(SAFETENSORS_TYPES)
    if len(found) != 1:
        raise ToolchainError(
            f"{files[0]}: weights in {sorted(found) or 'no float type'}; set export.outtype to "
            f"one of {', '.join(OUTTYPES)}"
        )
    return SAFETENSORS_TYPES[found.pop()]


def pre_tokenizer_fallback(tokenizer_json: str | Path) -> str:
    """`gpt-2` when the tokenizer splits text exactly as GPT-2 (byte-level with GPT-2's regex), else ''."""
    path = Path(tokenizer_json)
    if not path.is_file():
        return ""
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    ok = (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )
    return GPT2_SPLIT if ok else ""


def convert(model_dir: str | Path, out_file: str | Path, outtype: str, log_file: str | Path) -> None:
    """llama.cpp's converter: the hub-format model directory as one GGUF file of `outtype` (f32, bf16 or f16).

    It runs in this process (`_converter`), which has torch imported already: a process of its own spent about 4 s
    of a tiny model's 10 s export importing torch again. Its output goes to `log_file`."""
    conv = converter_dir()
    args = [str(model_dir), "--outtype", outtype, "--outfile", str(out_file)]
    fallback = pre_tokenizer_fallback(Path(model_dir) / "tokenizer.json")
    with open(log_file, "a") as log:
        log.write(f"$ {conv / 'convert_hf_to_gguf.py'} {' '.join(args)} (in process)\n")
        log.flush()
        try:
            with _converter(conv, log):
                _run_converter(conv, fallback, args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - any failure of the converter is the export's ToolchainError
            log.write(traceback.format_exc())
            code = 1
    if code != 0:
        tail = Path(log_file).read_text().splitlines()[-5:]
        raise ToolchainError(
            f"llama.cpp's converter failed on {model_dir} (exit {code}); see {log_file}:\n" + "\n".join(tail)
        )


CONVERTER_MODULES = ("gguf", "conversion")
"""The converter's own packages (from its directory): imported for a conversion and dropped after it, so that
`import gguf` elsewhere in the process still finds PyPI's gguf (requirements.txt), which is older."""


@contextlib.contextmanager
def _converter(conv: Path, log) -> Iterator[None]:
    """The converter's packages first on the path, its logging and printing into `log`, and the process as it was
    afterwards: sys.path, sys.argv, the modules it imported, the root logger's handlers and level."""
    ours = lambda name: name.split(".")[0] in CONVERTER_MODULES  # noqa: E731
    before = {name: m for name, m in sys.modules.items() if ours(name)}
    for name in before:
        del sys.modules[name]
    path, argv = list(sys.path), list(sys.argv)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))  # what its own logging.basicConfig writes
    root.handlers, root.level = [handler], logging.INFO
    sys.path[:0] = [str(conv), str(conv / "gguf-py")]
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        handler.flush()
        root.handlers, root.level = handlers, level
        sys.path[:], sys.argv[:] = path, argv
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(before)


@contextlib.contextmanager
def native_output_to(log_file: str | Path | None) -> Iterator[None]:
    """What C code writes to stdout and stderr (llama.cpp prints a line per tensor) into the log file."""
    if log_file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_file, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def quantize(
    src: str | Path, dst: str | Path, quant: str, threads: int, log_file: str | Path | None = None
) -> None:
    """llama.cpp's quantizer (its C API, as the llama-quantize tool calls it)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTS[quant])
    params.nthread = threads
    with native_output_to(log_file):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ToolchainError(f"llama.cpp's quantizer failed ({quant}, return code {rc}) on {src}")


def gguf_metadata(path: str | Path) -> dict:
    """The tokenizer fields a runtime needs to chat with the file: template, bos, eos, end of turn."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name):
        f = reader.fields.get(name)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else int(value[0])

    return {
        "architecture": field("general.architecture"),
        "chat_template": field("tokenizer.chat_template"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "eot_token_id": field("tokenizer.ggml.eot_token_id"),
        "pre_tokenizer": field("tokenizer.ggml.pre"),
    }


def _run_converter(conv: Path, fallback: str, args: list[str]) -> None:
    """convert_hf_to_gguf.py as its own script would run (inside `_converter`), with the GPT-2 split named for a
    tokenizer it cannot identify."""
    import conversion.base as base  # the converter's own package (llama.cpp's conversion/)

    identify = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return identify(self, tokenizer)
        except NotImplementedError:
            if not fallback:
                raise
            print(f"pre-tokenizer: not in llama.cpp's list; byte-level with GPT-2's regex: {fallback}")
            return fallback

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = str(conv / "convert_hf_to_gguf.py")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["install"] and len(sys.argv) in (3, 4):
        print(install_converter(*sys.argv[2:]))
    else:
        sys.exit("usage: python -m snaketune.export.llama_cpp install <llama_cpp_python sdist> [destination]")
