"""A target on the integer engine: every projection a ``QuantLinear`` over 32-value integer blocks, the token
embedding read from the same blocks, norms / RoPE / attention in fp32.

Precisions (``--dtype``): ``gguf`` runs a GGUF file's own blocks (``model.gguf`` says which types map exactly and
requantizes the rest to q8); ``q8`` / ``q4`` quantize a float checkpoint's matrices (``kernels.quant.quantize``);
``fp32`` is the float engine. The converted model (packed blocks, norms, config, tokenizer) is cached as one
folder, so a later start maps the packed file and converts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from spechead.kernels.qlinear import QuantLinear, QuantWeight
from spechead.kernels.quant import QuantBlocks
from spechead.model.config import ModelConfig
from spechead.model.layers import RMSNorm
from spechead.model.transformer import Transformer

PRECISIONS = ("gguf", "q8", "q4", "fp32")
LAYOUT_FILE = "quantization.json"  # {module name: format}, and the tensors requantized at conversion

_FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


class QuantEmbedding(nn.Module):
    """Token embedding rows dequantized from a ``QuantWeight`` (the tied LM head's own blocks: one copy for both),
    times the model's embedding scale (sqrt(d) in Gemma)."""

    def __init__(self, weight: QuantWeight, scale: float = 1.0) -> None:
        super().__init__()
        self.table, self.scale = weight, scale
        self.num_embeddings, self.embedding_dim = weight.rows, weight.in_features

    def forward(self, ids: Tensor) -> Tensor:
        x = self.table.dequantize_rows(ids)
        return x if self.scale == 1.0 else x * torch.tensor(self.scale, dtype=x.dtype)


def _cat(parts: list[QuantBlocks]) -> QuantBlocks:
    mins = [p.min for p in parts]
    m = None if mins[0] is None else torch.cat(mins)  # type: ignore[arg-type]
    return QuantBlocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), m, parts[0].format)


def pack_state(cfg: ModelConfig, tensors: dict[str, QuantBlocks | Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The converted model: each layer's q/k/v and gate/up fused where their formats agree, every matrix packed
    (``name.data`` / ``.scale`` / ``.min``), fp32 vectors as they are. Returns (state dict, {module: format})."""
    tensors = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        for fused, parts in _FUSED.items():
            owner, _, _ = fused.partition(".")
            names = [f"model.layers.{i}.{owner}.{p}.weight" for p in parts]
            blocks = [tensors[n] for n in names]
            if all(isinstance(b, QuantBlocks) and b.format == blocks[0].format for b in blocks):
                for n in names:
                    del tensors[n]
                tensors[f"model.layers.{i}.{fused}.weight"] = _cat(blocks)  # type: ignore[arg-type]
    state: dict[str, Tensor] = {}
    layout: dict[str, str] = {}
    for name, t in tensors.items():
        if isinstance(t, QuantBlocks):
            module = name.removesuffix(".weight")
            w = QuantWeight.pack(t)
            state.update({f"{module}.data": w.data, f"{module}.scale": w.scale, f"{module}.min": w.min})
            layout[module] = t.format
        else:
            state[name] = t.float().contiguous()
    return state, layout


def build(cfg: ModelConfig, state: dict[str, Tensor], layout: dict[str, str]) -> Transformer:
    """The ``Transformer`` of a converted model: ``QuantLinear`` projections (fused as the layout says), the
    embedding and a tied LM head over one set of blocks, fp32 norms (Gemma's 1 + w folded)."""
    with torch.device("meta"):
        model = Transformer(cfg)

    def quant(module: str) -> QuantWeight:
        return QuantWeight(
            state[f"{module}.data"], state[f"{module}.scale"], state[f"{module}.min"], _rows(cfg, module)
        )

    for module in layout:
        parent, _, attr = module.rpartition(".")
        if module == "model.embed_tokens":
            continue
        owner = model.get_submodule(parent)
        setattr(owner, attr, QuantLinear(quant(module)))
        for fused, parts in _FUSED.items():
            if module.endswith(fused):
                for p in parts:
                    delattr(owner, p)
    table = quant("model.embed_tokens")
    model.model.embed_tokens = QuantEmbedding(table, cfg.embed_scale)
    if "lm_head" not in layout:
        if not cfg.tie_word_embeddings:
            raise ValueError("a converted model without lm_head must tie it to the embedding")
        model.lm_head = QuantLinear(table)
    vectors = {k: v for k, v in state.items() if not k.endswith((".data", ".scale", ".min"))}
    missing = [k for k, p in model.named_parameters() if p.is_meta and k not in vectors]
    if missing:
        raise ValueError(f"the converted model lacks {missing[:3]}")
    model.load_state_dict(vectors, strict=False, assign=True)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fold_offset()
    return model.eval().requires_grad_(False)


def _rows(cfg: ModelConfig, module: str) -> int:
    """Output features of a projection by its name (the packed data holds them rounded up to 16)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    widths = {
        "q_proj": q,
        "k_proj": kv,
        "v_proj": kv,
        "qkv_proj": q + 2 * kv,
        "o_proj": d,
        "gate_proj": inter,
        "up_proj": inter,
        "gate_up_proj": 2 * inter,
        "down_proj": d,
        "lm_head": cfg.vocab_size,
        "embed_tokens": cfg.vocab_size,
    }
    return widths[module.rpartition(".")[2]]


def write_layout(folder: Path, layout: dict[str, str], requantized: dict[str, tuple[str, float]]) -> None:
    (folder / LAYOUT_FILE).write_text(json.dumps({"formats": layout, "requantized": requantized}, indent=1))


def read_layout(folder: Path) -> tuple[dict[str, str], dict[str, tuple[str, float]]]:
    data = json.loads((folder / LAYOUT_FILE).read_text())
    return data["formats"], {name: (t, err) for name, (t, err) in data["requantized"].items()}


def requantized_note(requantized: dict[str, tuple[str, float]]) -> str:
    """The one-line notice of the tensors a conversion requantized (name -> (GGUF type, largest weight error))."""
    worst = max(requantized.items(), key=lambda kv: kv[1][1])
    types = sorted({t for t, _ in requantized.values()})
    return (
        f"[spechead] {len(requantized)} tensors ({', '.join(types)}) have no exact integer form here: "
        f"requantized to q8, largest weight error {worst[1][1]:.3g} ({worst[0]})"
    )
