"""A GGUF's tokenizer (and chat template) as transformers builds it from the file's metadata, also for
architectures transformers' GGUF loader refuses or misreads (controller.cli.gguf_convert calls it)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from logicpipe.common.modeldir import ModelError


def _contents(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 — a field gguf cannot decode is one we do not need
        return None


def write_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer (and chat template) transformers builds from the GGUF's metadata."""
    from transformers import AutoTokenizer

    if _architecture(src) in TOKENIZER_ONLY:
        tokenizer = _tokenizer_alone(src)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        except Exception as exc:  # an architecture transformers reads no GGUF config of (deepseek2, glm4moe,
            try:                  # smollm3, ...): the tokenizer from the file's tokenizer fields alone
                tokenizer = _tokenizer_alone(src)
            except ModelError:
                raise ModelError(f"{src}: its tokenizer cannot be read ({exc})") from exc
    tokenizer.save_pretrained(str(out))


# architectures whose GGUF metadata transformers cannot parse (5.24 reads gpt-oss's rope.scaling fields wrongly
# and fails): their tokenizer is read from a copy of the file's tokenizer fields alone
TOKENIZER_ONLY = ("gpt-oss",)


def _architecture(src: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(src)).fields.get("general.architecture")
    return str(_contents(field)) if field is not None else ""


def tokenizer_only(src: Path, path: Path) -> Path:
    """A GGUF at `path` holding only `src`'s tokenizer fields (tokenizer.*, the chat template), under
    architecture "llama": what transformers builds the tokenizer from."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, field in GGUFReader(str(src)).fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _tokenizer_alone(src: Path):
    """The tokenizer transformers builds from `src`'s tokenizer fields alone (see tokenizer_only)."""
    from transformers import AutoTokenizer

    try:
        with tempfile.TemporaryDirectory() as tmp:
            only = tokenizer_only(src, Path(tmp) / "tokenizer.gguf")
            return AutoTokenizer.from_pretrained(str(only.parent), gguf_file=only.name)
    except Exception as exc:
        raise ModelError(f"{src}: its tokenizer cannot be read ({exc})") from exc
